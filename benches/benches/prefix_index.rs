//! Criterion micro-benchmark: the scheduler's prefix index (`agentgate_scheduler::prefix_index`).
//!
//! - `prefix_index_hashing_1MiB_prompt`: chained XXH3 chunk hashes per MiB of rendered prompt
//!   text, at the default 256-byte chunk (~64 tokens) and at 64 bytes (~16 tokens, one vLLM block).
//! - `prefix_index_decision_200k_tokens_64_endpoints`: one routing decision's prefix work for a
//!   200k-token prompt (800 000 bytes at 4 bytes/token, 3125 chunks) against 64 endpoints, each
//!   with the default 512k-token capacity (8192 chunks) filled by agent sessions: every session
//!   starts with the same 20k-token system prompt and tools, then 30k to 175k tokens of its own.
//!   The scored prompt's previous turn (all but its last 5k tokens) lives on one endpoint; every
//!   other endpoint holds only the shared system prefix of it. Measured: hash + score (the whole
//!   decision), score alone, hash + score when all 64 endpoints hold the whole prompt (the worst
//!   case for the walk), and the `record` that follows the decision (steady state, and for a
//!   prompt the endpoint has never seen).

use std::hint::black_box;
use std::time::Duration;

use agentgate_scheduler::prefix_index::chunk_hashes;
use agentgate_scheduler::{PrefixIndex, PrefixIndexConfig};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

/// Endpoints in the pool.
const ENDPOINTS: usize = 64;
/// Model name the hashes are seeded with.
const MODEL: &str = "Qwen/Qwen3-Coder-30B-A3B-Instruct";
/// Assumed bytes of rendered prompt text per token.
const BYTES_PER_TOKEN: usize = 4;
/// The scored prompt: 200k tokens.
const PROMPT_TOKENS: usize = 200_000;
/// System prompt and tools every session shares.
const SYSTEM_TOKENS: usize = 20_000;
/// Tokens of the scored prompt the previous turn did not have.
const NEW_TURN_TOKENS: usize = 5_000;
/// Endpoint holding the scored prompt's session.
const SESSION_ENDPOINT: usize = 17;

/// About `bytes` of lowercase words (3 to 8 letters) separated by single spaces.
fn prompt_text(bytes: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        if !text.is_empty() {
            text.push(' ');
        }
        for _ in 0..rng.usize(3..=8) {
            text.push(rng.lowercase());
        }
    }
    text.truncate(bytes);
    text.into_bytes()
}

/// An index whose endpoints are filled with other sessions sharing `system` as their prefix.
fn filled_index(system: &[u64], rng: &mut fastrand::Rng) -> PrefixIndex {
    let index = PrefixIndex::new(ENDPOINTS, PrefixIndexConfig::default());
    let tokens_per_chunk = index.tokens_per_chunk() as usize;
    for e in 0..ENDPOINTS {
        // Send twice the capacity through each endpoint so its LRU has churned.
        let mut sent = 0;
        while sent < 2 * index.capacity_chunks(e) {
            let own = rng.usize(30_000..=175_000) / tokens_per_chunk;
            // Distinct random values stand in for a distinct chain after the shared prefix.
            let session: Vec<u64> = system
                .iter()
                .copied()
                .chain((0..own).map(|_| rng.u64(..)))
                .collect();
            index.record(e, &session);
            sent += session.len();
        }
    }
    index
}

fn hashing(c: &mut Criterion) {
    let text = prompt_text(1024 * 1024, 7);
    let mut group = c.benchmark_group("prefix_index_hashing_1MiB_prompt");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.measurement_time(Duration::from_secs(5));
    for chunk_bytes in [256, 64] {
        group.bench_function(format!("chunk_hashes_{chunk_bytes}B_chunks"), |b| {
            b.iter(|| chunk_hashes(MODEL, black_box(&text), chunk_bytes))
        });
    }
    group.finish();
}

fn decision(c: &mut Criterion) {
    let text = prompt_text(PROMPT_TOKENS * BYTES_PER_TOKEN, 11);
    let mut rng = fastrand::Rng::with_seed(3);
    let probe = PrefixIndex::new(1, PrefixIndexConfig::default());
    let hashes = probe.chunk_hashes(MODEL, &text);
    let tokens_per_chunk = probe.tokens_per_chunk() as usize;
    let system = &hashes[..SYSTEM_TOKENS / tokens_per_chunk];
    let previous_turn = &hashes[..hashes.len() - NEW_TURN_TOKENS / tokens_per_chunk];
    let candidates: Vec<usize> = (0..ENDPOINTS).collect();

    let realistic = filled_index(system, &mut rng);
    realistic.record(SESSION_ENDPOINT, previous_turn);
    // Other sessions keep arriving there after that turn, short of evicting it.
    let room = realistic.capacity_chunks(SESSION_ENDPOINT) - previous_turn.len();
    let other: Vec<u64> = system
        .iter()
        .copied()
        .chain((0..room / 2).map(|_| rng.u64(..)))
        .collect();
    realistic.record(SESSION_ENDPOINT, &other);
    for e in 0..ENDPOINTS {
        realistic.record(e, system);
    }
    let lens = realistic.match_lens(&hashes, &candidates);
    eprintln!(
        "prompt: {} bytes, {} chunks; matched chunks: endpoint {SESSION_ENDPOINT} = {}, others = {}..={}; held per endpoint ~{}",
        text.len(),
        hashes.len(),
        lens[SESSION_ENDPOINT],
        lens.iter().enumerate().filter(|(e, _)| *e != SESSION_ENDPOINT).map(|(_, l)| *l).min().unwrap_or(0),
        lens.iter().enumerate().filter(|(e, _)| *e != SESSION_ENDPOINT).map(|(_, l)| *l).max().unwrap_or(0),
        realistic.held_chunks(0),
    );

    let worst = filled_index(system, &mut rng);
    for e in 0..ENDPOINTS {
        worst.record(e, &hashes);
    }

    let mut group = c.benchmark_group("prefix_index_decision_200k_tokens_64_endpoints");
    group.measurement_time(Duration::from_secs(5));
    group.bench_function("hash_and_score", |b| {
        b.iter(|| {
            let hashes = realistic.chunk_hashes(MODEL, black_box(&text));
            realistic.score(&hashes, &candidates)
        })
    });
    group.bench_function("score_only", |b| {
        b.iter(|| realistic.score(black_box(&hashes), &candidates))
    });
    group.bench_function("hash_and_score_all_endpoints_hold_prompt", |b| {
        b.iter(|| {
            let hashes = worst.chunk_hashes(MODEL, black_box(&text));
            worst.score(&hashes, &candidates)
        })
    });
    // Steady state after the first iteration: the session endpoint already holds every chunk,
    // so this is 3125 LRU touches under one endpoint lock.
    group.bench_function("record_after_decision", |b| {
        b.iter(|| realistic.record(SESSION_ENDPOINT, black_box(&hashes)))
    });
    // A prompt the endpoint has never seen, on a full LRU: 3125 inserts and 3125 evictions.
    let fresh_endpoint = (SESSION_ENDPOINT + 1) % ENDPOINTS;
    group.bench_function("record_unseen_prompt_on_full_endpoint", |b| {
        b.iter_batched(
            || (0..hashes.len()).map(|_| rng.u64(..)).collect::<Vec<u64>>(),
            |unseen| realistic.record(fresh_endpoint, &unseen),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, hashing, decision);
criterion_main!(benches);
