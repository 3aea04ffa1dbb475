//! The `agentic` generator: coding-agent sessions shaped like published agent traces.
//!
//! Shape (defaults; numbers for 200 sessions over 120 s with seed 1 are checked by the tests):
//! - **Shared prefixes**: three per team, each a system prompt of 22k, 28k or 34k words plus eight
//!   function tools (~2.5k tokens), so a session's first request starts at ~25k-37k tokens;
//!   sessions pick a prefix at random and sessions on the same prefix send identical text.
//! - **Turns**: 10 to 40 per session, skewed short (`10 + 30 u^3`, median ~14), and a session ends
//!   early once its input would pass [`CONTEXT_CAP_TOKENS`] (200k), so only long sessions get there.
//! - **New tokens per turn**: lognormal, median 4,000, mean ~6,000 (sigma 0.9), clamped to
//!   64..=60,000. Draws are pooled over the workload: the largest go to first turns (a task with
//!   pasted context), the rest are dealt to sessions, and within a session each turn takes the
//!   largest draw that keeps its previous input >= 90% of its own input, so the per-turn
//!   distribution stays lognormal while >= 90% of follow-up turns reuse >= 90% of the previous
//!   input (as measured on agent traces).
//! - **Tool-call loops**: a user turn names a tool with probability 0.85 (the simulator then calls
//!   it); the next turn is that call's output; otherwise the next turn is a user message.
//!   Think time before a tool output is the tool's run time (lognormal, median 1.5 s), before a
//!   user turn the agent harness's delay (lognormal, median 3 s).
//! - **Sub-agents**: 10% of sessions spawn 3..=10 parallel sub-agents at one turn in their first
//!   half; each continues from the parent's history (same prefix) for 2..=4 turns.
//! - **Modes**: even sessions chain with `previous_response_id`, odd ones resend the full
//!   history with `store: false` and `prompt_cache_key` = their id; sub-agents follow the parent.
//!
//! At 200 sessions (seed 1) this is 332 sessions with the sub-agents, 3,508 requests, per-turn
//! new tokens median 4,129 / mean 5,955, 92.7% of follow-up turns reusing >= 90%, the longest
//! input 199,857 tokens and ~356M prompt tokens in total (~100k per request, ~1.5 GB of request
//! text to send); pass fewer `--sessions` for a quicker run ([`super::Workload::stats`] prints
//! the same figures for any parameters).

use serde_json::json;

use super::stats::{calls_tool, output_estimate, prefix_tokens, MESSAGE_OVERHEAD_TOKENS};
use super::text::{mix_seed, seeded_words, words};
use super::{lognormal, ParentLink, SessionMode, SessionPlan, TurnInput, TurnPlan};

/// Words of the system prompt of each shared prefix of a team.
pub const PREFIX_INSTRUCTION_WORDS: [usize; 3] = [22_000, 28_000, 34_000];
/// Fewest turns of a top-level session.
pub const MIN_TURNS: usize = 10;
/// Most turns of a top-level session.
pub const MAX_TURNS: usize = 40;
/// Median new tokens per turn.
pub const NEW_TOKENS_MEDIAN: f64 = 4_000.0;
/// Log-space standard deviation of new tokens per turn (mean = median * 1.5).
pub const NEW_TOKENS_SIGMA: f64 = 0.9;
/// A session stops before its estimated input passes this many tokens.
pub const CONTEXT_CAP_TOKENS: usize = 200_000;
/// Probability that a top-level session fans out to sub-agents.
pub const SUB_AGENT_PROBABILITY: f64 = 0.1;
/// Probability that a user turn names a tool (and so gets a function call back).
pub const TOOL_MENTION_PROBABILITY: f64 = 0.85;

const MIN_NEW_TOKENS: f64 = 64.0;
const MAX_NEW_TOKENS: f64 = 60_000.0;

/// Tool names (each one token; `_` never occurs in generated words, so only deliberate mentions match).
const TOOL_NAMES: [&str; 8] = [
    "read_file",
    "edit_file",
    "write_file",
    "run_shell",
    "grep_code",
    "list_dir",
    "run_tests",
    "web_fetch",
];

/// Who sends the sessions and when they start.
#[derive(Debug, Clone)]
pub struct AgenticSpec<'a> {
    /// Team of every session.
    pub team: &'a str,
    /// Session ids are `{id_prefix}-{n:04}` (sub-agents `...-sub{k}`).
    pub id_prefix: &'a str,
    /// Start time of each top-level session (one session per entry).
    pub starts: Vec<f64>,
    /// Seed of every random choice.
    pub seed: u64,
    /// Index of the first generated session in the final workload (for spawn and parent links).
    pub index_offset: usize,
}

/// A shared prefix: system prompt plus tools.
struct Prefix {
    instructions: String,
    tools: Vec<serde_json::Value>,
    tokens: usize,
}

/// FNV-1a of a team name, so each team gets its own prefixes.
pub(crate) fn team_seed(team: &str) -> u64 {
    team.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn prefixes(team: &str, seed: u64) -> Vec<Prefix> {
    let base = mix_seed(seed, team_seed(team));
    PREFIX_INSTRUCTION_WORDS
        .iter()
        .enumerate()
        .map(|(variant, &count)| {
            let variant_seed = mix_seed(base, variant as u64 + 1);
            let instructions = seeded_words(variant_seed, count);
            let mut rng = fastrand::Rng::with_seed(mix_seed(variant_seed, 0x7001));
            let tools: Vec<serde_json::Value> = TOOL_NAMES
                .iter()
                .map(|name| {
                    let description_words = rng.usize(200..=400);
                    json!({
                        "type": "function",
                        "name": name,
                        "description": words(&mut rng, description_words),
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "target": {"type": "string", "description": words(&mut rng, 12)},
                                "limit": {"type": "integer", "description": words(&mut rng, 8)},
                            },
                            "required": ["target"],
                            "additionalProperties": false,
                        },
                    })
                })
                .collect();
            let tokens = prefix_tokens(Some(&instructions), &tools);
            Prefix {
                instructions,
                tools,
                tokens,
            }
        })
        .collect()
}

fn new_tokens(rng: &mut fastrand::Rng) -> usize {
    lognormal(rng, NEW_TOKENS_MEDIAN, NEW_TOKENS_SIGMA).clamp(MIN_NEW_TOKENS, MAX_NEW_TOKENS)
        as usize
}

/// A user message of exactly `count` words; with `tool`, one of them is the tool's name.
fn user_text(rng: &mut fastrand::Rng, count: usize, tool: Option<&str>) -> String {
    match tool {
        None => words(rng, count.max(1)),
        Some(name) => {
            let before = rng.usize(..count.max(1));
            let after = count.max(1) - 1 - before;
            let mut text = words(rng, before);
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(name);
            if after > 0 {
                text.push(' ');
                text.push_str(&words(rng, after));
            }
            text
        }
    }
}

fn think_s(rng: &mut fastrand::Rng, tool_output: bool) -> f64 {
    if tool_output {
        lognormal(rng, 1.5, 1.0).clamp(0.1, 60.0)
    } else {
        lognormal(rng, 3.0, 0.8).clamp(0.5, 60.0)
    }
}

/// Builds the turns of one session from its pool of new-token sizes.
struct TurnBuilder<'a> {
    tools: &'a [serde_json::Value],
    /// Estimated input of the last turn (or the starting context before the first turn).
    context: usize,
    /// Estimated output of the last turn (0 before the first turn of a top-level session).
    last_output: usize,
    /// Whether the last turn's response is a function call.
    last_called_tool: bool,
    turns: Vec<TurnPlan>,
    inputs: Vec<usize>,
}

impl<'a> TurnBuilder<'a> {
    fn new(tools: &'a [serde_json::Value], context: usize, last_output: usize) -> Self {
        TurnBuilder {
            tools,
            context,
            last_output,
            last_called_tool: false,
            turns: Vec::new(),
            inputs: Vec::new(),
        }
    }

    /// Index into `sizes` of the largest draw that keeps reuse >= 90%, else of the smallest.
    fn pick(&self, sizes: &[usize]) -> Option<usize> {
        let fixed = self.last_output + MESSAGE_OVERHEAD_TOKENS;
        let bound = (self.context / 9).saturating_sub(fixed);
        let fitting = sizes
            .iter()
            .enumerate()
            .filter(|(_, &size)| size <= bound)
            .max_by_key(|(_, &size)| size)
            .map(|(index, _)| index);
        fitting.or_else(|| {
            sizes
                .iter()
                .enumerate()
                .min_by_key(|(_, &size)| size)
                .map(|(index, _)| index)
        })
    }

    /// Append one turn of `size` new tokens; false (nothing appended) if it would pass the cap.
    fn push(&mut self, rng: &mut fastrand::Rng, size: usize, force_tool: bool) -> bool {
        let input_tokens = self.context + self.last_output + MESSAGE_OVERHEAD_TOKENS + size;
        if input_tokens > CONTEXT_CAP_TOKENS {
            return false;
        }
        let tool_output = self.last_called_tool;
        let input = if tool_output {
            TurnInput::ToolOutput(words(rng, size.max(1)))
        } else {
            let mention = force_tool || rng.f64() < TOOL_MENTION_PROBABILITY;
            let tool = mention
                .then(|| self.tools.get(rng.usize(..self.tools.len().max(1))))
                .flatten()
                .and_then(|tool| tool.get("name"))
                .and_then(serde_json::Value::as_str);
            TurnInput::User(user_text(rng, size, tool))
        };
        let output = output_estimate(&input, self.tools);
        self.last_called_tool = output == super::TOOL_CALL_OUTPUT_TOKENS;
        self.turns.push(TurnPlan {
            think_s: if self.turns.is_empty() && !tool_output {
                0.0
            } else {
                think_s(rng, tool_output)
            },
            input,
            spawn: Vec::new(),
        });
        self.inputs.push(input_tokens);
        self.context = input_tokens;
        self.last_output = output;
        true
    }

    /// Place every size of `sizes` (largest fitting first) until they run out or the cap is hit.
    fn fill(&mut self, rng: &mut fastrand::Rng, mut sizes: Vec<usize>) {
        while let Some(index) = self.pick(&sizes) {
            let size = sizes.swap_remove(index);
            if !self.push(rng, size, false) {
                break;
            }
        }
    }
}

/// Generate the sessions (top-level sessions in start order, each followed by its sub-agents).
pub fn generate(spec: &AgenticSpec<'_>) -> Vec<SessionPlan> {
    let prefixes = prefixes(spec.team, spec.seed);
    let mut rng = fastrand::Rng::with_seed(mix_seed(spec.seed, team_seed(spec.team) ^ 0xA6E7));
    let count = spec.starts.len();
    let turn_counts: Vec<usize> = (0..count)
        .map(|_| MIN_TURNS + ((MAX_TURNS - MIN_TURNS) as f64 * rng.f64().powi(3)) as usize)
        .collect();
    // One pool of sizes for the whole workload: the largest open sessions, the rest are dealt.
    let mut pool: Vec<usize> = (0..turn_counts.iter().sum::<usize>())
        .map(|_| new_tokens(&mut rng))
        .collect();
    pool.sort_unstable();
    let mut firsts = pool.split_off(pool.len().saturating_sub(count));
    rng.shuffle(&mut firsts);
    rng.shuffle(&mut pool);
    let mut rest = pool.into_iter();

    let mut sessions = Vec::new();
    for (number, (&start_s, &turns)) in spec.starts.iter().zip(&turn_counts).enumerate() {
        let prefix = &prefixes[rng.usize(..prefixes.len())];
        let id = format!("{}-{number:04}", spec.id_prefix);
        let chained = number % 2 == 0;
        let mut builder = TurnBuilder::new(&prefix.tools, prefix.tokens, 0);
        let first = firsts
            .get(number)
            .copied()
            .unwrap_or(NEW_TOKENS_MEDIAN as usize);
        builder.push(&mut rng, first, true);
        builder.fill(
            &mut rng,
            rest.by_ref().take(turns.saturating_sub(1)).collect(),
        );
        let TurnBuilder {
            turns: mut parent_turns,
            inputs: parent_inputs,
            ..
        } = builder;
        let parent_index = spec.index_offset + sessions.len();
        let mut children = Vec::new();
        // Sub-agents start after a text answer, never with the parent's function call unanswered.
        let spawn_points: Vec<usize> = (1..=(parent_turns.len() / 2))
            .filter(|&t| {
                parent_turns
                    .get(t)
                    .is_some_and(|turn| !calls_tool(&turn.input, &prefix.tools))
            })
            .collect();
        if !spawn_points.is_empty() && rng.f64() < SUB_AGENT_PROBABILITY {
            let turn = spawn_points[rng.usize(..spawn_points.len())];
            let fan_out = rng.usize(3..=10);
            let base_context = parent_inputs.get(turn).copied().unwrap_or(0);
            let base_output = parent_turns
                .get(turn)
                .map_or(0, |t| output_estimate(&t.input, &prefix.tools));
            for k in 0..fan_out {
                let sub_id = format!("{id}-sub{k}");
                let mut sub = TurnBuilder::new(&prefix.tools, base_context, base_output);
                let sizes: Vec<usize> = (0..rng.usize(2..=4))
                    .map(|_| new_tokens(&mut rng))
                    .collect();
                let mut sizes = sizes;
                if let Some(index) = sub.pick(&sizes) {
                    let size = sizes.swap_remove(index);
                    sub.push(&mut rng, size, true);
                }
                sub.fill(&mut rng, sizes);
                if sub.turns.is_empty() {
                    continue;
                }
                children.push(SessionPlan {
                    mode: if chained {
                        SessionMode::Chained
                    } else {
                        SessionMode::Stateless {
                            prompt_cache_key: Some(sub_id.clone()),
                        }
                    },
                    id: sub_id,
                    team: spec.team.to_string(),
                    start_s,
                    instructions: Some(prefix.instructions.clone()),
                    tools: prefix.tools.clone(),
                    turns: sub.turns,
                    parent: Some(ParentLink {
                        session: parent_index,
                        turn,
                    }),
                });
            }
            if let Some(spawning) = parent_turns.get_mut(turn) {
                spawning.spawn = (1..=children.len()).map(|k| parent_index + k).collect();
            }
        }
        sessions.push(SessionPlan {
            mode: if chained {
                SessionMode::Chained
            } else {
                SessionMode::Stateless {
                    prompt_cache_key: Some(id.clone()),
                }
            },
            id,
            team: spec.team.to_string(),
            start_s,
            instructions: Some(prefix.instructions.clone()),
            tools: prefix.tools.clone(),
            turns: parent_turns,
            parent: None,
        });
        sessions.extend(children);
    }
    sessions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{generate as generate_workload, Workload, WorkloadKind, WorkloadParams};

    fn agentic(sessions: usize, seed: u64) -> Workload {
        generate_workload(&WorkloadParams {
            kind: WorkloadKind::Agentic,
            sessions,
            duration_s: 120.0,
            seed,
            agent_sessions: None,
        })
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The default-size workload (200 sessions, seed 1), generated once for all tests.
    fn default_agentic() -> &'static Workload {
        static DEFAULT: std::sync::OnceLock<Workload> = std::sync::OnceLock::new();
        DEFAULT.get_or_init(|| agentic(200, 1))
    }

    #[test]
    fn same_seed_same_workload_other_seed_differs() {
        let a = agentic(30, 1);
        assert_eq!(a, agentic(30, 1));
        assert_ne!(a, agentic(30, 2));
    }

    #[test]
    fn default_workload_has_the_published_shape() {
        let workload = default_agentic();
        let stats = workload.stats();
        assert_eq!(stats.sessions, 200);
        assert!(
            (3_600.0..=4_400.0).contains(&stats.new_tokens_median),
            "median new tokens {}",
            stats.new_tokens_median
        );
        assert!(
            (5_400.0..=6_600.0).contains(&stats.new_tokens_mean),
            "mean new tokens {}",
            stats.new_tokens_mean
        );
        assert!(
            stats.high_reuse_fraction >= 0.9,
            "only {:.3} of follow-up turns reuse >= 90% of the previous input",
            stats.high_reuse_fraction
        );
        assert!(
            (150_000..=CONTEXT_CAP_TOKENS).contains(&stats.max_input_tokens),
            "longest input {}",
            stats.max_input_tokens
        );
        // Half chained, half stateless, counting top-level sessions.
        let top: Vec<_> = workload
            .sessions
            .iter()
            .filter(|s| s.parent.is_none())
            .collect();
        let chained = top
            .iter()
            .filter(|s| s.mode == SessionMode::Chained)
            .count();
        assert_eq!(chained, 100);
        // Sane size: a few thousand requests, a few hundred million prompt tokens at most.
        assert!(
            (2_000..=5_000).contains(&stats.turns),
            "{} turns",
            stats.turns
        );
        assert!(stats.estimated_prompt_tokens < 450_000_000);
        // Turn counts within 10..=40 for top-level sessions (fewer only when the cap ends them).
        assert!(top.iter().all(|s| (1..=MAX_TURNS).contains(&s.turns.len())));
        assert!(top.iter().filter(|s| s.turns.len() >= MIN_TURNS).count() >= 150);
        let lengths = crate::workload::stats::input_lengths(&workload.sessions);
        let long_sessions_reach_far = lengths
            .iter()
            .zip(&workload.sessions)
            .filter(|(_, s)| s.turns.len() >= 30)
            .all(|(inputs, _)| inputs.last().copied().unwrap_or(0) >= 100_000);
        assert!(long_sessions_reach_far);
    }

    #[test]
    fn a_few_shared_prefixes_and_tool_loops() {
        let workload = agentic(40, 3);
        let mut prefixes: Vec<&str> = workload
            .sessions
            .iter()
            .filter_map(|s| s.instructions.as_deref())
            .collect();
        prefixes.sort_unstable();
        prefixes.dedup();
        assert_eq!(prefixes.len(), PREFIX_INSTRUCTION_WORDS.len());
        for session in &workload.sessions {
            assert_eq!(session.team, "default");
            assert_eq!(session.tools.len(), TOOL_NAMES.len());
            assert!(session.turns.first().is_some_and(|t| t.think_s >= 0.0));
            // A tool output only ever follows a user turn that named a tool.
            for pair in session.turns.windows(2) {
                if matches!(pair[1].input, TurnInput::ToolOutput(_)) {
                    assert!(crate::workload::stats::calls_tool(
                        &pair[0].input,
                        &session.tools
                    ));
                }
            }
            if let SessionMode::Stateless { prompt_cache_key } = &session.mode {
                assert_eq!(prompt_cache_key.as_deref(), Some(session.id.as_str()));
            }
        }
        let tool_outputs = workload
            .sessions
            .iter()
            .flat_map(|s| &s.turns)
            .filter(|t| matches!(t.input, TurnInput::ToolOutput(_)))
            .count();
        let turns = workload
            .sessions
            .iter()
            .map(|s| s.turns.len())
            .sum::<usize>();
        assert!(tool_outputs * 3 > turns, "tool loops are common");
        let mut ids: Vec<&str> = workload.sessions.iter().map(|s| s.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), workload.sessions.len(), "ids are unique");
    }

    #[test]
    fn sub_agents_fan_out_from_the_parent_prefix() {
        let workload = default_agentic();
        let mut fan_outs = 0;
        for (index, session) in workload.sessions.iter().enumerate() {
            for (turn_index, turn) in session.turns.iter().enumerate() {
                if turn.spawn.is_empty() {
                    continue;
                }
                fan_outs += 1;
                assert!((3..=10).contains(&turn.spawn.len()));
                for &child in &turn.spawn {
                    let sub = &workload.sessions[child];
                    assert_eq!(
                        sub.parent,
                        Some(ParentLink {
                            session: index,
                            turn: turn_index
                        })
                    );
                    assert_eq!(sub.instructions, session.instructions);
                    assert_eq!(sub.tools, session.tools);
                    assert_eq!(
                        sub.mode == SessionMode::Chained,
                        session.mode == SessionMode::Chained
                    );
                    assert!((1..=4).contains(&sub.turns.len()));
                }
            }
        }
        assert!(fan_outs >= 5, "{fan_outs} fan-outs in 200 sessions");
        let subs = workload
            .sessions
            .iter()
            .filter(|s| s.parent.is_some())
            .count();
        let spawned: usize = workload
            .sessions
            .iter()
            .flat_map(|s| &s.turns)
            .map(|t| t.spawn.len())
            .sum();
        assert_eq!(subs, spawned, "every sub-agent is spawned exactly once");
    }

    #[test]
    fn user_text_has_exactly_the_requested_words_and_names_the_tool() {
        let mut rng = fastrand::Rng::with_seed(5);
        for count in [1, 2, 50] {
            let text = user_text(&mut rng, count, Some("read_file"));
            assert_eq!(agentgate_sim::tokenizer::tokenize(&text).len(), count);
            assert!(text.contains("read_file"));
        }
        assert_eq!(user_text(&mut rng, 7, None).split(' ').count(), 7);
    }
}
