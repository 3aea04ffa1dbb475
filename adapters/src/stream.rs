//! Synthesis of Responses API streaming events from Chat Completions chunks.
//!
//! [`ResponseStream`] consumes engine chunks (vLLM / SGLang / OpenAI shapes) and produces the exact
//! Responses event sequence the official SDKs and Codex expect, with a gapless `sequence_number`
//! from 0 and consistent `output_index` / `content_index` / `item_id`:
//!
//! ```text
//! response.created, response.in_progress
//!   (a response that waits before it runs, a background one: response.created and
//!    response.queued with status `queued` when it is created, response.in_progress when it runs)
//! per reasoning item:  output_item.added, content_part.added (reasoning_text),
//!                      reasoning_text.delta*, reasoning_text.done, content_part.done, output_item.done
//! per message item:    output_item.added, content_part.added (output_text),
//!                      output_text.delta*, output_text.done, content_part.done, output_item.done
//! per tool call:       output_item.added (function_call), function_call_arguments.delta*,
//!                      function_call_arguments.done, output_item.done
//! per custom tool call: output_item.added (custom_tool_call), custom_tool_call_input.delta*
//!                      (the `input` argument decoded as it is written),
//!                      custom_tool_call_input.done, output_item.done
//! response.completed | response.incomplete | response.failed   (always last)
//! ```
//!
//! Reasoning comes from `delta.reasoning_content` (vLLM < 0.11, SGLang) or `delta.reasoning`
//! (vLLM >= 0.11). A reasoning or text item stays open until a delta of another kind arrives;
//! tool calls (one item per chat `tool_calls[].index`) stay open until text/reasoning arrives or
//! the stream ends, so interleaved argument deltas of parallel calls are all delivered. Under
//! `parallel_tool_calls: false` only the first call is kept (engines do not all enforce it).
//! Whitespace-only text while no message is open (the newlines a tool parser passes on around
//! calls) is held back: it opens a message only if other text follows, or if it is the whole
//! answer, so it never becomes a message of its own between two calls.
//! `finish_reason: "abort"` or `"error"` (vLLM: the engine aborted or failed the request) ends as
//! `failed`, code `server_error`. `finish_reason: "length"` ends as `incomplete` with `incomplete_details.reason =
//! "max_output_tokens"` (`content_filter` -> `"content_filter"`); a message or reasoning item
//! still open then gets status `incomplete` and its `done` events. A stream that fails or is
//! cancelled closes an open message or reasoning item the same way. In all three cases an open
//! tool call gets no `done` event: clients run a call once its item is done (Codex does
//! whatever its status says), and its arguments were cut short; the call is `incomplete` in
//! the final response's output, as an OpenAI response cut off mid-call lists it without a
//! `done` event. When the engine reports no `completion_tokens_details.reasoning_tokens` (nor
//! SGLang's top-level `reasoning_tokens`), or 0 while reasoning streamed, the number of
//! reasoning deltas is used as the count.

use crate::compaction::encode_compaction_blob;
use crate::error::is_context_overflow;
use crate::ids::new_item_id;
use crate::reasoning_blob::encode_reasoning_blob;
use crate::tools::ToolNameMap;
use serde_json::{json, Map, Value};
use std::collections::HashMap;

/// One server-sent event: `event: <event>` and `data: <data>` (data carries `type` == event and
/// `sequence_number`).
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    /// The event name (same as `data.type`).
    pub event: String,
    /// The JSON payload.
    pub data: Value,
}

impl SseEvent {
    /// The event framed for the wire: `event: ...\ndata: ...\n\n`.
    pub fn to_sse_frame(&self) -> String {
        format!("event: {}\ndata: {}\n\n", self.event, self.data)
    }
}

/// The status [`ResponseStream::close_calls`] takes for calls cut off by a failed or cancelled
/// stream (not a status any item carries).
const CUT_OFF: &str = "cut off";

/// The text-like item currently being streamed.
#[derive(Debug)]
enum OpenItem {
    Reasoning {
        output_index: usize,
        item_id: String,
        text: String,
    },
    Message {
        output_index: usize,
        item_id: String,
        text: String,
        /// The text's log probabilities, when the engine sends them.
        logprobs: Vec<Value>,
    },
}

/// A function call being streamed (keyed by the chat `tool_calls[].index`).
#[derive(Debug)]
struct OpenCall {
    output_index: Option<usize>,
    item_id: String,
    call_id: String,
    engine_name: String,
    arguments: String,
    closed: bool,
    /// A custom tool's call: a `custom_tool_call` item whose input is the `input` argument.
    custom: bool,
    /// Of a custom call: the input sent so far in `custom_tool_call_input.delta` events.
    input_sent: String,
}

/// Chat chunks -> Responses events for one response (see the module doc).
#[derive(Debug)]
pub struct ResponseStream {
    response: Value,
    tool_names: ToolNameMap,
    encrypted_reasoning: bool,
    next_sequence: u64,
    output: Vec<Value>,
    current: Option<OpenItem>,
    calls: Vec<OpenCall>,
    /// Every call before this index is closed ([`ResponseStream::close_calls`] starts here, so
    /// closing is linear in the calls opened, however often text and calls alternate).
    calls_closed: usize,
    call_by_index: HashMap<u64, usize>,
    finish_reason: Option<String>,
    engine_usage: Option<Value>,
    reasoning_deltas: u64,
    /// Output item ids given so far ([`ResponseStream::next_item_id`]).
    item_ids: u32,
    /// `response.created` has been emitted (by [`ResponseStream::queued`] or the start).
    created: bool,
    started: bool,
    ended: bool,
    /// `Some(summary so far)` for a compaction turn ([`ResponseStream::with_compaction`]).
    compaction: Option<String>,
    /// `parallel_tool_calls: false`: only the engine's first tool call becomes an item
    /// ([`ResponseStream::with_single_tool_call`]).
    single_tool_call: bool,
    /// Whitespace-only text that arrived while no message was open, held back: it opens a
    /// message only if text follows it, so a tool parser's newlines around calls do not become
    /// messages of their own between the calls.
    held_whitespace: String,
    /// The log probabilities of `held_whitespace`.
    held_logprobs: Vec<Value>,
}

/// The log probabilities of a chunk's content `text` (`choices[].logprobs.content`, as vLLM
/// and SGLang send them when asked), in the Responses shape: `{token, logprob, bytes,
/// top_logprobs: [{token, logprob, bytes}]}` (`bytes` from the token's text when the engine
/// sends none). The engine lists every token the chunk decoded: when the chunk also carries
/// reasoning or a tool call (`mixed`), only the trailing entries that spell `text` are its
/// (none if no run of them does); otherwise all are.
fn content_logprobs(choice: &Value, text: &str, mixed: bool) -> Vec<Value> {
    let Some(entries) = choice
        .pointer("/logprobs/content")
        .and_then(Value::as_array)
    else {
        return Vec::new();
    };
    fn token(e: &Value) -> &str {
        e.get("token").and_then(Value::as_str).unwrap_or_default()
    }
    let mut start = 0;
    if mixed {
        // The shortest run of trailing entries whose tokens spell `text`.
        let mut spelled = 0;
        start = entries.len();
        while start > 0 && spelled < text.len() {
            start -= 1;
            spelled += token(&entries[start]).len();
        }
        let run: String = entries[start..].iter().map(token).collect();
        if run != text {
            return Vec::new();
        }
    }
    let entries = &entries[start..];
    let entry = |e: &Value| {
        let token = e.get("token").and_then(Value::as_str).unwrap_or_default();
        let bytes = match e.get("bytes") {
            Some(Value::Array(bytes)) => Value::Array(bytes.clone()),
            _ => json!(token.as_bytes()),
        };
        let logprob = e.get("logprob").and_then(Value::as_f64).unwrap_or(0.0);
        (token.to_string(), logprob, bytes)
    };
    entries
        .iter()
        .map(|e| {
            let (token, logprob, bytes) = entry(e);
            let top: Vec<Value> = e
                .get("top_logprobs")
                .and_then(Value::as_array)
                .map(|top| {
                    top.iter()
                        .map(|t| {
                            let (token, logprob, bytes) = entry(t);
                            json!({"token": token, "logprob": logprob, "bytes": bytes})
                        })
                        .collect()
                })
                .unwrap_or_default();
            json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
        })
        .collect()
}

impl ResponseStream {
    /// `response` is the Response object skeleton (every key present, status "in_progress",
    /// output [], usage null); the stream fills output, usage, status, incomplete_details, error.
    pub fn new(response: Value, tool_names: ToolNameMap) -> Self {
        let mut response = match response {
            Value::Object(map) => Value::Object(map),
            _ => json!({}),
        };
        if let Some(object) = response.as_object_mut() {
            object.insert("status".into(), json!("in_progress"));
            object.insert("output".into(), json!([]));
        }
        ResponseStream {
            response,
            tool_names,
            encrypted_reasoning: false,
            next_sequence: 0,
            output: Vec::new(),
            current: None,
            calls: Vec::new(),
            calls_closed: 0,
            call_by_index: HashMap::new(),
            held_whitespace: String::new(),
            held_logprobs: Vec::new(),
            single_tool_call: false,
            finish_reason: None,
            engine_usage: None,
            reasoning_deltas: 0,
            item_ids: 0,
            created: false,
            started: false,
            ended: false,
            compaction: None,
        }
    }

    /// A compaction turn ([`crate::compaction`]): the engine's text is the summary, collected
    /// rather than streamed, and the output is one `compaction` item announced when the engine
    /// is done (`output_item.added`, `output_item.done`). Reasoning and tool calls are dropped.
    /// A summary cut short (token limit, content filter) still completes; no summary at all
    /// fails the turn (`compaction_failed`).
    pub fn with_compaction(mut self, enabled: bool) -> Self {
        self.compaction = enabled.then(String::new);
        self
    }

    /// `parallel_tool_calls: false`: a tool call after the engine's first is dropped (with a
    /// debug log line), as the client asked for at most one; engines do not all hold the model
    /// to it.
    pub fn with_single_tool_call(mut self, enabled: bool) -> Self {
        self.single_tool_call = enabled;
        self
    }

    /// Fill reasoning items' `encrypted_content` with the round-trip blob (set when the request's
    /// `include` lists `reasoning.encrypted_content`); otherwise it is `null`.
    pub fn with_encrypted_reasoning(mut self, enabled: bool) -> Self {
        self.encrypted_reasoning = enabled;
        self
    }

    /// `response.created` and `response.queued`, the response's status `queued`: for a response
    /// that waits before it runs. [`ResponseStream::start`] then announces only
    /// `response.in_progress`. Empty once created.
    pub fn queued(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if self.created {
            return events;
        }
        self.created = true;
        self.set_field("status", json!("queued"));
        self.emit_snapshot(&mut events, "response.created");
        self.emit_snapshot(&mut events, "response.queued");
        events
    }

    /// `response.created` (unless [`ResponseStream::queued`] announced it) and
    /// `response.in_progress` (empty if already started).
    pub fn start(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        self.start_into(&mut events);
        events
    }

    fn start_into(&mut self, events: &mut Vec<SseEvent>) {
        if self.started {
            return;
        }
        self.started = true;
        self.set_field("status", json!("in_progress"));
        if !self.created {
            self.created = true;
            self.emit_snapshot(events, "response.created");
        }
        self.emit_snapshot(events, "response.in_progress");
    }

    /// Translates one engine chunk; an error chunk ends the stream with `response.failed`.
    pub fn on_chunk(&mut self, chunk: &Value) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if self.ended {
            return events;
        }
        self.start_into(&mut events);
        if let Some(message) = engine_error_message(chunk) {
            let code = request_fault_code(chunk, &message).unwrap_or("server_error");
            events.extend(self.fail(code, &message));
            return events;
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.engine_usage = Some(usage.clone());
        }
        let choice = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|choices| {
                choices
                    .iter()
                    .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
            });
        let Some(choice) = choice else {
            return events;
        };
        if let (Some(summary), Some(delta)) = (self.compaction.as_mut(), choice.get("delta")) {
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                summary.push_str(text);
            }
        } else if let Some(delta) = choice.get("delta") {
            let reasoning = delta
                .get("reasoning_content")
                .and_then(Value::as_str)
                .or_else(|| delta.get("reasoning").and_then(Value::as_str))
                .filter(|s| !s.is_empty());
            if let Some(text) = reasoning {
                self.reasoning_delta(text, &mut events);
            }
            if let Some(text) = delta
                .get("content")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
            {
                // (SGLang sends `"tool_calls": null` in every chunk: not a tool call.)
                let calls = delta
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .is_some_and(|calls| !calls.is_empty());
                let mixed = reasoning.is_some() || calls;
                self.text_delta(text, content_logprobs(choice, text, mixed), &mut events);
            }
            if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                for (position, call) in calls.iter().enumerate() {
                    self.tool_call_delta(call, position as u64, &mut events);
                }
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_string());
        }
        events
    }

    /// Closes open parts/items and ends with `response.completed`, or `response.incomplete`
    /// when the engine stopped for length or content filtering, or `response.failed` when it
    /// reported the request aborted or failed (`finish_reason` `abort` or `error`).
    pub fn finish(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if self.ended {
            return events;
        }
        self.start_into(&mut events);
        // vLLM ends a request it aborted (engine shutdown or pause, an abort of the request, a
        // failed KV transfer) or failed with these, then `[DONE]`: what came is cut short.
        let cut_short = match self.finish_reason.as_deref() {
            Some("abort") => Some("The engine aborted the request before it finished; retry it."),
            Some("error") => Some("The engine failed while generating the response; retry it."),
            _ => None,
        };
        if let Some(message) = cut_short {
            events.extend(self.fail("server_error", message));
            return events;
        }
        if let Some(summary) = self.compaction.take() {
            if summary.trim().is_empty() {
                // Nothing to replace the history with (e.g. the whole budget went to reasoning).
                events.extend(self.fail(
                    "compaction_failed",
                    "The model wrote no summary for the compaction; the history was left as it was.",
                ));
                return events;
            }
            self.emit_compaction_item(&summary, &mut events);
            // A summary cut short (length, content filter) still replaces the history.
            self.finish_reason = None;
        }
        let incomplete_reason = match self.finish_reason.as_deref() {
            Some("length") => Some("max_output_tokens"),
            Some("content_filter") => Some("content_filter"),
            _ => None,
        };
        let item_status = if incomplete_reason.is_some() {
            "incomplete"
        } else {
            "completed"
        };
        // An answer of whitespace alone is still the answer, reasoning or not (whitespace
        // around tool calls is not one).
        let held = std::mem::take(&mut self.held_whitespace);
        let held_logprobs = std::mem::take(&mut self.held_logprobs);
        let answered = self.output.iter().any(|item| {
            item.get("type")
                .and_then(Value::as_str)
                .is_some_and(|kind| kind != "reasoning")
        });
        if !held.is_empty() && !answered {
            self.append_text(&held, held_logprobs, &mut events);
        }
        self.close_current(item_status, &mut events);
        // A call still open when the output budget ran out (or a filter stopped the model) was
        // cut off mid-arguments, as by a failure: no `done` event for it.
        self.close_calls(
            if incomplete_reason.is_some() {
                CUT_OFF
            } else {
                item_status
            },
            &mut events,
        );
        self.ended = true;
        self.finalize_response();
        let (event, status) = match incomplete_reason {
            Some(reason) => {
                self.set_field("incomplete_details", json!({"reason": reason}));
                ("response.incomplete", "incomplete")
            }
            None => ("response.completed", "completed"),
        };
        self.set_field("status", json!(status));
        if status == "completed" && self.response.get("completed_at").is_some() {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            self.set_field("completed_at", json!(now));
        }
        self.emit_snapshot(&mut events, event);
        events
    }

    /// Ends the stream with `response.failed` (`error: {code, message}`) as the last event; a
    /// message or reasoning item still open is closed first with status `incomplete` so the
    /// event log stays consistent; a tool call still open gets no `done` event (clients would
    /// run it), and is `incomplete` in the final response.
    pub fn fail(&mut self, code: &str, message: &str) -> Vec<SseEvent> {
        self.end_unsuccessful("failed", code, message)
    }

    /// End the stream because the response was cancelled: `response.failed` (the Responses
    /// stream has no other terminal event for it) carrying status `cancelled`, as the stored
    /// response says, and `error` with `code` and `message`.
    pub fn cancel(&mut self, code: &str, message: &str) -> Vec<SseEvent> {
        self.end_unsuccessful("cancelled", code, message)
    }

    /// `response.failed` with `status`. A response announced as queued that never ran goes
    /// straight there; one never announced is announced first.
    fn end_unsuccessful(&mut self, status: &str, code: &str, message: &str) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if self.ended {
            return events;
        }
        if !self.created {
            self.start_into(&mut events);
        }
        self.close_cut_off(&mut events);
        self.ended = true;
        self.finalize_response();
        self.set_field("status", json!(status));
        self.set_field("error", json!({"code": code, "message": message}));
        self.emit_snapshot(&mut events, "response.failed");
        events
    }

    /// The Response object as it stands (final after `finish`/`fail`).
    pub fn response(&self) -> &Value {
        &self.response
    }

    /// Output items so far (in-progress items as last announced, finished items complete).
    pub fn output_items(&self) -> &[Value] {
        &self.output
    }

    /// Whether the engine reported the request's usage (the response's `usage` is then the
    /// engine's count; otherwise zeros).
    pub fn reports_usage(&self) -> bool {
        self.engine_usage.is_some()
    }

    /// The cached prompt tokens the engine reported (`usage.prompt_tokens_details.cached_tokens`),
    /// `None` when it reported none: vLLM and SGLang leave the field out when nothing was
    /// cached, and always unless started with `--enable-prompt-tokens-details` /
    /// `--enable-cache-report`. The response's own `usage` says 0 then.
    pub fn engine_cached_tokens(&self) -> Option<u64> {
        self.engine_usage
            .as_ref()?
            .pointer("/prompt_tokens_details/cached_tokens")?
            .as_u64()
    }

    /// True once `finish` or `fail` has produced the terminal event.
    pub fn is_finished(&self) -> bool {
        self.ended
    }

    /// The one output item of a compaction turn.
    fn emit_compaction_item(&mut self, summary: &str, events: &mut Vec<SseEvent>) {
        let output_index = self.output.len();
        let item = json!({
            "id": self.next_item_id("cmp_"),
            "type": "compaction",
            "encrypted_content": encode_compaction_blob(summary),
        });
        self.output.push(item.clone());
        self.emit(
            events,
            "response.output_item.added",
            json!({"output_index": output_index, "item": item.clone()}),
        );
        self.emit(
            events,
            "response.output_item.done",
            json!({"output_index": output_index, "item": item}),
        );
    }

    fn emit(&mut self, events: &mut Vec<SseEvent>, kind: &str, fields: Value) {
        let mut data = Map::new();
        data.insert("type".into(), json!(kind));
        if let Value::Object(fields) = fields {
            data.extend(fields);
        }
        data.insert("sequence_number".into(), json!(self.next_sequence));
        self.next_sequence += 1;
        events.push(SseEvent {
            event: kind.to_string(),
            data: Value::Object(data),
        });
    }

    /// Emit `kind` carrying the Response object as it stands.
    fn emit_snapshot(&mut self, events: &mut Vec<SseEvent>, kind: &str) {
        let snapshot = self.response.clone();
        self.emit(events, kind, json!({"response": snapshot}));
    }

    fn set_field(&mut self, key: &str, value: Value) {
        if let Some(object) = self.response.as_object_mut() {
            object.insert(key.into(), value);
        }
    }

    /// Close whatever is open, add `item` to the output and announce it with its first content
    /// part; returns the item's output index.
    fn open_text_item(
        &mut self,
        item: Value,
        part: Value,
        item_id: &str,
        events: &mut Vec<SseEvent>,
    ) -> usize {
        self.close_current("completed", events);
        self.close_calls("completed", events);
        let output_index = self.output.len();
        self.output.push(item.clone());
        self.emit(
            events,
            "response.output_item.added",
            json!({"output_index": output_index, "item": item}),
        );
        self.emit(
            events,
            "response.content_part.added",
            json!({
                "item_id": item_id, "output_index": output_index, "content_index": 0,
                "part": part,
            }),
        );
        output_index
    }

    /// A new output item id, named after the response (`crate::ids::output_item_id`).
    fn next_item_id(&mut self, prefix: &str) -> String {
        let n = self.item_ids;
        self.item_ids = self.item_ids.wrapping_add(1);
        let response_id = self.response.get("id").and_then(Value::as_str);
        crate::ids::output_item_id(prefix, response_id.unwrap_or_default(), n)
    }

    fn reasoning_delta(&mut self, text: &str, events: &mut Vec<SseEvent>) {
        self.reasoning_deltas += 1;
        if !matches!(self.current, Some(OpenItem::Reasoning { .. })) {
            let item_id = self.next_item_id("rs_");
            let item = json!({
                "id": item_id, "type": "reasoning", "summary": [], "content": [],
                "encrypted_content": null, "status": "in_progress",
            });
            let part = json!({"type": "reasoning_text", "text": ""});
            let output_index = self.open_text_item(item, part, &item_id, events);
            self.current = Some(OpenItem::Reasoning {
                output_index,
                item_id,
                text: String::new(),
            });
        }
        if let Some(OpenItem::Reasoning {
            output_index,
            item_id,
            text: buffer,
        }) = &mut self.current
        {
            buffer.push_str(text);
            let fields = json!({
                "item_id": item_id, "output_index": *output_index, "content_index": 0, "delta": text,
            });
            self.emit(events, "response.reasoning_text.delta", fields);
        }
    }

    fn text_delta(&mut self, text: &str, logprobs: Vec<Value>, events: &mut Vec<SseEvent>) {
        let open = matches!(self.current, Some(OpenItem::Message { .. }));
        if !open && text.trim().is_empty() {
            self.held_whitespace.push_str(text);
            self.held_logprobs.extend(logprobs);
            return;
        }
        let held = std::mem::take(&mut self.held_whitespace);
        let mut held_logprobs = std::mem::take(&mut self.held_logprobs);
        match held.is_empty() {
            true => self.append_text(text, logprobs, events),
            false => {
                held_logprobs.extend(logprobs);
                self.append_text(&(held + text), held_logprobs, events)
            }
        }
    }

    /// Add `text` (with its log probabilities) to the open message, opening one first if none
    /// is.
    fn append_text(&mut self, text: &str, logprobs: Vec<Value>, events: &mut Vec<SseEvent>) {
        if !matches!(self.current, Some(OpenItem::Message { .. })) {
            let item_id = self.next_item_id("msg_");
            let item = json!({
                "id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
                "content": [],
            });
            let part =
                json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
            let output_index = self.open_text_item(item, part, &item_id, events);
            self.current = Some(OpenItem::Message {
                output_index,
                item_id,
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        if let Some(OpenItem::Message {
            output_index,
            item_id,
            text: buffer,
            logprobs: all,
        }) = &mut self.current
        {
            buffer.push_str(text);
            all.extend(logprobs.iter().cloned());
            let fields = json!({
                "item_id": item_id, "output_index": *output_index, "content_index": 0,
                "delta": text, "logprobs": logprobs,
            });
            self.emit(events, "response.output_text.delta", fields);
        }
    }

    fn tool_call_delta(&mut self, call: &Value, position: u64, events: &mut Vec<SseEvent>) {
        let index = call
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(position);
        // A delta naming another call id at an index whose call is already under way starts a
        // new call: some OpenAI-compatible servers send every call at index 0 (or none).
        let id = call
            .get("id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty());
        let known = self.call_by_index.get(&index).copied().filter(|&slot| {
            let another = self.calls.get(slot).is_some_and(|open| {
                open.output_index.is_some() && id.is_some_and(|id| id != open.call_id)
            });
            !another
        });
        // With parallel_tool_calls false, only the first call is kept.
        if known.is_none() && self.single_tool_call && !self.calls.is_empty() {
            tracing::debug!(
                tool_call_index = index,
                "parallel_tool_calls is false: dropping a tool call after the first"
            );
            return;
        }
        if known.is_some_and(|slot| self.calls.get(slot).is_some_and(|open| open.closed)) {
            // (Before anything is closed: the message written since goes on as one item.)
            tracing::warn!(
                tool_call_index = index,
                "engine sent tool-call arguments after the call was closed; ignoring them"
            );
            return;
        }
        self.held_whitespace.clear();
        self.held_logprobs.clear();
        self.close_current("completed", events);
        let function = call.get("function");
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let arguments = function
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let slot = match known {
            Some(slot) => slot,
            None => {
                let call_id = id
                    .map(str::to_string)
                    .unwrap_or_else(|| new_item_id("call_"));
                let item_id = self.next_item_id("fc_");
                self.calls.push(OpenCall {
                    output_index: None,
                    item_id,
                    call_id,
                    engine_name: String::new(),
                    arguments: String::new(),
                    closed: false,
                    custom: false,
                    input_sent: String::new(),
                });
                self.call_by_index.insert(index, self.calls.len() - 1);
                self.calls.len() - 1
            }
        };
        let Some(open) = self.calls.get_mut(slot) else {
            return;
        };
        if let Some(name) = name {
            if open.engine_name.is_empty() {
                open.engine_name = name.to_string();
            }
        }
        if open.output_index.is_none() {
            // Announce the item once the name is known; arguments seen before are replayed.
            open.arguments.push_str(arguments);
            if open.engine_name.is_empty() {
                return;
            }
            let output_index = self.output.len();
            open.output_index = Some(output_index);
            if self.tool_names.is_custom(&open.engine_name) {
                open.custom = true;
                // The same id under the custom call's prefix.
                open.item_id = open.item_id.replacen("fc_", "ctc_", 1);
            }
            let custom = open.custom;
            let buffered = open.arguments.clone();
            let item_id = open.item_id.clone();
            let item = self.call_item(slot, "in_progress", "");
            self.output.push(item.clone());
            self.emit(
                events,
                "response.output_item.added",
                json!({"output_index": output_index, "item": item}),
            );
            if custom {
                self.send_custom_input(slot, events);
            } else if !buffered.is_empty() {
                self.emit(
                    events,
                    "response.function_call_arguments.delta",
                    json!({
                        "item_id": item_id, "output_index": output_index, "delta": buffered,
                    }),
                );
            }
            return;
        }
        if arguments.is_empty() {
            return;
        }
        open.arguments.push_str(arguments);
        if open.custom {
            self.send_custom_input(slot, events);
            return;
        }
        let fields = json!({
            "item_id": open.item_id, "output_index": open.output_index, "delta": arguments,
        });
        self.emit(events, "response.function_call_arguments.delta", fields);
    }

    /// A custom call's input is the `input` string of its JSON arguments (`{"input": "..."}`):
    /// what of it has been written so far and not sent goes out as a
    /// `custom_tool_call_input.delta`. Arguments of another shape are sent whole at the end.
    fn send_custom_input(&mut self, slot: usize, events: &mut Vec<SseEvent>) {
        let Some(call) = self.calls.get_mut(slot) else {
            return;
        };
        let Some(output_index) = call.output_index else {
            return;
        };
        let Some(written) = cut_input(&call.arguments) else {
            return;
        };
        let Some(delta) = written.strip_prefix(call.input_sent.as_str()) else {
            return;
        };
        if delta.is_empty() {
            return;
        }
        let fields = json!({
            "item_id": call.item_id, "output_index": output_index, "delta": delta,
        });
        call.input_sent = written;
        self.emit(events, "response.custom_tool_call_input.delta", fields);
    }

    /// The output item of call `slot`: a `function_call` with `arguments`, or for a custom
    /// tool a `custom_tool_call` whose `input` is `arguments` (the input itself).
    fn call_item(&self, slot: usize, status: &str, arguments: &str) -> Value {
        let Some(call) = self.calls.get(slot) else {
            return Value::Null;
        };
        let tool = self.tool_names.resolve(&call.engine_name);
        let mut item = Map::new();
        item.insert("id".into(), json!(call.item_id));
        match call.custom {
            true => item.insert("type".into(), json!("custom_tool_call")),
            false => item.insert("type".into(), json!("function_call")),
        };
        item.insert("status".into(), json!(status));
        item.insert("call_id".into(), json!(call.call_id));
        item.insert("name".into(), json!(tool.name));
        if let Some(namespace) = tool.namespace {
            item.insert("namespace".into(), json!(namespace));
        }
        match call.custom {
            true => item.insert("input".into(), json!(arguments)),
            false => item.insert("arguments".into(), json!(arguments)),
        };
        Value::Object(item)
    }

    fn close_current(&mut self, status: &str, events: &mut Vec<SseEvent>) {
        match self.current.take() {
            None => {}
            Some(OpenItem::Reasoning {
                output_index,
                item_id,
                text,
            }) => {
                self.emit(events, "response.reasoning_text.done", json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0, "text": text,
                }));
                let part = json!({"type": "reasoning_text", "text": text});
                self.emit(events, "response.content_part.done", json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0, "part": part,
                }));
                let encrypted = if self.encrypted_reasoning {
                    json!(encode_reasoning_blob(&text))
                } else {
                    Value::Null
                };
                let item = json!({
                    "id": item_id, "type": "reasoning", "summary": [], "content": [part],
                    "encrypted_content": encrypted, "status": status,
                });
                self.store_item(output_index, item.clone());
                self.emit(
                    events,
                    "response.output_item.done",
                    json!({"output_index": output_index, "item": item}),
                );
            }
            Some(OpenItem::Message {
                output_index,
                item_id,
                text,
                logprobs,
            }) => {
                self.emit(
                    events,
                    "response.output_text.done",
                    json!({
                        "item_id": item_id, "output_index": output_index, "content_index": 0,
                        "text": text, "logprobs": logprobs,
                    }),
                );
                let part = json!({
                    "type": "output_text", "text": text, "annotations": [], "logprobs": logprobs,
                });
                self.emit(events, "response.content_part.done", json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0, "part": part,
                }));
                let item = json!({
                    "id": item_id, "type": "message", "status": status, "role": "assistant",
                    "content": [part],
                });
                self.store_item(output_index, item.clone());
                self.emit(
                    events,
                    "response.output_item.done",
                    json!({"output_index": output_index, "item": item}),
                );
            }
        }
    }

    fn close_calls(&mut self, status: &str, events: &mut Vec<SseEvent>) {
        let from = std::mem::replace(&mut self.calls_closed, self.calls.len());
        for slot in from..self.calls.len() {
            let Some(call) = self.calls.get_mut(slot) else {
                continue;
            };
            if call.closed {
                continue;
            }
            call.closed = true;
            let Some(output_index) = call.output_index else {
                tracing::warn!(call_id = %call.call_id, "engine sent a tool call without a function name; dropping it");
                continue;
            };
            let item_id = call.item_id.clone();
            if status == CUT_OFF {
                // The stream failed or was cancelled while the call's arguments were still
                // coming: no `*.done` event, since clients run a tool call when its item is
                // done (Codex does, whatever its status) and these arguments are cut short.
                // The final response lists it `incomplete`.
                let arguments = if call.custom {
                    custom_input(&call.arguments)
                } else {
                    call.arguments.clone()
                };
                let item = self.call_item(slot, "incomplete", &arguments);
                self.store_item(output_index, item);
                continue;
            }
            if call.custom {
                let input = custom_input(&call.arguments);
                // What the deltas have not carried yet (all of it when the arguments were not
                // `{"input": ...}`); the done event carries the whole input either way.
                let rest = input
                    .strip_prefix(call.input_sent.as_str())
                    .unwrap_or_default()
                    .to_string();
                let item = self.call_item(slot, status, &input);
                if !rest.is_empty() {
                    self.emit(
                        events,
                        "response.custom_tool_call_input.delta",
                        json!({
                            "item_id": item_id, "output_index": output_index, "delta": rest,
                        }),
                    );
                }
                self.emit(
                    events,
                    "response.custom_tool_call_input.done",
                    json!({
                        "item_id": item_id, "output_index": output_index, "input": input,
                    }),
                );
                self.store_item(output_index, item.clone());
                self.emit(
                    events,
                    "response.output_item.done",
                    json!({"output_index": output_index, "item": item}),
                );
                continue;
            }
            let arguments = call.arguments.clone();
            let item = self.call_item(slot, status, &arguments);
            let name = item.get("name").cloned().unwrap_or(Value::Null);
            self.emit(events, "response.function_call_arguments.done", json!({
                "item_id": item_id, "output_index": output_index, "name": name, "arguments": arguments,
            }));
            self.store_item(output_index, item.clone());
            self.emit(
                events,
                "response.output_item.done",
                json!({"output_index": output_index, "item": item}),
            );
        }
    }

    /// Close what is open as a stream that failed or was cancelled: a message or reasoning
    /// item is done `incomplete`; a tool call is left without a `done` event ([`CUT_OFF`]).
    fn close_cut_off(&mut self, events: &mut Vec<SseEvent>) {
        self.close_current("incomplete", events);
        self.close_calls(CUT_OFF, events);
    }

    fn store_item(&mut self, output_index: usize, item: Value) {
        if let Some(slot) = self.output.get_mut(output_index) {
            *slot = item;
        }
    }

    fn finalize_response(&mut self) {
        let output = Value::Array(self.output.clone());
        self.set_field("output", output);
        let usage = self.usage();
        self.set_field("usage", usage);
    }

    fn usage(&self) -> Value {
        let usage = self.engine_usage.as_ref();
        let number = |path: &[&str]| -> Option<u64> {
            let mut value = usage?;
            for key in path {
                value = value.get(*key)?;
            }
            value.as_u64()
        };
        let input = number(&["prompt_tokens"]).unwrap_or(0);
        let output = number(&["completion_tokens"]).unwrap_or(0);
        let cached = number(&["prompt_tokens_details", "cached_tokens"]).unwrap_or(0);
        // SGLang reports its count at the top level of `usage`, and 0 when it did not count
        // (no reasoning parser asked for it) even though reasoning streamed: a 0 against
        // streamed reasoning is no count. Part of the output: never more than that.
        let reasoning = number(&["completion_tokens_details", "reasoning_tokens"])
            .or_else(|| number(&["reasoning_tokens"]))
            .filter(|&n| n > 0 || self.reasoning_deltas == 0)
            .unwrap_or(self.reasoning_deltas)
            .min(output);
        let total = number(&["total_tokens"]).unwrap_or(input.saturating_add(output));
        // Engines report no cache writes (their prefix caches keep what they compute, but
        // say nothing of it), so `cache_write_tokens` is always 0.
        json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": total,
        })
    }
}

/// An engine failure reported inside its stream by a chunk that carries no output: an error
/// chunk, or a choice that ends `abort` or `error` with nothing in its delta (vLLM and SGLang
/// end a request this way when the engine fails or drains before it produced anything). Such
/// a chunk before the first output leaves the request free to run again elsewhere. Its message.
pub fn failure_without_output(chunk: &Value) -> Option<String> {
    if let Some(message) = engine_error_message(chunk) {
        // A fault of the request the engine reports in its stream (SGLang sends some of its
        // validation errors so, coded 4xx) would fail alike anywhere: not a failed engine.
        if request_fault_code(chunk, &message).is_some() {
            return None;
        }
        return Some(format!(
            "the engine reported an error in its stream: {message}"
        ));
    }
    let choice = chunk.get("choices")?.as_array()?.first()?;
    let reason = choice.get("finish_reason")?.as_str()?;
    if !matches!(reason, "abort" | "error") || carries_output(chunk) {
        return None;
    }
    Some(format!(
        "the engine ended the request ({reason}) before any output"
    ))
}

/// The message of an engine error chunk that reports the prompt over the context window
/// (SGLang reports it so once a streaming request's stream started).
pub fn context_overflow_in_chunk(chunk: &Value) -> Option<String> {
    engine_error_message(chunk).filter(|message| is_context_overflow(message))
}

/// Whether an engine chunk carries output: text, reasoning or a tool call. vLLM's first chunk
/// (the assistant role, empty content) does not; it comes just before the first token, and
/// also before the `abort` of a request that never had one.
pub fn carries_output(chunk: &Value) -> bool {
    let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
        return false;
    };
    let carries = |delta: &Value, key: &str| match delta.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    choices.iter().filter_map(|c| c.get("delta")).any(|delta| {
        ["content", "reasoning_content", "reasoning", "tool_calls"]
            .iter()
            .any(|key| carries(delta, key))
    })
}

/// The `error.code` of an error chunk (whose message is `message`) that reports a fault of the
/// request rather than of the engine: `context_length_exceeded` for a prompt over the context
/// window (as OpenAI codes it, and as Codex needs to compact), `invalid_prompt` for another
/// error coded 4xx (OpenAI's code for a request the model cannot run, which Codex does not
/// send again; it retries a stream that fails with any code it does not know); `None` for an
/// engine failure.
pub(crate) fn request_fault_code(chunk: &Value, message: &str) -> Option<&'static str> {
    if is_context_overflow(message) {
        return Some("context_length_exceeded");
    }
    if is_engine_death(message) {
        return None;
    }
    let status = chunk
        .get("error")
        .and_then(|e| e.get("code"))
        .or_else(|| chunk.get("code"))
        .and_then(Value::as_u64);
    status
        .is_some_and(|c| (400..500).contains(&c))
        .then_some("invalid_prompt")
}

/// Whether an engine error's message says the engine itself died, whatever the error's code:
/// vLLM before 0.12 codes every error raised inside its stream 400 (`BadRequestError`),
/// including the `EngineDeadError` every request in flight gets when its engine core crashes,
/// and vLLM's V0 engine said `Background loop has errored`. Such a request runs again
/// elsewhere if nothing of it was sent, and fails as the server's fault otherwise.
fn is_engine_death(message: &str) -> bool {
    const DEATHS: [&str; 3] = [
        "EngineCore encountered an issue",
        "EngineDeadError",
        "Background loop has errored",
    ];
    DEATHS.iter().any(|death| message.contains(death))
}

/// The message of an engine error delivered inside the stream (`{"error": {...}}` or
/// `{"object": "error", "message": ...}`), if this chunk is one.
pub(crate) fn engine_error_message(chunk: &Value) -> Option<String> {
    if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| error.to_string());
        return Some(message);
    }
    if chunk.get("object").and_then(Value::as_str) == Some("error") {
        let message = chunk
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("engine reported an error")
            .to_string();
        return Some(message);
    }
    None
}

/// A custom tool's input from the arguments the engine wrote for its one-string function:
/// `{"input": "..."}`, or what there is of its string when the arguments were cut short
/// (`{"input": "print(1` is `print(1`); arguments that are not such an object (a model that
/// wrote the text itself) are the input as they are.
fn custom_input(arguments: &str) -> String {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(object)) => match object.get("input") {
            Some(Value::String(input)) => input.clone(),
            _ => arguments.to_string(),
        },
        Ok(Value::String(input)) => input,
        _ => cut_input(arguments).unwrap_or_else(|| arguments.to_string()),
    }
}

/// The decoded start of the `input` string of arguments `{"input": "...` cut short.
fn cut_input(arguments: &str) -> Option<String> {
    let rest = arguments.trim_start().strip_prefix('{')?.trim_start();
    let rest = rest.strip_prefix("\"input\"")?.trim_start();
    let rest = rest.strip_prefix(':')?.trim_start();
    let body = rest.strip_prefix('"')?;
    // The string as written so far, closed: dropping a half-written escape at the cut.
    let mut end = body.len();
    loop {
        let candidate = format!("\"{}\"", &body[..end]);
        if let Ok(Value::String(text)) = serde_json::from_str::<Value>(&candidate) {
            return Some(text);
        }
        // At most a `\uXXXX` (six bytes) is half-written; back off over it.
        if body.len() - end >= 6 || end == 0 {
            return None;
        }
        end -= 1;
        while !body.is_char_boundary(end) {
            end -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolName;

    #[test]
    fn failures_without_output_are_told_from_output() {
        let err = json!({"error": {"message": "EngineDeadError", "code": 500}});
        assert!(failure_without_output(&err)
            .unwrap()
            .contains("EngineDeadError"));
        let flat = json!({"object": "error", "message": "engine busy"});
        assert!(failure_without_output(&flat).is_some());
        // The request's own fault would fail anywhere: not retried.
        let invalid = json!({"object": "error", "message": "bad schema", "code": 400});
        assert_eq!(failure_without_output(&invalid), None);
        let long = json!({"error": {"message": "The input (9000 tokens) is longer than the model's context length (8192 tokens).", "code": 500}});
        assert_eq!(failure_without_output(&long), None);
        // vLLM before 0.12 codes a dead engine core 400 like a bad request: still the engine's.
        let dead = json!({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", "type": "BadRequestError", "param": null, "code": 400}});
        assert!(failure_without_output(&dead).is_some());
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = stream.on_chunk(&dead);
        assert_eq!(events.last().unwrap().event, "response.failed");
        assert_eq!(stream.response()["error"]["code"], "server_error");
        let abort =
            json!({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "abort"}]});
        assert!(failure_without_output(&abort).is_some());
        // Output, or an ordinary end, is not such a failure.
        let cut = json!({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": "abort"}]});
        assert_eq!(failure_without_output(&cut), None);
        let first =
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
        assert_eq!(failure_without_output(&first), None);
        let stop = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        assert_eq!(failure_without_output(&stop), None);
        assert!(!carries_output(&first) && !carries_output(&abort) && carries_output(&cut));
        let call = json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]});
        assert!(carries_output(&call));
    }

    fn skeleton() -> Value {
        json!({
            "id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress",
            "error": null, "incomplete_details": null, "instructions": null, "model": "m",
            "output": [], "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
            "usage": null,
        })
    }

    fn chunk(delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    }

    fn usage_chunk(prompt: u64, completion: u64, cached: u64) -> Value {
        json!({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
        })
    }

    fn run(stream: &mut ResponseStream, chunks: &[Value]) -> Vec<SseEvent> {
        let mut events = stream.start();
        for chunk in chunks {
            events.extend(stream.on_chunk(chunk));
        }
        events.extend(stream.finish());
        events
    }

    /// Rebuilds the output the way an SDK client does and checks every structural invariant;
    /// returns the rebuilt output items.
    fn replay(events: &[SseEvent]) -> Vec<Value> {
        assert!(events.len() >= 3);
        for (n, event) in events.iter().enumerate() {
            assert_eq!(
                event.data["sequence_number"],
                json!(n),
                "gapless sequence at {n}"
            );
            assert_eq!(event.data["type"], json!(event.event));
        }
        assert_eq!(events[0].event, "response.created");
        assert_eq!(events[1].event, "response.in_progress");
        let terminal = [
            "response.completed",
            "response.incomplete",
            "response.failed",
        ];
        for event in &events[..events.len() - 1] {
            assert!(
                !terminal.contains(&event.event.as_str()),
                "terminal event before the end"
            );
        }
        let last = events.last().unwrap();
        assert!(terminal.contains(&last.event.as_str()));

        let mut output: Vec<Value> = Vec::new();
        let mut done: Vec<bool> = Vec::new();
        for event in &events[2..events.len() - 1] {
            let data = &event.data;
            let index = data["output_index"].as_u64().unwrap() as usize;
            if event.event == "response.output_item.added" {
                assert_eq!(index, output.len(), "items are added in output_index order");
                output.push(data["item"].clone());
                done.push(false);
                continue;
            }
            assert!(!done[index], "{} after output_item.done", event.event);
            let item = &mut output[index];
            if event.event != "response.output_item.done" {
                assert_eq!(data["item_id"], item["id"], "item_id matches output_index");
            }
            match event.event.as_str() {
                "response.content_part.added" => {
                    let parts = item["content"].as_array_mut().unwrap();
                    assert_eq!(data["content_index"], json!(parts.len()));
                    parts.push(data["part"].clone());
                }
                "response.output_text.delta" | "response.reasoning_text.delta" => {
                    let ci = data["content_index"].as_u64().unwrap() as usize;
                    let part = &mut item["content"][ci];
                    let text = format!(
                        "{}{}",
                        part["text"].as_str().unwrap(),
                        data["delta"].as_str().unwrap()
                    );
                    part["text"] = json!(text);
                    if let (Some(all), Some(more)) = (
                        part.get_mut("logprobs").and_then(Value::as_array_mut),
                        data["logprobs"].as_array(),
                    ) {
                        all.extend(more.iter().cloned());
                    }
                }
                "response.output_text.done" | "response.reasoning_text.done" => {
                    let ci = data["content_index"].as_u64().unwrap() as usize;
                    assert_eq!(item["content"][ci]["text"], data["text"]);
                }
                "response.content_part.done" => {
                    let ci = data["content_index"].as_u64().unwrap() as usize;
                    assert_eq!(item["content"][ci], data["part"]);
                }
                "response.function_call_arguments.delta" => {
                    let text = format!(
                        "{}{}",
                        item["arguments"].as_str().unwrap(),
                        data["delta"].as_str().unwrap()
                    );
                    item["arguments"] = json!(text);
                }
                "response.function_call_arguments.done" => {
                    assert_eq!(item["arguments"], data["arguments"]);
                    assert_eq!(item["name"], data["name"]);
                }
                "response.output_item.done" => {
                    let final_item = &data["item"];
                    let mut built = item.clone();
                    if let Some(status) = final_item.get("status") {
                        built["status"] = status.clone();
                    }
                    if final_item.get("encrypted_content").is_some() {
                        built["encrypted_content"] = final_item["encrypted_content"].clone();
                    }
                    assert_eq!(&built, final_item, "deltas add up to the finished item");
                    *item = final_item.clone();
                    done[index] = true;
                }
                other => panic!("unexpected event {other}"),
            }
        }
        // A failed stream leaves a tool call open (clients would run it once done); the final
        // response lists it `incomplete`.
        for (n, (item, done)) in output.iter_mut().zip(&done).enumerate() {
            let call = matches!(
                item["type"].as_str(),
                Some("function_call" | "custom_tool_call")
            );
            if !done && call && last.event == "response.failed" {
                let listed = &last.data["response"]["output"][n];
                assert_eq!(listed["status"], "incomplete");
                assert_eq!(
                    (&listed["type"], &listed["id"]),
                    (&item["type"], &item["id"])
                );
                if item["type"] == "function_call" {
                    assert_eq!(listed["arguments"], item["arguments"], "the deltas sent");
                }
                *item = listed.clone();
                continue;
            }
            assert!(*done, "every item is closed before the terminal event");
        }
        assert_eq!(
            last.data["response"]["output"],
            json!(output),
            "final response matches the events"
        );
        output
    }

    #[test]
    fn a_compaction_turn_answers_with_one_compaction_item_holding_the_summary() {
        let stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let mut stream = stream.with_compaction(true);
        let events = run(
            &mut stream,
            &[
                chunk(
                    json!({"role": "assistant", "reasoning_content": "hmm"}),
                    None,
                ),
                chunk(json!({"content": "Goal: parser. "}), None),
                chunk(
                    json!({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                             "function": {"name": "shell", "arguments": "{}"}}]}),
                    None,
                ),
                chunk(json!({"content": "Next: docs"}), Some("length")),
                usage_chunk(100, 9, 64),
            ],
        );
        let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.output_item.done",
                "response.completed",
            ],
            "a summary cut at the token limit still completes"
        );
        let output = replay(&events);
        assert_eq!(output.len(), 1);
        assert_eq!(output[0]["type"], "compaction");
        assert!(output[0]["id"].as_str().unwrap().starts_with("cmp_"));
        let blob = output[0]["encrypted_content"].as_str().unwrap();
        assert_eq!(
            crate::compaction::decode_compaction_blob(blob).as_deref(),
            Some("Goal: parser. Next: docs")
        );
        assert_eq!(stream.response()["usage"]["output_tokens"], 9);
        // No summary at all (the budget went to reasoning): the turn fails, with no item.
        let mut empty = ResponseStream::new(skeleton(), ToolNameMap::new()).with_compaction(true);
        let events = run(
            &mut empty,
            &[chunk(
                json!({"reasoning_content": "thinking"}),
                Some("length"),
            )],
        );
        assert_eq!(events.last().unwrap().event, "response.failed");
        assert_eq!(empty.response()["error"]["code"], "compaction_failed");
        assert_eq!(replay(&events), Vec::<Value>::new());
        // A failure yields no item.
        let mut failing = ResponseStream::new(skeleton(), ToolNameMap::new()).with_compaction(true);
        let mut events = failing.start();
        events.extend(failing.on_chunk(&chunk(json!({"content": "Goal"}), None)));
        events.extend(failing.fail("server_error", "engine gone"));
        assert_eq!(replay(&events), Vec::<Value>::new());
    }

    #[test]
    fn plain_text_stream() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                chunk(json!({"role": "assistant", "content": ""}), None),
                chunk(json!({"content": "Hel"}), None),
                chunk(json!({"content": "lo"}), None),
                chunk(json!({"content": ""}), Some("stop")),
                usage_chunk(10, 2, 8),
            ],
        );
        let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        assert_eq!(
            kinds,
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(events[0].data["response"]["status"], "in_progress");
        assert_eq!(events[0].data["response"]["output"], json!([]));
        assert_eq!(events[4].data["logprobs"], json!([]));
        let output = replay(&events);
        assert_eq!(output.len(), 1);
        assert_eq!(output[0]["type"], "message");
        assert_eq!(output[0]["status"], "completed");
        assert_eq!(
            output[0]["content"][0],
            json!({"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []})
        );
        let response = stream.response();
        assert_eq!(response["status"], "completed");
        assert_eq!(
            response["usage"],
            json!({
                "input_tokens": 10, "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
                "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12,
            })
        );
        assert_eq!(response, &events.last().unwrap().data["response"]);
        assert_eq!(stream.output_items(), output.as_slice());
        assert!(stream.finish().is_empty(), "finish is idempotent");
    }

    #[test]
    fn the_engines_log_probabilities_go_with_the_text() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let with_logprobs = |text: &str, logprob: f64| {
            json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null,
                "logprobs": {"content": [{"token": text, "logprob": logprob,
                    "bytes": text.as_bytes(),
                    "top_logprobs": [{"token": text, "logprob": logprob}, {"token": "x", "logprob": -3.0, "bytes": null}]}]}}]})
        };
        let events = run(
            &mut stream,
            &[
                with_logprobs("\n", -0.5),
                with_logprobs("Hi", -0.1),
                chunk(json!({}), Some("stop")),
            ],
        );
        let deltas: Vec<&SseEvent> = events
            .iter()
            .filter(|e| e.event == "response.output_text.delta")
            .collect();
        // The held newline opens the message with the text after it, its logprob first.
        assert_eq!(deltas.len(), 1);
        assert_eq!(deltas[0].data["delta"], "\nHi");
        let tokens: Vec<&Value> = deltas[0].data["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| &l["token"])
            .collect();
        assert_eq!(tokens, ["\n", "Hi"]);
        let part = &replay(&events)[0]["content"][0];
        assert_eq!(part["logprobs"], deltas[0].data["logprobs"]);

        // A chunk ending the reasoning and starting the answer lists both's tokens: the
        // answer's are the trailing ones that spell it.
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let entry = |token: &str| json!({"token": token, "logprob": -0.2});
        let events = run(
            &mut stream,
            &[
                json!({"choices": [{"index": 0, "finish_reason": null,
                    "delta": {"reasoning_content": "Hm.", "content": "Yes!"},
                    "logprobs": {"content": [entry("Hm"), entry("."), entry("Yes"), entry("!")]}}]}),
                chunk(json!({}), Some("stop")),
            ],
        );
        let output = replay(&events);
        let tokens: Vec<&Value> = output[1]["content"][0]["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| &l["token"])
            .collect();
        assert_eq!(tokens, ["Yes", "!"]);

        // A chunk whose token does not spell its text (a byte-fallback token of a character
        // split over two tokens), with SGLang's `"tool_calls": null`: a plain text chunk, its
        // logprobs kept.
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                json!({"choices": [{"index": 0, "finish_reason": null,
                    "delta": {"content": "é", "tool_calls": null},
                    "logprobs": {"content": [entry("<0xC3>"), entry("<0xA9>")]}}]}),
                chunk(json!({}), Some("stop")),
            ],
        );
        let output = replay(&events);
        assert_eq!(
            output[0]["content"][0]["logprobs"].as_array().map(Vec::len),
            Some(2)
        );
        assert_eq!(
            part["logprobs"][1],
            json!({"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
                {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                {"token": "x", "logprob": -3.0, "bytes": [120]}]})
        );
    }

    #[test]
    fn sglangs_top_level_reasoning_count_is_read() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        run(
            &mut stream,
            &[
                chunk(json!({"reasoning_content": "Hm."}), None),
                chunk(json!({"content": "Yes"}), Some("stop")),
                json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9,
                       "total_tokens": 14, "reasoning_tokens": 7}}),
            ],
        );
        let usage = &stream.response()["usage"];
        assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 7);

        // SGLang writes 0 when it did not count: the streamed reasoning is counted instead.
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        run(
            &mut stream,
            &[
                chunk(json!({"reasoning_content": "Hm."}), None),
                chunk(json!({"reasoning_content": " Ok."}), None),
                chunk(json!({"content": "Yes"}), Some("stop")),
                json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                       "total_tokens": 8, "reasoning_tokens": 0}}),
            ],
        );
        let usage = &stream.response()["usage"];
        assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 2);
    }

    #[test]
    fn reasoning_then_text_with_encrypted_content() {
        let mut stream =
            ResponseStream::new(skeleton(), ToolNameMap::new()).with_encrypted_reasoning(true);
        let events = run(
            &mut stream,
            &[
                chunk(json!({"role": "assistant", "content": ""}), None),
                chunk(json!({"reasoning_content": "Let me "}), None),
                chunk(json!({"reasoning": "think."}), None),
                chunk(json!({"content": "Answer"}), None),
                chunk(json!({}), Some("stop")),
                json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}),
            ],
        );
        let output = replay(&events);
        assert_eq!(output.len(), 2);
        assert_eq!(output[0]["type"], "reasoning");
        assert_eq!(
            output[0]["content"],
            json!([{"type": "reasoning_text", "text": "Let me think."}])
        );
        assert_eq!(output[0]["summary"], json!([]));
        let blob = output[0]["encrypted_content"].as_str().unwrap();
        assert_eq!(
            crate::decode_reasoning_blob(blob).as_deref(),
            Some("Let me think.")
        );
        assert_eq!(output[1]["content"][0]["text"], "Answer");
        assert_eq!(
            events
                .iter()
                .filter(|e| e.event == "response.reasoning_text.delta")
                .count(),
            2
        );
        let usage = &stream.response()["usage"];
        assert_eq!(
            usage["output_tokens_details"]["reasoning_tokens"], 2,
            "counted from deltas"
        );
        assert_eq!(
            usage["input_tokens_details"]["cached_tokens"], 0,
            "0 when absent"
        );
    }

    #[test]
    fn a_custom_tools_input_is_its_input_argument_or_the_text_as_written() {
        assert_eq!(
            custom_input(r#"{"input": "*** Begin Patch"}"#),
            "*** Begin Patch"
        );
        assert_eq!(custom_input(r#""quoted""#), "quoted");
        // Cut short (the output limit, a failed stream): the string so far, decoded.
        assert_eq!(
            custom_input(r#"{"input": "print(1)\nx = "#),
            "print(1)\nx = "
        );
        assert_eq!(custom_input(r#"{"input":"tab\"#), "tab");
        assert_eq!(custom_input(r#"{"input":"caf\u00"#), "caf");
        assert_eq!(custom_input(r#"{"input": "#), r#"{"input": "#);
        assert_eq!(custom_input("*** Begin Patch"), "*** Begin Patch");
        assert_eq!(custom_input(r#"{"other": 1}"#), r#"{"other": 1}"#);
    }

    #[test]
    fn a_custom_calls_input_streams_as_it_is_written() {
        let mut names = ToolNameMap::new();
        let engine_name = names.insert_custom(ToolName::plain("apply_patch"));
        let piece = |name: Option<&str>, arguments: &str| {
            let mut function = json!({"arguments": arguments});
            if let Some(name) = name {
                function["name"] = json!(name);
            }
            json!({"tool_calls": [{"index": 0, "id": "call_p", "type": "function", "function": function}]})
        };
        let mut stream = ResponseStream::new(skeleton(), names);
        let events = run(
            &mut stream,
            &[
                chunk(piece(Some(&engine_name), r#"{"inp"#), None),
                chunk(piece(None, r#"ut": "*** Begin"#), None),
                chunk(piece(None, r#" Patch\n-x = \"caf\u00"#), None),
                chunk(piece(None, r#"e9\"\n*** End Patch"}"#), Some("tool_calls")),
            ],
        );
        let input = "*** Begin Patch\n-x = \"caf\u{e9}\"\n*** End Patch";
        let deltas: Vec<&str> = events
            .iter()
            .filter(|e| e.event == "response.custom_tool_call_input.delta")
            .map(|e| e.data["delta"].as_str().unwrap())
            .collect();
        assert_eq!(
            deltas,
            ["*** Begin", " Patch\n-x = \"caf", "\u{e9}\"\n*** End Patch"],
            "each piece as it is written; a half-written escape waits for its end"
        );
        let done: Vec<&Value> = events
            .iter()
            .filter(|e| e.event == "response.custom_tool_call_input.done")
            .map(|e| &e.data["input"])
            .collect();
        assert_eq!(done, [&json!(input)]);
        assert_eq!(stream.response()["output"][0]["input"], input);
        // Arguments that are not `{"input": ...}` are sent whole once the call ends.
        let mut names = ToolNameMap::new();
        let engine_name = names.insert_custom(ToolName::plain("apply_patch"));
        let mut stream = ResponseStream::new(skeleton(), names);
        let events = run(
            &mut stream,
            &[
                chunk(piece(Some(&engine_name), "*** Begin"), None),
                chunk(piece(None, " Patch"), Some("tool_calls")),
            ],
        );
        let deltas: Vec<&str> = events
            .iter()
            .filter(|e| e.event == "response.custom_tool_call_input.delta")
            .map(|e| e.data["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, ["*** Begin Patch"]);
    }

    #[test]
    fn whitespace_around_tool_calls_opens_no_message() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("f"));
        let call = |index: u64, id: &str| {
            json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]})
        };
        let mut stream = ResponseStream::new(skeleton(), names);
        let events = run(
            &mut stream,
            &[
                chunk(json!({"content": "\n"}), None),
                chunk(call(0, "call_a"), None),
                chunk(json!({"content": "\n\n"}), None),
                chunk(call(1, "call_b"), None),
                chunk(json!({"content": "\n"}), Some("tool_calls")),
            ],
        );
        let output = replay(&events);
        let kinds: Vec<&str> = output.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["function_call", "function_call"]);

        // Whitespace followed by text is kept with it; whitespace alone is still an answer.
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                chunk(json!({"content": "\n "}), None),
                chunk(json!({"content": "Hi"}), Some("stop")),
            ],
        );
        assert_eq!(replay(&events)[0]["content"][0]["text"], "\n Hi");
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(&mut stream, &[chunk(json!({"content": " "}), Some("stop"))]);
        assert_eq!(replay(&events)[0]["content"][0]["text"], " ");
        // After reasoning too.
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                chunk(json!({"reasoning_content": "Nothing to say."}), None),
                chunk(json!({"content": "\n"}), Some("stop")),
            ],
        );
        let output = replay(&events);
        let kinds: Vec<&str> = output.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["reasoning", "message"]);
        assert_eq!(output[1]["content"][0]["text"], "\n");
    }

    #[test]
    fn arguments_for_a_closed_call_leave_the_message_after_it_whole() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("f"));
        let mut stream = ResponseStream::new(skeleton(), names);
        let events = run(
            &mut stream,
            &[
                chunk(
                    json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]}),
                    None,
                ),
                chunk(json!({"content": "Done."}), None),
                chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}),
                    None,
                ),
                chunk(json!({"content": " More."}), Some("stop")),
            ],
        );
        let output = replay(&events);
        let kinds: Vec<&str> = output.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["function_call", "message"], "{output:?}");
        assert_eq!(output[0]["arguments"], "{}");
        assert_eq!(output[1]["content"][0]["text"], "Done. More.");
    }

    #[test]
    fn without_parallel_tool_calls_only_the_first_call_is_kept() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("a"));
        names.insert(ToolName::plain("b"));
        let mut stream = ResponseStream::new(skeleton(), names).with_single_tool_call(true);
        let call = |index: u64, name: Option<&str>, args: &str| {
            let mut delta = json!({"index": index, "function": {"arguments": args}});
            if let Some(name) = name {
                delta["id"] = json!(format!("call-{index}"));
                delta["function"]["name"] = json!(name);
            }
            chunk(json!({"tool_calls": [delta]}), None)
        };
        let events = run(
            &mut stream,
            &[
                call(0, Some("a"), "{\"x\":"),
                call(1, Some("b"), "{}"),
                call(0, None, " 1}"),
                chunk(json!({}), Some("tool_calls")),
                usage_chunk(10, 5, 0),
            ],
        );
        let output = replay(&events);
        assert_eq!(output.len(), 1, "{output:?}");
        assert_eq!(output[0]["name"], "a");
        assert_eq!(output[0]["arguments"], "{\"x\": 1}");
        assert_eq!(stream.response()["output"], json!(output));
    }

    #[test]
    fn calls_sent_at_one_index_under_new_ids_are_separate_calls() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("read"));
        let call = |id: Option<&str>, name: Option<&str>, args: &str| {
            let mut delta = json!({"index": 0, "function": {"arguments": args}});
            if let Some(id) = id {
                delta["id"] = json!(id);
            }
            if let Some(name) = name {
                delta["function"]["name"] = json!(name);
            }
            chunk(json!({"tool_calls": [delta]}), None)
        };
        let chunks = [
            call(Some("call_1"), Some("read"), "{\"path\":"),
            call(None, None, "\"a\"}"),
            call(Some("call_2"), Some("read"), "{\"path\":\"b\"}"),
            chunk(json!({}), Some("tool_calls")),
        ];
        let mut stream = ResponseStream::new(skeleton(), names.clone());
        let output = replay(&run(&mut stream, &chunks));
        let calls: Vec<(&Value, &Value)> = output
            .iter()
            .map(|item| (&item["call_id"], &item["arguments"]))
            .collect();
        assert_eq!(
            calls,
            [
                (&json!("call_1"), &json!("{\"path\":\"a\"}")),
                (&json!("call_2"), &json!("{\"path\":\"b\"}")),
            ]
        );
        // Without parallel tool calls, the second is dropped.
        let mut single = ResponseStream::new(skeleton(), names).with_single_tool_call(true);
        assert_eq!(replay(&run(&mut single, &chunks)).len(), 1);
    }

    #[test]
    fn parallel_tool_calls_with_namespace_round_trip() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("get_weather"));
        names.insert(ToolName::namespaced("mcp__docs", "search"));
        let mut stream = ResponseStream::new(skeleton(), names);
        let events = run(
            &mut stream,
            &[
                chunk(json!({"role": "assistant", "content": ""}), None),
                chunk(json!({"content": "Checking."}), None),
                chunk(
                    json!({"tool_calls": [{"id": "chatcmpl-tool-a", "type": "function", "index": 0,
                                         "function": {"name": "get_weather", "arguments": ""}}]}),
                    None,
                ),
                chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": \""}}]}),
                    None,
                ),
                chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": "Paris\"}"}}]}),
                    None,
                ),
                chunk(
                    json!({"tool_calls": [{"id": "chatcmpl-tool-b", "type": "function", "index": 1,
                                         "function": {"name": "mcp__docs__search"}}]}),
                    None,
                ),
                chunk(
                    json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"q\": 1}"}}]}),
                    None,
                ),
                chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": " "}}]}),
                    None,
                ),
                chunk(json!({}), Some("tool_calls")),
                usage_chunk(100, 20, 96),
            ],
        );
        let output = replay(&events);
        assert_eq!(output.len(), 3);
        assert_eq!(output[0]["type"], "message");
        assert_eq!(
            output[1],
            json!({
                "id": output[1]["id"], "type": "function_call", "status": "completed",
                "call_id": "chatcmpl-tool-a", "name": "get_weather", "arguments": "{\"city\": \"Paris\"} ",
            })
        );
        assert_eq!(output[2]["name"], "search");
        assert_eq!(output[2]["namespace"], "mcp__docs");
        assert_eq!(output[2]["call_id"], "chatcmpl-tool-b");
        assert_eq!(output[2]["arguments"], "{\"q\": 1}");
        assert!(output[1]["id"].as_str().unwrap().starts_with("fc_"));
        assert_eq!(stream.response()["status"], "completed");
        assert_eq!(
            stream.response()["usage"]["input_tokens_details"]["cached_tokens"],
            96
        );
    }

    /// Every value of every chunk of a stream with reasoning, text and two tool calls replaced
    /// in turn by a value of every JSON type, and every key removed: whatever an engine sends,
    /// the events stay a well-formed Responses stream that ends in one terminal event.
    #[test]
    fn malformed_engine_chunks_still_give_a_well_formed_stream() {
        let chunks = vec![
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"reasoning_content": "Think."}), None),
            chunk(json!({"content": "Checking."}), None),
            chunk(
                json!({"tool_calls": [{"id": "t-a", "type": "function", "index": 0,
                                     "function": {"name": "get_weather", "arguments": "{\"c\": 1}"}}]}),
                None,
            ),
            chunk(
                json!({"tool_calls": [{"id": "t-b", "type": "function", "index": 1,
                                     "function": {"name": "f", "arguments": "{}"}}]}),
                None,
            ),
            chunk(json!({}), Some("tool_calls")),
            usage_chunk(10, 5, 4),
        ];
        let replacements = [
            Value::Null,
            json!(true),
            json!(-1),
            json!(1e300),
            json!(u64::MAX),
            json!(""),
            json!("x"),
            json!([]),
            json!([null]),
            json!({}),
        ];
        fn paths(v: &Value, at: String, out: &mut Vec<String>) {
            match v {
                Value::Object(map) => {
                    for (k, child) in map {
                        let p = format!("{at}/{k}");
                        out.push(p.clone());
                        paths(child, p, out);
                    }
                }
                Value::Array(items) => {
                    for (i, child) in items.iter().enumerate() {
                        let p = format!("{at}/{i}");
                        out.push(p.clone());
                        paths(child, p, out);
                    }
                }
                _ => {}
            }
        }
        let mut variants = 0;
        for (c, original) in chunks.iter().enumerate() {
            let mut pointers = Vec::new();
            paths(original, String::new(), &mut pointers);
            for pointer in &pointers {
                let mut changed: Vec<Value> = replacements
                    .iter()
                    .map(|r| {
                        let mut v = original.clone();
                        *v.pointer_mut(pointer).unwrap() = r.clone();
                        v
                    })
                    .collect();
                let mut removed = original.clone();
                let (parent, key) = pointer.rsplit_once('/').unwrap();
                match removed.pointer_mut(parent) {
                    Some(Value::Object(map)) => {
                        map.remove(key);
                    }
                    Some(Value::Array(items)) => {
                        items.remove(key.parse::<usize>().unwrap());
                    }
                    _ => {}
                }
                changed.push(removed);
                for variant in changed {
                    let mut sequence = chunks.clone();
                    sequence[c] = variant.clone();
                    let mut names = ToolNameMap::new();
                    names.insert(ToolName::plain("get_weather"));
                    let mut stream = ResponseStream::new(skeleton(), names);
                    let events = run(&mut stream, &sequence);
                    let result = std::panic::catch_unwind(|| replay(&events));
                    assert!(result.is_ok(), "chunk {c} with {pointer} = {variant}");
                    variants += 1;
                }
            }
        }
        assert!(variants > 500, "{variants}");
    }

    #[test]
    fn tool_call_name_arriving_after_arguments_is_announced_with_them() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                chunk(
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}),
                    None,
                ),
                chunk(
                    json!({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ":1}"}}]}),
                    None,
                ),
                chunk(json!({}), Some("tool_calls")),
            ],
        );
        let output = replay(&events);
        assert_eq!(output[0]["arguments"], "{\"a\":1}");
        assert_eq!(output[0]["name"], "f");
        assert!(
            output[0]["call_id"].as_str().unwrap().starts_with("call_"),
            "first chunk had no id"
        );
    }

    #[test]
    fn length_finish_is_incomplete() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                chunk(json!({"content": "partial"}), None),
                chunk(json!({"content": " text"}), Some("length")),
                usage_chunk(3, 2, 0),
            ],
        );
        let output = replay(&events);
        assert_eq!(events.last().unwrap().event, "response.incomplete");
        assert_eq!(output[0]["status"], "incomplete");
        let response = stream.response();
        assert_eq!(response["status"], "incomplete");
        assert_eq!(
            response["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
    }

    #[test]
    fn failure_mid_stream_ends_with_response_failed() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let mut events = stream.start();
        events.extend(stream.on_chunk(&chunk(json!({"reasoning_content": "hmm"}), None)));
        events.extend(stream.on_chunk(&chunk(json!({"content": "Par"}), None)));
        events.extend(stream.fail("server_error", "engine connection lost"));
        assert!(stream
            .on_chunk(&chunk(json!({"content": "late"}), None))
            .is_empty());
        assert!(stream.finish().is_empty());
        let output = replay(&events);
        assert_eq!(events.last().unwrap().event, "response.failed");
        assert_eq!(output[1]["status"], "incomplete");
        assert_eq!(output[1]["content"][0]["text"], "Par");
        let response = stream.response();
        assert_eq!(response["status"], "failed");
        assert_eq!(
            response["error"],
            json!({"code": "server_error", "message": "engine connection lost"})
        );
        assert_eq!(response["usage"]["output_tokens"], 0);
    }

    /// A message then a call cut off while its arguments came: the message is done, the call
    /// has no done event, and `output` lists it `incomplete` with the `arguments` written.
    fn assert_cut_off(events: &[SseEvent], output: &[Value], arguments: &str) {
        let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
        assert!(
            !kinds.contains(&"response.function_call_arguments.done"),
            "{kinds:?}"
        );
        let done: Vec<&str> = events
            .iter()
            .filter(|e| e.event == "response.output_item.done")
            .map(|e| e.data["item"]["type"].as_str().unwrap())
            .collect();
        assert_eq!(done, ["message"], "the message is done, the call never");
        assert_eq!(output[1]["type"], "function_call");
        assert_eq!(output[1]["status"], "incomplete");
        assert_eq!(output[1]["arguments"], arguments);
    }

    #[test]
    fn a_tool_call_cut_off_by_the_output_budget_is_never_done() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[
                chunk(json!({"content": "Editing."}), None),
                chunk(
                    json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                           "function": {"name": "edit", "arguments": "{\"path\": \"src/"}}]}),
                    Some("length"),
                ),
                usage_chunk(3, 9, 0),
            ],
        );
        let output = stream.response()["output"].as_array().cloned().unwrap();
        assert_cut_off(&events, &output, "{\"path\": \"src/");
        assert_eq!(events.last().unwrap().event, "response.incomplete");
        let response = stream.response();
        assert_eq!(
            response["output"][0]["status"], "completed",
            "the message ended when the call began"
        );
    }

    #[test]
    fn a_tool_call_cut_off_by_a_failure_is_never_done() {
        for cancel in [false, true] {
            let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
            let mut events = stream.start();
            events.extend(stream.on_chunk(&chunk(json!({"content": "Running it."}), None)));
            events.extend(stream.on_chunk(&chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                       "function": {"name": "shell", "arguments": "{\"cmd\": \"rm -r"}}]}),
                None,
            )));
            events.extend(if cancel {
                stream.cancel("cancelled", "cancelled")
            } else {
                stream.fail("server_error", "engine connection lost")
            });
            assert_cut_off(&events, &replay(&events), "{\"cmd\": \"rm -r");
        }
    }

    #[test]
    fn engine_error_chunk_fails_the_stream() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = {
            let mut events = stream.start();
            events.extend(stream.on_chunk(&chunk(json!({"content": "x"}), None)));
            events.extend(
                stream.on_chunk(&json!({"error": {"message": "CUDA out of memory", "code": 500}})),
            );
            events
        };
        replay(&events);
        assert_eq!(stream.response()["error"]["message"], "CUDA out of memory");
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let mut events = stream.start();
        events
            .extend(stream.on_chunk(
                &json!({"object": "error", "message": "bad", "type": "BadRequestError"}),
            ));
        replay(&events);
        assert_eq!(stream.response()["status"], "failed");
        assert_eq!(stream.response()["error"]["code"], "server_error");
    }

    #[test]
    fn an_error_chunk_about_the_request_fails_with_its_code() {
        // A prompt over the context window reported in the stream gets OpenAI's code (Codex
        // compacts on it; `server_error` would have it resend the same prompt), another fault
        // of the request (coded 4xx) OpenAI's `invalid_prompt`, which Codex does not resend.
        for (chunk, code) in [
            (
                json!({"error": {"message": "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.", "code": 400}}),
                "context_length_exceeded",
            ),
            (
                json!({"object": "error", "message": "invalid tool schema", "code": 400}),
                "invalid_prompt",
            ),
        ] {
            let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
            let mut events = stream.start();
            events.extend(stream.on_chunk(&chunk));
            replay(&events);
            assert_eq!(events.last().unwrap().event, "response.failed");
            assert_eq!(stream.response()["error"]["code"], code, "{chunk}");
        }
    }

    #[test]
    fn empty_stream_completes_with_no_output() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let events = run(
            &mut stream,
            &[chunk(json!({"role": "assistant"}), Some("stop"))],
        );
        let output = replay(&events);
        assert!(output.is_empty());
        assert_eq!(stream.response()["status"], "completed");
        assert_eq!(events[2].data["response"]["usage"]["total_tokens"], 0);
    }

    #[test]
    fn on_chunk_before_start_starts_implicitly() {
        let mut stream = ResponseStream::new(skeleton(), ToolNameMap::new());
        let mut events = stream.on_chunk(&chunk(json!({"content": "hi"}), None));
        assert!(stream.start().is_empty());
        events.extend(stream.finish());
        replay(&events);
    }
}
