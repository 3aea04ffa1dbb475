//! Rate limits shared by every gateway replica: GCRA (the generic cell rate algorithm) over
//! counters kept by the store, so two gateways on one Redis enforce one budget.
//!
//! A limit allows `limit` units (requests, or tokens) per `period`, with a burst of the whole
//! period's worth. Each key holds one number, its *theoretical arrival time* `tat` (ms):
//!
//! ```text
//! T        = period / limit                     (ms per unit)
//! tat'     = max(tat, now) + T * cost           (tat after this request)
//! allow_at = tat' - period                      (the request fits if allow_at <= now + 1 µs:
//!                                                float rounding of tat' - period is forgiven)
//! remaining = floor((now - allow_at) / T)       (units left after it; before it when refused)
//! reset_after = tat' - now                      (until the budget is full again)
//! retry_after = allow_at - now                  (when refused: until it would fit)
//! ```
//!
//! A check covers several limits at once (a team's requests AND tokens per minute) and is
//! all-or-nothing: if any limit refuses, no key is charged. A cost above `limit` can never fit
//! and is refused as [`RateDecision::too_large`]. The key expires when its budget is full again,
//! so idle teams cost nothing.
//!
//! The memory backend runs [`gcra_step`]; the Redis backend runs the same arithmetic in one Lua
//! script (`redis_store/rate_limit.lua`) on the server's clock, so gateways with skewed clocks
//! still agree.

use std::time::Duration;

/// One limit to check and charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    /// Counter key (e.g. `team:acme:rpm`); the store adds its own prefix.
    pub key: String,
    /// Units allowed per period.
    pub limit: u64,
    /// The period (a minute for OpenAI-style limits).
    pub period: Duration,
    /// Units this request costs.
    pub cost: u64,
}

/// The outcome of one limit of a check.
#[derive(Debug, Clone, PartialEq)]
pub struct RateDecision {
    /// Units allowed per period.
    pub limit: u64,
    /// Units left (after this request when the check passed, before it when refused).
    pub remaining: u64,
    /// Until the budget is full again.
    pub reset_after: Duration,
    /// When refused by this limit: how long until the request would fit.
    pub retry_after: Option<Duration>,
    /// The cost exceeds the whole limit: the request can never fit.
    pub too_large: bool,
}

impl RateDecision {
    /// Whether this limit lets the request through.
    pub fn allowed(&self) -> bool {
        self.retry_after.is_none() && !self.too_large
    }
}

/// How far past `now` a request's `allow_at` may fall and still fit: `tat' - period` is
/// `now` for a full budget's last unit only up to float rounding (`now + 60000 - 60000` need
/// not be `now` again), which must not refuse it.
const ROUNDING_MS: f64 = 1e-3;

/// Whole units in `span_ms` at `t` ms per unit, forgiving float rounding just below a unit.
fn units_left(span_ms: f64, t: f64) -> u64 {
    (span_ms / t + 1e-6).floor().max(0.0) as u64
}

fn ms(v: f64) -> Duration {
    Duration::try_from_secs_f64(v.max(0.0) / 1000.0).unwrap_or(Duration::MAX)
}

/// The figures of `limit` at `now_ms` with nothing charged: what a limit that would let a
/// request through reports when another limit of the same check refused it.
pub fn uncharged(tat: Option<f64>, now_ms: f64, limit: &RateLimit) -> RateDecision {
    let period = limit.period.as_secs_f64() * 1000.0;
    let t = period / limit.limit.max(1) as f64;
    let tat = tat.unwrap_or(now_ms).max(now_ms);
    RateDecision {
        limit: limit.limit,
        remaining: units_left(now_ms - (tat - period), t),
        reset_after: ms(tat - now_ms),
        retry_after: None,
        too_large: false,
    }
}

/// The `tat` once `limit.cost` is charged at `now_ms` whatever the budget: past `now_ms +
/// period` when it takes the budget into debt.
pub fn charged_tat(tat: Option<f64>, now_ms: f64, limit: &RateLimit) -> f64 {
    let period = limit.period.as_secs_f64() * 1000.0;
    let t = period / limit.limit.max(1) as f64;
    tat.unwrap_or(now_ms).max(now_ms) + t * limit.cost as f64
}

/// The `tat` once `limit.cost` charged earlier is given back at `now_ms` (a request refused
/// after it was charged): never below `now_ms`, an empty bucket. None: nothing to keep (no
/// key, or a bucket full again).
pub fn refunded_tat(tat: Option<f64>, now_ms: f64, limit: &RateLimit) -> Option<f64> {
    let period = limit.period.as_secs_f64() * 1000.0;
    let t = period / limit.limit.max(1) as f64;
    Some(tat? - t * limit.cost as f64).filter(|tat| *tat > now_ms)
}

/// One GCRA step for `limit` at time `now_ms` over the stored `tat` (None: no key). Returns the
/// decision and the new `tat` to store if every limit of the check passes.
pub fn gcra_step(tat: Option<f64>, now_ms: f64, limit: &RateLimit) -> (RateDecision, f64) {
    let period = limit.period.as_secs_f64() * 1000.0;
    let units = limit.limit.max(1) as f64;
    let t = period / units;
    let tat = tat.unwrap_or(now_ms).max(now_ms);
    let new_tat = tat + t * limit.cost as f64;
    let allow_at = new_tat - period;
    let too_large = limit.cost > limit.limit;
    if too_large || allow_at > now_ms + ROUNDING_MS {
        // Refused: nothing is charged, so the figures are those before this request.
        return (
            RateDecision {
                retry_after: (!too_large).then(|| ms(allow_at - now_ms)),
                too_large,
                ..uncharged(Some(tat), now_ms, limit)
            },
            tat,
        );
    }
    let remaining = units_left(now_ms - allow_at, t);
    (
        RateDecision {
            limit: limit.limit,
            remaining,
            reset_after: ms(new_tat - now_ms),
            retry_after: None,
            too_large: false,
        },
        new_tat,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rpm(limit: u64, cost: u64) -> RateLimit {
        RateLimit {
            key: "k".into(),
            limit,
            period: Duration::from_secs(60),
            cost,
        }
    }

    #[test]
    fn a_full_budget_then_one_unit_per_interval() {
        let limit = rpm(60, 1); // one per second
        let mut tat = None;
        for i in 0..60 {
            let (d, next) = gcra_step(tat, 0.0, &limit);
            assert!(d.allowed(), "request {i}");
            assert_eq!(d.remaining, 59 - i);
            tat = Some(next);
        }
        let (d, _) = gcra_step(tat, 0.0, &limit);
        assert!(!d.allowed());
        assert_eq!(d.retry_after, Some(Duration::from_secs(1)));
        assert_eq!(d.reset_after, Duration::from_secs(60));
        // A second later one more fits.
        let (d, _) = gcra_step(tat, 1000.0, &limit);
        assert!(d.allowed());
        assert_eq!(d.remaining, 0);
    }

    #[test]
    fn a_whole_budget_fits_at_any_instant_whatever_the_rounding() {
        // A limit of 1 at a time whose sum with the period rounds up: 0.3 + 60000 - 60000 is
        // 0.3000000000029104 in f64.
        let (d, _) = gcra_step(None, 0.3, &rpm(1, 1));
        assert!(d.allowed(), "{d:?}");
        // Seven per minute, all at one instant: each interval (60000 / 7) is inexact.
        let mut tat = None;
        for i in 0..7 {
            let (d, next) = gcra_step(tat, 123.456, &rpm(7, 1));
            assert!(d.allowed(), "request {i}: {d:?}");
            tat = Some(next);
        }
        assert!(!gcra_step(tat, 123.456, &rpm(7, 1)).0.allowed());
    }

    #[test]
    fn token_costs_and_oversized_requests() {
        let limit = rpm(1000, 600);
        let (d, tat) = gcra_step(None, 0.0, &limit);
        assert!(d.allowed());
        assert_eq!(d.remaining, 400);
        let (d, _) = gcra_step(Some(tat), 0.0, &limit);
        assert!(!d.allowed());
        assert_eq!(d.remaining, 400);
        assert_eq!(d.retry_after, Some(Duration::from_secs(12)));
        let (d, same) = gcra_step(Some(tat), 0.0, &rpm(1000, 1001));
        assert!(d.too_large && !d.allowed());
        assert_eq!(same, tat, "a refused request charges nothing");
    }

    #[test]
    fn a_budget_in_debt_beyond_any_duration_answers_the_longest_one() {
        let limit = rpm(1, u64::MAX);
        let tat = charged_tat(Some(charged_tat(None, 0.0, &limit)), 0.0, &limit);
        let (d, _) = gcra_step(Some(tat), 0.0, &rpm(1, 1));
        assert_eq!(d.retry_after, Some(Duration::MAX));
        assert_eq!(
            uncharged(Some(f64::INFINITY), 0.0, &limit).reset_after,
            Duration::MAX
        );
    }
}
