//! Criterion micro-benchmark: the simulator's prefix-cache block hashing per MiB of prompt text
//! (`agentgate_sim::cache::chain_hashes`, 16-token blocks, each hash chained on its parent), alone
//! on pre-tokenized prompts and together with the tokenizer, as the simulator runs it per request.
//! Throughput is reported in bytes of prompt text.

use std::hint::black_box;
use std::time::Duration;

use agentgate_sim::cache::chain_hashes;
use agentgate_sim::tokenizer::tokenize;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// Prompt size hashed per iteration.
const PROMPT_BYTES: usize = 1024 * 1024;
/// Tokens per KV block, the simulator's default.
const BLOCK_SIZE: usize = 16;

/// About `bytes` of lowercase words (3 to 8 letters) separated by single spaces.
fn prompt_text(bytes: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(7);
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        if !text.is_empty() {
            text.push(' ');
        }
        for _ in 0..rng.usize(3..=8) {
            text.push(rng.lowercase());
        }
    }
    text
}

fn block_hashing(c: &mut Criterion) {
    let text = prompt_text(PROMPT_BYTES);
    let tokens = tokenize(&text);
    eprintln!(
        "prompt: {} bytes, {} tokens, {} full blocks of {BLOCK_SIZE}",
        text.len(),
        tokens.len(),
        tokens.len() / BLOCK_SIZE
    );
    let mut group = c.benchmark_group("sim_prefix_block_hashing_1MiB_prompt");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.measurement_time(Duration::from_secs(5));
    group.bench_function("chain_hashes", |b| {
        b.iter(|| chain_hashes(black_box(&tokens), BLOCK_SIZE))
    });
    group.bench_function("tokenize_and_chain_hashes", |b| {
        b.iter(|| chain_hashes(&tokenize(black_box(&text)), BLOCK_SIZE))
    });
    group.finish();
}

criterion_group!(benches, block_hashing);
criterion_main!(benches);
