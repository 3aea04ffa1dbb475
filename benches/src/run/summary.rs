//! `summary.json`: one object per row (a routing policy, a fleet layout and threshold, flow
//! control on or off, and which traffic; see `run::rows`), computed from the client's request records, the engines' counters, the reuse
//! oracle and the gateways' flow-control state. Times are simulated milliseconds.
//!
//! Outcomes: `requests = successes + errors + shed + rate_limited`, where `shed` counts the
//! flow-control refusals for load (`overloaded_shed`, `queue_full`, `queue_timeout`) and
//! `rate_limited` the refusals by a team's rate limits (the benchmark configures none, so it
//! stays 0 and `requests = successes + errors + shed`). Every other failure is an error.
//! Flow-control figures (`bands`, `turns`, `fairness`, queue waits) are defined in
//! [`super::flow`].

use std::collections::BTreeMap;

use serde::Serialize;

use crate::oracle::ReuseResult;

use super::flow::{self, BandSummary, FairnessSummary, SaturationSample, TurnsSummary};
use super::kill::KillSummary;
use super::metrics::{FleetMetrics, Sample};
use super::pd::PdSummary;
use super::replay::{Outcome, RequestRecord};

/// The whole `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Workload name.
    pub workload: String,
    /// The command line that produced it.
    pub command: String,
    /// Replicas per policy.
    pub replicas: usize,
    /// Gateways per policy; turn `t` of session `s` goes to gateway `(s + t) % gateways`.
    pub gateways: usize,
    /// Where the gateways keep conversation state and session pins: `memory` (in process,
    /// shared by all gateways of a policy) or `redis` (shared by all gateways of a policy).
    pub store: String,
    /// `--kill-replica`: simulated second at which replica 0 is killed, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill_replica_s: Option<f64>,
    /// Sessions in the workload (sub-agents included).
    pub sessions: usize,
    /// Simulated span replayed, seconds.
    pub duration_s: f64,
    /// Wall seconds per simulated second (1 on the virtual clock).
    pub time_scale: f64,
    /// `--clock`: `wall` or `virtual`.
    pub clock: String,
    /// KV blocks per replica.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Seed of the workload and the replicas.
    pub seed: u64,
    /// `max_num_seqs` of every replica (the engine's batch width).
    pub max_num_seqs: usize,
    /// Tokens every replica computes per step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Largest prefill chunk per sequence and step (`--long-prefill-token-threshold`).
    pub long_prefill_token_threshold: usize,
    /// The interactive band's reserve (`--interactive-reserve`; workloads with bands).
    pub interactive_reserve: f64,
    /// `--kv-working-set`: every gateway's `max_kv_working_set` (0: no limit).
    pub kv_working_set: f64,
    /// `--aging`: every gateway's `[flow] aging_s`, simulated seconds.
    pub aging_s: f64,
    /// Requests the fleet of the first `--topology` layout runs at once: replicas serving
    /// requests (all of `agg`, the decode ones of `pd:PxD`) x max_num_seqs. `--mixed-batch-load`
    /// is a factor of it; each row's own is in its `request_slots`.
    pub request_slots: usize,
    /// `--flow-control` settings compared, in order (`on`, `off`).
    pub flow_control: Vec<String>,
    /// Whether the batch band is sheddable (`--batch-sheddable`).
    pub batch_sheddable: bool,
    /// `--mixed-batch-load`: the agents team's sessions per request slot, if given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixed_batch_load: Option<f64>,
    /// Whether the engines expose simulated engine busy time (else GPU figures are null).
    pub engine_busy_counter: bool,
    /// One object per row, in the order of `run::rows`: for each policy, layout and threshold,
    /// each `--flow-control` setting, then the interactive team alone (`--interactive-alone`).
    pub policies: Vec<PolicySummary>,
    /// Per policy, layout and threshold, the interactive team's TTFT p99 with flow control on,
    /// off and alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub interactive_isolation: Vec<IsolationCheck>,
    /// The same policies replayed at a second time scale (`--compare-time-scale`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_scale_check: Option<TimeScaleCheck>,
    /// Fleet layouts compared (`--topology`); `replicas` is the size of `agg`.
    pub topologies: Vec<String>,
    /// `--pd-threshold` values swept over the P/D layouts (empty: the gateway's default).
    pub pd_thresholds: Vec<u64>,
}

/// How well flow control isolates the interactive team from a batch load, for one policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IsolationCheck {
    /// Routing policy.
    pub policy: String,
    /// The rows' common label part: the policy, with `@TOPOLOGY[/t=T]` when the run compares
    /// layouts (see `run::rows`).
    pub setup: String,
    /// Fleet layout of the rows compared: `agg` or `pd:PxD`.
    pub topology: String,
    /// Interactive TTFT p99 when it runs alone (the `interactive-alone` row).
    pub alone_ttft_p99_ms: Option<f64>,
    /// Interactive TTFT p99 beside the batch load with flow control on.
    pub flow_on_ttft_p99_ms: Option<f64>,
    /// The same with flow control off.
    pub flow_off_ttft_p99_ms: Option<f64>,
    /// Interactive requests that got no answer (refused or failed), which the p99s above
    /// leave out: alone, flow on, flow off.
    pub alone_unanswered: Option<u64>,
    /// See `alone_unanswered`.
    pub flow_on_unanswered: Option<u64>,
    /// See `alone_unanswered`.
    pub flow_off_unanswered: Option<u64>,
    /// flow_on / alone (the goal: at most 2).
    pub on_over_alone: Option<f64>,
    /// flow_off / flow_on (the goal: at least 5).
    pub off_over_on: Option<f64>,
    /// The agents team's offered load with flow control on (outstanding requests per request
    /// slot; the goal needs at least 2).
    pub agents_offered_load: Option<f64>,
}

/// A second replay at another time scale, to show how much the figures depend on it.
#[derive(Debug, Clone, Serialize)]
pub struct TimeScaleCheck {
    /// The second time scale.
    pub time_scale: f64,
    /// One object per policy at that scale.
    pub policies: Vec<PolicySummary>,
}

/// Latency and cache figures of one team's requests.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TeamSummary {
    /// Requests sent by the team.
    pub requests: u64,
    /// Requests that ended in an error.
    pub errors: u64,
    /// Requests refused for load (`overloaded_shed`, `queue_full`, `queue_timeout`).
    pub shed: u64,
    /// Requests refused by rate limits.
    pub rate_limited: u64,
    /// Input + output tokens of its successful requests (what the fleet ran for it).
    pub dispatched_tokens: u64,
    /// dispatched_tokens over every team's.
    pub dispatched_token_share: f64,
    /// Mean requests outstanding (sent, not finished) over the replayed span.
    pub outstanding_mean: f64,
    /// outstanding_mean / the fleet's request slots: above 1 the team alone asks for more than
    /// the fleet runs at once.
    pub offered_load: f64,
    /// Prompt tokens of its successful requests.
    pub prompt_tokens: u64,
    /// Cached prompt tokens of its successful requests.
    pub cached_tokens: u64,
    /// cached_tokens / prompt_tokens.
    pub cache_hit_ratio: f64,
    /// Time to first token, median.
    pub ttft_p50_ms: f64,
    /// Time to first token, 90th percentile.
    pub ttft_p90_ms: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_ms: f64,
    /// End-to-end latency, median.
    pub e2e_p50_ms: f64,
    /// End-to-end latency, 99th percentile.
    pub e2e_p99_ms: f64,
    /// Queue wait of its admitted requests, median (null without flow control).
    pub queue_wait_p50_ms: Option<f64>,
    /// Queue wait, 99th percentile.
    pub queue_wait_p99_ms: Option<f64>,
    /// Its continuing turns versus new sessions (turn-first order applies within a team).
    pub turns: TurnsSummary,
}

/// Engine-side totals as scraped from the replicas.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineSummary {
    /// `vllm:prompt_tokens_total` over the fleet.
    pub prompt_tokens: u64,
    /// `vllm:prefix_cache_hits_total` over the fleet.
    pub prefix_cache_hits: u64,
    /// `vllm:generation_tokens_total` over the fleet.
    pub generation_tokens: u64,
    /// Simulated engine busy seconds over the fleet (null when the replicas do not expose it).
    pub busy_seconds: Option<f64>,
    /// Whether `prefill_tokens_computed` is the sim's counter (else prompt - hits).
    pub prefill_counter_exposed: bool,
    /// `vllm:num_preemptions_total` over the fleet: running sequences an engine preempted for
    /// lack of KV blocks (their blocks freed, their tokens computed again once readmitted).
    pub preemptions: u64,
}

/// One row's results: every field `summary.json` promises.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicySummary {
    /// Row label, unique in the run (see `run::rows`): the policy, `POLICY@TOPOLOGY[/t=T]` when
    /// the run compares layouts, then ` flow-off` or ` interactive-alone`. Same as `label`.
    pub row: String,
    /// Routing policy name.
    pub policy: String,
    /// `on` or `off`.
    pub flow_control: String,
    /// `all` (the whole workload) or `interactive-alone` (only the interactive team).
    pub traffic: String,
    /// Requests this row's fleet runs at once: replicas serving requests x max_num_seqs (the
    /// unit of the teams' `offered_load`).
    pub request_slots: usize,
    /// Time scale of this replay.
    pub time_scale: f64,
    /// Requests sent (= successes + errors + shed + rate_limited).
    pub requests: u64,
    /// Requests with a terminal completed/incomplete event.
    pub successes: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Requests refused for load by flow control (`overloaded_shed`, `queue_full`,
    /// `queue_timeout`).
    pub shed: u64,
    /// Requests refused by rate limits.
    pub rate_limited: u64,
    /// Refusals for load (shed, queue full, queue timeout; not rate limits) for which no
    /// saturation sample from before their send to after their answer shows the gateways'
    /// pool saturated (see `run::flow`); null without flow control.
    pub shed_unsaturated: Option<u64>,
    /// Fraction of the replay's saturation samples in which the pool was saturated; null
    /// without flow control.
    pub saturated_fraction: Option<f64>,
    /// Prompt tokens of successful requests (`usage.input_tokens`).
    pub prompt_tokens: u64,
    /// Cached prompt tokens of successful requests (`usage.input_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// cached_tokens / prompt_tokens.
    pub cache_hit_ratio: f64,
    /// Hit ratio of one LRU prefix cache with the whole fleet's capacity replaying the same prompts.
    pub available_reuse_ratio: f64,
    /// The same with unlimited capacity.
    pub infinite_reuse_ratio: f64,
    /// cache_hit_ratio / available_reuse_ratio (can exceed 1).
    pub captured_reuse: f64,
    /// Prompt tokens the oracle replayed (equals prompt_tokens when the token model matches).
    pub oracle_prompt_tokens: u64,
    /// KV blocks per replica with which no replica could have evicted anything in this replay:
    /// distinct full blocks of the successful requests' prompts and answers (as the engines
    /// cache them), plus per successful request `ceil(output_tokens / block_size) + 2` (blocks
    /// holding its output, and its partial block while running). Conservative: answers are
    /// counted twice; requests that failed are not counted.
    pub no_eviction_kv_blocks: u64,
    /// Time to first token, median.
    pub ttft_p50_ms: f64,
    /// Time to first token, 90th percentile.
    pub ttft_p90_ms: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_ms: f64,
    /// End-to-end latency, median.
    pub e2e_p50_ms: f64,
    /// End-to-end latency, 99th percentile.
    pub e2e_p99_ms: f64,
    /// Output tokens per simulated second over the replay's span.
    pub output_tokens_per_s: f64,
    /// Prompt tokens the engines actually prefilled.
    pub prefill_tokens_computed: u64,
    /// Simulated engine busy seconds per million tokens processed (prompt + output); null when
    /// the replicas do not expose busy time.
    pub gpu_seconds_per_million_tokens: Option<f64>,
    /// Simulated seconds from the first send to the last completion.
    pub span_s: f64,
    /// Wall seconds the replay took.
    pub wall_s: f64,
    /// Engine-side totals (a killed replica contributes its counters as of the kill).
    pub engine: EngineSummary,
    /// Requests sent to each gateway, in gateway order.
    pub requests_per_gateway: Vec<u64>,
    /// Requests the gateways reported (`x-agentgate-endpoint`) as served by each replica, in
    /// replica order, whatever their outcome; requests without an endpoint are not counted.
    pub requests_per_replica: Vec<u64>,
    /// Each replica's mean load over the run, in replica order: its engine's running + waiting
    /// requests averaged over the periodic metric samples (`run::metrics::mean_load`); empty
    /// without samples.
    pub replica_mean_load: Vec<f64>,
    /// What killing a replica did (`--kill-replica`); see `run::kill`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill: Option<KillSummary>,
    /// Per team (the gateway's unit of priority bands), by name.
    pub teams: BTreeMap<String, TeamSummary>,
    /// Per flow-control band, by name (with flow control off, by the band each team would run
    /// in).
    pub bands: BTreeMap<String, BandSummary>,
    /// Continuing turns versus new sessions.
    pub turns: TurnsSummary,
    /// Per band with several teams: token shares while every team of it was backlogged.
    pub fairness: BTreeMap<String, FairnessSummary>,
    /// The first error message seen, to show what went wrong.
    pub first_error: Option<String>,
    /// Row label (see `run::rows`); the same as `row`.
    pub label: String,
    /// Fleet layout: `agg` or `pd:PxD`.
    pub topology: String,
    /// Prefill/decode figures of a `pd:PxD` row; see `run::pd` for how P/D rows count tokens,
    /// cache hits and GPU time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pd: Option<PdSummary>,
}

/// One policy's summary plus the raw material for the charts.
#[derive(Debug, Clone)]
pub struct PolicyRun {
    /// The summary.
    pub summary: PolicySummary,
    /// Every request, in send order.
    pub records: Vec<RequestRecord>,
    /// Periodic metric samples of the replicas.
    pub samples: Vec<Sample>,
    /// What the fleet-capacity oracle found cached, per served request in send order.
    pub oracle: Vec<crate::run::reuse::OracleHit>,
}

/// What [`PolicySummary::build`] needs.
pub struct BuildInput<'a> {
    /// Row label.
    pub row: &'a str,
    /// Policy name.
    pub policy: &'a str,
    /// `on` or `off`.
    pub flow_control: &'a str,
    /// `all` or `interactive-alone`.
    pub traffic: &'a str,
    /// The band the configuration gives each team (empty with flow control off).
    pub team_bands: &'a BTreeMap<String, String>,
    /// Gateway saturation samples (empty with flow control off).
    pub saturation: &'a [SaturationSample],
    /// Simulated span in which turns start (`--duration`).
    pub duration_s: f64,
    /// Requests the row's fleet runs at once.
    pub request_slots: usize,
    /// Time scale of the replay.
    pub time_scale: f64,
    /// The requests.
    pub records: &'a [RequestRecord],
    /// Oracle with the fleet's capacity.
    pub available: &'a ReuseResult,
    /// Oracle with unlimited capacity.
    pub infinite: &'a ReuseResult,
    /// Distinct full prompt blocks the unlimited oracle holds.
    pub distinct_prompt_blocks: u64,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Final scrape.
    pub engine: &'a FleetMetrics,
    /// Gateways the requests were spread over.
    pub gateways: usize,
    /// Replicas behind the gateways.
    pub replicas: usize,
    /// Wall seconds of the replay.
    pub wall_s: f64,
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted
        .get(rank.clamp(1, sorted.len()) - 1)
        .copied()
        .unwrap_or(0.0)
}

/// part / whole (0 when whole is 0).
pub fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Counts, tokens and latency percentiles over a set of records.
struct Tally {
    requests: u64,
    successes: u64,
    errors: u64,
    shed: u64,
    rate_limited: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    output_tokens: u64,
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    queue_wait: Vec<f64>,
}

impl Tally {
    fn of<'a>(records: impl Iterator<Item = &'a RequestRecord>) -> Tally {
        let mut tally = Tally {
            requests: 0,
            successes: 0,
            errors: 0,
            shed: 0,
            rate_limited: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens: 0,
            ttft: Vec::new(),
            e2e: Vec::new(),
            queue_wait: Vec::new(),
        };
        for record in records {
            tally.requests += 1;
            match record.outcome {
                Outcome::Success => {
                    tally.successes += 1;
                    tally.prompt_tokens += record.input_tokens;
                    tally.cached_tokens += record.cached_tokens;
                    tally.output_tokens += record.output_tokens;
                    if let Some(ttft) = record.ttft_ms {
                        tally.ttft.push(ttft);
                    }
                    tally.e2e.push(record.e2e_ms);
                }
                Outcome::Shed(_) => tally.shed += 1,
                Outcome::RateLimited(_) => tally.rate_limited += 1,
                Outcome::Error(_) => tally.errors += 1,
            }
            // Admitted requests that failed afterwards (cut at the drain limit, broken
            // mid-stream) waited too: their wait came with the response headers.
            tally.queue_wait.extend(record.queue_wait_ms);
        }
        tally.ttft.sort_by(f64::total_cmp);
        tally.e2e.sort_by(f64::total_cmp);
        tally.queue_wait.sort_by(f64::total_cmp);
        tally
    }

    /// Queue wait percentile, None when no request reported one.
    fn queue_wait(&self, p: f64) -> Option<f64> {
        (!self.queue_wait.is_empty()).then(|| percentile(&self.queue_wait, p))
    }
}

impl PolicySummary {
    /// Summarise one policy's replay.
    pub fn build(input: BuildInput<'_>) -> PolicySummary {
        let records = input.records;
        let all = Tally::of(records.iter());
        let mut teams: BTreeMap<String, Vec<&RequestRecord>> = BTreeMap::new();
        for record in records {
            teams.entry(record.team.clone()).or_default().push(record);
        }
        let all_dispatched = all.prompt_tokens + all.output_tokens;
        let slots = input.request_slots.max(1) as f64;
        let teams = teams
            .into_iter()
            .map(|(team, records)| {
                let outstanding = flow::outstanding_mean(records.iter().copied(), input.duration_s);
                let turns = flow::turns(records.iter().copied(), input.saturation);
                let t = Tally::of(records.into_iter());
                let dispatched_tokens = t.prompt_tokens + t.output_tokens;
                let summary = TeamSummary {
                    requests: t.requests,
                    errors: t.errors,
                    shed: t.shed,
                    rate_limited: t.rate_limited,
                    dispatched_tokens,
                    dispatched_token_share: ratio(dispatched_tokens, all_dispatched),
                    outstanding_mean: outstanding,
                    offered_load: outstanding / slots,
                    prompt_tokens: t.prompt_tokens,
                    cached_tokens: t.cached_tokens,
                    cache_hit_ratio: ratio(t.cached_tokens, t.prompt_tokens),
                    ttft_p50_ms: percentile(&t.ttft, 50.0),
                    ttft_p90_ms: percentile(&t.ttft, 90.0),
                    ttft_p99_ms: percentile(&t.ttft, 99.0),
                    e2e_p50_ms: percentile(&t.e2e, 50.0),
                    e2e_p99_ms: percentile(&t.e2e, 99.0),
                    queue_wait_p50_ms: t.queue_wait(50.0),
                    queue_wait_p99_ms: t.queue_wait(99.0),
                    turns,
                };
                (team, summary)
            })
            .collect();
        let first_sent = records
            .iter()
            .map(|r| r.sent_s)
            .fold(f64::INFINITY, f64::min);
        let last_done = records
            .iter()
            .map(|r| r.sent_s + r.e2e_ms / 1000.0)
            .fold(f64::NEG_INFINITY, f64::max);
        let span_s = if records.is_empty() {
            0.0
        } else {
            (last_done - first_sent).max(0.0)
        };
        let cache_hit_ratio = ratio(all.cached_tokens, all.prompt_tokens);
        let available_reuse_ratio = input.available.ratio;
        let engine = input.engine;
        let processed = engine.prompt_tokens + engine.generation_tokens;
        let gpu_seconds_per_million_tokens = engine.busy_seconds.map(|busy| {
            if processed == 0 {
                0.0
            } else {
                busy / processed as f64 * 1e6
            }
        });
        let block_size = input.block_size.max(1) as u64;
        let output_blocks: u64 = records
            .iter()
            .filter(|r| r.outcome == Outcome::Success)
            .map(|r| r.output_tokens.div_ceil(block_size) + 2)
            .sum();
        let mut requests_per_gateway = vec![0u64; input.gateways.max(1)];
        for record in records {
            if let Some(count) = requests_per_gateway.get_mut(record.gateway) {
                *count += 1;
            }
        }
        let mut requests_per_replica = vec![0u64; input.replicas];
        for record in records {
            let replica = record.endpoint.as_deref().and_then(super::replica_of);
            if let Some(count) = replica.and_then(|i| requests_per_replica.get_mut(i)) {
                *count += 1;
            }
        }
        let first_error = records.iter().find_map(|r| match &r.outcome {
            Outcome::Error(message) => Some(message.clone()),
            _ => None,
        });
        let sampled = !input.saturation.is_empty();
        let shed_unsaturated = sampled.then(|| {
            records
                .iter()
                // Refusals for load (a rate limit is the team's budget, not the fleet's).
                .filter(|r| matches!(r.outcome, Outcome::Shed(_)))
                .filter(|r| {
                    let answered_s = r.sent_s + r.e2e_ms / 1000.0;
                    !flow::saturated_during(input.saturation, r.sent_s, answered_s)
                })
                .count() as u64
        });
        let saturated_fraction = sampled.then(|| {
            let saturated = input.saturation.iter().filter(|s| s.saturated).count();
            saturated as f64 / input.saturation.len() as f64
        });
        PolicySummary {
            row: input.row.to_string(),
            policy: input.policy.to_string(),
            flow_control: input.flow_control.to_string(),
            traffic: input.traffic.to_string(),
            request_slots: input.request_slots,
            time_scale: input.time_scale,
            requests: all.requests,
            successes: all.successes,
            errors: all.errors,
            shed: all.shed,
            rate_limited: all.rate_limited,
            shed_unsaturated,
            saturated_fraction,
            prompt_tokens: all.prompt_tokens,
            cached_tokens: all.cached_tokens,
            output_tokens: all.output_tokens,
            cache_hit_ratio,
            available_reuse_ratio,
            infinite_reuse_ratio: input.infinite.ratio,
            captured_reuse: if available_reuse_ratio > 0.0 {
                cache_hit_ratio / available_reuse_ratio
            } else {
                0.0
            },
            oracle_prompt_tokens: input.available.prompt_tokens,
            no_eviction_kv_blocks: input.distinct_prompt_blocks + output_blocks,
            ttft_p50_ms: percentile(&all.ttft, 50.0),
            ttft_p90_ms: percentile(&all.ttft, 90.0),
            ttft_p99_ms: percentile(&all.ttft, 99.0),
            e2e_p50_ms: percentile(&all.e2e, 50.0),
            e2e_p99_ms: percentile(&all.e2e, 99.0),
            output_tokens_per_s: if span_s > 0.0 {
                all.output_tokens as f64 / span_s
            } else {
                0.0
            },
            prefill_tokens_computed: engine.prefill_tokens_computed,
            gpu_seconds_per_million_tokens,
            span_s,
            wall_s: input.wall_s,
            engine: EngineSummary {
                prompt_tokens: engine.prompt_tokens,
                prefix_cache_hits: engine.prefix_cache_hits,
                generation_tokens: engine.generation_tokens,
                busy_seconds: engine.busy_seconds,
                prefill_counter_exposed: engine.prefill_counter_exposed,
                preemptions: engine.preemptions,
            },
            requests_per_gateway,
            requests_per_replica,
            replica_mean_load: Vec::new(),
            kill: None,
            teams,
            bands: flow::bands(records, input.team_bands),
            turns: flow::turns(records.iter(), input.saturation),
            fairness: flow::fairness(records, input.team_bands),
            first_error,
            label: input.row.to_string(),
            topology: "agg".to_string(),
            pd: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, team: &str, outcome: Outcome, input: u64, cached: u64) -> RequestRecord {
        RequestRecord {
            seq,
            session: 0,
            turn: seq as usize,
            continuing: seq > 0,
            gateway: (seq % 2) as usize,
            endpoint: Some("bench/0".into()),
            route_reason: None,
            pin_moved: None,
            team: team.into(),
            band: None,
            queue_wait_ms: None,
            sent_s: seq as f64,
            outcome,
            ttft_ms: Some(100.0 * (seq + 1) as f64),
            e2e_ms: 1000.0,
            input_tokens: input,
            cached_tokens: cached,
            output_tokens: 10,
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), 50.0);
        assert_eq!(percentile(&values, 99.0), 99.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn summary_counts_add_up_per_policy_and_team() {
        let records = vec![
            record(0, "agents", Outcome::Success, 1000, 0),
            record(1, "agents", Outcome::Success, 1100, 1000),
            record(2, "interactive", Outcome::Shed("queue_full".into()), 0, 0),
            record(3, "interactive", Outcome::Error("HTTP 500".into()), 0, 0),
            record(
                4,
                "interactive",
                Outcome::RateLimited("rate_limit_exceeded_requests".into()),
                0,
                0,
            ),
        ];
        let oracle = ReuseResult {
            prompt_tokens: 2100,
            hit_tokens: 1050,
            ratio: 0.5,
        };
        let engine = FleetMetrics {
            prompt_tokens: 2100,
            prefix_cache_hits: 1000,
            generation_tokens: 20,
            prefill_tokens_computed: 1100,
            prefill_counter_exposed: false,
            busy_seconds: Some(2.12),
            preemptions: 0,
            replicas: Vec::new(),
        };
        let team_bands = BTreeMap::new();
        let saturation: Vec<SaturationSample> = [
            (1.0, false),
            (2.5, false),
            (3.2, false),
            (3.5, true),
            (4.5, false),
        ]
        .into_iter()
        .map(|(t_s, saturated)| SaturationSample {
            t_s,
            queued: u64::from(saturated),
            saturated,
        })
        .collect();
        let summary = PolicySummary::build(BuildInput {
            row: "round_robin",
            policy: "round_robin",
            flow_control: "on",
            traffic: "all",
            team_bands: &team_bands,
            saturation: &saturation,
            duration_s: 4.0,
            request_slots: 2,
            time_scale: 0.1,
            records: &records,
            available: &oracle,
            infinite: &oracle,
            distinct_prompt_blocks: 100,
            block_size: 4,
            engine: &engine,
            gateways: 2,
            replicas: 2,
            wall_s: 1.0,
        });
        assert_eq!(summary.requests, 5);
        assert_eq!(
            summary.successes + summary.errors + summary.shed + summary.rate_limited,
            summary.requests
        );
        assert_eq!((summary.shed, summary.rate_limited), (1, 1));
        // The refusal sent at 2 s and answered at 3 s saw no saturated sample from before to
        // after; the one sent at 4 s came right after a saturated one.
        assert_eq!(summary.shed_unsaturated, Some(1));
        assert!((summary.saturated_fraction.unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(summary.prompt_tokens, 2100);
        assert!((summary.cache_hit_ratio - 1000.0 / 2100.0).abs() < 1e-12);
        assert!((summary.captured_reuse - 2.0 * 1000.0 / 2100.0).abs() < 1e-12);
        assert_eq!(summary.ttft_p50_ms, 100.0);
        assert_eq!(summary.first_error.as_deref(), Some("HTTP 500"));
        assert!((summary.gpu_seconds_per_million_tokens.unwrap() - 1000.0).abs() < 1e-9);
        let interactive = &summary.teams["interactive"];
        assert_eq!(
            (
                interactive.requests,
                interactive.shed,
                interactive.rate_limited,
                interactive.errors
            ),
            (3, 1, 1, 1)
        );
        let agents = &summary.teams["agents"];
        assert_eq!(agents.cached_tokens, 1000);
        assert_eq!(agents.dispatched_tokens, 2120);
        assert_eq!(agents.dispatched_token_share, 1.0);
        assert_eq!(interactive.dispatched_tokens, 0);
        // Two requests of 1 s each over a 4 s span, over 2 request slots.
        assert!((agents.outstanding_mean - 0.5).abs() < 1e-12);
        assert!((agents.offered_load - 0.25).abs() < 1e-12);
        assert_eq!(agents.queue_wait_p50_ms, None, "no queue wait was reported");
        assert!(summary.bands.is_empty() && summary.fairness.is_empty());
        assert_eq!(summary.turns.new.requests, 1);
        assert_eq!(summary.requests_per_gateway, [3, 2]);
        assert_eq!(summary.requests_per_replica, [5, 0]);
        // 100 distinct blocks + two successes with 10 output tokens: (3 + 2) each.
        assert_eq!(summary.no_eviction_kv_blocks, 110);
        assert_eq!(summary.kill, None);
        // span: first send at 0 s, last completion at 4 s + 1 s.
        assert_eq!(summary.span_s, 5.0);
    }
}
