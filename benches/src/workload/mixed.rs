//! The `mixed` generator: interactive chat and batch agents sharing the fleet at once.
//!
//! Half the sessions (rounded up) are `chat` conversations of team `interactive`, starting
//! uniformly over the duration; the other half are `agentic` sessions of team `agents` arriving in
//! up to three bursts (each burst's sessions start within [`BURST_WINDOW_S`] of a random moment in
//! the first 80% of the duration), which is what a batch of agent jobs looks like to a fleet.
//! Chat sessions come first in the list, then the agent sessions with their sub-agents.

use super::text::mix_seed;
use super::{agentic, chat, uniform_starts, SessionPlan};

/// Seconds over which the sessions of one agent burst start.
pub const BURST_WINDOW_S: f64 = 10.0;
/// Most agent bursts in one run.
pub const MAX_BURSTS: usize = 3;

/// Generate `sessions` top-level sessions over `duration_s`.
pub fn generate(sessions: usize, duration_s: f64, seed: u64) -> Vec<SessionPlan> {
    let agent_count = sessions / 2;
    let chat_count = sessions - agent_count;
    let mut plans = chat::generate(&chat::ChatSpec {
        team: "interactive",
        id_prefix: "chat",
        starts: uniform_starts(mix_seed(seed, 1), chat_count, duration_s),
        seed,
    });
    let mut rng = fastrand::Rng::with_seed(mix_seed(seed, 0xB0257));
    let bursts = MAX_BURSTS.min(agent_count).max(1);
    let mut centers: Vec<f64> = (0..bursts).map(|_| rng.f64() * 0.8 * duration_s).collect();
    centers.sort_by(f64::total_cmp);
    let mut starts: Vec<f64> = (0..agent_count)
        .map(|n| {
            let center = centers.get(n % bursts).copied().unwrap_or(0.0);
            (center + rng.f64() * BURST_WINDOW_S).min(duration_s * 0.999)
        })
        .collect();
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
}
