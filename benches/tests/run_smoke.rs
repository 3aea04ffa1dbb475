//! End to end: `agentgate-bench run` on a tiny agentic workload against two baseline policies
//! (in-process replicas and gateway, time scale 0), checking that summary.json is complete and
//! consistent and that the report and charts are written; that an unavailable policy fails
//! before anything runs; that two gateways sharing one Redis serve a session policy run whose
//! turns alternate between them; that killing a replica mid-run is accounted for; and that a
//! prefill/decode topology with a threshold sweep runs next to the aggregated baseline, with
//! some requests disaggregated and every replica's work accounted for.

use std::path::PathBuf;
use std::time::Duration;

use agentgate_bench::run::summary::PolicySummary;
use agentgate_bench::run::topology::Topology;
use agentgate_bench::run::{execute, Args};
use agentgate_sessions::testing::TestRedis;
use serde_json::Value;

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
        redis_url: None,
        kill_replica: None,
        policies: policies.iter().map(|p| p.to_string()).collect(),
        sessions: 3,
        duration: Duration::from_secs(3),
        time_scale: 0.0,
        kv_blocks: 65_536,
        block_size: 16,
        seed: 7,
        compare_time_scale: None,
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
    assert_consistent(policy);
    // Chained turns continue a response the other gateway stored: without a shared store they
    // would fail.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_replica_mid_run_loses_no_request_and_is_reported() {
    let out = out_dir("kill");
    // Short chat turns keep every request quick even in a debug build, so the replay follows
    // the simulated clock closely and traffic is running on both sides of the kill.
    let args = Args {
        workload: "chat".into(),
        sessions: 20,
        duration: Duration::from_secs(30),
        time_scale: 0.02,
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
