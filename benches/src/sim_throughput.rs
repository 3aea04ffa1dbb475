//! `agentgate-bench sim-throughput`: how many small non-streaming chat completions per second one
//! simulator serves with no simulated delays (`--time-scale 0`), measured with a real HTTP client.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use crate::duration::parse_duration;
use crate::load::{run_closed_loop, LoadPlan, LoadReport};
use crate::procs::{self, free_port, sibling_binary, ChildGuard};
use crate::stats::LatencySummary;

/// Engine flavor the simulator imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    /// vLLM's HTTP API.
    Vllm,
    /// SGLang's HTTP API.
    Sglang,
}

impl Flavor {
    fn as_arg(self) -> &'static str {
        match self {
            Flavor::Vllm => "vllm",
            Flavor::Sglang => "sglang",
        }
    }
}

/// Options of `sim-throughput`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Requests in flight at all times.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Measured window (e.g. 10s, 500ms, 1m).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Load before the measured window starts; its requests are not counted.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Words in each prompt.
    #[arg(long, default_value_t = 20)]
    pub prompt_words: usize,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// Engine flavor of the simulator that is started (ignored with --target).
    #[arg(long, value_enum, default_value_t = Flavor::Vllm)]
    pub flavor: Flavor,
    /// Model name sent in requests; must match the simulator's served model.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Benchmark an already running server at this base URL instead of starting a simulator.
    #[arg(long)]
    pub target: Option<String>,
    /// Run the simulator inside this process instead of as a child process.
    #[arg(long, conflicts_with = "target")]
    pub in_process: bool,
    /// Simulator binary to start (default: `agentgate-sim` next to this executable).
    #[arg(long, conflicts_with_all = ["target", "in_process"])]
    pub sim_bin: Option<PathBuf>,
    /// Write `sim_throughput.json` into this directory.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The JSON written to `sim_throughput.json`.
#[derive(Debug, Serialize)]
struct ThroughputResult {
    benchmark: &'static str,
    /// `child-process`, `in-process` or `external`.
    server: &'static str,
    target: String,
    flavor: Flavor,
    concurrency: usize,
    warmup_s: f64,
    duration_s: f64,
    prompt_words: usize,
    max_tokens: u32,
    completed: u64,
    errors: u64,
    requests_per_s: f64,
    latency_ms: LatencySummary,
    first_error: Option<String>,
}

/// Run the benchmark, print a summary and optionally write it as JSON.
pub async fn run(args: Args) -> Result<(), String> {
    let (server, base_url, _guard) = start_server(&args).await?;
    let base_url = base_url.trim_end_matches('/').to_owned();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency.max(1))
        .tcp_nodelay(true)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    procs::wait_ready(&format!("{base_url}/v1/models")).await?;

    let plan = LoadPlan {
        url: format!("{base_url}/v1/chat/completions"),
        concurrency: args.concurrency.max(1),
        warmup: args.warmup,
        duration: args.duration,
        bodies: Arc::new(request_bodies(&args, 256)),
    };
    eprintln!(
        "sim-throughput: {} workers against {} for {:?} (+{:?} warm-up)",
        plan.concurrency, plan.url, plan.duration, plan.warmup
    );
    let report = run_closed_loop(client, plan).await;
    let result = to_result(&args, server, &base_url, &report);
    print_summary(&result);
    if let Some(dir) = &args.out {
        write_result(dir, &result)?;
    }
    if report.completed == 0 {
        return Err(format!(
            "no request succeeded; first error: {}",
            report.first_error.as_deref().unwrap_or("none recorded")
        ));
    }
    Ok(())
}

/// Keeps whatever server the benchmark started alive until dropped.
#[derive(Default)]
struct ServerGuard {
    _child: Option<ChildGuard>,
    _in_process: Option<agentgate_sim::SimHandle>,
}

async fn start_server(args: &Args) -> Result<(&'static str, String, ServerGuard), String> {
    if let Some(target) = &args.target {
        return Ok(("external", target.clone(), ServerGuard::default()));
    }
    if args.in_process {
        return start_in_process(args).await;
    }
    let binary = match &args.sim_bin {
        Some(path) => path.clone(),
        None => sibling_binary("agentgate-sim")
            .map_err(|e| format!("{e}, or pass --sim-bin / --target / --in-process"))?,
    };
    let port = free_port()?;
    let base_url = format!("http://127.0.0.1:{port}");
    let child = procs::start_server(
        &binary,
        &[
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--time-scale".into(),
            "0".into(),
            "--flavor".into(),
            args.flavor.as_arg().into(),
            "--model".into(),
            args.model.clone(),
        ],
        &format!("{base_url}/v1/models"),
    )
    .await?;
    let guard = ServerGuard {
        _child: Some(child),
        _in_process: None,
    };
    Ok(("child-process", base_url, guard))
}

async fn start_in_process(args: &Args) -> Result<(&'static str, String, ServerGuard), String> {
    let config = agentgate_sim::SimConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        time_scale: 0.0,
        flavor: match args.flavor {
            Flavor::Vllm => agentgate_sim::Flavor::Vllm,
            Flavor::Sglang => agentgate_sim::Flavor::Sglang,
        },
        model: args.model.clone(),
        ..agentgate_sim::SimConfig::default()
    };
    let sim = agentgate_sim::spawn(config)
        .await
        .map_err(|e| format!("cannot start the in-process simulator: {e}"))?;
    let base_url = sim.base_url();
    let guard = ServerGuard {
        _child: None,
        _in_process: Some(sim),
    };
    Ok(("in-process", base_url, guard))
}

/// Distinct small chat bodies, so the simulator does real tokenizing and cache work.
fn request_bodies(args: &Args, count: usize) -> Vec<Bytes> {
    const WORDS: [&str; 16] = [
        "agent", "cache", "token", "route", "block", "prefix", "replica", "session", "stream",
        "gateway", "decode", "prefill", "queue", "batch", "model", "reply",
    ];
    let mut rng = fastrand::Rng::with_seed(7);
    (0..count)
        .map(|_| {
            let prompt: Vec<&str> = (0..args.prompt_words)
                .map(|_| WORDS[rng.usize(..WORDS.len())])
                .collect();
            let body = serde_json::json!({
                "model": args.model,
                "messages": [{"role": "user", "content": prompt.join(" ")}],
                "max_tokens": args.max_tokens,
                "stream": false,
            });
            Bytes::from(body.to_string())
        })
        .collect()
}

fn to_result(
    args: &Args,
    server: &'static str,
    base_url: &str,
    report: &LoadReport,
) -> ThroughputResult {
    ThroughputResult {
        benchmark: "sim-throughput",
        server,
        target: base_url.to_owned(),
        flavor: args.flavor,
        concurrency: args.concurrency,
        warmup_s: args.warmup.as_secs_f64(),
        duration_s: report.window.as_secs_f64(),
        prompt_words: args.prompt_words,
        max_tokens: args.max_tokens,
        completed: report.completed,
        errors: report.errors,
        requests_per_s: report.requests_per_s(),
        latency_ms: report.latency.clone(),
        first_error: report.first_error.clone(),
    }
}

fn print_summary(result: &ThroughputResult) {
    println!(
        "requests/s: {:.0}  completed: {}  errors: {}  latency p50: {:.2} ms  p99: {:.2} ms  (server: {}, concurrency {}, {:.1}s)",
        result.requests_per_s,
        result.completed,
        result.errors,
        result.latency_ms.p50_ms,
        result.latency_ms.p99_ms,
        result.server,
        result.concurrency,
        result.duration_s,
    );
    if let Some(error) = &result.first_error {
        println!("first error: {error}");
    }
}

fn write_result(dir: &Path, result: &ThroughputResult) -> Result<(), String> {
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create output directory {}: {e}", dir.display()))?;
    let path = dir.join("sim_throughput.json");
    let json = serde_json::to_string_pretty(result)
        .map_err(|e| format!("cannot serialise the result: {e}"))?;
    std::fs::write(&path, json + "\n")
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
