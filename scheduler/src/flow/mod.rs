//! Multi-team flow control: who waits, and in which order, when the fleet is full.
//!
//! The operator writes the policy down ([`FlowConfig`]): priority bands ([`BandSpec`]) and
//! teams ([`TeamSpec`]) with a default band, the bands they may use, a weight and limits. The
//! gateway maps the API key to a team, asks [`FlowController::admit`] before routing, and holds
//! the returned [`Permit`] until the response ends.
//!
//! # Admission
//!
//! [`FlowController::admit`] takes a [`Ticket`] through these steps, in order:
//!
//! 1. **Band.** The requested band (or the team's default) is checked by
//!    [`FlowConfig::band_for`]: a team may ask for a lower band than its default among its
//!    allowed bands, never a higher one ([`Rejection::BandNotAllowed`]). Background responses
//!    use [`FlowConfig::background_band`], the team's lowest.
//! 2. **Shedding.** If the band is `sheddable` and the [`CapacitySignal`] says the pool cannot
//!    take work, the request is refused at once ([`Rejection::Shed`]) with probability
//!    `p(saturation)` from the [`ShedCurve`] (default: always). While the pool can take work,
//!    nothing is shed, also when the band waits only because of a higher band's reserve (the
//!    pool has room; the request queues). Shedding comes before rate limiting so a retry storm during saturation
//!    neither spends the team's budget nor loads a shared store. For the same reason, while the
//!    pool takes no work, a request whose band's waiting requests already fill its caps is
//!    refused here ([`Rejection::QueueFull`]), before it is charged.
//! 3. **Rate limits.** The team's requests- and tokens-per-minute buckets are charged through
//!    the [`RateLimiter`] ([`Rejection::RateLimited`]); see [`rate_limit`] for the GCRA.
//! 4. **Queue.** The request joins its band's queue and dispatch runs at once, so an idle pool
//!    admits without waiting. If it is still queued and the band holds more than
//!    `max_queued` requests or `max_queued_bytes` bytes, it is refused
//!    ([`Rejection::QueueFull`]); a band with `max_queued = 0` dispatches or refuses. The byte
//!    cap never refuses a request that would wait alone (one larger than the cap could
//!    otherwise never wait).
//! 5. **Wait.** The future resolves with a [`Permit`] when the request is dispatched, or with
//!    [`Rejection::Timeout`] when its band's `queue_ttl` passes. The TTL is a timer in the
//!    future itself, so the answer comes at the TTL, not at the next dispatch. Dropping the
//!    future (client gone) takes the request out of the queue.
//!
//! # Dispatch
//!
//! Dispatch runs whenever a request arrives, a permit is released, the configuration changes,
//! the gateway calls [`FlowController::notify`] (after a metrics scrape) or a request held for
//! its endpoint has waited another `pin_wait`, and dispatches
//! while [`CapacitySignal::can_dispatch`] says yes:
//!
//! - **Between bands, strict priority.** The highest-priority band with a dispatchable request
//!   goes first. A request is dispatchable unless its team is at `max_concurrent` (counted
//!   over all bands, with the team's requests at the other gateways in front of the pool as
//!   last exchanged, [`FlowController::set_peer_teams`]; its last free slot is left for a
//!   while to an older request of the team waiting at another gateway); a band whose waiting teams are all at their cap does not hold back lower
//!   bands. A lower band can wait as long as higher bands stay backlogged: its TTL bounds that
//!   wait.
//! - **Within a band, weighted fair queuing across teams**, start-time fair queuing over
//!   tokens. Each band keeps a virtual time `V`; each team `i` in it a tag `F_i`; a request's
//!   cost `c` is its estimated tokens (input + max output), `w_i` the team's weight:
//!
//!   ```text
//!   a request arrives and team i had none queued:  F_i = max(F_i, V)
//!   next team:        the team with queued requests and the smallest F_i (ties: earliest arrival)
//!   dispatch cost c:  S = F_i;  V = max(V, S);  F_i = S + c / w_i
//!   Permit::finish(a): F_i = F_i + (a - c) / w_i      (actual tokens replace the estimate)
//!   ```
//!
//!   While teams `i` and `j` both stay backlogged, `|T_i / w_i - T_j / w_j|` (tokens dispatched
//!   since) stays below `c_max,i / w_i + c_max,j / w_j`: dispatched tokens split by weight,
//!   whatever each team offers, and a team that sends ten times more only queues more. A team
//!   that was idle starts at `V` (no saved-up credit), and so does one whose requests waited
//!   only because its own `max_concurrent` held them back while others were served.
//! - **Within a team, turn-first with aging.** At arrival a request is a *continuing* turn or
//!   a *new* session ([`TurnKind`]): if the controller has seen its session, it is continuing
//!   iff that session had a request in flight within `turn_window` (in flight now, or finished
//!   at most `turn_window` ago: its KV cache is likely warm); a session never seen here (first
//!   turn, another replica served it, restart) or no session at all falls back to
//!   [`Ticket::continuing`]. Continuing turns get a head start of `aging`: the team's next
//!   request is a continuing turn (the warmest, next bullet), unless its next new session
//!   arrived at least `aging` before that turn: then the new session goes (counted as
//!   promoted). So a
//!   continuing turn overtakes only the new sessions that arrived less than `aging` before it,
//!   including while it waits for its own endpoint (next bullets: a new session that could be
//!   placed elsewhere still waits behind it),
//!   and no new session waits more than `aging` behind arrival order, however long the queue
//!   (a rule on time waited alone would stop favouring continuing turns as soon as queue waits
//!   exceed `aging`). `aging = 0` gives plain arrival order.
//!
//!   With [`FlowConfig::aging_follows_wait`] the head start is `H = max(aging, k·W)`, `W` the
//!   band's typical queue wait (a moving average of dispatched requests' waits, weight 1/16)
//!   and `k` = 2 (`HEAD_START_WAITS`). A fixed head start stops mattering once waits
//!   are many times longer than it. With `H` tied to the wait, a new session waits about
//!   `W_n = W_c + k·W` where continuing turns wait `W_c`. The queue is work-conserving, so the
//!   order moves waits between the two kinds but not their mean: with a share `p` of continuing
//!   turns, `W = p·W_c + (1-p)·W_n`, hence
//!
//!   ```text
//!   W_c = W · (1 - k·(1-p))        W_c / W_n = (1 - k(1-p)) / (1 + k·p)     (k(1-p) < 1)
//!   ```
//!
//!   and `W_c` near 0 (continuing turns simply go first) when `k(1-p) >= 1`. With `k = 1` the
//!   ratio is `p / (1 + p)`, which reaches the 1/2 a "half as long" goal allows as `p -> 1`
//!   (agent traffic is nearly all continuing turns); `k = 2` gives `(2p - 1) / (2p + 1)`, at
//!   most 1/3. Nothing starves: `W` is bounded by the load (the order does not change it), and
//!   a new session waits at most `H = k·W` behind arrival order.
//!   The team's fair-queuing tag does not depend on which of its requests goes, so this order
//!   never changes the team's share.
//! - **Warmest first within a kind.** Among a team's placeable requests of one kind, the one
//!   whose session was active most recently (its last turn dispatched or finished here) goes
//!   first (`queue::Warmth`): its context is the likeliest to still be in the engine's prefix
//!   cache, which evicts least recently used blocks. A request that has waited the head start
//!   `H` goes before any of them, in arrival order, so none waits much more than `H` behind
//!   arrival order; requests of sessions not seen here come after the known ones, in arrival
//!   order. With `aging = 0` the order is arrival order. This matters once the contexts of the
//!   sessions on an endpoint exceed its KV cache and work waits in the gateway (see
//!   [`CapacitySignal::has_room`]'s `kv_bound`): served in arrival order, each turn would find
//!   its context evicted by those served since its last turn; warmest first, the sessions
//!   whose contexts are cached keep being served from cache while the others wait.
//! - **Across gateways.** Several controllers (one per gateway) in front of the same
//!   endpoints can act as one queue: each publishes what it holds for lack of room
//!   ([`FlowController::held`]) and the sessions it served ([`FlowController::recent_activity`]),
//!   takes in the others' activity ([`FlowController::note_activity`]: a session served
//!   elsewhere is active and warm here too), and a pinned turn that could take an endpoint's
//!   room leaves it to a turn held elsewhere that outranks it ([`HeldTurn::outranks`]), for at
//!   most [`CapacitySignal::yield_limit`] ([`CapacitySignal::warmer_elsewhere`]). The gateway
//!   carries this through its store (`agentgate::exchange`).
//! - **Below a reserve, per endpoint.** In a band with a reserve above it, a request without
//!   an endpoint of its own is placeable only while [`CapacitySignal::has_room`] finds some
//!   endpoint below the band's line (more than this dispatch round already sent to such
//!   endpoints), so the reserve holds on every endpoint rather than only over the pool.
//! - **Turns wait for their endpoint.** A request whose session is pinned to an endpoint
//!   ([`Ticket::affinity`]) in a band without a reserve of its own is placeable only while
//!   [`CapacitySignal::has_room`] says that endpoint can take one more request of the band (leaving
//!   the reserves of the bands above it free there, and counting what this dispatch round already
//!   sent it). An unplaceable request is passed over, and the next placeable one in the same order
//!   goes (looking at most `PLACEABLE_SCAN` = 32 deep into each turn kind of each team), until it
//!   has been passed over for [`FlowConfig::pin_wait`]. From then on it may move to another
//!   endpoint with room: fair queuing still picks the team a free slot serves (a team whose
//!   sessions are all pinned to busy endpoints is not starved by one whose sessions sit where the
//!   room is), and within the team a turn whose cache is on the endpoint goes before one that would
//!   move. Its permit says so ([`Permit::outwaited_pin`]) so that routing places it on an endpoint
//!   with room for its band, breaking its pin as for a saturated endpoint. Holding first is better
//!   on both counts than either alternative: dispatched to a full endpoint, the turn queues in the
//!   engine (where bands no longer apply) while another endpoint idles, or takes the slots a higher
//!   band's reserve keeps there, so that band's pinned sessions lose their endpoint; moved at once,
//!   it recomputes its whole context though a slot on its own endpoint is usually a few seconds
//!   away. `pin_wait` bounds the hold, so a session whose endpoint stays full (more sessions pinned
//!   there than it serves) moves, as the sticky-until-saturated rule wants; the engine's own queue
//!   would never show that saturation while the gateway holds the turns.
//!
//! # Permits, cancellation, leaks
//!
//! A queued request holds a oneshot sender; its `admit` future holds the receiver and a guard
//! that removes the request from the queue when the future is dropped. Answers are sent after
//! the controller's lock is released; a permit whose receiver is already gone comes back and is
//! released at once, dispatching the next request in its place. Dropping a [`Permit`] (or
//! [`Permit::finish`]) frees its slot and its team's `max_concurrent` slot and dispatches. No
//! path keeps a slot without a live permit.
//!
//! # Reconfiguration
//!
//! [`FlowController::reconfigure`] validates the new configuration and swaps it in under the
//! lock, keeping every queued request in arrival order and with the deadline it was admitted
//! with. A request stays in its band if its team may still use it and otherwise moves to the
//! team's default band; requests of removed teams are answered with
//! [`Rejection::TeamRemoved`]. Virtual times and counters of bands kept by name survive.
//! Queue caps apply to new arrivals only, so moved requests are never dropped for them.
//!
//! # Metrics
//!
//! [`FlowController::snapshot`] returns, per band, the queue depth and bytes, dispatched,
//! shed, rate-limited, queue-full, timed-out and cancelled counters and a wait-time histogram
//! ([`WAIT_BUCKETS_SECONDS`]); per team, queued, in flight, dispatched requests and tokens,
//! shed, rate-limited, queue-full, timed-out and cancelled, and a wait-time histogram; and
//! wait histograms of continuing turns and new sessions.

mod capacity;
mod config;
mod controller;
mod metrics;
mod queue;
pub mod rate_limit;
mod rejection;

pub use capacity::{CapacitySignal, FlowLoad, MaxInFlight};
pub use config::{BandSpec, ConfigError, FlowConfig, ShedCurve, TeamSpec};
pub use controller::{FlowController, PeerTeam, Permit, Ticket, MAX_REQUEST_TOKENS};
pub use metrics::{
    BandSnapshot, FlowSnapshot, TeamSnapshot, TurnWaits, WaitHistogram, WAIT_BUCKETS_SECONDS,
};
pub use queue::{HeldTurn, TurnKind, Warmth};
pub use rate_limit::{
    LocalRateLimiter, Quota, RateCharge, RateCheck, RateCost, RateKind, RateLimited, RateLimiter,
    RateLimits, RateStatus,
};
pub use rejection::{QueueLimit, Rejection};

#[cfg(test)]
mod tests;
