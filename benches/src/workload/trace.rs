//! The `trace:PATH` generator: replays a Mooncake-format JSONL trace.
//!
//! Each line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
//! [..]}` where every hash id names one 512-token block of the prompt. Every id becomes a fixed
//! block of [`BLOCK_WORDS`] pseudo-words (same id -> same text, in any trace), blocks are joined in
//! order and the prompt is cut to exactly `input_length` words (if the ids cover fewer words than
//! that, the rest is filler unique to the row). Each row becomes one single-turn stateless session
//! without `prompt_cache_key`, starting at `timestamp / 1000` simulated seconds; only rows that
//! arrive within the first `duration_s` seconds are replayed (`--sessions` is not used: the
//! duration selects the span). Output lengths are left to the simulator.

use std::collections::HashMap;
use std::path::Path;

use super::text::{mix_seed, seeded_words};
use super::{SessionMode, SessionPlan, TurnInput, TurnPlan, Workload};

/// Words (= tokens) per trace block.
pub const BLOCK_WORDS: usize = 512;

const BLOCK_TAG: u64 = 0x4d4f_4f4e_4341_4b45;
const FILLER_TAG: u64 = 0x4649_4c4c_4552;

/// One line of a Mooncake trace.
#[derive(Debug, serde::Deserialize)]
struct TraceRow {
    timestamp: f64,
    input_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Text of the block with this hash id.
pub fn block_text(hash_id: u64) -> String {
    seeded_words(mix_seed(BLOCK_TAG, hash_id), BLOCK_WORDS)
}

/// Append the first `count` words of `text` (single-space separated) to `out`.
fn push_words(out: &mut String, text: &str, count: usize) {
    if count == 0 {
        return;
    }
    if !out.is_empty() {
        out.push(' ');
    }
    let end = text
        .match_indices(' ')
        .nth(count - 1)
        .map_or(text.len(), |(index, _)| index);
    out.push_str(&text[..end]);
}

/// The prompt of a row: its blocks' text cut to exactly `input_length` words.
fn prompt_text(row_number: usize, row: &TraceRow, blocks: &mut HashMap<u64, String>) -> String {
    let mut out = String::with_capacity(row.input_length * 7);
    let mut remaining = row.input_length;
    for &hash_id in &row.hash_ids {
        if remaining == 0 {
            break;
        }
        let text = blocks.entry(hash_id).or_insert_with(|| block_text(hash_id));
        let take = remaining.min(BLOCK_WORDS);
        push_words(&mut out, text, take);
        remaining -= take;
    }
    let mut filler_block = 0u64;
    while remaining > 0 {
        let seed = mix_seed(FILLER_TAG, ((row_number as u64) << 20) | filler_block);
        let take = remaining.min(BLOCK_WORDS);
        push_words(&mut out, &seeded_words(seed, take), take);
        remaining -= take;
        filler_block += 1;
    }
    out
}

/// Read the trace at `path` and replay its first `duration_s` seconds of arrivals.
pub fn generate(path: &Path, duration_s: f64) -> Result<Workload, String> {
    let content = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "cannot read trace {}: {e}; pass trace:PATH with a Mooncake JSONL file such as ../shared/traces/mooncake_conversation.jsonl",
            path.display()
        )
    })?;
    let limit_ms = duration_s * 1000.0;
    let mut blocks: HashMap<u64, String> = HashMap::new();
    let mut sessions = Vec::new();
    for (index, line) in content.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: TraceRow = serde_json::from_str(line).map_err(|e| {
            format!(
                "line {} of {} is not a Mooncake trace row ({{\"timestamp\", \"input_length\", \"output_length\", \"hash_ids\"}}): {e}",
                index + 1,
                path.display()
            )
        })?;
        if !row.timestamp.is_finite() || row.timestamp < 0.0 || row.timestamp >= limit_ms {
            continue;
        }
        if row.input_length == 0 {
            continue;
        }
        let id = format!("trace-{index:05}");
        sessions.push(SessionPlan {
            id,
            team: "default".into(),
            start_s: row.timestamp / 1000.0,
            mode: SessionMode::Stateless {
                prompt_cache_key: None,
            },
            instructions: None,
            tools: Vec::new(),
            turns: vec![TurnPlan {
                think_s: 0.0,
                input: TurnInput::User(prompt_text(index, &row, &mut blocks)),
                spawn: Vec::new(),
            }],
            parent: None,
        });
    }
    if sessions.is_empty() {
        return Err(format!(
            "no request of {} arrives within the first {duration_s} s: pass a longer --duration",
            path.display()
        ));
    }
    sessions.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    let file = path.file_name().map_or_else(
        || path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    Ok(Workload {
        name: format!("trace:{file}"),
        sessions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{generate as generate_workload, WorkloadKind, WorkloadParams};

    fn write_trace(name: &str, lines: &[&str]) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("agentgate-bench-trace-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(name);
        let _ = std::fs::write(&path, lines.join("\n"));
        path
    }

    fn prompt(workload: &Workload, index: usize) -> &str {
        workload.sessions[index].turns[0].input.text()
    }

    #[test]
    fn rows_become_exact_length_prompts_sharing_block_text() {
        let path = write_trace(
            "small.jsonl",
            &[
                r#"{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]}"#,
                r#"{"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [0, 7]}"#,
                r#"{"timestamp": 2500, "input_length": 1500, "output_length": 5, "hash_ids": [9]}"#,
                r#"{"timestamp": 9000, "input_length": 50, "output_length": 5, "hash_ids": [0]}"#,
            ],
        );
        let params = WorkloadParams {
            kind: WorkloadKind::Trace(path.clone()),
            sessions: 1,
            duration_s: 5.0,
            seed: 1,
            agent_sessions: None,
        };
        let workload = generate_workload(&params).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(workload.name, "trace:small.jsonl");
        assert_eq!(
            workload.sessions.len(),
            3,
            "the row at 9 s is past the duration"
        );
        assert_eq!(
            workload,
            generate_workload(&params).unwrap_or_else(|e| panic!("{e}"))
        );
        let lengths: Vec<usize> = (0..3)
            .map(|i| agentgate_sim::tokenizer::tokenize(prompt(&workload, i)).len())
            .collect();
        assert_eq!(lengths, vec![1100, 700, 1500]);
        // Rows sharing hash id 0 share its 512-word block and nothing after it.
        let (a, b) = (prompt(&workload, 0), prompt(&workload, 1));
        let block0 = block_text(0);
        assert!(a.starts_with(&block0) && b.starts_with(&block0));
        let next_word = |text: &str| text[block0.len()..].split(' ').nth(1).map(str::to_owned);
        assert_ne!(next_word(a), next_word(b));
        assert!(!prompt(&workload, 2).starts_with(&block_text(0)[..20]));
        let session = &workload.sessions[1];
        assert_eq!(session.start_s, 1.5);
        assert_eq!(
            session.mode,
            SessionMode::Stateless {
                prompt_cache_key: None
            }
        );
        assert!(session.instructions.is_none() && session.tools.is_empty());
        assert_eq!(session.turns.len(), 1);
    }

    #[test]
    fn unreadable_or_malformed_traces_say_what_to_pass() {
        let missing = generate(Path::new("/nonexistent/trace.jsonl"), 10.0).unwrap_err();
        assert!(missing.contains("trace:PATH"));
        let bad = write_trace("bad.jsonl", &[r#"{"timestamp": "x"}"#]);
        assert!(generate(&bad, 10.0).unwrap_err().contains("line 1"));
        let late = write_trace(
            "late.jsonl",
            &[r#"{"timestamp": 60000, "input_length": 5, "output_length": 1, "hash_ids": [1]}"#],
        );
        assert!(generate(&late, 10.0).unwrap_err().contains("--duration"));
    }

    #[test]
    fn the_shared_conversation_trace_replays_when_present() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/traces/mooncake_conversation.jsonl");
        if !path.exists() {
            return;
        }
        let workload = generate(&path, 10.0).unwrap_or_else(|e| panic!("{e}"));
        assert!(!workload.sessions.is_empty());
        assert!(workload.sessions.iter().all(|s| s.start_s < 10.0));
    }
}
