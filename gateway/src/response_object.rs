//! The Response object: ids and the skeleton every response starts from.
//!
//! Every key of OpenAI's Response object is present (null where unknown), echoing the request's
//! settings. `instructions`, `tools` and sampling settings are this request's own: nothing is
//! inherited from `previous_response_id`.

use serde_json::{json, Map, Value};

/// A new random id with an OpenAI-style prefix (`resp`, `msg`, ...): prefix, `_`, 48 hex digits
/// from the operating system's random source (`agentgate_adapters::push_random_hex`).
pub fn new_id(prefix: &str) -> String {
    let mut s = String::with_capacity(prefix.len() + 49);
    s.push_str(prefix);
    s.push('_');
    agentgate_adapters::push_random_hex(&mut s);
    s
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn get(req: &Value, key: &str) -> Value {
    req.get(key).cloned().unwrap_or(Value::Null)
}

/// The Response object for a request before any output: status `in_progress` (or `queued` for
/// background runs), `output: []`, `usage: null`.
pub fn skeleton(id: &str, created_at: i64, req: &Value, model: &str, status: &str) -> Value {
    let text = match req.get("text") {
        Some(Value::Object(t)) => {
            let mut t = t.clone();
            t.entry("format").or_insert_with(|| json!({"type": "text"}));
            t.entry("verbosity").or_insert(json!("medium"));
            Value::Object(t)
        }
        _ => json!({"format": {"type": "text"}, "verbosity": "medium"}),
    };
    let reasoning = match req.get("reasoning") {
        Some(Value::Object(r)) => {
            let mut r: Map<String, Value> = r.clone();
            r.entry("effort").or_insert(Value::Null);
            r.entry("summary").or_insert(Value::Null);
            Value::Object(r)
        }
        _ => json!({"effort": null, "summary": null}),
    };
    json!({
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": req.get("background").and_then(Value::as_bool).unwrap_or(false),
        "completed_at": null,
        "conversation": crate::request::conversation_id(req).ok().flatten().map(|id| json!({"id": id})),
        "error": null,
        "incomplete_details": null,
        "instructions": get(req, "instructions"),
        "max_output_tokens": get(req, "max_output_tokens"),
        "max_tool_calls": get(req, "max_tool_calls"),
        "metadata": req.get("metadata").cloned().filter(|m| !m.is_null()).unwrap_or_else(|| json!({})),
        "model": model,
        "output": [],
        "parallel_tool_calls": req.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(true),
        "previous_response_id": get(req, "previous_response_id"),
        "prompt": get(req, "prompt"),
        "prompt_cache_key": get(req, "prompt_cache_key"),
        "reasoning": reasoning,
        "safety_identifier": get(req, "safety_identifier"),
        // The tier served, set by flow control ([`crate::flow::FlowControl::served_tier`]).
        "service_tier": "default",
        "store": req.get("store").and_then(Value::as_bool).unwrap_or(true),
        "temperature": req.get("temperature").cloned().filter(|t| !t.is_null()).unwrap_or(json!(1.0)),
        "text": text,
        "tool_choice": req.get("tool_choice").cloned().filter(|t| !t.is_null()).unwrap_or_else(|| json!("auto")),
        "tools": req.get("tools").cloned().filter(|t| !t.is_null()).unwrap_or_else(|| json!([])),
        "top_logprobs": req.get("top_logprobs").cloned().filter(|t| !t.is_null()).unwrap_or(json!(0)),
        "top_p": req.get("top_p").cloned().filter(|t| !t.is_null()).unwrap_or(json!(1.0)),
        "truncation": req.get("truncation").cloned().filter(|t| !t.is_null()).unwrap_or_else(|| json!("disabled")),
        "usage": null,
        "user": get(req, "user"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_and_unique() {
        let a = new_id("resp");
        let b = new_id("resp");
        assert!(a.starts_with("resp_") && a.len() == 53);
        assert_ne!(a, b);
    }

    #[test]
    fn skeleton_echoes_request_and_has_every_key() {
        let req =
            json!({"model": "m", "instructions": "be brief", "temperature": 0.2, "store": false});
        let r = skeleton("resp_1", 5, &req, "m", "in_progress");
        assert_eq!(r["instructions"], "be brief");
        assert_eq!(r["temperature"], 0.2);
        assert_eq!(r["store"], false);
        assert_eq!(r["usage"], Value::Null);
        for key in [
            "error",
            "incomplete_details",
            "previous_response_id",
            "user",
            "max_output_tokens",
        ] {
            assert!(r.get(key).is_some(), "{key} missing");
        }
    }
}
