//! Prefill/decode disaggregation: one chat request run as two legs on two engines, in each
//! engine's own protocol. The client-facing request and the streamed answer are unchanged; only
//! where the prompt is prefilled differs.
//!
//! **vLLM (NIXL connector).** The prefill leg is the request with `stream: false`,
//! `max_tokens: 1` (and `max_completion_tokens: 1` when set), no `stream_options`, and
//!
//! ```json
//! "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
//!   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}
//! ```
//!
//! The prefill engine answers with its own `kv_transfer_params` (`do_remote_prefill: true`, its
//! engine id, block ids, host and port). The decode leg is the original request with exactly those
//! params; the decode engine pulls the blocks from the prefill engine and decodes. The legs are
//! sequential, and share one `X-Request-Id`, as vLLM's disaggregation proxy sends them.
//!
//! **SGLang (bootstrap rooms).** Both legs are the same body: the original request plus
//! `bootstrap_host`, `bootstrap_port` (the prefill engine's bootstrap server) and a random
//! `bootstrap_room`; they run concurrently: the decode engine waits in the room until the prefill
//! engine has the KV cache. The prefill leg's answer is read to the end and discarded.
//!
//! Failures are reported by leg ([`DisaggError`]) so the caller can fall back: a failed prefill
//! leg means the request has not started anywhere and can run aggregated on a healthy endpoint;
//! a failed decode leg after a good prefill is almost always a lost KV transfer (the engines
//! answer 5xx) and can be retried once without disaggregation. No leg ever produced output the
//! client saw, so a retry neither loses nor duplicates anything.

use std::time::Duration;
use tokio::time::Instant;

use futures_util::StreamExt;
use serde_json::{json, Value};

use crate::client::{v1_url, ChunkStream, EngineClient};
use crate::error::UpstreamError;
use crate::Flavor;

/// Where the prefill leg runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillTarget {
    /// Base URL of the prefill engine.
    pub base_url: String,
    /// SGLang: host and port of its bootstrap server.
    pub bootstrap: Option<(String, u16)>,
}

/// Which leg of a disaggregated request failed.
#[derive(Debug)]
pub enum DisaggError {
    /// The prefill leg failed: nothing ran; run the request aggregated elsewhere.
    Prefill(UpstreamError),
    /// The decode leg failed after (or while) the prefill leg ran: usually the KV transfer.
    Decode(UpstreamError),
}

impl DisaggError {
    /// The underlying engine error.
    pub fn upstream(&self) -> &UpstreamError {
        match self {
            DisaggError::Prefill(e) | DisaggError::Decode(e) => e,
        }
    }
}

impl std::fmt::Display for DisaggError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DisaggError::Prefill(e) => write!(f, "prefill leg failed: {e}"),
            DisaggError::Decode(e) => write!(f, "decode leg failed: {e}"),
        }
    }
}

/// The vLLM prefill leg of `body` (see the module doc).
pub fn vllm_prefill_leg(body: &Value) -> Value {
    let mut leg = body.clone();
    if let Some(obj) = leg.as_object_mut() {
        obj.insert("stream".into(), Value::Bool(false));
        obj.remove("stream_options");
        obj.insert("max_tokens".into(), json!(1));
        if obj.contains_key("max_completion_tokens") {
            obj.insert("max_completion_tokens".into(), json!(1));
        }
        obj.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null}),
        );
    }
    leg
}

/// The vLLM decode leg: `body` with the `kv_transfer_params` the prefill leg returned.
pub fn vllm_decode_leg(body: &Value, kv_transfer_params: Value) -> Value {
    let mut leg = body.clone();
    if let Some(obj) = leg.as_object_mut() {
        obj.insert("kv_transfer_params".into(), kv_transfer_params);
    }
    leg
}

/// The SGLang body of both legs of `body` for one bootstrap room.
pub fn sglang_leg(body: &Value, host: &str, port: u16, room: u64) -> Value {
    let mut leg = body.clone();
    if let Some(obj) = leg.as_object_mut() {
        obj.insert("bootstrap_host".into(), json!(host));
        obj.insert("bootstrap_port".into(), json!(port));
        obj.insert("bootstrap_room".into(), json!(room));
    }
    leg
}

/// A fresh request id shared by a split's two vLLM legs (32 hex digits).
fn new_request_id() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// A fresh bootstrap room id (SGLang draws them at random from the non-negative i64 range).
pub fn new_bootstrap_room() -> u64 {
    fastrand::u64(..(i64::MAX as u64))
}

/// SGLang: how long a failed decode leg waits for the prefill leg's verdict before the
/// decode engine is blamed for the failure.
const PREFILL_VERDICT_WAIT: Duration = Duration::from_secs(2);

impl EngineClient {
    /// POST a chat completion and return the engine's answer once its status is good.
    async fn post_chat(
        &self,
        base_url: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<(String, reqwest::Response), UpstreamError> {
        let url = v1_url(base_url, "chat/completions");
        let limit = self.options().first_byte_timeout;
        let mut request = self.authorized(self.http.post(&url)).json(body);
        if let Some(id) = request_id {
            request = request.header("x-request-id", id);
        }
        let response = match tokio::time::timeout(limit, request.send()).await {
            Err(_) => {
                return Err(UpstreamError::Timeout(format!(
                    "no response from {url} within {limit:?}"
                )))
            }
            Ok(Err(err)) => return Err(crate::client::send_error(&url, err)),
            Ok(Ok(response)) => response,
        };
        Ok((url, self.check_status(response).await?))
    }

    /// POST a non-streaming chat completion and return its JSON body: at most 16 MiB, read
    /// whole within the idle timeout.
    pub async fn chat_json(&self, base_url: &str, body: &Value) -> Result<Value, UpstreamError> {
        self.chat_json_as(base_url, body, None).await
    }

    /// [`EngineClient::chat_json`] with an `X-Request-Id` when given.
    async fn chat_json_as(
        &self,
        base_url: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<Value, UpstreamError> {
        let (url, response) = self.post_chat(base_url, body, request_id).await?;
        let limit = self.options().idle_timeout;
        let bytes = tokio::time::timeout(
            limit,
            crate::client::read_capped(&url, response, crate::client::MAX_JSON_BODY),
        )
        .await
        .map_err(|_| UpstreamError::Timeout(format!("{url}: no body within {limit:?}")))??;
        serde_json::from_slice(&bytes)
            .map_err(|e| UpstreamError::Protocol(format!("{url}: unreadable JSON body: {e}")))
    }

    /// Stream a chat completion to its end, discarding it (an SGLang prefill leg): the
    /// client's first-byte and idle timeouts apply, and an error the engine reports inside its
    /// stream (SGLang answers 200, then an error chunk or an `abort`) fails it, as a failed
    /// status does (a fault of the request, such as a prompt over the context window, as a
    /// 400 would).
    pub async fn chat_discard(&self, base_url: &str, body: &Value) -> Result<(), UpstreamError> {
        let mut stream = self.chat_stream(base_url, body).await?;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            if let Some(message) = crate::stream::engine_error_message(&chunk) {
                // A fault of the request itself (a prompt over the context window) is the
                // request's answer, as the same error at open would be.
                if crate::stream::request_fault_code(&chunk, &message).is_some() {
                    return Err(UpstreamError::Status {
                        status: 400,
                        body: chunk.to_string(),
                    });
                }
            }
            let failure = crate::stream::engine_error_message(&chunk)
                .or_else(|| crate::stream::failure_without_output(&chunk));
            if let Some(message) = failure {
                return Err(UpstreamError::Protocol(format!(
                    "{base_url}: the prefill leg failed: {message}"
                )));
            }
        }
        Ok(())
    }

    /// Run `body` (a streaming chat request) disaggregated: prefill on `prefill`, decode
    /// streamed from `decode_url`, in `flavor`'s protocol (see the module doc).
    pub async fn chat_stream_disaggregated(
        &self,
        flavor: Flavor,
        prefill: &PrefillTarget,
        decode_url: &str,
        body: &Value,
    ) -> Result<ChunkStream, DisaggError> {
        self.open_disaggregated(flavor, prefill, decode_url, body)
            .await
            .map(|d| d.stream)
    }

    /// [`EngineClient::chat_stream_disaggregated`], also reporting how long the prefill leg
    /// took and, where the protocol returns it (vLLM), the prefill engine's usage.
    ///
    /// SGLang: the decode engine answers with its headers at once, then waits in the bootstrap
    /// room for the KV cache; this returns once its first chunk has come (`prefill_latency`
    /// ends then, or when the prefill leg ended, if earlier). When the prefill leg fails before that, the decode leg is
    /// abandoned at once (its engine would otherwise wait in the room until its transfer
    /// timeout) and the prefill leg is blamed. When the decode leg fails first (an error
    /// status, a broken stream, or an error chunk before any output), the prefill leg is
    /// blamed only if it fails within 2 s. A prefill leg still running when the decode leg
    /// fails, or when its stream is dropped, is dropped too. Either leg's answer is read with
    /// the client's first-byte and idle timeouts, so neither waits for ever on a silent engine.
    pub async fn open_disaggregated(
        &self,
        flavor: Flavor,
        prefill: &PrefillTarget,
        decode_url: &str,
        body: &Value,
    ) -> Result<Disaggregated, DisaggError> {
        let started = Instant::now();
        match flavor {
            Flavor::Sglang => {
                let Some((host, port)) = &prefill.bootstrap else {
                    return Err(DisaggError::Prefill(UpstreamError::Protocol(format!(
                        "prefill endpoint {} has no bootstrap port configured",
                        prefill.base_url
                    ))));
                };
                let leg = sglang_leg(body, host, *port, new_bootstrap_room());
                // The prefill leg runs on its own task, so it goes on while the decode leg is
                // opened and read, however late; it is dropped only once the decode leg is over
                // (below).
                let client = self.clone();
                let prefill_url = prefill.base_url.clone();
                let prefill_leg = leg.clone();
                let mut prefill_task =
                    tokio::spawn(
                        async move { client.chat_discard(&prefill_url, &prefill_leg).await },
                    );
                // Held from here: a caller that gives up while the decode leg waits for the KV
                // cache (which lasts the whole prefill) drops the prefill leg with it.
                let prefill_leg = AbortOnDrop(prefill_task.abort_handle());
                let decode = self.chat_stream(decode_url, &leg);
                tokio::pin!(decode);
                let mut prefill_done = false;
                let mut kv_ready = None;
                // 1. The decode engine's headers (or the prefill leg ending first: SGLang
                // releases that engine opens a stream with its first chunk, after the KV came).
                let opened = tokio::select! {
                    decode = &mut decode => decode,
                    prefilled = &mut prefill_task => {
                        prefill_done = true;
                        match prefilled {
                            Ok(Err(prefill_err)) => return Err(DisaggError::Prefill(prefill_err)),
                            _ => {
                                kv_ready = Some(started.elapsed());
                                decode.await
                            }
                        }
                    }
                };
                let mut stream = match opened {
                    Ok(stream) => stream,
                    Err(decode_err) => {
                        return Err(blame(&mut prefill_task, prefill_done, decode_err).await)
                    }
                };
                // 2. The KV cache in the room: a decode engine that answered with its headers at
                // once (SGLang releases that send them before the first chunk) waits for it. The KV is ready when the prefill leg ends or the
                // decode engine's first chunk comes, whichever is first; the request is open
                // once that chunk has come. A prefill leg failing first fails the request here
                // (the decode engine would wait out its transfer timeout), as does a decode leg
                // that fails, streams an error or ends before any output.
                let first = loop {
                    if prefill_done {
                        break stream.next().await;
                    }
                    tokio::select! {
                        first = stream.next() => break first,
                        prefilled = &mut prefill_task => {
                            prefill_done = true;
                            match prefilled {
                                Ok(Err(prefill_err)) => return Err(DisaggError::Prefill(prefill_err)),
                                _ => kv_ready = Some(started.elapsed()),
                            }
                        }
                    }
                };
                let prefill_latency = kv_ready.unwrap_or_else(|| started.elapsed());
                let failed = |why: String| {
                    UpstreamError::Protocol(format!(
                        "{decode_url}: the decode engine {why} before its first token"
                    ))
                };
                let head = match first {
                    Some(Ok(chunk)) => match crate::stream::engine_error_message(&chunk) {
                        // A fault of the request itself (a prompt over the context window),
                        // which SGLang reports in the stream it started: the request's answer,
                        // as the same error at open would be, not a lost transfer.
                        Some(message)
                            if crate::stream::request_fault_code(&chunk, &message).is_some() =>
                        {
                            return Err(DisaggError::Decode(UpstreamError::Status {
                                status: 400,
                                body: chunk.to_string(),
                            }));
                        }
                        Some(message) => Err(failed(format!("failed ({message})"))),
                        None => Ok(chunk),
                    },
                    Some(Err(decode_err)) => Err(decode_err),
                    None => Err(failed("ended its stream".into())),
                };
                let head = match head {
                    Ok(chunk) => chunk,
                    Err(decode_err) => {
                        return Err(blame(&mut prefill_task, prefill_done, decode_err).await)
                    }
                };
                // Once the decode stream is dropped (the turn ended or failed), nobody will
                // fetch what a prefill leg still running computes: it is dropped (the engine
                // aborts a request whose client went) rather than left to run to its end and
                // wait out its transfer timeout. A prefill leg that finished is not affected.
                let stream = futures_util::stream::iter([Ok(head)]).chain(stream);
                Ok(Disaggregated {
                    stream: Box::pin(stream.map(move |chunk| {
                        let _held = &prefill_leg;
                        chunk
                    })),
                    prefill_latency,
                    prefill_usage: None,
                })
            }
            Flavor::Vllm | Flavor::Openai => {
                // Both legs under one request id, as vLLM's disaggregation proxy sends them:
                // NIXL versions whose `kv_transfer_params` carry no `remote_request_id` match
                // the decode engine's "blocks read" notice to the prefill engine's request by
                // it; without a match the prefill engine holds the blocks until its abort
                // timeout.
                let request_id = new_request_id();
                let prefilled = self
                    .chat_json_as(
                        &prefill.base_url,
                        &vllm_prefill_leg(body),
                        Some(&request_id),
                    )
                    .await
                    .map_err(DisaggError::Prefill)?;
                let prefill_latency = started.elapsed();
                let params = prefilled
                    .get("kv_transfer_params")
                    .filter(|p| p.is_object())
                    .cloned();
                // vLLM hands over no blocks when the prefill leg's one token ended the answer
                // (a stop token: the request finished rather than being cut at its length):
                // the decode engine then runs the request itself, as vLLM's proxy sends it.
                let stopped = prefilled
                    .pointer("/choices/0/finish_reason")
                    .and_then(Value::as_str)
                    .is_some_and(|reason| matches!(reason, "stop" | "tool_calls"));
                let decode_body = match params {
                    Some(params) => vllm_decode_leg(body, params),
                    None if stopped => body.clone(),
                    None => {
                        return Err(DisaggError::Prefill(UpstreamError::Protocol(format!(
                            "prefill endpoint {} returned no kv_transfer_params (is its KV connector configured?)",
                            prefill.base_url
                        ))))
                    }
                };
                let stream = self
                    .chat_stream_as(decode_url, &decode_body, Some(&request_id))
                    .await
                    .map_err(DisaggError::Decode)?;
                Ok(Disaggregated {
                    stream,
                    prefill_latency,
                    prefill_usage: PrefillUsage::from_response(&prefilled),
                })
            }
        }
    }
}

/// Which leg a failed SGLang decode leg is blamed on: it often fails because the prefill leg
/// did (no KV arrived), so a prefill leg that fails within [`PREFILL_VERDICT_WAIT`] takes the
/// blame; one still running then (or done well) does not.
async fn blame(
    prefill_task: &mut tokio::task::JoinHandle<Result<(), UpstreamError>>,
    prefill_done: bool,
    decode_err: UpstreamError,
) -> DisaggError {
    if !prefill_done {
        if let Ok(Ok(Err(prefill_err))) =
            tokio::time::timeout(PREFILL_VERDICT_WAIT, prefill_task).await
        {
            return DisaggError::Prefill(prefill_err);
        }
    }
    DisaggError::Decode(decode_err)
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An opened disaggregated request.
pub struct Disaggregated {
    /// The decode engine's stream.
    pub stream: ChunkStream,
    /// From sending the request until the KV cache was ready for decode: the prefill leg's
    /// answer (vLLM), or the decode engine's first chunk or the prefill leg's end, whichever
    /// came first (SGLang).
    pub prefill_latency: Duration,
    /// The prefill engine's prompt usage, when its protocol returns it.
    pub prefill_usage: Option<PrefillUsage>,
}

impl std::fmt::Debug for Disaggregated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disaggregated")
            .field("prefill_latency", &self.prefill_latency)
            .field("prefill_usage", &self.prefill_usage)
            .finish_non_exhaustive()
    }
}

/// Prompt usage the prefill engine reported for its leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when the engine reports it.
    pub cached_tokens: Option<u64>,
}

impl PrefillUsage {
    /// The usage of a chat completion JSON body, if it has `usage.prompt_tokens`.
    pub fn from_response(body: &Value) -> Option<PrefillUsage> {
        let usage = body.get("usage")?;
        Some(PrefillUsage {
            prompt_tokens: usage.get("prompt_tokens")?.as_u64()?,
            cached_tokens: usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_legs_follow_the_nixl_proxy_protocol() {
        let body = json!({"model": "m", "messages": [], "stream": true,
            "stream_options": {"include_usage": true}, "max_completion_tokens": 300});
        let p = vllm_prefill_leg(&body);
        assert_eq!(p["stream"], false);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(p["kv_transfer_params"]["do_remote_prefill"], false);
        let d = vllm_decode_leg(&body, json!({"do_remote_prefill": true}));
        assert_eq!(d["stream"], true);
        assert_eq!(d["max_completion_tokens"], 300);
        assert_eq!(d["kv_transfer_params"]["do_remote_prefill"], true);
    }

    #[test]
    fn sglang_legs_share_one_room() {
        let body = json!({"model": "m", "messages": [], "stream": true});
        let leg = sglang_leg(&body, "10.0.0.1", 8998, 7);
        assert_eq!(leg["bootstrap_host"], "10.0.0.1");
        assert_eq!(leg["bootstrap_port"], 8998);
        assert_eq!(leg["bootstrap_room"], 7);
        assert_eq!(leg["stream"], true, "both legs carry the client's body");
        assert!(new_bootstrap_room() < i64::MAX as u64);
    }

    #[test]
    fn prefill_usage_is_read_from_the_prefill_answer() {
        let body = json!({"usage": {"prompt_tokens": 900, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 640}}});
        let usage = PrefillUsage::from_response(&body).unwrap();
        assert_eq!((usage.prompt_tokens, usage.cached_tokens), (900, Some(640)));
        let bare = json!({"usage": {"prompt_tokens": 10}});
        // No cached count (vLLM without `--enable-prompt-tokens-details`): unknown, not 0.
        let bare = PrefillUsage::from_response(&bare).unwrap();
        assert_eq!((bare.prompt_tokens, bare.cached_tokens), (10, None));
        assert_eq!(PrefillUsage::from_response(&json!({"choices": []})), None);
    }

    async fn sim(
        flavor: agentgate_sim::Flavor,
        role: agentgate_sim::Role,
    ) -> agentgate_sim::SimHandle {
        agentgate_sim::spawn(agentgate_sim::SimConfig {
            flavor,
            role,
            listen: "127.0.0.1:0".parse().unwrap(),
            time_scale: 0.0,
            // Far longer than the test may run: a decode leg left waiting would hang it.
            kv_transfer_timeout_s: 3600.0,
            ..Default::default()
        })
        .await
        .unwrap()
    }

    fn long_body() -> Value {
        json!({"model": "sim-model", "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "prefill me somewhere else please ".repeat(80)}]})
    }

    #[tokio::test]
    async fn a_failed_sglang_prefill_leg_abandons_the_waiting_decode_leg() {
        use agentgate_sim::{Flavor as SimFlavor, Role};
        let prefill = sim(SimFlavor::Sglang, Role::Prefill).await;
        let decode = sim(SimFlavor::Sglang, Role::Decode).await;
        // The prefill engine refuses the leg before it ever opens the bootstrap room.
        reqwest::Client::new()
            .post(format!("{}/sim/faults", prefill.base_url()))
            .json(&json!({"status": 503}))
            .send()
            .await
            .unwrap();
        let client = EngineClient::new(Default::default());
        let target = PrefillTarget {
            base_url: prefill.base_url(),
            bootstrap: Some(("127.0.0.1".into(), prefill.addr().port())),
        };
        // The bound only guards against a hang; the answer comes as soon as the prefill fails.
        let opened = tokio::time::timeout(
            Duration::from_secs(300),
            client.open_disaggregated(Flavor::Sglang, &target, &decode.base_url(), &long_body()),
        )
        .await
        .expect("the decode leg is not left waiting for the transfer timeout");
        match opened {
            Err(DisaggError::Prefill(UpstreamError::Status { status: 503, .. })) => {}
            other => panic!("expected a prefill-leg 503, got {other:?}"),
        }
        prefill.shutdown().await;
        decode.shutdown().await;
    }

    #[tokio::test]
    async fn vllm_reports_the_prefill_usage() {
        use agentgate_sim::{Flavor as SimFlavor, Role};
        let prefill = sim(SimFlavor::Vllm, Role::Prefill).await;
        let decode = sim(SimFlavor::Vllm, Role::Decode).await;
        let client = EngineClient::new(Default::default());
        let target = PrefillTarget {
            base_url: prefill.base_url(),
            bootstrap: None,
        };
        let first = client
            .open_disaggregated(Flavor::Vllm, &target, &decode.base_url(), &long_body())
            .await
            .unwrap();
        let usage = first.prefill_usage.unwrap();
        assert!(usage.prompt_tokens > 400, "{usage:?}");
        assert_eq!(usage.cached_tokens.unwrap_or(0), 0, "a cold prompt");
        drop(first.stream.collect::<Vec<_>>().await);
        let again = client
            .open_disaggregated(Flavor::Vllm, &target, &decode.base_url(), &long_body())
            .await
            .unwrap();
        let usage = again.prefill_usage.unwrap();
        assert!(
            usage.prompt_tokens - usage.cached_tokens.unwrap() < 16,
            "the prefill engine kept the prompt cached: {usage:?}"
        );
        prefill.shutdown().await;
        decode.shutdown().await;
    }
}
