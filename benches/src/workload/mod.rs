//! Workloads a benchmark replays: seeded, deterministic plans of sessions and turns.
//!
//! A [`Workload`] is a list of [`SessionPlan`]s; each session is a sequence of turns sent through
//! the Responses API, either chained with `previous_response_id` ([`SessionMode::Chained`]) or
//! resending the full history with `store: false` ([`SessionMode::Stateless`]). Sub-agent sessions
//! start when a parent's turn completes and begin from the parent's history.
//!
//! Generators (same [`WorkloadParams`] -> identical [`Workload`]):
//! - `agentic` ([`agentic`]): coding-agent sessions (long shared prefixes, tool-call loops,
//!   lognormal per-turn new tokens, contexts growing toward 200k, sub-agent fan-out);
//! - `chat` ([`chat`]): short human conversations with think times of tens of seconds;
//! - `mixed` ([`mixed`]): `chat` for team `interactive` plus bursts of `agentic` for team `agents`
//!   (or, with [`WorkloadParams::agent_sessions`], that many agent sessions from the start);
//! - `fairness` ([`fairness`]): two closed-loop teams of alike requests, `heavy` with ten times
//!   the sessions of `light`;
//! - `trace:PATH` ([`trace`]): replay of a Mooncake JSONL trace.
//!
//! All text is lowercase pseudo-words separated by single spaces ([`text`]), so for the
//! simulator's tokenizer `N` words are exactly `N` tokens. [`WorkloadStats`] summarises a plan
//! (per-turn new tokens, input lengths, reuse between consecutive turns) without running it.

pub mod agentic;
pub mod chat;
pub mod fairness;
pub mod mixed;
mod stats;
pub mod text;
pub mod trace;

use std::path::PathBuf;
use std::str::FromStr;

pub use stats::{WorkloadStats, TEXT_OUTPUT_TOKENS, TOOL_CALL_OUTPUT_TOKENS};

/// Which generator builds the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkloadKind {
    /// Coding-agent sessions.
    Agentic,
    /// Short human multi-turn conversations.
    Chat,
    /// `chat` (team `interactive`) and `agentic` bursts (team `agents`) at once.
    Mixed,
    /// Teams `light` and `heavy` (ten times the sessions), closed loops of alike requests.
    Fairness,
    /// Replay of a Mooncake-format JSONL trace at this path.
    Trace(PathBuf),
}

impl FromStr for WorkloadKind {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "agentic" => Ok(WorkloadKind::Agentic),
            "chat" => Ok(WorkloadKind::Chat),
            "mixed" => Ok(WorkloadKind::Mixed),
            "fairness" => Ok(WorkloadKind::Fairness),
            other => match other.strip_prefix("trace:") {
                Some("") => Err("`trace:` needs a path, e.g. trace:../shared/traces/mooncake_conversation.jsonl".into()),
                Some(path) => Ok(WorkloadKind::Trace(PathBuf::from(path))),
                None => Err(format!(
                    "unknown workload `{other}`: use agentic, chat, mixed, fairness or trace:PATH"
                )),
            },
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkloadKind::Agentic => f.write_str("agentic"),
            WorkloadKind::Chat => f.write_str("chat"),
            WorkloadKind::Mixed => f.write_str("mixed"),
            WorkloadKind::Fairness => f.write_str("fairness"),
            WorkloadKind::Trace(path) => write!(f, "trace:{}", path.display()),
        }
    }
}

/// What to generate: the kind, how many sessions start within `duration_s`, and the seed.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadParams {
    /// Which generator.
    pub kind: WorkloadKind,
    /// Top-level sessions starting within the duration (sub-agents come on top; unused by traces).
    pub sessions: usize,
    /// Simulated seconds over which sessions start (for a trace: the span of arrivals replayed).
    pub duration_s: f64,
    /// Seed of every random choice.
    pub seed: u64,
    /// `mixed` only: the `agents` team runs this many sessions, half in a burst at the start
    /// and half over the first half of the span ([`mixed`]), instead of half of `sessions` in
    /// up to three bursts.
    pub agent_sessions: Option<usize>,
}

/// A generated workload: every session to replay.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Short name for reports (`agentic`, `chat`, `mixed`, `trace:FILE`).
    pub name: String,
    /// The sessions; [`TurnPlan::spawn`] and [`ParentLink::session`] index into this list.
    pub sessions: Vec<SessionPlan>,
}

/// One session: a sequence of turns sharing a history.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionPlan {
    /// Unique id (stateless sessions of the generated workloads also send it as their
    /// `prompt_cache_key`).
    pub id: String,
    /// Team (API key) sending it: `agents`, `interactive` (mixed) or `default`.
    pub team: String,
    /// Simulated seconds from the start of the run (ignored for sub-agents).
    pub start_s: f64,
    /// How the history travels.
    pub mode: SessionMode,
    /// Shared system/tool prefix (identical text across sessions that share it).
    pub instructions: Option<String>,
    /// Responses function tools offered every turn (may be empty).
    pub tools: Vec<serde_json::Value>,
    /// The turns, in order.
    pub turns: Vec<TurnPlan>,
    /// For a sub-agent: the parent turn whose completion starts it.
    pub parent: Option<ParentLink>,
}

/// How a session carries its history from turn to turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionMode {
    /// `store: true` and `previous_response_id` of the previous turn.
    Chained,
    /// `store: false`, the full history resent as `input` every turn.
    Stateless {
        /// `prompt_cache_key` sent with every turn; `None` sends none (trace replays carry
        /// no session key).
        prompt_cache_key: Option<String>,
    },
}

/// Where a sub-agent starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParentLink {
    /// Index of the parent session in [`Workload::sessions`].
    pub session: usize,
    /// Index of the parent's turn; the sub-agent's history is the parent's up to and including it.
    pub turn: usize,
}

/// One request of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnPlan {
    /// Simulated delay after the previous turn completes (first turn: after the session starts).
    pub think_s: f64,
    /// What this turn adds to the history.
    pub input: TurnInput,
    /// Sub-agent session indices started (in parallel) when this turn completes.
    pub spawn: Vec<usize>,
}

/// The new input of a turn.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnInput {
    /// A user message.
    User(String),
    /// The output of the function call the previous response made (a user message if it made none).
    ToolOutput(String),
}

impl TurnInput {
    /// The text of the input.
    pub fn text(&self) -> &str {
        match self {
            TurnInput::User(text) | TurnInput::ToolOutput(text) => text,
        }
    }
}

/// Build the workload `params` describe; errors say which parameter to change.
pub fn generate(params: &WorkloadParams) -> Result<Workload, String> {
    if !params.duration_s.is_finite() || params.duration_s <= 0.0 {
        return Err(format!(
            "duration must be a positive number of seconds, got {}",
            params.duration_s
        ));
    }
    let needs_sessions = !matches!(params.kind, WorkloadKind::Trace(_));
    if needs_sessions && params.sessions == 0 {
        return Err(format!(
            "the {} workload needs at least one session: pass --sessions 1 or more",
            params.kind
        ));
    }
    match &params.kind {
        WorkloadKind::Agentic => Ok(Workload {
            name: "agentic".into(),
            sessions: agentic::generate(&agentic::AgenticSpec {
                team: "default",
                id_prefix: "agent",
                starts: uniform_starts(params.seed, params.sessions, params.duration_s),
                seed: params.seed,
                index_offset: 0,
            }),
        }),
        WorkloadKind::Chat => Ok(Workload {
            name: "chat".into(),
            sessions: chat::generate(&chat::ChatSpec {
                team: "default",
                id_prefix: "chat",
                starts: uniform_starts(params.seed, params.sessions, params.duration_s),
                seed: params.seed,
            }),
        }),
        WorkloadKind::Mixed => Ok(Workload {
            name: "mixed".into(),
            sessions: mixed::generate(
                params.sessions,
                params.agent_sessions,
                params.duration_s,
                params.seed,
            ),
        }),
        WorkloadKind::Fairness => Ok(Workload {
            name: "fairness".into(),
            sessions: fairness::generate(params.sessions, params.duration_s, params.seed),
        }),
        WorkloadKind::Trace(path) => trace::generate(path, params.duration_s),
    }
}

impl Workload {
    /// The sessions of `team` only, with spawn and parent links renumbered (a link to a session
    /// of another team is dropped); the name gets ` (TEAM only)`.
    pub fn only_team(&self, team: &str) -> Workload {
        let mut index = vec![None; self.sessions.len()];
        let mut next = 0;
        for (old, session) in self.sessions.iter().enumerate() {
            if session.team == team {
                index[old] = Some(next);
                next += 1;
            }
        }
        let remap = |old: usize| index.get(old).copied().flatten();
        let sessions = self
            .sessions
            .iter()
            .filter(|s| s.team == team)
            .map(|session| {
                let mut session = session.clone();
                for turn in &mut session.turns {
                    turn.spawn = turn.spawn.iter().filter_map(|&c| remap(c)).collect();
                }
                session.parent = session.parent.and_then(|link| {
                    remap(link.session).map(|session| ParentLink {
                        session,
                        turn: link.turn,
                    })
                });
                session
            })
            .collect();
        Workload {
            name: format!("{} ({team} only)", self.name),
            sessions,
        }
    }
}

/// `count` start times drawn uniformly over `[0, duration_s)`, sorted (Poisson arrivals given the count).
pub(crate) fn uniform_starts(seed: u64, count: usize, duration_s: f64) -> Vec<f64> {
    let mut rng = fastrand::Rng::with_seed(text::mix_seed(seed, 0x5747_4152_5453));
    let mut starts: Vec<f64> = (0..count).map(|_| rng.f64() * duration_s).collect();
    starts.sort_by(f64::total_cmp);
    starts
}

/// A standard normal draw (Box-Muller).
pub(crate) fn normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = rng.f64().max(f64::MIN_POSITIVE);
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A lognormal draw with the given median and log-space standard deviation.
pub(crate) fn lognormal(rng: &mut fastrand::Rng, median: f64, sigma: f64) -> f64 {
    median * (sigma * normal(rng)).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print() {
        assert_eq!("agentic".parse(), Ok(WorkloadKind::Agentic));
        assert_eq!("chat".parse(), Ok(WorkloadKind::Chat));
        assert_eq!("mixed".parse(), Ok(WorkloadKind::Mixed));
        assert_eq!(
            "trace:../t.jsonl".parse(),
            Ok(WorkloadKind::Trace(PathBuf::from("../t.jsonl")))
        );
        assert!("trace:".parse::<WorkloadKind>().is_err());
        let unknown = "agents".parse::<WorkloadKind>().unwrap_err();
        assert!(unknown.contains("agentic, chat, mixed, fairness or trace:PATH"));
        assert_eq!("fairness".parse(), Ok(WorkloadKind::Fairness));
        assert_eq!(WorkloadKind::Trace("a/b".into()).to_string(), "trace:a/b");
    }

    #[test]
    fn bad_parameters_are_refused_with_the_fix() {
        let mut params = WorkloadParams {
            kind: WorkloadKind::Chat,
            sessions: 0,
            duration_s: 10.0,
            seed: 1,
            agent_sessions: None,
        };
        assert!(generate(&params).unwrap_err().contains("--sessions"));
        params.sessions = 3;
        params.duration_s = 0.0;
        assert!(generate(&params).unwrap_err().contains("duration"));
    }

    #[test]
    fn one_team_keeps_its_sessions_and_their_links() {
        let params = WorkloadParams {
            kind: WorkloadKind::Mixed,
            sessions: 30,
            duration_s: 120.0,
            seed: 5,
            agent_sessions: None,
        };
        let workload = generate(&params).unwrap_or_else(|e| panic!("{e}"));
        let agents = workload.only_team("agents");
        let expected: Vec<&str> = workload
            .sessions
            .iter()
            .filter(|s| s.team == "agents")
            .map(|s| s.id.as_str())
            .collect();
        let kept: Vec<&str> = agents.sessions.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(kept, expected);
        assert_eq!(agents.name, "mixed (agents only)");
        // Every link still joins the same two sessions, by id.
        let links = |w: &Workload| {
            let mut links = Vec::new();
            for session in &w.sessions {
                for (t, turn) in session.turns.iter().enumerate() {
                    for &child in &turn.spawn {
                        let c = &w.sessions[child];
                        assert_eq!(
                            c.parent.map(|l| (l.turn, w.sessions[l.session].id.clone())),
                            Some((t, session.id.clone()))
                        );
                        links.push((session.id.clone(), c.id.clone()));
                    }
                }
            }
            links
        };
        let before = links(&workload);
        assert!(!before.is_empty(), "the seed spawns sub-agents");
        assert_eq!(links(&agents), before);
        let chat = workload.only_team("interactive");
        assert_eq!(chat.sessions.len(), 15);
        assert!(chat.sessions.iter().all(|s| s.team == "interactive"));
        assert!(workload.only_team("nobody").sessions.is_empty());
    }

    #[test]
    fn lognormal_has_the_requested_median() {
        let mut rng = fastrand::Rng::with_seed(9);
        let mut draws: Vec<f64> = (0..20_001)
            .map(|_| lognormal(&mut rng, 100.0, 0.9))
            .collect();
        draws.sort_by(f64::total_cmp);
        let median = draws[10_000];
        assert!((90.0..110.0).contains(&median), "median {median}");
        let starts = uniform_starts(1, 50, 10.0);
        assert!(starts.windows(2).all(|w| w[0] <= w[1]));
        assert!(starts.iter().all(|s| (0.0..10.0).contains(s)));
    }
}
