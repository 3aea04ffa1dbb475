//! One engine replica and the gateway's live view of it.
//!
//! Three sources feed the view, freshest first:
//!
//! - the gateway's own counts of the work it has sent there: requests and prompt tokens in
//!   flight, and *pending prefill tokens* (the uncached prompt tokens of requests that have not
//!   produced their first token yet). [`InFlight`] guards keep them exact: a guard adds its
//!   request on [`Endpoint::begin`], [`InFlight::prefill_done`] releases the prefill share at the
//!   first token, and dropping the guard releases the rest, so a failed or abandoned request can
//!   never leak load;
//! - the last [`LoadReport`] scraped from the engine's `/metrics` (queue depth, running
//!   sequences, KV usage), stamped with when it was taken. A report older than the configured
//!   staleness counts as saturated: an endpoint the gateway cannot see into gets no new work it
//!   could avoid;
//! - health: set by the gateway's probe loop; an unhealthy endpoint is skipped by every picker
//!   until it recovers. An endpoint removed by discovery is *retired*: requests already running
//!   on it finish, new ones go elsewhere.
//!
//! The gateway also keeps a decayed count of the turns of bands with a reserve it routed to
//! each endpoint ([`Endpoint::note_reserved_turn`]): where those bands' sessions live, so new
//! ones can be spread and each endpoint's reserve holds its share of them (see
//! [`crate::filter::SpreadReserved`]).
//!
//! Every endpoint has a stable `slot` in its pool: the prefix index and other per-endpoint
//! tables are keyed by slot, so the endpoint list can change (discovery reload) without
//! re-numbering what the gateway has learnt about the endpoints that stay.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use crate::disagg::PrefillThroughput;

/// What an endpoint does in a disaggregated deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Prefill and decode (an aggregated replica).
    #[default]
    Both,
    /// Prefill only (the first leg of a P/D request).
    Prefill,
    /// Decode only (the second leg).
    Decode,
}

impl Role {
    /// Every name the configuration accepts.
    pub const NAMES: &'static [&'static str] = &["both", "prefill", "decode"];

    /// Parse a role name; the error lists the names that exist.
    pub fn parse(name: &str) -> Result<Role, String> {
        match name {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!(
                "unknown role `{other}`; use one of: {}",
                Self::NAMES.join(", ")
            )),
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Load figures scraped from an engine's `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadReport {
    /// When the scrape finished.
    pub at: Instant,
    /// Requests waiting in the engine's queue (`vllm:num_requests_waiting`,
    /// `sglang:num_queue_reqs`).
    pub waiting: f64,
    /// Requests running (`vllm:num_requests_running`, `sglang:num_running_reqs`).
    pub running: f64,
    /// Fraction of KV cache in use, 0..=1 (`vllm:kv_cache_usage_perc`, `sglang:token_usage`),
    /// when the engine reports it.
    pub kv_usage: Option<f64>,
    /// Requests this gateway had in flight on the endpoint while the scrape ran (the larger of
    /// the counts before and after it): the engine's `running + waiting` beyond this are other
    /// gateways' requests ([`LoadReport::others_in_flight`]).
    pub gateway_in_flight: u64,
    /// Requests the peers this gateway exchanges state with had in flight on the endpoint
    /// at the scrape, as they last published ([`Endpoint::peer_in_flight`]).
    pub peer_in_flight: u64,
}

impl LoadReport {
    /// Requests other gateways had on the engine at the scrape, estimated as the engine's
    /// `running + waiting` less this gateway's own count then (0 when the engine counts no more
    /// than this gateway sent: requests in transit or still streaming their last bytes are
    /// counted here but not there, so the estimate errs low, toward a lone gateway's view).
    pub fn others_in_flight(&self) -> u64 {
        let engine = (self.running.max(0.0) + self.waiting.max(0.0)).round() as u64;
        engine.saturating_sub(self.gateway_in_flight)
    }

    /// KV tokens held on the engine at the scrape by requests neither this gateway nor its
    /// peers sent (a gateway that exchanges no state, clients calling the engine directly):
    /// the engine's KV usage times `capacity_tokens`, shared out by request count, the share of
    /// the requests the engine counted beyond those of this gateway and its peers. 0 when the
    /// engine reports no usage or counts no more requests than they sent (requests in transit
    /// are counted here but not there, so the estimate errs low, toward a lone gateway's
    /// view). By count, not as usage less the gateways' own working sets: those are in the
    /// gateway's estimated tokens, the usage in the engine's, and the difference between the
    /// two would read as others' KV.
    pub fn others_kv_tokens(&self, capacity_tokens: u64) -> u64 {
        let Some(usage) = self.kv_usage else {
            return 0;
        };
        let engine = (self.running.max(0.0) + self.waiting.max(0.0)).round() as u64;
        let ours = self.gateway_in_flight.saturating_add(self.peer_in_flight);
        let others = engine.saturating_sub(ours);
        if others == 0 {
            return 0;
        }
        let used = usage.clamp(0.0, 1.0) * capacity_tokens as f64;
        (used * others as f64 / engine as f64).round() as u64
    }
}

/// When an endpoint counts as saturated (see [`Endpoint::saturated`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saturation {
    /// Engine queue depth at or above which the endpoint is saturated.
    pub max_waiting: f64,
    /// KV usage at or above which the endpoint is saturated (with requests waiting).
    pub max_kv_usage: f64,
    /// A load report older than this counts as saturated. `None`: metrics are not scraped, so
    /// their absence says nothing.
    pub staleness: Option<Duration>,
}

impl Saturation {
    /// Whether an endpoint whose latest load report is `report` counts as saturated at `now`:
    /// metrics are expected (`staleness` set) and the report is missing or older than
    /// `staleness`, or the engine's queue is at `max_waiting`, or its KV cache is at
    /// `max_kv_usage` with requests waiting.
    pub fn saturated(&self, report: Option<&LoadReport>, now: Instant) -> bool {
        if self.stale(report, now) {
            return true;
        }
        report.is_some_and(|r| {
            r.waiting >= self.max_waiting
                || (r.waiting > 0.0 && r.kv_usage.is_some_and(|u| u >= self.max_kv_usage))
        })
    }

    /// Whether metrics are expected (`staleness` set) and `report` is missing or older than
    /// `staleness` at `now`: the gateway cannot see into the engine.
    pub fn stale(&self, report: Option<&LoadReport>, now: Instant) -> bool {
        self.staleness.is_some_and(|staleness| {
            report.is_none_or(|r| now.saturating_duration_since(r.at) > staleness)
        })
    }
}

impl Default for Saturation {
    fn default() -> Self {
        Saturation {
            max_waiting: 32.0,
            max_kv_usage: 0.98,
            staleness: None,
        }
    }
}

/// One engine replica.
#[derive(Debug)]
pub struct Endpoint {
    /// Display name (`pool/index` or the discovery name), safe to show in headers and logs.
    pub name: String,
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub base_url: String,
    /// Stable position in the pool's per-endpoint tables (prefix index).
    pub slot: usize,
    /// Prefill/decode role.
    pub role: Role,
    /// Free-form labels (`accelerator = "tpu-v5e"`, ...), from the config or discovery.
    pub labels: BTreeMap<String, String>,
    retired: AtomicBool,
    /// The engine's live state, shared with the endpoints that stand for the same engine
    /// under another name, role or labels ([`Endpoint::same_engine_as`]).
    live: Arc<Live>,
}

/// What the gateway knows and counts about one engine.
#[derive(Debug)]
struct Live {
    in_flight_requests: AtomicU64,
    in_flight_tokens: AtomicU64,
    pending_prefill_tokens: AtomicU64,
    prefilling_requests: AtomicU64,
    healthy: AtomicBool,
    report: Mutex<Option<LoadReport>>,
    throughput: PrefillThroughput,
    reserved_turns: Mutex<Decayed>,
    kv_capacity_tokens: AtomicU64,
    working_set: Mutex<WorkingSet>,
    working_set_tokens: AtomicU64,
    /// [`Endpoint::peer_working_set_tokens`].
    peer_working_set_tokens: AtomicU64,
    /// [`Endpoint::peer_in_flight`].
    peer_in_flight: AtomicU64,
    /// [`Endpoint::engine_restarted`]: the last lifetime counter seen, as f64 bits
    /// (`u64::MAX`: none yet).
    lifetime_counter: AtomicU64,
}

impl Default for Live {
    fn default() -> Self {
        Live {
            in_flight_requests: AtomicU64::new(0),
            in_flight_tokens: AtomicU64::new(0),
            pending_prefill_tokens: AtomicU64::new(0),
            prefilling_requests: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            report: Mutex::new(None),
            throughput: PrefillThroughput::default(),
            reserved_turns: Mutex::new(Decayed::default()),
            kv_capacity_tokens: AtomicU64::new(0),
            working_set: Mutex::new(WorkingSet::default()),
            working_set_tokens: AtomicU64::new(0),
            peer_working_set_tokens: AtomicU64::new(0),
            peer_in_flight: AtomicU64::new(0),
            lifetime_counter: AtomicU64::new(u64::MAX),
        }
    }
}

/// The distinct prompt chunks of the requests in flight on an endpoint, counted once however
/// many requests share them (prompt chunks are hashed as a chain, so equal hashes mean an
/// equal prefix): the KV the engine needs to run them all at once.
#[derive(Debug, Default)]
struct WorkingSet {
    /// Requests in flight per chunk hash.
    chunks: HashMap<u64, u32>,
}

/// A count that decays exponentially: `value * exp(-elapsed / window)`.
#[derive(Debug, Default, Clone, Copy)]
struct Decayed {
    value: f64,
    at: Option<Instant>,
}

impl Decayed {
    fn at(&self, now: Instant, window: Duration) -> f64 {
        match self.at {
            None => 0.0,
            Some(at) if window.is_zero() => {
                if now > at {
                    0.0
                } else {
                    self.value
                }
            }
            Some(at) => {
                let elapsed = now.saturating_duration_since(at).as_secs_f64();
                self.value * (-elapsed / window.as_secs_f64()).exp()
            }
        }
    }
}

impl Endpoint {
    /// A new, healthy endpoint in slot 0 with no work in flight, role `both`, no labels.
    pub fn new(name: impl Into<String>, base_url: impl Into<String>) -> Self {
        Endpoint {
            name: name.into(),
            base_url: base_url.into(),
            slot: 0,
            role: Role::Both,
            labels: BTreeMap::new(),
            retired: AtomicBool::new(false),
            live: Arc::new(Live::default()),
        }
    }

    /// Set the slot.
    pub fn with_slot(mut self, slot: usize) -> Self {
        self.slot = slot;
        self
    }

    /// Set the role.
    pub fn with_role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    /// Set the labels.
    pub fn with_labels(mut self, labels: BTreeMap<String, String>) -> Self {
        self.labels = labels;
        self
    }

    /// Stand for the same engine as `other` (under a new name, role or labels): share its live
    /// state, so its requests in flight, health, scraped load, KV capacity, working set and
    /// measured throughput count for both, whichever object a request holds.
    pub fn same_engine_as(mut self, other: &Endpoint) -> Self {
        self.live = Arc::clone(&other.live);
        self
    }

    /// Whether `other` shares this endpoint's live state ([`Endpoint::same_engine_as`]).
    pub fn is_same_engine(&self, other: &Endpoint) -> bool {
        Arc::ptr_eq(&self.live, &other.live)
    }

    /// Requests this gateway process has in flight on the endpoint.
    pub fn in_flight_requests(&self) -> u64 {
        self.live.in_flight_requests.load(Ordering::Relaxed)
    }

    /// Prompt tokens (estimated) of those requests.
    pub fn in_flight_tokens(&self) -> u64 {
        self.live.in_flight_tokens.load(Ordering::Relaxed)
    }

    /// Uncached prompt tokens (estimated) of the in-flight requests still waiting for their first
    /// token: the prefill work queued ahead of a new request.
    pub fn pending_prefill_tokens(&self) -> u64 {
        self.live.pending_prefill_tokens.load(Ordering::Relaxed)
    }

    /// In-flight requests of this gateway process still waiting for their first token, however
    /// much of their prompt was expected to be cached: each may be taking a prefill chunk of
    /// every engine step.
    pub fn prefilling_requests(&self) -> u64 {
        self.live.prefilling_requests.load(Ordering::Relaxed)
    }

    /// Whether the last health probe passed (true until a probe says otherwise).
    pub fn is_healthy(&self) -> bool {
        self.live.healthy.load(Ordering::Relaxed)
    }

    /// Record a health verdict; returns whether it changed.
    pub fn set_healthy(&self, healthy: bool) -> bool {
        self.live.healthy.swap(healthy, Ordering::Relaxed) != healthy
    }

    /// Whether discovery removed the endpoint (it finishes its requests, takes no new ones).
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Mark the endpoint removed.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Healthy and not retired: may be given new work.
    pub fn is_available(&self) -> bool {
        self.is_healthy() && !self.is_retired()
    }

    /// Store the latest scraped load figures.
    pub fn set_load_report(&self, report: LoadReport) {
        *self
            .live
            .report
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(report);
    }

    /// The latest scraped load figures, if any.
    pub fn load_report(&self) -> Option<LoadReport> {
        *self
            .live
            .report
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Saturated: metrics are expected and stale (or missing), or the engine's queue is at
    /// `max_waiting`, or its KV cache is at `max_kv_usage` with requests waiting (see
    /// [`Saturation::saturated`]).
    pub fn saturated(&self, limits: &Saturation, now: Instant) -> bool {
        limits.saturated(self.load_report().as_ref(), now)
    }

    /// Record a prefill the gateway timed on this endpoint: `tokens` of prefill work (the
    /// request's uncached prompt tokens plus the pending prefill queued ahead of it) done in
    /// `elapsed` (see [`PrefillThroughput`]).
    pub fn observe_prefill(&self, tokens: u64, elapsed: Duration) {
        self.live.throughput.observe(tokens, elapsed);
    }

    /// Count a turn of a band with a reserve routed here at `now`; the count decays with time
    /// constant `window` (the flow-control turn window).
    pub fn note_reserved_turn(&self, now: Instant, window: Duration) {
        let mut count = self
            .live
            .reserved_turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let at = count.at.map_or(now, |at| at.max(now));
        *count = Decayed {
            value: count.at(at, window) + 1.0,
            at: Some(at),
        };
    }

    /// Turns of bands with a reserve routed here, each weighted by `exp(-age / window)`.
    pub fn recent_reserved_turns(&self, now: Instant, window: Duration) -> f64 {
        self.live
            .reserved_turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .at(now, window)
    }

    /// Record the engine's KV capacity in tokens (`vllm:cache_config_info`); 0: unknown.
    pub fn set_kv_capacity_tokens(&self, tokens: u64) {
        self.live
            .kv_capacity_tokens
            .store(tokens, Ordering::Relaxed);
    }

    /// Record a counter the engine keeps since it started (vLLM's and SGLang's prefix-cache
    /// queries); whether it went back since the last one recorded, i.e. the engine restarted
    /// (and lost its cache) meanwhile.
    pub fn engine_restarted(&self, lifetime_counter: f64) -> bool {
        if !lifetime_counter.is_finite() || lifetime_counter < 0.0 {
            return false;
        }
        let last = self
            .live
            .lifetime_counter
            .swap(lifetime_counter.to_bits(), Ordering::Relaxed);
        last != u64::MAX && lifetime_counter < f64::from_bits(last)
    }

    /// The engine's metrics came without the lifetime counter it reported before: whether it
    /// had one, i.e. the engine restarted (SGLang exports its prompt-token counter only once a
    /// request finished, so a restarted SGLang has none for a while). The next counter
    /// reported starts over.
    pub fn lifetime_counter_vanished(&self) -> bool {
        self.live.lifetime_counter.swap(u64::MAX, Ordering::Relaxed) != u64::MAX
    }

    /// Whether the engine reported a lifetime counter ([`Endpoint::engine_restarted`]), by
    /// which its restarts are told apart from failed probes.
    pub fn tells_restarts(&self) -> bool {
        self.live.lifetime_counter.load(Ordering::Relaxed) != u64::MAX
    }

    /// The engine's KV capacity in tokens, 0 while unknown.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.live.kv_capacity_tokens.load(Ordering::Relaxed)
    }

    /// Tokens of KV the requests this gateway has in flight here span together: each distinct
    /// prompt chunk once, however many requests share it (see [`InFlight::hold_prompt`]).
    pub fn working_set_tokens(&self) -> u64 {
        self.live.working_set_tokens.load(Ordering::Relaxed)
    }

    /// Whether the working set, with the peers' as last exchanged and the KV others held at
    /// the last scrape ([`LoadReport::others_kv_tokens`]), is below `fraction` of the engine's
    /// KV capacity (always when the capacity is unknown or `fraction` is 0, i.e. no limit).
    /// Several gateways in front of one engine thus share its room instead of each keeping a
    /// fixed part of it: one that has no work there leaves its part to the others.
    pub fn kv_working_set_below(&self, fraction: f64) -> bool {
        let capacity = self.kv_capacity_tokens();
        if fraction <= 0.0 || capacity == 0 {
            return true;
        }
        let others = self
            .load_report()
            .map_or(0, |r| r.others_kv_tokens(capacity));
        let total = self
            .working_set_tokens()
            .saturating_add(self.peer_working_set_tokens())
            .saturating_add(others);
        (total as f64) < fraction * capacity as f64
    }

    /// Record what the other gateways in front of this endpoint published last, summed: their
    /// working set and requests in flight here (0 when none do or the exchange failed; the
    /// engine's scraped figures then stand in for them).
    pub fn set_peers(&self, working_set_tokens: u64, in_flight: u64) {
        self.live
            .peer_working_set_tokens
            .store(working_set_tokens, Ordering::Relaxed);
        self.live.peer_in_flight.store(in_flight, Ordering::Relaxed);
    }

    /// Requests the other gateways published in flight here, as last exchanged.
    pub fn peer_in_flight(&self) -> u64 {
        self.live.peer_in_flight.load(Ordering::Relaxed)
    }

    /// The working set other gateways published for this endpoint, as last exchanged.
    pub fn peer_working_set_tokens(&self) -> u64 {
        self.live.peer_working_set_tokens.load(Ordering::Relaxed)
    }

    /// Add (`add = true`) or remove one request's prompt chunks from the working set.
    fn update_working_set(&self, chunks: &[u64], tokens_per_chunk: u64, add: bool) {
        let mut set = self
            .live
            .working_set
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for &chunk in chunks {
            if add {
                *set.chunks.entry(chunk).or_insert(0) += 1;
            } else if let Some(count) = set.chunks.get_mut(&chunk) {
                *count -= 1;
                if *count == 0 {
                    set.chunks.remove(&chunk);
                }
            }
        }
        let tokens = (set.chunks.len() as u64).saturating_mul(tokens_per_chunk);
        self.live
            .working_set_tokens
            .store(tokens, Ordering::Relaxed);
    }

    /// Measured prefill throughput in tokens per second, once enough has been observed.
    pub fn prefill_tokens_per_s(&self) -> Option<f64> {
        self.live.throughput.tokens_per_s()
    }

    /// Count a request as in flight until the returned guard drops; `uncached_tokens` of its
    /// `prompt_tokens` count as pending prefill until [`InFlight::prefill_done`].
    pub fn begin(self: &Arc<Self>, prompt_tokens: u64, uncached_tokens: u64) -> InFlight {
        let prefill = uncached_tokens.min(prompt_tokens);
        self.live.in_flight_requests.fetch_add(1, Ordering::Relaxed);
        self.live
            .in_flight_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.live
            .pending_prefill_tokens
            .fetch_add(prefill, Ordering::Relaxed);
        self.live
            .prefilling_requests
            .fetch_add(1, Ordering::Relaxed);
        InFlight {
            endpoint: self.clone(),
            tokens: prompt_tokens,
            prefill,
            prefilling: true,
            held: None,
        }
    }
}

/// Holds one request's share of an endpoint's in-flight counts; released on drop, so a failed
/// or abandoned request can never leak load.
#[derive(Debug)]
pub struct InFlight {
    endpoint: Arc<Endpoint>,
    tokens: u64,
    prefill: u64,
    prefilling: bool,
    /// The prompt's share of the endpoint's working set ([`InFlight::hold_prompt`]).
    held: Option<HeldPrompt>,
}

#[derive(Debug)]
struct HeldPrompt {
    chunks: Vec<u64>,
    tokens_per_chunk: u64,
}

impl InFlight {
    /// The endpoint this request runs on.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// Count the request's prompt in the endpoint's working set until the guard drops: its
    /// `chunks`, chained hashes of `tokens_per_chunk` tokens each (the prefix index's). Without
    /// chunks (a policy that keeps no prefix index) nothing is counted: shared prefixes could
    /// not be told apart. Once per guard; a second call is ignored.
    pub fn hold_prompt(&mut self, chunks: &[u64], tokens_per_chunk: u64) {
        if self.held.is_some() || chunks.is_empty() || tokens_per_chunk == 0 {
            return;
        }
        self.endpoint
            .update_working_set(chunks, tokens_per_chunk, true);
        self.held = Some(HeldPrompt {
            chunks: chunks.to_vec(),
            tokens_per_chunk,
        });
    }

    /// The first token arrived: the request's prefill is no longer pending. Idempotent.
    pub fn prefill_done(&mut self) {
        let prefill = std::mem::take(&mut self.prefill);
        self.endpoint
            .live
            .pending_prefill_tokens
            .fetch_sub(prefill, Ordering::Relaxed);
        if std::mem::take(&mut self.prefilling) {
            self.endpoint
                .live
                .prefilling_requests
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.prefill_done();
        if let Some(held) = self.held.take() {
            self.endpoint
                .update_working_set(&held.chunks, held.tokens_per_chunk, false);
        }
        self.endpoint
            .live
            .in_flight_requests
            .fetch_sub(1, Ordering::Relaxed);
        self.endpoint
            .live
            .in_flight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_turns_decay_with_the_window() {
        let ep = Endpoint::new("p/0", "http://x");
        let (t0, window) = (Instant::now(), Duration::from_secs(60));
        assert_eq!(ep.recent_reserved_turns(t0, window), 0.0);
        ep.note_reserved_turn(t0, window);
        ep.note_reserved_turn(t0, window);
        assert_eq!(ep.recent_reserved_turns(t0, window), 2.0);
        let later = ep.recent_reserved_turns(t0 + window, window);
        assert!((later - 2.0 / std::f64::consts::E).abs() < 1e-9, "{later}");
        // a turn noted with an earlier clock reading counts as of the latest one
        ep.note_reserved_turn(t0 + window, window);
        ep.note_reserved_turn(t0, window);
        let now = ep.recent_reserved_turns(t0 + window, window);
        assert!(
            (now - (2.0 + 2.0 / std::f64::consts::E)).abs() < 1e-9,
            "{now}"
        );
    }

    #[test]
    fn guards_count_and_release() {
        let ep = Arc::new(Endpoint::new("p/0", "http://127.0.0.1:1"));
        let mut a = ep.begin(100, 40);
        let b = ep.begin(50, 50);
        assert_eq!((ep.in_flight_requests(), ep.in_flight_tokens()), (2, 150));
        assert_eq!(ep.pending_prefill_tokens(), 90);
        assert_eq!(ep.prefilling_requests(), 2);
        a.prefill_done();
        a.prefill_done();
        assert_eq!(ep.pending_prefill_tokens(), 50);
        assert_eq!(ep.prefilling_requests(), 1);
        drop(a);
        assert_eq!((ep.in_flight_requests(), ep.in_flight_tokens()), (1, 50));
        assert_eq!(ep.pending_prefill_tokens(), 50);
        drop(b);
        assert_eq!((ep.in_flight_requests(), ep.in_flight_tokens()), (0, 0));
        assert_eq!(ep.pending_prefill_tokens(), 0);
        assert_eq!(ep.prefilling_requests(), 0);
    }

    #[test]
    fn the_working_set_counts_a_shared_prefix_once() {
        let ep = Arc::new(Endpoint::new("p/0", "http://127.0.0.1:1"));
        ep.set_kv_capacity_tokens(1_000);
        // Two prompts sharing their first two 64-token chunks.
        let mut a = ep.begin(192, 192);
        a.hold_prompt(&[1, 2, 3], 64);
        a.hold_prompt(&[9, 9, 9, 9], 64);
        let mut b = ep.begin(256, 128);
        b.hold_prompt(&[1, 2, 4, 5], 64);
        assert_eq!(ep.working_set_tokens(), 5 * 64);
        // Without chunk hashes nothing is counted.
        let mut c = ep.begin(500, 500);
        c.hold_prompt(&[], 64);
        assert_eq!(ep.working_set_tokens(), 5 * 64);
        let mut d = ep.begin(640, 640);
        d.hold_prompt(&[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 64);
        assert_eq!(ep.working_set_tokens(), 15 * 64);
        assert!(ep.kv_working_set_below(0.97));
        assert!(!ep.kv_working_set_below(0.96));
        assert!(ep.kv_working_set_below(0.0), "0 is no limit");
        drop(b);
        assert_eq!(ep.working_set_tokens(), 13 * 64);
        drop((a, c, d));
        assert_eq!(ep.working_set_tokens(), 0);
        // An unknown capacity sets no limit.
        ep.set_kv_capacity_tokens(0);
        let mut e = ep.begin(6_400, 6_400);
        e.hold_prompt(&(100..200).collect::<Vec<u64>>(), 64);
        assert_eq!(ep.working_set_tokens(), 6_400);
        assert!(ep.kv_working_set_below(0.5));
    }

    #[test]
    fn the_working_set_line_counts_the_kv_others_held_at_the_scrape() {
        let ep = Arc::new(Endpoint::new("p/0", "http://127.0.0.1:1"));
        ep.set_kv_capacity_tokens(10_000);
        let mut own = ep.begin(3_200, 3_200);
        own.hold_prompt(&(0..50).collect::<Vec<u64>>(), 64);
        assert_eq!(ep.working_set_tokens(), 3_200);
        let report = |kv_usage, running, gateway_in_flight, peer_in_flight| LoadReport {
            at: Instant::now(),
            waiting: 0.0,
            running,
            kv_usage,
            gateway_in_flight,
            peer_in_flight,
        };
        // The engine runs 4 requests in 6,000 tokens; 1 is this gateway's, 1 a peer's: the
        // other 2 hold about half of it.
        ep.set_load_report(report(Some(0.6), 4.0, 1, 1));
        assert_eq!(ep.load_report().unwrap().others_kv_tokens(10_000), 3_000);
        assert!(ep.kv_working_set_below(0.63));
        assert!(!ep.kv_working_set_below(0.62));
        // The peer's working set as exchanged counts too.
        ep.set_peers(500, 1);
        assert!(!ep.kv_working_set_below(0.67));
        assert!(ep.kv_working_set_below(0.68));
        ep.set_peers(0, 0);
        // Only this gateway's and its peers' requests there: nobody else's KV, however the
        // engine's token count differs from this gateway's estimate.
        ep.set_load_report(report(Some(0.9), 2.0, 1, 1));
        assert_eq!(ep.load_report().unwrap().others_kv_tokens(10_000), 0);
        assert!(ep.kv_working_set_below(0.33));
        // Without a usage figure only the gateways' working sets count.
        ep.set_load_report(report(None, 4.0, 1, 0));
        assert!(ep.kv_working_set_below(0.33));
        assert!(!ep.kv_working_set_below(0.32));
        // Others' KV counts against the line even with nothing of this gateway's in flight.
        drop(own);
        ep.set_load_report(report(Some(0.5), 2.0, 0, 0));
        assert!(!ep.kv_working_set_below(0.5));
        assert!(ep.kv_working_set_below(0.51));
    }

    #[test]
    fn stale_or_full_endpoints_are_saturated() {
        let ep = Endpoint::new("p/0", "http://127.0.0.1:1");
        let now = Instant::now();
        let scraped = Saturation {
            staleness: Some(Duration::from_secs(5)),
            ..Saturation::default()
        };
        // Metrics expected but never scraped: saturated; not expected: not.
        assert!(ep.saturated(&scraped, now));
        assert!(!ep.saturated(&Saturation::default(), now));
        let fresh = |waiting, kv| LoadReport {
            at: now,
            waiting,
            running: 4.0,
            kv_usage: Some(kv),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        };
        ep.set_load_report(fresh(0.0, 0.99));
        assert!(!ep.saturated(&scraped, now), "full KV but nobody waiting");
        ep.set_load_report(fresh(1.0, 0.99));
        assert!(ep.saturated(&scraped, now));
        ep.set_load_report(fresh(32.0, 0.1));
        assert!(ep.saturated(&scraped, now));
        ep.set_load_report(fresh(3.0, 0.5));
        assert!(!ep.saturated(&scraped, now));
        assert!(
            ep.saturated(&scraped, now + Duration::from_secs(6)),
            "stale"
        );
    }

    #[test]
    fn health_and_retirement_gate_availability() {
        let ep = Endpoint::new("p/0", "http://127.0.0.1:1");
        assert!(ep.is_available());
        assert!(ep.set_healthy(false));
        assert!(!ep.set_healthy(false));
        assert!(!ep.is_available());
        assert!(ep.set_healthy(true));
        ep.retire();
        assert!(!ep.is_available());
        assert_eq!(Role::parse("decode").unwrap().name(), "decode");
        assert!(Role::parse("mixed").unwrap_err().contains("unknown role"));
    }

    #[test]
    fn a_lifetime_counter_that_goes_back_is_a_restart() {
        let ep = Endpoint::new("p/0", "http://127.0.0.1:1");
        assert!(!ep.tells_restarts());
        assert!(
            !ep.engine_restarted(500.0),
            "the first reading tells nothing"
        );
        assert!(ep.tells_restarts());
        assert!(!ep.engine_restarted(500.0));
        assert!(!ep.engine_restarted(800.0));
        assert!(ep.engine_restarted(20.0), "started over");
        assert!(!ep.engine_restarted(40.0));
        assert!(!ep.engine_restarted(f64::NAN), "no reading");
        assert!(!ep.engine_restarted(60.0));
        // The counter is gone (a restarted SGLang has none until a request finishes): a
        // restart, once; the next counter is a first reading again.
        assert!(ep.lifetime_counter_vanished());
        assert!(!ep.lifetime_counter_vanished());
        assert!(!ep.engine_restarted(5.0));
        assert!(ep.tells_restarts());
    }
}
