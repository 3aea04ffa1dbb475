//! End to end: `agentgate-bench run` on a tiny agentic workload against two baseline policies
//! (in-process replicas and gateway, time scale 0), checking that summary.json is complete and
//! consistent and that the report and charts are written; that an unavailable policy fails
//! before anything runs; that two gateways sharing one Redis serve a session policy run whose
//! turns alternate between them; that killing a replica mid-run is accounted for; that a
//! prefill/decode topology with a threshold sweep runs next to the aggregated baseline, with
//! some requests disaggregated and every replica's work accounted for; that the flow-control
//! sections (bands, teams, turn kinds, the interactive team's isolation, fairness between two
//! teams of one band) exist and add up; that layouts, flow settings and the interactive team
//! alone combine into one set of rows; and that a seed list replays each seed as its own run
//! would and sets the figures side by side.

use std::path::PathBuf;
use std::time::Duration;

use agentgate_bench::run::flow::{FlowMode, MatchedWaits};
use agentgate_bench::run::summary::PolicySummary;
use agentgate_bench::run::topology::Topology;
use agentgate_bench::run::{execute, execute_seeds, seeds, Args, ClockMode, StoreKind};
use agentgate_sessions::testing::TestRedis;
use serde_json::Value;

/// Replays at a time scale above 0 follow wall time (a queue forms, a kill lands mid-run) and
/// need the cores to keep up with it; replays at time scale 0 run flat out and would starve
/// them. The former hold this lock exclusively, the latter share it.
static CORES: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("agentgate-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tiny_args(policies: &[&str], out: PathBuf) -> Args {
    Args {
        workload: "agentic".into(),
        replicas: 2,
        gateways: 1,
        store: None,
        redis_url: None,
        kill_replica: None,
        policies: policies.iter().map(|p| p.to_string()).collect(),
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
        duration: Duration::from_secs(3),
        time_scale: Some(0.0),
        kv_blocks: 65_536,
        block_size: 16,
        seed: 7,
        seeds: None,
        compare_time_scale: None,
        clock: None,
        out,
        topology: vec![Topology::Agg],
        pd_threshold: Vec::new(),
    }
}

const FIELDS: &[&str] = &[
    "policy",
    "requests",
    "errors",
    "shed",
    "prompt_tokens",
    "cached_tokens",
    "cache_hit_ratio",
    "available_reuse_ratio",
    "infinite_reuse_ratio",
    "captured_reuse",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "output_tokens_per_s",
    "prefill_tokens_computed",
    "gpu_seconds_per_million_tokens",
    "no_eviction_kv_blocks",
    "requests_per_gateway",
    "requests_per_replica",
    "teams",
];

fn u(policy: &Value, key: &str) -> u64 {
    policy[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an integer: {policy}"))
}

fn f(policy: &Value, key: &str) -> f64 {
    policy[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number: {policy}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_agentic_run_writes_a_complete_consistent_summary() {
    let _cores = CORES.read().await;
    let out = out_dir("smoke");
    let args = tiny_args(&["round_robin", "least_loaded"], out.clone());
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    assert_eq!(summary.policies.len(), 2);

    let text = std::fs::read_to_string(out.join("summary.json")).expect("summary.json written");
    let json: Value = serde_json::from_str(&text).expect("summary.json is JSON");
    let policies = json["policies"].as_array().expect("policies array");
    let names: Vec<&str> = policies
        .iter()
        .filter_map(|p| p["policy"].as_str())
        .collect();
    assert_eq!(names, ["round_robin", "least_loaded"]);
    for policy in policies {
        for field in FIELDS {
            assert!(policy.get(field).is_some(), "{field} missing: {policy}");
        }
        let requests = u(policy, "requests");
        assert!(requests > 0, "no request was sent: {policy}");
        assert_eq!(
            requests,
            u(policy, "successes") + u(policy, "errors") + u(policy, "shed"),
            "requests = successes + errors + shed"
        );
        assert!(u(policy, "successes") > 0, "nothing succeeded: {policy}");
        let prompt = u(policy, "prompt_tokens");
        let cached = u(policy, "cached_tokens");
        assert!(prompt > 0 && cached <= prompt, "cached <= prompt: {policy}");
        assert_eq!(
            u(policy, "oracle_prompt_tokens"),
            prompt,
            "the oracle replays exactly the prompts the engines saw"
        );
        for ratio in [
            "cache_hit_ratio",
            "available_reuse_ratio",
            "infinite_reuse_ratio",
        ] {
            let value = f(policy, ratio);
            assert!((0.0..=1.0).contains(&value), "{ratio} = {value}");
        }
        assert!(f(policy, "available_reuse_ratio") <= f(policy, "infinite_reuse_ratio") + 1e-12);
        assert!(f(policy, "captured_reuse") >= 0.0);
        assert!(f(policy, "ttft_p50_ms") <= f(policy, "ttft_p90_ms"));
        assert!(f(policy, "ttft_p90_ms") <= f(policy, "ttft_p99_ms"));
        assert!(f(policy, "e2e_p50_ms") <= f(policy, "e2e_p99_ms"));
        assert!(f(policy, "output_tokens_per_s") > 0.0);
        assert!(u(policy, "prefill_tokens_computed") <= u(&policy["engine"], "prompt_tokens"));
        assert!(u(policy, "no_eviction_kv_blocks") > 0);
        assert!(
            u(policy, "no_eviction_kv_blocks") < args.kv_blocks as u64,
            "a tiny run fits in the replicas' caches: {policy}"
        );
        let teams = policy["teams"].as_object().expect("teams object");
        let team_requests: u64 = teams.values().map(|t| u(t, "requests")).sum();
        assert_eq!(team_requests, requests, "teams partition the requests");
    }

    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("| round_robin |") && report.contains("| least_loaded |"));
    assert!(
        report.contains("agentgate-bench run (test)"),
        "command line in the report"
    );
    assert!(
        report.contains("No replica can have evicted anything"),
        "eviction check in the report"
    );
    for chart in ["ttft_cdf.svg", "cache_hit_ratio.svg", "replica_load.svg"] {
        let svg = std::fs::read_to_string(out.join(chart)).expect("chart written");
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{chart}"
        );
        assert!(
            svg.contains("round_robin") && svg.contains("least_loaded"),
            "{chart} legend"
        );
    }
    // requests.jsonl adds up to the summary, row by row.
    let lines = std::fs::read_to_string(out.join("requests.jsonl")).expect("requests.jsonl");
    let records: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    for policy in policies {
        let row = policy["row"].as_str().expect("row label");
        let mine: Vec<&Value> = records.iter().filter(|r| r["row"] == row).collect();
        assert_eq!(
            mine.len() as u64,
            u(policy, "requests"),
            "{row}: one line a request"
        );
        let served: Vec<&&Value> = mine.iter().filter(|r| r["outcome"] == "success").collect();
        assert_eq!(served.len() as u64, u(policy, "successes"));
        let sum = |key: &str| served.iter().map(|r| u(r, key)).sum::<u64>();
        assert_eq!(sum("input_tokens"), u(policy, "prompt_tokens"));
        assert_eq!(sum("cached_tokens"), u(policy, "cached_tokens"));
        let oracle_hits = sum("oracle_cached_tokens") as f64;
        let oracle_ratio = oracle_hits / u(policy, "prompt_tokens") as f64;
        assert!(
            (oracle_ratio - f(policy, "available_reuse_ratio")).abs() < 1e-9,
            "{row}: per-request oracle hits add up to the available reuse"
        );
        assert!(served.iter().all(|r| r["endpoint"]
            .as_str()
            .is_some_and(|e| e.starts_with("bench/"))
            && r["route_reason"].is_string()));
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[tokio::test]
async fn an_unavailable_policy_fails_clearly_before_running() {
    let out = out_dir("unknown_policy");
    let args = tiny_args(&["round_robin", "fastest"], out.clone());
    let message = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect_err("fastest is not a gateway policy");
    assert!(message.contains("fastest"), "{message}");
    assert!(message.contains("policy"), "{message}");
    assert!(!out.join("summary.json").exists(), "nothing ran");
}

/// On the virtual clock only simulated engine time passes: a cold first prompt, alone on its
/// replica, gets its first token after exactly its prefill at the simulator's speed (on the
/// wall clock at time scale 0 it would take no simulated time at all), and the summary and the
/// report say which clock ran. It is the default; a time scale or a Redis store selects the wall
/// clock, and a virtual run that asks for either is refused.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn the_virtual_clock_measures_simulated_engine_time_only() {
    let _cores = CORES.read().await;
    let out = out_dir("virtual");
    let mut args = tiny_args(&["round_robin"], out.clone());
    args.time_scale = None;
    args.duration = Duration::from_secs(30);
    assert_eq!(args.clock(), ClockMode::Virtual, "the default");
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    assert_consistent(&summary.policies[0]);
    assert_eq!(summary.clock, "virtual");
    assert_eq!(summary.time_scale, 1.0);

    let lines = std::fs::read_to_string(out.join("requests.jsonl")).expect("requests.jsonl");
    let first: Value = lines
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a JSON record"))
        .min_by(|a, b| f(a, "sent_s").total_cmp(&f(b, "sent_s")))
        .expect("a request");
    assert_eq!(u(&first, "cached_tokens"), 0, "{first}");
    let speed = agentgate_sim::SimConfig::default().prefill_tokens_per_s;
    let prefill_ms = u(&first, "input_tokens") as f64 / speed * 1000.0;
    let ttft = f(&first, "ttft_ms");
    // Engine steps end on whole milliseconds: one of rounding per step at most.
    let steps = (u(&first, "input_tokens") as f64 / args.max_num_batched_tokens as f64).ceil();
    assert!(
        ttft >= prefill_ms - 1.0 && ttft <= prefill_ms + steps + 1.0,
        "TTFT {ttft} ms for a cold prompt of {} prefill ms: {first}",
        prefill_ms
    );
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("on the virtual clock"), "{report}");

    let mut shared = tiny_args(&["round_robin"], out_dir("virtual_redis"));
    shared.time_scale = None;
    shared.gateways = 2;
    assert_eq!(
        shared.clock(),
        ClockMode::Wall,
        "Redis needs the wall clock"
    );
    shared.clock = Some(ClockMode::Virtual);
    let message = execute(&shared, "agentgate-bench run (test)", false)
        .await
        .expect_err("a virtual run cannot wait on Redis");
    assert!(message.contains("--clock wall"), "{message}");
    let mut scaled = tiny_args(&["round_robin"], out_dir("virtual_scaled"));
    assert_eq!(
        scaled.clock(),
        ClockMode::Wall,
        "a time scale selects the wall clock"
    );
    scaled.clock = Some(ClockMode::Virtual);
    let message = execute(&scaled, "agentgate-bench run (test)", false)
        .await
        .expect_err("the virtual clock has no time scale");
    assert!(message.contains("--time-scale"), "{message}");
}

/// Both gateways served, and nothing failed: chained turns continue a response the other
/// gateway stored, which fails without a shared store.
fn assert_two_gateways_served_as_one(policy: &PolicySummary) {
    assert_consistent(policy);
    assert_eq!(
        (policy.errors, policy.shed),
        (0, 0),
        "{:?}",
        policy.first_error
    );
    assert_eq!(policy.requests_per_gateway.len(), 2);
    assert!(
        policy.requests_per_gateway.iter().all(|&n| n > 0),
        "both gateways served: {:?}",
        policy.requests_per_gateway
    );
}

/// requests = successes + errors + shed, and the gateways' and replicas' counts add up.
fn assert_consistent(policy: &PolicySummary) {
    assert!(policy.requests > 0, "no request was sent: {policy:?}");
    assert_eq!(
        policy.requests,
        policy.successes + policy.errors + policy.shed,
        "requests = successes + errors + shed: {policy:?}"
    );
    assert_eq!(
        policy.requests_per_gateway.iter().sum::<u64>(),
        policy.requests,
        "every request went to one gateway"
    );
    assert!(
        policy.requests_per_replica.iter().sum::<u64>() >= policy.successes,
        "every success names the replica that served it: {:?}",
        policy.requests_per_replica
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sharing_one_redis_serve_alternating_turns() {
    let redis = TestRedis::start();
    let _cores = CORES.read().await;
    let out = out_dir("gateways");
    let args = Args {
        gateways: 2,
        redis_url: Some(redis.url().to_string()),
        ..tiny_args(&["session"], out.clone())
    };
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    assert_eq!((summary.gateways, summary.store.as_str()), (2, "redis"));
    let policy = &summary.policies[0];
    assert_two_gateways_served_as_one(policy);
    assert!(policy.cached_tokens > 0, "later turns reuse the cache");

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    assert_eq!(json["gateways"], 2);
    assert_eq!(json["store"], "redis");
    assert!(
        json["policies"][0].get("kill").is_none(),
        "no kill requested"
    );
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(
        report.contains("(s + t) mod 2"),
        "assignment rule in the report"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Per request of `out/requests.jsonl`, in send order: (row, session, turn, endpoint, TTFT,
/// cached tokens), what two runs of one seed on the virtual clock must agree on.
fn request_timings(out: &std::path::Path) -> Vec<(String, u64, u64, String, f64, u64)> {
    let lines = std::fs::read_to_string(out.join("requests.jsonl")).expect("records");
    lines
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a JSON record"))
        .map(|r| {
            let text = |key: &str| r[key].as_str().unwrap_or_default().to_string();
            (
                text("row"),
                u(&r, "session"),
                u(&r, "turn"),
                text("endpoint"),
                f(&r, "ttft_ms"),
                u(&r, "cached_tokens"),
            )
        })
        .collect()
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn two_gateways_on_one_memory_store_follow_the_virtual_clock_and_repeat_a_run() {
    let _cores = CORES.read().await;
    let run = |name: &str| {
        let mut args = tiny_args(&["session"], out_dir(name));
        args.time_scale = None;
        args.duration = Duration::from_secs(30);
        args.sessions = 6;
        args.gateways = 2;
        args.store = Some(StoreKind::Memory);
        args
    };
    let (first, second) = (run("gateways_memory_a"), run("gateways_memory_b"));
    assert_eq!(first.clock(), ClockMode::Virtual, "no Redis to wait on");
    let mut records = Vec::new();
    for args in [&first, &second] {
        let summary = execute(args, "agentgate-bench run (test)", false)
            .await
            .expect("the run succeeds");
        assert_eq!(
            (
                summary.gateways,
                summary.store.as_str(),
                summary.clock.as_str()
            ),
            (2, "memory", "virtual")
        );
        assert_two_gateways_served_as_one(&summary.policies[0]);
        records.push(request_timings(&args.out));
        let _ = std::fs::remove_dir_all(&args.out);
    }
    assert_eq!(
        records[0], records[1],
        "same seed, same run, request for request"
    );

    let mut both = run("gateways_memory_redis");
    both.redis_url = Some("redis://127.0.0.1:1/0".into());
    let message = execute(&both, "agentgate-bench run (test)", false)
        .await
        .expect_err("one store or the other");
    assert!(message.contains("exclude each other"), "{message}");
}

/// Twelve prompts of 64k tokens (about 330 KB of request body each) sent at the same instant:
/// they reach routing and the replicas in the order they were sent, so runs match request for
/// request. A gateway parsing such bodies on its blocking pool finishes them in real-time order,
/// and every run took its own path here (three failures in three without the setting; fifteen
/// passes in fifteen with it).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn concurrent_large_prompts_replay_the_same_on_the_virtual_clock() {
    let _cores = CORES.read().await;
    let dir = out_dir("large_prompts");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("burst.jsonl");
    let blocks = 125; // 512 tokens each
    let lines: Vec<String> = (0..12)
        .map(|i| {
            let ids: Vec<usize> = (i * blocks..(i + 1) * blocks).collect();
            serde_json::json!({"timestamp": 0, "input_length": blocks * 512,
                "output_length": 16, "hash_ids": ids})
            .to_string()
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    // Each prompt is larger than what the gateway parses inline by default.
    let prompt_bytes: usize = (0..blocks as u64)
        .map(|id| agentgate_bench::workload::trace::block_text(id).len() + 1)
        .sum();
    let inline_limit = agentgate::config::ServerConfig::default().parse_inline_bytes;
    assert!(prompt_bytes > inline_limit, "{prompt_bytes} B");
    let mut records: Vec<Vec<_>> = Vec::new();
    for name in ["large_prompts_a", "large_prompts_b"] {
        let mut args = tiny_args(&["least_loaded"], out_dir(name));
        args.workload = format!("trace:{}", trace.display());
        args.time_scale = None;
        args.duration = Duration::from_secs(30);
        assert_eq!(args.clock(), ClockMode::Virtual);
        let summary = execute(&args, "agentgate-bench run (test)", false)
            .await
            .expect("the run succeeds");
        assert_eq!(summary.policies[0].successes, 12);
        records.push(request_timings(&args.out));
        let _ = std::fs::remove_dir_all(&args.out);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        records[0], records[1],
        "same burst, same run, request for request"
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_seed_list_repeats_each_seeds_own_run_and_sets_the_figures_side_by_side() {
    let _cores = CORES.read().await;
    let args = |name: &str| {
        let mut args = tiny_args(&["round_robin", "session"], out_dir(name));
        args.time_scale = None;
        args.duration = Duration::from_secs(30);
        args.sessions = 6;
        args
    };
    let listed = args("seeds");
    let summary = execute_seeds(&listed, &[8, 7], "agentgate-bench run (test)", false)
        .await
        .expect("the runs succeed");
    assert_eq!(summary.seeds, [8, 7], "in the order given");
    assert_eq!(summary.clock, "virtual");

    // Seed 7 run on its own, after the list: the list's second run (after seed 8) must match it.
    let alone = Args {
        seed: 7,
        ..args("seeds_alone")
    };
    let single = execute(&alone, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    assert_eq!(
        request_timings(&listed.out.join("seed-7")),
        request_timings(&alone.out),
        "a seed of the list replays exactly as --seed 7"
    );
    assert_ne!(
        request_timings(&listed.out.join("seed-8")),
        request_timings(&alone.out),
        "another seed, another workload"
    );

    let row = |label: &str| summary.rows.iter().find(|r| r.row == label).expect(label);
    let (session, round_robin) = (row("session"), row("round_robin"));
    let of = |label: &str| single.policies.iter().find(|p| p.row == label).unwrap();
    let (s7, rr7) = (of("session"), of("round_robin"));
    assert_eq!(session.round_robin_row.as_deref(), Some("round_robin"));
    assert_eq!(session.captured_reuse.per_seed[1], Some(s7.captured_reuse));
    assert_eq!(
        session.ttft_p50_vs_round_robin.per_seed[1],
        Some(s7.ttft_p50_ms / rr7.ttft_p50_ms)
    );
    let gpu =
        s7.gpu_seconds_per_million_tokens.unwrap() / rr7.gpu_seconds_per_million_tokens.unwrap();
    assert_eq!(session.gpu_vs_round_robin.per_seed[1], Some(gpu));
    let per_replica = &s7.requests_per_replica;
    let mean = per_replica.iter().sum::<u64>() as f64 / per_replica.len() as f64;
    assert_eq!(
        session.busiest_replica_vs_mean.per_seed[1],
        Some(*per_replica.iter().max().unwrap() as f64 / mean)
    );
    let captured = &session.captured_reuse.per_seed;
    let (lo, hi) = (
        captured[0].unwrap().min(captured[1].unwrap()),
        captured[0].unwrap().max(captured[1].unwrap()),
    );
    assert_eq!(
        (session.captured_reuse.min, session.captured_reuse.max),
        (Some(lo), Some(hi))
    );
    assert_eq!(session.captured_reuse.mean, Some((lo + hi) / 2.0));
    assert_eq!(
        round_robin.round_robin_row, None,
        "round_robin is not compared with itself"
    );
    assert_eq!(round_robin.ttft_p50_vs_round_robin.per_seed, [None, None]);

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(listed.out.join("seeds.json")).expect("seeds.json written"),
    )
    .expect("seeds.json is JSON");
    assert_eq!(json["seeds"], serde_json::json!([8, 7]));
    assert_eq!(json["rows"][1]["row"], "session");
    let table = std::fs::read_to_string(listed.out.join("seeds.md")).expect("seeds.md written");
    assert!(
        table.contains("| row | 8 | 7 | mean | median | min | max |"),
        "{table}"
    );
    assert!(table.contains("## TTFT p50 against round_robin"), "{table}");
    for seed in [8, 7] {
        let dir = listed.out.join(format!("seed-{seed}"));
        assert!(dir.join("summary.json").is_file() && dir.join("report.md").is_file());
    }
    let _ = std::fs::remove_dir_all(&listed.out);
    let _ = std::fs::remove_dir_all(&alone.out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_replica_mid_run_loses_no_request_and_is_reported() {
    let _cores = CORES.write().await;
    let out = out_dir("kill");
    // Short chat turns keep every request quick even in a debug build, so the replay follows
    // the simulated clock closely and traffic is running on both sides of the kill.
    let args = Args {
        workload: "chat".into(),
        sessions: 20,
        duration: Duration::from_secs(30),
        time_scale: Some(0.1),
        kill_replica: Some(Duration::from_secs(15)),
        ..tiny_args(&["round_robin"], out.clone())
    };
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    assert_eq!(summary.kill_replica_s, Some(15.0));
    let policy = &summary.policies[0];
    assert_consistent(policy);
    assert!(
        policy.requests_per_replica[0] > 0,
        "round robin sent replica 0 some of the requests sent before the kill: {policy:?}"
    );
    let kill = policy.kill.as_ref().expect("kill section");
    assert_eq!((kill.at_s, kill.replica), (15.0, 0));
    assert!(kill.performed, "the replay was still running at 15 s");
    assert!(kill.killed_at_s.is_some_and(|t| t >= 15.0), "{kill:?}");
    assert!(kill.errors_in_flight <= kill.in_flight, "{kill:?}");
    assert_eq!(
        kill.errors_in_flight + kill.errors_after + kill.errors_other,
        policy.errors,
        "every error is classified once: {kill:?}"
    );
    assert!(kill.shed_after <= policy.shed);
    assert_eq!(
        kill.routed_to_killed_after, 0,
        "nothing is served by a dead replica"
    );
    assert!(kill.requests_after > 0, "the replay went on after the kill");
    assert_eq!(
        kill.errors_after, 0,
        "a request sent after the kill runs on the other replica (refused at connect, it is \
         sent again): {kill:?}"
    );
    assert!(
        kill.hit_ratio_after_60s.is_some(),
        "requests sent after the kill still succeed on the other replica: {kill:?}"
    );
    for ratio in [
        kill.hit_ratio_before,
        kill.hit_ratio_after_60s,
        kill.hit_ratio_late,
    ]
    .into_iter()
    .flatten()
    {
        assert!((0.0..=1.0).contains(&ratio), "{kill:?}");
    }

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    let section = &json["policies"][0]["kill"];
    for field in [
        "at_s",
        "replica",
        "errors_in_flight",
        "errors_after",
        "hit_ratio_before",
        "hit_ratio_after_60s",
        "hit_ratio_late",
    ] {
        assert!(
            section.get(field).is_some(),
            "kill.{field} missing: {section}"
        );
    }
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(
        report.contains("### Replica kill"),
        "kill section in the report"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decode_rows_disaggregate_and_account_for_every_replica() {
    let _cores = CORES.read().await;
    let out = out_dir("pd");
    let pd = Topology::Pd {
        prefill: 1,
        decode: 1,
    };
    // Threshold 0: every prompt with anything uncached on its decode replica is prefilled
    // remotely; a threshold above any prompt keeps every request on its decode replica.
    let args = Args {
        replicas: 2,
        topology: vec![Topology::Agg, pd],
        pd_threshold: vec![0, 100_000_000],
        ..tiny_args(&["session"], out.clone())
    };
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    let labels: Vec<&str> = summary.policies.iter().map(|p| p.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "session@agg",
            "session@pd:1x1/t=0",
            "session@pd:1x1/t=100000000"
        ]
    );
    assert_eq!(summary.topologies, ["agg", "pd:1x1"]);
    let agg = &summary.policies[0];
    assert_eq!((agg.topology.as_str(), agg.pd.is_none()), ("agg", true));
    for row in &summary.policies {
        assert_consistent(row);
        assert_eq!((row.errors, row.shed), (0, 0), "{:?}", row.first_error);
        assert_eq!(row.policy, "session");
        assert!((0.0..=1.0).contains(&row.cache_hit_ratio), "{row:?}");
        assert!(row.prefill_tokens_computed <= row.engine.prompt_tokens);
    }
    for (row, threshold) in summary.policies[1..].iter().zip([0, 100_000_000]) {
        assert_eq!(row.topology, "pd:1x1");
        let pd = row.pd.as_ref().expect("pd figures");
        assert_eq!(pd.threshold_tokens, threshold);
        assert_eq!((pd.prefill_replicas, pd.decode_replicas), (1, 1));
        // One decision per request that reached the pool.
        assert_eq!(pd.disaggregated + pd.local, row.requests, "{pd:?}");
        assert_eq!(
            pd.fallbacks_prefill_failed + pd.fallbacks_transfer_failed,
            0
        );
        assert_eq!(pd.transfer_failures, 0);
        // The decode replica serves every request; the prefill replica only runs prefill legs.
        assert_eq!(row.requests_per_replica, [0, row.requests], "{row:?}");
        // Every replica's work is counted: busy time and prefill over both roles.
        let busy = |r: &agentgate_bench::run::pd::RoleTotals| r.busy_seconds.expect("busy time");
        let total = row.engine.busy_seconds.expect("busy time");
        assert!((busy(&pd.prefill) + busy(&pd.decode) - total).abs() < 1e-6);
        assert_eq!(
            pd.prefill.prefill_tokens_computed + pd.decode.prefill_tokens_computed,
            row.prefill_tokens_computed
        );
        // Each request's prompt is served once, by the decode replica.
        assert_eq!(pd.served_prompt_tokens, row.prompt_tokens);
        let tokens = (pd.decode.prompt_tokens + pd.decode.generation_tokens) as f64;
        let gpu = row.gpu_seconds_per_million_tokens.expect("gpu figure");
        assert!((gpu - total / tokens * 1e6).abs() < 1e-6 * gpu.max(1.0));
        let reuse = 1.0 - row.prefill_tokens_computed as f64 / pd.served_prompt_tokens as f64;
        assert!((row.cache_hit_ratio - reuse.max(0.0)).abs() < 1e-12);
    }
    let eager = summary.policies[1].pd.as_ref().unwrap();
    assert!(
        eager.disaggregated > 0,
        "threshold 0 disaggregates: {eager:?}"
    );
    assert!(eager.prefill.prompt_tokens > 0 && eager.prefill.busy_seconds > Some(0.0));
    assert!(
        eager.prefill_leg_mean_ms.is_some(),
        "prefill legs were timed"
    );
    assert!(
        eager.client_cache_hit_ratio > summary.policies[1].cache_hit_ratio,
        "the decode replica reports the KV it received as cached: {eager:?}"
    );
    let never = summary.policies[2].pd.as_ref().unwrap();
    assert_eq!(never.disaggregated, 0, "{never:?}");
    assert_eq!(
        never.prefill.prompt_tokens, 0,
        "the prefill replica stayed idle"
    );
    // Over a seed list the busiest replica is taken over the replicas that serve requests: the
    // one decode replica of pd:1x1 serves all of them, so it is exactly the mean.
    let side_by_side = seeds::summarize("test", &[(7, summary.clone())]);
    for row in &side_by_side.rows[1..] {
        assert_eq!(
            row.busiest_replica_vs_mean.per_seed,
            [Some(1.0)],
            "{}",
            row.row
        );
    }

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    assert_eq!(json["policies"][1]["topology"], "pd:1x1");
    assert_eq!(json["policies"][1]["label"], "session@pd:1x1/t=0");
    assert!(json["policies"][0].get("pd").is_none());
    for field in [
        "disaggregated",
        "local",
        "fallbacks_prefill_failed",
        "fallbacks_transfer_failed",
        "transfer_failures",
        "client_cache_hit_ratio",
        "prefill",
        "decode",
    ] {
        assert!(
            json["policies"][1]["pd"].get(field).is_some(),
            "pd.{field} missing"
        );
    }
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("## Prefill/decode"), "P/D section");
    assert!(
        report.contains("| session@pd:1x1/t=0 | pd:1x1 | 0 |"),
        "{report}"
    );
    assert!(report.contains("Against session@agg"), "generated reading");
    let _ = std::fs::remove_dir_all(&out);
}

/// A tiny mixed run through one policy with flow control on and off, plus the interactive team
/// alone, on replicas that run one sequence each, so requests queue in the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_mixed_run_reports_bands_teams_turns_and_isolation() {
    let _cores = CORES.read().await;
    let out = out_dir("flow");
    let args = Args {
        workload: "mixed".into(),
        sessions: 4,
        max_num_seqs: 1,
        mixed_batch_load: Some(1.0),
        interactive_alone: true,
        flow_control: vec![FlowMode::On, FlowMode::Off],
        ..tiny_args(&["least_loaded"], out.clone())
    };
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    assert_eq!(summary.request_slots, 2);
    let rows: Vec<(&str, &str, &str)> = summary
        .policies
        .iter()
        .map(|p| (p.row.as_str(), p.flow_control.as_str(), p.traffic.as_str()))
        .collect();
    assert_eq!(
        rows,
        [
            ("least_loaded", "on", "all"),
            ("least_loaded flow-off", "off", "all"),
            ("least_loaded interactive-alone", "on", "interactive-alone"),
        ]
    );
    for row in &summary.policies {
        assert_consistent(row);
        assert_eq!(row.rate_limited, 0, "the bench configures no rate limits");
        let teams_requests: u64 = row.teams.values().map(|t| t.requests).sum();
        assert_eq!(teams_requests, row.requests, "teams partition the requests");
        let dispatched: u64 = row.teams.values().map(|t| t.dispatched_tokens).sum();
        assert_eq!(dispatched, row.prompt_tokens + row.output_tokens);
        let shares: f64 = row.teams.values().map(|t| t.dispatched_token_share).sum();
        assert!((shares - 1.0).abs() < 1e-9, "token shares add up: {shares}");
        assert_eq!(
            row.turns.continuing.requests + row.turns.new.requests,
            row.requests,
            "every request is a continuing turn or a new session"
        );
        // With flow control off too, the requests are reported by the band their team
        // would run in.
        let bands: Vec<&str> = row.bands.keys().map(String::as_str).collect();
        let expected: &[&str] = if row.traffic == "all" {
            &["batch", "interactive"]
        } else {
            &["interactive"]
        };
        assert_eq!(bands, expected, "{}", row.row);
        let band_requests: u64 = row.bands.values().map(|b| b.requests).sum();
        assert_eq!(band_requests, row.requests, "bands partition the requests");
        let on = row.flow_control == "on";
        if on {
            for band in row.bands.values() {
                assert_eq!(
                    band.successes + band.errors + band.shed + band.rate_limited,
                    band.requests
                );
                assert!(
                    band.queue_wait_p50_ms.is_some(),
                    "admitted requests say their wait"
                );
                assert!(band.queue_wait_p50_ms <= band.queue_wait_p99_ms);
                assert!(band.queue_wait_p99_ms <= band.queue_wait_max_ms);
                assert!(band.ttft_p50_ms <= band.ttft_p99_ms);
            }
            assert!(row.turns.new.queue_wait_p50_ms.is_some());
            assert!(row.saturated_fraction.is_some());
            assert_eq!(row.shed_unsaturated, Some(0));
        } else {
            assert!(
                row.bands.values().all(|b| b.queue_wait_p50_ms.is_none()),
                "no queue waits without flow control"
            );
            assert!(row.fairness.is_empty());
            assert_eq!(row.turns.continuing.queue_wait_p50_ms, None);
            assert!(row.teams.values().all(|t| t.queue_wait_p50_ms.is_none()));
            assert_eq!(row.saturated_fraction, None);
        }
    }
    let alone = &summary.policies[2];
    assert_eq!(
        alone.teams.keys().collect::<Vec<_>>(),
        ["interactive"],
        "only the interactive team runs alone"
    );
    assert_eq!(
        alone.teams["interactive"].requests, summary.policies[0].teams["interactive"].requests,
        "the same interactive sessions, turn for turn"
    );
    let check = &summary.interactive_isolation;
    assert_eq!(check.len(), 1);
    assert_eq!(check[0].policy, "least_loaded");
    let (a, on, off) = (
        check[0].alone_ttft_p99_ms,
        check[0].flow_on_ttft_p99_ms,
        check[0].flow_off_ttft_p99_ms,
    );
    assert!(a.is_some() && on.is_some() && off.is_some(), "{check:?}");
    // The requests the p99s leave out are counted beside them.
    let interactive = |row: &str| {
        let t = &summary
            .policies
            .iter()
            .find(|p| p.row == row)
            .unwrap()
            .teams["interactive"];
        Some(t.errors + t.shed + t.rate_limited)
    };
    assert_eq!(
        (
            check[0].alone_unanswered,
            check[0].flow_on_unanswered,
            check[0].flow_off_unanswered
        ),
        (
            interactive(&summary.policies[2].row),
            interactive(&summary.policies[0].row),
            interactive(&summary.policies[1].row)
        ),
        "{check:?}"
    );
    assert_eq!(
        check[0].off_over_on,
        off.zip(on).map(|(off, on)| off / on),
        "{check:?}"
    );

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json written"),
    )
    .expect("summary.json is JSON");
    let first = &json["policies"][0];
    for band in ["interactive", "batch"] {
        for field in [
            "requests",
            "shed",
            "rate_limited",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "queue_wait_p50_ms",
            "queue_wait_p99_ms",
        ] {
            assert!(
                first["bands"][band].get(field).is_some(),
                "bands.{band}.{field} missing"
            );
        }
    }
    for team in ["interactive", "agents"] {
        for field in ["requests", "dispatched_tokens", "shed", "rate_limited"] {
            assert!(
                first["teams"][team].get(field).is_some(),
                "teams.{team}.{field} missing"
            );
        }
    }
    for kind in ["continuing", "new"] {
        assert!(first["turns"][kind].get("queue_wait_p50_ms").is_some());
    }
    assert_eq!(json["interactive_isolation"][0]["policy"], "least_loaded");

    // A seed list carries the flow figures of each seed's run.
    let side_by_side = seeds::summarize("test", &[(7, summary.clone())]);
    assert_eq!(side_by_side.interactive_isolation.len(), 1);
    assert_eq!(
        side_by_side.interactive_isolation[0].on_over_alone.per_seed,
        [check[0].on_over_alone]
    );
    let on_row = &side_by_side.rows[0];
    let matched = summary.policies[0].turns.matched.as_ref();
    assert_eq!(
        on_row.continuing_over_new.per_seed,
        [matched.and_then(|m| m.continuing_over_new)]
    );
    // Whether this tiny run pairs new sessions with continuing turns under saturation varies
    // from run to run; the figure is carried through either way.
    let mut paired = summary.clone();
    paired.policies[0].turns.matched = Some(MatchedWaits {
        pairs: 3,
        new_queue_wait_p50_ms: 400.0,
        continuing_queue_wait_p50_ms: 100.0,
        continuing_over_new: Some(0.25),
    });
    let paired = seeds::summarize("test", &[(7, paired)]);
    assert_eq!(paired.rows[0].continuing_over_new.per_seed, [Some(0.25)]);
    assert_eq!(on_row.shed_unsaturated.per_seed, [Some(0.0)]);
    assert_eq!(
        side_by_side.rows[1].shed_unsaturated.per_seed,
        [None],
        "flow off: nothing to say"
    );

    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("### Flow control"));
    assert!(report.contains("Interactive isolation"));
    assert!(report.contains("| least_loaded flow-off |"));
    let _ = std::fs::remove_dir_all(&out);
}

/// Two teams in one band, one with ten times the sessions, on a fleet of two request slots:
/// both wait in the gateway, and the fairness section splits what was dispatched while they did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fairness_run_splits_dispatched_tokens_while_both_teams_wait() {
    let _cores = CORES.write().await;
    let out = out_dir("fairness");
    let args = Args {
        workload: "fairness".into(),
        sessions: 11,
        replicas: 1,
        max_num_seqs: 2,
        duration: Duration::from_secs(20),
        time_scale: Some(0.05),
        ..tiny_args(&["round_robin"], out.clone())
    };
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    let row = &summary.policies[0];
    assert_consistent(row);
    assert_eq!((row.errors, row.shed), (0, 0), "{:?}", row.first_error);
    assert_eq!(row.bands.keys().collect::<Vec<_>>(), ["batch"]);
    let fairness = &row.fairness["batch"];
    assert!(
        fairness.backlogged_s > 0.0,
        "eleven sessions on two slots queue together: {fairness:?}"
    );
    let teams: Vec<&str> = fairness.teams.keys().map(String::as_str).collect();
    assert_eq!(teams, ["heavy", "light"]);
    let total: u64 = fairness.teams.values().map(|s| s.dispatched_tokens).sum();
    assert!(total > 0, "something was dispatched while both waited");
    let shares: f64 = fairness.teams.values().filter_map(|s| s.share).sum();
    assert!((shares - 1.0).abs() < 1e-9, "{fairness:?}");
    for (team, share) in &fairness.teams {
        assert!(
            share.dispatched_tokens <= row.teams[team].dispatched_tokens,
            "the window's tokens are part of the team's"
        );
    }
    assert_eq!(row.teams["heavy"].turns.new.requests, 10);
    assert_eq!(row.teams["light"].turns.new.requests, 1);
    let lowest = fairness
        .teams
        .values()
        .filter_map(|s| s.share)
        .min_by(f64::total_cmp);
    assert!(lowest.is_some());
    let side_by_side = seeds::summarize("test", &[(7, summary.clone())]);
    assert_eq!(side_by_side.rows[0].lowest_fair_share.per_seed, [lowest]);
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("Fairness within a band"));
    let _ = std::fs::remove_dir_all(&out);
}

/// Layouts, flow settings and the interactive team alone in one run: one row per combination,
/// labelled by what varies, each fleet's own request slots, P/D figures on P/D rows only, one
/// isolation check per policy and layout, and both the flow-control and P/D report sections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layouts_flow_settings_and_the_interactive_team_alone_combine_into_one_set_of_rows() {
    let _cores = CORES.read().await;
    let out = out_dir("combined");
    let pd = Topology::Pd {
        prefill: 1,
        decode: 1,
    };
    let args = Args {
        workload: "mixed".into(),
        sessions: 4,
        max_num_seqs: 2,
        interactive_alone: true,
        flow_control: vec![FlowMode::On, FlowMode::Off],
        topology: vec![Topology::Agg, pd],
        pd_threshold: vec![0],
        ..tiny_args(&["least_loaded"], out.clone())
    };
    let summary = execute(&args, "agentgate-bench run (test)", false)
        .await
        .expect("the run succeeds");
    let rows: Vec<(&str, &str, &str, &str)> = summary
        .policies
        .iter()
        .map(|p| {
            (
                p.label.as_str(),
                p.topology.as_str(),
                p.flow_control.as_str(),
                p.traffic.as_str(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("least_loaded@agg", "agg", "on", "all"),
            ("least_loaded@agg flow-off", "agg", "off", "all"),
            (
                "least_loaded@agg interactive-alone",
                "agg",
                "on",
                "interactive-alone"
            ),
            ("least_loaded@pd:1x1/t=0", "pd:1x1", "on", "all"),
            ("least_loaded@pd:1x1/t=0 flow-off", "pd:1x1", "off", "all"),
            (
                "least_loaded@pd:1x1/t=0 interactive-alone",
                "pd:1x1",
                "on",
                "interactive-alone"
            ),
        ]
    );
    // Two aggregated replicas x 2 sequences, against one decode replica x 2 on pd:1x1.
    assert_eq!(summary.request_slots, 4);
    for row in &summary.policies {
        assert_consistent(row);
        assert_eq!(row.row, row.label, "one label under both names");
        let pd_row = row.topology == "pd:1x1";
        assert_eq!(
            row.request_slots,
            if pd_row { 2 } else { 4 },
            "{}",
            row.label
        );
        assert_eq!(row.pd.is_some(), pd_row, "{}", row.label);
        assert!(!row.bands.is_empty(), "{}", row.label);
        assert_eq!(
            row.bands.values().any(|b| b.queue_wait_p50_ms.is_some()),
            row.flow_control == "on",
            "{}",
            row.label
        );
        if let Some(pd) = &row.pd {
            assert_eq!(pd.threshold_tokens, 0);
            assert_eq!(pd.disaggregated + pd.local, row.requests, "{pd:?}");
            assert_eq!(row.requests_per_replica, [0, row.requests], "{row:?}");
        }
    }
    let alone = &summary.policies[5];
    assert_eq!(alone.teams.keys().collect::<Vec<_>>(), ["interactive"]);
    let checks: Vec<(&str, &str, &str)> = summary
        .interactive_isolation
        .iter()
        .map(|c| (c.policy.as_str(), c.setup.as_str(), c.topology.as_str()))
        .collect();
    assert_eq!(
        checks,
        [
            ("least_loaded", "least_loaded@agg", "agg"),
            ("least_loaded", "least_loaded@pd:1x1/t=0", "pd:1x1"),
        ]
    );
    for check in &summary.interactive_isolation {
        assert!(
            check.alone_ttft_p99_ms.is_some()
                && check.flow_on_ttft_p99_ms.is_some()
                && check.flow_off_ttft_p99_ms.is_some(),
            "each check reads its own layout's rows: {check:?}"
        );
    }

    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("### Flow control"));
    assert!(report.contains("| least_loaded@pd:1x1/t=0 |"), "{report}");
    assert!(report.contains("4 or 2 request slots") || report.contains("2 or 4 request slots"));
    assert!(report.contains("## Prefill/decode"));
    // P/D rows compare with the aggregated row of the same flow setting and traffic.
    assert!(
        report.contains("Against least_loaded@agg (differences"),
        "{report}"
    );
    assert!(
        report.contains("Against least_loaded@agg flow-off (differences"),
        "{report}"
    );
    assert!(
        report.contains("Against least_loaded@agg interactive-alone (differences"),
        "{report}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
