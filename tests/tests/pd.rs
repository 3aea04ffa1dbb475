//! End-to-end: prefill/decode pools over simulated vLLM (NIXL protocol) and SGLang (bootstrap
//! rooms) replicas. A long cold prompt is prefilled on a prefill replica and decoded from the
//! transferred KV cache; a cached or short one runs whole on its decode replica; a failed
//! prefill leg falls back to a local prefill, a failed KV transfer is retried once without
//! disaggregation, and the stored conversation keeps exactly one response per turn; a burst of
//! sub-agents sharing their parent's long prefix computes it about once while their decodes
//! spread over the decode replicas, whether a header names their parent or only the shared
//! prefix does; one found by its prefix stays its parent's sub-agent when `truncation: auto`
//! routes it again with a shortened history.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use agentgate::Gateway;
use agentgate_sessions::Store;
use agentgate_sim::{Flavor, Role, SimConfig, SimHandle};
use agentgate_tests::*;

/// A simulated replica with a KV cache large enough for a 100k-token prompt.
async fn sim(flavor: Flavor, role: Role, time_scale: f64) -> SimHandle {
    agentgate_sim::spawn(SimConfig {
        flavor,
        role,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        model: "sim-model".into(),
        kv_blocks: 32_768,
        time_scale,
        seed: Some(7),
        ..Default::default()
    })
    .await
    .expect("simulator starts")
}

fn flavor_name(flavor: Flavor) -> &'static str {
    match flavor {
        Flavor::Vllm => "vllm",
        Flavor::Sglang => "sglang",
    }
}

/// One endpoint table of the pool: (base URL, role, extra keys such as `bootstrap_port = 9`).
type Entry = (String, &'static str, String);

/// A `session` pool named `pd` over `entries`, with probes and scrapes off (the test decides
/// what is healthy) and `extra` TOML appended to the pool.
fn pd_config(flavor: Flavor, entries: &[Entry], extra: &str) -> String {
    let tables: Vec<String> = entries
        .iter()
        .map(|(url, role, more)| {
            let more = if more.is_empty() {
                String::new()
            } else {
                format!(", {more}")
            };
            format!("{{ url = \"{url}\", role = \"{role}\"{more} }}")
        })
        .collect();
    format!(
        "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
         [[pools]]\nname = \"pd\"\nmodel = \"sim-model\"\nflavor = \"{}\"\npolicy = \"session\"\n\
         endpoints = [{}]\n{extra}\n",
        flavor_name(flavor),
        tables.join(", ")
    )
}

/// `sim` as an endpoint of `role`; a prefill sim names its bootstrap port, which a simulated
/// SGLang replica serves on its HTTP port (SGLang's own default, 8998, is a listener of its own).
fn entry(sim: &SimHandle, role: &'static str) -> Entry {
    let more = match role {
        "prefill" => format!("bootstrap_port = {}", sim.addr().port()),
        _ => String::new(),
    };
    (sim.base_url(), role, more)
}

/// A prefill and a decode replica of `flavor` (no simulated delays) behind a gateway on
/// [`pd_config`] over them, in that order (`pd/0`, `pd/1`).
async fn prefill_decode_pair(flavor: Flavor) -> (SimHandle, SimHandle, Gateway) {
    let prefill = sim(flavor, Role::Prefill, 0.0).await;
    let decode = sim(flavor, Role::Decode, 0.0).await;
    let gw = start_gateway(&pd_config(
        flavor,
        &[entry(&prefill, "prefill"), entry(&decode, "decode")],
        "",
    ))
    .await;
    (prefill, decode, gw)
}

/// The value of one exact series (`name{labels}`) in `text`, 0 when absent.
fn series(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// `series` in `m` is `expected`; a failure shows the whole of `m`.
fn assert_series(m: &str, series_name: &str, expected: f64) {
    assert_eq!(series(m, series_name), expected, "{series_name} in\n{m}");
}

/// Prompt tokens a replica actually prefilled (not served from its cache or a transfer).
async fn computed(sim: &SimHandle) -> f64 {
    metric_sum(
        &metrics_text(&sim.base_url()).await,
        "agentgate_sim_prefill_tokens_computed_total",
    )
}

/// A prompt of `words` distinct words (the simulator counts one token per word).
fn long_text(tag: &str, words: usize) -> String {
    let mut s = String::with_capacity(words * 8);
    for i in 0..words {
        s.push_str(tag);
        s.push_str(&i.to_string());
        s.push(' ');
    }
    s
}

/// POST a non-streaming response; returns (the Response object, x-agentgate-endpoint).
async fn create(gw: &str, body: Value, headers: &[(&str, &str)]) -> (Value, String) {
    let mut request = reqwest::Client::new()
        .post(format!("{gw}/v1/responses"))
        .json(&body);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let resp = request.send().await.expect("request");
    let status = resp.status().as_u16();
    let served = served_endpoint(&resp);
    let value: Value = resp.json().await.expect("json body");
    assert_eq!(status, 200, "{value}");
    // Cut at max_output_tokens or not, the answer is whole and stored.
    assert!(
        value["status"] == "completed" || value["status"] == "incomplete",
        "{value}"
    );
    (value, served)
}

fn cached_tokens(response: &Value) -> u64 {
    response["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn input_tokens(response: &Value) -> u64 {
    response["usage"]["input_tokens"].as_u64().unwrap_or(0)
}

/// The roles of the messages the model saw for `id`, oldest first.
async fn conversation_roles(gw: &str, id: &str) -> Vec<String> {
    let page: Value = reqwest::get(format!(
        "{gw}/v1/responses/{id}/input_items?order=asc&limit=100"
    ))
    .await
    .expect("input items")
    .json()
    .await
    .expect("json");
    page["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter(|i| i["type"] == "message")
        .map(|i| i["role"].as_str().unwrap_or_default().to_string())
        .collect()
}

async fn long_prompt_is_split_and_a_cached_turn_stays_local(flavor: Flavor) {
    let (prefill, decode, gw) = prefill_decode_pair(flavor).await;
    let base = gw.base_url();
    let session = [("x-session-id", "long-1")];

    // A cold 6000-word prompt: prefilled on the prefill replica, decoded from the transfer.
    let (first, served) = create(
        &base,
        json!({"model": "sim-model", "input": long_text("w", 6000), "max_output_tokens": 16}),
        &session,
    )
    .await;
    assert_eq!(served, "pd/1", "the decode replica streams the answer");
    let prompt = input_tokens(&first);
    assert!(prompt > 6000, "{prompt}");
    assert!(
        cached_tokens(&first) + 16 > prompt,
        "the decode engine reports the transferred prompt as cached: {first}"
    );
    let on_prefill = computed(&prefill).await;
    let on_decode = computed(&decode).await;
    assert!(on_prefill >= 6000.0, "{on_prefill}");
    assert!(on_decode < 16.0, "only the last partial block: {on_decode}");
    let m = metrics_text(&base).await;
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"disaggregated\",reason=\"uncached\"}",
        1.0,
    );
    assert_series(
        &m,
        "agentgate_pd_leg_duration_seconds_count{pool=\"pd\",leg=\"prefill\"}",
        1.0,
    );
    assert!(
        series(
            &m,
            "agentgate_endpoint_prefill_tokens_per_second{pool=\"pd\",endpoint=\"pd/0\"}"
        ) > 0.0,
        "the prefill leg was timed into the replica's throughput: {m}"
    );
    assert_series(
        &m,
        "agentgate_pd_leg_duration_seconds_count{pool=\"pd\",leg=\"decode\"}",
        1.0,
    );

    // The next turn appends a few words to what the decode replica now holds: vLLM's decode
    // instance prefills them itself. An SGLang decode server cannot prefill at all: the turn is
    // split again, and the prefill replica, which holds the prefix too, computes only the new
    // words.
    let (second, served) = create(
        &base,
        json!({"model": "sim-model", "input": "and now briefly", "max_output_tokens": 16,
            "previous_response_id": first["id"]}),
        &session,
    )
    .await;
    assert_eq!(served, "pd/1");
    assert!(cached_tokens(&second) >= prompt - 16, "{second}");
    let (local, forced) = match flavor {
        Flavor::Vllm => {
            assert_eq!(
                computed(&prefill).await,
                on_prefill,
                "no second prefill leg"
            );
            let appended = computed(&decode).await - on_decode;
            assert!(
                appended < 64.0,
                "only the new turn was prefilled: {appended}"
            );
            (2.0, 0.0)
        }
        Flavor::Sglang => {
            let appended = computed(&prefill).await - on_prefill;
            assert!(
                appended > 0.0 && appended < 64.0,
                "only the new turn was prefilled, on the prefill replica: {appended}"
            );
            let on_decode = computed(&decode).await - on_decode;
            assert!(on_decode < 16.0, "only a last partial block: {on_decode}");
            (0.0, 2.0)
        }
    };
    let on_prefill = computed(&prefill).await;

    // A short prompt in a new session is below the threshold: local too (split on SGLang).
    create(
        &base,
        json!({"model": "sim-model", "input": "hello there", "max_output_tokens": 16}),
        &[("x-session-id", "short-1")],
    )
    .await;
    assert_eq!(
        computed(&prefill).await > on_prefill,
        flavor == Flavor::Sglang
    );
    let m = metrics_text(&base).await;
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"local\",reason=\"cached\"}",
        local,
    );
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"disaggregated\",reason=\"decode_only_endpoint\"}",
        forced,
    );
    assert_eq!(
        conversation_roles(&base, second["id"].as_str().unwrap()).await,
        ["user", "assistant", "user"]
    );
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_long_prompt_is_split_and_a_cached_turn_stays_local() {
    long_prompt_is_split_and_a_cached_turn_stays_local(Flavor::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_long_prompt_is_split_and_a_cached_turn_stays_local() {
    long_prompt_is_split_and_a_cached_turn_stays_local(Flavor::Sglang).await;
}

/// Two turns of one conversation through a pool whose split requests fail in some way; each
/// turn still gets exactly one stored response, run whole by `runs_whole` (endpoint `name`).
/// Returns the gateway's metrics afterwards.
async fn two_turns_survive(base: &str, runs_whole: &SimHandle, name: &str) -> String {
    let session = [("x-session-id", "failing-1")];
    let (first, served) = create(
        base,
        json!({"model": "sim-model", "input": long_text("f", 4000), "max_output_tokens": 16}),
        &session,
    )
    .await;
    assert_eq!(served, name);
    assert!(
        computed(runs_whole).await >= 4000.0,
        "{name} prefilled the prompt itself"
    );
    let (second, _) = create(
        base,
        json!({"model": "sim-model", "input": long_text("g", 4000), "max_output_tokens": 16,
            "previous_response_id": first["id"]}),
        &session,
    )
    .await;
    assert_eq!(
        conversation_roles(base, second["id"].as_str().unwrap()).await,
        ["user", "assistant", "user"],
        "one stored response per turn, nothing lost or repeated"
    );
    metrics_text(base).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_replica_gone_falls_back_to_a_local_prefill() {
    let (prefill, decode, gw) = prefill_decode_pair(Flavor::Vllm).await;
    prefill.shutdown().await;
    let m = two_turns_survive(&gw.base_url(), &decode, "pd/1").await;
    assert_series(
        &m,
        "agentgate_pd_fallbacks_total{pool=\"pd\",cause=\"prefill_failed\"}",
        2.0,
    );
    assert_eq!(metric_sum(&m, "agentgate_pd_transfer_failures_total"), 0.0);
    assert!(
        series(
            &m,
            "agentgate_endpoint_prefill_tokens_per_second{pool=\"pd\",endpoint=\"pd/1\"}"
        ) > 0.0,
        "the decode replica's local prefills were timed into its throughput: {m}"
    );
    gw.shutdown().await;
    decode.shutdown().await;
}

/// POST a non-streaming response that must fail: its status and error object.
async fn create_failing(gw: &str, body: Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{gw}/v1/responses"))
        .json(&body)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    let value: Value = resp.json().await.expect("json body");
    (status, value["error"].clone())
}

/// A prompt over the engines' context window, which SGLang reports inside the streams it
/// started, is the client's `context_length_exceeded` (so `truncation: auto` can shorten it),
/// not a lost KV transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_split_over_the_context_window_is_context_length_exceeded() {
    let small = |role| {
        agentgate_sim::spawn(SimConfig {
            flavor: Flavor::Sglang,
            role,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "sim-model".into(),
            time_scale: 0.0,
            max_model_len: Some(3000),
            ..Default::default()
        })
    };
    let prefill = small(Role::Prefill).await.unwrap();
    let decode = small(Role::Decode).await.unwrap();
    let gw = start_gateway(&pd_config(
        Flavor::Sglang,
        &[entry(&prefill, "prefill"), entry(&decode, "decode")],
        "",
    ))
    .await;
    let body =
        json!({"model": "sim-model", "input": long_text("o", 4000), "max_output_tokens": 16});
    let (status, error) = create_failing(&gw.base_url(), body.clone()).await;
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["code"], "context_length_exceeded", "{error}");
    let m = metrics_text(&gw.base_url()).await;
    assert_series(
        &m,
        "agentgate_pd_transfer_failures_total{pool=\"pd\",prefill=\"pd/0\",decode=\"pd/1\"}",
        0.0,
    );
    // With `truncation: auto` the history is cut to fit instead.
    let mut body = body;
    body["input"] = json!([
        {"role": "user", "content": long_text("a", 2000)},
        {"role": "assistant", "content": long_text("b", 2000)},
        {"role": "user", "content": "and now?"},
    ]);
    body["truncation"] = json!("auto");
    let (response, _) = create(&gw.base_url(), body, &[]).await;
    assert_eq!(response["error"], Value::Null, "{response}");
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// An SGLang decode server cannot prefill: when the prefill leg fails, the turn runs whole on
/// an endpoint that can (role `both`), never on the decode server; with none, the client gets
/// the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_failing_prefill_replica_falls_back_to_an_endpoint_that_runs_it_whole() {
    // The prefill engine refuses every leg; the decode engine, waiting in the bootstrap room,
    // is abandoned rather than left to time out.
    sglang_prefill_failing_with(json!({"status": 503}), "503").await;
}

/// The same when the prefill engine reports its failure inside the stream it started (200,
/// then an abort with nothing in it), as SGLang does for a request it aborts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_leg_failing_in_its_stream_falls_back_too() {
    sglang_prefill_failing_with(json!({"abort_after": 0}), "prefill leg failed").await;
}

async fn sglang_prefill_failing_with(fault: Value, reported: &str) {
    let prefill = sim(Flavor::Sglang, Role::Prefill, 0.0).await;
    let decode = sim(Flavor::Sglang, Role::Decode, 0.0).await;
    let whole = sim(Flavor::Sglang, Role::Both, 0.0).await;
    set_sim_fault(&prefill, fault).await;
    let gw = start_gateway(&pd_config(
        Flavor::Sglang,
        &[
            entry(&prefill, "prefill"),
            entry(&decode, "decode"),
            entry(&whole, "both"),
        ],
        "",
    ))
    .await;
    // The session was served by the decode server before: its first turn goes there, is split,
    // and falls back. Its second turn follows the pin to the `both` endpoint, which runs
    // requests whole whatever their prompt.
    let pin = agentgate_sessions::SessionPin {
        endpoint: "pd/1".into(),
        moves: 0,
        url: Some(decode.base_url()),
    };
    gw.state()
        .store
        .swap_pin("pd", "h:failing-1", None, &pin)
        .await
        .unwrap();
    let m = two_turns_survive(&gw.base_url(), &whole, "pd/2").await;
    assert_series(
        &m,
        "agentgate_pd_fallbacks_total{pool=\"pd\",cause=\"prefill_failed\"}",
        1.0,
    );
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"local\",reason=\"runs_whole\"}",
        1.0,
    );
    if reported == "503" {
        assert_eq!(computed(&prefill).await, 0.0, "refused before it ran");
    }
    assert_eq!(
        computed(&decode).await,
        0.0,
        "nothing ran on the decode server"
    );
    gw.shutdown().await;

    // Prefill and decode servers only: the prefill leg's failure is the answer.
    let gw = start_gateway(&pd_config(
        Flavor::Sglang,
        &[entry(&prefill, "prefill"), entry(&decode, "decode")],
        "",
    ))
    .await;
    let body = json!({"model": "sim-model", "input": "hello there", "max_output_tokens": 16});
    let (status, error) = create_failing(&gw.base_url(), body).await;
    assert_eq!(status, 502, "{error}");
    assert!(
        error["message"].as_str().unwrap().contains(reported),
        "{error}"
    );
    assert_eq!(computed(&decode).await, 0.0);
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
    whole.shutdown().await;
}

/// A simulated vLLM decode replica (`pd/1`) behind a gateway whose prefill endpoint (`pd/0`)
/// is `prefill` (a fake engine's URL).
async fn vllm_decode_behind(prefill: String) -> (SimHandle, Gateway) {
    let decode = sim(Flavor::Vllm, Role::Decode, 0.0).await;
    let gw = start_gateway(&pd_config(
        Flavor::Vllm,
        &[
            (prefill, "prefill", String::new()),
            entry(&decode, "decode"),
        ],
        "",
    ))
    .await;
    (decode, gw)
}

/// A port nothing listens on.
/// A vLLM prefill engine whose KV connector hands out blocks nobody can fetch: every prefill
/// leg answers with `kv_transfer_params` pointing at `dead_port`, where nothing listens. Anything else gets 404.
async fn lost_transfer_prefill_engine(dead_port: u16) -> String {
    fake_prefill_engine(json!({
        "id": "chatcmpl-lost", "object": "chat.completion", "model": "sim-model",
        "choices": [{"index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": "x"}}],
        "usage": {"prompt_tokens": 4000, "completion_tokens": 1, "total_tokens": 4001},
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "gone", "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1", "remote_port": dead_port, "tp_size": 1}
    }))
    .await
}

/// An engine that answers every `POST /v1/chat/completions` with `answer` (anything else gets
/// 404).
async fn fake_prefill_engine(answer: Value) -> String {
    let answer = answer.to_string();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 65536];
                // Read the head, then as many body bytes as it announces.
                let (head_end, length) = loop {
                    let Ok(n) = socket.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        break (end + 4, length);
                    }
                };
                while buf.len() < head_end + length {
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
                let (status, body) = if head.starts_with("POST /v1/chat/completions") {
                    ("200 OK", answer)
                } else {
                    ("404 Not Found", "{}".to_string())
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    format!("http://{addr}")
}

/// Both turns of [`two_turns_survive`] lost their KV transfer from `pd/0` to `pd/1` and were
/// retried once without disaggregation.
fn assert_transfer_retried(m: &str) {
    assert_series(
        m,
        "agentgate_pd_transfer_failures_total{pool=\"pd\",prefill=\"pd/0\",decode=\"pd/1\"}",
        2.0,
    );
    assert_series(
        m,
        "agentgate_pd_fallbacks_total{pool=\"pd\",cause=\"transfer_failed\"}",
        2.0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_lost_kv_transfer_is_retried_once_without_disaggregation() {
    let (_closed, dead_port) = closed_port();
    let prefill = lost_transfer_prefill_engine(dead_port).await;
    let (decode, gw) = vllm_decode_behind(prefill).await;
    let m = two_turns_survive(&gw.base_url(), &decode, "pd/1").await;
    assert_transfer_retried(&m);
    gw.shutdown().await;
    decode.shutdown().await;
}

/// A decode leg that fails in its stream before its first token (vLLM with
/// `kv_load_failure_policy: fail` ends a request whose blocks it could not load) lost its KV
/// transfer: the request is retried once without disaggregation, on the decode replica, not
/// split again with another prefill replica. (The simulated leg fails after its blocks
/// arrived, so the retry finds them cached.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_lost_in_the_decode_stream_is_retried_once_without_disaggregation() {
    let prefills = [
        sim(Flavor::Vllm, Role::Prefill, 0.0).await,
        sim(Flavor::Vllm, Role::Prefill, 0.0).await,
    ];
    let decode = sim(Flavor::Vllm, Role::Decode, 0.0).await;
    let gw = start_gateway(&pd_config(
        Flavor::Vllm,
        &[
            entry(&prefills[0], "prefill"),
            entry(&prefills[1], "prefill"),
            entry(&decode, "decode"),
        ],
        "",
    ))
    .await;
    // The decode replica's first request (the split's decode leg) ends before its first token.
    set_sim_fault(&decode, json!({"abort_after": 0, "times": 1})).await;
    let (response, served) = create(
        &gw.base_url(),
        json!({"model": "sim-model", "input": long_text("t", 6000), "max_output_tokens": 16}),
        &[("x-session-id", "lost-in-stream")],
    )
    .await;
    assert_eq!(response["error"], Value::Null, "{response}");
    assert_eq!(served, "pd/2");
    let prompt = input_tokens(&response) as f64;
    let on_prefill = computed(&prefills[0]).await + computed(&prefills[1]).await;
    assert!(
        on_prefill < 1.5 * prompt,
        "prefilled once remotely, not split again: {on_prefill} of {prompt}"
    );
    let m = metrics_text(&gw.base_url()).await;
    assert_series(
        &m,
        "agentgate_pd_fallbacks_total{pool=\"pd\",cause=\"transfer_failed\"}",
        1.0,
    );
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"local\",reason=\"transfer_failed\"}",
        1.0,
    );
    gw.shutdown().await;
    for sim in prefills {
        sim.shutdown().await;
    }
    decode.shutdown().await;
}

/// A prefill leg whose one token ended the answer (a stop token) hands over no blocks, as vLLM
/// does (`kv_transfer_params: null`): the decode replica runs the request itself, and nothing
/// failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_that_finished_the_answer_hands_the_request_to_the_decode_replica() {
    let prefill = fake_prefill_engine(json!({
        "id": "chatcmpl-stop", "object": "chat.completion", "model": "sim-model",
        "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": ""}}],
        "usage": {"prompt_tokens": 6000, "completion_tokens": 1, "total_tokens": 6001},
        "kv_transfer_params": null
    }))
    .await;
    let (decode, gw) = vllm_decode_behind(prefill).await;
    let (response, served) = create(
        &gw.base_url(),
        json!({"model": "sim-model", "input": long_text("s", 6000), "max_output_tokens": 16}),
        &[],
    )
    .await;
    assert_eq!(response["error"], Value::Null, "{response}");
    assert_eq!(served, "pd/1");
    let m = metrics_text(&gw.base_url()).await;
    assert_series(
        &m,
        "agentgate_pd_fallbacks_total{pool=\"pd\",cause=\"prefill_failed\"}",
        0.0,
    );
    gw.shutdown().await;
    decode.shutdown().await;
}

/// A lost SGLang KV transfer is not retried on the decode server alone (it cannot prefill):
/// with no endpoint that runs requests whole, the client gets the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_lost_kv_transfer_fails_the_turn_when_no_endpoint_can_run_it_whole() {
    let prefill = sim(Flavor::Sglang, Role::Prefill, 0.0).await;
    let decode = sim(Flavor::Sglang, Role::Decode, 0.0).await;
    // The configured bootstrap port is wrong: the prefill leg runs, the decode engine cannot
    // fetch its KV cache.
    let (_closed, dead_port) = closed_port();
    let wrong = format!("bootstrap_port = {dead_port}");
    let gw = start_gateway(&pd_config(
        Flavor::Sglang,
        &[
            (prefill.base_url(), "prefill", wrong),
            entry(&decode, "decode"),
        ],
        "",
    ))
    .await;
    let base = gw.base_url();
    let body =
        json!({"model": "sim-model", "input": long_text("f", 4000), "max_output_tokens": 16});
    let (status, error) = create_failing(&base, body).await;
    assert_eq!(status, 502, "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("KV transfer"),
        "{error}"
    );
    let m = metrics_text(&base).await;
    assert_series(
        &m,
        "agentgate_pd_transfer_failures_total{pool=\"pd\",prefill=\"pd/0\",decode=\"pd/1\"}",
        1.0,
    );
    assert!(
        computed(&prefill).await >= 4000.0,
        "the prefill leg itself ran"
    );
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// Requests each decode endpoint served, from the gateway's routing decisions.
fn served_by(metrics: &str, endpoints: &[&str]) -> BTreeMap<String, f64> {
    endpoints
        .iter()
        .map(|e| {
            let prefix =
                format!("agentgate_routing_decisions_total{{pool=\"pd\",endpoint=\"{e}\",");
            let n: f64 = metrics
                .lines()
                .filter(|l| l.starts_with(&prefix))
                .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
                .sum();
            (e.to_string(), n)
        })
        .collect()
}

/// How the ten sub-agents of [`sub_agents_share_their_parents_prefill`] are told apart from
/// new sessions.
#[derive(Clone, Copy, PartialEq)]
enum ParentNamed {
    /// By the `x-agentgate-parent-session` header.
    ByHeader,
    /// By nothing but the prefix they share with the parent.
    ByPrefixOnly,
}

async fn sub_agents_share_their_parents_prefill(flavor: Flavor, named: ParentNamed) {
    const PARENT_WORDS: usize = 100_000;
    const CHILDREN: usize = 10;
    // Slow enough that the sub-agents' decodes overlap, fast enough to run in seconds.
    let scale = 0.02;
    let prefills = [
        sim(flavor, Role::Prefill, scale).await,
        sim(flavor, Role::Prefill, scale).await,
    ];
    let decodes = [
        sim(flavor, Role::Decode, scale).await,
        sim(flavor, Role::Decode, scale).await,
    ];
    let entries = [
        entry(&prefills[0], "prefill"),
        entry(&prefills[1], "prefill"),
        entry(&decodes[0], "decode"),
        entry(&decodes[1], "decode"),
    ];
    let gw = start_gateway(&pd_config(flavor, &entries, "")).await;
    let base = gw.base_url();
    let context = long_text("ctx", PARENT_WORDS);

    // The parent's turn: 100k cold tokens, prefilled once on a prefill replica.
    let (parent, _) = create(
        &base,
        json!({"model": "sim-model", "max_output_tokens": 16,
            "input": [{"role": "user", "content": context}]}),
        &[("x-session-id", "parent-1")],
    )
    .await;
    assert!(input_tokens(&parent) >= PARENT_WORDS as u64);
    let mut before = 0.0;
    for s in prefills.iter().chain(&decodes) {
        before += computed(s).await;
    }
    assert!(before >= PARENT_WORDS as f64, "{before}");
    let decoded_before = served_by(&metrics_text(&base).await, &["pd/2", "pd/3"]);

    // Ten sub-agents at once, each with the parent's context and a task of its own.
    let calls = (0..CHILDREN).map(|i| {
        let base = base.clone();
        let context = context.clone();
        async move {
            let own = format!("child-{i}");
            let mut headers = vec![("x-session-id", own.as_str())];
            if named == ParentNamed::ByHeader {
                headers.push(("x-agentgate-parent-session", "parent-1"));
            }
            create(
                &base,
                json!({"model": "sim-model", "max_output_tokens": 32, "input": [
                    {"role": "user", "content": context},
                    {"role": "user", "content": format!("sub-task {i}: check module {i} and report")}
                ]}),
                &headers,
            )
            .await
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    for (answer, _) in &answers {
        assert!(input_tokens(answer) >= PARENT_WORDS as u64);
    }
    let mut after = 0.0;
    for s in prefills.iter().chain(&decodes) {
        after += computed(s).await;
    }
    let children = after - before;
    assert!(
        children < 0.2 * PARENT_WORDS as f64,
        "the shared prefix was computed about once, not {CHILDREN} times: the sub-agents \
         prefilled {children} tokens on top of the parent's {before}"
    );
    let m = metrics_text(&base).await;
    let decoded = served_by(&m, &["pd/2", "pd/3"]);
    let per_endpoint: Vec<f64> = decoded.iter().map(|(e, n)| n - decoded_before[e]).collect();
    assert_eq!(per_endpoint.iter().sum::<f64>(), CHILDREN as f64, "{m}");
    assert!(
        per_endpoint.iter().all(|&n| n >= 2.0),
        "the sub-agents' decodes spread over the decode pool: {per_endpoint:?}"
    );
    let source = match named {
        ParentNamed::ByHeader => "header",
        ParentNamed::ByPrefixOnly => "prefix",
    };
    assert_series(
        &m,
        &format!("agentgate_pd_sub_agent_calls_total{{pool=\"pd\",source=\"{source}\"}}"),
        CHILDREN as f64,
    );
    assert_eq!(
        metric_sum(&m, "agentgate_pd_sub_agent_calls_total"),
        CHILDREN as f64,
        "the parent is no sub-agent: {m}"
    );
    if named == ParentNamed::ByPrefixOnly {
        // The parent's next turn (pinned), and a client resending the parent's context
        // without naming any session (its only key is its own response id): neither is a
        // sub-agent.
        create(
            &base,
            json!({"model": "sim-model", "max_output_tokens": 16,
                "previous_response_id": parent["id"], "input": "and the summary?"}),
            &[("x-session-id", "parent-1")],
        )
        .await;
        create(
            &base,
            json!({"model": "sim-model", "max_output_tokens": 16, "input": [
                {"role": "user", "content": context},
                {"role": "user", "content": "a turn of a client that names no session"}
            ]}),
            &[],
        )
        .await;
        let m = metrics_text(&base).await;
        assert_eq!(
            metric_sum(&m, "agentgate_pd_sub_agent_calls_total"),
            CHILDREN as f64,
            "{m}"
        );
    }
    gw.shutdown().await;
    for s in prefills.into_iter().chain(decodes) {
        s.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_sub_agents_share_their_parents_prefill() {
    sub_agents_share_their_parents_prefill(Flavor::Vllm, ParentNamed::ByHeader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_sub_agents_share_their_parents_prefill() {
    sub_agents_share_their_parents_prefill(Flavor::Sglang, ParentNamed::ByHeader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_sub_agents_naming_no_parent_are_found_by_their_shared_prefix() {
    sub_agents_share_their_parents_prefill(Flavor::Vllm, ParentNamed::ByPrefixOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agent_follows_its_parents_prefill_pin_when_the_prefix_index_has_forgotten() {
    const PARENT_WORDS: usize = 20_000;
    let prefills = [
        sim(Flavor::Vllm, Role::Prefill, 0.0).await,
        sim(Flavor::Vllm, Role::Prefill, 0.0).await,
    ];
    let decode = sim(Flavor::Vllm, Role::Decode, 0.0).await;
    let entries = [
        entry(&prefills[0], "prefill"),
        entry(&prefills[1], "prefill"),
        entry(&decode, "decode"),
    ];
    // The stranger below shares the sub-agent's whole prompt with an active session: by
    // prefix it would be a sub-agent too. Only headers name parents here.
    let gw = start_gateway(&pd_config(
        Flavor::Vllm,
        &entries,
        "[pools.disaggregation]\nparent_by_prefix = false\n",
    ))
    .await;
    let base = gw.base_url();
    let context = long_text("p", PARENT_WORDS);
    create(
        &base,
        json!({"model": "sim-model", "max_output_tokens": 16,
            "input": [{"role": "user", "content": context}]}),
        &[("x-session-id", "parent-2")],
    )
    .await;
    let parents = if computed(&prefills[0]).await > 0.0 {
        0
    } else {
        1
    };
    let other = 1 - parents;
    assert!(computed(&prefills[parents]).await >= PARENT_WORDS as f64);

    // This gateway's prefix index forgets everything (as another gateway replica's never knew:
    // pins live in the shared store, the index in each process), and the parent's prefill
    // replica is a little busier than the other one.
    let pool = gw.state().pools.for_model("sim-model").unwrap();
    let forget = || {
        let index = pool.picker.prefix_index().unwrap();
        for slot in 0..3 {
            index.clear(slot);
        }
    };
    forget();
    let _busy = pool.endpoints()[parents].begin(1_000, 1_000);
    let child = |session: &'static str, parent: Option<&'static str>| {
        let mut headers = vec![("x-session-id", session)];
        headers.extend(parent.map(|p| ("x-agentgate-parent-session", p)));
        let body = json!({"model": "sim-model", "max_output_tokens": 16, "input": [
            {"role": "user", "content": context},
            {"role": "user", "content": format!("sub-task of {session}")}
        ]});
        let base = base.clone();
        async move { create(&base, body, &headers).await }
    };

    // The sub-agent prefills where its parent's prefill pin points: the prefix is reused.
    child("child-a", Some("parent-2")).await;
    assert!(
        computed(&prefills[parents]).await < (PARENT_WORDS + 200) as f64,
        "the parent's prefill replica computed only the sub-agent's own suffix"
    );
    assert_eq!(computed(&prefills[other]).await, 0.0);

    // The same prompt from an unrelated session goes by load to the idle replica and pays for
    // the whole prefix there: the pin, not luck, placed the sub-agent.
    forget();
    child("stranger", None).await;
    assert!(computed(&prefills[other]).await >= PARENT_WORDS as f64);
    let m = metrics_text(&base).await;
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"disaggregated\",reason=\"sub_agent\"}",
        1.0,
    );
    gw.shutdown().await;
    for s in prefills.into_iter().chain([decode]) {
        s.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agent_found_by_prefix_keeps_its_parent_when_truncation_retries() {
    const MAX_LEN: usize = 12_000;
    let small = |role| {
        agentgate_sim::spawn(SimConfig {
            role,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "sim-model".into(),
            kv_blocks: 4_096,
            max_model_len: Some(MAX_LEN),
            time_scale: 0.0,
            seed: Some(7),
            ..Default::default()
        })
    };
    let prefill = small(Role::Prefill).await.expect("simulator starts");
    let decode = small(Role::Decode).await.expect("simulator starts");
    let gw = start_gateway(&pd_config(
        Flavor::Vllm,
        &[entry(&prefill, "prefill"), entry(&decode, "decode")],
        "",
    ))
    .await;
    let base = gw.base_url();
    // The parent: two turns, about 10k tokens of context.
    let parent = [("x-session-id", "parent-3")];
    let (first, _) = create(
        &base,
        json!({"model": "sim-model", "max_output_tokens": 16, "input": long_text("a", 5_000)}),
        &parent,
    )
    .await;
    let (second, _) = create(
        &base,
        json!({"model": "sim-model", "max_output_tokens": 16,
            "previous_response_id": first["id"], "input": long_text("b", 5_000)}),
        &parent,
    )
    .await;
    let decisions = |m: &str, reason: &str| {
        series(
            m,
            &format!(
                "agentgate_pd_decisions_total{{pool=\"pd\",decision=\"disaggregated\",reason=\"{reason}\"}}"
            ),
        )
    };
    let before = metrics_text(&base).await;

    // A sub-agent forked from the parent's context, naming no parent: found by its prefix.
    // With its own task it outgrows the context, so truncation drops the middle of the
    // history and the call is routed again, still as the parent's sub-agent.
    let (child, _) = create(
        &base,
        json!({"model": "sim-model", "max_output_tokens": 16, "truncation": "auto",
            "previous_response_id": second["id"], "input": long_text("c", 3_000)}),
        &[("x-session-id", "child-3")],
    )
    .await;
    assert_eq!(child["truncation"], "auto");
    assert!(input_tokens(&child) < MAX_LEN as u64, "{child}");
    let after = metrics_text(&base).await;
    assert!(
        decisions(&after, "sub_agent") - decisions(&before, "sub_agent") >= 2.0,
        "the first attempt and at least one retry placed as a sub-agent:\n{after}"
    );
    assert_eq!(
        decisions(&after, "uncached"),
        decisions(&before, "uncached"),
        "the retry lost its parent:\n{after}"
    );
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// Poll the sum of `agentgate_endpoint_in_flight_requests` until `holds` accepts it, for at
/// most 15 s; fails the test with `what` otherwise.
async fn await_in_flight(base: &str, holds: impl Fn(f64) -> bool, what: &str) {
    let mut now = f64::NAN;
    for _ in 0..1500 {
        now = metric_sum(
            &metrics_text(base).await,
            "agentgate_endpoint_in_flight_requests",
        );
        if holds(now) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{what}: {now} requests in flight");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_background_response_stops_its_wait_for_the_prefill_leg() {
    let (prefill, decode, gw) = prefill_decode_pair(Flavor::Vllm).await;
    // The prefill replica holds its answer back for a minute.
    set_sim_fault(&prefill, json!({"stall_ms": 60_000})).await;
    let base = gw.base_url();
    let queued = json_body(
        reqwest::Client::new()
            .post(format!("{base}/v1/responses"))
            .json(
                &json!({"model": "sim-model", "input": long_text("w", 6000), "background": true}),
            ),
    )
    .await;
    let id = queued["id"].as_str().unwrap().to_string();
    // The decode endpoint and the prefill endpoint each count the request.
    await_in_flight(&base, |n| n > 0.0, "the run waits for its prefill leg").await;
    assert_eq!(cancel(&base, &id).await["status"], "cancelled");
    await_in_flight(
        &base,
        |n| n == 0.0,
        "the cancel ends the wait and frees the slots",
    )
    .await;
    assert_eq!(retrieve(&base, &id).await["status"], "cancelled");
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// While a split's prompt prefills on the prefill endpoint, the decode endpoint counts the
/// request in flight but not as prefilling (`[flow] max_prefilling_per_endpoint` limits the
/// prompts whose chunks compete for an engine's steps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_prompt_counts_as_prefilling_only_where_it_prefills() {
    for flavor in [Flavor::Vllm, Flavor::Sglang] {
        let (prefill, decode, gw) = prefill_decode_pair(flavor).await;
        set_sim_fault(&prefill, json!({"stall_ms": 60_000})).await;
        let base = gw.base_url();
        let queued = json_body(reqwest::Client::new().post(format!("{base}/v1/responses")).json(
            &json!({"model": "sim-model", "input": long_text("q", 6000), "background": true}),
        ))
        .await;
        let id = queued["id"].as_str().unwrap().to_string();
        await_in_flight(&base, |n| n >= 2.0, "both legs are under way").await;
        let pool = gw.state().pools.for_model("sim-model").unwrap();
        let endpoints = pool.endpoints();
        let by_url = |url: &str| {
            endpoints
                .iter()
                .find(|e| e.base_url.as_str().trim_end_matches('/') == url.trim_end_matches('/'))
                .unwrap()
                .clone()
        };
        let (p, d) = (by_url(&prefill.base_url()), by_url(&decode.base_url()));
        assert_eq!(p.prefilling_requests(), 1, "{flavor:?}");
        assert_eq!(d.prefilling_requests(), 0, "{flavor:?}");
        assert_eq!(d.in_flight_requests(), 1, "{flavor:?}");
        assert_eq!(cancel(&base, &id).await["status"], "cancelled");
        gw.shutdown().await;
        prefill.shutdown().await;
        decode.shutdown().await;
    }
}

/// A vLLM decode engine answers with its headers before it pulls the KV cache: a split whose
/// decode stream then breaks before the first token counts as a failed transfer (here no other
/// endpoint can take the request, so the client gets the failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_decode_stream_broken_before_its_first_token_counts_as_a_failed_transfer() {
    let (prefill, decode, gw) = prefill_decode_pair(Flavor::Vllm).await;
    set_sim_fault(&decode, json!({"cut_after": 0})).await;
    let base = gw.base_url();
    let body =
        json!({"model": "sim-model", "input": long_text("g", 4000), "max_output_tokens": 16});
    let (status, error) = create_failing(&base, body).await;
    assert!(status >= 500, "{status} {error}");
    let m = metrics_text(&base).await;
    assert_series(
        &m,
        "agentgate_pd_transfer_failures_total{pool=\"pd\",prefill=\"pd/0\",decode=\"pd/1\"}",
        1.0,
    );
    assert_series(
        &m,
        "agentgate_pd_decisions_total{pool=\"pd\",decision=\"disaggregated\",reason=\"uncached\"}",
        1.0,
    );
    gw.shutdown().await;
    prefill.shutdown().await;
    decode.shutdown().await;
}
