//! Disaggregated prefill/decode against simulated vLLM and SGLang replicas in their P/D roles:
//! the decode leg's prompt is served from the KV cache the prefill leg computed, and each failure
//! is reported by the leg it happened in.

use agentgate_adapters::{ClientOptions, DisaggError, EngineClient, Flavor, PrefillTarget};
use agentgate_sim::{Role, SimConfig, SimHandle};
use futures_util::StreamExt;
use serde_json::{json, Value};

async fn sim(flavor: agentgate_sim::Flavor, role: Role) -> SimHandle {
    agentgate_sim::spawn(SimConfig {
        flavor,
        role,
        listen: "127.0.0.1:0".parse().unwrap(),
        time_scale: 0.0,
        kv_transfer_timeout_s: 2.0,
        seed: Some(1),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn body() -> Value {
    json!({"model": "sim-model", "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "a long shared prompt to prefill elsewhere ".repeat(60)}]})
}

/// (completion tokens, cached prompt tokens) of a streamed answer.
async fn drain(stream: agentgate_adapters::ChunkStream) -> (u64, u64) {
    let chunks: Vec<Value> = stream.map(|c| c.unwrap()).collect().await;
    let usage = chunks
        .iter()
        .rev()
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
        .expect("usage chunk")
        .clone();
    (
        usage["completion_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

#[tokio::test]
async fn vllm_legs_transfer_the_prompt_and_failures_name_their_leg() {
    let prefill = sim(agentgate_sim::Flavor::Vllm, Role::Prefill).await;
    let decode = sim(agentgate_sim::Flavor::Vllm, Role::Decode).await;
    let client = EngineClient::new(ClientOptions::default());
    let target = PrefillTarget {
        base_url: prefill.base_url(),
        bootstrap: None,
    };
    let stream = client
        .chat_stream_disaggregated(Flavor::Vllm, &target, &decode.base_url(), &body())
        .await
        .unwrap();
    let (completion, cached) = drain(stream).await;
    assert_eq!(completion, 5);
    assert!(
        cached >= 400,
        "the decode leg reused the transferred KV: {cached}"
    );
    // The legs go under one request id of the gateway's (32 hex digits; vLLM names the
    // request `chatcmpl-<X-Request-Id>`), a new one per split.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let stream = client
            .chat_stream_disaggregated(Flavor::Vllm, &target, &decode.base_url(), &body())
            .await
            .unwrap();
        let chunks: Vec<Value> = stream.map(|c| c.unwrap()).collect().await;
        let id = chunks[0]["id"].as_str().unwrap().to_string();
        let hex = id.strip_prefix("chatcmpl-").unwrap_or_default();
        assert!(
            hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
        assert!(chunks.iter().all(|c| c["id"] == id.as_str()));
        ids.push(id);
    }
    assert_ne!(ids[0], ids[1]);

    // The decode replica cannot be reached: the prefill ran, the decode leg is at fault.
    let err = client
        .chat_stream_disaggregated(Flavor::Vllm, &target, "http://127.0.0.1:9", &body())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, DisaggError::Decode(_)), "{err}");

    // The prefill replica is gone: the prefill leg fails before anything ran.
    prefill.shutdown().await;
    let err = client
        .chat_stream_disaggregated(Flavor::Vllm, &target, &decode.base_url(), &body())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, DisaggError::Prefill(_)), "{err}");
    decode.shutdown().await;
}

#[tokio::test]
async fn sglang_legs_meet_in_a_bootstrap_room() {
    let prefill = sim(agentgate_sim::Flavor::Sglang, Role::Prefill).await;
    let decode = sim(agentgate_sim::Flavor::Sglang, Role::Decode).await;
    let client = EngineClient::new(ClientOptions::default());
    let target = PrefillTarget {
        base_url: prefill.base_url(),
        bootstrap: Some(("127.0.0.1".to_string(), prefill.addr().port())),
    };
    let stream = client
        .chat_stream_disaggregated(Flavor::Sglang, &target, &decode.base_url(), &body())
        .await
        .unwrap();
    let (completion, cached) = drain(stream).await;
    assert_eq!(completion, 5);
    assert!(
        cached >= 400,
        "the decode leg reused the transferred KV: {cached}"
    );

    // No bootstrap port configured: refused as a prefill-side problem, nothing sent.
    let bare = PrefillTarget {
        base_url: prefill.base_url(),
        bootstrap: None,
    };
    let err = client
        .chat_stream_disaggregated(Flavor::Sglang, &bare, &decode.base_url(), &body())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, DisaggError::Prefill(_)), "{err}");

    // The prefill replica is gone: the decode leg waits in vain and the prefill leg is blamed.
    prefill.shutdown().await;
    let err = client
        .chat_stream_disaggregated(Flavor::Sglang, &target, &decode.base_url(), &body())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, DisaggError::Prefill(_)), "{err}");
    decode.shutdown().await;
}

/// SGLang's decode engine answers with its headers at once and then waits in the bootstrap
/// room: a prefill leg that fails after that fails the request as a prefill failure (which the
/// gateway falls back from), instead of being handed back as an open stream that waits out the
/// decode engine's transfer timeout and then fails as an engine error.
#[tokio::test]
async fn an_sglang_prefill_failing_after_the_decode_headers_is_a_prefill_failure() {
    let decode = sim(agentgate_sim::Flavor::Sglang, Role::Decode).await;
    // A prefill engine (and bootstrap server) that takes connections and drops them 300 ms
    // later unanswered.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = hole.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((conn, _)) = hole.accept().await {
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                drop(conn);
            });
        }
    });
    let target = PrefillTarget {
        base_url: format!("http://127.0.0.1:{port}"),
        bootstrap: Some(("127.0.0.1".to_string(), port)),
    };
    let client = EngineClient::new(ClientOptions::default());
    let err = client
        .chat_stream_disaggregated(Flavor::Sglang, &target, &decode.base_url(), &body())
        .await
        .err()
        .expect("the request fails");
    assert!(matches!(err, DisaggError::Prefill(_)), "{err}");
    decode.shutdown().await;
}
