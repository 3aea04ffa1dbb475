//! The exchange: what the gateways in front of the same pools tell each other, through the
//! store, so that together they hold work back and order it as one gateway would.
//!
//! # Why
//!
//! Flow control keeps each engine's KV working set under `[flow] max_kv_working_set` and
//! lets the held turns go warmest first (`crate::flow`). Each gateway sees its own requests,
//! though, and clients spread a session's turns over the gateways (a load balancer in front
//! of them picks any). Without the exchange each gateway knows the others' KV only from the
//! engines' scraped usage (a scrape old), and releases room to the warmest turn *it* holds: when
//! a turn of session S ends on gateway A, A fills the room at once from its own queue, while
//! S's next turn, the warmest of all, may be waiting on gateway B. On the `agentic` benchmark
//! with turns alternating between two gateways, that cost one to two points of captured
//! reuse against one gateway (seed 2).
//!
//! # What
//!
//! Every `[flow] exchange_interval_ms` (default 100; 0: off) the gateway writes one state per
//! pool on the pool's board in the store and reads the others' back in the same round trip
//! ([`Store::exchange`]; Redis: one script over one hash, see `agentgate_sessions::exchange`).
//! A state carries, per endpoint of the pool (named by its engine's URL, which every gateway
//! agrees on, not by its name: configured endpoints are named by their position in the list,
//! which a rolling config change can shift between gateways):
//!
//! - `working_set`: this gateway's KV working set there (`Endpoint::working_set_tokens`), and
//!   `in_flight`, its requests there;
//! - `held`: of the turns it holds for that endpoint because it had no room (pinned turns of
//!   bands without a reserve, passed over by a dispatch round, of teams below their
//!   `max_concurrent`), the one that goes first (`FlowController::held`): its band's
//!   `priority`, and `aged` (waited out its head start) or `idle_ms`, how long ago its session
//!   was last active;
//!
//! `sessions`: the sessions it dispatched or finished a turn of within the last ten intervals,
//! with how long ago (`FlowController::recent_activity`; keys over 1 KiB are left out); and
//! `teams`: each team's requests in flight and waiting there, and its oldest waiting request:
//! how long it has waited, and its name (`<gateway>/<entry id>`; `FlowController::team_load`).
//!
//! From the others' fresh states (published within the last ten intervals, or a second if
//! that is longer, on the store's clock):
//!
//! - each endpoint's peer working set and requests in flight are their sums
//!   (`Endpoint::set_peers`): the KV line counts that working set with this gateway's own, and
//!   the engine's scraped usage then stands in only for requests no gateway accounts for;
//! - each endpoint's first held turn elsewhere is kept for
//!   [`PoolCapacity`](crate::flow::PoolCapacity): a pinned turn here that could take room
//!   there but is outranked by it (`HeldTurn::outranks`: a higher band, else warmer) leaves
//!   the room, for at most four intervals in all, to the gateway that holds it, which sees the
//!   room at its next exchange;
//! - their sessions' activity counts here as if their turns had run here
//!   (`FlowController::note_activity`): warmth and "continuing" follow a session across
//!   gateways;
//! - each team's requests in flight there count toward its `max_concurrent` here, and when
//!   its requests waiting there would take all its free room, a slot that frees here is left,
//!   for at most four intervals per request, to an older one of them
//!   (`FlowController::set_peer_teams`): the gateways hold one team to one cap and serve its
//!   requests about oldest first wherever they wait. Each counts
//!   the others' requests as of their last publication, so gateways admitting at the same
//!   moment can pass the cap together, by at most a cap each.
//!
//! The same round also shares the gateway's routing decisions with the others through the
//! pool's route feed, so each gateway's prefix index learns where every gateway sent which
//! prompt ([`crate::route_feed`]).
//!
//! Instants travel as ages ("how long ago") measured by the publisher, plus the state's age
//! measured by the store, so the gateways' clocks need not agree; the reader counts them back
//! from the middle of its round trip to the store, which errs by half that round trip at
//! most.
//!
//! A failed exchange clears what came from the others (peer working sets, held turns, team
//! counts): each gateway then falls back to the engines' scraped usage, its own queue and its
//! own team counts, as with the exchange off. A gateway shutting down publishes an empty state. With one gateway the board
//! holds only its own state and nothing changes; with an in-memory store of its own (no other
//! gateway can read it) the exchange does not run. Gateways of one process handed one
//! in-memory store (`MemoryStore::shared_in_process`) exchange through it as through Redis.
//! The interval is read at start; every gateway in front of the same pools should use the
//! same one (a state is read while it is younger than ten of the reader's intervals, or a
//! second).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use agentgate_scheduler::flow::{HeldTurn, PeerTeam, Warmth};
use agentgate_sessions::{PeerState, Store};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::app::AppState;
use crate::pools::Pool;
use crate::route_feed;

/// States older than this many intervals (and than [`MIN_FRESH`]) are not read.
const FRESH_INTERVALS: u32 = 10;

/// States are read for at least this long, so a gateway whose exchanges are late by a few
/// intervals (a busy machine) still counts.
const MIN_FRESH: Duration = Duration::from_secs(1);

/// How long another gateway's state is read, for an exchange every `every`.
fn fresh_for(every: Duration) -> Duration {
    (every * FRESH_INTERVALS).max(MIN_FRESH)
}

/// A session's activity is published for this many intervals: every other gateway reads it
/// unless its exchanges stall that long. Three were measured worse on the two-gateway
/// benchmark, where the interval is 20 ms of wall time on a busy machine.
const ACTIVITY_INTERVALS: u32 = 10;

/// Longest a turn leaves room to a warmer one elsewhere, in intervals.
const YIELD_INTERVALS: u32 = 4;

/// Longest session key published; longer keys (which no agent sends) stay local.
const MAX_SESSION_KEY_BYTES: usize = 1024;

/// Least time between two warnings about failing exchanges.
const WARN_EVERY: Duration = Duration::from_secs(30);

/// Whether a warning whose last one went out at `last` is due (at most one per
/// [`WARN_EVERY`]); if so, it is noted as sent now.
fn warning_due(last: &mut Option<Instant>) -> bool {
    let now = Instant::now();
    if last.is_some_and(|at| now.duration_since(at) < WARN_EVERY) {
        return false;
    }
    *last = Some(now);
    true
}

/// One gateway's state for one pool, as published.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
struct Published {
    #[serde(default)]
    endpoints: Vec<EndpointState>,
    #[serde(default)]
    sessions: Vec<SessionSeen>,
    /// Teams with requests in flight or waiting at this gateway.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    teams: Vec<TeamLoad>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct TeamLoad {
    name: String,
    #[serde(default)]
    in_flight: u64,
    /// Its requests waiting there.
    #[serde(default, skip_serializing_if = "is_zero")]
    waiting: u64,
    /// How long its oldest request waiting there had waited at publication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    waiting_ms: Option<u64>,
    /// That request's name, the same for as long as it waits (`<gateway>/<entry id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    oldest: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct EndpointState {
    name: String,
    working_set: u64,
    #[serde(default)]
    in_flight: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    held: Option<Held>,
}

/// The turn a gateway holds for an endpoint that goes first there.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
struct Held {
    /// Its band's priority.
    priority: i32,
    /// It waited out its head start.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    aged: bool,
    /// Otherwise its session was last active this many milliseconds before publication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    idle_ms: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct SessionSeen {
    key: String,
    idle_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What the other gateways published for one pool, merged, as of one exchange.
#[derive(Debug, Default)]
struct Peers {
    /// Endpoint name -> the others' working set and requests in flight there, summed.
    working_set: HashMap<String, (u64, u64)>,
    /// Endpoint name -> the turn the others hold for it that goes first.
    held: HashMap<String, HeldTurn>,
    /// Session -> when it was last active at another gateway.
    sessions: HashMap<String, Instant>,
    /// Team -> its requests in flight at the others, summed, and its oldest waiting there.
    teams: HashMap<String, PeerTeam>,
}

/// The instant `ms` milliseconds plus `age` before `now`; `None` when the clock cannot
/// represent it (then the activity is too old to matter).
fn ago(now: Instant, age: Duration, ms: u64) -> Option<Instant> {
    now.checked_sub(age.saturating_add(Duration::from_millis(ms)))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// This gateway's state: `working_set` per endpoint, `held` from its queue, `sessions` it
/// served recently, `teams` with requests in flight, all as of `now`.
fn publish(
    endpoints: impl IntoIterator<Item = (String, u64, u64)>,
    held: &HashMap<String, HeldTurn>,
    sessions: Vec<(String, Instant)>,
    teams: Vec<(String, PeerTeam)>,
    now: Instant,
) -> Published {
    Published {
        teams: teams
            .into_iter()
            .map(|(name, team)| TeamLoad {
                name,
                in_flight: team.in_flight,
                waiting: team.waiting,
                waiting_ms: team
                    .oldest_waiting
                    .as_ref()
                    .map(|(at, _)| millis(now.saturating_duration_since(*at))),
                oldest: team.oldest_waiting.map(|(_, key)| key),
            })
            .collect(),
        endpoints: endpoints
            .into_iter()
            .map(|(name, working_set, in_flight)| {
                let held = held.get(&name).and_then(|turn| {
                    let (aged, idle_ms) = match turn.warmth {
                        Warmth::Aged => (true, None),
                        Warmth::Since(at) => {
                            (false, Some(millis(now.saturating_duration_since(at))))
                        }
                        Warmth::Unknown => return None,
                    };
                    Some(Held {
                        priority: turn.priority,
                        aged,
                        idle_ms,
                    })
                });
                EndpointState {
                    name,
                    working_set,
                    in_flight,
                    held,
                }
            })
            .collect(),
        sessions: sessions
            .into_iter()
            .filter(|(key, _)| key.len() <= MAX_SESSION_KEY_BYTES)
            .map(|(key, at)| SessionSeen {
                key,
                idle_ms: millis(now.saturating_duration_since(at)),
            })
            .collect(),
    }
}

/// Merge the others' states read at `now`; unreadable states are skipped.
fn merge(states: &[PeerState], now: Instant) -> Peers {
    let mut peers = Peers::default();
    for peer in states {
        let Ok(published) = serde_json::from_str::<Published>(&peer.state) else {
            continue;
        };
        for e in published.endpoints {
            let sum = peers.working_set.entry(e.name.clone()).or_insert((0, 0));
            sum.0 = sum.0.saturating_add(e.working_set);
            sum.1 = sum.1.saturating_add(e.in_flight);
            let Some(held) = e.held else {
                continue;
            };
            let warmth = match (held.aged, held.idle_ms) {
                (true, _) => Warmth::Aged,
                (false, Some(ms)) => match ago(now, peer.age, ms) {
                    Some(at) => Warmth::Since(at),
                    None => continue,
                },
                (false, None) => continue,
            };
            HeldTurn {
                priority: held.priority,
                warmth,
            }
            .keep_first(&mut peers.held, &e.name);
        }
        for t in published.teams {
            let sum = peers.teams.entry(t.name).or_insert(PeerTeam {
                in_flight: 0,
                waiting: 0,
                oldest_waiting: None,
            });
            sum.in_flight = sum.in_flight.saturating_add(t.in_flight);
            sum.waiting = sum.waiting.saturating_add(t.waiting);
            let at = t.waiting_ms.and_then(|ms| ago(now, peer.age, ms));
            if let (Some(at), Some(key)) = (at, t.oldest) {
                if sum.oldest_waiting.as_ref().is_none_or(|(o, _)| at < *o) {
                    sum.oldest_waiting = Some((at, key));
                }
            }
        }
        for s in published.sessions {
            let Some(at) = ago(now, peer.age, s.idle_ms) else {
                continue;
            };
            let latest = peers.sessions.entry(s.key).or_insert(at);
            *latest = (*latest).max(at);
        }
    }
    peers
}

/// The background task exchanging state for every pool.
pub struct Exchange {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Exchange {
    /// Start exchanging every `[flow] exchange_interval_ms` under the id `gateway`; `None`
    /// when the interval is 0 or no other gateway can read the store (an in-memory store not
    /// shared in process).
    pub fn start(state: &Arc<AppState>, gateway: String) -> Option<Exchange> {
        let every = Duration::from_millis(state.config.flow.exchange_interval_ms);
        if every.is_zero() || !state.store.is_shared() {
            return None;
        }
        state.flow.set_yield_limit(every * YIELD_INTERVALS);
        for pool in state.pools.all() {
            if pool.picker.prefix_index().is_some() {
                pool.routes.enable();
            }
        }
        let (stop, mut rx) = watch::channel(false);
        let state = state.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_warning: Option<Instant> = None;
            let mut last_feed_warning: Option<Instant> = None;
            // Each pool's position in its route feed.
            let mut cursors: HashMap<String, Option<u64>> = HashMap::new();
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = rx.changed() => {
                        leave(&state, &gateway, every).await;
                        return;
                    }
                }
                for pool in state.pools.all() {
                    let cursor = cursors.entry(pool.name.clone()).or_default();
                    // Independent round trips: neither waits on the other.
                    let (shared, exchanged) = tokio::join!(
                        route_feed::share(&state, pool, &gateway, cursor),
                        exchange_pool(&state, pool, &gateway, every)
                    );
                    if let Err(e) = shared {
                        if warning_due(&mut last_feed_warning) {
                            tracing::warn!(
                                pool = %pool.name,
                                "sharing routing decisions with the other gateways failed: \
                                 {e}; until it works again, this gateway's prefix index learns \
                                 only from its own"
                            );
                        }
                    }
                    if let Err(e) = exchanged {
                        if warning_due(&mut last_warning) {
                            tracing::warn!(
                                pool = %pool.name,
                                "exchange with the other gateways failed: {e}; until it \
                                 works again, other gateways' KV counts only as the engines \
                                 report it"
                            );
                        }
                    }
                }
            }
        });
        Some(Exchange { stop, task })
    }

    /// Stop the task and wait for it.
    pub async fn shutdown(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
    }
}

/// Publish an empty state for every pool, so the others stop counting this gateway's work at
/// once rather than when its last state goes stale. Best effort, a second at most per pool.
async fn leave(state: &AppState, gateway: &str, every: Duration) {
    let empty = serde_json::to_string(&Published::default()).unwrap_or_default();
    for pool in state.pools.all() {
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            state
                .store
                .exchange(&pool.name, gateway, &empty, fresh_for(every)),
        )
        .await;
    }
}

/// One exchange for `pool`: publish, read, apply. On a store error what came from the others
/// is cleared before the error is returned.
async fn exchange_pool(
    state: &AppState,
    pool: &Pool,
    gateway: &str,
    every: Duration,
) -> Result<(), String> {
    let Some(controller) = state.flow.controller(&pool.name) else {
        return Ok(());
    };
    let fresh = fresh_for(every);
    let now = Instant::now();
    let endpoints = pool.endpoints();
    // Endpoints go on the board by their engine's URL, as flow control knows them.
    let held: HashMap<String, HeldTurn> = controller.held();
    let published = publish(
        endpoints.iter().map(|e| {
            (
                e.base_url.clone(),
                e.working_set_tokens(),
                e.in_flight_requests(),
            )
        }),
        &held,
        controller.recent_activity(now.checked_sub(every * ACTIVITY_INTERVALS).unwrap_or(now)),
        controller
            .team_load()
            .into_iter()
            .map(|(team, mut load)| {
                // Keys name the request among all the gateways'.
                load.oldest_waiting = load
                    .oldest_waiting
                    .map(|(at, id)| (at, format!("{gateway}/{id}")));
                (team, load)
            })
            .collect(),
        now,
    );
    let body = serde_json::to_string(&published).map_err(|e| e.to_string())?;
    let read = state
        .store
        .exchange(&pool.name, gateway, &body, fresh)
        .await;
    // Ages were measured at the store, between sending and receiving: read them from the
    // middle of the round trip.
    let now = now + Instant::now().saturating_duration_since(now) / 2;
    let peers = match &read {
        Ok(states) => merge(states, now),
        Err(_) => Peers::default(),
    };
    let mut changed = !peers.held.is_empty() || !peers.sessions.is_empty();
    for e in endpoints.iter() {
        let (tokens, in_flight) = peers
            .working_set
            .get(&e.base_url)
            .copied()
            .unwrap_or((0, 0));
        changed |= tokens != e.peer_working_set_tokens();
        e.set_peers(tokens, in_flight);
    }
    let held = endpoints
        .iter()
        .filter_map(|e| Some((e.base_url.clone(), *peers.held.get(&e.base_url)?)))
        .collect();
    changed |= state.flow.set_peers_held(&pool.name, held);
    changed |= controller.set_peer_teams(peers.teams);
    controller.note_activity(peers.sessions);
    // Alone on the board nothing changed: dispatch rounds stay paced by this gateway's own
    // arrivals, releases and scrapes.
    if changed {
        controller.notify();
    }
    read.map(drop).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(priority: i32, warmth: Warmth) -> HeldTurn {
        HeldTurn { priority, warmth }
    }

    #[test]
    fn a_published_state_reads_back_as_instants_on_the_readers_clock() {
        let now = Instant::now() + Duration::from_secs(100);
        let ours = HashMap::from([
            (
                "p/0".to_string(),
                held(0, Warmth::Since(now - Duration::from_millis(1_500))),
            ),
            ("p/1".to_string(), held(0, Warmth::Aged)),
            ("p/2".to_string(), held(0, Warmth::Unknown)),
        ]);
        let long = "x".repeat(MAX_SESSION_KEY_BYTES + 1);
        let published = publish(
            [
                ("p/0".into(), 640, 2),
                ("p/1".into(), 0, 0),
                ("p/2".into(), 64, 1),
            ],
            &ours,
            vec![("s1".into(), now - Duration::from_millis(200)), (long, now)],
            vec![(
                "team-a".into(),
                PeerTeam {
                    in_flight: 2,
                    waiting: 3,
                    oldest_waiting: Some((now - Duration::from_millis(700), "g1/7".into())),
                },
            )],
            now,
        );
        let body = serde_json::to_string(&published).unwrap();
        assert_eq!(
            body,
            r#"{"endpoints":[{"name":"p/0","working_set":640,"in_flight":2,"held":{"priority":0,"idle_ms":1500}},{"name":"p/1","working_set":0,"in_flight":0,"held":{"priority":0,"aged":true}},{"name":"p/2","working_set":64,"in_flight":1}],"sessions":[{"key":"s1","idle_ms":200}],"teams":[{"name":"team-a","in_flight":2,"waiting":3,"waiting_ms":700,"oldest":"g1/7"}]}"#
        );
        // Three peers: this one 300 ms old; one holding a colder turn for p/0 and a turn of a
        // higher band for p/1 (which goes first even against an aged one); one unreadable.
        let other = r#"{"endpoints":[{"name":"p/0","working_set":100,"in_flight":1,"held":{"priority":0,"idle_ms":9000}},{"name":"p/1","working_set":5,"held":{"priority":10,"idle_ms":60000}}],"sessions":[{"key":"s1","idle_ms":50}],"teams":[{"name":"team-a","in_flight":1,"waiting":1,"waiting_ms":5000,"oldest":"g2/3"},{"name":"team-b","in_flight":4}]}"#;
        let read_at = now + Duration::from_millis(10);
        let peers = merge(
            &[
                PeerState {
                    age: Duration::from_millis(300),
                    state: body,
                },
                PeerState {
                    age: Duration::ZERO,
                    state: other.into(),
                },
                PeerState {
                    age: Duration::ZERO,
                    state: "not json".into(),
                },
            ],
            read_at,
        );
        assert_eq!(peers.working_set["p/0"], (740, 3));
        assert_eq!(peers.working_set["p/1"], (5, 0), "in_flight defaults to 0");
        assert_eq!(peers.working_set["p/2"], (64, 1));
        assert_eq!(
            peers.teams,
            HashMap::from([
                (
                    "team-a".to_string(),
                    PeerTeam {
                        in_flight: 3,
                        waiting: 4,
                        oldest_waiting: Some((
                            read_at - Duration::from_millis(5_000),
                            "g2/3".to_string()
                        )),
                    }
                ),
                (
                    "team-b".to_string(),
                    PeerTeam {
                        in_flight: 4,
                        waiting: 0,
                        oldest_waiting: None
                    }
                )
            ]),
            "in flight summed; the oldest waiting request of either"
        );
        assert_eq!(
            peers.held["p/0"],
            held(0, Warmth::Since(read_at - Duration::from_millis(1_800))),
            "the warmer of the two, aged by the state's age"
        );
        assert_eq!(
            peers.held["p/1"],
            held(10, Warmth::Since(read_at - Duration::from_millis(60_000)))
        );
        assert!(!peers.held.contains_key("p/2"));
        assert_eq!(
            peers.sessions["s1"],
            read_at - Duration::from_millis(50),
            "the latest activity anywhere"
        );
        assert_eq!(peers.sessions.len(), 1, "over-long keys are not published");
        // Activity too old to represent is dropped, never taken as recent.
        let ancient = r#"{"sessions":[{"key":"old","idle_ms":18446744073709551615}]}"#;
        let peers = merge(
            &[PeerState {
                age: Duration::ZERO,
                state: ancient.into(),
            }],
            read_at,
        );
        assert!(peers
            .sessions
            .get("old")
            .is_none_or(|at| *at + Duration::from_secs(3600) < read_at));
    }
}
