//! Context compaction: a conversation replaced by its user messages and one `compaction` item.
//!
//! Clients ask for it two ways, and both end in the same engine request:
//!
//! - `POST /v1/responses` whose input ends with `{"type": "compaction_trigger"}` (Codex's
//!   "remote compaction v2"). The answer's output is exactly one `compaction` item instead of
//!   a message; the client keeps its user messages and that item as its new history.
//! - `POST /v1/responses/compact` (the `responses.compact` call of the SDKs): the gateway runs
//!   the same turn and answers with the retained user messages followed by the item.
//!
//! Engines keep no hidden state, so the item carries the summary itself: `encrypted_content`
//! is standard base64 of the JSON `{"agentgate_compaction": 1, "text": "<summary>"}`, like the
//! reasoning blob ([`crate::encode_reasoning_blob`]). It is NOT encrypted and NOT secret: it is
//! an opaque round-trip token holding the client's own conversation. When the item comes back
//! in a later input it is given to the engine as a user message, [`SUMMARY_PREFIX`] followed by
//! the summary. A `compaction` item this gateway did not make (OpenAI's own, encrypted) cannot
//! be read, and the request is refused with 400 rather than answered without that context.
//!
//! The summary is written by the pool's model: the conversation so far, rendered exactly as for
//! a normal turn (same instructions, tools and history, so the engine's prefix cache serves it),
//! followed by a user message with the compaction prompt ([`DEFAULT_PROMPT`] unless configured),
//! with `tool_choice` `none` and at most [`CompactionOptions::max_output_tokens`] tokens. A summary
//! cut at that limit is kept as it is: shorter context is the point, and the turn completes.

use serde_json::Value;

use crate::reasoning_blob::{decode_tagged, encode_tagged};

pub(crate) const FORMAT_KEY: &str = "agentgate_compaction";

/// What the engine reads before a compacted summary.
pub const SUMMARY_PREFIX: &str =
    "Summary of the conversation so far (earlier turns were compacted into it):\n\n";

/// The instruction that asks the model for the summary.
pub const DEFAULT_PROMPT: &str = "Your context is about to be compacted: everything above will be \
replaced by the user's messages and the summary you write now. Write that summary for whoever \
continues the work: the goal and the constraints the user set, what has been done and found \
(files, commands, results, decisions and why), what is in progress, and the next steps. Be \
specific and complete, but do not repeat the user's messages. Reply with the summary only.";

/// Default most tokens the summary may take.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;

/// How compaction turns are built ([module doc](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompactionOptions {
    /// The user message that asks for the summary.
    pub prompt: String,
    /// Most tokens the summary may take (a request's smaller `max_output_tokens` wins).
    pub max_output_tokens: u64,
}

impl Default for CompactionOptions {
    fn default() -> Self {
        CompactionOptions {
            prompt: DEFAULT_PROMPT.to_string(),
            max_output_tokens: DEFAULT_MAX_OUTPUT_TOKENS,
        }
    }
}

/// The `encrypted_content` of a compaction item holding `summary`.
pub fn encode_compaction_blob(summary: &str) -> String {
    encode_tagged(FORMAT_KEY, summary)
}

/// The summary in an `encrypted_content` made by [`encode_compaction_blob`]; `None` for
/// anything else (another provider's item, or a reasoning blob).
pub fn decode_compaction_blob(blob: &str) -> Option<String> {
    decode_tagged(FORMAT_KEY, blob)
}

/// Whether `item` is the request control that asks for a compaction.
pub fn is_compaction_trigger(item: &Value) -> bool {
    item.get("type").and_then(Value::as_str) == Some("compaction_trigger")
}

/// Whether a turn with these input items is a compaction: its last item is the trigger.
pub fn requests_compaction(input: &[Value]) -> bool {
    input.last().is_some_and(is_compaction_trigger)
}

/// The items a compaction keeps besides its `compaction` item: every user message of the
/// conversation (`history` then `input`), in order.
pub fn retained_user_messages<'a>(
    history: &'a [Value],
    input: &'a [Value],
) -> impl Iterator<Item = &'a Value> {
    history.iter().chain(input).filter(|item| {
        item.get("type").and_then(Value::as_str) == Some("message")
            && item.get("role").and_then(Value::as_str) == Some("user")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode_reasoning_blob;
    use serde_json::json;

    #[test]
    fn blobs_round_trip_and_foreign_ones_do_not_decode() {
        let summary = "Goal: fix the \"parser\" — done: tests 🚀\nnext: docs";
        assert_eq!(
            decode_compaction_blob(&encode_compaction_blob(summary)).as_deref(),
            Some(summary)
        );
        assert_eq!(decode_compaction_blob(&encode_reasoning_blob("x")), None);
        assert_eq!(decode_compaction_blob("gAAAAABpZ-openai-ciphertext"), None);
        assert_eq!(decode_compaction_blob(""), None);
    }

    #[test]
    fn only_a_trailing_trigger_asks_for_compaction() {
        let user = json!({"type": "message", "role": "user", "content": []});
        let trigger = json!({"type": "compaction_trigger"});
        assert!(requests_compaction(&[user.clone(), trigger.clone()]));
        assert!(!requests_compaction(&[trigger, user]));
        assert!(!requests_compaction(&[]));
    }
}
