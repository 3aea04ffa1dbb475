//! The `mixed` generator: interactive chat and batch agents sharing the fleet at once.
//!
//! Half the sessions (rounded up) are `chat` conversations of team `interactive`, starting
//! uniformly over the duration; the other half are `agentic` sessions of team `agents` arriving in
//! up to three bursts (each burst's sessions start within [`BURST_WINDOW_S`] of a random moment in
//! the first 80% of the duration), which is what a batch of agent jobs looks like to a fleet.
//! Chat sessions come first in the list, then the agent sessions with their sub-agents.
//!
//! With `agent_sessions = Some(n)` the agents team runs `n` sessions instead: `ceil(n / 2)`
//! start in one burst within the first [`BURST_WINDOW_S`] (a batch of jobs submitted at once),
//! the rest at uniformly random times over the first half of the span (jobs queued behind it),
//! so the fleet is loaded from the start and new sessions keep arriving while it is full
//! (`agentgate-bench run --mixed-batch-load` sizes `n` from the fleet's request slots). The chat
//! sessions are the same either way.

use super::text::mix_seed;
use super::{agentic, chat, uniform_starts, SessionPlan};

/// Seconds over which the sessions of one agent burst start.
pub const BURST_WINDOW_S: f64 = 10.0;
/// Most agent bursts in one run.
pub const MAX_BURSTS: usize = 3;

/// Generate `sessions` top-level sessions over `duration_s` (half chat, half agents), or
/// `ceil(sessions / 2)` chat sessions and `agent_sessions` agent sessions in one burst.
pub fn generate(
    sessions: usize,
    agent_sessions: Option<usize>,
    duration_s: f64,
    seed: u64,
) -> Vec<SessionPlan> {
    let chat_count = sessions - sessions / 2;
    let agent_count = sessions / 2;
    let mut plans = chat::generate(&chat::ChatSpec {
        team: "interactive",
        id_prefix: "chat",
        starts: uniform_starts(mix_seed(seed, 1), chat_count, duration_s),
        seed,
    });
    let mut rng = fastrand::Rng::with_seed(mix_seed(seed, 0xB0257));
    let mut starts: Vec<f64> = match agent_sessions {
        Some(count) => (0..count)
            .map(|n| {
                let window = if n < count.div_ceil(2) {
                    BURST_WINDOW_S
                } else {
                    duration_s * 0.5
                };
                (rng.f64() * window).min(duration_s * 0.999)
            })
            .collect(),
        None => {
            let bursts = MAX_BURSTS.min(agent_count).max(1);
            let mut centers: Vec<f64> = (0..bursts).map(|_| rng.f64() * 0.8 * duration_s).collect();
            centers.sort_by(f64::total_cmp);
            (0..agent_count)
                .map(|n| {
                    let center = centers.get(n % bursts).copied().unwrap_or(0.0);
                    (center + rng.f64() * BURST_WINDOW_S).min(duration_s * 0.999)
                })
                .collect()
        }
    };
    starts.sort_by(f64::total_cmp);
    let agents = agentic::generate(&agentic::AgenticSpec {
        team: "agents",
        id_prefix: "agent",
        starts,
        seed,
        index_offset: plans.len(),
    });
    plans.extend(agents);
    plans
}

#[cfg(test)]
mod tests {
    use crate::workload::{generate, WorkloadKind, WorkloadParams};

    #[test]
    fn interactive_chat_and_agent_bursts() {
        let params = WorkloadParams {
            kind: WorkloadKind::Mixed,
            sessions: 41,
            duration_s: 120.0,
            seed: 2,
            agent_sessions: None,
        };
        let workload = generate(&params).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            workload,
            generate(&params).unwrap_or_else(|e| panic!("{e}"))
        );
        let top = |team: &str| {
            workload
                .sessions
                .iter()
                .filter(|s| s.team == team && s.parent.is_none())
                .count()
        };
        assert_eq!(top("interactive"), 21);
        assert_eq!(top("agents"), 20);
        assert!(workload
            .sessions
            .iter()
            .all(|s| s.team == "interactive" || s.team == "agents"));
        // Agents arrive in at most three bursts of at most 10 s each.
        let mut agent_starts: Vec<f64> = workload
            .sessions
            .iter()
            .filter(|s| s.team == "agents" && s.parent.is_none())
            .map(|s| s.start_s)
            .collect();
        agent_starts.sort_by(f64::total_cmp);
        let gaps = agent_starts
            .windows(2)
            .filter(|w| w[1] - w[0] > 10.0)
            .count();
        assert!(gaps <= 2, "{gaps} gaps between agent starts");
        // Spawn and parent links point at the right sessions after the chat sessions.
        for (index, session) in workload.sessions.iter().enumerate() {
            for turn in &session.turns {
                for &child in &turn.spawn {
                    let link = workload.sessions[child].parent.map(|l| l.session);
                    assert_eq!(link, Some(index));
                }
            }
        }
        let mut ids: Vec<&str> = workload.sessions.iter().map(|s| s.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), workload.sessions.len());
    }

    #[test]
    fn a_sized_batch_starts_at_once_beside_the_same_chat_sessions() {
        let params = WorkloadParams {
            kind: WorkloadKind::Mixed,
            sessions: 41,
            duration_s: 120.0,
            seed: 2,
            agent_sessions: Some(7),
        };
        let sized = generate(&params).unwrap_or_else(|e| panic!("{e}"));
        let default = generate(&WorkloadParams {
            agent_sessions: None,
            ..params
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let agents: Vec<_> = sized
            .sessions
            .iter()
            .filter(|s| s.team == "agents" && s.parent.is_none())
            .collect();
        assert_eq!(agents.len(), 7);
        let burst = agents
            .iter()
            .filter(|s| s.start_s < super::BURST_WINDOW_S)
            .count();
        assert!(burst >= 4, "ceil(7 / 2) start in the burst, {burst} did");
        assert!(
            agents.iter().all(|s| s.start_s < 60.0),
            "the rest in the first half"
        );
        let chats = |w: &crate::workload::Workload| {
            w.sessions
                .iter()
                .filter(|s| s.team == "interactive")
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(chats(&sized), chats(&default));
    }
}
