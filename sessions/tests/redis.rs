//! The Redis backend against a real `redis-server`: the shared store suite, round-trip counts,
//! TTLs, script-cache loss, connection errors, the memory one conversation costs, and session
//! pins (the shared pin suite, their TTL, key shape and length, races across connections).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentgate_sessions::pins::MAX_KEY_PART_LEN;
use agentgate_sessions::testing::{
    closed_port, items_of, pin, pin_expiry_suite, record, suite, unique_prefix, TestRedis,
};
use agentgate_sessions::{
    AnyStore, RedisStore, ResponseRecord, SessionPin, Store, StoreError, StoreOptions,
};
use redis::aio::MultiplexedConnection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// TTL for test keys: long enough for any test, short enough not to pile up in a shared Redis.
const TEST_TTL: Duration = Duration::from_secs(3600);

async fn store(redis: &TestRedis, test_name: &str) -> RedisStore {
    store_with_ttl(redis, test_name, TEST_TTL).await
}

async fn store_with_ttl(redis: &TestRedis, test_name: &str, ttl: Duration) -> RedisStore {
    let opts = StoreOptions {
        ttl,
        key_prefix: unique_prefix(test_name),
        ..StoreOptions::default()
    };
    connect(redis, opts).await
}

async fn connect(redis: &TestRedis, opts: StoreOptions) -> RedisStore {
    RedisStore::connect(redis.url(), opts)
        .await
        .expect("connect to the test Redis")
}

async fn raw(redis: &TestRedis) -> MultiplexedConnection {
    redis::Client::open(redis.url())
        .expect("valid URL")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection to the test Redis")
}

async fn pttl(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(conn)
        .await
        .expect("PTTL")
}

/// Shorten `key`'s TTL to 10 s, as if it had been written long ago.
async fn expire_in_10s(conn: &mut MultiplexedConnection, key: &str) {
    let _: () = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(10_000)
        .query_async(conn)
        .await
        .expect("PEXPIRE");
}

/// Store a linear chain of `turns` responses, each with `text_bytes` of text per item.
async fn put_chain<S: Store>(
    store: &S,
    team: &str,
    stem: &str,
    turns: usize,
    text_bytes: usize,
) -> Vec<ResponseRecord> {
    let mut chain: Vec<ResponseRecord> = Vec::new();
    for turn in 0..turns {
        let prev = chain.last().map(|r| r.id.clone());
        let rec = record(team, &format!("{stem}_{turn}"), prev.as_deref(), text_bytes);
        store.put(&rec).await.expect("put");
        chain.push(rec);
    }
    chain
}

#[tokio::test]
async fn passes_the_store_suite() {
    let redis = TestRedis::start();
    let store = store(&redis, "suite").await;
    suite(&store).await;
    assert!(store.round_trips() > 0, "Redis operations must be counted");
}

#[tokio::test]
async fn any_store_on_redis_passes_the_store_suite() {
    let redis = TestRedis::start();
    let opts = StoreOptions {
        ttl: TEST_TTL,
        key_prefix: unique_prefix("any"),
        ..StoreOptions::default()
    };
    let store = AnyStore::open(Some(redis.url()), opts).await.expect("open");
    assert_eq!(store.backend_name(), "redis");
    suite(&store).await;
}

#[tokio::test]
async fn history_of_a_long_chain_is_exactly_one_round_trip() {
    let redis = TestRedis::start();
    let store = store(&redis, "one_trip").await;
    let chain = put_chain(&store, "t", "resp", 300, 100).await;
    for last in [0usize, 1, 150, 299] {
        let before = store.round_trips();
        let history = store
            .history("t", &chain[last].id)
            .await
            .expect("history")
            .expect("chain stored");
        assert_eq!(store.round_trips() - before, 1);
        assert_eq!(history.items.len(), 2 * (last + 1));
    }
}

/// A predecessor evicted (or lost in a restart) under a response that continues it is an error,
/// not a history silently cut short; a deleted one is where the history starts.
#[tokio::test]
async fn a_lost_predecessor_is_an_error_a_deleted_one_a_cut() {
    let redis = TestRedis::start();
    let store = store(&redis, "lost").await;
    let chain = put_chain(&store, "t", "resp", 4, 10).await;
    assert!(redis.delete(&store.response_key(&chain[1].id)), "evicted");
    match store.history("t", &chain[3].id).await {
        Err(StoreError::Lost { id, missing }) => {
            assert_eq!((id.as_str(), missing.as_str()), ("resp_3", "resp_1"));
        }
        other => panic!("a lost predecessor must be reported: {other:?}"),
    }
    // Deleted through the API instead (written long ago: 10 s left): the history starts after
    // it.
    let mut conn = raw(&redis).await;
    expire_in_10s(&mut conn, &store.response_key(&chain[2].id)).await;
    assert!(store.delete("t", &chain[2].id).await.expect("delete"));
    // The marker lives the store's whole TTL, not what the deleted response had left: the
    // responses continuing it may live that long.
    let marker = format!(
        "{}deleted:resp_2",
        store.response_key("").trim_end_matches("resp:")
    );
    let ttl = pttl(&mut conn, &marker).await;
    assert!(ttl > 10_000 && ttl <= TEST_TTL.as_millis() as i64, "{ttl}");
    let history = store.history("t", &chain[3].id).await.expect("history");
    let history = history.expect("the newest is stored");
    assert_eq!(history.root_id, "resp_3");
    assert_eq!(history.items, items_of(&[&chain[3]]));
    // ...and as long as the chain that continues it: a walk refreshes it.
    expire_in_10s(&mut conn, &marker).await;
    store.history("t", &chain[3].id).await.expect("history");
    assert!(pttl(&mut conn, &marker).await > 10_000);
}

#[tokio::test]
async fn every_key_gets_the_ttl_and_history_refreshes_it() {
    let redis = TestRedis::start();
    let store = connect(
        &redis,
        StoreOptions {
            ttl: TEST_TTL,
            ended_log_ttl: Duration::from_secs(60),
            key_prefix: unique_prefix("ttl"),
            ..StoreOptions::default()
        },
    )
    .await;
    let mut conn = raw(&redis).await;
    let chain = put_chain(&store, "t", "resp", 3, 10).await;
    for rec in &chain {
        let left = pttl(&mut conn, &store.response_key(&rec.id)).await;
        assert!(left > 0 && left <= 3_600_000, "PTTL {left}");
    }

    // A history walk refreshes every response it reads, but not an ended response's event
    // log, which is kept only while a client may resume its stream.
    let root_key = store.response_key(&chain[0].id);
    let root_log = store.events_key(&chain[0].id);
    store
        .append_events(&chain[0].id, &["event: a\n\n".to_string()])
        .await
        .expect("append");
    let left = pttl(&mut conn, &root_log).await;
    assert!(
        left > 10_000 && left <= 60_000,
        "an ended response's log: {left}"
    );
    expire_in_10s(&mut conn, &root_key).await;
    expire_in_10s(&mut conn, &root_log).await;
    store.history("t", &chain[2].id).await.expect("history");
    assert!(pttl(&mut conn, &root_key).await > 10_000);
    assert!(pttl(&mut conn, &root_log).await <= 10_000);
    // A key set again within the last 64th of the TTL is left as it is (no write per turn);
    // one set longer ago is set again.
    let ttl = TEST_TTL.as_millis() as i64;
    for (age, refreshed) in [(10_000, false), (ttl / 64 + 10_000, true)] {
        let _: () = redis::cmd("PEXPIRE")
            .arg(&root_key)
            .arg(ttl - age)
            .query_async(&mut conn)
            .await
            .expect("PEXPIRE");
        store.history("t", &chain[2].id).await.expect("history");
        let left = pttl(&mut conn, &root_key).await;
        assert_eq!(
            left > ttl - 5_000,
            refreshed,
            "set {age} ms ago: PTTL {left}"
        );
    }

    expire_in_10s(&mut conn, &store.response_key(&chain[2].id)).await;
    let mut running = chain[2].response.clone();
    running["status"] = "in_progress".into();
    store
        .put(&ResponseRecord {
            response: running.clone(),
            ..chain[2].clone()
        })
        .await
        .expect("put");
    assert!(pttl(&mut conn, &store.response_key(&chain[2].id)).await > 10_000);

    // A running response and its event log live as long as each other: appending events
    // refreshes both; finishing it leaves the log the ended-log TTL.
    let (resp_key, log_key) = (
        store.response_key(&chain[2].id),
        store.events_key(&chain[2].id),
    );
    store
        .append_events(&chain[2].id, &["event: a\n\n".to_string()])
        .await
        .expect("append");
    expire_in_10s(&mut conn, &resp_key).await;
    expire_in_10s(&mut conn, &log_key).await;
    store
        .append_events(&chain[2].id, &["event: b\n\n".to_string()])
        .await
        .expect("append");
    assert!(pttl(&mut conn, &resp_key).await > 3_000_000);
    assert!(pttl(&mut conn, &log_key).await > 3_000_000);
    let mut done = running;
    done["status"] = "completed".into();
    assert!(store
        .update_if_active("t", &chain[2].id, &done, &chain[2].output_items)
        .await
        .expect("update"));
    let left = pttl(&mut conn, &log_key).await;
    assert!(left > 10_000 && left <= 60_000, "{left}");
    assert!(pttl(&mut conn, &resp_key).await > 3_000_000);
}

#[tokio::test]
async fn expired_responses_disappear_and_cut_the_chain() {
    let redis = TestRedis::start();
    let short = store_with_ttl(&redis, "expiry", Duration::from_millis(100)).await;
    short
        .put(&record("t", "gone", None, 10))
        .await
        .expect("put");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(short.get("t", "gone").await.expect("get"), None);
    assert_eq!(short.history("t", "gone").await.expect("history"), None);
}

#[tokio::test]
async fn scripts_still_run_after_the_server_forgets_them() {
    let redis = TestRedis::start();
    let store = store(&redis, "noscript").await;
    let chain = put_chain(&store, "t", "resp", 3, 10).await;
    let mut conn = raw(&redis).await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("SCRIPT FLUSH");

    let before = store.round_trips();
    let history = store.history("t", &chain[2].id).await.expect("history");
    assert_eq!(history.map(|h| h.items.len()), Some(6));
    assert_eq!(store.round_trips() - before, 2, "EVALSHA, then EVAL");

    let before = store.round_trips();
    store.history("t", &chain[2].id).await.expect("history");
    assert_eq!(store.round_trips() - before, 1, "EVAL cached the script");

    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("SCRIPT FLUSH");
    assert!(store.delete("t", &chain[2].id).await.expect("delete"));
    let mut running = chain[1].clone();
    running.response["status"] = "queued".into();
    store.put(&running).await.expect("put");
    assert!(store
        .update_if_active(
            "t",
            &chain[1].id,
            &chain[1].response,
            &chain[1].output_items
        )
        .await
        .expect("update"));
}

#[tokio::test]
async fn unreachable_or_malformed_urls_are_reported() {
    let err = AnyStore::open(Some("not a url"), StoreOptions::default())
        .await
        .err()
        .expect("malformed URL must fail");
    assert!(matches!(err, StoreError::InvalidUrl(_)), "{err}");

    let (_closed, port) = closed_port();
    let err = RedisStore::connect(
        &format!("redis://127.0.0.1:{port}/0"),
        StoreOptions::default(),
    )
    .await
    .err()
    .expect("nothing listens there");
    assert!(matches!(err, StoreError::Backend(_)), "{err}");
    assert!(err.to_string().contains("Redis"), "{err}");
}

#[tokio::test]
async fn corrupt_records_are_reported_not_panicked_on() {
    let redis = TestRedis::start();
    let store = store(&redis, "corrupt").await;
    store.put(&record("t", "bad", None, 10)).await.expect("put");
    let mut conn = raw(&redis).await;
    let _: () = redis::cmd("HSET")
        .arg(store.response_key("bad"))
        .arg("input")
        .arg("{not json")
        .query_async(&mut conn)
        .await
        .expect("HSET");
    let err = store.get("t", "bad").await.expect_err("get must fail");
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    let err = store
        .history("t", "bad")
        .await
        .expect_err("history must fail");
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
}

/// Prints the Redis memory one 100-turn conversation takes (~2 KB of text per turn: 1 KB in,
/// 1 KB out). Informational; run with `--nocapture` to see the numbers.
#[tokio::test]
async fn memory_used_by_a_100_turn_conversation() {
    let redis = TestRedis::start();
    let store = store(&redis, "memory").await;
    let mut conn = raw(&redis).await;
    let used_memory = |info: String| -> i64 {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let before: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .expect("INFO");
    let chain = put_chain(&store, "t", "resp", 100, 1024).await;
    let after: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .expect("INFO");

    let mut key_bytes: i64 = 0;
    for rec in &chain {
        let usage: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(store.response_key(&rec.id))
            .arg("SAMPLES")
            .arg(0)
            .query_async(&mut conn)
            .await
            .expect("MEMORY USAGE");
        key_bytes += usage.expect("key exists");
    }
    let json_bytes: usize = chain
        .iter()
        .map(|r| serde_json::to_string(r).map(|s| s.len()).unwrap_or(0))
        .sum();
    let history = store
        .history("t", "resp_99")
        .await
        .expect("history")
        .expect("stored");
    assert_eq!(history.items.len(), 200);
    let history_bytes = serde_json::to_string(&history.items)
        .map(|s| s.len())
        .unwrap_or(0);
    println!(
        "100-turn conversation, ~2 KB text/turn: MEMORY USAGE sum = {key_bytes} bytes \
         ({} bytes/turn); used_memory delta = {} bytes; records as JSON = {json_bytes} bytes; \
         full history as JSON = {history_bytes} bytes",
        key_bytes / 100,
        used_memory(after) - used_memory(before),
    );
    assert!(key_bytes > 0);
}

#[tokio::test]
async fn reconnects_after_redis_restarts() {
    let mut redis = TestRedis::start_private();
    let store = store(&redis, "reconnect").await;
    store
        .put(&record("t", "before", None, 10))
        .await
        .expect("put");

    redis.stop();
    let err = store
        .get("t", "before")
        .await
        .expect_err("Redis is down, get must fail");
    assert!(matches!(err, StoreError::Backend(_)), "{err}");

    redis.restart();
    // The first request after the restart may still see the broken connection.
    let mut result = store.put(&record("t", "after", None, 10)).await;
    for _ in 0..20 {
        if result.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        result = store.put(&record("t", "after", None, 10)).await;
    }
    result.expect("put after restart");
    assert!(store.get("t", "after").await.expect("get").is_some());
    assert_eq!(
        store
            .history("t", "after")
            .await
            .expect("history")
            .map(|h| h.items.len()),
        Some(2),
        "scripts work again although the restarted server lost its script cache"
    );
}

#[tokio::test]
async fn pins_expire_after_their_own_ttl() {
    let redis = TestRedis::start();
    let pin_ttl = Duration::from_millis(100);
    let store = connect(
        &redis,
        StoreOptions {
            key_prefix: unique_prefix("pin_expiry"),
            pin_ttl,
            ..StoreOptions::default()
        },
    )
    .await;
    pin_expiry_suite(&store, pin_ttl).await;
}

#[tokio::test]
async fn pins_get_the_pin_ttl_and_swaps_reads_and_touches_refresh_it() {
    let redis = TestRedis::start();
    let store = connect(
        &redis,
        StoreOptions {
            key_prefix: unique_prefix("pin_ttl"),
            pin_ttl: Duration::from_secs(600),
            ..StoreOptions::default()
        },
    )
    .await;
    let mut conn = raw(&redis).await;
    let key = store.pin_key("pool", "s");

    store
        .swap_pin("pool", "s", None, &pin("e0", 0))
        .await
        .expect("swap");
    let left = pttl(&mut conn, &key).await;
    assert!(left > 10_000 && left <= 600_000, "PTTL {left}");

    let shorten = |ms: i64| redis::cmd("PEXPIRE").arg(&key).arg(ms).to_owned();
    let _: () = shorten(10_000)
        .query_async(&mut conn)
        .await
        .expect("PEXPIRE");
    let before = store.round_trips();
    store.touch_pin("pool", "s").await.expect("touch");
    assert_eq!(store.round_trips() - before, 1);
    assert!(
        pttl(&mut conn, &key).await > 10_000,
        "touch refreshes the TTL"
    );

    let _: () = shorten(10_000)
        .query_async(&mut conn)
        .await
        .expect("PEXPIRE");
    let before = store.round_trips();
    assert_eq!(
        store.get_pin("pool", "s").await.expect("get"),
        Some(pin("e0", 0))
    );
    assert_eq!(store.round_trips() - before, 1);
    assert!(
        pttl(&mut conn, &key).await > 10_000,
        "a read (one per turn) refreshes the TTL"
    );

    let _: () = shorten(10_000)
        .query_async(&mut conn)
        .await
        .expect("PEXPIRE");
    let lost = store
        .swap_pin("pool", "s", Some(&pin("other", 0)), &pin("e1", 1))
        .await
        .expect("swap");
    assert_eq!((lost.pin, lost.applied), (pin("e0", 0), false));
    assert!(
        pttl(&mut conn, &key).await > 10_000,
        "a lost swap still refreshes the TTL"
    );

    let _: () = shorten(10_000)
        .query_async(&mut conn)
        .await
        .expect("PEXPIRE");
    store
        .swap_pin("pool", "s", Some(&pin("e0", 0)), &pin("e1", 1))
        .await
        .expect("swap");
    assert!(
        pttl(&mut conn, &key).await > 10_000,
        "a winning swap sets the TTL"
    );

    store
        .touch_pin("pool", "never-pinned")
        .await
        .expect("touch");
    let exists: i64 = redis::cmd("EXISTS")
        .arg(store.pin_key("pool", "never-pinned"))
        .query_async(&mut conn)
        .await
        .expect("EXISTS");
    assert_eq!(exists, 0, "touching a missing pin creates nothing");
}

#[tokio::test]
async fn pin_keys_are_prefixed_bounded_and_hold_json() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("pin_keys");
    let store = connect(
        &redis,
        StoreOptions {
            key_prefix: prefix.clone(),
            ..StoreOptions::default()
        },
    )
    .await;
    let mut conn = raw(&redis).await;
    let long = "k:{x}*".repeat(10_000);
    store
        .swap_pin("pool", "abc-123", None, &pin("e0", 2))
        .await
        .expect("swap");
    store
        .swap_pin("pool", &long, None, &pin("e1", 0))
        .await
        .expect("swap");

    let plain = store.pin_key("pool", "abc-123");
    assert_eq!(plain, format!("{prefix}pin:pool:abc-123"));
    let stored: String = redis::cmd("GET")
        .arg(&plain)
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(stored, r#"{"endpoint":"e0","moves":2}"#);

    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}pin:*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    keys.sort();
    assert_eq!(keys.len(), 2, "{keys:?}");
    for key in &keys {
        let part = key
            .strip_prefix(&format!("{prefix}pin:pool:"))
            .expect("pin key shape");
        assert!(part.len() <= MAX_KEY_PART_LEN, "{key}");
        assert!(
            !part.contains(':') && !part.contains('{') && !part.contains('*'),
            "{key}"
        );
    }
}

#[tokio::test]
async fn unreadable_pins_are_reported_and_replaced_by_the_next_swap() {
    let redis = TestRedis::start();
    let store = store(&redis, "pin_corrupt").await;
    let mut conn = raw(&redis).await;
    // Not JSON, JSON without a pin's fields, and fields the gateway cannot read (a move count
    // that is negative, fractional or past u32, a URL that is not a string).
    for unreadable in [
        "{not json",
        r#"{"endpoint":"e9"}"#,
        r#"{"endpoint":"e9","moves":-1}"#,
        r#"{"endpoint":"e9","moves":1.5}"#,
        r#"{"endpoint":"e9","moves":4294967296}"#,
        r#"{"endpoint":"e9","moves":1,"url":7}"#,
    ] {
        let _: () = redis::cmd("SET")
            .arg(store.pin_key("pool", "s"))
            .arg(unreadable)
            .query_async(&mut conn)
            .await
            .expect("SET");
        let err = store
            .get_pin("pool", "s")
            .await
            .expect_err("get_pin must fail");
        assert!(matches!(err, StoreError::CorruptPin { .. }), "{err}");
        let set = store
            .swap_pin("pool", "s", None, &pin("e0", 0))
            .await
            .expect("swap over an unreadable pin");
        assert_eq!(
            (&set.pin, set.applied),
            (&pin("e0", 0), true),
            "{unreadable}"
        );
        assert_eq!(
            store.get_pin("pool", "s").await.expect("get"),
            Some(set.pin)
        );
    }
}

#[tokio::test]
async fn gateways_on_separate_connections_racing_to_move_a_session_agree_on_one_winner() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("pin_race");
    let opts = StoreOptions {
        key_prefix: prefix,
        ..StoreOptions::default()
    };
    let gateways = [
        connect(&redis, opts.clone()).await,
        connect(&redis, opts.clone()).await,
        connect(&redis, opts).await,
    ];
    for round in 0..20u32 {
        let session = format!("s{round}");
        let start = pin("e0", 0);
        gateways[0]
            .swap_pin("pool", &session, None, &start)
            .await
            .expect("swap");
        let candidates: Vec<SessionPin> = (1..=3).map(|i| pin(&format!("e{i}"), 1)).collect();
        let (a, b, c) = tokio::join!(
            gateways[0].swap_pin("pool", &session, Some(&start), &candidates[0]),
            gateways[1].swap_pin("pool", &session, Some(&start), &candidates[1]),
            gateways[2].swap_pin("pool", &session, Some(&start), &candidates[2]),
        );
        let (a, b, c) = (a.expect("swap"), b.expect("swap"), c.expect("swap"));
        assert_eq!(a.pin, b.pin);
        assert_eq!(b.pin, c.pin);
        assert!(candidates.contains(&a.pin), "winner {a:?}");
        let applied = [&a, &b, &c].iter().filter(|swap| swap.applied).count();
        assert_eq!(applied, 1, "exactly one swap applies");
        for gateway in &gateways {
            assert_eq!(
                gateway.get_pin("pool", &session).await.expect("get"),
                Some(a.pin.clone())
            );
        }
    }
}

#[tokio::test]
async fn pin_swaps_still_run_after_the_server_forgets_the_script() {
    let redis = TestRedis::start();
    let store = store(&redis, "pin_noscript").await;
    let mut conn = raw(&redis).await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("SCRIPT FLUSH");
    let set = store
        .swap_pin("pool", "s", None, &pin("e0", 0))
        .await
        .expect("swap");
    assert_eq!((set.pin, set.applied), (pin("e0", 0), true));
}

#[tokio::test]
async fn two_gateways_on_one_redis_share_one_rate_budget() {
    let redis = TestRedis::start();
    let opts = StoreOptions {
        key_prefix: unique_prefix("rate_shared"),
        ..StoreOptions::default()
    };
    let a = connect(&redis, opts.clone()).await;
    let b = connect(&redis, opts).await;
    let limit = agentgate_sessions::RateLimit {
        key: "team:acme:requests".into(),
        limit: 4,
        period: Duration::from_secs(3600),
        cost: 1,
    };
    let mut allowed = 0;
    for i in 0..8 {
        let store = if i % 2 == 0 { &a } else { &b };
        let d = store
            .rate_limit(std::slice::from_ref(&limit))
            .await
            .unwrap();
        if d[0].allowed() {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 4, "the budget is shared, not per gateway");
}

/// A TCP proxy to `upstream` whose connections can be silenced all at once: a silenced
/// connection stays open and swallows what either side sends, as one does whose peer vanished
/// without a reset (a failover to a new address, a NAT that dropped its state). Connections
/// opened later are forwarded again.
struct SilencingProxy {
    port: u16,
    generation: Arc<AtomicU64>,
    /// Connections opened from now on are silent from the start.
    silence_new: Arc<std::sync::atomic::AtomicBool>,
}

impl SilencingProxy {
    async fn start(upstream: SocketAddr) -> SilencingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let generation = Arc::new(AtomicU64::new(0));
        let silence_new = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let current = generation.clone();
        let silent = silence_new.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let born = match silent.load(Ordering::SeqCst) {
                    true => u64::MAX,
                    false => current.load(Ordering::SeqCst),
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pump(client_read, server_write, born, current.clone()));
                tokio::spawn(pump(server_read, client_write, born, current.clone()));
            }
        });
        SilencingProxy {
            port,
            generation,
            silence_new,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Silence every connection open now.
    fn silence_open_connections(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Silence every connection open now and every one opened later.
    fn silence_everything(&self) {
        self.silence_new.store(true, Ordering::SeqCst);
        self.silence_open_connections();
    }
}

/// A test Redis, a [`SilencingProxy`] in front of it, and a store connected through the proxy
/// holding response `r1` of team `t`.
async fn store_through_a_proxy() -> (TestRedis, SilencingProxy, RedisStore) {
    let redis = TestRedis::start();
    let upstream: SocketAddr = redis
        .url()
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .and_then(|addr| addr.parse().ok())
        .expect("the test Redis URL names an IP address and port");
    let proxy = SilencingProxy::start(upstream).await;
    let opts = StoreOptions {
        ttl: TEST_TTL,
        key_prefix: unique_prefix("proxied"),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&proxy.url(), opts)
        .await
        .expect("connect through the proxy");
    store.put(&record("t", "r1", None, 10)).await.expect("put");
    (redis, proxy, store)
}

/// Copy `from` to `to` while the proxy's generation is still `born`; after that, read and drop.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    born: u64,
    generation: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if generation.load(Ordering::SeqCst) == born && to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn a_connection_whose_replies_stop_is_replaced() {
    let (_redis, proxy, store) = store_through_a_proxy().await;

    proxy.silence_open_connections();
    let store = Arc::new(store);
    // A second call, sent a moment later on the same silenced connection, times out after the
    // first one's timeout has replaced it: its failure is the old connection's, not the new one's.
    let later = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            store.get("t", "r1").await
        })
    };
    let err = store
        .get("t", "r1")
        .await
        .expect_err("no reply comes on the silenced connection");
    assert!(err.to_string().contains("timed out"), "{err}");
    let late = later.await.expect("task");
    assert!(
        late.as_ref()
            .is_err_and(|e| e.to_string().contains("timed out")),
        "{late:?}"
    );

    // The timeout opened a new connection in the background; the next calls use it.
    let mut found = None;
    for _ in 0..10 {
        if let Ok(rec) = store.get("t", "r1").await {
            found = rec;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(found.expect("served again on a new connection").id, "r1");
    assert_eq!(store.connections_replaced(), 1);
}

/// Redis out of reach for good (every connection, old and new, swallows what is sent): a call
/// sent while a replacement connection is being opened fails after waiting for it a while,
/// instead of waiting out all its connection attempts and then a reply timeout on the old
/// connection.
#[tokio::test]
async fn a_call_does_not_wait_out_a_replacement_that_cannot_be_opened() {
    let (_redis, proxy, store) = store_through_a_proxy().await;

    proxy.silence_everything();
    let err = store
        .get("t", "r1")
        .await
        .expect_err("no reply comes on the silenced connection");
    assert!(err.to_string().contains("timed out"), "{err}");
    // That timeout started opening a new connection, which cannot succeed.
    let err = store
        .get("t", "r1")
        .await
        .expect_err("no connection answers");
    assert!(
        err.to_string().contains("no connection to Redis"),
        "waited for the replacement, then timed out on the old connection: {err}"
    );
}

#[tokio::test]
async fn a_reconnect_refused_by_the_server_does_not_break_the_store_for_good() {
    let redis = TestRedis::start_private();
    let mut admin = raw(&redis).await;
    let set_password = |conn: &mut MultiplexedConnection, password: &'static str| {
        let mut conn = conn.clone();
        async move {
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("requirepass")
                .arg(password)
                .query_async::<()>(&mut conn)
                .await
                .expect("CONFIG SET requirepass");
        }
    };
    set_password(&mut admin, "first").await;
    let url = redis.url().replace("redis://", "redis://:first@");
    let opts = StoreOptions {
        key_prefix: unique_prefix("refused-reconnect"),
        ..StoreOptions::default()
    };
    let store = RedisStore::connect(&url, opts).await.expect("connect");
    store
        .put(&record("t", "before", None, 10))
        .await
        .expect("put");

    // The connection drops, and its reconnect is refused (the password changed meanwhile, as
    // during a credentials rotation; a full client table answers with an error likewise).
    set_password(&mut admin, "second").await;
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async::<()>(&mut admin)
        .await
        .expect("CLIENT KILL");
    for _ in 0..3 {
        assert!(store.get("t", "before").await.is_err());
    }
    // Once the server takes the credentials again, so does the store.
    set_password(&mut admin, "first").await;
    let mut result = store.get("t", "before").await;
    for _ in 0..100 {
        if result.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        result = store.get("t", "before").await;
    }
    assert!(result
        .expect("get after the server takes the credentials again")
        .is_some());
}

#[tokio::test]
async fn a_server_refusing_writes_keeps_its_connection() {
    let redis = TestRedis::start_private();
    let mut admin = raw(&redis).await;
    let store = store(&redis, "oom").await;
    store
        .put(&record("t", "before", None, 10))
        .await
        .expect("put");
    // Out of memory with nothing to evict: every write is refused, over a working connection.
    for (key, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(key)
            .arg(value)
            .query_async::<()>(&mut admin)
            .await
            .expect("CONFIG SET");
    }
    for i in 0..6 {
        let err = store
            .put(&record("t", &format!("r{i}"), None, 10))
            .await
            .expect_err("refused");
        assert!(err.to_string().contains("OOM"), "{err}");
    }
    assert_eq!(store.connections_replaced(), 0);
    // Reads still go through on it.
    assert!(store.get("t", "before").await.expect("get").is_some());
}
