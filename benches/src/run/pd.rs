//! Prefill/decode rows: the gateway's P/D counters, per-role engine totals, the accounting that
//! keeps P/D rows comparable with aggregated ones, and the report's P/D section.
//!
//! # Counters
//! At the end of a P/D replay every gateway's `/metrics` is scraped and summed
//! ([`GatewayCounters`]): `agentgate_pd_decisions_total` by decision (`disaggregated`: prefilled
//! on a prefill replica, reason `uncached` or `sub_agent`; `local`: run whole on the decode
//! replica, reason `cached` or `no_prefill_endpoint`), `agentgate_pd_fallbacks_total` by cause,
//! `agentgate_pd_transfer_failures_total`, `agentgate_pd_prefill_pin_moves_total` and the mean of
//! each leg of `agentgate_pd_leg_duration_seconds` (wall time there, reported here in simulated
//! ms: wall / time scale, like every latency of the run).
//!
//! # Accounting
//! A disaggregated request is admitted twice: by the prefill replica (its prompt, one token
//! generated) and by the decode replica (its prompt again, the KV received counted as cached,
//! then the output). Summing engine counters naively would count its prompt twice and its
//! transferred KV as cache hits. So, for P/D rows:
//! - `gpu_seconds_per_million_tokens` = busy seconds of ALL replicas (prefill and decode) x 1e6
//!   / (prompt + generated tokens of the decode replicas): every request's tokens once, at the
//!   replica that served it. With aggregated replicas only this is the usual formula.
//! - `prefill_tokens_computed` = prompt tokens prefilled by any replica, prefill and decode (the
//!   decode replica computes only what it was not sent, e.g. the prompt's last partial block).
//! - `cache_hit_ratio` = 1 - prefill_tokens_computed / (prompt tokens of the decode replicas),
//!   clamped to [0, 1]: the share of prompt tokens no engine had to compute because some engine's
//!   prefix cache held them. The cached tokens clients see (`cached_tokens`, and the per-team
//!   ratios) come from the decode replica and include the KV it received; their ratio is kept as
//!   `pd.client_cache_hit_ratio`. `captured_reuse` is recomputed from the engine-side ratio.
//!   For an aggregated row the same engine-side formula ([`engine_reuse`]) gives (up to failed
//!   requests and preemptions) its client-side ratio.
//! - per role, the engine totals, the busy share (busy seconds / (replicas x span)), and from the
//!   replicas' gauges sampled during the replay, the mean number of requests waiting per replica
//!   and the mean KV-cache usage: together they tell which pool limited the row, and whether by
//!   compute (busy) or by KV capacity (waiting with a full cache while not busy).
//!
//! The reuse oracle's capacity is the whole fleet's, prefill and decode replicas alike, so
//! `available_reuse_ratio` is the same for `agg` with N replicas and `pd:PxD` with P + D = N.

use std::fmt::Write;
use std::time::Duration;

use agentgate_sim::Role;
use serde::Serialize;

use super::metrics::{fleet_totals, FleetMetrics, ReplicaMetrics, Sample};
use super::summary::{PolicySummary, RunSummary};
use super::POOL;

/// Decisions of pools with prefill endpoints, by `decision` and `reason`.
pub const DECISIONS: &str = "agentgate_pd_decisions_total";
/// Disaggregated requests retried with a local prefill, by `cause`.
pub const FALLBACKS: &str = "agentgate_pd_fallbacks_total";
/// Decode legs that failed after their prefill leg ran.
pub const TRANSFER_FAILURES: &str = "agentgate_pd_transfer_failures_total";
/// Moves of the prefill half of session pins.
pub const PREFILL_PIN_MOVES: &str = "agentgate_pd_prefill_pin_moves_total";
/// Latency of each leg of a disaggregated request, by `leg`.
pub const LEG_DURATION: &str = "agentgate_pd_leg_duration_seconds";

/// Every series named `name` in a Prometheus text exposition, with its labels and value.
pub fn series(text: &str, name: &str) -> Vec<(Vec<(String, String)>, f64)> {
    let mut found = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value_text) = match rest.strip_prefix('{') {
            Some(inside) => match parse_labels(inside) {
                Some(parsed) => parsed,
                None => continue,
            },
            None if rest.starts_with(' ') => (Vec::new(), rest),
            None => continue,
        };
        if let Some(value) = value_text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            found.push((labels, value));
        }
    }
    found
}

/// `a="x",b="y"}` (label values escaped with `\\`, `\"`, `\n`) into pairs and the rest.
fn parse_labels(mut text: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        text = text.trim_start_matches([',', ' ']);
        if let Some(rest) = text.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, rest) = text.split_once('=')?;
        let mut chars = rest.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim().to_string(), value));
        text = rest.get(end + 2..)?;
    }
}

/// Sum of the series of `name` whose labels include every pair of `filter`.
pub fn sum_where(text: &str, name: &str, filter: &[(&str, &str)]) -> f64 {
    series(text, name)
        .into_iter()
        .filter(|(labels, _)| {
            filter
                .iter()
                .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, value)| value)
        .sum()
}

/// The gateway's P/D counters for the benchmark's pool, summed over gateways.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GatewayCounters {
    /// Requests prefilled on a prefill replica.
    pub disaggregated: u64,
    /// Of those, sub-agent calls.
    pub disaggregated_sub_agent: u64,
    /// Requests run whole on their decode replica.
    pub local: u64,
    /// Of those, because no prefill replica could take them.
    pub local_no_prefill_endpoint: u64,
    /// Retried locally after a failed prefill leg.
    pub fallbacks_prefill_failed: u64,
    /// Retried locally after a failed KV transfer.
    pub fallbacks_transfer_failed: u64,
    /// Failed KV transfers.
    pub transfer_failures: u64,
    /// Prefill halves of session pins that moved.
    pub prefill_pin_moves: u64,
    /// Wall seconds of all prefill legs.
    pub prefill_leg_seconds: f64,
    /// Prefill legs timed.
    pub prefill_legs: u64,
    /// Wall seconds of all decode legs (KV ready to first token).
    pub decode_leg_seconds: f64,
    /// Decode legs timed.
    pub decode_legs: u64,
}

impl GatewayCounters {
    /// Read one gateway's exposition.
    pub fn parse(text: &str) -> GatewayCounters {
        let count = |name: &str, filter: &[(&str, &str)]| {
            let mut all = vec![("pool", POOL)];
            all.extend_from_slice(filter);
            sum_where(text, name, &all).round().max(0.0) as u64
        };
        let seconds = |leg: &str| {
            sum_where(
                text,
                &format!("{LEG_DURATION}_sum"),
                &[("pool", POOL), ("leg", leg)],
            )
        };
        let legs = |leg: &str| count(&format!("{LEG_DURATION}_count"), &[("leg", leg)]);
        GatewayCounters {
            disaggregated: count(DECISIONS, &[("decision", "disaggregated")]),
            disaggregated_sub_agent: count(
                DECISIONS,
                &[("decision", "disaggregated"), ("reason", "sub_agent")],
            ),
            local: count(DECISIONS, &[("decision", "local")]),
            local_no_prefill_endpoint: count(
                DECISIONS,
                &[("decision", "local"), ("reason", "no_prefill_endpoint")],
            ),
            fallbacks_prefill_failed: count(FALLBACKS, &[("cause", "prefill_failed")]),
            fallbacks_transfer_failed: count(FALLBACKS, &[("cause", "transfer_failed")]),
            transfer_failures: count(TRANSFER_FAILURES, &[]),
            prefill_pin_moves: count(PREFILL_PIN_MOVES, &[]),
            prefill_leg_seconds: seconds("prefill"),
            prefill_legs: legs("prefill"),
            decode_leg_seconds: seconds("decode"),
            decode_legs: legs("decode"),
        }
    }

    fn add(&mut self, other: &GatewayCounters) {
        self.disaggregated += other.disaggregated;
        self.disaggregated_sub_agent += other.disaggregated_sub_agent;
        self.local += other.local;
        self.local_no_prefill_endpoint += other.local_no_prefill_endpoint;
        self.fallbacks_prefill_failed += other.fallbacks_prefill_failed;
        self.fallbacks_transfer_failed += other.fallbacks_transfer_failed;
        self.transfer_failures += other.transfer_failures;
        self.prefill_pin_moves += other.prefill_pin_moves;
        self.prefill_leg_seconds += other.prefill_leg_seconds;
        self.prefill_legs += other.prefill_legs;
        self.decode_leg_seconds += other.decode_leg_seconds;
        self.decode_legs += other.decode_legs;
    }
}

/// GET every gateway's `/metrics` (`base_urls`) and add up their P/D counters.
pub async fn scrape_gateways(
    client: &reqwest::Client,
    base_urls: &[String],
) -> Result<GatewayCounters, String> {
    let mut total = GatewayCounters::default();
    for base in base_urls {
        let url = format!("{base}/metrics");
        let text = client
            .get(&url)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map_err(|e| format!("cannot scrape the gateway's {url}: {e}"))?
            .text()
            .await
            .map_err(|e| format!("cannot read the gateway's {url}: {e}"))?;
        total.add(&GatewayCounters::parse(&text));
    }
    Ok(total)
}

/// Engine totals of the replicas of one role.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoleTotals {
    /// Replicas with this role.
    pub replicas: usize,
    /// Prompt tokens they admitted.
    pub prompt_tokens: u64,
    /// Prompt tokens they reported as cached (for decode replicas, KV received included).
    pub prefix_cache_hits: u64,
    /// Prompt tokens they prefilled.
    pub prefill_tokens_computed: u64,
    /// Tokens they generated (a prefill leg generates one).
    pub generation_tokens: u64,
    /// Simulated busy seconds (null when the replicas do not expose it).
    pub busy_seconds: Option<f64>,
    /// busy_seconds / (replicas x span_s): how busy the role's replicas were on average (null
    /// at time scale 0, where the span is wall time and busy time is not).
    pub busy_share: Option<f64>,
    /// Preemptions (`vllm:num_preemptions_total`).
    pub preemptions: u64,
    /// Requests waiting per replica, mean over the samples taken during the replay (null
    /// without samples).
    pub mean_waiting: Option<f64>,
    /// KV-cache usage (0..1), mean over the same samples.
    pub mean_kv_usage: Option<f64>,
}

/// `busy` seconds over `replicas` replicas and a span of `span_s`, when both are simulated time.
fn share(busy: Option<f64>, replicas: usize, span_s: f64, time_scale: f64) -> Option<f64> {
    let busy = busy?;
    (replicas > 0 && span_s > 0.0 && time_scale > 0.0).then(|| busy / (replicas as f64 * span_s))
}

/// Mean of `gauge` over the replicas `indices` and every sample.
fn sampled_mean(
    samples: &[Sample],
    indices: &[usize],
    gauge: fn(&ReplicaMetrics) -> f64,
) -> Option<f64> {
    let values: Vec<f64> = samples
        .iter()
        .flat_map(|s| indices.iter().filter_map(|&i| s.replicas.get(i)))
        .map(gauge)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

impl RoleTotals {
    fn of(
        indices: &[usize],
        engine: &FleetMetrics,
        samples: &[Sample],
        span_s: f64,
        time_scale: f64,
    ) -> RoleTotals {
        let replicas: Vec<ReplicaMetrics> = indices
            .iter()
            .filter_map(|&i| engine.replicas.get(i).copied())
            .collect();
        let count = replicas.len();
        let preemptions = replicas.iter().map(|r| r.preemptions).sum::<f64>();
        let totals = fleet_totals(replicas);
        RoleTotals {
            replicas: count,
            prompt_tokens: totals.prompt_tokens,
            prefix_cache_hits: totals.prefix_cache_hits,
            prefill_tokens_computed: totals.prefill_tokens_computed,
            generation_tokens: totals.generation_tokens,
            busy_seconds: totals.busy_seconds,
            busy_share: share(totals.busy_seconds, count, span_s, time_scale),
            preemptions: preemptions.round().max(0.0) as u64,
            mean_waiting: sampled_mean(samples, indices, |r| r.waiting),
            mean_kv_usage: sampled_mean(samples, indices, |r| r.kv_usage),
        }
    }
}

/// What `summary.json` adds to a P/D row (`pd`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdSummary {
    /// Prefill-role replicas.
    pub prefill_replicas: usize,
    /// Decode-role replicas.
    pub decode_replicas: usize,
    /// `[pools.disaggregation] threshold_tokens` the gateway used.
    pub threshold_tokens: u64,
    /// Requests prefilled on a prefill replica (gateway decisions).
    pub disaggregated: u64,
    /// Of those, sub-agent calls.
    pub disaggregated_sub_agent: u64,
    /// Requests run whole on their decode replica.
    pub local: u64,
    /// Of those, because no prefill replica could take them.
    pub local_no_prefill_endpoint: u64,
    /// disaggregated / (disaggregated + local).
    pub disaggregated_share: f64,
    /// Disaggregated requests retried locally after their prefill leg failed.
    pub fallbacks_prefill_failed: u64,
    /// Disaggregated requests retried locally after their KV transfer failed.
    pub fallbacks_transfer_failed: u64,
    /// Failed KV transfers.
    pub transfer_failures: u64,
    /// Moves of the prefill half of session pins.
    pub prefill_pin_moves: u64,
    /// Mean prefill leg (until the KV cache is ready on the decode replica), simulated ms.
    pub prefill_leg_mean_ms: Option<f64>,
    /// Mean decode leg (KV ready to first token), simulated ms.
    pub decode_leg_mean_ms: Option<f64>,
    /// Prompt tokens the decode replicas admitted: every request's prompt once.
    pub served_prompt_tokens: u64,
    /// cached_tokens / prompt_tokens as clients saw them (KV received from a prefill replica
    /// counts as cached there).
    pub client_cache_hit_ratio: f64,
    /// Totals of the prefill replicas.
    pub prefill: RoleTotals,
    /// Totals of the decode replicas.
    pub decode: RoleTotals,
}

/// Mean of `legs` legs lasting `seconds` in all, in simulated ms.
fn leg_mean_ms(seconds: f64, legs: u64, time_scale: f64) -> Option<f64> {
    if legs == 0 {
        return None;
    }
    let wall_ms = seconds / legs as f64 * 1000.0;
    Some(if time_scale > 0.0 {
        wall_ms / time_scale
    } else {
        wall_ms
    })
}

/// What [`finish`] needs about a P/D replay.
pub struct PdInput<'a> {
    /// Role of each replica, in replica order (the order of `engine.replicas`).
    pub roles: &'a [Role],
    /// Final scrape of the replicas.
    pub engine: &'a FleetMetrics,
    /// The replicas' gauges sampled during the replay.
    pub samples: &'a [Sample],
    /// The gateways' counters.
    pub counters: GatewayCounters,
    /// Threshold the pool used.
    pub threshold_tokens: u64,
    /// Time scale of the replay.
    pub time_scale: f64,
}

/// Turn a P/D row's summary into the accounting of the module doc and attach `pd`.
pub fn finish(summary: &mut PolicySummary, input: PdInput<'_>) {
    let (prefill, decode): (Vec<usize>, Vec<usize>) =
        (0..input.roles.len()).partition(|&i| input.roles[i] == Role::Prefill);
    let role = |indices: &[usize]| {
        RoleTotals::of(
            indices,
            input.engine,
            input.samples,
            summary.span_s,
            input.time_scale,
        )
    };
    let prefill = role(&prefill);
    let decode = role(&decode);
    let served = decode.prompt_tokens;
    let computed = input.engine.prefill_tokens_computed;
    let client_cache_hit_ratio = summary.cache_hit_ratio;
    summary.cache_hit_ratio = if served == 0 {
        0.0
    } else {
        served.saturating_sub(computed) as f64 / served as f64
    };
    summary.captured_reuse = if summary.available_reuse_ratio > 0.0 {
        summary.cache_hit_ratio / summary.available_reuse_ratio
    } else {
        0.0
    };
    let tokens = decode.prompt_tokens + decode.generation_tokens;
    summary.gpu_seconds_per_million_tokens = input.engine.busy_seconds.map(|busy| {
        if tokens == 0 {
            0.0
        } else {
            busy / tokens as f64 * 1e6
        }
    });
    let c = input.counters;
    let decided = c.disaggregated + c.local;
    summary.pd = Some(PdSummary {
        prefill_replicas: prefill.replicas,
        decode_replicas: decode.replicas,
        threshold_tokens: input.threshold_tokens,
        disaggregated: c.disaggregated,
        disaggregated_sub_agent: c.disaggregated_sub_agent,
        local: c.local,
        local_no_prefill_endpoint: c.local_no_prefill_endpoint,
        disaggregated_share: if decided == 0 {
            0.0
        } else {
            c.disaggregated as f64 / decided as f64
        },
        fallbacks_prefill_failed: c.fallbacks_prefill_failed,
        fallbacks_transfer_failed: c.fallbacks_transfer_failed,
        transfer_failures: c.transfer_failures,
        prefill_pin_moves: c.prefill_pin_moves,
        prefill_leg_mean_ms: leg_mean_ms(c.prefill_leg_seconds, c.prefill_legs, input.time_scale),
        decode_leg_mean_ms: leg_mean_ms(c.decode_leg_seconds, c.decode_legs, input.time_scale),
        served_prompt_tokens: served,
        client_cache_hit_ratio,
        prefill,
        decode,
    });
}

/// Share of prompt tokens no engine had to compute: 1 - prefill computed / prompt tokens
/// served (for an aggregated row, the engines' own prompt tokens).
pub fn engine_reuse(p: &PolicySummary) -> f64 {
    if p.pd.is_some() {
        return p.cache_hit_ratio;
    }
    let served = p.engine.prompt_tokens;
    if served == 0 {
        0.0
    } else {
        served.saturating_sub(p.prefill_tokens_computed) as f64 / served as f64
    }
}

/// Average busy share of all replicas of a row.
fn busy_share(p: &PolicySummary) -> Option<f64> {
    share(
        p.engine.busy_seconds,
        p.requests_per_replica.len(),
        p.span_s,
        p.time_scale,
    )
}

fn pct(value: f64) -> String {
    format!("{:.0}%", value * 100.0)
}

fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

fn gpu(p: &PolicySummary) -> String {
    p.gpu_seconds_per_million_tokens
        .map_or_else(|| "n/a".to_string(), |v| format!("{v:.1}"))
}

/// Busy shares (0..1) further apart than this name the busier pool when neither queues.
const BUSY_MARGIN: f64 = 0.1;

/// Relative differences below this are reported as a tie.
const TIE: f64 = 0.02;

/// One headline figure: its name, its value in a row, and whether lower is better.
struct Figure {
    name: &'static str,
    value: fn(&PolicySummary) -> Option<f64>,
    lower_is_better: bool,
    show: fn(f64) -> String,
}

/// The figures a P/D row is compared with `agg` on; TTFT p99 is `FIGURES[1]`.
const FIGURES: [Figure; 5] = [
    Figure {
        name: "TTFT p50",
        value: |p| Some(p.ttft_p50_ms),
        lower_is_better: true,
        show: |v| format!("{} ms", ms(v)),
    },
    Figure {
        name: "TTFT p99",
        value: |p| Some(p.ttft_p99_ms),
        lower_is_better: true,
        show: |v| format!("{} ms", ms(v)),
    },
    Figure {
        name: "e2e p50",
        value: |p| Some(p.e2e_p50_ms),
        lower_is_better: true,
        show: |v| format!("{} ms", ms(v)),
    },
    Figure {
        name: "output tokens/s",
        value: |p| Some(p.output_tokens_per_s),
        lower_is_better: false,
        show: |v| format!("{v:.0}"),
    },
    Figure {
        name: "GPU s / M tokens",
        value: |p| p.gpu_seconds_per_million_tokens,
        lower_is_better: true,
        show: |v| format!("{v:.1}"),
    },
];

/// +1 when `row` beats `base` on `figure` by more than [`TIE`], -1 when it loses, 0 otherwise.
fn verdict(figure: &Figure, base: &PolicySummary, row: &PolicySummary) -> Option<i32> {
    let (b, r) = ((figure.value)(base)?, (figure.value)(row)?);
    if b.abs() < f64::EPSILON {
        return Some(0);
    }
    let gain = (r - b) / b.abs() * if figure.lower_is_better { -1.0 } else { 1.0 };
    Some(if gain > TIE {
        1
    } else if gain < -TIE {
        -1
    } else {
        0
    })
}

fn threshold_of(p: &PolicySummary) -> String {
    p.pd.as_ref()
        .map_or_else(|| "-".to_string(), |pd| pd.threshold_tokens.to_string())
}

/// The P/D comparison table.
pub fn table(policies: &[PolicySummary]) -> String {
    let mut out = String::from(
        "| row | topology | threshold | disaggregated | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | output tok/s | GPU s / M tok | prefill computed | reuse at engines | client hit | busy (prefill / decode) | fallbacks | transfer failures |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in policies {
        let (disaggregated, client, busy, fallbacks, failures) = match &p.pd {
            Some(pd) => (
                format!("{} ({})", pd.disaggregated, pct(pd.disaggregated_share)),
                pct(pd.client_cache_hit_ratio),
                format!(
                    "{} / {}",
                    pd.prefill.busy_share.map_or("n/a".into(), pct),
                    pd.decode.busy_share.map_or("n/a".into(), pct)
                ),
                (pd.fallbacks_prefill_failed + pd.fallbacks_transfer_failed).to_string(),
                pd.transfer_failures.to_string(),
            ),
            None => (
                "-".to_string(),
                pct(if p.prompt_tokens == 0 {
                    0.0
                } else {
                    p.cached_tokens as f64 / p.prompt_tokens as f64
                }),
                busy_share(p).map_or("n/a".into(), |b| format!("{} (all)", pct(b))),
                "-".to_string(),
                "-".to_string(),
            ),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} |",
            p.label,
            p.topology,
            threshold_of(p),
            disaggregated,
            ms(p.ttft_p50_ms),
            ms(p.ttft_p99_ms),
            ms(p.e2e_p50_ms),
            ms(p.e2e_p99_ms),
            p.output_tokens_per_s,
            gpu(p),
            p.prefill_tokens_computed,
            pct(engine_reuse(p)),
            client,
            busy,
            fallbacks,
            failures,
        );
    }
    out
}

/// A generated reading: per policy (and flow setting and traffic, when those vary), how each
/// P/D row compares with the aggregated row on the headline figures, what the threshold
/// changed, and which pool was the busier.
pub fn reading(policies: &[PolicySummary]) -> String {
    // Rows that differ only in layout and threshold compare with each other.
    let group = |p: &PolicySummary| (p.policy.clone(), p.flow_control.clone(), p.traffic.clone());
    let mut groups: Vec<(String, String, String)> = Vec::new();
    for p in policies {
        if !groups.contains(&group(p)) {
            groups.push(group(p));
        }
    }
    let mut text = String::new();
    for key in groups {
        let rows: Vec<&PolicySummary> = policies.iter().filter(|p| group(p) == key).collect();
        let pd_rows: Vec<&PolicySummary> =
            rows.iter().copied().filter(|p| p.pd.is_some()).collect();
        if pd_rows.is_empty() {
            continue;
        }
        match rows.iter().find(|p| p.pd.is_none()) {
            Some(agg) => compare_with_agg(&mut text, agg, &pd_rows),
            None => {
                let (policy, flow, traffic) = &key;
                let name = if traffic != "all" {
                    format!("{policy} {traffic}")
                } else if flow == "off" {
                    format!("{policy} flow-off")
                } else {
                    policy.clone()
                };
                let _ = write!(
                    text,
                    "With {name} there is no aggregated row to compare with (add `agg` to \
                     --topology). "
                );
            }
        }
        threshold_effect(&mut text, &pd_rows);
        busiest_pool(&mut text, &pd_rows);
    }
    text.trim_end().to_string()
}

fn compare_with_agg(text: &mut String, agg: &PolicySummary, pd_rows: &[&PolicySummary]) {
    let _ = write!(
        text,
        "Against {} (differences under {:.0}% counted as ties): ",
        agg.label,
        TIE * 100.0
    );
    let mut parts = Vec::new();
    for figure in &FIGURES {
        let Some(base) = (figure.value)(agg) else {
            continue;
        };
        let mut better = Vec::new();
        let mut worse = Vec::new();
        for row in pd_rows {
            let Some(value) = (figure.value)(row) else {
                continue;
            };
            let item = format!("{} ({})", short(row), (figure.show)(value));
            match verdict(figure, agg, row) {
                Some(1) => better.push(item),
                Some(-1) => worse.push(item),
                _ => {}
            }
        }
        let mut part = format!("{} {} on agg", figure.name, (figure.show)(base));
        if !better.is_empty() {
            let _ = write!(part, ", better at {}", better.join(", "));
        }
        if !worse.is_empty() {
            let _ = write!(part, ", worse at {}", worse.join(", "));
        }
        if better.is_empty() && worse.is_empty() {
            part.push_str(", a tie everywhere");
        }
        parts.push(part);
    }
    let _ = write!(text, "{}. ", parts.join("; "));
    let reuse: Vec<String> = pd_rows
        .iter()
        .map(|row| format!("{} at {}", pct(engine_reuse(row)), short(row)))
        .collect();
    let _ = write!(
        text,
        "Reuse at the engines was {} on agg and {}. ",
        pct(engine_reuse(agg)),
        reuse.join(", ")
    );
    let wins: Vec<String> = pd_rows
        .iter()
        .filter(|row| {
            let verdicts: Vec<i32> = FIGURES
                .iter()
                .filter_map(|f| verdict(f, agg, row))
                .collect();
            let score: i32 = verdicts.iter().sum();
            // Never a win when the tail got worse.
            score > 0 && verdict(&FIGURES[1], agg, row) != Some(-1)
        })
        .map(|row| short(row))
        .collect();
    if wins.is_empty() {
        let _ = write!(
            text,
            "No P/D row came out ahead of {} on balance with this workload. ",
            agg.label
        );
    } else {
        let _ = write!(
            text,
            "P/D came out ahead on balance (more headline figures better than worse, TTFT p99 no \
             worse) at {}. ",
            wins.join(", ")
        );
    }
}

/// `pd:2x2/t=2048` for a row label `session@pd:2x2/t=2048`.
fn short(p: &PolicySummary) -> String {
    match &p.pd {
        Some(pd) => format!("{}/t={}", p.topology, pd.threshold_tokens),
        None => p.topology.clone(),
    }
}

fn threshold_effect(text: &mut String, pd_rows: &[&PolicySummary]) {
    let mut topologies: Vec<&str> = Vec::new();
    for row in pd_rows {
        if !topologies.contains(&row.topology.as_str()) {
            topologies.push(&row.topology);
        }
    }
    for topology in topologies {
        let mut sweep: Vec<(&PolicySummary, &PdSummary)> = pd_rows
            .iter()
            .filter(|p| p.topology == topology)
            .filter_map(|p| p.pd.as_ref().map(|pd| (*p, pd)))
            .collect();
        if sweep.len() < 2 {
            continue;
        }
        sweep.sort_by_key(|(_, pd)| pd.threshold_tokens);
        let (Some((lo, lo_pd)), Some((hi, hi_pd))) = (sweep.first(), sweep.last()) else {
            continue;
        };
        let _ = write!(
            text,
            "On {topology}, raising the threshold from {} to {} tokens took the share of \
             disaggregated requests from {} to {}, TTFT p50 from {} to {} ms, p99 from {} to {} \
             ms, and GPU s / M tokens from {} to {}",
            lo_pd.threshold_tokens,
            hi_pd.threshold_tokens,
            pct(lo_pd.disaggregated_share),
            pct(hi_pd.disaggregated_share),
            ms(lo.ttft_p50_ms),
            ms(hi.ttft_p50_ms),
            ms(lo.ttft_p99_ms),
            ms(hi.ttft_p99_ms),
            gpu(lo),
            gpu(hi),
        );
        let best = sweep
            .iter()
            .min_by(|a, b| a.0.ttft_p99_ms.total_cmp(&b.0.ttft_p99_ms));
        if let Some((best, pd)) = best {
            let _ = write!(
                text,
                "; the lowest TTFT p99 was at {} tokens ({} ms)",
                pd.threshold_tokens,
                ms(best.ttft_p99_ms)
            );
        }
        text.push_str(". ");
    }
}

fn busiest_pool(text: &mut String, pd_rows: &[&PolicySummary]) {
    let Some((row, pd)) = pd_rows
        .iter()
        .filter_map(|p| p.pd.as_ref().map(|pd| (*p, pd)))
        .max_by(|a, b| a.1.disaggregated_share.total_cmp(&b.1.disaggregated_share))
    else {
        return;
    };
    let (p, d) = (&pd.prefill, &pd.decode);
    let (Some(p_busy), Some(d_busy)) = (p.busy_share, d.busy_share) else {
        return;
    };
    let (p_wait, d_wait) = (p.mean_waiting.unwrap_or(0.0), d.mean_waiting.unwrap_or(0.0));
    let leg = |v: Option<f64>| v.map_or_else(|| "n/a".to_string(), |v| format!("{} ms", ms(v)));
    let _ = write!(
        text,
        "At {} ({} of requests disaggregated) the prefill replicas were busy {} of the span with \
         {:.1} requests waiting per replica on average (mean prefill leg {}), the decode \
         replicas busy {} with {:.1} waiting and their KV cache {} full on average (mean decode \
         leg, KV ready to first token, {}; preemptions: {})",
        short(row),
        pct(pd.disaggregated_share),
        pct(p_busy),
        p_wait,
        leg(pd.prefill_leg_mean_ms),
        pct(d_busy),
        d_wait,
        d.mean_kv_usage.map_or_else(|| "n/a".to_string(), pct),
        leg(pd.decode_leg_mean_ms),
        d.preemptions,
    );
    let d_kv = d.mean_kv_usage.unwrap_or(0.0);
    // Queueing decides first; without it (the simulator admits up to its batch width and
    // prefills everything admitted in one step), the busier pool by a clear margin.
    let d_queues = d_wait > p_wait * 1.5 && d_wait >= 0.5;
    let p_queues = p_wait > d_wait * 1.5 && p_wait >= 0.5;
    if d_queues && d_busy < 0.9 && d_kv > 0.8 {
        text.push_str(
            ": requests queued on the decode replicas while they were not busy all the time and \
             their KV cache was nearly full, so the decode pool's KV capacity (every running \
             request's whole context must fit in D of the fleet's replicas) limited it; more \
             decode replicas per prefill replica is what would help. ",
        );
    } else if d_queues || (!p_queues && d_busy > p_busy + BUSY_MARGIN) {
        text.push_str(
            ": decode is the bottleneck; more decode replicas per prefill replica, or a lower \
             threshold that moves more prefill work off them, relieves it. ",
        );
    } else if p_queues || p_busy > d_busy + BUSY_MARGIN {
        text.push_str(
            ": prefill is the bottleneck; more prefill replicas per decode replica, or a higher \
             threshold that keeps more prompts on the decode replicas, relieves it. ",
        );
    } else {
        text.push_str(": the two pools were about evenly loaded. ");
    }
}

/// The report's P/D section (heading included), when the run has P/D rows.
pub fn report_section(summary: &RunSummary) -> Option<String> {
    if summary.policies.iter().all(|p| p.pd.is_none()) {
        return None;
    }
    let mut out = String::from("## Prefill/decode\n\n");
    let _ = writeln!(
        out,
        "Every layout has the same simulated hardware per replica ({} KV blocks of {} tokens, the \
         simulator's prefill speed and decode time per token): `agg` is {} aggregated replicas; \
         `pd:PxD` is P prefill-role and D decode-role replicas. The gateway picks the decode \
         replica first (pin, prefix, load) and prefills on a prefill replica only when more than \
         the threshold of the prompt's tokens are not cached on it; otherwise the decode replica \
         runs the request whole. The threshold is compared with the gateway's estimate of \
         uncached tokens (prompt bytes / 4); this benchmark's text has about {} bytes per engine \
         token, so the estimate runs about {:.1}x the engines' count.\n",
        summary.kv_blocks,
        summary.block_size,
        summary.replicas,
        super::SIM_BYTES_PER_TOKEN,
        super::SIM_BYTES_PER_TOKEN as f64 / 4.0,
    );
    out.push_str(&table(&summary.policies));
    out.push_str(
        "\n\"disaggregated\" counts the gateway's decisions to prefill remotely (and their share \
         of all its P/D decisions). GPU s / M tok is the busy time of every replica, prefill and \
         decode, per million prompt + output tokens, each request's tokens counted once (the \
         copy of the prompt a prefill replica also admits is not counted again). \"prefill \
         computed\" is the prompt tokens all replicas actually prefilled. A decode replica \
         reports the KV cache it received from a prefill replica as cached, so the ratio clients \
         see (\"client hit\") counts transfers as hits; \"reuse at engines\" is 1 - prefill \
         computed / prompt tokens served, the share of prompt tokens no engine had to compute, \
         the same formula for every row. For P/D rows `cache_hit_ratio` in summary.json, the \
         \"cache hit\" column of the results table and `captured_reuse` use that engine-side \
         figure, and the cache-hit chart shows the aggregated rows only. \"busy\" is busy time \
         / (replicas x span).\n\n",
    );
    out.push_str(&reading(&summary.policies));
    out.push('\n');
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::summary::EngineSummary;
    use std::collections::BTreeMap;

    const GATEWAY: &str = "\
# HELP agentgate_pd_decisions_total Requests ...
# TYPE agentgate_pd_decisions_total counter
agentgate_pd_decisions_total{pool=\"bench\",decision=\"disaggregated\",reason=\"uncached\"} 7
agentgate_pd_decisions_total{pool=\"bench\",decision=\"disaggregated\",reason=\"sub_agent\"} 3
agentgate_pd_decisions_total{pool=\"bench\",decision=\"local\",reason=\"cached\"} 5
agentgate_pd_decisions_total{pool=\"other\",decision=\"local\",reason=\"cached\"} 100
agentgate_pd_decisions_total_extra{pool=\"bench\",decision=\"local\"} 100
agentgate_pd_fallbacks_total{pool=\"bench\",cause=\"transfer_failed\"} 1
agentgate_pd_transfer_failures_total{pool=\"bench\",prefill=\"bench/0\",decode=\"bench/2\"} 1
agentgate_pd_leg_duration_seconds_bucket{pool=\"bench\",leg=\"prefill\",le=\"0.05\"} 2
agentgate_pd_leg_duration_seconds_sum{pool=\"bench\",leg=\"prefill\"} 0.5
agentgate_pd_leg_duration_seconds_count{pool=\"bench\",leg=\"prefill\"} 10
agentgate_pd_leg_duration_seconds_sum{pool=\"bench\",leg=\"decode\"} 0.25
agentgate_pd_leg_duration_seconds_count{pool=\"bench\",leg=\"decode\"} 10
";

    #[test]
    fn labels_parse_with_escapes_and_filters_select_series() {
        let text = "m{a=\"x\\\"y\",b=\"p\\\\q\"} 2\nm{a=\"z\"} 3\nm 4\nm{broken 9\n";
        let all = series(text, "m");
        assert_eq!(all.len(), 3, "{all:?}");
        assert_eq!(all[0].0[0], ("a".to_string(), "x\"y".to_string()));
        assert_eq!(all[0].0[1], ("b".to_string(), "p\\q".to_string()));
        assert_eq!(sum_where(text, "m", &[]), 9.0);
        assert_eq!(sum_where(text, "m", &[("a", "z")]), 3.0);
        assert_eq!(sum_where(text, "m", &[("a", "nope")]), 0.0);
    }

    #[test]
    fn gateway_counters_read_the_benchmarks_pool_only() {
        let c = GatewayCounters::parse(GATEWAY);
        assert_eq!((c.disaggregated, c.disaggregated_sub_agent), (10, 3));
        assert_eq!((c.local, c.local_no_prefill_endpoint), (5, 0));
        assert_eq!(
            (c.fallbacks_transfer_failed, c.fallbacks_prefill_failed),
            (1, 0)
        );
        assert_eq!(c.transfer_failures, 1);
        assert_eq!((c.prefill_legs, c.decode_legs), (10, 10));
        assert!((c.prefill_leg_seconds - 0.5).abs() < 1e-12);
        let mut two = c;
        two.add(&c);
        assert_eq!(two.disaggregated, 20);
        assert_eq!(leg_mean_ms(0.5, 10, 0.1), Some(500.0), "wall 50 ms at 0.1");
        assert_eq!(leg_mean_ms(0.5, 10, 0.0), Some(50.0), "wall ms at scale 0");
        assert_eq!(leg_mean_ms(0.0, 0, 0.1), None);
    }

    fn replica(prompt: f64, hits: f64, computed: f64, generated: f64, busy: f64) -> ReplicaMetrics {
        ReplicaMetrics {
            prompt_tokens: prompt,
            prefix_cache_hits: hits,
            generation_tokens: generated,
            busy_seconds: Some(busy),
            prefill_computed: Some(computed),
            ..ReplicaMetrics::default()
        }
    }

    pub(crate) fn row(label: &str, policy: &str, topology: &str) -> PolicySummary {
        PolicySummary {
            row: label.into(),
            policy: policy.into(),
            flow_control: "on".into(),
            traffic: "all".into(),
            request_slots: 128,
            time_scale: 0.1,
            requests: 10,
            successes: 10,
            errors: 0,
            shed: 0,
            rate_limited: 0,
            shed_unsaturated: None,
            saturated_fraction: None,
            prompt_tokens: 10_000,
            cached_tokens: 9_000,
            output_tokens: 500,
            cache_hit_ratio: 0.9,
            available_reuse_ratio: 0.5,
            infinite_reuse_ratio: 0.6,
            captured_reuse: 1.8,
            oracle_prompt_tokens: 10_000,
            no_eviction_kv_blocks: 1,
            ttft_p50_ms: 100.0,
            ttft_p90_ms: 200.0,
            ttft_p99_ms: 300.0,
            e2e_p50_ms: 1000.0,
            e2e_p99_ms: 2000.0,
            output_tokens_per_s: 50.0,
            prefill_tokens_computed: 6_000,
            gpu_seconds_per_million_tokens: None,
            span_s: 10.0,
            wall_s: 1.0,
            engine: EngineSummary {
                prompt_tokens: 0,
                prefix_cache_hits: 0,
                generation_tokens: 0,
                busy_seconds: None,
                prefill_counter_exposed: true,
                preemptions: 0,
            },
            requests_per_gateway: vec![10],
            requests_per_replica: vec![0, 10],
            replica_mean_load: Vec::new(),
            kill: None,
            teams: BTreeMap::new(),
            bands: BTreeMap::new(),
            turns: crate::run::flow::turns(std::iter::empty(), &[]),
            fairness: BTreeMap::new(),
            first_error: None,
            label: label.into(),
            topology: topology.into(),
            pd: None,
        }
    }

    #[test]
    fn pd_rows_count_every_replicas_busy_time_and_each_prompt_once() {
        // One prefill replica (prompt 8000, 2000 cached, 6000 computed, 4 busy seconds) and one
        // decode replica (prompt 10000 of which 8000 transferred + 1000 cached, 1000 computed,
        // 500 generated, 6 busy seconds).
        let engine = fleet_totals(vec![
            replica(8_000.0, 2_000.0, 6_000.0, 4.0, 4.0),
            ReplicaMetrics {
                preemptions: 3.0,
                ..replica(10_000.0, 9_000.0, 1_000.0, 500.0, 6.0)
            },
        ]);
        let gauges = |waiting: f64, kv_usage: f64| ReplicaMetrics {
            waiting,
            kv_usage,
            ..ReplicaMetrics::default()
        };
        let samples = [
            Sample {
                t_s: 1.0,
                replicas: vec![gauges(2.0, 0.5), gauges(0.0, 0.9)],
            },
            Sample {
                t_s: 2.0,
                replicas: vec![gauges(4.0, 0.7), gauges(1.0, 1.0)],
            },
        ];
        let mut summary = row("session@pd:1x1", "session", "pd:1x1");
        summary.prefill_tokens_computed = engine.prefill_tokens_computed;
        let counters = GatewayCounters {
            disaggregated: 3,
            local: 1,
            ..GatewayCounters::default()
        };
        finish(
            &mut summary,
            PdInput {
                roles: &[Role::Prefill, Role::Decode],
                engine: &engine,
                samples: &samples,
                counters,
                threshold_tokens: 2048,
                time_scale: 0.1,
            },
        );
        assert_eq!(
            summary.prefill_tokens_computed, 7_000,
            "both roles' prefill"
        );
        // 10 busy seconds over 10000 prompt + 500 generated tokens of the decode replica.
        let gpu = summary.gpu_seconds_per_million_tokens.unwrap();
        assert!((gpu - 10.0 / 10_500.0 * 1e6).abs() < 1e-6, "{gpu}");
        // 1 - 7000 / 10000 of the prompt tokens came from some cache.
        assert!((summary.cache_hit_ratio - 0.3).abs() < 1e-12);
        assert!((summary.captured_reuse - 0.6).abs() < 1e-12);
        let pd = summary.pd.as_ref().unwrap();
        assert_eq!(pd.client_cache_hit_ratio, 0.9, "what clients saw is kept");
        assert_eq!(pd.served_prompt_tokens, 10_000);
        assert_eq!((pd.prefill.replicas, pd.decode.replicas), (1, 1));
        assert_eq!(pd.prefill.busy_seconds, Some(4.0));
        assert_eq!(pd.prefill.busy_share, Some(0.4), "4 s of a 10 s span");
        assert_eq!(pd.decode.busy_share, Some(0.6));
        assert_eq!(pd.disaggregated_share, 0.75);
        assert_eq!(pd.threshold_tokens, 2048);
        assert_eq!(engine_reuse(&summary), summary.cache_hit_ratio);
        assert_eq!((pd.prefill.preemptions, pd.decode.preemptions), (0, 3));
        assert_eq!(pd.prefill.mean_waiting, Some(3.0));
        assert_eq!(pd.decode.mean_waiting, Some(0.5));
        assert!((pd.prefill.mean_kv_usage.unwrap() - 0.6).abs() < 1e-12);
        assert!((pd.decode.mean_kv_usage.unwrap() - 0.95).abs() < 1e-12);

        // More computed than served (preemptions recomputing) clamps at 0.
        let mut odd = row("x", "session", "pd:1x1");
        let engine = fleet_totals(vec![replica(10.0, 0.0, 50.0, 1.0, 1.0)]);
        finish(
            &mut odd,
            PdInput {
                roles: &[Role::Decode],
                engine: &engine,
                samples: &[],
                counters: GatewayCounters::default(),
                threshold_tokens: 0,
                time_scale: 0.0,
            },
        );
        assert_eq!(odd.cache_hit_ratio, 0.0);
        let odd = odd.pd.unwrap();
        assert_eq!(odd.disaggregated_share, 0.0, "no decision: no share");
        assert_eq!(odd.decode.mean_waiting, None, "no samples, no mean");
        assert_eq!(
            odd.decode.busy_share, None,
            "at time scale 0 the span is wall time"
        );
    }

    #[test]
    fn aggregated_reuse_at_the_engines_uses_their_own_prompt_tokens() {
        let mut agg = row("session@agg", "session", "agg");
        agg.engine.prompt_tokens = 10_000;
        agg.prefill_tokens_computed = 2_500;
        assert_eq!(engine_reuse(&agg), 0.75);
        agg.engine.prompt_tokens = 0;
        assert_eq!(engine_reuse(&agg), 0.0);
    }

    /// Busy share, mean waiting and mean KV usage of one pool.
    type Load = (f64, f64, f64);

    fn pd_row(
        threshold: u64,
        share: f64,
        ttft: (f64, f64),
        prefill: Load,
        decode: Load,
    ) -> PolicySummary {
        let mut p = row(
            &format!("session@pd:2x2/t={threshold}"),
            "session",
            "pd:2x2",
        );
        (p.ttft_p50_ms, p.ttft_p99_ms) = ttft;
        let totals = |(busy, waiting, kv): Load| RoleTotals {
            replicas: 2,
            prompt_tokens: 0,
            prefix_cache_hits: 0,
            prefill_tokens_computed: 0,
            generation_tokens: 0,
            busy_seconds: Some(1.0),
            busy_share: Some(busy),
            preemptions: 0,
            mean_waiting: Some(waiting),
            mean_kv_usage: Some(kv),
        };
        p.pd = Some(PdSummary {
            prefill_replicas: 2,
            decode_replicas: 2,
            threshold_tokens: threshold,
            disaggregated: 1,
            disaggregated_sub_agent: 0,
            local: 1,
            local_no_prefill_endpoint: 0,
            disaggregated_share: share,
            fallbacks_prefill_failed: 0,
            fallbacks_transfer_failed: 0,
            transfer_failures: 0,
            prefill_pin_moves: 0,
            prefill_leg_mean_ms: None,
            decode_leg_mean_ms: None,
            served_prompt_tokens: 0,
            client_cache_hit_ratio: 0.9,
            prefill: totals(prefill),
            decode: totals(decode),
        });
        p
    }

    #[test]
    fn reading_names_where_pd_wins_the_threshold_effect_and_the_bottleneck() {
        let agg = row("session@agg", "session", "agg");
        // t=0: faster median, slower tail; t=8192: faster on both.
        let prefill_bound = [(0.9, 4.0, 0.5), (0.3, 0.1, 0.3)];
        let rows = vec![
            agg,
            pd_row(8192, 0.2, (80.0, 250.0), prefill_bound[0], prefill_bound[1]),
            pd_row(0, 0.9, (50.0, 600.0), prefill_bound[0], prefill_bound[1]),
        ];
        let text = reading(&rows);
        assert!(text.contains("Against session@agg"), "{text}");
        assert!(
            text.contains(
                "TTFT p50 100 ms on agg, better at pd:2x2/t=8192 (80.0 ms), pd:2x2/t=0 (50.0 ms)"
            ),
            "{text}"
        );
        assert!(
            text.contains("TTFT p99 300 ms on agg, better at pd:2x2/t=8192 (250 ms), worse at pd:2x2/t=0 (600 ms)"),
            "{text}"
        );
        assert!(
            text.contains("output tokens/s 50 on agg, a tie everywhere"),
            "{text}"
        );
        assert!(
            text.contains("came out ahead on balance (more headline figures better than worse, TTFT p99 no worse) at pd:2x2/t=8192."),
            "t=0 lost its tail: {text}"
        );
        assert!(
            text.contains("raising the threshold from 0 to 8192 tokens took the share of disaggregated requests from 90% to 20%"),
            "{text}"
        );
        assert!(
            text.contains("lowest TTFT p99 was at 8192 tokens"),
            "{text}"
        );
        assert!(text.contains("prefill is the bottleneck"), "{text}");
        assert!(
            text.contains("prefill replicas were busy 90% of the span with 4.0 requests waiting"),
            "{text}"
        );

        // Decode replicas queueing with a full cache while not always busy: KV-bound.
        let kv_bound = pd_row(0, 0.9, (50.0, 600.0), (0.5, 0.0, 0.2), (0.6, 3.0, 0.95));
        let text = reading(&[rows[0].clone(), kv_bound.clone()]);
        assert!(text.contains("decode pool's KV capacity"), "{text}");
        let busy_decode = pd_row(0, 0.9, (50.0, 600.0), (0.5, 0.0, 0.2), (0.97, 3.0, 0.5));
        let text = reading(&[rows[0].clone(), busy_decode]);
        assert!(text.contains("decode is the bottleneck"), "{text}");
        // Nothing waiting: the busier pool by more than 10 points, else even.
        let busy_prefill = pd_row(0, 0.9, (50.0, 600.0), (0.85, 0.0, 0.2), (0.6, 0.0, 0.2));
        let text = reading(&[rows[0].clone(), busy_prefill]);
        assert!(text.contains("prefill is the bottleneck"), "{text}");
        let even = pd_row(0, 0.9, (50.0, 600.0), (0.65, 0.0, 0.2), (0.6, 0.0, 0.2));
        let text = reading(&[rows[0].clone(), even]);
        assert!(text.contains("about evenly loaded"), "{text}");

        let table = table(&rows);
        assert_eq!(table.lines().count(), 2 + rows.len());
        assert!(
            table.contains("| session@pd:2x2/t=0 | pd:2x2 | 0 | 1 (90%) |"),
            "{table}"
        );
        assert!(table.contains("| session@agg | agg | - | - |"), "{table}");

        let alone = reading(&rows[1..]);
        assert!(alone.contains("no aggregated row"), "{alone}");
        assert_eq!(reading(&rows[..1]), "", "no P/D row, nothing to read");
    }
}
