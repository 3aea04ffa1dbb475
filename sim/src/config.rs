//! Simulator configuration: one field per command-line flag, shared by the binary and the library.

use std::net::SocketAddr;

/// Which engine the simulator imitates (HTTP extras, error shape, metric names, P/D protocol).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Flavor {
    /// vLLM: `vllm:*` metrics, NIXL-style `kv_transfer_params` for P/D.
    Vllm,
    /// SGLang: `sglang:*` metrics, bootstrap host/port/room for P/D.
    Sglang,
}

/// `--scheduling-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicyArg {
    /// Arrival order; requests with a non-zero `priority` are refused (vLLM) or the field is
    /// ignored (SGLang).
    Fcfs,
    /// By the request's `priority`, then arrival.
    Priority,
}

/// The part a replica plays in prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Serves whole requests (and may still act as either P/D leg when asked).
    Both,
    /// Prefill leg of a disaggregated pair.
    Prefill,
    /// Decode leg of a disaggregated pair.
    Decode,
}

/// Everything a simulated replica needs; `SimConfig::default()` equals the command-line defaults.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "agentgate-sim",
    version,
    about = "Engine simulator speaking vLLM's or SGLang's HTTP API, with a paged prefix-cache model and a timing model"
)]
pub struct SimConfig {
    /// Engine to imitate: HTTP extras, error shape, metric names and P/D protocol.
    #[arg(long, value_enum, default_value_t = Flavor::Vllm)]
    pub flavor: Flavor,
    /// Address to serve HTTP on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8100")]
    pub listen: SocketAddr,
    /// Served model name; requests naming another model get 404.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Prefill/decode role of this replica.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Number of KV-cache blocks (capacity = kv_blocks * block_size tokens).
    #[arg(long, default_value_t = 4096)]
    pub kv_blocks: usize,
    /// Maximum number of sequences running at once (continuous batching width).
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Tokens one engine step may compute (vLLM `--max-num-batched-tokens`): decodes take one
    /// each, prompts are prefilled in chunks of what is left. The default is vLLM's for an API
    /// server on a large GPU; 0 prefills whole prompts in one step.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Largest prefill chunk one sequence takes per step (vLLM
    /// `--long-prefill-token-threshold`), so long prompts leave budget for short ones; 0 = no
    /// limit beyond the step budget.
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Order of the waiting queue (vLLM `--scheduling-policy`; SGLang
    /// `--enable-priority-scheduling`): `priority` orders by the request's `priority` field
    /// (vLLM: lower first; SGLang: higher first) and preempts the lowest priority first.
    #[arg(long, value_enum, default_value_t = SchedulingPolicyArg::Fcfs)]
    pub scheduling_policy: SchedulingPolicyArg,
    /// Report a request's cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`,
    /// left out when there are none) as vLLM started with `--enable-prompt-tokens-details`
    /// does, or SGLang with `--enable-cache-report`; `false`: never, as both do by default.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub prompt_tokens_details: bool,
    /// Prefill throughput: uncached prompt tokens processed per simulated second.
    #[arg(long, default_value_t = 20000.0)]
    pub prefill_tokens_per_s: f64,
    /// Decode time per output token at batch size 1, in simulated milliseconds; grows with the batch.
    #[arg(long, default_value_t = 20.0)]
    pub decode_ms_per_token: f64,
    /// Wall seconds per simulated second: 1.0 real time, 0.01 a hundred times faster, 0 no delays at all.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Publish vLLM KV events over ZMQ PUB to this endpoint (tcp://host:port connects, tcp://*:port binds).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// Topic of the KV-event frames.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Seed for generated text and tool arguments (the same seed and prompt give the same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Maximum prompt + output tokens per request; defaults to the KV capacity (kv_blocks * block_size).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Mean number of output tokens when a request sets no max_tokens (actual: 50%..150% of it).
    #[arg(long, default_value_t = 64)]
    pub default_output_tokens: usize,
    /// Largest accepted request body in bytes; larger bodies get 413.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Require this bearer key on every `/v1/*` request, as vLLM and SGLang started with
    /// `--api-key` do (401 `{"error": "Unauthorized"}` without it; health, metrics and the
    /// rest stay open).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Simulated KV transfer bandwidth between P/D replicas, in GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub kv_transfer_gbps: f64,
    /// Bytes of KV cache per token (used for the transfer delay).
    #[arg(long, default_value_t = 131072)]
    pub kv_bytes_per_token: u64,
    /// Seconds a prefill replica keeps finished blocks pinned for a decode replica to fetch.
    #[arg(long, default_value_t = 60.0)]
    pub kv_transfer_timeout_s: f64,
    /// SGLang flavor: also serve the bootstrap endpoint on this port (default: the HTTP port serves it).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Engine id reported in kv_transfer_params (default: derived from the listen address).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Send and receive buffer of every accepted connection, in bytes (0: the kernel's
    /// autotuning). Autotuning sizes buffers by measured real time, so concurrent large
    /// requests can complete in a different order from run to run; a fixed buffer larger than
    /// the largest request keeps them in send order (the benchmark's virtual clock sets it).
    #[arg(long, default_value_t = 0)]
    pub socket_buffer_bytes: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        <SimConfig as clap::Parser>::parse_from(["agentgate-sim"])
    }
}

/// A setting [`SimConfig::validate`] refuses: the command-line flag and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSetting {
    /// The flag, e.g. `--kv-blocks`.
    pub flag: &'static str,
    /// What is wrong with its value.
    pub reason: String,
}

impl std::fmt::Display for InvalidSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.flag, self.reason)
    }
}

impl std::error::Error for InvalidSetting {}

/// Most KV blocks a replica may have (2^24: 268M tokens at 16 per block, beyond any
/// accelerator's KV cache).
pub const MAX_KV_BLOCKS: usize = 1 << 24;

impl SimConfig {
    /// Check the settings [`crate::spawn`] cannot run with.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let invalid = |flag, reason: String| Err(InvalidSetting { flag, reason });
        for (flag, value) in [
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
        ] {
            if value == 0 {
                return invalid(flag, "must be at least 1".into());
            }
        }
        if !(1..=MAX_KV_BLOCKS).contains(&self.kv_blocks) {
            return invalid(
                "--kv-blocks",
                format!(
                    "must be between 1 and {MAX_KV_BLOCKS}, got {}",
                    self.kv_blocks
                ),
            );
        }
        let positive = [
            ("--prefill-tokens-per-s", self.prefill_tokens_per_s),
            ("--kv-transfer-gbps", self.kv_transfer_gbps),
        ];
        for (flag, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return invalid(flag, format!("must be a positive number, got {value}"));
            }
        }
        let non_negative = [
            ("--decode-ms-per-token", self.decode_ms_per_token),
            ("--time-scale", self.time_scale),
            ("--kv-transfer-timeout-s", self.kv_transfer_timeout_s),
        ];
        for (flag, value) in non_negative {
            if !(value.is_finite() && value >= 0.0) {
                return invalid(flag, format!("must be a number >= 0, got {value}"));
            }
        }
        Ok(())
    }

    /// Maximum prompt + output tokens per request.
    pub fn effective_max_model_len(&self) -> usize {
        let capacity = self.kv_blocks.saturating_mul(self.block_size.max(1));
        self.max_model_len.unwrap_or(capacity).min(capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_matches_cli_defaults() {
        let config = SimConfig::default();
        assert_eq!(config.flavor, Flavor::Vllm);
        assert_eq!(config.block_size, 16);
        assert_eq!(config.kv_blocks, 4096);
        assert_eq!(config.effective_max_model_len(), 65536);
        assert!(config.kv_events.is_none());
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn settings_the_engine_cannot_run_with_are_refused() {
        let refused = |change: fn(&mut SimConfig)| {
            let mut config = SimConfig::default();
            change(&mut config);
            config.validate().unwrap_err().to_string()
        };
        assert!(refused(|c| c.kv_blocks = 0).contains("--kv-blocks"));
        assert!(refused(|c| c.kv_blocks = MAX_KV_BLOCKS + 1).contains("--kv-blocks"));
        assert!(refused(|c| c.time_scale = f64::NAN).contains("--time-scale"));
        assert!(refused(|c| c.kv_transfer_timeout_s = f64::INFINITY)
            .contains("--kv-transfer-timeout-s"));
        assert!(refused(|c| c.prefill_tokens_per_s = 0.0).contains("--prefill-tokens-per-s"));
        assert!(refused(|c| c.decode_ms_per_token = -1.0).contains("--decode-ms-per-token"));
        assert!(refused(|c| c.max_num_seqs = 0).contains("--max-num-seqs"));
    }
}
