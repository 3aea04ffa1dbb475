//! The Responses API handlers: create, compact, retrieve (and follow), delete, cancel, input
//! items, input tokens.
//!
//! `create` resolves the conversation (`previous_response_id` -> the stored history, in one store
//! round trip), translates the turn for the pool's engine flavor, admits it through flow control
//! ([`crate::flow`]: it may wait there while the pool is full) and hands it to [`crate::turn`].
//! `compact` runs the same path for a turn ending with a `compaction_trigger`
//! (`agentgate_adapters::compaction`). A background response logs its events in the store as it
//! runs, and `retrieve` with `stream=true` replays and follows that log (`stream_stored`), so
//! a client can pick its stream up again on any gateway replica. Every stored object is scoped
//! to the team whose key created it: other teams get 404.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use agentgate_adapters::{build_chat_request, includes_encrypted_reasoning, normalize_input};
use agentgate_sessions::{ResponseRecord, Store, StoreError};

use crate::app::AppState;
use crate::auth::Team;
use crate::error::HttpError;
use crate::flow;
use crate::pools::{Endpoint, Pool};

use crate::request::{parse_json_body, validate_common, CreateRequest};
use crate::response_object::{new_id, now_secs, skeleton};
use crate::turn::{self, Turn};

/// Header naming the endpoint that served a response (for debugging routing).
pub const ENDPOINT_HEADER: &str = "x-agentgate-endpoint";

pub(crate) fn body_error(rejection: BytesRejection, limit: usize) -> HttpError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        HttpError::new(
            413,
            "invalid_request_error",
            format!("The request body is larger than this gateway accepts ({limit} bytes)."),
            None,
            Some("request_too_large"),
        )
    } else {
        HttpError::invalid(
            format!("Could not read the request body: {rejection}."),
            None,
            Some("invalid_body"),
        )
    }
}

/// The error code of a prompt over the engine's context window.
const CONTEXT_LENGTH_EXCEEDED: &str = "context_length_exceeded";

/// The answer to a store failure: 503 (nothing was lost, the client may retry) when the store
/// is unavailable; 400 `previous_response_not_found` when part of the chain is gone (a retry
/// would not bring it back); 500 without `Retry-After` for stored data this gateway cannot read.
pub fn store_error(e: StoreError) -> HttpError {
    tracing::error!("store error: {e}");
    match e {
        StoreError::Lost { missing, .. } => HttpError::invalid(
            format!(
                "Previous response with id '{missing}', earlier in this chain, is no longer stored (the store evicted or lost it), so the conversation's history cannot be rebuilt."
            ),
            Some("previous_response_id"),
            Some("previous_response_not_found"),
        ),
        StoreError::Corrupt { id, .. } => HttpError::server(
            500,
            format!("The stored response '{id}' cannot be read by this gateway."),
            "store_corrupt",
        ),
        _ => HttpError::server(
            503,
            "The conversation store is unavailable. Retry shortly.",
            "store_unavailable",
        )
        .with_retry_after(1),
    }
}

/// An unknown model, as the Responses API answers it: 400 (Chat Completions and `GET
/// /v1/models/{id}` answer 404).
fn model_not_found(model: &str) -> HttpError {
    HttpError::new(
        400,
        "invalid_request_error",
        format!("The requested model '{model}' does not exist."),
        Some("model"),
        Some("model_not_found"),
    )
}

fn response_not_found(id: &str) -> HttpError {
    HttpError::not_found(format!("Response with id '{id}' not found."), None)
}

/// The team's stored record `id`, or 404.
async fn load_record(
    state: &AppState,
    team: &Team,
    id: &str,
) -> Result<agentgate_sessions::ResponseRecord, HttpError> {
    state
        .store
        .get(&team.0, id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| response_not_found(id))
}

/// The items response `rec` was given: its chain's items up to and including its own input.
/// Walked from the response itself, so a predecessor deleted through the API is where the
/// list starts, and one the store lost is an error naming it (no parameter of a listing is at
/// fault), never a list silently cut short.
async fn input_items_of(
    state: &AppState,
    team: &Team,
    rec: ResponseRecord,
) -> Result<Vec<Value>, HttpError> {
    if rec.previous_response_id.is_none() {
        return Ok(rec.input_items);
    }
    let history = state
        .store
        .history(&team.0, &rec.id)
        .await
        .map_err(|e| match e {
            StoreError::Lost { missing, .. } => HttpError::new(
                404,
                "invalid_request_error",
                format!(
                    "Response '{missing}', earlier in this response's chain, is no longer stored \
                     (the store evicted or lost it), so the items this response was given \
                     cannot be listed."
                ),
                None,
                Some("previous_response_not_found"),
            ),
            e => store_error(e),
        })?;
    Ok(match history {
        Some(history) => {
            let mut items = history.items;
            items.truncate(items.len().saturating_sub(rec.output_items.len()));
            items
        }
        // Deleted meanwhile.
        None => rec.input_items,
    })
}

fn previous_not_found(id: &str) -> HttpError {
    HttpError::invalid(
        format!("Previous response with id '{id}' not found."),
        Some("previous_response_id"),
        Some("previous_response_not_found"),
    )
}

/// Resolve `item_reference` input items. A reference to an item already in the conversation
/// (the loaded history or earlier in this input) adds nothing new to the context, so it is
/// dropped rather than duplicated; one to an output item of another stored response of the
/// team (a client that sends its whole history by reference, without `previous_response_id`)
/// is replaced by that item, found through its id (`agentgate_adapters::response_of_item`);
/// a reference to an unknown item is a 400. An item whose id is already in the history or
/// earlier in this input is a 400, as OpenAI answers it (two items with one id would make
/// `after=<id>` pagination repeat or loop). Returns the items kept and, for each, its position
/// in the request's `input` (for error `param`s).
async fn resolve_item_references(
    state: &AppState,
    team: &Team,
    items: Vec<Value>,
    history: &[Value],
) -> Result<(Vec<Value>, Vec<usize>), HttpError> {
    fn item_id(item: &Value) -> Option<&str> {
        item.get("id").and_then(Value::as_str)
    }
    // The ids in the conversation so far: the history's, then each kept item's as it is kept.
    let history_ids: HashSet<&str> = history.iter().filter_map(item_id).collect();
    let mut input_ids: HashSet<String> = HashSet::new();
    let mut out: Vec<Value> = Vec::with_capacity(items.len());
    let mut positions = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        if item.get("type").and_then(Value::as_str) != Some("item_reference") {
            if let Some(id) = item_id(&item) {
                if history_ids.contains(id) || !input_ids.insert(id.to_owned()) {
                    return Err(duplicate_item(id, "input"));
                }
            }
            out.push(item);
            positions.push(i);
            continue;
        }
        let id = item_id(&item).unwrap_or_default();
        if history_ids.contains(id) || input_ids.contains(id) {
            continue;
        }
        let Some(stored) = stored_output_item(state, team, id).await? else {
            return Err(HttpError::invalid(
                format!("Item with id '{id}' not found."),
                Some(&format!("input[{i}]")),
                Some("item_not_found"),
            ));
        };
        input_ids.insert(id.to_owned());
        out.push(stored);
        positions.push(i);
    }
    Ok((out, positions))
}

/// Output item `id` of the team's stored response it names, if that response and item exist.
async fn stored_output_item(
    state: &AppState,
    team: &Team,
    id: &str,
) -> Result<Option<Value>, HttpError> {
    let Some(response) = agentgate_adapters::response_of_item(id) else {
        return Ok(None);
    };
    let record = state
        .store
        .get(&team.0, &response)
        .await
        .map_err(store_error)?;
    Ok(record.and_then(|rec| {
        rec.output_items
            .into_iter()
            .find(|item| item.get("id").and_then(Value::as_str) == Some(id))
    }))
}

/// 400 for an item whose id the conversation already holds, on `param`.
pub fn duplicate_item(id: &str, param: &str) -> HttpError {
    HttpError::invalid(
        format!("Duplicate item found with id {id}. Remove duplicate items from your {param} and try again."),
        Some(param),
        Some("duplicate_item"),
    )
}

/// For a `param` of `input[k]...` (`k` counting the input items kept): `input[k]` and the same
/// item as the client sent it, `input[n]`.
fn param_in_request(param: &str, positions: &[usize]) -> Option<(String, String)> {
    let rest = param.strip_prefix("input[")?;
    let (k, _) = rest.split_once(']')?;
    let kept = k.parse::<usize>().ok()?;
    let sent = positions.get(kept)?;
    Some((format!("input[{kept}]"), format!("input[{sent}]")))
}

/// A resolved turn before it runs: pool, history, translated plan.
struct Prepared {
    pool: Arc<Pool>,
    history: Vec<Value>,
    /// Root of the `previous_response_id` chain, when the request continues one.
    chain_root: Option<String>,
    input_items: Vec<Value>,
    plan: agentgate_adapters::ChatPlan,
}

async fn prepare(
    state: &AppState,
    team: &Team,
    body: &Value,
    model: &str,
    previous: Option<&str>,
    conversation: Option<&str>,
) -> Result<Prepared, HttpError> {
    let pool = state
        .pools
        .for_model(model)
        .ok_or_else(|| model_not_found(model))?;
    let input = body.get("input").cloned().unwrap_or_else(|| json!([]));
    let input_items = normalize_input(&input)?;
    let (history, chain_root) = match (previous, conversation) {
        (_, Some(id)) => {
            let items = crate::conversations::items(state, team, id)
                .await
                .map_err(|mut e| {
                    if e.error.status == 404 {
                        e.error.param = Some("conversation".into());
                    }
                    e
                })?;
            (items, None)
        }
        (Some(prev), None) => {
            let history = || async {
                state
                    .store
                    .history(&team.0, prev)
                    .await
                    .map_err(store_error)?
                    .ok_or_else(|| previous_not_found(prev))
            };
            let mut h = history().await?;
            if matches!(h.status.as_str(), "queued" | "in_progress") {
                // A background response lost with its gateway is said so, not "not finished"
                // (and one that finished meanwhile is read again, its answer with it).
                if settle_orphan_by_id(state, team, prev).await {
                    h = history().await?;
                }
            }
            previous_answered(prev, &h.status)?;
            // A response made in a conversation holds only its own turn: continued by its id,
            // the conversation's earlier items would be silently left out. (Only a chain's
            // root can be one: a continuation of it is refused here.)
            if h.root_id == prev {
                refuse_conversation_response(state, team, prev).await?;
            }
            (h.items, Some(h.root_id))
        }
        (None, None) => (Vec::new(), None),
    };
    let (input_items, positions) =
        resolve_item_references(state, team, input_items, &history).await?;
    if input_items.is_empty() && history.is_empty() {
        return Err(HttpError::invalid(
            "'input' must contain at least one item when there is no 'previous_response_id'.",
            Some("input"),
            Some("empty_input"),
        ));
    }
    let opts = state.translate_options(&pool);
    let mut plan = build_chat_request(body, &history, &input_items, &opts).map_err(|mut e| {
        // The history came from the conversation, not from a previous response.
        if let Some(rest) = conversation
            .and(e.param.as_deref())
            .and_then(|p| p.strip_prefix("previous_response_id"))
        {
            e.param = Some(format!("conversation{rest}"));
        }
        if let Some((kept, sent)) = e
            .param
            .as_deref()
            .and_then(|p| param_in_request(p, &positions))
        {
            e.message = e.message.replace(&kept, &sent);
            e.param = e.param.map(|p| p.replacen(&kept, &sent, 1));
        }
        e
    })?;
    plan.body["model"] = Value::from(pool.model.clone());
    Ok(Prepared {
        pool,
        history,
        chain_root,
        input_items,
        plan,
    })
}

/// An SSE response of the frames sent on `rx`; `held` goes with the body, so its sender sees
/// it closed when the body is dropped (the client went away, or the stream ended).
fn sse_response(
    rx: mpsc::Receiver<Bytes>,
    endpoint: Option<&Endpoint>,
    held: Option<mpsc::Receiver<()>>,
) -> Response {
    let stream = futures_util::stream::unfold((rx, held), |(mut rx, held)| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(b), (rx, held)))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Some(ep) = endpoint {
        if let Ok(v) = HeaderValue::from_str(&ep.name) {
            h.insert(ENDPOINT_HEADER, v);
        }
    }
    resp
}

fn json_with_endpoint(value: Value, endpoint: Option<&Endpoint>) -> Response {
    let mut resp = Json(value).into_response();
    if let Some(ep) = endpoint {
        if let Ok(v) = HeaderValue::from_str(&ep.name) {
            resp.headers_mut().insert(ENDPOINT_HEADER, v);
        }
    }
    resp
}

/// Header naming what decided the endpoint: `pin`, `prefix`, `load` or `round_robin`.
pub const ROUTE_REASON_HEADER: &str = "x-agentgate-route-reason";

/// Header present when the request's session was pinned to another endpoint and moved: why
/// (`unavailable`, `saturated`, `wait`, `outscored`, `failed`; see `agentgate_scheduler::pin`).
pub const PIN_MOVED_HEADER: &str = "x-agentgate-pin-moved";

/// The request's session key (configured header, agents' native headers, `prompt_cache_key`,
/// the root of its `previous_response_id` chain, `conversation`). A stored first turn with none
/// of these is the root of the chain its successors will form, so it is keyed by its own id.
fn session_key_of(
    state: &AppState,
    team: &str,
    headers: &HeaderMap,
    body: &Value,
    chain_root: Option<&str>,
) -> Option<String> {
    let cfg = agentgate_scheduler::SessionKeyConfig {
        header: state.config.routing.session_header.clone(),
        native_headers: state.config.routing.native_session_headers,
    };
    let owned = turn::header_texts(headers);
    let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_ref())).collect();
    agentgate_scheduler::session_key(&cfg, &pairs, body, chain_root)
        .map(|k| turn::team_session_key(team, k.value))
}

/// `POST /v1/responses`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let bytes = body.map_err(|r| body_error(r, state.config.server.max_body_bytes))?;
    let req = CreateRequest::from_body(
        parse_json_body(&headers, &bytes, state.config.server.parse_inline_bytes).await?,
    )?;
    match run(&state, &headers, team, req, bytes.len() as u64).await? {
        Started::Answered(resp) => Ok(resp),
        Started::Finished(done) => {
            let response = finished_or_error(done.response)?;
            let resp = with_reason(
                json_with_endpoint(response, Some(&done.endpoint)),
                done.reason,
            );
            Ok(with_headers(resp, done.flow_headers))
        }
    }
}

/// `POST /v1/responses/compact`: the conversation (`previous_response_id` and/or `input`)
/// compacted into its user messages and one `compaction` item, as a `response.compaction`
/// object. It runs as a turn whose input ends with a `compaction_trigger`
/// (`agentgate_adapters::compaction`), not stored; `stream` and `background` do not apply.
pub async fn compact(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let bytes = body.map_err(|r| body_error(r, state.config.server.max_body_bytes))?;
    let mut body =
        parse_json_body(&headers, &bytes, state.config.server.parse_inline_bytes).await?;
    let Some(fields) = body.as_object_mut() else {
        return Err(HttpError::invalid(
            "The request body must be a JSON object.",
            None,
            Some("invalid_type"),
        ));
    };
    for param in ["stream", "background"] {
        match fields.get(param) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => {
                return Err(HttpError::invalid(
                    format!("'{param}' is not supported by /v1/responses/compact."),
                    Some(param),
                    Some("unsupported_parameter"),
                ))
            }
            Some(_) => return Err(crate::request::invalid_type(param, "a boolean")),
        }
    }
    if fields.get("conversation").is_some_and(|c| !c.is_null()) {
        return Err(HttpError::invalid(
            "'conversation' is not supported by /v1/responses/compact: compact its items by \
             sending them as 'input'.",
            Some("conversation"),
            Some("unsupported_parameter"),
        ));
    }
    if !matches!(
        fields.get("previous_response_id"),
        None | Some(Value::Null | Value::String(_))
    ) {
        return Err(crate::request::invalid_type(
            "previous_response_id",
            "a string",
        ));
    }
    let input = fields.get("input").cloned().unwrap_or(Value::Null);
    let mut input = normalize_input(&input)?;
    let previous = fields
        .get("previous_response_id")
        .and_then(Value::as_str)
        .map(str::to_owned);
    if input.is_empty() && previous.is_none() {
        return Err(HttpError::invalid(
            "Nothing to compact: give 'input', 'previous_response_id', or both.",
            Some("input"),
            Some("missing_required_parameter"),
        ));
    }
    let retained_input: Vec<Value> = input.clone();
    input.push(json!({"type": "compaction_trigger"}));
    fields.insert("input".into(), Value::Array(input));
    fields.insert("stream".into(), Value::Bool(false));
    fields.insert("background".into(), Value::Bool(false));
    fields.insert("store".into(), Value::Bool(false));
    let req = CreateRequest::from_body(body)?;
    let done = match run(&state, &headers, team, req, bytes.len() as u64).await? {
        Started::Finished(done) => done,
        Started::Answered(resp) => return Ok(resp),
    };
    let response = finished_or_error(done.response)?;
    let item = response
        .get("output")
        .and_then(Value::as_array)
        .and_then(|output| output.iter().find(|i| i["type"] == "compaction"))
        .cloned()
        .ok_or_else(|| {
            HttpError::server(
                500,
                "The compaction produced no summary.",
                "compaction_failed",
            )
            .with_headers(vec![(SHOULD_RETRY_HEADER, "false".into())])
        })?;
    let mut output: Vec<Value> =
        agentgate_adapters::compaction::retained_user_messages(&done.history, &retained_input)
            .cloned()
            .collect();
    output.push(item);
    let compacted = json!({
        "id": new_id("resp"),
        "object": "response.compaction",
        "created_at": now_secs(),
        "output": output,
        "usage": response.get("usage").cloned().unwrap_or(Value::Null),
    });
    let resp = with_reason(
        json_with_endpoint(compacted, Some(&done.endpoint)),
        done.reason,
    );
    Ok(with_headers(resp, done.flow_headers))
}

/// How [`run`] left a request.
enum Started {
    /// Answered already: a stream, or a background response's `queued` object.
    Answered(Response),
    /// Not streamed: the finished Response object, whatever its status.
    Finished(Finished),
}

/// A non-streamed turn that ran to its end.
struct Finished {
    response: Value,
    endpoint: Arc<Endpoint>,
    reason: (&'static str, Option<&'static str>),
    flow_headers: Vec<(&'static str, String)>,
    /// A compaction turn's history (empty for other turns).
    history: Vec<Value>,
}

/// A turn continues from a previous response's answer: one still queued or running has none
/// yet, and a failed or cancelled one has none to go on from (a failed one may end in a tool
/// call cut short).
fn previous_answered(id: &str, status: &str) -> Result<(), HttpError> {
    let why = match status {
        "queued" | "in_progress" => "has not finished yet; continue from it once it has",
        "failed" | "cancelled" => {
            "has no answer to continue from; continue from the response before it, or retry it"
        }
        _ => return Ok(()),
    };
    Err(HttpError::invalid(
        format!("Previous response '{id}' is {status}: it {why}."),
        Some("previous_response_id"),
        Some("invalid_value"),
    ))
}

/// A failed non-streamed response as the HTTP error it is: 503 when the store could not keep
/// it or the gateway is shutting down, 400 when the engine found fault with the request in its
/// stream (a prompt over the context window, an invalid request), 502 for an engine failure.
fn finished_or_error(response: Value) -> Result<Value, HttpError> {
    if response.get("status").and_then(Value::as_str) != Some("failed") {
        return Ok(response);
    }
    let message = response
        .pointer("/error/message")
        .and_then(Value::as_str)
        .unwrap_or("The model backend failed.")
        .to_string();
    let code = response.pointer("/error/code").and_then(Value::as_str);
    Err(match code {
        Some(code @ (turn::UNSTORED_CODE | turn::SHUTDOWN_CODE)) => {
            HttpError::server(503, message, code).with_retry_after(1)
        }
        // The model wrote no summary: trying again the same way would do the same (the
        // OpenAI SDKs retry a 500 unless told not to).
        Some(code @ "compaction_failed") => HttpError::server(500, message, code)
            .with_headers(vec![(SHOULD_RETRY_HEADER, "false".into())]),
        Some(CONTEXT_LENGTH_EXCEEDED) => {
            HttpError::invalid(message, Some("input"), Some(CONTEXT_LENGTH_EXCEEDED))
        }
        // A fault of the request the engine reported in its stream: the 400 its HTTP answer
        // would have been.
        Some("invalid_prompt") => HttpError::invalid(message, None, Some("invalid_request")),
        _ => HttpError::server(502, message, "upstream_error").with_retry_after(1),
    })
}

/// The header by which the OpenAI SDKs are told whether to retry a failed request.
const SHOULD_RETRY_HEADER: &str = "x-should-retry";

/// 400 on `previous_response_id` when `prev` was created in a conversation, which holds the
/// history it continues.
async fn refuse_conversation_response(
    state: &AppState,
    team: &Team,
    prev: &str,
) -> Result<(), HttpError> {
    let record = state.store.get(&team.0, prev).await.map_err(store_error)?;
    let conversation = record.as_ref().and_then(|r| {
        r.response
            .pointer("/conversation/id")
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    match conversation {
        Some(conversation) => Err(HttpError::invalid(
            format!(
                "Response '{prev}' was created in conversation '{conversation}', which holds \
                 the history it continues: send the next turn with 'conversation', not \
                 'previous_response_id'."
            ),
            Some("previous_response_id"),
            Some("invalid_value"),
        )),
        None => Ok(()),
    }
}

/// What a request waiting in a band's queue counts against its `max_queued_bytes`: its body,
/// or its engine request when that is larger (four bytes per estimated prompt token, the
/// estimate's own ratio). A turn continuing a stored chain, or a conversation, sends a small
/// body but holds the whole history, loaded from the store, while it waits.
fn queued_bytes(body_bytes: u64, prompt_tokens: u64) -> u64 {
    body_bytes.max(prompt_tokens.saturating_mul(4))
}

/// Prepare, admit, place and run one Responses request from its parsed body.
async fn run(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    team: Team,
    req: CreateRequest,
    body_bytes: u64,
) -> Result<Started, HttpError> {
    let id = new_id("resp");
    // One turn at a time in a conversation: locked before its items are read, released once
    // the turn's items are in (or, on a refusal, before the client is answered). A request
    // whose model or input is wrong is told so, not that the conversation is busy.
    let conversation_lock = match req.conversation.as_deref() {
        Some(conversation) => Some({
            state
                .pools
                .for_model(&req.model)
                .ok_or_else(|| model_not_found(&req.model))?;
            if let Some(input) = req.body.get("input") {
                normalize_input(input)?;
            }
            crate::conversations::ConversationLock::take(
                &state.store,
                &team,
                conversation,
                &id,
                req.background,
            )
            .await?
        }),
        None => None,
    };
    let started = run_turn(
        state,
        headers,
        team,
        req,
        body_bytes,
        id,
        conversation_lock.clone(),
    )
    .await;
    if let (Err(_), Some(lock)) = (&started, &conversation_lock) {
        lock.release().await;
    }
    started
}

/// [`run`] with the response's id and its conversation's lock taken.
async fn run_turn(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    team: Team,
    req: CreateRequest,
    body_bytes: u64,
    id: String,
    conversation_lock: Option<crate::conversations::ConversationLock>,
) -> Result<Started, HttpError> {
    let prepared = prepare(
        state,
        &team,
        &req.body,
        &req.model,
        req.previous_response_id.as_deref(),
        req.conversation.as_deref(),
    )
    .await?;
    // A full conversation takes no more turns (counting a prompt's tokens in it adds nothing:
    // `input_tokens` is not refused).
    if let Some(id) = req.conversation.as_deref() {
        crate::conversations::check_room(state, id, prepared.history.len(), 0, "conversation")?;
    }
    let continuing = prepared.chain_root.is_some()
        || !prepared.history.is_empty()
        || req.conversation.is_some()
        || flow::input_continues(&prepared.input_items);
    let status = if req.background {
        "queued"
    } else {
        "in_progress"
    };
    let session = session_key_of(
        state,
        &team.0,
        headers,
        &req.body,
        // A stored first turn roots the chain its successors form, unless it runs in a
        // conversation, whose id keys every turn.
        prepared
            .chain_root
            .as_deref()
            .or((req.store && req.conversation.is_none()).then_some(id.as_str())),
    );
    let mut turn = Turn {
        team: team.0,
        id: id.clone(),
        previous_response_id: req.previous_response_id.clone(),
        input_items: prepared.input_items,
        pool: prepared.pool.clone(),
        plan: prepared.plan,
        skeleton: {
            let mut skeleton = skeleton(&id, now_secs(), &req.body, &req.model, status);
            skeleton["service_tier"] = state.flow.served_tier(headers, &req.body);
            skeleton
        },
        store: req.store,
        background: req.background,
        encrypted_reasoning: includes_encrypted_reasoning(&req.body),
        request: req.body.clone(),
        history: prepared.history,
        session,
        permit: None,
        lineage: None,
        admission_pin: None,
        failed_slots: Vec::new(),
        transfer_failed: false,
        background_slot: None,
        conversation: req.conversation.clone(),
        conversation_lock,
    };
    turn.lineage = turn::lineage_of(&turn.pool, &turn.team, headers, turn.session.as_deref());
    // Admission comes after the request is prepared (its token estimate exists) and before
    // an endpoint is picked; a band the team may not use is refused here.
    let prompt_tokens = agentgate_adapters::estimate_prompt_tokens(&turn.plan.body);
    let admission = state.flow.pending(flow::FlowRequest {
        team: &turn.team,
        pool: &turn.pool.name,
        headers,
        body: &req.body,
        prompt_tokens,
        bytes: queued_bytes(body_bytes, prompt_tokens),
        session: turn.session.clone(),
        continuing,
        background: req.background,
    })?;
    // A pinned session's turn waits in the queue for a slot on its endpoint, where its cache
    // is, rather than queueing in that engine or moving.
    let admission = match admission {
        Some(pending) if continuing => {
            let pin = turn::session_pin(state, &turn.pool, turn.session.as_deref()).await;
            // The engine the pin stands for, by its URL (a renamed engine keeps its sessions,
            // and its queued turns their place there); a pin whose engine is gone holds
            // nothing: no affinity.
            let endpoint = pin.as_ref().and_then(|p| {
                turn.pool
                    .endpoints()
                    .iter()
                    .find(|e| turn::pins_to(p, e))
                    .map(|e| e.base_url.clone())
            });
            turn.admission_pin = Some(pin);
            Some(pending.with_affinity(endpoint))
        }
        other => other,
    };

    if req.background {
        let (cancel_tx, cancel_rx) = tokio::sync::watch::channel(false);
        let mut registered = turn::RunRegistration::new(state, &id, &turn.team, cancel_tx)
            .map_err(|held| {
                HttpError::new(
                    429,
                    "rate_limit_error",
                    format!("{held}; retry once some have finished."),
                    None,
                    Some("too_many_background_responses"),
                )
                .with_retry_after(1)
            })?;
        // Shedding, a full queue and the rate limits are judged now (the team is charged),
        // so a refusal is a 429 here; the slot in the pool is waited for inside the run.
        let mut admission = admission;
        let rate_headers = match admission.as_mut() {
            Some(pending) => pending.charge().await?,
            None => Vec::new(),
        };
        let created = match registered.hold_lease().await {
            Ok(()) => state.store.put(&turn::queued_record(&turn)).await,
            Err(e) => Err(e),
        };
        if let Err(e) = created {
            // Not created: the request costs the team nothing (a retry pays once).
            if let Some(pending) = admission.as_mut() {
                pending.refund().await;
            }
            return Err(store_error(e));
        }
        let queued = turn.skeleton.clone();
        let (tx, rx) = if req.stream {
            let (tx, rx) = mpsc::channel(256);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let stops = turn::StopSignals::new(cancel_rx, state.stopping.subscribe());
        tokio::spawn(turn::run_background(
            state.clone(),
            turn,
            admission,
            tx,
            stops,
            registered,
        ));
        let answer = match rx {
            Some(rx) => sse_response(rx, None, None),
            None => Json(queued).into_response(),
        };
        return Ok(Started::Answered(with_headers(answer, rate_headers)));
    }

    let mut turn = turn;
    let mut flow_headers = Vec::new();
    // A shutdown whose grace ran out answers 503 to a request still waiting for its turn or
    // for the engine's first answer (a P/D prefill leg can take minutes).
    let mut stopping = state.stopping.subscribe();
    let shut_down = || {
        let stop = turn::Stop::Shutdown;
        HttpError::server(503, stop.message(), stop.code()).with_retry_after(1)
    };
    if let Some(pending) = admission {
        // Waits here while the pool is full; a client that leaves drops this future, which
        // takes the request out of the queue.
        let admitted = tokio::select! {
            permit = pending.admit() => permit,
            Ok(_) = stopping.wait_for(|s| *s) => return Err(shut_down()),
        };
        let permit = match admitted {
            Ok(permit) => permit,
            Err(e) if req.stream && e.retry_after.is_some() && retries_only_in_stream(headers) => {
                return Ok(Started::Answered(refused_in_stream(state, &turn, &e).await));
            }
            Err(e) => return Err(e),
        };
        flow_headers = flow::response_headers(&permit);
        turn.permit = Some(permit);
    }
    let opened = tokio::select! {
        opened = turn::open_turn(state, &mut turn) => opened,
        Ok(_) = stopping.wait_for(|s| *s) => return Err(shut_down()),
    };
    let (chunks, in_flight) = match opened {
        Ok(opened) => opened,
        // Streamed, a prompt over the context window fails as OpenAI streams it: the response
        // is created, then fails with `context_length_exceeded`. Codex compacts its history on
        // that event; an HTTP 400 it takes for a request it cannot send at all.
        Err(e) if req.stream && e.error.code.as_deref() == Some(CONTEXT_LENGTH_EXCEEDED) => {
            let failed =
                failed_in_stream(state, &turn, CONTEXT_LENGTH_EXCEEDED, &e.error.message).await;
            return Ok(Started::Answered(with_headers(failed, flow_headers)));
        }
        Err(e) => return Err(e),
    };
    let endpoint = in_flight.endpoint().clone();
    let reason = (in_flight.reason, in_flight.pin_moved);
    if req.stream {
        let (tx, rx) = mpsc::channel(256);
        let (present, here) = mpsc::channel(1);
        let stops = turn::StopSignals::shutdown_only(state.stopping.subscribe())
            .until_client_leaves(&turn, &present);
        let counted = state.foreground_turn();
        let run = turn::drive(
            state.clone(),
            turn,
            chunks,
            in_flight,
            Some(tx),
            Some(stops),
        );
        tokio::spawn(async move {
            let _counted = counted;
            run.await
        });
        let resp = with_reason(sse_response(rx, Some(&endpoint), Some(here)), reason);
        return Ok(Started::Answered(with_headers(resp, flow_headers)));
    }
    // A compaction answers with the history's user messages besides its summary.
    let history = match turn.plan.compaction {
        true => turn.history.clone(),
        false => Vec::new(),
    };
    // Held while the client waits: a client that leaves drops this handler, and with it
    // `waiting`, which stops a turn nobody could read later.
    let (present, waiting) = mpsc::channel(1);
    let stops = turn::StopSignals::shutdown_only(state.stopping.subscribe())
        .until_client_leaves(&turn, &present);
    drop(present);
    // Runs on if the client leaves (a stored turn is kept): counted for shutdown to wait on.
    let counted = state.foreground_turn();
    let run = turn::drive(state.clone(), turn, chunks, in_flight, None, Some(stops));
    let task = tokio::spawn(async move {
        let _counted = counted;
        run.await
    });
    let served = task.await;
    drop(waiting);
    let served = served.map_err(|e| {
        HttpError::server(
            500,
            format!("the response task failed: {e}"),
            "internal_error",
        )
    })?;
    Ok(Started::Finished(Finished {
        response: served.response,
        endpoint: served.endpoint,
        reason: served.reason,
        flow_headers,
        history,
    }))
}

/// Whether the client retries a refusal it should retry only when it comes in the stream:
/// Codex (`originator: codex_*`) takes an HTTP 429 for final, but retries a stream that ends
/// with `response.failed`, code `rate_limit_exceeded`, after the delay its message names
/// ("Please try again in 2s").
fn retries_only_in_stream(headers: &HeaderMap) -> bool {
    headers
        .get("originator")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with("codex"))
}

/// A streamed turn refused by flow control, for a client that retries only what fails in the
/// stream ([`retries_only_in_stream`]): `response.created`, `response.in_progress`, then
/// `response.failed` with code `rate_limit_exceeded` and the refusal's message and delay (its
/// own code, `overloaded_shed`, `queue_full`, ..., stays in the log and the metrics). Nothing is
/// stored, and it adds nothing to its conversation.
async fn refused_in_stream(state: &AppState, turn: &turn::Turn, e: &HttpError) -> Response {
    let secs = e.retry_after.unwrap_or(1);
    let message = format!(
        "{} Please try again in {secs}s.",
        e.error.message.trim_end()
    );
    let resp = failed_in_stream(state, turn, "rate_limit_exceeded", &message).await;
    match &e.headers {
        Some(headers) => with_headers(resp, headers.as_ref().clone()),
        None => resp,
    }
}

/// The stream of a turn that failed before any engine ran it ([`turn::failed_at_start`]):
/// nothing stored, and nothing added to its conversation, whose lock goes.
async fn failed_in_stream(
    state: &AppState,
    turn: &turn::Turn,
    code: &str,
    message: &str,
) -> Response {
    let events = turn::failed_at_start(state, turn, code, message);
    turn::release_conversation(turn).await;
    let (tx, rx) = mpsc::channel(events.len().max(1));
    for event in &events {
        let _ = tx.try_send(Bytes::from(event.to_sse_frame()));
    }
    sse_response(rx, None, None)
}

fn with_reason(
    mut resp: Response,
    (reason, pin_moved): (&'static str, Option<&'static str>),
) -> Response {
    resp.headers_mut()
        .insert(ROUTE_REASON_HEADER, HeaderValue::from_static(reason));
    if let Some(cause) = pin_moved {
        resp.headers_mut()
            .insert(PIN_MOVED_HEADER, HeaderValue::from_static(cause));
    }
    resp
}

fn with_headers(mut resp: Response, headers: Vec<(&'static str, String)>) -> Response {
    for (name, value) in headers {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

/// Query of `GET /v1/responses/{id}`.
#[derive(Debug, Deserialize)]
pub struct RetrieveQuery {
    stream: Option<String>,
    starting_after: Option<String>,
}

/// How often a follower of a background response's events looks for new ones.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// How long a follower waits for the terminal event once the stored response is final (the run
/// logs it right after storing the response) before it ends the stream from the stored record.
const FOLLOW_TERMINAL_GRACE: Duration = Duration::from_secs(1);

/// Store failures in a row after which a follower closes its stream.
const FOLLOW_STORE_TRIES: u32 = 5;

/// How long a follower waits without a new event before it closes its stream (the client may
/// resume it with `starting_after`).
const FOLLOW_IDLE_LIMIT: Duration = Duration::from_secs(15 * 60);

/// `GET /v1/responses/{id}`: the stored response, or with `stream=true` the events of a
/// background response (`background: true`) from its event log: from the first, or after
/// `starting_after` (a `sequence_number`), then as they are generated until the terminal event.
/// Any gateway replica can serve it; see `stream_stored`.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<RetrieveQuery>,
) -> Result<Response, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let stream = match q.stream.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(HttpError::invalid(
                format!("Invalid 'stream': {other:?}; expected true or false."),
                Some("stream"),
                Some("invalid_value"),
            ))
        }
    };
    let starting_after = match q.starting_after.as_deref() {
        None => None,
        Some(text) => Some(text.parse::<u64>().map_err(|_| {
            HttpError::invalid(
                format!("Invalid 'starting_after': {text:?}; expected a sequence number (an integer >= 0)."),
                Some("starting_after"),
                Some("invalid_value"),
            )
        })?),
    };
    let mut rec = load_record(&state, &team, &id).await?;
    settle_orphan(&state, &team, &mut rec).await;
    if !stream {
        return Ok(Json(rec.response).into_response());
    }
    if rec.response.get("background") != Some(&Value::Bool(true)) {
        return Err(HttpError::invalid(
            "Only background responses ('background': true) can be streamed after they were \
             created; retrieve this one without 'stream'.",
            Some("stream"),
            Some("unsupported_parameter"),
        ));
    }
    let Some(slot) = crate::app::FollowSlot::take(&state, &team.0) else {
        return Err(HttpError::new(
            429,
            "rate_limit_error",
            format!(
                "Your team already follows {} background responses on this gateway \
                 ([background] max_follows_per_team); close a stream or retry shortly.",
                state.config.background.max_follows_per_team
            ),
            None,
            Some("too_many_follows"),
        )
        .with_retry_after(1));
    };
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let _slot = slot;
        stream_stored(state.clone(), team, id, starting_after, tx).await;
    });
    Ok(sse_response(rx, None, None))
}

/// Follow a background response's event log (`Store::events`, written by the run wherever it
/// runs): send what is logged after `starting_after`, then poll every [`FOLLOW_POLL`] for more,
/// until the terminal event (`response.completed`, `.incomplete` or `.failed`) has been sent.
/// Frames are sent in `sequence_number` order, each once. When the stored response is final and
/// no terminal event is logged within [`FOLLOW_TERMINAL_GRACE`] (a response cancelled before it
/// ran, a run lost with its gateway and stored failed by [`settle_orphan`], which the follow
/// checks for every third of `background.orphaned_after_s`, or a log the store lost), the
/// stream ends with one carrying the stored response.
///
/// A follow that cannot go on while the response itself goes on closes the stream without a
/// terminal event, so the client picks it up again with `starting_after`: the client left, the
/// store failed [`FOLLOW_STORE_TRIES`] times in a row, the response was deleted, nothing new
/// arrived for [`FOLLOW_IDLE_LIMIT`] (a run that is alive but silent, e.g. waiting for a run slot), the
/// client left its events unread for `client_stall_timeout_s`, or this gateway starts shutting
/// down (a follow holds no work, so it does not wait out the grace; one blocked on a client
/// that is not reading ends too, and the server closes the connection once that client reads
/// or the grace ends).
async fn stream_stored(
    state: Arc<AppState>,
    team: Team,
    id: String,
    starting_after: Option<u64>,
    tx: mpsc::Sender<Bytes>,
) {
    let mut next = starting_after.map_or(0, |n| {
        usize::try_from(n).unwrap_or(usize::MAX).saturating_add(1)
    });
    let mut last_sequence = starting_after;
    let mut final_since: Option<tokio::time::Instant> = None;
    let mut last_news = tokio::time::Instant::now();
    let mut store_failures = 0;
    let mut record_failures = 0;
    let mut draining = state.draining.subscribe();
    let stall = state.config.server.client_stall_timeout();
    // How often a response that stays queued or running is checked for a lost run.
    let orphan_check = (state.config.background.orphaned_after() / 3).max(FOLLOW_POLL);
    let mut checked_at = tokio::time::Instant::now();
    loop {
        if tx.is_closed() || last_news.elapsed() >= FOLLOW_IDLE_LIMIT {
            return;
        }
        // New events first; only when there are none is the stored status read (the status
        // alone: the record, input included, only to end the stream from it).
        let read = async {
            let frames = state.store.events(&id, next).await?;
            let status = match frames.is_empty() {
                true => Some(state.store.status(&team.0, &id).await?),
                false => None,
            };
            Ok::<_, agentgate_sessions::StoreError>((frames, status))
        };
        let (frames, status) = match read.await {
            Ok(read) => {
                store_failures = 0;
                read
            }
            Err(e) => {
                store_failures += 1;
                tracing::warn!(response = %id, tries = store_failures, "cannot follow the response's events: {e}");
                if store_failures >= FOLLOW_STORE_TRIES {
                    return;
                }
                (Vec::new(), None)
            }
        };
        next += frames.len();
        for frame in frames {
            let (event, sequence) = frame_kind(&frame);
            // A frame logged twice (a write retried after a lost reply) goes out once.
            if sequence.is_some_and(|n| last_sequence.is_some_and(|last| n <= last)) {
                continue;
            }
            last_sequence = sequence.or(last_sequence);
            last_news = tokio::time::Instant::now();
            if !turn::send_to_client(&tx, Bytes::from(frame), stall, drained(&mut draining)).await {
                return;
            }
            if TERMINAL_EVENTS.contains(&event.as_str()) {
                return;
            }
        }
        if let Some(status) = status {
            let Some(status) = status else {
                return; // deleted meanwhile
            };
            if matches!(status.as_str(), "queued" | "in_progress") {
                final_since = None;
                // A run lost with its gateway logs nothing more: stored failed, the stream
                // ends with it once the grace below has passed.
                if checked_at.elapsed() >= orphan_check {
                    checked_at = tokio::time::Instant::now();
                    settle_orphan_by_id(&state, &team, &id).await;
                }
            } else if final_since
                .get_or_insert_with(tokio::time::Instant::now)
                .elapsed()
                >= FOLLOW_TERMINAL_GRACE
            {
                // The run's last events may have landed since this pass read none: send
                // them first. A terminal event in the log before `starting_after`: the
                // client has seen the end already, nothing more to send.
                if let Ok(log) = state.store.events(&id, 0).await {
                    if log.len() > next {
                        continue;
                    }
                    if log
                        .iter()
                        .any(|f| TERMINAL_EVENTS.contains(&frame_kind(f).0.as_str()))
                    {
                        return;
                    }
                }
                // The terminal event never reached the log: end with the stored record.
                let record = match state.store.get(&team.0, &id).await {
                    Ok(Some(record)) => record,
                    Ok(None) => return, // deleted meanwhile
                    Err(e) => {
                        record_failures += 1;
                        tracing::warn!(response = %id, tries = record_failures, "cannot read the finished response: {e}");
                        if record_failures >= FOLLOW_STORE_TRIES {
                            return;
                        }
                        tokio::time::sleep(FOLLOW_POLL).await;
                        continue;
                    }
                };
                let status = agentgate_sessions::record::response_status(&record.response);
                let event = match status {
                    "completed" => "response.completed",
                    "incomplete" => "response.incomplete",
                    _ => "response.failed",
                };
                let sequence = last_sequence.map_or(0, |n| n.saturating_add(1));
                let data = json!({"type": event, "sequence_number": sequence, "response": record.response});
                let frame = agentgate_adapters::SseEvent {
                    event: event.to_string(),
                    data,
                };
                let frame = Bytes::from(frame.to_sse_frame());
                turn::send_to_client(&tx, frame, stall, drained(&mut draining)).await;
                return;
            }
        }
        let shutting_down = tokio::select! {
            () = tokio::time::sleep(FOLLOW_POLL) => false,
            stop = draining.wait_for(|stop| *stop) => stop.is_ok(),
        };
        if shutting_down {
            return;
        }
    }
}

/// Resolves once the gateway starts draining (or the signal is gone).
async fn drained(draining: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = draining.wait_for(|stop| *stop).await;
}

/// The events that end a Responses stream.
const TERMINAL_EVENTS: [&str; 3] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
];

/// An SSE frame's event name and `sequence_number`.
fn frame_kind(frame: &str) -> (String, Option<u64>) {
    let mut event = String::new();
    let mut sequence = None;
    for line in frame.lines() {
        if let Some(name) = line.strip_prefix("event: ") {
            event = name.to_string();
        } else if let Some(data) = line.strip_prefix("data: ") {
            sequence = serde_json::from_str::<Value>(data)
                .ok()
                .and_then(|d| d.get("sequence_number").and_then(Value::as_u64));
        }
    }
    (event, sequence)
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    // A response still running in a conversation holds the conversation's lock, and its run
    // may be on another gateway, which notices the deletion only at its next store write: the
    // lock is given back here, as a cancel does, so the conversation's next turn need not wait.
    let running_in = match state.store.get(&team.0, &id).await {
        Ok(Some(rec)) if is_active(&rec.response) => Some(rec.response),
        _ => None,
    };
    if !state
        .store
        .delete(&team.0, &id)
        .await
        .map_err(store_error)?
    {
        return Err(response_not_found(&id));
    }
    signal_cancel(&state, &id);
    if let Some(response) = running_in {
        crate::conversations::release_for(&state, &team.0, &response, &id).await;
    }
    Ok(Json(
        json!({"id": id, "object": "response", "deleted": true}),
    ))
}

/// The message a background response lost with its gateway is stored with.
const ORPHANED: &str = "The gateway running this background response stopped before it \
                        finished; create it again.";

/// A background response still `queued` or `in_progress` whose run's lease is gone lost its
/// run with the gateway running it (the gateway died, or had no word through the store for
/// `background.orphaned_after_s`): it is stored `failed` (code `server_error`, unless its run
/// ended meanwhile) and its conversation given back, and `rec` becomes what is stored. One
/// younger than that TTL is left alone (its gateway may not have taken the lease yet), as is
/// one whose lease cannot be read or was never taken (a gateway from before leases runs it).
/// Whether it was settled.
async fn settle_orphan(state: &AppState, team: &Team, rec: &mut ResponseRecord) -> bool {
    if rec.response.get("background") != Some(&Value::Bool(true)) || !is_active(&rec.response) {
        return false;
    }
    let ttl = state.config.background.orphaned_after();
    let created = rec.response.get("created_at").and_then(Value::as_i64);
    let age = crate::response_object::now_secs().saturating_sub(created.unwrap_or(i64::MAX));
    if age < 0 || (age as u64) < ttl.as_secs().max(1) {
        return false;
    }
    let id = rec.response["id"].as_str().unwrap_or_default().to_string();
    match state.store.run_held(&id).await {
        Ok(Some(false)) => {}
        // Alive; or run by a gateway from before leases (during a rolling upgrade), whose
        // run says nothing of its life.
        Ok(Some(true) | None) => return false,
        Err(e) => {
            tracing::warn!(response = %id, "cannot read the background run's lease: {e}");
            return false;
        }
    }
    let mut failed = rec.response.clone();
    failed["status"] = Value::from("failed");
    failed["error"] = json!({"code": "server_error", "message": ORPHANED});
    match state
        .store
        .update_if_active(&team.0, &id, &failed, &rec.output_items)
        .await
    {
        Ok(true) => {
            tracing::warn!(response = %id, "background response lost with the gateway running it (no run lease); stored as failed");
            crate::conversations::release_for(state, &team.0, &failed, &id).await;
            rec.response = failed;
            true
        }
        // Its run ended (or it was cancelled) meanwhile: what is stored now says so.
        Ok(false) => match state.store.get(&team.0, &id).await {
            Ok(Some(now)) => {
                *rec = now;
                true
            }
            _ => false,
        },
        Err(e) => {
            tracing::warn!(response = %id, "could not store the lost background response as failed: {e}");
            false
        }
    }
}

/// [`settle_orphan`] for response `id` of `team`, whose record is read only when its run's
/// lease lapsed (a follow checks a running response this way every few seconds).
async fn settle_orphan_by_id(state: &AppState, team: &Team, id: &str) -> bool {
    if !matches!(state.store.run_held(id).await, Ok(Some(false))) {
        return false;
    }
    match state.store.get(&team.0, id).await {
        Ok(Some(mut rec)) => settle_orphan(state, team, &mut rec).await,
        _ => false,
    }
}

/// Whether a stored response is still queued or running.
fn is_active(response: &Value) -> bool {
    matches!(
        response.get("status").and_then(Value::as_str),
        Some("queued" | "in_progress")
    )
}

/// Tell a background run in this process to stop (runs in other gateway processes notice the
/// cancelled status at their next event-log write, or when they finish, and stop there).
pub(crate) fn signal_cancel(state: &AppState, id: &str) {
    let run = state
        .background
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(id);
    if let Some(run) = run {
        run.cancel.send_replace(true);
    }
}

/// `POST /v1/responses/{id}/cancel`: stop a background response.
pub async fn cancel(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let rec = load_record(&state, &team, &id).await?;
    if rec.response.get("background").and_then(Value::as_bool) != Some(true) {
        return Err(HttpError::invalid(
            "Only responses created with 'background': true can be cancelled.",
            None,
            Some("not_cancellable"),
        ));
    }
    let mut cancelled = rec.response.clone();
    cancelled["status"] = Value::from("cancelled");
    // What a stream of it ends with says the same (`turn::Stop::Cancelled`).
    let stop = turn::Stop::Cancelled;
    cancelled["error"] = json!({"code": stop.code(), "message": stop.message()});
    let applied = state
        .store
        .update_if_active(&team.0, &id, &cancelled, &rec.output_items)
        .await
        .map_err(store_error)?;
    if applied {
        signal_cancel(&state, &id);
        // It adds nothing to its conversation: the next turn there need not wait for the run
        // to notice.
        crate::conversations::release_for(&state, &team.0, &rec.response, &id).await;
        return Ok(Json(cancelled));
    }
    // Already final (cancelled before, or it finished first): cancelling again changes
    // nothing and answers with the response as it ended, as OpenAI does, so a client that
    // cancels on a timeout does not fail when the run wins the race.
    Ok(Json(load_record(&state, &team, &id).await?.response))
}

/// Query of a paginated item list (`GET /v1/responses/{id}/input_items`, a conversation's items).
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    limit: Option<String>,
    order: Option<String>,
    after: Option<String>,
    /// The items just before this one, in the list's order (older clients page backwards).
    before: Option<String>,
}

/// Item types whose listed form always carries a `status`.
const LISTED_WITH_STATUS: [&str; 5] = [
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
];

/// An item as the API lists it, with the fields OpenAI's listed items always carry that a
/// client may have left out of what it sent: `status` (`completed`) on messages, tool calls
/// and their outputs, `annotations` (empty) on `output_text` parts and `detail` (`auto`) on
/// `input_image` parts.
pub fn as_listed(mut item: Value) -> Value {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("");
    let needs_status = LISTED_WITH_STATUS.contains(&kind) && item.get("status").is_none();
    let Some(fields) = item.as_object_mut() else {
        return item;
    };
    if needs_status {
        fields.insert("status".into(), Value::from("completed"));
    }
    if let Some(parts) = fields.get_mut("content").and_then(Value::as_array_mut) {
        for part in parts {
            let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
            // Fields the SDK's types require, with OpenAI's defaults.
            let (key, default) = match kind {
                "output_text" => ("annotations", json!([])),
                "input_image" => ("detail", json!("auto")),
                _ => continue,
            };
            if let Some(part) = part.as_object_mut() {
                part.entry(key).or_insert(default);
            }
        }
    }
    item
}

/// One page of `items` (oldest first) as an OpenAI list: `limit` 1-100 (default 20), `order`
/// `desc` (default) or `asc`, starting after the item with id `after` (`what` names the list in
/// the error when there is none).
pub fn item_page(items: Vec<Value>, q: &ListQuery, what: &str) -> Result<Value, HttpError> {
    let limit = match q.limit.as_deref() {
        None => 20,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=100).contains(&n) => n,
            _ => {
                return Err(HttpError::invalid(
                    format!("Invalid 'limit': '{s}'; it must be an integer between 1 and 100."),
                    Some("limit"),
                    Some("invalid_value"),
                ))
            }
        },
    };
    let descending = match q.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(other) => {
            return Err(HttpError::invalid(
                format!("Invalid 'order': '{other}'; expected 'asc' or 'desc'."),
                Some("order"),
                Some("invalid_value"),
            ))
        }
    };
    let mut items = items;
    if descending {
        items.reverse();
    }
    let position = |cursor: &str, param: &str| {
        items
            .iter()
            .position(|it| it.get("id").and_then(Value::as_str) == Some(cursor))
            .ok_or_else(|| {
                HttpError::invalid(
                    format!("Invalid '{param}': no item with id '{cursor}' in {what}."),
                    Some(param),
                    Some("invalid_value"),
                )
            })
    };
    let start = match &q.after {
        None => 0,
        Some(after) => position(after, "after")? + 1,
    };
    let end = match &q.before {
        None => items.len(),
        Some(before) => position(before, "before")?,
    };
    let window = items.get(start..end.max(start)).unwrap_or_default();
    // Paging backwards (`before` alone), the page is the items just before the cursor, and
    // more means more before them.
    let backwards = q.before.is_some() && q.after.is_none();
    let page: Vec<Value> = match backwards {
        true => window[window.len().saturating_sub(limit)..].to_vec(),
        false => window.iter().take(limit).cloned().collect(),
    };
    let has_more = window.len() > page.len();
    Ok(item_list(page, has_more))
}

/// `items` as an OpenAI list object (each [`as_listed`]).
pub fn item_list(items: Vec<Value>, has_more: bool) -> Value {
    let items: Vec<Value> = items.into_iter().map(as_listed).collect();
    let id_of = |v: Option<&Value>| {
        v.and_then(|it| it.get("id"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    json!({
        "object": "list",
        "first_id": id_of(items.first()),
        "last_id": id_of(items.last()),
        "has_more": has_more,
        "data": items,
    })
}

/// `GET /v1/responses/{id}/input_items`: every item the model saw as input for this response
/// (the earlier turns' inputs and outputs, then this turn's input), paginated.
pub async fn input_items(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let rec = load_record(&state, &team, &id).await?;
    let items = input_items_of(&state, &team, rec).await?;
    Ok(Json(item_page(items, &q, "this response's input")?))
}

/// `POST /v1/responses/input_tokens`: how many input tokens a create request would use.
pub async fn input_tokens(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, HttpError> {
    let team = state.keys.authenticate(&headers)?;
    let bytes = body.map_err(|r| body_error(r, state.config.server.max_body_bytes))?;
    let body = parse_json_body(&headers, &bytes, state.config.server.parse_inline_bytes).await?;
    validate_common(&body)?;
    let model = match crate::request::opt_str(&body, "model")? {
        Some(m) => m.to_string(),
        None => state
            .pools
            .all()
            .first()
            .map(|p| p.model.clone())
            .ok_or_else(|| model_not_found(""))?,
    };
    let previous = crate::request::opt_str(&body, "previous_response_id")?.map(str::to_string);
    let conversation = crate::request::conversation_id(&body)?;
    let prepared = prepare(
        &state,
        &team,
        &body,
        &model,
        previous.as_deref(),
        conversation.as_deref(),
    )
    .await?;
    let pool = &prepared.pool;
    // It generates nothing, but asks an engine to tokenize the prompt: one request of the
    // team's requests-per-minute budget.
    let rate_headers = state.flow.charge_request(&pool.name, &team.0).await?;
    let endpoints = pool.endpoints();
    let ep = pool
        .picker
        .pick(&endpoints, &crate::pools::PickRequest::default())
        .and_then(|p| endpoints.get(p.index))
        .ok_or_else(|| {
            HttpError::server(503, "no endpoint available", "upstream_unavailable")
                .with_retry_after(1)
        })?;
    let n = state
        .engines
        .count_tokens(pool.flavor, &ep.base_url, &prepared.plan.body)
        .await
        .map_err(|e| {
            HttpError::server(
                502,
                format!("could not count tokens: {e}"),
                "upstream_error",
            )
        })?;
    Ok(with_headers(
        Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response(),
        rate_headers,
    ))
}
