//! `summary.json`: one object per policy, computed from the client's request records, the
//! engines' counters and the reuse oracle. Times are simulated milliseconds.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::oracle::ReuseResult;

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
    /// Where the gateways keep conversation state and session pins: `memory` (one gateway) or
    /// `redis` (shared by all gateways of a policy).
    pub store: String,
    /// `--kill-replica`: simulated second at which replica 0 is killed, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill_replica_s: Option<f64>,
    /// Sessions in the workload (sub-agents included).
    pub sessions: usize,
    /// Simulated span replayed, seconds.
    pub duration_s: f64,
    /// Wall seconds per simulated second.
    pub time_scale: f64,
    /// KV blocks per replica.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Seed of the workload and the replicas.
    pub seed: u64,
    /// Whether the replicas expose simulated engine busy time (else GPU figures are null).
    pub engine_busy_counter: bool,
    /// One object per policy, in the order requested.
    pub policies: Vec<PolicySummary>,
    /// The same policies replayed at a second time scale (`--compare-time-scale`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_scale_check: Option<TimeScaleCheck>,
    /// Fleet layouts compared (`--topology`); `replicas` is the size of `agg`.
    pub topologies: Vec<String>,
    /// `--pd-threshold` values swept over the P/D layouts (empty: the gateway's default).
    pub pd_thresholds: Vec<u64>,
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
    /// Requests shed (429/503).
    pub shed: u64,
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
}

/// One policy's results: every field `summary.json` promises.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicySummary {
    /// Routing policy name.
    pub policy: String,
    /// Time scale of this replay.
    pub time_scale: f64,
    /// Requests sent (= successes + errors + shed).
    pub requests: u64,
    /// Requests with a terminal completed/incomplete event.
    pub successes: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Requests rejected for load (429/503).
    pub shed: u64,
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
    /// distinct full prompt blocks of the successful requests, plus per successful request
    /// `ceil(output_tokens / block_size) + 2` (blocks holding its output, and its partial block
    /// while running). Conservative; requests that failed are not counted.
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
    /// What killing a replica did (`--kill-replica`); see `run::kill`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill: Option<KillSummary>,
    /// Per team (the gateway's unit of priority bands), by name.
    pub teams: BTreeMap<String, TeamSummary>,
    /// The first error message seen, to show what went wrong.
    pub first_error: Option<String>,
    /// Row label: the policy, or `POLICY@TOPOLOGY[/t=THRESHOLD]` when the run compares
    /// topologies (see `run::topology`).
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
}

/// What [`PolicySummary::build`] needs.
pub struct BuildInput<'a> {
    /// Policy name.
    pub policy: &'a str,
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

fn ratio(part: u64, whole: u64) -> f64 {
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
    prompt_tokens: u64,
    cached_tokens: u64,
    output_tokens: u64,
    ttft: Vec<f64>,
    e2e: Vec<f64>,
}

impl Tally {
    fn of<'a>(records: impl Iterator<Item = &'a RequestRecord>) -> Tally {
        let mut tally = Tally {
            requests: 0,
            successes: 0,
            errors: 0,
            shed: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens: 0,
            ttft: Vec::new(),
            e2e: Vec::new(),
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
                Outcome::Shed => tally.shed += 1,
                Outcome::Error(_) => tally.errors += 1,
            }
        }
        tally.ttft.sort_by(f64::total_cmp);
        tally.e2e.sort_by(f64::total_cmp);
        tally
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
        let teams = teams
            .into_iter()
            .map(|(team, records)| {
                let t = Tally::of(records.into_iter());
                let summary = TeamSummary {
                    requests: t.requests,
                    errors: t.errors,
                    shed: t.shed,
                    prompt_tokens: t.prompt_tokens,
                    cached_tokens: t.cached_tokens,
                    cache_hit_ratio: ratio(t.cached_tokens, t.prompt_tokens),
                    ttft_p50_ms: percentile(&t.ttft, 50.0),
                    ttft_p90_ms: percentile(&t.ttft, 90.0),
                    ttft_p99_ms: percentile(&t.ttft, 99.0),
                    e2e_p50_ms: percentile(&t.e2e, 50.0),
                    e2e_p99_ms: percentile(&t.e2e, 99.0),
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
        PolicySummary {
            policy: input.policy.to_string(),
            time_scale: input.time_scale,
            requests: all.requests,
            successes: all.successes,
            errors: all.errors,
            shed: all.shed,
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
            },
            requests_per_gateway,
            requests_per_replica,
            kill: None,
            teams,
            first_error,
            label: input.policy.to_string(),
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
            gateway: (seq % 2) as usize,
            endpoint: Some("bench/0".into()),
            team: team.into(),
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
            record(2, "interactive", Outcome::Shed, 0, 0),
            record(3, "interactive", Outcome::Error("HTTP 500".into()), 0, 0),
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
            replicas: Vec::new(),
        };
        let summary = PolicySummary::build(BuildInput {
            policy: "round_robin",
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
        assert_eq!(summary.requests, 4);
        assert_eq!(
            summary.successes + summary.errors + summary.shed,
            summary.requests
        );
        assert_eq!(summary.prompt_tokens, 2100);
        assert!((summary.cache_hit_ratio - 1000.0 / 2100.0).abs() < 1e-12);
        assert!((summary.captured_reuse - 2.0 * 1000.0 / 2100.0).abs() < 1e-12);
        assert_eq!(summary.ttft_p50_ms, 100.0);
        assert_eq!(summary.first_error.as_deref(), Some("HTTP 500"));
        assert!((summary.gpu_seconds_per_million_tokens.unwrap() - 1000.0).abs() < 1e-9);
        let interactive = &summary.teams["interactive"];
        assert_eq!(
            (interactive.requests, interactive.shed, interactive.errors),
            (2, 1, 1)
        );
        assert_eq!(summary.teams["agents"].cached_tokens, 1000);
        assert_eq!(summary.requests_per_gateway, [2, 2]);
        assert_eq!(summary.requests_per_replica, [4, 0]);
        // 100 distinct blocks + two successes with 10 output tokens: (3 + 2) each.
        assert_eq!(summary.no_eviction_kv_blocks, 110);
        assert_eq!(summary.kill, None);
        // span: first send at 0 s, last completion at 3 s + 1 s.
        assert_eq!(summary.span_s, 4.0);
    }
}
