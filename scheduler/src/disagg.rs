//! Prefill/decode disaggregation: whether a request's prompt is prefilled on a prefill endpoint,
//! on which one, and how fast each endpoint prefills.
//!
//! A pool may mix aggregated endpoints (role `both`), prefill endpoints and decode endpoints.
//! The gateway places a request with a prompt of `P` tokens in three steps:
//!
//! 1. **Decode first.** The pool's picker chooses among the endpoints that can decode (roles
//!    `decode` and `both`) as for any request: the session's pin, prefix match, load.
//! 2. **Does remote prefill pay off?** With `m(d)` the prefix-match fraction of the chosen
//!    decode endpoint `d` (from the prefix index),
//!
//!    ```text
//!    uncached(d) = P * (1 - m(d))
//!    remote      = uncached(d) > threshold_tokens  and a prefill endpoint is available
//!    ```
//!
//!    ([`remote_prefill_pays_off`]). Otherwise `d` runs the whole request: a turn appended to
//!    a conversation `d` already holds stays local, a cold long prompt goes to a prefill
//!    endpoint. Below the threshold a prefill fits in a decode engine's chunked-prefill budget
//!    with little effect on the decodes running there, while every remote prefill pays a
//!    second queue, a network hop and a KV transfer. Default [`DEFAULT_THRESHOLD_TOKENS`].
//! 3. **Prefill endpoint** ([`PrefillPicker`]): the one expected to finish the prefill
//!    soonest, by prefix match and load weighed by measured throughput:
//!
//!    ```text
//!    cost(e) = ( pending_prefill_tokens(e)
//!              + queue_penalty_tokens * engine_waiting(e)
//!              + P * (1 - m(e)) ) / rate(e)                      seconds
//!    ```
//!
//!    `rate(e)` is `e`'s measured prefill throughput ([`PrefillThroughput`]); until `e` has
//!    one, the mean measured rate of the other candidates, and with none measured 1 token/s
//!    (the costs are then in tokens, as the decode pipeline's wait rule counts them). Endpoints
//!    on faster hardware therefore take proportionally more work, whatever their labels say.
//!    There is no anti-herding gate: a burst of sub-agents sharing their parent's prefix should
//!    queue their small uncached suffixes where that prefix is cached, and `cost` already
//!    charges the queue there. Unavailable and excluded endpoints are skipped, saturated ones
//!    too while another candidate is not (as [`crate::filter::PreferUnsaturated`]).
//!
//! # The prefill half of a session's pin
//!
//! A session is pinned to a (prefill, decode) pair. The decode half is the session's ordinary
//! pin; the prefill half is stored under [`prefill_pin_key`] and follows the same
//! sticky-until-saturated rule ([`crate::pin`]), stated in time because prefill endpoints may
//! differ in speed. It breaks when its endpoint is unavailable or excluded
//! ([`BreakCause::Unavailable`]), saturated while another candidate is not
//! ([`BreakCause::Saturated`]), or when
//!
//! ```text
//! (cost(pin) - min over other candidates a of cost(a)) * rate(pin) > hysteresis_tokens
//! ```
//!
//! ([`BreakCause::Wait`]): moving must save more than `hysteresis_tokens` of the pinned
//! endpoint's own prefill time. Each half breaks and re-pins independently.
//!
//! # Measured throughput
//!
//! The gateway times prefills it can see: the prefill leg of a disaggregated request, and the
//! first token of a request an endpoint runs whole. One sample is `(tokens, seconds)` with
//! `tokens` the request's uncached prompt tokens plus the pending prefill tokens queued ahead
//! of it on that endpoint when it was sent (the work the engine had to finish before this
//! request's first token), and `seconds` the time until then. The estimate is the ratio of two
//! exponentially weighted moving averages,
//!
//! ```text
//! T <- (1 - alpha) * T + alpha * tokens
//! S <- (1 - alpha) * S + alpha * seconds
//! rate = T / S                                  alpha = 0.2
//! ```
//!
//! so a long prefill weighs more than a short one, and samples under
//! [`PrefillThroughput::MIN_SAMPLE_TOKENS`] (dominated by fixed overheads) are ignored.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use crate::endpoint::{Endpoint, LoadReport, Saturation};
use crate::picker::{random_choice, BreakCause, Pick, PinOutcome, Pinned, Reason};
use crate::pin::PinRule;
use crate::prefix_index::PrefixIndex;

/// Default `threshold_tokens`: remote prefill only above this many uncached prompt tokens.
pub const DEFAULT_THRESHOLD_TOKENS: u64 = 2048;

/// Whether a prompt with `uncached_on_decode` tokens not cached on the chosen decode endpoint
/// is worth prefilling elsewhere: `uncached_on_decode > threshold_tokens`.
pub fn remote_prefill_pays_off(uncached_on_decode: u64, threshold_tokens: u64) -> bool {
    uncached_on_decode > threshold_tokens
}

/// The store key of the prefill half of `session`'s pin. Session keys always start with their
/// kind (`h:`, `pck:`, ...), so the derived key never equals one.
pub fn prefill_pin_key(session: &str) -> String {
    format!("prefill|{session}")
}

/// An endpoint's measured prefill throughput (see the module doc for the estimator).
#[derive(Debug, Default)]
pub struct PrefillThroughput {
    /// `(T, S)`: weighted mean tokens and seconds per sample; None before the first sample.
    state: Mutex<Option<(f64, f64)>>,
}

impl PrefillThroughput {
    /// Weight of a new sample.
    pub const ALPHA: f64 = 0.2;
    /// Samples with fewer tokens than this are ignored.
    pub const MIN_SAMPLE_TOKENS: u64 = 512;

    /// Add a sample: `tokens` of prefill work finished in `elapsed`.
    pub fn observe(&self, tokens: u64, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        if tokens < Self::MIN_SAMPLE_TOKENS || seconds <= 0.0 || seconds.is_nan() {
            return;
        }
        let tokens = tokens as f64;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = Some(match *state {
            None => (tokens, seconds),
            Some((t, s)) => (
                (1.0 - Self::ALPHA) * t + Self::ALPHA * tokens,
                (1.0 - Self::ALPHA) * s + Self::ALPHA * seconds,
            ),
        });
    }

    /// Tokens per second, once a sample has been taken.
    pub fn tokens_per_s(&self) -> Option<f64> {
        let state = *self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .map(|(t, s)| t / s)
            .filter(|r| r.is_finite() && *r > 0.0)
    }
}

/// What the prefill pick looks at.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillRequest<'a> {
    /// Positions (in the list passed to [`PrefillPicker::pick`]) that may not be chosen.
    pub exclude: &'a [usize],
    /// Chunk hashes of the rendered prompt (empty without a prefix index).
    pub prefix: &'a [u64],
    /// Estimated prompt tokens `P`.
    pub prompt_tokens: u64,
    /// The prefill half of the session's pin (or, for a sub-agent, its parent's).
    pub pinned: Pinned,
}

/// Chooses the prefill endpoint of a disaggregated request (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillPicker {
    /// `queue_penalty_tokens` and `hysteresis_tokens`, as for the decode half.
    pub rule: PinRule,
    /// When an endpoint counts as saturated.
    pub saturation: Saturation,
}

/// Relative tolerance within which two costs tie.
const TIE: f64 = 1e-9;

impl PrefillPicker {
    /// The prefill endpoint among `endpoints` (the caller passes only prefill endpoints), or
    /// None when none may take the request. The pick's `uncached_tokens_estimate` is
    /// `P * (1 - m(winner))`; its reason is `pin` when the pin held, `prefix` when the winner
    /// holds the longest prefix of the prompt among the candidates, else `load`.
    pub fn pick(
        &self,
        endpoints: &[Arc<Endpoint>],
        index: Option<&PrefixIndex>,
        request: &PrefillRequest<'_>,
    ) -> Option<Pick> {
        self.pick_at(endpoints, index, request, Instant::now())
    }

    /// [`PrefillPicker::pick`] at a given time (for metrics staleness).
    pub fn pick_at(
        &self,
        endpoints: &[Arc<Endpoint>],
        index: Option<&PrefixIndex>,
        request: &PrefillRequest<'_>,
        now: Instant,
    ) -> Option<Pick> {
        let reports: Vec<Option<LoadReport>> = endpoints.iter().map(|e| e.load_report()).collect();
        let saturated = |i: usize| self.saturation.saturated(reports[i].as_ref(), now);
        let admits = |i: usize| endpoints[i].is_available() && !request.exclude.contains(&i);
        let mut candidates: Vec<usize> = (0..endpoints.len()).filter(|&i| admits(i)).collect();
        if candidates.iter().any(|&i| !saturated(i)) {
            candidates.retain(|&i| !saturated(i));
        }
        if candidates.is_empty() {
            return None;
        }
        let mut matched: Vec<usize> = match index {
            Some(index) if !request.prefix.is_empty() => {
                let slots: Vec<usize> = candidates.iter().map(|&i| endpoints[i].slot).collect();
                index.match_lens(request.prefix, &slots)
            }
            _ => vec![0; candidates.len()],
        };
        let chunks = request.prefix.len().max(1) as f64;
        let prompt = request.prompt_tokens as f64;
        let measured: Vec<f64> = candidates
            .iter()
            .filter_map(|&i| endpoints[i].prefill_tokens_per_s())
            .collect();
        let fallback_rate = if measured.is_empty() {
            1.0
        } else {
            measured.iter().sum::<f64>() / measured.len() as f64
        };
        let rate = |i: usize| endpoints[i].prefill_tokens_per_s().unwrap_or(fallback_rate);
        let cost = |i: usize, m: usize| -> f64 {
            let waiting = reports[i].map_or(0.0, |r| r.waiting);
            let wait = self
                .rule
                .wait_tokens(endpoints[i].pending_prefill_tokens(), waiting);
            let own = prompt * (1.0 - (m as f64 / chunks).clamp(0.0, 1.0));
            (wait + own) / rate(i)
        };
        let mut costs: Vec<f64> = candidates
            .iter()
            .zip(&matched)
            .map(|(&i, &m)| cost(i, m))
            .collect();

        let mut pin = PinOutcome::None;
        match request.pinned {
            Pinned::None => {}
            Pinned::Gone => pin = PinOutcome::Broken(BreakCause::Unavailable),
            Pinned::At(p) => match candidates.iter().position(|&i| i == p) {
                None => {
                    let cause = if p < endpoints.len() && admits(p) && saturated(p) {
                        BreakCause::Saturated
                    } else {
                        BreakCause::Unavailable
                    };
                    pin = PinOutcome::Broken(cause);
                }
                Some(k) => {
                    let best_other = (0..candidates.len())
                        .filter(|&j| j != k)
                        .map(|j| costs[j])
                        .fold(f64::INFINITY, f64::min);
                    let excess_tokens = (costs[k] - best_other) * rate(p);
                    if excess_tokens > self.rule.hysteresis_tokens {
                        candidates.remove(k);
                        matched.remove(k);
                        costs.remove(k);
                        pin = PinOutcome::Broken(BreakCause::Wait);
                    } else {
                        return Some(Pick {
                            index: p,
                            reason: Reason::Pin,
                            uncached_tokens_estimate: uncached(prompt, matched[k], chunks),
                            pin: PinOutcome::Held,
                            matched_chunks: matched[k],
                        });
                    }
                }
            },
        }
        if candidates.is_empty() {
            return None;
        }
        let best = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let tied: Vec<usize> = (0..candidates.len())
            .filter(|&k| costs[k] <= best + best.abs() * TIE || costs[k] == best)
            .collect();
        let winner = random_choice(&tied).unwrap_or(0);
        let longest = matched.iter().copied().max().unwrap_or(0);
        let reason = if matched[winner] > 0 && matched[winner] == longest {
            Reason::Prefix
        } else {
            Reason::Load
        };
        Some(Pick {
            index: candidates[winner],
            reason,
            uncached_tokens_estimate: uncached(prompt, matched[winner], chunks),
            pin,
            matched_chunks: matched[winner],
        })
    }
}

/// `P * (1 - matched / chunks)`, rounded, at most `P`.
fn uncached(prompt: f64, matched: usize, chunks: f64) -> u64 {
    let m = (matched as f64 / chunks).clamp(0.0, 1.0);
    (prompt * (1.0 - m)).round().max(0.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_index::PrefixIndexConfig;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                let ep = Endpoint::new(format!("p/{i}"), format!("http://127.0.0.1:{}", 9000 + i));
                Arc::new(ep.with_slot(i).with_role(crate::Role::Prefill))
            })
            .collect()
    }

    fn chunks(n: u64) -> Vec<u64> {
        (1..=n).collect()
    }

    fn req(prefix: &[u64], prompt_tokens: u64, pinned: Pinned) -> PrefillRequest<'_> {
        PrefillRequest {
            prefix,
            prompt_tokens,
            pinned,
            ..PrefillRequest::default()
        }
    }

    fn report(at: Instant, waiting: f64) -> LoadReport {
        LoadReport {
            at,
            waiting,
            running: 1.0,
            kv_usage: Some(0.2),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        }
    }

    #[test]
    fn the_threshold_is_strict() {
        assert!(!remote_prefill_pays_off(2048, 2048));
        assert!(remote_prefill_pays_off(2049, 2048));
        assert!(!remote_prefill_pays_off(0, 0));
        assert_eq!(prefill_pin_key("h:abc"), "prefill|h:abc");
    }

    #[test]
    fn throughput_is_a_ratio_of_weighted_means_and_ignores_small_samples() {
        let t = PrefillThroughput::default();
        assert_eq!(t.tokens_per_s(), None);
        t.observe(100, Duration::from_secs(1));
        t.observe(10_000, Duration::ZERO);
        assert_eq!(t.tokens_per_s(), None, "too small, or no time: ignored");
        t.observe(10_000, Duration::from_secs(1));
        assert_eq!(t.tokens_per_s(), Some(10_000.0));
        // T = 0.8 * 10000 + 0.2 * 40000 = 16000; S = 0.8 * 1 + 0.2 * 2 = 1.2.
        t.observe(40_000, Duration::from_secs(2));
        let rate = t.tokens_per_s().unwrap();
        assert!((rate - 16_000.0 / 1.2).abs() < 1e-6, "{rate}");
    }

    #[test]
    fn the_endpoint_holding_the_prefix_wins_however_many_requests_wait_there() {
        let e = eps(3);
        let index = PrefixIndex::new(3, PrefixIndexConfig::default());
        let h = chunks(100);
        index.record(1, &h[..95]);
        // Ten siblings already queued their small suffixes on endpoint 1: no herding gate.
        let _queued: Vec<_> = (0..10).map(|_| e[1].begin(100_000, 5_000)).collect();
        let p = PrefillPicker::default();
        let pick = p
            .pick(&e, Some(&index), &req(&h, 100_000, Pinned::None))
            .unwrap();
        assert_eq!((pick.index, pick.reason), (1, Reason::Prefix));
        assert_eq!(pick.matched_chunks, 95);
        assert_eq!(pick.uncached_tokens_estimate, 5_000);
        // Once its queue costs more than recomputing the prefix elsewhere, load wins.
        let _more: Vec<_> = (0..10).map(|_| e[1].begin(100_000, 5_000)).collect();
        let pick = p
            .pick(&e, Some(&index), &req(&h, 100_000, Pinned::None))
            .unwrap();
        assert_ne!(pick.index, 1);
        assert_eq!(pick.reason, Reason::Load);
    }

    #[test]
    fn measured_throughput_weighs_the_load() {
        let e = eps(2);
        // Same queue on both; endpoint 1 prefills four times as fast.
        let _a = e[0].begin(8_000, 8_000);
        let _b = e[1].begin(8_000, 8_000);
        e[0].observe_prefill(10_000, Duration::from_secs(1));
        e[1].observe_prefill(40_000, Duration::from_secs(1));
        let p = PrefillPicker::default();
        for _ in 0..10 {
            let pick = p.pick(&e, None, &req(&[], 4_000, Pinned::None)).unwrap();
            assert_eq!((pick.index, pick.reason), (1, Reason::Load));
        }
        // Four times the queue on the fast one: (32k + 4k) / 40k = 0.9 s < (8k + 4k) / 10k;
        // six times: (48k + 4k) / 40k = 1.3 s > 1.2 s.
        let _c: Vec<_> = (0..3).map(|_| e[1].begin(8_000, 8_000)).collect();
        assert_eq!(
            p.pick(&e, None, &req(&[], 4_000, Pinned::None))
                .unwrap()
                .index,
            1
        );
        let _d: Vec<_> = (0..2).map(|_| e[1].begin(8_000, 8_000)).collect();
        assert_eq!(
            p.pick(&e, None, &req(&[], 4_000, Pinned::None))
                .unwrap()
                .index,
            0
        );
        // An unmeasured endpoint is assumed to run at the mean of the measured ones.
        let f = eps(3);
        f[0].observe_prefill(10_000, Duration::from_secs(1));
        f[1].observe_prefill(30_000, Duration::from_secs(1));
        let _q0 = f[0].begin(1_000, 1_000);
        let _q1 = f[1].begin(5_000, 5_000);
        let _q2 = f[2].begin(3_000, 3_000);
        // Costs: (1000+1000)/10k = 0.2, (5000+1000)/30k = 0.2, (3000+1000)/20k = 0.2 -> tie;
        // one more token on 0 and 1 leaves 2.
        let _r0 = f[0].begin(1, 1);
        let _r1 = f[1].begin(1, 1);
        assert_eq!(
            p.pick(&f, None, &req(&[], 1_000, Pinned::None))
                .unwrap()
                .index,
            2
        );
    }

    #[test]
    fn unavailable_excluded_and_saturated_endpoints_are_skipped() {
        let e = eps(4);
        let now = Instant::now();
        let p = PrefillPicker::default();
        e[0].set_healthy(false);
        e[1].retire();
        e[2].set_load_report(report(now, 40.0));
        let request = req(&[], 1000, Pinned::None);
        assert_eq!(p.pick_at(&e, None, &request, now).unwrap().index, 3);
        let excluded = PrefillRequest {
            exclude: &[3],
            ..request
        };
        // Only the saturated one is left: it is used anyway.
        assert_eq!(p.pick_at(&e, None, &excluded, now).unwrap().index, 2);
        let none = PrefillRequest {
            exclude: &[2, 3],
            ..request
        };
        assert_eq!(p.pick_at(&e, None, &none, now), None);
        assert_eq!(p.pick_at(&[], None, &request, now), None);
    }

    #[test]
    fn the_prefill_pin_is_sticky_until_saturated() {
        let e = eps(2);
        let now = Instant::now();
        let index = PrefixIndex::new(2, PrefixIndexConfig::default());
        let h = chunks(100);
        index.record(0, &h[..90]);
        index.record(1, &h[..10]);
        let mut p = PrefillPicker::default();
        p.rule.hysteresis_tokens = 4096.0;
        let request = req(&h, 100_000, Pinned::At(0));
        let pick = p.pick_at(&e, Some(&index), &request, now).unwrap();
        assert_eq!(
            (pick.index, pick.pin, pick.reason),
            (0, PinOutcome::Held, Reason::Pin)
        );
        assert_eq!(pick.uncached_tokens_estimate, 10_000);
        // Moving recomputes 80k tokens: the pin holds up to 80k + 4096 of queue, then breaks.
        let _q = e[0].begin(84_096, 84_096);
        let pick = p.pick_at(&e, Some(&index), &request, now).unwrap();
        assert_eq!(pick.pin, PinOutcome::Held);
        let _one = e[0].begin(1, 1);
        let pick = p.pick_at(&e, Some(&index), &request, now).unwrap();
        assert_eq!(
            (pick.index, pick.pin),
            (1, PinOutcome::Broken(BreakCause::Wait))
        );
        // Saturated (a full engine queue) while the other is not; gone; unavailable.
        e[0].set_load_report(report(now, 40.0));
        let pick = p
            .pick_at(&e, Some(&index), &req(&h, 1000, Pinned::At(0)), now)
            .unwrap();
        assert_eq!(
            (pick.index, pick.pin),
            (1, PinOutcome::Broken(BreakCause::Saturated))
        );
        let pick = p
            .pick_at(&e, None, &req(&h, 1000, Pinned::Gone), now)
            .unwrap();
        assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Unavailable));
        e[0].set_healthy(false);
        let pick = p
            .pick_at(&e, None, &req(&h, 1000, Pinned::At(0)), now)
            .unwrap();
        assert_eq!(
            (pick.index, pick.pin),
            (1, PinOutcome::Broken(BreakCause::Unavailable))
        );
        let pick = p
            .pick_at(&e, None, &req(&h, 1000, Pinned::At(7)), now)
            .unwrap();
        assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Unavailable));
    }

    #[test]
    fn a_faster_pinned_endpoint_holds_longer() {
        // Same prefixes, same queues; the pin is 4x faster, so its queue costs a quarter.
        let e = eps(2);
        let index = PrefixIndex::new(2, PrefixIndexConfig::default());
        let h = chunks(100);
        index.record(0, &h[..90]);
        index.record(1, &h[..10]);
        e[0].observe_prefill(40_000, Duration::from_secs(1));
        e[1].observe_prefill(10_000, Duration::from_secs(1));
        let _q = e[0].begin(200_000, 200_000);
        let p = PrefillPicker::default();
        let pick = p
            .pick(&e, Some(&index), &req(&h, 100_000, Pinned::At(0)))
            .unwrap();
        // Stay: (200k + 10k) / 40k = 5.25 s; move: 90k / 10k = 9 s.
        assert_eq!((pick.index, pick.pin), (0, PinOutcome::Held));
    }
}
