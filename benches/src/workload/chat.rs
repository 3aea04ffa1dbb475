//! The `chat` generator: short multi-turn conversations typed by people.
//!
//! Shape: a short system prompt (two per team, 300 or 600 words), 2..=11 turns per conversation
//! (`2 + 10 u^2`, median ~4), user messages lognormal with median 60 words (4..=2,000), no tools,
//! and think time between turns lognormal with median 25 s (5..=180 s: reading the answer and
//! typing). Even conversations chain with `previous_response_id`, odd ones resend the history with
//! `store: false`. At 200 sessions: ~1,000 requests of a few thousand tokens each.

use super::agentic::team_seed;
use super::text::{mix_seed, seeded_words, words};
use super::{lognormal, SessionMode, SessionPlan, TurnInput, TurnPlan};

/// Words of each shared system prompt of a team.
pub const SYSTEM_PROMPT_WORDS: [usize; 2] = [300, 600];
/// Median words of a user message.
pub const USER_WORDS_MEDIAN: f64 = 60.0;
/// Median seconds between an answer and the next user message.
pub const THINK_MEDIAN_S: f64 = 25.0;

/// Who sends the conversations and when they start.
#[derive(Debug, Clone)]
pub struct ChatSpec<'a> {
    /// Team of every session.
    pub team: &'a str,
    /// Session ids are `{id_prefix}-{n:04}`.
    pub id_prefix: &'a str,
    /// Start time of each conversation (one per entry).
    pub starts: Vec<f64>,
    /// Seed of every random choice.
    pub seed: u64,
}

/// Generate one conversation per start time.
pub fn generate(spec: &ChatSpec<'_>) -> Vec<SessionPlan> {
    let base = mix_seed(spec.seed, team_seed(spec.team) ^ 0xC4A7);
    let prompts: Vec<String> = SYSTEM_PROMPT_WORDS
        .iter()
        .enumerate()
        .map(|(variant, &count)| seeded_words(mix_seed(base, variant as u64 + 1), count))
        .collect();
    let mut rng = fastrand::Rng::with_seed(base);
    spec.starts
        .iter()
        .enumerate()
        .map(|(number, &start_s)| {
            let id = format!("{}-{number:04}", spec.id_prefix);
            let turn_count = 2 + (10.0 * rng.f64().powi(2)) as usize;
            let turns = (0..turn_count)
                .map(|index| {
                    let count = lognormal(&mut rng, USER_WORDS_MEDIAN, 0.9).clamp(4.0, 2_000.0);
                    TurnPlan {
                        think_s: if index == 0 {
                            0.0
                        } else {
                            lognormal(&mut rng, THINK_MEDIAN_S, 0.5).clamp(5.0, 180.0)
                        },
                        input: TurnInput::User(words(&mut rng, count as usize)),
                        spawn: Vec::new(),
                    }
                })
                .collect();
            let prompt = prompts[rng.usize(..prompts.len())].clone();
            SessionPlan {
                mode: if number % 2 == 0 {
                    SessionMode::Chained
                } else {
                    SessionMode::Stateless {
                        prompt_cache_key: Some(id.clone()),
                    }
                },
                id,
                team: spec.team.to_string(),
                start_s,
                instructions: Some(prompt),
                tools: Vec::new(),
                turns,
                parent: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::workload::{generate, WorkloadKind, WorkloadParams};

    #[test]
    fn conversations_are_short_human_and_deterministic() {
        let params = WorkloadParams {
            kind: WorkloadKind::Chat,
            sessions: 200,
            duration_s: 120.0,
            seed: 4,
            agent_sessions: None,
        };
        let workload = generate(&params).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            workload,
            generate(&params).unwrap_or_else(|e| panic!("{e}"))
        );
        assert_eq!(workload.sessions.len(), 200);
        let stats = workload.stats();
        assert!((40.0..=90.0).contains(&stats.new_tokens_median));
        assert!(stats.max_input_tokens < 20_000);
        let thinks: Vec<f64> = workload
            .sessions
            .iter()
            .flat_map(|s| s.turns.iter().skip(1).map(|t| t.think_s))
            .collect();
        let mean_think = thinks.iter().sum::<f64>() / thinks.len() as f64;
        assert!(
            (15.0..=60.0).contains(&mean_think),
            "mean think {mean_think}"
        );
        for session in &workload.sessions {
            assert!((2..=12).contains(&session.turns.len()));
            assert!(session.tools.is_empty() && session.parent.is_none());
            assert!((0.0..120.0).contains(&session.start_s));
            assert_eq!(session.team, "default");
        }
        assert_eq!(stats.chained_sessions, 100);
    }
}
