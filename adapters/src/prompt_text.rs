//! A canonical rendering of a Chat Completions request's prompt, for prefix routing.
//!
//! The gateway does not run the engines' chat templates; it only needs bytes that (a) are the
//! same for the same history and (b) grow by appending when a conversation takes a turn, so that
//! chunk hashes of a turn's prompt extend those of the previous turn. Tools render first (they
//! precede the conversation in every engine template), then each message as its role, its text,
//! its reasoning and its tool calls, each followed by a separator byte that cannot occur in JSON
//! text.

use serde_json::Value;

const SEP: u8 = 0x1e;

fn push_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(s.as_bytes());
    out.push(SEP);
}

fn push_content(out: &mut Vec<u8>, content: &Value) {
    match content {
        Value::String(s) => push_str(out, s),
        Value::Array(parts) => {
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(t) => push_str(out, t),
                    None => push_str(out, &part.to_string()),
                }
            }
        }
        Value::Null => {}
        other => push_str(out, &other.to_string()),
    }
}

/// The canonical prompt bytes of a chat request body (`tools`, then `messages`).
pub fn prompt_text(chat_body: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some(tools) = chat_body.get("tools").and_then(Value::as_array) {
        for tool in tools {
            push_str(&mut out, &tool.to_string());
        }
    }
    for message in chat_body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        push_str(
            &mut out,
            message.get("role").and_then(Value::as_str).unwrap_or(""),
        );
        if let Some(reasoning) = message.get("reasoning_content").and_then(Value::as_str) {
            push_str(&mut out, reasoning);
        }
        if let Some(content) = message.get("content") {
            push_content(&mut out, content);
        }
        for call in message
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let f = call.get("function");
            push_str(
                &mut out,
                f.and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or(""),
            );
            push_str(
                &mut out,
                f.and_then(|f| f.get("arguments"))
                    .and_then(Value::as_str)
                    .unwrap_or(""),
            );
        }
        if let Some(id) = message.get("tool_call_id").and_then(Value::as_str) {
            push_str(&mut out, id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_new_turn_only_appends() {
        let turn1 = json!({"tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]});
        let turn2 = json!({"tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "42"}]});
        let a = prompt_text(&turn1);
        let b = prompt_text(&turn2);
        assert!(b.starts_with(&a) && b.len() > a.len());
    }

    #[test]
    fn different_histories_differ_and_parts_render_like_strings() {
        let s = prompt_text(&json!({"messages": [{"role": "user", "content": "abc"}]}));
        let p = prompt_text(
            &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}),
        );
        let other = prompt_text(&json!({"messages": [{"role": "user", "content": "abd"}]}));
        assert_eq!(s, p);
        assert_ne!(s, other);
        assert!(prompt_text(&json!({})).is_empty());
    }
}
