//! The [`FlowController`]: admission, queueing, dispatch, permits and reconfiguration.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::capacity::{CapacitySignal, FlowLoad};
use super::config::{BandSpec, ConfigError, FlowConfig, TeamSpec};
use super::metrics::{BandSnapshot, FlowSnapshot, TeamSnapshot, TurnWaits, WaitHistogram};
use super::queue::{
    BandCounters, BandQueue, Entry, HeldTurn, Pick, Placeable, Reply, TurnKind, Warmth,
};
use super::rate_limit::{LocalRateLimiter, RateCost, RateLimiter, RateLimits, RateStatus};
use super::rejection::{QueueLimit, Rejection};

/// A deadline for a TTL too long to represent: effectively never.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Most tokens one request counts for in fair queuing and in-flight counts, as its estimate
/// ([`Ticket::cost_tokens`]) or its usage ([`Permit::finish`], also what is charged to its
/// team's budget beyond the estimate): far above any model's context, so only a nonsensical
/// figure (a `max_output_tokens` of 10^18, an engine reporting broken usage) is cut to it, and
/// one request cannot throw a band's fair-queuing clock or a team's token budget out of range.
/// Rate limits judge the estimate uncut: one over the whole budget is `request_too_large`.
pub const MAX_REQUEST_TOKENS: u64 = 1 << 24;

/// A request asking to be admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The team the request's API key belongs to.
    pub team: String,
    /// The band the client asked for; `None` is the team's default band. Checked as in
    /// [`FlowConfig::band_for`].
    pub band: Option<String>,
    /// Estimated input tokens + max output tokens: the cost for fairness and the tokens limit.
    pub cost_tokens: u64,
    /// The request's size while it waits, for `max_queued_bytes`.
    pub bytes: u64,
    /// The agent session this request belongs to, if known.
    pub session: Option<String>,
    /// Whether the request continues an earlier turn (it has a `previous_response_id`, a
    /// conversation, or prior turns in its input).
    pub continuing: bool,
    /// The endpoint the request is expected to go to (its session's pin), if known, in
    /// whatever names the [`CapacitySignal`] understands (the gateway uses the engine's URL):
    /// it waits up to [`FlowConfig::pin_wait`] for a slot there while requests for other
    /// endpoints go ahead (see [`CapacitySignal::has_room`]).
    pub affinity: Option<String>,
    /// `band` was checked against the configuration when the request was accepted: if a
    /// reconfiguration has since removed it or taken it from the team, the request runs in its
    /// team's default band (as a queued request is moved) instead of being refused.
    pub band_checked: bool,
}

impl Ticket {
    /// What admitting it charges to its team's rate limits: one request and its estimate.
    fn rate_cost(&self) -> RateCost {
        RateCost {
            requests: 1,
            tokens: self.cost_tokens,
        }
    }

    /// A new-session request of `team` in its default band.
    pub fn new(team: impl Into<String>, cost_tokens: u64) -> Self {
        Ticket {
            team: team.into(),
            band: None,
            cost_tokens,
            bytes: 0,
            session: None,
            continuing: false,
            affinity: None,
            band_checked: false,
        }
    }

    /// Ask for `band`.
    pub fn band(mut self, band: impl Into<String>) -> Self {
        self.band = Some(band.into());
        self
    }

    /// Set the body size.
    pub fn bytes(mut self, bytes: u64) -> Self {
        self.bytes = bytes;
        self
    }

    /// Set the session.
    pub fn session(mut self, session: impl Into<String>) -> Self {
        self.session = Some(session.into());
        self
    }

    /// Mark as continuing (or not).
    pub fn continuing(mut self, continuing: bool) -> Self {
        self.continuing = continuing;
        self
    }

    /// Expect the request to go to `endpoint`.
    pub fn affinity(mut self, endpoint: impl Into<String>) -> Self {
        self.affinity = Some(endpoint.into());
        self
    }
}

/// A dispatched request's slot. Dropping it frees the slot and dispatches the next request.
pub struct Permit {
    inner: Arc<Inner>,
    released: bool,
    team: String,
    band: String,
    band_priority: i32,
    band_reserves: bool,
    held_share: f64,
    cost: u64,
    session: Option<String>,
    waited: Duration,
    kind: TurnKind,
    promoted: bool,
    rate: Option<RateStatus>,
    actual_tokens: Option<u64>,
    outwaited_pin: Option<f64>,
}

impl Permit {
    /// The team.
    pub fn team(&self) -> &str {
        &self.team
    }

    /// The band it was dispatched from.
    pub fn band(&self) -> &str {
        &self.band
    }

    /// The priority of the band it was dispatched from.
    pub fn band_priority(&self) -> i32 {
        self.band_priority
    }

    /// Whether its band holds a reserve ([`BandSpec::reserve`](super::BandSpec::reserve) > 0): the request should be
    /// placed where it can start at once.
    pub fn band_reserves(&self) -> bool {
        self.band_reserves
    }

    /// The share of each endpoint's slots its band leaves to the bands above it (the largest
    /// reserve above it; 0 for a band with none above): routing places it on an endpoint below
    /// that line (see [`CapacitySignal::has_room`]).
    pub fn held_share(&self) -> f64 {
        self.held_share
    }

    /// `Some(share)` when the request waited [`FlowConfig::pin_wait`] for its endpoint
    /// ([`Ticket::affinity`]) and went without room there: routing should place it on an
    /// endpoint that can take it, with `share` of each endpoint's slots left to the bands
    /// above (see [`CapacitySignal::has_room`]); its pin breaks as if its endpoint were
    /// saturated. `None` for every other request.
    pub fn outwaited_pin(&self) -> Option<f64> {
        self.outwaited_pin
    }

    /// How long it waited in the queue (exactly zero when it was dispatched on arrival).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Whether it was queued as a continuing turn or a new session.
    pub fn turn_kind(&self) -> TurnKind {
        self.kind
    }

    /// Whether it was a new session sent ahead of a waiting continuing turn because it aged.
    pub fn promoted(&self) -> bool {
        self.promoted
    }

    /// The estimated tokens it was charged.
    pub fn cost_tokens(&self) -> u64 {
        self.cost
    }

    /// The team's rate-limit buckets after this request was charged (`None` when the team has
    /// no limits), for the `x-ratelimit-*` response headers.
    pub fn rate_status(&self) -> Option<&RateStatus> {
        self.rate.as_ref()
    }

    /// Release the slot, recording the tokens the request actually used (input + output), so
    /// fairness and the dispatched-tokens counters reflect real usage instead of the estimate.
    pub fn finish(mut self, actual_tokens: u64) {
        self.actual_tokens = Some(actual_tokens.min(MAX_REQUEST_TOKENS));
    }

    /// Undo this permit's accounting. Marks it released so `Drop` does nothing more.
    fn release_locked(&mut self, state: &mut State, now: Instant) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        state.in_flight = state.in_flight.saturating_sub(1);
        state.in_flight_tokens = state.in_flight_tokens.saturating_sub(self.cost);
        if let Some(team) = state.teams.get_mut(&self.team) {
            team.in_flight = team.in_flight.saturating_sub(1);
            team.finished_tokens = team
                .finished_tokens
                .saturating_add(self.actual_tokens.unwrap_or(self.cost));
            if let Some(actual) = self.actual_tokens {
                team.dispatched_tokens = team
                    .dispatched_tokens
                    .saturating_sub(self.cost)
                    .saturating_add(actual);
            }
        }
        if let Some(actual) = self.actual_tokens {
            let weight = state.team_spec(&self.team).map(|t| t.weight);
            let band = state.band_index.get(&self.band).copied();
            if let (Some(weight), Some(band)) = (weight, band) {
                let delta = actual as f64 - self.cost as f64;
                state.bands[band].recharge(&self.team, delta, weight);
            }
        }
        if let Some(session) = &self.session {
            state.sessions.released(session, now);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let mut out = VecDeque::new();
        let tpm = {
            let mut state = inner.lock();
            self.release_locked(&mut state, Instant::now());
            state.pump(&inner, &mut out);
            state.team_spec(&self.team).and_then(|t| t.tpm)
        };
        deliver(&inner, out);
        // Used more tokens than it was admitted with: the rest goes to the team's budget.
        let excess = self.actual_tokens.unwrap_or(0).saturating_sub(self.cost);
        if let (Some(tpm), true, true) = (tpm, excess > 0, self.rate.is_some()) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let team = std::mem::take(&mut self.team);
                runtime.spawn(async move {
                    inner.limiter.charge_tokens(&team, tpm, excess).await;
                });
            }
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("team", &self.team)
            .field("band", &self.band)
            .field("cost", &self.cost)
            .field("waited", &self.waited)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// Multi-team flow control: admits requests into priority bands and dispatches them as
/// capacity allows (see the [module doc](super) for the policy). Cheap to clone; all clones
/// share one queue.
#[derive(Clone)]
pub struct FlowController {
    inner: Arc<Inner>,
}

impl fmt::Debug for FlowController {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FlowController").finish_non_exhaustive()
    }
}

struct Inner {
    state: Mutex<State>,
    capacity: Arc<dyn CapacitySignal>,
    limiter: Arc<dyn RateLimiter>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

type Delivery = (Reply, Result<Permit, Rejection>);

/// Send answers outside the lock. An answer whose client is gone comes back: a permit is
/// released at once and the next request dispatched in its place (no recursion).
fn deliver(inner: &Arc<Inner>, mut out: VecDeque<Delivery>) {
    while let Some((reply, result)) = out.pop_front() {
        if let Err(Ok(mut permit)) = reply.send(result) {
            let mut state = inner.lock();
            permit.release_locked(&mut state, Instant::now());
            state.pump(inner, &mut out);
        }
    }
}

/// Removes a still-queued request when its `admit` future is dropped (client gone).
struct QueuedGuard {
    inner: Arc<Inner>,
    id: Option<u64>,
}

impl Drop for QueuedGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = leave_queue(&self.inner, id, Outcome::Cancelled);
        }
    }
}

/// Remove a queued request, then dispatch what that lets go (a turn it held back, say).
fn leave_queue(inner: &Arc<Inner>, id: u64, outcome: Outcome) -> Option<Rejection> {
    let mut out = VecDeque::new();
    let rejection = {
        let mut state = inner.lock();
        let rejection = state.remove_queued(id, outcome);
        state.pump(inner, &mut out);
        rejection
    };
    deliver(inner, out);
    rejection
}

impl FlowController {
    /// A controller with rate limits kept in this process ([`LocalRateLimiter`]).
    pub fn new(config: FlowConfig, capacity: Arc<dyn CapacitySignal>) -> Result<Self, ConfigError> {
        Self::with_rate_limiter(config, capacity, Arc::new(LocalRateLimiter::new()))
    }

    /// A controller whose rate limits live in `limiter` (e.g. shared through Redis).
    pub fn with_rate_limiter(
        config: FlowConfig,
        capacity: Arc<dyn CapacitySignal>,
        limiter: Arc<dyn RateLimiter>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut state = State {
            config: FlowConfig::new(Vec::new(), Vec::new()),
            bands: Vec::new(),
            band_index: HashMap::new(),
            team_index: HashMap::new(),
            teams: HashMap::new(),
            peer_teams: HashMap::new(),
            team_yields: std::cell::RefCell::new(HashMap::new()),
            entries: HashMap::new(),
            next_id: 0,
            in_flight: 0,
            in_flight_tokens: 0,
            sessions: SessionTracker::default(),
            turns: TurnWaits::default(),
            retired_bands: HashMap::new(),
            retired_teams: HashMap::new(),
        };
        state.install(config);
        Ok(FlowController {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                capacity,
                limiter,
            }),
        })
    }

    /// Admit `ticket`: check its band, shed it if its band is sheddable and the pool is
    /// saturated, refuse it if its band's queue is full, charge its team's rate limits, then
    /// queue it until it is dispatched (the returned [`Permit`]) or its band's TTL passes
    /// ([`Rejection::Timeout`], at the TTL). A request refused before it is queued costs its
    /// team nothing. Dropping the future takes the request out of the queue. Runs on a Tokio
    /// runtime with the time driver enabled (the TTL is a Tokio timer).
    pub async fn admit(&self, ticket: Ticket) -> Result<Permit, Rejection> {
        let (limits, band) = self.check_room(&ticket)?;
        let rate = self
            .charge_limits(&ticket.team, limits, ticket.rate_cost(), Some(&band))
            .await?;
        self.queue(ticket, rate).await
    }

    /// Charge `ticket` to its team's rate limits now, for a request admitted later with
    /// [`Self::admit_charged`] (a background response: refused at creation when over its
    /// limits, queued when its run starts). What [`Self::admit`] would refuse before charging
    /// (shed, a full queue) is refused first, uncharged; a request shed when it is admitted
    /// later has spent its charge.
    pub async fn charge(&self, ticket: &Ticket) -> Result<Option<RateStatus>, Rejection> {
        let (limits, band) = self.check_room(ticket)?;
        self.charge_limits(&ticket.team, limits, ticket.rate_cost(), Some(&band))
            .await
    }

    /// Charge one request, and no tokens, to `team`'s requests-per-minute limit: for a call
    /// that runs no generation (counting a prompt's tokens) yet must stay within the team's
    /// request budget. Nothing is shed or queued.
    pub async fn charge_request(&self, team: &str) -> Result<Option<RateStatus>, Rejection> {
        let limits = self.inner.lock().team_limits(team);
        let limits = RateLimits {
            rpm: limits.rpm,
            tpm: None,
        };
        let cost = RateCost {
            requests: 1,
            tokens: 0,
        };
        self.charge_limits(team, limits, cost, None).await
    }

    /// Give back what [`Self::charge`] charged `ticket` (a background response that could not
    /// be created after all: the store refused it).
    pub async fn refund(&self, ticket: &Ticket) {
        self.refund_limits(&ticket.team, ticket.rate_cost()).await;
    }

    /// Give back `cost` charged to `team` under its current limits.
    async fn refund_limits(&self, team: &str, cost: RateCost) {
        let limits = self.inner.lock().team_limits(team);
        if !limits.is_unlimited() {
            self.inner.limiter.refund(team, limits, cost).await;
        }
    }

    /// [`Self::admit`] for a ticket [`Self::charge`] charged already (`rate` is its answer):
    /// shed, queue-full check, queue.
    pub async fn admit_charged(
        &self,
        ticket: Ticket,
        rate: Option<RateStatus>,
    ) -> Result<Permit, Rejection> {
        self.check_room(&ticket)?;
        self.queue(ticket, rate).await
    }

    /// Before charging: the band, shedding, and a full queue while the pool takes no work.
    /// Returns the team's limits and the band's name.
    fn check_room(&self, ticket: &Ticket) -> Result<(RateLimits, String), Rejection> {
        let inner = &self.inner;
        let mut state = inner.lock();
        let band = ticket_band(&state.config, ticket)?;
        let (band_name, sheddable) = (band.name.clone(), band.sheddable);
        let limits = state.team_limits(&ticket.team);
        if sheddable && state.should_shed(&*inner.capacity) {
            return Err(state.count_shed(&ticket.team, &band_name));
        }
        // The pool takes no work and the band's waiting requests already fill its caps:
        // this one would be refused once queued, so refuse it before it is charged. (With
        // room in the pool it may go at once, past requests held for their own endpoint
        // or by their team's cap: the check after queueing decides.)
        if !inner.capacity.can_dispatch(&state.load()) {
            if let Some(limit) = state.full_queue(&band_name, ticket.bytes) {
                return Err(state.count_queue_full(&ticket.team, &band_name, limit));
            }
        }
        Ok((limits, band_name))
    }

    /// Charge `cost` to `team`'s rate limits (none: nothing to charge); a refusal is counted
    /// for the team and, when given, the band.
    async fn charge_limits(
        &self,
        team: &str,
        limits: RateLimits,
        cost: RateCost,
        band_name: Option<&str>,
    ) -> Result<Option<RateStatus>, Rejection> {
        if limits.is_unlimited() {
            return Ok(None);
        }
        let inner = &self.inner;
        match inner.limiter.check(team, limits, cost).await {
            Ok(status) => Ok(Some(status)),
            Err(limited) => {
                let mut state = inner.lock();
                if let Some(t) = state.teams.get_mut(team) {
                    t.rate_limited += 1;
                }
                if let Some(&b) = band_name.and_then(|name| state.band_index.get(name)) {
                    state.bands[b].counters.rate_limited += 1;
                }
                Err(Rejection::RateLimited(limited))
            }
        }
    }

    /// Queue `ticket` (charged, with `rate` its limits' answer) until it is dispatched or its
    /// band's TTL passes.
    async fn queue(
        &self,
        mut ticket: Ticket,
        rate: Option<RateStatus>,
    ) -> Result<Permit, Rejection> {
        let inner = &self.inner;
        // What to give back should it be refused once queued (charged: its limits answered).
        let charged = rate
            .is_some()
            .then(|| (ticket.team.clone(), ticket.rate_cost()));
        // Rate limits judge the estimate as asked (over the budget is `request_too_large`);
        // fairness and in-flight counts take at most MAX_REQUEST_TOKENS of it.
        ticket.cost_tokens = ticket.cost_tokens.min(MAX_REQUEST_TOKENS);
        let (reply, mut answer) = oneshot::channel();
        let mut out = VecDeque::new();
        let queued = inner.lock().enqueue(inner, ticket, rate, reply, &mut out);
        deliver(inner, out);
        let queued = match queued {
            Ok(queued) => queued,
            Err(refused) => {
                // Refused when queued (its band's queue full, its team or band removed by a
                // reload): it costs its team nothing, as a refusal before the charge does.
                if let Some((team, cost)) = charged {
                    self.refund_limits(&team, cost).await;
                }
                return Err(refused);
            }
        };
        let Queued {
            id,
            band,
            enqueued_at,
            deadline,
            pin_wait,
        } = queued;
        let mut guard = QueuedGuard {
            inner: Arc::clone(inner),
            id: Some(id),
        };
        if let Some(every) = pin_wait {
            // Held for its endpoint, the request becomes placeable `pin_wait` after it was
            // first passed over; nothing else may pump then, so look again every `pin_wait`.
            let mut at = enqueued_at + every;
            while at < deadline {
                if let Ok(result) = tokio::time::timeout_at(at, &mut answer).await {
                    guard.id = None;
                    return flatten(result, band, enqueued_at);
                }
                let mut out = VecDeque::new();
                inner.lock().pump(inner, &mut out);
                deliver(inner, out);
                // A task that ran late looks again `every` from now, not in a burst.
                at = (at + every).max(Instant::now() + every);
            }
        }
        let timed_out = match tokio::time::timeout_at(deadline, &mut answer).await {
            Ok(result) => {
                guard.id = None;
                return flatten(result, band, enqueued_at);
            }
            Err(_elapsed) => {
                guard.id = None;
                leave_queue(inner, id, Outcome::TimedOut)
            }
        };
        match timed_out {
            Some(rejection) => Err(rejection),
            // Dispatched at the deadline: the permit is on its way.
            None => flatten(answer.await, band, enqueued_at),
        }
    }

    /// The band a request of `team` asking for `requested` runs in
    /// ([`FlowConfig::band_for`]).
    pub fn band_for(&self, team: &str, requested: Option<&str>) -> Result<String, Rejection> {
        let state = self.inner.lock();
        state
            .config
            .band_for(team, requested)
            .map(|b| b.name.clone())
    }

    /// The band background responses of `team` run in by default: its lowest.
    pub fn background_band(&self, team: &str) -> Option<String> {
        let state = self.inner.lock();
        state.config.background_band(team).map(|b| b.name.clone())
    }

    /// Dispatch whatever capacity allows now: call after the [`CapacitySignal`] may have
    /// changed without a permit being released (after each metrics scrape).
    pub fn notify(&self) {
        let mut out = VecDeque::new();
        self.inner.lock().pump(&self.inner, &mut out);
        deliver(&self.inner, out);
    }

    /// Switch to `config`, keeping queued requests: each stays in its band if its team may
    /// still use it, else moves to its team's default band (arrival order and deadline kept);
    /// requests of removed teams are refused with [`Rejection::TeamRemoved`]. An invalid
    /// config changes nothing.
    pub fn reconfigure(&self, config: FlowConfig) -> Result<(), ConfigError> {
        config.validate()?;
        let mut out = VecDeque::new();
        {
            let mut state = self.inner.lock();
            state.install(config);
            state.requeue(&mut out);
            state.pump(&self.inner, &mut out);
        }
        deliver(&self.inner, out);
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> FlowConfig {
        self.inner.lock().config.clone()
    }

    /// Counters, queue depths and wait histograms now.
    pub fn snapshot(&self) -> FlowSnapshot {
        self.inner.lock().snapshot()
    }

    /// Per endpoint, the turn that goes first among those queued here for lack of room there
    /// (a higher band, else the warmest): what this gateway tells the others in front of the
    /// same pool, so that room goes to the first turn any of them holds
    /// ([`CapacitySignal::warmer_elsewhere`]).
    pub fn held(&self) -> HashMap<String, HeldTurn> {
        self.inner.lock().held(Instant::now())
    }

    /// Each team's requests in flight and waiting here, and when its oldest waiting request
    /// here was queued (teams with neither left out): what this gateway tells the others in front of
    /// the same pool, so that a team's `max_concurrent` holds across them
    /// ([`FlowController::set_peer_teams`]).
    pub fn team_load(&self) -> Vec<(String, PeerTeam)> {
        let state = self.inner.lock();
        state
            .teams
            .iter()
            .filter(|(_, t)| t.in_flight > 0 || t.queued > 0)
            .map(|(name, t)| {
                let team = PeerTeam {
                    in_flight: t.in_flight,
                    waiting: t.queued as u64,
                    oldest_waiting: state.team_oldest(name).map(|(at, id)| (at, id.to_string())),
                };
                (name.clone(), team)
            })
            .collect()
    }

    /// The other gateways' load per team, summed (requests in flight; the oldest waiting
    /// request), as last exchanged: their requests count toward each team's `max_concurrent`
    /// with this gateway's own, and a freed slot may be left to an older request of the team
    /// waiting there (an empty map: none, e.g. after a failed exchange). Whether the caller
    /// should [`notify`](FlowController::notify): something changed, or a capped team has
    /// requests waiting both there and here (a slot left to them is taken back once it has
    /// been left long enough).
    pub fn set_peer_teams(&self, mut teams: HashMap<String, PeerTeam>) -> bool {
        let mut state = self.inner.lock();
        teams.retain(|_, t| t.in_flight > 0 || t.waiting > 0);
        let contended = teams.iter().any(|(name, t)| {
            t.waiting > 0
                && state
                    .team_spec(name)
                    .is_some_and(|spec| spec.max_concurrent.is_some())
                && state.teams.get(name).is_some_and(|own| own.queued > 0)
        });
        let changed = state.peer_teams != teams || contended;
        state.peer_teams = teams;
        changed
    }

    /// Sessions this gateway dispatched or finished a turn of at or after `since`, each with
    /// its latest such instant (at most the last 4,096 events).
    pub fn recent_activity(&self, since: Instant) -> Vec<(String, Instant)> {
        let state = self.inner.lock();
        let mut latest: HashMap<&str, Instant> = HashMap::new();
        for (session, at) in state.sessions.recent.iter().rev() {
            if *at < since {
                break;
            }
            latest.entry(session.as_str()).or_insert(*at);
        }
        latest
            .into_iter()
            .map(|(session, at)| (session.to_string(), at))
            .collect()
    }

    /// Turns of `sessions` were dispatched or finished by other gateways at the given
    /// instants: each session counts as active and as warm as that, as if its turn had run
    /// here, for turn-first order. Activity older than `turn_window` is ignored.
    pub fn note_activity(&self, sessions: impl IntoIterator<Item = (String, Instant)>) {
        let now = Instant::now();
        let mut state = self.inner.lock();
        let window = state.config.turn_window;
        for (session, at) in sessions {
            state.sessions.seen_elsewhere(&session, at, now, window);
        }
    }
}

/// A request just queued by [`State::enqueue`].
struct Queued {
    id: u64,
    band: String,
    enqueued_at: Instant,
    deadline: Instant,
    /// How often to look again while the request may be held for its endpoint.
    pin_wait: Option<Duration>,
}

fn flatten(
    answer: Result<Result<Permit, Rejection>, oneshot::error::RecvError>,
    band: String,
    enqueued_at: Instant,
) -> Result<Permit, Rejection> {
    // The sender is only dropped unanswered by this request's own removal, so a closed channel
    // cannot be observed here; answer it as a timeout rather than panic.
    answer.unwrap_or_else(|_| {
        Err(Rejection::Timeout {
            band,
            waited: enqueued_at.elapsed(),
            retry_after: Duration::from_secs(1),
        })
    })
}

/// Why a request leaves the queue without being dispatched.
enum Outcome {
    Cancelled,
    TimedOut,
    QueueFull(QueueLimit),
}

/// Per-team counters and live counts.
#[derive(Debug, Default)]
struct TeamState {
    in_flight: u64,
    queued: usize,
    dispatched_requests: u64,
    dispatched_tokens: u64,
    finished_tokens: u64,
    shed: u64,
    rate_limited: u64,
    queue_full: u64,
    timed_out: u64,
    cancelled: u64,
    wait: WaitHistogram,
}

/// Recently active sessions, for turn-first ordering.
#[derive(Debug)]
struct SessionTracker {
    sessions: HashMap<String, Activity>,
    prune_at: usize,
    /// This gateway's own dispatches and releases, newest last, for other gateways
    /// ([`FlowController::recent_activity`]); at most [`RECENT_ACTIVITY`] entries.
    recent: VecDeque<(String, Instant)>,
}

/// Most session events [`SessionTracker`] keeps for other gateways.
const RECENT_ACTIVITY: usize = 4096;

#[derive(Debug)]
struct Activity {
    in_flight: u32,
    last: Instant,
}

impl Default for SessionTracker {
    fn default() -> Self {
        SessionTracker {
            sessions: HashMap::new(),
            prune_at: 1024,
            recent: VecDeque::new(),
        }
    }
}

impl SessionTracker {
    /// `Some(active)` for a session seen here, `None` for one never seen (or forgotten).
    fn active(&self, session: &str, now: Instant, window: Duration) -> Option<bool> {
        self.sessions
            .get(session)
            .map(|a| a.in_flight > 0 || now.saturating_duration_since(a.last) <= window)
    }

    /// Forget sessions idle past `window` once the table has doubled since the last time.
    fn prune(&mut self, now: Instant, window: Duration) {
        if self.sessions.len() >= self.prune_at {
            self.sessions
                .retain(|_, a| a.in_flight > 0 || now.saturating_duration_since(a.last) <= window);
            self.prune_at = (self.sessions.len() * 2).max(1024);
        }
    }

    fn dispatched(&mut self, session: &str, now: Instant, window: Duration) {
        self.prune(now, window);
        let activity = self
            .sessions
            .entry(session.to_string())
            .or_insert(Activity {
                in_flight: 0,
                last: now,
            });
        activity.in_flight += 1;
        activity.last = now;
        self.record(session, now);
    }

    fn record(&mut self, session: &str, now: Instant) {
        if self.recent.len() >= RECENT_ACTIVITY {
            self.recent.pop_front();
        }
        self.recent.push_back((session.to_string(), now));
    }

    /// Another gateway saw `session` active at `at`: it counts as active here too, and as warm
    /// as its latest activity anywhere.
    fn seen_elsewhere(&mut self, session: &str, at: Instant, now: Instant, window: Duration) {
        if now.saturating_duration_since(at) > window {
            return;
        }
        self.prune(now, window);
        match self.sessions.get_mut(session) {
            Some(activity) => activity.last = activity.last.max(at),
            None => {
                self.sessions.insert(
                    session.to_string(),
                    Activity {
                        in_flight: 0,
                        last: at,
                    },
                );
            }
        }
    }

    /// When `session` last had a turn dispatched or finished, if it is tracked.
    fn last_active(&self, session: &str) -> Option<Instant> {
        self.sessions.get(session).map(|a| a.last)
    }

    fn released(&mut self, session: &str, now: Instant) {
        if let Some(activity) = self.sessions.get_mut(session) {
            activity.in_flight = activity.in_flight.saturating_sub(1);
            activity.last = now;
            self.record(session, now);
        }
    }
}

/// How much longer a request waiting at another gateway must have waited than any here to be
/// left a slot: more than the error of its queue instant read back from ages (half a store
/// round trip, and whole milliseconds), so two gateways never each take the other's for the
/// older.
const OLDER_BY: Duration = Duration::from_millis(50);

/// A team's load at the other gateways in front of a pool, summed, as exchanged (or, from
/// [`FlowController::team_load`], at this gateway).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTeam {
    /// Its requests in flight there.
    pub in_flight: u64,
    /// Its requests waiting there.
    pub waiting: u64,
    /// The oldest of its requests waiting there, if any waits: when it was queued, and a key
    /// naming it for as long as it waits (this gateway's: its entry id).
    pub oldest_waiting: Option<(Instant, String)>,
}

struct State {
    config: FlowConfig,
    /// Highest priority first.
    bands: Vec<BandQueue>,
    band_index: HashMap<String, usize>,
    team_index: HashMap<String, usize>,
    teams: HashMap<String, TeamState>,
    /// Team -> its requests in flight and its oldest waiting request at the other gateways in
    /// front of this pool, as last exchanged ([`FlowController::set_peer_teams`]): the
    /// requests count toward the team's `max_concurrent` with this gateway's own, and its last
    /// free slots may be left to an older request waiting there ([`State::team_eligible`]).
    peer_teams: HashMap<String, PeerTeam>,
    /// Team -> since when, and to which request waiting at another gateway (its key), a slot
    /// of the team has been left ([`State::team_eligible`]).
    team_yields: std::cell::RefCell<HashMap<String, (Instant, String)>>,
    entries: HashMap<u64, Entry>,
    next_id: u64,
    in_flight: u64,
    in_flight_tokens: u64,
    sessions: SessionTracker,
    turns: TurnWaits,
    /// Counters of bands and teams a reconfiguration removed, picked up again if they come
    /// back: counters are monotonic over the controller's life.
    retired_bands: HashMap<String, BandCounters>,
    retired_teams: HashMap<String, TeamState>,
}

/// The band `ticket` runs in under `config` (see [`Ticket::band_checked`]).
fn ticket_band<'c>(config: &'c FlowConfig, ticket: &Ticket) -> Result<&'c BandSpec, Rejection> {
    match config.band_for(&ticket.team, ticket.band.as_deref()) {
        Err(Rejection::UnknownBand { .. } | Rejection::BandNotAllowed { .. })
            if ticket.band_checked && ticket.band.is_some() =>
        {
            config.band_for(&ticket.team, None)
        }
        answer => answer,
    }
}

/// The cap `queue` passes with `requests` more requests of `bytes` more bytes waiting in it.
/// The byte cap never refuses a request the queue would hold alone: one larger than the cap
/// (a long history) could otherwise never wait, and would be refused for as long as the pool
/// is busy.
fn over_caps(queue: &BandQueue, requests: usize, bytes: u64) -> Option<QueueLimit> {
    let waiting = queue.queued.saturating_add(requests);
    if waiting > queue.spec.max_queued {
        Some(QueueLimit::Requests)
    } else if waiting > 1 && queue.queued_bytes.saturating_add(bytes) > queue.spec.max_queued_bytes
    {
        Some(QueueLimit::Bytes)
    } else {
        None
    }
}

impl State {
    fn team_spec(&self, team: &str) -> Option<&TeamSpec> {
        self.team_index.get(team).map(|&i| &self.config.teams[i])
    }

    /// The team's rate limits (none for a team the configuration does not name).
    fn team_limits(&self, team: &str) -> RateLimits {
        self.team_spec(team)
            .map(|t| RateLimits {
                rpm: t.rpm,
                tpm: t.tpm,
            })
            .unwrap_or_default()
    }

    fn load(&self) -> FlowLoad {
        FlowLoad {
            in_flight: self.in_flight,
            in_flight_tokens: self.in_flight_tokens,
            queued: self.entries.len(),
        }
    }

    /// Install a validated config: band queues reused by name (virtual times, counters), new
    /// ones created, removed ones dropped. Queued entries are not placed: see
    /// [`requeue`](Self::requeue).
    fn install(&mut self, config: FlowConfig) {
        let mut old: HashMap<String, BandQueue> = self
            .bands
            .drain(..)
            .map(|band| (band.spec.name.clone(), band))
            .collect();
        let mut specs = config.bands.clone();
        specs.sort_by_key(|b| Reverse(b.priority));
        self.bands = specs
            .into_iter()
            .map(|spec| match old.remove(&spec.name) {
                Some(mut band) => {
                    band.spec = spec;
                    band.clear();
                    band
                }
                None => {
                    let retired = self.retired_bands.remove(&spec.name);
                    let mut band = BandQueue::new(spec);
                    if let Some(counters) = retired {
                        band.counters = counters;
                    }
                    band
                }
            })
            .collect();
        for (name, band) in old {
            self.retired_bands.insert(name, band.counters);
        }
        self.band_index = self
            .bands
            .iter()
            .enumerate()
            .map(|(i, b)| (b.spec.name.clone(), i))
            .collect();
        self.team_index = config
            .teams
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        for band in &mut self.bands {
            band.flows
                .retain(|team, _| self.team_index.contains_key(team));
        }
        for team in &config.teams {
            if !self.teams.contains_key(&team.name) {
                let state = self.retired_teams.remove(&team.name).unwrap_or_default();
                self.teams.insert(team.name.clone(), state);
            }
        }
        let gone: Vec<String> = self
            .teams
            .iter()
            .filter(|(name, t)| !self.team_index.contains_key(*name) && t.in_flight == 0)
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            if let Some(team) = self.teams.remove(&name) {
                self.retired_teams.insert(name, team);
            }
        }
        self.config = config;
    }

    /// Place every queued entry again, in arrival order, after [`install`](Self::install).
    fn requeue(&mut self, out: &mut VecDeque<Delivery>) {
        let mut ids: Vec<u64> = self.entries.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let Some(entry) = self.entries.get_mut(&id) else {
                continue;
            };
            let Some(&team_at) = self.team_index.get(&entry.team) else {
                if let Some(entry) = self.entries.remove(&id) {
                    let rejection = Rejection::TeamRemoved {
                        team: entry.team.clone(),
                    };
                    out.push_back((entry.reply, Err(rejection)));
                }
                continue;
            };
            if self
                .config
                .band_for(&entry.team, Some(&entry.band))
                .is_err()
            {
                entry.band = self.config.teams[team_at].default_band.clone();
            }
            let Some(&band) = self.band_index.get(&entry.band) else {
                continue;
            };
            self.bands[band].push(id, &entry.team, entry.kind, entry.bytes);
        }
        for band in &mut self.bands {
            band.requeued();
        }
        for team in self.teams.values_mut() {
            team.queued = 0;
        }
        for entry in self.entries.values() {
            if let Some(team) = self.teams.get_mut(&entry.team) {
                team.queued += 1;
            }
        }
    }

    fn should_shed(&self, capacity: &dyn CapacitySignal) -> bool {
        let load = self.load();
        if capacity.can_dispatch(&load) {
            return false;
        }
        let p = self
            .config
            .shed_curve
            .probability(capacity.saturation(&load));
        p >= 1.0 || (p > 0.0 && fastrand::f64() < p)
    }

    fn count_shed(&mut self, team: &str, band: &str) -> Rejection {
        if let Some(&b) = self.band_index.get(band) {
            self.bands[b].counters.shed += 1;
        }
        if let Some(t) = self.teams.get_mut(team) {
            t.shed += 1;
        }
        Rejection::Shed {
            band: band.to_string(),
            retry_after: self.config.retry_after,
        }
    }

    /// The cap of `band`'s queue that a request of `bytes` more would pass (a band with
    /// `max_queued = 0` has no room for one: while the pool takes no work, it refuses each
    /// request as it comes).
    fn full_queue(&self, band: &str, bytes: u64) -> Option<QueueLimit> {
        let queue = &self.bands[*self.band_index.get(band)?];
        over_caps(queue, 1, bytes)
    }

    fn count_queue_full(&mut self, team: &str, band: &str, limit: QueueLimit) -> Rejection {
        if let Some(&b) = self.band_index.get(band) {
            self.bands[b].counters.queue_full += 1;
        }
        if let Some(t) = self.teams.get_mut(team) {
            t.queue_full += 1;
        }
        Rejection::QueueFull {
            band: band.to_string(),
            limit,
            retry_after: self.config.retry_after,
        }
    }

    fn turn_kind(&self, ticket: &Ticket, now: Instant) -> TurnKind {
        let active = ticket
            .session
            .as_deref()
            .and_then(|s| self.sessions.active(s, now, self.config.turn_window));
        match active {
            Some(true) => TurnKind::Continuing,
            Some(false) => TurnKind::New,
            None if ticket.continuing => TurnKind::Continuing,
            None => TurnKind::New,
        }
    }

    /// Queue `ticket`, dispatch what can be, and refuse it if it is still queued over its
    /// band's caps.
    fn enqueue(
        &mut self,
        inner: &Arc<Inner>,
        ticket: Ticket,
        rate: Option<RateStatus>,
        reply: Reply,
        out: &mut VecDeque<Delivery>,
    ) -> Result<Queued, Rejection> {
        // Resolved again: the config may have been reloaded while the rate limit was checked.
        let band = ticket_band(&self.config, &ticket)?;
        let (band_name, ttl) = (band.name.clone(), band.queue_ttl);
        let pin_wait =
            (ticket.affinity.is_some() && band.reserve <= 0.0 && !self.config.pin_wait.is_zero())
                .then_some(self.config.pin_wait);
        let Some(&b) = self.band_index.get(&band_name) else {
            return Err(Rejection::UnknownBand { band: band_name });
        };
        let now = Instant::now();
        let deadline = now.checked_add(ttl).unwrap_or_else(|| now + FAR_FUTURE);
        let kind = self.turn_kind(&ticket, now);
        let id = self.next_id;
        self.next_id += 1;
        self.bands[b].push(id, &ticket.team, kind, ticket.bytes);
        if let Some(team) = self.teams.get_mut(&ticket.team) {
            team.queued += 1;
        }
        self.entries.insert(
            id,
            Entry {
                team: ticket.team,
                band: band_name.clone(),
                cost: ticket.cost_tokens,
                bytes: ticket.bytes,
                session: ticket.session,
                kind,
                enqueued_at: now,
                affinity: ticket.affinity,
                held_since: Cell::new(None),
                yielded_since: Cell::new(None),
                rate,
                reply,
            },
        );
        // Same instant as the arrival: a request dispatched at once waited exactly zero.
        self.pump_at(inner, out, now);
        if self.entries.contains_key(&id) {
            if let Some(limit) = over_caps(&self.bands[b], 0, 0) {
                if let Some(rejection) = self.remove_queued(id, Outcome::QueueFull(limit)) {
                    return Err(rejection);
                }
            }
        }
        Ok(Queued {
            id,
            band: band_name,
            enqueued_at: now,
            deadline,
            pin_wait,
        })
    }

    /// Take a queued entry out without dispatching it; `None` if it is no longer queued
    /// (dispatched, or already removed).
    fn remove_queued(&mut self, id: u64, outcome: Outcome) -> Option<Rejection> {
        let entry = self.entries.remove(&id)?;
        let mut band = None;
        if let Some(&b) = self.band_index.get(&entry.band) {
            let queue = &mut self.bands[b];
            queue.remove(id, &entry.team, entry.kind, entry.bytes);
            band = Some(&mut queue.counters);
        }
        let mut team = self.teams.get_mut(&entry.team);
        if let Some(t) = team.as_deref_mut() {
            t.queued = t.queued.saturating_sub(1);
        }
        let bump = |counter: Option<&mut u64>| {
            if let Some(c) = counter {
                *c += 1;
            }
        };
        let retry_after = self.config.retry_after;
        match outcome {
            Outcome::Cancelled => {
                bump(band.map(|c| &mut c.cancelled));
                bump(team.map(|t| &mut t.cancelled));
                None
            }
            Outcome::TimedOut => {
                bump(band.map(|c| &mut c.timed_out));
                bump(team.map(|t| &mut t.timed_out));
                Some(Rejection::Timeout {
                    band: entry.band,
                    waited: entry.enqueued_at.elapsed(),
                    retry_after,
                })
            }
            Outcome::QueueFull(limit) => {
                bump(band.map(|c| &mut c.queue_full));
                bump(team.map(|t| &mut t.queue_full));
                Some(Rejection::QueueFull {
                    band: entry.band,
                    limit,
                    retry_after,
                })
            }
        }
    }

    /// Dispatch while the capacity signal allows: the highest band with an eligible team
    /// first, then fair queuing and turn order within it. A band dispatches only while the
    /// reserves of the bands above it stay free (see [`BandSpec::reserve`](super::BandSpec::reserve)).
    fn pump(&mut self, inner: &Arc<Inner>, out: &mut VecDeque<Delivery>) {
        self.pump_at(inner, out, Instant::now());
    }

    /// [`pump`](Self::pump) at `now`.
    fn pump_at(&mut self, inner: &Arc<Inner>, out: &mut VecDeque<Delivery>, now: Instant) {
        // Requests this pump sent toward each endpoint: routing has not counted them there yet.
        let mut promised: HashMap<String, u64> = HashMap::new();
        let mut promised_any = 0u64;
        while !self.entries.is_empty() && inner.capacity.can_dispatch(&self.load()) {
            let Some((b, pick)) = self.pick(&*inner.capacity, &promised, promised_any, now) else {
                break;
            };
            let share = self.reserve_above(b);
            // Held for its endpoint until pin_wait ran out, with still no room there: routing
            // should look for an endpoint with room for the band instead.
            let outwaited = pick.moving.then_some(share);
            let mut held = false;
            if let Some(entry) = self.entries.get(&pick.id) {
                held = entry.held_since.get().is_some();
                // (One moving off its endpoint is routed elsewhere: it takes no place there.)
                if let Some(endpoint) = entry.affinity.as_ref().filter(|_| !pick.moving) {
                    *promised.entry(endpoint.clone()).or_default() += 1;
                }
            }
            if pick.moving || share > 0.0 {
                promised_any += 1;
            }
            if share > 0.0 {
                if let Some(capacity) = inner.capacity.capacity() {
                    // Rounded up, but never the whole pool: the lower bands keep a slot (a
                    // pool of one slot, or one whose endpoints are mostly down, still serves
                    // them, as an endpoint of one slot does).
                    let reserved =
                        ((share * capacity as f64).ceil() as u64).min(capacity.saturating_sub(1));
                    if self.in_flight.saturating_add(reserved) >= capacity {
                        // every band below `b` holds back at least as much
                        break;
                    }
                }
            }
            if let Some(mut delivery) = self.dispatch(inner, b, &pick, now) {
                if let Ok(permit) = &mut delivery.1 {
                    permit.outwaited_pin = outwaited;
                }
                match (held, outwaited) {
                    (_, Some(_)) => self.turns.outwaited += 1,
                    (true, None) => self.turns.held += 1,
                    (false, None) => {}
                }
                out.push_back(delivery);
            }
        }
    }

    /// The share of capacity held free for the bands ranked above band `b` (bands are kept in
    /// priority order): the largest of their reserves, since a band's reserve serves it and
    /// every band above it.
    fn reserve_above(&self, b: usize) -> f64 {
        self.bands
            .iter()
            .take(b)
            .map(|band| band.spec.reserve)
            .fold(0.0, f64::max)
    }

    /// The next request to dispatch. A request with an [`affinity`](Ticket::affinity), in a
    /// band without a reserve of its own, is placeable only while its endpoint has room for
    /// the band (its share is [`reserve_above`](Self::reserve_above), counting the requests
    /// this pump already sent there), or, to move elsewhere, once it has been passed over for
    /// [`FlowConfig::pin_wait`]: fair queuing picks the team, and within it a request whose
    /// endpoint has room goes before one that would move, until that one has waited half its
    /// band's queue TTL (then arrival order, rather than time out).
    fn pick(
        &self,
        capacity: &dyn CapacitySignal,
        promised: &HashMap<String, u64>,
        promised_any: u64,
        now: Instant,
    ) -> Option<(usize, Pick)> {
        let pin_wait = self.config.pin_wait;
        let yield_limit = capacity.yield_limit();
        let eligible = |team: &str| self.team_eligible(team, now, yield_limit);
        let enqueued_at = |id: u64| self.entries.get(&id).map(|e| e.enqueued_at);
        self.bands.iter().enumerate().find_map(|(b, band)| {
            if band.queued == 0 {
                return None;
            }
            let head_start = band.head_start(self.config.aging, self.config.aging_follows_wait);
            // A band without a reserve of its own waits for an endpoint with KV room, and its
            // pinned turns for their own endpoint.
            let kv_bound = band.spec.reserve <= 0.0;
            let holds = kv_bound && !pin_wait.is_zero();
            let share = self.reserve_above(b);
            // Below a reserve, a request needs an endpoint below its band's line.
            let room_anywhere = || {
                (share <= 0.0 && !kv_bound)
                    || capacity.has_room(None, share, promised_any, kv_bound)
            };
            let placeable = |id: u64| {
                let Some(entry) = self.entries.get(&id) else {
                    return Placeable::Now;
                };
                let Some(endpoint) = entry.affinity.as_deref().filter(|_| holds) else {
                    return match room_anywhere() {
                        true => Placeable::Now,
                        false => Placeable::No,
                    };
                };
                let sent = promised.get(endpoint).copied().unwrap_or(0);
                if capacity.has_room(Some(endpoint), share, sent, kv_bound) {
                    let turn = HeldTurn {
                        priority: band.spec.priority,
                        warmth: self.warmth(entry, head_start, now),
                    };
                    if kv_bound && self.yields(entry, endpoint, &turn, capacity, now) {
                        return Placeable::No;
                    }
                    return Placeable::Now;
                }
                let since = entry.held_since.get().unwrap_or_else(|| {
                    entry.held_since.set(Some(now));
                    now
                });
                if now.saturating_duration_since(since) < pin_wait || !room_anywhere() {
                    return Placeable::No;
                }
                match now.saturating_duration_since(entry.enqueued_at) >= band.spec.queue_ttl / 2 {
                    true => Placeable::Overdue,
                    false => Placeable::Moving,
                }
            };
            // Until it has waited out the head start, a turn is ranked by when its session
            // was last active: the most recent first, as its context is the likeliest to
            // still be in the engine's cache.
            let warmth = |id: u64| {
                self.entries
                    .get(&id)
                    .map_or(Warmth::Unknown, |entry| self.warmth(entry, head_start, now))
            };
            band.pick(enqueued_at, eligible, head_start, placeable, warmth)
                .map(|pick| (b, pick))
        })
    }

    /// How warm `entry`'s session is at `now` in a band with `head_start`
    /// ([`Warmth::Unknown`] for all when turn-first ordering is off).
    fn warmth(&self, entry: &Entry, head_start: Duration, now: Instant) -> Warmth {
        if head_start.is_zero() {
            return Warmth::Unknown;
        }
        if now.saturating_duration_since(entry.enqueued_at) >= head_start {
            return Warmth::Aged;
        }
        entry
            .session
            .as_deref()
            .and_then(|s| self.sessions.last_active(s))
            .map_or(Warmth::Unknown, Warmth::Since)
    }

    /// Whether `team` has room for one more request in flight under its `max_concurrent`,
    /// counting its requests at the other gateways as last exchanged.
    fn team_has_room(&self, team: &str) -> bool {
        match self.team_spec(team).map(|t| t.max_concurrent) {
            Some(Some(max)) => self.team_in_flight(team) < u64::from(max),
            Some(None) => true,
            None => false,
        }
    }

    /// The team's requests in flight here and, as last exchanged, at the other gateways.
    fn team_in_flight(&self, team: &str) -> u64 {
        let here = self.teams.get(team).map_or(0, |t| t.in_flight);
        let there = self.peer_teams.get(team).map_or(0, |p| p.in_flight);
        here.saturating_add(there)
    }

    /// Whether `team` may have one more request dispatched here now: it has room
    /// ([`State::team_has_room`]) and this is not the slot to leave to another gateway. A
    /// slot freed here is refilled here before the others hear of it, so a gateway that keeps
    /// a backlog of a capped team would keep its slots. So when the other gateways' waiting
    /// requests of the team would take all its free room and the oldest of them waited longer
    /// than any here (by more than [`OLDER_BY`]), the slot is left to it, for at most
    /// `yield_limit` per request waiting there (that gateway may be gone, or unable to place
    /// it for another reason).
    fn team_eligible(&self, team: &str, now: Instant, yield_limit: Duration) -> bool {
        if !self.team_has_room(team) {
            return false;
        }
        let Some(Some(max)) = self.team_spec(team).map(|t| t.max_concurrent) else {
            return true;
        };
        let Some(peer) = self.peer_teams.get(team) else {
            return true;
        };
        let Some((theirs, key)) = &peer.oldest_waiting else {
            return true;
        };
        let free = u64::from(max).saturating_sub(self.team_in_flight(team));
        let older = self
            .team_oldest(team)
            .is_some_and(|(ours, _)| *theirs + OLDER_BY < ours);
        if peer.waiting < free || !older {
            return true;
        }
        let mut yields = self.team_yields.borrow_mut();
        let since = match yields.get(team) {
            Some((since, seen)) if seen == key => *since,
            _ => {
                yields.insert(team.to_string(), (now, key.clone()));
                now
            }
        };
        now.saturating_duration_since(since) >= yield_limit
    }

    /// The oldest request of `team` waiting here: when it was queued, and its id. The fronts
    /// of its queues in each band hold its oldest.
    fn team_oldest(&self, team: &str) -> Option<(Instant, u64)> {
        self.bands
            .iter()
            .flat_map(|band| band.team_fronts(team))
            .filter_map(|id| self.entries.get(&id).map(|e| (e.enqueued_at, id)))
            .min()
    }

    /// Whether `entry` (as `turn`), which could go to `endpoint` now, leaves the room to a
    /// turn another gateway holds for it that outranks it
    /// ([`CapacitySignal::warmer_elsewhere`]), until it has done so for
    /// [`CapacitySignal::yield_limit`] in all.
    fn yields(
        &self,
        entry: &Entry,
        endpoint: &str,
        turn: &HeldTurn,
        capacity: &dyn CapacitySignal,
        now: Instant,
    ) -> bool {
        if !capacity.warmer_elsewhere(endpoint, turn) {
            return false;
        }
        let since = entry.yielded_since.get().unwrap_or_else(|| {
            entry.yielded_since.set(Some(now));
            now
        });
        now.saturating_duration_since(since) < capacity.yield_limit()
    }

    /// Per endpoint, the turn queued here that goes first among those waiting for room there:
    /// pinned turns of bands without a reserve that a dispatch round has passed over for lack
    /// of room, of teams that may have another request in flight. Other gateways leave that
    /// room to it when it outranks theirs.
    fn held(&self, now: Instant) -> HashMap<String, HeldTurn> {
        let mut held: HashMap<String, HeldTurn> = HashMap::new();
        if self.config.pin_wait.is_zero() {
            return held;
        }
        for entry in self.entries.values() {
            let (Some(endpoint), Some(&b), Some(_)) = (
                entry.affinity.as_ref(),
                self.band_index.get(&entry.band),
                entry.held_since.get(),
            ) else {
                continue;
            };
            let band = &self.bands[b];
            if band.spec.reserve > 0.0 || !self.team_has_room(&entry.team) {
                continue;
            }
            let head_start = band.head_start(self.config.aging, self.config.aging_follows_wait);
            let turn = HeldTurn {
                priority: band.spec.priority,
                warmth: self.warmth(entry, head_start, now),
            };
            if turn.warmth == Warmth::Unknown {
                continue;
            }
            turn.keep_first(&mut held, endpoint);
        }
        held
    }

    fn dispatch(
        &mut self,
        inner: &Arc<Inner>,
        b: usize,
        pick: &Pick,
        now: Instant,
    ) -> Option<Delivery> {
        let weight = self.team_spec(&pick.team).map_or(1.0, |t| t.weight);
        let held_share = self.reserve_above(b);
        let (cost, bytes) = match self.entries.get(&pick.id) {
            Some(entry) => (entry.cost, entry.bytes),
            None => (0, 0),
        };
        let taken = self.bands[b].take(pick, cost, weight, bytes);
        let entry = self.entries.remove(&pick.id);
        let (true, Some(entry)) = (taken, entry) else {
            // Inconsistent queue (cannot happen): drop the stale id and carry on.
            return None;
        };
        let waited = now.saturating_duration_since(entry.enqueued_at);
        let band = &mut self.bands[b];
        band.counters.dispatched += 1;
        band.counters.wait.observe(waited);
        band.observe_wait(waited);
        if let Some(team) = self.teams.get_mut(&entry.team) {
            team.in_flight += 1;
            team.queued = team.queued.saturating_sub(1);
            team.dispatched_requests += 1;
            team.dispatched_tokens = team.dispatched_tokens.saturating_add(entry.cost);
            team.wait.observe(waited);
        }
        self.in_flight += 1;
        self.in_flight_tokens = self.in_flight_tokens.saturating_add(entry.cost);
        match entry.kind {
            TurnKind::Continuing => self.turns.continuing.observe(waited),
            TurnKind::New => self.turns.new.observe(waited),
        }
        if pick.promoted {
            self.turns.promoted += 1;
        }
        if let Some(session) = &entry.session {
            self.sessions
                .dispatched(session, now, self.config.turn_window);
        }
        let permit = Permit {
            inner: Arc::clone(inner),
            released: false,
            team: entry.team,
            band: band.spec.name.clone(),
            band_priority: band.spec.priority,
            band_reserves: band.spec.reserve > 0.0,
            held_share,
            cost: entry.cost,
            session: entry.session,
            waited,
            kind: entry.kind,
            promoted: pick.promoted,
            rate: entry.rate,
            actual_tokens: None,
            outwaited_pin: None,
        };
        Some((entry.reply, Ok(permit)))
    }

    fn snapshot(&self) -> FlowSnapshot {
        let bands = self
            .bands
            .iter()
            .map(|band| BandSnapshot {
                name: band.spec.name.clone(),
                priority: band.spec.priority,
                queued: band.queued,
                queued_bytes: band.queued_bytes,
                dispatched: band.counters.dispatched,
                shed: band.counters.shed,
                rate_limited: band.counters.rate_limited,
                queue_full: band.counters.queue_full,
                timed_out: band.counters.timed_out,
                cancelled: band.counters.cancelled,
                wait: band.counters.wait.clone(),
            })
            .collect();
        let teams = self
            .config
            .teams
            .iter()
            .map(|spec| {
                let t = self.teams.get(&spec.name);
                let get = |f: fn(&TeamState) -> u64| t.map_or(0, f);
                TeamSnapshot {
                    name: spec.name.clone(),
                    queued: t.map_or(0, |t| t.queued),
                    in_flight: get(|t| t.in_flight),
                    peer_in_flight: self.peer_teams.get(&spec.name).map_or(0, |p| p.in_flight),
                    peer_waiting: self
                        .peer_teams
                        .get(&spec.name)
                        .is_some_and(|p| p.waiting > 0),
                    dispatched_requests: get(|t| t.dispatched_requests),
                    dispatched_tokens: get(|t| t.dispatched_tokens),
                    finished_tokens: get(|t| t.finished_tokens),
                    shed: get(|t| t.shed),
                    rate_limited: get(|t| t.rate_limited),
                    queue_full: get(|t| t.queue_full),
                    timed_out: get(|t| t.timed_out),
                    cancelled: get(|t| t.cancelled),
                    wait: t.map(|t| t.wait.clone()).unwrap_or_default(),
                }
            })
            .collect();
        FlowSnapshot {
            in_flight: self.in_flight,
            in_flight_tokens: self.in_flight_tokens,
            bands,
            teams,
            turns: self.turns.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{BandSpec, MaxInFlight};

    /// A client can leave between its request's dispatch and the delivery of its permit (the
    /// permit is sent after the lock is released). The returned permit must free its slot and
    /// pass it on.
    #[tokio::test(start_paused = true)]
    async fn a_permit_nobody_receives_is_passed_on() {
        let config = FlowConfig::new(vec![BandSpec::new("b", 0)], vec![TeamSpec::new("t", "b")]);
        let capacity = Arc::new(MaxInFlight::new(0));
        let flow = FlowController::new(config, capacity.clone()).unwrap();
        for _ in 0..2 {
            let (reply, answer) = oneshot::channel();
            drop(answer);
            let mut out = VecDeque::new();
            let queued =
                flow.inner
                    .lock()
                    .enqueue(&flow.inner, Ticket::new("t", 5), None, reply, &mut out);
            assert!(queued.is_ok() && out.is_empty());
        }
        let live = tokio::spawn({
            let flow = flow.clone();
            async move { flow.admit(Ticket::new("t", 7)).await }
        });
        while flow.snapshot().queued() < 3 {
            tokio::task::yield_now().await;
        }
        capacity.set_limit(1);
        flow.notify();
        let permit = live.await.unwrap().unwrap();
        assert_eq!(permit.cost_tokens(), 7);
        let snapshot = flow.snapshot();
        assert_eq!((snapshot.in_flight, snapshot.in_flight_tokens), (1, 7));
        assert_eq!(snapshot.queued(), 0);
        assert_eq!(snapshot.team("t").unwrap().dispatched_requests, 3);
        drop(permit);
        assert_eq!(flow.snapshot().in_flight, 0);
    }
}
