//! The [`Picker`] seam and the baseline policies.
//!
//! - [`RoundRobin`]: the next endpoint in turn, as a plain Kubernetes Service or generic proxy
//!   would spread requests; blind to load and to caches.
//! - [`LeastLoaded`]: the endpoint with the fewest requests this gateway has in flight there
//!   (ties: fewer in-flight prompt tokens, then random). Blind to caches.
//!
//! Both skip endpoints the request already failed on (`PickRequest::exclude`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::endpoint::Endpoint;
use crate::prefix_index::PrefixIndex;

/// What a picker may look at besides the endpoints.
#[derive(Debug, Default)]
pub struct PickRequest<'a> {
    /// Endpoint indexes already tried (and failed) for this request.
    pub exclude: &'a [usize],
    /// Chunk hashes of the rendered prompt, when the picker uses a prefix index.
    pub prefix: Option<&'a [u64]>,
}

/// Chooses the endpoint that serves a request.
pub trait Picker: Send + Sync + std::fmt::Debug {
    /// Index into `endpoints`, or None when every endpoint is excluded.
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<usize>;

    /// The prefix index this picker scores with, if any (the caller then hashes prompts).
    fn prefix_index(&self) -> Option<&PrefixIndex> {
        None
    }

    /// Whether `endpoint` is too loaded to keep taking a pinned session's turns (sticky until
    /// crowded). Pickers without a notion of crowding never say so.
    fn crowded(&self, _endpoints: &[Arc<Endpoint>], _endpoint: usize) -> bool {
        false
    }

    /// The request was sent to `endpoint`.
    fn routed(&self, _endpoint: usize, _request: &PickRequest<'_>) {}

    /// The request sent to `endpoint` completed; the engine served `cached_tokens` from cache.
    fn completed(&self, _endpoint: usize, _prefix: &[u64], _cached_tokens: u64) {}
}

/// One of `tied` chosen uniformly at random (the tie-break of every max-score picker).
pub(crate) fn random_choice(tied: &[usize]) -> Option<usize> {
    match tied.len() {
        0 => None,
        1 => Some(tied[0]),
        n => Some(tied[fastrand::usize(..n)]),
    }
}

/// Round robin over the endpoints not yet tried.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Picker for RoundRobin {
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<usize> {
        let n = endpoints.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .find(|i| !request.exclude.contains(i))
    }
}

/// Fewest in-flight requests, then fewest in-flight tokens, then random.
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Picker for LeastLoaded {
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<usize> {
        let mut best: Vec<usize> = Vec::new();
        let mut best_load = (u64::MAX, u64::MAX);
        for (i, ep) in endpoints.iter().enumerate() {
            if request.exclude.contains(&i) {
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
        random_choice(&best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                Arc::new(Endpoint::new(
                    format!("p/{i}"),
                    format!("http://127.0.0.1:{}", 9000 + i),
                ))
            })
            .collect()
    }

    #[test]
    fn round_robin_cycles_and_skips_excluded() {
        let rr = RoundRobin::default();
        let e = eps(3);
        let picks: Vec<_> = (0..6)
            .map(|_| rr.pick(&e, &PickRequest::default()).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        for _ in 0..6 {
            assert_ne!(
                rr.pick(
                    &e,
                    &PickRequest {
                        exclude: &[1],
                        prefix: None
                    }
                )
                .unwrap(),
                1
            );
        }
        assert_eq!(
            rr.pick(
                &e,
                &PickRequest {
                    exclude: &[0, 1, 2],
                    prefix: None
                }
            ),
            None
        );
        assert_eq!(rr.pick(&[], &PickRequest::default()), None);
    }

    #[test]
    fn least_loaded_follows_in_flight_work() {
        let e = eps(3);
        let _a = e[0].begin(10, 10);
        let _b = e[1].begin(10, 10);
        let _c = e[1].begin(10, 10);
        assert_eq!(LeastLoaded.pick(&e, &PickRequest::default()), Some(2));
        let _d = e[2].begin(1000, 1000);
        // 0 and 2 both have one request; 0 has fewer tokens.
        assert_eq!(LeastLoaded.pick(&e, &PickRequest::default()), Some(0));
        assert_eq!(
            LeastLoaded.pick(
                &e,
                &PickRequest {
                    exclude: &[0],
                    prefix: None
                }
            ),
            Some(2)
        );
        assert_eq!(
            LeastLoaded.pick(
                &e,
                &PickRequest {
                    exclude: &[0, 1, 2],
                    prefix: None
                }
            ),
            None
        );
    }

    #[test]
    fn least_loaded_breaks_ties_randomly() {
        let e = eps(4);
        let mut seen = [false; 4];
        for _ in 0..200 {
            seen[LeastLoaded.pick(&e, &PickRequest::default()).unwrap()] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }
}
