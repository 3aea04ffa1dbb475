//! Filters: the first stage of a scoring pipeline, deciding which endpoints may take a request.
//!
//! A [`Filter`] narrows the candidate list (positions in the pool's endpoint list) in place.
//! The pipeline runs, in order:
//!
//! 1. [`Available`]: healthy and not retired;
//! 2. [`NotExcluded`]: not already tried (and failed) for this request;
//! 3. [`RoleMatch`]: of the role the request asks for, when it asks for one;
//! 4. [`PreferUnsaturated`]: drop saturated endpoints (stale or missing metrics where metrics
//!    are expected, a full engine queue, a full KV cache with requests waiting; see
//!    [`Saturation::saturated`]) *unless every candidate is saturated*, in which case all stay:
//!    saturation steers work away from an endpoint while there is somewhere else to go, and
//!    admission control (not the picker) decides whether to queue or shed when there is not;
//! 5. [`PreferFreeSlot`]: when the request asks for a free slot
//!    ([`PickRequest::free_slot_below`]), drop endpoints where this gateway already has that
//!    many requests in flight, unless every candidate has. A request of a band with a reserve
//!    finds the capacity held for it on an endpoint that can start it at once, instead of in
//!    the queue of an engine whose batch is full; a request of a band below a reserve finds an
//!    endpoint below its band's line ([`PickRequest::prefilling_below`] also counts requests
//!    still prefilling there). A pin on a dropped endpoint breaks as for a saturated one.
//!    A request without a pin on an available endpoint (a new session) that asks for KV room
//!    ([`PickRequest::kv_working_set_below`]) also drops endpoints whose working set has
//!    reached that share of their KV capacity: flow control let it go because some endpoint
//!    was below that line, and placed on one that is not it would take the room that
//!    endpoint's waiting turns are held for. Pinned requests are not dropped for it: flow
//!    control held them for their own endpoint.
//! 6. [`SpreadReserved`]: a new session (no pin on a candidate) of a band with a reserve
//!    ([`PickRequest::spread_window`]) keeps only the endpoints with the fewest of those bands'
//!    turns routed lately, within [`SPREAD_SLACK`]. A reserve is a share of each endpoint's
//!    slots, so it holds a band's bursts only if the band's sessions are spread; placed by
//!    prefix and load alone, a team's chat sessions (one shared system prompt, short requests
//!    that barely register as load beside agents filling every batch slot) all land on the
//!    replica that cached the prompt first: 29 of 30 in `agentgate-bench run --workload mixed
//!    --replicas 2`, whose turns then overflowed that replica's reserve and moved, recomputing
//!    their history, while the other replica's reserve sat idle. Recomputing a new session's
//!    shared prompt elsewhere costs one prefill of it; later turns stay pinned.
//!
//! Every filter sees the same [`PoolView`], taken once per pick, so they agree with each other
//! and with the scorers about each endpoint's load report.

use std::sync::Arc;
use tokio::time::Instant;

use crate::picker::Pinned;

use crate::endpoint::{Endpoint, LoadReport, Saturation};
use crate::picker::PickRequest;

/// One pick's view of the pool: the endpoints, the request, the time, and each endpoint's
/// load report read once.
#[derive(Debug, Clone, Copy)]
pub struct PoolView<'a> {
    /// The pool's endpoints; candidates are positions in this list.
    pub endpoints: &'a [Arc<Endpoint>],
    /// The request being placed.
    pub request: &'a PickRequest<'a>,
    /// When the pick happens (for metrics staleness).
    pub now: Instant,
    /// `endpoints[i].load_report()`, read once per pick.
    pub reports: &'a [Option<LoadReport>],
}

impl PoolView<'_> {
    /// Requests this gateway has in flight on the endpoint at `position` (0 if out of range).
    pub fn in_flight_requests(&self, position: usize) -> u64 {
        self.endpoints
            .get(position)
            .map_or(0, |e| e.in_flight_requests())
    }

    /// Requests in flight on the endpoint at `position` from every gateway, as far as this one
    /// can tell: its own count now plus the other gateways' at the last scrape
    /// ([`LoadReport::others_in_flight`]). With one gateway this is its own count.
    pub fn fleet_in_flight(&self, position: usize) -> u64 {
        let others = self
            .report(position)
            .map_or(0, LoadReport::others_in_flight);
        self.in_flight_requests(position).saturating_add(others)
    }

    /// Pending prefill tokens on the endpoint at `position` (0 if out of range).
    pub fn pending_prefill_tokens(&self, position: usize) -> u64 {
        self.endpoints
            .get(position)
            .map_or(0, |e| e.pending_prefill_tokens())
    }

    /// The load report of the endpoint at `position`, if any.
    pub fn report(&self, position: usize) -> Option<&LoadReport> {
        self.reports.get(position).and_then(Option::as_ref)
    }

    /// Requests waiting in the engine's queue at `position` per its last report (0 without one).
    pub fn engine_waiting(&self, position: usize) -> f64 {
        self.report(position).map_or(0.0, |r| r.waiting).max(0.0)
    }

    /// Whether the endpoint at `position` is saturated under `limits`.
    pub fn saturated(&self, position: usize, limits: &Saturation) -> bool {
        limits.saturated(self.report(position), self.now)
    }
}

/// Keeps or drops candidates.
pub trait Filter: Send + Sync + std::fmt::Debug {
    /// Name for logs and configuration.
    fn name(&self) -> &'static str;

    /// Remove from `candidates` (positions in `view.endpoints`) the endpoints that may not
    /// take the request.
    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>);
}

/// Healthy and not retired.
#[derive(Debug, Default, Clone, Copy)]
pub struct Available;

impl Filter for Available {
    fn name(&self) -> &'static str {
        "available"
    }

    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>) {
        candidates.retain(|&i| view.endpoints.get(i).is_some_and(|e| e.is_available()));
    }
}

/// Not in [`PickRequest::exclude`].
#[derive(Debug, Default, Clone, Copy)]
pub struct NotExcluded;

impl Filter for NotExcluded {
    fn name(&self) -> &'static str {
        "not_excluded"
    }

    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>) {
        if !view.request.exclude.is_empty() {
            candidates.retain(|i| !view.request.exclude.contains(i));
        }
    }
}

/// Of [`PickRequest::role`], when set.
#[derive(Debug, Default, Clone, Copy)]
pub struct RoleMatch;

impl Filter for RoleMatch {
    fn name(&self) -> &'static str {
        "role"
    }

    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>) {
        if let Some(role) = view.request.role {
            candidates.retain(|&i| view.endpoints.get(i).is_some_and(|e| e.role == role));
        }
    }
}

/// Drops saturated endpoints while at least one candidate is not saturated; with every one
/// saturated, drops those whose metrics are stale while one is not (the figures of a stale
/// report may show an engine idle that is overloaded), except the request's pinned endpoint
/// (the pin rule weighs it against the others).
#[derive(Debug, Clone, Copy)]
pub struct PreferUnsaturated {
    /// What counts as saturated.
    pub limits: Saturation,
}

impl Filter for PreferUnsaturated {
    fn name(&self) -> &'static str {
        "prefer_unsaturated"
    }

    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>) {
        if candidates.iter().any(|&i| !view.saturated(i, &self.limits)) {
            candidates.retain(|&i| !view.saturated(i, &self.limits));
            return;
        }
        let stale = |i: usize| {
            self.limits.stale(view.report(i), view.now) && view.request.pinned != Pinned::At(i)
        };
        if candidates.iter().any(|&i| !stale(i)) {
            candidates.retain(|&i| !stale(i));
        }
    }
}

/// Drops endpoints without a free slot for the request ([`PickRequest::free_slot_below`]),
/// with too many requests prefilling ([`PickRequest::prefilling_below`]) or, for a request
/// not pinned to an endpoint, with a full KV working set
/// ([`PickRequest::kv_working_set_below`]), while at least one candidate passes them all.
#[derive(Debug, Clone, Copy, Default)]
pub struct PreferFreeSlot;

impl Filter for PreferFreeSlot {
    fn name(&self) -> &'static str {
        "prefer_free_slot"
    }

    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>) {
        let (slots, prefilling) = (view.request.free_slot_below, view.request.prefilling_below);
        let kv = view
            .request
            .kv_working_set_below
            .filter(|_| !pinned_candidate(view, candidates));
        if slots.is_none() && prefilling.is_none() && kv.is_none() {
            return;
        }
        let endpoint = |i: usize| view.endpoints.get(i);
        let free = |i: usize| {
            slots.is_none_or(|limit| view.in_flight_requests(i) < limit)
                && prefilling.is_none_or(|limit| {
                    endpoint(i).is_some_and(|e| e.prefilling_requests() < limit)
                })
                && kv.is_none_or(|share| endpoint(i).is_some_and(|e| e.kv_working_set_below(share)))
        };
        if candidates.iter().any(|&i| free(i)) {
            candidates.retain(|&i| free(i));
        }
    }
}

/// Whether the request is pinned to one of `candidates`: a pin whose endpoint is unavailable,
/// excluded (the request failed there) or gone places the request as a new session's.
fn pinned_candidate(view: &PoolView<'_>, candidates: &[usize]) -> bool {
    matches!(view.request.pinned, Pinned::At(p) if candidates.contains(&p))
}

/// How many more recent reserved turns than the least an endpoint may count and still be kept
/// by [`SpreadReserved`]: within one turn is even enough for the scorers to choose by prefix
/// and load.
pub const SPREAD_SLACK: f64 = 1.0;

/// Spreads new sessions of bands with a reserve (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct SpreadReserved;

impl Filter for SpreadReserved {
    fn name(&self) -> &'static str {
        "spread_reserved"
    }

    fn filter(&self, view: &PoolView<'_>, candidates: &mut Vec<usize>) {
        let Some(window) = view.request.spread_window else {
            return;
        };
        if pinned_candidate(view, candidates) {
            return;
        }
        let recent: Vec<f64> = candidates
            .iter()
            .map(|&i| {
                view.endpoints
                    .get(i)
                    .map_or(f64::INFINITY, |e| e.recent_reserved_turns(view.now, window))
            })
            .collect();
        let least = recent.iter().copied().fold(f64::INFINITY, f64::min);
        if least.is_finite() {
            let mut counts = recent.into_iter();
            candidates.retain(|_| counts.next().is_some_and(|n| n <= least + SPREAD_SLACK));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Role;
    use std::time::Duration;

    /// Endpoints `p/0` .. `p/{n-1}` in slots `0..n`.
    fn endpoints(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| Arc::new(Endpoint::new(format!("p/{i}"), "http://x").with_slot(i)))
            .collect()
    }

    /// What `filter` keeps of all of `endpoints` for `request` at `now` (no load reports).
    fn kept(
        filter: &dyn Filter,
        endpoints: &[Arc<Endpoint>],
        request: &PickRequest<'_>,
        now: Instant,
    ) -> Vec<usize> {
        let reports = vec![None; endpoints.len()];
        let view = PoolView {
            endpoints,
            request,
            now,
            reports: &reports,
        };
        let mut candidates: Vec<usize> = (0..endpoints.len()).collect();
        filter.filter(&view, &mut candidates);
        candidates
    }

    #[test]
    fn filters_drop_unavailable_excluded_and_wrong_role() {
        let endpoints: Vec<Arc<Endpoint>> = (0..5)
            .map(|i| {
                let role = if i == 4 { Role::Decode } else { Role::Both };
                let ep = Endpoint::new(format!("p/{i}"), "http://x").with_slot(i);
                Arc::new(ep.with_role(role))
            })
            .collect();
        endpoints[1].set_healthy(false);
        endpoints[2].retire();
        let request = PickRequest {
            exclude: &[3],
            role: Some(Role::Both),
            ..PickRequest::default()
        };
        let reports = vec![None; endpoints.len()];
        let view = PoolView {
            endpoints: &endpoints,
            request: &request,
            now: Instant::now(),
            reports: &reports,
        };
        let mut candidates: Vec<usize> = (0..7).collect(); // 5 and 6 do not exist
        Available.filter(&view, &mut candidates);
        assert_eq!(candidates, [0, 3, 4]);
        NotExcluded.filter(&view, &mut candidates);
        assert_eq!(candidates, [0, 4]);
        RoleMatch.filter(&view, &mut candidates);
        assert_eq!(candidates, [0]);
    }

    #[test]
    fn saturated_endpoints_are_dropped_only_while_another_is_not() {
        let now = Instant::now();
        let endpoints = endpoints(3);
        let report = |waiting| LoadReport {
            at: now,
            waiting,
            running: 1.0,
            kv_usage: Some(0.5),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        };
        let filter = PreferUnsaturated {
            limits: Saturation {
                max_waiting: 8.0,
                max_kv_usage: 0.98,
                staleness: Some(Duration::from_secs(5)),
            },
        };
        let request = PickRequest::default();
        // 0: queue full; 1: fine; 2: never scraped (stale).
        let reports = vec![Some(report(8.0)), Some(report(1.0)), None];
        let view = PoolView {
            endpoints: &endpoints,
            request: &request,
            now,
            reports: &reports,
        };
        let mut candidates = vec![0, 1, 2];
        filter.filter(&view, &mut candidates);
        assert_eq!(candidates, [1]);
        // Without 1, everything left is saturated: the one the gateway can see into goes
        // first (2's figures, were there any, would be guesses).
        let mut candidates = vec![0, 2];
        filter.filter(&view, &mut candidates);
        assert_eq!(candidates, [0]);
        // Unless 2 is the request's pinned endpoint: the pin rule weighs it.
        let pinned = PickRequest {
            pinned: Pinned::At(2),
            ..PickRequest::default()
        };
        let mut candidates = vec![0, 2];
        filter.filter(
            &PoolView {
                request: &pinned,
                ..view
            },
            &mut candidates,
        );
        assert_eq!(candidates, [0, 2]);
        // Everything stale (the scraper is down): keep it all.
        let all_stale = vec![None, None, None];
        let mut candidates = vec![0, 1, 2];
        filter.filter(
            &PoolView {
                reports: &all_stale,
                ..view
            },
            &mut candidates,
        );
        assert_eq!(candidates, [0, 1, 2]);
        assert_eq!(view.engine_waiting(0), 8.0);
        assert_eq!(view.engine_waiting(2), 0.0);
        assert_eq!(view.engine_waiting(9), 0.0);
    }

    #[test]
    fn a_request_asking_for_a_free_slot_skips_full_endpoints_while_one_has_room() {
        let endpoints = endpoints(3);
        let mut running: Vec<_> = [0, 0, 1, 2, 2]
            .iter()
            .map(|&i| endpoints[i].begin(10, 10))
            .collect();
        let keep_both = |free_slot_below: Option<u64>, prefilling_below: Option<u64>| {
            let request = PickRequest {
                free_slot_below,
                prefilling_below,
                ..PickRequest::default()
            };
            kept(&PreferFreeSlot, &endpoints, &request, Instant::now())
        };
        let keep = |free_slot_below| keep_both(free_slot_below, None);
        assert_eq!(keep(Some(2)), [1]);
        assert_eq!(keep(Some(3)), [0, 1, 2]);
        assert_eq!(keep(Some(1)), [0, 1, 2], "all full: all stay");
        assert_eq!(keep(None), [0, 1, 2]);
        // Endpoint 1's request got its first token: below 1 prefilling, only 1 passes; with a
        // free slot below 2 as well, still only 1.
        running[2].prefill_done();
        let keep_prefilling =
            |prefilling_below, free_slot_below| keep_both(free_slot_below, prefilling_below);
        assert_eq!(keep_prefilling(Some(1), None), [1]);
        assert_eq!(keep_prefilling(Some(1), Some(2)), [1]);
        assert_eq!(
            keep_prefilling(Some(2), Some(3)),
            [1],
            "0 and 2 have 2 prefilling"
        );
    }

    #[test]
    fn a_request_without_a_pin_skips_endpoints_with_a_full_kv_working_set() {
        let endpoints = endpoints(3);
        for e in &endpoints {
            e.set_kv_capacity_tokens(1_000);
        }
        // Working sets 700, 300 and 700 tokens of 1,000 (endpoint 2's prompts share 600).
        let _held: Vec<_> = [(0, 7), (1, 3), (2, 6), (2, 7)]
            .iter()
            .map(|&(i, chunks)| {
                let mut guard = endpoints[i].begin(100 * chunks, 0);
                guard.hold_prompt(&(0..chunks).collect::<Vec<u64>>(), 100);
                guard
            })
            .collect();
        assert_eq!(endpoints[2].working_set_tokens(), 700);
        let keep = |share: Option<f64>, pinned: Pinned| {
            let request = PickRequest {
                kv_working_set_below: share,
                pinned,
                ..PickRequest::default()
            };
            kept(&PreferFreeSlot, &endpoints, &request, Instant::now())
        };
        assert_eq!(keep(Some(0.6), Pinned::None), [1]);
        assert_eq!(keep(Some(0.8), Pinned::None), [0, 1, 2]);
        assert_eq!(
            keep(Some(0.2), Pinned::None),
            [0, 1, 2],
            "all full: all stay"
        );
        assert_eq!(keep(None, Pinned::None), [0, 1, 2]);
        // A pinned request was let through for its own endpoint: the pin decides.
        assert_eq!(keep(Some(0.6), Pinned::At(0)), [0, 1, 2]);
        // One whose endpoint is gone looks for room like a new session.
        assert_eq!(keep(Some(0.6), Pinned::Gone), [1]);
        // So does one pinned to an endpoint it may not go to (unhealthy, or failed there).
        let request = PickRequest {
            kv_working_set_below: Some(0.6),
            pinned: Pinned::At(0),
            exclude: &[0],
            ..PickRequest::default()
        };
        let view = PoolView {
            endpoints: &endpoints,
            request: &request,
            now: Instant::now(),
            reports: &[None, None, None],
        };
        let mut candidates = vec![0, 1, 2];
        NotExcluded.filter(&view, &mut candidates);
        PreferFreeSlot.filter(&view, &mut candidates);
        assert_eq!(candidates, [1]);
    }

    #[test]
    fn new_sessions_of_reserved_bands_go_where_fewest_such_turns_were_routed() {
        let endpoints = endpoints(3);
        let (now, window) = (Instant::now(), std::time::Duration::from_secs(60));
        for (i, turns) in [3, 1, 2].into_iter().enumerate() {
            for _ in 0..turns {
                endpoints[i].note_reserved_turn(now, window);
            }
        }
        let keep = |spread_window, pinned| {
            let request = PickRequest {
                spread_window,
                pinned,
                ..PickRequest::default()
            };
            kept(&SpreadReserved, &endpoints, &request, now)
        };
        assert_eq!(
            keep(Some(window), Pinned::None),
            [1, 2],
            "within one turn of the least"
        );
        assert_eq!(keep(None, Pinned::None), [0, 1, 2], "not a reserved band");
        assert_eq!(
            keep(Some(window), Pinned::At(0)),
            [0, 1, 2],
            "pinned: the pin rule judges"
        );
        // a minute later the counts have decayed to within one turn of each other
        let later = |e: &Endpoint| e.recent_reserved_turns(now + 2 * window, window);
        assert!(later(&endpoints[0]) - later(&endpoints[1]) < SPREAD_SLACK);
    }
}
