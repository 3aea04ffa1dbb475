//! End-to-end tests of metrics scraping and health checks against the engine simulator, for both
//! the vLLM and the SGLang flavor: counters follow the requests sent, the cache configuration
//! matches the simulator's, live load shows up while requests run and queue, and `/health`
//! failures surface as errors.

use agentgate_adapters::{ClientOptions, EngineClient, EngineMetrics, Flavor, UpstreamError};
use agentgate_sim::SimConfig;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::Duration;

const BLOCK_SIZE: usize = 16;
const KV_BLOCKS: usize = 512;

fn sim_flavor(flavor: Flavor) -> agentgate_sim::Flavor {
    match flavor {
        Flavor::Sglang => agentgate_sim::Flavor::Sglang,
        _ => agentgate_sim::Flavor::Vllm,
    }
}

fn config(flavor: Flavor) -> SimConfig {
    SimConfig {
        flavor: sim_flavor(flavor),
        listen: "127.0.0.1:0".parse().expect("loopback address"),
        time_scale: 0.0,
        block_size: BLOCK_SIZE,
        kv_blocks: KV_BLOCKS,
        seed: Some(7),
        ..SimConfig::default()
    }
}

fn client() -> EngineClient {
    EngineClient::new(ClientOptions {
        request_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    })
}

/// A prompt long enough to fill several cache blocks.
fn long_prompt() -> String {
    (0..200)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sends one non-streaming chat request; returns (prompt_tokens, cached_tokens).
async fn chat_once(base_url: &str, prompt: &str) -> (f64, f64) {
    let body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
    });
    let answer: Value = reqwest::Client::new()
        .post(format!("{base_url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("chat request")
        .json()
        .await
        .expect("chat answer");
    let usage = &answer["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_f64().expect("prompt_tokens");
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap_or(0.0);
    (prompt_tokens, cached)
}

async fn scrape(client: &EngineClient, flavor: Flavor, base_url: &str) -> EngineMetrics {
    client
        .scrape_metrics(flavor, base_url)
        .await
        .expect("scrape metrics")
}

async fn counters_follow_requests(flavor: Flavor) {
    let sim = agentgate_sim::spawn(config(flavor))
        .await
        .expect("spawn sim");
    let base = sim.base_url();
    let client = client();

    let idle = scrape(&client, flavor, &base).await;
    assert_eq!(idle.running, Some(0.0), "{flavor:?}");
    assert_eq!(idle.waiting, Some(0.0), "{flavor:?}");
    assert_eq!(idle.kv_usage, Some(0.0), "{flavor:?}");
    assert_eq!(idle.prefix_cache_queries, Some(0.0), "{flavor:?}");
    assert_eq!(idle.prefix_cache_hits, Some(0.0), "{flavor:?}");

    let prompt = long_prompt();
    let (prompt_tokens, first_cached) = chat_once(&base, &prompt).await;
    let after_first = scrape(&client, flavor, &base).await;
    assert_eq!(
        after_first.prefix_cache_queries,
        Some(prompt_tokens),
        "{flavor:?}"
    );
    assert_eq!(
        after_first.prefix_cache_hits,
        Some(first_cached),
        "{flavor:?}"
    );

    let (again_tokens, cached) = chat_once(&base, &prompt).await;
    assert!(cached > 0.0, "{flavor:?}: the repeated prefix must hit");
    let after_second = scrape(&client, flavor, &base).await;
    assert_eq!(
        after_second.prefix_cache_queries,
        Some(prompt_tokens + again_tokens),
        "{flavor:?}"
    );
    assert_eq!(
        after_second.prefix_cache_hits,
        Some(first_cached + cached),
        "{flavor:?}"
    );
    let rate = after_second.cache_hit_rate.expect("hit rate");
    let expected = (first_cached + cached) / (prompt_tokens + again_tokens);
    assert!(
        (rate - expected).abs() < 1e-9,
        "{flavor:?}: {rate} vs {expected}"
    );
    assert_eq!(after_second.running, Some(0.0), "{flavor:?}");
    assert_eq!(after_second.waiting, Some(0.0), "{flavor:?}");

    // Only vLLM exports its cache configuration (SGLang's capacity gauges are not simulated).
    if flavor == Flavor::Vllm {
        assert_eq!(after_second.block_size, Some(BLOCK_SIZE as u64));
        assert_eq!(after_second.num_gpu_blocks, Some(KV_BLOCKS as u64));
        assert_eq!(
            after_second.kv_capacity_tokens(),
            Some((BLOCK_SIZE * KV_BLOCKS) as u64)
        );
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn vllm_counters_follow_requests() {
    counters_follow_requests(Flavor::Vllm).await;
}

#[tokio::test]
async fn sglang_counters_follow_requests() {
    counters_follow_requests(Flavor::Sglang).await;
}

/// One running and one queued request show up as load; the engine decodes so slowly that
/// neither finishes while the test looks.
async fn live_load_is_reported(flavor: Flavor) {
    let sim = agentgate_sim::spawn(SimConfig {
        time_scale: 1.0,
        decode_ms_per_token: 600_000.0,
        max_num_seqs: 1,
        ..config(flavor)
    })
    .await
    .expect("spawn sim");
    let base = sim.base_url();
    let client = client();
    let mut holders = Vec::new();
    for turn in 0..2 {
        let client = client.clone();
        let base = base.clone();
        let body = json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": format!("request {turn}: {}", long_prompt())}],
            "max_tokens": 50,
            "stream": true,
        });
        holders.push(tokio::spawn(async move {
            if let Ok(mut stream) = client.chat_stream(&base, &body).await {
                while stream.next().await.is_some() {}
            }
        }));
    }
    let mut seen = EngineMetrics::default();
    for _ in 0..400 {
        seen = scrape(&client, flavor, &base).await;
        if seen.running == Some(1.0) && seen.waiting == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(seen.running, Some(1.0), "{flavor:?}: {seen:?}");
    assert_eq!(seen.waiting, Some(1.0), "{flavor:?}: {seen:?}");
    let usage = seen.kv_usage.expect("kv usage");
    assert!(usage > 0.0 && usage <= 1.0, "{flavor:?}: {usage}");
    for holder in holders {
        holder.abort();
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn vllm_live_load_is_reported() {
    live_load_is_reported(Flavor::Vllm).await;
}

#[tokio::test]
async fn sglang_live_load_is_reported() {
    live_load_is_reported(Flavor::Sglang).await;
}

async fn health_follows_the_unhealthy_fault(flavor: Flavor) {
    let sim = agentgate_sim::spawn(config(flavor))
        .await
        .expect("spawn sim");
    let base = sim.base_url();
    let client = client();
    client.health(&base).await.expect("healthy at start");
    client
        .health(&format!("{base}/v1/"))
        .await
        .expect("a /v1 base URL reaches the same /health");

    let http = reqwest::Client::new();
    let set = http
        .post(format!("{base}/sim/faults"))
        .json(&json!({"unhealthy": true}))
        .send()
        .await
        .expect("set fault");
    assert!(set.status().is_success());
    match client.health(&base).await {
        Err(UpstreamError::Status { status: 503, .. }) => {}
        other => panic!("{flavor:?}: expected a 503 health failure, got {other:?}"),
    }
    // Metrics stay readable while the health check fails.
    scrape(&client, flavor, &base).await;

    let cleared = http
        .delete(format!("{base}/sim/faults"))
        .send()
        .await
        .expect("clear faults");
    assert!(cleared.status().is_success());
    client.health(&base).await.expect("healthy again");
    sim.shutdown().await;
}

#[tokio::test]
async fn vllm_health_follows_the_unhealthy_fault() {
    health_follows_the_unhealthy_fault(Flavor::Vllm).await;
}

#[tokio::test]
async fn sglang_health_follows_the_unhealthy_fault() {
    health_follows_the_unhealthy_fault(Flavor::Sglang).await;
}

#[tokio::test]
async fn wrong_flavor_and_unreachable_engines_are_errors() {
    let sim = agentgate_sim::spawn(config(Flavor::Vllm))
        .await
        .expect("spawn sim");
    let base = sim.base_url();
    let client = client();
    match client.scrape_metrics(Flavor::Sglang, &base).await {
        Err(UpstreamError::Protocol(message)) => assert!(message.contains("flavor"), "{message}"),
        other => panic!("expected a protocol error, got {other:?}"),
    }
    assert_eq!(
        client.scrape_metrics(Flavor::Openai, &base).await,
        Ok(EngineMetrics::default())
    );
    sim.shutdown().await;

    // Nothing listens on the port once the simulator is gone.
    match client.health(&base).await {
        Err(UpstreamError::Connect(_)) => {}
        other => panic!("expected a connection error, got {other:?}"),
    }
    match client.scrape_metrics(Flavor::Vllm, &base).await {
        Err(UpstreamError::Connect(_)) => {}
        other => panic!("expected a connection error, got {other:?}"),
    }
}
