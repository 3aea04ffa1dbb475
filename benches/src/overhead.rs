//! `agentgate-bench overhead`: what the gateway costs on top of talking to an engine directly,
//! for every (concurrency, prompt size) cell of a grid.
//!
//! One simulator runs as a child process at `--time-scale 0` (no simulated delays), so what is
//! measured is pure request handling. For each cell a fresh `agentgate serve` child process (in-memory
//! store, default `store: true`) points at that simulator, and the same closed-loop client at the
//! same concurrency drives three phases over the same prompts:
//! - `direct`: non-streaming chat completions straight at the simulator;
//! - `direct_streamed`: the same, streamed (`stream: true` with usage), which is what the gateway
//!   always asks of the engine, so it separates the engine's streaming cost from the gateway's own;
//! - `gateway`: the equivalent non-streaming Responses API requests through the gateway.
//!
//! With `--rounds N` the three phases alternate N times and each phase reports its median-p50
//! round. Added latency is the gateway's percentile minus the direct one (and minus the streamed one).
//! Requests/s are closed-loop throughput at the cell's concurrency; the highest over the
//! concurrencies is reported as the maximum sustained rate per prompt size. CPU time comes from
//! the processes' own accounting (`utime + stime` in `/proc/PID/stat`, sampled at the edges of
//! the measured window) and is reported in CPU seconds per 1,000 requests.
//!
//! Prompt sizes are in simulator tokens: prompts are lowercase words of at most 12 letters
//! separated by single spaces, and the simulator's tokenizer makes one token per such word; the
//! chat template adds a few tokens, and the engine's own count is recorded per cell.
//! Writes `DIR/overhead.json` and `DIR/overhead.md`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use serde_json::{json, Value};

use crate::duration::parse_duration;
use crate::load::{run_closed_loop, LoadPlan, LoadReport};
use crate::procs::{free_port, sibling_binary, start_server, ChildGuard};

/// Model name the simulator serves and every request names.
const MODEL: &str = "sim-model";
/// Tokens per KV block of the simulator started here.
const BLOCK_SIZE: usize = 16;
/// Tokens the chat template and the output may add to a prompt, for sizing the KV cache.
const TEMPLATE_SLACK_TOKENS: usize = 64;

/// Flags of `overhead`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Concurrent requests in flight (closed loop), one cell per value.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 64])]
    pub concurrency: Vec<usize>,
    /// Prompt sizes in simulator tokens (one word = one token), one cell per value.
    #[arg(long, value_delimiter = ',', default_values_t = [100usize, 100_000])]
    pub prompt_tokens: Vec<usize>,
    /// Measured time per phase of each cell (e.g. 3s).
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Warm-up before each phase's measured window, not counted.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Rounds per cell (each runs all three phases); the round with the median p50 is reported.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Output tokens per request (`max_tokens` / `max_output_tokens`).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Distinct prompts per cell, sent in turn (each starts with its own word, so no two share a
    /// KV block).
    #[arg(long, default_value_t = 32)]
    pub distinct_prompts: usize,
    /// Seed of the prompt words.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory for `overhead.json` and `overhead.md` (created if missing).
    #[arg(long)]
    pub out: PathBuf,
}

/// One phase of one cell: latency, throughput and CPU per 1,000 requests.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PhaseResult {
    /// Successful requests completed in the measured window.
    pub requests: u64,
    /// Failed requests in the measured window.
    pub errors: u64,
    /// The first failure, if any.
    pub first_error: Option<String>,
    /// Successful requests per second over the window.
    pub requests_per_s: f64,
    /// Median latency.
    pub p50_ms: f64,
    /// 90th percentile latency.
    pub p90_ms: f64,
    /// 99th percentile latency.
    pub p99_ms: f64,
    /// Mean latency.
    pub mean_ms: f64,
    /// Simulator CPU seconds per 1,000 requests in the window.
    pub sim_cpu_s_per_1k: Option<f64>,
    /// Gateway CPU seconds per 1,000 requests in the window (gateway phase only).
    pub gateway_cpu_s_per_1k: Option<f64>,
    /// Benchmark client CPU seconds per 1,000 requests in the window.
    pub client_cpu_s_per_1k: Option<f64>,
}

/// One (concurrency, prompt size) cell.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CellResult {
    /// Requests in flight.
    pub concurrency: usize,
    /// Words (= simulator tokens) of user text per prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens the engine counted for one request (template included).
    pub engine_prompt_tokens: Option<u64>,
    /// Input tokens the gateway reported for the same prompt.
    pub gateway_input_tokens: Option<u64>,
    /// Non-streaming requests straight to the simulator.
    pub direct: PhaseResult,
    /// Streamed requests straight to the simulator (what the gateway sends upstream).
    pub direct_streamed: PhaseResult,
    /// Responses API requests through the gateway.
    pub gateway: PhaseResult,
    /// Gateway p50 minus direct p50.
    pub added_p50_ms: f64,
    /// Gateway p99 minus direct p99.
    pub added_p99_ms: f64,
    /// Gateway p50 minus streamed-direct p50.
    pub added_over_streamed_p50_ms: f64,
    /// Gateway p99 minus streamed-direct p99.
    pub added_over_streamed_p99_ms: f64,
}

impl CellResult {
    fn new(
        concurrency: usize,
        prompt_tokens: usize,
        direct: PhaseResult,
        direct_streamed: PhaseResult,
        gateway: PhaseResult,
    ) -> Self {
        CellResult {
            concurrency,
            prompt_tokens,
            engine_prompt_tokens: None,
            gateway_input_tokens: None,
            added_p50_ms: gateway.p50_ms - direct.p50_ms,
            added_p99_ms: gateway.p99_ms - direct.p99_ms,
            added_over_streamed_p50_ms: gateway.p50_ms - direct_streamed.p50_ms,
            added_over_streamed_p99_ms: gateway.p99_ms - direct_streamed.p99_ms,
            direct,
            direct_streamed,
            gateway,
        }
    }

    fn has_errors(&self) -> bool {
        self.direct.errors + self.direct_streamed.errors + self.gateway.errors > 0
    }
}

/// Highest closed-loop throughput per prompt size over the measured concurrencies.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MaxSustained {
    /// Prompt size in simulator tokens.
    pub prompt_tokens: usize,
    /// Best direct non-streaming requests/s, and the concurrency that reached it.
    pub direct_requests_per_s: f64,
    /// Concurrency of the best direct rate.
    pub direct_at_concurrency: usize,
    /// Best streamed direct requests/s.
    pub direct_streamed_requests_per_s: f64,
    /// Concurrency of the best streamed direct rate.
    pub direct_streamed_at_concurrency: usize,
    /// Best requests/s through the gateway.
    pub gateway_requests_per_s: f64,
    /// Concurrency of the best gateway rate.
    pub gateway_at_concurrency: usize,
}

/// The best rate per prompt size, in the order prompt sizes first appear in `cells`.
pub fn max_sustained(cells: &[CellResult]) -> Vec<MaxSustained> {
    let mut sizes: Vec<usize> = Vec::new();
    for cell in cells {
        if !sizes.contains(&cell.prompt_tokens) {
            sizes.push(cell.prompt_tokens);
        }
    }
    sizes
        .into_iter()
        .map(|size| {
            let of_size: Vec<&CellResult> =
                cells.iter().filter(|c| c.prompt_tokens == size).collect();
            let best = |phase: fn(&CellResult) -> &PhaseResult| {
                of_size
                    .iter()
                    .map(|c| (phase(c).requests_per_s, c.concurrency))
                    .fold((0.0, 0), |best, x| if x.0 > best.0 { x } else { best })
            };
            let direct = best(|c| &c.direct);
            let streamed = best(|c| &c.direct_streamed);
            let gateway = best(|c| &c.gateway);
            MaxSustained {
                prompt_tokens: size,
                direct_requests_per_s: direct.0,
                direct_at_concurrency: direct.1,
                direct_streamed_requests_per_s: streamed.0,
                direct_streamed_at_concurrency: streamed.1,
                gateway_requests_per_s: gateway.0,
                gateway_at_concurrency: gateway.1,
            }
        })
        .collect()
}

/// CPU seconds (user + system) a process has used, from `/proc/PID/stat` (None off Linux).
pub fn process_cpu_seconds(pid: u32, clock_ticks_per_s: f64) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_cpu_ticks(&stat).map(|ticks| ticks as f64 / clock_ticks_per_s)
}

/// `utime + stime` in clock ticks from the text of `/proc/PID/stat`.
///
/// The command name (field 2) is in parentheses and may itself contain spaces or parentheses,
/// so fields are counted from the last `)`: utime and stime are fields 14 and 15.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Clock ticks per second for `/proc` CPU times: `getconf CLK_TCK`, else Linux's usual 100.
pub fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|ticks| *ticks > 0.0)
        .unwrap_or(100.0)
}

/// A prompt of exactly `words` lowercase words (3 to 8 letters, the first one `p<index>` so
/// prompts differ from their first token), separated by single spaces.
pub fn prompt_text(words: usize, index: usize, seed: u64) -> String {
    let mut rng =
        fastrand::Rng::with_seed(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut text = String::with_capacity(words * 7);
    for w in 0..words {
        if w == 0 {
            text.push_str(&format!("p{index}"));
            continue;
        }
        text.push(' ');
        for _ in 0..rng.usize(3..=8) {
            text.push(rng.lowercase());
        }
    }
    text
}

/// The three request bodies of one prompt: direct, direct streamed, through the gateway.
fn bodies_for(prompt: &str, max_tokens: u32) -> (Bytes, Bytes, Bytes) {
    let messages = json!([{"role": "user", "content": prompt}]);
    let direct = json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens});
    let streamed = json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                          "stream": true, "stream_options": {"include_usage": true}});
    let gateway = json!({"model": MODEL, "input": prompt, "max_output_tokens": max_tokens});
    (
        Bytes::from(direct.to_string()),
        Bytes::from(streamed.to_string()),
        Bytes::from(gateway.to_string()),
    )
}

/// The round with the median p50 latency (the upper one of an even count).
fn median_round(mut rounds: Vec<PhaseResult>) -> PhaseResult {
    rounds.sort_by(|a, b| a.p50_ms.total_cmp(&b.p50_ms));
    let mid = rounds.len() / 2;
    rounds.swap_remove(mid)
}

/// Processes whose CPU time is sampled around a measured window.
#[derive(Debug, Clone, Copy)]
struct Watched {
    sim: u32,
    gateway: Option<u32>,
    client: u32,
    clock_ticks_per_s: f64,
}

/// CPU seconds of (sim, gateway, client) now.
fn cpu_now(watched: Watched) -> [Option<f64>; 3] {
    let ticks = watched.clock_ticks_per_s;
    [
        process_cpu_seconds(watched.sim, ticks),
        watched
            .gateway
            .and_then(|pid| process_cpu_seconds(pid, ticks)),
        process_cpu_seconds(watched.client, ticks),
    ]
}

/// Drive one phase and sample CPU at the edges of its measured window.
async fn measure_phase(
    url: String,
    bodies: Arc<Vec<Bytes>>,
    concurrency: usize,
    args: &Args,
    watched: Watched,
) -> Result<PhaseResult, String> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency * 2)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let start = tokio::time::Instant::now();
    let (warmup, duration) = (args.warmup, args.duration);
    let sampler = tokio::spawn(async move {
        tokio::time::sleep_until(start + warmup).await;
        let before = cpu_now(watched);
        tokio::time::sleep_until(start + warmup + duration).await;
        let after = cpu_now(watched);
        [0, 1, 2].map(|i| match (before[i], after[i]) {
            (Some(b), Some(a)) => Some(a - b),
            _ => None,
        })
    });
    let report = run_closed_loop(
        client,
        LoadPlan {
            url,
            concurrency,
            warmup,
            duration,
            bodies,
        },
    )
    .await;
    let cpu = sampler
        .await
        .map_err(|e| format!("CPU sampler failed: {e}"))?;
    Ok(phase_result(&report, cpu))
}

fn phase_result(report: &LoadReport, cpu: [Option<f64>; 3]) -> PhaseResult {
    let per_1k = |seconds: Option<f64>| {
        seconds
            .filter(|_| report.completed > 0)
            .map(|s| s * 1000.0 / report.completed as f64)
    };
    PhaseResult {
        requests: report.completed,
        errors: report.errors,
        first_error: report.first_error.clone(),
        requests_per_s: report.requests_per_s(),
        p50_ms: report.latency.p50_ms,
        p90_ms: report.latency.p90_ms,
        p99_ms: report.latency.p99_ms,
        mean_ms: report.latency.mean_ms,
        sim_cpu_s_per_1k: per_1k(cpu[0]),
        gateway_cpu_s_per_1k: per_1k(cpu[1]),
        client_cpu_s_per_1k: per_1k(cpu[2]),
    }
}

/// POST one body and return the JSON answer, failing on a non-2xx status.
async fn post_json(client: &reqwest::Client, url: &str, body: Bytes) -> Result<Value, String> {
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("POST {url} failed: {e}"))?;
    let status = response.status();
    let text = response
        .text()
        .await
        .map_err(|e| format!("reading the answer of POST {url} failed: {e}"))?;
    if !status.is_success() {
        let snippet: String = text.chars().take(300).collect();
        return Err(format!("POST {url} answered HTTP {status}: {snippet}"));
    }
    serde_json::from_str(&text).map_err(|e| format!("POST {url} answered invalid JSON: {e}"))
}

/// Start the gateway as a child process with one pool pointing at `sim_url`.
async fn start_gateway(sim_url: &str, config_dir: &Path) -> Result<(ChildGuard, String), String> {
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let config = config_dir.join(format!("agentgate-overhead-{port}.toml"));
    std::fs::write(
        &config,
        format!(
            "[server]\nmax_body_bytes = {}\n\n[[pools]]\nname = \"sim\"\nmodel = \"{MODEL}\"\nendpoints = [\"{sim_url}\"]\n",
            64 * 1024 * 1024
        ),
    )
    .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    let guard = start_server(
        &sibling_binary("agentgate")?,
        &[
            "serve".into(),
            "--config".into(),
            config.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ],
        &format!("{url}/health/ready"),
    )
    .await;
    let _ = std::fs::remove_file(&config);
    Ok((guard?, url))
}

/// Measure one cell: a fresh gateway, a probe request each way, then the three phases.
async fn run_cell(
    concurrency: usize,
    prompt_tokens: usize,
    sim: &ChildGuard,
    sim_url: &str,
    args: &Args,
    clock_ticks_per_s: f64,
) -> Result<CellResult, String> {
    let prompts: Vec<String> = (0..args.distinct_prompts.max(1))
        .map(|i| prompt_text(prompt_tokens, i, args.seed))
        .collect();
    let mut direct_bodies = Vec::with_capacity(prompts.len());
    let mut streamed_bodies = Vec::with_capacity(prompts.len());
    let mut gateway_bodies = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let (direct, streamed, gateway) = bodies_for(prompt, args.max_tokens);
        direct_bodies.push(direct);
        streamed_bodies.push(streamed);
        gateway_bodies.push(gateway);
    }
    drop(prompts);

    let (gateway, gw_url) = start_gateway(sim_url, &std::env::temp_dir()).await?;
    let probe = reqwest::Client::new();
    let direct_url = format!("{sim_url}/v1/chat/completions");
    let responses_url = format!("{gw_url}/v1/responses");
    let direct_answer = post_json(&probe, &direct_url, direct_bodies[0].clone()).await?;
    let gateway_answer = post_json(&probe, &responses_url, gateway_bodies[0].clone()).await?;

    let watched = Watched {
        sim: sim.0.id(),
        gateway: None,
        client: std::process::id(),
        clock_ticks_per_s,
    };
    let (direct_bodies, streamed_bodies, gateway_bodies) = (
        Arc::new(direct_bodies),
        Arc::new(streamed_bodies),
        Arc::new(gateway_bodies),
    );
    let via_gateway = Watched {
        gateway: Some(gateway.0.id()),
        ..watched
    };
    let rounds = args.rounds.max(1);
    let (mut direct, mut direct_streamed, mut through_gateway) = (
        Vec::with_capacity(rounds),
        Vec::with_capacity(rounds),
        Vec::with_capacity(rounds),
    );
    // Phases alternate within each round so a change in background load hits all three alike.
    for round in 1..=rounds {
        eprintln!("  round {round}/{rounds}: direct, direct streamed, through the gateway ...");
        direct.push(
            measure_phase(
                direct_url.clone(),
                direct_bodies.clone(),
                concurrency,
                args,
                watched,
            )
            .await?,
        );
        direct_streamed.push(
            measure_phase(
                direct_url.clone(),
                streamed_bodies.clone(),
                concurrency,
                args,
                watched,
            )
            .await?,
        );
        through_gateway.push(
            measure_phase(
                responses_url.clone(),
                gateway_bodies.clone(),
                concurrency,
                args,
                via_gateway,
            )
            .await?,
        );
    }
    let (direct, direct_streamed, through_gateway) = (
        median_round(direct),
        median_round(direct_streamed),
        median_round(through_gateway),
    );
    drop(gateway);

    let mut cell = CellResult::new(
        concurrency,
        prompt_tokens,
        direct,
        direct_streamed,
        through_gateway,
    );
    cell.engine_prompt_tokens = direct_answer["usage"]["prompt_tokens"].as_u64();
    cell.gateway_input_tokens = gateway_answer["usage"]["input_tokens"].as_u64();
    Ok(cell)
}

fn fmt_opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "n/a".to_string(), |v| format!("{v:.decimals$}"))
}

/// The Markdown report: per-cell table, maximum sustained rates, settings and command line.
pub fn render_markdown(
    cells: &[CellResult],
    best: &[MaxSustained],
    settings: &Value,
    command: &str,
) -> String {
    let mut md = String::new();
    md.push_str("# Gateway overhead\n\n");
    md.push_str(
        "Same prompts, same closed-loop client and concurrency: straight to one simulator \
         (`--time-scale 0`, non-streamed and streamed) and through `agentgate serve` (in-memory \
         store). Latencies in wall milliseconds; \"added\" is gateway minus direct; CPU is \
         seconds per 1,000 requests from `/proc/PID/stat`.\n\n",
    );
    md.push_str(
        "| prompt tokens | concurrency | direct p50 / p99 ms | streamed p50 / p99 ms | gateway p50 / p99 ms \
         | added p50 / p99 ms | added over streamed p50 / p99 ms | req/s direct / streamed / gateway \
         | gateway CPU s / 1k req | sim CPU s / 1k req (direct / via gateway) | errors |\n",
    );
    md.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for c in cells {
        md.push_str(&format!(
            "| {} | {} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} / {:.0} / {:.0} | {} | {} / {} | {} |\n",
            c.prompt_tokens,
            c.concurrency,
            c.direct.p50_ms,
            c.direct.p99_ms,
            c.direct_streamed.p50_ms,
            c.direct_streamed.p99_ms,
            c.gateway.p50_ms,
            c.gateway.p99_ms,
            c.added_p50_ms,
            c.added_p99_ms,
            c.added_over_streamed_p50_ms,
            c.added_over_streamed_p99_ms,
            c.direct.requests_per_s,
            c.direct_streamed.requests_per_s,
            c.gateway.requests_per_s,
            fmt_opt(c.gateway.gateway_cpu_s_per_1k, 3),
            fmt_opt(c.direct.sim_cpu_s_per_1k, 3),
            fmt_opt(c.gateway.sim_cpu_s_per_1k, 3),
            c.direct.errors + c.direct_streamed.errors + c.gateway.errors,
        ));
    }
    md.push_str("\n## Maximum sustained requests/s (best concurrency in brackets)\n\n");
    md.push_str("| prompt tokens | direct | direct streamed | gateway |\n|---:|---:|---:|---:|\n");
    for b in best {
        md.push_str(&format!(
            "| {} | {:.0} ({}) | {:.0} ({}) | {:.0} ({}) |\n",
            b.prompt_tokens,
            b.direct_requests_per_s,
            b.direct_at_concurrency,
            b.direct_streamed_requests_per_s,
            b.direct_streamed_at_concurrency,
            b.gateway_requests_per_s,
            b.gateway_at_concurrency,
        ));
    }
    let text = |key: &str| match &settings[key] {
        Value::String(s) => s.clone(),
        Value::Null => "unknown".to_string(),
        other => other.to_string(),
    };
    md.push_str(&format!(
        "\nEach phase: {} s measured after {} s of warm-up, median of {} round(s); {} output tokens \
         per request; {} distinct prompts per cell. Client, simulator and gateway share this machine's {} cores; load \
         average before the run {}, after {}.\n\nCommand:\n\n```sh\n{command}\n```\n",
        text("duration_s"),
        text("warmup_s"),
        text("rounds"),
        text("max_tokens"),
        text("distinct_prompts"),
        text("cpus"),
        text("load_average_before"),
        text("load_average_after"),
    ));
    md
}

/// KV blocks the simulator needs to hold `concurrency` prompts of `prompt_tokens` at once.
fn kv_blocks_for(concurrency: usize, prompt_tokens: usize, max_tokens: u32) -> usize {
    let per_request =
        (prompt_tokens + max_tokens as usize + TEMPLATE_SLACK_TOKENS).div_ceil(BLOCK_SIZE) + 1;
    (per_request * concurrency.max(1)).max(4096)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "unknown".to_string())
}

/// Run every cell, print a summary line per cell, and write `overhead.json` and `overhead.md`.
pub async fn run(args: Args) -> Result<(), String> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        return Err("--concurrency needs one or more positive numbers, e.g. 1,16,64".into());
    }
    if args.prompt_tokens.is_empty() || args.prompt_tokens.contains(&0) {
        return Err("--prompt-tokens needs one or more positive numbers, e.g. 100,100000".into());
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let load_before = load_average();
    let clock_ticks_per_s = clock_ticks_per_second();
    let max_concurrency = args.concurrency.iter().copied().max().unwrap_or(1);
    let max_prompt = args.prompt_tokens.iter().copied().max().unwrap_or(1);

    let sim_port = free_port()?;
    let sim_url = format!("http://127.0.0.1:{sim_port}");
    let sim = start_server(
        &sibling_binary("agentgate-sim")?,
        &[
            "--listen".into(),
            format!("127.0.0.1:{sim_port}"),
            "--time-scale".into(),
            "0".into(),
            "--model".into(),
            MODEL.into(),
            "--block-size".into(),
            BLOCK_SIZE.to_string(),
            "--kv-blocks".into(),
            kv_blocks_for(max_concurrency, max_prompt, args.max_tokens).to_string(),
            "--max-num-seqs".into(),
            max_concurrency.max(64).to_string(),
            "--max-body-bytes".into(),
            (64 * 1024 * 1024).to_string(),
        ],
        &format!("{sim_url}/v1/models"),
    )
    .await?;

    let started = Instant::now();
    let mut cells = Vec::new();
    for &prompt_tokens in &args.prompt_tokens {
        for &concurrency in &args.concurrency {
            eprintln!("prompt {prompt_tokens} tokens, concurrency {concurrency}:");
            let cell = run_cell(
                concurrency,
                prompt_tokens,
                &sim,
                &sim_url,
                &args,
                clock_ticks_per_s,
            )
            .await?;
            println!(
                "prompt {:>6} conc {:>3}: direct p50 {:.2} p99 {:.2} | streamed p50 {:.2} p99 {:.2} | gateway p50 {:.2} p99 {:.2} ms | added p50 {:.2} p99 {:.2} ms | req/s {:.0}/{:.0}/{:.0} | gateway CPU {} s/1k",
                prompt_tokens, concurrency,
                cell.direct.p50_ms, cell.direct.p99_ms,
                cell.direct_streamed.p50_ms, cell.direct_streamed.p99_ms,
                cell.gateway.p50_ms, cell.gateway.p99_ms,
                cell.added_p50_ms, cell.added_p99_ms,
                cell.direct.requests_per_s, cell.direct_streamed.requests_per_s, cell.gateway.requests_per_s,
                fmt_opt(cell.gateway.gateway_cpu_s_per_1k, 3),
            );
            cells.push(cell);
        }
    }
    drop(sim);

    let best = max_sustained(&cells);
    let settings = json!({
        "duration_s": args.duration.as_secs_f64(),
        "warmup_s": args.warmup.as_secs_f64(),
        "rounds": args.rounds.max(1),
        "max_tokens": args.max_tokens,
        "distinct_prompts": args.distinct_prompts,
        "seed": args.seed,
        "clock_ticks_per_s": clock_ticks_per_s,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "wall_s": started.elapsed().as_secs_f64(),
    });
    let report = json!({
        "command": command,
        "settings": settings,
        "cells": cells,
        "max_sustained": best,
    });
    let json_path = args.out.join("overhead.json");
    let text = serde_json::to_string_pretty(&report)
        .map_err(|e| format!("cannot serialise the results: {e}"))?;
    std::fs::write(&json_path, text)
        .map_err(|e| format!("cannot write {}: {e}", json_path.display()))?;
    let md_path = args.out.join("overhead.md");
    std::fs::write(
        &md_path,
        render_markdown(&cells, &best, &settings, &command),
    )
    .map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;
    eprintln!("wrote {} and {}", json_path.display(), md_path.display());

    let failed: Vec<String> = cells
        .iter()
        .filter(|c| c.has_errors())
        .map(|c| {
            let first = [&c.direct, &c.direct_streamed, &c.gateway]
                .iter()
                .find_map(|p| p.first_error.clone())
                .unwrap_or_default();
            format!(
                "prompt {} / concurrency {}: {first}",
                c.prompt_tokens, c.concurrency
            )
        })
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "requests failed in {} cell(s) (see overhead.json): {}",
            failed.len(),
            failed.join("; ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase(rps: f64, p50: f64, p99: f64) -> PhaseResult {
        PhaseResult {
            requests: 100,
            errors: 0,
            first_error: None,
            requests_per_s: rps,
            p50_ms: p50,
            p90_ms: p99,
            p99_ms: p99,
            mean_ms: p50,
            sim_cpu_s_per_1k: Some(0.5),
            gateway_cpu_s_per_1k: None,
            client_cpu_s_per_1k: None,
        }
    }

    #[test]
    fn stat_cpu_ticks_count_from_the_last_parenthesis() {
        let stat = "4242 (agent (gate) x) S 1 4242 4242 0 -1 4194560 1234 0 0 0 350 27 0 0 20 0 9 0 100 0 0";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(377));
        assert_eq!(parse_stat_cpu_ticks("4242 (x) S 1 2"), None);
        assert_eq!(parse_stat_cpu_ticks("no parenthesis"), None);
    }

    #[test]
    fn own_process_cpu_is_readable_and_grows() {
        let ticks = clock_ticks_per_second();
        assert!(ticks > 0.0);
        let before = process_cpu_seconds(std::process::id(), ticks).unwrap_or(f64::NAN);
        let mut x = 0u64;
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let after = process_cpu_seconds(std::process::id(), ticks).unwrap_or(f64::NAN);
        assert!(after >= before, "{before} -> {after}");
    }

    #[test]
    fn prompt_has_exactly_the_requested_simulator_tokens() {
        for words in [1, 2, 100, 5000] {
            let text = prompt_text(words, 7, 1);
            assert_eq!(agentgate_sim::tokenizer::tokenize(&text).len(), words);
            assert!(!text.contains("  ") && !text.ends_with(' '));
        }
        assert_ne!(prompt_text(50, 1, 1), prompt_text(50, 2, 1));
        assert_eq!(prompt_text(50, 3, 9), prompt_text(50, 3, 9));
        let first_blocks: Vec<u64> = (0..4)
            .map(|i| {
                let tokens = agentgate_sim::tokenizer::tokenize(&prompt_text(64, i, 1));
                agentgate_sim::cache::chain_hashes(&tokens, 16)[0]
            })
            .collect();
        for (i, a) in first_blocks.iter().enumerate() {
            assert!(
                !first_blocks[i + 1..].contains(a),
                "prompts share a first block"
            );
        }
    }

    #[test]
    fn bodies_carry_the_same_prompt_each_way() {
        let (direct, streamed, gateway) = bodies_for("p0 alpha beta", 16);
        let direct: Value = serde_json::from_slice(&direct).unwrap_or(Value::Null);
        let streamed: Value = serde_json::from_slice(&streamed).unwrap_or(Value::Null);
        let gateway: Value = serde_json::from_slice(&gateway).unwrap_or(Value::Null);
        assert_eq!(direct["messages"][0]["content"], "p0 alpha beta");
        assert_eq!(direct["stream"], Value::Null);
        assert_eq!(streamed["messages"], direct["messages"]);
        assert_eq!(streamed["stream"], true);
        assert_eq!(gateway["input"], "p0 alpha beta");
        assert_eq!(gateway["max_output_tokens"], 16);
    }

    #[test]
    fn added_latency_and_best_rates() {
        let cells = vec![
            CellResult::new(
                1,
                100,
                phase(900.0, 1.0, 2.0),
                phase(800.0, 1.2, 2.5),
                phase(600.0, 1.5, 3.5),
            ),
            CellResult::new(
                16,
                100,
                phase(3000.0, 5.0, 9.0),
                phase(2500.0, 6.0, 10.0),
                phase(2000.0, 8.0, 12.0),
            ),
            CellResult::new(
                1,
                1000,
                phase(100.0, 10.0, 20.0),
                phase(90.0, 11.0, 21.0),
                phase(80.0, 12.0, 25.0),
            ),
        ];
        assert_eq!(cells[0].added_p50_ms, 0.5);
        assert_eq!(cells[0].added_p99_ms, 1.5);
        assert!((cells[0].added_over_streamed_p50_ms - 0.3).abs() < 1e-9);
        assert_eq!(cells[0].added_over_streamed_p99_ms, 1.0);
        let best = max_sustained(&cells);
        assert_eq!(best.len(), 2);
        assert_eq!(best[0].prompt_tokens, 100);
        assert_eq!(
            (
                best[0].gateway_requests_per_s,
                best[0].gateway_at_concurrency
            ),
            (2000.0, 16)
        );
        assert_eq!(best[0].direct_at_concurrency, 16);
        assert_eq!(
            (best[1].prompt_tokens, best[1].direct_requests_per_s),
            (1000, 100.0)
        );
        let md = render_markdown(
            &cells,
            &best,
            &json!({"cpus": 2}),
            "agentgate-bench overhead",
        );
        assert_eq!(md.matches("\n| 100 | ").count(), 3, "{md}");
        assert!(md.contains("| 1000 | 1 | 10.00 / 20.00 |"), "{md}");
        assert!(
            md.contains("| 100 | 3000 (16) | 2500 (16) | 2000 (16) |"),
            "{md}"
        );
    }

    #[test]
    fn median_round_is_chosen_by_p50() {
        let rounds = vec![
            phase(10.0, 3.0, 9.0),
            phase(20.0, 1.0, 7.0),
            phase(30.0, 2.0, 8.0),
        ];
        assert_eq!(median_round(rounds).requests_per_s, 30.0);
        assert_eq!(median_round(vec![phase(5.0, 1.0, 1.0)]).requests_per_s, 5.0);
    }

    #[test]
    fn kv_capacity_fits_every_request_in_flight() {
        let blocks = kv_blocks_for(64, 100_000, 16);
        assert!(blocks * BLOCK_SIZE >= 64 * (100_000 + 16));
        assert_eq!(kv_blocks_for(1, 100, 16), 4096);
    }
}
