//! The `run` subcommand: replays one workload against a fresh simulated fleet behind the gateway,
//! once per row (routing policy, and the layouts and flow settings compared: [`rows()`]), and
//! writes `summary.json`, `report.md` and SVG charts.
//!
//! For each row it starts the simulated vLLM replicas of its layout and the gateways in-process
//! (fresh replicas per row, so every row starts with cold caches), replays the workload
//! through the Responses API with streaming ([`replay`]), samples the replicas' `/metrics` while it
//! runs ([`metrics`]), replays the exact prompt token ids through the reuse oracle, and summarises
//! ([`summary`]). All requested policies are validated against the gateway's configuration
//! parser before anything starts, so an unknown policy fails at once with the gateway's message.
//!
//! Simulated time is wall time divided by `--time-scale`; at time scale 0 the replicas do not
//! sleep at all, think times are skipped and latencies are reported in wall milliseconds.
//!
//! `--gateways N` starts N gateways per policy over the same replicas, sharing one store
//! ([`store`]: Redis by default when N > 1, or one in-process store with `--store memory`);
//! turn `t` of session `s` is sent to gateway `(s + t) % N` ([`replay::gateway_for`]), so
//! consecutive turns of a session alternate between gateways and keep their cache reuse only
//! if stored responses and session pins are shared through the store.
//!
//! `--kill-replica AT` crashes replica 0 at simulated second AT of each replay ([`kill`]): the
//! gateways reach the replicas through killable TCP relays ([`relay`]), and killing one refuses
//! new connections and breaks every stream in flight on it. The summary then counts the failures
//! and the cache hit ratio before, right after and late after the kill.
//!
//! `--topology agg,pd:PxD` replays each policy on several fleet layouts of the same simulated
//! hardware, and `--pd-threshold T1,T2` sweeps the P/D pools' disaggregation threshold
//! ([`topology`]). P/D rows add the gateway's P/D counters and per-role engine totals, and count
//! tokens so that they compare with aggregated rows ([`pd`]).
//!
//! Flow control ([`flow`]): `--flow-control on,off` replays every policy once with the gateway's
//! flow control and once without. A multi-team workload gets bands (`interactive` above
//! `batch`) and one API key per team; the gateway's per-endpoint cap is the replicas'
//! `--max-num-seqs`. For `mixed`, `--mixed-batch-load F` sizes the agents team at
//! `F x request slots` sessions (replicas serving requests x max_num_seqs, on the first
//! `--topology` layout), and `--interactive-alone` adds a row per policy and layout replaying
//! only the interactive team (same sessions, same configuration), so one run yields the
//! interactive team's TTFT alone, beside the batch load with flow control, and without it
//! ([`summary::IsolationCheck`]). The `fairness` workload puts two teams of equal weight in one
//! band, one with ten times the other's sessions.
//!
//! `--seeds 1-10` runs all of this once per seed into `OUT/seed-N` and sets the goal figures of
//! every seed side by side in `seeds.json` and `seeds.md` ([`seeds`]).
//!
//! Each replay is a *row* of the summary: one per policy x layout x threshold x flow setting,
//! plus the interactive team alone; [`rows()`] gives their order and labels.

pub mod clock;
pub mod flow;
pub mod kill;
pub mod metrics;
pub mod pd;
pub mod progress;
pub mod relay;
pub mod replay;
pub mod report;
pub mod reuse;
pub mod rows;
pub mod seeds;
pub mod sse;
pub mod store;
pub mod summary;
pub mod svg;
pub mod topology;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::workload::{self, Workload, WorkloadKind, WorkloadParams};

pub use clock::ClockMode;
use clock::SimClock;
use flow::{FlowMode, FlowSetup, SaturationSampler};
use kill::{KillOutcome, Killer, KILLED_REPLICA};
use relay::Relay;
pub use store::StoreKind;
use store::{SharedStore, StoreTarget};
use summary::{IsolationCheck, PolicyRun, PolicySummary, RunSummary};
use topology::Topology;

pub use rows::{rows, Row};

/// Model name the simulated replicas serve and the benchmark requests.
pub const MODEL: &str = "sim-model";
/// Cap on generated tokens per request; the simulator picks the actual length (150..450).
pub const MAX_OUTPUT_TOKENS: u64 = 4096;
/// Mean output length the replicas are configured with (`default_output_tokens`).
pub const DEFAULT_OUTPUT_TOKENS: usize = 300;

/// Socket buffers on the virtual clock, bytes: larger than any prompt the workloads send.
const VIRTUAL_SOCKET_BUFFER_BYTES: u32 = 8 << 20;

/// Send and receive buffers of the replicas', gateways' and relays' sockets. The kernel's
/// autotuning sizes them by measured real time, so on the virtual clock concurrent prompts
/// (hundreds of KB each) could complete in a different order from run to run; fixed buffers
/// larger than any prompt keep them in the order they were sent. The wall clock keeps the
/// kernel's autotuning (0).
pub fn socket_buffer_bytes(clock: ClockMode) -> u32 {
    match clock {
        ClockMode::Wall => 0,
        ClockMode::Virtual => VIRTUAL_SOCKET_BUFFER_BYTES,
    }
}

/// Command-line arguments of `agentgate-bench run`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Workload to replay: agentic, chat, mixed, fairness or trace:PATH (a Mooncake-format
    /// JSONL trace).
    #[arg(long)]
    pub workload: String,
    /// Simulated replicas behind the gateway.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Gateways per policy, all over the same replicas and sharing one store (see --store);
    /// turn t of session s is sent to gateway (s + t) % N.
    #[arg(long, default_value_t = 1)]
    pub gateways: usize,
    /// Where the gateways keep their state: `redis` (--redis-url, or a private redis-server on
    /// a free port; needs the wall clock) or `memory` (one in-process store all the gateways of
    /// a policy share; the virtual clock can run it). Default: `memory` with one gateway,
    /// `redis` with several or with --redis-url.
    #[arg(long, value_enum)]
    pub store: Option<StoreKind>,
    /// Redis the gateways keep their state in (default with `--store redis`: a private
    /// redis-server on a free port).
    #[arg(long)]
    pub redis_url: Option<String>,
    /// Kill replica 0 at this simulated time (e.g. 150s): it refuses connections from then on and
    /// the streams in flight on it break.
    #[arg(long, value_parser = crate::duration::parse_duration)]
    pub kill_replica: Option<Duration>,
    /// Routing policies to compare, comma-separated (round_robin, least_loaded, prefix, session).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_loaded,prefix,session"
    )]
    pub policies: Vec<String>,
    /// Flow control in the gateway, comma-separated to compare: on (bands, fair queuing, the
    /// gateway's cap) or off (arrival order, queueing only in the engines).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "on")]
    pub flow_control: Vec<FlowMode>,
    /// Sequences each simulated replica runs at once (vLLM --max-num-seqs); the gateway's
    /// per-endpoint cap is set to match.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Tokens each simulated replica computes per step (vLLM --max-num-batched-tokens; prompts
    /// are prefilled in chunks of what decodes leave; 0 = whole prompts in one step).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Largest prefill chunk one sequence takes per step (vLLM --long-prefill-token-threshold;
    /// 0 = only the step budget limits it).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Workloads with bands: the share of the pool's request slots the batch band leaves free
    /// for the interactive band (its `reserve`). The default is about the interactive team's
    /// peak concurrency when it runs alone on the `mixed` isolation setup (7 of 16 slots).
    #[arg(long, default_value_t = 0.5)]
    pub interactive_reserve: f64,
    /// `[flow] max_kv_working_set` of every gateway: the share of a replica's KV capacity the
    /// prompts in flight there may span (shared prefixes once; each gateway counts the KV the
    /// replica reports in use by the others' requests); 0 = no limit. The default is the
    /// gateway's.
    #[arg(long, default_value_t = 0.6)]
    pub kv_working_set: f64,
    /// `[flow] aging_s` of every gateway, simulated (e.g. 30s): the head start continuing
    /// turns get over new sessions while requests queue. The default is the gateway's.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_duration)]
    pub aging: Duration,
    /// mixed only: the agents team runs FACTOR x request slots sessions (replicas serving
    /// requests x max-num-seqs, on the first --topology layout), half
    /// starting within the first 10 s, half over the first half of the span (default: half of
    /// --sessions in up to three bursts).
    #[arg(long, value_name = "FACTOR")]
    pub mixed_batch_load: Option<f64>,
    /// mixed only: also replay the interactive team alone, once per policy, layout and
    /// threshold.
    #[arg(long)]
    pub interactive_alone: bool,
    /// Make the batch band sheddable: its requests are refused at once while the pool is
    /// saturated instead of queued.
    #[arg(long)]
    pub batch_sheddable: bool,
    /// Sessions that start within the replayed span (ignored by trace workloads; mixed: half
    /// are chat; fairness: split 1:10 between teams light and heavy).
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    /// Simulated span of the workload (e.g. 120s, 10m); no new turn starts after it.
    #[arg(long, default_value = "300s", value_parser = crate::duration::parse_duration)]
    pub duration: Duration,
    /// Wall-clock runs: wall seconds per simulated second (default 0.2 = five times faster than
    /// real time; 0 = no delays). Giving it selects the wall clock.
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// The clock the run follows: `virtual` (one thread on a paused clock that jumps to the next
    /// timer whenever every task waits: same-seed runs repeat each other) or `wall` (real time
    /// compressed by --time-scale). Default: `virtual`, or `wall` when the run needs real time
    /// (--time-scale, --compare-time-scale, a Redis store).
    #[arg(long, value_enum)]
    pub clock: Option<ClockMode>,
    /// KV-cache capacity of every replica, in blocks.
    #[arg(long, default_value_t = 65_536)]
    pub kv_blocks: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seed of the workload generator and of the replicas' generated outputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run the whole comparison once per seed (e.g. `1-10`, `1,3,5`), each into OUT/seed-N as
    /// --seed N would, and put the goal figures side by side in OUT/seeds.json and
    /// OUT/seeds.md. Not with --seed.
    #[arg(long, value_parser = SeedList::parse, conflicts_with = "seed")]
    pub seeds: Option<SeedList>,
    /// Also replay everything at this second time scale and report how the headline numbers move.
    #[arg(long)]
    pub compare_time_scale: Option<f64>,
    /// Directory for summary.json, report.md and the SVG charts (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Fleet layouts to compare, comma-separated: `agg` (--replicas aggregated replicas) or
    /// `pd:PxD` (P prefill and D decode replicas with the same simulated hardware).
    #[arg(long, value_delimiter = ',', default_value = "agg")]
    pub topology: Vec<Topology>,
    /// P/D layouts: `[pools.disaggregation] threshold_tokens`, comma-separated for a sweep (one
    /// row per value; default: the gateway's).
    #[arg(long, value_delimiter = ',')]
    pub pd_threshold: Vec<u64>,
}

/// The seeds of `--seeds`, in the order given (see [`seeds::parse_seeds`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedList(pub Vec<u64>);

impl SeedList {
    fn parse(text: &str) -> Result<SeedList, String> {
        seeds::parse_seeds(text).map(SeedList)
    }
}

/// `--time-scale` when the wall clock runs without one.
pub const DEFAULT_TIME_SCALE: f64 = 0.2;

impl Args {
    /// The store the gateways share: `--store`, else Redis when there are several gateways or
    /// a `--redis-url`, else memory.
    pub fn store_kind(&self) -> StoreKind {
        self.store
            .unwrap_or(if self.gateways > 1 || self.redis_url.is_some() {
                StoreKind::Redis
            } else {
                StoreKind::Memory
            })
    }

    /// The clock the run follows: `--clock`, else `wall` when an option asks for real time
    /// (a time scale, or a Redis store, which answers on its own clock), else `virtual`.
    pub fn clock(&self) -> ClockMode {
        self.clock.unwrap_or(
            if self.time_scale.is_some()
                || self.compare_time_scale.is_some()
                || self.store_kind() == StoreKind::Redis
            {
                ClockMode::Wall
            } else {
                ClockMode::Virtual
            },
        )
    }

    /// Wall seconds per simulated second the replay runs at: `--time-scale` (default
    /// [`DEFAULT_TIME_SCALE`]) on the wall clock, 1 on the virtual clock (whose seconds are the
    /// simulated ones).
    pub fn effective_time_scale(&self) -> f64 {
        match self.clock() {
            ClockMode::Wall => self.time_scale.unwrap_or(DEFAULT_TIME_SCALE),
            ClockMode::Virtual => 1.0,
        }
    }
}

/// Run the command: validate, generate, replay every row, write the outputs.
pub async fn run(args: Args) -> Result<(), String> {
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    // The `\r` progress line is for a person at a terminal; logs get the final table only.
    let show_progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    if let Some(SeedList(list)) = &args.seeds {
        let summary = execute_seeds(&args, list, &command_line, show_progress).await?;
        println!("{}", seeds::render(&summary));
        println!(
            "wrote {}, {} and one directory per seed",
            args.out.join("seeds.json").display(),
            args.out.join("seeds.md").display()
        );
        return Ok(());
    }
    let summary = execute(&args, &command_line, show_progress).await?;
    println!("{}", report::table(&summary.policies));
    println!(
        "wrote {}, {} and the SVG charts",
        args.out.join("summary.json").display(),
        args.out.join("report.md").display()
    );
    Ok(())
}

/// `--seeds`: everything `run` does for each seed ([`execute`] into `OUT/seed-N`), then
/// `seeds.json` and `seeds.md`; returns what was written to `seeds.json`. A failed seed ends
/// the run with its error, after the seeds before it are summed up. Callable from tests.
pub async fn execute_seeds(
    args: &Args,
    list: &[u64],
    command_line: &str,
    show_progress: bool,
) -> Result<seeds::SeedsSummary, String> {
    if list.is_empty() {
        return Err("--seeds names no seed".into());
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    for stale in ["seeds.json", "seeds.md"] {
        let _ = std::fs::remove_file(args.out.join(stale));
    }
    let mut runs = Vec::with_capacity(list.len());
    let mut failed = None;
    for (i, &seed) in list.iter().enumerate() {
        let one = Args {
            seed,
            seeds: None,
            out: args.out.join(format!("seed-{seed}")),
            ..args.clone()
        };
        let started = Instant::now();
        let command = format!("{command_line} [seed {seed}]");
        match execute(&one, &command, show_progress).await {
            Ok(summary) => {
                eprintln!(
                    "seed {seed} ({} of {}) done in {:.0} s: {}",
                    i + 1,
                    list.len(),
                    started.elapsed().as_secs_f64(),
                    one.out.display()
                );
                runs.push((seed, summary));
            }
            Err(e) => {
                failed = Some(format!("seed {seed}: {e}"));
                break;
            }
        }
    }
    match failed {
        Some(e) if runs.is_empty() => return Err(e),
        _ => {}
    }
    let summary = seeds::summarize(command_line, &runs);
    seeds::write(&args.out, &summary)?;
    match failed {
        Some(e) => Err(format!(
            "{e} (seeds.json and seeds.md sum up the {} seeds before it)",
            runs.len()
        )),
        None => Ok(summary),
    }
}

/// Requests the fleet of the first `--topology` layout runs at once (replicas serving requests
/// x max_num_seqs, see [`rows::request_slots`]): what `--mixed-batch-load` is a factor of.
pub fn request_slots(args: &Args) -> usize {
    let layout = args.topology.first().copied().unwrap_or(Topology::Agg);
    rows::request_slots(&layout.roles(args.replicas), args.max_num_seqs)
}

/// Sessions of the `mixed` agents team for `--mixed-batch-load`: `ceil(FACTOR x slots)`.
pub fn batch_sessions(args: &Args) -> Option<usize> {
    args.mixed_batch_load
        .map(|factor| (factor * request_slots(args) as f64).ceil() as usize)
}

/// Everything `run` does, callable from tests: returns what was written to `summary.json`.
pub async fn execute(
    args: &Args,
    command_line: &str,
    show_progress: bool,
) -> Result<RunSummary, String> {
    validate_args(args)?;
    let kind: WorkloadKind = args.workload.parse()?;
    validate_workload_args(args, &kind)?;
    let probe_teams = ["agents".to_string(), "interactive".to_string()];
    for policy in &args.policies {
        for &mode in &args.flow_control {
            gateway_config(
                policy,
                &["http://127.0.0.1:9".to_string()],
                &probe_teams,
                &StoreTarget::Memory,
                &flow_setup(args, mode, args.effective_time_scale()),
            )?;
        }
    }
    if let Some(url) = &args.redis_url {
        store::check_url(url)?;
    }
    let params = WorkloadParams {
        kind: kind.clone(),
        sessions: args.sessions,
        duration_s: args.duration.as_secs_f64(),
        seed: args.seed,
        agent_sessions: batch_sessions(args),
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
    let alone = Arc::new(workload.only_team(flow::INTERACTIVE_TEAM));
    if args.interactive_alone && alone.sessions.is_empty() {
        return Err(
            "--interactive-alone: the workload has no interactive session; raise --sessions".into(),
        );
    }
    let teams = teams_of(&workload);
    std::fs::create_dir_all(&args.out)
        .map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let store =
        SharedStore::open(args.store_kind(), args.gateways, args.redis_url.as_deref()).await?;

    let rows = rows(args);
    let replay = |row: &Row| {
        if row.interactive_alone {
            Arc::clone(&alone)
        } else {
            Arc::clone(&workload)
        }
    };
    let mut runs = Vec::new();
    for row in &rows {
        let scale = args.effective_time_scale();
        let load = replay(row);
        runs.push(run_row(args, row, &load, &teams, &store, scale, show_progress).await?);
    }
    let mut check = Vec::new();
    if let Some(scale) = args.compare_time_scale {
        for row in &rows {
            let load = replay(row);
            let run = run_row(args, row, &load, &teams, &store, scale, show_progress).await?;
            check.push(run.summary);
        }
    }
    let policies: Vec<PolicySummary> = runs.iter().map(|r| r.summary.clone()).collect();
    let interactive_isolation = if kind == WorkloadKind::Mixed {
        isolation_checks(&rows, &policies)
    } else {
        Vec::new()
    };
    let summary = RunSummary {
        workload: workload.name.clone(),
        command: command_line.to_string(),
        replicas: args.replicas,
        gateways: args.gateways,
        store: store.kind().to_string(),
        kill_replica_s: args.kill_replica.map(|at| at.as_secs_f64()),
        sessions: workload.sessions.len(),
        duration_s: args.duration.as_secs_f64(),
        time_scale: args.effective_time_scale(),
        clock: args.clock().as_str().to_string(),
        kv_blocks: args.kv_blocks,
        block_size: args.block_size,
        seed: args.seed,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        long_prefill_token_threshold: args.long_prefill_token_threshold,
        interactive_reserve: args.interactive_reserve,
        kv_working_set: args.kv_working_set,
        aging_s: args.aging.as_secs_f64(),
        request_slots: request_slots(args),
        flow_control: args
            .flow_control
            .iter()
            .map(|m| m.as_str().to_string())
            .collect(),
        batch_sheddable: args.batch_sheddable,
        mixed_batch_load: args.mixed_batch_load,
        engine_busy_counter: runs.iter().all(|r| r.summary.engine.busy_seconds.is_some()),
        policies,
        interactive_isolation,
        time_scale_check: args
            .compare_time_scale
            .map(|scale| summary::TimeScaleCheck {
                time_scale: scale,
                policies: check,
            }),
        topologies: args.topology.iter().map(Topology::to_string).collect(),
        pd_thresholds: args.pd_threshold.clone(),
    };
    write_outputs(&args.out, &summary, &runs)?;
    Ok(summary)
}

/// Per setup (policy, layout and threshold: [`Row::setup`]), the interactive team's TTFT p99
/// alone, with flow control on and off, and the ratios the isolation goal is stated in. `rows`
/// and `summaries` are parallel: the summary of `rows[i]` is `summaries[i]`.
pub fn isolation_checks(rows: &[Row], summaries: &[PolicySummary]) -> Vec<IsolationCheck> {
    let mut setups: Vec<&Row> = Vec::new();
    for row in rows {
        if !setups.iter().any(|s| s.setup == row.setup) {
            setups.push(row);
        }
    }
    let find = |setup: &str, flow: Option<FlowMode>, alone: bool| {
        rows.iter()
            .zip(summaries)
            .find(|(r, _)| {
                r.setup == setup && r.interactive_alone == alone && flow.is_none_or(|f| r.flow == f)
            })
            .map(|(_, s)| s)
    };
    let p99 = |row: Option<&PolicySummary>| {
        row.and_then(|r| r.teams.get(flow::INTERACTIVE_TEAM))
            .filter(|t| t.requests > t.errors + t.shed + t.rate_limited)
            .map(|t| t.ttft_p99_ms)
    };
    let unanswered = |row: Option<&PolicySummary>| {
        row.and_then(|r| r.teams.get(flow::INTERACTIVE_TEAM))
            .map(|t| t.errors + t.shed + t.rate_limited)
    };
    let over = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    setups
        .into_iter()
        .map(|row| {
            let on = find(&row.setup, Some(FlowMode::On), false);
            let alone_row = find(&row.setup, None, true);
            let off = find(&row.setup, Some(FlowMode::Off), false);
            let alone = p99(alone_row);
            let flow_on = p99(on);
            let flow_off = p99(off);
            IsolationCheck {
                policy: row.policy.clone(),
                setup: row.setup.clone(),
                topology: row.topology.to_string(),
                alone_ttft_p99_ms: alone,
                flow_on_ttft_p99_ms: flow_on,
                flow_off_ttft_p99_ms: flow_off,
                alone_unanswered: unanswered(alone_row),
                flow_on_unanswered: unanswered(on),
                flow_off_unanswered: unanswered(off),
                on_over_alone: over(flow_on, alone),
                off_over_on: over(flow_off, flow_on),
                agents_offered_load: on
                    .and_then(|r| r.teams.get(flow::AGENTS_TEAM))
                    .map(|t| t.offered_load),
            }
        })
        .collect()
}

/// The flow-control setup of a replay with `mode` at `time_scale`.
fn flow_setup(args: &Args, mode: FlowMode, time_scale: f64) -> FlowSetup {
    FlowSetup::new(
        mode,
        args.max_num_seqs,
        args.gateways,
        time_scale,
        args.batch_sheddable,
    )
    .with_interactive_reserve(args.interactive_reserve)
    .with_kv_working_set(args.kv_working_set)
    .with_aging(args.aging.as_secs_f64())
    .with_engine_chunking(
        args.max_num_batched_tokens,
        args.long_prefill_token_threshold,
    )
}

fn validate_args(args: &Args) -> Result<(), String> {
    if args.replicas == 0 {
        return Err("--replicas must be at least 1".into());
    }
    if args.gateways == 0 {
        return Err("--gateways must be at least 1".into());
    }
    if args.store == Some(StoreKind::Memory) && args.redis_url.is_some() {
        return Err("--store memory and --redis-url exclude each other".into());
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
    if args.flow_control.is_empty() {
        return Err("--flow-control needs on, off or on,off".into());
    }
    let modes: BTreeSet<&str> = args.flow_control.iter().map(|m| m.as_str()).collect();
    if modes.len() != args.flow_control.len() {
        return Err("--flow-control lists a setting twice; use on, off or on,off".into());
    }
    if args.max_num_seqs == 0 {
        return Err("--max-num-seqs must be at least 1".into());
    }
    if let Some(factor) = args.mixed_batch_load {
        if !factor.is_finite() || factor <= 0.0 {
            return Err(format!(
                "--mixed-batch-load {factor} is invalid; use a factor above 0 (2 = twice the fleet's request slots)"
            ));
        }
    }
    let scales = std::iter::once(args.effective_time_scale()).chain(args.compare_time_scale);
    for scale in scales {
        if !scale.is_finite() || scale < 0.0 {
            return Err(format!(
                "time scale {scale} is invalid; use a number >= 0 (0.1 = ten times faster than real time)"
            ));
        }
    }
    if args.clock() == ClockMode::Virtual {
        // A Redis server answers on its own clock: the virtual clock would jump while waiting.
        if args.store_kind() == StoreKind::Redis {
            return Err(
                "--clock virtual runs everything in this process, and a Redis store is \
                        outside it: use --clock wall with a Redis store (--gateways above 1, \
                        --redis-url or --store redis), or --store memory"
                    .into(),
            );
        }
        if args.compare_time_scale.is_some() || args.time_scale.is_some() {
            return Err(
                "--time-scale and --compare-time-scale apply to the wall clock; the virtual \
                        clock has no time scale (use --clock wall)"
                    .into(),
            );
        }
    }
    if args.kv_blocks == 0 || args.block_size == 0 {
        return Err("--kv-blocks and --block-size must be at least 1".into());
    }
    if args.duration.is_zero() {
        return Err("--duration must be positive, e.g. 120s".into());
    }
    topology::validate(
        &args.topology,
        &args.pd_threshold,
        args.kill_replica.is_some(),
    )?;
    if let Some(at) = args.kill_replica {
        if at.is_zero() || at >= args.duration {
            return Err(format!(
                "--kill-replica {}s must fall inside the replayed span (0s, {}s)",
                at.as_secs_f64(),
                args.duration.as_secs_f64()
            ));
        }
        let scales = std::iter::once(args.effective_time_scale()).chain(args.compare_time_scale);
        if scales.into_iter().any(|scale| scale <= 0.0) {
            return Err(
                "--kill-replica is a simulated time, which needs a time scale above 0 (e.g. --time-scale 0.2)"
                    .into(),
            );
        }
    }
    Ok(())
}

/// Checks of the options that only some workloads take.
fn validate_workload_args(args: &Args, kind: &WorkloadKind) -> Result<(), String> {
    if *kind != WorkloadKind::Mixed {
        if args.mixed_batch_load.is_some() {
            return Err(format!(
                "--mixed-batch-load applies to --workload mixed, not {kind}"
            ));
        }
        if args.interactive_alone {
            return Err(format!(
                "--interactive-alone applies to --workload mixed, not {kind}"
            ));
        }
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

/// Name of the gateway's one pool.
pub const POOL: &str = "bench";

/// The gateway's name for the endpoint of replica `index` (the gateway names the endpoints of a
/// pool `POOL/INDEX`, in configuration order, and reports it in `x-agentgate-endpoint`).
pub fn endpoint_name(index: usize) -> String {
    format!("{POOL}/{index}")
}

/// The replica index of an endpoint name, if it is one of ours.
pub fn replica_of(endpoint: &str) -> Option<usize> {
    endpoint
        .strip_prefix(POOL)
        .and_then(|rest| rest.strip_prefix('/'))
        .and_then(|index| index.parse().ok())
}

/// The gateway configuration for one replay: one pool over `endpoints` with `policy`, the
/// `store`, and flow control as `flow` says; with several teams, one API key per team (so the
/// gateway sees who sends what) and the bands of [`flow`].
pub fn gateway_config(
    policy: &str,
    endpoints: &[String],
    teams: &[String],
    store: &StoreTarget,
    flow: &FlowSetup,
) -> Result<agentgate::Config, String> {
    let quoted: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
    let mut text = format!(
        "{}{}[upstream]\nfirst_byte_timeout_s = 3600.0\nidle_timeout_s = 3600.0\n\n\
         [[pools]]\nname = \"{POOL}\"\nmodel = \"{MODEL}\"\nflavor = \"vllm\"\npolicy = \"{policy}\"\n\
         prefix_bytes_per_token = {SIM_BYTES_PER_TOKEN}\nendpoints = [{}]\n",
        store.toml(),
        flow.toml(),
        quoted.join(", ")
    );
    if teams.len() > 1 {
        if flow.enabled {
            // the engines order their own queues by band too
            text.push_str("engine_priority = true\n");
        }
        // a reserve only where a team runs in the interactive band: unused, it would only hold
        // slots back from the others
        let interactive = teams
            .iter()
            .any(|t| flow::band_of(t) == flow::INTERACTIVE_BAND);
        let reserve = if interactive {
            flow.interactive_reserve
        } else {
            0.0
        };
        text.push_str(&flow.clone().with_interactive_reserve(reserve).bands_toml());
        for team in teams {
            text.push_str(&format!(
                "\n[[teams]]\nname = \"{team}\"\napi_key_sha256 = [\"{}\"]\ndefault_band = \"{}\"\n",
                agentgate::auth::hash_key(&team_key(team)),
                flow::band_of(team)
            ));
        }
    }
    agentgate::Config::parse(&text).map_err(|e| {
        format!("policy `{policy}` cannot be used: the gateway rejects its configuration: {e}")
    })
}

/// The band each team's requests run in, as configured: the bench's bands with several teams,
/// the gateway's implicit band with one. With flow control off no band applies, but the rows
/// still report their requests by the band they would run in, so the two compare band by band.
pub fn team_bands(teams: &[String]) -> std::collections::BTreeMap<String, String> {
    teams
        .iter()
        .map(|team| {
            let band = if teams.len() > 1 {
                flow::band_of(team)
            } else {
                agentgate::config::IMPLICIT_BAND
            };
            (team.clone(), band.to_string())
        })
        .collect()
}

/// Distinct team names of a workload, sorted.
fn teams_of(workload: &Workload) -> Vec<String> {
    let set: BTreeSet<&str> = workload.sessions.iter().map(|s| s.team.as_str()).collect();
    set.into_iter().map(str::to_string).collect()
}

/// One row: fresh replicas of its layout (behind relays when one is to be killed), the
/// gateways, the replay (with the kill, if any), the final scrape and the oracle. `teams` are
/// the whole workload's, so a row replaying one team's sessions runs under the same
/// configuration.
async fn run_row(
    args: &Args,
    row: &Row,
    workload: &Arc<Workload>,
    teams: &[String],
    store: &SharedStore,
    time_scale: f64,
    show_progress: bool,
) -> Result<PolicyRun, String> {
    let policy = row.policy.as_str();
    if args.clock() == ClockMode::Virtual {
        // Every task runs on this thread: each row draws the same random choices, whatever the
        // rows before it drew.
        fastrand::seed(args.seed);
    }
    let roles = row.roles(args.replicas);
    let mut sims = Vec::with_capacity(roles.len());
    for (index, role) in roles.iter().enumerate() {
        let config = agentgate_sim::SimConfig {
            role: *role,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: MODEL.to_string(),
            time_scale,
            kv_blocks: args.kv_blocks,
            block_size: args.block_size,
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            long_prefill_token_threshold: args.long_prefill_token_threshold,
            // requests without a `priority` (no bands) all have 0: arrival order
            scheduling_policy: agentgate_sim::config::SchedulingPolicyArg::Priority,
            default_output_tokens: DEFAULT_OUTPUT_TOKENS,
            seed: Some(args.seed),
            socket_buffer_bytes: socket_buffer_bytes(args.clock()),
            ..agentgate_sim::SimConfig::default()
        };
        let sim = agentgate_sim::spawn(config)
            .await
            .map_err(|e| format!("cannot start simulated replica {index}: {e}"))?;
        sims.push(Some(sim));
    }
    let urls: Vec<String> = sims.iter().flatten().map(|s| s.base_url()).collect();
    let kill_at = args.kill_replica.map(|at| at.as_secs_f64());
    // Every replica gets a relay when one is to be killed, so all pay the same extra hop.
    let mut relays: Vec<Option<Relay>> = Vec::new();
    if kill_at.is_some() {
        for (index, sim) in sims.iter().flatten().enumerate() {
            let relay = Relay::start(sim.addr(), socket_buffer_bytes(args.clock()))
                .await
                .map_err(|e| format!("cannot start the relay of replica {index}: {e}"))?;
            relays.push(Some(relay));
        }
    }
    let targets: Vec<String> = if relays.is_empty() {
        urls.clone()
    } else {
        relays.iter().flatten().map(Relay::base_url).collect()
    };
    let flow_setup = flow_setup(args, row.flow, time_scale);
    let mut config = gateway_config(
        policy,
        &targets,
        teams,
        &store.for_replay(policy),
        &flow_setup,
    )?;
    config.server.socket_buffer_bytes = socket_buffer_bytes(args.clock());
    // The blocking pool finishes parses in real-time order: on the virtual clock every body is
    // parsed on its request's task, so concurrent large prompts are routed in arrival order.
    if args.clock() == ClockMode::Virtual {
        config.server.parse_inline_bytes = usize::MAX;
    }
    let threshold = topology::configure(&mut config, &roles, row.threshold)?;
    let shared_memory = (args.gateways > 1 && args.store_kind() == StoreKind::Memory).then(|| {
        Arc::new(agentgate_sessions::AnyStore::shared_in_process(
            config.store_options(),
        ))
    });
    let mut gateways = Vec::with_capacity(args.gateways);
    for index in 0..args.gateways {
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let gateway = match &shared_memory {
            Some(store) => {
                agentgate::Gateway::start_with_store(config.clone(), listen, Arc::clone(store))
                    .await
            }
            None => agentgate::Gateway::start(config.clone(), listen).await,
        }
        .map_err(|e| format!("cannot start gateway {index} for policy `{policy}`: {e}"))?;
        gateways.push(gateway);
    }

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let clock = SimClock::start(time_scale);
    let sampler = metrics::Sampler::start(client.clone(), urls.clone(), clock);
    let saturation = (row.flow == FlowMode::On).then(|| {
        let states = gateways.iter().map(|g| Arc::clone(g.state())).collect();
        SaturationSampler::start(states, POOL, clock)
    });
    let keys = if teams.len() > 1 {
        teams.iter().map(|t| (t.clone(), team_key(t))).collect()
    } else {
        Default::default()
    };
    let replay_config = replay::ReplayConfig {
        urls: gateways
            .iter()
            .map(|g| format!("{}/v1/responses", g.base_url()))
            .collect(),
        model: MODEL.to_string(),
        duration_s: args.duration.as_secs_f64(),
        drain_s: drain_limit_s(args.duration.as_secs_f64()),
        max_output_tokens: MAX_OUTPUT_TOKENS,
        keys,
    };
    let capacity = args.kv_blocks.saturating_mul(roles.len());
    // With a kill, the windows after it compare against the capacity of the replicas left.
    let survivors = kill_at.map(|_| args.kv_blocks.saturating_mul(roles.len().saturating_sub(1)));
    let reuse = reuse::ReuseFeed::start(args.block_size, capacity, survivors)
        .map_err(|e| format!("cannot start the reuse oracle: {e}"))?;
    let killer = match kill_at {
        Some(at) => {
            let relay = relays.get_mut(KILLED_REPLICA).and_then(Option::take);
            let sim = sims.get_mut(KILLED_REPLICA).and_then(Option::take);
            match (relay, sim) {
                (Some(relay), Some(sim)) => {
                    Some(Killer::start(clock, at, relay, sim, client.clone()))
                }
                _ => return Err(format!("there is no replica {KILLED_REPLICA} to kill")),
            }
        }
        None => None,
    };
    let started = Instant::now();
    let progress = progress::Progress::start(&row.label, show_progress);
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
    let mut kill_event = None;
    let mut killed_metrics = None;
    if let Some(killer) = killer {
        match killer.finish().await {
            Some(KillOutcome::Killed { event, metrics }) => {
                kill_event = Some(event);
                killed_metrics = Some(metrics);
            }
            Some(KillOutcome::NotReached { relay, sim }) => {
                if let Some(slot) = relays.get_mut(KILLED_REPLICA) {
                    *slot = Some(relay);
                }
                if let Some(slot) = sims.get_mut(KILLED_REPLICA) {
                    *slot = Some(sim);
                }
            }
            None => {}
        }
    }
    let samples = sampler.stop().await;
    let saturation = match saturation {
        Some(sampler) => sampler.stop().await,
        None => Vec::new(),
    };
    // A replica that is gone contributes its counters as of the kill.
    let mut replicas = Vec::with_capacity(urls.len());
    for (sim, url) in sims.iter().zip(&urls) {
        match sim {
            Some(_) => replicas.push(metrics::scrape(&client, url).await?),
            None => replicas.push(killed_metrics.unwrap_or_default()),
        }
    }
    let engine = metrics::fleet_totals(replicas);
    let pd_counters = if row.topology.is_pd() {
        let bases: Vec<String> = gateways.iter().map(|g| g.base_url()).collect();
        Some(pd::scrape_gateways(&client, &bases).await)
    } else {
        None
    };
    for gateway in gateways {
        gateway.shutdown().await;
    }
    for sim in sims.into_iter().flatten() {
        sim.shutdown().await;
    }
    drop(relays);
    let pd_counters = pd_counters.transpose()?;

    let mut records = outcome.records;
    records.sort_by_key(|r| r.seq);
    let oracle = tokio::task::spawn_blocking(move || reuse.finish())
        .await
        .map_err(|e| format!("the reuse oracle failed: {e}"))??;
    let team_bands = team_bands(teams);
    let mut summary = PolicySummary::build(summary::BuildInput {
        row: &row.label,
        policy,
        flow_control: row.flow.as_str(),
        traffic: row.traffic(),
        team_bands: &team_bands,
        saturation: &saturation,
        duration_s: args.duration.as_secs_f64(),
        request_slots: rows::request_slots(&roles, args.max_num_seqs),
        time_scale,
        records: &records,
        available: &oracle.available,
        infinite: &oracle.infinite,
        distinct_prompt_blocks: oracle.distinct_prompt_blocks,
        block_size: args.block_size,
        engine: &engine,
        gateways: args.gateways,
        replicas: roles.len(),
        wall_s,
    });
    summary.topology = row.topology.to_string();
    summary.replica_mean_load = metrics::mean_load(&samples, roles.len());
    if let Some(counters) = pd_counters {
        let input = pd::PdInput {
            roles: &roles,
            engine: &engine,
            samples: &samples,
            counters,
            threshold_tokens: threshold,
            time_scale,
        };
        pd::finish(&mut summary, input);
    }
    summary.kill = kill_at.map(|at| {
        kill::summarize(
            &records,
            &oracle.per_request,
            at,
            KILLED_REPLICA,
            &endpoint_name(KILLED_REPLICA),
            kill_event,
        )
    });
    Ok(PolicyRun {
        summary,
        records,
        samples,
        oracle: oracle.per_request,
    })
}

/// How long in-flight requests may run past `--duration` (simulated seconds) before they are cut
/// and counted as errors.
pub fn drain_limit_s(duration_s: f64) -> f64 {
    duration_s.max(120.0)
}

/// Write `text` to `out/name`.
fn write_file(out: &std::path::Path, name: &str, text: String) -> Result<(), String> {
    let path = out.join(name);
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Write `value` as pretty JSON (and a final newline) to `out/name`.
fn write_json(
    out: &std::path::Path,
    name: &str,
    value: &impl serde::Serialize,
) -> Result<(), String> {
    let json =
        serde_json::to_string_pretty(value).map_err(|e| format!("cannot encode {name}: {e}"))?;
    write_file(out, name, json + "\n")
}

fn write_outputs(
    out: &std::path::Path,
    summary: &RunSummary,
    runs: &[PolicyRun],
) -> Result<(), String> {
    let write = |name: &str, text: String| write_file(out, name, text);
    write_json(out, "summary.json", summary)?;
    write("report.md", report::render(summary))?;
    write("ttft_cdf.svg", svg::ttft_cdf(runs))?;
    write("cache_hit_ratio.svg", svg::cache_hit_over_time(runs))?;
    write("replica_load.svg", svg::replica_load(runs))?;
    write("requests.jsonl", request_lines(runs))?;
    Ok(())
}

/// `requests.jsonl`: one line per request of every row, in send order, with what the client saw
/// (endpoint, route reason, tokens, latencies) beside what the fleet-capacity oracle found
/// cached, for tracing a summary figure back to the requests behind it.
fn request_lines(runs: &[PolicyRun]) -> String {
    let mut text = String::new();
    for run in runs {
        let oracle: std::collections::HashMap<u64, u64> = run
            .oracle
            .iter()
            .map(|hit| (hit.seq, hit.hit_tokens))
            .collect();
        for record in &run.records {
            let (outcome, detail) = match &record.outcome {
                replay::Outcome::Success => ("success", None),
                replay::Outcome::Shed(code) => ("shed", Some(code.as_str())),
                replay::Outcome::RateLimited(code) => ("rate_limited", Some(code.as_str())),
                replay::Outcome::Error(message) => ("error", Some(message.as_str())),
            };
            let line = serde_json::json!({
                "row": run.summary.row,
                "seq": record.seq,
                "session": record.session,
                "turn": record.turn,
                "continuing": record.continuing,
                "gateway": record.gateway,
                "team": record.team,
                "band": record.band,
                "endpoint": record.endpoint,
                "route_reason": record.route_reason,
                "pin_moved": record.pin_moved,
                "outcome": outcome,
                "detail": detail,
                "sent_s": record.sent_s,
                "queue_wait_ms": record.queue_wait_ms,
                "ttft_ms": record.ttft_ms,
                "e2e_ms": record.e2e_ms,
                "input_tokens": record.input_tokens,
                "cached_tokens": record.cached_tokens,
                "oracle_cached_tokens": oracle.get(&record.seq),
                "output_tokens": record.output_tokens,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> FlowSetup {
        FlowSetup::new(FlowMode::On, 8, 1, 0.5, false).with_interactive_reserve(0.25)
    }

    #[test]
    fn baseline_policies_configure_and_unknown_ones_fail_clearly() {
        let urls = ["http://127.0.0.1:1".to_string()];
        let memory = StoreTarget::Memory;
        assert!(gateway_config("round_robin", &urls, &[], &memory, &on()).is_ok());
        let teams = ["agents".to_string(), "interactive".to_string()];
        let config = gateway_config("least_loaded", &urls, &teams, &memory, &on()).unwrap();
        assert_eq!(config.teams.len(), 2);
        assert_eq!(config.store.url, None);
        let message = gateway_config("no_such_policy", &urls, &[], &memory, &on()).unwrap_err();
        assert!(message.contains("no_such_policy"), "{message}");
        assert!(message.contains("pools[0].policy"), "{message}");
    }

    #[test]
    fn teams_get_their_bands_keys_and_the_engines_batch_as_cap() {
        let urls = ["http://127.0.0.1:1".to_string()];
        let teams = ["agents".to_string(), "interactive".to_string()];
        let memory = StoreTarget::Memory;
        let config = gateway_config("session", &urls, &teams, &memory, &on()).unwrap();
        assert!(config.flow.enabled);
        assert_eq!(config.flow.max_in_flight_per_endpoint, 8);
        assert_eq!(config.routing.scrape_interval_ms, 500);
        let bands: Vec<(&str, i32, u64)> = config
            .bands
            .iter()
            .map(|b| (b.name.as_str(), b.priority, b.queue_ttl_ms))
            .collect();
        assert_eq!(
            bands,
            [("interactive", 100, 30_000), ("batch", 10, 300_000)]
        );
        assert!(config.bands.iter().all(|b| !b.sheddable));
        let reserves: Vec<f64> = config.bands.iter().map(|b| b.reserve).collect();
        assert_eq!(reserves, [0.25, 0.0]);
        assert!(
            config.pools[0].engine_priority,
            "flow on: band priorities go to the engines"
        );
        // no team in the interactive band: it reserves nothing
        let batch_only = ["light".to_string(), "heavy".to_string()];
        let fair = gateway_config("session", &urls, &batch_only, &memory, &on()).unwrap();
        assert!(fair.bands.iter().all(|b| b.reserve == 0.0));
        let flow = config.flow_config();
        let band_of = |team: &str| {
            flow.teams
                .iter()
                .find(|t| t.name == team)
                .map(|t| t.default_band.clone())
        };
        assert_eq!(band_of("interactive").as_deref(), Some("interactive"));
        assert_eq!(band_of("agents").as_deref(), Some("batch"));
        // Each team is known by its own key.
        for team in &teams {
            let digest = agentgate::auth::hash_key(&team_key(team));
            let owner = config
                .teams
                .iter()
                .find(|t| t.api_key_sha256.contains(&digest));
            assert_eq!(owner.map(|t| t.name.as_str()), Some(team.as_str()));
        }
        // Off: the same configuration with flow control disabled.
        let off = FlowSetup::new(FlowMode::Off, 8, 1, 0.5, false);
        let config = gateway_config("session", &urls, &teams, &memory, &off).unwrap();
        assert!(!config.flow.enabled);
        assert_eq!(config.bands.len(), 2);
        // One team: the gateway runs open with its implicit band.
        let single = gateway_config("session", &urls, &["default".to_string()], &memory, &on());
        assert!(single.unwrap().bands.is_empty());
        assert_eq!(team_bands(&["default".to_string()])["default"], "default");
        assert_eq!(team_bands(&teams)["agents"], "batch");
    }

    #[test]
    fn shared_store_goes_into_every_gateways_configuration() {
        let urls = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".to_string(),
        ];
        let redis = StoreTarget::Redis {
            url: "redis://127.0.0.1:6390/0".into(),
            key_prefix: "agentgate-bench:test:".into(),
        };
        let config = gateway_config("session", &urls, &[], &redis, &on()).unwrap();
        assert_eq!(
            config.store.url.as_deref(),
            Some("redis://127.0.0.1:6390/0")
        );
        assert_eq!(config.store.key_prefix, "agentgate-bench:test:");
        let bad = StoreTarget::Redis {
            url: "http://127.0.0.1:6390".into(),
            key_prefix: "p:".into(),
        };
        let message = gateway_config("session", &urls, &[], &bad, &on()).unwrap_err();
        assert!(message.contains("store.url"), "{message}");
    }

    #[test]
    fn endpoint_names_round_trip() {
        assert_eq!(endpoint_name(3), "bench/3");
        assert_eq!(replica_of(&endpoint_name(3)), Some(3));
        assert_eq!(replica_of("bench/"), None);
        assert_eq!(replica_of("benchy/1"), None);
        assert_eq!(replica_of("other/1"), None);
    }

    pub(crate) fn args() -> Args {
        Args {
            workload: "agentic".into(),
            replicas: 2,
            gateways: 1,
            store: None,
            redis_url: None,
            kill_replica: None,
            policies: vec!["session".into()],
            flow_control: vec![FlowMode::On],
            max_num_seqs: 64,
            max_num_batched_tokens: 8192,
            long_prefill_token_threshold: 0,
            interactive_reserve: 0.25,
            kv_working_set: 0.6,
            aging: Duration::from_secs(10),
            mixed_batch_load: None,
            interactive_alone: false,
            batch_sheddable: false,
            sessions: 3,
            duration: Duration::from_secs(60),
            time_scale: Some(0.1),
            kv_blocks: 1024,
            block_size: 16,
            seed: 1,
            seeds: None,
            compare_time_scale: None,
            clock: None,
            out: PathBuf::from("unused"),
            topology: vec![Topology::Agg],
            pd_threshold: Vec::new(),
        }
    }

    #[test]
    fn seed_lists_come_from_the_command_line_and_exclude_one_seed() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |extra: &[&str]| {
            let base = ["bench", "--workload", "agentic", "--out", "o"];
            Cli::try_parse_from(base.iter().chain(extra)).map(|cli| cli.args)
        };
        let listed = parse(&["--seeds", "3-5,9"]).expect("a seed list");
        assert_eq!(listed.seeds, Some(SeedList(vec![3, 4, 5, 9])));
        assert_eq!(parse(&[]).expect("defaults").seeds, None);
        let both = parse(&["--seed", "2", "--seeds", "1-3"]).unwrap_err();
        assert_eq!(both.kind(), clap::error::ErrorKind::ArgumentConflict);
        let bad = parse(&["--seeds", "5-1"]).unwrap_err().to_string();
        assert!(bad.contains("backwards"), "{bad}");
    }

    #[test]
    fn gateways_and_kill_time_are_validated() {
        assert!(validate_args(&args()).is_ok());
        let zero = Args {
            gateways: 0,
            ..args()
        };
        assert!(validate_args(&zero).unwrap_err().contains("--gateways"));
        let inside = Args {
            kill_replica: Some(Duration::from_secs(30)),
            ..args()
        };
        assert!(validate_args(&inside).is_ok());
        for at in [0, 60, 90] {
            let outside = Args {
                kill_replica: Some(Duration::from_secs(at)),
                ..args()
            };
            let message = validate_args(&outside).unwrap_err();
            assert!(message.contains("--kill-replica"), "{message}");
        }
        let instant = Args {
            time_scale: Some(0.0),
            ..inside.clone()
        };
        assert!(validate_args(&instant).unwrap_err().contains("time scale"));
        let compare_instant = Args {
            compare_time_scale: Some(0.0),
            ..inside
        };
        assert!(validate_args(&compare_instant).is_err());
    }

    #[test]
    fn flow_options_are_validated() {
        let twice = Args {
            flow_control: vec![FlowMode::Off, FlowMode::Off],
            ..args()
        };
        assert!(validate_args(&twice)
            .unwrap_err()
            .contains("--flow-control"));
        let none = Args {
            flow_control: Vec::new(),
            ..args()
        };
        assert!(validate_args(&none).is_err());
        let seqs = Args {
            max_num_seqs: 0,
            ..args()
        };
        assert!(validate_args(&seqs).unwrap_err().contains("--max-num-seqs"));
        for factor in [0.0, -1.0, f64::NAN] {
            let load = Args {
                mixed_batch_load: Some(factor),
                ..args()
            };
            assert!(validate_args(&load)
                .unwrap_err()
                .contains("--mixed-batch-load"));
        }
        let load = Args {
            mixed_batch_load: Some(2.0),
            max_num_seqs: 8,
            ..args()
        };
        assert!(validate_args(&load).is_ok());
        // 2 x 2 replicas x 8 sequences.
        assert_eq!(batch_sessions(&load), Some(32));
        let message = validate_workload_args(&load, &WorkloadKind::Agentic).unwrap_err();
        assert!(message.contains("--mixed-batch-load"), "{message}");
        assert!(validate_workload_args(&load, &WorkloadKind::Mixed).is_ok());
        let alone = Args {
            interactive_alone: true,
            ..args()
        };
        let message = validate_workload_args(&alone, &WorkloadKind::Fairness).unwrap_err();
        assert!(message.contains("--interactive-alone"), "{message}");
    }
}
