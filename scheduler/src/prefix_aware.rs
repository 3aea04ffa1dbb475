//! The `prefix` policy: send a request where its prompt's prefix is cached, unless that
//! endpoint is crowded; place cold prompts by load.
//!
//! For a request whose rendered prompt has chunk hashes `h` (see [`crate::prefix_index`]), each
//! candidate endpoint `e` gets
//!
//! ```text
//! match(e) = leading chunks of h held by e / len(h)                       in [0, 1]
//! load(e)  = 1 - in_flight(e) / (max_in_flight + 1)                         in (0, 1]
//! score(e) = w_prefix * match(e) * uncrowded(e) + w_load * load(e)
//! uncrowded(e) = 1 if in_flight(e) <= herd_factor * mean_in_flight + herd_slack, else 0
//! ```
//!
//! with defaults `w_prefix = 2`, `w_load = 1`, `herd_factor = 1.5`, `herd_slack = 2`. A full
//! prefix match outweighs any load difference until its endpoint is crowded (anti-herding: a
//! burst of requests sharing one prefix — sub-agent fan-out, a team's system prompt — spills to
//! the least-loaded endpoints instead of piling onto the one that holds it). Cold prompts
//! (`match = 0` everywhere) go to the least-loaded endpoint, random among ties, so distinct
//! prefixes spread over the fleet and its caches fill evenly. The index is updated with the
//! prompt's chunks when a request is routed: once the engine has run it, it holds all of them,
//! whatever it reported as cached beforehand (a cold first turn reports 0 and then holds the
//! whole prompt), so completion does not shrink the index. Evictions are modelled by each
//! endpoint's LRU capacity, sized from the engine's reported KV capacity.

use std::sync::Arc;

use crate::endpoint::Endpoint;
use crate::picker::{random_choice, PickRequest, Picker};
use crate::prefix_index::{PrefixIndex, PrefixIndexConfig};

/// Weights and thresholds of the `prefix` policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixWeights {
    /// Weight of the prefix-match term.
    pub prefix: f64,
    /// Weight of the load term.
    pub load: f64,
    /// An endpoint above `herd_factor` x the mean in-flight count (plus `herd_slack`) loses
    /// its prefix bonus.
    pub herd_factor: f64,
    /// Absolute slack added to the crowding threshold, so small fleets are not over-eager.
    pub herd_slack: f64,
}

impl Default for PrefixWeights {
    fn default() -> Self {
        PrefixWeights {
            prefix: 2.0,
            load: 1.0,
            herd_factor: 1.5,
            herd_slack: 2.0,
        }
    }
}

/// Prefix match plus load, over a [`PrefixIndex`] of the pool's endpoints.
#[derive(Debug)]
pub struct PrefixAware {
    index: PrefixIndex,
    weights: PrefixWeights,
}

impl PrefixAware {
    /// A picker for `endpoints` endpoints.
    pub fn new(endpoints: usize, config: PrefixIndexConfig, weights: PrefixWeights) -> Self {
        PrefixAware {
            index: PrefixIndex::new(endpoints, config),
            weights,
        }
    }

    /// Score every candidate (see the module doc); `None` for excluded endpoints.
    pub fn scores(
        &self,
        endpoints: &[Arc<Endpoint>],
        request: &PickRequest<'_>,
    ) -> Vec<Option<f64>> {
        let candidates: Vec<usize> = (0..endpoints.len())
            .filter(|i| !request.exclude.contains(i))
            .collect();
        let mut out = vec![None; endpoints.len()];
        if candidates.is_empty() {
            return out;
        }
        let loads: Vec<u64> = candidates
            .iter()
            .map(|&i| endpoints[i].in_flight_requests())
            .collect();
        let max_load = loads.iter().copied().max().unwrap_or(0) as f64;
        let crowded_above = self.crowded_above(&loads);
        let hashes = request.prefix.unwrap_or(&[]);
        let matches = if hashes.is_empty() {
            vec![0.0; candidates.len()]
        } else {
            self.index.score(hashes, &candidates)
        };
        for (k, &i) in candidates.iter().enumerate() {
            let load = loads[k] as f64;
            let uncrowded = if load <= crowded_above { 1.0 } else { 0.0 };
            let load_score = 1.0 - load / (max_load + 1.0);
            out[i] =
                Some(self.weights.prefix * matches[k] * uncrowded + self.weights.load * load_score);
        }
        out
    }
}

impl PrefixAware {
    /// The in-flight count above which an endpoint counts as crowded, given the candidates'.
    fn crowded_above(&self, loads: &[u64]) -> f64 {
        let mean = if loads.is_empty() {
            0.0
        } else {
            loads.iter().sum::<u64>() as f64 / loads.len() as f64
        };
        self.weights.herd_factor * mean + self.weights.herd_slack
    }
}

impl Picker for PrefixAware {
    fn crowded(&self, endpoints: &[Arc<Endpoint>], endpoint: usize) -> bool {
        let loads: Vec<u64> = endpoints.iter().map(|e| e.in_flight_requests()).collect();
        let limit = self.crowded_above(&loads);
        loads.get(endpoint).is_none_or(|&l| l as f64 > limit)
    }

    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<usize> {
        let scores = self.scores(endpoints, request);
        let best = scores
            .iter()
            .flatten()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = scores
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some_and(|s| (s - best).abs() <= 1e-9))
            .map(|(i, _)| i)
            .collect();
        random_choice(&tied)
    }

    fn prefix_index(&self) -> Option<&PrefixIndex> {
        Some(&self.index)
    }

    fn routed(&self, endpoint: usize, request: &PickRequest<'_>) {
        if let Some(hashes) = request.prefix {
            self.index.record(endpoint, hashes);
        }
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

    fn picker(n: usize) -> PrefixAware {
        PrefixAware::new(n, PrefixIndexConfig::default(), PrefixWeights::default())
    }

    fn hashes(p: &PrefixAware, text: &str) -> Vec<u64> {
        p.index.chunk_hashes("m", text.as_bytes())
    }

    #[test]
    fn a_routed_prefix_comes_back_to_its_endpoint() {
        let e = eps(4);
        let p = picker(4);
        let h = hashes(&p, &"shared system prompt ".repeat(200));
        let first = p
            .pick(
                &e,
                &PickRequest {
                    exclude: &[],
                    prefix: Some(&h),
                },
            )
            .unwrap();
        p.routed(
            first,
            &PickRequest {
                exclude: &[],
                prefix: Some(&h),
            },
        );
        for _ in 0..20 {
            assert_eq!(
                p.pick(
                    &e,
                    &PickRequest {
                        exclude: &[],
                        prefix: Some(&h)
                    }
                ),
                Some(first)
            );
        }
    }

    #[test]
    fn cold_prompts_go_to_the_least_loaded_endpoint() {
        let e = eps(3);
        let p = picker(3);
        let _a = e[0].begin(1, 1);
        let _b = e[2].begin(1, 1);
        let h = hashes(&p, &"never seen before ".repeat(100));
        assert_eq!(
            p.pick(
                &e,
                &PickRequest {
                    exclude: &[],
                    prefix: Some(&h)
                }
            ),
            Some(1)
        );
    }

    #[test]
    fn a_crowded_endpoint_loses_its_prefix_bonus() {
        let e = eps(3);
        let p = picker(3);
        let h = hashes(&p, &"fan-out parent context ".repeat(200));
        p.routed(
            0,
            &PickRequest {
                exclude: &[],
                prefix: Some(&h),
            },
        );
        // Mean in flight 4, threshold 1.5 * 4 + 2 = 8: endpoint 0 with 10 is crowded.
        let _busy: Vec<_> = (0..10).map(|_| e[0].begin(1, 1)).collect();
        let _other: Vec<_> = (0..2).map(|_| e[1].begin(1, 1)).collect();
        assert_eq!(
            p.pick(
                &e,
                &PickRequest {
                    exclude: &[],
                    prefix: Some(&h)
                }
            ),
            Some(2)
        );
        // Below the threshold the prefix still wins over an idle endpoint.
        let e2 = eps(3);
        let _some: Vec<_> = (0..3).map(|_| e2[0].begin(1, 1)).collect();
        assert_eq!(
            p.pick(
                &e2,
                &PickRequest {
                    exclude: &[],
                    prefix: Some(&h)
                }
            ),
            Some(0)
        );
    }

    #[test]
    fn crowding_uses_the_same_threshold_as_scoring() {
        let e = eps(3);
        let p = picker(3);
        assert!(!p.crowded(&e, 0));
        let _busy: Vec<_> = (0..10).map(|_| e[0].begin(1, 1)).collect();
        let _other: Vec<_> = (0..2).map(|_| e[1].begin(1, 1)).collect();
        assert!(p.crowded(&e, 0), "10 > 1.5 * 4 + 2");
        assert!(!p.crowded(&e, 1));
        assert!(p.crowded(&e, 7), "an unknown endpoint is never a good pin");
    }

    #[test]
    fn excluded_endpoints_are_never_picked() {
        let e = eps(2);
        let p = picker(2);
        let h = hashes(&p, &"x ".repeat(500));
        p.routed(
            0,
            &PickRequest {
                exclude: &[],
                prefix: Some(&h),
            },
        );
        assert_eq!(
            p.pick(
                &e,
                &PickRequest {
                    exclude: &[0],
                    prefix: Some(&h)
                }
            ),
            Some(1)
        );
        assert_eq!(
            p.pick(
                &e,
                &PickRequest {
                    exclude: &[0, 1],
                    prefix: Some(&h)
                }
            ),
            None
        );
    }

    #[test]
    fn a_cold_first_turn_reporting_no_cache_still_counts_as_held() {
        let e = eps(2);
        let p = picker(2);
        let h = hashes(&p, &"first turn context ".repeat(300));
        let req = PickRequest {
            exclude: &[],
            prefix: Some(&h),
        };
        p.routed(1, &req);
        p.completed(1, &h, 0);
        assert_eq!(p.pick(&e, &req), Some(1));
    }
}
