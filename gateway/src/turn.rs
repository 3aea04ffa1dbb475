//! Running one turn: open the engine stream, turn chat chunks into Responses events, persist.
//!
//! A turn always runs in its own task, so a client that disconnects never loses a response that
//! was already being generated: the task drives the engine stream to its end and stores the
//! result (unless `store: false`). Streaming clients read the task's events through a channel;
//! non-streaming clients await its final Response object. The terminal event is sent only after
//! the response is persisted, so a client that saw `response.completed` can chain on it at once.
//! When the store cannot keep it (three tries a second apart in all, each waiting up to the store
//! client's reply timeout), the turn ends as `failed`
//! with code `store_unavailable` instead (503 when not streamed): an id that can be neither
//! retrieved nor continued is never handed out as a finished response. A background run keeps
//! trying for about ten minutes, since its record would otherwise stay `in_progress` (a client
//! streaming it gets the terminal event once the write lands or is given up). A turn still running
//! when the gateway shuts down and `[server] shutdown_grace_s` has run out ends the same way
//! with code `server_shutdown` (a background run still queued is recorded so too), so no
//! client is left with a cut stream or a response that stays `in_progress` for ever. A gateway
//! that dies records nothing, so each background run holds a lease in the store while it lasts
//! ([`RunRegistration::hold_lease`], renewed every third of `background.orphaned_after_s`): a
//! read on any gateway that finds the response still queued or running without it stores it
//! `failed` with code `server_error` (`responses::settle_orphan`).
//!
//! # Placement
//!
//! A pool without prefill endpoints sends the turn to the endpoint its picker chooses, trying
//! the others when an engine is unreachable or answers 5xx ([`open_upstream`]). A pool with
//! prefill endpoints splits long prompts (also [`open_upstream`]; formulas in
//! `agentgate_scheduler::disagg`):
//!
//! 1. the picker chooses a decode endpoint `d` among those that can decode (roles `decode` and
//!    `both`), by the session's pin (the decode half), prefix and load. A sub-agent call
//!    (`agentgate_scheduler::lineage`, or, when its headers name no parent and
//!    `parent_by_prefix` is on, `agentgate_scheduler::prefix_lineage`: a session's first
//!    request sharing a long prefix with an active session, beyond what unrelated sessions
//!    share) is placed by load alone, so a burst of siblings spreads over the decode
//!    endpoints; its own pin, when it has a key of its own, still holds;
//! 2. when more than `threshold_tokens` of the prompt are not cached on `d`, a prefill
//!    endpoint `p` is chosen by prefix match and load weighed by measured throughput, starting
//!    from the prefill half of the session's pin, or for a sub-agent without one, its parent's:
//!    its siblings then prefill where the parent's prefix is cached and compute it once;
//! 3. the request runs on `p` then `d` in the engines' P/D protocol; both halves of the pin are
//!    re-pinned independently. Otherwise `d` runs it whole.
//!
//! Failures before the client has seen anything are retried without splitting: a failed
//! prefill leg runs the request on `d` (local prefill); a failed decode leg (almost always a
//! lost KV transfer) retries once on `d` without disaggregation; either continues to the other
//! decode endpoints if `d` fails too. The stored conversation gets exactly one response.
//! Each split request logs both endpoints (`debug`), and its legs are timed into
//! `agentgate_pd_leg_duration_seconds`.
//!
//! SGLang servers are bound to their disaggregation mode ([`Pool::runs_whole`],
//! [`Pool::receives_kv`]): one in `decode` mode never prefills, so every request placed there
//! is split whatever the threshold, and its fallbacks run whole on an endpoint of role `both`
//! (with none: a failed prefill fails the request, a transfer lost in the decode stream is
//! split once more); one of role `both` cannot receive KV, so it always runs whole.
//!
//! Every prefill the gateway can time feeds the endpoint's measured throughput: the prefill
//! leg of a split request (vLLM reports the tokens it computed), and the first token of a
//! request run whole (uncached tokens from the engine's usage, plus the prefill queued ahead
//! of it when it was sent).

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use axum::http::HeaderMap;
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use agentgate_adapters::{
    carries_output, failure_without_output, ChatPlan, ChunkStream, DisaggError, PrefillTarget,
    ResponseStream, SseEvent, UpstreamError,
};
use agentgate_sessions::{ResponseRecord, Store};

use crate::app::AppState;
use crate::error::HttpError;
use agentgate_scheduler::{
    prefill_pin_key, remote_prefill_pays_off, Endpoint, InFlight, Lineage, Observation, Permit,
    Pick, PinOutcome, Pinned, PrefillRequest, Role,
};
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
    /// The session that spawned this call, when it comes from a sub-agent (see
    /// [`lineage_of`]); only pools with prefill endpoints use it.
    pub lineage: Option<Lineage>,
    /// The session's pin as read from the store at admission, if it was read there (the
    /// turn's affinity in flow control). Routing reuses it when the turn was dispatched
    /// without waiting, and reads the store again otherwise: a queued turn's pin may have
    /// moved meanwhile.
    pub admission_pin: Option<Option<SessionPin>>,
    /// Slots of the endpoints this turn failed on before its first token: its next attempt
    /// goes elsewhere.
    pub failed_slots: Vec<usize>,
    /// A split of this turn lost its KV transfer (its decode leg failed before its first
    /// token): the next attempt runs without disaggregation.
    pub transfer_failed: bool,
    /// A background run's slot (`[background] max_concurrent`), released with the engine.
    pub background_slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The conversation the turn runs in (`conversation`): its items were the history, and
    /// the turn's input and output items are appended once it finishes.
    pub conversation: Option<String>,
    /// The conversation's lock: released once the turn adds nothing more to the
    /// conversation (its items appended, or it failed), before its client is told it ended;
    /// at the latest when the turn is dropped.
    pub conversation_lock: Option<crate::conversations::ConversationLock>,
}

/// Session key `key` (`agentgate_scheduler::session_key`) of a request of `team`: the same key
/// from two teams names two sessions, so one team's turns can neither move another's pin nor
/// learn where it points. An open gateway's one team keeps the keys as they are.
pub fn team_session_key(team: &str, key: String) -> String {
    match team_prefix(team) {
        Some(prefix) => prefix + &key,
        None => key,
    }
}

/// What [`team_session_key`] puts before a key of `team` (none for an open gateway's team).
fn team_prefix(team: &str) -> Option<String> {
    (team != crate::auth::OPEN_TEAM).then(|| format!("team:{}:{team}/", team.len()))
}

/// The sub-agent lineage of a request of `team` to `pool` with these headers and session key
/// (already the team's), read as the pool's `[pools.disaggregation]` says
/// (`agentgate_scheduler::lineage`), its keys the team's as session keys are.
pub fn lineage_of(
    pool: &Pool,
    team: &str,
    headers: &HeaderMap,
    session: Option<&str>,
) -> Option<Lineage> {
    let owned = header_texts(headers);
    let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_ref())).collect();
    team_lineage(&pool.disaggregation.lineage, team, &pairs, session)
}

/// The request's headers as text, for the session key and lineage rules: a value that is not
/// visible ASCII (UTF-8 an agent put in a session id) is read as UTF-8; one that is not UTF-8
/// either is written as its bytes in hex (`0x...`), so two such values stay two keys.
pub fn header_texts(headers: &HeaderMap) -> Vec<(&str, std::borrow::Cow<'_, str>)> {
    headers
        .iter()
        .map(|(k, v)| {
            let text = match std::str::from_utf8(v.as_bytes()) {
                Ok(text) => std::borrow::Cow::Borrowed(text),
                Err(_) => std::borrow::Cow::Owned(v.as_bytes().iter().fold(
                    String::from("0x"),
                    |mut hex, b| {
                        hex.push_str(&format!("{b:02x}"));
                        hex
                    },
                )),
            };
            (k.as_str(), text)
        })
        .collect()
}

/// [`lineage_of`] from the pool's lineage settings and the request's headers.
fn team_lineage(
    cfg: &agentgate_scheduler::LineageConfig,
    team: &str,
    pairs: &[(&str, &str)],
    session: Option<&str>,
) -> Option<Lineage> {
    // Read as the scheduler reads keys (its keys from headers are compared with the session
    // key, and Claude Code's are made from it), then made the team's, all alike.
    let prefix = team_prefix(team);
    let raw = session.map(|s| match &prefix {
        Some(prefix) => s.strip_prefix(prefix.as_str()).unwrap_or(s),
        None => s,
    });
    let mut lineage = agentgate_scheduler::lineage(cfg, pairs, raw)?;
    lineage.parent = team_session_key(team, lineage.parent);
    lineage.own = lineage.own.map(|own| team_session_key(team, own));
    Some(lineage)
}

/// Whether the turn's session key names a session the client will use again: anything but
/// the key made from the turn's own response id when nothing else named one (no session
/// header, `prompt_cache_key`, `conversation` or `previous_response_id`).
fn named_session(turn: &Turn) -> bool {
    turn.previous_response_id.is_some()
        || agentgate_scheduler::chain_root_key(&turn.id)
            .map(|k| team_session_key(&turn.team, k.value))
            != turn.session
}

/// Most rounds of `truncation: "auto"` before the context-length error is returned.
const MAX_TRUNCATION_ROUNDS: usize = 8;

/// `truncation: "auto"`: drop the oldest quarter (at least one) of the items between the
/// conversation's first item (its opening, usually the task) and its last (what this turn
/// answers), over the history and then this turn's input, as OpenAI drops "input items in the
/// middle of the conversation". A tool call goes with its output and an output with its call
/// (no orphan tool message), except that nothing is dropped with the last item; reasoning left
/// leading right after the opening goes too. When nothing in the middle may go, the opening
/// does. False when nothing is left to drop.
pub fn truncate_middle(history: &mut Vec<Value>, input: &mut Vec<Value>) -> bool {
    let total = history.len() + input.len();
    if total <= 1 {
        return false;
    }
    let items: Vec<&Value> = history.iter().chain(input.iter()).collect();
    let call_of = |item: &Value| {
        item.get("call_id")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let kept_call = call_of(items[total - 1]);
    let take = ((total - 2) / 4).max(1);
    let mut drop = vec![false; total];
    let mut calls = std::collections::HashSet::new();
    let droppable = items
        .iter()
        .enumerate()
        .take(total - 1)
        .skip(1)
        .filter(|(_, item)| kept_call.is_none() || call_of(item) != kept_call);
    for (at, item) in droppable.take(take) {
        drop[at] = true;
        calls.extend(call_of(item));
    }
    for (at, item) in items.iter().enumerate().take(total - 1).skip(1) {
        if call_of(item).is_some_and(|c| calls.contains(&c)) {
            drop[at] = true;
        }
    }
    // Reasoning that led to a dropped item is left leading after the opening: it goes too.
    let mut at = 1;
    while at < total - 1
        && (drop[at] || items[at].get("type").and_then(Value::as_str) == Some("reasoning"))
    {
        drop[at] = true;
        at += 1;
    }
    if !drop.iter().any(|d| *d) {
        // Nothing in the middle may go: as a last resort the opening does.
        let opening = call_of(items[0]);
        if opening.is_some() && opening == kept_call {
            return false;
        }
        drop[0] = true;
    }
    let split = history.len();
    let mut index = 0;
    history.retain(|_| {
        index += 1;
        !drop[index - 1]
    });
    let mut index = split;
    input.retain(|_| {
        index += 1;
        !drop[index - 1]
    });
    true
}

/// The oldest quarter (at least one) of what a compaction may leave out, from `history` then
/// `input`: tool calls with their outputs, reasoning, assistant messages. User, system and
/// developer messages, compaction items and the trigger stay. False when nothing is left to
/// drop.
pub fn shrink_for_compaction(history: &mut Vec<Value>, input: &mut Vec<Value>) -> bool {
    let droppable =
        |item: &Value| match item.get("type").and_then(Value::as_str).unwrap_or_default() {
            "message" => item.get("role").and_then(Value::as_str) == Some("assistant"),
            "compaction" | "compaction_trigger" => false,
            _ => true,
        };
    let candidates: Vec<&Value> = history
        .iter()
        .chain(input.iter())
        .filter(|item| droppable(item))
        .collect();
    if candidates.is_empty() {
        return false;
    }
    let take = (candidates.len() / 4).max(1);
    let mut ids: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut calls: std::collections::HashSet<String> = std::collections::HashSet::new();
    for item in &candidates[..take] {
        if let Some(id) = item.get("id").and_then(Value::as_str) {
            ids.insert(id.to_string());
        }
        if let Some(call) = item.get("call_id").and_then(Value::as_str) {
            calls.insert(call.to_string());
        }
    }
    // A call goes with its output, and an output with its call: no orphan tool message.
    let keep = |item: &Value| {
        let by_id = item
            .get("id")
            .and_then(Value::as_str)
            .is_some_and(|id| ids.contains(id));
        let by_call = droppable(item)
            && item
                .get("call_id")
                .and_then(Value::as_str)
                .is_some_and(|call| calls.contains(call));
        !(by_id || by_call)
    };
    history.retain(keep);
    input.retain(keep);
    true
}

/// Open the engine stream for a turn. With `truncation: "auto"`, a context-length rejection
/// drops items from the middle of the conversation ([`truncate_middle`]: the stored history and
/// this turn's input, which is the whole conversation for a client that sends it every turn)
/// and tries again; the stored conversation is
/// unchanged, only what the engine sees is shorter. A compaction turn rejected so (whatever
/// `truncation` says) summarizes less: [`shrink_for_compaction`], up to the same number of
/// rounds.
pub async fn open_turn(
    state: &AppState,
    turn: &mut Turn,
) -> Result<(ChunkStream, Routed), HttpError> {
    let auto = turn.request.get("truncation").and_then(Value::as_str) == Some("auto");
    let mut rounds = 0;
    // This turn's input as the engine sees it once a compaction shrank it or truncation cut
    // it (the stored input is unchanged).
    let mut compacted_input: Option<Vec<Value>> = None;
    let room = turn
        .permit
        .as_ref()
        .map(|p| {
            let pins = turn.pool.policy.uses_pins();
            Room::for_permit(
                p,
                state.flow.max_in_flight_per_endpoint(),
                state.flow.max_prefilling_per_endpoint(),
                pins.then(|| state.flow.turn_window()),
                if pins {
                    state.flow.max_kv_working_set()
                } else {
                    0.0
                },
            )
        })
        .unwrap_or_default();
    let engine_priority = turn
        .permit
        .as_ref()
        .and_then(|p| turn.pool.engine_priority_of(p.band_priority()));
    loop {
        if let (Some(priority), Some(body)) = (engine_priority, turn.plan.body.as_object_mut()) {
            body.insert("priority".into(), Value::from(priority));
        }
        let known_pin = turn
            .admission_pin
            .clone()
            .filter(|_| turn.permit.as_ref().is_some_and(|p| p.waited().is_zero()));
        let routed = open_upstream(
            state,
            &turn.pool,
            &turn.plan.body,
            turn.session.as_deref(),
            named_session(turn),
            &mut turn.lineage,
            room,
            known_pin,
            &turn.failed_slots,
            !turn.transfer_failed,
        );
        let mut routed = routed.await;
        // SGLang reports a prompt over its context window in the stream it has started (200,
        // then the error): read the first chunk first when a shorter prompt can be tried.
        if (auto || turn.plan.compaction) && turn.pool.flavor == agentgate_adapters::Flavor::Sglang
        {
            if let Ok((stream, placed)) = routed {
                routed = overflow_in_stream(state, &turn.pool.name, stream, placed).await;
                if routed.is_err() {
                    // A pin it moved went back: read it again.
                    turn.admission_pin = None;
                }
            }
        }
        // No truncation helps when the output budget alone fills the window (a compaction's
        // budget is the gateway's, and it summarizes less of the history instead).
        if let Some(err) = routed
            .as_ref()
            .err()
            .filter(|_| !turn.plan.compaction)
            .and_then(|e| output_fills_the_window(&turn.plan.body, e))
        {
            return Err(err);
        }
        match routed {
            Err(e)
                if turn.plan.compaction
                    && rounds < MAX_TRUNCATION_ROUNDS
                    && e.error.code.as_deref() == Some("context_length_exceeded") =>
            {
                // A compaction is needed most when the context is full: summarize less of it
                // rather than fail, whatever `truncation` says (the summary is lossy anyway).
                let mut input = compacted_input
                    .take()
                    .unwrap_or_else(|| turn.input_items.clone());
                if !shrink_for_compaction(&mut turn.history, &mut input) {
                    return Err(e);
                }
                rounds += 1;
                tracing::info!(response = %turn.id, items = turn.history.len() + input.len(), "context too long for the compaction; summarizing less of it");
                let opts = state.translate_options(&turn.pool);
                let mut plan = agentgate_adapters::build_chat_request(
                    &turn.request,
                    &turn.history,
                    &input,
                    &opts,
                )?;
                plan.body["model"] = Value::from(turn.pool.model.clone());
                turn.plan = plan;
                compacted_input = Some(input);
            }
            Err(e)
                if auto
                    && rounds < MAX_TRUNCATION_ROUNDS
                    && e.error.code.as_deref() == Some("context_length_exceeded") =>
            {
                let mut input = compacted_input
                    .take()
                    .unwrap_or_else(|| turn.input_items.clone());
                if !truncate_middle(&mut turn.history, &mut input) {
                    return Err(e);
                }
                rounds += 1;
                tracing::info!(response = %turn.id, remaining = turn.history.len() + input.len(), "context too long; truncating the conversation's middle");
                let opts = state.translate_options(&turn.pool);
                let mut plan = agentgate_adapters::build_chat_request(
                    &turn.request,
                    &turn.history,
                    &input,
                    &opts,
                )?;
                plan.body["model"] = Value::from(turn.pool.model.clone());
                turn.plan = plan;
                compacted_input = Some(input);
            }
            other => return other,
        }
    }
}

/// The engine's answer, unless its first chunk reports the prompt over the context window:
/// then the error its HTTP 400 would have been (`context_length_exceeded`), the request given
/// up and a pin it moved put back. The first chunk is put back otherwise.
async fn overflow_in_stream(
    state: &AppState,
    pool: &str,
    mut stream: ChunkStream,
    mut routed: Routed,
) -> Result<(ChunkStream, Routed), HttpError> {
    let first = stream.next().await;
    if let Some(message) = first
        .as_ref()
        .and_then(|chunk| chunk.as_ref().ok())
        .and_then(agentgate_adapters::context_overflow_in_chunk)
    {
        drop(stream);
        // The engine ran nothing of it: a pin moved there goes back.
        routed.undo_moves(state, pool).await;
        drop(routed);
        return Err(HttpError::invalid(
            message,
            Some("input"),
            Some("context_length_exceeded"),
        ));
    }
    let rest: ChunkStream = match first {
        Some(first) => Box::pin(futures_util::stream::once(async move { first }).chain(stream)),
        None => stream,
    };
    Ok((rest, routed))
}

/// The client's error when the engine refused a prompt as over its context window while the
/// requested output alone (`max_output_tokens`, sent as `max_tokens`) fills the window: it is
/// that parameter's fault, and neither truncating the history nor compacting it (which a
/// `context_length_exceeded` code asks of Codex) would help.
fn output_fills_the_window(body: &Value, e: &HttpError) -> Option<HttpError> {
    if e.error.code.as_deref() != Some("context_length_exceeded") {
        return None;
    }
    let window = agentgate_adapters::context_window_in(&e.error.message)?;
    let asked = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
        .and_then(Value::as_u64)?;
    (asked >= window).then(|| {
        HttpError::invalid(
            format!(
                "'max_output_tokens' is {asked}, but the model's context window is {window} \
                 tokens in all, the input included; ask for fewer."
            ),
            Some("max_output_tokens"),
            Some("invalid_value"),
        )
    })
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
    /// Why the session's pin moved to this endpoint (`unavailable`, `saturated`, `wait`,
    /// `outscored`, `failed`), when it pointed elsewhere.
    pub pin_moved: Option<&'static str>,
    /// The pins this turn pointed at its endpoints (the session's, and a split's prefill pin).
    /// A move is counted once the endpoint produced output (`Routed::count_moves`), and
    /// undone when the endpoint failed before that (`Routed::undo_moves`): the session's
    /// cache never got there.
    pub repins: Vec<Repin>,
    /// When the request was sent to the endpoint.
    pub sent: Instant,
    /// Pending prefill tokens queued ahead of it on the endpoint when it was sent.
    pub ahead: u64,
    /// The prefill leg, when the prompt was prefilled on another endpoint.
    pub prefill: Option<PrefillLeg>,
}

/// The prefill half of a disaggregated request.
#[derive(Debug)]
pub struct PrefillLeg {
    /// The prefill endpoint.
    pub endpoint: Arc<Endpoint>,
    /// When the prefill leg ended: the KV cache was ready for the decode endpoint (vLLM: to
    /// pull; SGLang: transferred). The decode leg is timed from here to the first token.
    pub kv_ready: Instant,
}

impl Routed {
    /// The endpoint serving the request.
    pub fn endpoint(&self) -> &Arc<agentgate_scheduler::Endpoint> {
        self.in_flight.endpoint()
    }

    /// Count the pin moves of this turn in the metrics, once (the endpoint produced output, or
    /// the turn finished on it).
    fn count_moves(&mut self, state: &AppState, pool: &str) {
        for repin in &mut self.repins {
            match repin.cause.take() {
                Some(cause) if repin.prefill => state.metrics.pd_prefill_pin_moved(pool, cause),
                Some(cause) => state.metrics.pin_moved(pool, cause),
                None => {}
            }
        }
    }

    /// Point the pins this turn moved back where they were, unless another turn has moved them
    /// since; the moves are not counted. (A pin this turn created, where the session had none,
    /// stays: the next turn finds its endpoint failed or gone, or finds it well.)
    async fn undo_moves(&mut self, state: &AppState, pool: &str) {
        // A split whose prefill leg ran left the prompt's KV on its prefill endpoint, whatever
        // became of the decode leg: that half of the session's pin stays, and its move counts.
        if self.prefill.is_some() {
            for repin in self.repins.iter_mut().filter(|r| r.prefill) {
                if let Some(cause) = repin.cause.take() {
                    state.metrics.pd_prefill_pin_moved(pool, cause);
                }
            }
            self.repins.retain(|r| !r.prefill);
        }
        for repin in self.repins.drain(..) {
            let (key, from, to) = (repin.key, repin.from, repin.to);
            match pin_op(state.store.swap_pin(pool, &key, Some(&to), &from)).await {
                Ok(swap) if swap.applied => {
                    tracing::info!(%key, to = %from.endpoint, "session pin moved back: its new endpoint failed before any output");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("could not move the session pin back: {e}"),
            }
        }
    }
}

/// A pin a turn pointed at its endpoint.
#[derive(Debug)]
pub struct Repin {
    /// The pin's store key.
    key: String,
    /// The pin it replaced.
    from: SessionPin,
    /// The pin it stored.
    to: SessionPin,
    /// Why it moved, until counted.
    cause: Option<&'static str>,
    /// A split's prefill pin (counted apart).
    prefill: bool,
}

/// Longest wait for the store on a pin read or write. Pins steer routing but are not needed
/// to serve a turn: a store that does not answer in time (stalled, unreachable) costs a turn
/// its placement, not seconds of its latency.
const PIN_TIMEOUT: Duration = Duration::from_millis(500);

/// `op`, or an error when the store takes longer than [`PIN_TIMEOUT`].
async fn pin_op<T, E: std::fmt::Display>(
    op: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(PIN_TIMEOUT, op).await {
        Ok(done) => done.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "no answer from the store within {} ms",
            PIN_TIMEOUT.as_millis()
        )),
    }
}

/// The session's pin in the store, when the pool's policy pins sessions. A store error (or no
/// answer within `PIN_TIMEOUT`, 500 ms) is logged and treated as no pin: routing goes on by prefix
/// and load.
pub async fn session_pin(
    state: &AppState,
    pool: &Pool,
    session: Option<&str>,
) -> Option<SessionPin> {
    let key = session.filter(|_| pool.policy.uses_pins())?;
    match pin_op(state.store.get_pin(&pool.name, key)).await {
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
/// the store and the move counted with its cause. A pool with prefill endpoints splits long
/// prompts (see the module doc); `lineage` says which session spawned a sub-agent's call, as
/// its headers name it, and `named` whether `session` names more than this one request (a
/// request whose key does not may not be found a parent by prefix). `known_pin` is the
/// session's pin when it was just read (at admission); otherwise it is read from the store.
/// The endpoints in slots `avoid` (where the request failed before) are not picked to run it;
/// `may_split` false (a split of it lost its KV transfer) runs it without disaggregation.
#[allow(clippy::too_many_arguments)]
pub async fn open_upstream(
    state: &AppState,
    pool: &Pool,
    body: &Value,
    session: Option<&str>,
    named: bool,
    lineage: &mut Option<Lineage>,
    room: Room,
    known_pin: Option<Option<SessionPin>>,
    avoid: &[usize],
    may_split: bool,
) -> Result<(ChunkStream, Routed), HttpError> {
    let endpoints = pool.endpoints();
    let prompt_tokens = agentgate_adapters::estimate_prompt_tokens(body);
    let prefix: Vec<u64> = match pool.picker.prefix_index() {
        Some(index) => index.chunk_hashes(&pool.model, &agentgate_adapters::prompt_text(body)),
        None => Vec::new(),
    };
    if !endpoints.iter().any(|e| e.role == Role::Prefill) {
        let placement = Placement {
            body,
            prompt_tokens,
            prefix,
            pin: match known_pin {
                Some(pin) => pin,
                None => session_pin(state, pool, session).await,
            },
            key: session,
            room,
            avoid: avoid.to_vec(),
        };
        // The list as it is after the store read: one discovery changed meanwhile would have
        // retired the endpoints of the older one.
        let endpoints = pool.endpoints();
        return open_local(state, pool, &endpoints, placement, None).await;
    }
    open_split(
        state,
        pool,
        body,
        prompt_tokens,
        prefix,
        session,
        named,
        lineage,
        room,
        avoid,
        may_split,
    )
    .await
}

/// Where a request's band may start it: the filters of `PickRequest::free_slot_below` and
/// `PickRequest::prefilling_below` (formulas in `crate::flow`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Room {
    /// Prefer endpoints with fewer of this gateway's requests in flight than this.
    pub free_slot_below: Option<u64>,
    /// Prefer endpoints with fewer of this gateway's requests waiting for a first token.
    pub prefilling_below: Option<u64>,
    /// A band with a reserve under a policy that pins sessions: new sessions spread by the
    /// reserved turns routed lately, counted over this window (`PickRequest::spread_window`),
    /// and every turn routed is counted.
    pub spread_window: Option<Duration>,
    /// The band has a reserve and the bands below keep few prompts prefilling per endpoint:
    /// its prompts share engine steps rather than wait (`PickRequest::prefill_not_queued`).
    pub prefill_not_queued: bool,
    /// A band without a reserve of its own, under a policy that pins sessions: a request not
    /// pinned prefers endpoints whose working set is below this share of their KV capacity
    /// (`PickRequest::kv_working_set_below`), as flow control counted it.
    pub kv_working_set_below: Option<f64>,
}

impl Room {
    /// For a request admitted with `permit`, under the per-endpoint cap `cap` and prefill limit
    /// `max_prefilling` (0: none). A band with a reserve looks for a free slot under the cap;
    /// a band below one (and a turn that waited out `pin_wait` for its full endpoint) for an
    /// endpoint below its line, `cap - floor(share * cap)`, with fewer than `max_prefilling`
    /// requests prefilling when it is below a reserve. `spread_window`: the turn window, when the
    /// pool's policy pins sessions. `max_kv_working_set`: `[flow] max_kv_working_set` when the
    /// pool's policy pins sessions, else 0 (a band without a reserve of its own then prefers
    /// endpoints below that share of their KV for requests without a pin).
    pub fn for_permit(
        permit: &Permit,
        cap: u64,
        max_prefilling: u64,
        spread_window: Option<Duration>,
        max_kv_working_set: f64,
    ) -> Room {
        let share = permit.held_share();
        let free_slot_below = if cap == 0 {
            None
        } else if permit.band_reserves() {
            Some(cap)
        } else if share > 0.0 || permit.outwaited_pin().is_some() {
            Some(flow::band_line(cap, share))
        } else {
            None
        };
        let prefilling_below = (share > 0.0 && max_prefilling > 0).then_some(max_prefilling);
        Room {
            free_slot_below,
            prefilling_below,
            spread_window: spread_window.filter(|_| permit.band_reserves()),
            prefill_not_queued: permit.band_reserves() && max_prefilling > 0,
            kv_working_set_below: (!permit.band_reserves() && max_kv_working_set > 0.0)
                .then_some(max_kv_working_set),
        }
    }

    /// `request` with this room's placement preferences.
    pub fn pick_request<'a>(&self, request: PickRequest<'a>) -> PickRequest<'a> {
        PickRequest {
            free_slot_below: self.free_slot_below,
            prefilling_below: self.prefilling_below,
            spread_window: self.spread_window,
            prefill_not_queued: self.prefill_not_queued,
            kv_working_set_below: self.kv_working_set_below,
            ..request
        }
    }
}

/// One request's routing inputs, shared by its attempts.
struct Placement<'a> {
    body: &'a Value,
    prompt_tokens: u64,
    /// Chunk hashes of the rendered prompt (empty unless the policy keeps a prefix index).
    prefix: Vec<u64>,
    /// Where the session's pin (the decode half, in a split pool) is kept, if anywhere.
    key: Option<&'a str>,
    /// The pin found there.
    pin: Option<SessionPin>,
    /// Where the request's band may start it.
    room: Room,
    /// Slots of endpoints not to run it on (it failed there before its first token).
    avoid: Vec<usize>,
}

impl Placement<'_> {
    /// Positions in `view` of the endpoints to avoid.
    fn avoided_in(&self, view: &[Arc<Endpoint>]) -> Vec<usize> {
        view.iter()
            .enumerate()
            .filter(|(_, e)| self.avoid.contains(&e.slot))
            .map(|(i, _)| i)
            .collect()
    }
}

/// The pin's position in `view`: `At`, `Gone` when its endpoint is not there, `None` unpinned.
fn pinned_in(view: &[Arc<Endpoint>], pin: Option<&SessionPin>) -> Pinned {
    match pin {
        None => Pinned::None,
        Some(p) => view
            .iter()
            .position(|e| pins_to(p, e))
            .map_or(Pinned::Gone, Pinned::At),
    }
}

/// Whether `pin` stands for `e`: by the engine's URL when the pin recorded one (the engine
/// holds the session's cache whatever it is called: a name that now stands for another engine
/// does not, and an endpoint renamed in the endpoints file still does), else by name.
pub(crate) fn pins_to(pin: &SessionPin, e: &Endpoint) -> bool {
    match pin.url.as_deref() {
        Some(url) => url == e.base_url,
        None => pin.endpoint == e.name,
    }
}

fn no_endpoint(pool: &Pool, last: &str) -> HttpError {
    HttpError::server(
        503,
        format!(
            "No replica serving model '{}' could take the request ({last}). Retry shortly.",
            pool.model
        ),
        "upstream_unavailable",
    )
    .with_retry_after(1)
}

/// Run the request whole on one endpoint of `view`: `first` (a pick already made in `view`),
/// then whatever the picker chooses among the endpoints not tried yet.
async fn open_local(
    state: &AppState,
    pool: &Pool,
    view: &[Arc<Endpoint>],
    placement: Placement<'_>,
    first: Option<Placed>,
) -> Result<(ChunkStream, Routed), HttpError> {
    let pinned = pinned_in(view, placement.pin.as_ref());
    let mut first = first.filter(|(p, ..)| p.index < view.len());
    // Endpoints that failed this request: avoided by the caller, then each one tried here.
    let mut failed: Vec<usize> = placement.avoided_in(view);
    let mut tried = failed.clone();
    // Not an endpoint that cannot run a request whole (an SGLang decode-mode server), whatever
    // else fails; left out, not failed.
    tried.extend((0..view.len()).filter(|&i| !pool.runs_whole(&view[i])));
    let mut last = String::from("no available endpoint");
    let begin = |pick: Pick| count_local(pool, view, &placement, pick);
    loop {
        let (pick, ahead, in_flight) = match first.take() {
            Some(placed) => placed,
            None => {
                let request = placement.room.pick_request(PickRequest {
                    exclude: &tried,
                    prefix: &placement.prefix,
                    prompt_tokens: placement.prompt_tokens,
                    pinned,
                    ..PickRequest::default()
                });
                match pool.place(|| pool.picker.pick(view, &request).map(&begin)) {
                    Some(placed) => placed,
                    None => break,
                }
            }
        };
        tried.push(pick.index);
        let ep = &view[pick.index];
        let sent = Instant::now();
        match state
            .engines
            .chat_stream(&ep.base_url, placement.body)
            .await
        {
            Ok(stream) => {
                pool.routed(ep, &placement.prefix);
                if let Some(window) = placement.room.spread_window {
                    ep.note_reserved_turn(sent, window);
                }
                state
                    .metrics
                    .routing_decision(&pool.name, ep, pick.reason.as_str());
                let mut repins = Vec::new();
                if let Some(key) = placement.key.filter(|_| pool.policy.uses_pins()) {
                    let pin_failed = matches!(pinned, Pinned::At(i) if failed.contains(&i));
                    repins.extend(
                        repin(
                            state,
                            pool,
                            key,
                            placement.pin.as_ref(),
                            ep,
                            pick.pin,
                            pin_failed,
                        )
                        .await,
                    );
                }
                let pin_moved = repins.first().and_then(|r| r.cause);
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
                        prefix: placement.prefix,
                        reason: pick.reason.as_str(),
                        pin_moved,
                        repins,
                        sent,
                        ahead,
                        prefill: None,
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
                tracing::info!(endpoint = %ep.name, "engine rejected the request: {}", agentgate_adapters::OneLine(&api.message));
                return Err(api.into());
            }
            Err(e) => {
                tracing::warn!(endpoint = %ep.name, "engine request failed: {e}");
                last = e.to_string();
                failed.push(pick.index);
            }
        }
    }
    Err(no_endpoint(pool, &last))
}

/// A pick counted on its endpoint: the pick, the prefill tokens queued there before it, and
/// the guard that counts it.
type Placed = (Pick, u64, InFlight);

/// Count a request that runs whole on `view[pick.index]` (call inside [`Pool::place`]): its
/// prompt and expected prefill in the endpoint's load, its prompt in the working set.
fn count_local(
    pool: &Pool,
    view: &[Arc<Endpoint>],
    placement: &Placement<'_>,
    pick: Pick,
) -> Placed {
    let ep = &view[pick.index];
    let ahead = ep.pending_prefill_tokens();
    let mut in_flight = ep.begin(placement.prompt_tokens, pick.uncached_tokens_estimate);
    in_flight.hold_prompt(&placement.prefix, pool.tokens_per_chunk());
    (pick, ahead, in_flight)
}

/// Where the decode endpoint's pick leaves a request of a pool with prefill endpoints.
enum DecodeLeg {
    /// It runs whole on the decode endpoint, already counted: cached enough there (`cached`),
    /// or an endpoint that cannot take a split's decode leg (`runs_whole`).
    Local(Placed, &'static str),
    /// Its prompt is prefilled elsewhere: the decode endpoint counts it, without a prefill.
    Split(Pick, InFlight),
}

/// `P * (1 - matched / chunks)`: the prompt tokens not covered by `matched` leading chunks.
fn uncached_tokens(prompt_tokens: u64, matched: usize, chunks: usize) -> u64 {
    if chunks == 0 {
        return prompt_tokens;
    }
    let covered = (prompt_tokens as f64 * matched.min(chunks) as f64 / chunks as f64).round();
    prompt_tokens.saturating_sub(covered as u64)
}

/// Place a request in a pool with prefill endpoints (see the module doc).
#[allow(clippy::too_many_arguments)]
async fn open_split(
    state: &AppState,
    pool: &Pool,
    body: &Value,
    prompt_tokens: u64,
    prefix: Vec<u64>,
    session: Option<&str>,
    named: bool,
    lineage: &mut Option<Lineage>,
    room: Room,
    avoid: &[usize],
    may_split: bool,
) -> Result<(ChunkStream, Routed), HttpError> {
    // A sub-agent's own pins live under its own key; without one it is placed afresh.
    let own_key = lineage.as_ref().map(|l| l.own.clone());
    let key = match &own_key {
        Some(own) => own.as_deref(),
        None => session,
    };
    let pin = session_pin(state, pool, key).await;
    // The list as it is after the store read (see `open_upstream`).
    let endpoints = pool.endpoints();
    let prefill_view: Vec<Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| e.role == Role::Prefill)
        .cloned()
        .collect();
    let mut decode_view: Vec<Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| e.role != Role::Prefill)
        .cloned()
        .collect();
    if decode_view.is_empty() {
        // Prefill endpoints only: they run requests whole.
        decode_view = endpoints.to_vec();
    }
    // A call whose headers name no parent may still be a sub-agent: its parent is found by
    // the prefix it shares with an active session. Every call is recorded for the next. The
    // parent found is kept for the turn's later attempts (after `truncation: auto` shortened
    // the history, the prompt may no longer share the parent's prefix).
    let inferred = match (&pool.disaggregation.parents, session) {
        (Some(parents), Some(session)) => parents.observe(&Observation {
            session,
            lineage: lineage.as_ref(),
            pinned: pin.is_some(),
            named,
            prefix: &prefix,
        }),
        _ => None,
    };
    if lineage.is_none() {
        lineage.clone_from(&inferred);
    }
    let lineage = lineage.as_ref();
    if let Some(l) = lineage {
        state.metrics.pd_sub_agent(&pool.name, l.source);
        if inferred.is_some() {
            tracing::debug!(session = ?session, parent = %l.parent, "sub-agent found by shared prefix");
        }
    }
    let placement = Placement {
        body,
        prompt_tokens,
        prefix,
        pin,
        key,
        room,
        avoid: avoid.to_vec(),
    };

    // 1. The decode endpoint, counted there as it is picked. Siblings of a burst spread by
    // load, whatever they share.
    // 2. Does remote prefill pay off there?
    let settings = &pool.disaggregation;
    let decode_prefix: &[u64] = if lineage.is_some() {
        &[]
    } else {
        &placement.prefix
    };
    let avoided = placement.avoided_in(&decode_view);
    let pinned = pinned_in(&decode_view, placement.pin.as_ref());
    let request = placement.room.pick_request(PickRequest {
        exclude: &avoided,
        prefix: decode_prefix,
        prompt_tokens,
        pinned,
        ..PickRequest::default()
    });
    let leg = pool.place(|| {
        let mut decode = pool.picker.pick(&decode_view, &request)?;
        if lineage.is_some() {
            let matched = pool.picker.prefix_index().map_or(0, |index| {
                index.match_len(decode_view[decode.index].slot, &placement.prefix)
            });
            decode.matched_chunks = matched;
            decode.uncached_tokens_estimate =
                uncached_tokens(prompt_tokens, matched, placement.prefix.len());
        }
        let d = &decode_view[decode.index];
        let pays_off =
            remote_prefill_pays_off(decode.uncached_tokens_estimate, settings.threshold_tokens);
        // After a lost KV transfer the request runs whole, once (a decode endpoint that
        // cannot prefill still splits: see below).
        let split = !pool.runs_whole(d) || (may_split && pays_off && pool.receives_kv(d));
        Some(match split {
            false => {
                let why = match (may_split, pays_off) {
                    (false, _) => "transfer_failed",
                    (true, true) => "runs_whole",
                    (true, false) => "cached",
                };
                DecodeLeg::Local(count_local(pool, &decode_view, &placement, decode), why)
            }
            true => {
                let mut guard = d.begin(prompt_tokens, 0);
                // The prompt is prefilled elsewhere: `d` runs no prefill chunks for it, so it
                // does not count against `[flow] max_prefilling_per_endpoint` there.
                guard.prefill_done();
                guard.hold_prompt(&placement.prefix, pool.tokens_per_chunk());
                DecodeLeg::Split(decode, guard)
            }
        })
    });
    let (decode, decode_guard) = match leg {
        None => return Err(no_endpoint(pool, "no available decode endpoint")),
        Some(DecodeLeg::Local(placed, why)) => {
            state.metrics.pd_decision(&pool.name, "local", why);
            return open_local(state, pool, &decode_view, placement, Some(placed)).await;
        }
        Some(DecodeLeg::Split(decode, guard)) => (decode, guard),
    };
    let d = decode_view[decode.index].clone();
    // A decode endpoint that cannot prefill, for a request whose split lost its transfer:
    // an endpoint that runs requests whole takes it, if the pool has one; else it is split
    // again.
    if !may_split && decode_view.iter().any(|e| pool.runs_whole(e)) {
        drop(decode_guard);
        state
            .metrics
            .pd_decision(&pool.name, "local", "transfer_failed");
        return open_whole_elsewhere(state, pool, &decode_view, placement, None).await;
    }
    let prefill_key = key.map(prefill_pin_key);
    let own_prefill_pin = session_pin(state, pool, prefill_key.as_deref()).await;
    let prefill_pin = match (&own_prefill_pin, lineage) {
        (None, Some(l)) => session_pin(state, pool, Some(&prefill_pin_key(&l.parent))).await,
        _ => own_prefill_pin.clone(),
    };
    // Not an endpoint this request failed on; with prefill endpoints only, `d` is one of
    // them: it does not prefill for itself.
    let mut excluded = placement.avoided_in(&prefill_view);
    let pinned_prefill = pinned_in(&prefill_view, prefill_pin.as_ref());
    // (A prefill pin on an endpoint this request failed on breaks because it failed.)
    let prefill_pin_failed = matches!(pinned_prefill, Pinned::At(i) if excluded.contains(&i));
    excluded.extend(prefill_view.iter().position(|e| Arc::ptr_eq(e, &d)));
    let prefill_request = PrefillRequest {
        exclude: &excluded,
        prefix: &placement.prefix,
        prompt_tokens,
        pinned: pinned_prefill,
    };
    let picked = pool.place(|| {
        let prefill =
            settings
                .prefill
                .pick(&prefill_view, pool.picker.prefix_index(), &prefill_request)?;
        let p = &prefill_view[prefill.index];
        let ahead = p.pending_prefill_tokens();
        let guard = p.begin(prompt_tokens, prefill.uncached_tokens_estimate);
        Some((prefill, ahead, guard))
    });
    let Some((prefill, prefill_ahead, prefill_guard)) = picked else {
        state
            .metrics
            .pd_decision(&pool.name, "local", "no_prefill_endpoint");
        if !pool.runs_whole(&d) {
            drop(decode_guard);
            return open_whole_elsewhere(state, pool, &decode_view, placement, None).await;
        }
        let placed = pool.place(|| {
            drop(decode_guard);
            count_local(pool, &decode_view, &placement, decode)
        });
        return open_local(state, pool, &decode_view, placement, Some(placed)).await;
    };
    let p = prefill_view[prefill.index].clone();
    let why = if lineage.is_some() {
        "sub_agent"
    } else if remote_prefill_pays_off(decode.uncached_tokens_estimate, settings.threshold_tokens) {
        "uncached"
    } else {
        "decode_only_endpoint"
    };
    state.metrics.pd_decision(&pool.name, "disaggregated", why);

    // 3. Both legs.
    let target = PrefillTarget {
        base_url: p.base_url.clone(),
        bootstrap: pool.bootstrap(&p),
    };
    let sent = Instant::now();
    let opened = state
        .engines
        .open_disaggregated(pool.flavor, &target, &d.base_url, body)
        .await;
    drop(prefill_guard);
    let failure = match opened {
        Ok(opened) => {
            let kv_ready = sent + opened.prefill_latency;
            // What the prefill engine computed, when it says what it had cached (one that
            // leaves the count out, as vLLM does without `--enable-prompt-tokens-details`,
            // would read as having computed the whole prompt, and look that much faster).
            let computed = opened
                .prefill_usage
                .and_then(|u| {
                    pool.cached_tokens(u.cached_tokens)
                        .map(|cached| u.prompt_tokens.saturating_sub(cached))
                })
                .unwrap_or(prefill.uncached_tokens_estimate);
            p.observe_prefill(
                prefill_ahead.saturating_add(computed),
                opened.prefill_latency,
            );
            state
                .metrics
                .pd_leg(&pool.name, "prefill", opened.prefill_latency);
            // (Its guard dropped, a prefill endpoint discovery removed meanwhile may have given
            // its slot to another engine: that one is not credited with this prompt.)
            let credited = !p.is_retired();
            if credited {
                pool.routed(&p, &placement.prefix);
            }
            pool.routed(&d, &placement.prefix);
            // (An engine that leaves out the cached count, as vLLM does unless started with
            // `--enable-prompt-tokens-details`, told nothing about its cache.)
            if let Some(usage) = opened.prefill_usage.filter(|_| credited) {
                if let Some(cached) = pool.cached_tokens(usage.cached_tokens) {
                    pool.picker.completed(
                        p.slot,
                        &placement.prefix,
                        prefill.matched_chunks,
                        cached,
                        usage.prompt_tokens,
                    );
                }
            }
            if let Some(window) = placement.room.spread_window {
                d.note_reserved_turn(sent, window);
            }
            state
                .metrics
                .routing_decision(&pool.name, &d, decode.reason.as_str());
            let mut pin_moved = None;
            let mut repins = Vec::new();
            if let Some(key) = key.filter(|_| pool.policy.uses_pins()) {
                let pin_failed = matches!(pinned, Pinned::At(i) if avoided.contains(&i));
                let session = repin(
                    state,
                    pool,
                    key,
                    placement.pin.as_ref(),
                    &d,
                    decode.pin,
                    pin_failed,
                )
                .await;
                pin_moved = session.as_ref().and_then(|r| r.cause);
                repins.extend(session);
                let prefill_key = prefill_pin_key(key);
                repins.extend(
                    repin(
                        state,
                        pool,
                        &prefill_key,
                        own_prefill_pin.as_ref(),
                        &p,
                        prefill.pin,
                        prefill_pin_failed,
                    )
                    .await
                    .map(|repin| Repin {
                        prefill: true,
                        ..repin
                    }),
                );
            }
            tracing::debug!(
                prefill = %p.name,
                decode = %d.name,
                reason = why,
                uncached_on_decode = decode.uncached_tokens_estimate,
                uncached_on_prefill = computed,
                prefill_ms = opened.prefill_latency.as_millis() as u64,
                "disaggregated"
            );
            return Ok((
                opened.stream,
                Routed {
                    in_flight: decode_guard,
                    slot: d.slot,
                    matched_chunks: decode.matched_chunks,
                    prefix: placement.prefix,
                    reason: decode.reason.as_str(),
                    pin_moved,
                    repins,
                    sent,
                    ahead: 0,
                    prefill: Some(PrefillLeg {
                        endpoint: p,
                        kv_ready,
                    }),
                },
            ));
        }
        Err(e) => e,
    };
    drop(decode_guard);
    if let UpstreamError::Status {
        status: 400 | 413 | 422,
        ..
    } = failure.upstream()
    {
        let api = failure.upstream().to_api_error();
        tracing::info!(prefill = %p.name, decode = %d.name, "engine rejected the request: {}", agentgate_adapters::OneLine(&api.message));
        return Err(api.into());
    }
    let whole = pool.runs_whole(&d);
    let instead = match whole {
        true => "prefilling on the decode endpoint",
        false => "running it whole on an endpoint that can",
    };
    match &failure {
        DisaggError::Prefill(e) => {
            tracing::warn!(prefill = %p.name, decode = %d.name, "prefill leg failed ({e}); {instead}");
            state.metrics.pd_fallback(&pool.name, "prefill_failed");
        }
        DisaggError::Decode(e) => {
            tracing::warn!(prefill = %p.name, decode = %d.name, "decode leg failed after the prefill ({e}); retrying once without disaggregation, {instead}");
            state.metrics.pd_transfer_failed(&pool.name, &p, &d);
            state.metrics.pd_fallback(&pool.name, "transfer_failed");
            // (The retry's decision, as when the transfer is lost in the decode stream.)
            state
                .metrics
                .pd_decision(&pool.name, "local", "transfer_failed");
        }
    }
    if !whole {
        return open_whole_elsewhere(state, pool, &decode_view, placement, Some(failure)).await;
    }
    let placed = pool.place(|| count_local(pool, &decode_view, &placement, decode));
    open_local(state, pool, &decode_view, placement, Some(placed)).await
}

/// Run a request whole on one of `view`'s endpoints that can (see [`Pool::runs_whole`]), for a
/// request whose decode endpoint cannot prefill and could not be split. With none, the split's
/// failure, or 503 when there was no prefill endpoint to split with.
async fn open_whole_elsewhere(
    state: &AppState,
    pool: &Pool,
    view: &[Arc<Endpoint>],
    placement: Placement<'_>,
    failure: Option<DisaggError>,
) -> Result<(ChunkStream, Routed), HttpError> {
    let whole: Vec<Arc<Endpoint>> = view
        .iter()
        .filter(|e| pool.runs_whole(e))
        .cloned()
        .collect();
    if whole.is_empty() {
        return Err(match failure {
            Some(failure) => failure.upstream().to_api_error().into(),
            None => no_endpoint(
                pool,
                "no prefill endpoint is available, and the pool's SGLang decode endpoints cannot prefill",
            ),
        });
    }
    open_local(state, pool, &whole, placement, None).await
}

/// Point the pin under `key` at `ep` when it points elsewhere (or nowhere yet). (A pin that
/// holds had its TTL refreshed when it was read for the turn, so it lasts `pin_ttl` after the
/// session's last turn.) Returns the pin stored, with the cause of the move when an existing
/// pin moved, for the turn to count once its endpoint produced output: `failed` when the old
/// endpoint failed this request (`pin_failed`), else why the pick broke it. A move another turn
/// made first (the swap did not apply, even when it chose the same endpoint) or that could not
/// be stored is not returned.
async fn repin(
    state: &AppState,
    pool: &Pool,
    key: &str,
    pin: Option<&SessionPin>,
    ep: &Endpoint,
    outcome: PinOutcome,
    pin_failed: bool,
) -> Option<Repin> {
    if let Some(p) = pin.filter(|p| pins_to(p, ep)) {
        // Reading it for this turn refreshed its TTL. A pin from before pins recorded their
        // endpoint's URL gets it now, and one whose endpoint was renamed the new name (not
        // moves).
        if p.url.is_none() || p.endpoint != ep.name {
            let with_url = SessionPin {
                endpoint: ep.name.clone(),
                url: Some(ep.base_url.clone()),
                moves: p.moves,
            };
            if let Err(e) = pin_op(state.store.swap_pin(&pool.name, key, Some(p), &with_url)).await
            {
                tracing::warn!("could not store the session pin: {e}");
            }
        }
        return None;
    }
    let new = SessionPin {
        endpoint: ep.name.clone(),
        moves: pin.map_or(0, |p| p.moves.saturating_add(1)),
        url: Some(ep.base_url.clone()),
    };
    match pin_op(state.store.swap_pin(&pool.name, key, pin, &new)).await {
        Ok(swap) if !swap.applied => {
            // Another turn of the session (on this gateway or another) moved it first, maybe
            // to the same endpoint: that move is its to count.
            tracing::info!(key, pinned = %swap.pin.endpoint, served = %ep.name, "another turn re-pinned the session first");
            return None;
        }
        Ok(_) => {}
        Err(e) => {
            // The pin still names the old endpoint: the next turn decides again.
            tracing::warn!("could not store the session pin: {e}");
            return None;
        }
    }
    let old = pin?;
    let cause = match outcome {
        _ if pin_failed => "failed",
        PinOutcome::Broken(cause) => cause.as_str(),
        // Held or not consulted, yet the request went elsewhere: its pinned endpoint failed.
        _ => "failed",
    };
    tracing::info!(key, from = %old.endpoint, to = %ep.name, moves = new.moves, cause, "session re-pinned");
    Some(Repin {
        key: key.to_string(),
        from: old.clone(),
        to: new,
        cause: Some(cause),
        prefill: false,
    })
}

/// The events of a streamed turn that failed before any endpoint ran it: `response.created`,
/// `response.in_progress`, then `response.failed` with `code` and `message`; counted as the
/// response ended. Nothing is stored (a retrieve of its id answers 404).
pub fn failed_at_start(state: &AppState, turn: &Turn, code: &str, message: &str) -> Vec<SseEvent> {
    let mut rs = new_stream(turn);
    let mut events = rs.start();
    events.extend(rs.fail(code, message));
    turn_ended(state, turn, rs.response());
    events
}

/// Count a turn that ended as `response` says: among responses, and among compactions when it
/// was one.
fn turn_ended(state: &AppState, turn: &Turn, response: &Value) {
    state.metrics.response_ended(&turn.pool.name, response);
    if turn.plan.compaction {
        state.metrics.compaction_ended(&turn.pool.name, response);
    }
}

fn new_stream(turn: &Turn) -> ResponseStream {
    ResponseStream::new(turn.skeleton.clone(), turn.plan.tool_names.clone())
        .with_encrypted_reasoning(turn.encrypted_reasoning)
        .with_compaction(turn.plan.compaction)
        .with_single_tool_call(turn.request.get("parallel_tool_calls") == Some(&Value::Bool(false)))
}

/// Longest a background response's events wait before they are appended to its event log.
const EVENT_LOG_BATCH: Duration = Duration::from_millis(100);

/// Where a turn's events go: the client's stream when one is attached and, for a background
/// response, its event log in the store, which `GET /v1/responses/{id}?stream=true` replays
/// and follows from any gateway replica (`responses::stream_stored`). The log is appended in
/// batches, at most one write per [`EVENT_LOG_BATCH`], and a batch waits no longer than that
/// when the engine pauses; the last batch, ending
/// with the terminal event, is written after the response is stored, as the stream gets it. A
/// batch the store refuses is kept for the next write; the last is tried three times and then
/// dropped (logged): a follower then misses those events but still ends, on the stored status.
/// A write that finds the response no longer running (cancelled or deleted through another
/// gateway replica) stops the run as a cancel here would.
struct Sink {
    /// The streaming client, until it goes away or stalls.
    tx: Option<mpsc::Sender<Bytes>>,
    log: Option<EventLog>,
    /// `[server] client_stall_timeout_s`.
    stall: Duration,
    /// The turn's stop signals: a stop drops a client that is not reading rather than wait on
    /// it.
    stops: Option<StopSignals>,
}

struct EventLog {
    id: String,
    pending: Vec<String>,
    written_at: Option<Instant>,
}

impl Sink {
    /// Whether events wait for the log's next write.
    fn holds_events(&self) -> bool {
        self.log.as_ref().is_some_and(|log| !log.pending.is_empty())
    }

    fn new(
        state: &AppState,
        turn: &Turn,
        tx: Option<mpsc::Sender<Bytes>>,
        stops: Option<StopSignals>,
    ) -> Sink {
        let log = (turn.background && turn.store).then(|| EventLog {
            id: turn.id.clone(),
            pending: Vec::new(),
            written_at: None,
        });
        Sink {
            tx,
            log,
            stall: state.config.server.client_stall_timeout(),
            stops,
        }
    }

    /// Send `events`; `last` writes the log's pending batch whatever its age.
    async fn send(&mut self, state: &AppState, events: Vec<SseEvent>, last: bool) {
        if let Some(log) = self.log.as_mut() {
            log.pending
                .extend(events.iter().map(SseEvent::to_sse_frame));
            let due = last
                || log
                    .written_at
                    .is_none_or(|t| t.elapsed() >= EVENT_LOG_BATCH);
            if due && !log.pending.is_empty() {
                // A batch the store refuses waits for the next one; the last is tried three
                // times, then dropped (a follower then ends on the stored status).
                let tries = if last { 3 } else { 1 };
                for attempt in 1..=tries {
                    match state.store.append_events(&log.id, &log.pending).await {
                        Ok(running) => {
                            log.pending.clear();
                            // Cancelled (or deleted) through another gateway replica, which
                            // cannot signal this run: it stops here as if cancelled here.
                            if !running && !last {
                                tracing::info!(response = %log.id, "the response no longer runs in the store (cancelled elsewhere); stopping its run");
                                crate::responses::signal_cancel(state, &log.id);
                            }
                            break;
                        }
                        Err(e) if attempt < tries => {
                            tracing::warn!(response = %log.id, attempt, "could not log the response's events ({e}); retrying");
                            tokio::time::sleep(EVENT_LOG_BATCH * 2 * attempt).await;
                        }
                        Err(e) => {
                            tracing::warn!(response = %log.id, events = log.pending.len(), "could not log the response's events: {e}");
                            if last {
                                log.pending.clear();
                            }
                        }
                    }
                }
                log.written_at = Some(Instant::now());
            }
        }
        self.emit(events).await;
    }

    /// Send events to the client if it is still there. Neither a client that went away nor
    /// one that stopped reading holds the turn: the first is noticed at the next send; the
    /// second once its connection's buffers stay full for the stall timeout, or at once when
    /// the turn is stopped (cancel, shutdown). Either way the client is dropped (its stream
    /// ends) and the turn runs on to its end and is stored as usual (one that would not be
    /// kept stops when its client goes: [`StopSignals::until_client_leaves`]).
    async fn emit(&mut self, events: Vec<SseEvent>) {
        for ev in &events {
            let Some(tx) = self.tx.as_ref() else {
                return;
            };
            let mut by_stop = false;
            let stopped = async {
                match self.stops.as_mut() {
                    Some(stops) => {
                        stops.stopped().await;
                        by_stop = true;
                    }
                    None => std::future::pending().await,
                }
            };
            let frame = Bytes::from(ev.to_sse_frame());
            if !send_to_client(tx, frame, self.stall, stopped).await {
                self.tx = None;
                // A client dropped for not reading still holds its connection (and the
                // response body that would tell the turn it left): a turn that stops when its
                // client goes stops now, as if it had.
                if let Some(stops) = self.stops.as_ref().filter(|_| !by_stop) {
                    stops.client_abandoned();
                }
                return;
            }
        }
    }
}

/// Send one SSE frame to a streaming client; `false` when the client is to be dropped: it went
/// away, it left its stream unread (the channel full) for `stall`, or `stop` resolved while it
/// was not reading. A client with room in its channel costs no timer.
pub(crate) async fn send_to_client(
    tx: &mpsc::Sender<Bytes>,
    frame: Bytes,
    stall: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> bool {
    let frame = match tx.try_send(frame) {
        Ok(()) => return true,
        Err(mpsc::error::TrySendError::Closed(_)) => return false,
        Err(mpsc::error::TrySendError::Full(frame)) => frame,
    };
    tokio::select! {
        biased;
        sent = tx.send(frame) => sent.is_ok(),
        () = tokio::time::sleep(stall) => {
            tracing::warn!(?stall, "streaming client left its events unread; no longer sending to it");
            false
        }
        () = stop => false,
    }
}

/// Drive an opened engine stream to the end, persist, then send the terminal event.
/// Returns the final Response object and where it ran.
pub async fn drive(
    state: Arc<AppState>,
    turn: Turn,
    chunks: ChunkStream,
    routed: Routed,
    tx: Option<mpsc::Sender<Bytes>>,
    stops: Option<StopSignals>,
) -> Served {
    let rs = new_stream(&turn);
    let sink = Sink::new(&state, &turn, tx, stops.clone());
    drive_announced(state, turn, chunks, routed, Announced { rs, sink }, stops).await
}

/// How many times a turn whose engine failed before its first token is sent again (each time
/// to an endpoint it has not failed on: `Turn::failed_slots`).
const MAX_REOPENS: u32 = 2;

/// A turn's event stream and where its events go, from before it runs: a background response
/// is announced (`response.created`, `response.queued`) when it is created.
struct Announced {
    rs: ResponseStream,
    sink: Sink,
}

impl Announced {
    /// End a turn that never ran: `events` (its terminal one last) to the client and the log.
    async fn end(mut self, state: &AppState, events: Vec<SseEvent>) {
        self.sink.send(state, events, true).await;
    }
}

/// [`drive`] with the stream already announced.
async fn drive_announced(
    state: Arc<AppState>,
    mut turn: Turn,
    mut chunks: ChunkStream,
    mut routed: Routed,
    announced: Announced,
    mut stops: Option<StopSignals>,
) -> Served {
    let Announced { mut rs, mut sink } = announced;
    let mut endpoint = routed.endpoint().clone();
    let mut first_token: Option<Instant> = None;
    let mut reopens_left = MAX_REOPENS;
    sink.send(&state, rs.start(), false).await;
    let terminal = loop {
        // Events waiting for the log go out after a pause in the engine's stream too.
        let flush_due = sink.holds_events();
        let next = match stops.as_mut() {
            Some(stops) => tokio::select! {
                chunk = chunks.next() => chunk,
                stop = stops.stopped() => {
                    tracing::info!(response = %turn.id, why = stop.code(), "response stopped while running");
                    break stop.end(&mut rs);
                }
                () = tokio::time::sleep(EVENT_LOG_BATCH), if flush_due => {
                    sink.send(&state, Vec::new(), false).await;
                    continue;
                }
            },
            None => chunks.next().await,
        };
        // An engine that fails or drains before its first token may say so in its stream
        // (an error chunk, an `abort` with nothing in it): as when the connection breaks, the
        // client has seen nothing of the engine's, and another endpoint may run the request.
        let next = match next {
            Some(Ok(chunk)) if first_token.is_none() => match failure_without_output(&chunk) {
                Some(failure) => Some(Err(UpstreamError::Protocol(failure))),
                None => Some(Ok(chunk)),
            },
            next => next,
        };
        match next {
            Some(Ok(chunk)) => {
                // The engine is past this request's prefill: it no longer delays new work there.
                routed.in_flight.prefill_done();
                // (vLLM's first chunk, the assistant role, comes just before the first token,
                // and also ahead of the `abort` of a request that never had one.)
                if first_token.is_none() && carries_output(&chunk) {
                    let now = Instant::now();
                    first_token = Some(now);
                    routed.count_moves(&state, &turn.pool.name);
                    if let Some(leg) = &routed.prefill {
                        let decode = now.saturating_duration_since(leg.kv_ready);
                        state.metrics.pd_leg(&turn.pool.name, "decode", decode);
                    }
                }
                let events = rs.on_chunk(&chunk);
                if rs.is_finished() {
                    // An error the engine sent in its stream: the terminal event goes out once
                    // the response is stored, like any other.
                    break events;
                }
                sink.send(&state, events, false).await;
            }
            // Nothing came of it yet (the engine answers with its headers at once, then
            // queues and prefills): the client has seen nothing of the engine's, so another
            // endpoint may run it.
            Some(Err(e)) if first_token.is_none() && reopens_left > 0 => {
                reopens_left -= 1;
                tracing::warn!(response = %turn.id, endpoint = %endpoint.name, "engine failed before its first token ({e}); trying the request again elsewhere");
                // (The failed request still counts on its endpoint while another is picked.)
                // A split's decode leg that fails before its first token most likely lost its
                // KV transfer (vLLM's decode engine answers with its headers before it pulls
                // the blocks): counted as one, and retried once without disaggregation, as a
                // transfer that fails when the legs open is (the decode endpoint prefills the
                // prompt itself; one that cannot hands it to an endpoint that runs requests
                // whole, or, with none, splits it again with another prefill endpoint).
                // The next attempt runs without disaggregation (once: should it fail too, the
                // decode endpoint is avoided as any other).
                match &routed.prefill {
                    Some(leg) if !turn.transfer_failed => {
                        state
                            .metrics
                            .pd_transfer_failed(&turn.pool.name, &leg.endpoint, &endpoint);
                        state
                            .metrics
                            .pd_fallback(&turn.pool.name, "transfer_failed");
                        turn.failed_slots.push(leg.endpoint.slot);
                        turn.transfer_failed = true;
                    }
                    Some(leg) => {
                        state
                            .metrics
                            .pd_transfer_failed(&turn.pool.name, &leg.endpoint, &endpoint);
                        turn.failed_slots.push(leg.endpoint.slot);
                        turn.failed_slots.push(routed.slot);
                    }
                    None => turn.failed_slots.push(routed.slot),
                }
                // A pin this turn moved to the failed endpoint goes back (the session's cache
                // never got there), and is read again.
                routed.undo_moves(&state, &turn.pool.name).await;
                turn.admission_pin = None;
                // The failed engine request is given up now, not once another endpoint has
                // answered: its connection would keep it queued or prefilling there (and a
                // split's prefill leg running) for nobody.
                chunks = Box::pin(futures_util::stream::empty());
                let reopened = match stops.as_mut() {
                    Some(stops) => tokio::select! {
                        reopened = open_turn(&state, &mut turn) => reopened,
                        stop = stops.stopped() => {
                            tracing::info!(response = %turn.id, why = stop.code(), "response stopped while running");
                            break stop.end(&mut rs);
                        }
                    },
                    None => open_turn(&state, &mut turn).await,
                };
                match reopened {
                    Ok((reopened, placed)) => {
                        chunks = reopened;
                        routed = placed;
                        endpoint = routed.endpoint().clone();
                    }
                    Err(err) => {
                        tracing::warn!(response = %turn.id, "no endpoint could take the request again: {}", agentgate_adapters::OneLine(&err.error.message));
                        // A fault of the request that the retry found (a prompt over the
                        // context window, an output budget that fills it) is the answer a
                        // client acts on: Codex compacts its history on
                        // `context_length_exceeded` and retries on an engine failure.
                        let code = match err.error.code.as_deref() {
                            Some(code) if err.error.status == 400 => code,
                            _ => e.failure_code(),
                        };
                        break rs.fail(
                            code,
                            &format!(
                                "The model backend failed before generating the response: {e}; \
                                 trying it again elsewhere failed: {}",
                                err.error.message
                            ),
                        );
                    }
                }
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
    // Whatever the engine would still send is not wanted: a stopped or failed turn releases
    // its engine request now, not after the store write.
    drop(chunks);
    let mut response = rs.response().clone();
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
        compaction = turn.plan.compaction,
        "turn finished"
    );
    // What the engine served from cache corrects the prefix index and times its prefill; an
    // engine that does not report it leaves the index as it is.
    // (A stream that ended without its usage chunk reported nothing, not 0 cached.)
    let reported = rs
        .reports_usage()
        .then(|| turn.pool.cached_tokens(rs.engine_cached_tokens()))
        .flatten();
    // The pin moves this turn made: counted once the endpoint produced output (or finished
    // without any); moved back when it ended otherwise before its first token (the engine
    // failed, refused the request in its stream, or the turn was stopped): the session's
    // cache never got there.
    let finished = status == "completed" || status == "incomplete";
    if !finished && first_token.is_none() {
        routed.undo_moves(&state, &turn.pool.name).await;
    }
    if finished {
        routed.count_moves(&state, &turn.pool.name);
        let input = response
            .pointer("/usage/input_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        if let Some(cached) = reported {
            turn.pool.picker.completed(
                routed.slot,
                &routed.prefix,
                routed.matched_chunks,
                cached,
                input,
            );
        }
        // Unreported, the prefill is timed with what the index expected the engine to hold.
        let cached = reported.unwrap_or_else(|| {
            turn.pool.picker.prefix_index().map_or(0, |index| {
                (routed.matched_chunks as u64).saturating_mul(index.tokens_per_chunk())
            })
        });
        // A request run whole: its first token came after its own prefill and the prefill
        // queued ahead of it.
        if let (None, Some(first)) = (&routed.prefill, first_token) {
            let work = routed.ahead.saturating_add(input.saturating_sub(cached));
            endpoint.observe_prefill(work, first.saturating_duration_since(routed.sent));
        }
    }
    // The engine is done with it: its slot and admission permit go before the store write,
    // which a background run may retry for minutes.
    let reason = (routed.reason, routed.pin_moved);
    drop(routed);
    drop(turn.background_slot.take());
    if let Some(permit) = turn.permit.take() {
        match rs.reports_usage() {
            true => flow::finish(permit, &response),
            // Cut short before the engine counted it: charged at its estimate, not as free.
            false => drop(permit),
        }
    }
    let persisted = persist(&state, &turn, &response, rs.output_items()).await;
    // Its items are in the conversation (or never will be): the next turn may start there
    // as soon as the client reads the terminal event.
    release_conversation(&turn).await;
    let mut terminal = terminal;
    match persisted {
        // The client would get an id it cannot retrieve or continue from: say so instead. A
        // background run that gave up (the store failed for minutes, or the gateway is
        // stopping) says so to its stream too; its record stays as last written.
        Persisted::Failed => fail_unstored(&mut response, &mut terminal),
        // A client waiting on a conversation turn is told it did not land (its items are not
        // in the conversation); a background run's record is complete and retrievable.
        Persisted::Unjoined if !turn.background => {
            fail_unstored(&mut response, &mut terminal);
            // Its record would answer as completed to a retrieve and be continued from,
            // against what the client is told: it goes (best effort: the store is failing).
            if let Err(e) = state.store.delete(&turn.team, &turn.id).await {
                tracing::warn!(response = %turn.id, "could not delete the response left out of its conversation: {e}");
            }
        }
        // Cancelled as it ended (or by a gateway replica with no signal to this run): the
        // stream and the log end as the record says.
        // As stored, where the store still has it (a deleted response is gone).
        Persisted::Discarded(Some(stored)) => {
            response = stored;
            end_failed(&mut terminal, &response);
        }
        Persisted::Discarded(None) => {
            let stop = Stop::Cancelled;
            rewrite_terminal(
                &mut response,
                &mut terminal,
                "cancelled",
                stop.code(),
                stop.message(),
            );
        }
        _ => {}
    }
    turn_ended(&state, &turn, &response);
    sink.send(&state, terminal, true).await;
    Served {
        response,
        endpoint,
        reason,
    }
}

/// A driven turn: its final Response object and where it ran (another endpoint than the one
/// first picked when the engine failed before its first token and the turn ran again).
pub struct Served {
    /// The final Response object.
    pub response: Value,
    /// The endpoint that served it.
    pub endpoint: Arc<Endpoint>,
    /// Why that endpoint, and why the session's pin moved there ([`Routed::reason`],
    /// [`Routed::pin_moved`]).
    pub reason: (&'static str, Option<&'static str>),
}

/// Code of a response generated but not stored (the store failed).
pub const UNSTORED_CODE: &str = "store_unavailable";

/// Turn a finished `response` and its terminal event into a failure: the store could not keep
/// it, so its id can be neither retrieved nor continued (`previous_response_id`).
fn fail_unstored(response: &mut Value, terminal: &mut [agentgate_adapters::SseEvent]) {
    rewrite_terminal(
        response,
        terminal,
        "failed",
        UNSTORED_CODE,
        "The response was generated but the conversation store could not keep it, so its id \
         cannot be retrieved or continued. Retry the request.",
    );
}

/// End a finished `response` and its terminal event as `response.failed` with `status` and
/// an error of `code` and `message`.
fn rewrite_terminal(
    response: &mut Value,
    terminal: &mut [agentgate_adapters::SseEvent],
    status: &str,
    code: &str,
    message: &str,
) {
    response["status"] = Value::from(status);
    response["incomplete_details"] = Value::Null;
    // Only a completed response has a completion time.
    response["completed_at"] = Value::Null;
    response["error"] = serde_json::json!({"code": code, "message": message});
    end_failed(terminal, response);
}

/// Make the last of `terminal` a `response.failed` carrying `response`.
fn end_failed(terminal: &mut [agentgate_adapters::SseEvent], response: &Value) {
    if let Some(last) = terminal.last_mut() {
        last.event = "response.failed".into();
        last.data["type"] = Value::from("response.failed");
        last.data["response"] = response.clone();
    }
}

/// What became of a finished response's write.
#[derive(Debug, Clone, PartialEq)]
pub enum Persisted {
    /// Stored (or nothing to store).
    Stored,
    /// A background response cancelled or deleted meanwhile: its result was discarded. The
    /// Response object stored instead, unless it was deleted.
    Discarded(Option<Value>),
    /// The store did not take it.
    Failed,
    /// Stored, but its items could not be added to its conversation.
    Unjoined,
}

impl Persisted {
    /// The outcome of giving up, once the response itself was written (`stored`) or not.
    fn failed(stored: bool) -> Persisted {
        match stored {
            true => Persisted::Unjoined,
            false => Persisted::Failed,
        }
    }
}

/// Store the finished response (or update the background record in place), trying again while
/// the store fails (`retry_pause`).
pub async fn persist(
    state: &AppState,
    turn: &Turn,
    response: &Value,
    output: &[Value],
) -> Persisted {
    // A finished turn in a conversation adds its items to it (a failed one adds nothing).
    let joins = turn.conversation.is_some()
        && matches!(
            agentgate_sessions::record::response_status(response),
            "completed" | "incomplete"
        );
    let mut stored = !turn.store;
    let mut joined = !joins;
    if stored && joined {
        return Persisted::Stored;
    }
    let mut stopping = state.stopping.subscribe();
    let mut failures = 0;
    loop {
        let e = match persist_steps(state, turn, response, output, &mut stored, &mut joined).await {
            Ok(persisted) => return persisted,
            Err(e) => e,
        };
        failures += 1;
        state.metrics.store_write_errors.inc([]);
        let what = if stored {
            "add the response's items to its conversation"
        } else {
            "store the response"
        };
        let Some(pause) = retry_pause(turn.background, failures) else {
            tracing::error!(response = %turn.id, tries = failures, "could not {what}: {e}");
            return Persisted::failed(stored);
        };
        tracing::warn!(response = %turn.id, tries = failures, "could not {what} ({e}); retrying in {pause:?}");
        if !turn.background {
            tokio::time::sleep(pause).await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = stopping.wait_for(|stop| *stop) => {
                tracing::error!(response = %turn.id, tries = failures, "could not {what} before shutdown: {e}");
                return Persisted::failed(stored);
            }
        }
    }
}

/// The pause before trying a response write again after its `failures`-th failure, or `None`
/// to give up. A foreground turn tries three times over about a second: its client is waiting,
/// and is told the response could not be kept. A background run keeps trying for about ten
/// minutes (until the gateway shuts down): nobody waits on it, and a record left `in_progress`
/// would keep every client polling it waiting for ever.
fn retry_pause(background: bool, failures: u32) -> Option<Duration> {
    let ms = match (background, failures) {
        (_, 1) => 200,
        (_, 2) => 800,
        (false, _) => return None,
        (true, 3) => 2_000,
        (true, 4) => 5_000,
        (true, 5) => 10_000,
        (true, 6..=24) => 30_000,
        (true, _) => return None,
    };
    Some(Duration::from_millis(ms))
}

/// The writes of [`persist`] still to do: the response (`stored`), then the conversation's new
/// items (`joined`); each flag is set once its write has landed, so a retry does not repeat it
/// (and the store adds one response's items to a conversation once, should a write land whose
/// reply was lost). A background response cancelled meanwhile adds nothing, and is
/// [`Persisted::Discarded`].
async fn persist_steps(
    state: &AppState,
    turn: &Turn,
    response: &Value,
    output: &[Value],
    stored: &mut bool,
    joined: &mut bool,
) -> Result<Persisted, agentgate_sessions::StoreError> {
    let mut persisted = Persisted::Stored;
    if !*stored {
        let applied = persist_once(state, turn, response, output).await?;
        if !applied {
            // Cancelled or deleted meanwhile, or an earlier try landed and only its reply was
            // lost: the stored record says which.
            let current = state.store.get(&turn.team, &turn.id).await?;
            if current
                .as_ref()
                .is_none_or(|record| record.response != *response)
            {
                *joined = true;
                persisted = Persisted::Discarded(current.map(|record| record.response));
            }
        }
        *stored = true;
    }
    if !*joined {
        if let Some(conversation) = &turn.conversation {
            let items: Vec<Value> = turn
                .input_items
                .iter()
                .filter(|item| !agentgate_adapters::compaction::is_compaction_trigger(item))
                .chain(output)
                .cloned()
                .collect();
            if !state
                .store
                .append_conversation_items(&turn.team, conversation, &turn.id, &items)
                .await?
            {
                tracing::warn!(response = %turn.id, %conversation, "the conversation is gone; its new items were not added");
            }
        }
        *joined = true;
    }
    Ok(persisted)
}

/// Write the response; false when a background response was cancelled (or deleted) meanwhile
/// and its result is discarded.
async fn persist_once(
    state: &AppState,
    turn: &Turn,
    response: &Value,
    output: &[Value],
) -> Result<bool, agentgate_sessions::StoreError> {
    if turn.background {
        state
            .store
            .update_if_active(&turn.team, &turn.id, response, output)
            .await
            .inspect(|applied| {
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
        state.store.put(&record).await.map(|()| true)
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

/// Run a background turn: announce it (`response.created` and `response.queued`, to a
/// streaming client and the event log), wait for a background slot, then for flow-control
/// admission (`admission`, in the team's lowest band unless the request asked for one), mark it
/// `in_progress`, run it, record the result. A refused admission fails the response with the
/// refusal's code; a cancel ends its stream with status `cancelled`, whether it ran or not.
/// Its place in the registry of runs goes back when it returns, with `_registered`.
pub async fn run_background(
    state: Arc<AppState>,
    mut turn: Turn,
    admission: Option<Pending>,
    tx: Option<mpsc::Sender<Bytes>>,
    mut stops: StopSignals,
    _registered: RunRegistration,
) {
    // Announced at once, to a streaming client and in the event log a follower replays.
    let mut rs = new_stream(&turn);
    let mut sink = Sink::new(&state, &turn, tx, Some(stops.clone()));
    sink.send(&state, rs.queued(), false).await;
    let announced = Announced { rs, sink };
    let (team, id) = (turn.team.clone(), turn.id.clone());
    turn.background_slot = match state.background_slots.clone().try_acquire_owned() {
        Ok(permit) => Some(permit),
        Err(_) => {
            // Other turns of the session may move its pin meanwhile: read it again at routing.
            turn.admission_pin = None;
            tokio::select! {
                permit = state.background_slots.clone().acquire_owned() => permit.ok(),
                stop = waiting_stopped(&mut stops, &state, &team, &id) => {
                    stop_queued(&state, &mut turn, announced, stop).await;
                    return;
                }
            }
        }
    };
    if let Some(pending) = admission {
        let admitted = tokio::select! {
            admitted = pending.admit() => admitted,
            stop = waiting_stopped(&mut stops, &state, &team, &id) => {
                stop_queued(&state, &mut turn, announced, stop).await;
                return;
            }
        };
        match admitted {
            Ok(permit) => turn.permit = Some(permit),
            Err(err) => {
                fail_background(&state, &mut turn, announced, &err).await;
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
            // Cancelled (or deleted) while queued; the cancel may have come from another
            // gateway replica, so this one has no signal for it.
            stop_queued(&state, &mut turn, announced, Stop::Cancelled).await;
            return;
        }
        Err(e) => tracing::error!(response = %turn.id, "store error starting background run: {e}"),
    }
    turn.skeleton = in_progress;
    // Opening waits for the engine's first byte (queueing and prefill there): a cancel or the
    // shutdown stops that wait too, and dropping it drops the engine request.
    let opened = tokio::select! {
        opened = open_turn(&state, &mut turn) => opened,
        stop = waiting_stopped(&mut stops, &state, &team, &id) => {
            stop_queued(&state, &mut turn, announced, stop).await;
            return;
        }
    };
    match opened {
        Ok((chunks, ep)) => {
            drive_announced(state.clone(), turn, chunks, ep, announced, Some(stops)).await;
        }
        Err(err) => fail_background(&state, &mut turn, announced, &err).await,
    }
}

/// How often a background run waiting for a run slot, for admission or for its engine's first
/// byte reads its stored status: a cancel or a delete sent to another gateway replica reaches
/// it only through the store.
const QUEUED_STATUS_POLL: Duration = Duration::from_secs(1);

/// Resolves once the stored response is no longer queued or in progress (cancelled or
/// deleted through any gateway replica); a store that cannot be read keeps the run waiting.
async fn ended_in_store(state: &AppState, team: &str, id: &str) {
    loop {
        tokio::time::sleep(QUEUED_STATUS_POLL).await;
        match state.store.status(team, id).await {
            Ok(Some(status)) if matches!(status.as_str(), "queued" | "in_progress") => {}
            Ok(_) => return,
            Err(e) => tracing::debug!(response = %id, "cannot read the run's status: {e}"),
        }
    }
}

/// Resolves with why a background run that waits (for a run slot, admission or its engine's
/// first byte) must stop: a signal of this process, or its stored status no longer active
/// (cancelled or deleted through any gateway replica).
async fn waiting_stopped(stops: &mut StopSignals, state: &AppState, team: &str, id: &str) -> Stop {
    tokio::select! {
        stop = stops.stopped() => stop,
        () = ended_in_store(state, team, id) => Stop::Cancelled,
    }
}

/// Why a background run stops before its engine stream ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// `POST /v1/responses/{id}/cancel` (the record already says `cancelled`).
    Cancelled,
    /// The gateway is shutting down and `[background] shutdown_grace_s` has run out.
    Shutdown,
    /// The client of a turn whose result nobody could read later (not stored, in no
    /// conversation) went away.
    ClientGone,
}

/// Code of a turn ended by the gateway's shutdown.
pub const SHUTDOWN_CODE: &str = "server_shutdown";

impl Stop {
    /// The `error.code` the stopped response records.
    pub fn code(self) -> &'static str {
        match self {
            Stop::Cancelled => "response_cancelled",
            Stop::Shutdown => SHUTDOWN_CODE,
            Stop::ClientGone => "client_disconnected",
        }
    }

    /// End `rs` for this stop: cancelled, or failed by the shutdown.
    fn end(self, rs: &mut ResponseStream) -> Vec<SseEvent> {
        match self {
            Stop::Cancelled => rs.cancel(self.code(), self.message()),
            Stop::Shutdown | Stop::ClientGone => rs.fail(self.code(), self.message()),
        }
    }

    /// The `error.message` the stopped response records.
    pub fn message(self) -> &'static str {
        match self {
            Stop::Cancelled => "The response was cancelled.",
            Stop::Shutdown => {
                "The gateway running this response shut down before it finished. Create it again."
            }
            Stop::ClientGone => {
                "The client disconnected before the response finished; it was not stored, so the \
                 engine request was stopped."
            }
        }
    }
}

/// What can stop a turn early: a background run's cancel signal, and for every turn the
/// gateway's shutdown once its grace has run out (`AppState::stopping`).
#[derive(Clone)]
pub struct StopSignals {
    cancel: Option<watch::Receiver<bool>>,
    shutdown: watch::Receiver<bool>,
    /// Closed when the client goes away, for a turn that stops then ([`Stop::ClientGone`]).
    client: Option<mpsc::Sender<()>>,
    /// Raised (for the same turns) when the turn stops sending to a client that left its
    /// events unread: that client counts as gone ([`StopSignals::client_abandoned`]).
    abandoned: Option<watch::Sender<bool>>,
}

impl StopSignals {
    /// A background run's signals: its cancel channel and the gateway's shutdown channel.
    pub fn new(cancel: watch::Receiver<bool>, shutdown: watch::Receiver<bool>) -> Self {
        StopSignals {
            cancel: Some(cancel),
            shutdown,
            client: None,
            abandoned: None,
        }
    }

    /// A foreground turn's: the gateway's shutdown only.
    pub fn shutdown_only(shutdown: watch::Receiver<bool>) -> Self {
        StopSignals {
            cancel: None,
            shutdown,
            client: None,
            abandoned: None,
        }
    }

    /// Also stop when `client`'s receiving end is dropped (held by what serves the client: the
    /// response body of a stream, the handler waiting for a non-streamed answer), if `turn`'s
    /// result could not be read later anyway: not stored and in no conversation. Generating
    /// it for nobody would hold an engine slot and the team's admission for its whole length.
    pub fn until_client_leaves(mut self, turn: &Turn, client: &mpsc::Sender<()>) -> Self {
        if !turn.store && turn.conversation.is_none() && !turn.background {
            self.client = Some(client.clone());
            self.abandoned = Some(watch::Sender::new(false));
        }
        self
    }

    /// The turn no longer sends to its client (it left its events unread for the stall
    /// timeout): for a turn that stops when its client goes, the client counts as gone.
    fn client_abandoned(&self) {
        if let Some(abandoned) = &self.abandoned {
            abandoned.send_replace(true);
        }
    }

    /// Resolves when a signal is raised (a dropped cancel sender counts as a cancel).
    async fn stopped(&mut self) -> Stop {
        let cancel = async {
            match self.cancel.as_mut() {
                Some(cancel) => {
                    let _ = cancel.wait_for(|c| *c).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let client = async {
            match (self.client.as_ref(), self.abandoned.as_ref()) {
                (Some(client), Some(abandoned)) => {
                    let mut abandoned = abandoned.subscribe();
                    tokio::select! {
                        () = client.closed() => {}
                        _ = abandoned.wait_for(|a| *a) => {}
                    }
                }
                (Some(client), None) => client.closed().await,
                _ => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = cancel => Stop::Cancelled,
            Ok(_) = self.shutdown.wait_for(|s| *s) => Stop::Shutdown,
            () = client => Stop::ClientGone,
        }
    }
}

/// A background run stopped before its engine stream opened: cancelled (the record already
/// says so), or cut short by shutdown (recorded as failed, so a client polling it stops
/// waiting).
async fn stop_queued(state: &AppState, turn: &mut Turn, mut announced: Announced, stop: Stop) {
    release_slots(turn);
    match stop {
        // (A background run does not stop when a client leaves.)
        Stop::Shutdown | Stop::ClientGone => {
            let err = HttpError::server(503, stop.message(), stop.code());
            fail_background(state, turn, announced, &err).await;
        }
        // The record says `cancelled` already; the stream and the log end saying so too.
        Stop::Cancelled => {
            let events = stop.end(&mut announced.rs);
            turn_ended(state, turn, announced.rs.response());
            release_conversation(turn).await;
            announced.end(state, events).await;
        }
    }
}

/// Record a background response that could not run as failed with `err`'s code and message,
/// and tell a streaming client.
async fn fail_background(
    state: &AppState,
    turn: &mut Turn,
    mut announced: Announced,
    err: &HttpError,
) {
    release_slots(turn);
    let events = announced.rs.fail(
        err.error.code.as_deref().unwrap_or("server_error"),
        &err.error.message,
    );
    // Nothing was generated: a record that cannot be written leaves nothing to lose.
    persist(
        state,
        turn,
        announced.rs.response(),
        announced.rs.output_items(),
    )
    .await;
    turn_ended(state, turn, announced.rs.response());
    release_conversation(turn).await;
    announced.end(state, events).await;
}

/// Give back a background run's engine slot (its flow-control permit) and run slot: it runs
/// no more, and what is left to do (store writes it may retry for minutes, its client's
/// stream) needs neither.
fn release_slots(turn: &mut Turn) {
    drop(turn.permit.take());
    drop(turn.background_slot.take());
}

/// Release the turn's conversation lock, if it holds one: the turn adds nothing more to it.
pub(crate) async fn release_conversation(turn: &Turn) {
    if let Some(lock) = &turn.conversation_lock {
        lock.release().await;
    }
}

/// A background response's place in this process's registry of runs (`AppState::background`),
/// taken before its record is written so that the `[background]` limits hold under concurrent
/// creates; dropping it (the run ended, its record could not be written, its task unwound)
/// gives the place back.
///
/// It also holds the run's lease in the store ([`RunRegistration::hold_lease`]), which readers
/// on any gateway take for a sign of life (`responses::settle_orphan`).
pub struct RunRegistration {
    state: Arc<AppState>,
    id: String,
    /// The task renewing the run's lease, once taken.
    lease: Option<tokio::task::JoinHandle<()>>,
}

impl RunRegistration {
    /// Register run `id` of `team` with its cancel signal, unless this process already holds
    /// `[background] max_concurrent + max_queued` runs, or `max_per_team` of the team's (the
    /// error says which, for the caller's 429).
    pub fn new(
        state: &Arc<AppState>,
        id: &str,
        team: &str,
        cancel: tokio::sync::watch::Sender<bool>,
    ) -> Result<RunRegistration, String> {
        let limits = &state.config.background;
        let mut runs = state
            .background
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let limit = limits.max_concurrent.saturating_add(limits.max_queued);
        if runs.len() >= limit {
            return Err(format!(
                "This gateway already holds {limit} background responses (running and waiting \
                 to run)"
            ));
        }
        if limits.max_per_team > 0
            && runs.values().filter(|run| run.team == team).count() >= limits.max_per_team
        {
            return Err(format!(
                "This gateway already holds {} background responses of your team (running and \
                 waiting to run)",
                limits.max_per_team
            ));
        }
        let run = crate::app::BackgroundRun {
            team: team.to_string(),
            cancel,
        };
        runs.insert(id.to_string(), run);
        Ok(RunRegistration {
            state: state.clone(),
            id: id.to_string(),
            lease: None,
        })
    }

    /// Take the run's lease in the store (before the response is stored, so no reader finds it
    /// queued without one) and renew it every third of `background.orphaned_after_s` until
    /// the registration is dropped, which gives it up. A lease the store cannot take refuses
    /// the run: a response stored without one would read as a run of a gateway from before
    /// leases, never settled as lost if this gateway died. A renewal that fails is retried by
    /// the next; a reader gives a run that long before it counts as lost.
    pub async fn hold_lease(&mut self) -> Result<(), agentgate_sessions::StoreError> {
        let ttl = self.state.config.background.orphaned_after();
        let (store, id) = (self.state.store.clone(), self.id.clone());
        store.hold_run(&id, ttl).await?;
        self.lease = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(ttl / 3).await;
                if let Err(e) = store.hold_run(&id, ttl).await {
                    tracing::warn!(response = %id, "could not renew the background run's lease: {e}");
                }
            }
        }));
        Ok(())
    }
}

impl Drop for RunRegistration {
    fn drop(&mut self) {
        self.state
            .background
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.id);
        let Some(keeper) = self.lease.take() else {
            return;
        };
        keeper.abort();
        // Given up from a task; outside a runtime, its TTL ends it.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (store, id) = (self.state.store.clone(), self.id.clone());
            runtime.spawn(async move {
                let _ = keeper.await;
                if let Err(e) = store.end_run(&id).await {
                    tracing::warn!(response = %id, "could not give up the background run's lease (it expires by itself): {e}");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_in_any_bytes_read_as_distinct_texts() {
        let mut headers = HeaderMap::new();
        let value = |bytes: &[u8]| axum::http::HeaderValue::from_bytes(bytes).unwrap();
        headers.insert("x-session-id", value("sesión".as_bytes()));
        headers.insert("x-a", value(b"caf\xe9"));
        headers.insert("x-b", value(b"caf\xe8"));
        let texts = header_texts(&headers);
        let of = |name: &str| {
            texts
                .iter()
                .find(|(k, _)| *k == name)
                .unwrap()
                .1
                .to_string()
        };
        assert_eq!(of("x-session-id"), "sesión");
        assert_eq!(
            (of("x-a"), of("x-b")),
            ("0x636166e9".into(), "0x636166e8".into())
        );
    }
    use serde_json::json;

    fn item(kind: &str, n: usize) -> Value {
        json!({"type": kind, "id": format!("{kind}_{n}")})
    }

    /// A team's sub-agent lineage is read in the same key space as its session key: the
    /// parent named by a header and the request's own session, each the team's once.
    #[test]
    fn a_teams_lineage_keys_are_its_session_keys() {
        let cfg = agentgate_scheduler::LineageConfig::default();
        let session = team_session_key("acme", "h:child".into());
        let pairs = [("x-agentgate-parent-session", "root")];
        let l = team_lineage(&cfg, "acme", &pairs, Some(&session)).unwrap();
        assert_eq!(l.parent, team_session_key("acme", "h:root".into()));
        assert_eq!(l.own.as_deref(), Some(session.as_str()));
        // A request naming its own session as its parent has no own key apart from it.
        let root = team_session_key("acme", "h:root".into());
        let l = team_lineage(&cfg, "acme", &pairs, Some(&root)).unwrap();
        assert_eq!((l.parent.as_str(), l.own), (root.as_str(), None));
        // An open gateway's keys are the scheduler's.
        let l = team_lineage(&cfg, crate::auth::OPEN_TEAM, &pairs, Some("h:child")).unwrap();
        assert_eq!(
            (l.parent.as_str(), l.own.as_deref()),
            ("h:root", Some("h:child"))
        );
    }

    /// A store that never answers a pin read or write (stalled, black-holed) costs a turn at
    /// most PIN_TIMEOUT, not the store client's own timeouts and reconnects.
    #[tokio::test(start_paused = true)]
    async fn a_pin_operation_the_store_does_not_answer_gives_up() {
        let started = tokio::time::Instant::now();
        let never = std::future::pending::<Result<(), String>>();
        let err = pin_op(never).await.unwrap_err();
        assert_eq!(started.elapsed(), PIN_TIMEOUT);
        assert_eq!(err, "no answer from the store within 500 ms");
        assert_eq!(
            pin_op(async { Err::<(), _>("refused") }).await.unwrap_err(),
            "refused"
        );
    }

    #[test]
    fn background_writes_are_retried_for_about_ten_minutes_foreground_for_one_second() {
        let total = |background| {
            (1..)
                .map_while(|failures| retry_pause(background, failures))
                .sum::<Duration>()
        };
        assert_eq!(total(false), Duration::from_millis(1_000));
        assert_eq!(
            (1..).map_while(|f| retry_pause(false, f)).count() + 1,
            3,
            "three tries"
        );
        let background = total(true).as_secs();
        assert!((540..=660).contains(&background), "{background} s");
    }

    #[test]
    fn truncation_keeps_the_opening_and_the_end() {
        let mut h: Vec<Value> = (0..9).map(|n| item("message", n)).collect();
        let mut input = vec![item("message", 9)];
        assert!(truncate_middle(&mut h, &mut input));
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
        assert_eq!(input.len(), 1);
        // Two items: nothing between them, the opening goes; then nothing is left to drop.
        let (mut h, mut input) = (vec![item("message", 0)], vec![item("message", 1)]);
        assert!(truncate_middle(&mut h, &mut input));
        assert!(h.is_empty() && input.len() == 1);
        assert!(!truncate_middle(&mut h, &mut input));
    }

    #[test]
    fn truncation_cuts_a_history_sent_as_input_and_keeps_calls_with_their_outputs() {
        let call = |n: usize| json!({"type": "function_call", "id": format!("fc{n}"), "call_id": format!("c{n}")});
        let output = |n: usize| json!({"type": "function_call_output", "call_id": format!("c{n}")});
        let user = json!({"type": "message", "role": "user", "id": "task"});
        // Codex without stored responses: the whole conversation is this turn's input. Calls
        // made in parallel come before their outputs.
        let mut input = vec![
            user.clone(),
            json!({"type": "reasoning", "id": "rs1"}),
            call(1),
            call(2),
            output(1),
            output(2),
            call(3),
            output(3),
            call(4),
            output(4),
        ];
        let mut history = Vec::new();
        assert!(truncate_middle(&mut history, &mut input));
        let kept: Vec<String> = input
            .iter()
            .map(|i| {
                i.get("id")
                    .or(i.get("call_id"))
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        // The oldest quarter of the middle (the reasoning and call 1) went, and call 1's output
        // with it; call 2 and its output stay together.
        assert_eq!(kept, ["task", "fc2", "c2", "fc3", "c3", "fc4", "c4"]);
        // The last item's call is never dropped with it: the next droppable item goes (with
        // its pair), and when none is left, the opening.
        let mut input = vec![user.clone(), call(5), call(6), output(6), output(5)];
        assert!(truncate_middle(&mut history, &mut input));
        assert_eq!(input, [user.clone(), call(5), output(5)]);
        let mut input = vec![user, call(5), output(5)];
        assert!(truncate_middle(&mut history, &mut input));
        assert_eq!(input, [call(5), output(5)]);
        assert!(!truncate_middle(&mut history, &mut input));
    }

    #[test]
    fn a_compaction_that_overflows_drops_its_oldest_tool_work_in_pairs() {
        let user = |n: usize| json!({"type": "message", "role": "user", "id": format!("u{n}")});
        let call = |n: usize| json!({"type": "function_call", "id": format!("fc{n}"), "call_id": format!("c{n}")});
        let output = |n: usize| json!({"type": "function_call_output", "id": format!("fo{n}"), "call_id": format!("c{n}")});
        let mut history = vec![user(0), call(1), output(1)];
        let mut input = vec![
            call(2),
            output(2),
            json!({"type": "message", "role": "assistant", "id": "a3"}),
            user(4),
            json!({"type": "compaction_trigger", "id": "t"}),
        ];
        let ids = |items: &[Value]| -> Vec<String> {
            items
                .iter()
                .map(|i| i["id"].as_str().unwrap().to_string())
                .collect()
        };
        // Five candidates: the oldest one (a call) goes, with its output.
        assert!(shrink_for_compaction(&mut history, &mut input));
        assert_eq!(ids(&history), ["u0"]);
        assert_eq!(ids(&input), ["fc2", "fo2", "a3", "u4", "t"]);
        assert!(shrink_for_compaction(&mut history, &mut input));
        assert!(shrink_for_compaction(&mut history, &mut input));
        assert_eq!(ids(&input), ["u4", "t"]);
        assert!(
            !shrink_for_compaction(&mut history, &mut input),
            "only messages left"
        );
    }
}
