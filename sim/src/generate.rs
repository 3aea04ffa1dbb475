//! Output planning: what a request generates, decided up front and deterministically.
//!
//! The random source is seeded from `--seed`, the request's `seed` and the prompt, so the same
//! request always yields the same output. Plain text is words from a small vocabulary (natural
//! length 50%..150% of `--default-output-tokens`); `tools` + `tool_choice` produce one tool call
//! whose arguments are an instance of the function's JSON schema; `response_format` produces
//! schema-valid JSON; reasoning requests get a short `reasoning_content` first. The plan is a list
//! of pieces, one per token, which the engine's token events reveal in order; `max_tokens` cuts the
//! list (finish reason `length`), `ignore_eos` pads it to `max_tokens`.
//!
//! The pieces spell out exactly what the chat template renders for the answer when it comes back
//! in the history: reasoning wrapped in [`THINK_OPEN`]/[`THINK_CLOSE`], the content, and a tool call
//! wrapped in [`tool_call_open`]/[`TOOL_CALL_CLOSE`]. The wrapping is [`Channel::Markup`]: counted
//! and cached like any token, never shown. [`OutputPlan::token_ids`] are therefore the ids the next
//! turn's prompt repeats, which is what lets the engine's cache hit through the previous answer.
//! Integer schema fields (`"type": "integer"`) always get integers; only `"number"` gets decimals.

use serde_json::{Map, Number, Value};

use crate::template::{content_text, tool_call_open, THINK_CLOSE, THINK_OPEN, TOOL_CALL_CLOSE};
use crate::tokenizer::{piece_id, split_pieces};

const WORDS: &[&str] = &[
    "the", "model", "cache", "token", "request", "replica", "prefix", "block", "stream", "agent",
    "tool", "result", "value", "file", "change", "test", "build", "route", "session", "queue",
    "latency", "batch", "decode", "prefill", "works", "looks", "runs", "keeps", "returns", "needs",
    "uses", "makes", "fast", "small", "stable", "simple", "next", "first", "again", "here", "then",
    "so", "and", "with", "for", "from", "into", "this",
];

/// Which part of the message a piece belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// `reasoning_content`.
    Reasoning,
    /// `content`.
    Content,
    /// The first token of a tool call; reveals its header (id, type, name), shows no text.
    ToolHeader,
    /// A fragment of the tool call's `arguments`.
    ToolArguments,
    /// Template markup around reasoning and tool calls: a real token, never shown.
    Markup,
}

/// A planned tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedToolCall {
    /// Call id (`chatcmpl-tool-…`).
    pub id: String,
    /// Function name.
    pub name: String,
}

/// Everything a request will generate, one piece per token.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputPlan {
    /// Pieces in generation order.
    pub pieces: Vec<(Channel, String)>,
    /// The tool call, when the plan calls one.
    pub tool_call: Option<PlannedToolCall>,
    /// Finish reason when all pieces are generated.
    pub finish_reason: &'static str,
}

impl OutputPlan {
    /// Finish reason when only `generated` pieces were produced.
    pub fn finish_reason_after(&self, generated: usize) -> &'static str {
        if generated < self.pieces.len() {
            "length"
        } else {
            self.finish_reason
        }
    }

    /// Token ids of the pieces, one per piece, as the tokenizer gives them for the rendered answer.
    pub fn token_ids(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.pieces.iter().map(|(_, piece)| piece_id(piece))
    }

    /// Whether the first `generated` pieces include the start of the tool call.
    pub fn tool_call_started(&self, generated: usize) -> bool {
        self.pieces
            .iter()
            .take(generated)
            .any(|(channel, _)| *channel == Channel::ToolHeader)
    }

    /// Concatenated text of the first `generated` pieces of `channel`.
    pub fn text(&self, channel: Channel, generated: usize) -> String {
        self.pieces
            .iter()
            .take(generated)
            .filter(|(c, _)| *c == channel)
            .map(|(_, text)| text.as_str())
            .collect()
    }
}

/// Inputs to the planner that come from the request.
#[derive(Debug, Clone, Default)]
pub struct PlanRequest<'a> {
    /// Chat messages (empty for completions).
    pub messages: &'a [Value],
    /// `tools`.
    pub tools: &'a [Value],
    /// `tool_choice`.
    pub tool_choice: Option<&'a Value>,
    /// `response_format`.
    pub response_format: Option<&'a Value>,
    /// Whether to emit reasoning first.
    pub reasoning: bool,
    /// `max_tokens` / `max_completion_tokens`.
    pub max_tokens: Option<usize>,
    /// `min_tokens`.
    pub min_tokens: usize,
    /// `ignore_eos`.
    pub ignore_eos: bool,
}

/// Mix the configured seed, the request seed and the prompt into one RNG seed.
pub fn seed_for(config_seed: Option<u64>, request_seed: Option<u64>, prompt_tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(16 + prompt_tokens.len() * 4);
    bytes.extend_from_slice(&config_seed.unwrap_or(0).to_le_bytes());
    bytes.extend_from_slice(&request_seed.unwrap_or(0).to_le_bytes());
    for token in prompt_tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

fn words(rng: &mut fastrand::Rng, count: usize) -> String {
    let mut out = String::new();
    for index in 0..count {
        let word = WORDS[rng.usize(..WORDS.len())];
        if index > 0 {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

fn function_of(tool: &Value) -> &Value {
    tool.get("function").unwrap_or(tool)
}

fn tool_name(tool: &Value) -> &str {
    function_of(tool)
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// Plan the output of a request; `Err` explains an unusable `tool_choice`.
pub fn plan(
    request: &PlanRequest<'_>,
    seed: u64,
    default_tokens: usize,
) -> Result<OutputPlan, String> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let default_tokens = default_tokens.max(2);
    let natural = rng
        .usize(default_tokens / 2..=default_tokens + default_tokens / 2)
        .max(1);
    let mut pieces: Vec<(Channel, String)> = Vec::new();
    let push_text = |pieces: &mut Vec<(Channel, String)>, channel: Channel, text: &str| {
        pieces.extend(
            split_pieces(text)
                .into_iter()
                .map(|piece| (channel, piece.to_string())),
        );
    };
    if request.reasoning {
        let text = format!("Thinking: {}.", words(&mut rng, (natural / 4).max(3)));
        push_text(&mut pieces, Channel::Markup, THINK_OPEN);
        push_text(&mut pieces, Channel::Reasoning, &text);
        push_text(&mut pieces, Channel::Markup, THINK_CLOSE);
    }

    let last = request.messages.last();
    let last_role = last
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        .unwrap_or("user");
    let last_user_text = request
        .messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .and_then(|m| m.get("content"))
        .map(content_text)
        .unwrap_or_default()
        .to_lowercase();
    let mentioned = request.tools.iter().find(|tool| {
        let name = tool_name(tool);
        !name.is_empty() && last_user_text.contains(&name.to_lowercase())
    });

    let chosen: Option<&Value> = match request.tool_choice {
        _ if request.tools.is_empty() => None,
        Some(Value::String(choice)) if choice == "none" => None,
        Some(Value::String(choice)) if choice == "required" => {
            mentioned.or_else(|| request.tools.first())
        }
        Some(Value::Object(named)) => {
            let wanted = named
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| named.get("name"))
                .and_then(Value::as_str)
                .unwrap_or("");
            match request.tools.iter().find(|tool| tool_name(tool) == wanted) {
                Some(tool) => Some(tool),
                None => {
                    return Err(format!(
                        "tool_choice names function `{wanted}`, which is not in `tools`"
                    ))
                }
            }
        }
        _ if last_role == "tool" => None,
        _ => mentioned,
    };

    let mut tool_call = None;
    let finish_reason;
    if let Some(tool) = chosen {
        let function = function_of(tool);
        let name = tool_name(tool).to_string();
        let schema = function
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type":"object"}));
        let arguments = instance(&schema, &mut rng, 0).to_string();
        let id = format!("chatcmpl-tool-{:016x}{:016x}", rng.u64(..), rng.u64(..));
        let header_at = pieces.len();
        push_text(&mut pieces, Channel::Markup, &tool_call_open(&name));
        if let Some((channel, _)) = pieces.get_mut(header_at) {
            *channel = Channel::ToolHeader;
        }
        push_text(&mut pieces, Channel::ToolArguments, &arguments);
        push_text(&mut pieces, Channel::Markup, TOOL_CALL_CLOSE);
        tool_call = Some(PlannedToolCall { id, name });
        finish_reason = "tool_calls";
    } else {
        let format_type = request
            .response_format
            .and_then(|f| f.get("type"))
            .and_then(Value::as_str);
        let text = match format_type {
            Some("json_schema") => {
                let format = request.response_format.unwrap_or(&Value::Null);
                let schema = format
                    .get("json_schema")
                    .and_then(|s| s.get("schema"))
                    .or_else(|| format.get("schema"))
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({"type":"object"}));
                instance(&schema, &mut rng, 0).to_string()
            }
            Some("json_object") => {
                serde_json::json!({"answer": words(&mut rng, natural.clamp(1, 32))}).to_string()
            }
            _ => {
                let mut text = words(&mut rng, natural.saturating_sub(1).max(1));
                if let Some(first) = text.get(..1) {
                    let upper = first.to_uppercase();
                    text.replace_range(..1, &upper);
                }
                text.push('.');
                text
            }
        };
        push_text(&mut pieces, Channel::Content, &text);
        finish_reason = "stop";
    }

    let mut wanted_min = request.min_tokens;
    if request.ignore_eos {
        wanted_min = wanted_min.max(request.max_tokens.unwrap_or(0));
    }
    if pieces.len() < wanted_min && tool_call.is_none() {
        let padding = words(&mut rng, wanted_min - pieces.len());
        for piece in split_pieces(&padding) {
            pieces.push((Channel::Content, format!(" {}", piece.trim_start())));
        }
    }
    let mut plan = OutputPlan {
        pieces,
        tool_call,
        finish_reason,
    };
    if let Some(max) = request.max_tokens {
        if plan.pieces.len() > max.max(1) {
            plan.pieces.truncate(max.max(1));
            plan.finish_reason = "length";
        }
    }
    Ok(plan)
}

/// A JSON value valid against the (simple subset of JSON Schema) `schema`.
pub fn instance(schema: &Value, rng: &mut fastrand::Rng, depth: usize) -> Value {
    let Some(schema) = schema.as_object() else {
        return Value::Null;
    };
    if let Some(value) = schema.get("const") {
        return value.clone();
    }
    if let Some(choices) = schema.get("enum").and_then(Value::as_array) {
        if !choices.is_empty() {
            return choices[rng.usize(..choices.len())].clone();
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = schema.get(key).and_then(Value::as_array) {
            if let Some(option) = options
                .iter()
                .find(|o| o.get("type").and_then(Value::as_str) != Some("null"))
            {
                return instance(option, rng, depth);
            }
        }
    }
    if let Some(parts) = schema.get("allOf").and_then(Value::as_array) {
        let mut merged = schema.clone();
        merged.remove("allOf");
        for part in parts.iter().filter_map(Value::as_object) {
            merge_schema(&mut merged, part);
        }
        return instance(&Value::Object(merged), rng, depth + 1);
    }
    let kind = match schema.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(Value::Array(kinds)) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|k| *k != "null")
            .unwrap_or("null"),
        _ if schema.contains_key("properties") => "object",
        _ if schema.contains_key("items") => "array",
        _ if schema.contains_key("minimum") || schema.contains_key("maximum") => "number",
        _ => "string",
    };
    match kind {
        "object" => {
            let mut object = Map::new();
            if depth < 8 {
                if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                    for (name, property) in properties {
                        object.insert(name.clone(), instance(property, rng, depth + 1));
                    }
                }
            }
            Value::Object(object)
        }
        "array" => {
            let min = schema.get("minItems").and_then(Value::as_u64).unwrap_or(1) as usize;
            let max = schema
                .get("maxItems")
                .and_then(Value::as_u64)
                .map(|m| m as usize)
                .unwrap_or(min.max(2));
            let count = if depth >= 8 {
                0
            } else {
                rng.usize(min..=max.max(min)).min(min.max(3))
            };
            let items = schema.get("items").cloned().unwrap_or(Value::Null);
            Value::Array(
                (0..count)
                    .map(|_| instance(&items, rng, depth + 1))
                    .collect(),
            )
        }
        "integer" => Value::Number(Number::from(integer_instance(schema, rng))),
        "number" => number_instance(schema, rng),
        "boolean" => Value::Bool(rng.bool()),
        "null" => Value::Null,
        _ => {
            let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
            let max = schema
                .get("maxLength")
                .and_then(Value::as_u64)
                .map(|m| m as usize)
                .unwrap_or(usize::MAX);
            let mut text = match schema.get("format").and_then(Value::as_str) {
                Some("date-time") => "2025-01-01T00:00:00Z".to_string(),
                Some("date") => "2025-01-01".to_string(),
                Some("email") => "user@example.com".to_string(),
                Some("uri") | Some("url") => "https://example.com/".to_string(),
                _ => {
                    let count = rng.usize(1..=3);
                    words(rng, count)
                }
            };
            while text.chars().count() < min {
                text.push('x');
            }
            if text.chars().count() > max {
                text = text.chars().take(max).collect();
            }
            Value::String(text)
        }
    }
}

/// Fold the constraints of an `allOf` part into `merged`: properties and `required` are united,
/// other keywords are taken from the part unless `merged` already has them.
fn merge_schema(merged: &mut Map<String, Value>, part: &Map<String, Value>) {
    for (key, value) in part {
        match (key.as_str(), merged.get_mut(key), value) {
            ("properties", Some(Value::Object(into)), Value::Object(from)) => {
                for (name, property) in from {
                    into.entry(name.clone()).or_insert_with(|| property.clone());
                }
            }
            ("required", Some(Value::Array(into)), Value::Array(from)) => {
                for name in from {
                    if !into.contains(name) {
                        into.push(name.clone());
                    }
                }
            }
            (_, Some(_), _) => {}
            (_, None, _) => {
                merged.insert(key.clone(), value.clone());
            }
        }
    }
}

/// The lower (`minimum`/`exclusiveMinimum`) or upper (`maximum`/`exclusiveMaximum`) bound of a
/// numeric schema and whether it is exclusive, in both the draft-4 (`exclusiveMinimum: true` next
/// to `minimum`) and the draft-6+ (`exclusiveMinimum: 3`) forms; the tighter bound wins.
fn numeric_bound(schema: &Map<String, Value>, lower: bool) -> Option<(f64, bool)> {
    let (inclusive, exclusive) = if lower {
        ("minimum", "exclusiveMinimum")
    } else {
        ("maximum", "exclusiveMaximum")
    };
    let bound = schema.get(inclusive).and_then(Value::as_f64);
    match schema.get(exclusive) {
        Some(Value::Number(value)) => {
            let value = value.as_f64()?;
            match bound {
                Some(bound) if (lower && bound > value) || (!lower && bound < value) => {
                    Some((bound, false))
                }
                _ => Some((value, true)),
            }
        }
        Some(Value::Bool(true)) => bound.map(|bound| (bound, true)),
        _ => bound.map(|bound| (bound, false)),
    }
}

/// An integer within `minimum`/`maximum` (inclusive or exclusive, integral or not) that is a
/// multiple of an integral `multipleOf`; a range of 100 from whichever bound is given.
fn integer_instance(schema: &Map<String, Value>, rng: &mut fastrand::Rng) -> i64 {
    // `as` saturates out-of-range floats, which is the clamping wanted here
    let low = numeric_bound(schema, true).map(|(value, exclusive)| {
        if exclusive {
            value.floor() as i64 + 1
        } else {
            value.ceil() as i64
        }
    });
    let high = numeric_bound(schema, false).map(|(value, exclusive)| {
        if exclusive {
            value.ceil() as i64 - 1
        } else {
            value.floor() as i64
        }
    });
    let (low, high) = match (low, high) {
        (Some(low), Some(high)) => (low, high.max(low)),
        (Some(low), None) => (low, low.saturating_add(100)),
        (None, Some(high)) => (
            high.min(0).saturating_sub(if high < 0 { 100 } else { 0 }),
            high,
        ),
        (None, None) => (0, 100),
    };
    let step = schema
        .get("multipleOf")
        .and_then(Value::as_f64)
        .filter(|step| *step >= 1.0 && step.fract() == 0.0)
        .map(|step| step as i64)
        .unwrap_or(1);
    let first = low.div_euclid(step) + i64::from(low.rem_euclid(step) != 0);
    let last = high.div_euclid(step);
    if first > last {
        return low;
    }
    rng.i64(first..=last).saturating_mul(step)
}

/// A number within `minimum`/`maximum` (inclusive or exclusive), rounded to two decimals, or to a
/// multiple of `multipleOf` when given.
fn number_instance(schema: &Map<String, Value>, rng: &mut fastrand::Rng) -> Value {
    let low = numeric_bound(schema, true);
    let high = numeric_bound(schema, false);
    let (min, max) = match (low, high) {
        (Some((low, _)), Some((high, _))) => (low, high.max(low)),
        (Some((low, _)), None) => (low, low + 100.0),
        (None, Some((high, _))) => (high.min(0.0) - if high < 0.0 { 100.0 } else { 0.0 }, high),
        (None, None) => (0.0, 100.0),
    };
    let raw = min + rng.f64() * (max - min);
    let mut value = match schema
        .get("multipleOf")
        .and_then(Value::as_f64)
        .filter(|step| *step > 0.0)
    {
        Some(step) => (raw / step).round() * step,
        None => (raw * 100.0).round() / 100.0,
    };
    if value < min || value > max {
        value = raw;
    }
    let excluded = |bound: Option<(f64, bool)>, value: f64| {
        bound.is_some_and(|(bound, exclusive)| exclusive && value == bound)
    };
    if excluded(low, value) || excluded(high, value) {
        value = (min + max) / 2.0;
    }
    Number::from_f64(value)
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request<'a>(
        messages: &'a [Value],
        tools: &'a [Value],
        choice: Option<&'a Value>,
    ) -> PlanRequest<'a> {
        PlanRequest {
            messages,
            tools,
            tool_choice: choice,
            ..PlanRequest::default()
        }
    }

    #[test]
    fn text_is_deterministic_and_max_tokens_cuts_it() {
        let messages = [json!({"role":"user","content":"hi"})];
        let a = plan(&request(&messages, &[], None), 7, 64).unwrap_or_else(|e| panic!("{e}"));
        let b = plan(&request(&messages, &[], None), 7, 64).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a, b);
        assert_eq!(a.finish_reason, "stop");
        let mut short = request(&messages, &[], None);
        short.max_tokens = Some(3);
        let cut = plan(&short, 7, 64).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((cut.pieces.len(), cut.finish_reason), (3, "length"));
        short.ignore_eos = true;
        short.max_tokens = Some(500);
        assert_eq!(plan(&short, 7, 64).map(|p| p.pieces.len()), Ok(500));
    }

    #[test]
    fn tool_choice_rules() {
        let tools = [
            json!({"type":"function","function":{"name":"get_weather","parameters":{
            "type":"object","required":["city","days"],
            "properties":{"city":{"type":"string"},"days":{"type":"integer","minimum":1,"maximum":7},
                          "unit":{"enum":["c","f"]},"tags":{"type":"array","items":{"type":"string"}}}}}}),
        ];
        let mention = [json!({"role":"user","content":"use get_weather please"})];
        let plain = [json!({"role":"user","content":"hello"})];
        let auto = json!("auto");
        let required = json!("required");
        let called =
            plan(&request(&mention, &tools, Some(&auto)), 1, 16).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(called.finish_reason, "tool_calls");
        let args: Value = serde_json::from_str(&called.text(Channel::ToolArguments, usize::MAX))
            .unwrap_or_default();
        assert!(args["city"].is_string());
        let days = args["days"].as_i64().unwrap_or(0);
        assert!((1..=7).contains(&days));
        assert!(args["unit"] == "c" || args["unit"] == "f");
        assert!(args["tags"].is_array());
        assert_eq!(
            plan(&request(&plain, &tools, Some(&auto)), 1, 16).map(|p| p.finish_reason),
            Ok("stop")
        );
        assert_eq!(
            plan(&request(&plain, &tools, Some(&required)), 1, 16).map(|p| p.finish_reason),
            Ok("tool_calls")
        );
        let mut after_tool = mention.to_vec();
        after_tool.push(json!({"role":"tool","content":"sunny"}));
        assert_eq!(
            plan(&request(&after_tool, &tools, Some(&auto)), 1, 16).map(|p| p.finish_reason),
            Ok("stop")
        );
        let missing = json!({"type":"function","function":{"name":"nope"}});
        assert!(plan(&request(&plain, &tools, Some(&missing)), 1, 16).is_err());
    }

    #[test]
    fn integer_fields_get_integers_and_only_numbers_get_decimals() {
        let schema = json!({"type": "object", "properties": {
            "plain": {"type": "integer"},
            "float_bounds": {"type": "integer", "minimum": 1.5, "maximum": 4.5},
            "exclusive": {"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 5},
            "draft4": {"type": "integer", "minimum": 2, "exclusiveMinimum": true, "maximum": 3},
            "negative": {"type": "integer", "maximum": -10},
            "step": {"type": "integer", "minimum": 1, "maximum": 100, "multipleOf": 7},
            "nullable": {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
            "any": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 5, "maximum": 6}]},
            "all": {"allOf": [{"type": "integer"}, {"minimum": 10, "maximum": 12}]},
            "list": {"type": "array", "items": {"type": "integer"}},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "open": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.01},
            "merged": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                  {"properties": {"b": {"type": "string"}}}]}}});
        let mut decimals = 0;
        for seed in 0..300 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let value = instance(&schema, &mut rng, 0);
            // the text is what a client parses: an integer field must not print as `3.0`
            let reparsed: Value = serde_json::from_str(&value.to_string()).unwrap_or_default();
            let int = |key: &str| {
                let field = &reparsed[key];
                assert!(field.is_i64(), "{key} is not an integer: {reparsed}");
                field.as_i64().unwrap_or_default()
            };
            int("plain");
            assert!((2..=4).contains(&int("float_bounds")), "{reparsed}");
            assert!((3..=4).contains(&int("exclusive")), "{reparsed}");
            assert_eq!(int("draft4"), 3);
            assert!(int("negative") <= -10);
            let step = int("step");
            assert!(step % 7 == 0 && (7..=98).contains(&step), "{step}");
            assert!((0..=3).contains(&int("nullable")));
            assert!((5..=6).contains(&int("any")));
            assert!((10..=12).contains(&int("all")));
            let list = reparsed["list"].as_array().cloned().unwrap_or_default();
            assert!(
                !list.is_empty() && list.iter().all(Value::is_i64),
                "{reparsed}"
            );
            let ratio = reparsed["ratio"].as_f64().unwrap_or(-1.0);
            assert!((0.0..=1.0).contains(&ratio));
            decimals += usize::from(ratio.fract() != 0.0);
            let open = reparsed["open"].as_f64().unwrap_or(-1.0);
            assert!(open > 0.0 && open < 0.01, "{open}");
            assert!(reparsed["merged"]["a"].is_i64() && reparsed["merged"]["b"].is_string());
        }
        assert!(
            decimals > 100,
            "numbers do get decimals ({decimals} of 300)"
        );
    }

    #[test]
    fn the_output_spells_out_the_rendered_answer() {
        use crate::template::render_chat;
        use crate::tokenizer::tokenize;
        let tools = [
            json!({"type":"function","function":{"name":"get_weather","parameters":{
            "type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}}}}}),
        ];
        let history = vec![json!({"role":"user","content":"get_weather in Paris"})];
        let choice = json!("auto");
        for reasoning in [false, true] {
            let mut req = request(&history, &tools, Some(&choice));
            req.reasoning = reasoning;
            let out = plan(&req, 5, 16).unwrap_or_else(|e| panic!("{e}"));
            let call = out
                .tool_call
                .clone()
                .unwrap_or_else(|| panic!("a tool call"));
            let mut answer = json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.name, "arguments": out.text(Channel::ToolArguments, usize::MAX)}}]});
            if reasoning {
                answer["reasoning_content"] = json!(out.text(Channel::Reasoning, usize::MAX));
            }
            let before = tokenize(&render_chat(&history, Some(&tools), "reasoning_content"));
            let mut after = history.clone();
            after.push(answer);
            let after = tokenize(&render_chat(&after, Some(&tools), "reasoning_content"));
            let generated: Vec<u32> = out.token_ids().collect();
            assert_eq!(
                after.get(before.len()..before.len() + generated.len()),
                Some(generated.as_slice()),
                "the rendered answer repeats the generated tokens (reasoning: {reasoning})"
            );
            assert_eq!(
                out.pieces
                    .iter()
                    .filter(|(c, _)| *c == Channel::ToolHeader)
                    .count(),
                1
            );
        }
    }

    #[test]
    fn json_schema_output_is_valid_json() {
        let format = json!({"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object",
            "properties":{"ok":{"type":"boolean"},"score":{"type":"number","minimum":0,"maximum":1}}}}});
        let messages = [json!({"role":"user","content":"rate it"})];
        let mut req = request(&messages, &[], None);
        req.response_format = Some(&format);
        let out = plan(&req, 3, 16).unwrap_or_else(|e| panic!("{e}"));
        let value: Value =
            serde_json::from_str(&out.text(Channel::Content, usize::MAX)).unwrap_or_default();
        assert!(value["ok"].is_boolean());
        let score = value["score"].as_f64().unwrap_or(-1.0);
        assert!((0.0..=1.0).contains(&score));
    }
}
