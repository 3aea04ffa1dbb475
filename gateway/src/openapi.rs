//! The OpenAPI document of every endpoint the gateway serves, generated from [`ROUTES`].
//!
//! `agentgate openapi > openapi/openapi.yaml` regenerates the committed file; a test fails when
//! the file is stale, and `tests/tests/gateway.rs` sends every documented route to a running
//! gateway to check that the router serves it.

use serde_json::{json, Map, Value};

/// One documented route.
#[derive(Debug, Clone, Copy)]
pub struct RouteDoc {
    /// HTTP method, lowercase.
    pub method: &'static str,
    /// Path with `{param}` placeholders.
    pub path: &'static str,
    /// One-line summary.
    pub summary: &'static str,
    /// Request body schema name under `components/schemas`, if any.
    pub request: Option<&'static str>,
    /// Success response schema name (`text/event-stream` is added for streaming create).
    pub response: &'static str,
    /// Documented error statuses.
    pub errors: &'static [u16],
    /// Query parameters (name, description).
    pub query: &'static [(&'static str, &'static str)],
}

/// Every route the router serves (kept beside `app::router`).
pub const ROUTES: &[RouteDoc] = &[
    RouteDoc {
        method: "post",
        path: "/v1/responses",
        summary: "Create a model response (streaming when the body has \"stream\": true). A streamed request from Codex (an originator: codex_* header) refused with Retry-After (429, or 503 queue_timeout) is answered 200 instead, its stream ending with response.failed, code rate_limit_exceeded, whose message ends \"Please try again in Ns.\".",
        request: Some("CreateResponse"),
        response: "Response",
        errors: &[400, 401, 403, 404, 413, 415, 429, 500, 502, 503, 504],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/responses/{id}",
        summary: "Retrieve a stored response; with stream=true, a background response's events (replayed, then followed until the terminal event); a team holding [background] max_follows_per_team such streams on the gateway gets 429 too_many_follows for one more.",
        request: None,
        response: "Response",
        errors: &[400, 401, 404, 429, 503],
        query: &[
            (
                "stream",
                "true: stream the events of a background response (others are refused with 400)",
            ),
            (
                "starting_after",
                "with stream=true: the sequence_number after which to start",
            ),
        ],
    },
    RouteDoc {
        method: "delete",
        path: "/v1/responses/{id}",
        summary: "Delete a stored response.",
        request: None,
        response: "DeletedResponse",
        errors: &[400, 401, 404, 503],
        query: &[],
    },
    RouteDoc {
        method: "post",
        path: "/v1/responses/{id}/cancel",
        summary: "Cancel a background response.",
        request: None,
        response: "Response",
        errors: &[400, 401, 404, 503],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/responses/{id}/input_items",
        summary: "List the input items of a response.",
        request: None,
        response: "InputItemList",
        errors: &[400, 401, 404, 503],
        query: &[
            ("limit", "1-100, default 20"),
            ("order", "asc or desc (default)"),
            ("after", "item id to start after"),
            ("before", "item id to list the items just before"),
        ],
    },
    RouteDoc {
        method: "post",
        path: "/v1/responses/input_tokens",
        summary: "Count the input tokens a create request would use: the engine's tokenizer counts them, or, when it cannot (an openai-flavor pool, a failure, a timeout), an estimate from the prompt's length (one request of the team's requests-per-minute budget, no tokens).",
        request: Some("CountInputTokens"),
        response: "InputTokens",
        errors: &[400, 401, 404, 413, 415, 429, 503],
        query: &[],
    },
    RouteDoc {
        method: "post",
        path: "/v1/responses/compact",
        summary: "Compact a conversation into its user messages and one compaction item (not stored).",
        request: Some("CompactResponse"),
        response: "CompactedResponse",
        errors: &[400, 401, 403, 413, 415, 429, 500, 502, 503, 504],
        query: &[],
    },
    RouteDoc {
        method: "post",
        path: "/v1/conversations",
        summary: "Create a conversation, optionally with its first items (at most 20) and metadata.",
        request: Some("CreateConversation"),
        response: "Conversation",
        errors: &[400, 401, 413, 415, 503],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/conversations/{id}",
        summary: "Retrieve a conversation.",
        request: None,
        response: "Conversation",
        errors: &[401, 404, 503],
        query: &[],
    },
    RouteDoc {
        method: "post",
        path: "/v1/conversations/{id}",
        summary: "Replace a conversation's metadata.",
        request: Some("UpdateConversation"),
        response: "Conversation",
        errors: &[400, 401, 404, 413, 415, 503],
        query: &[],
    },
    RouteDoc {
        method: "delete",
        path: "/v1/conversations/{id}",
        summary: "Delete a conversation and its items (responses created in it stay).",
        request: None,
        response: "DeletedConversation",
        errors: &[401, 404, 503],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/conversations/{id}/items",
        summary: "List a conversation's items.",
        request: None,
        response: "InputItemList",
        errors: &[400, 401, 404, 503],
        query: &[
            ("limit", "1-100, default 20"),
            ("order", "asc or desc (default)"),
            ("after", "item id to start after"),
        ],
    },
    RouteDoc {
        method: "post",
        path: "/v1/conversations/{id}/items",
        summary: "Append items (at most 20) to a conversation; answers the items added (400 conversation_locked while a response runs in it).",
        request: Some("ConversationItems"),
        response: "InputItemList",
        errors: &[400, 401, 404, 413, 415, 503],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/conversations/{id}/items/{item_id}",
        summary: "Retrieve one item of a conversation.",
        request: None,
        response: "Item",
        errors: &[401, 404, 503],
        query: &[],
    },
    RouteDoc {
        method: "delete",
        path: "/v1/conversations/{id}/items/{item_id}",
        summary: "Delete one item of a conversation; answers the conversation.",
        request: None,
        response: "Conversation",
        errors: &[401, 404, 503],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/models",
        summary: "List the models the pools serve.",
        request: None,
        response: "ModelList",
        errors: &[401],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/v1/models/{model}",
        summary: "Retrieve one model.",
        request: None,
        response: "Model",
        errors: &[401, 404],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/health/live",
        summary: "Liveness: the process is up.",
        request: None,
        response: "Health",
        errors: &[],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/health/ready",
        summary: "Readiness: the store answers and some pool has an available endpoint (pools without one are listed in pools_without_endpoints).",
        request: None,
        response: "Health",
        errors: &[503],
        query: &[],
    },
    RouteDoc {
        method: "get",
        path: "/metrics",
        summary: "The gateway's Prometheus metrics: live endpoint state, routing decisions, pin moves, discovery reloads, probes, flow control (bands, teams, turns), prefill/decode decisions and sub-agent calls.",
        request: None,
        response: "PrometheusText",
        errors: &[],
        query: &[],
    },
];

/// The schema of query parameter `name`.
fn query_schema(name: &str) -> Value {
    match name {
        "limit" => json!({"type": "integer", "minimum": 1, "maximum": 100, "default": 20}),
        "order" => json!({"type": "string", "enum": ["asc", "desc"], "default": "desc"}),
        "stream" => json!({"type": "boolean", "default": false}),
        "starting_after" => json!({"type": "integer", "minimum": 0}),
        _ => json!({"type": "string"}),
    }
}

fn schema_ref(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn components() -> Value {
    let mut components = schemas();
    // The body of a token count: a create body whose model may be left out (the first
    // pool's is then counted with).
    let mut count = components["schemas"]["CreateResponse"].clone();
    if let Some(count) = count.as_object_mut() {
        count.remove("required");
        count.insert(
            "description".into(),
            json!("A create body to count the input tokens of; without `model`, the first pool's model counts them."),
        );
    }
    components["schemas"]["CountInputTokens"] = count;
    components
}

fn schemas() -> Value {
    let obj = |props: Value, required: &[&str]| json!({"type": "object", "properties": props, "required": required});
    json!({
        "schemas": {
            "Error": obj(json!({"error": obj(json!({
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": true},
                "code": {"type": "string", "nullable": true}
            }), &["message", "type", "param", "code"])}), &["error"]),
            "CreateResponse": {
                "type": "object",
                "description": "OpenAI Responses create body. Unknown fields are kept in the stored request.",
                "required": ["model"],
                "additionalProperties": true,
                "properties": {
                    "model": {"type": "string"},
                    "input": {
                        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
                        "description": "A string, or items: messages, function_call, function_call_output, reasoning, compaction (only as produced by this gateway; others are refused with 400), and a last compaction_trigger, which makes the turn a compaction: its output is one compaction item. May be left out with previous_response_id or conversation: the turn answers the history as it stands"
                    },
                    "instructions": {"type": "string", "nullable": true},
                    "previous_response_id": {"type": "string", "nullable": true},
                    "conversation": {
                        "oneOf": [{"type": "string"}, {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}],
                        "description": "Run in this conversation: its items are the history, and the turn's input and output items are appended once it is completed or incomplete. One turn at a time: while a response runs in the conversation, another (or an item append) is refused with 400 conversation_locked. Not with previous_response_id."
                    },
                    "store": {"type": "boolean", "default": true},
                    "stream": {"type": "boolean", "default": false},
                    "background": {"type": "boolean", "default": false, "description": "needs store: true"},
                    "tools": {"type": "array", "items": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"},
                            "strict": {"type": "boolean"}
                        }
                    }},
                    "tool_choice": {},
                    "parallel_tool_calls": {"type": "boolean"},
                    "max_output_tokens": {"type": "integer", "minimum": 16},
                    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
                    "text": {"type": "object", "properties": {
                        "format": {
                            "type": "object",
                            "required": ["type"],
                            "description": "json_schema needs name and schema",
                            "properties": {
                                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                "description": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": {"type": "boolean"}
                            }
                        },
                        "verbosity": {"type": "string", "enum": ["low", "medium", "high"]}
                    }},
                    "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string", "maxLength": 512}, "description": "at most 16 pairs, keys of at most 64 characters, values of at most 512"},
                    "prompt_cache_key": {"type": "string", "maxLength": 512},
                    "user": {"type": "string", "maxLength": 512},
                    "safety_identifier": {"type": "string", "maxLength": 512},
                    "include": {"type": "array", "items": {"type": "string"}, "description": "reasoning.encrypted_content (reasoning items carry it), message.output_text.logprobs (the answer's log probabilities, with top_logprobs alternatives); other values are accepted and ignored"},
                    "reasoning": {"type": "object", "properties": {
                        "effort": {"type": "string", "enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max"]},
                        "summary": {"type": "string", "enum": ["auto", "concise", "detailed"]}
                    }},
                    "truncation": {"type": "string", "enum": ["auto", "disabled"]},
                    "max_tool_calls": {"type": "integer", "minimum": 0},
                    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
                    "service_tier": {"type": "string", "description": "auto, default, flex, scale, priority, fast, ultrafast, or a key of [flow] service_tier"},
                    "prompt": {"description": "not supported: a request that sets it is refused with 400"}
                }
            },
            "Response": {
                "type": "object",
                "description": "OpenAI Response object; every key is present (null where unknown).",
                "additionalProperties": true,
                "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"type": "string", "enum": ["response"]},
                    "created_at": {"type": "integer"},
                    "status": {"type": "string", "enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
                    "model": {"type": "string"},
                    "output": {"type": "array", "items": {"type": "object"}},
                    "usage": {"type": "object", "nullable": true},
                    "error": {"type": "object", "nullable": true},
                    "incomplete_details": {"type": "object", "nullable": true}
                }
            },
            "CompactResponse": {
                "type": "object",
                "description": "What to compact: the previous_response_id chain, then input. Other CreateResponse fields (instructions, tools, reasoning, prompt_cache_key, service_tier) shape the summarizing turn, which is never stored (a store field is ignored); the gateway adds the compaction_trigger item itself; stream, background and conversation are refused.",
                "required": ["model"],
                "additionalProperties": true,
                "properties": {
                    "model": {"type": "string"},
                    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                    "instructions": {"type": "string", "nullable": true},
                    "previous_response_id": {"type": "string", "nullable": true}
                }
            },
            "CompactionItem": obj(json!({
                "type": {"type": "string", "enum": ["compaction"]},
                "id": {"type": "string"},
                "encrypted_content": {"type": "string", "description": "Opaque round-trip token (base64 of the summary; not encrypted)."}
            }), &["type", "id", "encrypted_content"]),
            "CompactedResponse": obj(json!({
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["response.compaction"]},
                "created_at": {"type": "integer"},
                "output": {"type": "array", "description": "Every user message of the conversation, then one compaction item.", "items": {"type": "object"}},
                "usage": {"type": "object"}
            }), &["id", "object", "created_at", "output", "usage"]),
            "Conversation": obj(json!({
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["conversation"]},
                "created_at": {"type": "integer"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}}
            }), &["id", "object", "created_at", "metadata"]),
            "CreateConversation": obj(json!({
                "items": {"type": "array", "maxItems": 20, "items": {"type": "object"}, "description": "Input items, as in CreateResponse.input"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}}
            }), &[]),
            "UpdateConversation": obj(json!({
                "metadata": {"type": "object", "nullable": true, "additionalProperties": {"type": "string"}, "description": "replaces the conversation's metadata; null clears it"}
            }), &["metadata"]),
            "ConversationItems": obj(json!({
                "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {"type": "object"}}
            }), &["items"]),
            "DeletedConversation": obj(json!({"id": {"type": "string"}, "object": {"type": "string", "enum": ["conversation.deleted"]}, "deleted": {"type": "boolean"}}), &["id", "object", "deleted"]),
            "Item": {"type": "object", "description": "A conversation item (message, function_call, function_call_output, reasoning, ...), with its id."},
            "DeletedResponse": obj(json!({"id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"type": "boolean"}}), &["id", "object", "deleted"]),
            "InputItemList": obj(json!({
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": {"type": "object"}},
                "first_id": {"type": "string", "nullable": true},
                "last_id": {"type": "string", "nullable": true},
                "has_more": {"type": "boolean"}
            }), &["object", "data", "has_more"]),
            "InputTokens": obj(json!({"object": {"type": "string", "enum": ["response.input_tokens"]}, "input_tokens": {"type": "integer"}}), &["object", "input_tokens"]),
            "Model": obj(json!({"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"}, "owned_by": {"type": "string"}}), &["id", "object"]),
            "ModelList": obj(json!({"object": {"type": "string"}, "data": {"type": "array", "items": schema_ref("Model")}}), &["object", "data"]),
            "Health": obj(json!({
                "status": {"type": "string"},
                "pools_without_endpoints": {"type": "array", "items": {"type": "string"}, "description": "GET /health/ready: pools with no available endpoint (their requests get 503 upstream_unavailable)."},
            }), &["status"])
        },
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}
    })
}

fn header(description: &str, kind: &str) -> Value {
    json!({"description": description, "schema": {"type": kind}})
}

/// OpenAI's rate-limit headers, sent when the team has limits.
fn rate_limit_headers(headers: &mut Map<String, Value>) {
    for kind in ["requests", "tokens"] {
        let what = format!("the team's {kind} per minute");
        headers.insert(
            format!("x-ratelimit-limit-{kind}"),
            header(&format!("Limit on {what}."), "integer"),
        );
        headers.insert(
            format!("x-ratelimit-remaining-{kind}"),
            header(&format!("What is left of {what}."), "integer"),
        );
        headers.insert(
            format!("x-ratelimit-reset-{kind}"),
            header(
                &format!("Until {what} are back to the limit, e.g. `6s`."),
                "string",
            ),
        );
    }
}

/// Headers of an admitted create request.
fn create_headers() -> Value {
    let mut headers = Map::new();
    headers.insert(
        crate::responses::ENDPOINT_HEADER.into(),
        header("The endpoint that served the request.", "string"),
    );
    headers.insert(
        crate::responses::ROUTE_REASON_HEADER.into(),
        header(
            "Why that endpoint: `pin`, `prefix`, `load` or `round_robin`.",
            "string",
        ),
    );
    headers.insert(
        crate::responses::PIN_MOVED_HEADER.into(),
        header(
            "Present when the session was pinned to another endpoint and moved: why \
             (`unavailable`, `saturated`, `wait`, `outscored` or `failed`).",
            "string",
        ),
    );
    headers.insert(
        crate::flow::BAND_HEADER.into(),
        header("The flow-control band the request ran in.", "string"),
    );
    headers.insert(
        crate::flow::QUEUE_WAIT_HEADER.into(),
        header(
            "Milliseconds the request waited in the gateway's queue.",
            "integer",
        ),
    );
    rate_limit_headers(&mut headers);
    Value::Object(headers)
}

/// Headers of a create request refused by flow control (shed, queue full, rate limited, queue timeout).
fn refusal_headers() -> Value {
    let mut headers = Map::new();
    headers.insert(
        "retry-after".into(),
        header("Seconds to wait before retrying.", "integer"),
    );
    rate_limit_headers(&mut headers);
    Value::Object(headers)
}

/// The OpenAPI document as JSON.
pub fn document() -> Value {
    let mut paths: Map<String, Value> = Map::new();
    for r in ROUTES {
        let mut op = Map::new();
        op.insert("summary".into(), json!(r.summary));
        let mut params: Vec<Value> = Vec::new();
        let mut rest = r.path;
        while let Some(start) = rest.find('{') {
            let Some(end) = rest[start..].find('}') else {
                break;
            };
            let name = &rest[start + 1..start + end];
            params.push(
                json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}),
            );
            rest = &rest[start + end + 1..];
        }
        for (name, desc) in r.query {
            params.push(json!({"name": name, "in": "query", "required": false, "description": desc, "schema": query_schema(name)}));
        }
        if !params.is_empty() {
            op.insert("parameters".into(), Value::Array(params));
        }
        if let Some(req) = r.request {
            op.insert("requestBody".into(), json!({"required": true, "content": {"application/json": {"schema": schema_ref(req)}}}));
        }
        let create = r.path == "/v1/responses" && r.method == "post";
        // Admitted through flow control like a create: the same routing and refusal headers.
        let admitted = create || (r.path == "/v1/responses/compact" && r.method == "post");
        let mut content = if r.response == "PrometheusText" {
            json!({"text/plain": {"schema": {"type": "string", "description": "Prometheus text exposition format, version 0.0.4"}}})
        } else {
            json!({"application/json": {"schema": schema_ref(r.response)}})
        };
        let streams = create || (r.path == "/v1/responses/{id}" && r.method == "get");
        if streams {
            content["text/event-stream"] = json!({"schema": {"type": "string", "description": "Server-sent Responses events (event: TYPE, data: JSON) with gapless sequence_number: response.created, response.queued (background), response.in_progress, response.output_item.added/.done, response.content_part.added/.done, response.output_text.delta/.done, response.function_call_arguments.delta/.done, response.custom_tool_call_input.delta/.done, response.reasoning_text.delta/.done, then one of response.completed, response.incomplete or response.failed (a cancelled background response's stream ends with response.failed carrying status cancelled). A followed background response (GET with stream=true) resumes after starting_after; the follow closes without a terminal event when the response is deleted, the gateway shuts down, or nothing happens for 15 minutes."}});
        }
        let mut ok = json!({"description": "OK", "content": content});
        if admitted {
            ok["headers"] = create_headers();
        }
        let mut responses = Map::new();
        responses.insert("200".into(), ok);
        for status in r.errors {
            let mut error = json!({"description": "Error", "content": {"application/json": {"schema": schema_ref("Error")}}});
            if admitted && matches!(status, 429 | 503) {
                error["headers"] = refusal_headers();
            }
            responses.insert(status.to_string(), error);
        }
        op.insert("responses".into(), Value::Object(responses));
        if !r.path.starts_with("/v1/") {
            // Health checks and metrics answer without a key.
            op.insert("security".into(), json!([]));
        }
        let entry = paths.entry(r.path.to_string()).or_insert_with(|| json!({}));
        entry[r.method] = Value::Object(op);
    }
    json!({
        "openapi": "3.0.3",
        "info": {"title": "agentgate", "version": env!("CARGO_PKG_VERSION"), "description": "OpenAI Responses API gateway for vLLM and SGLang fleets."},
        "security": [{"bearer": []}],
        "paths": paths,
        "components": components(),
    })
}

/// The OpenAPI document as YAML (the committed `openapi/openapi.yaml`).
pub fn yaml() -> String {
    let mut out = String::from("# Generated by `agentgate openapi`; do not edit by hand.\n");
    write_yaml(&document(), 0, &mut out);
    out
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => serde_json::to_string(s).unwrap_or_default(),
        other => other.to_string(),
    }
}

fn is_block(v: &Value) -> bool {
    matches!(v, Value::Object(m) if !m.is_empty()) || matches!(v, Value::Array(a) if !a.is_empty())
}

fn write_yaml(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) => {
            for (k, val) in m {
                let key = scalar(&Value::String(k.clone()));
                if is_block(val) {
                    out.push_str(&format!("{pad}{key}:\n"));
                    write_yaml(val, indent + 2, out);
                } else {
                    out.push_str(&format!("{pad}{key}: {}\n", inline(val)));
                }
            }
        }
        Value::Array(a) => {
            for val in a {
                if is_block(val) {
                    let mut inner = String::new();
                    write_yaml(val, indent + 2, &mut inner);
                    let trimmed = inner.get(indent + 2..).unwrap_or("");
                    out.push_str(&format!("{pad}- {trimmed}"));
                } else {
                    out.push_str(&format!("{pad}- {}\n", inline(val)));
                }
            }
        }
        other => out.push_str(&format!("{pad}{}\n", inline(other))),
    }
}

fn inline(v: &Value) -> String {
    match v {
        Value::Object(_) => "{}".into(),
        Value::Array(_) => "[]".into(),
        other => scalar(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_openapi_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../openapi/openapi.yaml");
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == yaml(),
            "openapi/openapi.yaml is stale: run `cargo run -- openapi > openapi/openapi.yaml`"
        );
    }
}
