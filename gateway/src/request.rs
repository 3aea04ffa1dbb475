//! Typed views over a `POST /v1/responses` body, and its validation.
//!
//! The body stays raw JSON (`serde_json::Value`): unknown fields pass through to the stored
//! request untouched. These views read and check only the fields the gateway acts on, and every
//! problem becomes a 400 naming the field in `param`.

use agentgate_adapters::REASONING_EFFORTS;
use serde_json::Value;

use crate::error::HttpError;

/// The fields of a create request the gateway acts on.
#[derive(Debug, Clone)]
pub struct CreateRequest {
    /// The raw body.
    pub body: Value,
    /// `model`.
    pub model: String,
    /// `stream` (default false).
    pub stream: bool,
    /// `store` (default true).
    pub store: bool,
    /// `background` (default false; requires `store`).
    pub background: bool,
    /// `previous_response_id`.
    pub previous_response_id: Option<String>,
    /// The conversation it runs in ([`conversation_id`]).
    pub conversation: Option<String>,
}

/// The `conversation` a request runs in: a conversation id, or an object with its `id`.
pub fn conversation_id(body: &Value) -> Result<Option<String>, HttpError> {
    match body.get("conversation") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) if !id.is_empty() => Ok(Some(id.clone())),
        Some(Value::Object(c)) => match c.get("id") {
            Some(Value::String(id)) if !id.is_empty() => Ok(Some(id.clone())),
            _ => Err(invalid_type("conversation.id", "a non-empty string")),
        },
        Some(_) => Err(invalid_type(
            "conversation",
            "a conversation id or an object with its 'id'",
        )),
    }
}

/// `metadata`: absent, null, or at most 16 string pairs (keys up to 64 characters, values up
/// to 512), as OpenAI allows.
pub fn validate_metadata(metadata: Option<&Value>) -> Result<(), HttpError> {
    let Some(m) = metadata.filter(|m| !m.is_null()) else {
        return Ok(());
    };
    let map = m
        .as_object()
        .ok_or_else(|| invalid_type("metadata", "an object"))?;
    if map.len() > 16 {
        return Err(HttpError::invalid(
            "Invalid 'metadata': at most 16 key-value pairs are allowed.",
            Some("metadata"),
            Some("invalid_value"),
        ));
    }
    for (k, v) in map {
        let ok = k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512);
        if !ok {
            return Err(HttpError::invalid(
                format!("Invalid 'metadata.{k}': keys are strings of at most 64 characters and values strings of at most 512."),
                Some("metadata"),
                Some("invalid_value"),
            ));
        }
    }
    Ok(())
}

pub(crate) fn invalid_type(param: &str, want: &str) -> HttpError {
    HttpError::invalid(
        format!("Invalid type for '{param}': expected {want}."),
        Some(param),
        Some("invalid_type"),
    )
}

fn opt_bool(body: &Value, key: &str) -> Result<Option<bool>, HttpError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid_type(key, "a boolean")),
    }
}

/// `body[key]` as a string, `None` when absent or null; another type is 400 naming `key`.
pub fn opt_str<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, HttpError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid_type(key, "a string")),
    }
}

fn missing(param: &str) -> HttpError {
    HttpError::invalid(
        format!("Missing required parameter: '{param}'."),
        Some(param),
        Some("missing_required_parameter"),
    )
}

/// `body[key]` when it is an object; `None` when absent or null; a 400 naming `param`
/// otherwise.
fn opt_object<'a>(body: &'a Value, key: &str, param: &str) -> Result<Option<&'a Value>, HttpError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) if v.is_object() => Ok(Some(v)),
        Some(_) => Err(invalid_type(param, "an object")),
    }
}

/// Each of `keys` in `body`, when present and not null, is of the JSON type `check` accepts
/// (`want` names it); the error's `param` is `{at}.{key}` (or `key` at the top level).
fn typed(
    body: &Value,
    at: &str,
    keys: &[&str],
    check: fn(&Value) -> bool,
    want: &str,
) -> Result<(), HttpError> {
    for key in keys {
        if let Some(v) = body.get(*key).filter(|v| !v.is_null()) {
            if !check(v) {
                let param = match at {
                    "" => key.to_string(),
                    _ => format!("{at}.{key}"),
                };
                return Err(invalid_type(&param, want));
            }
        }
    }
    Ok(())
}

/// `body[key]`, when present and not null, is one of `allowed` (OpenAI's wording and code);
/// the error's `param` is `{at}.{key}`.
fn one_of(body: &Value, at: &str, key: &str, allowed: &[&str]) -> Result<(), HttpError> {
    let Some(v) = body.get(key).filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let param = format!("{at}.{key}");
    let value = v.as_str().ok_or_else(|| invalid_type(&param, "a string"))?;
    if allowed.contains(&value) {
        return Ok(());
    }
    let quoted: Vec<String> = allowed.iter().map(|a| format!("'{a}'")).collect();
    let supported = match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{}, and {last}", rest.join(", ")),
        _ => quoted.join(""),
    };
    Err(HttpError::invalid(
        format!("Invalid value: '{value}'. Supported values are: {supported}."),
        Some(&param),
        Some("invalid_value"),
    ))
}

/// OpenAI's rule for function and schema names: 1 to 64 of `[a-zA-Z0-9_-]`.
fn check_name(name: &Value, param: &str) -> Result<(), HttpError> {
    let Some(name) = name.as_str() else {
        return Err(invalid_type(param, "a string"));
    };
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    match ok {
        true => Ok(()),
        false => Err(HttpError::invalid(
            format!(
                "Invalid '{param}': expected 1 to 64 letters, digits, '_' or '-', got {name:?}."
            ),
            Some(param),
            Some("invalid_value"),
        )),
    }
}

/// `tools`: an array of objects, each with a string `type`; a function tool's `name`,
/// `description`, `parameters` and `strict` of the types OpenAI takes. Other tool types are
/// left to translation (hosted tools are dropped or refused there, by configuration).
fn validate_tools(tools: &[Value]) -> Result<(), HttpError> {
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        if !tool.is_object() {
            return Err(invalid_type(&at, "an object"));
        }
        let kind = match tool.get("type") {
            None | Some(Value::Null) => return Err(missing(&format!("{at}.type"))),
            Some(Value::String(kind)) => kind.as_str(),
            Some(_) => return Err(invalid_type(&format!("{at}.type"), "a string")),
        };
        if kind != "function" {
            continue;
        }
        match tool.get("name") {
            None | Some(Value::Null) => return Err(missing(&format!("{at}.name"))),
            Some(name) => check_name(name, &format!("{at}.name"))?,
        }
        typed(tool, &at, &["description"], Value::is_string, "a string")?;
        typed(tool, &at, &["parameters"], Value::is_object, "an object")?;
        typed(tool, &at, &["strict"], Value::is_boolean, "a boolean")?;
    }
    Ok(())
}

/// `text`: an object whose `format`, when given, is an object with a string `type`; a
/// `json_schema` format's `name`, `description` and `strict` of the types OpenAI takes (the
/// values are checked where the format is translated).
fn validate_text(body: &Value) -> Result<(), HttpError> {
    let Some(text) = opt_object(body, "text", "text")? else {
        return Ok(());
    };
    one_of(text, "text", "verbosity", &["low", "medium", "high"])?;
    let Some(format) = opt_object(text, "format", "text.format")? else {
        return Ok(());
    };
    match format.get("type") {
        None | Some(Value::Null) => return Err(missing("text.format.type")),
        Some(Value::String(kind)) if kind == "json_schema" => {
            if let Some(name) = format.get("name").filter(|n| !n.is_null()) {
                check_name(name, "text.format.name")?;
            }
        }
        Some(Value::String(_)) => {}
        Some(_) => return Err(invalid_type("text.format.type", "a string")),
    }
    typed(
        format,
        "text.format",
        &["description"],
        Value::is_string,
        "a string",
    )?;
    typed(
        format,
        "text.format",
        &["strict"],
        Value::is_boolean,
        "a boolean",
    )?;
    Ok(())
}

/// `body[key]`, when present and not null, is a number (an integer when `integer`) of at least
/// `lo` and at most `hi` (when given).
fn in_range(
    body: &Value,
    key: &str,
    integer: bool,
    lo: f64,
    hi: Option<f64>,
) -> Result<(), HttpError> {
    let Some(v) = body.get(key).filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let (x, want) = match integer {
        true => (v.as_i64().map(|n| n as f64), "an integer"),
        false => (v.as_f64(), "a number"),
    };
    let x = x.ok_or_else(|| invalid_type(key, want))?;
    // Worded and coded as OpenAI words and codes them.
    let kind = if integer { "integer" } else { "decimal" };
    let out =
        |side: &str, relation: &str, bound: f64| {
            HttpError::invalid(
                format!(
                "Invalid '{key}': {kind} {side} {} value. Expected a value {relation} {bound}, \
                 but got {v} instead.",
                if side == "below" { "minimum" } else { "maximum" }
            ),
                Some(key),
                Some(&format!(
                    "{kind}_{side}_{}_value",
                    if side == "below" { "min" } else { "max" }
                )),
            )
        };
    if x < lo {
        return Err(out("below", ">=", lo));
    }
    if let Some(hi) = hi.filter(|hi| x > *hi) {
        return Err(out("above", "<=", hi));
    }
    Ok(())
}

/// Most JSON values (strings, numbers, arrays, objects, ...) a request body may hold. A parsed
/// value takes about 80 bytes, so a body of tiny values (`[0,0,0,...]`) would take some 40
/// times its size in memory: at most a million of them keeps that near 80 MB whatever
/// `max_body_bytes` allows. Real requests hold far fewer (text is one value per string; a long
/// agent history with tools is some tens of thousands).
pub const MAX_JSON_VALUES: usize = 1_000_000;

/// An upper bound of the JSON values in `bytes`, in one pass without parsing: one per comma,
/// colon or opening bracket outside strings, plus one. Exact enough to refuse bodies of
/// millions of tiny values before they are parsed.
fn json_values_at_most(bytes: &[u8]) -> usize {
    let mut count = 1;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b',' | b':' | b'[' | b'{' => count += 1,
                _ => {}
            }
        }
    }
    count
}

/// [`parse_json`] for a handler: a body larger than `inline_bytes` (`server.parse_inline_bytes`;
/// an agent history of megabytes takes tens to hundreds of milliseconds to scan and parse) is
/// parsed on the blocking pool, so the runtime thread goes on serving other requests' streams
/// meanwhile.
pub async fn parse_json_body(
    headers: &axum::http::HeaderMap,
    bytes: &axum::body::Bytes,
    inline_bytes: usize,
) -> Result<Value, HttpError> {
    if bytes.len() <= inline_bytes {
        return parse_json(headers, bytes);
    }
    let (headers, bytes) = (headers.clone(), bytes.clone());
    tokio::task::spawn_blocking(move || parse_json(&headers, &bytes))
        .await
        .unwrap_or_else(|e| {
            Err(HttpError::server(
                500,
                format!("could not parse the request body: {e}"),
                "server_error",
            ))
        })
}

/// Parse a request body into JSON, with OpenAI's error for malformed bodies. A body sent with
/// a `Content-Encoding` other than `identity` is refused with 415 rather than misread as
/// malformed JSON, and one of more than [`MAX_JSON_VALUES`] values with 413 before it is
/// parsed.
pub fn parse_json(headers: &axum::http::HeaderMap, bytes: &[u8]) -> Result<Value, HttpError> {
    if let Some(encoding) = headers.get(axum::http::header::CONTENT_ENCODING) {
        let encoding = String::from_utf8_lossy(encoding.as_bytes())
            .trim()
            .to_string();
        if !encoding.eq_ignore_ascii_case("identity") {
            return Err(HttpError::new(
                415,
                "invalid_request_error",
                format!("Request bodies with Content-Encoding '{encoding}' are not supported; send the JSON uncompressed."),
                None,
                Some("unsupported_content_encoding"),
            ));
        }
    }
    let values = json_values_at_most(bytes);
    if values > MAX_JSON_VALUES {
        return Err(HttpError::new(
            413,
            "invalid_request_error",
            format!(
                "The request body holds about {values} JSON values; this gateway accepts at most \
                 {MAX_JSON_VALUES}."
            ),
            None,
            Some("request_too_large"),
        ));
    }
    let body: Value = serde_json::from_slice(bytes).map_err(|e| {
        HttpError::invalid(
            format!("We could not parse the JSON body of your request ({e}). The body must be a JSON object."),
            None,
            Some("invalid_json"),
        )
    })?;
    if !body.is_object() {
        return Err(HttpError::invalid(
            "The request body must be a JSON object.",
            None,
            Some("invalid_json"),
        ));
    }
    Ok(body)
}

/// Longest `user`, `prompt_cache_key` or `safety_identifier`, in characters.
pub const MAX_IDENTIFIER_CHARS: usize = 512;

/// Chat Completions parameters the Responses API does not take, and what takes their place.
/// A client moved over from Chat Completions sends them; ignored, they would silently do
/// nothing (an answer without its token limit or its JSON format), so they are refused, as
/// OpenAI refuses them. Other unknown top-level parameters are ignored.
const CHAT_ONLY_PARAMETERS: [(&str, &str); 9] = [
    ("max_tokens", "'max_output_tokens'"),
    ("max_completion_tokens", "'max_output_tokens'"),
    ("response_format", "'text.format'"),
    ("messages", "'input'"),
    ("functions", "'tools'"),
    ("function_call", "'tool_choice'"),
    (
        "logprobs",
        "'top_logprobs' with include: ['message.output_text.logprobs']",
    ),
    ("stop", "nothing: the Responses API has no stop sequences"),
    ("n", "nothing: a response holds one answer"),
];

/// Check the fields shared by `POST /v1/responses` and `POST /v1/responses/input_tokens`.
pub fn validate_common(body: &Value) -> Result<(), HttpError> {
    for (name, instead) in CHAT_ONLY_PARAMETERS {
        // (What asks for nothing changes nothing: `n: 1`, `logprobs: false`, no stop
        // sequences, a `text` response format.)
        let asks = match body.get(name) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Array(items)) => !items.is_empty(),
            Some(Value::String(text)) => !text.is_empty(),
            Some(v) if name == "n" => v.as_u64() != Some(1),
            Some(v) if name == "response_format" => {
                v.get("type").and_then(Value::as_str) != Some("text")
            }
            Some(_) => true,
        };
        if asks {
            return Err(HttpError::invalid(
                format!("Unsupported parameter: '{name}'. In the Responses API, use {instead}."),
                Some(name),
                Some("unsupported_parameter"),
            ));
        }
    }
    match body.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Array(_)) => {}
        Some(_) => return Err(invalid_type("input", "a string or an array of input items")),
    }
    opt_str(body, "instructions")?;
    opt_str(body, "previous_response_id")?;
    opt_bool(body, "parallel_tool_calls")?;
    match body.get("truncation") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "auto" || s == "disabled" => {}
        Some(_) => {
            return Err(HttpError::invalid(
                "Invalid 'truncation': expected 'auto' or 'disabled'.",
                Some("truncation"),
                Some("invalid_value"),
            ))
        }
    }
    match body.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(tools)) => validate_tools(tools)?,
        Some(_) => return Err(invalid_type("tools", "an array")),
    }
    typed(
        body,
        "",
        &["user", "prompt_cache_key", "safety_identifier"],
        Value::is_string,
        "a string",
    )?;
    // Identifiers, echoed into every stored response and event: bounded as OpenAI bounds
    // metadata values.
    for key in ["user", "prompt_cache_key", "safety_identifier"] {
        if let Some(value) = body.get(key).and_then(Value::as_str) {
            if value.chars().count() > MAX_IDENTIFIER_CHARS {
                return Err(HttpError::invalid(
                    format!(
                        "Invalid '{key}': string too long. Expected a string with maximum length {MAX_IDENTIFIER_CHARS}, but got a string with length {}.",
                        value.chars().count()
                    ),
                    Some(key),
                    Some("string_above_max_length"),
                ));
            }
        }
    }
    if let Some(reasoning) = opt_object(body, "reasoning", "reasoning")? {
        one_of(reasoning, "reasoning", "effort", &REASONING_EFFORTS)?;
        one_of(
            reasoning,
            "reasoning",
            "summary",
            &["auto", "concise", "detailed"],
        )?;
    }
    validate_text(body)?;
    match body.get("include") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {}
        Some(_) => return Err(invalid_type("include", "an array of strings")),
    }
    conversation_id(body)?;
    if body.get("conversation").is_some_and(|c| !c.is_null())
        && body
            .get("previous_response_id")
            .is_some_and(|p| !p.is_null())
    {
        return Err(HttpError::invalid(
            "'previous_response_id' and 'conversation' cannot be used together.",
            Some("previous_response_id"),
            Some("invalid_value"),
        ));
    }
    Ok(())
}

impl CreateRequest {
    /// Validate a create body.
    pub fn from_body(body: Value) -> Result<CreateRequest, HttpError> {
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                return Err(HttpError::invalid(
                    "Missing required parameter: 'model'.",
                    Some("model"),
                    Some("missing_required_parameter"),
                ))
            }
            Some(_) => return Err(invalid_type("model", "a string")),
        };
        validate_common(&body)?;
        // Without `input` a turn continues its history as it stands (a conversation whose
        // items were just added, a response to carry on from); with neither, there is nothing
        // for the model to answer.
        let has = |key: &str| body.get(key).is_some_and(|v| !v.is_null());
        if !has("input") && !has("previous_response_id") && !has("conversation") {
            return Err(HttpError::invalid(
                "Missing required parameter: 'input'.",
                Some("input"),
                Some("missing_required_parameter"),
            ));
        }
        let stream = opt_bool(&body, "stream")?.unwrap_or(false);
        let store = opt_bool(&body, "store")?.unwrap_or(true);
        let background = opt_bool(&body, "background")?.unwrap_or(false);
        if background && !store {
            return Err(HttpError::invalid(
                "Background responses must be stored: set 'store' to true or drop 'background'.",
                Some("background"),
                Some("invalid_value"),
            ));
        }
        if body.get("prompt").is_some_and(|p| !p.is_null()) {
            return Err(HttpError::invalid(
                "Reusable prompts ('prompt') are not supported by this gateway; send the instructions and input in the request.",
                Some("prompt"),
                Some("unsupported_parameter"),
            ));
        }
        in_range(&body, "max_tool_calls", true, 0.0, None)?;
        in_range(&body, "top_logprobs", true, 0.0, Some(20.0))?;
        in_range(&body, "temperature", false, 0.0, Some(2.0))?;
        in_range(&body, "top_p", false, 0.0, Some(1.0))?;
        if let Some(v) = body.get("max_output_tokens").filter(|v| !v.is_null()) {
            let n = v
                .as_i64()
                .ok_or_else(|| invalid_type("max_output_tokens", "an integer"))?;
            if n < 16 {
                return Err(HttpError::invalid(
                    format!("Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, but got {n} instead."),
                    Some("max_output_tokens"),
                    Some("integer_below_min_value"),
                ));
            }
        }
        validate_metadata(body.get("metadata"))?;
        let previous_response_id = opt_str(&body, "previous_response_id")?.map(str::to_string);
        let conversation = conversation_id(&body)?;
        Ok(CreateRequest {
            model,
            stream,
            store,
            background,
            previous_response_id,
            conversation,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn a_large_body_parses_off_the_runtime_with_the_same_answers() {
        let headers = axum::http::HeaderMap::new();
        let text = "w ".repeat(200_000);
        let big =
            axum::body::Bytes::from(serde_json::json!({"model": "m", "input": text}).to_string());
        let zeros = axum::body::Bytes::from(format!("[{}0]", "0,".repeat(1_100_000)));
        // off the runtime (the default limit) and on the request's own task (a limit above the body)
        let inline_limit = crate::config::ServerConfig::default().parse_inline_bytes;
        assert!(big.len() > inline_limit);
        for limit in [inline_limit, usize::MAX] {
            let body = super::parse_json_body(&headers, &big, limit).await.unwrap();
            assert_eq!(body["input"].as_str().map(str::len), Some(400_000));
            let e = super::parse_json_body(&headers, &zeros, limit)
                .await
                .unwrap_err();
            assert_eq!(e.error.status, 413);
        }
    }

    #[test]
    fn chat_completions_parameters_are_refused_with_their_replacement() {
        let refused = |body: serde_json::Value| super::validate_common(&body).unwrap_err();
        let e = refused(serde_json::json!({"input": "hi", "max_tokens": 16}));
        assert_eq!(e.error.param.as_deref(), Some("max_tokens"));
        assert_eq!(e.error.code.as_deref(), Some("unsupported_parameter"));
        assert!(
            e.error.message.contains("'max_output_tokens'"),
            "{}",
            e.error.message
        );
        let e =
            refused(serde_json::json!({"input": "hi", "response_format": {"type": "json_object"}}));
        assert!(
            e.error.message.contains("'text.format'"),
            "{}",
            e.error.message
        );
        let e = refused(serde_json::json!({"input": "hi", "user": "u".repeat(513)}));
        assert_eq!(e.error.code.as_deref(), Some("string_above_max_length"));
        assert_eq!(e.error.param.as_deref(), Some("user"));
        for harmless in [
            serde_json::json!({"input": "hi", "n": 1, "stop": [], "max_tokens": null,
                               "logprobs": false, "response_format": {"type": "text"}}),
            serde_json::json!({"input": "hi", "frobnicate": 1}),
        ] {
            assert!(super::validate_common(&harmless).is_ok(), "{harmless}");
        }
    }

    #[test]
    fn json_values_are_bounded_from_above_without_parsing() {
        let count = |text: &str| json_values_at_most(text.as_bytes());
        assert_eq!(count("{}"), 2);
        assert_eq!(count(r#"{"a": [1, 2, 3], "b": {"c": null}}"#), 10);
        // Commas, colons and brackets inside strings (escaped quotes too) are text.
        assert_eq!(count(r#"{"t": "a, b: [c] {d} \" e, f"}"#), 3);
        assert_eq!(count(r#"{"t": "ends with a backslash \\", "u": 1}"#), 5);
        let zeros = format!("{{\"input\": [{}]}}", vec!["0"; MAX_JSON_VALUES].join(","));
        let e = parse_json(&axum::http::HeaderMap::new(), zeros.as_bytes()).unwrap_err();
        assert_eq!(e.error.status, 413);
        assert_eq!(e.error.code.as_deref(), Some("request_too_large"));
        let fine = format!("{{\"input\": [{}]}}", vec!["0"; 1000].join(","));
        assert!(parse_json(&axum::http::HeaderMap::new(), fine.as_bytes()).is_ok());
    }

    use super::*;
    use serde_json::json;

    fn param_of(body: Value) -> Option<String> {
        CreateRequest::from_body(body).unwrap_err().error.param
    }

    #[test]
    fn defaults() {
        let r = CreateRequest::from_body(json!({"model": "m", "input": "hi"})).unwrap();
        assert!(r.store && !r.stream && !r.background);
    }

    #[test]
    fn each_bad_field_is_named() {
        assert_eq!(param_of(json!({"input": "x"})).as_deref(), Some("model"));
        assert_eq!(param_of(json!({"model": "m"})).as_deref(), Some("input"));
        assert_eq!(
            param_of(json!({"model": "m", "input": 3})).as_deref(),
            Some("input")
        );
        assert_eq!(
            param_of(json!({"model": "m", "input": "x", "temperature": 3})).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param_of(json!({"model": "m", "input": "x", "stream": "yes"})).as_deref(),
            Some("stream")
        );
        assert_eq!(
            param_of(json!({"model": "m", "input": "x", "max_output_tokens": 2})).as_deref(),
            Some("max_output_tokens")
        );
        assert_eq!(
            param_of(json!({"model": "m", "input": "x", "background": true, "store": false}))
                .as_deref(),
            Some("background")
        );
        assert_eq!(
            param_of(json!({"model": "m", "input": "x", "metadata": {"k": 1}})).as_deref(),
            Some("metadata")
        );
    }

    #[test]
    fn nested_fields_are_named_by_their_path() {
        let bad = |extra: Value| {
            let mut body = json!({"model": "m", "input": "x"});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let e = CreateRequest::from_body(body).unwrap_err().error;
            (e.param.unwrap_or_default(), e.code.unwrap_or_default())
        };
        let function = |tool: Value| json!({"tools": [{"type": "function", "name": "f"}, tool]});
        let cases = [
            (json!({"tools": [3]}), "tools[0]", "invalid_type"),
            (
                json!({"tools": [{"name": "f"}]}),
                "tools[0].type",
                "missing_required_parameter",
            ),
            (
                json!({"tools": [{"type": 1}]}),
                "tools[0].type",
                "invalid_type",
            ),
            (
                function(json!({"type": "function"})),
                "tools[1].name",
                "missing_required_parameter",
            ),
            (
                function(json!({"type": "function", "name": "read file"})),
                "tools[1].name",
                "invalid_value",
            ),
            (
                function(json!({"type": "function", "name": "f", "description": 0})),
                "tools[1].description",
                "invalid_type",
            ),
            (
                function(json!({"type": "function", "name": "f", "parameters": []})),
                "tools[1].parameters",
                "invalid_type",
            ),
            (
                function(json!({"type": "function", "name": "f", "strict": "yes"})),
                "tools[1].strict",
                "invalid_type",
            ),
            (json!({"user": 7}), "user", "invalid_type"),
            (
                json!({"prompt_cache_key": ["a"]}),
                "prompt_cache_key",
                "invalid_type",
            ),
            (json!({"reasoning": "high"}), "reasoning", "invalid_type"),
            (
                json!({"reasoning": {"effort": 1}}),
                "reasoning.effort",
                "invalid_type",
            ),
            (
                json!({"reasoning": {"effort": "extreme"}}),
                "reasoning.effort",
                "invalid_value",
            ),
            (
                json!({"reasoning": {"effort": "low", "summary": "brief"}}),
                "reasoning.summary",
                "invalid_value",
            ),
            (
                json!({"text": {"verbosity": "terse"}}),
                "text.verbosity",
                "invalid_value",
            ),
            (json!({"text": "json"}), "text", "invalid_type"),
            (
                json!({"text": {"format": "json"}}),
                "text.format",
                "invalid_type",
            ),
            (
                json!({"text": {"format": {}}}),
                "text.format.type",
                "missing_required_parameter",
            ),
            (
                json!({"text": {"format": {"type": 1}}}),
                "text.format.type",
                "invalid_type",
            ),
            (
                json!({"text": {"format": {"type": "json_schema", "name": "", "schema": {}}}}),
                "text.format.name",
                "invalid_value",
            ),
            (
                json!({"text": {"format": {"type": "json_object", "strict": 1}}}),
                "text.format.strict",
                "invalid_type",
            ),
            (
                json!({"include": "reasoning.encrypted_content"}),
                "include",
                "invalid_type",
            ),
            (
                json!({"top_logprobs": 21}),
                "top_logprobs",
                "integer_above_max_value",
            ),
            (
                json!({"max_tool_calls": "3"}),
                "max_tool_calls",
                "invalid_type",
            ),
            (
                json!({"prompt": {"id": "pmpt_1"}}),
                "prompt",
                "unsupported_parameter",
            ),
        ];
        for (extra, param, code) in cases {
            assert_eq!(
                bad(extra.clone()),
                (param.to_string(), code.to_string()),
                "{extra}"
            );
        }
        // Tools of other types are left to translation, which drops or refuses hosted ones.
        assert!(CreateRequest::from_body(
            json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]})
        )
        .is_ok());
    }

    #[test]
    fn numbers_out_of_range_are_coded_as_openai_codes_them() {
        let refused = |extra: Value| {
            let mut body = json!({"model": "m", "input": "x"});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let e = CreateRequest::from_body(body).unwrap_err().error;
            (e.param.unwrap(), e.code.unwrap(), e.message)
        };
        let (param, code, message) = refused(json!({"temperature": 3}));
        assert_eq!(
            (param.as_str(), code.as_str()),
            ("temperature", "decimal_above_max_value")
        );
        assert_eq!(
            message,
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 3 instead."
        );
        let (_, code, _) = refused(json!({"top_p": -0.5}));
        assert_eq!(code, "decimal_below_min_value");
        let (_, code, _) = refused(json!({"top_logprobs": 21}));
        assert_eq!(code, "integer_above_max_value");
        let (_, code, _) = refused(json!({"max_tool_calls": -1}));
        assert_eq!(code, "integer_below_min_value");
    }

    #[test]
    fn enumerated_fields_take_openais_values() {
        for effort in REASONING_EFFORTS {
            let body = json!({"model": "m", "input": "x", "reasoning": {"effort": effort}});
            assert!(CreateRequest::from_body(body).is_ok(), "{effort}");
        }
        let body = json!({"model": "m", "input": "x", "text": {"verbosity": "loud"}});
        let e = CreateRequest::from_body(body).unwrap_err().error;
        assert_eq!(
            e.message,
            "Invalid value: 'loud'. Supported values are: 'low', 'medium', and 'high'."
        );
    }

    #[test]
    fn compressed_bodies_are_415_not_malformed_json() {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("content-encoding", "zstd".parse().unwrap());
        let e = parse_json(&headers, br#"{"model": "m"}"#)
            .unwrap_err()
            .error;
        assert_eq!(
            (e.status, e.code.as_deref()),
            (415, Some("unsupported_content_encoding"))
        );
        headers.insert("content-encoding", "identity".parse().unwrap());
        assert!(parse_json(&headers, br#"{"model": "m"}"#).is_ok());
    }

    #[test]
    fn malformed_json_is_400() {
        assert_eq!(
            parse_json(&Default::default(), b"{nope")
                .unwrap_err()
                .error
                .status,
            400
        );
        assert_eq!(
            parse_json(&Default::default(), b"[1]")
                .unwrap_err()
                .error
                .status,
            400
        );
    }
}
