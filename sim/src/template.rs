//! The chat template: renders messages, tools, tool calls and tool results into one prompt string.
//!
//! ChatML-like and append-only: tools come first (one JSON line each, in request order), then each
//! message as `<|im_start|>{role}\n{content}<|im_end|>\n`, assistant tool calls as
//! `<tool_call>{"name":..,"arguments":..}</tool_call>` lines, tool results as a `tool` turn, and
//! finally the generation prompt `<|im_start|>assistant\n`. Rendering a longer history of the same
//! conversation therefore only appends to the previous prompt, so its KV blocks are reused.
//!
//! An assistant message in the history renders as exactly the text the model generated for it
//! after the generation prompt: [`THINK_OPEN`] reasoning [`THINK_CLOSE`], the content, then each
//! tool call as [`tool_call_open`] arguments [`TOOL_CALL_CLOSE`]. The generator
//! ([`crate::generate`]) emits the same markup as (hidden) tokens, so the next turn's prompt
//! repeats the previous prompt and output token for token and hits the cache through the answer.

use serde_json::Value;

/// Opens the reasoning part of an assistant turn.
pub const THINK_OPEN: &str = "<think>";
/// Closes the reasoning part of an assistant turn.
pub const THINK_CLOSE: &str = "</think>\n";
/// Closes one tool call of an assistant turn.
pub const TOOL_CALL_CLOSE: &str = "}</tool_call>";

/// The text that opens a tool call of function `name`, up to where its arguments begin.
pub fn tool_call_open(name: &str) -> String {
    format!("\n<tool_call>{{\"name\":\"{name}\",\"arguments\":")
}

/// Text of a message `content`: a string, or the text parts of an array of content parts.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => {
            let mut out = String::new();
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(text) => out.push_str(text),
                    None => {
                        if let Some(kind) = part.get("type").and_then(Value::as_str) {
                            out.push_str("<|");
                            out.push_str(kind);
                            out.push_str("|>");
                        }
                    }
                }
            }
            out
        }
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Render a chat request (`messages`, optional `tools`) to the prompt string; an assistant
/// message's reasoning is read from its `reasoning_key` field (the engine's name for it), and
/// under any other name is not seen, as the engine would not see it.
pub fn render_chat(messages: &[Value], tools: Option<&[Value]>, reasoning_key: &str) -> String {
    let mut out = String::with_capacity(256);
    if let Some(tools) = tools.filter(|tools| !tools.is_empty()) {
        out.push_str("<|im_start|>tools\n");
        for tool in tools {
            out.push_str(&tool.to_string());
            out.push('\n');
        }
        out.push_str("<|im_end|>\n");
    }
    for message in messages {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user");
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
        if let Some(reasoning) = message.get(reasoning_key).and_then(Value::as_str) {
            out.push_str(THINK_OPEN);
            out.push_str(reasoning);
            out.push_str(THINK_CLOSE);
        }
        if let Some(content) = message.get("content") {
            out.push_str(&content_text(content));
        }
        if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
            for call in calls {
                let function = call.get("function").unwrap_or(&Value::Null);
                let name = function.get("name").and_then(Value::as_str).unwrap_or("");
                let arguments = function
                    .get("arguments")
                    .and_then(Value::as_str)
                    .unwrap_or("{}");
                out.push_str(&tool_call_open(name));
                out.push_str(arguments);
                out.push_str(TOOL_CALL_CLOSE);
            }
        }
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_new_turn_only_appends() {
        let tools = vec![json!({"type":"function","function":{"name":"ls"}})];
        let first = vec![json!({"role":"user","content":"list files"})];
        let mut second = first.clone();
        second.push(json!({"role":"assistant","content":null,"tool_calls":[
            {"id":"c1","type":"function","function":{"name":"ls","arguments":"{\"path\":\".\"}"}}]}));
        second.push(json!({"role":"tool","tool_call_id":"c1","content":"a.txt"}));
        let a = render_chat(&first, Some(&tools), "reasoning");
        let b = render_chat(&second, Some(&tools), "reasoning");
        let a_without_generation_prompt = a.trim_end_matches("<|im_start|>assistant\n");
        assert!(b.starts_with(a_without_generation_prompt));
        assert!(b.contains("<tool_call>{\"name\":\"ls\""));
        assert_eq!(a, render_chat(&first, Some(&tools), "reasoning"));
    }
}
