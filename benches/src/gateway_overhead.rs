//! `agentgate-bench gateway-overhead`: the latency the gateway adds over talking to the engine
//! directly.
//!
//! One simulator runs as a child process at `--time-scale 0` (no simulated delays), so what is
//! measured is pure request handling. The same closed-loop client, at the same concurrency, first
//! drives small non-streaming chat completions straight at the simulator, then the equivalent
//! Responses API requests through an `agentgate` child process (in-memory store, stored
//! responses) pointing at that simulator. Gateway-added latency is the difference of the two
//! latency percentiles. The gateway always streams from the engine (one code path for streaming
//! and non-streaming clients), so a third phase drives the simulator directly with streamed chat
//! requests to separate the engine's streaming cost from the gateway's own; each phase is repeated `--rounds` times and the median round reported.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;

use crate::duration::parse_duration;
use crate::load::{run_closed_loop, LoadPlan, LoadReport};
use crate::procs::{free_port, sibling_binary, start_server};

/// Flags of `gateway-overhead`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Concurrent requests in flight (closed loop).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Measured time per phase and round (e.g. 5s).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Warm-up per phase and round, not measured.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Rounds per phase; the median round is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Write `gateway_overhead.json` here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn prompt(i: usize) -> String {
    format!("request {i}: summarise the routing decision for this agent turn in one line")
}

fn median_by_p50(mut reports: Vec<LoadReport>) -> LoadReport {
    reports.sort_by(|a, b| a.latency.p50_ms.total_cmp(&b.latency.p50_ms));
    let mid = reports.len() / 2;
    reports.swap_remove(mid)
}

async fn measure(url: String, bodies: Vec<Bytes>, args: &Args) -> Result<LoadReport, String> {
    let bodies = Arc::new(bodies);
    let mut reports = Vec::new();
    for _ in 0..args.rounds.max(1) {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(args.concurrency * 2)
            .build()
            .map_err(|e| e.to_string())?;
        let report = run_closed_loop(
            client,
            LoadPlan {
                url: url.clone(),
                concurrency: args.concurrency,
                warmup: args.warmup,
                duration: args.duration,
                bodies: bodies.clone(),
            },
        )
        .await;
        if report.errors > 0 {
            return Err(format!(
                "{} errors against {url}; first: {}",
                report.errors,
                report.first_error.unwrap_or_default()
            ));
        }
        reports.push(report);
    }
    Ok(median_by_p50(reports))
}

/// Run the benchmark and print (and optionally write) the comparison.
pub async fn run(args: Args) -> Result<(), String> {
    let sim_port = free_port()?;
    let sim_url = format!("http://127.0.0.1:{sim_port}");
    let _sim = start_server(
        &sibling_binary("agentgate-sim")?,
        &[
            "--listen".into(),
            format!("127.0.0.1:{sim_port}"),
            "--time-scale".into(),
            "0".into(),
            "--model".into(),
            "sim-model".into(),
        ],
        &format!("{sim_url}/v1/models"),
    )
    .await?;

    let gw_port = free_port()?;
    let gw_url = format!("http://127.0.0.1:{gw_port}");
    let config = std::env::temp_dir().join(format!("agentgate-overhead-{gw_port}.toml"));
    std::fs::write(
        &config,
        format!("[[pools]]\nname = \"sim\"\nmodel = \"sim-model\"\nendpoints = [\"{sim_url}\"]\n"),
    )
    .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    let _gw = start_server(
        &sibling_binary("agentgate")?,
        &[
            "serve".into(),
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{gw_port}"),
        ],
        &format!("{gw_url}/health/ready"),
    )
    .await?;

    let n = 512;
    let direct_bodies = (0..n)
        .map(|i| {
            Bytes::from(
                json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": args.max_tokens})
                    .to_string(),
            )
        })
        .collect();
    let direct_stream_bodies = (0..n)
        .map(|i| {
            Bytes::from(
                json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": args.max_tokens,
                       "stream": true, "stream_options": {"include_usage": true}})
                    .to_string(),
            )
        })
        .collect();
    let gateway_bodies = (0..n)
        .map(|i| {
            Bytes::from(
                json!({"model": "sim-model", "input": prompt(i), "max_output_tokens": args.max_tokens})
                    .to_string(),
            )
        })
        .collect();
    eprintln!("direct to the simulator ...");
    let direct = measure(
        format!("{sim_url}/v1/chat/completions"),
        direct_bodies,
        &args,
    )
    .await?;
    eprintln!("direct to the simulator, streamed (what the gateway asks of the engine) ...");
    let direct_stream = measure(
        format!("{sim_url}/v1/chat/completions"),
        direct_stream_bodies,
        &args,
    )
    .await?;
    eprintln!("through the gateway ...");
    let gateway = measure(format!("{gw_url}/v1/responses"), gateway_bodies, &args).await?;
    let _ = std::fs::remove_file(&config);

    let result = json!({
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "duration_s": args.duration.as_secs_f64(),
        "direct": {"requests_per_s": direct.requests_per_s(), "p50_ms": direct.latency.p50_ms, "p99_ms": direct.latency.p99_ms},
        "direct_streamed": {"requests_per_s": direct_stream.requests_per_s(), "p50_ms": direct_stream.latency.p50_ms, "p99_ms": direct_stream.latency.p99_ms},
        "gateway": {"requests_per_s": gateway.requests_per_s(), "p50_ms": gateway.latency.p50_ms, "p99_ms": gateway.latency.p99_ms},
        "added_p50_ms": gateway.latency.p50_ms - direct.latency.p50_ms,
        "added_p99_ms": gateway.latency.p99_ms - direct.latency.p99_ms,
        "added_over_streamed_p50_ms": gateway.latency.p50_ms - direct_stream.latency.p50_ms,
        "added_over_streamed_p99_ms": gateway.latency.p99_ms - direct_stream.latency.p99_ms,
    });
    println!(
        "direct:  {:.0} req/s  p50 {:.3} ms  p99 {:.3} ms\nstreamed: {:.0} req/s  p50 {:.3} ms  p99 {:.3} ms\ngateway: {:.0} req/s  p50 {:.3} ms  p99 {:.3} ms\nadded:   p50 {:.3} ms  p99 {:.3} ms  (concurrency {}, median of {} rounds)",
        direct.requests_per_s(), direct.latency.p50_ms, direct.latency.p99_ms,
        direct_stream.requests_per_s(), direct_stream.latency.p50_ms, direct_stream.latency.p99_ms,
        gateway.requests_per_s(), gateway.latency.p50_ms, gateway.latency.p99_ms,
        result["added_p50_ms"].as_f64().unwrap_or(0.0), result["added_p99_ms"].as_f64().unwrap_or(0.0),
        args.concurrency, args.rounds
    );
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let path = dir.join("gateway_overhead.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&result).unwrap_or_default(),
        )
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}
