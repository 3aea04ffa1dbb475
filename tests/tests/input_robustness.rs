//! End-to-end: no request body makes the gateway fail. Every value of a few valid requests
//! (Responses: a plain one, one with tools, structured output and a tool-call history, a
//! streamed one, a streamed compaction, one in a conversation; `/v1/responses/compact`; a new
//! conversation; items added to one) is replaced in turn by a value of every JSON type, and
//! every key is removed in turn. Each answer must be a success or a 4xx with an OpenAI-shaped error body (`message`,
//! `type`, `param` and `code` keys); never a 5xx, a dropped connection or a stream that ends
//! without a terminal event. The gateway still serves a plain request afterwards. Paths and
//! query strings that do not decode get the same error shape. Neither a client nor an engine
//! can hold a turn: a client that stops reading its stream is dropped, an engine that only
//! sends keep-alive comments times out, and a request without a valid key is refused before
//! its body is read. A connection that never completes a request's headers is closed.

use serde_json::{json, Value};

use agentgate_tests::*;

/// Values each field is replaced by: one of every JSON type, and the edges of the numbers
/// and strings a parser might trip on.
fn replacements() -> Vec<Value> {
    vec![
        Value::Null,
        json!(true),
        json!(0),
        json!(-1),
        json!(1e300),
        json!(u64::MAX),
        json!(0.5),
        json!(""),
        json!("x"),
        json!("\u{0}\u{202e}\u{fffd}"),
        json!([]),
        json!([null]),
        json!({}),
        json!({"type": "nope"}),
    ]
}

/// The JSON pointer of every value inside `v` (not `v` itself).
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                out.push(p.clone());
                pointers(child, p, out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                let p = format!("{at}/{i}");
                out.push(p.clone());
                pointers(child, p, out);
            }
        }
        _ => {}
    }
}

/// `base` with the value at `pointer` removed (an object's key, or an array's element).
fn without(base: &Value, pointer: &str) -> Value {
    let mut v = base.clone();
    let (parent, last) = pointer.rsplit_once('/').expect("a pointer below the root");
    match v.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.remove(&last.replace("~1", "/").replace("~0", "~"));
        }
        Some(Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>() {
                items.remove(i);
            }
        }
        _ => {}
    }
    v
}

/// Variants of `base`: each value replaced by each of [`replacements`], each key removed.
fn variants(base: &Value) -> Vec<(String, Value)> {
    let mut paths = Vec::new();
    pointers(base, String::new(), &mut paths);
    let mut out = Vec::new();
    for p in &paths {
        for r in replacements() {
            let mut v = base.clone();
            *v.pointer_mut(p).expect("pointer from the walk") = r.clone();
            out.push((format!("{p} = {r}"), v));
        }
        out.push((format!("{p} removed"), without(base, p)));
    }
    out
}

/// The requests the variants start from, with the path each is sent to (`conversation` is an
/// existing conversation's id). Each is answered 200 as it stands.
fn bases(conversation: &str) -> Vec<(String, Value)> {
    let responses = responses_bases();
    let history = responses[1]["input"].clone();
    let mut out: Vec<(String, Value)> = responses
        .into_iter()
        .map(|body| ("/v1/responses".to_string(), body))
        .collect();
    let mut compaction = history.clone();
    if let Some(items) = compaction.as_array_mut() {
        items.push(json!({"type": "compaction_trigger"}));
    }
    out.push((
        "/v1/responses".into(),
        json!({"model": "sim-model", "input": compaction, "stream": true}),
    ));
    out.push((
        "/v1/responses".into(),
        json!({"model": "sim-model", "input": "and then?", "conversation": conversation,
               "max_output_tokens": 16}),
    ));
    out.push((
        "/v1/responses/compact".into(),
        json!({"model": "sim-model", "input": history, "instructions": "Be brief."}),
    ));
    out.push((
        "/v1/conversations".into(),
        json!({"items": [{"type": "message", "role": "user", "content": "hi"}],
               "metadata": {"topic": "tests"}}),
    ));
    out.push((
        format!("/v1/conversations/{conversation}/items"),
        json!({"items": [{"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "more"}]}]}),
    ));
    out
}

/// The Responses requests among [`bases`].
fn responses_bases() -> Vec<Value> {
    let schema = json!({
        "type": "object",
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["path", "lines"],
        "additionalProperties": false
    });
    vec![
        json!({"model": "sim-model", "input": "say hello", "max_output_tokens": 16}),
        json!({
            "model": "sim-model",
            "instructions": "You are a careful coding agent.",
            "input": [
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "read src/main.rs"}]},
                {"type": "function_call", "call_id": "call_1", "name": "read_file",
                 "arguments": "{\"path\":\"src/main.rs\",\"lines\":40}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"}
            ],
            "tools": [{"type": "function", "name": "read_file", "description": "Read a file",
                       "parameters": schema, "strict": true}],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "summary", "strict": true,
                                "schema": {"type": "object",
                                           "properties": {"done": {"type": "boolean"}},
                                           "required": ["done"],
                                           "additionalProperties": false}}},
            "reasoning": {"effort": "low"},
            "temperature": 0.2,
            "top_p": 0.9,
            "max_output_tokens": 32,
            "metadata": {"ticket": "T-1"},
            "truncation": "disabled",
            "prompt_cache_key": "repo-1",
            "user": "dev-1",
            "service_tier": "flex",
            "store": true
        }),
        json!({"model": "sim-model", "input": "stream a line", "stream": true,
               "max_output_tokens": 16}),
    ]
}

/// What is wrong with one answer, if anything.
async fn check(resp: reqwest::Response) -> Result<(), String> {
    let status = resp.status().as_u16();
    let streamed = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let text = resp
        .text()
        .await
        .map_err(|e| format!("{status}: body cut off: {e}"))?;
    if status == 200 && streamed {
        let terminal = [
            "response.completed",
            "response.incomplete",
            "response.failed",
        ];
        let last = text
            .lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .next_back()
            .unwrap_or_default()
            .trim()
            .to_string();
        return match terminal.contains(&last.as_str()) {
            true => Ok(()),
            false => Err(format!("stream ended with {last:?}")),
        };
    }
    let body: Value =
        serde_json::from_str(&text).map_err(|e| format!("{status}: not JSON ({e}): {text}"))?;
    let objects = ["response", "response.compaction", "conversation", "list"];
    match status {
        200 if objects.contains(&body["object"].as_str().unwrap_or_default()) => Ok(()),
        400..=499 => {
            let error = &body["error"];
            let shaped = error["message"].as_str().is_some_and(|m| !m.is_empty())
                && error["type"].is_string()
                && error.get("param").is_some()
                && error.get("code").is_some();
            match shaped {
                true => Ok(()),
                false => Err(format!("{status}: not an OpenAI error body: {body}")),
            }
        }
        _ => Err(format!("{status}: {body}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_body_gets_a_5xx_or_a_broken_answer() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let client = reqwest::Client::new();
    let mut failures = Vec::new();
    let mut sent = 0;
    let conversation: Value = client
        .post(format!("{base}/v1/conversations"))
        .json(&json!({}))
        .send()
        .await
        .expect("a conversation")
        .json()
        .await
        .expect("its JSON");
    let conversation = conversation["id"].as_str().expect("its id").to_string();
    for (path, request) in bases(&conversation) {
        let resp = client
            .post(format!("{base}{path}"))
            .json(&request)
            .send()
            .await
            .expect("an answer");
        assert_eq!(
            resp.status(),
            200,
            "the base request is valid: {path} {request}"
        );
        check(resp)
            .await
            .expect("the base request is answered whole");
        for (what, body) in variants(&request) {
            sent += 1;
            let what = format!("{path} {what}");
            let resp = client
                .post(format!("{base}{path}"))
                .json(&body)
                .send()
                .await;
            let verdict = match resp {
                Ok(resp) => check(resp).await,
                Err(e) => Err(format!("no answer: {e}")),
            };
            if let Err(e) = verdict {
                failures.push(format!("{what}: {e}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {sent} variants failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Still serving.
    let resp = post_response(
        &base,
        &json!({"model": "sim-model", "input": "still there?", "max_output_tokens": 16}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urls_that_do_not_decode_get_openai_errors() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let created: Value = post_response(
        &base,
        &json!({"model": "sim-model", "input": "hello", "max_output_tokens": 16}),
    )
    .await
    .json()
    .await
    .expect("json body");
    let id = created["id"].as_str().expect("an id");
    let client = reqwest::Client::new();
    let cases = [
        (
            "GET",
            format!("/v1/responses/{id}?stream=true"),
            400,
            Some("stream"),
        ),
        (
            "GET",
            format!("/v1/responses/{id}?stream=maybe"),
            400,
            Some("stream"),
        ),
        (
            "GET",
            format!("/v1/responses/{id}?stream=true&starting_after=-1"),
            400,
            Some("starting_after"),
        ),
        (
            "GET",
            format!("/v1/responses/{id}?stream=a&stream=b"),
            400,
            None,
        ),
        (
            "GET",
            format!("/v1/responses/{id}/input_items?limit=1&limit=2"),
            400,
            None,
        ),
        (
            "GET",
            format!("/v1/responses/{id}/input_items?limit=0"),
            400,
            Some("limit"),
        ),
        (
            "GET",
            format!("/v1/responses/{id}/input_items?order=up"),
            400,
            Some("order"),
        ),
        ("GET", "/v1/responses/%FF".to_string(), 400, None),
        ("DELETE", "/v1/responses/%FF".to_string(), 400, None),
        (
            "GET",
            "/v1/responses/%FF/input_items".to_string(),
            400,
            None,
        ),
        ("POST", "/v1/responses/%FF/cancel".to_string(), 400, None),
        ("GET", "/v1/responses/resp_missing".to_string(), 404, None),
        ("PUT", "/v1/responses".to_string(), 405, None),
    ];
    for (method, path, status, param) in cases {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("a method");
        let resp = client
            .request(method.clone(), format!("{base}{path}"))
            .send()
            .await
            .expect("an answer");
        assert_eq!(resp.status().as_u16(), status, "{method} {path}");
        let body: Value = resp.json().await.unwrap_or_else(|e| {
            panic!("{method} {path}: not JSON ({e})");
        });
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty())
                && error["type"].is_string()
                && error.get("code").is_some(),
            "{method} {path}: {body}"
        );
        assert_eq!(error["param"].as_str(), param, "{method} {path}: {body}");
    }
    // A WebSocket upgrade on the create path (Codex's built-in provider tries one first) is
    // 426, on which Codex falls back to HTTP; a plain GET there stays 405.
    let plain = client
        .get(format!("{base}/v1/responses"))
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status().as_u16(), 405);
    let upgrade = client
        .get(format!("{base}/v1/responses"))
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .send()
        .await
        .unwrap();
    assert_eq!(upgrade.status().as_u16(), 426);
    let body: Value = upgrade.json().await.unwrap();
    assert_eq!(body["error"]["code"], "websocket_not_supported", "{body}");
    // `stream=false` is the plain retrieval.
    let resp = client
        .get(format!("{base}/v1/responses/{id}?stream=false"))
        .send()
        .await
        .expect("an answer");
    assert_eq!(resp.status(), 200);
    fleet.shutdown().await;
}

/// Read a request's head (and whatever body arrives with it); `false` when the connection
/// ends first.
async fn read_request_head(socket: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 1 << 16];
    let mut seen = Vec::new();
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    true
}

/// A fake engine on a free port: every connection gets `answer` (the raw HTTP response) after
/// its request head, then the connection closes.
async fn broken_engine(answer: &'static str) -> String {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                if !read_request_head(&mut socket).await {
                    return;
                }
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_answers_that_break_the_protocol_end_cleanly() {
    let sse = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let answers: Vec<(&str, String)> = vec![
        (
            "an HTML page with status 200",
            "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\nconnection: close\r\n\r\n<html>proxy error</html>".into(),
        ),
        (
            "a 500 with a plain-text body",
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 4\r\nconnection: close\r\n\r\noops".into(),
        ),
        ("an event stream that closes at once", sse.into()),
        (
            "an event stream of non-JSON data",
            format!("{sse}data: {{not json\n\ndata: [DONE]\n\n"),
        ),
        (
            "an event stream cut inside a chunk",
            format!("{sse}data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"hel"),
        ),
        (
            "a body shorter than its content-length",
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 500\r\nconnection: close\r\n\r\ndata: {}\n\n".into(),
        ),
        ("a status line that is not HTTP", "SSH-2.0-OpenSSH_9.6\r\n".into()),
    ];
    for (what, answer) in answers {
        let url = broken_engine(Box::leak(answer.into_boxed_str())).await;
        let gw = start_gateway(&format!(
            "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
             [[pools]]\nname = \"p\"\nmodel = \"sim-model\"\nendpoints = [\"{url}\"]\n"
        ))
        .await;
        let base = gw.base_url();
        // Not streamed: an OpenAI error, or a response object that says it failed.
        let resp = post_response(
            &base,
            &json!({"model": "sim-model", "input": "hi", "max_output_tokens": 16}),
        )
        .await;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or_else(|e| panic!("{what}: {e}"));
        let failed = body["status"] == "failed" && body["error"]["message"].is_string();
        let error = status >= 500 && body["error"]["message"].is_string();
        assert!(failed || error, "{what}: {status} {body}");
        // Streamed: the events end with response.failed (or an error answer before any).
        let resp = post_response(
            &base,
            &json!({"model": "sim-model", "input": "hi", "max_output_tokens": 16, "stream": true}),
        )
        .await;
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_else(|e| panic!("{what}: {e}"));
        if status == 200 {
            let last = text
                .lines()
                .filter_map(|l| l.strip_prefix("event: "))
                .next_back()
                .unwrap_or_default();
            assert_eq!(last.trim(), "response.failed", "{what}: {text}");
        } else {
            let body: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: {e}: {text}"));
            assert!(
                status >= 500 && body["error"]["message"].is_string(),
                "{what}: {status} {body}"
            );
        }
        gw.shutdown().await;
    }
}

/// Raw HTTP/1.1 on a fresh connection with a small receive buffer: `head` (request line and
/// headers, without the blank line) and `body`.
async fn raw_request(base: &str, head: &str, body: &[u8]) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr: std::net::SocketAddr = base
        .trim_start_matches("http://")
        .parse()
        .expect("a loopback address");
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    stream
        .write_all(format!("{head}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    stream.write_all(body).await.unwrap();
    stream
}

#[tokio::test]
async fn a_connection_that_never_finishes_its_request_headers_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = start_sim("sim-model").await;
    let gw = start_gateway(&config_toml(
        &[sim.base_url()],
        None,
        "[server]\nheader_read_timeout_s = 0.2\n",
    ))
    .await;
    let base = gw.base_url();
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    // One connection sends half a request head and stops; another sends nothing at all (an
    // idle keep-alive connection, or a client gone without closing it).
    let mut partial = tokio::net::TcpStream::connect(addr).await.unwrap();
    partial
        .write_all(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    for stream in [&mut partial, &mut silent] {
        let mut seen = Vec::new();
        let closed = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            stream.read_to_end(&mut seen),
        )
        .await;
        // Closed (after a 408 or nothing at all), not left open.
        assert!(
            matches!(closed, Ok(Ok(_)) | Ok(Err(_))),
            "the connection stays open"
        );
        let text = String::from_utf8_lossy(&seen);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 408"),
            "{text}"
        );
    }
    // Complete requests are served as before.
    let resp = post_response(&base, &json!({"model": "sim-model", "input": "hi"})).await;
    assert_eq!(resp.status(), 200);
}

/// Read from `stream` until `until` holds for what was read; fails on end of stream.
async fn read_until(stream: &mut tokio::net::TcpStream, until: impl Fn(&str) -> bool) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !until(&String::from_utf8_lossy(&seen)) {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// A replica whose answers are 10k-30k tokens, streamed fast (megabytes of events, far more
/// than a connection's buffers hold), behind a gateway with small socket buffers that drops
/// clients leaving their events unread for `stall_s`.
async fn long_answers(stall_s: f64) -> (agentgate_sim::SimHandle, agentgate::Gateway) {
    long_answers_paced(stall_s, 0.01).await
}

/// [`long_answers`] decoding `decode_ms` real milliseconds per token.
async fn long_answers_paced(
    stall_s: f64,
    decode_ms: f64,
) -> (agentgate_sim::SimHandle, agentgate::Gateway) {
    let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        model: "sim-model".into(),
        default_output_tokens: 20_000,
        decode_ms_per_token: decode_ms,
        time_scale: 1.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = start_gateway(&config_toml(
        &[sim.base_url()],
        None,
        &format!("[server]\nsocket_buffer_bytes = 4096\nclient_stall_timeout_s = {stall_s}\n"),
    ))
    .await;
    (sim, gw)
}

/// The gateway's metrics once `done` holds of them, polled for at most 15 s (the last read
/// otherwise).
async fn metrics_once(base: &str, done: impl Fn(&str) -> bool) -> String {
    let mut m = String::new();
    for _ in 0..1500 {
        m = metrics_text(base).await;
        if done(&m) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    m
}

/// The stored status of response `id` once it is `completed` or `incomplete`, polled for at
/// most 15 s (the last status read otherwise).
async fn finished_status(base: &str, id: &str) -> Value {
    let mut status = Value::Null;
    for _ in 0..1500 {
        status = retrieve(base, id).await["status"].clone();
        if status == "completed" || status == "incomplete" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_its_stream_does_not_hold_the_turn() {
    let (sim, gw) = long_answers(0.5).await;
    let base = gw.base_url();
    let body =
        json!({"model": "sim-model", "input": "write at length", "stream": true}).to_string();
    let head = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}",
        body.len()
    );
    let mut stalled = raw_request(&base, &head, body.as_bytes()).await;
    // Read as far as the response's id, then stop reading (the connection stays open).
    let start = read_until(&mut stalled, |s| s.contains("\"id\":\"resp_")).await;
    let id = start
        .split("\"id\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .to_string();
    // The gateway stops sending to the stalled client; the turn runs to its end, is stored,
    // and gives its slot back.
    let status = finished_status(&base, &id).await;
    assert!(
        status == "completed" || status == "incomplete",
        "the turn ends although its client stopped reading: {status}"
    );
    let m = metrics_text(&base).await;
    assert_eq!(
        metric_sum(&m, "agentgate_endpoint_in_flight_requests"),
        0.0,
        "no slot is held: {m}"
    );
    drop(stalled);
    gw.shutdown().await;
    sim.shutdown().await;
}

/// A turn nobody could read later (not stored) stops when the gateway gives up on its client
/// for not reading, although the client keeps its connection open: generating the rest for
/// nobody would hold the engine slot and the team's admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstored_turn_whose_client_stops_reading_stops() {
    // About 4 s of decoding; the client is given up on after 0.3 s.
    let (sim, gw) = long_answers_paced(0.3, 0.2).await;
    let base = gw.base_url();
    let body = json!({"model": "sim-model", "input": "write at length", "stream": true,
                      "store": false})
    .to_string();
    let head = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}",
        body.len()
    );
    let mut stalled = raw_request(&base, &head, body.as_bytes()).await;
    read_until(&mut stalled, |s| s.contains("response.output_text.delta")).await;
    let gone = "code=\"client_disconnected\"} 1";
    let m = metrics_once(&base, |m| {
        m.contains(gone) && metric_sum(m, "agentgate_endpoint_in_flight_requests") == 0.0
    })
    .await;
    let ended: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("agentgate_responses_total"))
        .collect();
    assert!(m.contains(gone), "{ended:?}");
    drop(stalled);
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_key_are_refused_before_their_body_is_read() {
    let sim = start_sim("sim-model").await;
    let teams = format!(
        "[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{}\"]\n",
        agentgate::auth::hash_key("key-a")
    );
    let gw = start_gateway(&config_toml(&[sim.base_url()], None, &teams)).await;
    let base = gw.base_url();
    for (what, auth) in [
        ("no key", ""),
        ("a wrong key", "\r\nauthorization: Bearer nope"),
    ] {
        // A body of 16 MiB is announced and never sent: the refusal must not wait for it.
        let head = format!(
            "POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 16777216{auth}"
        );
        let mut stream = raw_request(&base, &head, b"{").await;
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            read_until(&mut stream, |s| s.contains("invalid_api_key")),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer before the body"));
        assert!(answer.starts_with("HTTP/1.1 401"), "{what}: {answer}");
    }
    // With the key, the body is read as usual.
    let ok = reqwest::Client::new()
        .post(format!("{base}/v1/responses"))
        .bearer_auth("key-a")
        .json(&json!({"model": "sim-model", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_comments_do_not_hold_a_silent_engine_stream() {
    engine_pinging_forever(b": ping\n\n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_chunks_do_not_hold_a_silent_engine_stream() {
    engine_pinging_forever(b"data: {\"object\":\"chat.completion.chunk\",\"choices\":[]}\n\n")
        .await;
}

/// An engine that starts a stream, sends one chunk, then only `ping` every 50 ms: the turn
/// fails at the gateway's idle timeout instead of waiting for it forever.
async fn engine_pinging_forever(ping: &'static [u8]) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                if !read_request_head(&mut socket).await {
                    return;
                }
                let chunk = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hel\"},\"finish_reason\":null}]}\n\n";
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
                if socket
                    .write_all(format!("{head}{chunk}").as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    if socket.write_all(ping).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let gw = start_gateway(&format!(
        "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
         [upstream]\nidle_timeout_s = 0.5\n\
         [[pools]]\nname = \"p\"\nmodel = \"sim-model\"\nendpoints = [\"{url}\"]\n"
    ))
    .await;
    let resp = post_response(
        &gw.base_url(),
        &json!({"model": "sim-model", "input": "hi", "stream": true}),
    )
    .await;
    let text = tokio::time::timeout(std::time::Duration::from_secs(30), resp.text())
        .await
        .expect("the stream ends although the engine keeps pinging")
        .unwrap();
    let events = parse_sse(&text);
    assert_eq!(
        events.last().map(|e| e.event.as_str()),
        Some("response.failed"),
        "{text}"
    );
    assert!(text.contains("no event from"), "{text}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_stops_reading_is_dropped() {
    let (sim, gw) = long_answers(0.2).await;
    let base = gw.base_url();
    let queued = json_body(
        reqwest::Client::new()
            .post(format!("{base}/v1/responses"))
            .json(&json!({"model": "sim-model", "input": "write at length", "background": true})),
    )
    .await;
    let id = queued["id"].as_str().unwrap().to_string();
    let status = finished_status(&base, &id).await;
    assert!(status == "completed" || status == "incomplete", "{status}");
    // Megabytes of logged events: the follower reads the first, then nothing for seconds,
    // far past the stall timeout.
    let head =
        format!("GET /v1/responses/{id}?stream=true HTTP/1.1\r\nhost: x\r\nconnection: close");
    let mut stalled = raw_request(&base, &head, b"").await;
    let mut text = read_until(&mut stalled, |s| s.contains("response.output_text.delta")).await;
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    // What was buffered still arrives, then the stream ends without its terminal event: the
    // client resumes with `starting_after`.
    let rest = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        use tokio::io::AsyncReadExt;
        let mut rest = Vec::new();
        stalled.read_to_end(&mut rest).await.map(|_| rest)
    })
    .await
    .expect("the stream ends")
    .unwrap();
    text.push_str(&String::from_utf8_lossy(&rest));
    assert!(text.contains("response.output_text.delta"), "{text}");
    assert!(
        !text.contains("response.completed") && !text.contains("response.incomplete"),
        "the stalled follower was dropped before the end: {} bytes",
        text.len()
    );
    gw.shutdown().await;
    sim.shutdown().await;
}

/// Every answer is counted by route template, method, status and error code, refusals before
/// any stream included, and the time to its head is observed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_answers_are_counted_by_route_status_and_error_code() {
    let sim = start_sim("sim-model").await;
    let gw = start_gateway(&config_toml(&[sim.base_url()], None, "")).await;
    let base = gw.base_url();
    let ok = post_response(
        &base,
        &json!({"model": "sim-model", "input": "hi", "max_output_tokens": 16}),
    )
    .await;
    assert_eq!(ok.status(), 200);
    let refused = post_response(&base, &json!({"model": "sim-model", "input": 5})).await;
    assert_eq!(refused.status(), 400);
    let refused: Value = refused.json().await.unwrap();
    let refused_code = refused["error"]["code"].as_str().unwrap().to_string();
    let missing =
        json_body(reqwest::Client::new().get(format!("{base}/v1/responses/resp_missing"))).await;
    let missing_code = missing["error"]["code"].as_str().unwrap().to_string();
    let unknown = json_body(reqwest::Client::new().get(format!("{base}/v1/nowhere"))).await;
    assert_eq!(unknown["error"]["code"], "unknown_url");

    let m = metrics_text(&base).await;
    for line in [
        r#"agentgate_http_requests_total{route="/v1/responses",method="POST",status="200",code=""} 1"#.to_string(),
        format!(r#"agentgate_http_requests_total{{route="/v1/responses",method="POST",status="400",code="{refused_code}"}} 1"#),
        format!(r#"agentgate_http_requests_total{{route="/v1/responses/{{id}}",method="GET",status="404",code="{missing_code}"}} 1"#),
        r#"agentgate_http_requests_total{route="unmatched",method="GET",status="404",code="unknown_url"} 1"#.to_string(),
        r#"agentgate_http_request_duration_seconds_count{route="/v1/responses",method="POST"} 2"#.to_string(),
    ] {
        assert!(m.contains(&line), "{line} missing from:\n{m}");
    }
    gw.shutdown().await;
    sim.shutdown().await;
}

/// A client that leaves before its answer's head (a non-streamed turn still running) is
/// counted as `499 client_closed`, not left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_its_answer_is_counted_as_closed() {
    // 50 ms per token of a 20,000-token answer: the turn runs far longer than the test.
    let (sim, gw) = long_answers_paced(30.0, 50.0).await;
    let base = gw.base_url();
    let body = json!({"model": "sim-model", "input": "write at length"}).to_string();
    let head = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}",
        body.len()
    );
    let waiting = raw_request(&base, &head, body.as_bytes()).await;
    let m = metrics_once(&base, |m| {
        metric_sum(m, "agentgate_endpoint_in_flight_requests") == 1.0
    })
    .await;
    assert_eq!(
        metric_sum(&m, "agentgate_endpoint_in_flight_requests"),
        1.0,
        "{m}"
    );
    drop(waiting);
    let closed = r#"agentgate_http_requests_total{route="/v1/responses",method="POST",status="499",code="client_closed"} 1"#;
    let m = metrics_once(&base, |m| m.contains(closed)).await;
    assert!(m.contains(closed), "{m}");
    gw.shutdown().await;
    sim.shutdown().await;
}
