//! Error types: [`ApiError`] for client-facing failures (HTTP status + OpenAI error fields) and
//! [`UpstreamError`] for failures talking to an engine.

use serde_json::{json, Value};
use std::fmt;

/// A client-facing error: HTTP status + OpenAI error fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status code to answer with.
    pub status: u16,
    /// Human-readable message that says what to change.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub r#type: String,
    /// The request parameter at fault, e.g. `input[3].call_id`.
    pub param: Option<String>,
    /// Machine-readable error code.
    pub code: Option<String>,
}

impl ApiError {
    /// A 400 `invalid_request_error` naming the offending parameter, coded `invalid_value`
    /// unless [`ApiError::with_code`] says otherwise.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            r#type: "invalid_request_error".to_string(),
            param: Some(param.into()),
            code: Some("invalid_value".to_string()),
        }
    }

    /// Sets the machine-readable error code.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn to_body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.r#type,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.param {
            Some(param) => write!(f, "{} ({}): {}", self.status, param, self.message),
            None => write!(f, "{}: {}", self.status, self.message),
        }
    }
}

impl std::error::Error for ApiError {}

/// A failure talking to an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpstreamError {
    /// The TCP/HTTP connection could not be made or broke.
    Connect(String),
    /// The engine did not answer (or stopped streaming) within the configured timeout.
    Timeout(String),
    /// The engine answered with a non-2xx status; `body` is its error text, kept for logs.
    Status {
        /// HTTP status the engine returned.
        status: u16,
        /// Response body (truncated), usually the engine's JSON error.
        body: String,
    },
    /// The engine's answer could not be understood (bad SSE framing, bad JSON).
    Protocol(String),
}

impl UpstreamError {
    /// A short machine-readable kind, for metrics labels and log fields.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamError::Connect(_) => "connect",
            UpstreamError::Timeout(_) => "timeout",
            UpstreamError::Status { .. } => "status",
            UpstreamError::Protocol(_) => "protocol",
        }
    }
}

impl UpstreamError {
    /// The client-facing error for this failure when it happens before any output was streamed.
    ///
    /// Engine 400/413/422 answers are the client's fault (bad schema, prompt too long) and keep
    /// the engine's message as a 400 `invalid_request_error`; a prompt over the context window
    /// gets code `context_length_exceeded` and param `input`, as OpenAI answers it (Codex
    /// compacts its history on that code). Timeouts
    /// are 504, everything else 502 `server_error`.
    pub fn to_api_error(&self) -> ApiError {
        match self {
            UpstreamError::Status {
                status: 400 | 413 | 422,
                body,
            } => {
                let message = engine_error_text(body);
                // OpenAI names `input` as the param of a prompt over the context window.
                let (code, param) = if is_context_overflow(&message) {
                    ("context_length_exceeded", Some("input".into()))
                } else {
                    ("invalid_request", None)
                };
                ApiError {
                    status: 400,
                    message,
                    r#type: "invalid_request_error".into(),
                    param,
                    code: Some(code.into()),
                }
            }
            UpstreamError::Timeout(_) => ApiError {
                status: 504,
                message: format!(
                    "{self}; retry, or raise the engine timeouts if prompts are very long"
                ),
                r#type: "server_error".into(),
                param: None,
                code: Some("engine_timeout".into()),
            },
            _ => ApiError {
                status: 502,
                message: format!("{self}; retry the request"),
                r#type: "server_error".into(),
                param: None,
                code: Some("server_error".into()),
            },
        }
    }

    /// The `error.code` for `response.failed` when this failure interrupts a stream.
    pub fn failure_code(&self) -> &'static str {
        match self {
            UpstreamError::Status { body, .. } if is_context_overflow(body) => {
                "context_length_exceeded"
            }
            _ => "server_error",
        }
    }
}

/// The `message` of an engine JSON error body (`{"message"}`, `{"error": {"message"}}` or
/// `{"detail"}`), else the body itself.
fn engine_error_text(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    parsed
        .as_ref()
        .and_then(|v| {
            v.get("message")
                .or_else(|| v.get("error").and_then(|e| e.get("message")))
                .or_else(|| v.get("detail"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| body.to_string())
}

/// The model's context window as an engine's overflow message states it: vLLM "maximum
/// context length is N tokens", SGLang "the model's context length (N tokens)" or "maximum
/// context length of N tokens".
pub fn context_window_in(message: &str) -> Option<u64> {
    let lower = message.to_ascii_lowercase();
    [
        "maximum context length is ",
        "context length (",
        "maximum context length of ",
    ]
    .iter()
    .find_map(|lead| {
        let at = lower.find(lead)? + lead.len();
        let digits: String = lower[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    })
}

/// True when an engine message says the prompt does not fit the context window
/// (vLLM: "maximum context length is N tokens", SGLang: "longer than the model's context length").
pub(crate) fn is_context_overflow(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    lower.contains("context length")
        || lower.contains("context window")
        || lower.contains("maximum context")
}

impl fmt::Display for UpstreamError {
    /// On one line: an engine's error text echoes request values, whose line breaks and other
    /// control characters are written escaped (`\n`), so a log line cannot be forged with them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpstreamError::Connect(m) => write!(f, "engine connection failed: {}", OneLine(m)),
            UpstreamError::Timeout(m) => write!(f, "engine timed out: {}", OneLine(m)),
            UpstreamError::Status { status, body } => {
                write!(f, "engine answered HTTP {status}: {}", OneLine(body))
            }
            UpstreamError::Protocol(m) => {
                write!(f, "engine sent an unreadable answer: {}", OneLine(m))
            }
        }
    }
}

/// Text written with its control characters escaped (`\n`), for a log line that cannot be
/// forged by what the text echoes.
pub struct OneLine<'a>(pub &'a str);

impl fmt::Display for OneLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                fmt::Write::write_char(f, c)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for UpstreamError {}

#[cfg(test)]
mod tests {
    #[test]
    fn the_context_window_is_read_from_either_engines_message() {
        use super::context_window_in;
        for (message, window) in [
            ("This model's maximum context length is 400 tokens. However, you requested 5000 tokens (100 in the messages, 4900 in the completion).", Some(400)),
            ("'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum context length is 4096 tokens and your request has 100 input tokens (5000 > 4096 - 100).", Some(4096)),
            ("The input (9000 tokens) is longer than the model's context length (8192 tokens).", Some(8192)),
            ("Requested token count exceeds the model's maximum context length of 32768 tokens.", Some(32768)),
            ("something else", None),
        ] {
            assert_eq!(context_window_in(message), window, "{message}");
        }
    }

    use super::*;

    #[test]
    fn an_engine_error_is_written_on_one_line() {
        let e = UpstreamError::Status {
            status: 400,
            body: "unknown tool `x`\nINFO forged line\r\u{1b}[31m".into(),
        };
        assert_eq!(
            e.to_string(),
            "engine answered HTTP 400: unknown tool `x`\\nINFO forged line\\r\\u{1b}[31m"
        );
    }

    #[test]
    fn engine_errors_map_to_client_errors() {
        let overflow = UpstreamError::Status {
            status: 400,
            body: r#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.","type":"BadRequestError","code":400}"#.into(),
        };
        let api = overflow.to_api_error();
        assert_eq!(
            (api.status, api.code.as_deref(), api.param.as_deref()),
            (400, Some("context_length_exceeded"), Some("input"))
        );
        assert!(api
            .message
            .starts_with("This model's maximum context length"));
        assert_eq!(overflow.failure_code(), "context_length_exceeded");

        let bad = UpstreamError::Status {
            status: 422,
            body: r#"{"error":{"message":"bad schema"}}"#.into(),
        };
        assert_eq!(bad.to_api_error().message, "bad schema");
        assert_eq!(bad.failure_code(), "server_error");

        let down = UpstreamError::Status {
            status: 503,
            body: "overloaded".into(),
        };
        assert_eq!(down.to_api_error().status, 502);
        assert_eq!(
            UpstreamError::Timeout("t".into()).to_api_error().status,
            504
        );
        assert_eq!(
            UpstreamError::Connect("c".into()).to_api_error().r#type,
            "server_error"
        );
        let body = ApiError::invalid("input[0]", "m").to_body();
        assert_eq!(
            body,
            json!({"error": {"message": "m", "type": "invalid_request_error", "param": "input[0]", "code": "invalid_value"}})
        );
    }
}
