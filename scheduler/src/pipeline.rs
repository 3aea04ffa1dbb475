//! The scoring pipeline behind the `prefix` and `session` policies: filters, then weighted
//! scorers, then the highest total wins (random among ties).
//!
//! One pick, over the pool's current endpoint list:
//!
//! 1. **View.** Every endpoint's load report is read once; filters and scorers share it.
//! 2. **Filter** ([`crate::filter`]): available, not excluded, of the requested role, and not
//!    saturated unless everything is (then, while one has fresh metrics, not one whose metrics
//!    are stale, unless it is the pin's). No candidate left: no pick.
//! 3. **Match.** The prompt's chunk hashes are matched against the prefix index, by each
//!    candidate's [`Endpoint::slot`]: `m(e)` in [0, 1].
//! 4. **Pin** (pipelines with the `session_pin` scorer): the sticky-until-saturated rule of
//!    [`crate::pin`] decides whether the session's pin holds. A pin broken by the wait rule
//!    leaves as candidates only the endpoints where the rule found moving cheaper
//!    (`wait(a) + recompute(a) + hysteresis < wait(pin)`), so the move goes where it pays, not
//!    to another endpoint as busy that holds the prefix too (and back the next turn).
//! 5. **Score** ([`crate::scorer`]): each scorer with a positive weight rates every candidate
//!    in [0, 1] (anything else is clamped; NaN counts as 0), and
//!
//!    ```text
//!    total(e) = sum over scorers s of  weight(s) * score_s(e)
//!    ```
//!
//!    The highest total wins; totals within 1e-9 of it tie and one is drawn at random, so cold
//!    prompts on an idle fleet spread evenly.
//! 6. **Explain.** The reason is the category (`pin`, `prefix`, `load`; the three load scorers
//!    count as one) that did most to beat the runner-up, the best other candidate:
//!
//!    ```text
//!    margin(c) = sum over scorers s in c of  weight(s) * (score_s(winner) - score_s(runner_up))
//!    reason    = the category with the largest positive margin; with no runner-up or no
//!                positive margin, the category contributing most to total(winner)
//!    ```
//!
//!    (ties: pin, then prefix, then load). The uncached estimate is
//!    `prompt_tokens * (1 - m(winner))`. A held pin whose endpoint did not win (its weight is
//!    too small to outweigh the others) is reported broken with cause `outscored`.
//!
//! # Defaults
//!
//! | scorer | `prefix` | `session` | why |
//! |---|---|---|---|
//! | `session_pin` | - | 10 | more than all the others together (5.5): a held pin always wins |
//! | `prefix` | 3 | 3 | more than the load scorers together (2.5): a full match beats any load difference |
//! | `queue` | 1 | 1 | the engine's and this gateway's queues |
//! | `in_flight_tokens` | 1 | 1 | prefill work queued ahead (as time, once throughput is measured) |
//! | `kv_usage` | 0.5 | 0.5 | secondary: cold-prefix placement, preemption risk |
//!
//! So a full prefix match wins until the anti-herding gate takes it away, a half match (1.5)
//! still beats moderate load differences, and cold prompts are placed by load alone.
//! Anti-herding: `herd_factor = 1.5`, `herd_slack = 2`. Pin rule: `queue_penalty_tokens =
//! 2048`, `pin_hysteresis_tokens = 131072` (reasons in [`crate::pin`]). Saturation:
//! [`Saturation::default`], with the metrics staleness set by whoever scrapes the engines.

use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::time::Instant;

use crate::endpoint::{Endpoint, LoadReport, Saturation};
use crate::filter::{
    Available, Filter, NotExcluded, PoolView, PreferFreeSlot, PreferUnsaturated, RoleMatch,
    SpreadReserved,
};
use crate::picker::{
    random_choice, BreakCause, Pick, PickRequest, Picker, PinOutcome, Pinned, Reason,
};
use crate::pin::{PinCost, PinRule, DEFAULT_HYSTERESIS_TOKENS, DEFAULT_QUEUE_PENALTY_TOKENS};
use crate::policy::Policy;
use crate::prefix_index::{PrefixIndex, PrefixIndexConfig};
use crate::scorer::{
    InFlightTokensScorer, KvUsageScorer, PrefixScorer, QueueScorer, ScoreContext, Scorer,
    SessionPinScorer, SCORER_NAMES,
};

/// Totals within this of the best tie.
const TIE: f64 = 1e-9;

/// A pool's scoring settings, as the configuration gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoringConfig {
    /// Weight per scorer name (one of [`SCORER_NAMES`]); a scorer absent or weighted 0 does not
    /// run.
    pub weights: BTreeMap<String, f64>,
    /// Anti-herding: an endpoint above `herd_factor` x the candidates' mean in-flight count
    /// (plus `herd_slack`) loses its prefix score.
    pub herd_factor: f64,
    /// Anti-herding: absolute slack on the threshold, in requests.
    pub herd_slack: f64,
    /// When an endpoint counts as saturated (filtered while others are not; breaks pins).
    pub saturation: Saturation,
    /// Pin rule: prefill tokens charged per request in an engine's queue.
    pub queue_penalty_tokens: f64,
    /// Pin rule: margin in prefill tokens by which moving must win before a pin breaks.
    pub pin_hysteresis_tokens: f64,
}

impl ScoringConfig {
    /// Defaults of the `prefix` policy: prefix and load scorers, no pin.
    pub fn prefix() -> Self {
        let weights = [
            (PrefixScorer::NAME, 3.0),
            (QueueScorer::NAME, 1.0),
            (InFlightTokensScorer::NAME, 1.0),
            (KvUsageScorer::NAME, 0.5),
        ];
        ScoringConfig {
            weights: weights
                .into_iter()
                .map(|(name, w)| (name.to_string(), w))
                .collect(),
            herd_factor: PrefixScorer::DEFAULT_HERD_FACTOR,
            herd_slack: PrefixScorer::DEFAULT_HERD_SLACK,
            saturation: Saturation::default(),
            queue_penalty_tokens: DEFAULT_QUEUE_PENALTY_TOKENS,
            pin_hysteresis_tokens: DEFAULT_HYSTERESIS_TOKENS,
        }
    }

    /// Defaults of the `session` policy: the `prefix` defaults plus `session_pin = 10`.
    pub fn session() -> Self {
        let mut config = Self::prefix();
        config
            .weights
            .insert(SessionPinScorer::NAME.to_string(), 10.0);
        config
    }

    /// The defaults for a policy (`session` or else `prefix`; the baselines do not score).
    pub fn for_policy(policy: Policy) -> Self {
        match policy {
            Policy::Session => Self::session(),
            _ => Self::prefix(),
        }
    }

    /// A scorer's weight (0 when absent).
    pub fn weight(&self, scorer: &str) -> f64 {
        self.weights.get(scorer).copied().unwrap_or(0.0)
    }

    /// Check names and numbers; the error says what to change.
    pub fn validate(&self) -> Result<(), String> {
        for (name, &weight) in &self.weights {
            if !SCORER_NAMES.contains(&name.as_str()) {
                return Err(format!(
                    "unknown scorer `{name}`; use one of: {}",
                    SCORER_NAMES.join(", ")
                ));
            }
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(format!(
                    "the weight of scorer `{name}` must be a finite number >= 0 (got {weight})"
                ));
            }
        }
        if self.weights.values().all(|&w| w == 0.0) {
            return Err(format!(
                "every scorer weight is 0; give at least one of {} a positive weight",
                SCORER_NAMES.join(", ")
            ));
        }
        let numbers = [
            ("herd_factor", self.herd_factor),
            ("herd_slack", self.herd_slack),
            ("queue_penalty_tokens", self.queue_penalty_tokens),
            ("pin_hysteresis_tokens", self.pin_hysteresis_tokens),
            ("max_waiting", self.saturation.max_waiting),
            ("max_kv_usage", self.saturation.max_kv_usage),
        ];
        for (name, value) in numbers {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!(
                    "`{name}` must be a finite number >= 0 (got {value})"
                ));
            }
        }
        Ok(())
    }
}

/// Filters, weighted scorers and the pin rule over a prefix index keyed by endpoint slot.
#[derive(Debug)]
pub struct Pipeline {
    filters: Vec<Box<dyn Filter>>,
    scorers: Vec<(f64, Box<dyn Scorer>)>,
    index: PrefixIndex,
    rule: PinRule,
    pins: bool,
}

impl Pipeline {
    /// A pipeline with an empty prefix index; fails when `config` does not validate.
    pub fn new(index: PrefixIndexConfig, config: &ScoringConfig) -> Result<Pipeline, String> {
        config.validate()?;
        let filters: Vec<Box<dyn Filter>> = vec![
            Box::new(Available),
            Box::new(NotExcluded),
            Box::new(RoleMatch),
            Box::new(PreferUnsaturated {
                limits: config.saturation,
            }),
            Box::new(PreferFreeSlot),
            Box::new(SpreadReserved),
        ];
        let all: [Box<dyn Scorer>; 5] = [
            Box::new(SessionPinScorer),
            Box::new(PrefixScorer {
                herd_factor: config.herd_factor,
                herd_slack: config.herd_slack,
            }),
            Box::new(QueueScorer),
            Box::new(KvUsageScorer),
            Box::new(InFlightTokensScorer),
        ];
        let scorers: Vec<(f64, Box<dyn Scorer>)> = all
            .into_iter()
            .map(|s| (config.weight(s.name()), s))
            .filter(|(w, _)| *w > 0.0)
            .collect();
        Ok(Pipeline {
            filters,
            scorers,
            index: PrefixIndex::new(0, index),
            rule: PinRule {
                queue_penalty_tokens: config.queue_penalty_tokens,
                hysteresis_tokens: config.pin_hysteresis_tokens,
            },
            pins: config.weight(SessionPinScorer::NAME) > 0.0,
        })
    }

    /// The scorers that run, with their weights, in order.
    pub fn scorers(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        self.scorers.iter().map(|(w, s)| (s.name(), *w))
    }

    /// Whether the pipeline honours session pins (it has the `session_pin` scorer).
    pub fn uses_pins(&self) -> bool {
        self.pins
    }

    /// [`Picker::pick`] at a given time (for metrics staleness).
    pub fn pick_at(
        &self,
        endpoints: &[Arc<Endpoint>],
        request: &PickRequest<'_>,
        now: Instant,
    ) -> Option<Pick> {
        let reports: Vec<Option<LoadReport>> = endpoints.iter().map(|e| e.load_report()).collect();
        let view = PoolView {
            endpoints,
            request,
            now,
            reports: &reports,
        };
        let mut candidates: Vec<usize> = (0..endpoints.len()).collect();
        for filter in &self.filters {
            filter.filter(&view, &mut candidates);
        }
        // Filters keep positions in range; a custom one might not.
        candidates.retain(|&i| i < endpoints.len());
        if candidates.is_empty() {
            return None;
        }
        let mut matched: Vec<usize> = if request.prefix.is_empty() {
            vec![0; candidates.len()]
        } else {
            let slots: Vec<usize> = candidates.iter().map(|&i| endpoints[i].slot).collect();
            self.index.match_lens(request.prefix, &slots)
        };
        let chunks = request.prefix.len().max(1) as f64;
        let mut matches: Vec<f64> = matched.iter().map(|&m| m as f64 / chunks).collect();

        let mut held_pin = None;
        let mut pin = PinOutcome::None;
        if self.pins {
            pin = match request.pinned {
                Pinned::None => PinOutcome::None,
                Pinned::Gone => PinOutcome::Broken(BreakCause::Unavailable),
                Pinned::At(p) => match candidates.iter().position(|&i| i == p) {
                    None => PinOutcome::Broken(self.why_dropped(&view, p)),
                    Some(k) => {
                        let cost = |j: usize| PinCost {
                            wait_tokens: self.rule.wait_tokens(
                                endpoints[candidates[j]].pending_prefill_tokens(),
                                view.engine_waiting(candidates[j]),
                            ),
                            matched: matches[j],
                        };
                        let others = (0..candidates.len()).filter(|&j| j != k).map(cost);
                        let verdict = match request.prefill_not_queued {
                            true => None,
                            false => self.rule.judge(request.prompt_tokens, &cost(k), others),
                        };
                        match verdict {
                            None => {
                                held_pin = Some(p);
                                PinOutcome::Held
                            }
                            Some(cause) => {
                                // Only where moving is cheaper by the rule's own measure: the
                                // scores alone could pick another endpoint holding the prefix
                                // and as busy, and the pin would swing back the next turn.
                                let stay = cost(k);
                                let kept: Vec<usize> = (0..candidates.len())
                                    .filter(|&j| {
                                        let moving = PinRule::move_tokens(
                                            request.prompt_tokens,
                                            &stay,
                                            &cost(j),
                                        );
                                        j != k
                                            && moving + self.rule.hysteresis_tokens
                                                < stay.wait_tokens
                                    })
                                    .collect();
                                candidates = kept.iter().map(|&j| candidates[j]).collect();
                                matched = kept.iter().map(|&j| matched[j]).collect();
                                matches = kept.iter().map(|&j| matches[j]).collect();
                                PinOutcome::Broken(cause)
                            }
                        }
                    }
                },
            };
        }

        if candidates.is_empty() {
            return None;
        }
        let ctx = ScoreContext {
            view: &view,
            index: Some(&self.index),
            matches: &matches,
            held_pin,
        };
        let c = candidates.len();
        let mut scores = vec![0.0; self.scorers.len() * c];
        for ((_, scorer), out) in self.scorers.iter().zip(scores.chunks_exact_mut(c)) {
            scorer.score(&ctx, &candidates, out);
            for s in out.iter_mut() {
                *s = if s.is_nan() { 0.0 } else { s.clamp(0.0, 1.0) };
            }
        }
        let total = |k: usize| -> f64 {
            self.scorers
                .iter()
                .enumerate()
                .map(|(j, (w, _))| w * scores[j * c + k])
                .sum()
        };
        let totals: Vec<f64> = (0..c).map(total).collect();
        let best = totals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = (0..c).filter(|&k| totals[k] >= best - TIE).collect();
        let winner = random_choice(&tied)?;
        let runner_up = (0..c)
            .filter(|&k| k != winner)
            .max_by(|&a, &b| totals[a].total_cmp(&totals[b]));

        if let Some(p) = held_pin {
            if candidates[winner] != p {
                pin = PinOutcome::Broken(BreakCause::Outscored);
            }
        }
        let uncached = request.prompt_tokens as f64 * (1.0 - matches[winner]);
        Some(Pick {
            index: candidates[winner],
            reason: self.reason(&scores, c, winner, runner_up),
            uncached_tokens_estimate: (uncached.round() as u64).min(request.prompt_tokens),
            pin,
            matched_chunks: matched[winner],
        })
    }

    /// Why the pinned endpoint at `position` did not survive the filters.
    fn why_dropped(&self, view: &PoolView<'_>, position: usize) -> BreakCause {
        match view.endpoints.get(position) {
            // admitted by the request but dropped by a load filter (saturated, no free slot)
            Some(ep) if view.request.admits(ep, position) => BreakCause::Saturated,
            _ => BreakCause::Unavailable,
        }
    }

    /// The deciding reason (see the module doc). `scores` holds one row of `c` per scorer.
    fn reason(&self, scores: &[f64], c: usize, winner: usize, runner_up: Option<usize>) -> Reason {
        const CATEGORIES: [Reason; 3] = [Reason::Pin, Reason::Prefix, Reason::Load];
        let by_category = |k: Option<usize>| -> [f64; 3] {
            let mut sums = [0.0; 3];
            for (j, (w, scorer)) in self.scorers.iter().enumerate() {
                let slot = CATEGORIES
                    .iter()
                    .position(|&r| r == scorer.reason())
                    .unwrap_or(2);
                sums[slot] += k.map_or(0.0, |k| w * scores[j * c + k]);
            }
            sums
        };
        let won = by_category(Some(winner));
        let largest = |values: [f64; 3]| -> Option<Reason> {
            let (mut best, mut at) = (TIE, None);
            for (r, v) in CATEGORIES.into_iter().zip(values) {
                if v > best {
                    (best, at) = (v, Some(r));
                }
            }
            at
        };
        let margins = runner_up.map(|r| {
            let lost = by_category(Some(r));
            [won[0] - lost[0], won[1] - lost[1], won[2] - lost[2]]
        });
        margins
            .and_then(largest)
            .or_else(|| largest(won))
            .unwrap_or(Reason::Load)
    }
}

impl Picker for Pipeline {
    fn pick(&self, endpoints: &[Arc<Endpoint>], request: &PickRequest<'_>) -> Option<Pick> {
        self.pick_at(endpoints, request, Instant::now())
    }

    fn prefix_index(&self) -> Option<&PrefixIndex> {
        Some(&self.index)
    }

    /// The engine will hold the prompt's chunks once it has run it, whatever it reported as
    /// cached beforehand, so routing records them.
    fn routed(&self, slot: usize, prefix: &[u64]) {
        if !prefix.is_empty() {
            self.index.record(slot, prefix);
        }
    }

    /// The engine's cached-token report corrects the index when it predicted more than the
    /// engine had ([`PrefixIndex::correct`]).
    fn completed(
        &self,
        slot: usize,
        prefix: &[u64],
        matched_chunks: usize,
        cached_tokens: u64,
        prompt_tokens: u64,
    ) {
        self.index
            .correct(slot, prefix, matched_chunks, cached_tokens, prompt_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Role;
    use std::time::Duration;

    fn eps(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                let ep = Endpoint::new(format!("p/{i}"), format!("http://127.0.0.1:{}", 9000 + i));
                Arc::new(ep.with_slot(i))
            })
            .collect()
    }

    fn pipeline(config: &ScoringConfig) -> Pipeline {
        Pipeline::new(PrefixIndexConfig::default(), config).unwrap()
    }

    fn session() -> Pipeline {
        pipeline(&ScoringConfig::session())
    }

    fn prefix() -> Pipeline {
        pipeline(&ScoringConfig::prefix())
    }

    /// Chunk hashes `1..=n` (any u64s do: the index never looks inside).
    fn chunks(n: u64) -> Vec<u64> {
        (1..=n).collect()
    }

    fn req<'a>(prefix: &'a [u64], prompt_tokens: u64, pinned: Pinned) -> PickRequest<'a> {
        PickRequest {
            prefix,
            prompt_tokens,
            pinned,
            ..PickRequest::default()
        }
    }

    fn report(at: Instant, waiting: f64) -> LoadReport {
        LoadReport {
            at,
            waiting,
            running: 1.0,
            kv_usage: Some(0.3),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        }
    }

    #[test]
    fn a_routed_prefix_comes_back_to_its_endpoint() {
        let e = eps(4);
        let p = prefix();
        let h = chunks(40);
        let first = p.pick(&e, &req(&h, 2560, Pinned::None)).unwrap();
        assert_eq!(first.reason, Reason::Load, "cold: placed by load");
        assert_eq!(
            (first.uncached_tokens_estimate, first.matched_chunks),
            (2560, 0)
        );
        p.routed(e[first.index].slot, &h);
        for _ in 0..20 {
            let again = p.pick(&e, &req(&h, 2560, Pinned::None)).unwrap();
            assert_eq!(again.index, first.index);
            assert_eq!(again.reason, Reason::Prefix);
            assert_eq!(
                (again.uncached_tokens_estimate, again.matched_chunks),
                (0, 40)
            );
            assert_eq!(again.pin, PinOutcome::None);
        }
    }

    #[test]
    fn the_uncached_estimate_follows_the_match_on_the_winner() {
        let e = eps(2);
        let p = prefix();
        let h = chunks(10);
        p.routed(1, &h[..9]);
        let pick = p.pick(&e, &req(&h, 1000, Pinned::None)).unwrap();
        assert_eq!(pick.index, 1);
        assert_eq!(pick.uncached_tokens_estimate, 100);
        assert_eq!(pick.matched_chunks, 9);
        let no_prompt = p.pick(&e, &req(&[], 1000, Pinned::None)).unwrap();
        assert_eq!(no_prompt.uncached_tokens_estimate, 1000);
    }

    #[test]
    fn cold_prompts_go_to_the_least_loaded_endpoint() {
        let e = eps(3);
        let p = prefix();
        let _a = e[0].begin(100, 100);
        let _b = e[2].begin(100, 100);
        let pick = p.pick(&e, &req(&chunks(30), 100, Pinned::None)).unwrap();
        assert_eq!((pick.index, pick.reason), (1, Reason::Load));
    }

    #[test]
    fn cold_prompts_go_where_the_queue_clears_soonest_by_measured_throughput() {
        // Equal queues, in requests and in tokens; endpoint 1 prefills four times as fast.
        let e = eps(2);
        let p = prefix();
        let _a = e[0].begin(8_000, 8_000);
        let _b = e[1].begin(8_000, 8_000);
        e[0].observe_prefill(10_000, Duration::from_secs(1));
        e[1].observe_prefill(40_000, Duration::from_secs(1));
        for _ in 0..50 {
            let pick = p.pick(&e, &req(&chunks(30), 4_000, Pinned::None)).unwrap();
            assert_eq!((pick.index, pick.reason), (1, Reason::Load));
        }
    }

    #[test]
    fn cold_prompts_on_an_idle_fleet_spread_at_random() {
        let e = eps(4);
        let p = prefix();
        let mut seen = [false; 4];
        for _ in 0..200 {
            seen[p.pick(&e, &req(&[], 10, Pinned::None)).unwrap().index] = true;
        }
        assert!(seen.iter().all(|&s| s), "{seen:?}");
    }

    #[test]
    fn cold_prompts_go_where_the_modelled_cache_has_room() {
        let config = PrefixIndexConfig {
            default_capacity_tokens: 64 * 10,
            ..PrefixIndexConfig::default()
        };
        let p = Pipeline::new(config, &ScoringConfig::prefix()).unwrap();
        let e = eps(3);
        p.routed(0, &(100..110).collect::<Vec<u64>>()); // full
        p.routed(1, &(200..205).collect::<Vec<u64>>()); // half full
        p.routed(2, &(300..310).collect::<Vec<u64>>()); // full, most recently used
        for _ in 0..10 {
            let pick = p.pick(&e, &req(&chunks(8), 512, Pinned::None)).unwrap();
            assert_eq!((pick.index, pick.reason), (1, Reason::Load));
        }
        // Once every cache is full, the one whose coldest chunk is coldest takes it.
        p.routed(1, &(400..410).collect::<Vec<u64>>());
        let pick = p.pick(&e, &req(&chunks(8), 512, Pinned::None)).unwrap();
        assert_eq!(pick.index, 0);
    }

    #[test]
    fn a_crowded_endpoint_loses_its_prefix_to_the_least_loaded() {
        let e = eps(3);
        let p = prefix();
        let h = chunks(50);
        p.routed(0, &h);
        // Mean in flight 4, threshold 1.5 * 4 + 2 = 8: endpoint 0 with 10 is crowded.
        let _busy: Vec<_> = (0..10).map(|_| e[0].begin(10, 10)).collect();
        let _other: Vec<_> = (0..2).map(|_| e[1].begin(10, 10)).collect();
        let pick = p.pick(&e, &req(&h, 3200, Pinned::None)).unwrap();
        assert_eq!((pick.index, pick.reason), (2, Reason::Load));
        // Below the threshold the prefix still wins over an idle endpoint.
        let e2 = eps(3);
        let _some: Vec<_> = (0..3).map(|_| e2[0].begin(10, 10)).collect();
        let pick = p.pick(&e2, &req(&h, 3200, Pinned::None)).unwrap();
        assert_eq!((pick.index, pick.reason), (0, Reason::Prefix));
    }

    #[test]
    fn a_burst_sharing_one_prefix_spreads_once_its_holder_is_crowded() {
        let e = eps(4);
        let p = prefix();
        let h = chunks(100);
        p.routed(2, &h);
        let mut guards = Vec::new();
        let mut per_endpoint = [0usize; 4];
        for _ in 0..24 {
            let pick = p.pick(&e, &req(&h, 6400, Pinned::None)).unwrap();
            per_endpoint[pick.index] += 1;
            guards.push(e[pick.index].begin(6400, pick.uncached_tokens_estimate));
            p.routed(e[pick.index].slot, &h);
        }
        // The holder takes the first few, then the burst spills, the others learn the prefix,
        // and no endpoint ends more than one request above the gate: 1.5 * 6 + 2 = 11.
        assert!(per_endpoint[2] >= 3, "{per_endpoint:?}");
        assert!(
            per_endpoint.iter().filter(|&&n| n > 0).count() >= 3,
            "{per_endpoint:?}"
        );
        assert!(per_endpoint.iter().all(|&n| n <= 12), "{per_endpoint:?}");
    }

    #[test]
    fn unavailable_endpoints_are_never_picked() {
        let e = eps(4);
        let p = session();
        let h = chunks(20);
        p.routed(0, &h);
        p.routed(1, &h);
        e[0].set_healthy(false);
        e[1].retire();
        for pinned in [Pinned::None, Pinned::At(0), Pinned::At(1), Pinned::Gone] {
            for _ in 0..20 {
                let pick = p.pick(&e, &req(&h, 1280, pinned)).unwrap();
                assert!(pick.index >= 2, "{pick:?}");
            }
        }
        e[2].set_healthy(false);
        e[3].retire();
        assert_eq!(p.pick(&e, &req(&h, 1280, Pinned::At(0))), None);
        assert_eq!(p.pick(&[], &req(&h, 1280, Pinned::None)), None);
    }

    #[test]
    fn excluded_endpoints_and_other_roles_are_never_picked() {
        let e: Vec<Arc<Endpoint>> = (0..3)
            .map(|i| {
                let role = if i == 2 { Role::Prefill } else { Role::Both };
                Arc::new(
                    Endpoint::new(format!("p/{i}"), "http://x")
                        .with_slot(i)
                        .with_role(role),
                )
            })
            .collect();
        let p = prefix();
        let h = chunks(20);
        p.routed(0, &h);
        let request = PickRequest {
            exclude: &[0],
            role: Some(Role::Both),
            ..req(&h, 1280, Pinned::None)
        };
        for _ in 0..20 {
            assert_eq!(p.pick(&e, &request).unwrap().index, 1);
        }
        let prefill = PickRequest {
            role: Some(Role::Prefill),
            ..req(&h, 1280, Pinned::None)
        };
        assert_eq!(p.pick(&e, &prefill).unwrap().index, 2);
        let none_left = PickRequest {
            exclude: &[0, 1],
            ..request
        };
        assert_eq!(p.pick(&e, &none_left), None);
    }

    #[test]
    fn saturated_endpoints_are_avoided_while_others_are_not() {
        let now = Instant::now();
        let e = eps(3);
        let p = prefix();
        let h = chunks(20);
        p.routed(0, &h);
        e[0].set_load_report(report(now, 40.0)); // queue full (default limit 32)
        e[1].set_load_report(report(now, 40.0));
        e[2].set_load_report(report(now, 1.0));
        assert_eq!(
            p.pick_at(&e, &req(&h, 1280, Pinned::None), now)
                .unwrap()
                .index,
            2
        );
        // Everything saturated: pick anyway (the prefix then wins).
        e[2].set_load_report(report(now, 40.0));
        assert_eq!(
            p.pick_at(&e, &req(&h, 1280, Pinned::None), now)
                .unwrap()
                .index,
            0
        );
    }

    #[test]
    fn the_prefix_index_is_keyed_by_slot_and_survives_reordering() {
        let p = prefix();
        let h = chunks(30);
        let a = Arc::new(Endpoint::new("a", "http://a").with_slot(0));
        let b = Arc::new(Endpoint::new("b", "http://b").with_slot(1));
        let c = Arc::new(Endpoint::new("c", "http://c").with_slot(2));
        let before = vec![a.clone(), b.clone(), c.clone()];
        let pick = p.pick(&before, &req(&h, 1920, Pinned::None)).unwrap();
        let holder = before[pick.index].clone();
        p.routed(holder.slot, &h);
        // Discovery reload: reordered, one endpoint gone, a new one in a fresh slot first.
        let d = Arc::new(Endpoint::new("d", "http://d").with_slot(7));
        let mut after: Vec<Arc<Endpoint>> = vec![d, c, b, a];
        after.retain(|e| e.slot == holder.slot || e.name == "d" || e.slot == (holder.slot + 1) % 3);
        for _ in 0..10 {
            let pick = p.pick(&after, &req(&h, 1920, Pinned::None)).unwrap();
            assert_eq!(after[pick.index].name, holder.name);
            assert_eq!(pick.reason, Reason::Prefix);
        }
        // The endpoint goes away for good: its slot is cleared and the prompt is cold again.
        p.prefix_index().unwrap().clear(holder.slot);
        let pick = p.pick(&after, &req(&h, 1920, Pinned::None)).unwrap();
        assert_eq!(pick.matched_chunks, 0);
        assert_eq!(pick.reason, Reason::Load);
    }

    #[test]
    fn a_cold_first_turn_reporting_no_cache_still_counts_as_held() {
        let e = eps(2);
        let p = prefix();
        let h = chunks(25);
        let first = p.pick(&e, &req(&h, 1600, Pinned::None)).unwrap();
        p.routed(e[first.index].slot, &h);
        p.completed(e[first.index].slot, &h, first.matched_chunks, 0, 0);
        assert_eq!(
            p.pick(&e, &req(&h, 1600, Pinned::None)).unwrap().index,
            first.index
        );
    }

    #[test]
    fn an_over_predicted_cache_hit_makes_the_index_forget_cold_chunks() {
        let e = eps(2);
        let config = PrefixIndexConfig {
            default_capacity_tokens: 64 * 20,
            ..PrefixIndexConfig::default()
        };
        let p = Pipeline::new(config, &ScoringConfig::prefix()).unwrap();
        let other: Vec<u64> = (100..110).collect();
        let h = chunks(10);
        p.routed(0, &other);
        p.routed(0, &h);
        let pick = p.pick(&e, &req(&h, 640, Pinned::None)).unwrap();
        assert_eq!((pick.index, pick.matched_chunks), (0, 10));
        p.routed(0, &h);
        // The engine had only 2 chunks (128 of the 640 tokens) of the 10 predicted: other
        // traffic evicted 8, so the index forgets the coldest, the tail of the other prompt,
        // all but a chunk of slack.
        p.completed(0, &h, pick.matched_chunks, 128, 640);
        let index = p.prefix_index().unwrap();
        assert_eq!(index.match_len(0, &other), 3);
        assert_eq!(index.match_len(0, &h), 10);
    }

    /// A session pinned to endpoint 0, which holds 90% of a 100k-token prompt (chunks of 1000
    /// tokens: the index only counts chunks); the others hold its first 10%.
    fn pinned_session(n: usize) -> (Vec<Arc<Endpoint>>, Pipeline, Vec<u64>) {
        let e = eps(n);
        let p = session();
        let h = chunks(100);
        p.routed(0, &h[..90]);
        for slot in 1..n {
            p.routed(slot, &h[..10]);
        }
        (e, p, h)
    }

    #[test]
    fn the_pin_holds_under_moderate_load() {
        let (e, p, h) = pinned_session(3);
        let now = Instant::now();
        // Moderately busy pin, idle alternatives.
        let _work: Vec<_> = (0..4).map(|_| e[0].begin(100_000, 10_000)).collect();
        e[0].set_load_report(report(now, 5.0));
        let pick = p
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), now)
            .unwrap();
        assert_eq!(pick.index, 0);
        assert_eq!(pick.pin, PinOutcome::Held);
        assert_eq!(pick.reason, Reason::Pin);
        assert_eq!(pick.uncached_tokens_estimate, 10_000);
    }

    #[test]
    fn the_pin_breaks_when_its_endpoint_is_unavailable_or_gone() {
        let (e, p, h) = pinned_session(3);
        let broken = PinOutcome::Broken(BreakCause::Unavailable);
        let gone = p.pick(&e, &req(&h, 100_000, Pinned::Gone)).unwrap();
        assert_eq!(gone.pin, broken);
        let out_of_range = p.pick(&e, &req(&h, 100_000, Pinned::At(9))).unwrap();
        assert_eq!(out_of_range.pin, broken);
        // It failed this request already.
        let retry = PickRequest {
            exclude: &[0],
            ..req(&h, 100_000, Pinned::At(0))
        };
        let pick = p.pick(&e, &retry).unwrap();
        assert_ne!(pick.index, 0);
        assert_eq!(pick.pin, broken);
        e[0].set_healthy(false);
        let pick = p.pick(&e, &req(&h, 100_000, Pinned::At(0))).unwrap();
        assert_ne!(pick.index, 0);
        assert_eq!(pick.pin, broken);
        assert_eq!(pick.reason, Reason::Load, "1 and 2 match alike: load chose");
        e[0].set_healthy(true);
        e[0].retire();
        let pick = p.pick(&e, &req(&h, 100_000, Pinned::At(0))).unwrap();
        assert_eq!((pick.index != 0, pick.pin), (true, broken));
    }

    #[test]
    fn the_pin_breaks_on_stale_metrics_or_a_full_queue_unless_everything_is_saturated() {
        let mut config = ScoringConfig::session();
        config.saturation.staleness = Some(Duration::from_secs(5));
        let p = pipeline(&config);
        let e = eps(3);
        let h = chunks(100);
        p.routed(0, &h[..90]);
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        // The pin's metrics are 10 s old; the others' fresh.
        e[0].set_load_report(report(t0, 0.0));
        e[1].set_load_report(report(later, 0.0));
        e[2].set_load_report(report(later, 0.0));
        let saturated = PinOutcome::Broken(BreakCause::Saturated);
        let pick = p
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), later)
            .unwrap();
        assert_eq!((pick.index != 0, pick.pin), (true, saturated));
        // Fresh but with a full queue.
        e[0].set_load_report(report(later, 32.0));
        let pick = p
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), later)
            .unwrap();
        assert_eq!((pick.index != 0, pick.pin), (true, saturated));
        // Everything stale (the scraper is down): moving buys nothing, the pin holds.
        let much_later = later + Duration::from_secs(60);
        let pick = p
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), much_later)
            .unwrap();
        assert_eq!((pick.index, pick.pin), (0, PinOutcome::Held));
        // Healthy again: holds.
        e[0].set_load_report(report(later, 2.0));
        let pick = p
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), later)
            .unwrap();
        assert_eq!((pick.index, pick.pin), (0, PinOutcome::Held));
        // Every endpoint saturated, one of them unseen for 10 s with an idle engine in its last
        // figures: new work goes to the ones the gateway can see into.
        e[0].set_load_report(report(t0, 0.0));
        e[1].set_load_report(report(later, 40.0));
        e[2].set_load_report(report(later, 40.0));
        for _ in 0..20 {
            let pick = p
                .pick_at(&e, &req(&[], 1_000, Pinned::None), later)
                .unwrap();
            assert_ne!(pick.index, 0);
        }
    }

    #[test]
    fn the_pin_breaks_when_waiting_costs_more_than_recomputing_and_holds_again_after() {
        let (e, p, h) = pinned_session(2);
        // 100k-token prompt: the pin holds 90k, the alternative 10k, so moving recomputes 80k;
        // with the default hysteresis the pin breaks once its pending prefill passes 80k + that.
        let threshold = 80_000 + DEFAULT_HYSTERESIS_TOKENS as u64;
        let request = req(&h, 100_000, Pinned::At(0));
        let mut queued = vec![e[0].begin(threshold, threshold)];
        let pick = p.pick(&e, &request).unwrap();
        assert_eq!(
            (pick.index, pick.pin),
            (0, PinOutcome::Held),
            "at the threshold: hold"
        );
        queued.push(e[0].begin(1, 1));
        let pick = p.pick(&e, &request).unwrap();
        assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Wait));
        assert_eq!(
            pick.index, 1,
            "the pin's endpoint is not a candidate once the rule breaks it"
        );
        assert_eq!(pick.uncached_tokens_estimate, 90_000);
        // A prompt that shares engine steps with the pending prefills does not wait behind them.
        let sharing = PickRequest {
            prefill_not_queued: true,
            ..request
        };
        let pick = p.pick(&e, &sharing).unwrap();
        assert_eq!((pick.index, pick.pin), (0, PinOutcome::Held));
        // The alternative gets busy too: waiting there costs as much, so the pin holds again.
        let _there = e[1].begin(100_000, 60_000);
        let pick = p.pick(&e, &request).unwrap();
        assert_eq!((pick.index, pick.pin), (0, PinOutcome::Held));
        // Both drained: the pin holds.
        drop(queued);
        drop(_there);
        let pick = p.pick(&e, &request).unwrap();
        assert_eq!((pick.index, pick.pin), (0, PinOutcome::Held));
    }

    #[test]
    fn a_pin_broken_by_the_wait_rule_moves_where_moving_pays_not_to_a_busy_copy() {
        let (e, p, h) = pinned_session(3);
        // Endpoint 2 holds the prefix too, and is as busy as the pin; endpoint 1 is idle.
        p.routed(2, &h[..90]);
        let request = req(&h, 100_000, Pinned::At(0));
        let _busy = [e[0].begin(300_000, 300_000), e[2].begin(300_000, 300_000)];
        for _ in 0..20 {
            let pick = p.pick(&e, &request).unwrap();
            assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Wait));
            assert_eq!(pick.index, 1, "the scores alone pick the busy copy");
        }
    }

    #[test]
    fn engine_queues_count_in_the_wait_rule() {
        let (e, p, h) = pinned_session(2);
        let now = Instant::now();
        // 80k to recompute + 4096 hysteresis = 84 096 tokens = 41.06 queued requests of 2048;
        // below the default saturation limit of 32 queued, so only the wait rule can break it.
        let mut config = ScoringConfig::session();
        config.saturation.max_waiting = 1000.0;
        config.pin_hysteresis_tokens = 4096.0;
        let p2 = pipeline(&config);
        p2.routed(0, &h[..90]);
        p2.routed(1, &h[..10]);
        e[0].set_load_report(report(now, 41.0));
        let pick = p2
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), now)
            .unwrap();
        assert_eq!(pick.pin, PinOutcome::Held);
        e[0].set_load_report(report(now, 42.0));
        let pick = p2
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), now)
            .unwrap();
        assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Wait));
        // With the default limits, 32 queued already counts as saturated.
        e[0].set_load_report(report(now, 32.0));
        let pick = p
            .pick_at(&e, &req(&h, 100_000, Pinned::At(0)), now)
            .unwrap();
        assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Saturated));
    }

    #[test]
    fn a_light_pin_weight_can_be_outscored() {
        let mut config = ScoringConfig::session();
        config.weights.insert("session_pin".into(), 0.5);
        let p = pipeline(&config);
        let e = eps(2);
        let h = chunks(10);
        p.routed(1, &h);
        // Pinned to 0, which holds nothing; 1 holds the whole prompt: prefix 3 beats pin 0.5.
        let pick = p.pick(&e, &req(&h, 640, Pinned::At(0))).unwrap();
        assert_eq!(pick.index, 1);
        assert_eq!(pick.pin, PinOutcome::Broken(BreakCause::Outscored));
        assert_eq!(pick.reason, Reason::Prefix);
        // With the default weight the pin wins (the wait rule sees nothing to wait for).
        let p = session();
        p.routed(1, &h);
        let pick = p.pick(&e, &req(&h, 640, Pinned::At(0))).unwrap();
        assert_eq!(
            (pick.index, pick.pin, pick.reason),
            (0, PinOutcome::Held, Reason::Pin)
        );
    }

    #[test]
    fn pins_are_ignored_without_the_session_pin_scorer() {
        let e = eps(2);
        let p = prefix();
        let h = chunks(10);
        p.routed(1, &h);
        for pinned in [Pinned::At(0), Pinned::Gone] {
            let pick = p.pick(&e, &req(&h, 640, pinned)).unwrap();
            assert_eq!((pick.index, pick.pin), (1, PinOutcome::None));
        }
        assert!(!p.uses_pins() && session().uses_pins());
    }

    #[test]
    fn the_reason_is_what_beat_the_runner_up() {
        let e = eps(3);
        let p = session();
        let h = chunks(10);
        // A single candidate: what contributed most to its total.
        let one = &e[..1];
        let pick = p.pick(one, &req(&h, 640, Pinned::None)).unwrap();
        assert_eq!(pick.reason, Reason::Load, "no match: only load scored");
        let pick = p.pick(one, &req(&h, 640, Pinned::At(0))).unwrap();
        assert_eq!(pick.reason, Reason::Pin);
        p.routed(0, &h);
        let pick = p.pick(one, &req(&h, 640, Pinned::None)).unwrap();
        assert_eq!(
            pick.reason,
            Reason::Prefix,
            "3 for the match against 2.5 of load"
        );
        // A match beats idle endpoints: prefix. The loaded holder, once crowded: load.
        let pick = p.pick(&e, &req(&h, 640, Pinned::None)).unwrap();
        assert_eq!((pick.index, pick.reason), (0, Reason::Prefix));
        let _busy: Vec<_> = (0..6).map(|_| e[0].begin(640, 640)).collect();
        let pick = p.pick(&e, &req(&h, 640, Pinned::None)).unwrap();
        assert_ne!(pick.index, 0);
        assert_eq!(pick.reason, Reason::Load);
        // The pin, busy as it is, holds: pin.
        let pick = p.pick(&e, &req(&h, 640, Pinned::At(0))).unwrap();
        assert_eq!((pick.index, pick.reason), (0, Reason::Pin));
    }

    #[test]
    fn scoring_configs_validate_names_and_numbers() {
        let ok = ScoringConfig::session();
        assert!(ok.validate().is_ok());
        let mut unknown = ok.clone();
        unknown.weights.insert("cache_hit".into(), 1.0);
        let err = unknown.validate().unwrap_err();
        assert_eq!(
            err,
            "unknown scorer `cache_hit`; use one of: session_pin, prefix, queue, kv_usage, in_flight_tokens"
        );
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let mut c = ok.clone();
            c.weights.insert("queue".into(), bad);
            assert!(
                c.validate().unwrap_err().contains("`queue` must be"),
                "{bad}"
            );
            let mut c = ok.clone();
            c.herd_factor = bad;
            assert!(c.validate().unwrap_err().contains("`herd_factor`"), "{bad}");
            let mut c = ok.clone();
            c.pin_hysteresis_tokens = bad;
            assert!(c
                .validate()
                .unwrap_err()
                .contains("`pin_hysteresis_tokens`"));
        }
        let mut zero = ok.clone();
        zero.weights.values_mut().for_each(|w| *w = 0.0);
        assert!(zero
            .validate()
            .unwrap_err()
            .contains("every scorer weight is 0"));
        assert!(Pipeline::new(PrefixIndexConfig::default(), &zero).is_err());
        // Zero-weight scorers do not run; the order is fixed.
        let mut some = ScoringConfig::prefix();
        some.weights.insert("kv_usage".into(), 0.0);
        let p = pipeline(&some);
        let scorers: Vec<_> = p.scorers().collect();
        assert_eq!(
            scorers,
            [("prefix", 3.0), ("queue", 1.0), ("in_flight_tokens", 1.0)]
        );
        assert_eq!(
            ScoringConfig::for_policy(Policy::Session),
            ScoringConfig::session()
        );
        assert_eq!(
            ScoringConfig::for_policy(Policy::Prefix),
            ScoringConfig::prefix()
        );
    }
}
