//! Flow control in the gateway: who waits, in which order, when a pool is full.
//!
//! The policy itself (priority bands, weighted fair queuing across teams, turn-first order,
//! shedding, queue TTLs, rate limits) is `agentgate_scheduler::flow`; this module wires it in:
//! one [`FlowController`] per pool (saturation is per pool), a [`CapacitySignal`] over the
//! pool's live endpoints ([`PoolCapacity`]), rate limits kept in the store
//! ([`StoreRateLimiter`]), and the translation of a request into a [`Ticket`] and of a
//! refusal into an OpenAI-shaped error.
//!
//! # Admission
//!
//! `POST /v1/responses` is parsed and prepared first (history loaded, engine request built),
//! so the token estimate exists; then, before an endpoint is picked:
//!
//! 1. **Band.** The `x-agentgate-band` header, else the body's `service_tier` mapped through
//!    `[flow] service_tier`, else the team's default band (for a background response: the
//!    team's lowest band). A team may ask for a lower band than its default, never a higher
//!    one: 403 `band_not_allowed` naming the header or `service_tier` as `param`; an unknown
//!    band is 400 `unknown_band`.
//! 2. **Ticket.** Cost = estimated prompt tokens + `max_output_tokens` (or
//!    `[flow] default_max_output_tokens`); bytes = the request body's size; the session key;
//!    *continuing* when the request carries earlier turns (`previous_response_id`, a
//!    `conversation`, or assistant/tool items in its input).
//! 3. **Admit** ([`FlowController::admit`]): shed, rate limits, queue, wait. The returned
//!    [`Permit`] moves into the turn's task and is released when the engine stream ends (with
//!    the actual token count, for fairness), on every path: an error drops it with the turn.
//!    A client that disconnects while queued drops the admission future, which takes the
//!    request out of the queue.
//!
//! Background responses are admitted inside their run, after a `[background]` slot, so a
//! detached run never holds pool capacity while it waits for its own slot; their rate limits
//! are charged at creation ([`Pending::charge`], after the shed and full-queue checks), so a
//! team over them gets its 429 there, as OpenAI answers it, not a run that fails later. A run
//! shed when it starts (the pool saturated meanwhile) has spent its charge.
//!
//! Refusals ([`rejection_error`]): shed, queue full and rate-limited are 429, a queue timeout
//! 503, each with `Retry-After` and a `code` naming the limit (`overloaded_shed`,
//! `queue_full`, `queue_timeout`, `rate_limit_exceeded_requests`,
//! `rate_limit_exceeded_tokens`, `request_too_large`). Rate-limited answers carry OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers, and so do admitted ones
//! when the team has limits; admitted answers also say the band ([`BAND_HEADER`]) and the
//! queue wait ([`QUEUE_WAIT_HEADER`]). A streamed Codex request gets a refusal with
//! `Retry-After` in its stream instead (`crate::responses`), where Codex retries it.
//!
//! # Capacity
//!
//! [`PoolCapacity`] says how many requests the pool may have in flight now: over the
//! available endpoints that serve requests (role `both` or `decode`; all available ones if
//! none do),
//!
//! ```text
//! capacity = sum over endpoints e of:  max_in_flight_per_endpoint   if e is not saturated
//!                                      in_flight(e)                 if e is saturated
//! can_dispatch = in_flight(controller) < capacity
//! ```
//!
//! A saturated endpoint keeps what it runs and takes nothing more; the others take up to the
//! gateway-side cap. Saturated is `Endpoint::saturated` with the pool's limits: the engine's
//! scraped queue depth at `routing.saturation_queue_depth`, its KV usage at
//! `routing.saturation_kv_usage` with requests waiting, or metrics older than
//! `routing.metrics_staleness_ms`. When *every* endpoint's metrics are stale the engine
//! figures say nothing and the cap alone applies, so a metrics outage slows nothing down.
//! With no available endpoint at all, dispatch is not held: routing answers 503 at once.
//!
//! The cap is what keeps waiting work in the gateway, where bands and fairness apply, instead
//! of in each engine's FIFO queue; the scraped figures catch what the cap cannot see (other
//! gateways' traffic, long contexts filling the KV cache). Its default, 64, is about the batch
//! past which decode throughput stops growing on one accelerator, and near what a replica's KV
//! cache holds of agent-length contexts: set it to the engines' `--max-num-seqs`
//! (`--max-running-requests` for SGLang) or a little under, lower for long contexts.
//!
//! **Reserves.** A band's `reserve` is a share of this capacity that lower bands leave free:
//! a band dispatches only while `in_flight + min(ceil(r * capacity), capacity - 1) <
//! capacity`, `r` the largest reserve of the bands above it (lower bands keep at least one
//! slot). A request of a band with a reserve then asks routing for an
//! endpoint where this gateway has fewer than `max_in_flight_per_endpoint` requests in flight
//! (`PickRequest::free_slot_below`), so it starts in a free batch slot at once instead of
//! waiting in an engine whose batch is full. With `engine_priority` on a pool, requests also
//! carry their band's priority to the engines, whose own queues then order by band.
//!
//! A reserve is held per endpoint, so it covers a band's bursts only where the band's sessions
//! are spread. Under a policy that pins sessions, a new session of a band with a reserve goes
//! to an endpoint with the fewest of such bands' turns routed lately, within one
//! (`PickRequest::spread_window`, decayed over `[flow] turn_window_s`; every such turn routed
//! is counted on its endpoint); prefix and load choose among those. And when the bands below
//! keep few prompts prefilling (`[flow] max_prefilling_per_endpoint`), such a request's prompt
//! shares every engine step with theirs rather than waiting behind them, so its pin is not
//! broken by the wait rule (`PickRequest::prefill_not_queued`), only by an endpoint that is
//! unavailable, saturated or out of free slots.
//!
//! **Turns wait for their endpoint.** A continuing turn whose session is pinned carries the
//! pinned endpoint as its ticket's affinity (read from the store at admission), named by its
//! engine's URL, so a turn queued while discovery renames the engine keeps waiting for it. In
//! a band without a reserve it is dispatched only while that endpoint has room for it,
//! `in_flight(e) + promised + floor(r * max_in_flight_per_endpoint) < max_in_flight_per_endpoint`
//! (`r` the largest reserve above the band, `promised` what the same dispatch round already
//! sent there), or, once it has been passed over for `[flow] pin_wait_s`, to move to an
//! endpoint with room when fair queuing picks its team (within the team, a turn whose endpoint
//! has room goes first, until the held one has waited half its band's queue TTL); meanwhile turns for other endpoints go ahead, but not the team's new
//! sessions that arrived after it (less than the head start before it). A turn dispatched
//! after that wait asks routing for an endpoint below the same line
//! (`PickRequest::free_slot_below`), so its pin breaks as for a saturated endpoint when another
//! has room. An endpoint that is unavailable or unknown always has room (routing re-pins the
//! session), and so does every endpoint when the cap is 0.
//!
//! **Below a reserve.** A band below one with a reserve (share `r` > 0 above it) keeps the
//! line on every endpoint, not only over the pool: its requests are dispatched only while some
//! endpoint is below it (a pinned turn: its own endpoint), and routing places them there
//! (`PickRequest::free_slot_below` = `cap - floor(r * cap)`; rounded down, so an endpoint of
//! one slot still serves lower bands and the pool-wide rule above keeps the reserve). With
//! `[flow] max_prefilling_per_endpoint = P` (0: off) the line also requires fewer than `P` of
//! the endpoint's requests still waiting for their first token (`PickRequest::prefilling_below`):
//! vLLM's scheduler gives the prompts already running their prefill chunks before a newly
//! admitted prompt, so `B / T` long prefills (`--max-num-batched-tokens B`,
//! `--long-prefill-token-threshold T`) leave a higher band's new prompt no room in a step
//! however many slots are free. Each lower-band chunk beside it also lengthens the steps its
//! prompt needs: at `P = 1` a step holds at most one, so they take about twice as long as alone.
//!
//! **KV working set.** With `[flow] max_kv_working_set = w` (default 0.6; 0: off) an
//! endpoint also needs `working_set(e) < w * kv_capacity(e)` to take a request of a band
//! without a reserve of its own; a turn held for its endpoint goes there one per dispatch round
//! until routing has counted it (a band with a reserve is never held for this; nor is any band
//! where the capacity is not known). The next round comes with the next arrival, release or
//! metrics scrape. Requests without a pin go while some endpoint is below the line, without
//! that pacing: pacing them too (every request a round sends counted against the endpoints
//! below the line) gave the same captured reuse on `agentic` (0.980 against 0.979, mean of 20
//! seeds) and left a burst of them waiting for events with slots free (until their TTL with
//! scrapes off). Starting it as
//! soon as routing has counted the request was measured worse on the `agentic` benchmark (seed
//! 1: captured reuse 0.986 against 0.994, TTFT p99 19.8 s against 13.8 s): held turns then go
//! out back to back instead of paced by releases and scrapes. `working_set(e)` is the KV the
//! prompts this gateway has in flight there span together: the distinct chunk hashes of their
//! prompts (chained, so a shared prefix is counted once) times the prefix index's tokens per
//! chunk (`Endpoint::working_set_tokens`), plus the other gateways' working sets as they last
//! published them (`crate::exchange`), plus the KV held there at the last scrape by requests
//! no gateway accounts for: the engine's KV usage times its capacity, times their share of
//! the requests the engine counted (`LoadReport::others_kv_tokens`; clients calling the engine
//! directly, gateways with the exchange off). So gateways in front of the same engines share
//! each one's room, each with the whole `w`: a fixed part each would leave room idle on one
//! gateway while turns wait on another. Policies without a prefix index (`round_robin`,
//! `least_loaded`) cannot tell shared prefixes apart and are not limited. `kv_capacity(e)` is
//! the engine's `vllm:cache_config_info` or `sglang:max_total_num_tokens` (no limit while unknown). The rule applies to the
//! `None` case above too: a request without a pin waits until some endpoint is below the line,
//! and under a policy that pins sessions routing then places it on one below it
//! (`PickRequest::kv_working_set_below`) rather than take the room a held turn waits for
//! elsewhere. Why: an engine admits queued requests while their blocks fit and evicts the
//! least recently used cached blocks to make room. When the contexts of the sessions sent to
//! it exceed its KV (after a replica is lost, say), its queue cycles through them and each
//! admitted prompt evicts the contexts of those queued behind it: nearly every turn is
//! recomputed. Held in the gateway instead, turns go warmest first (next paragraph), so the
//! sessions whose contexts are still cached keep being served from cache while the rest wait.
//! The part of the cache above the line keeps the contexts of sessions between turns.
//!
//! **Warmest first.** Within a team and turn kind, among the requests that may be placed, a
//! turn whose session was active most recently goes first (its context is the likeliest to be
//! in the engine's cache), until a request has waited the band's head start (`aging_s`, or
//! twice the typical wait with `aging_follows_wait`); those go first, in arrival order, so
//! nothing waits much longer than the head start behind arrival order. Requests of sessions
//! this gateway has not seen come after those of known sessions. With `aging_s = 0` the
//! order is arrival order. Several gateways order their queues as one: through the exchange
//! each learns when the others last served a session, and a turn that could take an
//! endpoint's room leaves it for a while to a warmer turn another gateway holds for that
//! endpoint (`crate::exchange`).
//!
//! For probabilistic shedding (`[flow] shed_start`/`shed_full`) the pool's saturation is
//! `(in_flight + queued) / (2 * capacity)`, clamped to 0..=1: 0.5 when the pool is exactly
//! full with nothing waiting, 1 when a whole pool's worth of requests waits.
//!
//! The signal changes without any permit being released when a scrape, a health verdict or
//! an endpoints file changes the pool, so the live-state loops call [`FlowControl::notify`]
//! after each round.
//!
//! # Reconfiguration
//!
//! [`FlowControl::reconfigure`] applies a reloaded configuration (see `crate::reload`): the
//! bands, teams and turn settings to every controller (queued requests stay queued), then the
//! cap and the per-request settings. Turning `enabled` off sends new requests straight to
//! routing; those already queued are dispatched as room frees up or answered at their TTL.
//! A team's `max_concurrent` counts per pool, like everything a controller keeps.
//!
//! # Rate limits
//!
//! [`StoreRateLimiter`] charges `team:{NAME}:rpm` and `team:{NAME}:tpm` (the braces make the
//! team name a Redis Cluster hash tag, so both keys share a slot) through `Store::rate_limit`:
//! one round trip, all-or-nothing, on the server's clock. With Redis every gateway sharing it
//! enforces one budget per team; with the memory store each process has its own. A team's
//! budget covers every pool. When the store fails or takes longer than a second, the limits
//! **fall back to this process**: that request and every check for the next 5 s use buckets
//! kept in the gateway (full when first used), so the store is not waited on again until one
//! request probes it after the 5 s; a warning is logged (at most every 30 s) and
//! `agentgate_flow_rate_limit_store_errors_total` counts each failed call. During an outage each
//! gateway enforces the whole budget on its own (N gateways admit up to N times it), and what
//! was charged in the store before is not known to them. Limits protect budgets and fairness,
//! not correctness; the queue and capacity gate still protect the engines, and an outage of the
//! store should neither become an outage of inference nor add a second to every request.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use axum::http::HeaderMap;
use serde_json::Value;

use agentgate_scheduler::flow::rate_limit::{format_reset, RATE_PERIOD};
use agentgate_scheduler::flow::{
    CapacitySignal, FlowLoad, HeldTurn, Quota, RateCharge, RateCheck, RateCost, RateKind,
    RateLimited, RateLimiter, RateLimits, RateStatus,
};
use agentgate_scheduler::{
    Endpoint, FlowController, LocalRateLimiter, Permit, Rejection, Role, Ticket,
};
use agentgate_sessions::{AnyStore, RateDecision, RateLimit, Store};

pub use agentgate_scheduler::flow::{BandSnapshot, TeamSnapshot, TurnWaits};
pub use agentgate_scheduler::{FlowSnapshot, LoadReport};

use crate::config::Config;
use crate::error::HttpError;
use crate::metrics::Metrics;
use crate::pools::{Pool, Pools};

/// Request header asking for a band (lower than the team's default); on a response, the band
/// the request ran in.
pub const BAND_HEADER: &str = "x-agentgate-band";

/// Response header: how long the request waited in the flow-control queue, in milliseconds.
pub const QUEUE_WAIT_HEADER: &str = "x-agentgate-queue-wait-ms";

/// Longest wait for the store's rate-limit answer before falling back to local limits.
const RATE_LIMIT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long rate limits stay local after the store failed, before one request tries it again.
const STORE_RETRY_EVERY: Duration = Duration::from_secs(5);

/// Least time between two warnings about a failing rate-limit store.
const STORE_WARNING_EVERY: Duration = Duration::from_secs(30);

/// The `[flow]` limits per endpoint, shared by every pool's [`PoolCapacity`] and updated in
/// place on reload.
#[derive(Debug)]
struct EndpointLimits {
    /// `max_in_flight_per_endpoint` (0: none).
    per_endpoint: AtomicU64,
    /// `max_prefilling_per_endpoint` (0: none).
    max_prefilling: AtomicU64,
    /// `max_kv_working_set` as `f64` bits (0.0: none).
    max_kv_working_set: AtomicU64,
    /// Longest a turn leaves room to a warmer one another gateway holds, ms (0: never).
    yield_limit_ms: AtomicU64,
}

impl EndpointLimits {
    fn new(per_endpoint: u64, max_prefilling: u64, max_kv_working_set: f64) -> Self {
        EndpointLimits {
            per_endpoint: AtomicU64::new(per_endpoint),
            max_prefilling: AtomicU64::new(max_prefilling),
            max_kv_working_set: AtomicU64::new(max_kv_working_set.to_bits()),
            yield_limit_ms: AtomicU64::new(0),
        }
    }

    fn per_endpoint(&self) -> u64 {
        self.per_endpoint.load(Ordering::Relaxed)
    }

    fn max_prefilling(&self) -> u64 {
        self.max_prefilling.load(Ordering::Relaxed)
    }

    fn max_kv_working_set(&self) -> f64 {
        f64::from_bits(self.max_kv_working_set.load(Ordering::Relaxed))
    }
}

/// The [`CapacitySignal`] of one pool (formula in the module doc).
pub struct PoolCapacity {
    pool: Arc<Pool>,
    limits: Arc<EndpointLimits>,
    /// Per endpoint, the warmest turn other gateways hold for it, as last exchanged
    /// (`crate::exchange`).
    peers_held: Mutex<HashMap<String, HeldTurn>>,
}

impl PoolCapacity {
    fn new(pool: Arc<Pool>, limits: Arc<EndpointLimits>) -> Self {
        PoolCapacity {
            pool,
            limits,
            peers_held: Mutex::new(HashMap::new()),
        }
    }

    /// Requests the pool may have in flight at `now`; `None` when no endpoint is available
    /// (dispatch is then not held back: routing answers at once).
    pub fn capacity(&self, now: Instant) -> Option<u64> {
        let endpoints = self.pool.endpoints();
        let available = || endpoints.iter().filter(|e| e.is_available());
        let mut serving: Vec<&Arc<Endpoint>> =
            available().filter(|e| e.role != Role::Prefill).collect();
        if serving.is_empty() {
            serving = available().collect();
        }
        if serving.is_empty() {
            return None;
        }
        let limits = &self.pool.saturation;
        let stale = |e: &Endpoint| {
            limits.staleness.is_some_and(|max| {
                e.load_report()
                    .is_none_or(|r| now.saturating_duration_since(r.at) > max)
            })
        };
        let engine_figures_known = !serving.iter().all(|e| stale(e));
        let per = match self.limits.per_endpoint() {
            0 => u64::MAX,
            n => n,
        };
        Some(serving.iter().fold(0u64, |total, e| {
            let saturated = engine_figures_known && e.saturated(limits, now);
            total.saturating_add(if saturated {
                e.in_flight_requests()
            } else {
                per
            })
        }))
    }
}

impl CapacitySignal for PoolCapacity {
    fn can_dispatch(&self, load: &FlowLoad) -> bool {
        self.capacity(Instant::now())
            .is_none_or(|capacity| load.in_flight < capacity)
    }

    fn capacity(&self) -> Option<u64> {
        PoolCapacity::capacity(self, Instant::now())
    }

    fn has_room(
        &self,
        endpoint: Option<&str>,
        held_share: f64,
        promised: u64,
        kv_bound: bool,
    ) -> bool {
        let per = self.limits.per_endpoint();
        let prefilling = match held_share > 0.0 {
            true => self.limits.max_prefilling(),
            false => 0,
        };
        let kv = match kv_bound {
            true => self.limits.max_kv_working_set(),
            false => 0.0,
        };
        if per == 0 && prefilling == 0 && kv <= 0.0 {
            return true;
        }
        let line = band_line(per, held_share);
        // A request promised to an endpoint is not in its working set yet: one at a time
        // where the engine's KV capacity is known (unknown, there is no line to keep).
        let fits = |e: &Endpoint, promised: u64| {
            (per == 0 || e.in_flight_requests() + promised < line)
                && (prefilling == 0 || e.prefilling_requests() + promised < prefilling)
                && (kv <= 0.0
                    || e.kv_capacity_tokens() == 0
                    || (promised == 0 && e.kv_working_set_below(kv)))
        };
        let endpoints = self.pool.endpoints();
        match endpoint {
            Some(url) => match endpoints.iter().find(|e| e.base_url == url) {
                Some(e) if e.is_available() => fits(e, promised),
                _ => true,
            },
            None => {
                let serving = || {
                    endpoints
                        .iter()
                        .filter(|e| e.is_available() && e.role != Role::Prefill)
                };
                let free = serving().filter(|e| fits(e, 0)).count() as u64;
                free > promised || serving().next().is_none()
            }
        }
    }

    fn warmer_elsewhere(&self, endpoint: &str, turn: &HeldTurn) -> bool {
        self.peers_held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(endpoint)
            .is_some_and(|held| held.outranks(turn))
    }

    fn yield_limit(&self) -> Duration {
        Duration::from_millis(self.limits.yield_limit_ms.load(Ordering::Relaxed))
    }

    fn saturation(&self, load: &FlowLoad) -> f64 {
        match self.capacity(Instant::now()) {
            None => 0.0,
            Some(0) => 1.0,
            Some(capacity) => {
                let demand = load.in_flight as f64 + load.queued as f64;
                (demand / (2.0 * capacity as f64)).min(1.0)
            }
        }
    }
}

/// Requests of a band that leaves `held_share` of each endpoint's slots to the bands above it
/// may have in flight on one endpoint under the per-endpoint cap `cap`: `cap - floor(share *
/// cap)`. Rounded down per endpoint, so an endpoint of one slot still serves lower bands; the
/// pool-wide reserve rounds up (module doc).
pub fn band_line(cap: u64, held_share: f64) -> u64 {
    cap.saturating_sub((held_share.clamp(0.0, 1.0) * cap as f64).floor() as u64)
}

/// Team rate limits kept in the store (see the module doc): shared by every gateway on the
/// same Redis, per process with the memory store. Falls back to limits kept in this process
/// while the store fails.
pub struct StoreRateLimiter {
    store: Arc<AnyStore>,
    metrics: Arc<Metrics>,
    warned_at: Mutex<Option<Instant>>,
    /// After the store failed: when it last failed, and until when checks skip it.
    store_down: Mutex<Option<(Instant, Instant)>>,
    /// The buckets used meanwhile.
    local: LocalRateLimiter,
}

impl StoreRateLimiter {
    /// Limits in `store`; failures are counted in `metrics`.
    pub fn new(store: Arc<AnyStore>, metrics: Arc<Metrics>) -> Self {
        StoreRateLimiter {
            store,
            metrics,
            warned_at: Mutex::new(None),
            store_down: Mutex::new(None),
            local: LocalRateLimiter::new(),
        }
    }

    /// The store keys of `team`'s two buckets.
    /// `team`'s limits as the store checks them, `cost` charged to each, with the kind of
    /// each (requests per minute first).
    fn store_limits(
        team: &str,
        limits: RateLimits,
        cost: RateCost,
    ) -> (Vec<RateKind>, Vec<RateLimit>) {
        let (rpm_key, tpm_key) = Self::keys(team);
        [
            (RateKind::Requests, rpm_key, limits.rpm, cost.requests),
            (RateKind::Tokens, tpm_key, limits.tpm, cost.tokens),
        ]
        .into_iter()
        .filter_map(|(kind, key, limit, cost)| {
            let limit = limit?;
            Some((
                kind,
                RateLimit {
                    key,
                    limit,
                    period: RATE_PERIOD,
                    cost,
                },
            ))
        })
        .unzip()
    }

    pub fn keys(team: &str) -> (String, String) {
        (
            format!("team:{{{team}}}:rpm"),
            format!("team:{{{team}}}:tpm"),
        )
    }

    /// Whether to ask the store: not while it is known down, except for one request (this
    /// one) once [`STORE_RETRY_EVERY`] has passed, which pushes the next try further out.
    fn use_store(&self) -> bool {
        let mut down = self
            .store_down
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        match *down {
            Some((_, until)) if now < until => false,
            Some((failed_at, _)) => {
                *down = Some((failed_at, now + STORE_RETRY_EVERY));
                true
            }
            None => true,
        }
    }

    /// The store answered a call made at `asked_at`: it is back, unless it failed since
    /// (a slow answer to a call from before an outage says nothing of now).
    fn store_answered(&self, asked_at: Instant) {
        let mut down = self
            .store_down
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if down.is_some_and(|(failed_at, _)| failed_at <= asked_at) {
            *down = None;
        }
    }

    /// The store failed (`reason`): count it, warn now and then, and keep limits local for
    /// [`STORE_RETRY_EVERY`].
    fn store_failed(&self, team: &str, reason: &str) {
        self.metrics.rate_limit_store_errors.inc([]);
        let now = Instant::now();
        *self
            .store_down
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((now, now + STORE_RETRY_EVERY));
        let mut warned_at = self
            .warned_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if warned_at.is_none_or(|at| now.saturating_duration_since(at) >= STORE_WARNING_EVERY) {
            *warned_at = Some(now);
            tracing::warn!(
                team,
                "rate limits unavailable in the store ({reason}); this gateway keeps them on its own until the store answers"
            );
        }
    }
}

/// The check result from the store's decisions, one per `kinds` entry.
fn rate_result(
    kinds: &[RateKind],
    decisions: &[RateDecision],
    cost: RateCost,
) -> Result<RateStatus, RateLimited> {
    let mut status = RateStatus::default();
    for (kind, d) in kinds.iter().zip(decisions) {
        let quota = Some(Quota {
            limit: d.limit,
            remaining: d.remaining,
            reset: d.reset_after,
        });
        match kind {
            RateKind::Requests => status.requests = quota,
            RateKind::Tokens => status.tokens = quota,
        }
    }
    let refused = kinds
        .iter()
        .zip(decisions)
        .filter(|(_, d)| !d.allowed())
        .max_by_key(|(_, d)| (d.too_large, d.retry_after.unwrap_or_default()));
    match refused {
        None => Ok(status),
        Some((&kind, d)) => Err(RateLimited {
            kind,
            retry_after: d.retry_after.unwrap_or_default(),
            exceeds_limit: d.too_large,
            requested: match kind {
                RateKind::Requests => cost.requests,
                RateKind::Tokens => cost.tokens,
            },
            status,
        }),
    }
}

impl RateLimiter for StoreRateLimiter {
    fn check<'a>(&'a self, team: &'a str, limits: RateLimits, cost: RateCost) -> RateCheck<'a> {
        Box::pin(async move {
            let (kinds, checks) = Self::store_limits(team, limits, cost);
            if checks.is_empty() {
                return Ok(RateStatus::default());
            }
            if !self.use_store() {
                return self.local.check(team, limits, cost).await;
            }
            let asked_at = Instant::now();
            let reason = match tokio::time::timeout(
                RATE_LIMIT_TIMEOUT,
                self.store.rate_limit(&checks),
            )
            .await
            {
                Ok(Ok(decisions)) if decisions.len() == checks.len() => {
                    self.store_answered(asked_at);
                    return rate_result(&kinds, &decisions, cost);
                }
                Ok(Ok(decisions)) => {
                    format!("{} decisions for {} limits", decisions.len(), checks.len())
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {}", format_reset(RATE_LIMIT_TIMEOUT)),
            };
            self.store_failed(team, &reason);
            self.local.check(team, limits, cost).await
        })
    }

    fn charge_tokens<'a>(&'a self, team: &'a str, tpm: u64, tokens: u64) -> RateCharge<'a> {
        Box::pin(async move {
            if !self.use_store() {
                return self.local.charge_tokens(team, tpm, tokens).await;
            }
            let asked_at = Instant::now();
            let charge = [RateLimit {
                key: Self::keys(team).1,
                limit: tpm,
                period: RATE_PERIOD,
                cost: tokens,
            }];
            let reason =
                match tokio::time::timeout(RATE_LIMIT_TIMEOUT, self.store.rate_charge(&charge))
                    .await
                {
                    Ok(Ok(())) => {
                        self.store_answered(asked_at);
                        return;
                    }
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("no answer within {}", format_reset(RATE_LIMIT_TIMEOUT)),
                };
            self.store_failed(team, &reason);
            self.local.charge_tokens(team, tpm, tokens).await
        })
    }

    fn refund<'a>(&'a self, team: &'a str, limits: RateLimits, cost: RateCost) -> RateCharge<'a> {
        Box::pin(async move {
            if !self.use_store() {
                return self.local.refund(team, limits, cost).await;
            }
            let (_, back) = Self::store_limits(team, limits, cost);
            // (A refund the store does not take is lost: the team paid for a refusal, as
            // before refunds. It is not worth failing anything over.)
            match tokio::time::timeout(RATE_LIMIT_TIMEOUT, self.store.rate_refund(&back)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(team = %team, "could not give back a refused request's rate-limit charge: {e}")
                }
                Err(_) => {
                    tracing::warn!(team = %team, "could not give back a refused request's rate-limit charge: no answer within {}", format_reset(RATE_LIMIT_TIMEOUT))
                }
            }
        })
    }
}

/// The `service_tier` a Response reports, as OpenAI reports the processing mode used rather
/// than the one asked for: an OpenAI tier name the request asked for that `tiers` (`[flow]
/// service_tier`) maps to a band, which stands for it (`fast` is served as `priority`, as
/// OpenAI reports it); otherwise `default` (`auto`, a tier name no band stands for, and names
/// only the config knows, which the SDK's type has not).
pub fn served_tier(tiers: &BTreeMap<String, String>, body: &Value) -> Value {
    let asked = body.get("service_tier").and_then(Value::as_str);
    match asked.and_then(|tier| mapped_tier(tiers, tier)) {
        Some((tier, _))
            if OPENAI_SERVICE_TIERS.contains(&tier) && !matches!(tier, "auto" | "default") =>
        {
            Value::from(if tier == "fast" { "priority" } else { tier })
        }
        _ => Value::from("default"),
    }
}

/// The `[flow] service_tier` entry `tier` uses: its own, else for `fast` (OpenAI's other name
/// for `priority`) the `priority` entry.
fn mapped_tier<'a>(
    tiers: &'a BTreeMap<String, String>,
    tier: &'a str,
) -> Option<(&'a str, &'a String)> {
    match tiers.get(tier) {
        Some(band) => Some((tier, band)),
        None if tier == "fast" => tiers.get("priority").map(|band| ("priority", band)),
        None => None,
    }
}

/// The `[flow]` settings read per request (reloadable).
#[derive(Debug, Clone)]
struct Settings {
    enabled: bool,
    service_tier: BTreeMap<String, String>,
    default_max_output_tokens: u64,
    turn_window: Duration,
}

impl Settings {
    fn from_config(config: &Config) -> Self {
        Settings {
            enabled: config.flow.enabled,
            service_tier: config.flow.service_tier.clone(),
            default_max_output_tokens: config.flow.default_max_output_tokens,
            turn_window: Duration::try_from_secs_f64(config.flow.turn_window_s).unwrap_or_default(),
        }
    }
}

struct PoolFlow {
    controller: FlowController,
    capacity: Arc<PoolCapacity>,
}

/// Flow control for every pool: one controller each, sharing the rate limiter and settings.
pub struct FlowControl {
    settings: RwLock<Arc<Settings>>,
    pools: BTreeMap<String, PoolFlow>,
    limits: Arc<EndpointLimits>,
}

/// What admission needs to know about one request.
#[derive(Debug)]
pub struct FlowRequest<'a> {
    /// The team the API key belongs to.
    pub team: &'a str,
    /// The pool serving the model.
    pub pool: &'a str,
    /// Request headers (for [`BAND_HEADER`]).
    pub headers: &'a HeaderMap,
    /// The request body (for `service_tier` and `max_output_tokens`).
    pub body: &'a Value,
    /// Estimated prompt tokens of the engine request.
    pub prompt_tokens: u64,
    /// What the request holds while it waits, for `max_queued_bytes`: its body's size, or
    /// its engine request's when larger.
    pub bytes: u64,
    /// The session key.
    pub session: Option<String>,
    /// Whether the request carries earlier turns.
    pub continuing: bool,
    /// A background response: runs in the team's lowest band unless it asks for one.
    pub background: bool,
}

/// A request ready to be admitted into its pool's queue.
pub struct Pending {
    controller: FlowController,
    ticket: Ticket,
    /// What named the band, for errors about it.
    param: Option<&'static str>,
    /// A background response in its team's lowest band: the band is looked up again at
    /// admission, which may come after a reload changed the team's bands.
    background_default: bool,
    /// Charged to the team's rate limits already ([`Pending::charge`]), with their answer.
    charged: Option<Option<RateStatus>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

impl Pending {
    /// The ticket that will be admitted.
    pub fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// Expect the request to go to `endpoint` (its session's pin): it waits up to
    /// `[flow] pin_wait_s` for a slot there while requests for other endpoints go ahead.
    pub fn with_affinity(mut self, endpoint: Option<String>) -> Self {
        self.ticket.affinity = endpoint;
        self
    }

    /// Judge shedding and a full queue and charge the team's rate limits now, for a request
    /// that waits for its slot later (a background response: refused at creation with 429, as
    /// OpenAI refuses one over its limits, rather than failed once its run starts). Returns
    /// the rate-limit headers to answer with.
    pub async fn charge(&mut self) -> Result<Vec<(&'static str, String)>, HttpError> {
        if self.background_default {
            self.ticket.band = self.controller.background_band(&self.ticket.team);
        }
        let status = self
            .controller
            .charge(&self.ticket)
            .await
            .map_err(|rejection| refused(&self.ticket.team, &rejection, self.param))?;
        let headers = status.as_ref().map(RateStatus::headers).unwrap_or_default();
        self.charged = Some(status);
        Ok(headers)
    }

    /// Give back what [`Pending::charge`] charged, for a request that was not created after
    /// all (the store refused its record).
    pub async fn refund(&mut self) {
        if self.charged.take().is_some() {
            self.controller.refund(&self.ticket).await;
        }
    }

    /// Wait for a slot (see [`FlowController::admit`]); a refusal comes back as the error to
    /// answer with. Dropping the future leaves the queue.
    pub async fn admit(self) -> Result<Permit, HttpError> {
        let Pending {
            controller,
            mut ticket,
            param,
            background_default,
            charged,
        } = self;
        if background_default {
            ticket.band = controller.background_band(&ticket.team);
        }
        let team = ticket.team.clone();
        let admitted = match charged {
            Some(rate) => controller.admit_charged(ticket, rate).await,
            None => controller.admit(ticket).await,
        };
        admitted.map_err(|rejection| refused(&team, &rejection, param))
    }
}

/// The error answering `rejection` of a request of `team`.
fn refused(team: &str, rejection: &Rejection, param: Option<&'static str>) -> HttpError {
    tracing::debug!(team = %team, code = rejection.code(), "not admitted: {rejection}");
    rejection_error(rejection, param)
}

impl FlowControl {
    /// A controller per pool of `pools`, with `config`'s bands, teams and `[flow]`, rate
    /// limits in `limiter`.
    pub fn new(
        config: &Config,
        pools: &Pools,
        limiter: Arc<dyn RateLimiter>,
    ) -> Result<FlowControl, String> {
        let limits = Arc::new(EndpointLimits::new(
            config.flow.max_in_flight_per_endpoint,
            config.flow.max_prefilling_per_endpoint,
            config.flow.max_kv_working_set,
        ));
        let flow_config = config.flow_config();
        let mut by_pool = BTreeMap::new();
        for pool in pools.all() {
            let capacity = Arc::new(PoolCapacity::new(pool.clone(), limits.clone()));
            let controller = FlowController::with_rate_limiter(
                flow_config.clone(),
                capacity.clone(),
                limiter.clone(),
            )
            .map_err(|e| e.to_string())?;
            by_pool.insert(
                pool.name.clone(),
                PoolFlow {
                    controller,
                    capacity,
                },
            );
        }
        Ok(FlowControl {
            settings: RwLock::new(Arc::new(Settings::from_config(config))),
            pools: by_pool,
            limits,
        })
    }

    fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The `service_tier` a Response reports ([`served_tier`] under the current settings):
    /// `default` when flow control is off or the band header chose the band (the tier did not).
    pub fn served_tier(&self, headers: &HeaderMap, body: &Value) -> Value {
        let settings = self.settings();
        if !settings.enabled || headers.contains_key(BAND_HEADER) {
            return Value::from("default");
        }
        served_tier(&settings.service_tier, body)
    }

    /// The gateway-side cap per endpoint (`[flow] max_in_flight_per_endpoint`; 0 = none).
    pub fn max_in_flight_per_endpoint(&self) -> u64 {
        self.limits.per_endpoint()
    }

    /// Most requests of a band below a reserve waiting for a first token per endpoint
    /// (`[flow] max_prefilling_per_endpoint`; 0 = no limit).
    pub fn max_prefilling_per_endpoint(&self) -> u64 {
        self.limits.max_prefilling()
    }

    /// Share of an engine's KV its requests in flight may span (`[flow] max_kv_working_set`;
    /// 0 = no limit).
    pub fn max_kv_working_set(&self) -> f64 {
        self.limits.max_kv_working_set()
    }

    /// How long a session counts as active after a turn (`[flow] turn_window_s`).
    pub fn turn_window(&self) -> Duration {
        self.settings().turn_window
    }

    /// Whether requests are admitted through flow control (`[flow] enabled`).
    pub fn enabled(&self) -> bool {
        self.settings().enabled
    }

    /// Charge one request (no tokens) to `team`'s requests-per-minute limit in `pool`, for a
    /// call that generates nothing (`POST /v1/responses/input_tokens`); the rate-limit headers
    /// to answer with, or the refusal (429 with `Retry-After`).
    pub async fn charge_request(
        &self,
        pool: &str,
        team: &str,
    ) -> Result<Vec<(&'static str, String)>, HttpError> {
        if !self.enabled() {
            return Ok(Vec::new());
        }
        let Some(controller) = self.controller(pool) else {
            return Ok(Vec::new());
        };
        let status = controller
            .charge_request(team)
            .await
            .map_err(|rejection| refused(team, &rejection, None))?;
        Ok(status.as_ref().map(RateStatus::headers).unwrap_or_default())
    }

    /// The controller of `pool`.
    pub fn controller(&self, pool: &str) -> Option<&FlowController> {
        self.pools.get(pool).map(|p| &p.controller)
    }

    /// Record the warmest turns other gateways hold for `pool`'s endpoints, as just exchanged
    /// (`crate::exchange`): a colder turn here leaves such an endpoint's room to them. Returns
    /// whether any were recorded before or now.
    pub fn set_peers_held(&self, pool: &str, held: HashMap<String, HeldTurn>) -> bool {
        let Some(p) = self.pools.get(pool) else {
            return false;
        };
        let mut peers = p
            .capacity
            .peers_held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let any = !peers.is_empty() || !held.is_empty();
        *peers = held;
        any
    }

    /// Longest a turn leaves room to a warmer one another gateway holds.
    pub fn set_yield_limit(&self, limit: Duration) {
        self.limits.yield_limit_ms.store(
            u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Requests `pool` may have in flight now (`None`: no endpoint is available).
    pub fn capacity(&self, pool: &str) -> Option<u64> {
        self.pools
            .get(pool)
            .and_then(|p| p.capacity.capacity(Instant::now()))
    }

    /// Every pool's name and snapshot.
    pub fn snapshots(&self) -> Vec<(String, FlowSnapshot)> {
        self.pools
            .iter()
            .map(|(name, p)| (name.clone(), p.controller.snapshot()))
            .collect()
    }

    /// Dispatch whatever capacity allows now, in every pool: call after anything that may
    /// have changed the pools' capacity without a permit being released.
    pub fn notify(&self) {
        for pool in self.pools.values() {
            pool.controller.notify();
        }
    }

    /// Change the gateway-side cap (`[flow] max_in_flight_per_endpoint`) and dispatch what it
    /// allows.
    pub fn set_max_in_flight_per_endpoint(&self, limit: u64) {
        self.limits.per_endpoint.store(limit, Ordering::Relaxed);
        self.notify();
    }

    /// Apply a reloaded configuration's `[[bands]]`, `[[teams]]` and `[flow]`, keeping every
    /// queued request (see `FlowController::reconfigure`). On error nothing changes.
    pub fn reconfigure(&self, config: &Config) -> Result<(), String> {
        let flow_config = config.flow_config();
        flow_config.validate().map_err(|e| e.to_string())?;
        // The per-endpoint limits first: each controller dispatches what its new config lets
        // go at once, against the new limits.
        *self
            .settings
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(Settings::from_config(config));
        self.limits
            .max_prefilling
            .store(config.flow.max_prefilling_per_endpoint, Ordering::Relaxed);
        self.limits
            .max_kv_working_set
            .store(config.flow.max_kv_working_set.to_bits(), Ordering::Relaxed);
        self.limits
            .per_endpoint
            .store(config.flow.max_in_flight_per_endpoint, Ordering::Relaxed);
        for (name, pool) in &self.pools {
            pool.controller
                .reconfigure(flow_config.clone())
                .map_err(|e| format!("pool `{name}`: {e}"))?;
        }
        Ok(())
    }

    /// The ticket for `request` with its band checked, or `None` when flow control is off.
    /// A band the team may not use is refused here, before any work.
    pub fn pending(&self, request: FlowRequest<'_>) -> Result<Option<Pending>, HttpError> {
        let settings = self.settings();
        check_service_tier(&settings, request.body)?;
        if !settings.enabled {
            return Ok(None);
        }
        let Some(pool) = self.pools.get(request.pool) else {
            return Ok(None);
        };
        let controller = &pool.controller;
        let asked = requested_band(&settings, request.headers, request.body)?;
        let (band, param) = match asked {
            Some((band, param)) => {
                let band = controller
                    .band_for(request.team, Some(&band))
                    .map_err(|r| rejection_error(&r, Some(param)))?;
                (Some(band), Some(param))
            }
            None if request.background => (controller.background_band(request.team), None),
            None => (None, None),
        };
        let max_output = request
            .body
            .get("max_output_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(settings.default_max_output_tokens);
        let ticket = Ticket {
            team: request.team.to_string(),
            band,
            cost_tokens: request.prompt_tokens.saturating_add(max_output),
            bytes: request.bytes,
            session: request.session,
            continuing: request.continuing,
            affinity: None,
            band_checked: true,
        };
        Ok(Some(Pending {
            controller: controller.clone(),
            background_default: request.background && param.is_none(),
            ticket,
            param,
            charged: None,
        }))
    }
}

/// OpenAI's `service_tier` values; `[flow] service_tier` may map these and others to bands.
const OPENAI_SERVICE_TIERS: [&str; 7] = [
    "auto",
    "default",
    "flex",
    "scale",
    "priority",
    "fast",
    "ultrafast",
];

/// `service_tier`, when given, is one of OpenAI's values or a key of `[flow] service_tier`.
fn check_service_tier(settings: &Settings, body: &Value) -> Result<(), HttpError> {
    match body.get("service_tier") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(tier))
            if OPENAI_SERVICE_TIERS.contains(&tier.as_str())
                || settings.service_tier.contains_key(tier) =>
        {
            Ok(())
        }
        Some(Value::String(tier)) => {
            let mut known: Vec<&str> = OPENAI_SERVICE_TIERS.to_vec();
            known.extend(settings.service_tier.keys().map(String::as_str));
            known.sort_unstable();
            known.dedup();
            Err(HttpError::invalid(
                format!(
                    "Invalid 'service_tier': {tier:?}. Supported values are: {}.",
                    known.join(", ")
                ),
                Some("service_tier"),
                Some("invalid_value"),
            ))
        }
        Some(_) => Err(HttpError::invalid(
            "Invalid type for 'service_tier': expected a string.",
            Some("service_tier"),
            Some("invalid_type"),
        )),
    }
}

/// The band a request asks for and what named it: the [`BAND_HEADER`], else a mapped
/// `service_tier`. A header that is not text is a 400.
fn requested_band(
    settings: &Settings,
    headers: &HeaderMap,
    body: &Value,
) -> Result<Option<(String, &'static str)>, HttpError> {
    if let Some(value) = headers.get(BAND_HEADER) {
        let band = value.to_str().map(str::trim).unwrap_or("");
        if band.is_empty() {
            return Err(HttpError::invalid(
                format!("The '{BAND_HEADER}' header must name a band."),
                Some(BAND_HEADER),
                Some("unknown_band"),
            ));
        }
        return Ok(Some((band.to_string(), BAND_HEADER)));
    }
    let tier = body.get("service_tier").and_then(Value::as_str);
    Ok(tier
        .and_then(|t| mapped_tier(&settings.service_tier, t))
        .map(|(_, band)| (band.clone(), "service_tier")))
}

/// Whether a request's input carries earlier turns: assistant messages or tool calls, outputs
/// and reasoning (clients that resend the whole history, such as Codex with `store: false`).
pub fn input_continues(items: &[Value]) -> bool {
    items
        .iter()
        .any(|item| match item.get("type").and_then(Value::as_str) {
            None | Some("message") => item.get("role").and_then(Value::as_str) == Some("assistant"),
            Some(_) => true,
        })
}

/// Headers for an admitted response: the band, the queue wait and the team's rate limits.
pub fn response_headers(permit: &Permit) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        (BAND_HEADER, permit.band().to_string()),
        (
            QUEUE_WAIT_HEADER,
            permit
                .waited()
                .as_millis()
                .min(u128::from(u64::MAX))
                .to_string(),
        ),
    ];
    if let Some(status) = permit.rate_status() {
        headers.extend(status.headers());
    }
    headers
}

/// Release `permit` with the tokens the response used (input + output), when it reports them.
pub fn finish(permit: Permit, response: &Value) {
    let usage = |key: &str| {
        response
            .get("usage")
            .and_then(|u| u.get(key))
            .and_then(Value::as_u64)
    };
    match (usage("input_tokens"), usage("output_tokens")) {
        (Some(input), Some(output)) => permit.finish(input.saturating_add(output)),
        _ => drop(permit),
    }
}

/// The OpenAI-shaped error for a refusal; `param` names what asked for the band.
pub fn rejection_error(rejection: &Rejection, param: Option<&str>) -> HttpError {
    let status = rejection.http_status();
    let kind = match rejection {
        Rejection::RateLimited(limited) => match limited.kind {
            RateKind::Requests => "requests",
            RateKind::Tokens => "tokens",
        },
        _ if status == 429 => "rate_limit_error",
        _ if status >= 500 => "server_error",
        _ => "invalid_request_error",
    };
    let param = match rejection {
        Rejection::UnknownBand { .. } | Rejection::BandNotAllowed { .. } => param,
        _ => None,
    };
    let mut message = rejection.to_string();
    if let Some(first) = message.get(..1) {
        let upper = first.to_uppercase();
        message.replace_range(..1, &upper);
    }
    if !message.ends_with('.') {
        message.push('.');
    }
    let mut error = HttpError::new(status, kind, message, param, Some(rejection.code()));
    if let Some(secs) = rejection.retry_after_secs() {
        error = error.with_retry_after(secs);
    }
    if let Rejection::RateLimited(limited) = rejection {
        error = error.with_headers(limited.status.headers());
    }
    error
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentgate_scheduler::flow::{QueueLimit, Quota};
    use serde_json::json;

    fn config(extra: &str) -> Config {
        Config::parse(&format!(
            "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
             [[pools]]\nname = \"p\"\nmodel = \"m\"\n\
             endpoints = [\"http://127.0.0.1:9\", \"http://127.0.0.1:10\"]\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn the_tier_served_is_reported() {
        let tiers = BTreeMap::from([("flex".to_string(), "batch".to_string())]);
        let tier = |asked: Value| served_tier(&tiers, &json!({"service_tier": asked}));
        assert_eq!(tier(json!("flex")), "flex", "its band stands for it");
        assert_eq!(tier(json!("priority")), "default", "no band stands for it");
        assert_eq!(tier(json!("auto")), "default");
        assert_eq!(
            tier(json!("batch")),
            "default",
            "a name only the config knows"
        );
        assert_eq!(tier(Value::Null), "default");
        // `fast` is OpenAI's other name for `priority`, and is reported as `priority`.
        let tiers = BTreeMap::from([
            ("priority".to_string(), "interactive".to_string()),
            ("ultrafast".to_string(), "interactive".to_string()),
        ]);
        let tier = |asked: &str| served_tier(&tiers, &json!({"service_tier": asked}));
        assert_eq!(tier("fast"), "priority");
        assert_eq!(tier("priority"), "priority");
        assert_eq!(tier("ultrafast"), "ultrafast");
        // `auto` is a request, not a mode served, even when a band stands for it.
        let auto = BTreeMap::from([("auto".to_string(), "batch".to_string())]);
        assert_eq!(
            served_tier(&auto, &json!({"service_tier": "auto"})),
            "default"
        );
        let fast = BTreeMap::from([("fast".to_string(), "interactive".to_string())]);
        assert_eq!(
            served_tier(&fast, &json!({"service_tier": "fast"})),
            "priority"
        );
    }

    async fn pools(config: &Config) -> Pools {
        let engines = agentgate_adapters::EngineClient::new(Default::default());
        Pools::start(config, &engines).await.unwrap()
    }

    /// `config`'s pools, its pool `m`, and a capacity signal over that pool with `limits`:
    /// per-endpoint cap, prompts prefilling per endpoint, KV working-set line.
    async fn capacity(
        config: &Config,
        limits: (u64, u64, f64),
    ) -> (Pools, Arc<Pool>, PoolCapacity) {
        let pools = pools(config).await;
        let pool = pools.for_model("m").unwrap();
        let (per, prefilling, kv) = limits;
        let limits = Arc::new(EndpointLimits::new(per, prefilling, kv));
        (pools, pool.clone(), PoolCapacity::new(pool, limits))
    }

    #[tokio::test]
    async fn a_full_kv_working_set_leaves_no_room_for_queued_work() {
        let config = config("[flow]\nmax_kv_working_set = 0.5\n");
        let (pools, pool, cap) = capacity(&config, (0, 0, config.flow.max_kv_working_set)).await;
        let eps = pool.endpoints();
        let (a, b) = (eps[0].base_url.as_str(), eps[1].base_url.as_str());
        let chunks = |first: u64, n: u64| (first..first + n).collect::<Vec<u64>>();
        let mut big = eps[0].begin(900, 900);
        big.hold_prompt(&chunks(0, 9), 100);
        assert!(
            cap.has_room(Some(a), 0.0, 0, true),
            "no limit while the capacity is unknown"
        );
        assert!(
            cap.has_room(Some(a), 0.0, 3, true),
            "nor one request at a time"
        );
        eps[0].set_kv_capacity_tokens(1_000);
        eps[1].set_kv_capacity_tokens(1_000);
        assert!(!cap.has_room(Some(a), 0.0, 0, true));
        assert!(cap.has_room(Some(b), 0.0, 0, true));
        assert!(
            !cap.has_room(Some(b), 0.0, 1, true),
            "one request at a time until routed"
        );
        assert!(cap.has_room(None, 0.0, 0, true));
        let mut other = eps[1].begin(600, 600);
        other.hold_prompt(&chunks(100, 6), 100);
        assert!(!cap.has_room(None, 0.0, 0, true));
        drop(big);
        assert!(cap.has_room(Some(a), 0.0, 0, true));
        assert!(cap.has_room(None, 0.0, 0, true));
        assert!(
            cap.has_room(Some(b), 0.5, 0, false),
            "a band with a reserve is not held"
        );
        cap.limits.max_kv_working_set.store(0, Ordering::Relaxed);
        assert!(cap.has_room(Some(b), 0.0, 0, true), "0 sets no limit");
        pools.shutdown().await;
    }

    #[tokio::test]
    async fn capacity_counts_the_cap_per_unsaturated_endpoint() {
        let config = config("[flow]\nmax_in_flight_per_endpoint = 3\n");
        let (pools, pool, cap) = capacity(&config, (3, 0, 0.0)).await;
        let now = Instant::now();
        assert_eq!(cap.capacity(now), Some(6));
        let eps = pool.endpoints();
        // A saturated endpoint keeps what it runs and takes nothing more.
        let _a = eps[0].begin(10, 10);
        let _b = eps[0].begin(10, 10);
        eps[0].set_load_report(LoadReport {
            at: now,
            waiting: 1000.0,
            running: 2.0,
            kv_usage: None,
            gateway_in_flight: 0,
            peer_in_flight: 0,
        });
        assert_eq!(cap.capacity(now), Some(3 + 2));
        let load = |in_flight, queued| FlowLoad {
            in_flight,
            in_flight_tokens: 0,
            queued,
        };
        assert!(cap.can_dispatch(&load(4, 0)));
        assert!(!cap.can_dispatch(&load(5, 0)));
        assert_eq!(cap.saturation(&load(5, 0)), 0.5);
        assert_eq!(cap.saturation(&load(5, 5)), 1.0);
        // No cap: only the engines' figures hold dispatch back.
        cap.limits.per_endpoint.store(0, Ordering::Relaxed);
        assert_eq!(cap.capacity(now), Some(u64::MAX));
        // Unavailable endpoints count for nothing; none available holds nothing back.
        eps[1].set_healthy(false);
        assert_eq!(cap.capacity(now), Some(2));
        eps[0].set_healthy(false);
        assert_eq!(cap.capacity(now), None);
        assert!(cap.can_dispatch(&load(100, 0)));
        pools.shutdown().await;
    }

    #[tokio::test]
    async fn stale_metrics_saturate_unless_every_endpoint_is_stale() {
        let mut config = config("[flow]\nmax_in_flight_per_endpoint = 4\n");
        config.routing.scrape_interval_ms = 100;
        config.routing.metrics_staleness_ms = Some(500);
        let (pools, pool, cap) = capacity(&config, (4, 0, 0.0)).await;
        let now = Instant::now();
        // Nothing scraped at all: the engines' figures are unknown, the cap applies.
        assert_eq!(cap.capacity(now), Some(8));
        let eps = pool.endpoints();
        eps[0].set_load_report(LoadReport {
            at: now,
            waiting: 0.0,
            running: 0.0,
            kv_usage: Some(0.1),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        });
        // One fresh, one never scraped: the stale one takes nothing more.
        assert_eq!(cap.capacity(now), Some(4));
        // Both stale again later: the cap alone.
        assert_eq!(cap.capacity(now + Duration::from_secs(1)), Some(8));
        pools.shutdown().await;
    }

    fn decision(limit: u64, remaining: u64, retry: Option<u64>, too_large: bool) -> RateDecision {
        RateDecision {
            limit,
            remaining,
            reset_after: Duration::from_secs(6),
            retry_after: retry.map(Duration::from_millis),
            too_large,
        }
    }

    #[test]
    fn store_decisions_become_rate_results() {
        let kinds = [RateKind::Requests, RateKind::Tokens];
        let cost = RateCost {
            requests: 1,
            tokens: 300,
        };
        let ok = rate_result(
            &kinds,
            &[
                decision(3, 2, None, false),
                decision(1000, 700, None, false),
            ],
            cost,
        )
        .unwrap();
        assert_eq!(
            ok.tokens,
            Some(Quota {
                limit: 1000,
                remaining: 700,
                reset: Duration::from_secs(6)
            })
        );
        let refused = rate_result(
            &kinds,
            &[
                decision(3, 0, Some(20_000), false),
                decision(1000, 100, Some(12_000), false),
            ],
            cost,
        )
        .unwrap_err();
        assert_eq!(refused.kind, RateKind::Requests, "the later to clear wins");
        assert_eq!(refused.retry_after, Duration::from_secs(20));
        assert_eq!(refused.requested, 1);
        let too_large = rate_result(
            &kinds,
            &[
                decision(3, 0, Some(20_000), false),
                decision(100, 100, None, true),
            ],
            cost,
        )
        .unwrap_err();
        assert!(too_large.exceeds_limit);
        assert_eq!(
            (too_large.kind, too_large.requested),
            (RateKind::Tokens, 300)
        );
    }

    #[test]
    fn refusals_become_openai_errors() {
        let shed = rejection_error(
            &Rejection::Shed {
                band: "batch".into(),
                retry_after: Duration::from_millis(1500),
            },
            Some(BAND_HEADER),
        );
        assert_eq!(shed.error.status, 429);
        assert_eq!(shed.error.code.as_deref(), Some("overloaded_shed"));
        assert_eq!(shed.error.param, None);
        assert_eq!(shed.retry_after, Some(2));
        let not_allowed = rejection_error(
            &Rejection::BandNotAllowed {
                team: "t".into(),
                band: "gold".into(),
                default_band: "batch".into(),
                allowed: vec!["batch".into()],
            },
            Some("service_tier"),
        );
        assert_eq!(not_allowed.error.status, 403);
        assert_eq!(not_allowed.error.param.as_deref(), Some("service_tier"));
        assert!(not_allowed
            .error
            .message
            .starts_with("Team `t` may not use band `gold`"));
        let full = rejection_error(
            &Rejection::QueueFull {
                band: "b".into(),
                limit: QueueLimit::Bytes,
                retry_after: Duration::from_secs(1),
            },
            None,
        );
        assert_eq!(
            (full.error.status, full.error.code.as_deref()),
            (429, Some("queue_full"))
        );
        let limited = RateLimited {
            kind: RateKind::Tokens,
            retry_after: Duration::from_millis(2500),
            exceeds_limit: false,
            requested: 50,
            status: RateStatus {
                requests: None,
                tokens: Some(Quota {
                    limit: 100,
                    remaining: 10,
                    reset: Duration::from_secs(54),
                }),
            },
        };
        let e = rejection_error(&Rejection::RateLimited(limited), None);
        assert_eq!(e.error.r#type, "tokens");
        assert_eq!(e.error.code.as_deref(), Some("rate_limit_exceeded_tokens"));
        assert_eq!(e.retry_after, Some(3));
        let headers = e.headers.as_deref().cloned().unwrap_or_default();
        assert!(headers.contains(&("x-ratelimit-remaining-tokens", "10".to_string())));
        assert!(headers.contains(&("x-ratelimit-reset-tokens", "54s".to_string())));
    }

    #[test]
    fn continuing_input_is_recognised() {
        assert!(!input_continues(&[
            json!({"type": "message", "role": "user", "content": "hi"})
        ]));
        assert!(!input_continues(&[
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": "hi"})
        ]));
        assert!(input_continues(&[
            json!({"role": "user", "content": "hi"}),
            json!({"type": "message", "role": "assistant", "content": "hello"}),
        ]));
        assert!(input_continues(&[
            json!({"type": "function_call_output", "call_id": "c", "output": "42"})
        ]));
    }

    #[tokio::test]
    async fn band_requests_by_header_and_service_tier() {
        let config = config(
            "[[bands]]\nname = \"interactive\"\npriority = 10\n\
             [[bands]]\nname = \"batch\"\npriority = 0\n\
             [flow]\nservice_tier = { flex = \"batch\", priority = \"interactive\" }\n\
             [[teams]]\nname = \"agents\"\ndefault_band = \"batch\"\n",
        );
        let pools = pools(&config).await;
        let limiter = Arc::new(agentgate_scheduler::LocalRateLimiter::new());
        let flow = FlowControl::new(&config, &pools, limiter).unwrap();
        let headers = HeaderMap::new();
        let request = |headers, body| FlowRequest {
            team: "agents",
            pool: "p",
            headers,
            body,
            prompt_tokens: 10,
            bytes: 5,
            session: None,
            continuing: false,
            background: false,
        };
        let flex = json!({"service_tier": "flex", "max_output_tokens": 7});
        let pending = flow.pending(request(&headers, &flex)).unwrap().unwrap();
        assert_eq!(pending.ticket().band.as_deref(), Some("batch"));
        assert_eq!(pending.ticket().cost_tokens, 17);
        let auto = json!({"service_tier": "auto"});
        let pending = flow.pending(request(&headers, &auto)).unwrap().unwrap();
        assert_eq!(
            pending.ticket().band,
            None,
            "unmapped tiers use the default"
        );
        assert_eq!(pending.ticket().cost_tokens, 10 + 1024);
        let unknown = json!({"service_tier": "fastest"});
        let e = flow.pending(request(&headers, &unknown)).unwrap_err();
        assert_eq!(
            (e.error.param.as_deref(), e.error.code.as_deref()),
            (Some("service_tier"), Some("invalid_value"))
        );
        let number = json!({"service_tier": 1});
        let e = flow.pending(request(&headers, &number)).unwrap_err();
        assert_eq!(e.error.code.as_deref(), Some("invalid_type"));
        let priority = json!({"service_tier": "priority"});
        let e = flow.pending(request(&headers, &priority)).unwrap_err();
        assert_eq!(e.error.status, 403);
        assert_eq!(e.error.param.as_deref(), Some("service_tier"));
        let mut upgrade = HeaderMap::new();
        upgrade.insert(BAND_HEADER, "interactive".parse().unwrap());
        let e = flow.pending(request(&upgrade, &flex)).unwrap_err();
        assert_eq!(
            (e.error.status, e.error.param.as_deref()),
            (403, Some(BAND_HEADER)),
            "the header wins over service_tier"
        );
        let mut unknown = HeaderMap::new();
        unknown.insert(BAND_HEADER, "gold".parse().unwrap());
        let e = flow.pending(request(&unknown, &auto)).unwrap_err();
        assert_eq!(
            (e.error.status, e.error.code.as_deref()),
            (400, Some("unknown_band"))
        );
        pools.shutdown().await;
    }
}
