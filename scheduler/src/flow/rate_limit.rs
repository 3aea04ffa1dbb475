//! Per-team rate limits: requests per minute and tokens per minute, as two GCRA buckets charged
//! together or not at all.
//!
//! # GCRA
//!
//! A limit of `L` per period `P` (one minute) has emission interval `T = P / L`. Each bucket
//! keeps one number, its theoretical arrival time `tat` (absent = a full bucket). A request of
//! cost `n` at time `now`:
//!
//! ```text
//! tat'     = max(tat, now) + n * T
//! allowed  = tat' - P <= now                      (the burst fits in one period)
//! on allow:  tat = tat'
//! remaining = floor((now + P - tat) / T)          (after the charge, if allowed)
//! reset     = tat - now                           (until the bucket is full again)
//! retry_after = tat' - P - now                    (when the same request would fit)
//! ```
//!
//! A full bucket therefore admits a burst of `L` at once, then one unit every `T`. A request
//! with `n > L` can never fit; it is refused with [`RateLimited::exceeds_limit`] set. Both
//! buckets are computed first and written only if both allow, so a request refused for tokens
//! does not use up a request. Tokens are charged at admission with the request's estimate
//! (input + max output), as OpenAI does; a request that then used more (it named no max output,
//! and the engine wrote past the default assumed) is charged the rest when it finishes
//! ([`RateLimiter::charge_tokens`]), unconditionally: the bucket goes into debt and the team's
//! next requests wait until it refills, so the limit holds over time whatever the estimates.
//!
//! The reported figures map onto OpenAI's headers ([`RateStatus::headers`]):
//! `x-ratelimit-limit-{requests,tokens}`, `x-ratelimit-remaining-*` and `x-ratelimit-reset-*`
//! (formatted like `1s`, `6m0s`, `20ms`).
//!
//! # Shared limits
//!
//! [`LocalRateLimiter`] keeps the buckets in this process. Several gateway replicas share one
//! budget through a [`RateLimiter`] over a shared store: `agentgate-sessions` runs the same
//! arithmetic in one Redis round trip on the server's clock (`Store::rate_limit`), and the
//! gateway adapts it to this trait.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The period both limits are expressed over.
pub const RATE_PERIOD: Duration = Duration::from_secs(60);

/// Slack, in milliseconds, for floating-point error in the GCRA comparison.
const EPSILON_MS: f64 = 1e-6;

/// A team's limits; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimits {
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// Tokens per minute.
    pub tpm: Option<u64>,
}

impl RateLimits {
    /// Whether neither limit is set (no check is needed).
    pub fn is_unlimited(&self) -> bool {
        self.rpm.is_none() && self.tpm.is_none()
    }
}

/// What one request costs against the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateCost {
    /// Requests (normally 1).
    pub requests: u64,
    /// Tokens: estimated input + max output.
    pub tokens: u64,
}

/// Which limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateKind {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
}

/// One bucket's state as OpenAI's headers report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// The limit per minute.
    pub limit: u64,
    /// What is left right now.
    pub remaining: u64,
    /// Time until the bucket is full again.
    pub reset: Duration,
}

/// Both buckets after a check; `None` for a limit the team does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateStatus {
    /// Requests-per-minute bucket.
    pub requests: Option<Quota>,
    /// Tokens-per-minute bucket.
    pub tokens: Option<Quota>,
}

impl RateStatus {
    /// OpenAI's `x-ratelimit-*` headers for the limits the team has.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = Vec::new();
        if let Some(q) = self.requests {
            headers.push(("x-ratelimit-limit-requests", q.limit.to_string()));
            headers.push(("x-ratelimit-remaining-requests", q.remaining.to_string()));
            headers.push(("x-ratelimit-reset-requests", format_reset(q.reset)));
        }
        if let Some(q) = self.tokens {
            headers.push(("x-ratelimit-limit-tokens", q.limit.to_string()));
            headers.push(("x-ratelimit-remaining-tokens", q.remaining.to_string()));
            headers.push(("x-ratelimit-reset-tokens", format_reset(q.reset)));
        }
        headers
    }

    /// The quota of `kind`.
    pub fn quota(&self, kind: RateKind) -> Option<Quota> {
        match kind {
            RateKind::Requests => self.requests,
            RateKind::Tokens => self.tokens,
        }
    }
}

/// A refused check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimited {
    /// The limit that refused (the later to clear if both did).
    pub kind: RateKind,
    /// When the same request would be allowed.
    pub retry_after: Duration,
    /// The request alone costs more than the limit: it will never be allowed.
    pub exceeds_limit: bool,
    /// What the request asked of the refusing limit.
    pub requested: u64,
    /// Both buckets, unchanged by the refused request.
    pub status: RateStatus,
}

impl RateLimited {
    /// The refusing bucket (limit, remaining, reset).
    pub fn quota(&self) -> Option<Quota> {
        self.status.quota(self.kind)
    }
}

impl fmt::Display for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.kind {
            RateKind::Requests => "requests",
            RateKind::Tokens => "tokens",
        };
        let limit = self.quota().map_or(0, |q| q.limit);
        if self.exceeds_limit {
            return write!(
                f,
                "request needs {} {unit}, more than the team's limit of {limit} {unit} per minute",
                self.requested
            );
        }
        let remaining = self.quota().map_or(0, |q| q.remaining);
        write!(
            f,
            "rate limit reached on {unit} per minute: limit {limit}, remaining {remaining}, \
             requested {}; retry in {}",
            self.requested,
            format_reset(self.retry_after)
        )
    }
}

/// The future a [`RateLimiter`] check returns.
pub type RateCheck<'a> = Pin<Box<dyn Future<Output = Result<RateStatus, RateLimited>> + Send + 'a>>;

/// Where rate-limit buckets live: this process ([`LocalRateLimiter`]) or a shared store.
///
/// `check` charges `cost` to `team`'s buckets if every limit in `limits` allows it and
/// charges nothing otherwise. Limits come with each call, so a reloaded configuration applies
/// at once and a shared store needs no copy of it. An implementation whose store is
/// unreachable decides whether to fail open (allow, with an empty [`RateStatus`]: nothing is
/// known about the buckets) or closed, and should log it; it must not hang: bound the round
/// trip with a timeout.
pub trait RateLimiter: Send + Sync {
    /// Check and charge one request.
    fn check<'a>(&'a self, team: &'a str, limits: RateLimits, cost: RateCost) -> RateCheck<'a>;

    /// Charge `tokens` more to `team`'s tokens bucket of `tpm` per minute, unconditionally:
    /// what a finished request used beyond the estimate it was admitted with. The bucket may
    /// go into debt; later requests wait until it refills.
    fn charge_tokens<'a>(&'a self, team: &'a str, tpm: u64, tokens: u64) -> RateCharge<'a>;

    /// Give back `cost`, which a [`RateLimiter::check`] charged under `limits`, for a request
    /// refused after it was charged (its queue was full): the buckets move back, never past
    /// full.
    fn refund<'a>(&'a self, team: &'a str, limits: RateLimits, cost: RateCost) -> RateCharge<'a>;
}

/// The future of [`RateLimiter::charge_tokens`].
pub type RateCharge<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// One bucket's GCRA step: see the module doc.
#[derive(Debug, Clone, Copy)]
struct Step {
    allowed: bool,
    exceeds: bool,
    retry_ms: f64,
    /// `max(tat, now)`: the bucket if nothing is charged.
    tat: f64,
    /// The bucket once this request is charged.
    new_tat: f64,
    interval: f64,
}

fn gcra_step(tat: Option<f64>, now: f64, limit: u64, cost: u64, period: f64) -> Step {
    let interval = period / limit as f64;
    let tat = tat.unwrap_or(now).max(now);
    let new_tat = tat + cost as f64 * interval;
    let allow_at = new_tat - period;
    let allowed = allow_at <= now + EPSILON_MS;
    Step {
        allowed,
        exceeds: !allowed && cost > limit,
        retry_ms: if allowed { 0.0 } else { allow_at - now },
        tat,
        new_tat,
        interval,
    }
}

fn ceil_ms(ms: f64) -> Duration {
    Duration::from_millis(ms.max(0.0).ceil() as u64)
}

/// Both buckets' steps (each `None` when unlimited) as a check result. The status shows the
/// buckets charged if the request is allowed, untouched if it is refused.
fn decide(
    limits: RateLimits,
    cost: RateCost,
    now: f64,
    period: f64,
    requests: Option<Step>,
    tokens: Option<Step>,
) -> Result<RateStatus, RateLimited> {
    let allowed = requests.is_none_or(|s| s.allowed) && tokens.is_none_or(|s| s.allowed);
    let quota = |limit: Option<u64>, step: Option<Step>| {
        limit.zip(step).map(|(limit, s)| {
            let tat = if allowed { s.new_tat } else { s.tat };
            Quota {
                limit,
                remaining: ((now + period - tat) / s.interval + 1e-9).floor().max(0.0) as u64,
                reset: ceil_ms(tat - now),
            }
        })
    };
    let status = RateStatus {
        requests: quota(limits.rpm, requests),
        tokens: quota(limits.tpm, tokens),
    };
    let refused = [
        (RateKind::Requests, requests, cost.requests),
        (RateKind::Tokens, tokens, cost.tokens),
    ]
    .into_iter()
    .filter_map(|(kind, step, requested)| step.map(|s| (kind, s, requested)))
    .filter(|(_, s, _)| !s.allowed)
    .max_by(|a, b| {
        (a.1.exceeds, a.1.retry_ms)
            .partial_cmp(&(b.1.exceeds, b.1.retry_ms))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    match refused {
        None => Ok(status),
        Some((kind, step, requested)) => Err(RateLimited {
            kind,
            retry_after: ceil_ms(step.retry_ms),
            exceeds_limit: step.exceeds,
            requested,
            status,
        }),
    }
}

/// Rate limits kept in this process (one gateway replica).
#[derive(Debug)]
pub struct LocalRateLimiter {
    base: Instant,
    buckets: Mutex<Buckets>,
}

#[derive(Debug, Default)]
struct Buckets {
    /// Team -> (requests tat, tokens tat), milliseconds since `base`.
    tats: HashMap<String, (Option<f64>, Option<f64>)>,
    /// Prune full buckets when the map grows past this.
    prune_at: usize,
}

impl Default for LocalRateLimiter {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalRateLimiter {
    /// Empty buckets (every team starts full).
    pub fn new() -> Self {
        LocalRateLimiter {
            base: Instant::now(),
            buckets: Mutex::new(Buckets {
                tats: HashMap::new(),
                prune_at: 1024,
            }),
        }
    }

    /// The check, synchronously.
    pub fn check_now(
        &self,
        team: &str,
        limits: RateLimits,
        cost: RateCost,
    ) -> Result<RateStatus, RateLimited> {
        let now = Instant::now().duration_since(self.base).as_secs_f64() * 1000.0;
        let period = RATE_PERIOD.as_secs_f64() * 1000.0;
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.tats.len() >= buckets.prune_at {
            let full = |tat: Option<f64>| tat.is_none_or(|t| t <= now);
            buckets.tats.retain(|_, (r, t)| !(full(*r) && full(*t)));
            buckets.prune_at = (buckets.tats.len() * 2).max(1024);
        }
        let (req_tat, tok_tat) = buckets.tats.get(team).copied().unwrap_or((None, None));
        let requests = limits
            .rpm
            .map(|limit| gcra_step(req_tat, now, limit, cost.requests, period));
        let tokens = limits
            .tpm
            .map(|limit| gcra_step(tok_tat, now, limit, cost.tokens, period));
        let result = decide(limits, cost, now, period, requests, tokens);
        if result.is_ok() {
            let entry = buckets.tats.entry(team.to_string()).or_default();
            if let Some(s) = requests {
                entry.0 = Some(s.new_tat);
            }
            if let Some(s) = tokens {
                entry.1 = Some(s.new_tat);
            }
        }
        result
    }
}

impl RateLimiter for LocalRateLimiter {
    fn check<'a>(&'a self, team: &'a str, limits: RateLimits, cost: RateCost) -> RateCheck<'a> {
        Box::pin(std::future::ready(self.check_now(team, limits, cost)))
    }

    fn charge_tokens<'a>(&'a self, team: &'a str, tpm: u64, tokens: u64) -> RateCharge<'a> {
        let now = Instant::now().duration_since(self.base).as_secs_f64() * 1000.0;
        let period = RATE_PERIOD.as_secs_f64() * 1000.0;
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let entry = buckets.tats.entry(team.to_string()).or_default();
        let step = gcra_step(entry.1, now, tpm.max(1), tokens, period);
        entry.1 = Some(step.new_tat);
        Box::pin(std::future::ready(()))
    }

    fn refund<'a>(&'a self, team: &'a str, limits: RateLimits, cost: RateCost) -> RateCharge<'a> {
        let now = Instant::now().duration_since(self.base).as_secs_f64() * 1000.0;
        let period = RATE_PERIOD.as_secs_f64() * 1000.0;
        let back = |tat: Option<f64>, limit: Option<u64>, units: u64| match limit {
            Some(limit) => tat
                .map(|tat| tat - period / limit.max(1) as f64 * units as f64)
                .filter(|tat| *tat > now),
            None => tat,
        };
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = buckets.tats.get_mut(team) {
            entry.0 = back(entry.0, limits.rpm, cost.requests);
            entry.1 = back(entry.1, limits.tpm, cost.tokens);
        }
        Box::pin(std::future::ready(()))
    }
}

/// `x-ratelimit-reset-*` formatting, as OpenAI does (Go's duration format, to the
/// millisecond): `0s`, `20ms`, `1s`, `2.383s`, `6m0s`, `1h15m0s`.
pub fn format_reset(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_string();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = ms % 3_600_000 / 60_000;
    let rest = ms % 60_000;
    let secs = match rest % 1000 {
        0 => format!("{}", rest / 1000),
        millis => {
            let s = format!("{}.{millis:03}", rest / 1000);
            s.trim_end_matches('0').to_string()
        }
    };
    if hours > 0 {
        format!("{hours}h{minutes}m{secs}s")
    } else if minutes > 0 {
        format!("{minutes}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: RateCost = RateCost {
        requests: 1,
        tokens: 100,
    };

    #[tokio::test(start_paused = true)]
    async fn requests_per_minute_burst_then_one_per_interval() {
        let limiter = LocalRateLimiter::new();
        let limits = RateLimits {
            rpm: Some(3),
            tpm: None,
        };
        for expected_remaining in [2, 1, 0] {
            let status = limiter.check("t", limits, ONE).await.unwrap();
            let q = status.requests.unwrap();
            assert_eq!(q.limit, 3);
            assert_eq!(q.remaining, expected_remaining);
            assert!(status.tokens.is_none());
        }
        let refused = limiter.check("t", limits, ONE).await.unwrap_err();
        assert_eq!(refused.kind, RateKind::Requests);
        assert_eq!(refused.retry_after, Duration::from_secs(20));
        assert!(!refused.exceeds_limit);
        assert_eq!(
            refused.quota(),
            Some(Quota {
                limit: 3,
                remaining: 0,
                reset: Duration::from_secs(60)
            })
        );
        // Another team has its own bucket.
        assert!(limiter.check("other", limits, ONE).await.is_ok());
        tokio::time::advance(Duration::from_millis(19_999)).await;
        assert!(limiter.check("t", limits, ONE).await.is_err());
        tokio::time::advance(Duration::from_millis(1)).await;
        let status = limiter.check("t", limits, ONE).await.unwrap();
        assert_eq!(status.requests.unwrap().remaining, 0);
        // A full minute of quiet refills the bucket to its full burst.
        tokio::time::advance(RATE_PERIOD).await;
        let status = limiter.check("t", limits, ONE).await.unwrap();
        assert_eq!(status.requests.unwrap().remaining, 2);
        assert_eq!(status.requests.unwrap().reset, Duration::from_secs(20));
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_refusal_charges_nothing() {
        let limiter = LocalRateLimiter::new();
        let limits = RateLimits {
            rpm: Some(10),
            tpm: Some(1000),
        };
        let big = RateCost {
            requests: 1,
            tokens: 800,
        };
        let status = limiter.check("t", limits, big).await.unwrap();
        assert_eq!(status.tokens.unwrap().remaining, 200);
        assert_eq!(status.requests.unwrap().remaining, 9);
        let refused = limiter.check("t", limits, big).await.unwrap_err();
        assert_eq!(refused.kind, RateKind::Tokens);
        // 600 more tokens must drain at 1000/min: 36 s.
        assert_eq!(refused.retry_after, Duration::from_secs(36));
        // The refused request did not use up a request.
        assert_eq!(refused.status.requests.unwrap().remaining, 9);
        let small = RateCost {
            requests: 1,
            tokens: 200,
        };
        let status = limiter.check("t", limits, small).await.unwrap();
        assert_eq!(status.requests.unwrap().remaining, 8);
        assert_eq!(status.tokens.unwrap().remaining, 0);
        assert_eq!(status.tokens.unwrap().reset, Duration::from_secs(60));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_above_the_limit_never_fits() {
        let limiter = LocalRateLimiter::new();
        let limits = RateLimits {
            rpm: None,
            tpm: Some(1000),
        };
        let huge = RateCost {
            requests: 1,
            tokens: 1001,
        };
        let refused = limiter.check("t", limits, huge).await.unwrap_err();
        assert!(refused.exceeds_limit);
        assert_eq!(refused.kind, RateKind::Tokens);
        assert!(
            refused.to_string().contains("needs 1001 tokens"),
            "{refused}"
        );
    }

    #[test]
    fn unlimited_status_is_empty() {
        let limiter = LocalRateLimiter::new();
        let status = limiter.check_now("t", RateLimits::default(), ONE).unwrap();
        assert_eq!(status, RateStatus::default());
        assert!(status.headers().is_empty());
    }

    #[test]
    fn headers_follow_openai_names_and_formats() {
        let status = RateStatus {
            requests: Some(Quota {
                limit: 60,
                remaining: 59,
                reset: Duration::from_secs(1),
            }),
            tokens: Some(Quota {
                limit: 150_000,
                remaining: 149_984,
                reset: Duration::from_millis(6),
            }),
        };
        let headers = status.headers();
        let get = |name: &str| headers.iter().find(|(n, _)| *n == name).unwrap().1.clone();
        assert_eq!(get("x-ratelimit-limit-requests"), "60");
        assert_eq!(get("x-ratelimit-remaining-requests"), "59");
        assert_eq!(get("x-ratelimit-reset-requests"), "1s");
        assert_eq!(get("x-ratelimit-limit-tokens"), "150000");
        assert_eq!(get("x-ratelimit-remaining-tokens"), "149984");
        assert_eq!(get("x-ratelimit-reset-tokens"), "6ms");
        assert_eq!(format_reset(Duration::from_secs(360)), "6m0s");
        assert_eq!(format_reset(Duration::from_millis(2383)), "2.383s");
        assert_eq!(format_reset(Duration::from_millis(90_500)), "1m30.5s");
        assert_eq!(format_reset(Duration::from_secs(4500)), "1h15m0s");
        assert_eq!(format_reset(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(format_reset(Duration::ZERO), "0s");
    }
}
