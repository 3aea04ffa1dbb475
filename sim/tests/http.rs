//! End-to-end tests of the simulator over HTTP: cache reuse, streaming, tools, errors, P/D, faults.

use agentgate_sim::{spawn, Flavor, Role, SimConfig, SimHandle};
use serde_json::{json, Value};

fn config() -> SimConfig {
    SimConfig {
        listen: "127.0.0.1:0".parse().expect("literal address"),
        time_scale: 0.0,
        seed: Some(1),
        ..SimConfig::default()
    }
}

async fn start(config: SimConfig) -> SimHandle {
    spawn(config).await.expect("simulator starts")
}

fn long_system_prompt() -> String {
    (0..400).map(|i| format!("rule{i} ")).collect()
}

fn chat(user: &str) -> Value {
    json!({"model": "sim-model", "messages": [
        {"role": "system", "content": long_system_prompt()},
        {"role": "user", "content": user}]})
}

async fn post(client: &reqwest::Client, sim: &SimHandle, path: &str, body: &Value) -> (u16, Value) {
    let response = client
        .post(format!("{}{path}", sim.base_url()))
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn metric(client: &reqwest::Client, sim: &SimHandle, name: &str) -> f64 {
    let text = client
        .get(format!("{}/metrics", sim.base_url()))
        .send()
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    text.lines()
        .find(|line| line.starts_with(name) && line.as_bytes().get(name.len()) == Some(&b'{'))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

async fn sse_events(response: reqwest::Response) -> Vec<String> {
    let text = response.text().await.expect("stream body");
    text.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| frame.trim_start_matches("data: ").to_string())
        .collect()
}

/// The SSE `data` payloads of a streamed chat request.
async fn post_streamed(client: &reqwest::Client, sim: &SimHandle, body: &Value) -> Vec<String> {
    let response = client
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(body)
        .send()
        .await
        .expect("sent");
    sse_events(response).await
}

#[tokio::test]
async fn shared_prefix_hits_the_cache_on_the_same_replica_only() {
    let client = reqwest::Client::new();
    let warm = start(config()).await;
    let cold = start(config()).await;
    let (status, first) = post(
        &client,
        &warm,
        "/v1/chat/completions",
        &chat("first question"),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    // Nothing cached: no details, as vLLM reports it.
    assert_eq!(
        first["usage"]["prompt_tokens_details"],
        Value::Null,
        "{first}"
    );
    let hits_before = metric(&client, &warm, "vllm:prefix_cache_hits_total").await;
    let (_, second) = post(
        &client,
        &warm,
        "/v1/chat/completions",
        &chat("second question"),
    )
    .await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= 400, "the long shared prefix is cached: {second}");
    assert_eq!(cached % 16, 0, "hits are counted in full blocks");
    let hits_after = metric(&client, &warm, "vllm:prefix_cache_hits_total").await;
    assert!(hits_after > hits_before);
    assert!(!warm.cached_block_hashes().is_empty());

    let (_, elsewhere) = post(
        &client,
        &cold,
        "/v1/chat/completions",
        &chat("second question"),
    )
    .await;
    assert_eq!(elsewhere["usage"]["prompt_tokens_details"], Value::Null);
    assert_eq!(
        metric(&client, &cold, "vllm:prefix_cache_hits_total").await,
        0.0
    );
    warm.shutdown().await;
    cold.shutdown().await;
}

#[tokio::test]
async fn streaming_follows_vllm_framing() {
    let client = reqwest::Client::new();
    // real (scaled) time exercises the step-by-step path
    let sim = start(SimConfig {
        time_scale: 0.001,
        ..config()
    })
    .await;
    let mut body = chat("stream please");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(5);
    body["ignore_eos"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = client
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(&body)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let events = sse_events(response).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json chunk"))
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content_chunks: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["content"].is_string())
        .skip(1)
        .collect();
    assert_eq!(content_chunks.len(), 5, "one chunk per token");
    assert_eq!(content_chunks[4]["choices"][0]["finish_reason"], "length");
    let usage_chunk = chunks.last().expect("usage chunk");
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 5);
    assert!(
        content_chunks
            .iter()
            .all(|c| c["choices"][0]["logprobs"].is_null()),
        "no log probabilities unless asked"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn sglang_streams_end_with_a_finish_chunk_of_their_own() {
    let client = reqwest::Client::new();
    let sim = start(SimConfig {
        flavor: Flavor::Sglang,
        time_scale: 0.001,
        ..config()
    })
    .await;
    let mut body = chat("stream please");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(3);
    body["ignore_eos"] = json!(true);
    let events = post_streamed(&client, &sim, &body).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json chunk"))
        .collect();
    let choices: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]).collect();
    let last = choices.last().expect("chunks");
    assert_eq!(last["delta"], json!({}));
    assert_eq!(last["finish_reason"], "length");
    assert!(last.get("matched_stop").is_some(), "{last}");
    let text: Vec<&&Value> = choices
        .iter()
        .filter(|c| {
            c["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .collect();
    assert_eq!(text.len(), 3, "one chunk per token");
    for choice in text {
        assert!(choice["finish_reason"].is_null(), "{choice}");
        assert!(choice["delta"]["tool_calls"].is_null(), "{choice}");
        assert!(
            choice["delta"].get("tool_calls").is_some(),
            "sent as null: {choice}"
        );
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn log_probabilities_come_when_asked() {
    let client = reqwest::Client::new();
    let sim = start(config()).await;
    let mut body = chat("with logprobs");
    body["max_tokens"] = json!(4);
    body["ignore_eos"] = json!(true);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let (status, answer) = post(&client, &sim, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let content = answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content");
    let text: String = content
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(json!(text), answer["choices"][0]["message"]["content"]);
    for entry in content {
        assert!(entry["logprob"].as_f64().unwrap() < 0.0, "{entry}");
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(entry["top_logprobs"][0]["token"], entry["token"]);
        assert_eq!(
            entry["bytes"],
            json!(entry["token"].as_str().unwrap().as_bytes())
        );
    }
    // Streamed: each content chunk carries its own token's entry.
    body["stream"] = json!(true);
    let events = post_streamed(&client, &sim, &body).await;
    let streamed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).expect("json chunk"))
        .filter(|c| c["choices"][0]["logprobs"].is_object())
        .map(|c| c["choices"][0]["logprobs"]["content"][0].clone())
        .collect();
    assert_eq!(&streamed, content);
    // As vLLM checks them.
    body["logprobs"] = json!(false);
    let (status, error) = post(&client, &sim, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{error}");
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(21);
    assert_eq!(
        post(&client, &sim, "/v1/chat/completions", &body).await.0,
        400
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn tools_json_schema_and_max_tokens() {
    let client = reqwest::Client::new();
    let sim = start(config()).await;
    let tools = json!([{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1, "maximum": 9}}}}}]);
    let body = json!({"model": "sim-model", "tools": tools, "tool_choice": "auto",
        "messages": [{"role": "user", "content": "please read_file the readme"}]});
    let (_, response) = post(&client, &sim, "/v1/chat/completions", &body).await;
    assert_eq!(
        response["choices"][0]["finish_reason"], "tool_calls",
        "{response}"
    );
    let call = &response["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "read_file");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or(""))
        .expect("valid JSON arguments");
    assert!(args["path"].is_string());
    assert!((1..=9).contains(&args["lines"].as_i64().unwrap_or(0)));

    // streamed: header delta first, then argument deltas that add up to the same JSON
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = post_streamed(&client, &sim, &streamed).await;
    let deltas: Vec<Value> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["tool_calls"][0]
                .as_object()
                .cloned()
                .map(Value::Object)
        })
        .collect();
    assert_eq!(deltas[0]["function"]["name"], "read_file");
    assert_eq!(deltas[0]["type"], "function");
    assert!(deltas[0]["id"]
        .as_str()
        .unwrap_or("")
        .starts_with("chatcmpl-tool-"));
    let joined: String = deltas[1..]
        .iter()
        .filter_map(|d| d["function"]["arguments"].as_str())
        .collect();
    assert_eq!(joined, call["function"]["arguments"].as_str().unwrap_or(""));

    // after the tool result, auto answers in text
    let follow_up = json!({"model": "sim-model", "tools": tools, "tool_choice": "auto", "messages": [
        {"role": "user", "content": "please read_file the readme"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "# readme"}]});
    let (_, text) = post(&client, &sim, "/v1/chat/completions", &follow_up).await;
    assert_eq!(text["choices"][0]["finish_reason"], "stop");
    assert!(text["choices"][0]["message"]["content"]
        .as_str()
        .is_some_and(|c| !c.is_empty()));

    let schema = json!({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object",
        "required": ["ok", "items"], "properties": {"ok": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}}}}}});
    let body = json!({"model": "sim-model", "response_format": schema, "messages": [{"role": "user", "content": "json"}]});
    let (_, response) = post(&client, &sim, "/v1/chat/completions", &body).await;
    let parsed: Value = serde_json::from_str(
        response["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or(""),
    )
    .expect("JSON content");
    assert!(parsed["ok"].is_boolean());
    assert!(parsed["items"]
        .as_array()
        .is_some_and(|items| items.iter().all(|i| i == "a" || i == "b")));

    let mut short = chat("hello");
    short["max_tokens"] = json!(2);
    let (_, response) = post(&client, &sim, "/v1/chat/completions", &short).await;
    assert_eq!(response["choices"][0]["finish_reason"], "length");
    assert_eq!(response["usage"]["completion_tokens"], 2);

    let completion = json!({"model": "sim-model", "prompt": "once upon a time", "max_tokens": 3});
    let (status, response) = post(&client, &sim, "/v1/completions", &completion).await;
    assert_eq!(status, 200);
    assert_eq!(response["object"], "text_completion");
    assert_eq!(response["usage"]["prompt_tokens"], 4);
    sim.shutdown().await;
}

#[tokio::test]
async fn errors_use_the_engine_shapes() {
    let client = reqwest::Client::new();
    let sim = start(SimConfig {
        max_body_bytes: 2048,
        kv_blocks: 8,
        block_size: 16,
        ..config()
    })
    .await;
    let url = format!("{}/v1/chat/completions", sim.base_url());
    let response = client
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.expect("json error");
    assert_eq!(body["error"]["code"], 400);
    assert_eq!(body["error"]["type"], "BadRequestError");

    let (status, body) = post(
        &client,
        &sim,
        "/v1/chat/completions",
        &json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!((status, body["error"]["code"].as_u64()), (404, Some(404)));

    let huge = json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]});
    let (status, _) = post(&client, &sim, "/v1/chat/completions", &huge).await;
    assert_eq!(status, 413);

    let too_long: String = (0..200).map(|i| format!("w{i} ")).collect();
    let (status, body) = post(
        &client,
        &sim,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": too_long}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("maximum context length is 128 tokens"));

    let sglang = start(SimConfig {
        flavor: Flavor::Sglang,
        ..config()
    })
    .await;
    let (status, body) = post(
        &client,
        &sglang,
        "/v1/chat/completions",
        &json!({"messages": "nope"}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["object"], "error");
    assert_eq!(body["code"], 400);
    sim.shutdown().await;
    sglang.shutdown().await;
}

#[tokio::test]
async fn vllm_prefill_decode_round_trip_and_failed_transfer() {
    let client = reqwest::Client::new();
    let prefill = start(SimConfig {
        role: Role::Prefill,
        ..config()
    })
    .await;
    let decode = start(SimConfig {
        role: Role::Decode,
        ..config()
    })
    .await;
    let mut body = chat("disaggregate me");
    body["max_tokens"] = json!(1);
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let (status, prefilled) = post(&client, &prefill, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{prefilled}");
    let params = prefilled["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["remote_port"], prefill.addr().port());
    let blocks = params["remote_block_ids"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0);
    assert!(blocks > 20);

    let mut decode_body = chat("disaggregate me");
    decode_body["max_tokens"] = json!(8);
    decode_body["kv_transfer_params"] = params.clone();
    let (status, decoded) = post(&client, &decode, "/v1/chat/completions", &decode_body).await;
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(
        decoded["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(blocks as u64 * 16)
    );
    assert_eq!(decoded["usage"]["completion_tokens"], 8);

    // the blocks were fetched once; fetching again fails like a lost transfer
    let (status, failed) = post(&client, &decode, "/v1/chat/completions", &decode_body).await;
    assert_eq!(status, 500, "{failed}");
    assert_eq!(failed["error"]["type"], "InternalServerError");

    // prefill replica gone
    prefill.shutdown().await;
    let (status, _) = post(&client, &decode, "/v1/chat/completions", &decode_body).await;
    assert_eq!(status, 500);
    decode.shutdown().await;
}

#[tokio::test]
async fn sglang_bootstrap_legs_meet_in_the_room() {
    let client = reqwest::Client::new();
    let sglang = SimConfig {
        flavor: Flavor::Sglang,
        ..config()
    };
    let prefill = start(SimConfig {
        role: Role::Prefill,
        ..sglang.clone()
    })
    .await;
    let decode = start(SimConfig {
        role: Role::Decode,
        kv_transfer_timeout_s: 2.0,
        ..sglang
    })
    .await;
    let mut body = chat("bootstrap me");
    body["max_tokens"] = json!(6);
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(prefill.addr().port());
    body["bootstrap_room"] = json!(42);
    // decode first: it must wait for the prefill leg of the same room
    let decode_leg = post(&client, &decode, "/v1/chat/completions", &body);
    let prefill_leg = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        post(&client, &prefill, "/v1/chat/completions", &body).await
    };
    let ((decode_status, decoded), (prefill_status, _)) = tokio::join!(decode_leg, prefill_leg);
    assert_eq!((decode_status, prefill_status), (200, 200), "{decoded}");
    assert!(
        decoded["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
            >= 400
    );
    assert_eq!(decoded["usage"]["completion_tokens"], 6);

    // a room whose prefill leg never comes fails after the transfer timeout
    body["bootstrap_room"] = json!(43);
    let (status, failed) = post(&client, &decode, "/v1/chat/completions", &body).await;
    assert_eq!(status, 500);
    assert_eq!(failed["object"], "error");
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test]
async fn faults_per_request_and_global() {
    let client = reqwest::Client::new();
    let sim = start(config()).await;
    let url = format!("{}/v1/chat/completions", sim.base_url());
    let response = client
        .post(&url)
        .header("x-sim-fault", "status=503")
        .json(&chat("x"))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 503);

    let mut streamed = chat("cut me");
    streamed["stream"] = json!(true);
    streamed["max_tokens"] = json!(20);
    streamed["ignore_eos"] = json!(true);
    let response = client
        .post(&url)
        .header("x-sim-fault", "cut_after=3")
        .json(&streamed)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    assert!(response.text().await.is_err(), "the stream is cut mid-way");

    let started = std::time::Instant::now();
    let response = client
        .post(&url)
        .header("x-sim-fault", "stall_ms=150")
        .json(&chat("stall"))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    assert!(started.elapsed() >= std::time::Duration::from_millis(150));

    let set = client
        .post(format!("{}/sim/faults", sim.base_url()))
        .json(&json!({"unhealthy": true, "status": 429}))
        .send()
        .await
        .expect("sent");
    assert_eq!(set.status(), 200);
    let health = client
        .get(format!("{}/health", sim.base_url()))
        .send()
        .await
        .expect("sent");
    assert_eq!(health.status(), 503);
    assert_eq!(
        client
            .post(&url)
            .json(&chat("x"))
            .send()
            .await
            .expect("sent")
            .status(),
        429
    );
    client
        .delete(format!("{}/sim/faults", sim.base_url()))
        .send()
        .await
        .expect("sent");
    assert_eq!(
        client
            .get(format!("{}/health", sim.base_url()))
            .send()
            .await
            .expect("sent")
            .status(),
        200
    );
    assert_eq!(
        client
            .post(&url)
            .json(&chat("x"))
            .send()
            .await
            .expect("sent")
            .status(),
        200
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn models_tokenize_and_reset() {
    let client = reqwest::Client::new();
    let sim = start(config()).await;
    let models: Value = client
        .get(format!("{}/v1/models", sim.base_url()))
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("json");
    assert_eq!(models["data"][0]["id"], "sim-model");
    let (_, tokens) = post(
        &client,
        &sim,
        "/tokenize",
        &json!({"prompt": "Hello, world!"}),
    )
    .await;
    assert_eq!(tokens["count"], 4);
    post(
        &client,
        &sim,
        "/v1/chat/completions",
        &chat("fill the cache"),
    )
    .await;
    assert!(!sim.cached_block_hashes().is_empty());
    let reset = client
        .post(format!("{}/reset_prefix_cache", sim.base_url()))
        .send()
        .await
        .expect("sent");
    assert_eq!(reset.status(), 200);
    assert!(sim.cached_block_hashes().is_empty());
    sim.shutdown().await;
}
