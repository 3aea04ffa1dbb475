//! The stored unit (one response and its delta of items) and the options shared by all backends
//! (response TTL, session pin TTL, key prefix).

use std::time::Duration;

use serde_json::Value;

/// One stored response: its own delta plus the Response object clients GET.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ResponseRecord {
    /// The response id (`resp_...`).
    pub id: String,
    /// The team that created it; other teams cannot see it.
    pub team: String,
    /// The response this one continues, if any.
    pub previous_response_id: Option<String>,
    /// This turn's new input items (each has an "id").
    pub input_items: Vec<Value>,
    /// This turn's output items.
    pub output_items: Vec<Value>,
    /// The full Response object (has "status").
    pub response: Value,
}

/// A conversation of the Conversations API (`conv_...`), without its items: those are a list
/// kept beside it ([`crate::Store::conversation_items`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ConversationRecord {
    /// The conversation id (`conv_...`).
    pub id: String,
    /// The team that created it; other teams cannot see it.
    pub team: String,
    /// Unix seconds of its creation.
    pub created_at: u64,
    /// Its `metadata` object (up to 16 string pairs, checked by the gateway).
    pub metadata: Value,
}

/// A conversation as [`crate::Store::history`] loads it.
#[derive(Debug, Clone, PartialEq)]
pub struct History {
    /// Every item of the chain, oldest first.
    pub items: Vec<Value>,
    /// Id of the oldest response walked: the chain's root, or the oldest response still stored
    /// when the beginning has expired or been deleted.
    pub root_id: String,
    /// `status` of the newest response, the one asked for (`completed`, `in_progress`, ...).
    pub status: String,
}

impl ResponseRecord {
    /// The `status` field of the stored Response object, or "" if it has none.
    pub fn status(&self) -> &str {
        response_status(&self.response)
    }
}

/// The `status` field of a Response object, or "" if it has none.
pub fn response_status(response: &Value) -> &str {
    response.get("status").and_then(Value::as_str).unwrap_or("")
}

/// Whether a Response status still allows [`crate::Store::update_if_active`] to replace it.
pub fn is_active_status(status: &str) -> bool {
    status == "queued" || status == "in_progress"
}

/// Settings shared by every backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// How long a response stays stored after it was last written or used in a history load.
    pub ttl: Duration,
    /// Prefix of every Redis key this store writes.
    pub key_prefix: String,
    /// How long a session pin stays after it was last set or touched.
    pub pin_ttl: Duration,
    /// In-memory backend only: most bytes its records may take (estimated, see
    /// [`crate::MemoryStore`]); past it the least recently used records are dropped. 0: no
    /// limit. Redis bounds its memory with its own `maxmemory`.
    pub max_memory_bytes: u64,
    /// How long a response's event log is kept once the response has ended (at most `ttl`):
    /// long enough for a client to resume a stream it lost, not the response's whole life (a
    /// log holds every streamed delta, many times the response's size).
    pub ended_log_ttl: Duration,
}

/// Default time a stored response is kept: 30 days.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Default time a session pin is kept after its last use: 1 hour.
pub const DEFAULT_PIN_TTL: Duration = Duration::from_secs(60 * 60);

/// Default time an ended response's event log is kept: 1 hour.
pub const DEFAULT_ENDED_LOG_TTL: Duration = Duration::from_secs(60 * 60);

/// Default memory bound of the in-memory backend's records: 1 GiB.
pub const DEFAULT_MAX_MEMORY_BYTES: u64 = 1 << 30;

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            ttl: DEFAULT_TTL,
            key_prefix: "agentgate:".to_string(),
            pin_ttl: DEFAULT_PIN_TTL,
            max_memory_bytes: DEFAULT_MAX_MEMORY_BYTES,
            ended_log_ttl: DEFAULT_ENDED_LOG_TTL,
        }
    }
}
