//! Flow-control configuration: priority bands, teams, turn-first and shedding settings, and
//! their validation.
//!
//! The gateway parses its TOML (`[[bands]]`, `[[teams]]`) into these types; API keys stay in the
//! gateway, which maps a key to a team name. [`FlowConfig::validate`] lists every problem it
//! finds, each naming the band or team at fault.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use super::rejection::Rejection;

/// One priority band: a queue with its own limits, TTL and shedding rule.
#[derive(Debug, Clone, PartialEq)]
pub struct BandSpec {
    /// Band name (`interactive`, `batch`, ...), unique.
    pub name: String,
    /// Higher is dispatched first; unique across bands (the order between bands is strict).
    pub priority: i32,
    /// While the pool is saturated, this band's new requests are rejected at once instead of
    /// queued.
    pub sheddable: bool,
    /// Most requests waiting in this band; more are rejected with [`Rejection::QueueFull`].
    /// `0` means the band never queues: a request is dispatched at once or rejected.
    pub max_queued: usize,
    /// Most bytes of requests waiting in this band (each request's size as the caller
    /// counts it: the gateway counts its body, or its engine request when larger); more are
    /// rejected with [`Rejection::QueueFull`].
    pub max_queued_bytes: u64,
    /// Longest a request waits in the queue before it is answered with [`Rejection::Timeout`].
    pub queue_ttl: Duration,
    /// Share of the pool's capacity (0..1) held for this band and the bands above it: lower
    /// bands dispatch only while that much stays free, so a request of this band finds a slot
    /// at once instead of waiting for a lower band's request to finish. Requests of a band with
    /// a reserve are also placed on an endpoint with a free slot when one exists (the gateway's
    /// routing does this). 0 (the default) holds nothing back.
    pub reserve: f64,
}

impl BandSpec {
    /// A band with generous defaults: not sheddable, 10 000 requests / 1 GiB queued, 60 s TTL.
    pub fn new(name: impl Into<String>, priority: i32) -> Self {
        BandSpec {
            name: name.into(),
            priority,
            sheddable: false,
            max_queued: 10_000,
            max_queued_bytes: 1 << 30,
            queue_ttl: Duration::from_secs(60),
            reserve: 0.0,
        }
    }
}

/// One team (tenant): which bands it may use, its share within a band, and its limits.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamSpec {
    /// Team name, unique.
    pub name: String,
    /// Band used when the client asks for none.
    pub default_band: String,
    /// Bands the team may use; empty means only `default_band`. None may rank above
    /// `default_band`: a client can ask for a lower band than its team's default, never a higher
    /// one.
    pub allowed_bands: Vec<String>,
    /// Share within a band relative to the other teams backlogged in it (finite, > 0).
    pub weight: f64,
    /// Most requests of this team dispatched at once, over all bands.
    pub max_concurrent: Option<u32>,
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// Tokens (estimated input + max output) per minute.
    pub tpm: Option<u64>,
}

impl TeamSpec {
    /// A team using only `default_band`, weight 1, no limits.
    pub fn new(name: impl Into<String>, default_band: impl Into<String>) -> Self {
        TeamSpec {
            name: name.into(),
            default_band: default_band.into(),
            allowed_bands: Vec::new(),
            weight: 1.0,
            max_concurrent: None,
            rpm: None,
            tpm: None,
        }
    }

    /// The bands this team may use (`default_band` when `allowed_bands` is empty).
    pub fn allowed(&self) -> impl Iterator<Item = &str> {
        let default = self
            .allowed_bands
            .is_empty()
            .then_some(self.default_band.as_str());
        default
            .into_iter()
            .chain(self.allowed_bands.iter().map(String::as_str))
    }

    /// Whether this team may use `band`.
    pub fn allows(&self, band: &str) -> bool {
        self.allowed().any(|b| b == band)
    }
}

/// How likely a sheddable request is to be rejected while the pool is saturated, as a function
/// of [`CapacitySignal::saturation`](super::CapacitySignal::saturation). While the pool is not
/// saturated nothing is shed, whatever the curve.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ShedCurve {
    /// Shed every sheddable request that arrives while saturated.
    #[default]
    Always,
    /// Shed with probability `p(s) = clamp((s - start) / (full - start), 0, 1)`: none at or
    /// below `start`, all at or above `full` (`0 <= start < full <= 1`). The requests let
    /// through queue like any other.
    Linear {
        /// Saturation at which shedding starts.
        start: f64,
        /// Saturation at which every sheddable request is shed.
        full: f64,
    },
}

impl ShedCurve {
    /// Probability of shedding at `saturation` (clamped to 0..=1), given the pool is saturated.
    pub fn probability(&self, saturation: f64) -> f64 {
        match *self {
            ShedCurve::Always => 1.0,
            ShedCurve::Linear { start, full } => {
                let s = if saturation.is_nan() {
                    1.0
                } else {
                    saturation.clamp(0.0, 1.0)
                };
                if s >= full {
                    1.0
                } else if s <= start {
                    0.0
                } else {
                    (s - start) / (full - start)
                }
            }
        }
    }
}

/// The whole flow-control policy.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowConfig {
    /// Priority bands, in any order.
    pub bands: Vec<BandSpec>,
    /// Teams, in any order.
    pub teams: Vec<TeamSpec>,
    /// A session that had a request in flight within this window is active: its next turn
    /// (the cache is likely still warm) goes ahead of new sessions.
    pub turn_window: Duration,
    /// Head start of continuing turns over new sessions: a continuing turn is ordered as if it
    /// had arrived this much earlier, so a new session never waits more than this behind
    /// arrival order. `Duration::ZERO` turns turn-first ordering off.
    pub aging: Duration,
    /// Grow the head start with the band's queue: `max(aging, 2 x typical wait)`, the typical wait
    /// being a moving average of the band's recent queue waits (see the module doc). With a
    /// fixed head start, continuing turns lose their lead once waits grow well past it.
    pub aging_follows_wait: bool,
    /// Longest a queued request whose session is pinned to an endpoint waits for a slot there
    /// (while requests for other endpoints go ahead) before it is dispatched to be placed on an
    /// endpoint with room ([`Permit::outwaited_pin`](super::Permit::outwaited_pin)); counted from
    /// when it was first passed over. `Duration::ZERO` dispatches in queue order whatever the
    /// endpoint.
    pub pin_wait: Duration,
    /// Shedding curve for sheddable bands while saturated.
    pub shed_curve: ShedCurve,
    /// `Retry-After` suggested with shed, queue-full and timed-out rejections.
    pub retry_after: Duration,
}

impl FlowConfig {
    /// Defaults for everything but bands and teams: 60 s turn window, 10 s aging, 10 s pin
    /// wait, shed always
    /// when saturated, retry after 1 s.
    pub fn new(bands: Vec<BandSpec>, teams: Vec<TeamSpec>) -> Self {
        FlowConfig {
            bands,
            teams,
            turn_window: Duration::from_secs(60),
            aging: Duration::from_secs(10),
            aging_follows_wait: false,
            pin_wait: Duration::from_secs(10),
            shed_curve: ShedCurve::Always,
            retry_after: Duration::from_secs(1),
        }
    }

    /// The band named `name`.
    pub fn band(&self, name: &str) -> Option<&BandSpec> {
        self.bands.iter().find(|b| b.name == name)
    }

    /// The team named `name`.
    pub fn team(&self, name: &str) -> Option<&TeamSpec> {
        self.teams.iter().find(|t| t.name == name)
    }

    /// The band a request of `team` runs in: `requested` if the team may use it and it does
    /// not rank above the team's default band, the default band if `requested` is `None`.
    pub fn band_for(&self, team: &str, requested: Option<&str>) -> Result<&BandSpec, Rejection> {
        let spec = self.team(team).ok_or_else(|| Rejection::UnknownTeam {
            team: team.to_string(),
        })?;
        let default = self
            .band(&spec.default_band)
            .ok_or_else(|| Rejection::UnknownBand {
                band: spec.default_band.clone(),
            })?;
        let Some(name) = requested else {
            return Ok(default);
        };
        let band = self.band(name).ok_or_else(|| Rejection::UnknownBand {
            band: name.to_string(),
        })?;
        if band.priority > default.priority || !spec.allows(name) {
            return Err(Rejection::BandNotAllowed {
                team: team.to_string(),
                band: name.to_string(),
                default_band: default.name.clone(),
                allowed: spec.allowed().map(str::to_string).collect(),
            });
        }
        Ok(band)
    }

    /// The band background responses of `team` run in: the lowest-priority band it may use.
    pub fn background_band(&self, team: &str) -> Option<&BandSpec> {
        let spec = self.team(team)?;
        spec.allowed()
            .filter_map(|name| self.band(name))
            .min_by_key(|b| b.priority)
    }

    /// Every problem with this configuration, or `Ok` if there is none.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        if self.bands.is_empty() {
            problems.push("no bands: at least one [[bands]] entry is needed".to_string());
        }
        let mut band_names = HashSet::new();
        let mut priorities: HashMap<i32, &str> = HashMap::new();
        for band in &self.bands {
            if band.name.is_empty() {
                problems.push("a band has an empty name".to_string());
            } else if !band_names.insert(band.name.as_str()) {
                problems.push(format!("band `{}` is defined more than once", band.name));
            }
            if let Some(other) = priorities.insert(band.priority, &band.name) {
                problems.push(format!(
                    "bands `{other}` and `{}` share priority {}; priorities must differ",
                    band.name, band.priority
                ));
            }
            if !(0.0..1.0).contains(&band.reserve) {
                problems.push(format!(
                    "band `{}`: reserve must be at least 0 and below 1 (a share of the pool's capacity), got {}",
                    band.name, band.reserve
                ));
            }
            if band.queue_ttl.is_zero() {
                problems.push(format!(
                    "band `{}`: queue_ttl must be > 0 (use max_queued = 0 for a band that never queues)",
                    band.name
                ));
            }
        }
        // Added to instants: bounded so that no deadline overflows the clock.
        let most = Duration::from_secs(1_000_000_000);
        for (key, d) in [
            ("turn_window", self.turn_window),
            ("aging", self.aging),
            ("pin_wait", self.pin_wait),
            ("retry_after", self.retry_after),
        ] {
            if d > most {
                problems.push(format!("{key} must be at most 1e9 seconds, got {d:?}"));
            }
        }
        let mut team_names = HashSet::new();
        for team in &self.teams {
            let t = &team.name;
            if t.is_empty() {
                problems.push("a team has an empty name".to_string());
            } else if !team_names.insert(t.as_str()) {
                problems.push(format!("team `{t}` is defined more than once"));
            }
            let default = self.band(&team.default_band);
            if default.is_none() {
                problems.push(format!(
                    "team `{t}`: default band `{}` is not a defined band",
                    team.default_band
                ));
            }
            if !team.allowed_bands.is_empty() && !team.allowed_bands.contains(&team.default_band) {
                problems.push(format!(
                    "team `{t}`: default band `{}` is not in its allowed bands [{}]",
                    team.default_band,
                    team.allowed_bands.join(", ")
                ));
            }
            let mut seen = HashSet::new();
            for name in &team.allowed_bands {
                if !seen.insert(name.as_str()) {
                    problems.push(format!("team `{t}`: band `{name}` is allowed twice"));
                    continue;
                }
                match (self.band(name), default) {
                    (None, _) => problems.push(format!(
                        "team `{t}`: allowed band `{name}` is not a defined band"
                    )),
                    (Some(band), Some(default)) if band.priority > default.priority => {
                        problems.push(format!(
                            "team `{t}`: allowed band `{name}` (priority {}) ranks above its default \
                             band `{}` (priority {}); clients may only ask for a lower band than the \
                             default, so make `{name}` the default or remove it",
                            band.priority, default.name, default.priority
                        ))
                    }
                    _ => {}
                }
            }
            if !(team.weight.is_finite() && team.weight > 0.0) {
                problems.push(format!(
                    "team `{t}`: weight must be a finite number > 0, got {}",
                    team.weight
                ));
            }
            if team.max_concurrent == Some(0) {
                problems.push(format!(
                    "team `{t}`: max_concurrent = 0 would never dispatch; omit it for no limit"
                ));
            }
            if team.rpm == Some(0) {
                problems.push(format!(
                    "team `{t}`: rpm = 0 would refuse every request; omit it for no limit"
                ));
            }
            if team.tpm == Some(0) {
                problems.push(format!(
                    "team `{t}`: tpm = 0 would refuse every request; omit it for no limit"
                ));
            }
        }
        if let ShedCurve::Linear { start, full } = self.shed_curve {
            let ok = start.is_finite()
                && full.is_finite()
                && (0.0..=1.0).contains(&start)
                && (0.0..=1.0).contains(&full)
                && start < full;
            if !ok {
                problems.push(format!(
                    "shed curve: need 0 <= start < full <= 1, got start = {start}, full = {full}"
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }
}

/// What is wrong with a [`FlowConfig`]: one message per problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Human-readable problems, each naming the band or team at fault.
    pub problems: Vec<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid flow-control config: {}",
            self.problems.join("; ")
        )
    }
}

impl std::error::Error for ConfigError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> FlowConfig {
        let mut agents = TeamSpec::new("agents", "interactive");
        agents.allowed_bands = vec!["interactive".into(), "batch".into()];
        FlowConfig::new(
            vec![
                BandSpec::new("interactive", 10),
                BandSpec::new("batch", 0),
                BandSpec::new("critical", 20),
            ],
            vec![agents, TeamSpec::new("bulk", "batch")],
        )
    }

    #[test]
    fn a_valid_config_validates() {
        assert_eq!(config().validate(), Ok(()));
    }

    #[test]
    fn band_for_allows_a_downgrade_and_refuses_an_upgrade() {
        let c = config();
        assert_eq!(c.band_for("agents", None).unwrap().name, "interactive");
        assert_eq!(c.band_for("agents", Some("batch")).unwrap().name, "batch");
        assert_eq!(
            c.band_for("bulk", Some("interactive")),
            Err(Rejection::BandNotAllowed {
                team: "bulk".into(),
                band: "interactive".into(),
                default_band: "batch".into(),
                allowed: vec!["batch".into()],
            })
        );
        let upgrade = c.band_for("agents", Some("critical")).unwrap_err();
        assert!(
            upgrade
                .to_string()
                .contains("team `agents` may not use band `critical`"),
            "{upgrade}"
        );
        assert_eq!(
            c.band_for("agents", Some("nope")),
            Err(Rejection::UnknownBand {
                band: "nope".into()
            })
        );
        assert_eq!(
            c.band_for("ghost", None),
            Err(Rejection::UnknownTeam {
                team: "ghost".into()
            })
        );
    }

    #[test]
    fn background_band_is_the_lowest_allowed() {
        let c = config();
        assert_eq!(c.background_band("agents").unwrap().name, "batch");
        assert_eq!(c.background_band("bulk").unwrap().name, "batch");
        assert!(c.background_band("ghost").is_none());
    }

    #[test]
    fn validation_names_every_problem() {
        let mut c = config();
        c.bands.push(BandSpec::new("batch", 5));
        c.bands.push(BandSpec::new("other", 20));
        c.bands[0].queue_ttl = Duration::ZERO;
        let mut bad = TeamSpec::new("bad", "missing");
        bad.weight = 0.0;
        bad.max_concurrent = Some(0);
        bad.rpm = Some(0);
        c.teams.push(bad);
        let mut upgrade = TeamSpec::new("upgrade", "batch");
        upgrade.allowed_bands = vec!["batch".into(), "interactive".into(), "batch".into()];
        c.teams.push(upgrade);
        let mut not_default = TeamSpec::new("not-default", "interactive");
        not_default.allowed_bands = vec!["batch".into()];
        not_default.weight = f64::NAN;
        c.teams.push(not_default);
        c.teams.push(TeamSpec::new("bulk", "batch"));
        c.shed_curve = ShedCurve::Linear {
            start: 0.9,
            full: 0.5,
        };
        let problems = c.validate().unwrap_err().problems;
        let expected = [
            "band `batch` is defined more than once",
            "bands `critical` and `other` share priority 20",
            "band `interactive`: queue_ttl must be > 0",
            "team `bad`: default band `missing` is not a defined band",
            "team `bad`: weight must be a finite number > 0, got 0",
            "team `bad`: max_concurrent = 0",
            "team `bad`: rpm = 0",
            "team `upgrade`: allowed band `interactive` (priority 10) ranks above its default band `batch`",
            "team `upgrade`: band `batch` is allowed twice",
            "team `not-default`: default band `interactive` is not in its allowed bands [batch]",
            "team `not-default`: weight must be a finite number > 0, got NaN",
            "team `bulk` is defined more than once",
            "shed curve: need 0 <= start < full <= 1",
        ];
        for needle in expected {
            assert!(
                problems.iter().any(|p| p.contains(needle)),
                "missing {needle:?} in {problems:#?}"
            );
        }
        assert_eq!(problems.len(), expected.len(), "{problems:#?}");
        assert!(FlowConfig::new(vec![], vec![]).validate().is_err());
    }

    #[test]
    fn shed_curve_probabilities() {
        assert_eq!(ShedCurve::Always.probability(0.0), 1.0);
        let linear = ShedCurve::Linear {
            start: 0.5,
            full: 0.9,
        };
        assert_eq!(linear.probability(0.2), 0.0);
        assert_eq!(linear.probability(0.5), 0.0);
        assert!((linear.probability(0.7) - 0.5).abs() < 1e-9);
        assert_eq!(linear.probability(0.95), 1.0);
        assert_eq!(linear.probability(f64::NAN), 1.0);
        assert_eq!(linear.probability(7.0), 1.0);
    }
}
