//! The [`Picker`] seam, what a pick reports, and the baseline policies.
//!
//! A picker gets the pool's current endpoint list and a [`PickRequest`] and returns a [`Pick`]:
//! the chosen endpoint's position in the list, the deciding [`Reason`], an estimate of the
//! prompt tokens the engine will have to prefill there (for [`Endpoint::begin`]), and what became
//! of the session's pin ([`PinOutcome`]). After sending the request the caller reports
//! [`Picker::routed`], and when the engine has answered, [`Picker::completed`] with the cached
//! token count it reported and the pick's [`Pick::matched_chunks`]; both address the endpoint by its stable [`Endpoint::slot`], so they
//! stay right when the endpoint list changes in between.
//!
//! Baselines (no prefix index, no pins):
//!
//! - [`RoundRobin`]: the next endpoint in turn, as a plain Kubernetes Service or generic proxy
//!   would spread requests; blind to load and to caches.
//! - [`LeastLoaded`]: the endpoint with the fewest requests this gateway has in flight there
//!   (ties: fewer in-flight prompt tokens, then random). Blind to caches.
//!
//! Both skip endpoints that are unavailable (unhealthy or retired), that the request already
//! failed on (`PickRequest::exclude`), or whose role is not the one asked for. The scoring
//! pickers are in [`crate::pipeline`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::endpoint::{Endpoint, Role};
use crate::prefix_index::PrefixIndex;

/// The session's pin, as the caller found it in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pinned {
    /// No pin (no session, a new session, or a policy without pins).
    #[default]
    None,
    /// Pinned to the endpoint at this position in the list passed to [`Picker::pick`].
    At(usize),
    /// Pinned to an endpoint that is no longer in the list.
    Gone,
}

/// What a picker may look at besides the endpoints.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickRequest<'a> {
    /// Positions of the endpoints already tried (and failed) for this request.
    pub exclude: &'a [usize],
    /// Chunk hashes of the rendered prompt (empty when the picker keeps no prefix index).
    pub prefix: &'a [u64],
    /// Estimated prompt tokens.
    pub prompt_tokens: u64,
    /// The session's pin.
    pub pinned: Pinned,
    /// Only endpoints of this role; `None`: any role.
    pub role: Option<Role>,
    /// Prefer endpoints with fewer than this many of this gateway's requests in flight, when
    /// any has (a request of a band with a reserve looks for a free batch slot); `None`: no
    /// preference. Honoured by the scoring pipeline ([`crate::filter::PreferFreeSlot`]).
    pub free_slot_below: Option<u64>,
    /// Prefer endpoints where fewer than this many of this gateway's requests are still
    /// waiting for their first token (a lower band leaving engine step budget to the bands
    /// above, see `[flow] max_prefilling_per_endpoint`); `None`: no preference. Honoured with
    /// `free_slot_below`: an endpoint must pass both.
    pub prefilling_below: Option<u64>,
    /// A request of a band with a reserve, placed by a policy that pins sessions: a new
    /// session (no pin) prefers the endpoints where the fewest such turns were routed lately,
    /// counted with this decay window ([`crate::Endpoint::recent_reserved_turns`]); `None`: no
    /// preference. Honoured by the scoring pipeline ([`crate::filter::SpreadReserved`]).
    pub spread_window: Option<std::time::Duration>,
    /// The request's prompt shares every engine step with the prefills already running there
    /// instead of waiting behind them: a band with a reserve while the bands below it keep few
    /// prompts prefilling per endpoint (`[flow] max_prefilling_per_endpoint`). The pin's wait
    /// rule ([`crate::pin`]), which charges the prefill pending ahead, then does not apply: the
    /// pin breaks only when its endpoint is unavailable, saturated or has no free slot.
    pub prefill_not_queued: bool,
    /// Prefer endpoints whose working set ([`Endpoint::working_set_tokens`]) is below this
    /// share of their KV capacity, when any is, for a request not pinned to an endpoint (a new
    /// session of a band held to `[flow] max_kv_working_set`: flow control dispatched it
    /// because some endpoint was below the line); `None`: no preference. Honoured with
    /// `free_slot_below` ([`crate::filter::PreferFreeSlot`]).
    pub kv_working_set_below: Option<f64>,
}

impl PickRequest<'_> {
    /// Whether the endpoint at `position` may take this request: available (healthy, not
    /// retired), not excluded, and of the requested role.
    pub fn admits(&self, endpoint: &Endpoint, position: usize) -> bool {
        endpoint.is_available()
            && !self.exclude.contains(&position)
            && self.role.is_none_or(|r| r == endpoint.role)
    }
}

/// Why the chosen endpoint won.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The session's pin held.
    Pin,
    /// Its cached prefix of the prompt.
    Prefix,
    /// Its load (queue depth, KV pressure, in-flight work).
    Load,
    /// Its turn in a round robin.
    RoundRobin,
}

impl Reason {
    /// Name for headers and metric labels: `pin`, `prefix`, `load`, `round_robin`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Pin => "pin",
            Reason::Prefix => "prefix",
            Reason::Load => "load",
            Reason::RoundRobin => "round_robin",
        }
    }
}

/// Why a session's pin broke (see [`crate::pin`] for the rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakCause {
    /// The pinned endpoint is unhealthy, retired, gone from the list, of the wrong role, or
    /// already failed this request.
    Unavailable,
    /// The pinned endpoint is saturated (stale metrics, full engine queue, full KV cache with
    /// requests waiting) while another endpoint is not.
    Saturated,
    /// The estimated wait on the pinned endpoint exceeds the cost of recomputing the prefix on
    /// another one, by more than the hysteresis.
    Wait,
    /// The pin held but the weighted scores preferred another endpoint (only when the
    /// `session_pin` weight is too small to outweigh the other scorers).
    Outscored,
}

impl BreakCause {
    /// Name for metric labels: `unavailable`, `saturated`, `wait`, `outscored`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakCause::Unavailable => "unavailable",
            BreakCause::Saturated => "saturated",
            BreakCause::Wait => "wait",
            BreakCause::Outscored => "outscored",
        }
    }
}

/// What became of the session's pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinOutcome {
    /// There was no pin, or the picker does not use pins.
    None,
    /// The request goes to the pinned endpoint.
    Held,
    /// The request goes elsewhere: the caller re-pins the session and counts the move.
    Broken(BreakCause),
}

impl PinOutcome {
    /// Name for metric labels: `none`, `held`, or the [`BreakCause`] name.
    pub fn as_str(self) -> &'static str {
        match self {
            PinOutcome::None => "none",
            PinOutcome::Held => "held",
            PinOutcome::Broken(cause) => cause.as_str(),
        }
    }
}

/// A picker's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// Position of the chosen endpoint in the list passed to [`Picker::pick`].
    pub index: usize,
    /// The deciding reason.
    pub reason: Reason,
    /// Prompt tokens the engine will probably have to prefill there:
    /// `prompt_tokens * (1 - match fraction)`; the whole prompt without a prefix index. Pass it
    /// to [`Endpoint::begin`].
    pub uncached_tokens_estimate: u64,
    /// What became of the session's pin.
    pub pin: PinOutcome,
    /// Leading chunks of the prompt the prefix index believed the endpoint held (0 without an
    /// index). Pass it back to [`Picker::completed`] with the engine's cached-token report.
    pub matched_chunks: usize,
}

/// Chooses the endpoint that serves a request.
pub trait Picker: Send + Sync + std::fmt::Debug {
    /// The endpoint to use, or None when no endpoint may take the request.
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<Pick>;

    /// The prefix index this picker scores with, if any (the caller then hashes prompts into
    /// [`PickRequest::prefix`], sizes slots from the engines' KV capacity, and clears the slots
    /// of endpoints that go away or restart).
    fn prefix_index(&self) -> Option<&PrefixIndex> {
        None
    }

    /// The request with chunk hashes `prefix` was sent to the endpoint in `slot`.
    fn routed(&self, _slot: usize, _prefix: &[u64]) {}

    /// The request with chunk hashes `prefix`, picked with [`Pick::matched_chunks`] =
    /// `matched_chunks` and sent to the endpoint in `slot`, completed; the engine served
    /// `cached_tokens` of its `prompt_tokens` (0: not reported) from cache. Lets the picker
    /// correct its prefix index.
    fn completed(
        &self,
        _slot: usize,
        _prefix: &[u64],
        _matched_chunks: usize,
        _cached_tokens: u64,
        _prompt_tokens: u64,
    ) {
    }
}

/// One of `tied` chosen uniformly at random (the tie-break of every max-score picker).
pub(crate) fn random_choice(tied: &[usize]) -> Option<usize> {
    match tied.len() {
        0 => None,
        1 => Some(tied[0]),
        n => Some(tied[fastrand::usize(..n)]),
    }
}

/// A pick made without a prefix index or pins.
fn baseline(index: usize, reason: Reason, request: &PickRequest<'_>) -> Pick {
    Pick {
        index,
        reason,
        uncached_tokens_estimate: request.prompt_tokens,
        pin: PinOutcome::None,
        matched_chunks: 0,
    }
}

/// Round robin over the endpoints that may take the request: the k-th pick goes to the
/// (k mod m)-th of the m that may, so one that may not (unhealthy, excluded) leaves its share
/// to all the others evenly, not to its next neighbour.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Picker for RoundRobin {
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<Pick> {
        // (One reading of which may: a probe may take one out meanwhile.)
        let admitted: Vec<usize> = (0..endpoints.len())
            .filter(|&i| request.admits(&endpoints[i], i))
            .collect();
        if admitted.is_empty() {
            return None;
        }
        let k = self.next.fetch_add(1, Ordering::Relaxed) % admitted.len();
        Some(baseline(admitted[k], Reason::RoundRobin, request))
    }
}

/// Fewest in-flight requests, then fewest in-flight tokens, then random.
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Picker for LeastLoaded {
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<Pick> {
        let mut best: Vec<usize> = Vec::new();
        let mut best_load = (u64::MAX, u64::MAX);
        for (i, ep) in endpoints.iter().enumerate() {
            if !request.admits(ep, i) {
                continue;
            }
            let load = (ep.in_flight_requests(), ep.in_flight_tokens());
            if load < best_load {
                best_load = load;
                best.clear();
                best.push(i);
            } else if load == best_load {
                best.push(i);
            }
        }
        random_choice(&best).map(|i| baseline(i, Reason::Load, request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Endpoint::new(format!("p/{i}"), format!("http://127.0.0.1:{}", 9000 + i))
                        .with_slot(i),
                )
            })
            .collect()
    }

    fn index(p: Option<Pick>) -> Option<usize> {
        p.map(|p| p.index)
    }

    fn excluding(exclude: &[usize]) -> PickRequest<'_> {
        PickRequest {
            exclude,
            ..PickRequest::default()
        }
    }

    #[test]
    fn round_robin_cycles_and_skips_excluded() {
        let rr = RoundRobin::default();
        let e = eps(3);
        let picks: Vec<_> = (0..6)
            .map(|_| index(rr.pick(&e, &PickRequest::default())).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        // The endpoint left out leaves its share to the others evenly.
        let mut counts = [0; 3];
        for _ in 0..6 {
            counts[index(rr.pick(&e, &excluding(&[1]))).unwrap()] += 1;
        }
        assert_eq!(counts, [3, 0, 3]);
        assert_eq!(rr.pick(&e, &excluding(&[0, 1, 2])), None);
        assert_eq!(rr.pick(&[], &PickRequest::default()), None);
    }

    #[test]
    fn baselines_report_their_reason_and_the_whole_prompt_as_uncached() {
        let e = eps(2);
        let request = PickRequest {
            prompt_tokens: 1234,
            pinned: Pinned::At(1),
            ..PickRequest::default()
        };
        let rr = RoundRobin::default().pick(&e, &request).unwrap();
        assert_eq!(rr.reason.as_str(), "round_robin");
        assert_eq!(rr.uncached_tokens_estimate, 1234);
        assert_eq!(rr.pin, PinOutcome::None, "baselines ignore pins");
        let ll = LeastLoaded.pick(&e, &request).unwrap();
        assert_eq!(ll.reason, Reason::Load);
        assert_eq!(ll.uncached_tokens_estimate, 1234);
    }

    #[test]
    fn baselines_never_pick_unavailable_endpoints_or_the_wrong_role() {
        let e: Vec<Arc<Endpoint>> = vec![
            Arc::new(Endpoint::new("p/0", "http://a").with_slot(0)),
            Arc::new(Endpoint::new("p/1", "http://b").with_slot(1)),
            Arc::new(
                Endpoint::new("p/2", "http://c")
                    .with_slot(2)
                    .with_role(Role::Prefill),
            ),
            Arc::new(Endpoint::new("p/3", "http://d").with_slot(3)),
        ];
        e[0].set_healthy(false);
        e[1].retire();
        let rr = RoundRobin::default();
        let both = PickRequest {
            role: Some(Role::Both),
            ..PickRequest::default()
        };
        for _ in 0..8 {
            assert_eq!(index(rr.pick(&e, &both)), Some(3));
            assert_eq!(index(LeastLoaded.pick(&e, &both)), Some(3));
            let any = index(rr.pick(&e, &PickRequest::default())).unwrap();
            assert!(any == 2 || any == 3, "{any}");
        }
        let prefill = PickRequest {
            role: Some(Role::Prefill),
            ..PickRequest::default()
        };
        assert_eq!(index(LeastLoaded.pick(&e, &prefill)), Some(2));
        e[3].set_healthy(false);
        assert_eq!(rr.pick(&e, &both), None);
        assert_eq!(LeastLoaded.pick(&e, &both), None);
    }

    #[test]
    fn least_loaded_follows_in_flight_work() {
        let e = eps(3);
        let _a = e[0].begin(10, 10);
        let _b = e[1].begin(10, 10);
        let _c = e[1].begin(10, 10);
        assert_eq!(
            index(LeastLoaded.pick(&e, &PickRequest::default())),
            Some(2)
        );
        let _d = e[2].begin(1000, 1000);
        // 0 and 2 both have one request; 0 has fewer tokens.
        assert_eq!(
            index(LeastLoaded.pick(&e, &PickRequest::default())),
            Some(0)
        );
        assert_eq!(index(LeastLoaded.pick(&e, &excluding(&[0]))), Some(2));
        assert_eq!(LeastLoaded.pick(&e, &excluding(&[0, 1, 2])), None);
    }

    #[test]
    fn least_loaded_breaks_ties_randomly() {
        let e = eps(4);
        let mut seen = [false; 4];
        for _ in 0..200 {
            seen[index(LeastLoaded.pick(&e, &PickRequest::default())).unwrap()] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }

    #[test]
    fn names_for_headers_and_metrics() {
        let reasons = [
            Reason::Pin,
            Reason::Prefix,
            Reason::Load,
            Reason::RoundRobin,
        ];
        let names: Vec<_> = reasons.iter().map(|r| r.as_str()).collect();
        assert_eq!(names, ["pin", "prefix", "load", "round_robin"]);
        let outcomes = [
            PinOutcome::None,
            PinOutcome::Held,
            PinOutcome::Broken(BreakCause::Unavailable),
            PinOutcome::Broken(BreakCause::Saturated),
            PinOutcome::Broken(BreakCause::Wait),
            PinOutcome::Broken(BreakCause::Outscored),
        ];
        let names: Vec<_> = outcomes.iter().map(|o| o.as_str()).collect();
        assert_eq!(
            names,
            [
                "none",
                "held",
                "unavailable",
                "saturated",
                "wait",
                "outscored"
            ]
        );
    }
}
