//! Counters, histograms and the Prometheus text exposition, with vLLM's or SGLang's metric names.
//!
//! Latencies are in *simulated* seconds (independent of `--time-scale`). Every series carries the
//! `model_name` label, as in the engines.
//!
//! Both flavors also expose the simulator's own counters, for benchmarks that compare routing
//! policies by the work the engines did:
//! - `agentgate_sim_engine_busy_seconds_total`: simulated seconds spent running engine steps
//!   (prefill + decode), counted once per step whatever the batch size;
//! - `agentgate_sim_prefill_tokens_computed_total`: prompt tokens actually prefilled, i.e. not
//!   served from the prefix cache (blocks transferred to a decode replica count as cached;
//!   tokens recomputed after a preemption count again).

use std::fmt::Write;

use crate::config::Flavor;

/// vLLM's time-to-first-token buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's end-to-end latency buckets.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative-bucket histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (upper bucket bounds, ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Record `times` observations of `value`.
    pub fn observe(&mut self, value: f64, times: u64) {
        if times == 0 {
            return;
        }
        if let Some(index) = self.bounds.iter().position(|bound| value <= *bound) {
            if let Some(slot) = self.counts.get_mut(index) {
                *slot += times;
            }
        }
        self.sum += value * times as f64;
        self.count += times;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{bound:?}\"}} {cumulative}.0"
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}.0",
            self.count
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {}.0", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
    }
}

/// Everything the engine counts.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: u64,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: u64,
    /// Finished requests.
    pub requests_finished: u64,
    /// Simulated seconds spent running engine steps (prefill + decode, once per step).
    pub busy_seconds: f64,
    /// Prompt (and, after preemption, recomputed) tokens prefilled rather than served from the
    /// cache or transferred from a prefill replica.
    pub prefill_tokens_computed: u64,
    /// Time to first token, simulated seconds.
    pub ttft: Histogram,
    /// Inter-token latency, simulated seconds.
    pub itl: Histogram,
    /// End-to-end latency, simulated seconds.
    pub e2e: Histogram,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            prompt_tokens: 0,
            generation_tokens: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            requests_finished: 0,
            busy_seconds: 0.0,
            prefill_tokens_computed: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// Gauges sampled at scrape time.
#[derive(Debug, Clone, Copy)]
pub struct Gauges {
    /// Running sequences.
    pub running: usize,
    /// Waiting sequences.
    pub waiting: usize,
    /// KV-cache usage 0..=1.
    pub kv_usage: f64,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
}

fn scalar(out: &mut String, kind: &str, name: &str, help: &str, labels: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value:?}"
    );
}

/// The simulator's own counters, the same in both flavors.
fn render_sim_counters(out: &mut String, stats: &Stats, labels: &str) {
    scalar(
        out,
        "counter",
        "agentgate_sim_engine_busy_seconds_total",
        "Simulated seconds the engine spent running steps (prefill + decode), once per step regardless of batch size.",
        labels,
        stats.busy_seconds,
    );
    scalar(
        out,
        "counter",
        "agentgate_sim_prefill_tokens_computed_total",
        "Prompt tokens prefilled, i.e. not served from the prefix cache or transferred from a prefill replica.",
        labels,
        stats.prefill_tokens_computed as f64,
    );
}

/// Render the Prometheus text exposition for `flavor`.
pub fn render(flavor: Flavor, model: &str, stats: &Stats, gauges: Gauges) -> String {
    let mut out = String::with_capacity(8192);
    let model = model.replace('\\', "\\\\").replace('"', "\\\"");
    match flavor {
        Flavor::Vllm => {
            let labels = format!("engine=\"0\",model_name=\"{model}\"");
            let l = labels.as_str();
            scalar(
                &mut out,
                "gauge",
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                l,
                gauges.running as f64,
            );
            scalar(
                &mut out,
                "gauge",
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                l,
                gauges.waiting as f64,
            );
            scalar(
                &mut out,
                "gauge",
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                l,
                gauges.kv_usage,
            );
            scalar(
                &mut out,
                "gauge",
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                l,
                gauges.kv_usage,
            );
            scalar(
                &mut out,
                "counter",
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                l,
                stats.prefix_queries as f64,
            );
            scalar(
                &mut out,
                "counter",
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                l,
                stats.prefix_hits as f64,
            );
            scalar(
                &mut out,
                "counter",
                "vllm:num_preemptions_total",
                "Cumulative number of preemption from the engine.",
                l,
                stats.preemptions as f64,
            );
            scalar(
                &mut out,
                "counter",
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                l,
                stats.prompt_tokens as f64,
            );
            scalar(
                &mut out,
                "counter",
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                l,
                stats.generation_tokens as f64,
            );
            scalar(
                &mut out,
                "counter",
                "vllm:request_success_total",
                "Count of successfully processed requests.",
                l,
                stats.requests_finished as f64,
            );
            stats.ttft.render(
                &mut out,
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                l,
            );
            stats.itl.render(
                &mut out,
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                l,
            );
            stats.itl.render(
                &mut out,
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                l,
            );
            stats.e2e.render(
                &mut out,
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                l,
            );
            let info = format!(
                "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"",
                gauges.block_size, gauges.num_blocks
            );
            scalar(
                &mut out,
                "gauge",
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                &info,
                1.0,
            );
            render_sim_counters(&mut out, stats, l);
        }
        Flavor::Sglang => {
            let labels = format!("model_name=\"{model}\"");
            let l = labels.as_str();
            let hit_rate = if stats.prefix_queries == 0 {
                0.0
            } else {
                stats.prefix_hits as f64 / stats.prefix_queries as f64
            };
            scalar(
                &mut out,
                "gauge",
                "sglang:num_running_reqs",
                "The number of running requests.",
                l,
                gauges.running as f64,
            );
            scalar(
                &mut out,
                "gauge",
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                l,
                gauges.waiting as f64,
            );
            scalar(
                &mut out,
                "gauge",
                "sglang:token_usage",
                "The token usage.",
                l,
                gauges.kv_usage,
            );
            scalar(
                &mut out,
                "gauge",
                "sglang:cache_hit_rate",
                "The prefix cache hit rate.",
                l,
                hit_rate,
            );
            scalar(
                &mut out,
                "counter",
                "sglang:prompt_tokens_total",
                "Number of prefill tokens processed.",
                l,
                stats.prompt_tokens as f64,
            );
            scalar(
                &mut out,
                "counter",
                "sglang:generation_tokens_total",
                "Number of generation tokens processed.",
                l,
                stats.generation_tokens as f64,
            );
            scalar(
                &mut out,
                "counter",
                "sglang:cached_tokens_total",
                "Number of cached prompt tokens.",
                l,
                stats.prefix_hits as f64,
            );
            scalar(
                &mut out,
                "counter",
                "sglang:num_requests_total",
                "Number of requests processed.",
                l,
                stats.requests_finished as f64,
            );
            scalar(
                &mut out,
                "counter",
                "sglang:num_retracted_requests_total",
                "Number of retracted requests.",
                l,
                stats.preemptions as f64,
            );
            // The KV capacity, as SGLang states it: tokens, and tokens per page.
            scalar(
                &mut out,
                "gauge",
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                l,
                (gauges.num_blocks * gauges.block_size) as f64,
            );
            scalar(
                &mut out,
                "gauge",
                "sglang:page_size",
                "The page size of the KV cache.",
                l,
                gauges.block_size as f64,
            );
            stats.ttft.render(
                &mut out,
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                l,
            );
            stats.itl.render(
                &mut out,
                "sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                l,
            );
            stats.e2e.render(
                &mut out,
                "sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                l,
            );
            render_sim_counters(&mut out, stats, l);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut histogram = Histogram::new(&[0.1, 1.0]);
        histogram.observe(0.05, 2);
        histogram.observe(0.5, 1);
        histogram.observe(5.0, 1);
        let mut out = String::new();
        histogram.render(&mut out, "x", "help", "a=\"b\"");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.1\"} 2.0"));
        assert!(out.contains("x_bucket{a=\"b\",le=\"1.0\"} 3.0"));
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 4.0"));
        assert_eq!(histogram.count(), 4);
    }

    #[test]
    fn vllm_names_are_exposed() {
        let gauges = Gauges {
            running: 1,
            waiting: 2,
            kv_usage: 0.5,
            block_size: 16,
            num_blocks: 64,
        };
        let text = render(Flavor::Vllm, "m", &Stats::default(), gauges);
        for name in [
            "vllm:num_requests_running{",
            "vllm:prefix_cache_hits_total{",
            "vllm:e2e_request_latency_seconds_bucket{",
        ] {
            assert!(text.contains(name), "{name} missing");
        }
        assert!(text.contains("num_gpu_blocks=\"64\""));
        let text = render(Flavor::Sglang, "m", &Stats::default(), gauges);
        assert!(text.contains("sglang:num_queue_reqs{model_name=\"m\"} 2.0"));
    }

    #[test]
    fn sim_counters_are_exposed_in_both_flavors() {
        let gauges = Gauges {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            block_size: 16,
            num_blocks: 64,
        };
        let stats = Stats {
            busy_seconds: 1.5,
            prefill_tokens_computed: 42,
            ..Stats::default()
        };
        for (flavor, labels) in [
            (Flavor::Vllm, "engine=\"0\",model_name=\"m\""),
            (Flavor::Sglang, "model_name=\"m\""),
        ] {
            let text = render(flavor, "m", &stats, gauges);
            for (name, value) in [
                ("agentgate_sim_engine_busy_seconds_total", "1.5"),
                ("agentgate_sim_prefill_tokens_computed_total", "42.0"),
            ] {
                assert!(text.contains(&format!("# HELP {name} ")), "{name} HELP");
                assert!(
                    text.contains(&format!("# TYPE {name} counter\n")),
                    "{name} TYPE"
                );
                assert!(
                    text.contains(&format!("{name}{{{labels}}} {value}\n")),
                    "{name} value in:\n{text}"
                );
            }
        }
    }
}
