//! Criterion micro-benchmark: loading the history of a 100-turn conversation (one user message
//! and one assistant message per turn) from each conversation store, `MemoryStore` and
//! `RedisStore`, at two message sizes. Redis is a private `redis-server` started through
//! `agentgate_sessions::testing::TestRedis` (or the one named by `AGENTGATE_TEST_REDIS_URL`).

use std::hint::black_box;
use std::time::Duration;

use agentgate_sessions::testing::{record, unique_prefix, TestRedis};
use agentgate_sessions::{MemoryStore, RedisStore, Store, StoreOptions};
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion};
use tokio::runtime::Runtime;

/// Turns in the benchmarked conversation.
const TURNS: usize = 100;
/// Text bytes per message: short chat turns and agent-sized turns.
const MESSAGE_BYTES: [usize; 2] = [1024, 16 * 1024];
/// Team that owns the conversation.
const TEAM: &str = "bench";

/// Store a chain of `TURNS` responses and return their ids, oldest first.
fn fill<S: Store>(runtime: &Runtime, store: &S, message_bytes: usize) -> Vec<String> {
    runtime.block_on(async {
        let mut ids: Vec<String> = Vec::with_capacity(TURNS);
        for turn in 0..TURNS {
            let id = format!("resp_{message_bytes}_{turn}");
            let rec = record(TEAM, &id, ids.last().map(String::as_str), message_bytes);
            if let Err(e) = store.put(&rec).await {
                panic!("storing turn {turn} failed: {e}");
            }
            ids.push(id);
        }
        ids
    })
}

fn bench_store<S: Store>(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    runtime: &Runtime,
    name: &str,
    store: &S,
) {
    for message_bytes in MESSAGE_BYTES {
        let ids = fill(runtime, store, message_bytes);
        let last = ids.last().cloned().unwrap_or_default();
        let loaded = runtime.block_on(store.history(TEAM, &last));
        match loaded {
            Ok(Some(h)) if h.items.len() == 2 * TURNS => {}
            other => panic!(
                "{name}: expected {} history items, got {other:?}",
                2 * TURNS
            ),
        }
        group.bench_function(format!("{name}/{}B_messages", message_bytes), |b| {
            b.iter(|| runtime.block_on(store.history(TEAM, black_box(&last))))
        });
        runtime.block_on(async {
            for id in &ids {
                let _ = store.delete(TEAM, id).await;
            }
        });
    }
}

fn history_load(c: &mut Criterion) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => panic!("cannot start a tokio runtime: {e}"),
    };
    let mut group = c.benchmark_group("history_load_100_turns");
    group.measurement_time(Duration::from_secs(6));
    group.sample_size(30);

    let memory = MemoryStore::new(StoreOptions::default());
    bench_store(&mut group, &runtime, "memory", &memory);

    let redis_server = TestRedis::start();
    let opts = StoreOptions {
        key_prefix: unique_prefix("history_load_bench"),
        ..StoreOptions::default()
    };
    let redis = match runtime.block_on(RedisStore::connect(redis_server.url(), opts)) {
        Ok(store) => store,
        Err(e) => panic!("cannot connect to {}: {e}", redis_server.url()),
    };
    bench_store(&mut group, &runtime, "redis", &redis);
    group.finish();
    drop(redis);
    drop(redis_server);
}

criterion_group!(benches, history_load);
criterion_main!(benches);
