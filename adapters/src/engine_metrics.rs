//! Engine load and cache state read from an engine's Prometheus `/metrics` (vLLM and SGLang
//! metric names), and the `/health` check.
//!
//! [`parse_metrics`] reads the Prometheus text exposition: `# HELP` / `# TYPE` / other comments
//! are skipped, label values may hold escaped quotes, commas and braces, values may be `NaN` or
//! `±Inf` (such samples are dropped: they carry no usable reading), and a trailing timestamp is
//! accepted. Malformed lines are skipped, never fatal. One metric may appear under several label
//! sets (one per `model_name`, per data-parallel `engine`, per SGLang `cache_source` or
//! `dp_rank`): counts and counters are summed over them, fractions are combined as stated per
//! field. SGLang's copies of one scheduler's figures are read once: with
//! `--enable-metrics-for-all-schedulers` every tensor-, pipeline- and expert-parallel rank
//! exports them, and only rank 0 (`tp_rank`, `pp_rank`, `moe_ep_rank`, `attn_tp_rank` absent
//! or `"0"`) counts; with priority scheduling the per-priority breakdown (`priority="N"`) is
//! skipped for the total (`priority=""`).
//!
//! Names read, newest first where an engine renamed a metric:
//!
//! | field | vLLM | SGLang |
//! |---|---|---|
//! | `running` | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | `waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs`, plus the P/D queues `sglang:num_prefill_bootstrap_queue_reqs`, `sglang:num_prefill_prealloc_queue_reqs`, `sglang:num_decode_prealloc_queue_reqs`, `sglang:num_decode_transfer_queue_reqs` |
//! | `kv_usage` | `vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc` | `sglang:token_usage` |
//! | `prefix_cache_queries` | `vllm:prefix_cache_queries_total`, `vllm:gpu_prefix_cache_queries_total` | `sglang:prompt_tokens_total` |
//! | `prefix_cache_hits` | `vllm:prefix_cache_hits_total`, `vllm:gpu_prefix_cache_hits_total` | `sglang:cached_tokens_total` |
//! | `cache_hit_rate` | hits / queries, else `vllm:gpu_prefix_cache_hit_rate` | `sglang:cache_hit_rate` |
//! | `preemptions` | `vllm:num_preemptions_total` | `sglang:num_retracted_requests_total` |
//! | `block_size` | label `block_size` of `vllm:cache_config_info` | `sglang:page_size`, else label `page_size` of `sglang:cache_config_info` |
//! | `num_gpu_blocks` | label `num_gpu_blocks` of `vllm:cache_config_info` (its largest line: with data parallelism every engine's line carries the server's total) | — |
//! | `max_total_tokens` | — | `sglang:max_total_num_tokens` |
//!
//! Both engines report KV usage as a fraction in 0..=1 despite vLLM's `_perc` suffix. vLLM
//! counts prefix-cache queries and hits in tokens; SGLang has no query counter, so its prompt
//! token counter stands in (cached tokens are a subset of prompt tokens).

use crate::client::{root_url, send_error};
use crate::error::UpstreamError;
use crate::{EngineClient, Flavor};
use std::collections::HashMap;

/// Largest `/metrics` answer read, in bytes (vLLM's is a few hundred KiB with many models).
const MAX_METRICS_BYTES: usize = 16 * 1024 * 1024;

/// One scrape of an engine's load and cache state (None where the engine does not report it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineMetrics {
    /// Requests in the running batch (summed over engines and models).
    pub running: Option<f64>,
    /// Requests queued and not yet running (summed over engines and models).
    pub waiting: Option<f64>,
    /// KV-cache usage in 0..=1; the fullest engine when several report.
    pub kv_usage: Option<f64>,
    /// Prompt tokens looked up in the prefix cache since the engine started (counter).
    pub prefix_cache_queries: Option<f64>,
    /// Prompt tokens found in the prefix cache since the engine started (counter).
    pub prefix_cache_hits: Option<f64>,
    /// Prefix-cache hit rate in 0..=1 (vLLM: lifetime hits / queries; SGLang: its own gauge,
    /// averaged over engines).
    pub cache_hit_rate: Option<f64>,
    /// Sequences preempted (vLLM) or retracted (SGLang) since the engine started (counter).
    pub preemptions: Option<f64>,
    /// Tokens per KV-cache block (vLLM block size, SGLang page size).
    pub block_size: Option<u64>,
    /// KV-cache blocks on the GPU, summed over data-parallel engines (vLLM).
    pub num_gpu_blocks: Option<u64>,
    /// KV-cache capacity in tokens as the engine reports it (SGLang `max_total_num_tokens`).
    pub max_total_tokens: Option<u64>,
}

impl EngineMetrics {
    /// KV-cache capacity in tokens: `block_size * num_gpu_blocks` when both are known, else the
    /// engine's reported token capacity. A capacity of 0 (an engine still starting) is
    /// unknown: sizing the prefix index by it would forget what it learnt of the engine.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        match (self.block_size, self.num_gpu_blocks) {
            (Some(block_size), Some(blocks)) if block_size > 0 && blocks > 0 => {
                block_size.checked_mul(blocks)
            }
            _ => self.max_total_tokens.filter(|&tokens| tokens > 0),
        }
    }

    /// True when no field was reported (wrong flavor, or the engine's metrics are disabled).
    pub fn is_empty(&self) -> bool {
        *self == EngineMetrics::default()
    }
}

/// Metric names read for vLLM.
mod vllm {
    pub const RUNNING: &str = "vllm:num_requests_running";
    pub const WAITING: &str = "vllm:num_requests_waiting";
    pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
    pub const KV_USAGE_OLD: &str = "vllm:gpu_cache_usage_perc";
    pub const QUERIES: &str = "vllm:prefix_cache_queries_total";
    pub const QUERIES_OLD: &str = "vllm:gpu_prefix_cache_queries_total";
    pub const HITS: &str = "vllm:prefix_cache_hits_total";
    pub const HITS_OLD: &str = "vllm:gpu_prefix_cache_hits_total";
    pub const HIT_RATE_OLD: &str = "vllm:gpu_prefix_cache_hit_rate";
    pub const PREEMPTIONS: &str = "vllm:num_preemptions_total";
    pub const CACHE_CONFIG: &str = "vllm:cache_config_info";
    pub const ALL: &[&str] = &[
        RUNNING,
        WAITING,
        KV_USAGE,
        KV_USAGE_OLD,
        QUERIES,
        QUERIES_OLD,
        HITS,
        HITS_OLD,
        HIT_RATE_OLD,
        PREEMPTIONS,
    ];
}

/// Metric names read for SGLang.
mod sglang {
    pub const RUNNING: &str = "sglang:num_running_reqs";
    pub const WAITING: &str = "sglang:num_queue_reqs";
    /// Queues of a prefill/decode server, where its requests wait besides the scheduler's:
    /// a prefill server's requests waiting for their decode server's handshake, a decode
    /// server's waiting for KV room or for their transfer.
    pub const PD_QUEUES: &[&str] = &[
        "sglang:num_prefill_bootstrap_queue_reqs",
        "sglang:num_prefill_prealloc_queue_reqs",
        "sglang:num_decode_prealloc_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs",
    ];
    pub const CACHE_CONFIG: &str = "sglang:cache_config_info";
    pub const KV_USAGE: &str = "sglang:token_usage";
    pub const PROMPT_TOKENS: &str = "sglang:prompt_tokens_total";
    pub const CACHED_TOKENS: &str = "sglang:cached_tokens_total";
    pub const HIT_RATE: &str = "sglang:cache_hit_rate";
    pub const RETRACTIONS: &str = "sglang:num_retracted_requests_total";
    pub const PAGE_SIZE: &str = "sglang:page_size";
    pub const MAX_TOTAL_TOKENS: &str = "sglang:max_total_num_tokens";
    pub const ALL: &[&str] = &[
        RUNNING,
        WAITING,
        KV_USAGE,
        PROMPT_TOKENS,
        CACHED_TOKENS,
        HIT_RATE,
        RETRACTIONS,
        PAGE_SIZE,
        MAX_TOTAL_TOKENS,
        PD_QUEUES[0],
        PD_QUEUES[1],
        PD_QUEUES[2],
        PD_QUEUES[3],
    ];

    /// Ranks whose schedulers all export the same figures when SGLang runs with
    /// `--enable-metrics-for-all-schedulers`: only rank 0 of each counts (data-parallel ranks,
    /// `dp_rank`, each have their own queue and KV pool, and add up).
    const REPLICATED_RANKS: &[&str] = &["tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank"];

    /// Whether a series counts: not another rank's copy of rank 0's figures, and not a
    /// per-priority breakdown (with priority scheduling the total is the series with
    /// `priority=""`).
    pub fn counts(labels: &[(&str, String)]) -> bool {
        labels.iter().all(|(name, value)| {
            let value = value.trim();
            if REPLICATED_RANKS.contains(name) {
                value.is_empty() || value == "0"
            } else if *name == "priority" {
                value.is_empty()
            } else {
                true
            }
        })
    }
}

/// Parse Prometheus text exposition for a flavor; sums over label sets (e.g. several model_name or
/// engine labels), ignores unknown metrics, never panics on malformed lines.
pub fn parse_metrics(flavor: Flavor, text: &str) -> EngineMetrics {
    let wanted = match flavor {
        Flavor::Vllm => vllm::ALL,
        Flavor::Sglang => sglang::ALL,
        Flavor::Openai => return EngineMetrics::default(),
    };
    let mut collected = Collected::default();
    for line in text.lines() {
        let Some(sample) = parse_sample(line) else {
            continue;
        };
        if flavor == Flavor::Vllm && sample.name == vllm::CACHE_CONFIG {
            collected.add_cache_config(&sample.labels);
            continue;
        }
        if flavor == Flavor::Sglang && !sglang::counts(&sample.labels) {
            continue;
        }
        if flavor == Flavor::Sglang && sample.name == sglang::CACHE_CONFIG {
            collected.add_page_size(&sample.labels);
            continue;
        }
        if let Some(name) = wanted.iter().find(|name| **name == sample.name) {
            if sample.value.is_finite() {
                collected.series.entry(name).or_default().add(sample.value);
            }
        }
    }
    match flavor {
        Flavor::Vllm => collected.into_vllm(),
        Flavor::Sglang => collected.into_sglang(),
        Flavor::Openai => EngineMetrics::default(),
    }
}

impl EngineClient {
    /// GET `{base_url}/metrics` and parse it for `flavor` (a trailing `/v1` on `base_url` is
    /// ignored). An answer without any of the flavor's metrics is a [`UpstreamError::Protocol`]
    /// (wrong flavor configured, or SGLang started without `--enable-metrics`). The OpenAI
    /// flavor exposes no known metrics: it answers empty metrics without a request.
    pub async fn scrape_metrics(
        &self,
        flavor: Flavor,
        base_url: &str,
    ) -> Result<EngineMetrics, UpstreamError> {
        if flavor == Flavor::Openai {
            return Ok(EngineMetrics::default());
        }
        let url = format!("{}/metrics", root_url(base_url));
        let text = self.get_text(&url).await?;
        let metrics = parse_metrics(flavor, &text);
        if metrics.is_empty() {
            return Err(UpstreamError::Protocol(format!(
                "{url} reports none of the {flavor:?} engine metrics; check the endpoint's flavor \
                 (and start SGLang with --enable-metrics)"
            )));
        }
        Ok(metrics)
    }

    /// GET `{base_url}/health`; any 2xx is healthy, anything else an error.
    pub async fn health(&self, base_url: &str) -> Result<(), UpstreamError> {
        let url = format!("{}/health", root_url(base_url));
        let limit = self.options().request_timeout;
        let call = async {
            let response = self
                .authorized(self.http.get(&url))
                .send()
                .await
                .map_err(|err| send_error(&url, err))?;
            self.check_status(response).await.map(drop)
        };
        tokio::time::timeout(limit, call)
            .await
            .map_err(|_| UpstreamError::Timeout(format!("{url} did not answer within {limit:?}")))?
    }

    /// GET `url` as text, at most [`MAX_METRICS_BYTES`], within the request timeout.
    async fn get_text(&self, url: &str) -> Result<String, UpstreamError> {
        let limit = self.options().request_timeout;
        let call = async {
            let response = self
                .authorized(self.http.get(url))
                .send()
                .await
                .map_err(|err| send_error(url, err))?;
            let response = self.check_status(response).await?;
            let body = crate::client::read_capped(url, response, MAX_METRICS_BYTES).await?;
            Ok(String::from_utf8_lossy(&body).into_owned())
        };
        tokio::time::timeout(limit, call)
            .await
            .map_err(|_| UpstreamError::Timeout(format!("{url} did not answer within {limit:?}")))?
    }
}

/// One metric sample line: name, labels and value (the timestamp, if any, is dropped).
#[derive(Debug, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

/// Parses one exposition line; None for comments, blank and malformed lines.
fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at_checked(name_end)?;
    if name.is_empty() {
        return None;
    }
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, remaining) = parse_labels(after_brace)?;
        labels = parsed;
        rest = remaining;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    if let Some(timestamp) = fields.next() {
        timestamp.parse::<f64>().ok()?;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `name="value",...}` (the text after `{`); returns the labels and the text after `}`.
fn parse_labels(text: &str) -> Option<(Vec<(&str, String)>, &str)> {
    let mut labels = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, after_key) = rest.split_once('=')?;
        let key = key.trim();
        if key.is_empty() || key.contains([',', '"', '}', '{']) {
            return None;
        }
        let quoted = after_key.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let close = loop {
            let (index, c) = chars.next()?;
            match c {
                '"' => break index,
                '\\' => {
                    let (_, escaped) = chars.next()?;
                    value.push(if escaped == 'n' { '\n' } else { escaped });
                }
                other => value.push(other),
            }
        };
        labels.push((key, value));
        rest = quoted.get(close + 1..)?.trim_start();
        if let Some(after_comma) = rest.strip_prefix(',') {
            rest = after_comma;
        } else if !rest.starts_with('}') {
            return None;
        }
    }
}

/// A sample value: a float, `NaN`, `+Inf` or `-Inf`.
fn parse_value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => text.parse::<f64>().ok(),
    }
}

/// Finite values of one metric over its label sets.
#[derive(Clone, Copy, Debug, Default)]
struct Series {
    sum: f64,
    max: f64,
    count: u32,
}

impl Series {
    fn add(&mut self, value: f64) {
        self.max = if self.count == 0 {
            value
        } else {
            self.max.max(value)
        };
        self.sum += value;
        self.count += 1;
    }

    fn mean(&self) -> f64 {
        self.sum / f64::from(self.count.max(1))
    }
}

/// Everything a parse collected before it becomes [`EngineMetrics`].
#[derive(Debug, Default)]
struct Collected {
    series: HashMap<&'static str, Series>,
    block_size: Option<u64>,
    num_gpu_blocks: Option<u64>,
}

impl Collected {
    /// The first of `names` that was reported.
    fn first(&self, names: &[&str]) -> Option<Series> {
        names.iter().find_map(|name| self.series.get(name).copied())
    }

    fn sum(&self, names: &[&str]) -> Option<f64> {
        self.first(names).map(|series| series.sum)
    }

    /// SGLang's waiting requests: its scheduler's queue and, on a P/D server, its P/D queues
    /// (None when it reports none of them).
    fn waiting_sglang(&self) -> Option<f64> {
        std::iter::once(sglang::WAITING)
            .chain(sglang::PD_QUEUES.iter().copied())
            .filter_map(|name| self.sum(&[name]))
            .reduce(|a, b| a + b)
    }

    fn count(&self, name: &str) -> Option<u64> {
        self.sum(&[name]).and_then(to_count)
    }

    /// Reads `block_size` and `num_gpu_blocks` from one `vllm:cache_config_info` label set.
    fn add_cache_config(&mut self, labels: &[(&str, String)]) {
        let label = |key: &str| {
            labels
                .iter()
                .find(|(name, _)| *name == key)
                .and_then(|(_, value)| value.trim().parse::<u64>().ok())
        };
        if let Some(block_size) = label("block_size") {
            self.block_size = Some(self.block_size.map_or(block_size, |b| b.max(block_size)));
        }
        // vLLM's front end sums the blocks of its data-parallel engines into one figure and
        // writes that total on every engine's line: the largest line is the server's capacity.
        if let Some(blocks) = label("num_gpu_blocks") {
            self.num_gpu_blocks = Some(self.num_gpu_blocks.map_or(blocks, |b| b.max(blocks)));
        }
    }

    /// Reads the page size from one `sglang:cache_config_info` label set (newer SGLang reports
    /// it there instead of in `sglang:page_size`).
    fn add_page_size(&mut self, labels: &[(&str, String)]) {
        let page_size = labels
            .iter()
            .find(|(name, _)| *name == "page_size")
            .and_then(|(_, value)| value.trim().parse::<u64>().ok());
        if let Some(page_size) = page_size {
            self.block_size = Some(self.block_size.map_or(page_size, |b| b.max(page_size)));
        }
    }

    fn into_vllm(self) -> EngineMetrics {
        let queries = self.sum(&[vllm::QUERIES, vllm::QUERIES_OLD]);
        let hits = self.sum(&[vllm::HITS, vllm::HITS_OLD]);
        let cache_hit_rate = match (queries, hits) {
            (Some(queries), Some(hits)) if queries > 0.0 => Some(hits / queries),
            (Some(_), Some(_)) => Some(0.0),
            _ => self.first(&[vllm::HIT_RATE_OLD]).map(|s| s.mean()),
        };
        EngineMetrics {
            running: self.sum(&[vllm::RUNNING]),
            waiting: self.sum(&[vllm::WAITING]),
            kv_usage: self
                .first(&[vllm::KV_USAGE, vllm::KV_USAGE_OLD])
                .map(|s| unit(s.max)),
            prefix_cache_queries: queries,
            prefix_cache_hits: hits,
            cache_hit_rate: cache_hit_rate.map(unit),
            preemptions: self.sum(&[vllm::PREEMPTIONS]),
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_total_tokens: None,
        }
    }

    fn into_sglang(self) -> EngineMetrics {
        EngineMetrics {
            running: self.sum(&[sglang::RUNNING]),
            waiting: self.waiting_sglang(),
            kv_usage: self.first(&[sglang::KV_USAGE]).map(|s| unit(s.max)),
            prefix_cache_queries: self.sum(&[sglang::PROMPT_TOKENS]),
            prefix_cache_hits: self.sum(&[sglang::CACHED_TOKENS]),
            cache_hit_rate: self.first(&[sglang::HIT_RATE]).map(|s| unit(s.mean())),
            preemptions: self.sum(&[sglang::RETRACTIONS]),
            block_size: self
                .first(&[sglang::PAGE_SIZE])
                .and_then(|s| to_count(s.max))
                .or(self.block_size),
            num_gpu_blocks: None,
            max_total_tokens: self.count(sglang::MAX_TOTAL_TOKENS),
        }
    }
}

/// Clamps a fraction into 0..=1.
fn unit(value: f64) -> f64 {
    value.clamp(0.0, 1.0)
}

/// A non-negative whole count from a float sample.
fn to_count(value: f64) -> Option<u64> {
    (value.is_finite() && value >= 0.0 && value <= u64::MAX as f64).then(|| value.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written after vLLM 0.11's exposition: two data-parallel engines, the current names, the
    /// cache config as labels, histograms and `_created` series that must be ignored.
    const VLLM_SAMPLE: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.625
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 6000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 2000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 4000.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 2000.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 3.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="8192",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="8192",prefix_caching_hash_algo="sha256"} 1.0
"#;

    /// Written after vLLM 0.8-0.10, which also export the deprecated names (and older versions,
    /// which export only those).
    const VLLM_OLD_SAMPLE: &str = r#"# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 25.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"#;

    /// Written after SGLang's documented exposition, with cached tokens split by source.
    const SGLANG_SAMPLE: &str = r#"# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
# HELP sglang:page_size The page size
# TYPE sglang:page_size gauge
sglang:page_size{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0e+06
sglang:cached_tokens_total{cache_source="host",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0e+06
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
# HELP sglang:num_retracted_requests_total Number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
"#;

    #[test]
    fn vllm_sample_sums_engines_and_reads_cache_config() {
        let metrics = parse_metrics(Flavor::Vllm, VLLM_SAMPLE);
        assert_eq!(
            metrics,
            EngineMetrics {
                running: Some(5.0),
                waiting: Some(1.0),
                kv_usage: Some(0.625),
                prefix_cache_queries: Some(8000.0),
                prefix_cache_hits: Some(6000.0),
                cache_hit_rate: Some(0.75),
                preemptions: Some(7.0),
                block_size: Some(16),
                num_gpu_blocks: Some(8192),
                max_total_tokens: None,
            }
        );
        assert_eq!(metrics.kv_capacity_tokens(), Some(16 * 8192));
    }

    #[test]
    fn vllm_deprecated_names_are_read_and_current_names_win() {
        let old = parse_metrics(Flavor::Vllm, VLLM_OLD_SAMPLE);
        assert_eq!(old.kv_usage, Some(0.5));
        assert_eq!(old.prefix_cache_queries, Some(100.0));
        assert_eq!(old.prefix_cache_hits, Some(25.0));
        assert_eq!(old.cache_hit_rate, Some(0.25));
        assert_eq!(old.kv_capacity_tokens(), None);

        let both = format!("{VLLM_OLD_SAMPLE}{VLLM_SAMPLE}");
        let metrics = parse_metrics(Flavor::Vllm, &both);
        assert_eq!(metrics.kv_usage, Some(0.625));
        assert_eq!(metrics.prefix_cache_queries, Some(8000.0));
        assert_eq!(metrics.prefix_cache_hits, Some(6000.0));
        assert_eq!(
            metrics.running,
            Some(6.0),
            "running has one name: all sets sum"
        );
    }

    #[test]
    fn vllm_v0_hit_rate_gauge_is_used_without_counters() {
        let text = "vllm:gpu_prefix_cache_hit_rate{model_name=\"m\"} 0.4\n";
        assert_eq!(parse_metrics(Flavor::Vllm, text).cache_hit_rate, Some(0.4));
        let idle = "vllm:prefix_cache_queries_total 0\nvllm:prefix_cache_hits_total 0\n";
        assert_eq!(parse_metrics(Flavor::Vllm, idle).cache_hit_rate, Some(0.0));
    }

    #[test]
    fn sglang_sample_is_read() {
        let metrics = parse_metrics(Flavor::Sglang, SGLANG_SAMPLE);
        assert_eq!(
            metrics,
            EngineMetrics {
                running: Some(12.0),
                waiting: Some(4.0),
                kv_usage: Some(0.28),
                prefix_cache_queries: Some(8_128_902.0),
                prefix_cache_hits: Some(6_000_000.0),
                cache_hit_rate: Some(0.0075),
                preemptions: Some(3.0),
                block_size: Some(1),
                num_gpu_blocks: None,
                max_total_tokens: Some(161_721),
            }
        );
        assert_eq!(metrics.kv_capacity_tokens(), Some(161_721));
        // Reported as 0 while the engine starts: unknown, not empty.
        let starting = EngineMetrics {
            max_total_tokens: Some(0),
            ..metrics
        };
        assert_eq!(starting.kv_capacity_tokens(), None);
    }

    #[test]
    fn sglang_pd_queues_wait_and_newer_servers_report_the_page_size_as_a_label() {
        let decode = "sglang:num_running_reqs{model_name=\"m\"} 3\n\
                      sglang:num_queue_reqs{model_name=\"m\"} 1\n\
                      sglang:num_decode_prealloc_queue_reqs{model_name=\"m\"} 5\n\
                      sglang:num_decode_transfer_queue_reqs{model_name=\"m\"} 2\n\
                      sglang:cache_config_info{page_size=\"64\",num_pages=\"1000\"} 1\n";
        let metrics = parse_metrics(Flavor::Sglang, decode);
        assert_eq!(metrics.waiting, Some(8.0));
        assert_eq!(metrics.block_size, Some(64));
        let prefill = "sglang:num_prefill_bootstrap_queue_reqs 4\n";
        assert_eq!(parse_metrics(Flavor::Sglang, prefill).waiting, Some(4.0));
    }

    #[test]
    fn sglang_ranks_count_once_per_data_parallel_rank_and_priorities_once() {
        // Two data-parallel ranks of two tensor-parallel ranks each, all exporting
        // (`--enable-metrics-for-all-schedulers`), with priority scheduling's breakdown.
        let mut text = String::new();
        for dp in 0..2 {
            for tp in 0..2 {
                let labels = format!("model_name=\"m\",engine_type=\"unified\",tp_rank=\"{tp}\",pp_rank=\"0\",moe_ep_rank=\"0\",dp_rank=\"{dp}\"");
                text += &format!("sglang:num_running_reqs{{{labels},priority=\"\"}} 6\n");
                text += &format!("sglang:num_running_reqs{{{labels},priority=\"0\"}} 4\n");
                text += &format!("sglang:num_running_reqs{{{labels},priority=\"1\"}} 2\n");
                text += &format!("sglang:num_queue_reqs{{{labels},priority=\"\"}} 10\n");
                text += &format!("sglang:num_queue_reqs{{{labels},priority=\"5\"}} 10\n");
                text += &format!("sglang:max_total_num_tokens{{{labels}}} 100000\n");
            }
        }
        let metrics = parse_metrics(Flavor::Sglang, &text);
        assert_eq!(metrics.running, Some(12.0));
        assert_eq!(metrics.waiting, Some(20.0));
        assert_eq!(metrics.max_total_tokens, Some(200_000));
    }

    #[test]
    fn flavors_do_not_read_each_others_names() {
        assert!(parse_metrics(Flavor::Sglang, VLLM_SAMPLE).is_empty());
        assert!(parse_metrics(Flavor::Vllm, SGLANG_SAMPLE).is_empty());
        assert!(parse_metrics(Flavor::Openai, VLLM_SAMPLE).is_empty());
    }

    #[test]
    fn labels_with_escapes_commas_and_braces_are_skipped_correctly() {
        let line = r#"vllm:num_requests_running{model_name="a \"quoted\", {odd} name\\",engine="0"} 4 1712345678901"#;
        let sample = parse_sample(line).expect("sample");
        assert_eq!(sample.name, "vllm:num_requests_running");
        assert_eq!(sample.value, 4.0);
        assert_eq!(
            sample.labels,
            vec![
                ("model_name", "a \"quoted\", {odd} name\\".to_string()),
                ("engine", "0".to_string())
            ]
        );
        let multiline = parse_sample(r#"x{help="line\nbreak",} 1"#).expect("trailing comma");
        assert_eq!(multiline.labels, vec![("help", "line\nbreak".to_string())]);
        let bare = parse_sample("vllm:num_requests_waiting 2.5e+00").expect("no labels");
        assert_eq!((bare.name, bare.value), ("vllm:num_requests_waiting", 2.5));
        assert!(bare.labels.is_empty());
    }

    #[test]
    fn special_values_parse_and_non_finite_samples_are_dropped() {
        assert!(parse_sample("x NaN").is_some_and(|s| s.value.is_nan()));
        assert_eq!(parse_sample("x +Inf").map(|s| s.value), Some(f64::INFINITY));
        assert_eq!(
            parse_sample("x -Inf").map(|s| s.value),
            Some(f64::NEG_INFINITY)
        );
        let text = "vllm:num_requests_running{engine=\"0\"} NaN\n\
                    vllm:num_requests_running{engine=\"1\"} 2\n\
                    vllm:kv_cache_usage_perc +Inf\n";
        let metrics = parse_metrics(Flavor::Vllm, text);
        assert_eq!(metrics.running, Some(2.0));
        assert_eq!(metrics.kv_usage, None);
    }

    #[test]
    fn malformed_lines_are_skipped_without_panicking() {
        let garbage = [
            "",
            "#",
            "# TYPE",
            "{",
            "{} 1",
            "vllm:num_requests_running",
            "vllm:num_requests_running{",
            "vllm:num_requests_running{engine=\"0",
            "vllm:num_requests_running{engine=\"0\\",
            "vllm:num_requests_running{engine=0} 1",
            "vllm:num_requests_running{engine=\"0\"\"x\"} 1",
            "vllm:num_requests_running{=\"0\"} 1",
            "vllm:num_requests_running{engine=\"0\"} one",
            "vllm:num_requests_running 1 2 3",
            "vllm:num_requests_running 1 notatime",
            "vllm:num_requests_running{engine=\"é\u{0}\"} ",
            "\u{feff}\u{1F600}{\"}",
        ];
        for line in garbage {
            assert_eq!(parse_sample(line), None, "{line:?}");
        }
        let mut text = garbage.join("\n");
        text.push_str("\nvllm:num_requests_running{engine=\"0\"} 9\n");
        assert_eq!(parse_metrics(Flavor::Vllm, &text).running, Some(9.0));
    }

    #[test]
    fn cache_config_with_unparsed_values_is_ignored() {
        let text = r#"vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0"#;
        let metrics = parse_metrics(Flavor::Vllm, text);
        assert_eq!(
            (metrics.block_size, metrics.num_gpu_blocks),
            (Some(16), None)
        );
        assert_eq!(metrics.kv_capacity_tokens(), None);
    }

    #[test]
    fn fractions_are_clamped_to_unit_range() {
        let metrics = parse_metrics(Flavor::Sglang, "sglang:token_usage 1.5\n");
        assert_eq!(metrics.kv_usage, Some(1.0));
    }
}
