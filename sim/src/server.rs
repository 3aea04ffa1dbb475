//! The HTTP surface: OpenAI-compatible endpoints in vLLM's / SGLang's shapes, plus the sim's
//! admin and P/D endpoints.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::cache::chain_hashes;
use crate::config::{Flavor, Role, SchedulingPolicyArg, SimConfig};
use crate::engine::{Command, Core, Handoff, PinKey, SeqEvent, SeqRequest};
use crate::faults::{FaultSpec, FaultState};
use crate::generate::{self, Channel, OutputPlan, PlanRequest};
use crate::metrics::{self, Gauges};
use crate::pd::{self, RoomStatus, Rooms};
use crate::template::{content_text, render_chat};
use crate::tokenizer::tokenize;

/// Shared state of one replica's HTTP side.
#[derive(Debug)]
pub struct AppState {
    /// Configuration.
    pub config: SimConfig,
    /// Commands to the engine loop.
    pub commands: mpsc::UnboundedSender<Command>,
    /// Engine state (metrics, cache inspection).
    pub core: Arc<Mutex<Core>>,
    /// Global faults.
    pub faults: Arc<FaultState>,
    /// SGLang bootstrap rooms.
    pub rooms: Rooms,
    /// Client for P/D transfers.
    pub http: reqwest::Client,
    /// Address other replicas reach this one on.
    pub advertised: SocketAddr,
    /// Engine id in kv_transfer_params.
    pub engine_id: String,
    /// Unix time the replica started.
    pub created: u64,
    next_id: AtomicU64,
}

impl AppState {
    /// Build the state for a replica reachable at `advertised`.
    pub fn new(
        config: SimConfig,
        commands: mpsc::UnboundedSender<Command>,
        core: Arc<Mutex<Core>>,
        faults: Arc<FaultState>,
        advertised: SocketAddr,
    ) -> Self {
        let engine_id = config
            .engine_id
            .clone()
            .unwrap_or_else(|| format!("sim-{}", advertised.port()));
        let created = unix_now();
        AppState {
            config,
            commands,
            core,
            faults,
            rooms: Rooms::default(),
            http: reqwest::Client::new(),
            advertised,
            engine_id,
            created,
            next_id: AtomicU64::new(fastrand::u64(..) & 0xffff_ffff_0000_0000),
        }
    }

    fn request_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:016x}",
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

type Shared = Arc<AppState>;

/// The router for one replica.
pub fn router(state: Shared) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .route("/metrics", get(metrics_text))
        .route("/tokenize", post(tokenize_endpoint))
        .route(
            "/version",
            get(|| async { axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .route("/reset_prefix_cache", post(reset_cache))
        .route("/flush_cache", post(reset_cache))
        .route(
            "/sim/faults",
            get(get_faults).post(set_faults).delete(clear_faults),
        )
        .route("/sim/kv/pull", post(kv_pull))
        .route("/sim/bootstrap/{room}", get(bootstrap_room))
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .with_state(state)
}

/// `--api-key`: the engines' authentication middleware, which guards the `/v1` routes only.
async fn require_api_key(
    State(state): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if request.uri().path().starts_with("/v1") && given != Some(&format!("Bearer {key}")) {
            return (
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({"error": "Unauthorized"})),
            )
                .into_response();
        }
    }
    next.run(request).await
}

// ----- errors ---------------------------------------------------------------------------------

fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        413 => "RequestEntityTooLargeError",
        429 => "TooManyRequestsError",
        500 => "InternalServerError",
        503 => "ServiceUnavailableError",
        _ => "Error",
    }
}

/// An error in the engine's shape: vLLM `{"error":{message,type,param,code}}`, SGLang
/// `{"object":"error",message,type,param,code}`; `code` is the integer status.
pub fn error_response(
    flavor: Flavor,
    status: StatusCode,
    message: &str,
    param: Option<&str>,
) -> Response {
    let error = json!({
        "message": message,
        "type": error_type(status),
        "param": param,
        "code": status.as_u16(),
    });
    let body = match flavor {
        Flavor::Vllm => json!({ "error": error }),
        Flavor::Sglang => {
            let mut flat = json!({"object": "error"});
            if let (Some(flat), Some(error)) = (flat.as_object_mut(), error.as_object()) {
                flat.extend(error.clone());
            }
            flat
        }
    };
    (status, axum::Json(body)).into_response()
}

struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
    /// Reported in the stream: SGLang releases that check the prompt's length once a streaming
    /// request's stream has started answer 200, then the error as an SSE event
    /// (`{"error": {"object": "error", ...}}`) and `[DONE]` (newer ones answer 400 first).
    in_stream: bool,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
            in_stream: false,
        }
    }
    fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
            in_stream: false,
        }
    }
    fn into_response(self, flavor: Flavor) -> Response {
        if self.in_stream {
            let event = json!({"error": {
                "object": "error",
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.status.as_u16(),
            }});
            let body = format!("data: {event}\n\ndata: [DONE]\n\n");
            return (
                [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                body,
            )
                .into_response();
        }
        error_response(flavor, self.status, &self.message, self.param)
    }
}

fn parse_body(
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let bytes = body.map_err(|rejection| ApiError {
        status: rejection.status(),
        message: format!(
            "request body rejected: {}; send at most --max-body-bytes bytes",
            rejection.body_text()
        ),
        param: None,
        in_stream: false,
    })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request("request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!(
            "request body is not valid JSON: {e}"
        ))),
    }
}

// ----- generation -------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
}

async fn chat_completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let flavor = state.config.flavor;
    match serve(state, Api::Chat, headers, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(flavor),
    }
}

async fn completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let flavor = state.config.flavor;
    match serve(state, Api::Completion, headers, body).await {
        Ok(response) => response,
        Err(error) => error.into_response(flavor),
    }
}

fn request_faults(state: &AppState, headers: &HeaderMap) -> Result<FaultSpec, ApiError> {
    let request = match headers.get("x-sim-fault").map(|v| v.to_str()) {
        Some(Ok(value)) => FaultSpec::parse_header(value).map_err(ApiError::bad_request)?,
        Some(Err(_)) => return Err(ApiError::bad_request("x-sim-fault header is not ASCII")),
        None => FaultSpec::default(),
    };
    Ok(state.faults.for_request().merged_with(&request))
}

fn check_model(state: &AppState, body: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(model)) if *model == state.config.model => Ok(()),
        Some(Value::String(model)) => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
            in_stream: false,
        }),
        Some(_) => Err(ApiError::bad_request("`model` must be a string")),
    }
}

fn as_count(value: Option<&Value>, name: &str) -> Result<Option<usize>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            ApiError::bad_request(format!("`{name}` must be a non-negative integer"))
        }),
    }
}

/// Everything known about one request before it reaches the engine.
struct Prepared {
    api: Api,
    id: String,
    model: String,
    stream: bool,
    include_usage: bool,
    tokens: Vec<u32>,
    plan: OutputPlan,
    faults: FaultSpec,
    kv_params: Option<serde_json::Map<String, Value>>,
    bootstrap: Option<(String, u16, u64)>,
    /// Scheduling priority, lower first (see [`request_priority`]).
    priority: i64,
    /// When the request arrived (Unix seconds): every chunk's and the response's `created`.
    created: u64,
    /// `top_logprobs` alternatives when the request asked for `logprobs` (chat only).
    logprobs: Option<usize>,
}

/// Wall-clock Unix seconds.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The request's `priority` field, normalised to "lower runs first". vLLM takes lower values
/// first and refuses a non-zero priority unless `--scheduling-policy priority`; SGLang takes
/// higher values first and ignores the field without priority scheduling.
fn request_priority(
    config: &SimConfig,
    body: &serde_json::Map<String, Value>,
) -> Result<i64, ApiError> {
    let priority = match body.get("priority") {
        None | Some(Value::Null) => 0,
        Some(value) => value
            .as_i64()
            .ok_or_else(|| ApiError::bad_request("`priority` must be an integer"))?,
    };
    let enabled = config.scheduling_policy == SchedulingPolicyArg::Priority;
    match config.flavor {
        Flavor::Vllm if priority != 0 && !enabled => Err(ApiError::bad_request(format!(
            "Got priority {priority} but priority scheduling is not enabled"
        ))),
        Flavor::Vllm => Ok(priority),
        Flavor::Sglang if enabled => Ok(priority.saturating_neg()),
        Flavor::Sglang => Ok(0),
    }
}

async fn serve(
    state: Shared,
    api: Api,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let faults = request_faults(&state, &headers)?;
    if let Some(status) = faults.status {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Err(ApiError {
            status,
            message: format!("simulated fault: status {}", status.as_u16()),
            param: None,
            in_stream: false,
        });
    }
    let body = parse_body(body)?;
    check_model(&state, &body)?;
    let mut prepared = prepare(&state, api, &body, faults)?;
    // vLLM names the request after an `X-Request-Id` it is given.
    if state.config.flavor == Flavor::Vllm {
        if let Some(id) = headers.get("x-request-id").and_then(|v| v.to_str().ok()) {
            let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
            prepared.id = format!("{prefix}-{id}");
        }
    }
    run(state, prepared).await
}

/// SGLang parses every assistant tool call's arguments as a JSON object before it renders the
/// prompt, and refuses the request otherwise (`normalize_assistant_tool_call_arguments`).
fn sglang_tool_call_arguments(messages: &[Value]) -> Result<(), ApiError> {
    let calls = messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .flatten();
    for call in calls {
        let arguments = call.pointer("/function/arguments").unwrap_or(&Value::Null);
        let parsed = match arguments {
            Value::String(text) => serde_json::from_str::<Value>(text).ok(),
            other => Some(other.clone()),
        };
        match parsed {
            Some(Value::Object(_)) => {}
            Some(_) => {
                return Err(ApiError::bad_request(
                    "Assistant tool call function.arguments must be a JSON object.",
                ))
            }
            None => {
                return Err(ApiError::bad_request(
                    "Assistant tool call function.arguments must be valid JSON.",
                ))
            }
        }
    }
    Ok(())
}

/// The tools SGLang renders into the prompt: none under `tool_choice: "none"`, only the named
/// one under a named choice, else all of them.
fn sglang_rendered_tools(tools: Option<&Vec<Value>>, choice: Option<&Value>) -> Option<Vec<Value>> {
    let tools = tools.filter(|t| !t.is_empty())?;
    match choice {
        Some(Value::String(mode)) if mode == "none" => None,
        Some(Value::Object(named)) => {
            let name = named.get("function").and_then(|f| f.get("name"));
            Some(
                tools
                    .iter()
                    .filter(|t| t.pointer("/function/name") == name)
                    .cloned()
                    .collect(),
            )
        }
        _ => Some(tools.clone()),
    }
}

fn prepare(
    state: &AppState,
    api: Api,
    body: &serde_json::Map<String, Value>,
    faults: FaultSpec,
) -> Result<Prepared, ApiError> {
    let empty: Vec<Value> = Vec::new();
    let (tokens, messages) = match api {
        Api::Chat => {
            let messages = match body.get("messages") {
                Some(Value::Array(messages)) if !messages.is_empty() => messages,
                Some(Value::Array(_)) => {
                    return Err(ApiError::bad_request("`messages` must not be empty"))
                }
                _ => {
                    return Err(ApiError::bad_request(
                        "`messages` is required and must be an array of messages",
                    ))
                }
            };
            if messages.iter().any(|m| !m.is_object()) {
                return Err(ApiError::bad_request(
                    "every entry of `messages` must be an object with a `role`",
                ));
            }
            if state.config.flavor == Flavor::Sglang {
                sglang_tool_call_arguments(messages)?;
            }
            let tools = body.get("tools").and_then(Value::as_array);
            let rendered = match state.config.flavor {
                Flavor::Sglang => sglang_rendered_tools(tools, body.get("tool_choice")),
                Flavor::Vllm => tools.cloned(),
            };
            (
                tokenize(&render_chat(
                    messages,
                    rendered.as_deref(),
                    reasoning_field(state.config.flavor),
                )),
                messages.as_slice(),
            )
        }
        Api::Completion => {
            let tokens = match body.get("prompt") {
                Some(Value::String(prompt)) => tokenize(prompt),
                Some(Value::Array(items)) if items.iter().all(Value::is_u64) => items
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect(),
                Some(Value::Array(items)) if items.len() == 1 => match items.first() {
                    Some(Value::String(prompt)) => tokenize(prompt),
                    _ => {
                        return Err(ApiError::bad_request(
                            "`prompt` must be a string or a list of token ids",
                        ))
                    }
                },
                _ => {
                    return Err(ApiError::bad_request(
                        "`prompt` is required: a string or a list of token ids",
                    ))
                }
            };
            (tokens, empty.as_slice())
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::bad_request(
            "the prompt is empty; send at least one token",
        ));
    }
    let max_model_len = state.config.effective_max_model_len();
    let prompt_len = tokens.len();
    if prompt_len >= max_model_len {
        return Err(match state.config.flavor {
            Flavor::Vllm => ApiError::bad_request(format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_len} input tokens. Please reduce the length of the input messages."
            )),
            Flavor::Sglang => ApiError {
                in_stream: body.get("stream").and_then(Value::as_bool) == Some(true),
                ..ApiError::bad_request(format!(
                    "The input ({prompt_len} tokens) is longer than the model's context length ({max_model_len} tokens)."
                ))
            },
        });
    }
    let max_tokens = match as_count(body.get("max_completion_tokens"), "max_completion_tokens")? {
        Some(n) => Some(n),
        None => as_count(body.get("max_tokens"), "max_tokens")?,
    };
    if let Some(max) = max_tokens {
        if max == 0 {
            return Err(ApiError::bad_request(
                "max_tokens must be at least 1, got 0.",
            ));
        }
        if prompt_len + max > max_model_len {
            return Err(ApiError::bad_request(format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {max}. This model's maximum context length is {max_model_len} tokens and your request has {prompt_len} input tokens ({max} > {max_model_len} - {prompt_len})."
            )));
        }
    }
    let max_tokens = Some(max_tokens.unwrap_or(max_model_len - prompt_len));
    // `reasoning_effort: "none"` turns thinking off (SGLang maps it to `enable_thinking:
    // false`); any other effort turns it on.
    let reasoning = body
        .get("reasoning_effort")
        .is_some_and(|v| !v.is_null() && v.as_str() != Some("none"))
        || body.get("chat_template_kwargs").is_some_and(|k| {
            k.get("enable_thinking") == Some(&Value::Bool(true))
                || k.get("thinking") == Some(&Value::Bool(true))
        });
    let tools = body
        .get("tools")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let plan_request = PlanRequest {
        messages,
        tools,
        tool_choice: body.get("tool_choice"),
        response_format: body.get("response_format"),
        reasoning: reasoning && api == Api::Chat,
        max_tokens,
        min_tokens: as_count(body.get("min_tokens"), "min_tokens")?.unwrap_or(0),
        ignore_eos: body
            .get("ignore_eos")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    let seed = generate::seed_for(
        state.config.seed,
        body.get("seed").and_then(Value::as_u64),
        &tokens,
    );
    let plan = generate::plan(&plan_request, seed, state.config.default_output_tokens)
        .map_err(ApiError::bad_request)?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let priority = request_priority(&state.config, body)?;
    let logprobs = requested_logprobs(body, api)?;
    let kv_params = body
        .get("kv_transfer_params")
        .and_then(Value::as_object)
        .cloned();
    let bootstrap = match (body.get("bootstrap_host"), body.get("bootstrap_room")) {
        (Some(Value::String(host)), Some(room)) => {
            let room = room.as_u64().ok_or_else(|| {
                ApiError::bad_request("`bootstrap_room` must be a non-negative integer")
            })?;
            let port = body
                .get("bootstrap_port")
                .and_then(Value::as_u64)
                .unwrap_or(u64::from(state.advertised.port()));
            let port = u16::try_from(port)
                .map_err(|_| ApiError::bad_request("`bootstrap_port` must be a port number"))?;
            Some((host.clone(), port, room))
        }
        _ => None,
    };
    let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
    Ok(Prepared {
        created: unix_now(),
        api,
        id: state.request_id(prefix),
        model: state.config.model.clone(),
        stream,
        include_usage,
        tokens,
        plan,
        faults,
        kv_params,
        bootstrap,
        priority,
        logprobs,
    })
}

/// Most `top_logprobs` a request may ask for (vLLM's default `--max-logprobs`).
const MAX_LOGPROBS: u64 = 20;

/// The chat request's `logprobs` and `top_logprobs`, checked as vLLM checks them: the number
/// of alternatives when log probabilities are asked for, else `None`.
fn requested_logprobs(
    body: &serde_json::Map<String, Value>,
    api: Api,
) -> Result<Option<usize>, ApiError> {
    if api != Api::Chat {
        return Ok(None);
    }
    let asked = match body.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(asked)) => *asked,
        Some(_) => return Err(ApiError::bad_request("`logprobs` must be a boolean")),
    };
    let top = match body.get("top_logprobs") {
        None | Some(Value::Null) => 0,
        Some(value) => value.as_u64().ok_or_else(|| {
            ApiError::bad_request("`top_logprobs` must be a non-negative integer")
        })?,
    };
    if top > 0 && !asked {
        return Err(ApiError::bad_request(
            "when using `top_logprobs`, `logprobs` must be set to true.",
        ));
    }
    if top > MAX_LOGPROBS {
        return Err(ApiError::bad_request(format!(
            "Requested top logprobs of {top} exceeds the maximum of {MAX_LOGPROBS}."
        )));
    }
    Ok(asked.then_some(top as usize))
}

/// The log probability entry of the `index`-th generated piece `token`, with `top` alternatives
/// (the token itself first): made-up figures, the same for the same piece.
fn logprob_entry(index: usize, token: &str, top: usize) -> Value {
    let logprob = -0.05 * ((index % 7) as f64 + 1.0);
    let alternatives: Vec<Value> = (0..top)
        .map(|k| {
            let (alt, lp) = match k {
                0 => (token.to_string(), logprob),
                k => (format!("{token}~{k}"), logprob - 1.5 * k as f64),
            };
            json!({"token": alt, "logprob": lp, "bytes": alt.as_bytes()})
        })
        .collect();
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes(), "top_logprobs": alternatives})
}

/// Decide the P/D part: blocks imported from a prefill replica and whether to hand blocks off.
async fn transfer(
    state: &AppState,
    prepared: &Prepared,
    hashes: &[u64],
) -> Result<(usize, Option<Handoff>), ApiError> {
    let config = &state.config;
    let mut imported = Vec::new();
    let mut handoff = None;
    match config.flavor {
        Flavor::Vllm => {
            if let Some(params) = &prepared.kv_params {
                if params.get("do_remote_decode").and_then(Value::as_bool) == Some(true) {
                    handoff = Some(Handoff::Blocks);
                } else if params.get("do_remote_prefill").and_then(Value::as_bool) == Some(true) {
                    let host = params
                        .get("remote_host")
                        .and_then(Value::as_str)
                        .unwrap_or("127.0.0.1");
                    let port = params
                        .get("remote_port")
                        .and_then(Value::as_u64)
                        .and_then(|p| u16::try_from(p).ok())
                        .ok_or_else(|| {
                            ApiError::bad_request(
                                "kv_transfer_params.remote_port must be a port number",
                            )
                        })?;
                    let block_ids = block_ids_of(params.get("remote_block_ids"));
                    if !block_ids.is_empty() {
                        imported = pd::pull_blocks(&state.http, host, port, &block_ids)
                            .await
                            .map_err(ApiError::internal)?;
                    }
                }
            }
        }
        Flavor::Sglang => {
            if prepared.bootstrap.is_none() && config.role == Role::Decode {
                // An SGLang server in `--disaggregation-mode decode` never prefills: every
                // request waits for a KV transfer from `bootstrap_host:bootstrap_port`, which a
                // request without one names as `None` and cannot reach.
                return Err(ApiError::internal(
                    "this SGLang server runs in disaggregation-mode decode: a request needs bootstrap_host, bootstrap_port and bootstrap_room to receive its KV from a prefill server",
                ));
            }
            if let Some((host, port, room)) = &prepared.bootstrap {
                match config.role {
                    Role::Prefill => {
                        // make the room visible to an early decode leg before prefill starts
                        drop(state.rooms.subscribe(*room));
                        handoff = Some(Handoff::Room(*room));
                    }
                    Role::Decode => {
                        let timeout =
                            Duration::from_secs_f64(config.kv_transfer_timeout_s.max(0.0));
                        imported = pd::fetch_room(&state.http, host, *port, *room, timeout)
                            .await
                            .map_err(ApiError::internal)?;
                    }
                    Role::Both => {}
                }
            }
        }
    }
    if !imported.is_empty() {
        if hashes.get(..imported.len()) != Some(imported.as_slice()) {
            return Err(ApiError::internal(
                "KV transfer failed: the prefill replica's blocks do not match this prompt; send the same body to both legs",
            ));
        }
        let delay = pd::transfer_delay(
            imported.len(),
            config.block_size,
            config.kv_bytes_per_token,
            config.kv_transfer_gbps,
            config.time_scale,
        );
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
    Ok((imported.len(), handoff))
}

async fn run(state: Shared, prepared: Prepared) -> Result<Response, ApiError> {
    // A decode server sends a streamed answer's headers at once, as SGLang releases whose HTTP
    // server streams without kick-starting the generator do (later ones send them with the
    // first chunk; the gateway reads both), then waits in the bootstrap room for the KV cache,
    // and a transfer that fails ends the stream with an error.
    if prepared.stream
        && prepared.bootstrap.is_some()
        && state.config.flavor == Flavor::Sglang
        && state.config.role == Role::Decode
    {
        return Ok(headers_first(state, prepared));
    }
    run_now(state, prepared).await
}

/// A streamed answer whose headers go out at once, its events once [`run_now`] has them; a
/// failure before the first event is sent in the stream as SGLang sends it (an `error` object,
/// then `[DONE]`).
fn headers_first(state: Shared, prepared: Prepared) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        // A client gone while the transfer is awaited leaves nothing to submit.
        let answer = tokio::select! {
            answer = run_now(state, prepared) => answer,
            () = tx.closed() => return,
        };
        match answer {
            Ok(answer) => {
                let mut body = answer.into_body().into_data_stream();
                while let Some(frame) = futures_util::StreamExt::next(&mut body).await {
                    // A client that left drops `rx`: the answer's stream is dropped with it, and
                    // the engine cancels the request.
                    if tx.send(frame.map_err(std::io::Error::other)).await.is_err() {
                        return;
                    }
                }
            }
            Err(error) => {
                let frame = json!({"error": {"object": "error", "message": error.message,
                    "type": "InternalServerError", "param": null,
                    "code": error.status.as_u16()}});
                let _ = tx.send(Ok(sse(&frame))).await;
                let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
            }
        }
    });
    sse_answer(rx)
}

/// A `200` event stream of the frames sent on `rx` (an `Err` breaks the connection).
fn sse_answer(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Response {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_default()
}

/// Transfer the KV cache a disaggregated request needs, submit the request to the engine and
/// answer it.
async fn run_now(state: Shared, prepared: Prepared) -> Result<Response, ApiError> {
    let hashes = chain_hashes(&prepared.tokens, state.config.block_size);
    let (imported_blocks, handoff) = match transfer(&state, &prepared, &hashes).await {
        Ok(result) => result,
        Err(error) => {
            if let (Some((_, _, room)), Role::Prefill) = (&prepared.bootstrap, state.config.role) {
                state.rooms.mark(*room, RoomStatus::Failed);
            }
            return Err(error);
        }
    };
    let (events_tx, events) = mpsc::unbounded_channel();
    // the whole sequence the engine will hold: the prompt, then the planned output tokens
    let mut tokens = Vec::with_capacity(prepared.tokens.len() + prepared.plan.pieces.len());
    tokens.extend_from_slice(&prepared.tokens);
    tokens.extend(prepared.plan.token_ids());
    let request = SeqRequest {
        prompt_len: prepared.tokens.len(),
        tokens,
        hashes,
        output_tokens: prepared.plan.pieces.len().max(1),
        imported_blocks,
        handoff: handoff.clone(),
        priority: prepared.priority,
        events: events_tx,
    };
    state
        .commands
        .send(Command::Submit(request))
        .map_err(|_| ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "engine stopped".into(),
            param: None,
            in_stream: false,
        })?;
    if prepared.stream {
        Ok(stream_response(state, prepared, events, handoff))
    } else {
        complete_response(state, prepared, events, handoff).await
    }
}

/// Per-token delivery pacing and the first-token stall. A stall set globally follows the
/// global faults while it lasts: it ends once they hold no stall (`DELETE /sim/faults`) or one
/// already served, so a test can hold requests as long as it needs and release them when it is
/// done.
struct Pacer {
    stall: Option<Duration>,
    /// The replica, when the stall is the global one.
    global: Option<Shared>,
    per_token: Duration,
}

impl Pacer {
    fn new(state: &Shared, faults: &FaultSpec) -> Self {
        let slow = faults.slow.unwrap_or(1.0).max(1.0);
        let per_token = if state.config.time_scale > 0.0 {
            Duration::from_secs_f64(
                (slow - 1.0) * state.config.decode_ms_per_token / 1000.0 * state.config.time_scale,
            )
        } else {
            Duration::ZERO
        };
        let global = faults.stall_is_global;
        Pacer {
            stall: faults.stall_ms.map(Duration::from_millis),
            global: global.then(|| Arc::clone(state)),
            per_token,
        }
    }

    async fn before(&mut self, count: usize) {
        if let Some(stall) = self.stall.take() {
            let start = tokio::time::Instant::now();
            match &self.global {
                None => tokio::time::sleep(stall).await,
                Some(state) => {
                    while let Some(ms) = state.faults.global().stall_ms {
                        let until = start + Duration::from_millis(ms);
                        let now = tokio::time::Instant::now();
                        if now >= until {
                            break;
                        }
                        tokio::time::sleep((until - now).min(Duration::from_millis(20))).await;
                    }
                }
            }
        }
        if !self.per_token.is_zero() {
            tokio::time::sleep(self.per_token * count as u32).await;
        }
    }
}

/// A request's `usage`; `prompt_tokens_details` only when the engine reports cached tokens
/// (`--prompt-tokens-details`) and there are some, as vLLM and SGLang do.
fn usage(config: &SimConfig, prompt: usize, completion: usize, cached: usize) -> Value {
    let mut usage = json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    });
    if config.prompt_tokens_details && cached > 0 {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    usage
}

async fn complete_response(
    state: Shared,
    prepared: Prepared,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    handoff: Option<Handoff>,
) -> Result<Response, ApiError> {
    let mut pacer = Pacer::new(&state, &prepared.faults);
    let mut generated = 0usize;
    let (cached, block_ids) = loop {
        match events.recv().await {
            Some(SeqEvent::Tokens { count }) => {
                pacer.before(count).await;
                generated += count;
            }
            Some(SeqEvent::Done {
                cached_tokens,
                handoff_block_ids,
            }) => break (cached_tokens, handoff_block_ids),
            None => {
                return Err(ApiError::internal(
                    "the engine dropped the request; retry it",
                ))
            }
        }
    };
    if let Some(Handoff::Room(room)) = handoff {
        state.rooms.mark(room, RoomStatus::Ready);
    }
    let plan = &prepared.plan;
    let generated = generated
        .min(plan.pieces.len())
        .max(usize::from(!plan.pieces.is_empty()));
    let finish_reason = plan.finish_reason_after(generated);
    let kv_transfer_params = match handoff {
        Some(Handoff::Blocks) => json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": block_ids,
            "remote_engine_id": state.engine_id,
            "remote_host": state.advertised.ip().to_string(),
            "remote_port": state.advertised.port(),
            "tp_size": 1,
        }),
        _ => Value::Null,
    };
    let usage = usage(&state.config, prepared.tokens.len(), generated, cached);
    let body = match prepared.api {
        Api::Chat => {
            let content = plan.text(Channel::Content, generated);
            let reasoning = plan.text(Channel::Reasoning, generated);
            let tool_calls: Vec<Value> = plan
                .tool_call
                .iter()
                .filter(|_| plan.tool_call_started(generated))
                .map(|call| {
                    json!({"id": call.id, "type": "function", "function": {
                        "name": call.name, "arguments": plan.text(Channel::ToolArguments, generated)}})
                })
                .collect();
            let content = if content.is_empty() && !tool_calls.is_empty() {
                Value::Null
            } else {
                Value::String(content)
            };
            let reasoning = if reasoning.is_empty() {
                Value::Null
            } else {
                Value::String(reasoning)
            };
            json!({
                "id": prepared.id,
                "object": "chat.completion",
                "created": prepared.created,
                "model": prepared.model,
                "choices": [{
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "refusal": null,
                        "annotations": null,
                        "audio": null,
                        "function_call": null,
                        "tool_calls": tool_calls,
                        reasoning_field(state.config.flavor): reasoning,
                    },
                    "logprobs": prepared.logprobs.map(|top| {
                        let content: Vec<Value> = plan
                            .pieces
                            .iter()
                            .take(generated)
                            .enumerate()
                            .filter(|(_, (channel, _))| *channel == Channel::Content)
                            .map(|(index, (_, token))| logprob_entry(index, token, top))
                            .collect();
                        json!({"content": content})
                    }),
                    "finish_reason": finish_reason,
                    "stop_reason": null,
                }],
                "service_tier": null,
                "system_fingerprint": null,
                "usage": usage,
                "prompt_logprobs": null,
                "kv_transfer_params": kv_transfer_params,
            })
        }
        Api::Completion => json!({
            "id": prepared.id,
            "object": "text_completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": [{
                "index": 0,
                "text": plan.text(Channel::Content, generated),
                "logprobs": null,
                "finish_reason": finish_reason,
                "stop_reason": null,
                "prompt_logprobs": null,
            }],
            "service_tier": null,
            "system_fingerprint": null,
            "usage": usage,
            "kv_transfer_params": kv_transfer_params,
        }),
    };
    if prepared.faults.cut_after.is_some() {
        let failing = futures_util::stream::once(async {
            Err::<Bytes, std::io::Error>(std::io::Error::other("simulated cut"))
        });
        return Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from_stream(failing))
            .unwrap_or_default());
    }
    Ok(axum::Json(body).into_response())
}

fn sse(value: &Value) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut out, value).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

fn chunk(prepared: &Prepared, created: u64, choice: Value) -> Value {
    let object = if prepared.api == Api::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    json!({"id": prepared.id, "object": object, "created": created, "model": prepared.model, "choices": [choice]})
}

/// The field reasoning text comes in, out and back in a history: vLLM has named it `reasoning`
/// since 0.11 (and dropped `reasoning_content` in 2026); SGLang still says `reasoning_content`.
fn reasoning_field(flavor: Flavor) -> &'static str {
    match flavor {
        Flavor::Vllm => "reasoning",
        Flavor::Sglang => "reasoning_content",
    }
}

/// Whether this stream is SGLang's chat stream (its own shape: see [`piece_choice`]).
fn sglang_chat(state: &AppState, prepared: &Prepared) -> bool {
    state.config.flavor == Flavor::Sglang && prepared.api == Api::Chat
}

/// The chunk choice revealing piece `index`; `None` for a hidden piece that does not end the
/// output. SGLang's chat deltas carry `tool_calls: null` beside text
/// (the gateway must not read it as a call), and SGLang ends its stream with a chunk of its
/// own for the finish reason (the caller sends it: `finish` is None then).
fn piece_choice(
    flavor: Flavor,
    prepared: &Prepared,
    index: usize,
    (channel, text): (Channel, &str),
    finish: Option<&str>,
) -> Option<Value> {
    if prepared.api == Api::Completion {
        return Some(
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null}),
        );
    }
    let delta = match channel {
        Channel::Markup if finish.is_none() => return None,
        Channel::Markup => json!({}),
        Channel::Reasoning if flavor == Flavor::Sglang => {
            json!({"content": null, "reasoning_content": text, "tool_calls": null})
        }
        Channel::Reasoning => json!({reasoning_field(flavor): text}),
        Channel::Content if flavor == Flavor::Sglang => {
            json!({"content": text, "tool_calls": null})
        }
        Channel::Content => json!({"content": text}),
        Channel::ToolHeader => {
            let (id, name) = prepared
                .plan
                .tool_call
                .as_ref()
                .map(|c| (c.id.as_str(), c.name.as_str()))
                .unwrap_or_default();
            json!({"tool_calls": [{"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
        }
        Channel::ToolArguments => {
            json!({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        }
    };
    let logprobs = match (prepared.logprobs, channel) {
        (Some(top), Channel::Content) => json!({"content": [logprob_entry(index, text, top)]}),
        _ => Value::Null,
    };
    Some(
        json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": null}),
    )
}

fn stream_response(
    state: Shared,
    prepared: Prepared,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    handoff: Option<Handoff>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut pacer = Pacer::new(&state, &prepared.faults);
        let cut_after = prepared.faults.cut_after;
        let abort_after = prepared.faults.abort_after;
        let mut sent = 0usize;
        let mut generated = 0usize;
        let total = prepared.plan.pieces.len();
        // Send one SSE frame, honouring cut_after; false when the stream must end.
        macro_rules! send {
            ($value:expr) => {{
                if cut_after.is_some_and(|cut| sent >= cut) {
                    let _ = tx.send(Err(std::io::Error::other("simulated cut"))).await;
                    return;
                }
                if tx.send(Ok(sse(&$value))).await.is_err() {
                    return;
                }
                sent += 1;
            }};
        }
        let cached = loop {
            match events.recv().await {
                Some(SeqEvent::Tokens { count }) => {
                    pacer.before(count).await;
                    if generated == 0 && prepared.api == Api::Chat {
                        let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                        send!(chunk(&prepared, prepared.created, first));
                    }
                    let end = (generated + count).min(total);
                    for index in generated..end {
                        if abort_after.is_some_and(|after| sent >= after) {
                            // The engine aborts the request: what it made so far counts.
                            let choice = json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "abort", "stop_reason": null});
                            send!(chunk(&prepared, prepared.created, choice));
                            generated = index;
                            break;
                        }
                        let Some((channel, text)) = prepared.plan.pieces.get(index) else {
                            break;
                        };
                        let last = index + 1 == total;
                        let finish = last.then(|| prepared.plan.finish_reason_after(total));
                        // SGLang ends a chat stream with a chunk of its own: an empty delta,
                        // the finish reason and `matched_stop`.
                        let own_chunk = sglang_chat(&state, &prepared);
                        if let Some(choice) = piece_choice(
                            state.config.flavor,
                            &prepared,
                            index,
                            (*channel, text),
                            finish.filter(|_| !own_chunk),
                        ) {
                            send!(chunk(&prepared, prepared.created, choice));
                        }
                        if let Some(reason) = finish.filter(|_| own_chunk) {
                            let choice = json!({"index": 0, "delta": {}, "logprobs": null,
                                "finish_reason": reason, "matched_stop": null});
                            send!(chunk(&prepared, prepared.created, choice));
                        }
                    }
                    if abort_after.is_some_and(|after| sent > after) {
                        break 0;
                    }
                    generated = end;
                }
                Some(SeqEvent::Done { cached_tokens, .. }) => {
                    // A streamed SGLang prefill leg hands its room over like a non-streamed one.
                    if let Some(Handoff::Room(room)) = &handoff {
                        state.rooms.mark(*room, RoomStatus::Ready);
                    }
                    break cached_tokens;
                }
                None => {
                    let _ = tx
                        .send(Err(std::io::Error::other("engine dropped the request")))
                        .await;
                    return;
                }
            }
        };
        if prepared.include_usage {
            let mut last = chunk(&prepared, prepared.created, Value::Null);
            last["choices"] = json!([]);
            last["usage"] = usage(&state.config, prepared.tokens.len(), generated, cached);
            send!(last);
        }
        if cut_after.is_some_and(|cut| sent >= cut) {
            let _ = tx.send(Err(std::io::Error::other("simulated cut"))).await;
            return;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    sse_answer(rx)
}

// ----- other endpoints --------------------------------------------------------------------------

async fn models(State(state): State<Shared>) -> Response {
    let owner = match state.config.flavor {
        Flavor::Vllm => "vllm",
        Flavor::Sglang => "sglang",
    };
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.model,
            "object": "model",
            "created": state.created,
            "owned_by": owner,
            "root": state.config.model,
            "parent": null,
            "max_model_len": state.config.effective_max_model_len(),
        }],
    }))
    .into_response()
}

async fn health(State(state): State<Shared>) -> Response {
    if let Some(ms) = state.faults.global().health_stall_ms {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    if state.faults.global().unhealthy {
        return error_response(
            state.config.flavor,
            StatusCode::SERVICE_UNAVAILABLE,
            "simulated fault: unhealthy",
            None,
        );
    }
    StatusCode::OK.into_response()
}

async fn metrics_text(State(state): State<Shared>) -> Response {
    let text = {
        let Ok(core) = state.core.lock() else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        let gauges = Gauges {
            running: core.num_running(),
            waiting: core.num_waiting(),
            kv_usage: core.cache.usage(),
            block_size: core.cache.block_size(),
            num_blocks: core.cache.capacity(),
        };
        metrics::render(
            state.config.flavor,
            &state.config.model,
            &core.stats,
            gauges,
        )
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn tokenize_endpoint(
    State(state): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let flavor = state.config.flavor;
    let body = match parse_body(body) {
        Ok(body) => body,
        Err(error) => return error.into_response(flavor),
    };
    if let Err(error) = check_model(&state, &body) {
        return error.into_response(flavor);
    }
    let tokens = match (body.get("prompt"), body.get("messages")) {
        (Some(prompt), _) => tokenize(&content_text(prompt)),
        (None, Some(Value::Array(messages))) => {
            let tools = body
                .get("tools")
                .and_then(Value::as_array)
                .map(Vec::as_slice);
            tokenize(&render_chat(
                messages,
                tools,
                reasoning_field(state.config.flavor),
            ))
        }
        _ => {
            return ApiError::bad_request("send `prompt` (a string) or `messages`")
                .into_response(flavor)
        }
    };
    axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": state.config.effective_max_model_len(),
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response()
}

async fn reset_cache(State(state): State<Shared>) -> Response {
    let (reply, answer) = oneshot::channel();
    if state.commands.send(Command::ResetCache { reply }).is_err() {
        return ApiError::internal("engine stopped").into_response(state.config.flavor);
    }
    match answer.await {
        Ok(true) => StatusCode::OK.into_response(),
        _ => error_response(
            state.config.flavor,
            StatusCode::BAD_REQUEST,
            "cannot reset the prefix cache while requests are running; retry when idle",
            None,
        ),
    }
}

async fn get_faults(State(state): State<Shared>) -> Response {
    axum::Json(state.faults.global()).into_response()
}

async fn set_faults(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let flavor = state.config.flavor;
    let bytes = match body {
        Ok(bytes) => bytes,
        Err(rejection) => {
            return error_response(flavor, rejection.status(), &rejection.body_text(), None)
        }
    };
    match serde_json::from_slice::<FaultSpec>(&bytes) {
        Ok(spec) => {
            state.faults.set(spec.clone());
            axum::Json(spec).into_response()
        }
        Err(e) => error_response(
            flavor,
            StatusCode::BAD_REQUEST,
            &format!("fault spec not understood: {e}; fields: status, stall_ms, cut_after, abort_after, slow, unhealthy, health_stall_ms"),
            None,
        ),
    }
}

async fn clear_faults(State(state): State<Shared>) -> Response {
    state.faults.set(FaultSpec::default());
    StatusCode::NO_CONTENT.into_response()
}

/// Hand over pinned blocks at once, as a KV connector does: the transfer runs beside the
/// engine's compute, so it must not wait for the engine loop's current step to end.
async fn take_pin(state: &AppState, key: PinKey) -> Option<Vec<u64>> {
    state.core.lock().ok()?.take_pin(&key)
}

/// KV block ids from a JSON array (`remote_block_ids`, `block_ids`); non-numbers are skipped.
fn block_ids_of(value: Option<&Value>) -> Vec<u32> {
    value
        .and_then(Value::as_array)
        .map(|ids| {
            ids.iter()
                .filter_map(Value::as_u64)
                .map(|id| id as u32)
                .collect()
        })
        .unwrap_or_default()
}

async fn kv_pull(State(state): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let flavor = state.config.flavor;
    let body = match parse_body(body) {
        Ok(body) => body,
        Err(error) => return error.into_response(flavor),
    };
    let block_ids = block_ids_of(body.get("block_ids"));
    match take_pin(&state, PinKey::Blocks(block_ids)).await {
        Some(hashes) => axum::Json(json!({"block_hashes": hashes})).into_response(),
        None => error_response(
            flavor,
            StatusCode::NOT_FOUND,
            "no pinned blocks with these ids: they were already fetched, expired, or never prefilled here",
            Some("block_ids"),
        ),
    }
}

#[derive(serde::Deserialize)]
struct RoomQuery {
    timeout_ms: Option<u64>,
}

async fn bootstrap_room(
    State(state): State<Shared>,
    Path(room): Path<u64>,
    Query(query): Query<RoomQuery>,
) -> Response {
    let flavor = state.config.flavor;
    let default_timeout = (state.config.kv_transfer_timeout_s.max(0.0) * 1000.0) as u64;
    let timeout = Duration::from_millis(query.timeout_ms.unwrap_or(default_timeout));
    let mut status = state.rooms.subscribe(room);
    let ready = {
        let waited =
            tokio::time::timeout(timeout, status.wait_for(|s| *s != RoomStatus::Pending)).await;
        matches!(waited.map(|r| r.map(|s| *s)), Ok(Ok(RoomStatus::Ready)))
    };
    state.rooms.remove(room);
    if !ready {
        return error_response(
            flavor,
            StatusCode::NOT_FOUND,
            &format!("bootstrap room {room}: the prefill leg did not finish in time or failed"),
            None,
        );
    }
    match take_pin(&state, PinKey::Room(room)).await {
        Some(hashes) => axum::Json(json!({"block_hashes": hashes})).into_response(),
        None => error_response(
            flavor,
            StatusCode::NOT_FOUND,
            &format!("bootstrap room {room}: blocks expired"),
            None,
        ),
    }
}
