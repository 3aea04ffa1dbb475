//! One band's queue: a flow per team, ordered across teams by start-time fair queuing over
//! tokens and, within a team, turn-first with aging (formulas in the [module doc](super)).

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::config::BandSpec;
use super::controller::Permit;
use super::metrics::WaitHistogram;
use super::rate_limit::RateStatus;
use super::rejection::Rejection;

/// Whether a request continues an active session or starts a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TurnKind {
    /// The next turn of a session active within the turn window: its KV cache is likely warm.
    Continuing,
    /// A new session, or one idle longer than the turn window.
    New,
}

/// Where a dispatched (or refused) request's answer goes.
pub(super) type Reply = oneshot::Sender<Result<Permit, Rejection>>;

/// A queued request.
pub(super) struct Entry {
    pub team: String,
    pub band: String,
    pub cost: u64,
    pub bytes: u64,
    pub session: Option<String>,
    pub kind: TurnKind,
    pub enqueued_at: Instant,
    /// The endpoint the request is expected to go to
    /// ([`Ticket::affinity`](super::Ticket::affinity)).
    pub affinity: Option<String>,
    /// When a pick first passed the request over because its endpoint had no room.
    pub held_since: Cell<Option<Instant>>,
    /// When a pick first left its endpoint's room to a warmer turn another gateway holds
    /// ([`CapacitySignal::warmer_elsewhere`](super::CapacitySignal::warmer_elsewhere)).
    pub yielded_since: Cell<Option<Instant>>,
    pub rate: Option<RateStatus>,
    pub reply: Reply,
}

/// One team's requests in one band.
#[derive(Debug, Default)]
pub(super) struct Flow {
    /// Virtual finish time of the team's last dispatched request; while the flow is
    /// backlogged, the start tag of its next one.
    pub finish: f64,
    /// Continuing turns, in arrival order (entry ids).
    continuing: VecDeque<u64>,
    /// New sessions, in arrival order (entry ids).
    new: VecDeque<u64>,
    /// Emptied by [`BandQueue::clear`] while backlogged: re-queued, it keeps its virtual time.
    was_backlogged: bool,
    /// Passed over by [`BandQueue::pick`] while it had requests, because its team may not
    /// take more (its own cap): like idle time, that earns no credit, so once eligible it
    /// starts no earlier than the band's virtual time.
    held_back: std::cell::Cell<bool>,
}

impl Flow {
    fn is_empty(&self) -> bool {
        self.continuing.is_empty() && self.new.is_empty()
    }

    fn queue(&mut self, kind: TurnKind) -> &mut VecDeque<u64> {
        match kind {
            TurnKind::Continuing => &mut self.continuing,
            TurnKind::New => &mut self.new,
        }
    }
}

/// The next request of a band, as chosen by [`BandQueue::pick`].
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Pick {
    pub team: String,
    pub kind: TurnKind,
    pub id: u64,
    /// A new session going ahead of a waiting continuing turn because it aged.
    pub promoted: bool,
    /// Placeable only by moving off its endpoint ([`Placeable::Moving`]).
    pub moving: bool,
}

/// Counters of one band.
#[derive(Debug, Default, Clone)]
pub(super) struct BandCounters {
    pub dispatched: u64,
    pub shed: u64,
    pub rate_limited: u64,
    pub queue_full: u64,
    pub timed_out: u64,
    pub cancelled: u64,
    pub wait: WaitHistogram,
}

/// One priority band.
pub(super) struct BandQueue {
    pub spec: BandSpec,
    /// The band's virtual time: the start tag of the last dispatched request.
    pub vtime: f64,
    pub flows: HashMap<String, Flow>,
    pub queued: usize,
    pub queued_bytes: u64,
    pub counters: BandCounters,
    /// Moving average of the band's queue waits, seconds (weight [`WAIT_AVERAGE_WEIGHT`]).
    pub typical_wait_s: f64,
}

/// Weight of the newest wait in [`BandQueue::typical_wait_s`]: about the last 16 dispatches.
pub(super) const WAIT_AVERAGE_WEIGHT: f64 = 1.0 / 16.0;

/// Whether a queued request may be dispatched now ([`BandQueue::pick`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeable {
    /// Not now: its endpoint has no room and it has not waited long enough to move.
    No,
    /// Only by moving elsewhere: it waited out its endpoint (`pin_wait`).
    Moving,
    /// Only by moving elsewhere, and it has waited half its band's queue TTL: it goes in
    /// arrival order, before turns whose endpoint has room, rather than time out.
    Overdue,
    /// Yes: it has no endpoint of its own, or its endpoint has room.
    Now,
}

/// How likely a queued turn's context still is in the engine's cache, which orders a team's
/// turns of one kind (`BandQueue::pick`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Warmth {
    /// Waited out its head start: goes first, in arrival order, whatever its warmth.
    Aged,
    /// Its session was last active at this instant: the most recent goes first.
    Since(Instant),
    /// No session activity known: after those with one, in arrival order.
    Unknown,
}

impl Warmth {
    /// Whether a turn of this warmth goes before one of `other`'s when they wait for the same
    /// room: aged before the rest, then the most recently active, then those of unknown
    /// sessions. Ties, and an unknown session against anything, do not outrank: their order is
    /// arrival order, which only the queue that holds both knows.
    pub fn outranks(&self, other: &Warmth) -> bool {
        match (self, other) {
            (Warmth::Aged, Warmth::Aged) => false,
            (Warmth::Aged, _) => true,
            (Warmth::Since(a), Warmth::Since(b)) => a > b,
            (Warmth::Since(_), Warmth::Unknown) => true,
            (Warmth::Since(_), Warmth::Aged) | (Warmth::Unknown, _) => false,
        }
    }
}

/// A queued turn waiting for room on an endpoint, as gateways compare them across their
/// queues (`FlowController::held`, [`CapacitySignal::warmer_elsewhere`](super::CapacitySignal::warmer_elsewhere)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldTurn {
    /// Its band's priority.
    pub priority: i32,
    /// How warm its session is.
    pub warmth: Warmth,
}

impl HeldTurn {
    /// Whether this turn goes before `other` when both wait for the same room: a higher
    /// band first, then [`Warmth::outranks`].
    pub fn outranks(&self, other: &HeldTurn) -> bool {
        self.priority > other.priority
            || (self.priority == other.priority && self.warmth.outranks(&other.warmth))
    }

    /// Keep in `first`, per endpoint, the turn that goes first: this one for `endpoint`
    /// unless the turn kept there already is not outranked by it.
    pub fn keep_first(self, first: &mut HashMap<String, HeldTurn>, endpoint: &str) {
        match first.get_mut(endpoint) {
            Some(best) if !self.outranks(best) => {}
            Some(best) => *best = self,
            None => {
                first.insert(endpoint.to_string(), self);
            }
        }
    }
}

/// How deep [`BandQueue::pick`] looks into a team's queue of one turn kind for an entry it
/// may place: far enough to pass the requests waiting for a few busy endpoints, bounded so a
/// pick stays cheap under a long queue.
pub const PLACEABLE_SCAN: usize = 32;

/// Typical waits in the head start of continuing turns when it follows the wait (derivation
/// in the module doc of [`crate::flow`]): continuing turns then wait at most about a third as
/// long as new sessions.
pub const HEAD_START_WAITS: f64 = 2.0;

impl BandQueue {
    /// The ids at the front of `team`'s queues in this band (continuing turns, new sessions):
    /// its oldest requests here.
    pub fn team_fronts(&self, team: &str) -> impl Iterator<Item = u64> + '_ {
        self.flows
            .get(team)
            .into_iter()
            .flat_map(|flow| flow.continuing.front().into_iter().chain(flow.new.front()))
            .copied()
    }

    pub fn new(spec: BandSpec) -> Self {
        BandQueue {
            spec,
            vtime: 0.0,
            flows: HashMap::new(),
            queued: 0,
            queued_bytes: 0,
            counters: BandCounters::default(),
            typical_wait_s: 0.0,
        }
    }

    /// Fold a dispatched request's queue wait into the typical wait.
    pub fn observe_wait(&mut self, waited: Duration) {
        let w = waited.as_secs_f64();
        self.typical_wait_s += WAIT_AVERAGE_WEIGHT * (w - self.typical_wait_s);
    }

    /// The head start of continuing turns in this band: `aging`, or with `follows_wait` the
    /// larger of it and [`HEAD_START_WAITS`] typical waits; none when `aging` is zero
    /// (turn-first off).
    pub fn head_start(&self, aging: Duration, follows_wait: bool) -> Duration {
        if aging.is_zero() || !follows_wait {
            return aging;
        }
        let typical = Duration::try_from_secs_f64(HEAD_START_WAITS * self.typical_wait_s)
            .unwrap_or(Duration::ZERO);
        aging.max(typical)
    }

    /// Queue entry `id` of `team` at the back of its turn kind. A team whose flow was idle
    /// starts at the band's virtual time: idle time earns no credit.
    pub fn push(&mut self, id: u64, team: &str, kind: TurnKind, bytes: u64) {
        let vtime = self.vtime;
        let flow = self.flows.entry(team.to_string()).or_default();
        if flow.is_empty() && !std::mem::take(&mut flow.was_backlogged) {
            flow.finish = flow.finish.max(vtime);
            // (Caught up already: an old hold must not clip it again later.)
            flow.held_back.set(false);
        }
        flow.queue(kind).push_back(id);
        self.queued += 1;
        self.queued_bytes = self.queued_bytes.saturating_add(bytes);
    }

    /// Re-queueing after [`BandQueue::clear`] is over: a team none of whose requests came
    /// back here is idle from now on.
    pub fn requeued(&mut self) {
        for flow in self.flows.values_mut() {
            flow.was_backlogged = false;
        }
    }

    /// Take entry `id` out of the queue (client gone, timed out, refused); `false` if it is
    /// not queued here.
    pub fn remove(&mut self, id: u64, team: &str, kind: TurnKind, bytes: u64) -> bool {
        let Some(flow) = self.flows.get_mut(team) else {
            return false;
        };
        let queue = flow.queue(kind);
        let Some(position) = queue.iter().position(|&queued| queued == id) else {
            return false;
        };
        queue.remove(position);
        if flow.is_empty() {
            // Idle from now on: its next request starts at the band's time anyway.
            flow.held_back.set(false);
        }
        self.queued = self.queued.saturating_sub(1);
        self.queued_bytes = self.queued_bytes.saturating_sub(bytes);
        true
    }

    /// Empty every flow, keeping virtual times (before re-queueing on reconfiguration): a
    /// backlogged team's first request pushed again is not clipped to the band's virtual
    /// time as an idle team's would be. Call [`BandQueue::requeued`] once every request is
    /// back.
    pub fn clear(&mut self) {
        for flow in self.flows.values_mut() {
            flow.was_backlogged = !flow.is_empty();
            flow.continuing.clear();
            flow.new.clear();
        }
        self.queued = 0;
        self.queued_bytes = 0;
    }

    /// The next request: among teams with queued requests that `eligible` accepts, the one
    /// with the smallest start tag (earliest arrival breaks ties); within it, a continuing
    /// turn, unless the new session chosen the same way arrived at least `aging` before it.
    /// Only entries `placeable` accepts count, looking at most [`PLACEABLE_SCAN`] deep into
    /// each turn kind's queue: one whose endpoint has no room yet lets the next one go. Of a
    /// turn kind's [`Placeable::Now`] and [`Placeable::Overdue`] entries, the first `Overdue`
    /// or [`Warmth::Aged`] `Now` one counts; else, of the `Now` ones, the warmest
    /// [`Warmth::Since`], else the first; without any, the first [`Placeable::Moving`]. So fair
    /// queuing across teams decides which team a free slot serves; among a team's requests of
    /// one kind, one whose endpoint has room goes before one that would have to move (until
    /// that one has waited half its TTL), and the session active most recently first until
    /// requests have waited out the head start (turn-first order between the kinds is
    /// unchanged).
    pub fn pick(
        &self,
        enqueued_at: impl Fn(u64) -> Option<Instant>,
        eligible: impl Fn(&str) -> bool,
        aging: Duration,
        placeable: impl Fn(u64) -> Placeable,
        warmth: impl Fn(u64) -> Warmth,
    ) -> Option<Pick> {
        let mut best: Option<(f64, u64, Pick)> = None;
        // The first overdue or (placeable now) aged, else of the entries placeable now the
        // warmest, else the first; failing those, the first that would move (and whether it
        // moves).
        let first = |queue: &VecDeque<u64>| {
            let mut moving = None;
            let mut warmest: Option<(Instant, u64)> = None;
            let mut unknown = None;
            for &id in queue.iter().take(PLACEABLE_SCAN) {
                match placeable(id) {
                    Placeable::Now => match warmth(id) {
                        Warmth::Aged => return Some((id, false)),
                        Warmth::Since(w) => {
                            if warmest.is_none_or(|(best, _)| w > best) {
                                warmest = Some((w, id));
                            }
                        }
                        Warmth::Unknown => {
                            unknown.get_or_insert(id);
                        }
                    },
                    // Ranked below turns with room, it would wait as long as its team sends
                    // those (and hold back the team's new sessions, which follow it).
                    Placeable::Overdue => return Some((id, true)),
                    Placeable::Moving => {
                        moving.get_or_insert((id, true));
                    }
                    Placeable::No => {}
                }
            }
            warmest
                .map(|(_, id)| id)
                .or(unknown)
                .map(|id| (id, false))
                .or(moving)
        };
        for (team, flow) in &self.flows {
            if flow.is_empty() {
                continue;
            }
            if !eligible(team) {
                flow.held_back.set(true);
                continue;
            }
            let start = match flow.held_back.get() {
                true => flow.finish.max(self.vtime),
                false => flow.finish,
            };
            // Continuing turns are ordered as if they had arrived `aging` earlier: a new
            // session goes first only when it arrived at least `aging` before the oldest
            // continuing turn, so it never waits more than `aging` behind arrival order. That
            // holds while the continuing turns wait for their endpoints too: room elsewhere
            // does not let a new session overtake them.
            let oldest_continuing = flow.continuing.front().copied();
            let promoted = |n: u64| {
                oldest_continuing.is_none_or(|c| {
                    n < c
                        && match (enqueued_at(n), enqueued_at(c)) {
                            (Some(new_at), Some(cont_at)) => new_at + aging <= cont_at,
                            _ => true,
                        }
                })
            };
            let ((id, moving), kind, promoted) = match (first(&flow.continuing), first(&flow.new)) {
                (Some(_), Some(n)) if promoted(n.0) => (n, TurnKind::New, true),
                (Some(c), _) => (c, TurnKind::Continuing, false),
                (None, Some(n)) if aging.is_zero() || promoted(n.0) => (
                    n,
                    TurnKind::New,
                    oldest_continuing.is_some_and(|_| !aging.is_zero()),
                ),
                (None, _) => continue,
            };
            let better = best
                .as_ref()
                .is_none_or(|(finish, first, _)| (start, id) < (*finish, *first));
            if better {
                let pick = Pick {
                    team: team.clone(),
                    kind,
                    id,
                    promoted,
                    moving,
                };
                best = Some((start, id, pick));
            }
        }
        best.map(|(_, _, pick)| pick)
    }

    /// Dequeue `pick` (which [`pick`](Self::pick) just returned; not necessarily the head) and
    /// charge its team `cost / weight` of virtual time.
    pub fn take(&mut self, pick: &Pick, cost: u64, weight: f64, bytes: u64) -> bool {
        let Some(flow) = self.flows.get_mut(&pick.team) else {
            return false;
        };
        let queue = flow.queue(pick.kind);
        let Some(position) = queue.iter().position(|&id| id == pick.id) else {
            return false;
        };
        queue.remove(position);
        let start = match flow.held_back.take() {
            true => flow.finish.max(self.vtime),
            false => flow.finish,
        };
        flow.finish = start + cost as f64 / weight;
        self.vtime = self.vtime.max(start);
        self.queued = self.queued.saturating_sub(1);
        self.queued_bytes = self.queued_bytes.saturating_sub(bytes);
        true
    }

    /// Correct `team`'s virtual time by `delta_tokens` (actual minus estimated cost).
    pub fn recharge(&mut self, team: &str, delta_tokens: f64, weight: f64) {
        if let Some(flow) = self.flows.get_mut(team) {
            flow.finish += delta_tokens / weight;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn band() -> BandQueue {
        BandQueue::new(BandSpec::new("b", 0))
    }

    /// `q`'s next request when every team is eligible, every request placeable, all arrived
    /// at once, turn-first off and no session activity known.
    fn next(q: &BandQueue) -> Option<Pick> {
        let now = Instant::now();
        q.pick(
            |_| Some(now),
            |_| true,
            Duration::ZERO,
            |_| Placeable::Now,
            |_| Warmth::Unknown,
        )
    }

    /// Dispatch everything, one request at a time, returning (team, id) in order.
    fn drain(
        q: &mut BandQueue,
        costs: &HashMap<u64, u64>,
        weights: &HashMap<&str, f64>,
    ) -> Vec<(String, u64)> {
        let now = Instant::now();
        let mut order = Vec::new();
        while let Some(pick) = q.pick(
            |_| Some(now),
            |_| true,
            Duration::from_secs(60),
            |_| Placeable::Now,
            |_| Warmth::Unknown,
        ) {
            assert!(q.take(&pick, costs[&pick.id], weights[pick.team.as_str()], 0));
            order.push((pick.team, pick.id));
        }
        assert_eq!(q.queued, 0);
        order
    }

    #[test]
    fn a_backlogged_team_keeps_its_credit_through_a_requeue_an_idle_one_earns_none() {
        let mut q = band();
        let take = |q: &mut BandQueue, team: &str, id: u64, cost: u64| {
            let pick = Pick {
                team: team.into(),
                kind: TurnKind::New,
                id,
                promoted: false,
                moving: false,
            };
            assert!(q.take(&pick, cost, 1.0, 0));
        };
        // a runs one request estimated at 5,000 tokens while b runs three of 1,000; a's used
        // 10, so a is owed: its next request (id 3) starts well below the band's time.
        q.push(1, "a", TurnKind::New, 0);
        take(&mut q, "a", 1, 5000);
        q.push(3, "a", TurnKind::New, 0);
        for id in [2, 4, 5] {
            q.push(id, "b", TurnKind::New, 0);
            take(&mut q, "b", id, 1000);
        }
        q.push(6, "b", TurnKind::New, 0);
        q.recharge("a", -4990.0, 1.0);
        assert_eq!((q.flows["a"].finish, q.vtime), (10.0, 2000.0));
        // A reload empties and refills the queues: a stays owed.
        q.clear();
        q.push(3, "a", TurnKind::New, 0);
        q.push(6, "b", TurnKind::New, 0);
        q.requeued();
        assert_eq!(q.flows["a"].finish, 10.0);
        // A team idle at the reload (c) starts at the band's time when it comes back.
        q.flows.entry("c".into()).or_default().finish = 5.0;
        q.clear();
        q.requeued();
        q.push(7, "c", TurnKind::New, 0);
        assert_eq!(q.flows["c"].finish, 2000.0);
    }

    #[test]
    fn equal_weights_split_tokens_not_requests() {
        let mut q = band();
        let mut costs = HashMap::new();
        // Team a sends 100-token requests, team b 300-token ones; both backlogged.
        for id in 0..40 {
            let (team, cost) = if id % 2 == 0 { ("a", 100) } else { ("b", 300) };
            q.push(id, team, TurnKind::New, 0);
            costs.insert(id, cost);
        }
        let weights = HashMap::from([("a", 1.0), ("b", 1.0)]);
        let order = drain(&mut q, &costs, &weights);
        // While both are backlogged, a gets three requests per one of b.
        let first: Vec<&str> = order[..12].iter().map(|(t, _)| t.as_str()).collect();
        let a = first.iter().filter(|t| **t == "a").count();
        assert_eq!(a, 9, "{first:?}");
    }

    #[test]
    fn an_idle_team_earns_no_credit() {
        let mut q = band();
        for id in 0..10 {
            q.push(id, "a", TurnKind::New, 0);
        }
        for _ in 0..10 {
            let pick = next(&q).unwrap();
            q.take(&pick, 100, 1.0, 0);
        }
        // b arrives after a has been served alone: it starts at the band's virtual time and
        // alternates with a instead of getting ten requests in a row.
        for id in 10..20 {
            q.push(id, "a", TurnKind::New, 0);
        }
        for id in 20..30 {
            q.push(id, "b", TurnKind::New, 0);
        }
        let mut teams = Vec::new();
        for _ in 0..4 {
            let pick = next(&q).unwrap();
            q.take(&pick, 100, 1.0, 0);
            teams.push(pick.team);
        }
        assert_eq!(teams.iter().filter(|t| *t == "b").count(), 2, "{teams:?}");
    }

    #[test]
    fn remove_and_ineligible_teams() {
        let mut q = band();
        let now = Instant::now();
        q.push(1, "a", TurnKind::New, 10);
        q.push(2, "b", TurnKind::Continuing, 20);
        assert_eq!(q.queued_bytes, 30);
        assert!(!q.remove(2, "b", TurnKind::New, 20));
        assert!(q.remove(2, "b", TurnKind::Continuing, 20));
        assert_eq!((q.queued, q.queued_bytes), (1, 10));
        assert!(q
            .pick(
                |_| Some(now),
                |t| t != "a",
                Duration::ZERO,
                |_| Placeable::Now,
                |_| Warmth::Unknown
            )
            .is_none());
        let pick = next(&q).unwrap();
        assert_eq!(pick.id, 1);
        // A stale pick is not taken.
        let stale = Pick {
            id: 9,
            ..pick.clone()
        };
        assert!(!q.take(&stale, 1, 1.0, 0));
        assert!(q.take(&pick, 1, 1.0, 10));
        assert_eq!((q.queued, q.queued_bytes), (0, 0));
    }
}
