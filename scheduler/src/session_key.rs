//! Session identity: which agent session a Responses request belongs to, from its headers and body.
//!
//! Every turn of a session should reach the replica that holds its KV cache, so the gateway needs a
//! key that stays the same across the turns of one conversation and differs between
//! conversations. [`session_key`] takes the first source that applies, in this order:
//!
//! 1. the configured session header ([`SessionKeyConfig::header`], default `x-session-id`);
//! 2. the headers coding agents send natively ([`NATIVE_SESSION_HEADERS`], when
//!    [`SessionKeyConfig::native_headers`] is on), in this order:
//!    - `x-claude-code-session-id`: Claude Code (v2.1.86 and later) on every model request, one
//!      UUID per session (Claude Code's LLM gateway protocol reference);
//!    - `session-id`: Codex CLI, the session id (for a root session the same value as the
//!      thread id and `prompt_cache_key`; spawned sub-agent threads carry their root's session id
//!      and their own `thread-id`, so a Codex session's sub-agents share its key);
//!    - `session_id`: earlier Codex CLI releases, the conversation id;
//!    - `x-opencode-session`: OpenCode, its session id (`ses_...`), on requests to OpenCode's
//!      own providers;
//!    - `x-session-affinity`: OpenCode, the same session id, on requests to every other
//!      provider (which also carry it as `X-Session-Id`, the default configured header above);
//! 3. the body's `prompt_cache_key` (Codex sends its thread id here on every turn, stateless or
//!    not);
//! 4. the root of the `previous_response_id` chain (the first response of a stored conversation,
//!    resolved by the caller from the response store);
//! 5. the body's `conversation` (a string id, or an object with an `id`).
//!
//! A request with none of these has no session key; the prefix index routes it.
//!
//! # Key format
//!
//! Values are trimmed; empty ones are skipped and the next source is tried. The key is the value
//! behind a prefix naming the kind of source, so equal values from different kinds never collide:
//!
//! ```text
//! header            h:<value>      (all session headers share one namespace)
//! prompt_cache_key  pck:<value>
//! chain root        root:<value>
//! conversation      conv:<value>
//! ```
//!
//! A value longer than [`MAX_RAW_VALUE_BYTES`] bytes, or containing control characters, is
//! replaced by its XXH3-128 digest in 32 hex digits, behind `#` instead of `:` (`h#<digest>`,
//! `pck#<digest>`, ...), so keys stay short and printable and a hashed key never equals a raw one.
//!
//! A conversation driven by `previous_response_id` alone has no key on its first turn (its root
//! does not exist yet); pin that turn under [`chain_root_key`] of the response it produced, which
//! is the key every later turn of the chain computes.

use std::fmt;

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128;

/// Values longer than this many bytes are hashed into a fixed-length key.
pub const MAX_RAW_VALUE_BYTES: usize = 256;

/// The session header [`SessionKeyConfig::default`] reads.
pub const DEFAULT_SESSION_HEADER: &str = "x-session-id";

/// Headers coding agents send natively, in the order they are tried, with the client sending each.
pub const NATIVE_SESSION_HEADERS: &[(&str, &str)] = &[
    ("x-claude-code-session-id", "Claude Code"),
    ("session-id", "Codex CLI"),
    ("session_id", "Codex CLI (earlier releases)"),
    ("x-opencode-session", "OpenCode (OpenCode providers)"),
    ("x-session-affinity", "OpenCode (other providers)"),
];

/// Where a session key came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SessionSource {
    /// A request header, by its lowercase name.
    Header(String),
    /// The body's `prompt_cache_key`.
    PromptCacheKey,
    /// The first response of the `previous_response_id` chain.
    ChainRoot,
    /// The body's `conversation` id.
    Conversation,
}

impl SessionSource {
    /// A short, fixed label for metrics and logs (`header`, `prompt_cache_key`, `chain_root`,
    /// `conversation`).
    pub fn label(&self) -> &'static str {
        match self {
            SessionSource::Header(_) => "header",
            SessionSource::PromptCacheKey => "prompt_cache_key",
            SessionSource::ChainRoot => "chain_root",
            SessionSource::Conversation => "conversation",
        }
    }

    /// The key prefix of this kind of source (headers share one).
    fn prefix(&self) -> &'static str {
        match self {
            SessionSource::Header(_) => "h",
            SessionSource::PromptCacheKey => "pck",
            SessionSource::ChainRoot => "root",
            SessionSource::Conversation => "conv",
        }
    }
}

impl fmt::Display for SessionSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionSource::Header(name) => write!(f, "header {name}"),
            other => f.write_str(other.label()),
        }
    }
}

/// A request's session key and where it came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SessionKey {
    /// The key, prefixed by the kind of source (see the module docs); pins are stored under it.
    pub value: String,
    /// The source the key was taken from.
    pub source: SessionSource,
}

impl SessionKey {
    /// Builds the key for `raw` from `source`: trimmed, prefixed, hashed when too long or not
    /// printable; `None` when `raw` is empty or whitespace.
    pub fn from_source(source: SessionSource, raw: &str) -> Option<SessionKey> {
        let raw = raw.trim();
        if raw.is_empty() {
            return None;
        }
        let value = key_part(source.prefix(), raw);
        Some(SessionKey { value, source })
    }
}

/// Which session sources [`session_key`] reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionKeyConfig {
    /// The session header tried first (matched case-insensitively; empty to read none).
    pub header: String,
    /// Whether the agents' native headers ([`NATIVE_SESSION_HEADERS`]) are read.
    pub native_headers: bool,
}

impl Default for SessionKeyConfig {
    fn default() -> Self {
        SessionKeyConfig {
            header: DEFAULT_SESSION_HEADER.to_string(),
            native_headers: true,
        }
    }
}

/// The session key of a Responses request, from the first source that applies (see the module
/// docs for the order).
///
/// `headers` are (name, value) pairs, names in any case; the first non-empty value of a header
/// wins. `body` is the raw request JSON. `chain_root` is the id of the first response of the
/// `previous_response_id` chain, when the caller could resolve it.
pub fn session_key(
    cfg: &SessionKeyConfig,
    headers: &[(&str, &str)],
    body: &Value,
    chain_root: Option<&str>,
) -> Option<SessionKey> {
    let configured = cfg.header.trim();
    let configured = (!configured.is_empty()).then_some(configured);
    let native = NATIVE_SESSION_HEADERS
        .iter()
        .filter(|_| cfg.native_headers)
        .map(|(name, _)| *name);
    for name in configured.into_iter().chain(native) {
        if let Some(key) = header_key(headers, name) {
            return Some(key);
        }
    }
    if let Some(key) = body
        .get("prompt_cache_key")
        .and_then(Value::as_str)
        .and_then(|v| SessionKey::from_source(SessionSource::PromptCacheKey, v))
    {
        return Some(key);
    }
    if let Some(key) =
        chain_root.and_then(|root| SessionKey::from_source(SessionSource::ChainRoot, root))
    {
        return Some(key);
    }
    let conversation = body.get("conversation").and_then(|c| match c {
        Value::String(id) => Some(id.as_str()),
        Value::Object(obj) => obj.get("id").and_then(Value::as_str),
        _ => None,
    });
    conversation.and_then(|id| SessionKey::from_source(SessionSource::Conversation, id))
}

/// The key a chain rooted at `response_id` maps to: pin the first turn of a conversation driven
/// by `previous_response_id` under it, and its later turns find the pin.
pub fn chain_root_key(response_id: &str) -> Option<SessionKey> {
    SessionKey::from_source(SessionSource::ChainRoot, response_id)
}

/// `{prefix}:{raw}`, or `{prefix}#` and the 128-bit xxh3 hash of `raw` in hex when `raw` is
/// longer than [`MAX_RAW_VALUE_BYTES`] or holds control characters: a key's size stays bounded
/// whatever a client sends.
pub(crate) fn key_part(prefix: &str, raw: &str) -> String {
    if raw.len() > MAX_RAW_VALUE_BYTES || raw.chars().any(char::is_control) {
        format!("{prefix}#{:032x}", xxh3_128(raw.as_bytes()))
    } else {
        format!("{prefix}:{raw}")
    }
}

/// The key from the first non-empty value of header `name` (case-insensitive).
fn header_key(headers: &[(&str, &str)], name: &str) -> Option<SessionKey> {
    headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .find_map(|(_, v)| {
            SessionKey::from_source(SessionSource::Header(name.to_ascii_lowercase()), v)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(headers: &[(&str, &str)], body: &Value, root: Option<&str>) -> Option<SessionKey> {
        session_key(&SessionKeyConfig::default(), headers, body, root)
    }

    fn value(headers: &[(&str, &str)], body: &Value, root: Option<&str>) -> Option<String> {
        key(headers, body, root).map(|k| k.value)
    }

    #[test]
    fn no_source_gives_no_key() {
        let body = json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"});
        assert_eq!(
            key(&[("content-type", "application/json")], &body, None),
            None
        );
    }

    #[test]
    fn configured_header_comes_first() {
        let body = json!({"prompt_cache_key": "pck-1", "conversation": "conv_1"});
        let headers = [
            ("session-id", "codex-1"),
            ("x-claude-code-session-id", "claude-1"),
            ("x-session-id", "mine"),
        ];
        let k = key(&headers, &body, Some("resp_root")).unwrap();
        assert_eq!(k.value, "h:mine");
        assert_eq!(k.source, SessionSource::Header("x-session-id".into()));
    }

    #[test]
    fn full_precedence_order() {
        let full_body = json!({"prompt_cache_key": "p", "conversation": {"id": "c"}});
        let all_headers = [
            ("x-session-affinity", "affinity"),
            ("x-opencode-session", "opencode"),
            ("session_id", "codex-old"),
            ("session-id", "codex"),
            ("x-claude-code-session-id", "claude"),
            ("x-session-id", "configured"),
        ];
        // Drop the highest-precedence source one at a time and check the next one answers.
        let expected_headers = [
            "configured",
            "claude",
            "codex",
            "codex-old",
            "opencode",
            "affinity",
        ];
        for (dropped, want) in expected_headers.iter().enumerate() {
            let remaining = &all_headers[..all_headers.len() - dropped];
            assert_eq!(
                value(remaining, &full_body, Some("r")),
                Some(format!("h:{want}"))
            );
        }
        assert_eq!(value(&[], &full_body, Some("r")).as_deref(), Some("pck:p"));
        let no_pck = json!({"conversation": {"id": "c"}});
        assert_eq!(value(&[], &no_pck, Some("r")).as_deref(), Some("root:r"));
        assert_eq!(value(&[], &no_pck, None).as_deref(), Some("conv:c"));
    }

    #[test]
    fn each_native_header_is_read_and_named() {
        for (name, _client) in NATIVE_SESSION_HEADERS {
            let k = key(&[(name, "abc")], &json!({}), None).unwrap();
            assert_eq!(k.value, "h:abc");
            assert_eq!(k.source, SessionSource::Header((*name).to_string()));
        }
    }

    #[test]
    fn header_names_match_case_insensitively() {
        let k = key(&[("X-Claude-Code-Session-Id", "u-1")], &json!({}), None).unwrap();
        assert_eq!(k.value, "h:u-1");
        assert_eq!(
            k.source,
            SessionSource::Header("x-claude-code-session-id".into())
        );
        let cfg = SessionKeyConfig {
            header: "X-Agent-Session".into(),
            native_headers: true,
        };
        let k = session_key(&cfg, &[("x-agent-session", "s")], &json!({}), None).unwrap();
        assert_eq!(k.source, SessionSource::Header("x-agent-session".into()));
    }

    #[test]
    fn native_headers_can_be_turned_off() {
        let cfg = SessionKeyConfig {
            header: "x-session-id".into(),
            native_headers: false,
        };
        let body = json!({"prompt_cache_key": "p"});
        let k = session_key(&cfg, &[("session-id", "codex")], &body, None).unwrap();
        assert_eq!(k.value, "pck:p");
        let k = session_key(&cfg, &[("x-session-id", "mine")], &body, None).unwrap();
        assert_eq!(k.value, "h:mine");
    }

    #[test]
    fn custom_header_replaces_the_default() {
        let cfg = SessionKeyConfig {
            header: "x-team-session".into(),
            native_headers: false,
        };
        let body = json!({});
        assert_eq!(
            session_key(&cfg, &[("x-session-id", "s")], &body, None),
            None
        );
        let k = session_key(&cfg, &[("x-team-session", "t")], &body, None).unwrap();
        assert_eq!(k.value, "h:t");
    }

    #[test]
    fn empty_configured_header_reads_no_configured_header() {
        let cfg = SessionKeyConfig {
            header: String::new(),
            native_headers: true,
        };
        let k = session_key(
            &cfg,
            &[("", "x"), ("session-id", "codex")],
            &json!({}),
            None,
        );
        assert_eq!(k.map(|k| k.value).as_deref(), Some("h:codex"));
    }

    #[test]
    fn empty_and_whitespace_values_fall_through() {
        let body = json!({"prompt_cache_key": "  ", "conversation": {"id": " conv_9 "}});
        let headers = [
            ("x-session-id", ""),
            ("x-claude-code-session-id", " \t "),
            ("session-id", "   "),
        ];
        assert_eq!(
            value(&headers, &body, Some(" ")).as_deref(),
            Some("conv:conv_9")
        );
        let nothing = json!({"prompt_cache_key": "", "conversation": ""});
        assert_eq!(value(&headers, &nothing, Some("")), None);
    }

    #[test]
    fn values_are_trimmed() {
        assert_eq!(
            value(&[("x-session-id", "  abc \t")], &json!({}), None).as_deref(),
            Some("h:abc")
        );
        assert_eq!(
            value(&[], &json!({"prompt_cache_key": " p "}), None).as_deref(),
            Some("pck:p")
        );
    }

    #[test]
    fn first_non_empty_duplicate_header_wins() {
        let headers = [
            ("x-session-id", " "),
            ("x-session-id", "b"),
            ("x-session-id", "c"),
        ];
        assert_eq!(value(&headers, &json!({}), None).as_deref(), Some("h:b"));
    }

    #[test]
    fn non_string_body_fields_are_ignored() {
        let body = json!({"prompt_cache_key": 42, "conversation": {"id": 7}});
        assert_eq!(value(&[], &body, None), None);
        let body = json!({"prompt_cache_key": null, "conversation": "conv_s"});
        assert_eq!(value(&[], &body, None).as_deref(), Some("conv:conv_s"));
        assert_eq!(value(&[], &json!("not an object"), None), None);
    }

    #[test]
    fn long_values_are_hashed_to_a_fixed_length() {
        let at_limit = "a".repeat(MAX_RAW_VALUE_BYTES);
        let k = value(&[("x-session-id", &at_limit)], &json!({}), None).unwrap();
        assert_eq!(k, format!("h:{at_limit}"));

        let long_a = "a".repeat(MAX_RAW_VALUE_BYTES + 1);
        let long_b = "b".repeat(10_000);
        let ka = value(&[("x-session-id", &long_a)], &json!({}), None).unwrap();
        let kb = value(&[("x-session-id", &long_b)], &json!({}), None).unwrap();
        assert!(ka.starts_with("h#") && kb.starts_with("h#"), "{ka} {kb}");
        assert_eq!(ka.len(), 2 + 32);
        assert_eq!(kb.len(), 2 + 32);
        assert_ne!(ka, kb);
        // Stable: the same value always hashes to the same key, and trimming happens first.
        let padded = format!("  {long_a}  ");
        let again = value(&[("x-session-id", &padded)], &json!({}), None).unwrap();
        assert_eq!(ka, again);

        let body = json!({"prompt_cache_key": long_b});
        let kp = value(&[], &body, None).unwrap();
        assert!(kp.starts_with("pck#"), "{kp}");
        assert_eq!(kp.len(), 4 + 32);
        // Same digest, different source prefix: the keys differ.
        assert_eq!(kp[4..], kb[2..]);
        assert_ne!(kp, kb);
    }

    #[test]
    fn control_characters_are_hashed() {
        let k = value(&[("x-session-id", "a\nb")], &json!({}), None).unwrap();
        assert!(k.starts_with("h#") && k.len() == 34, "{k}");
    }

    #[test]
    fn equal_values_from_different_sources_do_not_collide() {
        let id = "same-id";
        let keys = [
            value(&[("x-session-id", id)], &json!({}), None),
            value(&[], &json!({"prompt_cache_key": id}), None),
            value(&[], &json!({}), Some(id)),
            value(&[], &json!({"conversation": id}), None),
        ];
        for (i, a) in keys.iter().enumerate() {
            assert!(a.is_some());
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn codex_turns_keep_their_key_whether_they_chain_or_not() {
        // Codex sends the same prompt_cache_key (its thread id) on every turn. Stateless turns
        // resend the whole input; stored turns chain with previous_response_id.
        let thread = "019a5b7e-3c1f-7d2e-9a4b-5c6d7e8f9a0b";
        let stateless_1 = json!({"prompt_cache_key": thread, "input": [], "store": false});
        let stateless_2 = json!({"prompt_cache_key": thread, "input": [], "store": false});
        let chained_2 = json!({
            "prompt_cache_key": thread,
            "previous_response_id": "resp_2",
            "input": [],
        });
        let k1 = key(&[], &stateless_1, None).unwrap();
        let k2 = key(&[], &stateless_2, None).unwrap();
        let k3 = key(&[], &chained_2, Some("resp_1")).unwrap();
        assert_eq!(k1, k2);
        assert_eq!(k1, k3);
        assert_eq!(k1.source, SessionSource::PromptCacheKey);
    }

    #[test]
    fn header_sessions_keep_their_key_whether_they_chain_or_not() {
        let headers = [(
            "x-claude-code-session-id",
            "0b6c6f1e-2d4e-4f7a-9e1b-3c5d7f9a1b2c",
        )];
        let first = key(&headers, &json!({"input": "hi"}), None).unwrap();
        let chained = key(
            &headers,
            &json!({"input": "more", "previous_response_id": "resp_1"}),
            Some("resp_1"),
        )
        .unwrap();
        assert_eq!(first, chained);
    }

    #[test]
    fn chained_only_conversations_key_on_their_root() {
        // Turn 1 has no key; its response id becomes the root every later turn resolves to.
        assert_eq!(key(&[], &json!({"input": "hi"}), None), None);
        let pinned_under = chain_root_key("resp_1").unwrap();
        for prev in ["resp_1", "resp_2", "resp_3"] {
            let body = json!({"input": "next", "previous_response_id": prev});
            assert_eq!(key(&[], &body, Some("resp_1")).unwrap(), pinned_under);
        }
        assert_eq!(chain_root_key("  "), None);
    }

    #[test]
    fn conversation_as_string_or_object_gives_the_same_key() {
        let as_string = key(&[], &json!({"conversation": "conv_1"}), None).unwrap();
        let as_object = key(&[], &json!({"conversation": {"id": "conv_1"}}), None).unwrap();
        assert_eq!(as_string, as_object);
        assert_eq!(as_string.value, "conv:conv_1");
        assert_eq!(as_string.source, SessionSource::Conversation);
    }

    #[test]
    fn source_labels_and_display() {
        assert_eq!(
            SessionSource::Header("x-session-id".into()).label(),
            "header"
        );
        assert_eq!(
            SessionSource::Header("session-id".into()).to_string(),
            "header session-id"
        );
        assert_eq!(
            SessionSource::PromptCacheKey.to_string(),
            "prompt_cache_key"
        );
        assert_eq!(SessionSource::ChainRoot.label(), "chain_root");
        assert_eq!(SessionSource::Conversation.label(), "conversation");
    }
}
