//! Flow control in the benchmark: the gateway configuration a run generates for it, the
//! gateway-side saturation sampled while a replay runs, and the per-band, per-turn-kind and
//! fairness figures of `summary.json`.
//!
//! # Configuration
//!
//! `--flow-control on` admits every request through the gateway's flow control; `off` sets
//! `[flow] enabled = false`: requests go straight to routing in arrival order and queue only in
//! the engines. Everything else in the configuration is the same for both. A workload with
//! several teams gets one API key per team and two bands:
//!
//! | band | priority | sheddable | reserve | queue TTL (simulated) | teams |
//! |---|---:|---|---:|---:|---|
//! | `interactive` | 100 | no | `--interactive-reserve` (default 0.5) when a team runs in it, else 0 | [`INTERACTIVE_TTL_S`] | `interactive` |
//! | `batch` | 10 | `--batch-sheddable` (default no) | 0 | [`BATCH_TTL_S`] | every other team (`agents`, `light`, `heavy`) |
//!
//! With flow control on, the pool also sends each request's band priority to the engines
//! (`engine_priority = true`); the simulated replicas always run vLLM's
//! `--scheduling-policy priority`, so without bands (or with flow control off) every request
//! has priority 0 and they run in arrival order.
//!
//! Batch work is not sheddable by default: an agent job waits rather than fails, and the
//! replay, like a job runner that gives up on a turn, would otherwise turn every refusal into a
//! skipped turn and a lighter load than the one offered. With one team (agentic, chat, trace)
//! no team or band is declared: the gateway runs open with its implicit band `default`.
//!
//! The gateway's per-endpoint cap (`max_in_flight_per_endpoint`) is the replicas' `max_num_seqs`
//! divided among the gateways (rounded up), so the fleet runs at most what its engines batch and
//! the rest waits in the gateway, where bands apply. With `--long-prefill-token-threshold T` and
//! `--max-num-batched-tokens B`, bands below the interactive reserve keep one request
//! prefilling per endpoint (`max_prefilling_per_endpoint`, see
//! [`FlowSetup::with_engine_chunking`]). Time-based settings are simulated durations converted to
//! wall time with the replay's time scale (band TTLs, `turn_window_s` = [`TURN_WINDOW_S`],
//! `aging_s` = [`AGING_S`] or `--aging`, `pin_wait_s` = [`PIN_WAIT_S`], and the engines'
//! metrics scrape, [`SCRAPE_INTERVAL_S`]), so the gateway
//! sees the engines as often, and waits as long, in simulated time as it would in real time.
//!
//! # Saturation
//!
//! While a replay runs, [`SaturationSampler`] reads every gateway's flow controller every
//! [`SAMPLE_EVERY`] on the run's clock (simulated time on the virtual clock): the pool is *saturated* when requests are queued or the
//! requests in flight reach its capacity. The gateway decides a refusal somewhere between the
//! request's send and its answer (it reads the body and loads the history first), so a refusal
//! is counted in `shed_unsaturated` when no sample from the one before its send time to the one
//! after its answer shows saturation.
//!
//! # Figures
//!
//! A request's band is the `x-agentgate-band` header of its answer, or for a request that was
//! not admitted, the band the configuration gives its team. Queue waits come from the
//! `x-agentgate-queue-wait-ms` header of admitted requests. A turn is *continuing* when the
//! gateway sees it so: it is not the first of its session, or belongs to a sub-agent (which
//! starts from its parent's history), unless its session's earlier turns all failed (it then
//! goes out without any); *new* otherwise.
//!
//! Fairness, per band with two or more teams: a team is *backlogged* while it has a request in
//! the gateway's queue (an admitted request queued from its send time for its queue wait, one
//! refused with `queue_timeout` for its whole wait). Over the windows where every team of the
//! band is backlogged, each team's share is the tokens (input + output) of its requests
//! dispatched (sent + queue wait) inside a window, over all teams' such tokens. Weighted fair
//! queuing should split them by weight whatever each team offers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::clock::SimClock;
use super::replay::{Outcome, RequestRecord};
use super::summary::{percentile, ratio};

/// The high-priority band of the interactive team.
pub const INTERACTIVE_BAND: &str = "interactive";
/// The band of every other team.
pub const BATCH_BAND: &str = "batch";
/// Team of the `mixed` workload's chat sessions.
pub const INTERACTIVE_TEAM: &str = "interactive";
/// Team of the `mixed` workload's agent sessions.
pub const AGENTS_TEAM: &str = "agents";
/// Queue TTL of the interactive band, simulated seconds.
pub const INTERACTIVE_TTL_S: f64 = 60.0;
/// Queue TTL of the batch band, simulated seconds.
pub const BATCH_TTL_S: f64 = 600.0;
/// `[flow] turn_window_s`, simulated seconds.
pub const TURN_WINDOW_S: f64 = 60.0;
/// `[flow] aging_s`, simulated seconds (the gateway's default; `--aging` sets another).
pub const AGING_S: f64 = 10.0;
/// `[flow] pin_wait_s`, simulated seconds (the gateway's default).
pub const PIN_WAIT_S: f64 = 10.0;
/// `routing.scrape_interval_ms` (engines' `/metrics`), simulated seconds.
pub const SCRAPE_INTERVAL_S: f64 = 1.0;
/// `flow.exchange_interval_ms` (state shared between gateways), simulated seconds: the
/// gateway's default of 100 ms.
pub const EXCHANGE_INTERVAL_S: f64 = 0.1;
/// Wall time between two saturation samples.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// Flow control on or off (`--flow-control`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum FlowMode {
    /// Admission through bands, fair queuing and the gateway's cap.
    On,
    /// `[flow] enabled = false`: straight to routing in arrival order.
    Off,
}

impl FlowMode {
    /// `on` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            FlowMode::On => "on",
            FlowMode::Off => "off",
        }
    }
}

/// The band the bench configures for `team` in a multi-team workload.
pub fn band_of(team: &str) -> &'static str {
    if team == INTERACTIVE_TEAM {
        INTERACTIVE_BAND
    } else {
        BATCH_BAND
    }
}

/// The flow-control part of one replay's gateway configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSetup {
    /// `[flow] enabled`.
    pub enabled: bool,
    /// `[flow] max_in_flight_per_endpoint` of each gateway.
    pub max_in_flight_per_endpoint: u64,
    /// Wall seconds per simulated second of the time-based settings (1 at time scale 0, where
    /// simulated time is wall time).
    pub wall_per_sim_s: f64,
    /// Whether the batch band is sheddable.
    pub batch_sheddable: bool,
    /// The interactive band's `reserve`.
    pub interactive_reserve: f64,
    /// `[flow] max_prefilling_per_endpoint` of each gateway (0: none).
    pub max_prefilling_per_endpoint: u64,
    /// `[flow] max_kv_working_set` of each gateway (0: none).
    pub max_kv_working_set: f64,
    /// `[flow] aging_s` of each gateway, simulated seconds.
    pub aging_s: f64,
}

impl FlowSetup {
    /// The setup of one replay: `mode`, the replicas' `max_num_seqs` shared by `gateways`, the
    /// replay's time scale.
    pub fn new(
        mode: FlowMode,
        max_num_seqs: usize,
        gateways: usize,
        time_scale: f64,
        batch_sheddable: bool,
    ) -> FlowSetup {
        FlowSetup {
            enabled: mode == FlowMode::On,
            max_in_flight_per_endpoint: max_num_seqs.div_ceil(gateways.max(1)).max(1) as u64,
            wall_per_sim_s: if time_scale > 0.0 { time_scale } else { 1.0 },
            batch_sheddable,
            interactive_reserve: 0.0,
            max_prefilling_per_endpoint: 0,
            max_kv_working_set: 0.0,
            aging_s: AGING_S,
        }
    }

    /// The same for engines stepping `max_num_batched_tokens` with prefill chunks of at most
    /// `long_prefill_token_threshold`: each gateway lets lower bands keep one request prefilling
    /// per endpoint, and none while a request of any band is prefilling there. A higher band's
    /// new prompt then shares each engine step with at most one lower-band chunk per gateway,
    /// not `B / T - 1` of them, so its steps take about twice as long as alone, not `B / T`
    /// times. No limit when a step holds only one chunk, or without a threshold (one prompt may
    /// then take a whole step).
    pub fn with_engine_chunking(
        mut self,
        max_num_batched_tokens: usize,
        long_prefill_token_threshold: usize,
    ) -> FlowSetup {
        let chunks = match (max_num_batched_tokens, long_prefill_token_threshold) {
            (0, _) | (_, 0) => 0,
            (b, t) => b / t,
        };
        self.max_prefilling_per_endpoint = u64::from(chunks >= 2);
        self
    }

    /// The same with each gateway's prompts in flight on a replica spanning at most `share` of
    /// its KV capacity (0: no limit).
    pub fn with_kv_working_set(mut self, share: f64) -> FlowSetup {
        self.max_kv_working_set = share;
        self
    }

    /// The same with continuing turns getting a head start of `aging_s` simulated seconds.
    pub fn with_aging(mut self, aging_s: f64) -> FlowSetup {
        self.aging_s = aging_s;
        self
    }

    /// The same with the interactive band holding `reserve` of the pool's request slots.
    pub fn with_interactive_reserve(mut self, reserve: f64) -> FlowSetup {
        self.interactive_reserve = reserve;
        self
    }

    /// Wall milliseconds of `sim_s` simulated seconds, at least 1.
    fn wall_ms(&self, sim_s: f64) -> u64 {
        ((sim_s * 1000.0 * self.wall_per_sim_s).round() as u64).max(1)
    }

    /// `[routing]` and `[flow]` sections.
    pub fn toml(&self) -> String {
        format!(
            "[routing]\nscrape_interval_ms = {}\n\n\
             [flow]\nenabled = {}\nmax_in_flight_per_endpoint = {}\nmax_prefilling_per_endpoint = {}\n\
             max_kv_working_set = {:?}\nturn_window_s = {:?}\naging_s = {:?}\npin_wait_s = {:?}\n\
             exchange_interval_ms = {}\n\n",
            self.wall_ms(SCRAPE_INTERVAL_S),
            self.enabled,
            self.max_in_flight_per_endpoint,
            self.max_prefilling_per_endpoint,
            self.max_kv_working_set,
            self.wall_ms(TURN_WINDOW_S) as f64 / 1000.0,
            match self.aging_s > 0.0 {
                true => self.wall_ms(self.aging_s) as f64 / 1000.0,
                false => 0.0,
            },
            self.wall_ms(PIN_WAIT_S) as f64 / 1000.0,
            self.wall_ms(EXCHANGE_INTERVAL_S),
        )
    }

    /// `[[bands]]` of a multi-team workload.
    pub fn bands_toml(&self) -> String {
        format!(
            "\n[[bands]]\nname = \"{INTERACTIVE_BAND}\"\npriority = 100\nqueue_ttl_ms = {}\nreserve = {:?}\n\
             \n[[bands]]\nname = \"{BATCH_BAND}\"\npriority = 10\nsheddable = {}\nqueue_ttl_ms = {}\n",
            self.wall_ms(INTERACTIVE_TTL_S),
            self.interactive_reserve,
            self.batch_sheddable,
            self.wall_ms(BATCH_TTL_S),
        )
    }
}

/// Simulated queue TTL of `band` in the bench's configuration (None for other bands).
pub fn band_ttl_s(band: &str) -> Option<f64> {
    match band {
        INTERACTIVE_BAND => Some(INTERACTIVE_TTL_S),
        BATCH_BAND => Some(BATCH_TTL_S),
        _ => None,
    }
}

/// One saturation sample: simulated time and whether any gateway's pool was saturated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationSample {
    /// Simulated seconds since the replay started.
    pub t_s: f64,
    /// Requests queued in the gateways' flow control, summed.
    pub queued: u64,
    /// Whether a gateway had requests queued or its in-flight requests at capacity.
    pub saturated: bool,
}

/// Samples the gateways' flow controllers while a replay runs.
pub struct SaturationSampler {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Vec<SaturationSample>>,
}

impl SaturationSampler {
    /// Start sampling `gateways` (their pool `pool`) on `clock`.
    pub fn start(
        gateways: Vec<Arc<agentgate::AppState>>,
        pool: &str,
        clock: SimClock,
    ) -> SaturationSampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let pool = pool.to_string();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                let (mut queued, mut saturated) = (0u64, false);
                for state in &gateways {
                    let flow = &state.flow;
                    let Some(controller) = flow.controller(&pool) else {
                        continue;
                    };
                    let snapshot = controller.snapshot();
                    let waiting = snapshot.queued() as u64;
                    queued += waiting;
                    let full = flow
                        .capacity(&pool)
                        .is_some_and(|capacity| snapshot.in_flight >= capacity);
                    saturated |= waiting > 0 || full;
                }
                samples.push(SaturationSample {
                    t_s: clock.now_s(),
                    queued,
                    saturated,
                });
            }
            samples
        });
        SaturationSampler { stop, task }
    }

    /// Stop and return the samples in time order.
    pub async fn stop(self) -> Vec<SaturationSample> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

/// Whether the pool was saturated around simulated time `t_s`: the last sample at or before it
/// or the first after it says so (true when there are no samples).
pub fn saturated_around(samples: &[SaturationSample], t_s: f64) -> bool {
    saturated_during(samples, t_s, t_s)
}

/// Whether the pool was saturated at some point of `[from_s, to_s]` as far as the samples can
/// tell: a sample inside it, the last one before it or the first one after it says so (true
/// when there are no samples).
pub fn saturated_during(samples: &[SaturationSample], from_s: f64, to_s: f64) -> bool {
    if samples.is_empty() {
        return true;
    }
    let first = samples
        .partition_point(|s| s.t_s <= from_s)
        .saturating_sub(1);
    let last = samples.partition_point(|s| s.t_s <= to_s.max(from_s));
    samples
        .get(first..=last.min(samples.len() - 1))
        .unwrap_or(&[])
        .iter()
        .any(|s| s.saturated)
}

/// Per-band figures (`bands.<name>` in summary.json).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BandSummary {
    /// Requests of the band (admitted ones by the band header, the others by their team's band).
    pub requests: u64,
    /// Requests that completed.
    pub successes: u64,
    /// Requests refused for load: `overloaded_shed`, `queue_full`, `queue_timeout`.
    pub shed: u64,
    /// Requests refused by rate limits.
    pub rate_limited: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Time to first token of its successful requests, median (null when none succeeded).
    pub ttft_p50_ms: Option<f64>,
    /// Time to first token, 99th percentile.
    pub ttft_p99_ms: Option<f64>,
    /// Queue wait of its admitted requests, median (null when none said).
    pub queue_wait_p50_ms: Option<f64>,
    /// Queue wait, 99th percentile.
    pub queue_wait_p99_ms: Option<f64>,
    /// Longest queue wait of an admitted request.
    pub queue_wait_max_ms: Option<f64>,
    /// The band's queue TTL in the bench's configuration, simulated ms (null for the implicit
    /// band).
    pub queue_ttl_ms: Option<f64>,
}

/// Queue waits and TTFT of one turn kind (`turns.continuing`, `turns.new`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnKindSummary {
    /// Requests of this kind.
    pub requests: u64,
    /// Admitted requests whose queue wait is known.
    pub admitted: u64,
    /// Queue wait, median (null when no request said).
    pub queue_wait_p50_ms: Option<f64>,
    /// Queue wait, 99th percentile.
    pub queue_wait_p99_ms: Option<f64>,
    /// Time to first token of its successful requests, median (null when none succeeded).
    pub ttft_p50_ms: Option<f64>,
    /// Admitted requests sent while the pool was saturated.
    pub saturated_admitted: u64,
    /// Queue wait of those, median (null when there were none or no saturation samples).
    pub saturated_queue_wait_p50_ms: Option<f64>,
}

/// `turns` in summary.json: continuing turns (after the first of their session, or of a
/// sub-agent) and new sessions' first turns.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnsSummary {
    /// Turns after the first of their session, and sub-agents' turns.
    pub continuing: TurnKindSummary,
    /// First turns of top-level sessions.
    pub new: TurnKindSummary,
    /// New sessions compared with the continuing turns of their team sent around the same
    /// time, while the pool was saturated (null without saturation samples or such pairs).
    pub matched: Option<MatchedWaits>,
}

/// Half-width, in simulated seconds, of the window around a new session's first turn in which
/// its team's continuing turns are its comparison.
pub const MATCH_HALF_WINDOW_S: f64 = 15.0;

/// Queue waits of new sessions and of the continuing turns sent around the same time.
///
/// Queue waits drift with the backlog, so medians over a whole run compare requests sent at
/// different moments: new sessions that mostly arrive early would seem favoured. Here each new
/// session's first turn sent while the pool was saturated is paired with its team's admitted
/// continuing turns sent within [`MATCH_HALF_WINDOW_S`] of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MatchedWaits {
    /// New sessions' first turns that had continuing turns to compare with.
    pub pairs: u64,
    /// Their queue wait, median.
    pub new_queue_wait_p50_ms: f64,
    /// Median, over those new turns, of the median wait of their matched continuing turns.
    pub continuing_queue_wait_p50_ms: f64,
    /// continuing_queue_wait_p50_ms / new_queue_wait_p50_ms (null when the latter is 0).
    pub continuing_over_new: Option<f64>,
}

/// One team's share within a band while every team of it was backlogged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FairShare {
    /// Tokens (input + output) of its requests dispatched inside the windows.
    pub dispatched_tokens: u64,
    /// Requests dispatched inside the windows.
    pub dispatched_requests: u64,
    /// dispatched_tokens over every team's (null when nothing was dispatched).
    pub share: Option<f64>,
}

/// `fairness.<band>` in summary.json.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FairnessSummary {
    /// Simulated seconds during which every team of the band had a request queued.
    pub backlogged_s: f64,
    /// Per team.
    pub teams: BTreeMap<String, FairShare>,
}

/// The band a record counts under: its band header, else `team_bands` of its team.
pub fn band_of_record<'a>(
    record: &'a RequestRecord,
    team_bands: &'a BTreeMap<String, String>,
) -> Option<&'a str> {
    record
        .band
        .as_deref()
        .or_else(|| team_bands.get(&record.team).map(String::as_str))
}

fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

fn optional_percentile(sorted: &[f64], p: f64) -> Option<f64> {
    (!sorted.is_empty()).then(|| percentile(sorted, p))
}

/// Queue waits (sorted) of the admitted records, whatever became of them after (their wait
/// came with the response headers), and TTFTs (sorted) of the successful ones.
fn waits_and_ttfts<'a>(records: impl Iterator<Item = &'a RequestRecord>) -> (Vec<f64>, Vec<f64>) {
    let (mut waits, mut ttfts) = (Vec::new(), Vec::new());
    for r in records {
        waits.extend(r.queue_wait_ms);
        if r.outcome == Outcome::Success {
            ttfts.extend(r.ttft_ms);
        }
    }
    (sorted(waits), sorted(ttfts))
}

/// Per-band figures, by [`band_of_record`] (with flow control off, by the team's configured
/// band; queue waits are then null).
pub fn bands(
    records: &[RequestRecord],
    team_bands: &BTreeMap<String, String>,
) -> BTreeMap<String, BandSummary> {
    let mut by_band: BTreeMap<&str, Vec<&RequestRecord>> = BTreeMap::new();
    for record in records {
        if let Some(band) = band_of_record(record, team_bands) {
            by_band.entry(band).or_default().push(record);
        }
    }
    by_band
        .into_iter()
        .map(|(band, records)| {
            let count = |f: fn(&Outcome) -> bool| records.iter().filter(|r| f(&r.outcome)).count();
            let (waits, ttfts) = waits_and_ttfts(records.iter().copied());
            let summary = BandSummary {
                requests: records.len() as u64,
                successes: count(|o| *o == Outcome::Success) as u64,
                shed: count(|o| matches!(o, Outcome::Shed(_))) as u64,
                rate_limited: count(|o| matches!(o, Outcome::RateLimited(_))) as u64,
                errors: count(|o| matches!(o, Outcome::Error(_))) as u64,
                ttft_p50_ms: optional_percentile(&ttfts, 50.0),
                ttft_p99_ms: optional_percentile(&ttfts, 99.0),
                queue_wait_p50_ms: optional_percentile(&waits, 50.0),
                queue_wait_p99_ms: optional_percentile(&waits, 99.0),
                queue_wait_max_ms: waits.last().copied(),
                queue_ttl_ms: band_ttl_s(band).map(|s| s * 1000.0),
            };
            (band.to_string(), summary)
        })
        .collect()
}

/// Continuing versus new turns; the `saturated_*` figures count the requests sent while the
/// pool was saturated according to `saturation` (none when it is empty).
pub fn turns<'a, I>(records: I, saturation: &[SaturationSample]) -> TurnsSummary
where
    I: Iterator<Item = &'a RequestRecord> + Clone,
{
    let kind = |continuing: bool| {
        let of_kind = || records.clone().filter(move |r| r.continuing == continuing);
        let (waits, ttfts) = waits_and_ttfts(of_kind());
        let saturated = if saturation.is_empty() {
            Vec::new()
        } else {
            let sent_saturated = of_kind().filter(|r| saturated_around(saturation, r.sent_s));
            waits_and_ttfts(sent_saturated).0
        };
        TurnKindSummary {
            requests: of_kind().count() as u64,
            admitted: waits.len() as u64,
            queue_wait_p50_ms: optional_percentile(&waits, 50.0),
            queue_wait_p99_ms: optional_percentile(&waits, 99.0),
            ttft_p50_ms: optional_percentile(&ttfts, 50.0),
            saturated_admitted: saturated.len() as u64,
            saturated_queue_wait_p50_ms: optional_percentile(&saturated, 50.0),
        }
    };
    TurnsSummary {
        continuing: kind(true),
        new: kind(false),
        matched: matched_waits(records, saturation),
    }
}

/// See [`MatchedWaits`].
fn matched_waits<'a, I>(records: I, saturation: &[SaturationSample]) -> Option<MatchedWaits>
where
    I: Iterator<Item = &'a RequestRecord> + Clone,
{
    if saturation.is_empty() {
        return None;
    }
    // Admitted: a queue wait came with the response headers, whatever became of it after.
    let admitted = |r: &&'a RequestRecord| r.queue_wait_ms.is_some();
    let mut continuing: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for r in records.clone().filter(admitted).filter(|r| r.continuing) {
        if let Some(wait) = r.queue_wait_ms {
            continuing
                .entry(&r.team)
                .or_default()
                .push((r.sent_s, wait));
        }
    }
    for turns in continuing.values_mut() {
        turns.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let (mut new_waits, mut matched) = (Vec::new(), Vec::new());
    for r in records.filter(admitted).filter(|r| !r.continuing) {
        let Some(wait) = r.queue_wait_ms else {
            continue;
        };
        if !saturated_around(saturation, r.sent_s) {
            continue;
        }
        let Some(turns) = continuing.get(r.team.as_str()) else {
            continue;
        };
        let from = turns.partition_point(|t| t.0 < r.sent_s - MATCH_HALF_WINDOW_S);
        let to = turns.partition_point(|t| t.0 <= r.sent_s + MATCH_HALF_WINDOW_S);
        let around = sorted(
            turns
                .get(from..to)
                .unwrap_or(&[])
                .iter()
                .map(|t| t.1)
                .collect(),
        );
        if around.is_empty() {
            continue;
        }
        new_waits.push(wait);
        matched.push(percentile(&around, 50.0));
    }
    if new_waits.is_empty() {
        return None;
    }
    let (new_waits, matched) = (sorted(new_waits), sorted(matched));
    let (new_p50, continuing_p50) = (percentile(&new_waits, 50.0), percentile(&matched, 50.0));
    Some(MatchedWaits {
        pairs: new_waits.len() as u64,
        new_queue_wait_p50_ms: new_p50,
        continuing_queue_wait_p50_ms: continuing_p50,
        continuing_over_new: (new_p50 > 0.0).then(|| continuing_p50 / new_p50),
    })
}

/// The simulated interval a record spent in the gateway's queue, if it is known and not empty.
fn queued_interval(record: &RequestRecord) -> Option<(f64, f64)> {
    let wait_ms = match &record.outcome {
        Outcome::Success | Outcome::Error(_) => record.queue_wait_ms?,
        Outcome::Shed(code) if code == "queue_timeout" => record.e2e_ms,
        _ => return None,
    };
    (wait_ms > 0.0).then(|| (record.sent_s, record.sent_s + wait_ms / 1000.0))
}

/// The union of `intervals` as sorted, disjoint intervals.
pub fn union(mut intervals: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for (start, end) in intervals {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
}

/// The intersection of two sorted, disjoint interval lists.
pub fn intersect(a: &[(f64, f64)], b: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while let (Some(&(a0, a1)), Some(&(b0, b1))) = (a.get(i), b.get(j)) {
        let (start, end) = (a0.max(b0), a1.min(b1));
        if start < end {
            out.push((start, end));
        }
        if a1 < b1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

fn inside(windows: &[(f64, f64)], t: f64) -> bool {
    let after = windows.partition_point(|w| w.0 <= t);
    after
        .checked_sub(1)
        .and_then(|i| windows.get(i))
        .is_some_and(|w| t <= w.1)
}

/// Fairness per band with at least two teams (see the module doc); bands without queue waits
/// (flow control off) are left out.
pub fn fairness(
    records: &[RequestRecord],
    team_bands: &BTreeMap<String, String>,
) -> BTreeMap<String, FairnessSummary> {
    let mut teams_of: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for record in records {
        if let Some(band) = band_of_record(record, team_bands) {
            teams_of.entry(band).or_default().insert(&record.team);
        }
    }
    let mut out = BTreeMap::new();
    for (band, teams) in teams_of.into_iter().filter(|(_, t)| t.len() > 1) {
        let in_band = |r: &&RequestRecord| band_of_record(r, team_bands) == Some(band);
        if !records
            .iter()
            .filter(in_band)
            .any(|r| r.queue_wait_ms.is_some())
        {
            continue;
        }
        let mut windows: Option<Vec<(f64, f64)>> = None;
        for team in &teams {
            let queued = union(
                records
                    .iter()
                    .filter(in_band)
                    .filter(|r| r.team == *team)
                    .filter_map(queued_interval)
                    .collect(),
            );
            windows = Some(match windows {
                None => queued,
                Some(w) => intersect(&w, &queued),
            });
        }
        let windows = windows.unwrap_or_default();
        let mut shares: BTreeMap<String, FairShare> = teams
            .iter()
            .map(|t| {
                let empty = FairShare {
                    dispatched_tokens: 0,
                    dispatched_requests: 0,
                    share: None,
                };
                (t.to_string(), empty)
            })
            .collect();
        for r in records.iter().filter(in_band) {
            let (Outcome::Success, Some(wait)) = (&r.outcome, r.queue_wait_ms) else {
                continue;
            };
            if !inside(&windows, r.sent_s + wait / 1000.0) {
                continue;
            }
            if let Some(share) = shares.get_mut(&r.team) {
                share.dispatched_tokens += r.input_tokens + r.output_tokens;
                share.dispatched_requests += 1;
            }
        }
        let total: u64 = shares.values().map(|s| s.dispatched_tokens).sum();
        for share in shares.values_mut() {
            share.share = (total > 0).then(|| ratio(share.dispatched_tokens, total));
        }
        out.insert(
            band.to_string(),
            FairnessSummary {
                backlogged_s: windows.iter().map(|(a, b)| b - a).sum(),
                teams: shares,
            },
        );
    }
    out
}

/// Mean number of `records` outstanding (sent and not finished) over `[0, span_s]`.
pub fn outstanding_mean<'a>(records: impl Iterator<Item = &'a RequestRecord>, span_s: f64) -> f64 {
    if span_s <= 0.0 {
        return 0.0;
    }
    let busy: f64 = records
        .map(|r| {
            let (start, end) = (r.sent_s, r.sent_s + r.e2e_ms / 1000.0);
            (end.min(span_s) - start.max(0.0)).max(0.0)
        })
        .sum();
    busy / span_s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(team: &str, turn: usize, sent_s: f64, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            seq: 0,
            session: 0,
            turn,
            continuing: turn > 0,
            gateway: 0,
            endpoint: None,
            route_reason: None,
            pin_moved: None,
            team: team.into(),
            band: None,
            queue_wait_ms: None,
            sent_s,
            outcome,
            ttft_ms: Some(50.0),
            e2e_ms: 1000.0,
            input_tokens: 0,
            cached_tokens: 0,
            output_tokens: 0,
        }
    }

    fn admitted(team: &str, sent_s: f64, wait_ms: f64, tokens: u64) -> RequestRecord {
        RequestRecord {
            band: Some(BATCH_BAND.into()),
            queue_wait_ms: Some(wait_ms),
            input_tokens: tokens,
            output_tokens: 0,
            ..record(team, 1, sent_s, Outcome::Success)
        }
    }

    #[test]
    fn configuration_scales_simulated_durations_and_shares_the_cap() {
        let setup = FlowSetup::new(FlowMode::On, 8, 3, 0.2, false);
        assert_eq!(setup.max_in_flight_per_endpoint, 3, "ceil(8 / 3)");
        let text = setup.toml();
        assert!(text.contains("scrape_interval_ms = 200\n"), "{text}");
        assert!(text.contains("turn_window_s = 12.0\n"), "{text}");
        assert!(text.contains("aging_s = 2.0\n"), "{text}");
        assert!(text.contains("pin_wait_s = 2.0\n"), "{text}");
        assert!(text.contains("max_prefilling_per_endpoint = 0\n"), "{text}");
        // `--aging 30s` at time scale 0.2; `--aging 0s` turns turn-first ordering off.
        let aged = |s| setup.clone().with_aging(s).toml();
        assert!(aged(30.0).contains("aging_s = 6.0\n"));
        assert!(aged(0.0).contains("aging_s = 0.0\n"));
        // 2048-token steps of 512-token chunks: one lower-band prompt prefilling; a step of
        // one chunk, or no threshold: no limit.
        let chunked = |b, t| {
            setup
                .clone()
                .with_engine_chunking(b, t)
                .max_prefilling_per_endpoint
        };
        assert_eq!(chunked(2048, 512), 1);
        assert_eq!(chunked(1024, 512), 1);
        assert_eq!(chunked(512, 512), 0);
        assert_eq!(chunked(8192, 0), 0);
        let bands = setup.bands_toml();
        assert!(bands.contains("queue_ttl_ms = 12000\n"), "{bands}");
        assert!(bands.contains("queue_ttl_ms = 120000\n"), "{bands}");
        // Time scale 0: simulated time is wall time.
        let instant = FlowSetup::new(FlowMode::Off, 64, 1, 0.0, true);
        assert!(instant.toml().contains("enabled = false\n"));
        assert!(instant.toml().contains("scrape_interval_ms = 1000\n"));
        assert!(instant.bands_toml().contains("sheddable = true\n"));
        assert_eq!(band_of("interactive"), "interactive");
        assert_eq!(band_of("agents"), "batch");
    }

    #[test]
    fn saturation_is_read_around_a_moment() {
        let sample = |t_s, saturated| SaturationSample {
            t_s,
            queued: 0,
            saturated,
        };
        let samples = [sample(1.0, false), sample(2.0, true), sample(3.0, false)];
        assert!(!saturated_around(&samples, 0.5));
        assert!(saturated_around(&samples, 1.5), "the sample after");
        assert!(saturated_around(&samples, 2.5), "the sample before");
        assert!(!saturated_around(&samples, 3.5));
        assert!(saturated_around(&[], 1.0), "unknown counts as saturated");
        let samples = [
            sample(1.0, false),
            sample(2.0, false),
            sample(3.0, true),
            sample(4.0, false),
            sample(5.0, false),
            sample(6.0, false),
        ];
        assert!(!saturated_during(&samples, 1.2, 1.8));
        assert!(
            saturated_during(&samples, 1.2, 2.5),
            "the first sample after"
        );
        assert!(saturated_during(&samples, 2.5, 2.7));
        assert!(
            saturated_during(&samples, 3.5, 5.5),
            "the last sample before"
        );
        assert!(!saturated_during(&samples, 4.5, 5.5));
        assert!(
            !saturated_during(&samples, 4.5, 9.0),
            "past the last sample"
        );
        assert!(
            !saturated_during(&samples, 0.0, 0.5),
            "before the first sample"
        );
    }

    #[test]
    fn bands_take_the_header_or_the_teams_band() {
        let team_bands: BTreeMap<String, String> = [("interactive", "interactive")]
            .into_iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let records = vec![
            RequestRecord {
                band: Some("interactive".into()),
                queue_wait_ms: Some(30.0),
                ..record("interactive", 0, 1.0, Outcome::Success)
            },
            RequestRecord {
                band: Some("interactive".into()),
                queue_wait_ms: Some(10.0),
                ttft_ms: Some(90.0),
                ..record("interactive", 1, 2.0, Outcome::Success)
            },
            record("interactive", 2, 3.0, Outcome::Shed("queue_timeout".into())),
            record(
                "interactive",
                3,
                3.0,
                Outcome::RateLimited("rate_limit_exceeded_tokens".into()),
            ),
            // No header and no configured band: flow control was off for it.
            record("agents", 0, 1.0, Outcome::Success),
        ];
        let bands = bands(&records, &team_bands);
        assert_eq!(bands.len(), 1);
        let b = &bands["interactive"];
        assert_eq!(
            (b.requests, b.successes, b.shed, b.rate_limited, b.errors),
            (4, 2, 1, 1, 0)
        );
        assert_eq!((b.ttft_p50_ms, b.ttft_p99_ms), (Some(50.0), Some(90.0)));
        assert_eq!(
            (b.queue_wait_p50_ms, b.queue_wait_p99_ms),
            (Some(10.0), Some(30.0))
        );
        assert_eq!(b.queue_wait_max_ms, Some(30.0));
        assert_eq!(b.queue_ttl_ms, Some(INTERACTIVE_TTL_S * 1000.0));
        assert!(super::bands(&records, &BTreeMap::new()).contains_key("interactive"));
        let off: Vec<RequestRecord> = records
            .iter()
            .filter(|r| r.band.is_none())
            .cloned()
            .collect();
        assert!(super::bands(&off, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn turns_split_first_turns_from_later_ones() {
        let with_wait = |turn, wait| RequestRecord {
            queue_wait_ms: Some(wait),
            ..record("a", turn, 0.0, Outcome::Success)
        };
        let later = |turn, wait| RequestRecord {
            sent_s: 10.0,
            ..with_wait(turn, wait)
        };
        let records = vec![
            with_wait(0, 400.0),
            with_wait(0, 600.0),
            with_wait(1, 100.0),
            with_wait(2, 200.0),
            with_wait(3, 300.0),
            record("a", 4, 0.0, Outcome::Shed("queue_full".into())),
            // A sub-agent's first turn continues its parent's conversation.
            RequestRecord {
                continuing: true,
                ..with_wait(0, 250.0)
            },
            // Sent at 10 s, while the pool was saturated.
            later(0, 900.0),
            later(5, 50.0),
        ];
        let saturation = [
            SaturationSample {
                t_s: 5.0,
                queued: 0,
                saturated: false,
            },
            SaturationSample {
                t_s: 9.0,
                queued: 3,
                saturated: true,
            },
        ];
        let t = turns(records[..7].iter(), &[]);
        assert_eq!((t.new.requests, t.new.admitted), (2, 2));
        assert_eq!((t.continuing.requests, t.continuing.admitted), (5, 4));
        assert_eq!(t.new.queue_wait_p50_ms, Some(400.0));
        assert_eq!(t.continuing.queue_wait_p50_ms, Some(200.0));
        assert_eq!(t.continuing.queue_wait_p99_ms, Some(300.0));
        assert_eq!(t.new.saturated_queue_wait_p50_ms, None, "no samples");
        let t = turns(records.iter(), &saturation);
        assert_eq!(
            (t.new.saturated_admitted, t.continuing.saturated_admitted),
            (1, 1)
        );
        assert_eq!(t.new.saturated_queue_wait_p50_ms, Some(900.0));
        assert_eq!(t.continuing.saturated_queue_wait_p50_ms, Some(50.0));
        // The new session sent at 10 s is matched with the continuing turns sent within 15 s
        // of it: every one here (waits 100, 200, 250, 300 and 50 ms; median 200).
        let matched = t.matched.expect("a saturated new session with neighbours");
        assert_eq!(matched.pairs, 1);
        assert_eq!(matched.new_queue_wait_p50_ms, 900.0);
        assert_eq!(matched.continuing_queue_wait_p50_ms, 200.0);
        assert_eq!(matched.continuing_over_new, Some(200.0 / 900.0));
        assert_eq!(turns(records[..7].iter(), &[]).matched, None);
        let off = turns([record("a", 1, 0.0, Outcome::Success)].iter(), &[]);
        assert_eq!(off.continuing.queue_wait_p50_ms, None);
        assert_eq!(off.new.requests, 0);
    }

    #[test]
    fn new_sessions_are_compared_with_continuing_turns_sent_around_the_same_time() {
        let at = |team: &str, continuing: bool, sent_s: f64, wait: f64| RequestRecord {
            continuing,
            queue_wait_ms: Some(wait),
            ..record(team, usize::from(continuing), sent_s, Outcome::Success)
        };
        let records = [
            // Early, short waits: outside the window of the new session at 100 s.
            at("a", true, 10.0, 100.0),
            at("a", true, 20.0, 100.0),
            // Around 100 s: long waits.
            at("a", true, 90.0, 4_000.0),
            at("a", true, 114.0, 6_000.0),
            at("a", false, 100.0, 10_000.0),
            // Another team's continuing turns are not a comparison.
            at("b", true, 100.0, 1.0),
            // A new session with no continuing turn of its team nearby is left out.
            at("a", false, 200.0, 50.0),
        ];
        let saturated = [SaturationSample {
            t_s: 0.0,
            queued: 1,
            saturated: true,
        }];
        let matched = turns(records.iter(), &saturated).matched.unwrap();
        assert_eq!(matched.pairs, 1);
        assert_eq!(matched.new_queue_wait_p50_ms, 10_000.0);
        assert_eq!(matched.continuing_queue_wait_p50_ms, 4_000.0);
        assert_eq!(matched.continuing_over_new, Some(0.4));
        let unsaturated = [SaturationSample {
            t_s: 0.0,
            queued: 0,
            saturated: false,
        }];
        assert_eq!(turns(records.iter(), &unsaturated).matched, None);
    }

    #[test]
    fn intervals_union_and_intersect() {
        let a = union(vec![(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]);
        assert_eq!(a, [(0.0, 3.0), (5.0, 6.0)]);
        let b = union(vec![(2.0, 5.5)]);
        assert_eq!(intersect(&a, &b), [(2.0, 3.0), (5.0, 5.5)]);
        assert!(intersect(&a, &[]).is_empty());
        assert!(inside(&a, 3.0) && inside(&a, 0.0) && !inside(&a, 4.0));
    }

    #[test]
    fn fairness_counts_only_what_was_dispatched_while_both_teams_waited() {
        let team_bands = BTreeMap::new();
        let records = vec![
            // light waits 0..10 s and 12..20 s; heavy waits 0..20 s.
            admitted("light", 0.0, 10_000.0, 100),
            admitted("light", 12.0, 8_000.0, 100),
            admitted("heavy", 0.0, 20_000.0, 300),
            // Dispatched inside a window: counted.
            admitted("heavy", 1.0, 4_000.0, 100),
            admitted("light", 1.0, 5_000.0, 100),
            // Dispatched at 11 s, while light had nothing queued: not counted.
            admitted("heavy", 2.0, 9_000.0, 1_000),
            // A timed-out request was queued for its whole wait, but dispatched nothing.
            RequestRecord {
                band: Some(BATCH_BAND.into()),
                e2e_ms: 30_000.0,
                ..record("heavy", 3, 25.0, Outcome::Shed("queue_timeout".into()))
            },
        ];
        let fairness = fairness(&records, &team_bands);
        let batch = &fairness[BATCH_BAND];
        assert!((batch.backlogged_s - 18.0).abs() < 1e-9, "{batch:?}");
        let (light, heavy) = (&batch.teams["light"], &batch.teams["heavy"]);
        // light: 100 at 10 s, 100 at 20 s, 100 at 6 s; heavy: 300 at 20 s, 100 at 5 s.
        assert_eq!(
            (light.dispatched_tokens, heavy.dispatched_tokens),
            (300, 400)
        );
        assert_eq!(
            (light.dispatched_requests, heavy.dispatched_requests),
            (3, 2)
        );
        assert!((light.share.unwrap() - 300.0 / 700.0).abs() < 1e-12);
        // Without queue waits (flow control off) there is no fairness section.
        let off: Vec<RequestRecord> = records
            .iter()
            .map(|r| RequestRecord {
                queue_wait_ms: None,
                outcome: Outcome::Success,
                ..r.clone()
            })
            .collect();
        assert!(super::fairness(&off, &team_bands).is_empty());
    }

    #[test]
    fn outstanding_requests_are_averaged_over_the_span() {
        let records = [
            record("a", 0, 0.0, Outcome::Success),
            record("a", 1, 9.5, Outcome::Success),
        ];
        // 1 s + 0.5 s (clipped at 10 s) over 10 s.
        assert!((outstanding_mean(records.iter(), 10.0) - 0.15).abs() < 1e-12);
        assert_eq!(outstanding_mean(records.iter(), 0.0), 0.0);
    }
}
