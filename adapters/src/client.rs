//! HTTP client for engines: streaming chat completions, model listing and prompt token counts.
//!
//! One pooled `reqwest` client per gateway (connections are reused across requests). Timeouts:
//! `connect_timeout` for the TCP connect; `first_byte_timeout` from sending the request until
//! the first SSE event arrives (covers queueing and prefill of long prompts);
//! `idle_timeout` between later events; `request_timeout` for the small JSON calls.
//! `base_url` is the engine root (`http://10.0.0.7:8000`); a trailing `/v1` is accepted too.

use crate::error::UpstreamError;
use crate::sse::SseDecoder;
use crate::Flavor;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::Instant;

/// A stream of parsed chat-completion chunks from an engine.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<Value, UpstreamError>> + Send>>;

/// Largest engine error body kept for logs, in bytes.
const MAX_ERROR_BODY: usize = 8 * 1024;

/// Largest JSON body read from an engine (`/v1/models`, `/tokenize`, a non-streaming prefill
/// answer), in bytes; a larger answer is a protocol error rather than unbounded memory.
pub(crate) const MAX_JSON_BODY: usize = 16 * 1024 * 1024;

/// `at + wait`, or about a century later when that overflows the clock (a timeout of
/// `Duration::MAX` means "never").
pub(crate) fn deadline_after(at: Instant, wait: Duration) -> Instant {
    at.checked_add(wait)
        .unwrap_or_else(|| at + Duration::from_secs(100 * 365 * 86_400))
}

/// Read `response`'s body, refusing one longer than `max` bytes.
pub(crate) async fn read_capped(
    url: &str,
    mut response: reqwest::Response,
    max: usize,
) -> Result<Vec<u8>, UpstreamError> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|err| UpstreamError::Connect(format!("reading {url}: {err}")))?
    {
        if body.len() + chunk.len() > max {
            return Err(UpstreamError::Protocol(format!(
                "{url} answered more than {max} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Connection and timeout settings for [`EngineClient`].
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Limit for establishing a TCP connection.
    pub connect_timeout: Duration,
    /// Limit from sending a chat request until its first streamed event.
    pub first_byte_timeout: Duration,
    /// Limit between two streamed events once the first has arrived.
    pub idle_timeout: Duration,
    /// Limit for non-streaming calls (`/v1/models`, `/tokenize`).
    pub request_timeout: Duration,
    /// How long an idle pooled connection is kept open.
    pub pool_idle_timeout: Duration,
    /// Bearer token sent to engines (for OpenAI-compatible services that need one).
    pub api_key: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            first_byte_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
            pool_idle_timeout: Duration::from_secs(90),
            api_key: None,
        }
    }
}

/// HTTP client for engines; see the module doc for timeouts.
#[derive(Clone, Debug)]
pub struct EngineClient {
    pub(crate) http: reqwest::Client,
    options: ClientOptions,
}

impl EngineClient {
    /// A client with pooled connections configured by `opts`.
    pub fn new(opts: ClientOptions) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(opts.connect_timeout)
            .pool_idle_timeout(opts.pool_idle_timeout)
            .tcp_nodelay(true)
            // A peer that vanished without closing (host down, cable cut) is noticed on
            // connections that wait for it, not only at the next request's timeout.
            .tcp_keepalive(Duration::from_secs(30))
            .build()
            .unwrap_or_else(|err| {
                tracing::warn!(error = %err, "engine HTTP client options rejected; using defaults");
                reqwest::Client::new()
            });
        EngineClient {
            http,
            options: opts,
        }
    }

    /// The options this client was built with.
    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// POST `{base_url}/v1/chat/completions` and parse the SSE stream into chunk JSON values.
    /// Non-2xx -> [`UpstreamError::Status`] with the engine's error body preserved for logs.
    pub async fn chat_stream(
        &self,
        base_url: &str,
        body: &Value,
    ) -> Result<ChunkStream, UpstreamError> {
        self.chat_stream_as(base_url, body, None).await
    }

    /// [`EngineClient::chat_stream`] with an `X-Request-Id` (the engine's request id) when
    /// given.
    pub(crate) async fn chat_stream_as(
        &self,
        base_url: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<ChunkStream, UpstreamError> {
        let url = v1_url(base_url, "chat/completions");
        let deadline = deadline_after(Instant::now(), self.options.first_byte_timeout);
        let mut request = self
            .authorized(self.http.post(&url))
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .json(body);
        if let Some(id) = request_id {
            request = request.header("x-request-id", id);
        }
        let response = match tokio::time::timeout_at(deadline, request.send()).await {
            Err(_) => {
                return Err(UpstreamError::Timeout(format!(
                    "no response from {url} within {:?}",
                    self.options.first_byte_timeout
                )))
            }
            Ok(Err(err)) => return Err(send_error(&url, err)),
            Ok(Ok(response)) => response,
        };
        let response = self.check_status(response).await?;
        let state = ChunkReader {
            body: Box::pin(response.bytes_stream()),
            decoder: SseDecoder::default(),
            pending: VecDeque::new(),
            last_event: None,
            deadline,
            idle_timeout: self.options.idle_timeout,
            done: false,
            url,
        };
        Ok(Box::pin(futures_util::stream::unfold(state, next_chunk)))
    }

    /// GET `{base_url}/v1/models` -> model ids.
    pub async fn models(&self, base_url: &str) -> Result<Vec<String>, UpstreamError> {
        let url = v1_url(base_url, "models");
        let value = self.get_json(&url).await?;
        let data = value.get("data").and_then(Value::as_array).ok_or_else(|| {
            UpstreamError::Protocol(format!("{url} answered without a `data` array"))
        })?;
        Ok(data
            .iter()
            .filter_map(|model| model.get("id").and_then(Value::as_str).map(str::to_string))
            .collect())
    }

    /// Prompt token count of a chat body. vLLM / SGLang: POST `{root}/tokenize` with
    /// `{model, messages, tools}` and read `count`. OpenAI flavor, or any failure: the estimate
    /// of [`estimate_prompt_tokens`]. Never returns an error today; the `Result` leaves room for
    /// callers that want strict counts later.
    pub async fn count_tokens(
        &self,
        flavor: Flavor,
        base_url: &str,
        chat_body: &Value,
    ) -> Result<u64, UpstreamError> {
        if flavor == Flavor::Openai {
            return Ok(estimate_prompt_tokens(chat_body));
        }
        let url = format!("{}/tokenize", root_url(base_url));
        let mut request =
            json!({"messages": chat_body.get("messages").cloned().unwrap_or(json!([]))});
        for key in ["model", "tools"] {
            if let Some(value) = chat_body.get(key) {
                request[key] = value.clone();
            }
        }
        match self.post_json(&url, &request).await {
            Ok(answer) => {
                let count = answer.get("count").and_then(Value::as_u64).or_else(|| {
                    answer
                        .get("tokens")
                        .and_then(Value::as_array)
                        .map(|t| t.len() as u64)
                });
                match count {
                    Some(count) => Ok(count),
                    None => {
                        tracing::debug!(%url, "tokenize answer has no count; estimating prompt tokens");
                        Ok(estimate_prompt_tokens(chat_body))
                    }
                }
            }
            Err(err) => {
                tracing::debug!(%url, error = %err, "tokenize failed; estimating prompt tokens");
                Ok(estimate_prompt_tokens(chat_body))
            }
        }
    }

    async fn get_json(&self, url: &str) -> Result<Value, UpstreamError> {
        let request = self.authorized(self.http.get(url));
        self.send_json(url, request).await
    }

    async fn post_json(&self, url: &str, body: &Value) -> Result<Value, UpstreamError> {
        let request = self.authorized(self.http.post(url)).json(body);
        self.send_json(url, request).await
    }

    async fn send_json(
        &self,
        url: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<Value, UpstreamError> {
        let limit = self.options.request_timeout;
        let call = async {
            let response = request.send().await.map_err(|err| send_error(url, err))?;
            let response = self.check_status(response).await?;
            let bytes = read_capped(url, response, MAX_JSON_BODY).await?;
            serde_json::from_slice::<Value>(&bytes).map_err(|err| {
                UpstreamError::Protocol(format!("{url} answered invalid JSON: {err}"))
            })
        };
        tokio::time::timeout(limit, call)
            .await
            .map_err(|_| UpstreamError::Timeout(format!("{url} did not answer within {limit:?}")))?
    }

    pub(crate) fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.options.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    pub(crate) async fn check_status(
        &self,
        mut response: reqwest::Response,
    ) -> Result<reqwest::Response, UpstreamError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        // The first MAX_ERROR_BODY bytes are enough to explain the failure; what follows is
        // not read, so an error page of any size costs no more than that.
        let mut body = Vec::new();
        let _ = tokio::time::timeout(self.options.request_timeout, async {
            while body.len() < MAX_ERROR_BODY {
                match response.chunk().await {
                    Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                    _ => break,
                }
            }
        })
        .await;
        let mut body =
            String::from_utf8_lossy(&body[..body.len().min(MAX_ERROR_BODY)]).into_owned();
        if body.is_empty() {
            body = status.canonical_reason().unwrap_or("").to_string();
        }
        Err(UpstreamError::Status {
            status: status.as_u16(),
            body,
        })
    }
}

/// Rough prompt token estimate used when the engine cannot count: one token per 4 bytes of
/// message text and tool definitions, plus 4 tokens of framing per message.
pub fn estimate_prompt_tokens(chat_body: &Value) -> u64 {
    let messages = chat_body.get("messages").and_then(Value::as_array);
    let mut bytes = 0usize;
    let mut framing = 0u64;
    for message in messages.into_iter().flatten() {
        framing += 4;
        bytes += match message.get("content") {
            Some(Value::String(text)) => text.len(),
            Some(Value::Null) | None => 0,
            Some(other) => other.to_string().len(),
        };
        for key in ["tool_calls", "reasoning_content"] {
            if let Some(value) = message.get(key) {
                bytes += value.to_string().len();
            }
        }
    }
    if let Some(tools) = chat_body.get("tools") {
        bytes += tools.to_string().len();
    }
    (bytes as u64).div_ceil(4) + framing
}

/// An engine's API root: its base URL without a trailing `/` or `/v1` (where `/metrics`,
/// `/health` and `/v1/...` are found).
pub fn root_url(base_url: &str) -> &str {
    let base = base_url.trim_end_matches('/');
    base.strip_suffix("/v1").unwrap_or(base)
}

pub(crate) fn v1_url(base_url: &str, path: &str) -> String {
    format!("{}/v1/{path}", root_url(base_url))
}

pub(crate) fn send_error(url: &str, err: reqwest::Error) -> UpstreamError {
    if err.is_timeout() {
        UpstreamError::Timeout(format!("{url}: {err}"))
    } else {
        UpstreamError::Connect(format!("{url}: {err}"))
    }
}

/// State of one streaming chat response being read.
struct ChunkReader {
    body: Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>,
    decoder: SseDecoder,
    pending: VecDeque<Result<Value, UpstreamError>>,
    /// When the last event with news arrived ([`carries_news`]): the idle timeout runs from
    /// it, so bytes that make no event (comment lines, keep-alive pings, a partial line) and
    /// events without news (chunks without choices) do not keep a stuck stream open.
    last_event: Option<Instant>,
    deadline: Instant,
    idle_timeout: Duration,
    done: bool,
    url: String,
}

impl ChunkReader {
    /// Queues parsed payloads; `[DONE]` ends the stream.
    fn accept(&mut self, payloads: Vec<String>) {
        for payload in payloads {
            if self.done {
                return;
            }
            let payload = payload.trim();
            if payload == "[DONE]" {
                self.done = true;
                return;
            }
            match serde_json::from_str::<Value>(payload) {
                Ok(value) => {
                    if carries_news(&value) {
                        self.last_event = Some(Instant::now());
                    }
                    self.pending.push_back(Ok(value));
                }
                Err(err) => {
                    self.pending.push_back(Err(UpstreamError::Protocol(format!(
                        "{} streamed invalid JSON ({err}): {}",
                        self.url,
                        payload.chars().take(200).collect::<String>()
                    ))));
                    self.done = true;
                }
            }
        }
    }
}

/// Whether a chunk says something: a choice (a delta, a finish), usage or an error. Chunks
/// without any (`"choices": []` alone) could come forever from an engine that makes no progress.
fn carries_news(chunk: &Value) -> bool {
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|choices| !choices.is_empty())
        || chunk.get("usage").is_some_and(|u| !u.is_null())
        || chunk.get("error").is_some_and(|e| !e.is_null())
        || chunk.get("object").and_then(Value::as_str) == Some("error")
}

async fn next_chunk(
    mut reader: ChunkReader,
) -> Option<(Result<Value, UpstreamError>, ChunkReader)> {
    loop {
        if let Some(item) = reader.pending.pop_front() {
            return Some((item, reader));
        }
        if reader.done {
            return None;
        }
        let wait_until = match reader.last_event {
            Some(at) => deadline_after(at, reader.idle_timeout),
            None => reader.deadline,
        };
        match tokio::time::timeout_at(wait_until, reader.body.next()).await {
            Err(_) => {
                reader.done = true;
                let what = if reader.last_event.is_some() {
                    format!("no event from {} for {:?}", reader.url, reader.idle_timeout)
                } else {
                    format!(
                        "no first event from {} before the first-byte deadline",
                        reader.url
                    )
                };
                return Some((Err(UpstreamError::Timeout(what)), reader));
            }
            Ok(Some(Ok(bytes))) => match reader.decoder.push(&bytes) {
                Ok(payloads) => reader.accept(payloads),
                Err(oversized) => {
                    reader.done = true;
                    let error = UpstreamError::Protocol(format!(
                        "the stream from {} broke: {oversized}",
                        reader.url
                    ));
                    return Some((Err(error), reader));
                }
            },
            Ok(Some(Err(err))) => {
                reader.done = true;
                let error =
                    UpstreamError::Connect(format!("stream from {} broke: {err}", reader.url));
                return Some((Err(error), reader));
            }
            Ok(None) => {
                let tail: Vec<String> = reader.decoder.finish().into_iter().collect();
                reader.accept(tail);
                if !reader.done {
                    // vLLM, SGLang and OpenAI end every stream with `data: [DONE]`: without
                    // it the answer was cut off, or was not an event stream at all.
                    reader
                        .pending
                        .push_back(Err(UpstreamError::Protocol(format!(
                            "the stream from {} ended without [DONE]",
                            reader.url
                        ))));
                }
                reader.done = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_accept_roots_with_or_without_v1() {
        assert_eq!(v1_url("http://h:8000", "models"), "http://h:8000/v1/models");
        assert_eq!(
            v1_url("http://h:8000/", "models"),
            "http://h:8000/v1/models"
        );
        assert_eq!(
            v1_url("http://h:8000/v1/", "chat/completions"),
            "http://h:8000/v1/chat/completions"
        );
        assert_eq!(root_url("http://h:8000/v1"), "http://h:8000");
    }

    #[test]
    fn estimate_counts_text_tools_and_framing() {
        let body = json!({"messages": [{"role": "user", "content": "abcdefgh"}]});
        assert_eq!(estimate_prompt_tokens(&body), 2 + 4);
        let with_tools = json!({"messages": [{"role": "user", "content": "abcdefgh"}],
                                "tools": [{"type": "function", "function": {"name": "f"}}]});
        assert!(estimate_prompt_tokens(&with_tools) > 6);
    }
}
