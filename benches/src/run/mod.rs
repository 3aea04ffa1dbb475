//! The `run` subcommand: replays one workload against a fresh simulated fleet behind the gateway,
//! once per routing policy, and writes `summary.json`, `report.md` and SVG charts.
//!
//! For each policy it starts `--replicas` simulated vLLM replicas and one gateway in-process
//! (fresh replicas per policy, so every policy starts with cold caches), replays the workload
//! through the Responses API with streaming ([`replay`]), samples the replicas' `/metrics` while it
//! runs ([`metrics`]), replays the exact prompt token ids through the reuse oracle, and summarises
//! ([`summary`]). All requested policies are validated against the gateway's configuration
//! parser before anything starts, so an unknown policy fails at once with the gateway's message.
//!
//! Simulated time is wall time divided by `--time-scale`; at time scale 0 the replicas do not
//! sleep at all, think times are skipped and latencies are reported in wall milliseconds.

pub mod clock;
pub mod metrics;
pub mod progress;
pub mod replay;
pub mod report;
pub mod reuse;
pub mod sse;
pub mod summary;
pub mod svg;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::workload::{self, Workload, WorkloadKind, WorkloadParams};

use clock::SimClock;
use summary::{PolicyRun, PolicySummary, RunSummary};

/// Model name the simulated replicas serve and the benchmark requests.
pub const MODEL: &str = "sim-model";
/// Cap on generated tokens per request; the simulator picks the actual length (150..450).
pub const MAX_OUTPUT_TOKENS: u64 = 4096;
/// Mean output length the replicas are configured with (`default_output_tokens`).
pub const DEFAULT_OUTPUT_TOKENS: usize = 300;

/// Command-line arguments of `agentgate-bench run`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Workload to replay: agentic, chat, mixed or trace:PATH (a Mooncake-format JSONL trace).
    #[arg(long)]
    pub workload: String,
    /// Simulated replicas behind the gateway.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Routing policies to compare, comma-separated (round_robin, least_loaded, prefix, session).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_loaded,prefix,session"
    )]
    pub policies: Vec<String>,
    /// Sessions that start within the replayed span (ignored by trace workloads).
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    /// Simulated span of the workload (e.g. 120s, 10m); no new turn starts after it.
    #[arg(long, default_value = "300s", value_parser = crate::duration::parse_duration)]
    pub duration: Duration,
    /// Wall seconds per simulated second (0.2 = five times faster than real time; 0 = no delays).
    #[arg(long, default_value_t = 0.2)]
    pub time_scale: f64,
    /// KV-cache capacity of every replica, in blocks.
    #[arg(long, default_value_t = 65_536)]
    pub kv_blocks: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seed of the workload generator and of the replicas' generated outputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also replay everything at this second time scale and report how the headline numbers move.
    #[arg(long)]
    pub compare_time_scale: Option<f64>,
    /// Directory for summary.json, report.md and the SVG charts (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

/// Run the command: validate, generate, replay per policy, write the outputs.
pub async fn run(args: Args) -> Result<(), String> {
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    // The `\r` progress line is for a person at a terminal; logs get the final table only.
    let show_progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let summary = execute(&args, &command_line, show_progress).await?;
    println!("{}", report::table(&summary.policies));
    println!(
        "wrote {}, {} and the SVG charts",
        args.out.join("summary.json").display(),
        args.out.join("report.md").display()
    );
    Ok(())
}

/// Everything `run` does, callable from tests: returns what was written to `summary.json`.
pub async fn execute(
    args: &Args,
    command_line: &str,
    show_progress: bool,
) -> Result<RunSummary, String> {
    validate_args(args)?;
    for policy in &args.policies {
        gateway_config(policy, &["http://127.0.0.1:9".to_string()], &[])?;
    }
    let kind: WorkloadKind = args.workload.parse()?;
    let params = WorkloadParams {
        kind,
        sessions: args.sessions,
        duration_s: args.duration.as_secs_f64(),
        seed: args.seed,
    };
    let workload = Arc::new(
        workload::generate(&params).map_err(|e| format!("workload {}: {e}", args.workload))?,
    );
    if workload.sessions.is_empty() {
        return Err(format!(
            "workload {} produced no sessions; raise --sessions or --duration",
            args.workload
        ));
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;

    let mut runs = Vec::new();
    for policy in &args.policies {
        runs.push(run_policy(args, policy, &workload, args.time_scale, show_progress).await?);
    }
    let mut check = Vec::new();
    if let Some(scale) = args.compare_time_scale {
        for policy in &args.policies {
            let run = run_policy(args, policy, &workload, scale, show_progress).await?;
            check.push(run.summary);
        }
    }
    let summary = RunSummary {
        workload: workload.name.clone(),
        command: command_line.to_string(),
        replicas: args.replicas,
        sessions: workload.sessions.len(),
        duration_s: args.duration.as_secs_f64(),
        time_scale: args.time_scale,
        kv_blocks: args.kv_blocks,
        block_size: args.block_size,
        seed: args.seed,
        engine_busy_counter: runs.iter().all(|r| r.summary.engine.busy_seconds.is_some()),
        policies: runs.iter().map(|r| r.summary.clone()).collect(),
        time_scale_check: args
            .compare_time_scale
            .map(|scale| summary::TimeScaleCheck {
                time_scale: scale,
                policies: check,
            }),
    };
    write_outputs(&args.out, &summary, &runs)?;
    Ok(summary)
}

fn validate_args(args: &Args) -> Result<(), String> {
    if args.replicas == 0 {
        return Err("--replicas must be at least 1".into());
    }
    if args.policies.is_empty() {
        return Err("--policies needs at least one policy, e.g. round_robin,least_loaded".into());
    }
    let mut seen = BTreeSet::new();
    for policy in &args.policies {
        if !seen.insert(policy.as_str()) {
            return Err(format!("--policies lists `{policy}` twice"));
        }
    }
    let scales = std::iter::once(args.time_scale).chain(args.compare_time_scale);
    for scale in scales {
        if !scale.is_finite() || scale < 0.0 {
            return Err(format!(
                "time scale {scale} is invalid; use a number >= 0 (0.1 = ten times faster than real time)"
            ));
        }
    }
    if args.kv_blocks == 0 || args.block_size == 0 {
        return Err("--kv-blocks and --block-size must be at least 1".into());
    }
    if args.duration.is_zero() {
        return Err("--duration must be positive, e.g. 120s".into());
    }
    Ok(())
}

/// API key the benchmark uses for `team` (teams are configured only when a workload has several).
fn team_key(team: &str) -> String {
    format!("bench-key-{team}")
}

/// Bytes of rendered prompt text per simulator token (one token per word of the workloads'
/// filler text, ~5-7 letters plus a space), so the prefix index is sized like the replicas' caches.
const SIM_BYTES_PER_TOKEN: usize = 6;

/// The gateway configuration for one policy: one pool over `endpoints`, and one API key per team
/// when there are several teams (so the gateway sees who sends what).
pub fn gateway_config(
    policy: &str,
    endpoints: &[String],
    teams: &[String],
) -> Result<agentgate::Config, String> {
    let quoted: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
    let mut text = format!(
        "[upstream]\nfirst_byte_timeout_s = 3600.0\nidle_timeout_s = 3600.0\n\n\
         [[pools]]\nname = \"bench\"\nmodel = \"{MODEL}\"\nflavor = \"vllm\"\npolicy = \"{policy}\"\n\
         prefix_bytes_per_token = {SIM_BYTES_PER_TOKEN}\nendpoints = [{}]\n",
        quoted.join(", ")
    );
    if teams.len() > 1 {
        for team in teams {
            text.push_str(&format!(
                "\n[[teams]]\nname = \"{team}\"\napi_key_sha256 = [\"{}\"]\n",
                agentgate::auth::hash_key(&team_key(team))
            ));
        }
    }
    agentgate::Config::parse(&text).map_err(|e| {
        format!("policy `{policy}` cannot be used: the gateway rejects its configuration: {e}")
    })
}

/// Distinct team names of a workload, sorted.
fn teams_of(workload: &Workload) -> Vec<String> {
    let set: BTreeSet<&str> = workload.sessions.iter().map(|s| s.team.as_str()).collect();
    set.into_iter().map(str::to_string).collect()
}

/// One policy: fresh replicas, a gateway, the replay, the final scrape and the oracle.
async fn run_policy(
    args: &Args,
    policy: &str,
    workload: &Arc<Workload>,
    time_scale: f64,
    show_progress: bool,
) -> Result<PolicyRun, String> {
    let mut sims = Vec::with_capacity(args.replicas);
    for index in 0..args.replicas {
        let config = agentgate_sim::SimConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: MODEL.to_string(),
            time_scale,
            kv_blocks: args.kv_blocks,
            block_size: args.block_size,
            default_output_tokens: DEFAULT_OUTPUT_TOKENS,
            seed: Some(args.seed),
            ..agentgate_sim::SimConfig::default()
        };
        let sim = agentgate_sim::spawn(config)
            .await
            .map_err(|e| format!("cannot start simulated replica {index}: {e}"))?;
        sims.push(sim);
    }
    let urls: Vec<String> = sims.iter().map(|s| s.base_url()).collect();
    let teams = teams_of(workload);
    let config = gateway_config(policy, &urls, &teams)?;
    let gateway = agentgate::Gateway::start(config, SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .map_err(|e| format!("cannot start the gateway for policy `{policy}`: {e}"))?;

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let clock = SimClock::start(time_scale);
    let sampler = metrics::Sampler::start(client.clone(), urls.clone(), clock);
    let keys = if teams.len() > 1 {
        teams.iter().map(|t| (t.clone(), team_key(t))).collect()
    } else {
        Default::default()
    };
    let replay_config = replay::ReplayConfig {
        url: format!("{}/v1/responses", gateway.base_url()),
        model: MODEL.to_string(),
        duration_s: args.duration.as_secs_f64(),
        drain_s: drain_limit_s(args.duration.as_secs_f64()),
        max_output_tokens: MAX_OUTPUT_TOKENS,
        keys,
    };
    let capacity = args.kv_blocks.saturating_mul(args.replicas);
    let reuse = reuse::ReuseFeed::start(args.block_size, capacity)
        .map_err(|e| format!("cannot start the reuse oracle: {e}"))?;
    let started = Instant::now();
    let progress = progress::Progress::start(policy, show_progress);
    let outcome = replay::replay(
        client.clone(),
        Arc::clone(workload),
        replay_config,
        clock,
        progress.counters(),
        reuse.sender(),
    )
    .await;
    progress.finish().await;
    let wall_s = started.elapsed().as_secs_f64();
    let samples = sampler.stop().await;
    let engine = metrics::scrape_fleet(&client, &urls).await?;
    gateway.shutdown().await;
    for sim in sims {
        sim.shutdown().await;
    }

    let mut records = outcome.records;
    records.sort_by_key(|r| r.seq);
    let (available, infinite) = tokio::task::spawn_blocking(move || reuse.finish())
        .await
        .map_err(|e| format!("the reuse oracle failed: {e}"))??;
    let summary = PolicySummary::build(summary::BuildInput {
        policy,
        time_scale,
        records: &records,
        available: &available,
        infinite: &infinite,
        engine: &engine,
        wall_s,
    });
    Ok(PolicyRun {
        summary,
        records,
        samples,
    })
}

/// How long in-flight requests may run past `--duration` (simulated seconds) before they are cut
/// and counted as errors.
pub fn drain_limit_s(duration_s: f64) -> f64 {
    duration_s.max(120.0)
}

fn write_outputs(
    out: &std::path::Path,
    summary: &RunSummary,
    runs: &[PolicyRun],
) -> Result<(), String> {
    let write = |name: &str, text: String| {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    let json = serde_json::to_string_pretty(summary)
        .map_err(|e| format!("cannot encode summary.json: {e}"))?;
    write("summary.json", json + "\n")?;
    write("report.md", report::render(summary))?;
    write("ttft_cdf.svg", svg::ttft_cdf(runs))?;
    write("cache_hit_ratio.svg", svg::cache_hit_over_time(runs))?;
    write("replica_load.svg", svg::replica_load(runs))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_policies_configure_and_unknown_ones_fail_clearly() {
        let urls = ["http://127.0.0.1:1".to_string()];
        assert!(gateway_config("round_robin", &urls, &[]).is_ok());
        let teams = ["agents".to_string(), "interactive".to_string()];
        let config = gateway_config("least_loaded", &urls, &teams).unwrap();
        assert_eq!(config.teams.len(), 2);
        let message = gateway_config("no_such_policy", &urls, &[]).unwrap_err();
        assert!(message.contains("no_such_policy"), "{message}");
        assert!(message.contains("pools[0].policy"), "{message}");
    }
}
