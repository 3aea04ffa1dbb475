//! End-to-end tests of `EngineClient` against a tiny local engine (axum on 127.0.0.1:0):
//! streaming chat with SSE split across writes, error statuses, model listing, token counting,
//! timeouts and connection failures, and the chunks flowing through `ResponseStream`.

use agentgate_adapters::{
    build_chat_request, normalize_input, ClientOptions, EngineClient, Flavor, ResponseStream,
    TranslateOptions, UpstreamError,
};
use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::Duration;

fn sse_pieces() -> Vec<Vec<u8>> {
    let chunks = [
        json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
        json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "finish_reason": null}]}),
        json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "héllo"}, "finish_reason": null}]}),
        json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        json!({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}),
    ];
    let mut text = String::new();
    for chunk in chunks {
        text.push_str(&format!("data: {chunk}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    // Split at awkward places (inside JSON and inside a multi-byte character).
    let bytes = text.into_bytes();
    bytes.chunks(7).map(<[u8]>::to_vec).collect()
}

async fn chat(Json(body): Json<Value>) -> Response {
    match body.get("model").and_then(Value::as_str) {
        Some("missing") => (
            StatusCode::NOT_FOUND,
            Json(json!({"object": "error", "message": "The model `missing` does not exist.", "code": 404})),
        )
            .into_response(),
        Some("endless-error") => {
            // An error page that never ends: the client reads its start and stops.
            let stream = futures_util::stream::unfold(0u32, |step| async move {
                let piece = if step == 0 {
                    "engine overloaded: ".to_string()
                } else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    "x".repeat(1024)
                };
                Some((Ok::<_, std::io::Error>(piece.into_bytes()), step + 1))
            });
            Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(Body::from_stream(stream))
                .unwrap()
        }
        Some("stall") => {
            let first = format!(
                "data: {}\n\n",
                json!({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]})
            );
            let stream = futures_util::stream::unfold(0u32, move |step| {
                let first = first.clone();
                async move {
                    if step == 0 {
                        Some((Ok::<_, std::io::Error>(first.into_bytes()), 1))
                    } else {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        None
                    }
                }
            });
            Response::new(Body::from_stream(stream))
        }
        _ => {
            assert_eq!(body["stream"], true);
            let stream = futures_util::stream::iter(sse_pieces().into_iter().map(Ok::<_, std::io::Error>));
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .unwrap()
        }
    }
}

async fn tokenize(Json(body): Json<Value>) -> Json<Value> {
    let n = body["messages"].as_array().map(Vec::len).unwrap_or(0) as u64;
    Json(json!({"count": 100 + n, "max_model_len": 4096, "tokens": []}))
}

async fn start_engine(with_tokenize: bool) -> String {
    let mut app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route(
            "/v1/models",
            get(|| async {
                Json(json!({"object": "list", "data": [{"id": "qwen"}, {"id": "llama"}]}))
            }),
        );
    if with_tokenize {
        app = app.route("/tokenize", post(tokenize));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn streams_chunks_into_a_complete_response() {
    let base = start_engine(true).await;
    let client = EngineClient::new(ClientOptions::default());
    let input = normalize_input(&json!("hi")).unwrap();
    let plan = build_chat_request(
        &json!({"model": "qwen"}),
        &[],
        &input,
        &TranslateOptions::new(Flavor::Vllm),
    )
    .unwrap();
    let mut chunks = client.chat_stream(&base, &plan.body).await.unwrap();
    let mut stream = ResponseStream::new(
        json!({"id": "resp_x", "object": "response", "status": "in_progress", "output": [], "usage": null}),
        plan.tool_names,
    );
    let mut events = stream.start();
    let mut count = 0;
    while let Some(chunk) = chunks.next().await {
        events.extend(stream.on_chunk(&chunk.unwrap()));
        count += 1;
    }
    events.extend(stream.finish());
    assert_eq!(count, 5, "[DONE] ends the stream and is not yielded");
    let response = stream.response();
    assert_eq!(response["status"], "completed");
    assert_eq!(response["output"][0]["type"], "reasoning");
    assert_eq!(response["output"][1]["content"][0]["text"], "héllo");
    assert_eq!(
        response["usage"]["input_tokens_details"]["cached_tokens"],
        4
    );
    assert_eq!(events.last().unwrap().event, "response.completed");
}

#[tokio::test]
async fn non_2xx_keeps_the_engine_error_body() {
    let (status, body) = error_status("missing", ClientOptions::default()).await;
    assert_eq!(status, 404);
    assert!(body.contains("does not exist"), "{body}");
}

/// The status and body of the engine's answer to a chat request for `model`, which must be an
/// error status.
async fn error_status(model: &str, options: ClientOptions) -> (u16, String) {
    let base = start_engine(true).await;
    let client = EngineClient::new(options);
    let err = match client
        .chat_stream(&base, &json!({"model": model, "messages": []}))
        .await
    {
        Err(err) => err,
        Ok(_) => panic!("expected an error status"),
    };
    match err {
        UpstreamError::Status { status, body } => (status, body),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn an_endless_error_body_is_read_only_as_far_as_it_is_kept() {
    let options = ClientOptions {
        request_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    };
    let (status, body) = error_status("endless-error", options).await;
    assert_eq!(status, 503);
    assert!(body.starts_with("engine overloaded: xxx"), "{body:.80}");
    assert_eq!(body.len(), 8 * 1024);
}

#[tokio::test]
async fn idle_engine_times_out_after_the_first_chunk() {
    let base = start_engine(true).await;
    let client = EngineClient::new(ClientOptions {
        idle_timeout: Duration::from_millis(200),
        ..ClientOptions::default()
    });
    let mut chunks = client
        .chat_stream(&base, &json!({"model": "stall", "messages": []}))
        .await
        .unwrap();
    let first = chunks.next().await.unwrap().unwrap();
    assert_eq!(first["choices"][0]["delta"]["content"], "a");
    let second = chunks.next().await.unwrap();
    assert!(
        matches!(second, Err(UpstreamError::Timeout(_))),
        "{second:?}"
    );
    assert!(chunks.next().await.is_none());
}

#[tokio::test]
async fn lists_models_and_counts_tokens() {
    let base = start_engine(true).await;
    let client = EngineClient::new(ClientOptions::default());
    assert_eq!(
        client.models(&format!("{base}/v1/")).await.unwrap(),
        vec!["qwen", "llama"]
    );
    let body = json!({"model": "qwen", "messages": [{"role": "user", "content": "abcdefgh"}]});
    assert_eq!(
        client
            .count_tokens(Flavor::Vllm, &base, &body)
            .await
            .unwrap(),
        101
    );
    let estimate = agentgate_adapters::estimate_prompt_tokens(&body);
    assert_eq!(
        client
            .count_tokens(Flavor::Openai, &base, &body)
            .await
            .unwrap(),
        estimate
    );
    let without = start_engine(false).await;
    assert_eq!(
        client
            .count_tokens(Flavor::Sglang, &without, &body)
            .await
            .unwrap(),
        estimate
    );
}

#[tokio::test]
async fn closed_port_is_a_connect_error() {
    // Bound but never listened on: connections are refused, and no other server takes it.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let client = EngineClient::new(ClientOptions::default());
    let err = client.models(&format!("http://{addr}")).await.unwrap_err();
    assert!(matches!(err, UpstreamError::Connect(_)), "{err:?}");
}
