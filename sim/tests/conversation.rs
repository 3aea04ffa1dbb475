//! End to end over HTTP: a conversation's next turn hits the cache through the previous answer
//! (text, tool call, reasoning; instant and timed engines; streamed or not), and the simulator's
//! work counters add up.

use agentgate_sim::{spawn, Role, SimConfig, SimHandle};
use serde_json::{json, Value};

const BLOCK_SIZE: u64 = 16;

fn config(time_scale: f64) -> SimConfig {
    SimConfig {
        listen: "127.0.0.1:0".parse().expect("literal address"),
        time_scale,
        // fast simulated steps so a timed engine finishes a turn in a few wall milliseconds
        decode_ms_per_token: 1.0,
        prefill_tokens_per_s: 1_000_000.0,
        seed: Some(3),
        ..SimConfig::default()
    }
}

async fn start(config: SimConfig) -> SimHandle {
    spawn(config).await.expect("simulator starts")
}

async fn post(client: &reqwest::Client, sim: &SimHandle, body: &Value) -> Value {
    let response = client
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = response.status();
    let body: Value = response.json().await.expect("JSON body");
    assert!(status.is_success(), "{status}: {body}");
    body
}

/// The same request streamed, reassembled into a non-streaming shape (message and usage).
async fn post_streamed(client: &reqwest::Client, sim: &SimHandle, body: &Value) -> Value {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let text = client
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(&body)
        .send()
        .await
        .expect("request sent")
        .text()
        .await
        .expect("stream body");
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut call = json!(null);
    let mut arguments = String::new();
    let mut usage = json!(null);
    let mut finish = json!(null);
    for frame in text.split("\n\n").filter(|frame| !frame.is_empty()) {
        let data = frame.trim_start_matches("data: ");
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).expect("chunk is JSON");
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
        let choice = &chunk["choices"][0];
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or(""));
        reasoning.push_str(delta["reasoning"].as_str().unwrap_or(""));
        if let Some(tool) = delta["tool_calls"][0].as_object() {
            if tool.contains_key("id") {
                call = json!({"id": tool["id"], "type": "function",
                    "function": {"name": tool["function"]["name"]}});
            }
            arguments.push_str(tool["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning"] = json!(reasoning);
    }
    if !call.is_null() {
        call["function"]["arguments"] = json!(arguments);
        message["content"] = json!(null);
        message["tool_calls"] = json!([call]);
    }
    json!({"choices": [{"message": message, "finish_reason": finish}], "usage": usage})
}

fn usage(response: &Value) -> (u64, u64, u64) {
    let usage = &response["usage"];
    (
        usage["prompt_tokens"].as_u64().expect("prompt_tokens"),
        usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens"),
        // Left out when nothing was cached, as vLLM does.
        match &usage["prompt_tokens_details"] {
            Value::Null => 0,
            details => details["cached_tokens"].as_u64().expect("cached_tokens"),
        },
    )
}

/// The assistant message of a response as a client sends it back in the history.
fn answer(response: &Value) -> Value {
    let message = &response["choices"][0]["message"];
    let mut answer = json!({"role": "assistant", "content": message["content"]});
    if message["tool_calls"]
        .as_array()
        .is_some_and(|calls| !calls.is_empty())
    {
        answer["tool_calls"] = message["tool_calls"].clone();
    }
    if message["reasoning"].is_string() {
        answer["reasoning"] = message["reasoning"].clone();
    }
    answer
}

fn system_prompt() -> String {
    (0..120).map(|i| format!("guideline{i} ")).collect()
}

/// Turn 1, then turn 2 with the answer (and `follow_up`) appended: turn 2's cached tokens must be
/// exactly every full block of turn 1's prompt and output.
async fn assert_next_turn_hits_through_the_answer(
    client: &reqwest::Client,
    sim: &SimHandle,
    mut body: Value,
    follow_up: Value,
    streamed: bool,
) -> Value {
    let first = if streamed {
        post_streamed(client, sim, &body).await
    } else {
        post(client, sim, &body).await
    };
    let (prompt, output, _) = usage(&first);
    assert!(output >= 8, "a real answer: {first}");
    let messages = body["messages"].as_array_mut().expect("messages");
    messages.push(answer(&first));
    messages.push(follow_up);
    let second = post(client, sim, &body).await;
    let (prompt2, _, cached) = usage(&second);
    assert!(prompt2 > prompt + output, "turn 2 repeats turn 1: {second}");
    let full_blocks = (prompt + output) / BLOCK_SIZE * BLOCK_SIZE;
    assert_eq!(
        cached, full_blocks,
        "turn 2 reuses every full block of turn 1's prompt ({prompt}) and output ({output})"
    );
    assert!(cached >= prompt + output - BLOCK_SIZE);
    first
}

async fn conversation_reuses_answers(time_scale: f64, streamed: bool) {
    let client = reqwest::Client::new();
    let sim = start(config(time_scale)).await;

    // a text answer
    let body = json!({"model": "sim-model", "messages": [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": "explain the cache"}]});
    let follow_up = json!({"role": "user", "content": "and then?"});
    let first =
        assert_next_turn_hits_through_the_answer(&client, &sim, body, follow_up, streamed).await;
    assert_eq!(first["choices"][0]["finish_reason"], "stop");

    // a tool call answer, followed by the tool's result
    let tools = json!([{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "required": ["path", "lines"],
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1},
                       "ratio": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}}}}}]);
    let body = json!({"model": "sim-model", "tools": tools, "tool_choice": "auto", "messages": [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": "please read_file the readme"}]});
    let call = assert_next_turn_hits_through_the_answer(
        &client,
        &sim,
        body,
        json!({"role": "tool", "tool_call_id": "call-1", "content": "# readme"}),
        streamed,
    )
    .await;
    assert_eq!(call["choices"][0]["finish_reason"], "tool_calls");
    let arguments: Value = serde_json::from_str(
        call["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .expect("arguments"),
    )
    .expect("arguments are JSON");
    assert!(arguments["lines"].is_i64(), "{arguments}");

    // a reasoning answer sent back with its reasoning
    let body = json!({"model": "sim-model", "reasoning_effort": "low", "messages": [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": "think about it"}]});
    let thought = assert_next_turn_hits_through_the_answer(
        &client,
        &sim,
        body,
        json!({"role": "user", "content": "go on"}),
        streamed,
    )
    .await;
    assert!(thought["choices"][0]["message"]["reasoning"].is_string());

    // effort "none" turns thinking off
    let body = json!({"model": "sim-model", "reasoning_effort": "none", "stream": false,
        "messages": [{"role": "user", "content": "answer at once"}]});
    let plain = post(&client, &sim, &body).await;
    let message = &plain["choices"][0]["message"];
    assert!(message["reasoning"].is_null(), "{plain}");
    assert!(message["content"].is_string(), "{plain}");
    sim.shutdown().await;
}

#[tokio::test]
async fn next_turn_hits_through_the_answer_instantly() {
    conversation_reuses_answers(0.0, false).await;
}

#[tokio::test]
async fn next_turn_hits_through_the_answer_when_timed() {
    conversation_reuses_answers(0.001, false).await;
}

#[tokio::test]
async fn next_turn_hits_through_a_streamed_answer() {
    conversation_reuses_answers(0.0, true).await;
    conversation_reuses_answers(0.001, true).await;
}

#[tokio::test]
async fn an_answer_cut_by_max_tokens_is_reused_up_to_its_last_full_block() {
    let client = reqwest::Client::new();
    let sim = start(config(0.0)).await;
    let body = json!({"model": "sim-model", "max_tokens": 21, "messages": [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": "a long story"}]});
    let first = assert_next_turn_hits_through_the_answer(
        &client,
        &sim,
        body,
        json!({"role": "user", "content": "continue"}),
        false,
    )
    .await;
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["completion_tokens"], 21);
    sim.shutdown().await;
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
    assert!(text.contains(&format!("# TYPE {name} counter\n")), "{text}");
    text.lines()
        .find(|line| line.starts_with(name) && line.as_bytes().get(name.len()) == Some(&b'{'))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

const COMPUTED: &str = "agentgate_sim_prefill_tokens_computed_total";
const BUSY: &str = "agentgate_sim_engine_busy_seconds_total";

#[tokio::test]
async fn work_counters_count_uncached_prefill_and_busy_time() {
    let client = reqwest::Client::new();
    for time_scale in [0.0, 0.001] {
        let sim = start(config(time_scale)).await;
        assert_eq!(metric(&client, &sim, COMPUTED).await, 0.0);
        assert_eq!(metric(&client, &sim, BUSY).await, 0.0);
        let mut uncached = 0;
        for question in ["first", "second"] {
            let body = json!({"model": "sim-model", "max_tokens": 4, "messages": [
                {"role": "system", "content": system_prompt()},
                {"role": "user", "content": question}]});
            let (prompt, _, cached) = usage(&post(&client, &sim, &body).await);
            uncached += prompt - cached;
        }
        assert_eq!(metric(&client, &sim, COMPUTED).await, uncached as f64);
        let busy = metric(&client, &sim, BUSY).await;
        // per request: prefill at 1M tokens/s, then 3 decode steps of at least 1 ms after the first token
        assert!(busy >= 2.0 * 0.003, "busy {busy}");
        assert!(busy < 1.0, "busy {busy}");
        sim.shutdown().await;
    }
}

#[tokio::test]
async fn a_decode_leg_counts_transferred_blocks_as_cached() {
    let client = reqwest::Client::new();
    let prefill = start(SimConfig {
        role: Role::Prefill,
        ..config(0.0)
    })
    .await;
    let decode = start(SimConfig {
        role: Role::Decode,
        ..config(0.0)
    })
    .await;
    let messages = json!([{"role": "system", "content": system_prompt()},
        {"role": "user", "content": "split me"}]);
    let prefilled = post(
        &client,
        &prefill,
        &json!({"model": "sim-model", "messages": messages, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    let (prompt, _, _) = usage(&prefilled);
    assert_eq!(metric(&client, &prefill, COMPUTED).await, prompt as f64);
    let decoded = post(
        &client,
        &decode,
        &json!({"model": "sim-model", "messages": messages, "max_tokens": 8,
            "kv_transfer_params": prefilled["kv_transfer_params"]}),
    )
    .await;
    let (prompt, _, cached) = usage(&decoded);
    assert_eq!(cached, prompt / BLOCK_SIZE * BLOCK_SIZE);
    assert_eq!(
        metric(&client, &decode, COMPUTED).await,
        (prompt - cached) as f64
    );
    assert!(metric(&client, &decode, BUSY).await > 0.0);
    prefill.shutdown().await;
    decode.shutdown().await;
}
