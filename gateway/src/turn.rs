//! Running one turn: open the engine stream, turn chat chunks into Responses events, persist.
//!
//! A turn always runs in its own task, so a client that disconnects never loses a response that
//! was already being generated: the task drives the engine stream to its end and stores the
//! result (unless `store: false`). Streaming clients read the task's events through a channel;
//! non-streaming clients await its final Response object. The terminal event is sent only after
//! the response is persisted, so a client that saw `response.completed` can chain on it at once.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use agentgate_adapters::{ChatPlan, ChunkStream, ResponseStream, SseEvent, UpstreamError};
use agentgate_sessions::{ResponseRecord, Store};

use crate::app::AppState;
use crate::error::HttpError;
use agentgate_scheduler::{Endpoint, InFlight, Permit, PinOutcome, Pinned};
use agentgate_sessions::SessionPin;

use crate::flow::{self, Pending};

use crate::pools::{PickRequest, Pool};

/// Everything needed to run one turn.
pub struct Turn {
    /// Team the response belongs to.
    pub team: String,
    /// The response id.
    pub id: String,
    /// Predecessor, if chained.
    pub previous_response_id: Option<String>,
    /// This turn's input items (ids assigned).
    pub input_items: Vec<Value>,
    /// The pool serving the model.
    pub pool: Arc<Pool>,
    /// The chat request and tool-name map.
    pub plan: ChatPlan,
    /// The Response object skeleton.
    pub skeleton: Value,
    /// Persist the result.
    pub store: bool,
    /// Background run: the record already exists (status `queued`) and is updated in place.
    pub background: bool,
    /// Return reasoning as `encrypted_content` (`include: ["reasoning.encrypted_content"]`).
    pub encrypted_reasoning: bool,
    /// The raw request body (to rebuild the engine request when truncating).
    pub request: Value,
    /// The conversation before this turn, as the engine sees it.
    pub history: Vec<Value>,
    /// The session key, when the request carries one (see `agentgate_scheduler::session_key`).
    pub session: Option<String>,
    /// The flow-control slot the turn was admitted with, released when the engine stream
    /// ends (or with the turn, on any other path).
    pub permit: Option<Permit>,
}

/// Most rounds of `truncation: "auto"` before the context-length error is returned.
const MAX_TRUNCATION_ROUNDS: usize = 8;

/// Drop the oldest quarter (at least one item) of the history after its first item, and any
/// tool outputs left without their call, so the conversation keeps its opening and its end.
pub fn drop_middle(history: &mut Vec<Value>) {
    if history.len() <= 1 {
        history.clear();
        return;
    }
    let k = ((history.len() - 1) / 4).max(1);
    history.drain(1..1 + k);
    while history
        .get(1)
        .and_then(|item| item.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t == "function_call_output" || t == "reasoning")
    {
        history.remove(1);
    }
}

/// Open the engine stream for a turn. With `truncation: "auto"`, a context-length rejection
/// drops items from the middle of the history and tries again; the stored conversation is
/// unchanged, only what the engine sees is shorter.
pub async fn open_turn(
    state: &AppState,
    turn: &mut Turn,
) -> Result<(ChunkStream, Routed), HttpError> {
    let auto = turn.request.get("truncation").and_then(Value::as_str) == Some("auto");
    let mut rounds = 0;
    loop {
        match open_upstream(state, &turn.pool, &turn.plan.body, turn.session.as_deref()).await {
            Err(e)
                if auto
                    && rounds < MAX_TRUNCATION_ROUNDS
                    && !turn.history.is_empty()
                    && e.error.code.as_deref() == Some("context_length_exceeded") =>
            {
                rounds += 1;
                drop_middle(&mut turn.history);
                tracing::info!(response = %turn.id, remaining = turn.history.len(), "context too long; truncating history");
                let opts = agentgate_adapters::TranslateOptions {
                    flavor: turn.pool.flavor,
                    hosted_tools: state.hosted_tools,
                };
                let mut plan = agentgate_adapters::build_chat_request(
                    &turn.request,
                    &turn.history,
                    &turn.input_items,
                    &opts,
                )?;
                plan.body["model"] = Value::from(turn.pool.model.clone());
                turn.plan = plan;
            }
            other => return other,
        }
    }
}

/// Where a request was sent: the in-flight guard, the endpoint's slot in its pool, and the
/// prompt's chunk hashes when the pool's policy routes by prefix.
#[derive(Debug)]
pub struct Routed {
    /// Counts the request on its endpoint until dropped.
    pub in_flight: InFlight,
    /// The endpoint's slot in the pool's per-endpoint tables.
    pub slot: usize,
    /// Leading prompt chunks the prefix index expected the endpoint to hold.
    pub matched_chunks: usize,
    /// Chunk hashes of the rendered prompt (empty unless the policy uses a prefix index).
    pub prefix: Vec<u64>,
    /// Why this endpoint: `pin`, `prefix`, `load` or `round_robin` (the scorer that decided).
    pub reason: &'static str,
}

impl Routed {
    /// The endpoint serving the request.
    pub fn endpoint(&self) -> &Arc<agentgate_scheduler::Endpoint> {
        self.in_flight.endpoint()
    }
}

/// The session's pin in the store, when the pool's policy pins sessions. A store error is
/// logged and treated as no pin: routing goes on by prefix and load.
async fn session_pin(state: &AppState, pool: &Pool, session: Option<&str>) -> Option<SessionPin> {
    let key = session.filter(|_| pool.policy.uses_pins())?;
    match state.store.get_pin(&pool.name, key).await {
        Ok(pin) => pin,
        Err(e) => {
            tracing::warn!("session pin unavailable ({e}); routing by prefix and load");
            None
        }
    }
}

/// Open a chat stream on one of the pool's endpoints, trying the others when an endpoint is
/// unreachable or answers 5xx. A 4xx from the engine is the client's problem and returned as 400.
///
/// The pool's picker chooses (see `agentgate_scheduler::pipeline`): under the `session` policy
/// the session's pin (read from the store, so every gateway replica agrees) holds until its
/// endpoint is unavailable or saturated, or waiting there costs more than recomputing the
/// prefix elsewhere; when the chosen endpoint differs from the pin, the session is re-pinned in
/// the store and the move counted with its cause.
pub async fn open_upstream(
    state: &AppState,
    pool: &Pool,
    body: &Value,
    session: Option<&str>,
) -> Result<(ChunkStream, Routed), HttpError> {
    let pin = session_pin(state, pool, session).await;
    let endpoints = pool.endpoints();
    let pinned = match &pin {
        None => Pinned::None,
        Some(p) => endpoints
            .iter()
            .position(|e| e.name == p.endpoint)
            .map_or(Pinned::Gone, Pinned::At),
    };
    let prompt_tokens = agentgate_adapters::estimate_prompt_tokens(body);
    let prefix: Vec<u64> = match pool.picker.prefix_index() {
        Some(index) => index.chunk_hashes(&pool.model, &agentgate_adapters::prompt_text(body)),
        None => Vec::new(),
    };
    let mut tried: Vec<usize> = Vec::new();
    let mut last = String::from("no available endpoint");
    loop {
        let request = PickRequest {
            exclude: &tried,
            prefix: &prefix,
            prompt_tokens,
            pinned,
            role: None,
        };
        let Some(pick) = pool.picker.pick(&endpoints, &request) else {
            break;
        };
        tried.push(pick.index);
        let ep = &endpoints[pick.index];
        let in_flight = ep.begin(prompt_tokens, pick.uncached_tokens_estimate);
        match state.engines.chat_stream(&ep.base_url, body).await {
            Ok(stream) => {
                pool.picker.routed(ep.slot, &prefix);
                state
                    .metrics
                    .routing_decision(&pool.name, &ep.name, pick.reason.as_str());
                if let Some(key) = session.filter(|_| pool.policy.uses_pins()) {
                    repin(state, pool, key, pin.as_ref(), ep, pick.pin).await;
                }
                tracing::debug!(
                    endpoint = %ep.name,
                    reason = pick.reason.as_str(),
                    pin = pick.pin.as_str(),
                    uncached = pick.uncached_tokens_estimate,
                    "routed"
                );
                return Ok((
                    stream,
                    Routed {
                        in_flight,
                        slot: ep.slot,
                        matched_chunks: pick.matched_chunks,
                        prefix,
                        reason: pick.reason.as_str(),
                    },
                ));
            }
            Err(
                e @ UpstreamError::Status {
                    status: 400 | 413 | 422,
                    ..
                },
            ) => {
                let api = e.to_api_error();
                tracing::info!(endpoint = %ep.name, "engine rejected the request: {}", api.message);
                return Err(api.into());
            }
            Err(e) => {
                tracing::warn!(endpoint = %ep.name, "engine request failed: {e}");
                last = e.to_string();
            }
        }
    }
    Err(HttpError::server(
        503,
        format!(
            "No replica serving model '{}' could take the request ({last}). Retry shortly.",
            pool.model
        ),
        "upstream_unavailable",
    )
    .with_retry_after(1))
}

/// Point the session's pin at `ep` when it points elsewhere (or nowhere yet), and count a move.
async fn repin(
    state: &AppState,
    pool: &Pool,
    key: &str,
    pin: Option<&SessionPin>,
    ep: &Endpoint,
    outcome: PinOutcome,
) {
    if pin.is_some_and(|p| p.endpoint == ep.name) {
        return;
    }
    let new = SessionPin {
        endpoint: ep.name.clone(),
        moves: pin.map_or(0, |p| p.moves + 1),
    };
    if let Err(e) = state.store.swap_pin(&pool.name, key, pin, &new).await {
        tracing::warn!("could not store the session pin: {e}");
    }
    if let Some(old) = pin {
        // A pin that held but whose endpoint then failed this request moved because it failed.
        let cause = match outcome {
            PinOutcome::Broken(cause) => cause.as_str(),
            _ => "failed",
        };
        state.metrics.pin_moved(&pool.name, cause);
        tracing::info!(from = %old.endpoint, to = %ep.name, moves = new.moves, cause, "session re-pinned");
    }
}

fn new_stream(turn: &Turn) -> ResponseStream {
    ResponseStream::new(turn.skeleton.clone(), turn.plan.tool_names.clone())
        .with_encrypted_reasoning(turn.encrypted_reasoning)
}

/// Send events to the client if it is still there; a gone client does not stop the turn.
async fn emit(tx: &Option<mpsc::Sender<Bytes>>, events: Vec<SseEvent>) {
    if let Some(tx) = tx {
        for ev in &events {
            if tx.send(Bytes::from(ev.to_sse_frame())).await.is_err() {
                return;
            }
        }
    }
}

/// Drive an opened engine stream to the end, persist, then send the terminal event.
/// Returns the final Response object.
pub async fn drive(
    state: Arc<AppState>,
    mut turn: Turn,
    mut chunks: ChunkStream,
    mut routed: Routed,
    tx: Option<mpsc::Sender<Bytes>>,
    mut cancel: Option<watch::Receiver<bool>>,
) -> Value {
    let endpoint = routed.endpoint().clone();
    let mut rs = new_stream(&turn);
    emit(&tx, rs.start()).await;
    let terminal = loop {
        let next = match cancel.as_mut() {
            Some(cancel) => tokio::select! {
                chunk = chunks.next() => chunk,
                _ = cancel.wait_for(|c| *c) => {
                    tracing::info!(response = %turn.id, "background response cancelled while running");
                    break rs.fail("response_cancelled", "The response was cancelled.");
                }
            },
            None => chunks.next().await,
        };
        match next {
            Some(Ok(chunk)) => {
                // The engine is past this request's prefill: it no longer delays new work there.
                routed.in_flight.prefill_done();
                let events = rs.on_chunk(&chunk);
                emit(&tx, events).await;
            }
            Some(Err(e)) => {
                tracing::warn!(response = %turn.id, endpoint = %endpoint.name, "engine stream failed: {e}");
                break rs.fail(
                    e.failure_code(),
                    &format!("The model backend failed while generating the response: {e}"),
                );
            }
            None => break rs.finish(),
        }
    };
    let response = rs.response().clone();
    persist(&state, &turn, &response, rs.output_items()).await;
    let status = response
        .get("status")
        .and_then(|s| s.as_str())
        .unwrap_or("")
        .to_string();
    tracing::info!(
        response = %turn.id,
        team = %turn.team,
        endpoint = %endpoint.name,
        status = %status,
        "turn finished"
    );
    if status == "completed" || status == "incomplete" {
        let cached = response
            .pointer("/usage/input_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        turn.pool
            .picker
            .completed(routed.slot, &routed.prefix, routed.matched_chunks, cached);
    }
    drop(routed);
    if let Some(permit) = turn.permit.take() {
        flow::finish(permit, &response);
    }
    emit(&tx, terminal).await;
    response
}

/// Store the finished response (or update the background record in place).
pub async fn persist(state: &AppState, turn: &Turn, response: &Value, output: &[Value]) {
    if !turn.store {
        return;
    }
    let result = if turn.background {
        state
            .store
            .update_if_active(&turn.team, &turn.id, response, output)
            .await
            .map(|applied| {
                if !applied {
                    tracing::info!(response = %turn.id, "background response was cancelled; result discarded");
                }
            })
    } else {
        let record = ResponseRecord {
            id: turn.id.clone(),
            team: turn.team.clone(),
            previous_response_id: turn.previous_response_id.clone(),
            input_items: turn.input_items.clone(),
            output_items: output.to_vec(),
            response: response.clone(),
        };
        state.store.put(&record).await
    };
    if let Err(e) = result {
        tracing::error!(response = %turn.id, "could not store the response: {e}");
    }
}

/// The stored record of a background response before it runs.
pub fn queued_record(turn: &Turn) -> ResponseRecord {
    ResponseRecord {
        id: turn.id.clone(),
        team: turn.team.clone(),
        previous_response_id: turn.previous_response_id.clone(),
        input_items: turn.input_items.clone(),
        output_items: Vec::new(),
        response: turn.skeleton.clone(),
    }
}

/// Run a background turn: wait for a background slot, then for flow-control admission
/// (`admission`, in the team's lowest band unless the request asked for one), mark it
/// `in_progress`, run it, record the result. A refused admission fails the response with the
/// refusal's code.
pub async fn run_background(
    state: Arc<AppState>,
    mut turn: Turn,
    admission: Option<Pending>,
    tx: Option<mpsc::Sender<Bytes>>,
    mut cancel: watch::Receiver<bool>,
) {
    let id = turn.id.clone();
    let _permit = tokio::select! {
        permit = state.background_slots.clone().acquire_owned() => permit,
        _ = cancel.wait_for(|c| *c) => {
            forget_run(&state, &id);
            return; // cancelled while queued
        }
    };
    if let Some(pending) = admission {
        let admitted = tokio::select! {
            admitted = pending.admit() => admitted,
            _ = cancel.wait_for(|c| *c) => {
                forget_run(&state, &id);
                return; // cancelled while queued
            }
        };
        match admitted {
            Ok(permit) => turn.permit = Some(permit),
            Err(err) => {
                fail_background(&state, &turn, &tx, &err).await;
                forget_run(&state, &id);
                return;
            }
        }
    }
    let mut in_progress = turn.skeleton.clone();
    in_progress["status"] = Value::from("in_progress");
    match state
        .store
        .update_if_active(&turn.team, &turn.id, &in_progress, &[])
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            forget_run(&state, &id);
            return; // cancelled while queued
        }
        Err(e) => tracing::error!(response = %turn.id, "store error starting background run: {e}"),
    }
    turn.skeleton = in_progress;
    match open_turn(&state, &mut turn).await {
        Ok((chunks, ep)) => {
            drive(state.clone(), turn, chunks, ep, tx, Some(cancel)).await;
        }
        Err(err) => fail_background(&state, &turn, &tx, &err).await,
    }
    forget_run(&state, &id);
}

/// Record a background response that could not run as failed with `err`'s code and message,
/// and tell a streaming client.
async fn fail_background(
    state: &AppState,
    turn: &Turn,
    tx: &Option<mpsc::Sender<Bytes>>,
    err: &HttpError,
) {
    let mut rs = new_stream(turn);
    let mut events = rs.start();
    events.extend(rs.fail(
        err.error.code.as_deref().unwrap_or("server_error"),
        &err.error.message,
    ));
    persist(state, turn, rs.response(), rs.output_items()).await;
    emit(tx, events).await;
}

fn forget_run(state: &AppState, id: &str) {
    if let Ok(mut runs) = state.background.lock() {
        runs.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn item(kind: &str, n: usize) -> Value {
        json!({"type": kind, "id": format!("{kind}_{n}")})
    }

    #[test]
    fn drop_middle_keeps_the_opening_and_the_end() {
        let mut h: Vec<Value> = (0..9).map(|n| item("message", n)).collect();
        drop_middle(&mut h);
        let ids: Vec<&str> = h.iter().map(|i| i["id"].as_str().unwrap()).collect();
        assert_eq!(
            ids,
            [
                "message_0",
                "message_3",
                "message_4",
                "message_5",
                "message_6",
                "message_7",
                "message_8"
            ]
        );
    }

    #[test]
    fn drop_middle_never_leaves_an_orphan_tool_output() {
        let mut h = vec![
            item("message", 0),
            item("function_call", 1),
            item("function_call_output", 2),
            item("message", 3),
        ];
        drop_middle(&mut h);
        assert_eq!(h.len(), 2);
        assert_eq!(h[1]["type"], "message");
        let mut one = vec![item("message", 0)];
        drop_middle(&mut one);
        assert!(one.is_empty());
    }
}
