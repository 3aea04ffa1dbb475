//! Shape of a workload computed from its plan alone: per-turn new tokens, estimated input lengths
//! and how much of each turn's input the previous turn's input already covered.
//!
//! Output lengths are decided by the simulator, so the estimate assumes [`TEXT_OUTPUT_TOKENS`] for
//! a text answer and [`TOOL_CALL_OUTPUT_TOKENS`] for a function call (a user turn that names a
//! tool); every message costs [`MESSAGE_OVERHEAD_TOKENS`] of chat-template markup.

use super::{SessionPlan, TurnInput, Workload};

/// Assumed output tokens of a text answer (the simulator's median with `default_output_tokens = 300`).
pub const TEXT_OUTPUT_TOKENS: usize = 300;
/// Assumed output tokens of a function call (name plus short JSON arguments, with markup).
pub const TOOL_CALL_OUTPUT_TOKENS: usize = 30;
/// Chat-template tokens around one message (`<|im_start|>role` ... `<|im_end|>`).
pub(crate) const MESSAGE_OVERHEAD_TOKENS: usize = 11;

/// What a workload looks like, estimated from the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadStats {
    /// Top-level sessions.
    pub sessions: usize,
    /// Sub-agent sessions.
    pub sub_agent_sessions: usize,
    /// Sessions chained with `previous_response_id`.
    pub chained_sessions: usize,
    /// Requests in total.
    pub turns: usize,
    /// Median new tokens a turn adds (the words of its input).
    pub new_tokens_median: f64,
    /// Mean new tokens a turn adds.
    pub new_tokens_mean: f64,
    /// Longest estimated input of any request.
    pub max_input_tokens: usize,
    /// Turns that have a previous input (not the first turn of a top-level session).
    pub follow_up_turns: usize,
    /// Fraction of follow-up turns whose previous input is at least 90% of their own input.
    pub high_reuse_fraction: f64,
    /// Sum of the estimated inputs of every request.
    pub estimated_prompt_tokens: u64,
}

/// Words (= simulator tokens) of a text made by the generators.
fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

/// Estimated tokens of the shared prefix: instructions and tool definitions with their markup.
pub(crate) fn prefix_tokens(instructions: Option<&str>, tools: &[serde_json::Value]) -> usize {
    let instructions = instructions.map_or(0, |text| words(text) + MESSAGE_OVERHEAD_TOKENS);
    let tools = if tools.is_empty() {
        0
    } else {
        MESSAGE_OVERHEAD_TOKENS
            + tools
                .iter()
                .map(|tool| agentgate_sim::tokenizer::tokenize(&tool.to_string()).len())
                .sum::<usize>()
    };
    instructions + tools
}

/// Whether the response to this input is a function call (a user message naming one of `tools`).
pub(crate) fn calls_tool(input: &TurnInput, tools: &[serde_json::Value]) -> bool {
    let TurnInput::User(text) = input else {
        return false;
    };
    tools.iter().any(|tool| {
        tool.get("name")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|name| !name.is_empty() && text.contains(name))
    })
}

/// Estimated output tokens of the response to this input.
pub(crate) fn output_estimate(input: &TurnInput, tools: &[serde_json::Value]) -> usize {
    if calls_tool(input, tools) {
        TOOL_CALL_OUTPUT_TOKENS
    } else {
        TEXT_OUTPUT_TOKENS
    }
}

/// Estimated input tokens of every turn of every session (sub-agents start from their parent's).
pub(crate) fn input_lengths(sessions: &[SessionPlan]) -> Vec<Vec<usize>> {
    let mut lengths: Vec<Vec<usize>> = Vec::with_capacity(sessions.len());
    for session in sessions {
        let start = session
            .parent
            .and_then(|link| {
                let parent = sessions.get(link.session)?;
                let input = lengths.get(link.session)?.get(link.turn)?;
                let output = output_estimate(&parent.turns.get(link.turn)?.input, &parent.tools);
                Some(input + output)
            })
            .unwrap_or_else(|| prefix_tokens(session.instructions.as_deref(), &session.tools));
        let mut context = start;
        let mut inputs = Vec::with_capacity(session.turns.len());
        for (index, turn) in session.turns.iter().enumerate() {
            if index > 0 {
                context += session
                    .turns
                    .get(index - 1)
                    .map_or(0, |prev| output_estimate(&prev.input, &session.tools));
            }
            context += MESSAGE_OVERHEAD_TOKENS + words(turn.input.text());
            inputs.push(context);
        }
        lengths.push(inputs);
    }
    lengths
}

impl Workload {
    /// Summarise the plan (see [`WorkloadStats`]).
    pub fn stats(&self) -> WorkloadStats {
        let lengths = input_lengths(&self.sessions);
        let mut new_tokens: Vec<usize> = Vec::new();
        let mut follow_up_turns = 0usize;
        let mut high_reuse = 0usize;
        for (index, session) in self.sessions.iter().enumerate() {
            let inputs = lengths.get(index).map(Vec::as_slice).unwrap_or_default();
            let mut previous = session
                .parent
                .and_then(|link| lengths.get(link.session)?.get(link.turn).copied());
            for (turn, input) in session.turns.iter().zip(inputs) {
                new_tokens.push(words(turn.input.text()));
                if let Some(previous) = previous {
                    follow_up_turns += 1;
                    if previous as f64 >= 0.9 * *input as f64 {
                        high_reuse += 1;
                    }
                }
                previous = Some(*input);
            }
        }
        new_tokens.sort_unstable();
        let turns = new_tokens.len();
        let new_tokens_median = match turns {
            0 => 0.0,
            n if n % 2 == 1 => new_tokens[n / 2] as f64,
            n => (new_tokens[n / 2 - 1] + new_tokens[n / 2]) as f64 / 2.0,
        };
        let new_tokens_mean = if turns == 0 {
            0.0
        } else {
            new_tokens.iter().sum::<usize>() as f64 / turns as f64
        };
        let sub_agent_sessions = self.sessions.iter().filter(|s| s.parent.is_some()).count();
        WorkloadStats {
            sessions: self.sessions.len() - sub_agent_sessions,
            sub_agent_sessions,
            chained_sessions: self
                .sessions
                .iter()
                .filter(|s| s.mode == super::SessionMode::Chained)
                .count(),
            turns,
            new_tokens_median,
            new_tokens_mean,
            max_input_tokens: lengths.iter().flatten().copied().max().unwrap_or(0),
            follow_up_turns,
            high_reuse_fraction: if follow_up_turns == 0 {
                0.0
            } else {
                high_reuse as f64 / follow_up_turns as f64
            },
            estimated_prompt_tokens: lengths.iter().flatten().map(|&n| n as u64).sum(),
        }
    }
}
