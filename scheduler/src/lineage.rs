//! Sub-agent lineage: whether a request comes from a sub-agent, and which session spawned it.
//!
//! Sub-agents spawn in bursts and share their parent's context. Routing their prefill to the
//! endpoint that holds the parent's prefix computes that prefix once instead of once per
//! sub-agent, while their decodes spread over the decode endpoints. [`lineage`] takes the first
//! source that applies:
//!
//! 1. the configured parent header ([`LineageConfig::parent_header`], default
//!    [`DEFAULT_PARENT_HEADER`]): its value is the parent's session id as the parent sends it
//!    in a session header (`x-session-id`, an agent's native header), so the parent key is
//!    `h:<value>`, the key the parent's own requests have. The request's own key is its
//!    session key, when it has one that differs from the parent's;
//! 2. the agents' native headers ([`LineageConfig::native_headers`]):
//!    - **Codex CLI**: a spawned thread sends `x-codex-parent-thread-id` (its parent thread),
//!      `thread-id` (its own) and `session-id` (its root's, which is also the root thread's
//!      id). Parent `h:<parent thread>`, own `h:<thread-id>`: a first-level child finds its
//!      root's pins under the root's session key.
//!    - **Claude Code** (2.1.139 and later): a sub-agent's requests carry
//!      `x-claude-code-agent-id` (its own id) and `x-claude-code-parent-agent-id` (the agent
//!      that spawned it) beside the session's `x-claude-code-session-id`, which the main agent
//!      and all its sub-agents share. Own `<session>/agent:<agent id>`; parent
//!      `<session>/agent:<parent agent id>`, or the session itself when no parent agent is
//!      named. A parent that never ran on its own agent id has no pins under that key; the
//!      prefix index then finds its prefix.
//!    - **OpenCode**: a child session's requests carry `x-parent-session-id` (the parent
//!      session's id) beside its own `X-Session-Id`. Parent `h:<parent id>`, the key of the
//!      parent's own requests; own: the request's session key.
//!
//! Header keys are built as [`crate::session_key()`] builds them (trimmed, `h:` prefix, long or
//! unprintable values hashed), so a parent key equals the session key of the parent's own
//! requests. The own key, when there is one, is what the sub-agent's own pins are stored
//! under, apart from its siblings'; without one a sub-agent is placed by load every time.
//!
//! A burst with none of these headers still shares a prefix with its parent:
//! [`crate::prefix_lineage`] finds the parent from it, and the prefill pick finds where that
//! prefix is cached by prefix match (it has no anti-herding gate, see [`crate::disagg`]).

use crate::session_key::{key_part, SessionKey, SessionSource};

/// The parent header [`LineageConfig::default`] reads.
pub const DEFAULT_PARENT_HEADER: &str = "x-agentgate-parent-session";

/// Codex CLI: the thread that spawned this one.
pub const CODEX_PARENT_THREAD_HEADER: &str = "x-codex-parent-thread-id";
/// Codex CLI: this thread.
pub const CODEX_THREAD_HEADER: &str = "thread-id";
/// Claude Code: this sub-agent.
pub const CLAUDE_CODE_AGENT_HEADER: &str = "x-claude-code-agent-id";
/// Claude Code: the agent that spawned this sub-agent.
pub const CLAUDE_CODE_PARENT_AGENT_HEADER: &str = "x-claude-code-parent-agent-id";
/// OpenCode: the session that spawned this one.
pub const OPENCODE_PARENT_SESSION_HEADER: &str = "x-parent-session-id";

/// Which lineage sources [`lineage`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineageConfig {
    /// Header naming the parent's session id (matched case-insensitively; empty to read none).
    pub parent_header: String,
    /// Whether Codex's, Claude Code's and OpenCode's native sub-agent headers are read.
    pub native_headers: bool,
}

impl Default for LineageConfig {
    fn default() -> Self {
        LineageConfig {
            parent_header: DEFAULT_PARENT_HEADER.to_string(),
            native_headers: true,
        }
    }
}

/// A sub-agent request's ties to the session that spawned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    /// The parent's session key.
    pub parent: String,
    /// This sub-agent's own key, when the request names one apart from its parent's.
    pub own: Option<String>,
    /// Where the lineage came from: `header`, `codex`, `claude_code` or `opencode`.
    pub source: &'static str,
}

/// The first non-empty value of header `name` (case-insensitive), trimmed.
fn header<'a>(headers: &[(&'a str, &'a str)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
        .find(|v| !v.is_empty())
}

/// `h:<value>` (or its hashed form), as a session header's key.
fn header_key(name: &str, value: &str) -> Option<String> {
    SessionKey::from_source(SessionSource::Header(name.to_string()), value).map(|k| k.value)
}

/// The request's lineage, or None when nothing says it is a sub-agent. `headers` are (name,
/// value) pairs in any case; `session` is the request's session key
/// ([`crate::session_key()`]).
pub fn lineage(
    cfg: &LineageConfig,
    headers: &[(&str, &str)],
    session: Option<&str>,
) -> Option<Lineage> {
    let configured = cfg.parent_header.trim();
    if !configured.is_empty() {
        if let Some(parent) = header(headers, configured).and_then(|v| header_key(configured, v)) {
            let own = session.filter(|s| *s != parent).map(str::to_string);
            return Some(Lineage {
                parent,
                own,
                source: "header",
            });
        }
    }
    if !cfg.native_headers {
        return None;
    }
    if let Some(parent) = header(headers, CODEX_PARENT_THREAD_HEADER)
        .and_then(|v| header_key(CODEX_PARENT_THREAD_HEADER, v))
    {
        let own = header(headers, CODEX_THREAD_HEADER)
            .and_then(|v| header_key(CODEX_THREAD_HEADER, v))
            .filter(|own| *own != parent);
        return Some(Lineage {
            parent,
            own,
            source: "codex",
        });
    }
    if let (Some(agent), Some(session)) = (header(headers, CLAUDE_CODE_AGENT_HEADER), session) {
        // (A long or odd id is hashed, as in session keys.)
        let agent_key = |id: &str| format!("{session}/{}", key_part("agent", id));
        let parent = match header(headers, CLAUDE_CODE_PARENT_AGENT_HEADER) {
            Some(id) if id != agent => agent_key(id),
            _ => session.to_string(),
        };
        return Some(Lineage {
            parent,
            own: Some(agent_key(agent)),
            source: "claude_code",
        });
    }
    if let Some(parent) = header(headers, OPENCODE_PARENT_SESSION_HEADER)
        .and_then(|v| header_key(OPENCODE_PARENT_SESSION_HEADER, v))
    {
        let own = session.filter(|s| *s != parent).map(str::to_string);
        return Some(Lineage {
            parent,
            own,
            source: "opencode",
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(headers: &[(&str, &str)], session: Option<&str>) -> Option<Lineage> {
        lineage(&LineageConfig::default(), headers, session)
    }

    #[test]
    fn no_parent_signal_no_lineage() {
        assert_eq!(of(&[("x-session-id", "s")], Some("h:s")), None);
        assert_eq!(of(&[("x-agentgate-parent-session", "  ")], None), None);
        // A Claude Code main-agent request: session id, no agent id.
        assert_eq!(of(&[("x-claude-code-session-id", "c")], Some("h:c")), None);
    }

    #[test]
    fn the_configured_header_names_the_parent_session() {
        let l = of(
            &[("X-AgentGate-Parent-Session", " root-1 ")],
            Some("h:child-1"),
        )
        .unwrap();
        assert_eq!(l.parent, "h:root-1");
        assert_eq!(l.own.as_deref(), Some("h:child-1"));
        assert_eq!(l.source, "header");
        // A child sending its parent's session id as its own has no key of its own.
        let l = of(
            &[("x-agentgate-parent-session", "root-1")],
            Some("h:root-1"),
        )
        .unwrap();
        assert_eq!(l.own, None);
        // Long values are hashed exactly as session keys are.
        let long = "x".repeat(300);
        let l = of(&[("x-agentgate-parent-session", &long)], None).unwrap();
        let session = crate::session_key(
            &crate::SessionKeyConfig::default(),
            &[("x-session-id", &long)],
            &serde_json::Value::Null,
            None,
        )
        .unwrap();
        assert_eq!(l.parent, session.value);
        assert!(l.parent.starts_with("h#"));
    }

    #[test]
    fn codex_threads_name_their_parent_thread() {
        let headers = [
            ("session-id", "root"),
            ("thread-id", "child-a"),
            ("x-codex-parent-thread-id", "root"),
            ("x-openai-subagent", "collab_spawn"),
        ];
        let l = of(&headers, Some("h:root")).unwrap();
        assert_eq!(
            (l.parent.as_str(), l.own.as_deref(), l.source),
            ("h:root", Some("h:child-a"), "codex")
        );
        // The configured header wins over native ones.
        let mut both = headers.to_vec();
        both.push(("x-agentgate-parent-session", "other"));
        assert_eq!(of(&both, Some("h:root")).unwrap().parent, "h:other");
        // Native headers off: nothing.
        let off = LineageConfig {
            native_headers: false,
            ..LineageConfig::default()
        };
        assert_eq!(lineage(&off, &headers, Some("h:root")), None);
    }

    #[test]
    fn claude_code_sub_agents_hang_off_their_session() {
        let first = [
            ("x-claude-code-session-id", "s1"),
            ("x-claude-code-agent-id", "a1"),
        ];
        let l = of(&first, Some("h:s1")).unwrap();
        assert_eq!(
            (l.parent.as_str(), l.own.as_deref(), l.source),
            ("h:s1", Some("h:s1/agent:a1"), "claude_code")
        );
        let nested = [
            ("x-claude-code-session-id", "s1"),
            ("x-claude-code-agent-id", "a2"),
            ("x-claude-code-parent-agent-id", "a1"),
        ];
        let l = of(&nested, Some("h:s1")).unwrap();
        assert_eq!(l.parent, "h:s1/agent:a1");
        assert_eq!(l.own.as_deref(), Some("h:s1/agent:a2"));
        // A huge agent id is hashed: the key's size does not follow the header's.
        let huge = "a".repeat(100_000);
        let long = [
            ("x-claude-code-session-id", "s1"),
            ("x-claude-code-agent-id", huge.as_str()),
        ];
        let own = of(&long, Some("h:s1")).unwrap().own.unwrap();
        assert!(own.starts_with("h:s1/agent#") && own.len() < 64, "{own}");
        // Without a session key there is nothing to hang the agent off.
        assert_eq!(of(&first[1..], None), None);
    }

    #[test]
    fn opencode_child_sessions_name_their_parent_session() {
        let child = [
            ("X-Session-Id", "ses_child"),
            ("x-session-affinity", "ses_child"),
            ("x-parent-session-id", "ses_parent"),
        ];
        let l = of(&child, Some("h:ses_child")).unwrap();
        assert_eq!(
            (l.parent.as_str(), l.own.as_deref(), l.source),
            ("h:ses_parent", Some("h:ses_child"), "opencode")
        );
        // The parent's own requests carry no parent header.
        assert_eq!(of(&child[..2], Some("h:ses_parent")), None);
    }
}
