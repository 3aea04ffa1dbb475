//! Scorers: each rates every candidate endpoint in [0, 1]; a pipeline adds them up with weights.
//!
//! A [`Scorer`] writes one score per candidate, higher is better. Scores are relative to the
//! candidates of one pick where the formula says so (the busiest candidate anchors the load
//! scores), so they rank endpoints rather than measure them. Formulas, for candidate `e` among
//! the candidates `C`:
//!
//! ```text
//! session_pin       1 if e is the session's pinned endpoint and the pin holds, else 0
//!
//! prefix            m(e) * gate(e)
//!   m(e)            prefix-match fraction of the prompt held by e (crate::prefix_index)
//!   gate(e)         1 if f(e) <= herd_factor * mean_C(f) + herd_slack, else 0
//!   f(e)            in_flight(e) + others(e)
//!   others(e)       max(0, engine_running(e) + engine_waiting(e) - in_flight_at_scrape(e))
//!
//! queue             1 - q(e) / (max_C q + 1)
//!   q(e)            engine_waiting(e) + in_flight(e)
//!
//! kv_usage          mean of the terms that are known:
//!   engine(e)       1 - kv_usage(e)                             (from the engine's metrics)
//!   room(e)         1 - fraction(e) / 2                         if e's modelled cache has room
//!                   idle(e) / (2 * max_{full C} idle)           if it is full
//!
//! in_flight_tokens  1 - w(e) / (max_C w + S)      S = 8192 tokens (IN_FLIGHT_TOKENS_SCALE)
//!   w(e)            p(e) * r_max / r(e)     when every candidate has a measured rate r
//!                   p(e)                    otherwise
//!   p(e)            pending prefill tokens on e
//!   r(e)            e's measured prefill throughput, tokens/s (crate::disagg)
//!   r_max           max_C r
//! ```
//!
//! with `in_flight(e)` the requests this gateway has in flight on `e`, `engine_waiting(e)` the
//! engine's queue depth from its last scrape (0 without one), and `fraction`, `idle` the slot's
//! [`Occupancy`](crate::prefix_index::Occupancy).
//!
//! - **prefix** with its anti-herding gate: a full match is worth the whole weight until its
//!   endpoint's in-flight count passes `herd_factor` times the candidates' mean plus
//!   `herd_slack` (defaults 1.5 and 2). A burst of requests sharing one prefix (sub-agent
//!   fan-out, a team's system prompt) then spills to the endpoints the load scorers prefer,
//!   which learn the prefix in turn, instead of queueing on the one that held it. The gate uses
//!   the gateway's own in-flight counts, which move with every request, rather than scraped
//!   metrics, which lag a burst; to them it adds `others(e)`, the requests other gateways had
//!   on the engine at its last scrape (the engine's count beyond this gateway's own then, see
//!   [`LoadReport::others_in_flight`](crate::LoadReport::others_in_flight)). With one gateway
//!   `others` is 0; with several, each would otherwise see only its share of a team's sessions
//!   and let the shared prefix pile up on one replica. `herd_slack` keeps small fleets from
//!   spreading at the first queued request.
//! - **queue**: the engine's queue (which also counts other gateways' requests) plus this
//!   gateway's in-flight requests (which the next scrape has not seen yet).
//! - **kv_usage**: `engine` steers away from replicas whose KV cache is filling with running
//!   requests (preemption risk). `room` places new prefixes by cache pressure: an endpoint
//!   whose modelled cache still has room scores above every full one (nothing is evicted), and
//!   among full ones, the one whose next victim is coldest scores highest. The fleet then evicts
//!   roughly in global LRU order, as one cache of its total size would, instead of one replica
//!   thrashing while another holds stale prefixes.
//! - **in_flight_tokens**: the prefill work queued ahead of a new request on each endpoint, as
//!   the time it takes there. `S`, about one engine step of prefill, keeps the score from
//!   magnifying small differences: with `+ 1`, an endpoint with a few hundred pending tokens
//!   scored near 0 beside an idle one, a full point of weight for a few milliseconds of work,
//!   enough to outvote a third of the prompt cached (prefix weight 3) on a lightly loaded
//!   fleet. With `S`, two endpoints differ by a whole point only when one has many steps of
//!   work queued and the other none. `p(e) / r(e)` is the seconds `e` needs to clear its queue;
//!   multiplying by `r_max` states it in tokens of the fastest candidate's time, so the scale
//!   (and the `+ S` smoothing) is the token form's, and on a pool of equal rates the score is
//!   exactly the token form. On a pool of mixed hardware a token queued on a slow endpoint
//!   then weighs more than one queued on a fast endpoint, by the throughput the gateway
//!   measured rather than by what the hardware labels suggest. Until every candidate has a
//!   measured rate the scorer counts tokens: an unmeasured endpoint's speed is unknown, and
//!   any rate assumed for it (the mean, the slowest) would rank it by the assumption rather
//!   than by its queue. Rates appear after the first timed prefills (a few requests per
//!   endpoint), so the fallback lasts only through warm-up.
//!
//! Every score is in [0, 1]; the load scores are 1 for all candidates when all are idle.

use crate::filter::PoolView;
use crate::picker::Reason;
use crate::prefix_index::PrefixIndex;

/// Names of the scorers a [`ScoringConfig`](crate::ScoringConfig) may weight.
pub const SCORER_NAMES: &[&str] = &[
    SessionPinScorer::NAME,
    PrefixScorer::NAME,
    QueueScorer::NAME,
    KvUsageScorer::NAME,
    InFlightTokensScorer::NAME,
];

/// What a scorer sees: the pool view plus what the pipeline worked out before scoring.
#[derive(Debug, Clone, Copy)]
pub struct ScoreContext<'a> {
    /// Endpoints, request, time and load reports.
    pub view: &'a PoolView<'a>,
    /// The pipeline's prefix index, if it keeps one.
    pub index: Option<&'a PrefixIndex>,
    /// Prefix-match fraction per candidate (aligned with the candidates), 0 without a prompt.
    pub matches: &'a [f64],
    /// Position of the session's pinned endpoint when its pin holds.
    pub held_pin: Option<usize>,
}

/// Rates candidate endpoints.
pub trait Scorer: Send + Sync + std::fmt::Debug {
    /// Name in the configuration's weights.
    fn name(&self) -> &'static str;

    /// Which [`Reason`] a pick is attributed to when this scorer decided it.
    fn reason(&self) -> Reason {
        Reason::Load
    }

    /// Write a score in [0, 1] for each of `candidates` (positions in `ctx.view.endpoints`)
    /// into `out` (same length).
    fn score(&self, ctx: &ScoreContext<'_>, candidates: &[usize], out: &mut [f64]);
}

/// `1 - x / (max + scale)` for each candidate's `x >= 0`.
fn relative_load(out: &mut [f64], load: impl Fn(usize) -> f64, candidates: &[usize], scale: f64) {
    let max = candidates.iter().map(|&i| load(i)).fold(0.0, f64::max);
    for (o, &i) in out.iter_mut().zip(candidates) {
        *o = 1.0 - load(i) / (max + scale);
    }
}

/// Smoothing of the `in_flight_tokens` score, in prefill tokens: about one engine step's
/// budget (vLLM's default `max_num_batched_tokens` on large GPUs), so differences smaller than
/// a step of work barely move the score.
pub const IN_FLIGHT_TOKENS_SCALE: f64 = 8192.0;

/// `session_pin`: 1 for the pinned endpoint while the pin holds.
#[derive(Debug, Default, Clone, Copy)]
pub struct SessionPinScorer;

impl SessionPinScorer {
    /// Configuration name.
    pub const NAME: &'static str = "session_pin";
}

impl Scorer for SessionPinScorer {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn reason(&self) -> Reason {
        Reason::Pin
    }

    fn score(&self, ctx: &ScoreContext<'_>, candidates: &[usize], out: &mut [f64]) {
        for (o, &i) in out.iter_mut().zip(candidates) {
            *o = if ctx.held_pin == Some(i) { 1.0 } else { 0.0 };
        }
    }
}

/// `prefix`: match fraction behind the anti-herding gate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixScorer {
    /// An endpoint above `herd_factor` x the candidates' mean in-flight count (plus
    /// `herd_slack`) loses its prefix score.
    pub herd_factor: f64,
    /// Absolute slack on the herding threshold, in requests.
    pub herd_slack: f64,
}

impl PrefixScorer {
    /// Configuration name.
    pub const NAME: &'static str = "prefix";
    /// Default `herd_factor`.
    pub const DEFAULT_HERD_FACTOR: f64 = 1.5;
    /// Default `herd_slack`.
    pub const DEFAULT_HERD_SLACK: f64 = 2.0;

    /// The in-flight count above which a candidate is crowded (loses its prefix score).
    pub fn crowded_above(&self, ctx: &ScoreContext<'_>, candidates: &[usize]) -> f64 {
        let total: u64 = candidates
            .iter()
            .map(|&i| ctx.view.fleet_in_flight(i))
            .sum();
        let mean = total as f64 / candidates.len().max(1) as f64;
        self.herd_factor * mean + self.herd_slack
    }
}

impl Default for PrefixScorer {
    fn default() -> Self {
        PrefixScorer {
            herd_factor: Self::DEFAULT_HERD_FACTOR,
            herd_slack: Self::DEFAULT_HERD_SLACK,
        }
    }
}

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn reason(&self) -> Reason {
        Reason::Prefix
    }

    fn score(&self, ctx: &ScoreContext<'_>, candidates: &[usize], out: &mut [f64]) {
        out.fill(0.0);
        if ctx.matches.iter().all(|&m| m <= 0.0) {
            return;
        }
        let limit = self.crowded_above(ctx, candidates);
        for ((o, &i), &m) in out.iter_mut().zip(candidates).zip(ctx.matches) {
            let in_flight = ctx.view.fleet_in_flight(i) as f64;
            *o = if in_flight <= limit { m } else { 0.0 };
        }
    }
}

/// `queue`: engine queue depth plus this gateway's in-flight requests, relative to the busiest.
#[derive(Debug, Default, Clone, Copy)]
pub struct QueueScorer;

impl QueueScorer {
    /// Configuration name.
    pub const NAME: &'static str = "queue";
}

impl Scorer for QueueScorer {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn score(&self, ctx: &ScoreContext<'_>, candidates: &[usize], out: &mut [f64]) {
        let view = ctx.view;
        let load = |i: usize| view.engine_waiting(i) + view.in_flight_requests(i) as f64;
        relative_load(out, load, candidates, 1.0);
    }
}

/// `kv_usage`: free KV cache on the engine, and room in the modelled prefix cache.
#[derive(Debug, Default, Clone, Copy)]
pub struct KvUsageScorer;

impl KvUsageScorer {
    /// Configuration name.
    pub const NAME: &'static str = "kv_usage";
}

impl Scorer for KvUsageScorer {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn score(&self, ctx: &ScoreContext<'_>, candidates: &[usize], out: &mut [f64]) {
        let view = ctx.view;
        let occupancy = |i: usize| {
            ctx.index
                .zip(view.endpoints.get(i))
                .map(|(index, ep)| index.occupancy(ep.slot))
        };
        let max_idle = candidates
            .iter()
            .filter_map(|&i| occupancy(i))
            .filter(|o| o.is_full())
            .map(|o| o.idle)
            .max()
            .unwrap_or(0);
        for (o, &i) in out.iter_mut().zip(candidates) {
            let engine = view
                .report(i)
                .and_then(|r| r.kv_usage)
                .filter(|u| u.is_finite())
                .map(|u| 1.0 - u.clamp(0.0, 1.0));
            let room = occupancy(i).map(|occ| {
                if !occ.is_full() {
                    1.0 - occ.fraction() / 2.0
                } else if max_idle == 0 {
                    0.0
                } else {
                    occ.idle as f64 / (2.0 * max_idle as f64)
                }
            });
            *o = match (engine, room) {
                (Some(a), Some(b)) => (a + b) / 2.0,
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => 1.0,
            };
        }
    }
}

/// `in_flight_tokens`: pending prefill tokens, relative to the busiest.
#[derive(Debug, Default, Clone, Copy)]
pub struct InFlightTokensScorer;

impl InFlightTokensScorer {
    /// Configuration name.
    pub const NAME: &'static str = "in_flight_tokens";
}

impl Scorer for InFlightTokensScorer {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn score(&self, ctx: &ScoreContext<'_>, candidates: &[usize], out: &mut [f64]) {
        let view = ctx.view;
        let rate = |i: usize| view.endpoints.get(i).and_then(|e| e.prefill_tokens_per_s());
        let rates: Option<Vec<f64>> = candidates.iter().map(|&i| rate(i)).collect();
        let pending = |i: usize| view.pending_prefill_tokens(i) as f64;
        match rates {
            Some(rates) if !rates.is_empty() => {
                let fastest = rates.iter().copied().fold(0.0, f64::max);
                let weighted: Vec<f64> = candidates
                    .iter()
                    .zip(&rates)
                    .map(|(&i, &r)| pending(i) * fastest / r)
                    .collect();
                let max = weighted.iter().copied().fold(0.0, f64::max);
                for (o, w) in out.iter_mut().zip(&weighted) {
                    *o = 1.0 - w / (max + IN_FLIGHT_TOKENS_SCALE);
                }
            }
            _ => relative_load(out, pending, candidates, IN_FLIGHT_TOKENS_SCALE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, LoadReport};
    use crate::picker::PickRequest;
    use crate::prefix_index::PrefixIndexConfig;
    use std::sync::Arc;
    use tokio::time::Instant;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| Arc::new(Endpoint::new(format!("p/{i}"), "http://x").with_slot(i)))
            .collect()
    }

    /// Run `scorer` over every endpoint with the given match fractions and pin.
    fn run(
        scorer: &dyn Scorer,
        endpoints: &[Arc<Endpoint>],
        index: Option<&PrefixIndex>,
        matches: &[f64],
        held_pin: Option<usize>,
    ) -> Vec<f64> {
        let request = PickRequest::default();
        let reports: Vec<_> = endpoints.iter().map(|e| e.load_report()).collect();
        let view = PoolView {
            endpoints,
            request: &request,
            now: Instant::now(),
            reports: &reports,
        };
        let candidates: Vec<usize> = (0..endpoints.len()).collect();
        let zeros = vec![0.0; endpoints.len()];
        let ctx = ScoreContext {
            view: &view,
            index,
            matches: if matches.is_empty() { &zeros } else { matches },
            held_pin,
        };
        let mut out = vec![f64::NAN; candidates.len()];
        scorer.score(&ctx, &candidates, &mut out);
        out
    }

    fn report(waiting: f64, kv_usage: Option<f64>) -> LoadReport {
        LoadReport {
            at: Instant::now(),
            waiting,
            running: 0.0,
            kv_usage,
            gateway_in_flight: 0,
            peer_in_flight: 0,
        }
    }

    #[test]
    fn names_are_unique_and_match_the_scorers() {
        let scorers: [&dyn Scorer; 5] = [
            &SessionPinScorer,
            &PrefixScorer::default(),
            &QueueScorer,
            &KvUsageScorer,
            &InFlightTokensScorer,
        ];
        let names: Vec<_> = scorers.iter().map(|s| s.name()).collect();
        assert_eq!(names, SCORER_NAMES);
        let reasons: Vec<_> = scorers.iter().map(|s| s.reason()).collect();
        assert_eq!(
            reasons,
            [
                Reason::Pin,
                Reason::Prefix,
                Reason::Load,
                Reason::Load,
                Reason::Load
            ]
        );
    }

    #[test]
    fn session_pin_scores_only_a_held_pin() {
        let e = eps(3);
        assert_eq!(
            run(&SessionPinScorer, &e, None, &[], Some(1)),
            [0.0, 1.0, 0.0]
        );
        assert_eq!(run(&SessionPinScorer, &e, None, &[], None), [0.0, 0.0, 0.0]);
    }

    #[test]
    fn prefix_is_the_match_fraction_until_the_endpoint_is_crowded() {
        let e = eps(3);
        let scorer = PrefixScorer::default();
        let matches = [1.0, 0.5, 0.0];
        assert_eq!(run(&scorer, &e, None, &matches, None), matches);
        // In flight 10, 2, 0: mean 4, threshold 1.5 * 4 + 2 = 8, so endpoint 0 is crowded.
        let _busy: Vec<_> = (0..10).map(|_| e[0].begin(1, 1)).collect();
        let _some: Vec<_> = (0..2).map(|_| e[1].begin(1, 1)).collect();
        assert_eq!(run(&scorer, &e, None, &matches, None), [0.0, 0.5, 0.0]);
        // At the threshold exactly it is not: in flight x, 0, 0 -> limit 1.5 * x/3 + 2 = 4 at x = 4.
        let e = eps(3);
        let _busy: Vec<_> = (0..4).map(|_| e[0].begin(1, 1)).collect();
        assert_eq!(
            run(&scorer, &e, None, &matches, None),
            matches,
            "4 <= 1.5*4/3+2"
        );
        let _one_more = e[0].begin(1, 1);
        assert_eq!(
            run(&scorer, &e, None, &matches, None)[0],
            0.0,
            "5 > 1.5*5/3+2"
        );
        // No prompt, or no match anywhere: all 0.
        assert_eq!(run(&scorer, &e, None, &[0.0; 3], None), [0.0; 3]);
    }

    #[test]
    fn the_herding_gate_counts_other_gateways_requests_from_the_last_scrape() {
        let e = eps(3);
        let scorer = PrefixScorer::default();
        let matches = [1.0, 0.0, 0.0];
        // This gateway has 2 on endpoint 0 and nothing elsewhere: limit 1.5 * 2/3 + 2 = 3.
        let _own: Vec<_> = (0..2).map(|_| e[0].begin(1, 1)).collect();
        assert_eq!(run(&scorer, &e, None, &matches, None), matches);
        // The engine reported 6 running and 2 waiting while this gateway had 2 there: 6 are
        // another gateway's. Fleet in flight 8, 0, 0: limit 1.5 * 8/3 + 2 = 6, so it is crowded.
        e[0].set_load_report(LoadReport {
            running: 6.0,
            gateway_in_flight: 2,
            peer_in_flight: 0,
            ..report(2.0, None)
        });
        assert_eq!(run(&scorer, &e, None, &matches, None), [0.0; 3]);
        // An engine that counts fewer than this gateway sent adds nothing (requests in transit).
        e[0].set_load_report(LoadReport {
            running: 1.0,
            gateway_in_flight: 2,
            peer_in_flight: 0,
            ..report(0.0, None)
        });
        assert_eq!(run(&scorer, &e, None, &matches, None), matches);
    }

    #[test]
    fn queue_counts_engine_queue_and_in_flight_requests() {
        let e = eps(3);
        assert_eq!(run(&QueueScorer, &e, None, &[], None), [1.0, 1.0, 1.0]);
        e[0].set_load_report(report(3.0, None));
        let _a = e[1].begin(1, 1);
        // q = 3, 1, 0; max 3.
        let s = run(&QueueScorer, &e, None, &[], None);
        assert_eq!(s, [1.0 - 3.0 / 4.0, 1.0 - 1.0 / 4.0, 1.0]);
    }

    #[test]
    fn in_flight_tokens_counts_pending_prefill() {
        let e = eps(3);
        let mut first_token = e[0].begin(5000, 999);
        let _b = e[1].begin(5000, 4999);
        // w = 999, 4999, 0: scaled by the busiest plus one step of work (8192 tokens).
        let scale = 4999.0 + IN_FLIGHT_TOKENS_SCALE;
        let s = run(&InFlightTokensScorer, &e, None, &[], None);
        assert_eq!(s, [1.0 - 999.0 / scale, 1.0 - 4999.0 / scale, 1.0]);
        assert!(
            s[0] > 0.9,
            "a thousand tokens queued is a fraction of a step: barely below idle"
        );
        first_token.prefill_done();
        let s = run(&InFlightTokensScorer, &e, None, &[], None);
        assert_eq!(s, [1.0, 1.0 - 4999.0 / scale, 1.0]);
    }

    #[test]
    fn in_flight_tokens_weighs_pending_prefill_by_measured_throughput() {
        use std::time::Duration;
        let e = eps(2);
        // Equal queues; endpoint 1 prefills four times as fast, so its queue clears in a
        // quarter of the time.
        let _a = e[0].begin(8_000, 8_000);
        let _b = e[1].begin(8_000, 8_000);
        e[1].observe_prefill(40_000, Duration::from_secs(1));
        // Endpoint 0 unmeasured: tokens, a tie.
        let s = run(&InFlightTokensScorer, &e, None, &[], None);
        assert_eq!(s[0], s[1], "{s:?}");
        e[0].observe_prefill(10_000, Duration::from_secs(1));
        // w = 8000 * 40k / 10k = 32000 and 8000 * 40k / 40k = 8000.
        let s = run(&InFlightTokensScorer, &e, None, &[], None);
        let scale = 32_000.0 + IN_FLIGHT_TOKENS_SCALE;
        let want = [1.0 - 32_000.0 / scale, 1.0 - 8_000.0 / scale];
        for (got, want) in s.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{s:?}");
        }
        assert!(s[1] > s[0], "the faster endpoint scores higher: {s:?}");
        // Three times the queue on the fast one still clears sooner (24k < 32k); five times
        // does not (40k > 32k).
        let _c: Vec<_> = (0..2).map(|_| e[1].begin(8_000, 8_000)).collect();
        let s = run(&InFlightTokensScorer, &e, None, &[], None);
        assert!(s[1] > s[0], "{s:?}");
        let _d: Vec<_> = (0..2).map(|_| e[1].begin(8_000, 8_000)).collect();
        let s = run(&InFlightTokensScorer, &e, None, &[], None);
        assert!(s[1] < s[0], "{s:?}");
        // Equal measured rates: exactly the token form.
        let f = eps(2);
        let _q = f[0].begin(3_000, 3_000);
        let tokens = run(&InFlightTokensScorer, &f, None, &[], None);
        for ep in &f {
            ep.observe_prefill(20_000, Duration::from_secs(1));
        }
        assert_eq!(run(&InFlightTokensScorer, &f, None, &[], None), tokens);
    }

    #[test]
    fn kv_usage_combines_engine_usage_and_cache_room() {
        // 1 token per chunk, 10 chunks per slot.
        let config = PrefixIndexConfig {
            chunk_bytes: 4,
            bytes_per_token: 4,
            default_capacity_tokens: 10,
        };
        let index = PrefixIndex::new(4, config);
        let e = eps(4);
        // Engine figures only.
        e[0].set_load_report(report(0.0, Some(0.8)));
        e[1].set_load_report(report(0.0, Some(f64::NAN)));
        let s = run(&KvUsageScorer, &e, None, &[], None);
        assert!((s[0] - 0.2).abs() < 1e-12);
        assert_eq!(s[1..], [1.0, 1.0, 1.0], "unknown usage is neutral");
        // Cache room: 0 empty, 1 half full, 2 and 3 full with victims idle 1 and 2 records.
        index.record(2, &(100..110).collect::<Vec<u64>>()); // clock 1
        index.record(3, &(200..210).collect::<Vec<u64>>()); // clock 2
        index.record(2, &(300..310).collect::<Vec<u64>>()); // clock 3
        index.record(1, &(400..405).collect::<Vec<u64>>()); // clock 4
        assert_eq!(index.occupancy(2).idle, 1);
        assert_eq!(index.occupancy(3).idle, 2);
        let s = run(&KvUsageScorer, &e, Some(&index), &[], None);
        let room = [1.0, 0.75, 0.25, 0.5];
        let expected = [(0.2 + room[0]) / 2.0, room[1], room[2], room[3]];
        for (got, want) in s.iter().zip(expected) {
            assert!((got - want).abs() < 1e-12, "{s:?} vs {expected:?}");
        }
        // Any room beats any full cache; the coldest victim wins among full ones.
        assert!(s[1] > s[3] && s[3] > s[2]);
    }

    #[test]
    fn every_score_stays_in_the_unit_interval() {
        let index = PrefixIndex::new(3, PrefixIndexConfig::default());
        let e = eps(3);
        e[0].set_load_report(report(1e12, Some(7.0)));
        e[1].set_load_report(report(-5.0, Some(-1.0)));
        let _g: Vec<_> = (0..50)
            .map(|_| e[2].begin(u64::MAX / 64, u64::MAX / 64))
            .collect();
        let scorers: [&dyn Scorer; 5] = [
            &SessionPinScorer,
            &PrefixScorer::default(),
            &QueueScorer,
            &KvUsageScorer,
            &InFlightTokensScorer,
        ];
        for scorer in scorers {
            let s = run(scorer, &e, Some(&index), &[1.0, 0.3, 0.0], Some(2));
            assert!(
                s.iter().all(|x| (0.0..=1.0).contains(x)),
                "{}: {s:?}",
                scorer.name()
            );
        }
    }
}
