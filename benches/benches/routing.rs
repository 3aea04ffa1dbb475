//! Criterion micro-benchmark: one routing decision over a pool of 64 endpoints, for each picker
//! of `agentgate_scheduler`.
//!
//! - Baselines: round robin; least loaded with every endpoint idle (a 64-way tie broken at
//!   random) and with distinct in-flight loads.
//! - Scoring pipelines (`prefix`, `session`) for a 200k-token prompt (3125 chunk hashes of 64
//!   tokens) over a prefix index whose 64 slots are filled to their default capacity by other
//!   sessions sharing a 20k-token system prompt; the scored prompt's previous turn (all but its
//!   last 5k tokens) lives on one endpoint, every endpoint has some load and a fresh metrics
//!   report. Measured: the `prefix` pick, the `session` pick with the pin holding, and the
//!   `session` pick with the pin unavailable (filters, wait rule skipped, re-placement). Prompt
//!   hashing is measured separately in the `prefix_index` benchmark.

use std::hint::black_box;
use std::sync::Arc;
use tokio::time::Instant;

use agentgate_scheduler::{
    Endpoint, InFlight, LeastLoaded, LoadReport, PickRequest, Picker, Pinned, Pipeline, Policy,
    PrefixIndexConfig, RoundRobin, ScoringConfig,
};
use criterion::{criterion_group, criterion_main, Criterion};

/// Endpoints in the benchmarked pool.
const ENDPOINTS: usize = 64;
/// Chunks of the scored prompt: 200k tokens at 64 tokens per chunk.
const PROMPT_CHUNKS: usize = 3125;
/// Chunks of the shared system prompt (20k tokens).
const SYSTEM_CHUNKS: usize = 312;
/// Chunks of the new turn the session's endpoint has not seen (5k tokens).
const NEW_TURN_CHUNKS: usize = 78;
/// The session's endpoint.
const SESSION_ENDPOINT: usize = 17;

fn endpoints() -> Vec<Arc<Endpoint>> {
    (0..ENDPOINTS)
        .map(|i| {
            Arc::new(
                Endpoint::new(format!("pool/{i}"), format!("http://10.0.0.{i}:8000")).with_slot(i),
            )
        })
        .collect()
}

/// Endpoint i has (i * 7) % 64 + 1 requests in flight, so one minimum exists.
fn distinct_loads(pool: &[Arc<Endpoint>]) -> Vec<InFlight> {
    pool.iter()
        .enumerate()
        .flat_map(|(i, ep)| {
            let requests = (i * 7) % ENDPOINTS + 1;
            (0..requests).map(move |_| ep.begin(4096, 512))
        })
        .collect()
}

/// A pipeline whose index holds other sessions on every slot, and the scored prompt's
/// previous turn on the session's endpoint.
fn filled(policy: Policy, prompt: &[u64], rng: &mut fastrand::Rng) -> Pipeline {
    let pipeline = Pipeline::new(
        PrefixIndexConfig::default(),
        &ScoringConfig::for_policy(policy),
    )
    .expect("default scoring config");
    let picker: &dyn Picker = &pipeline;
    let system = &prompt[..SYSTEM_CHUNKS];
    for slot in 0..ENDPOINTS {
        picker.routed(slot, system);
        // Twice the default capacity (8192 chunks) so each LRU has churned.
        let mut sent = 0;
        while sent < 2 * 8192 {
            let own = rng.usize(470..=2734);
            let session: Vec<u64> = system
                .iter()
                .copied()
                .chain((0..own).map(|_| rng.u64(..)))
                .collect();
            picker.routed(slot, &session);
            sent += session.len();
        }
    }
    picker.routed(SESSION_ENDPOINT, &prompt[..PROMPT_CHUNKS - NEW_TURN_CHUNKS]);
    for slot in 0..ENDPOINTS {
        picker.routed(slot, system);
    }
    pipeline
}

fn routing(c: &mut Criterion) {
    let pool = endpoints();
    let mut group = c.benchmark_group("routing_decision_64_endpoints");

    let round_robin = RoundRobin::default();
    group.bench_function("round_robin", |b| {
        b.iter(|| round_robin.pick(black_box(&pool), &PickRequest::default()))
    });

    group.bench_function("least_loaded_all_idle", |b| {
        b.iter(|| LeastLoaded.pick(black_box(&pool), &PickRequest::default()))
    });

    let loaded = endpoints();
    let _guards = distinct_loads(&loaded);
    group.bench_function("least_loaded_varied_load", |b| {
        b.iter(|| LeastLoaded.pick(black_box(&loaded), &PickRequest::default()))
    });

    let exclude = [0usize, 1, 2];
    group.bench_function("least_loaded_varied_load_3_excluded", |b| {
        b.iter(|| {
            LeastLoaded.pick(
                black_box(&loaded),
                &PickRequest {
                    exclude: black_box(&exclude),
                    ..PickRequest::default()
                },
            )
        })
    });

    // Scoring pipelines, 200k-token prompt.
    let mut rng = fastrand::Rng::with_seed(5);
    let prompt: Vec<u64> = (0..PROMPT_CHUNKS).map(|_| rng.u64(..)).collect();
    let now = Instant::now();
    for ep in &loaded {
        ep.set_load_report(LoadReport {
            at: now,
            waiting: 1.0,
            running: 8.0,
            kv_usage: Some(0.6),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        });
    }
    let prefix = filled(Policy::Prefix, &prompt, &mut rng);
    let session = filled(Policy::Session, &prompt, &mut rng);
    let request = |pinned| PickRequest {
        prefix: &prompt,
        prompt_tokens: 200_000,
        pinned,
        ..PickRequest::default()
    };
    let check = session
        .pick(&loaded, &request(Pinned::At(SESSION_ENDPOINT)))
        .expect("a pick");
    eprintln!(
        "session pick: endpoint {} ({}), pin {}, {} chunks matched, {} tokens to prefill",
        check.index,
        check.reason.as_str(),
        check.pin.as_str(),
        check.matched_chunks,
        check.uncached_tokens_estimate
    );

    group.bench_function("prefix_pipeline_200k_prompt", |b| {
        b.iter(|| prefix.pick(black_box(&loaded), &request(Pinned::None)))
    });
    group.bench_function("session_pipeline_200k_prompt_pin_held", |b| {
        b.iter(|| session.pick(black_box(&loaded), &request(Pinned::At(SESSION_ENDPOINT))))
    });
    group.bench_function("session_pipeline_200k_prompt_pin_gone", |b| {
        b.iter(|| session.pick(black_box(&loaded), &request(Pinned::Gone)))
    });
    group.finish();
}

criterion_group!(benches, routing);
criterion_main!(benches);
