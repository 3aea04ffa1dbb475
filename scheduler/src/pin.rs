//! Sticky until saturated: when a session's pin holds and when it breaks.
//!
//! A session's turns share an ever-growing prefix, so the endpoint that served the last turn
//! holds most of the next one in its KV cache: staying there saves prefilling it again. The pin
//! is worth keeping until waiting for that endpoint costs more than recomputing the prefix
//! somewhere else. The pipeline ([`crate::pipeline`]) breaks a pin, in this order, when
//!
//! 1. the pinned endpoint is **unavailable**: unhealthy, retired, gone from the endpoint list,
//!    of the wrong role, or already failed this request ([`BreakCause::Unavailable`]);
//! 2. it is **saturated** (stale or missing metrics where metrics are expected, engine queue at
//!    `max_waiting`, KV cache at `max_kv_usage` with requests waiting) while some other
//!    candidate is not ([`BreakCause::Saturated`]); when every candidate is saturated, moving
//!    buys nothing and the pin is judged by the wait rule alone;
//! 3. the **wait rule** says moving is cheaper ([`BreakCause::Wait`]); not for a request whose
//!    prompt shares each engine step with the prefills running there rather than waiting
//!    behind them ([`PickRequest::prefill_not_queued`](crate::PickRequest::prefill_not_queued):
//!    a band with a reserve above bands whose prefills are limited), where the pending
//!    prefill the rule charges is not a wait. In `agentgate-bench run --workload mixed` the rule
//!    moved a chat turn away from its 2k cached tokens because agents' prompts were pending
//!    on its replica, and its first token came after 251 ms instead of about 100.
//!
//! # The wait rule
//!
//! Both sides are counted in tokens of prefill work. The pool is homogeneous enough that every
//! endpoint prefills at about the same rate, so dividing both sides by that rate (to get
//! seconds) would not change the comparison. With `P` the request's prompt tokens and `m(e)`
//! the prefix-match fraction of endpoint `e` from the prefix index:
//!
//! ```text
//! wait(e)      = pending_prefill_tokens(e) + queue_penalty_tokens * engine_waiting(e)
//! recompute(a) = P * (m(pin) - m(a))                  extra prefill if the turn goes to a
//! best         = min over the other candidates a of  wait(a) + recompute(a)
//! break        if  wait(pin) > best + hysteresis_tokens
//! ```
//!
//! `pending_prefill_tokens(e)` is exact for this gateway's own requests (uncached prompt tokens
//! of the requests there that have not produced their first token, see
//! [`Endpoint::pending_prefill_tokens`](crate::Endpoint::pending_prefill_tokens)).
//! `engine_waiting(e)` is the engine's own queue depth from its last metrics scrape; it also
//! counts other gateways' requests, whose sizes are unknown, so each is charged a flat
//! `queue_penalty_tokens`. (The gateway's own queued requests appear in both terms; the overlap
//! inflates both sides of the comparison alike.) `recompute(a)` is negative when `a` holds more
//! of the prompt than the pinned endpoint, which makes moving cheaper, as it should.
//!
//! Staying costs `wait(pin) + P * (1 - m(pin))` of prefill before the first token; moving to
//! `a` costs `wait(a) + P * (1 - m(a))`. Subtracting `P * (1 - m(pin))` from both gives the rule
//! above. Moving also re-warms the session on `a`, so later turns are cached there: one
//! recompute is the whole price of a move.
//!
//! # Constants
//!
//! - `queue_penalty_tokens = 2048`: an agent turn usually adds one tool result or user message
//!   (a few hundred to a few thousand tokens) to a cached history, so a request waiting in an
//!   engine's queue stands for about 2k tokens of prefill. The term only has to rank engine
//!   queues; the gateway's own work is counted exactly.
//! - `hysteresis_tokens = 131072`: a move must save at least 128k tokens of prefill (several
//!   seconds on one GPU for a mid-size model prefilling 10k to 40k tokens/s), so only a replica
//!   that is badly backed up loses its sessions. `pending_prefill_tokens` is each gateway
//!   replica's own view: with several gateways each sees part of every endpoint's work, their
//!   views differ, and a small margin lets them move the same session back and forth
//!   (sub-agents of one session run concurrently through different gateways), recomputing its
//!   context on every move. With `agentgate-bench run --workload agentic --policies session`
//!   (4 replicas, seed 1) a margin of 4096 kept 0.96 of the pooled oracle's reuse with one
//!   gateway but 0.89 with `--gateways 2`; 131072 kept 0.96 with both. Unavailable and
//!   saturated pins still break at once.
//!
//! Both are fields of [`ScoringConfig`](crate::ScoringConfig).

use crate::picker::BreakCause;

/// Default charge, in prefill tokens, per request waiting in an engine's queue.
pub const DEFAULT_QUEUE_PENALTY_TOKENS: f64 = 2048.0;
/// Default margin, in prefill tokens, by which moving must win before a pin breaks.
pub const DEFAULT_HYSTERESIS_TOKENS: f64 = 131_072.0;

/// One endpoint's side of the wait rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinCost {
    /// `wait(e)` in prefill tokens ([`PinRule::wait_tokens`]).
    pub wait_tokens: f64,
    /// Prefix-match fraction `m(e)` in [0, 1].
    pub matched: f64,
}

/// The wait rule's constants (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinRule {
    /// Prefill tokens charged per request in an engine's queue.
    pub queue_penalty_tokens: f64,
    /// Margin in prefill tokens by which moving must win.
    pub hysteresis_tokens: f64,
}

impl Default for PinRule {
    fn default() -> Self {
        PinRule {
            queue_penalty_tokens: DEFAULT_QUEUE_PENALTY_TOKENS,
            hysteresis_tokens: DEFAULT_HYSTERESIS_TOKENS,
        }
    }
}

impl PinRule {
    /// `wait(e) = pending_prefill_tokens + queue_penalty_tokens * engine_waiting`; a negative
    /// or unknown (NaN) queue depth counts as 0.
    pub fn wait_tokens(&self, pending_prefill_tokens: u64, engine_waiting: f64) -> f64 {
        let waiting = if engine_waiting > 0.0 {
            engine_waiting
        } else {
            0.0
        };
        pending_prefill_tokens as f64 + self.queue_penalty_tokens * waiting
    }

    /// `recompute(a) = prompt_tokens * (m(pin) - m(a))`: the extra prefill of moving to `a`.
    pub fn recompute_tokens(prompt_tokens: u64, pin: &PinCost, alternative: &PinCost) -> f64 {
        prompt_tokens as f64 * (pin.matched - alternative.matched)
    }

    /// `wait(a) + recompute(a)`: what moving to `a` costs, in prefill tokens.
    pub fn move_tokens(prompt_tokens: u64, pin: &PinCost, alternative: &PinCost) -> f64 {
        alternative.wait_tokens + Self::recompute_tokens(prompt_tokens, pin, alternative)
    }

    /// By how many prefill tokens moving beats staying, before the hysteresis:
    /// `wait(pin) - min_a (wait(a) + recompute(a))`. Negative infinity without alternatives.
    pub fn excess_tokens(
        &self,
        prompt_tokens: u64,
        pin: &PinCost,
        alternatives: impl IntoIterator<Item = PinCost>,
    ) -> f64 {
        let best = alternatives
            .into_iter()
            .map(|a| Self::move_tokens(prompt_tokens, pin, &a))
            .fold(f64::INFINITY, f64::min);
        pin.wait_tokens - best
    }

    /// The wait rule: `None` while the pin holds, `Some(BreakCause::Wait)` once
    /// `wait(pin) > min_a (wait(a) + recompute(a)) + hysteresis_tokens`. Undefined arithmetic
    /// (NaN) keeps the pin.
    pub fn judge(
        &self,
        prompt_tokens: u64,
        pin: &PinCost,
        alternatives: impl IntoIterator<Item = PinCost>,
    ) -> Option<BreakCause> {
        let excess = self.excess_tokens(prompt_tokens, pin, alternatives);
        (excess > self.hysteresis_tokens).then_some(BreakCause::Wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(wait_tokens: f64, matched: f64) -> PinCost {
        PinCost {
            wait_tokens,
            matched,
        }
    }

    #[test]
    fn wait_counts_pending_prefill_and_queued_requests() {
        let rule = PinRule::default();
        assert_eq!(rule.wait_tokens(0, 0.0), 0.0);
        assert_eq!(rule.wait_tokens(10_000, 0.0), 10_000.0);
        assert_eq!(rule.wait_tokens(10_000, 3.0), 10_000.0 + 3.0 * 2048.0);
        assert_eq!(rule.wait_tokens(5, -2.0), 5.0);
        assert_eq!(rule.wait_tokens(5, f64::NAN), 5.0);
    }

    #[test]
    fn the_pin_holds_until_waiting_costs_more_than_recomputing_plus_hysteresis() {
        let rule = PinRule::default();
        // 100k-token prompt, 90% cached on the pin, 10% (the shared system prompt) elsewhere:
        // moving costs 80k tokens of extra prefill.
        let prompt = 100_000;
        let idle_elsewhere = cost(0.0, 0.1);
        let recompute = PinRule::recompute_tokens(prompt, &cost(0.0, 0.9), &idle_elsewhere);
        assert!((recompute - 80_000.0).abs() < 1e-6);
        let threshold = recompute + rule.hysteresis_tokens;
        // Moderate load on the pin: hold.
        assert_eq!(
            rule.judge(prompt, &cost(30_000.0, 0.9), [idle_elsewhere]),
            None
        );
        // Just inside the hysteresis band: still hold.
        let inside = cost(threshold - 1.0, 0.9);
        assert_eq!(rule.judge(prompt, &inside, [idle_elsewhere]), None);
        // Beyond it: break.
        let beyond = cost(threshold + 1.0, 0.9);
        assert_eq!(
            rule.judge(prompt, &beyond, [idle_elsewhere]),
            Some(BreakCause::Wait)
        );
        // The best alternative decides: a busier one with the same match changes nothing.
        let busy_elsewhere = cost(50_000.0, 0.1);
        assert_eq!(
            rule.judge(prompt, &beyond, [busy_elsewhere, idle_elsewhere]),
            Some(BreakCause::Wait)
        );
        assert_eq!(rule.judge(prompt, &beyond, [busy_elsewhere]), None);
        // No alternative: nothing to move to.
        assert_eq!(rule.judge(prompt, &beyond, []), None);
    }

    #[test]
    fn an_alternative_holding_more_of_the_prompt_makes_moving_cheaper() {
        let rule = PinRule {
            hysteresis_tokens: 4096.0,
            ..PinRule::default()
        };
        // The index lost the pin's copy (m = 0) while another endpoint holds it all.
        let pin = cost(5_000.0, 0.0);
        let holder = cost(0.0, 1.0);
        assert!(rule.excess_tokens(50_000, &pin, [holder]) > 50_000.0);
        assert_eq!(rule.judge(50_000, &pin, [holder]), Some(BreakCause::Wait));
    }

    #[test]
    fn nan_keeps_the_pin() {
        let rule = PinRule::default();
        assert_eq!(
            rule.judge(1000, &cost(f64::NAN, 0.5), [cost(0.0, 0.0)]),
            None
        );
        assert_eq!(
            rule.judge(1000, &cost(1e9, 0.5), [cost(f64::NAN, 0.0)]),
            None
        );
    }
}
