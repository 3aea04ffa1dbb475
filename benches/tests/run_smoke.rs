//! End to end: `agentgate-bench run` on a tiny agentic workload against two baseline policies
//! (in-process replicas and gateway, time scale 0), checking that summary.json is complete and
//! consistent and that the report and charts are written; that an unavailable policy fails
//! before anything runs; that two gateways sharing one Redis serve a session policy run whose
//! turns alternate between them; that killing a replica mid-run is accounted for; and that the
//! flow-control sections (bands, teams, turn kinds, the interactive team's isolation, fairness
//! between two teams of one band) exist and add up.

use std::path::PathBuf;
use std::time::Duration;

use agentgate_bench::run::flow::FlowMode;
use agentgate_bench::run::summary::PolicySummary;
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
        flow_control: vec![FlowMode::On],
        max_num_seqs: 64,
        mixed_batch_load: None,
        interactive_alone: false,
        batch_sheddable: false,
        sessions: 3,
        duration: Duration::from_secs(3),
        time_scale: 0.0,
        kv_blocks: 65_536,
        block_size: 16,
        seed: 7,
        compare_time_scale: None,
        out,
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

/// A tiny mixed run through one policy with flow control on and off, plus the interactive team
/// alone, on replicas that run one sequence each, so requests queue in the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_mixed_run_reports_bands_teams_turns_and_isolation() {
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
        let on = row.flow_control == "on";
        if on {
            let bands: Vec<&str> = row.bands.keys().map(String::as_str).collect();
            let expected: &[&str] = if row.traffic == "all" {
                &["batch", "interactive"]
            } else {
                &["interactive"]
            };
            assert_eq!(bands, expected, "{}", row.row);
            let band_requests: u64 = row.bands.values().map(|b| b.requests).sum();
            assert_eq!(band_requests, row.requests, "bands partition the requests");
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
            assert!(row.bands.is_empty(), "no bands without flow control");
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
    let out = out_dir("fairness");
    let args = Args {
        workload: "fairness".into(),
        sessions: 11,
        replicas: 1,
        max_num_seqs: 2,
        duration: Duration::from_secs(20),
        time_scale: 0.05,
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
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    assert!(report.contains("Fairness within a band"));
    let _ = std::fs::remove_dir_all(&out);
}
