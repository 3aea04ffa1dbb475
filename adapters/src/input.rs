//! Normalization of the Responses `input` field into a list of items with ids.
//!
//! A string becomes one user message; every item gets an `id` when it lacks one; message content
//! given as a string becomes a one-part array; item shapes are checked and errors name the
//! offending parameter (e.g. `input[3].call_id`). Item types this gateway cannot translate
//! (hosted-tool calls such as `web_search_call`) are kept as they are and skipped at translation.

use crate::error::ApiError;
use crate::ids::new_item_id;
use serde_json::{json, Map, Value};

/// Input (string or array) -> items, each with an `id`; see the module doc for the rules.
pub fn normalize_input(input: &Value) -> Result<Vec<Value>, ApiError> {
    match input {
        Value::String(text) => Ok(vec![json!({
            "id": new_item_id("msg_"),
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        })]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(index, item)| normalize_item(item, &format!("input[{index}]")))
            .collect(),
        Value::Null => Ok(Vec::new()),
        _ => Err(ApiError::invalid(
            "input",
            "`input` must be a string or an array of input items",
        )
        .with_code("invalid_type")),
    }
}

/// The error for `field` of the wrong type: `missing_required_parameter` when it is absent (or
/// null), `invalid_type` otherwise.
fn wrong_type(value: Option<&Value>, param: String, message: String) -> ApiError {
    let code = match value {
        None | Some(Value::Null) => "missing_required_parameter",
        Some(_) => "invalid_type",
    };
    ApiError::invalid(param, message).with_code(code)
}

/// OpenAI's input item types that reach no engine as such (hosted tools' calls and outputs,
/// MCP items): kept in the history, left out of the prompt.
const HOSTED_ITEM_TYPES: &[&str] = &[
    "web_search_call",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "code_interpreter_call",
    "image_generation_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "tool_search_call",
    "tool_search_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
];

/// Whether `kind` is one of [`HOSTED_ITEM_TYPES`]. Any other unknown type is refused: a
/// misspelt type would otherwise be dropped from the prompt without a word.
fn other_known_item(kind: &str) -> bool {
    HOSTED_ITEM_TYPES.contains(&kind)
}

fn normalize_item(item: &Value, param: &str) -> Result<Value, ApiError> {
    let Some(object) = item.as_object() else {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be an object (an input item such as a message or function_call_output)"),
        )
        .with_code("invalid_type"));
    };
    let mut object = object.clone();
    let kind = match object.get("type") {
        Some(Value::String(kind)) => kind.clone(),
        None if object.contains_key("role") => {
            object.insert("type".into(), json!("message"));
            "message".to_string()
        }
        // An item reference may leave its type out: `{"id": "msg_..."}`.
        None if object.len() == 1 && object.get("id").is_some_and(Value::is_string) => {
            object.insert("type".into(), json!("item_reference"));
            "item_reference".to_string()
        }
        other => {
            return Err(wrong_type(
                other,
                format!("{param}.type"),
                format!("{param}.type is required and must be a string: use \"message\", \"function_call\", \"function_call_output\" or \"reasoning\""),
            ))
        }
    };
    let prefix = match kind.as_str() {
        "message" => {
            normalize_message(&mut object, param)?;
            "msg_"
        }
        "function_call" => {
            require_string(&object, "call_id", param)?;
            require_string(&object, "name", param)?;
            match object.get("arguments") {
                Some(Value::String(_)) => {}
                None | Some(Value::Null) => {
                    object.insert("arguments".into(), json!(""));
                }
                Some(other) if other.is_object() => {
                    let text = other.to_string();
                    object.insert("arguments".into(), json!(text));
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("{param}.arguments"),
                        format!("{param}.arguments must be a JSON-encoded string"),
                    )
                    .with_code("invalid_type"))
                }
            }
            "fc_"
        }
        "function_call_output" | "custom_tool_call_output" => {
            require_string(&object, "call_id", param)?;
            match object.get("output") {
                Some(Value::String(_)) | Some(Value::Array(_)) => {}
                other => {
                    return Err(wrong_type(
                        other,
                        format!("{param}.output"),
                        format!("{param}.output must be a string or an array of content parts"),
                    ))
                }
            }
            if kind == "function_call_output" {
                "fco_"
            } else {
                "ctco_"
            }
        }
        "custom_tool_call" => {
            require_string(&object, "call_id", param)?;
            require_string(&object, "name", param)?;
            require_string(&object, "input", param)?;
            "ctc_"
        }
        "reasoning" => {
            match object.get("summary") {
                Some(Value::Array(_)) => {}
                None | Some(Value::Null) => {
                    object.insert("summary".into(), json!([]));
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("{param}.summary"),
                        format!("{param}.summary must be an array of summary_text parts"),
                    )
                    .with_code("invalid_type"))
                }
            }
            "rs_"
        }
        "item_reference" => {
            require_string(&object, "id", param)?;
            "ref_"
        }
        "compaction" | "compaction_summary" => {
            require_string(&object, "encrypted_content", param)?;
            let blob = object
                .get("encrypted_content")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if crate::compaction::decode_compaction_blob(blob).is_none() {
                return Err(ApiError::invalid(
                    format!("{param}.encrypted_content"),
                    format!(
                        "{param} is a compaction item this gateway did not produce; its \
                         encrypted_content cannot be read here. Send the conversation itself, \
                         or compact it again through this gateway."
                    ),
                )
                .with_code("invalid_encrypted_content"));
            }
            object.insert("type".into(), json!("compaction"));
            "cmp_"
        }
        "compaction_trigger" => "ctrg_",
        // A content part where an item belongs (a common slip): it would reach no engine.
        "input_text" | "input_image" | "input_file" | "input_audio" | "output_text" | "refusal"
        | "text" => {
            return Err(ApiError::invalid(
                param.to_string(),
                format!(
                    "Invalid value: '{kind}'. {param} is a content part, not an input item: \
                     put it in a message's content, e.g. {{\"role\": \"user\", \"content\": \
                     [{{\"type\": \"{kind}\", ...}}]}}."
                ),
            )
            .with_code("invalid_value"));
        }
        other if other_known_item(other) => "item_",
        other => {
            return Err(ApiError::invalid(
                format!("{param}.type"),
                format!(
                    "Invalid value: '{other}'. {param}.type must be an input item type: \
                     message, function_call, function_call_output, custom_tool_call, \
                     custom_tool_call_output, reasoning, item_reference, compaction, or a hosted \
                     tool's call or output."
                ),
            ))
        }
    };
    let has_id = matches!(object.get("id"), Some(Value::String(id)) if !id.is_empty());
    if !has_id {
        object.insert("id".into(), json!(new_item_id(prefix)));
    }
    Ok(Value::Object(object))
}

fn normalize_message(object: &mut Map<String, Value>, param: &str) -> Result<(), ApiError> {
    let role = match object.get("role") {
        Some(Value::String(role)) => role.clone(),
        other => {
            return Err(wrong_type(
                other,
                format!("{param}.role"),
                format!("{param}.role is required: one of user, assistant, system, developer"),
            ))
        }
    };
    if !matches!(role.as_str(), "user" | "assistant" | "system" | "developer") {
        return Err(ApiError::invalid(
            format!("{param}.role"),
            format!("{param}.role \"{role}\" is not supported; use user, assistant, system or developer"),
        ));
    }
    let text_part_type = if role == "assistant" {
        "output_text"
    } else {
        "input_text"
    };
    match object.get("content") {
        Some(Value::String(text)) => {
            let part = if role == "assistant" {
                json!({"type": "output_text", "text": text, "annotations": []})
            } else {
                json!({"type": text_part_type, "text": text})
            };
            object.insert("content".into(), json!([part]));
        }
        Some(Value::Array(parts)) => {
            for (index, part) in parts.iter().enumerate() {
                let part_param = format!("{param}.content[{index}]");
                let kind = part.get("type").and_then(Value::as_str).ok_or_else(|| {
                    wrong_type(
                        part.get("type"),
                        format!("{part_param}.type"),
                        format!("{part_param}.type is required (input_text, output_text, input_image, ...)"),
                    )
                })?;
                match kind {
                    "input_text" | "output_text" | "text" | "summary_text" | "refusal"
                    | "input_image" | "input_file" | "input_audio" => {}
                    // A Chat Completions part: say what the Responses API calls it.
                    "image_url" => {
                        return Err(ApiError::invalid(
                            format!("{part_param}.type"),
                            format!("{part_param}.type \"image_url\" is a Chat Completions part; in the Responses API an image is {{\"type\": \"input_image\", \"image_url\": \"...\"}}"),
                        )
                        .with_code("invalid_value"))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            format!("{part_param}.type"),
                            format!("{part_param}.type \"{other}\" is not a content part type; use input_text, input_image or input_file (output_text or refusal in an assistant message)"),
                        )
                        .with_code("invalid_value"))
                    }
                }
                if matches!(kind, "input_text" | "output_text" | "text" | "summary_text")
                    && !part.get("text").is_some_and(Value::is_string)
                {
                    return Err(wrong_type(
                        part.get("text"),
                        format!("{part_param}.text"),
                        format!("{part_param}.text must be a string"),
                    ));
                }
                if kind == "refusal" && !part.get("refusal").is_some_and(Value::is_string) {
                    return Err(wrong_type(
                        part.get("refusal"),
                        format!("{part_param}.refusal"),
                        format!("{part_param}.refusal must be a string"),
                    ));
                }
            }
        }
        other => {
            return Err(wrong_type(
                other,
                format!("{param}.content"),
                format!("{param}.content must be a string or an array of content parts"),
            ))
        }
    }
    Ok(())
}

fn require_string(object: &Map<String, Value>, field: &str, param: &str) -> Result<(), ApiError> {
    let code = match object.get(field) {
        Some(Value::String(_)) => return Ok(()),
        None | Some(Value::Null) => "missing_required_parameter",
        Some(_) => "invalid_type",
    };
    Err(ApiError::invalid(
        format!("{param}.{field}"),
        format!("{param}.{field} is required and must be a string"),
    )
    .with_code(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_input_becomes_one_user_message() {
        let items = normalize_input(&json!("hello")).unwrap();
        assert_eq!(items.len(), 1);
        let item = &items[0];
        assert_eq!(item["type"], "message");
        assert_eq!(item["role"], "user");
        assert_eq!(
            item["content"],
            json!([{"type": "input_text", "text": "hello"}])
        );
        assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    }

    #[test]
    fn a_content_part_sent_as_an_item_is_refused_not_dropped() {
        let err = normalize_input(&json!([
            {"role": "user", "content": "hi"},
            {"type": "input_text", "text": "and this"},
        ]))
        .unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.param.as_deref(), Some("input[1]"));
        assert_eq!(err.code.as_deref(), Some("invalid_value"));
        assert!(err.message.contains("content part"), "{}", err.message);
    }

    #[test]
    fn a_missing_field_and_a_wrong_one_are_coded_apart() {
        let code = |item: Value| normalize_input(&json!([item])).unwrap_err();
        let missing = code(json!({"type": "function_call_output", "output": "ok"}));
        assert_eq!(missing.param.as_deref(), Some("input[0].call_id"));
        assert_eq!(missing.code.as_deref(), Some("missing_required_parameter"));
        let wrong = code(json!({"type": "function_call_output", "call_id": 7, "output": "ok"}));
        assert_eq!(wrong.code.as_deref(), Some("invalid_type"));
        let bad = code(json!({"type": "function_call_output", "call_id": "c", "output": 7}));
        assert_eq!(bad.code.as_deref(), Some("invalid_type"));
    }

    #[test]
    fn items_get_ids_by_kind_and_keep_existing_ids() {
        let items = normalize_input(&json!([
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
            {"type": "reasoning", "summary": []},
            {"type": "message", "id": "msg_keep", "role": "assistant", "content": "done"},
            {"type": "web_search_call", "status": "completed"},
        ]))
        .unwrap();
        let ids: Vec<&str> = items.iter().map(|i| i["id"].as_str().unwrap()).collect();
        assert!(ids[0].starts_with("msg_"));
        assert!(ids[1].starts_with("fc_"));
        assert!(ids[2].starts_with("fco_"));
        assert!(ids[3].starts_with("rs_"));
        assert_eq!(ids[4], "msg_keep");
        assert!(ids[5].starts_with("item_"));
        assert_eq!(items[0]["type"], "message");
        assert_eq!(items[0]["content"][0]["type"], "input_text");
        assert_eq!(items[4]["content"][0]["type"], "output_text");
    }

    #[test]
    fn errors_name_the_parameter() {
        let err = normalize_input(&json!([
            {"role": "user", "content": "hi"},
            {"type": "function_call_output", "output": "x"},
        ]))
        .unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.param.as_deref(), Some("input[1].call_id"));

        let err = normalize_input(&json!([{"role": "tool", "content": "x"}])).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0].role"));

        let err = normalize_input(&json!([{"role": "user", "content": [{"type": "input_text"}]}]))
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0].content[0].text"));

        let err = normalize_input(&json!(42)).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input"));

        let err = normalize_input(&json!([7])).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0]"));
    }

    #[test]
    fn errors_say_whether_a_field_is_missing_or_of_the_wrong_type() {
        let code = |input: Value| {
            let err = normalize_input(&input).unwrap_err();
            (err.param.unwrap(), err.code.unwrap())
        };
        let at = |p: &str, c: &str| (p.to_string(), c.to_string());
        assert_eq!(code(json!(42)), at("input", "invalid_type"));
        assert_eq!(code(json!([7])), at("input[0]", "invalid_type"));
        assert_eq!(
            code(json!([{"type": 5, "role": "user", "content": "x"}])),
            at("input[0].type", "invalid_type")
        );
        assert_eq!(
            code(json!([{"content": "x"}])),
            at("input[0].type", "missing_required_parameter")
        );
        assert_eq!(
            code(json!([{"type": "message", "role": 7, "content": "x"}])),
            at("input[0].role", "invalid_type")
        );
        assert_eq!(
            code(json!([{"role": "user", "content": 5}])),
            at("input[0].content", "invalid_type")
        );
        assert_eq!(
            code(json!([{"role": "user"}])),
            at("input[0].content", "missing_required_parameter")
        );
        assert_eq!(
            code(json!([{"type": "function_call_output", "call_id": "c", "output": {}}])),
            at("input[0].output", "invalid_type")
        );
        assert_eq!(
            code(json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}])),
            at("input[0].arguments", "invalid_type")
        );
    }

    #[test]
    fn a_misspelt_item_type_is_refused_and_a_hosted_tools_item_kept() {
        let err = normalize_input(&json!([{"type": "mesage", "role": "user", "content": "hi"}]))
            .unwrap_err();
        assert_eq!(
            (err.param.as_deref(), err.code.as_deref()),
            (Some("input[0].type"), Some("invalid_value"))
        );
        for misspelt in [
            "function_call_ouput",
            "fuction_call",
            "Function_call",
            "custom_tool_cal_output",
        ] {
            let err = normalize_input(&json!([
                {"type": misspelt, "call_id": "c1", "name": "f", "output": "42"}
            ]))
            .unwrap_err();
            assert_eq!(err.param.as_deref(), Some("input[0].type"), "{misspelt}");
        }
        for kind in [
            "web_search_call",
            "local_shell_call_output",
            "mcp_list_tools",
            "tool_search_output",
        ] {
            let items = normalize_input(&json!([{"type": kind, "id": "x_1"}])).unwrap();
            assert_eq!(items[0]["type"], kind);
        }
    }
}
