//! Typed views over a `POST /v1/responses` body, and its validation.
//!
//! The body stays raw JSON (`serde_json::Value`): unknown fields pass through to the stored
//! request untouched. These views read and check only the fields the gateway acts on, and every
//! problem becomes a 400 naming the field in `param`.

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
}

fn invalid_type(param: &str, want: &str) -> HttpError {
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

fn opt_str<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, HttpError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid_type(key, "a string")),
    }
}

fn number_in(body: &Value, key: &str, lo: f64, hi: f64) -> Result<(), HttpError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(v) => {
            let x = v.as_f64().ok_or_else(|| invalid_type(key, "a number"))?;
            if x < lo || x > hi {
                return Err(HttpError::invalid(
                    format!(
                        "Invalid '{key}': {x} is out of range; it must be between {lo} and {hi}."
                    ),
                    Some(key),
                    Some("invalid_value"),
                ));
            }
            Ok(())
        }
    }
}

/// Parse a request body into JSON, with OpenAI's error for malformed bodies.
pub fn parse_json(bytes: &[u8]) -> Result<Value, HttpError> {
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

/// Check the fields shared by `POST /v1/responses` and `POST /v1/responses/input_tokens`.
pub fn validate_common(body: &Value) -> Result<(), HttpError> {
    match body.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Array(_)) => {}
        Some(_) => return Err(invalid_type("input", "a string or an array of input items")),
    }
    opt_str(body, "instructions")?;
    opt_str(body, "previous_response_id")?;
    if let Some(tools) = body.get("tools") {
        if !tools.is_null() && !tools.is_array() {
            return Err(invalid_type("tools", "an array"));
        }
    }
    if body.get("conversation").is_some_and(|c| !c.is_null()) {
        return Err(HttpError::invalid(
            "The 'conversation' parameter is not supported by this gateway; chain turns with 'previous_response_id'.",
            Some("conversation"),
            Some("unsupported_parameter"),
        ));
    }
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
        if body.get("input").is_none_or(Value::is_null) {
            return Err(HttpError::invalid(
                "Missing required parameter: 'input'.",
                Some("input"),
                Some("missing_required_parameter"),
            ));
        }
        let stream = opt_bool(&body, "stream")?.unwrap_or(false);
        let store = opt_bool(&body, "store")?.unwrap_or(true);
        let background = opt_bool(&body, "background")?.unwrap_or(false);
        opt_bool(&body, "parallel_tool_calls")?;
        if background && !store {
            return Err(HttpError::invalid(
                "Background responses must be stored: set 'store' to true or drop 'background'.",
                Some("background"),
                Some("invalid_value"),
            ));
        }
        number_in(&body, "temperature", 0.0, 2.0)?;
        number_in(&body, "top_p", 0.0, 1.0)?;
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
        if let Some(m) = body.get("metadata").filter(|m| !m.is_null()) {
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
                let ok =
                    k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512);
                if !ok {
                    return Err(HttpError::invalid(
                        format!("Invalid 'metadata.{k}': keys are strings of at most 64 characters and values strings of at most 512."),
                        Some("metadata"),
                        Some("invalid_value"),
                    ));
                }
            }
        }
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
        let previous_response_id = opt_str(&body, "previous_response_id")?.map(str::to_string);
        Ok(CreateRequest {
            model,
            stream,
            store,
            background,
            previous_response_id,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
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
    fn malformed_json_is_400() {
        assert_eq!(parse_json(b"{nope").unwrap_err().error.status, 400);
        assert_eq!(parse_json(b"[1]").unwrap_err().error.status, 400);
    }
}
