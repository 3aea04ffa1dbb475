//! Output planning: what a request generates, decided up front and deterministically.
//!
//! The random source is seeded from `--seed`, the request's `seed` and the prompt, so the same
//! request always yields the same output. Plain text is words from a small vocabulary (natural
//! length 50%..150% of `--default-output-tokens`); `tools` + `tool_choice` produce one tool call
//! whose arguments are an instance of the function's JSON schema; `response_format` produces
//! schema-valid JSON; reasoning requests get a short `reasoning_content` first. The plan is a list
//! of pieces, one per token, which the engine's token events reveal in order; `max_tokens` cuts the
//! list (finish reason `length`), `ignore_eos` pads it to `max_tokens`.

use serde_json::{Map, Number, Value};

use crate::template::content_text;
use crate::tokenizer::split_pieces;

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
    /// The tool call's header (id, type, name); carries no text.
    ToolHeader,
    /// A fragment of the tool call's `arguments`.
    ToolArguments,
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
        push_text(&mut pieces, Channel::Reasoning, &text);
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
        pieces.push((Channel::ToolHeader, String::new()));
        push_text(&mut pieces, Channel::ToolArguments, &arguments);
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
        let mut merged = Map::new();
        for part in parts {
            if let Value::Object(object) = instance(part, rng, depth) {
                merged.extend(object);
            }
        }
        return Value::Object(merged);
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
        "integer" => {
            let min = schema.get("minimum").and_then(Value::as_i64).unwrap_or(0);
            let max = schema
                .get("maximum")
                .and_then(Value::as_i64)
                .unwrap_or(min.saturating_add(100))
                .max(min);
            Value::Number(Number::from(rng.i64(min..=max)))
        }
        "number" => {
            let min = schema.get("minimum").and_then(Value::as_f64).unwrap_or(0.0);
            let max = schema
                .get("maximum")
                .and_then(Value::as_f64)
                .unwrap_or(min + 100.0)
                .max(min);
            let value = ((min + rng.f64() * (max - min)) * 100.0).round() / 100.0;
            Number::from_f64(value.clamp(min, max))
                .map(Value::Number)
                .unwrap_or(Value::Null)
        }
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
