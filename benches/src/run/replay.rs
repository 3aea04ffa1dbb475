//! Replays a [`Workload`] against a gateway through the Responses API: one task per session,
//! streaming requests, think times in simulated seconds, tool-call loops and sub-agent fan-out;
//! records one [`RequestRecord`] per request sent.
//!
//! Chained sessions send only the new items with `previous_response_id` (`store: true`); stateless
//! ones resend the whole history (inputs plus the output items received) with `store: false` and
//! `prompt_cache_key`. A sub-agent starts when its parent's turn completes, from the parent's
//! history up to that turn (by `previous_response_id` when both are chained and the parent's turn
//! was stored, inline otherwise); the parent waits for its sub-agents before its next turn.
//! No turn starts after `duration_s`; requests still running `drain_s` after it are cut and
//! counted as errors. Errors and refusals are counted, never fatal: a 429/503 whose error `code`
//! is `overloaded_shed`, `queue_full` or `queue_timeout` is [`Outcome::Shed`], one with a
//! `rate_limit_exceeded_*` or `request_too_large` code is [`Outcome::RateLimited`], anything else
//! is an [`Outcome::Error`].
//!
//! Flow control: an admitted response says the band it ran in (`x-agentgate-band`) and how long
//! it waited in the gateway's queue (`x-agentgate-queue-wait-ms`, wall milliseconds, converted
//! to simulated milliseconds like every other latency); both are kept in the record.
//!
//! With several gateways (`urls`), turn `t` (0-based) of session `s` (its index in
//! [`Workload::sessions`], sub-agents included) goes to gateway `(s + t) % urls.len()`: a session
//! alternates between gateways from one turn to the next, and neighbouring sessions start on
//! different ones, so a turn's stored predecessor and its session pin were almost always written
//! by another gateway and reach it only through the shared store. Each record keeps the gateway
//! it went to and the endpoint that served it (the gateway's `x-agentgate-endpoint` header).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

use serde_json::{json, Value};

use crate::workload::{SessionMode, SessionPlan, TurnInput, Workload};

use super::clock::SimClock;
use super::reuse::ReuseJob;
use super::sse::SseParser;

/// Where and how to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// `http://HOST:PORT/v1/responses` of each gateway (at least one); see [`gateway_for`].
    pub urls: Vec<String>,
    /// Model name to request.
    pub model: String,
    /// Simulated seconds after which no new turn starts.
    pub duration_s: f64,
    /// Simulated seconds after `duration_s` that in-flight requests may still run.
    pub drain_s: f64,
    /// `max_output_tokens` of every request (a cap; the engine picks the length).
    pub max_output_tokens: u64,
    /// Bearer key per team; a team without a key sends no `Authorization` header.
    pub keys: HashMap<String, String>,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// A terminal `response.completed` (or `response.incomplete`) event arrived.
    Success,
    /// Refused by flow control for load: 429 `overloaded_shed` or `queue_full`, 503
    /// `queue_timeout` (the code is kept).
    Shed(String),
    /// Refused by the team's rate limits: 429 `rate_limit_exceeded_requests`,
    /// `rate_limit_exceeded_tokens` or `request_too_large` (the code is kept).
    RateLimited(String),
    /// Anything else: transport error, other status, `response.failed`, cut stream.
    Error(String),
}

/// Error codes of flow-control load refusals ([`Outcome::Shed`]).
pub const SHED_CODES: &[&str] = &["overloaded_shed", "queue_full", "queue_timeout"];

impl Outcome {
    /// Whether the gateway refused the request (shed or rate-limited) rather than failing it.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Outcome::Shed(_) | Outcome::RateLimited(_))
    }

    /// The outcome of an HTTP 429/503 answer whose body is `body`: [`Outcome::Shed`] or
    /// [`Outcome::RateLimited`] by its OpenAI-shaped error `code`, else an error.
    pub fn of_refusal(status: u16, body: &str) -> Outcome {
        let code = serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
            .unwrap_or_default();
        if SHED_CODES.contains(&code.as_str()) {
            Outcome::Shed(code)
        } else if code.starts_with("rate_limit_exceeded") || code == "request_too_large" {
            Outcome::RateLimited(code)
        } else {
            let snippet: String = body.chars().take(300).collect();
            Outcome::Error(format!("HTTP {status}: {snippet}"))
        }
    }
}

/// One request as the client saw it.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// Send order across the whole replay.
    pub seq: u64,
    /// Index of the session in the workload.
    pub session: usize,
    /// Index of the turn in its session.
    pub turn: usize,
    /// Whether the request continues a conversation, as the gateway judges it from what was
    /// sent: a `previous_response_id`, or earlier turns in its input (a turn after the first
    /// of its session, or any turn of a sub-agent, which starts from its parent's history; not
    /// a turn whose earlier turns all failed).
    pub continuing: bool,
    /// Index of the gateway it was sent to.
    pub gateway: usize,
    /// The endpoint the gateway streamed it from (`x-agentgate-endpoint`, e.g. `bench/0`); None
    /// when the gateway answered without one (an error before any engine was reached).
    pub endpoint: Option<String>,
    /// Why the gateway chose that endpoint (`x-agentgate-route-reason`: pin, prefix, load, ...).
    pub route_reason: Option<String>,
    /// Why the session's pin moved to that endpoint (`x-agentgate-pin-moved`), when it did.
    pub pin_moved: Option<String>,
    /// The session's team.
    pub team: String,
    /// The band the gateway ran it in (`x-agentgate-band`); None without flow control or when
    /// it was not admitted.
    pub band: Option<String>,
    /// Simulated ms it waited in the gateway's flow-control queue (`x-agentgate-queue-wait-ms`);
    /// None when the gateway did not say (flow control off, or not admitted).
    pub queue_wait_ms: Option<f64>,
    /// Simulated time the request was sent, seconds since the start.
    pub sent_s: f64,
    /// How it ended.
    pub outcome: Outcome,
    /// Simulated ms from send to the first output delta.
    pub ttft_ms: Option<f64>,
    /// Simulated ms from send to the terminal event (or the failure).
    pub e2e_ms: f64,
    /// `usage.input_tokens` of the terminal event.
    pub input_tokens: u64,
    /// `usage.input_tokens_details.cached_tokens` of the terminal event.
    pub cached_tokens: u64,
    /// `usage.output_tokens` of the terminal event.
    pub output_tokens: u64,
}

/// Live counters for the progress line.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests finished (any outcome).
    pub done: AtomicU64,
    /// Requests that ended in an error.
    pub errors: AtomicU64,
    /// Requests refused by flow control (shed or rate-limited).
    pub shed: AtomicU64,
    /// Requests sent and not finished.
    pub in_flight: AtomicU64,
}

/// Everything recorded by one replay.
#[derive(Debug)]
pub struct ReplayOutcome {
    /// One record per request sent, in completion order (sort by `seq` for send order).
    pub records: Vec<RequestRecord>,
}

struct Shared {
    client: reqwest::Client,
    workload: Arc<Workload>,
    config: ReplayConfig,
    clock: SimClock,
    /// Wall instant after which in-flight requests are cut (None at time scale 0).
    hard_stop: Option<Instant>,
    seq: AtomicU64,
    counters: Arc<Counters>,
    reuse: std::sync::mpsc::Sender<ReuseJob>,
    records: Mutex<Vec<RequestRecord>>,
}

/// The conversation as one session sees it.
#[derive(Debug, Clone, Default)]
struct Conversation {
    /// Every item so far: inputs sent and output items received.
    history: Vec<Value>,
    /// Output items of the latest successful response.
    last_output: Vec<Value>,
    /// Id of the latest successful stored response (chained sessions).
    last_response_id: Option<String>,
}

/// Replay `workload` and return every request's record; every request is also reported to
/// `reuse` (its prompt when it succeeded).
pub async fn replay(
    client: reqwest::Client,
    workload: Arc<Workload>,
    config: ReplayConfig,
    clock: SimClock,
    counters: Arc<Counters>,
    reuse: std::sync::mpsc::Sender<ReuseJob>,
) -> ReplayOutcome {
    let hard_stop = (clock.time_scale() > 0.0)
        .then(|| clock.instant_at(config.duration_s + config.drain_s.max(0.0)));
    let shared = Arc::new(Shared {
        client,
        workload: Arc::clone(&workload),
        config,
        clock,
        hard_stop,
        seq: AtomicU64::new(0),
        counters,
        reuse,
        records: Mutex::new(Vec::new()),
    });
    let mut tasks = Vec::new();
    for (index, plan) in workload.sessions.iter().enumerate() {
        if plan.parent.is_some() || plan.start_s > shared.config.duration_s {
            continue;
        }
        let shared = Arc::clone(&shared);
        let start_s = plan.start_s;
        tasks.push(tokio::spawn(async move {
            shared.clock.sleep_until(start_s).await;
            run_session(shared, index, Conversation::default()).await;
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    let records = shared
        .records
        .lock()
        .map(|mut records| std::mem::take(&mut *records))
        .unwrap_or_default();
    ReplayOutcome { records }
}

type SessionFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Play every turn of session `index`, starting from `conversation` (empty, or a parent's fork).
fn run_session(shared: Arc<Shared>, index: usize, conversation: Conversation) -> SessionFuture {
    Box::pin(async move {
        let Some(plan) = shared.workload.sessions.get(index) else {
            return;
        };
        let mut conversation = conversation;
        for (turn_index, turn) in plan.turns.iter().enumerate() {
            shared.clock.sleep(turn.think_s).await;
            if shared.clock.now_s() > shared.config.duration_s {
                return;
            }
            let new_items = turn_items(&turn.input, &conversation.last_output);
            send_turn(
                &shared,
                (index, turn_index),
                plan,
                &mut conversation,
                new_items,
            )
            .await;
            if turn.spawn.is_empty() || shared.clock.now_s() > shared.config.duration_s {
                continue;
            }
            let children: Vec<_> = turn
                .spawn
                .iter()
                .map(|&child| {
                    let fork = fork_for(&shared, child, plan, &conversation);
                    tokio::spawn(run_session(Arc::clone(&shared), child, fork))
                })
                .collect();
            for child in children {
                let _ = child.await;
            }
        }
    })
}

/// The conversation a sub-agent starts from: the parent's history; the parent's stored response
/// is continued only when both sessions chain (a stateless session never uses stored state).
fn fork_for(
    shared: &Shared,
    child: usize,
    parent: &SessionPlan,
    conversation: &Conversation,
) -> Conversation {
    let child_chains = shared
        .workload
        .sessions
        .get(child)
        .is_some_and(|plan| matches!(plan.mode, SessionMode::Chained));
    let parent_chains = matches!(parent.mode, SessionMode::Chained);
    Conversation {
        history: conversation.history.clone(),
        last_output: conversation.last_output.clone(),
        last_response_id: if child_chains && parent_chains {
            conversation.last_response_id.clone()
        } else {
            None
        },
    }
}

/// The input items of a turn: a user message, or outputs answering the previous response's
/// function calls (a user message when there were none).
fn turn_items(input: &TurnInput, last_output: &[Value]) -> Vec<Value> {
    let user = |text: &str| json!({"type": "message", "role": "user", "content": text});
    match input {
        TurnInput::User(text) => vec![user(text)],
        TurnInput::ToolOutput(text) => {
            let calls: Vec<&str> = last_output
                .iter()
                .filter(|item| item.get("type").and_then(Value::as_str) == Some("function_call"))
                .filter_map(|item| item.get("call_id").and_then(Value::as_str))
                .collect();
            if calls.is_empty() {
                return vec![user(text)];
            }
            calls
                .iter()
                .enumerate()
                .map(|(n, call_id)| {
                    let output = if n == 0 { text.as_str() } else { "done" };
                    json!({"type": "function_call_output", "call_id": call_id, "output": output})
                })
                .collect()
        }
    }
}

/// The gateway that turn `turn` of session `session` is sent to, out of `gateways`:
/// `(session + turn) % gateways` (0 when there are none).
pub fn gateway_for(session: usize, turn: usize, gateways: usize) -> usize {
    if gateways == 0 {
        0
    } else {
        (session % gateways + turn % gateways) % gateways
    }
}

/// Send turn `at.1` of session `at.0`, record it, and advance the conversation when it succeeded.
async fn send_turn(
    shared: &Shared,
    at: (usize, usize),
    plan: &SessionPlan,
    conversation: &mut Conversation,
    new_items: Vec<Value>,
) {
    let chained = matches!(plan.mode, SessionMode::Chained);
    let continue_from = if chained {
        conversation.last_response_id.clone()
    } else {
        None
    };
    let (sent_input, oracle_history): (Vec<Value>, &[Value]) = match &continue_from {
        Some(_) => (new_items.clone(), &conversation.history),
        None => {
            let mut all = conversation.history.clone();
            all.extend(new_items.iter().cloned());
            (all, &[])
        }
    };
    // As the gateway judges it, from what is sent: a turn whose earlier turns all failed goes
    // out as a new session's first.
    let continuing = continue_from.is_some() || agentgate::flow::input_continues(&sent_input);
    let mut body = json!({
        "model": shared.config.model,
        "input": sent_input,
        "stream": true,
        "store": chained,
        "max_output_tokens": shared.config.max_output_tokens,
    });
    if let Some(instructions) = &plan.instructions {
        body["instructions"] = json!(instructions);
    }
    if !plan.tools.is_empty() {
        body["tools"] = json!(plan.tools);
        body["tool_choice"] = json!("auto");
    }
    if let Some(id) = &continue_from {
        body["previous_response_id"] = json!(id);
    }
    if let SessionMode::Stateless {
        prompt_cache_key: Some(key),
    } = &plan.mode
    {
        body["prompt_cache_key"] = json!(key);
    }

    let seq = shared.seq.fetch_add(1, Ordering::Relaxed);
    let sent_s = shared.clock.now_s();
    let sent = Instant::now();
    shared.counters.in_flight.fetch_add(1, Ordering::Relaxed);
    let key = shared.config.keys.get(&plan.team).map(String::as_str);
    let (index, turn_index) = at;
    let gateway = gateway_for(index, turn_index, shared.config.urls.len());
    let url = shared
        .config
        .urls
        .get(gateway)
        .map(String::as_str)
        .unwrap_or_default();
    let mut admission = Admission::default();
    let exchange = stream_response(shared, url, &body, key, sent, &mut admission);
    let result = match shared.hard_stop {
        Some(stop) => match tokio::time::timeout_at(stop, exchange).await {
            Ok(result) => result,
            Err(_) => Exchange::failed(
                Outcome::Error("still running at the drain limit; cut".into()),
                None,
            ),
        },
        None => exchange.await,
    };
    shared.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
    let e2e_ms = shared.clock.to_sim_s(sent.elapsed()) * 1000.0;

    let mut record = RequestRecord {
        seq,
        session: index,
        turn: turn_index,
        continuing,
        gateway,
        endpoint: admission.endpoint,
        route_reason: admission.route_reason,
        pin_moved: admission.pin_moved,
        team: plan.team.clone(),
        band: admission.band,
        queue_wait_ms: admission
            .queue_wait
            .map(|wait| shared.clock.to_sim_s(wait) * 1000.0),
        sent_s,
        outcome: result.outcome.clone(),
        ttft_ms: result
            .first_token
            .map(|d| shared.clock.to_sim_s(d) * 1000.0),
        e2e_ms,
        input_tokens: 0,
        cached_tokens: 0,
        output_tokens: 0,
    };
    match &result.outcome {
        Outcome::Success => {
            let response = result.response.unwrap_or(Value::Null);
            let usage = &response["usage"];
            record.input_tokens = usage["input_tokens"].as_u64().unwrap_or(0);
            record.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            record.output_tokens = usage["output_tokens"].as_u64().unwrap_or(0);
            let output: Vec<Value> = response["output"].as_array().cloned().unwrap_or_default();
            let (history, items) = match &continue_from {
                Some(_) => (oracle_history.to_vec(), new_items.clone()),
                None => match body["input"].take() {
                    Value::Array(items) => (Vec::new(), items),
                    _ => (Vec::new(), Vec::new()),
                },
            };
            let _ = shared.reuse.send(ReuseJob::Served {
                seq,
                body: strip_input(body),
                history,
                items,
                output: output.clone(),
            });
            conversation.history.extend(new_items);
            conversation.history.extend(output.iter().cloned());
            conversation.last_output = output;
            if chained {
                conversation.last_response_id = response["id"].as_str().map(str::to_string);
            }
        }
        Outcome::Shed(_) | Outcome::RateLimited(_) => {
            shared.counters.shed.fetch_add(1, Ordering::Relaxed);
            let _ = shared.reuse.send(ReuseJob::Failed { seq });
        }
        Outcome::Error(_) => {
            shared.counters.errors.fetch_add(1, Ordering::Relaxed);
            let _ = shared.reuse.send(ReuseJob::Failed { seq });
        }
    }
    shared.counters.done.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut records) = shared.records.lock() {
        records.push(record);
    }
}

/// The body without its `input` (the oracle takes the items separately), so the copy is small.
fn strip_input(mut body: Value) -> Value {
    if let Some(object) = body.as_object_mut() {
        object.remove("input");
    }
    body
}

/// What came back for one request.
struct Exchange {
    outcome: Outcome,
    first_token: Option<std::time::Duration>,
    response: Option<Value>,
}

impl Exchange {
    fn failed(outcome: Outcome, first_token: Option<std::time::Duration>) -> Self {
        Exchange {
            outcome,
            first_token,
            response: None,
        }
    }
}

// The gateway's response headers: the endpoint that served a request and why it was chosen,
// and the flow-control band it ran in with its queue wait (wall milliseconds).
pub use agentgate::flow::{BAND_HEADER, QUEUE_WAIT_HEADER};
pub use agentgate::responses::{ENDPOINT_HEADER, PIN_MOVED_HEADER, ROUTE_REASON_HEADER};

/// What the response headers said about routing and admission.
#[derive(Debug, Default)]
struct Admission {
    endpoint: Option<String>,
    route_reason: Option<String>,
    pin_moved: Option<String>,
    band: Option<String>,
    queue_wait: Option<std::time::Duration>,
}

impl Admission {
    fn read(headers: &reqwest::header::HeaderMap) -> Admission {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_string)
        };
        Admission {
            endpoint: text(ENDPOINT_HEADER),
            route_reason: text(ROUTE_REASON_HEADER),
            pin_moved: text(PIN_MOVED_HEADER),
            band: text(BAND_HEADER),
            queue_wait: text(QUEUE_WAIT_HEADER)
                .and_then(|ms| ms.trim().parse::<u64>().ok())
                .map(std::time::Duration::from_millis),
        }
    }
}

/// Event types that carry generated tokens (the first one marks time to first token).
const DELTA_EVENTS: &[&str] = &[
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_text.delta",
];

/// Whether a stream event carries the model's first output: a text, reasoning or argument
/// delta, or a function call appearing. A tool call's name reaches the client with the first
/// token the engine generates for it (the call item is added then), while its first argument
/// delta waits for the markup tokens before the arguments (`<tool_call>{"name": ...,
/// "arguments": `), which would count several decode steps as time to first token.
fn is_first_output(kind: &str, data: &Value) -> bool {
    DELTA_EVENTS.contains(&kind)
        || (kind == "response.output_item.added"
            && data.pointer("/item/type").and_then(Value::as_str) == Some("function_call"))
}

/// POST the body to `url` and read the event stream to its terminal event; `admission` is set
/// from the response headers as soon as they arrive (so it is known even if the stream is cut).
async fn stream_response(
    shared: &Shared,
    url: &str,
    body: &Value,
    key: Option<&str>,
    sent: Instant,
    admission: &mut Admission,
) -> Exchange {
    let mut request = shared.client.post(url).json(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let mut response = match request.send().await {
        Ok(response) => response,
        Err(e) => return Exchange::failed(Outcome::Error(format!("transport: {e}")), None),
    };
    *admission = Admission::read(response.headers());
    let status = response.status().as_u16();
    if status == 429 || status == 503 {
        let text = response.text().await.unwrap_or_default();
        return Exchange::failed(Outcome::of_refusal(status, &text), None);
    }
    if !response.status().is_success() {
        let text = response.text().await.unwrap_or_default();
        let snippet: String = text.chars().take(300).collect();
        return Exchange::failed(Outcome::Error(format!("HTTP {status}: {snippet}")), None);
    }
    let mut parser = SseParser::default();
    let mut first_token = None;
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => {
                return Exchange::failed(
                    Outcome::Error("stream ended before a terminal event".into()),
                    first_token,
                )
            }
            Err(e) => {
                return Exchange::failed(Outcome::Error(format!("stream read: {e}")), first_token)
            }
        };
        for event in parser.push(&chunk) {
            let kind = event.kind.as_str();
            if first_token.is_none() && is_first_output(kind, &event.data) {
                first_token = Some(sent.elapsed());
            }
            match kind {
                "response.completed" | "response.incomplete" => {
                    return Exchange {
                        outcome: Outcome::Success,
                        first_token,
                        response: Some(event.data["response"].clone()),
                    };
                }
                "response.failed" => {
                    let message = event.data["response"]["error"]["message"]
                        .as_str()
                        .unwrap_or("response.failed")
                        .to_string();
                    return Exchange::failed(
                        Outcome::Error(format!("response.failed: {message}")),
                        first_token,
                    );
                }
                "error" => {
                    let message = event.data["message"]
                        .as_str()
                        .or_else(|| event.data["error"]["message"].as_str())
                        .unwrap_or("error event")
                        .to_string();
                    return Exchange::failed(
                        Outcome::Error(format!("error event: {message}")),
                        first_token,
                    );
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_output_is_a_delta_or_a_function_call_appearing() {
        let call = json!({"item": {"type": "function_call", "name": "shell"}});
        let message = json!({"item": {"type": "message"}});
        assert!(is_first_output("response.output_item.added", &call));
        assert!(!is_first_output("response.output_item.added", &message));
        assert!(is_first_output("response.output_text.delta", &Value::Null));
        assert!(is_first_output(
            "response.reasoning_text.delta",
            &Value::Null
        ));
        assert!(!is_first_output("response.created", &Value::Null));
    }

    #[test]
    fn turns_alternate_between_gateways_and_neighbouring_sessions_start_apart() {
        assert_eq!(gateway_for(5, 3, 1), 0);
        assert_eq!(gateway_for(0, 0, 0), 0, "no gateways: no panic");
        let session0: Vec<usize> = (0..4).map(|t| gateway_for(0, t, 2)).collect();
        let session1: Vec<usize> = (0..4).map(|t| gateway_for(1, t, 2)).collect();
        assert_eq!(session0, [0, 1, 0, 1]);
        assert_eq!(session1, [1, 0, 1, 0]);
        assert_eq!(gateway_for(7, 2, 3), 0);
        // (s + t) % n without overflow: 2^64 - 1 is divisible by 3.
        assert_eq!(gateway_for(usize::MAX, usize::MAX, 3), 0);
        assert_eq!(gateway_for(usize::MAX, 1, 3), 1);
    }

    #[test]
    fn refusals_are_told_apart_by_their_error_code() {
        let body = |code: &str| {
            json!({"error": {"message": "m", "type": "rate_limit_error", "code": code}}).to_string()
        };
        for code in ["overloaded_shed", "queue_full", "queue_timeout"] {
            assert_eq!(
                Outcome::of_refusal(429, &body(code)),
                Outcome::Shed(code.into())
            );
        }
        for code in [
            "rate_limit_exceeded_requests",
            "rate_limit_exceeded_tokens",
            "request_too_large",
        ] {
            let outcome = Outcome::of_refusal(429, &body(code));
            assert_eq!(outcome, Outcome::RateLimited(code.into()));
            assert!(outcome.is_refusal());
        }
        // A 503 without a flow-control code (no endpoint, an engine's own answer) is a failure.
        let Outcome::Error(message) = Outcome::of_refusal(503, "no healthy endpoint") else {
            panic!("expected an error");
        };
        assert!(
            message.starts_with("HTTP 503: no healthy endpoint"),
            "{message}"
        );
        assert!(!Outcome::of_refusal(503, &body("server_error")).is_refusal());
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(BAND_HEADER, "batch".parse().unwrap());
        headers.insert(QUEUE_WAIT_HEADER, "1250".parse().unwrap());
        headers.insert(ENDPOINT_HEADER, "bench/1".parse().unwrap());
        let admission = Admission::read(&headers);
        assert_eq!(admission.band.as_deref(), Some("batch"));
        assert_eq!(
            admission.queue_wait,
            Some(std::time::Duration::from_millis(1250))
        );
        assert_eq!(admission.endpoint.as_deref(), Some("bench/1"));
        headers.insert(QUEUE_WAIT_HEADER, "soon".parse().unwrap());
        assert_eq!(Admission::read(&headers).queue_wait, None);
    }

    #[test]
    fn tool_outputs_answer_every_call_of_the_previous_response() {
        let last = vec![
            json!({"type": "message", "role": "assistant", "content": []}),
            json!({"type": "function_call", "call_id": "call_a", "name": "read", "arguments": "{}"}),
            json!({"type": "function_call", "call_id": "call_b", "name": "grep", "arguments": "{}"}),
        ];
        let items = turn_items(&TurnInput::ToolOutput("file text".into()), &last);
        assert_eq!(items.len(), 2);
        assert_eq!(items[0]["call_id"], "call_a");
        assert_eq!(items[0]["output"], "file text");
        assert_eq!(items[1]["call_id"], "call_b");
        let fallback = turn_items(&TurnInput::ToolOutput("file text".into()), &last[..1]);
        assert_eq!(fallback[0]["role"], "user");
        assert_eq!(fallback[0]["content"], "file text");
        let user = turn_items(&TurnInput::User("hello there".into()), &last);
        assert_eq!(
            user,
            vec![json!({"type": "message", "role": "user", "content": "hello there"})]
        );
    }
}
