//! The `fairness` generator: two teams of equal weight in one band, one offering ten times the
//! other's load, both kept backlogged.
//!
//! Team `light` runs `n = max(1, sessions / 11)` sessions and team `heavy` `10 n`, so the
//! workload has `11 n` sessions (`--sessions` rounded down to a multiple of 11, at least 11).
//! Every session is a closed loop: one request at a time, the next sent as soon as the previous
//! answer arrives (no think time), so a team keeps as many requests outstanding as it has
//! sessions and "ten times the load" is ten times the requests wanting service at any moment.
//! Sessions start within the first [`START_WINDOW_S`] and keep sending until the replayed span
//! ends.
//!
//! Requests are alike across teams, so tokens and requests split the same way: a shared
//! system prompt per team ([`SYSTEM_PROMPT_WORDS`]) and per turn a user message lognormal with
//! median [`USER_WORDS_MEDIAN`] words (8..=400); the engine answers ~300 tokens. A session has
//! enough turns to outlast the span (one per [`MIN_TURN_S`] simulated seconds, at most
//! [`MAX_TURNS`]), so contexts stay within a few tens of thousands of tokens. Even sessions
//! chain with `previous_response_id`, odd ones resend the history with `store: false`.
//!
//! Both teams are backlogged when each keeps more requests outstanding than its fair half of
//! the fleet's request slots: `n > replicas x max_num_seqs / 2`. The run measures the share of
//! dispatched tokens while both have requests queued in the gateway (`fairness` in
//! summary.json).

use super::agentic::team_seed;
use super::text::{mix_seed, seeded_words, words};
use super::{lognormal, SessionMode, SessionPlan, TurnInput, TurnPlan};

/// Team offering one part of the load.
pub const LIGHT_TEAM: &str = "light";
/// Team offering ten parts.
pub const HEAVY_TEAM: &str = "heavy";
/// Sessions of the heavy team per session of the light team.
pub const LOAD_RATIO: usize = 10;
/// Words of each team's shared system prompt.
pub const SYSTEM_PROMPT_WORDS: usize = 500;
/// Median words of a user message.
pub const USER_WORDS_MEDIAN: f64 = 60.0;
/// Simulated seconds over which the sessions start.
pub const START_WINDOW_S: f64 = 5.0;
/// A turn takes at least this long (the engine decodes ~300 tokens at >= 20 ms each), which
/// bounds the turns a session can send within the span.
pub const MIN_TURN_S: f64 = 5.0;
/// Most turns of one session.
pub const MAX_TURNS: usize = 400;

/// Sessions of the light team for `sessions` requested in total.
pub fn light_sessions(sessions: usize) -> usize {
    (sessions / (LOAD_RATIO + 1)).max(1)
}

/// Generate both teams' sessions: the light team's first, then the heavy team's.
pub fn generate(sessions: usize, duration_s: f64, seed: u64) -> Vec<SessionPlan> {
    let light = light_sessions(sessions);
    let turns = ((duration_s / MIN_TURN_S).ceil() as usize + 1).clamp(2, MAX_TURNS);
    let mut plans = team_sessions(LIGHT_TEAM, light, turns, duration_s, seed);
    plans.extend(team_sessions(
        HEAVY_TEAM,
        light * LOAD_RATIO,
        turns,
        duration_s,
        seed,
    ));
    plans
}

fn team_sessions(
    team: &str,
    count: usize,
    turns: usize,
    duration_s: f64,
    seed: u64,
) -> Vec<SessionPlan> {
    let base = mix_seed(seed, team_seed(team) ^ 0xFA12);
    let prompt = seeded_words(mix_seed(base, 1), SYSTEM_PROMPT_WORDS);
    let mut rng = fastrand::Rng::with_seed(base);
    let window = START_WINDOW_S.min(duration_s * 0.5);
    (0..count)
        .map(|number| {
            let id = format!("{team}-{number:04}");
            let turns = (0..turns)
                .map(|_| {
                    let count = lognormal(&mut rng, USER_WORDS_MEDIAN, 0.7).clamp(8.0, 400.0);
                    TurnPlan {
                        think_s: 0.0,
                        input: TurnInput::User(words(&mut rng, count as usize)),
                        spawn: Vec::new(),
                    }
                })
                .collect();
            SessionPlan {
                mode: if number % 2 == 0 {
                    SessionMode::Chained
                } else {
                    SessionMode::Stateless {
                        prompt_cache_key: Some(id.clone()),
                    }
                },
                id,
                team: team.to_string(),
                start_s: rng.f64() * window,
                instructions: Some(prompt.clone()),
                tools: Vec::new(),
                turns,
                parent: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{generate as generate_workload, WorkloadKind, WorkloadParams};

    #[test]
    fn heavy_team_runs_ten_times_the_sessions_of_the_light_one() {
        let params = WorkloadParams {
            kind: WorkloadKind::Fairness,
            sessions: 35,
            duration_s: 60.0,
            seed: 3,
            agent_sessions: None,
        };
        let workload = generate_workload(&params).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            workload,
            generate_workload(&params).unwrap_or_else(|e| panic!("{e}"))
        );
        let count = |team: &str| workload.sessions.iter().filter(|s| s.team == team).count();
        assert_eq!((count(LIGHT_TEAM), count(HEAVY_TEAM)), (3, 30));
        for session in &workload.sessions {
            assert!(session.start_s < START_WINDOW_S);
            // Enough turns to keep sending for the whole span, back to back.
            assert_eq!(session.turns.len(), 13);
            assert!(session.turns.iter().all(|t| t.think_s == 0.0));
            assert!(session.parent.is_none() && session.tools.is_empty());
        }
        // Requests are alike across teams: the same prompt size and message distribution.
        let mean_words = |team: &str| {
            let (sum, n) = workload
                .sessions
                .iter()
                .filter(|s| s.team == team)
                .flat_map(|s| s.turns.iter())
                .fold((0usize, 0usize), |(sum, n), t| {
                    (
                        sum + crate::workload::text::word_count(t.input.text()),
                        n + 1,
                    )
                });
            sum as f64 / n as f64
        };
        let (light, heavy) = (mean_words(LIGHT_TEAM), mean_words(HEAVY_TEAM));
        assert!(
            (light / heavy - 1.0).abs() < 0.3,
            "light {light}, heavy {heavy}"
        );
        // At least one light session even when fewer than 11 are asked for.
        assert_eq!(light_sessions(4), 1);
        assert_eq!(generate(4, 60.0, 1).len(), 11);
    }
}
