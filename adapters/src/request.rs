//! Builds the Chat Completions request body for one turn from a Responses request.
//!
//! Item translation:
//! - `instructions` and every `system`/`developer` message that comes before the first
//!   user/assistant/tool message are merged (blank-line separated, in order) into ONE leading
//!   `system` message, because many chat templates accept a system message only in first
//!   position. Later `system`/`developer` messages become `system` messages in place.
//! - user messages: text parts -> a plain string content (parts joined by `\n`); when an image is
//!   present, an array of `text` / `image_url` parts. `input_file` and file-id images are rejected.
//! - assistant messages: `output_text` (and `refusal`) text joined into a string.
//! - `function_call` -> an assistant `tool_calls` entry; consecutive calls (and calls right after
//!   an assistant text message) merge into one assistant message. `custom_tool_call` likewise,
//!   with arguments `{"input": <input>}`. Arguments that are not a JSON object (a call cut short
//!   by `max_output_tokens`) go as `{}` (empty) or `{"arguments": <text>}`: engines refuse the
//!   whole request over one such call.
//! - a compaction turn keeps the tools declared with `tool_choice: "none"` (vLLM renders them
//!   still, so the prompt's prefix stays cached); SGLang would render none, so there the choice
//!   is left out.
//! - `function_call_output` / `custom_tool_call_output` -> a `tool` message with `tool_call_id`
//!   (array outputs are flattened to their text, files named `[file NAME]`; an output with
//!   images goes to vLLM and SGLang as text and `image_url` parts when the pool's model takes
//!   images (`vision`), else, and to an `openai`-flavor server, whose tool messages hold text
//!   only, with each image named `[image]`).
//! - images given by URL: a pool with `remote_images` off takes `data:` URLs only (a user's
//!   other image is refused, a tool's named `[image]`), so the engines fetch nothing.
//! - `system` / `developer` messages hold text: an image, file or audio part in one is refused
//!   in the request's input; in its history (a chain or a conversation stored before such
//!   parts were refused) it is dropped, as it was then, and the text kept.
//! - `reasoning` items: for vLLM / SGLang the reasoning text (from `content`, else from this
//!   gateway's `encrypted_content` blob, else from `summary`) is attached to the next assistant
//!   message (as `reasoning_content` for SGLang; as `reasoning` and `reasoning_content` for vLLM,
//!   which reads the first since 0.11 and only it in later versions), so templates that re-render thinking (Qwen3, DeepSeek, gpt-oss)
//!   see it; for the OpenAI flavor reasoning items are dropped from the prompt.
//! - hosted-tool items (`web_search_call`, ...) are skipped; `item_reference` is rejected (the
//!   caller resolves references before translating).
//! - `include: ["message.output_text.logprobs"]` asks the engine for `logprobs` with
//!   `top_logprobs` alternatives (the request's, else 0).

use crate::compaction::{
    decode_compaction_blob, requests_compaction, CompactionOptions, SUMMARY_PREFIX,
};
use crate::error::ApiError;
use crate::reasoning_blob::decode_reasoning_blob;
use crate::tools::{translate_tool_choice, translate_tools, ToolNameMap};
use crate::Flavor;
use serde_json::{json, Map, Value};

/// What to do with hosted tools (web_search, file_search, ...) that no engine can run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HostedToolPolicy {
    /// Remove them from the request and log an info line (the default).
    #[default]
    Drop,
    /// Answer 400 with param `tools`.
    Reject,
}

/// Per-endpoint translation settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TranslateOptions {
    /// The engine dialect of the target endpoint.
    pub flavor: Flavor,
    /// What to do with hosted tools.
    pub hosted_tools: HostedToolPolicy,
    /// How a compaction turn asks for its summary ([`crate::compaction`]).
    pub compaction: CompactionOptions,
    /// The model takes images: images in tool outputs go to vLLM and SGLang as image parts
    /// (else each is named `[image]`).
    pub vision: bool,
    /// Images may be given by `http(s)` URL, which the engine fetches; false: `data:` URLs
    /// only (a user's other image is refused, a tool's is named `[image]`), so clients cannot
    /// make the engines fetch addresses inside their network.
    pub remote_images: bool,
    /// The `reasoning_effort` values the engines take (vLLM and SGLang releases before late
    /// 2025 take `low`, `medium` and `high` only): another effort is sent as the nearest one
    /// they take (`none` and `minimal` as `low`, `xhigh` and `max` as `high` on engines that
    /// take those three). None: every effort is sent as asked.
    pub reasoning_efforts: Option<Vec<String>>,
}

impl TranslateOptions {
    /// Options for `flavor` with the default hosted-tool policy (drop) and compaction prompt,
    /// for a text-only model.
    pub fn new(flavor: Flavor) -> Self {
        TranslateOptions {
            flavor,
            hosted_tools: HostedToolPolicy::Drop,
            compaction: CompactionOptions::default(),
            vision: false,
            remote_images: true,
            reasoning_efforts: None,
        }
    }
}

/// OpenAI's reasoning efforts, least to most (vLLM's latest releases take the same set; an
/// engine that takes fewer is given the nearest: [`TranslateOptions::reasoning_efforts`]).
pub const REASONING_EFFORTS: [&str; 7] =
    ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// The effort to send for `asked` to engines that take `accepted` (None: any): `asked` if
/// they take it, else the nearest they take, the lower of two equally near (`none` and
/// `minimal` are `low`, `xhigh` and `max` are `high` on engines that take those three), and
/// `None` (the field left out, the engine's default) when they take none of OpenAI's or
/// `asked` is unknown. (Left out, `none` would get the engine's default, more thinking than
/// `minimal` gets.)
pub fn engine_effort<'a>(asked: &'a str, accepted: Option<&'a [String]>) -> Option<&'a str> {
    let Some(accepted) = accepted else {
        return Some(asked);
    };
    if accepted.iter().any(|a| a == asked) {
        return Some(asked);
    }
    let at = REASONING_EFFORTS.iter().position(|e| *e == asked)?;
    let distance = |effort: &&str| {
        REASONING_EFFORTS
            .iter()
            .position(|e| e == effort)
            .map(|p| (p.abs_diff(at), p))
    };
    REASONING_EFFORTS
        .iter()
        .filter(|e| **e != "none" && accepted.iter().any(|a| a == *e))
        .min_by_key(|e| distance(e))
        .copied()
}

/// The Chat Completions body for one turn plus what the stream translator needs to map back.
#[derive(Clone, Debug)]
pub struct ChatPlan {
    /// The body to POST to `/v1/chat/completions` (always streaming, with usage).
    pub body: Value,
    /// Engine function name -> client tool name/namespace.
    pub tool_names: ToolNameMap,
    /// Labels of hosted tools removed from the request.
    pub dropped_tools: Vec<String>,
    /// A compaction turn (its input ends with a `compaction_trigger`): the answer is one
    /// `compaction` item ([`crate::ResponseStream::with_compaction`]).
    pub compaction: bool,
}

/// Builds the Chat Completions body for one turn (see the module doc for the item rules).
///
/// `req` is the raw Responses request, `history` the earlier items (from
/// `previous_response_id`), `input` this turn's normalized items.
pub fn build_chat_request(
    req: &Value,
    history: &[Value],
    input: &[Value],
    opts: &TranslateOptions,
) -> Result<ChatPlan, ApiError> {
    let tools = translate_tools(req.get("tools"), opts.flavor, opts.hosted_tools)?;
    let mut builder = MessageBuilder::new(opts.flavor, &tools.names);
    builder.vision = opts.vision;
    builder.remote_images = opts.remote_images;
    match req.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => builder.push_system(text.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                "instructions",
                "`instructions` must be a string",
            ))
        }
    }
    // Before the last compaction item only the user, system and developer messages remain:
    // the summary stands for the rest, as in the history a client replaces with it.
    let is_compaction =
        |item: &Value| item.get("type").and_then(Value::as_str) == Some("compaction");
    let compacted_before = match input.iter().rposition(is_compaction) {
        Some(at) => history.len() + at,
        None => history.iter().rposition(is_compaction).unwrap_or(0),
    };
    let params = (0..history.len())
        .map(|_| "previous_response_id".to_string())
        .chain((0..input.len()).map(|index| format!("input[{index}]")));
    for (position, (item, param)) in history.iter().chain(input).zip(params).enumerate() {
        if position < compacted_before && !survives_compaction(item) {
            continue;
        }
        builder.push_item(item, &param)?;
    }
    let compaction = requests_compaction(input);
    if compaction {
        builder
            .messages
            .push(json!({"role": "user", "content": opts.compaction.prompt}));
    }
    let messages = builder.finish();

    let mut body = Map::new();
    if let Some(model) = req.get("model").filter(|m| m.is_string()) {
        body.insert("model".into(), model.clone());
    }
    body.insert("messages".into(), Value::Array(messages));
    body.insert("stream".into(), json!(true));
    body.insert("stream_options".into(), json!({"include_usage": true}));

    let tool_choice =
        translate_tool_choice(req.get("tool_choice"), &tools.names, opts.hosted_tools)?;
    let mut chat_tools = tools.chat_tools;
    // (A compaction declares the tools its turns declared, so its prompt's prefix is theirs.)
    if let Some(allowed) = tool_choice.allowed.as_ref() {
        chat_tools.retain(|tool| {
            tool["function"]["name"]
                .as_str()
                .is_some_and(|name| allowed.contains(name))
        });
    }
    // Whether the turns of this request may call tools (a compaction's summary may not, but
    // its prompt is rendered as theirs).
    let may_call_tools = !chat_tools.is_empty()
        && tool_choice.choice.as_ref().and_then(Value::as_str) != Some("none");
    if !chat_tools.is_empty() {
        body.insert("tools".into(), Value::Array(chat_tools));
        if compaction {
            // The tools stay declared so the prompt's prefix matches the turns before. SGLang
            // leaves the tools out of the prompt under `tool_choice: "none"`, which would make
            // the summary recompute the whole history: there the choice stays `auto` (a tool
            // call instead of a summary ends the compaction as failed).
            if opts.flavor != Flavor::Sglang {
                body.insert("tool_choice".into(), json!("none"));
            }
        } else if let Some(choice) = tool_choice.choice {
            body.insert("tool_choice".into(), choice);
        }
        if let Some(parallel) = req.get("parallel_tool_calls").filter(|p| p.is_boolean()) {
            body.insert("parallel_tool_calls".into(), parallel.clone());
        }
    }

    let requested = match req.get("max_output_tokens") {
        None | Some(Value::Null) => None,
        Some(value) => {
            let Some(limit) = value.as_u64().filter(|n| *n >= 1) else {
                return Err(ApiError::invalid(
                    "max_output_tokens",
                    "max_output_tokens must be a positive integer",
                ));
            };
            Some(limit)
        }
    };
    let limit = if compaction {
        let most = opts.compaction.max_output_tokens.max(1);
        Some(requested.map_or(most, |r| r.min(most)))
    } else {
        requested
    };
    if let Some(limit) = limit {
        let key = if opts.flavor == Flavor::Openai {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        body.insert(key.into(), json!(limit));
    }
    for key in ["temperature", "top_p"] {
        match req.get(key) {
            None | Some(Value::Null) => {}
            Some(value) if value.is_number() => {
                body.insert(key.into(), value.clone());
            }
            Some(_) => {
                return Err(ApiError::invalid(key, format!("{key} must be a number")));
            }
        }
    }
    if let Some(user) = req.get("user").filter(|u| u.is_string()) {
        body.insert("user".into(), user.clone());
    }
    if opts.flavor == Flavor::Openai {
        for key in ["prompt_cache_key", "safety_identifier"] {
            if let Some(value) = req.get(key).filter(|v| v.is_string()) {
                body.insert(key.into(), value.clone());
            }
        }
    }
    if let Some(format) = req.get("text").and_then(|t| t.get("format")) {
        if let Some(response_format) = translate_text_format(format)? {
            // OpenAI holds the answer to the format, not the tool calls before it. vLLM's and
            // SGLang's `response_format` constrains every token they generate, so a turn that
            // may call tools would never get to call one: for them the format is asked for in
            // the instructions instead (the first system message, the same every turn and in a
            // compaction, so the cached prefix holds). An `openai`-flavor server holds only
            // the answer to it, as OpenAI does. A compaction's summary is the gateway's and
            // keeps its own form.
            if may_call_tools && opts.flavor != Flavor::Openai {
                ask_for_format(&mut body, &response_format);
            } else if !compaction {
                body.insert("response_format".into(), response_format);
            }
        }
    }
    if let Some(effort) = req
        .get("reasoning")
        .and_then(|r| r.get("effort"))
        .filter(|e| e.is_string())
    {
        let sent = effort
            .as_str()
            .and_then(|asked| engine_effort(asked, opts.reasoning_efforts.as_deref()));
        if let Some(sent) = sent {
            body.insert("reasoning_effort".into(), json!(sent));
        }
    }
    // Log probabilities of the answer's text, when `include` asks for them (`top_logprobs`
    // alternatives at each position); a compaction's summary is never shown.
    if includes(req, INCLUDE_LOGPROBS) && !compaction {
        body.insert("logprobs".into(), json!(true));
        let top = req.get("top_logprobs").and_then(Value::as_u64).unwrap_or(0);
        body.insert("top_logprobs".into(), json!(top));
    }

    Ok(ChatPlan {
        body: Value::Object(body),
        tool_names: tools.names,
        dropped_tools: tools.dropped,
        compaction,
    })
}

/// Whether `item` stays in a history compacted after it: a user, system or developer message.
fn survives_compaction(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) == Some("message")
        && matches!(
            item.get("role").and_then(Value::as_str),
            Some("user" | "system" | "developer")
        )
}

/// The `include` value asking for the answer text's log probabilities.
pub const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// True when the request's `include` asks for `reasoning.encrypted_content` (pass the answer to
/// [`crate::ResponseStream::with_encrypted_reasoning`]).
pub fn includes_encrypted_reasoning(req: &Value) -> bool {
    includes(req, "reasoning.encrypted_content")
}

/// Whether the request's `include` lists `value`.
fn includes(req: &Value, value: &str) -> bool {
    req.get("include")
        .and_then(Value::as_array)
        .is_some_and(|include| include.iter().any(|entry| entry.as_str() == Some(value)))
}

/// Append to the first system message (or add one) the instruction to answer in `format` (a
/// chat `response_format`) when answering rather than calling a tool.
fn ask_for_format(body: &mut Map<String, Value>, format: &Value) {
    let instruction = match format.get("json_schema") {
        Some(spec) => format!(
            "When you answer with a message rather than a tool call, the message must be only a \
             JSON value that matches this JSON Schema (\"{}\"): {}",
            spec.get("name").and_then(Value::as_str).unwrap_or("schema"),
            spec.get("schema").unwrap_or(&Value::Null)
        ),
        None => "When you answer with a message rather than a tool call, the message must be \
                 only a JSON object."
            .to_string(),
    };
    let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
        return;
    };
    let system = messages
        .first_mut()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("system"));
    match system.and_then(|m| m.get_mut("content")) {
        Some(Value::String(text)) => {
            text.push_str("\n\n");
            text.push_str(&instruction);
        }
        Some(Value::Array(parts)) => parts.push(json!({"type": "text", "text": instruction})),
        _ => messages.insert(0, json!({"role": "system", "content": instruction})),
    }
}

fn translate_text_format(format: &Value) -> Result<Option<Value>, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let name = format.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid("text.format.name", "text.format.name is required for json_schema")
            })?;
            let schema = format.get("schema").filter(|s| s.is_object()).ok_or_else(|| {
                ApiError::invalid("text.format.schema", "text.format.schema must be a JSON Schema object")
            })?;
            let mut json_schema = Map::new();
            json_schema.insert("name".into(), json!(name));
            if let Some(description) = format.get("description").filter(|d| d.is_string()) {
                json_schema.insert("description".into(), description.clone());
            }
            json_schema.insert("schema".into(), schema.clone());
            if let Some(strict) = format.get("strict").filter(|s| s.is_boolean()) {
                json_schema.insert("strict".into(), strict.clone());
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": json_schema})))
        }
        Some(other) => Err(ApiError::invalid(
            "text.format.type",
            format!("text.format.type \"{other}\" is not supported; use text, json_object or json_schema"),
        )),
    }
}

/// Accumulates chat messages from Responses items.
struct MessageBuilder<'a> {
    flavor: Flavor,
    /// [`TranslateOptions::vision`].
    vision: bool,
    /// [`TranslateOptions::remote_images`].
    remote_images: bool,
    names: &'a ToolNameMap,
    leading_system: Vec<String>,
    messages: Vec<Value>,
    pending_reasoning: Option<String>,
}

impl<'a> MessageBuilder<'a> {
    fn new(flavor: Flavor, names: &'a ToolNameMap) -> Self {
        MessageBuilder {
            flavor,
            vision: false,
            remote_images: true,
            names,
            leading_system: Vec::new(),
            messages: Vec::new(),
            pending_reasoning: None,
        }
    }

    fn push_system(&mut self, text: String) {
        if self.messages.is_empty() {
            if !text.is_empty() {
                self.leading_system.push(text);
            }
        } else {
            self.messages
                .push(json!({"role": "system", "content": text}));
        }
    }

    fn push_item(&mut self, item: &Value, param: &str) -> Result<(), ApiError> {
        let kind =
            item.get("type")
                .and_then(Value::as_str)
                .unwrap_or(if item.get("role").is_some() {
                    "message"
                } else {
                    ""
                });
        match kind {
            "message" => self.push_message(item, param),
            "function_call" => {
                let call_id = str_field(item, "call_id");
                let name = str_field(item, "name");
                let namespace = item.get("namespace").and_then(Value::as_str);
                let engine_name = self.names.engine_name(name, namespace);
                let arguments = match item.get("arguments") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Null) | None => String::new(),
                    Some(other) => other.to_string(),
                };
                self.push_tool_call(call_id, &engine_name, object_arguments(arguments));
                Ok(())
            }
            "custom_tool_call" => {
                let call_id = str_field(item, "call_id");
                let namespace = item.get("namespace").and_then(Value::as_str);
                let engine_name = self.names.engine_name(str_field(item, "name"), namespace);
                let arguments = json!({"input": str_field(item, "input")}).to_string();
                self.push_tool_call(call_id, &engine_name, arguments);
                Ok(())
            }
            "function_call_output" | "custom_tool_call_output" => {
                let content = tool_output(
                    item.get("output"),
                    self.flavor,
                    self.vision,
                    self.remote_images,
                );
                self.messages.push(json!({
                    "role": "tool",
                    "tool_call_id": str_field(item, "call_id"),
                    "content": content,
                }));
                Ok(())
            }
            "reasoning" => {
                if self.flavor.is_self_hosted() {
                    if let Some(text) = reasoning_text(item) {
                        match &mut self.pending_reasoning {
                            Some(existing) => {
                                existing.push_str("\n\n");
                                existing.push_str(&text);
                            }
                            None => self.pending_reasoning = Some(text),
                        }
                    }
                }
                Ok(())
            }
            "compaction" => {
                let summary = item
                    .get("encrypted_content")
                    .and_then(Value::as_str)
                    .and_then(decode_compaction_blob)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("{param}.encrypted_content"),
                            format!("{param} is a compaction item this gateway cannot read"),
                        )
                        .with_code("invalid_encrypted_content")
                    })?;
                self.messages.push(json!({
                    "role": "user",
                    "content": format!("{SUMMARY_PREFIX}{summary}"),
                }));
                Ok(())
            }
            // A request control, not context: it asks this turn for a compaction (handled by
            // `build_chat_request`) and means nothing in a history.
            "compaction_trigger" => Ok(()),
            "item_reference" => Err(ApiError::invalid(
                param,
                format!("{param} is an item_reference; send the referenced item itself or use previous_response_id"),
            )),
            other => {
                tracing::debug!(item_type = %other, "skipping an input item the engines cannot consume");
                Ok(())
            }
        }
    }

    fn push_message(&mut self, item: &Value, param: &str) -> Result<(), ApiError> {
        let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
        if role != "assistant" {
            // Reasoning that no assistant message of its turn took (a turn cut short while it
            // reasoned) is not the next turn's.
            self.pending_reasoning = None;
        }
        match role {
            "system" | "developer" => {
                // Instructions are text: an image or a file in them would be dropped without a
                // word, so it is refused, as a file in a user message is. (One stored in a
                // chain before it was refused stays dropped: the client cannot take it back.)
                let stored = param == "previous_response_id";
                if let Some((index, kind)) = instruction_media(item).filter(|_| !stored) {
                    return Err(ApiError::invalid(
                        format!("{param}.content[{index}].type"),
                        format!("{param}: a {role} message holds text only; send the {kind} in a user message"),
                    ));
                }
                let text = text_of_parts(item.get("content"));
                self.push_system(text);
            }
            "assistant" => {
                let text = text_of_parts(item.get("content"));
                // Text written after this turn's tool calls joins their message: a message
                // with tool calls must be followed by their results, not by more text.
                if let Some(Value::Object(last)) = self.messages.last_mut() {
                    let calls = last
                        .get("tool_calls")
                        .and_then(Value::as_array)
                        .is_some_and(|calls| !calls.is_empty());
                    if calls && last.get("role").and_then(Value::as_str) == Some("assistant") {
                        // Appended in place: a long run of such messages costs its length,
                        // not its length squared.
                        match last.get_mut("content") {
                            Some(Value::String(before)) if !before.is_empty() => {
                                before.push_str("\n\n");
                                before.push_str(&text);
                            }
                            _ => {
                                last.insert("content".into(), json!(text));
                            }
                        }
                        let pending = self.pending_reasoning.take();
                        attach_reasoning(self.flavor, pending, last);
                        return Ok(());
                    }
                }
                let mut message = Map::new();
                message.insert("role".into(), json!("assistant"));
                message.insert("content".into(), json!(text));
                self.attach_reasoning(&mut message);
                self.messages.push(Value::Object(message));
            }
            _ => {
                let content = user_content(item.get("content"), param, self.remote_images)?;
                self.messages
                    .push(json!({"role": "user", "content": content}));
            }
        }
        Ok(())
    }

    fn attach_reasoning(&mut self, message: &mut Map<String, Value>) {
        attach_reasoning(self.flavor, self.pending_reasoning.take(), message);
    }

    fn push_tool_call(&mut self, call_id: &str, engine_name: &str, arguments: String) {
        let call = json!({
            "id": call_id,
            "type": "function",
            "function": {"name": engine_name, "arguments": arguments},
        });
        let pending = self.pending_reasoning.take();
        if let Some(Value::Object(last)) = self.messages.last_mut() {
            if last.get("role").and_then(Value::as_str) == Some("assistant") {
                match last.get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => {
                        last.insert("tool_calls".into(), json!([call]));
                    }
                }
                attach_reasoning(self.flavor, pending, last);
                return;
            }
        }
        let empty_content = if self.flavor == Flavor::Openai {
            Value::Null
        } else {
            json!("")
        };
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert("content".into(), empty_content);
        message.insert("tool_calls".into(), json!([call]));
        attach_reasoning(self.flavor, pending, &mut message);
        self.messages.push(Value::Object(message));
    }

    fn finish(mut self) -> Vec<Value> {
        if !self.leading_system.is_empty() {
            let text = self.leading_system.join("\n\n");
            self.messages
                .insert(0, json!({"role": "system", "content": text}));
        }
        self.messages
    }
}

/// Adds `reasoning` to an assistant message (appending to any already there), under the names
/// the engine reads: SGLang `reasoning_content`; vLLM `reasoning` since 0.11 (later versions
/// ignore `reasoning_content`) and `reasoning_content` before, so both.
fn attach_reasoning(flavor: Flavor, reasoning: Option<String>, message: &mut Map<String, Value>) {
    let Some(reasoning) = reasoning else {
        return;
    };
    let keys: &[&str] = match flavor {
        Flavor::Vllm => &["reasoning", "reasoning_content"],
        Flavor::Sglang | Flavor::Openai => &["reasoning_content"],
    };
    for key in keys {
        match message.get_mut(*key) {
            Some(Value::String(existing)) => {
                existing.push_str("\n\n");
                existing.push_str(&reasoning);
            }
            _ => {
                message.insert((*key).into(), json!(reasoning));
            }
        }
    }
}

/// The first image, file or audio part of a `system` or `developer` message (its index and
/// type): instructions hold text only, so such a part would be dropped.
pub fn instruction_media(item: &Value) -> Option<(usize, &str)> {
    let role = item.get("role").and_then(Value::as_str);
    if !matches!(role, Some("system" | "developer")) {
        return None;
    }
    let parts = item.get("content").and_then(Value::as_array)?;
    parts.iter().enumerate().find_map(|(index, part)| {
        let kind = part.get("type").and_then(Value::as_str)?;
        matches!(kind, "input_image" | "input_file" | "input_audio").then_some((index, kind))
    })
}

fn str_field<'v>(item: &'v Value, field: &str) -> &'v str {
    item.get(field).and_then(Value::as_str).unwrap_or("")
}

/// Text of a message's content (string, or the text of its text/refusal parts joined by `\n`).
fn text_of_parts(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| {
                part.get("text")
                    .or_else(|| part.get("refusal"))
                    .and_then(Value::as_str)
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn user_content(
    content: Option<&Value>,
    param: &str,
    remote_images: bool,
) -> Result<Value, ApiError> {
    let parts = match content {
        Some(Value::String(text)) => return Ok(json!(text)),
        Some(Value::Array(parts)) => parts,
        _ => return Ok(json!("")),
    };
    let mut chat_parts = Vec::new();
    let mut has_image = false;
    for (index, part) in parts.iter().enumerate() {
        let part_param = format!("{param}.content[{index}]");
        match part.get("type").and_then(Value::as_str).unwrap_or("") {
            "input_text" | "output_text" | "text" => {
                chat_parts.push(json!({"type": "text", "text": str_field(part, "text")}));
            }
            "input_image" => {
                let Some(image) = chat_image(part) else {
                    return Err(ApiError::invalid(
                        format!("{part_param}.image_url"),
                        format!("{part_param}: images must be given as image_url (an http(s) or data: URL); file_id images are not supported"),
                    ));
                };
                if !remote_images && !is_data_url(part) {
                    // (One stored in a chain before the pool refused them is named instead.)
                    if param == "previous_response_id" {
                        chat_parts.push(json!({"type": "text", "text": "[image]"}));
                        continue;
                    }
                    return Err(ApiError::invalid(
                        format!("{part_param}.image_url"),
                        format!("{part_param}: this model takes images inline only, as data: URLs (base64); it does not fetch URLs"),
                    ));
                }
                chat_parts.push(image);
                has_image = true;
            }
            "input_file" | "input_audio" => {
                return Err(ApiError::invalid(
                    format!("{part_param}.type"),
                    format!("{part_param}: file and audio inputs are not supported by this gateway; send the content as input_text"),
                ))
            }
            _ => {}
        }
    }
    if has_image {
        return Ok(Value::Array(chat_parts));
    }
    let text = chat_parts
        .iter()
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join("\n");
    Ok(json!(text))
}

/// A tool message's content. vLLM and SGLang take content parts in any message, so a tool
/// output that holds images (a screenshot tool, Codex's `view_image`) reaches a model that
/// takes images (`vision`) as text and `image_url` parts; otherwise (a text-only model would
/// refuse the request, and an `openai`-flavor server's tool messages hold text only) it is
/// text, with other parts named.
fn tool_output(output: Option<&Value>, flavor: Flavor, vision: bool, remote_images: bool) -> Value {
    let Some(Value::Array(parts)) = output.filter(|_| vision && flavor.is_self_hosted()) else {
        return json!(output_text(output));
    };
    // (An image the engine may not fetch is named, as for a text-only model.)
    let image = |part: &Value| chat_image(part).filter(|_| remote_images || is_data_url(part));
    if !parts.iter().any(|part| image(part).is_some()) {
        return json!(output_text(output));
    }
    let chat_parts: Vec<Value> = parts
        .iter()
        .map(|part| {
            image(part).unwrap_or_else(
                || json!({"type": "text", "text": output_text(Some(&json!([part])))}),
            )
        })
        .collect();
    Value::Array(chat_parts)
}

/// The URL an image part gives in `image_url` (a string or `{url}`).
fn image_url_of(part: &Value) -> Option<&str> {
    match part.get("image_url") {
        Some(Value::String(url)) => Some(url.as_str()),
        Some(Value::Object(obj)) => obj.get("url").and_then(Value::as_str),
        _ => None,
    }
}

/// Whether an `input_image` part gives its image inline, as a `data:` URL.
fn is_data_url(part: &Value) -> bool {
    image_url_of(part).is_some_and(|url| {
        url.trim_start()
            .get(..5)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("data:"))
    })
}

/// The Chat Completions `image_url` part for an `input_image` part that gives a URL (a
/// string or `{url}`); `None` for any other part.
fn chat_image(part: &Value) -> Option<Value> {
    if part.get("type").and_then(Value::as_str) != Some("input_image") {
        return None;
    }
    let url = image_url_of(part).filter(|url| !url.is_empty())?;
    let mut image_url = Map::new();
    image_url.insert("url".into(), json!(url));
    // Chat Completions takes auto, low and high; the Responses API's `original` (full
    // resolution) is the engines' `high`.
    match part.get("detail").and_then(Value::as_str) {
        Some("original") => {
            image_url.insert("detail".into(), json!("high"));
        }
        Some(detail) => {
            image_url.insert("detail".into(), json!(detail));
        }
        None => {}
    }
    Some(json!({"type": "image_url", "image_url": image_url}))
}

fn output_text(output: Option<&Value>) -> String {
    match output {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|part| match part.get("text").and_then(Value::as_str) {
                Some(text) => text.to_string(),
                // A tool message holds text only: other parts are named, not sent.
                None => match part.get("type").and_then(Value::as_str) {
                    Some("input_file") => match part.get("filename").and_then(Value::as_str) {
                        Some(name) => format!("[file {name}]"),
                        None => "[file]".to_string(),
                    },
                    Some("input_image") | None => "[image]".to_string(),
                    Some(other) => format!("[{other}]"),
                },
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn reasoning_text(item: &Value) -> Option<String> {
    let joined = |parts: Option<&Value>| -> Option<String> {
        let parts = parts?.as_array()?;
        let texts: Vec<&str> = parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect();
        if texts.is_empty() {
            None
        } else {
            Some(texts.join("\n"))
        }
    };
    joined(item.get("content"))
        .or_else(|| {
            item.get("encrypted_content")
                .and_then(Value::as_str)
                .and_then(decode_reasoning_blob)
        })
        .or_else(|| joined(item.get("summary")))
        .filter(|text| !text.is_empty())
}

/// Deepest nesting passed on as a tool call's arguments: serde_json's own limit when it
/// builds a value, which the engines' parsers take too.
const MAX_ARGUMENT_DEPTH: usize = 128;

/// How deep arrays and objects nest in the JSON text `text` (brackets inside strings do not
/// count); meaningful for valid JSON only.
fn nesting_depth(text: &str) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for byte in text.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// A tool call's arguments as the engines' chat templates take them: SGLang parses each
/// assistant tool call's arguments as a JSON object and refuses the whole request otherwise (so
/// would vLLM with most templates), and one call cut short by `max_output_tokens` would then
/// fail every later turn of its conversation. A JSON object passes verbatim (the prompt stays
/// what the engine generated); empty arguments become `{}`; anything else is wrapped as
/// `{"arguments": "<the text>"}`.
fn object_arguments(arguments: String) -> String {
    if arguments.trim().is_empty() {
        return "{}".to_string();
    }
    // Checked without building the value: arguments come from clients, and a huge array
    // would take some 40 times its size in memory as a `Value`. (Skipping a value has no depth
    // limit: nesting past what the engines' JSON parsers take is bounded here.)
    let object = arguments.trim_start().starts_with('{')
        && nesting_depth(&arguments) <= MAX_ARGUMENT_DEPTH
        && serde_json::from_str::<serde::de::IgnoredAny>(&arguments).is_ok();
    if object {
        arguments
    } else {
        json!({ "arguments": arguments }).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::normalize_input;
    use crate::reasoning_blob::encode_reasoning_blob;

    fn vllm() -> TranslateOptions {
        TranslateOptions::new(Flavor::Vllm)
    }

    #[test]
    fn instructions_and_leading_developer_messages_merge_into_one_system_message() {
        let req = json!({"model": "m", "instructions": "be brief"});
        let input = normalize_input(&json!([
            {"role": "developer", "content": "sandbox: read-only"},
            {"role": "system", "content": [{"type": "input_text", "text": "policy"}]},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": "late note"},
        ]))
        .unwrap();
        let plan = build_chat_request(&req, &[], &input, &vllm()).unwrap();
        assert_eq!(
            plan.body["messages"],
            json!([
                {"role": "system", "content": "be brief\n\nsandbox: read-only\n\npolicy"},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "late note"},
            ])
        );
        assert_eq!(plan.body["model"], "m");
        assert_eq!(plan.body["stream"], true);
        assert_eq!(plan.body["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn every_item_kind_translates() {
        let blob = encode_reasoning_blob("think about ls");
        let history = normalize_input(&json!([
            {"role": "user", "content": "list files"},
            {"type": "reasoning", "summary": [], "encrypted_content": blob},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Sure.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{\"cmd\":\"ls\"}"},
            {"type": "function_call", "call_id": "call_b", "name": "search", "namespace": "mcp__docs",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "a.txt"},
            {"type": "function_call_output", "call_id": "call_b",
             "output": [{"type": "input_text", "text": "doc"}, {"type": "input_image", "image_url": "data:x"}]},
            {"type": "web_search_call", "status": "completed"},
        ]))
        .unwrap();
        let input = normalize_input(&json!([
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}],
             "content": [{"type": "reasoning_text", "text": "raw thought"}]},
            {"type": "custom_tool_call", "call_id": "call_c", "name": "apply_patch", "input": "*** Begin"},
            {"type": "custom_tool_call_output", "call_id": "call_c", "output": "patched"},
            {"role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]},
        ]))
        .unwrap();
        let req = json!({"tools": [
            {"type": "function", "name": "shell"},
            {"type": "namespace", "name": "mcp__docs", "tools": [{"type": "function", "name": "search"}]},
        ]});
        let plan = build_chat_request(&req, &history, &input, &vllm()).unwrap();
        assert_eq!(
            plan.body["messages"],
            json!([
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "Sure.", "reasoning": "think about ls", "reasoning_content": "think about ls",
                 "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": "{\"cmd\":\"ls\"}"}},
                    {"id": "call_b", "type": "function", "function": {"name": "mcp__docs__search", "arguments": "{}"}},
                 ]},
                {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
                {"role": "tool", "tool_call_id": "call_b", "content": "doc\n[image]"},
                {"role": "assistant", "content": "", "reasoning": "raw thought", "reasoning_content": "raw thought", "tool_calls": [
                    {"id": "call_c", "type": "function",
                     "function": {"name": "apply_patch", "arguments": "{\"input\":\"*** Begin\"}"}},
                ]},
                {"role": "tool", "tool_call_id": "call_c", "content": "patched"},
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
                ]},
            ])
        );
    }

    #[test]
    fn a_turns_text_after_its_tool_calls_stays_ahead_of_their_results() {
        let history = normalize_input(&json!([
            {"role": "user", "content": "fix it"},
            // Cut short while reasoning: not the next turn's.
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "stale"}]},
            {"role": "user", "content": "again"},
            {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{}"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Running it.", "annotations": []}]},
            {"type": "function_call_output", "call_id": "call_a",
             "output": [{"type": "input_file", "filename": "r.pdf", "file_data": "x"}]},
        ]))
        .unwrap();
        let input = normalize_input(&json!([{"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "https://x/y.png", "detail": "original"}]}]))
        .unwrap();
        let req = json!({"tools": [{"type": "function", "name": "shell"}]});
        let plan = build_chat_request(&req, &history, &input, &vllm()).unwrap();
        assert_eq!(
            plan.body["messages"],
            json!([
                {"role": "user", "content": "fix it"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "Running it.", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": "{}"}},
                ]},
                {"role": "tool", "tool_call_id": "call_a", "content": "[file r.pdf]"},
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}},
                ]},
            ])
        );
    }

    #[test]
    fn a_namespaced_custom_calls_history_keeps_its_namespace() {
        let history = normalize_input(&json!([
            {"role": "user", "content": "note it"},
            {"type": "custom_tool_call", "call_id": "call_n", "name": "note", "namespace": "mcp__docs",
             "input": "x"},
            {"type": "custom_tool_call_output", "call_id": "call_n", "output": "ok"},
        ]))
        .unwrap();
        let req = json!({"tools": [{"type": "namespace", "name": "mcp__docs",
                                    "tools": [{"type": "custom", "name": "note"}]}]});
        let plan = build_chat_request(&req, &history, &[], &vllm()).unwrap();
        assert_eq!(
            plan.body["messages"][1]["tool_calls"][0]["function"]["name"],
            "mcp__docs__note"
        );
    }

    #[test]
    fn openai_flavor_drops_reasoning_and_uses_max_completion_tokens() {
        let input = normalize_input(&json!([
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ]))
        .unwrap();
        let req = json!({"max_output_tokens": 64, "prompt_cache_key": "thread-1",
                         "safety_identifier": "user-7"});
        let plan =
            build_chat_request(&req, &[], &input, &TranslateOptions::new(Flavor::Openai)).unwrap();
        assert_eq!(
            plan.body["messages"][1],
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
        );
        assert_eq!(plan.body["max_completion_tokens"], 64);
        assert_eq!(plan.body["prompt_cache_key"], "thread-1");
        assert_eq!(plan.body["safety_identifier"], "user-7");
        assert!(plan.body.get("max_tokens").is_none());
        let plan = build_chat_request(&req, &[], &input, &vllm()).unwrap();
        assert_eq!(plan.body["max_tokens"], 64);
        assert!(plan.body.get("prompt_cache_key").is_none());
        assert!(plan.body.get("safety_identifier").is_none());
    }

    #[test]
    fn images_in_tool_outputs_reach_vision_models_and_are_named_for_the_others() {
        let input = normalize_input(&json!([
            {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_text", "text": "screenshot:"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "original"}]},
        ]))
        .unwrap();
        let tool_message = |opts: &TranslateOptions| {
            build_chat_request(&json!({}), &[], &input, opts)
                .unwrap()
                .body["messages"][1]
                .clone()
        };
        let parts = json!([
            {"type": "text", "text": "screenshot:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
        ]);
        let vision = |flavor| TranslateOptions {
            vision: true,
            ..TranslateOptions::new(flavor)
        };
        assert_eq!(tool_message(&vision(Flavor::Vllm))["content"], parts);
        assert_eq!(tool_message(&vision(Flavor::Sglang))["content"], parts);
        // A text-only model, or an `openai`-flavor server (tool messages hold text), reads
        // that there was an image.
        for opts in [vllm(), vision(Flavor::Openai)] {
            assert_eq!(tool_message(&opts)["content"], "screenshot:\n[image]");
        }
    }

    #[test]
    fn reasoning_efforts_an_engine_does_not_take_go_as_the_nearest_it_does() {
        let three: Vec<String> = ["low", "medium", "high"].map(String::from).to_vec();
        let sent = |asked| engine_effort(asked, Some(&three));
        assert_eq!(sent("minimal"), Some("low"));
        assert_eq!(sent("medium"), Some("medium"));
        assert_eq!(sent("xhigh"), Some("high"));
        assert_eq!(sent("max"), Some("high"));
        assert_eq!(
            sent("none"),
            Some("low"),
            "the least there is, not the default"
        );
        assert_eq!(sent("turbo"), None);
        assert_eq!(engine_effort("max", None), Some("max"));
        // In a request.
        let input = normalize_input(&json!("hi")).unwrap();
        let opts = TranslateOptions {
            reasoning_efforts: Some(three.clone()),
            ..vllm()
        };
        let body = |effort: &str| {
            build_chat_request(
                &json!({"reasoning": {"effort": effort}}),
                &[],
                &input,
                &opts,
            )
            .unwrap()
            .body
        };
        assert_eq!(body("xhigh")["reasoning_effort"], "high");
        assert_eq!(body("none")["reasoning_effort"], "low");
    }

    #[test]
    fn a_pool_without_remote_images_takes_inline_ones_only() {
        let inline = "data:image/png;base64,AAAA";
        let input = |url: &str| {
            normalize_input(&json!([{"role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": url}]}]))
            .unwrap()
        };
        let local = TranslateOptions {
            remote_images: false,
            ..vllm()
        };
        let err = build_chat_request(&json!({}), &[], &input("http://169.254.169.254/x"), &local)
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0].content[1].image_url"));
        assert!(build_chat_request(&json!({}), &[], &input(inline), &local).is_ok());
        // By default the engine may fetch it.
        assert!(build_chat_request(&json!({}), &[], &input("https://x/y.png"), &vllm()).is_ok());
        // One stored in a chain before is named, not refused.
        let plan = build_chat_request(&json!({}), &input("https://x/y.png"), &[], &local).unwrap();
        assert_eq!(plan.body["messages"][0]["content"], "look\n[image]");
    }

    #[test]
    fn an_image_in_instructions_is_refused_not_dropped() {
        let input = normalize_input(&json!([
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": [
                {"type": "input_text", "text": "style guide"},
                {"type": "input_image", "image_url": "https://x/y.png"}]},
        ]))
        .unwrap();
        let err = build_chat_request(&json!({}), &[], &input, &vllm()).unwrap_err();
        assert_eq!(
            err.param.as_deref(),
            Some("input[1].content[1].type"),
            "{err:?}"
        );
        // Stored in a chain before it was refused: its text still goes, and the chain goes on.
        let plan = build_chat_request(&json!({}), &input, &[], &vllm()).unwrap();
        assert_eq!(plan.body["messages"][1]["content"], "style guide");
    }

    #[test]
    fn log_probabilities_are_asked_for_when_include_lists_them() {
        let input = normalize_input(&json!("hi")).unwrap();
        let plan = |req: Value| build_chat_request(&req, &[], &input, &vllm()).unwrap().body;
        let asked = plan(json!({"include": [INCLUDE_LOGPROBS], "top_logprobs": 3}));
        assert_eq!(
            (&asked["logprobs"], &asked["top_logprobs"]),
            (&json!(true), &json!(3))
        );
        let plain = plan(json!({"include": [INCLUDE_LOGPROBS]}));
        assert_eq!(
            (&plain["logprobs"], &plain["top_logprobs"]),
            (&json!(true), &json!(0))
        );
        // Alternatives alone are not asked for: the text's logprobs come with the include.
        let not = plan(json!({"top_logprobs": 3}));
        assert!(not.get("logprobs").is_none() && not.get("top_logprobs").is_none());
    }

    #[test]
    fn sampling_format_reasoning_and_tools_map() {
        let req = json!({
            "model": "qwen", "temperature": 0.2, "top_p": 0.9, "user": "u1",
            "text": {"format": {"type": "json_schema", "name": "answer", "strict": true,
                                "schema": {"type": "object"}}},
            "reasoning": {"effort": "high", "summary": "auto"},
            "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}],
            "tool_choice": "required", "parallel_tool_calls": false,
        });
        let input = normalize_input(&json!("hi")).unwrap();
        let plan = build_chat_request(&req, &[], &input, &vllm()).unwrap();
        let body = &plan.body;
        assert_eq!(body["temperature"], 0.2);
        assert_eq!(body["top_p"], 0.9);
        assert_eq!(body["user"], "u1");
        // With tools to call, the format is asked for in the instructions: an engine's
        // response_format would hold the tool calls to it too.
        assert!(body.get("response_format").is_none());
        assert_eq!(body["messages"][0]["role"], "system");
        let system = body["messages"][0]["content"].as_str().unwrap();
        assert!(
            system.ends_with(r#"matches this JSON Schema ("answer"): {"type":"object"}"#),
            "{system}"
        );
        // Without tools, the engine holds the answer to it.
        let mut no_tools = req.clone();
        no_tools.as_object_mut().unwrap().remove("tools");
        no_tools.as_object_mut().unwrap().remove("tool_choice");
        let plain = build_chat_request(&no_tools, &[], &input, &vllm()).unwrap();
        assert_eq!(
            plain.body["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": true}})
        );
        assert_eq!(plain.body["messages"][0]["role"], "user");
        // An OpenAI-compatible server holds only the answer to it, as OpenAI does.
        let mut openai = vllm();
        openai.flavor = Flavor::Openai;
        let generic = build_chat_request(&req, &[], &input, &openai).unwrap().body;
        assert_eq!(generic["response_format"]["type"], "json_schema");
        assert_eq!(generic["messages"][0]["role"], "user");
        assert_eq!(body["reasoning_effort"], "high");
        assert_eq!(body["tool_choice"], "required");
        assert_eq!(body["parallel_tool_calls"], false);
        assert_eq!(body["tools"].as_array().map(Vec::len), Some(1));
        assert_eq!(plan.dropped_tools, vec!["web_search"]);

        let req = json!({"text": {"format": {"type": "json_object"}}, "tools": [{"type": "web_search"}],
                         "tool_choice": "auto"});
        let plan = build_chat_request(&req, &[], &input, &vllm()).unwrap();
        assert_eq!(plan.body["response_format"], json!({"type": "json_object"}));
        assert!(plan.body.get("tools").is_none());
        assert!(plan.body.get("tool_choice").is_none());
    }

    #[test]
    fn tool_call_arguments_reach_the_engine_as_a_json_object() {
        assert_eq!(
            object_arguments(r#"{"city": "Oslo"}"#.into()),
            r#"{"city": "Oslo"}"#
        );
        assert_eq!(object_arguments(String::new()), "{}");
        assert_eq!(object_arguments("  ".into()), "{}");
        assert_eq!(
            object_arguments(r#"{"city": "Os"#.into()),
            r#"{"arguments":"{\"city\": \"Os"}"#,
            "cut short by max_output_tokens"
        );
        assert_eq!(object_arguments("[1]".into()), r#"{"arguments":"[1]"}"#);
        // Nesting as deep as a JSON parser builds passes; deeper is wrapped, brackets inside
        // strings aside.
        let nested = |depth: usize| {
            format!(
                "{{\"a\":{}1{}}}",
                "[".repeat(depth - 1),
                "]".repeat(depth - 1)
            )
        };
        assert_eq!(object_arguments(nested(128)), nested(128));
        assert!(object_arguments(nested(129)).starts_with(r#"{"arguments":"#));
        let quoted = format!("{{\"a\":\"{}\"}}", "[".repeat(500));
        assert_eq!(object_arguments(quoted.clone()), quoted);
    }

    #[test]
    fn allowed_tools_leave_the_other_tools_out_of_the_engine_request() {
        let req = json!({
            "tools": [{"type": "function", "name": "read"}, {"type": "function", "name": "rm"},
                      {"type": "custom", "name": "apply_patch"}],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": "read"}]},
        });
        let input = normalize_input(&json!("hi")).unwrap();
        let plan = build_chat_request(&req, &[], &input, &vllm()).unwrap();
        let declared: Vec<&str> = plan.body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(declared, ["read"]);
        assert_eq!(plan.body["tool_choice"], "required");
        // Allowing none sends none: the model answers in text.
        let mut req = req;
        req["tool_choice"] = json!({"type": "allowed_tools", "mode": "auto", "tools": []});
        let plan = build_chat_request(&req, &[], &input, &vllm()).unwrap();
        assert!(plan.body.get("tools").is_none());
        assert!(plan.body.get("tool_choice").is_none());
    }

    #[test]
    fn a_trailing_compaction_trigger_asks_for_a_summary_and_compaction_items_read_back() {
        use crate::compaction::{encode_compaction_blob, DEFAULT_PROMPT, SUMMARY_PREFIX};
        let req = json!({"instructions": "base", "tool_choice": "required", "max_output_tokens": 99999,
                         "tools": [{"type": "function", "name": "shell", "parameters": {}}]});
        let history = normalize_input(&json!([
            {"role": "user", "content": "fix the parser"},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a long listing"},
            {"type": "message", "role": "assistant", "content": "fixed"},
            {"type": "compaction_trigger"},
            {"type": "compaction", "encrypted_content": encode_compaction_blob("did A")},
        ]))
        .unwrap();
        let input = normalize_input(&json!([
            {"role": "user", "content": "now docs"},
            {"type": "compaction_trigger"},
        ]))
        .unwrap();
        let mut opts = vllm();
        opts.compaction.max_output_tokens = 500;
        let plan = build_chat_request(&req, &history, &input, &opts).unwrap();
        assert!(plan.compaction);
        let messages = plan.body["messages"].as_array().unwrap();
        let contents: Vec<&str> = messages
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        // Before the compaction item only the user's message stays (the summary stands for the
        // tool call, its output and the answer); the trigger is dropped; the summary read back.
        assert_eq!(
            contents,
            [
                "base",
                "fix the parser",
                &format!("{SUMMARY_PREFIX}did A"),
                "now docs",
                DEFAULT_PROMPT,
            ]
        );
        assert_eq!(plan.body["tool_choice"], "none");
        assert_eq!(plan.body["tools"].as_array().map(Vec::len), Some(1));
        assert_eq!(plan.body["max_tokens"], 500);
        // Without the trigger last, a turn is an ordinary one.
        let plan = build_chat_request(&req, &history, &input[..1], &opts).unwrap();
        assert!(!plan.compaction);
        assert_eq!(plan.body["tool_choice"], "required");
        assert_eq!(plan.body["max_tokens"], 99999);
    }

    #[test]
    fn a_compaction_renders_its_prompt_as_the_turns_before_it() {
        // A text.format asked for in the instructions and a subset of allowed tools: the
        // compaction's system message and tools are the turns', so its prefix is cached.
        let req = json!({"instructions": "base",
            "text": {"format": {"type": "json_object"}},
            "tool_choice": {"type": "allowed_tools", "mode": "auto",
                            "tools": [{"type": "function", "name": "shell"}]},
            "tools": [{"type": "function", "name": "shell", "parameters": {}},
                      {"type": "function", "name": "edit", "parameters": {}}]});
        let turn = normalize_input(&json!([{"role": "user", "content": "fix it"}])).unwrap();
        let mut compact = turn.clone();
        compact.extend(normalize_input(&json!([{"type": "compaction_trigger"}])).unwrap());
        let normal = build_chat_request(&req, &[], &turn, &vllm()).unwrap().body;
        let summary = build_chat_request(&req, &[], &compact, &vllm())
            .unwrap()
            .body;
        assert_eq!(summary["messages"][0], normal["messages"][0]);
        assert!(normal["messages"][0]["content"]
            .as_str()
            .unwrap()
            .ends_with("only a JSON object."));
        assert_eq!(summary["tools"], normal["tools"]);
        assert_eq!(normal["tools"].as_array().map(Vec::len), Some(1));
        assert!(summary.get("response_format").is_none());
    }

    #[test]
    fn compaction_items_from_elsewhere_are_refused_with_their_path() {
        let err = normalize_input(&json!([
            {"role": "user", "content": "hi"},
            {"type": "compaction", "encrypted_content": "gAAAAABopenai"},
        ]))
        .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[1].encrypted_content"));
        assert_eq!(err.code.as_deref(), Some("invalid_encrypted_content"));
        let err = normalize_input(&json!([{"type": "compaction"}])).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0].encrypted_content"));
        let alias = normalize_input(&json!([{"type": "compaction_summary",
            "encrypted_content": crate::compaction::encode_compaction_blob("s")}]))
        .unwrap();
        assert_eq!(alias[0]["type"], "compaction");
    }

    #[test]
    fn later_turns_extend_earlier_prompts_without_rewriting_them() {
        let blob = encode_reasoning_blob("plan");
        let items = normalize_input(&json!([
            {"role": "developer", "content": "perms"},
            {"role": "user", "content": "ctx"},
            {"role": "user", "content": "fix the bug"},
            {"type": "reasoning", "summary": [], "encrypted_content": blob},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"role": "developer", "content": "mode changed"},
            {"type": "message", "role": "assistant", "content": "done"},
            {"role": "user", "content": "thanks"},
        ]))
        .unwrap();
        let req = json!({"instructions": "base"});
        let full = build_chat_request(&req, &items, &[], &vllm()).unwrap().body["messages"].clone();
        // Turn boundaries: after each user message or tool output.
        for cut in [2, 3, 6, 9] {
            let (history, input) = items.split_at(cut);
            let earlier = build_chat_request(&req, &[], history, &vllm())
                .unwrap()
                .body["messages"]
                .clone();
            let earlier = earlier.as_array().unwrap();
            assert_eq!(
                &full.as_array().unwrap()[..earlier.len()],
                earlier.as_slice(),
                "cut at {cut}"
            );
            let split = build_chat_request(&req, history, input, &vllm())
                .unwrap()
                .body["messages"]
                .clone();
            assert_eq!(split, full, "history/input split does not matter");
        }
    }

    #[test]
    fn include_flag_detects_encrypted_reasoning() {
        assert!(includes_encrypted_reasoning(
            &json!({"include": ["reasoning.encrypted_content"]})
        ));
        assert!(!includes_encrypted_reasoning(
            &json!({"include": ["message.output_text.logprobs"]})
        ));
        assert!(!includes_encrypted_reasoning(&json!({})));
    }

    #[test]
    fn reasoning_goes_back_under_the_names_each_engine_reads() {
        let input = normalize_input(&json!([
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "thought"}]},
            {"role": "assistant", "content": "hello"},
        ]))
        .unwrap();
        for (flavor, keys) in [
            (Flavor::Vllm, vec!["reasoning", "reasoning_content"]),
            (Flavor::Sglang, vec!["reasoning_content"]),
        ] {
            let plan = build_chat_request(&json!({}), &[], &input, &TranslateOptions::new(flavor))
                .unwrap();
            let answer = &plan.body["messages"][1];
            let present: Vec<&str> = ["reasoning", "reasoning_content"]
                .into_iter()
                .filter(|k| answer.get(*k) == Some(&json!("thought")))
                .collect();
            assert_eq!(present, keys, "{flavor:?}: {answer}");
        }
    }

    #[test]
    fn hosted_tool_reject_policy_answers_400() {
        let req = json!({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]});
        let opts = TranslateOptions {
            hosted_tools: HostedToolPolicy::Reject,
            ..TranslateOptions::new(Flavor::Vllm)
        };
        let err = build_chat_request(&req, &[], &[], &opts).unwrap_err();
        assert_eq!((err.status, err.param.as_deref()), (400, Some("tools[0]")));
    }

    #[test]
    fn invalid_fields_name_their_parameter() {
        let input = normalize_input(&json!("hi")).unwrap();
        for (req, param) in [
            (json!({"max_output_tokens": 0}), "max_output_tokens"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"instructions": 5}), "instructions"),
            (
                json!({"text": {"format": {"type": "json_schema", "schema": {}}}}),
                "text.format.name",
            ),
            (
                json!({"text": {"format": {"type": "grammar"}}}),
                "text.format.type",
            ),
        ] {
            let err = build_chat_request(&req, &[], &input, &vllm()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{req}");
        }
        let input = normalize_input(&json!([{"type": "item_reference", "id": "msg_1"}])).unwrap();
        let err = build_chat_request(&json!({}), &[], &input, &vllm()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0]"));
        let input = normalize_input(
            &json!([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
        )
        .unwrap();
        let err = build_chat_request(&json!({}), &[], &input, &vllm()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0].content[0].type"));
    }
}
