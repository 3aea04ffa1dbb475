//! Client-facing errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
//!
//! Every failure a handler can meet becomes an [`HttpError`] with the right status, a `param`
//! naming the offending request field where there is one, a string `code`, and `Retry-After` on
//! rejections a client should retry (the OpenAI SDKs wait that long before they retry).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use agentgate_adapters::ApiError;

/// An error response: the OpenAI error fields plus optional retry advice.
#[derive(Debug, Clone)]
pub struct HttpError {
    /// Status, message, type, param and code.
    pub error: ApiError,
    /// Seconds to put in `Retry-After`.
    pub retry_after: Option<u32>,
    /// Further response headers (e.g. `x-ratelimit-*` on a rate-limited request); boxed to
    /// keep the error small on the common path.
    pub headers: Option<Box<Vec<(&'static str, String)>>>,
}

impl HttpError {
    /// A new error with the given status, OpenAI `type`, message, param and code.
    pub fn new(
        status: u16,
        kind: &str,
        message: impl Into<String>,
        param: Option<&str>,
        code: Option<&str>,
    ) -> Self {
        HttpError {
            error: ApiError {
                status,
                message: message.into(),
                r#type: kind.to_string(),
                param: param.map(str::to_string),
                code: code.map(str::to_string),
            },
            retry_after: None,
            headers: None,
        }
    }

    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>, code: Option<&str>) -> Self {
        Self::new(400, "invalid_request_error", message, param, code)
    }

    /// 404 for an object this team cannot see.
    pub fn not_found(message: impl Into<String>, param: Option<&str>) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            message,
            param,
            Some("not_found"),
        )
    }

    /// 500-class server error.
    pub fn server(status: u16, message: impl Into<String>, code: &str) -> Self {
        Self::new(status, "server_error", message, None, Some(code))
    }

    /// Add `Retry-After: secs`.
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(u32::try_from(secs).unwrap_or(u32::MAX));
        self
    }

    /// Add response headers.
    pub fn with_headers(mut self, headers: Vec<(&'static str, String)>) -> Self {
        self.headers
            .get_or_insert_with(Box::default)
            .extend(headers);
        self
    }

    /// The `{"error": {...}}` body.
    pub fn body(&self) -> serde_json::Value {
        error_body(&self.error)
    }
}

/// The OpenAI error body for an [`ApiError`].
pub fn error_body(e: &ApiError) -> serde_json::Value {
    json!({
        "error": {
            "message": e.message,
            "type": e.r#type,
            "param": e.param,
            "code": e.code,
        }
    })
}

impl From<ApiError> for HttpError {
    fn from(error: ApiError) -> Self {
        HttpError {
            error,
            retry_after: None,
            headers: None,
        }
    }
}

/// The error code of an error answer, kept in the response's extensions for the HTTP metrics
/// (`crate::metrics::observe_http`): the body's `code` when it is a plain snake_case word of at
/// most 64 characters, as the gateway's own codes are, `other` else (a code passed on from an
/// engine could be anything).
#[derive(Debug, Clone)]
pub struct ErrorCode(pub String);

impl ErrorCode {
    fn of(code: Option<&str>) -> ErrorCode {
        let code = code.unwrap_or("");
        let plain = !code.is_empty()
            && code.len() <= 64
            && code
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        ErrorCode(if plain { code } else { "other" }.to_string())
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.body())).into_response();
        resp.extensions_mut()
            .insert(ErrorCode::of(self.error.code.as_deref()));
        if let Some(secs) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        for (name, value) in self.headers.into_iter().flat_map(|h| *h) {
            if let Ok(v) = HeaderValue::from_str(&value) {
                resp.headers_mut().insert(name, v);
            }
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = HttpError::invalid("bad", Some("input"), Some("invalid_value"));
        assert_eq!(
            e.body(),
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "input", "code": "invalid_value"}})
        );
    }

    #[test]
    fn retry_after_header_is_set() {
        let r = HttpError::server(503, "busy", "overloaded")
            .with_retry_after(2)
            .into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }
}
