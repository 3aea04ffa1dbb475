//! End to end: `agentgate-bench run` on a tiny agentic workload against two baseline policies
//! (in-process replicas and gateway, time scale 0), checking that summary.json is complete and
//! consistent and that the report and charts are written; and that an unavailable policy fails
//! before anything runs.

use std::path::PathBuf;
use std::time::Duration;

use agentgate_bench::run::{execute, Args};
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
        policies: policies.iter().map(|p| p.to_string()).collect(),
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
