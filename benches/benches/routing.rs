//! Criterion micro-benchmark: one routing decision over a pool of 64 endpoints, for each baseline
//! picker of `agentgate_scheduler` (round robin; least loaded with every endpoint idle, which
//! breaks a 64-way tie at random, and with distinct in-flight loads).

use std::hint::black_box;
use std::sync::Arc;

use agentgate_scheduler::{Endpoint, InFlight, LeastLoaded, PickRequest, Picker, RoundRobin};
use criterion::{criterion_group, criterion_main, Criterion};

/// Endpoints in the benchmarked pool.
const ENDPOINTS: usize = 64;

fn endpoints() -> Vec<Arc<Endpoint>> {
    (0..ENDPOINTS)
        .map(|i| {
            Arc::new(Endpoint::new(
                format!("pool/{i}"),
                format!("http://10.0.0.{i}:8000"),
            ))
        })
        .collect()
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

    // Distinct loads: endpoint i has (i * 7) % 64 + 1 requests in flight, so one minimum exists.
    let loaded = endpoints();
    let _guards: Vec<InFlight> = loaded
        .iter()
        .enumerate()
        .flat_map(|(i, ep)| {
            let requests = (i * 7) % ENDPOINTS + 1;
            (0..requests).map(move |_| ep.begin(4096, 4096))
        })
        .collect();
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
                    prefix: None,
                },
            )
        })
    });
    group.finish();
}

criterion_group!(benches, routing);
criterion_main!(benches);
