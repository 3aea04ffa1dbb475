//! Test support shared by this crate's tests, the gateway's and the end-to-end tests: a
//! throwaway `redis-server` guard, unique key prefixes, sample records, and the behaviour suites
//! every [`Store`] backend must pass (responses and session pins).

use std::future::Future;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::pins::MAX_KEY_PART_LEN;
use crate::{PinSwap, ResponseRecord, SessionPin, Store};

/// Environment variable naming an existing Redis to test against instead of starting one.
pub const TEST_REDIS_URL_ENV: &str = "AGENTGATE_TEST_REDIS_URL";

/// A Redis for tests: the one named by `AGENTGATE_TEST_REDIS_URL`, or a private `redis-server`
/// on a free 127.0.0.1 port that is killed when this guard drops.
pub struct TestRedis {
    url: String,
    child: Option<Child>,
}

impl TestRedis {
    /// Use `AGENTGATE_TEST_REDIS_URL` if set, otherwise start `redis-server` from PATH.
    /// Panics with instructions if neither is available.
    pub fn start() -> TestRedis {
        if let Ok(url) = std::env::var(TEST_REDIS_URL_ENV) {
            if !url.is_empty() {
                return TestRedis { url, child: None };
            }
        }
        match Self::spawn_private() {
            Ok(redis) => redis,
            Err(reason) => panic!(
                "cannot start a Redis for tests: {reason}. Run `scripts/test.sh` (it provides one), \
                 set {TEST_REDIS_URL_ENV}=redis://127.0.0.1:6379/0, or install redis-server \
                 (e.g. `apt-get install redis-server`)."
            ),
        }
    }

    /// Always start a private `redis-server` (ignoring `AGENTGATE_TEST_REDIS_URL`), for tests
    /// that stop or restart the server. Panics with instructions if it cannot start.
    pub fn start_private() -> TestRedis {
        Self::spawn_private().unwrap_or_else(|reason| {
            panic!(
                "cannot start redis-server for tests: {reason}. Run `scripts/test.sh` or install \
                 redis-server (e.g. `apt-get install redis-server`)."
            )
        })
    }

    /// The URL to connect to (`redis://127.0.0.1:PORT/0`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Stop the private server (its data is lost); [`TestRedis::restart`] brings it back.
    /// Panics on a Redis from `AGENTGATE_TEST_REDIS_URL`, which is not ours to stop.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            panic!("only a private redis-server (TestRedis::start_private) can be stopped");
        };
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Make the private server refuse every write (`maxmemory` 1 byte, no eviction: Redis
    /// answers writes with an OOM error and still serves reads), or accept them again; its data
    /// stays. Panics on a Redis from `AGENTGATE_TEST_REDIS_URL`, which is not ours to change.
    pub fn refuse_writes(&self, refuse: bool) {
        assert!(
            self.child.is_some(),
            "only a running private redis-server (TestRedis::start_private) can refuse writes"
        );
        let addr = self.url.trim_start_matches("redis://");
        let addr = addr.split('/').next().unwrap_or(addr);
        let mut stream = TcpStream::connect(addr).expect("connect to the test redis-server");
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let command: &[u8] = if refuse {
            b"CONFIG SET maxmemory-policy noeviction maxmemory 1\r\n"
        } else {
            b"CONFIG SET maxmemory 0\r\n"
        };
        let mut reply = [0u8; 5];
        stream.write_all(command).expect("send CONFIG SET");
        stream.read_exact(&mut reply).expect("CONFIG SET answers");
        assert_eq!(&reply, b"+OK\r\n", "CONFIG SET refused");
    }

    /// Delete `key` (a key without spaces) from the database the URL names, as an eviction
    /// would; whether it existed.
    pub fn delete(&self, key: &str) -> bool {
        let rest = self.url.trim_start_matches("redis://");
        let (addr, db) = rest.split_once('/').unwrap_or((rest, "0"));
        let addr = addr.rsplit('@').next().unwrap_or(addr);
        let mut stream = TcpStream::connect(addr).expect("connect to the test redis-server");
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let db = if db.is_empty() { "0" } else { db };
        stream
            .write_all(format!("SELECT {db}\r\nDEL {key}\r\n").as_bytes())
            .expect("send DEL");
        // "+OK\r\n" then ":0\r\n" or ":1\r\n".
        let mut reply = [0u8; 9];
        stream.read_exact(&mut reply).expect("DEL answers");
        assert_eq!(&reply[..5], b"+OK\r\n", "SELECT refused");
        &reply[5..] == b":1\r\n"
    }

    /// Start the private server again on the same port, empty.
    pub fn restart(&mut self) {
        if self.child.is_some() {
            self.stop();
        }
        let port = self
            .url
            .rsplit(':')
            .next()
            .and_then(|tail| tail.split('/').next())
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or_else(|| panic!("no port in {}", self.url));
        let child =
            spawn_on(port).unwrap_or_else(|reason| panic!("cannot restart redis-server: {reason}"));
        self.child = Some(child);
    }

    /// Start a private `redis-server`; retries with another port if one is taken meanwhile.
    fn spawn_private() -> Result<TestRedis, String> {
        let mut last_error = String::new();
        for _ in 0..3 {
            let port = free_port().map_err(|e| format!("no free port: {e}"))?;
            match spawn_on(port) {
                Ok(child) => {
                    return Ok(TestRedis {
                        url: format!("redis://127.0.0.1:{port}/0"),
                        child: Some(child),
                    })
                }
                Err(reason) => last_error = reason,
            }
        }
        Err(last_error)
    }
}

/// Start `redis-server` on 127.0.0.1:`port` without persistence and wait until it answers PING.
fn spawn_on(port: u16) -> Result<Child, String> {
    let mut child = Command::new("redis-server")
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("redis-server is not runnable from PATH ({e})"))?;
    if wait_for_pong(port, Duration::from_secs(10)) {
        return Ok(child);
    }
    let _ = child.kill();
    let _ = child.wait();
    Err(format!("redis-server on port {port} did not answer PING"))
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port on 127.0.0.1 that refuses connections for as long as the returned socket lives: it is
/// bound but never listened on, so no other test's server can take it meanwhile.
pub fn closed_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind a port");
    let port = socket.local_addr().expect("its address").port();
    (socket, port)
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Poll `PING` until the server answers `+PONG` or `timeout` passes.
fn wait_for_pong(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
            let mut reply = [0u8; 7];
            if stream.write_all(b"PING\r\n").is_ok()
                && stream.read_exact(&mut reply).is_ok()
                && &reply == b"+PONG\r\n"
            {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A key prefix no other test uses, so tests can share one Redis.
pub fn unique_prefix(test_name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("test:{test_name}:{}:{nanos}:{n}:", std::process::id())
}

/// A completed response `id` continuing `prev`, with one user message in and one assistant
/// message out, each carrying `text_bytes` of text; the Response's `output` equals its output items.
pub fn record(team: &str, id: &str, prev: Option<&str>, text_bytes: usize) -> ResponseRecord {
    let text: String = "lorem ipsum dolor sit amet "
        .chars()
        .cycle()
        .take(text_bytes)
        .collect();
    let input_items = vec![json!({
        "id": format!("{id}_in"),
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    })];
    let output_items = vec![json!({
        "id": format!("{id}_out"),
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })];
    let response = json!({
        "id": id,
        "object": "response",
        "created_at": 1_700_000_000,
        "status": "completed",
        "model": "test-model",
        "previous_response_id": prev,
        "output": output_items,
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
    });
    ResponseRecord {
        id: id.to_string(),
        team: team.to_string(),
        previous_response_id: prev.map(str::to_string),
        input_items,
        output_items,
        response,
    }
}

/// The same record with its Response `status` set (and `output` emptied unless completed).
pub fn with_status(mut rec: ResponseRecord, status: &str) -> ResponseRecord {
    rec.response["status"] = json!(status);
    if status != "completed" {
        rec.response["output"] = json!([]);
        rec.output_items.clear();
    }
    rec
}

/// The items `history` must return for `records`, oldest first.
pub fn items_of(records: &[&ResponseRecord]) -> Vec<Value> {
    records
        .iter()
        .flat_map(|r| r.input_items.iter().chain(r.output_items.iter()).cloned())
        .collect()
}

/// Await `op` and check it cost the backend at most one round trip.
pub async fn at_most_one_round_trip<S: Store, T>(
    store: &S,
    what: &str,
    op: impl Future<Output = T>,
) -> T {
    let before = store.round_trips();
    let out = op.await;
    let spent = store.round_trips() - before;
    assert!(
        spent <= 1,
        "{what} took {spent} round trips, expected at most 1"
    );
    out
}

/// A pin to `endpoint` that has moved `moves` times.
pub fn pin(endpoint: &str, moves: u32) -> SessionPin {
    SessionPin {
        endpoint: endpoint.to_string(),
        moves,
        url: None,
    }
}

/// What a swap that wrote `pin` returns.
fn applied(pin: &SessionPin) -> PinSwap {
    PinSwap {
        pin: pin.clone(),
        applied: true,
    }
}

/// What a swap that found `pin` in force (and left it) returns.
fn kept(pin: &SessionPin) -> PinSwap {
    PinSwap {
        pin: pin.clone(),
        applied: false,
    }
}

/// The behaviour every backend must show, for responses ([`response_suite`]) and session pins
/// ([`pin_suite`]). Use a fresh store (or a fresh key prefix) per call.
pub async fn suite<S: Store>(store: &S) {
    response_suite(store).await;
    pin_suite(store).await;
    rate_suite(store).await;
    conversation_suite(store).await;
    exchange_suite(store).await;
    feed_suite(store).await;
}

/// A pool's feed: a first call reads what is kept; each gateway then reads every other
/// gateway's entries once, in order, never its own, at most `FEED_READ_MAX` a call, one round
/// trip per call; entries trimmed before a reader came back are counted; pools have separate
/// feeds.
pub async fn feed_suite<S: Store>(store: &S) {
    use crate::exchange::{FEED_LEN, FEED_READ_MAX};
    let feed = |pool: &'static str, gateway: &'static str, entries: Vec<String>, cursor| async move {
        at_most_one_round_trip(store, "feed", store.feed(pool, gateway, &entries, cursor))
            .await
            .expect("feed")
    };
    let strings = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let pair = |g: &str, e: &str| (g.to_string(), e.to_string());
    // g1 writes before g2 has ever read: g2's first read has it.
    let first = feed("feed-p", "g1", strings(&["a 1", "b"]), None).await;
    assert_eq!((first.entries.len(), first.skipped), (0, 0), "its own");
    let g2 = feed("feed-p", "g2", Vec::new(), None).await;
    assert_eq!(g2.entries, [pair("g1", "a 1"), pair("g1", "b")]);
    assert_eq!(g2.cursor, first.cursor);
    let g1 = feed("feed-p", "g1", strings(&["c", "d e"]), Some(first.cursor)).await;
    assert!(g1.entries.is_empty(), "its own entries are not read back");
    let _ = feed("feed-q", "g1", strings(&["other pool"]), None).await;
    let read = feed("feed-p", "g2", strings(&["x"]), Some(g2.cursor)).await;
    assert_eq!(read.entries, [pair("g1", "c"), pair("g1", "d e")]);
    assert_eq!((read.skipped, read.cursor), (0, g1.cursor + 1));
    // Nothing new: nothing read, the cursor stays.
    let again = feed("feed-p", "g2", Vec::new(), Some(read.cursor)).await;
    assert_eq!((again.entries.len(), again.cursor), (0, read.cursor));
    let g1 = feed("feed-p", "g1", Vec::new(), Some(g1.cursor)).await;
    assert_eq!(g1.entries, [pair("g2", "x")]);
    // g2 away while g1 writes more than the feed keeps: the oldest are skipped, and the rest
    // come FEED_READ_MAX at a time.
    let many: Vec<String> = (0..FEED_LEN + 5).map(|i| i.to_string()).collect();
    let _ = feed("feed-p", "g1", many, Some(g1.cursor)).await;
    let end = read.cursor + (FEED_LEN + 5) as u64;
    let mut cursor = read.cursor;
    let mut caught_up = Vec::new();
    let back = feed("feed-p", "g2", Vec::new(), Some(cursor)).await;
    assert_eq!((back.entries.len(), back.skipped), (FEED_READ_MAX, 5));
    assert_eq!(back.entries[0], pair("g1", "5"));
    caught_up.extend(back.entries);
    cursor = back.cursor;
    while cursor < end {
        let more = feed("feed-p", "g2", Vec::new(), Some(cursor)).await;
        assert!(more.entries.len() <= FEED_READ_MAX);
        assert_eq!(more.skipped, 0);
        assert!(more.cursor > cursor, "each read moves on");
        caught_up.extend(more.entries);
        cursor = more.cursor;
    }
    let expected: Vec<_> = (5..FEED_LEN + 5)
        .map(|i| pair("g1", &i.to_string()))
        .collect();
    assert_eq!(caught_up, expected);
    // A cursor from a feed that has since started again reads from the oldest kept.
    let ahead = feed("feed-p", "g2", Vec::new(), Some(cursor + 100)).await;
    assert_eq!(ahead.entries.len(), FEED_READ_MAX);
    assert_eq!(ahead.entries[0], pair("g1", "5"));
    assert_eq!(ahead.skipped, 0);
}

/// The exchange board: each gateway reads the others' fresh states, never its own, one round
/// trip per exchange; a state older than `fresh` is gone; pools have separate boards.
pub async fn exchange_suite<S: Store>(store: &S) {
    let fresh = Duration::from_secs(2);
    let exchange = |pool: &'static str, gateway: &'static str, state: &'static str| async move {
        at_most_one_round_trip(
            store,
            "exchange",
            store.exchange(pool, gateway, state, fresh),
        )
        .await
        .expect("exchange")
    };
    assert!(exchange("board-p", "g1", "one").await.is_empty());
    let seen = exchange("board-p", "g2", "two").await;
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].state, "one");
    assert!(seen[0].age < fresh);
    assert!(exchange("board-q", "g3", "{\"other\": \"pool\"}")
        .await
        .is_empty());
    // g1 publishes again: it sees g2's state, and g2 then sees g1's new one.
    assert_eq!(exchange("board-p", "g1", "one again").await[0].state, "two");
    let seen = exchange("board-p", "g2", "two again").await;
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].state, "one again");
    // A gateway that stops publishing drops off the board.
    tokio::time::sleep(fresh + Duration::from_millis(500)).await;
    assert!(exchange("board-p", "g2", "alone").await.is_empty());
    let seen = exchange("board-p", "g1", "back").await;
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].state, "alone");
}

/// Conversations: create with items, owner-only reads and writes, append in order, item
/// removal by id, metadata updates, delete; one round trip each. Use a fresh store (or a fresh
/// key prefix) per call.
pub async fn conversation_suite<S: Store>(store: &S) {
    use crate::ConversationRecord;
    macro_rules! one {
        ($what:expr, $op:expr) => {
            at_most_one_round_trip(store, $what, $op)
                .await
                .unwrap_or_else(|e| panic!("{} failed: {e}", $what))
        };
    }
    let item = |id: &str, text: &str| {
        json!({"id": id, "type": "message", "role": "user",
               "content": [{"type": "input_text", "text": text}]})
    };
    let conv = ConversationRecord {
        id: "conv_1".into(),
        team: "team-a".into(),
        created_at: 1_700_000_000,
        metadata: json!({"topic": "parsers"}),
    };
    assert_eq!(
        one!("get none", store.get_conversation("team-a", "conv_1")),
        None
    );
    assert_eq!(
        one!(
            "items of none",
            store.conversation_items("team-a", "conv_1")
        ),
        None
    );
    one!(
        "create",
        store.create_conversation(&conv, &[item("m1", "héllo \"x\"")])
    );
    assert_eq!(
        one!("get", store.get_conversation("team-a", "conv_1")),
        Some(conv.clone())
    );
    assert_eq!(
        one!("get other team", store.get_conversation("team-b", "conv_1")),
        None
    );
    let two = [item("m2", "b"), item("m3", "c")];
    assert!(one!(
        "append",
        store.append_conversation_items("team-a", "conv_1", "resp_1", &two)
    ));
    // The same response's items again (a retried write whose first try landed): nothing added.
    assert!(one!(
        "append again",
        store.append_conversation_items("team-a", "conv_1", "resp_1", &two)
    ));
    assert!(one!(
        "append nothing",
        store.append_conversation_items("team-a", "conv_1", "", &[])
    ));
    assert!(!one!(
        "append other team",
        store.append_conversation_items("team-b", "conv_1", "", &[item("x", "x")])
    ));
    assert_eq!(
        one!("len", store.conversation_len("team-a", "conv_1")),
        Some(3)
    );
    assert_eq!(
        one!("len other team", store.conversation_len("team-b", "conv_1")),
        None
    );
    assert_eq!(
        one!("len unknown", store.conversation_len("team-a", "conv_nope")),
        None
    );
    assert_eq!(
        one!("items", store.conversation_items("team-a", "conv_1")),
        Some(vec![
            item("m1", "héllo \"x\""),
            item("m2", "b"),
            item("m3", "c")
        ])
    );
    assert_eq!(
        one!(
            "items other team",
            store.conversation_items("team-b", "conv_1")
        ),
        None
    );
    assert_eq!(
        one!(
            "delete item",
            store.delete_conversation_item("team-a", "conv_1", "m2")
        ),
        Some(true)
    );
    assert_eq!(
        one!(
            "delete item again",
            store.delete_conversation_item("team-a", "conv_1", "m2")
        ),
        Some(false)
    );
    assert_eq!(
        one!(
            "delete item other team",
            store.delete_conversation_item("team-b", "conv_1", "m1")
        ),
        None
    );
    assert_eq!(
        one!(
            "items after delete",
            store.conversation_items("team-a", "conv_1")
        ),
        Some(vec![item("m1", "héllo \"x\""), item("m3", "c")])
    );
    let metadata = json!({"topic": "lexers", "owner": "ada"});
    let updated = one!(
        "metadata",
        store.set_conversation_metadata("team-a", "conv_1", &metadata)
    );
    assert_eq!(updated.as_ref().map(|c| &c.metadata), Some(&metadata));
    assert_eq!(updated.map(|c| c.created_at), Some(conv.created_at));
    assert_eq!(
        one!(
            "metadata other team",
            store.set_conversation_metadata("team-b", "conv_1", &metadata)
        ),
        None
    );
    assert!(!one!(
        "delete other team",
        store.delete_conversation("team-b", "conv_1")
    ));
    assert!(one!(
        "delete",
        store.delete_conversation("team-a", "conv_1")
    ));
    assert_eq!(
        one!("get deleted", store.get_conversation("team-a", "conv_1")),
        None
    );
    assert_eq!(
        one!(
            "items deleted",
            store.conversation_items("team-a", "conv_1")
        ),
        None
    );
    assert!(!one!(
        "delete again",
        store.delete_conversation("team-a", "conv_1")
    ));
    // Created empty; then more items than Lua's unpack returns at once.
    let empty = ConversationRecord {
        id: "conv_2".into(),
        ..conv
    };
    one!("create empty", store.create_conversation(&empty, &[]));
    assert_eq!(
        one!(
            "items of empty",
            store.conversation_items("team-a", "conv_2")
        ),
        Some(vec![])
    );
    let many: Vec<Value> = (0..9_000).map(|n| json!({"id": format!("i{n}")})).collect();
    assert!(one!(
        "append many",
        store.append_conversation_items("team-a", "conv_2", "", &many)
    ));
    assert_eq!(
        one!(
            "items of many",
            store.conversation_items("team-a", "conv_2")
        ),
        Some(many)
    );
    conversation_lock_suite(store).await;
    run_lease_suite(store).await;
}

/// Conversation locks: one owner at a time, re-entrant for that owner, per team, released
/// only by their owner, and free again once their TTL passes. One round trip each.
pub async fn conversation_lock_suite<S: Store>(store: &S) {
    let long = Duration::from_secs(60);
    let hold = |team: &'static str, owner: &'static str, ttl: Duration, renew_only: bool| async move {
        at_most_one_round_trip(
            store,
            "lock conversation",
            store.lock_conversation(team, "conv_l", owner, ttl, renew_only),
        )
        .await
        .expect("lock conversation")
    };
    let lock = |team, owner, ttl| hold(team, owner, ttl, false);
    let renew = |owner, ttl| hold("team-a", owner, ttl, true);
    let unlock = |owner: &'static str| async move {
        at_most_one_round_trip(
            store,
            "unlock conversation",
            store.unlock_conversation("team-a", "conv_l", owner),
        )
        .await
        .expect("unlock conversation")
    };
    assert!(!renew("resp_1", long).await, "a renewal takes no free lock");
    assert!(lock("team-a", "resp_1", long).await, "a free lock is taken");
    assert!(!lock("team-a", "resp_2", long).await, "held by another");
    assert!(!renew("resp_2", long).await, "held by another");
    assert!(
        lock("team-a", "resp_1", long).await,
        "its owner takes it again"
    );
    assert!(renew("resp_1", long).await, "its owner renews it");
    assert!(
        lock("team-b", "resp_2", long).await,
        "another team's conversation of that id is another lock"
    );
    unlock("resp_2").await;
    assert!(
        !lock("team-a", "resp_3", long).await,
        "only the owner releases it"
    );
    unlock("resp_1").await;
    assert!(!renew("resp_1", long).await, "released: not renewed");
    assert!(lock("team-a", "resp_3", long).await, "released");
    unlock("resp_3").await;
    // A holder that never releases (its process died) holds it for its TTL only.
    assert!(lock("team-a", "resp_4", Duration::from_millis(300)).await);
    assert!(!lock("team-a", "resp_5", long).await);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!renew("resp_4", long).await, "expired: not renewed");
    assert!(lock("team-a", "resp_5", long).await, "expired");
    unlock("resp_5").await;
}

/// Background runs' leases: held until given up or expired, renewed by holding again, told
/// apart from runs no lease was ever taken for, one round trip each.
pub async fn run_lease_suite<S: Store>(store: &S) {
    let held = |id: &'static str| async move {
        at_most_one_round_trip(store, "run held", store.run_held(id))
            .await
            .expect("run held")
    };
    let hold = |id: &'static str, ttl: Duration| async move {
        at_most_one_round_trip(store, "hold run", store.hold_run(id, ttl))
            .await
            .expect("hold run")
    };
    assert_eq!(held("resp_r1").await, None, "never held");
    hold("resp_r1", Duration::from_secs(60)).await;
    assert_eq!(held("resp_r1").await, Some(true));
    assert_eq!(held("resp_r2").await, None, "one lease per run");
    at_most_one_round_trip(store, "end run", store.end_run("resp_r1"))
        .await
        .expect("end run");
    assert_eq!(held("resp_r1").await, Some(false), "given up");
    // A run whose gateway died holds its lease for its TTL only; holding again renews it.
    hold("resp_r2", Duration::from_millis(300)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    hold("resp_r2", Duration::from_millis(300)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(held("resp_r2").await, Some(true), "renewed");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(held("resp_r2").await, Some(false), "lapsed");
}

/// Rate limits: a budget spent to the last unit, refusals with `retry_after`, all-or-nothing
/// checks of several limits, oversized costs, one round trip each. Use a fresh store (or a fresh
/// key prefix) per call. Time moves during the run, so the figures allow a little refill.
pub async fn rate_suite<S: Store>(store: &S) {
    use crate::rate::RateLimit;
    // A period long enough that the refill during the test is well under one unit.
    let hour = Duration::from_secs(3600);
    let rpm = |cost| RateLimit {
        key: "team:a:requests".into(),
        limit: 3,
        period: hour,
        cost,
    };
    let tpm = |cost| RateLimit {
        key: "team:a:tokens".into(),
        limit: 1000,
        period: hour,
        cost,
    };
    macro_rules! check {
        ($limits:expr) => {
            at_most_one_round_trip(store, "rate_limit", store.rate_limit(&$limits))
                .await
                .unwrap_or_else(|e| panic!("rate_limit failed: {e}"))
        };
    }
    let d = check!([rpm(1), tpm(600)]);
    assert!(d.iter().all(|d| d.allowed()), "{d:?}");
    assert_eq!((d[0].remaining, d[1].remaining), (2, 400));
    assert!(d[1].reset_after > Duration::from_secs(2000), "{d:?}");
    // Tokens refuse: nothing is charged, not even the request.
    let d = check!([rpm(1), tpm(600)]);
    assert!(d[0].allowed() && !d[1].allowed(), "{d:?}");
    // The limit that would have let it through reports its figures as they are: 2 requests
    // left, not 1 as if this one had been charged.
    assert_eq!((d[0].remaining, d[1].remaining), (2, 400), "{d:?}");
    assert!(
        d[0].reset_after <= Duration::from_secs(1200)
            && d[0].reset_after > Duration::from_secs(1190),
        "{d:?}"
    );
    let retry = d[1].retry_after.expect("a refusal says when to retry");
    assert!(
        retry > Duration::from_secs(700) && retry <= Duration::from_secs(721),
        "{retry:?}"
    );
    let d = check!([rpm(1), tpm(100)]);
    assert!(d.iter().all(|d| d.allowed()), "{d:?}");
    assert_eq!((d[0].remaining, d[1].remaining), (1, 300));
    let d = check!([rpm(1)]);
    assert_eq!(d[0].remaining, 0);
    let d = check!([rpm(1)]);
    assert!(!d[0].allowed() && !d[0].too_large, "{d:?}");
    // More than the whole budget can never fit.
    let d = check!([tpm(1001)]);
    assert!(d[0].too_large && !d[0].allowed(), "{d:?}");
    // Other keys are independent.
    let d = check!([RateLimit {
        key: "team:b:requests".into(),
        ..rpm(1)
    }]);
    assert!(d[0].allowed());
    assert!(check!([]).is_empty());

    // A whole budget in a burst, its interval inexact (a minute over 9, 13, 70): every unit fits
    // however its times round, and one more does not.
    for limit in [9, 13, 70] {
        let unit = [RateLimit {
            key: format!("team:burst{limit}:requests"),
            limit,
            period: Duration::from_secs(60),
            cost: 1,
        }];
        for i in 0..limit {
            let d = check!(unit);
            assert!(d[0].allowed(), "{limit}: unit {i}: {d:?}");
        }
        assert!(!check!(unit)[0].allowed(), "{limit}: one past the budget");
    }

    // Usage found out after admission is charged whatever the budget, into debt.
    let used = |cost| RateLimit {
        key: "team:c:tokens".into(),
        ..tpm(cost)
    };
    let d = check!([used(900)]);
    assert_eq!(d[0].remaining, 100);
    at_most_one_round_trip(store, "rate_charge", store.rate_charge(&[used(500)]))
        .await
        .unwrap_or_else(|e| panic!("rate_charge failed: {e}"));
    let d = check!([used(1)]);
    assert!(!d[0].allowed() && !d[0].too_large, "{d:?}");
    assert_eq!(d[0].remaining, 0);
    // 401 tokens' worth of the hour until one more fits.
    let retry = d[0].retry_after.expect("refused");
    assert!(
        retry > Duration::from_secs(1440) && retry <= Duration::from_millis(1_443_600),
        "{retry:?}"
    );

    // A request refused after it was charged gets its units back, but a budget never grows
    // past full.
    let back = |cost| RateLimit {
        key: "team:d:requests".into(),
        ..rpm(cost)
    };
    for _ in 0..3 {
        assert!(check!([back(1)])[0].allowed());
    }
    assert!(!check!([back(1)])[0].allowed(), "spent");
    at_most_one_round_trip(store, "rate_refund", store.rate_refund(&[back(1)]))
        .await
        .unwrap_or_else(|e| panic!("rate_refund failed: {e}"));
    let d = check!([back(1)]);
    assert!(d[0].allowed(), "the unit given back is spent again: {d:?}");
    store.rate_refund(&[back(3), back(5)]).await.unwrap();
    for i in 0..3 {
        assert!(check!([back(1)])[0].allowed(), "unit {i} of a full budget");
    }
    assert!(
        !check!([back(1)])[0].allowed(),
        "no more than a full budget"
    );
}

/// Session pins: get, compare-and-set swaps, a race of two swaps, touch, and session keys that
/// are long or contain key separators, glob and hash-tag characters, or arbitrary bytes. Every
/// operation costs at most one round trip. Use a fresh store (or a fresh key prefix) per call.
pub async fn pin_suite<S: Store>(store: &S) {
    macro_rules! one {
        ($what:expr, $op:expr) => {
            at_most_one_round_trip(store, $what, $op)
                .await
                .unwrap_or_else(|e| panic!("{} failed: {e}", $what))
        };
    }
    let pool = "pool-a";

    // No pin yet; the first swap from None applies.
    assert_eq!(one!("get_pin unknown", store.get_pin(pool, "s1")), None);
    one!("touch_pin unknown", store.touch_pin(pool, "s1"));
    assert_eq!(one!("get_pin after touch", store.get_pin(pool, "s1")), None);
    let first = pin("e0", 0);
    assert_eq!(
        one!("swap_pin new", store.swap_pin(pool, "s1", None, &first)),
        applied(&first)
    );
    assert_eq!(
        one!("get_pin", store.get_pin(pool, "s1")),
        Some(first.clone())
    );

    // A stale expectation loses and reports the pin in force, unchanged.
    let stale = pin("e9", 0);
    assert_eq!(
        one!(
            "swap_pin stale",
            store.swap_pin(pool, "s1", Some(&stale), &pin("e5", 1))
        ),
        kept(&first)
    );
    assert_eq!(
        one!(
            "swap_pin from None over a pin",
            store.swap_pin(pool, "s1", None, &pin("e5", 1))
        ),
        kept(&first)
    );
    let same_endpoint_other_moves = pin("e0", 7);
    assert_eq!(
        one!(
            "swap_pin with wrong moves",
            store.swap_pin(pool, "s1", Some(&same_endpoint_other_moves), &pin("e5", 8))
        ),
        kept(&first)
    );
    assert_eq!(
        one!("get_pin", store.get_pin(pool, "s1")),
        Some(first.clone())
    );

    // The right expectation moves the pin.
    let moved = pin("e1", 1);
    assert_eq!(
        one!(
            "swap_pin move",
            store.swap_pin(pool, "s1", Some(&first), &moved)
        ),
        applied(&moved)
    );
    assert_eq!(
        one!("get_pin", store.get_pin(pool, "s1")),
        Some(moved.clone())
    );
    one!("touch_pin", store.touch_pin(pool, "s1"));
    assert_eq!(
        one!("get_pin after touch", store.get_pin(pool, "s1")),
        Some(moved.clone())
    );

    // Pins are per pool and per session.
    assert_eq!(
        one!("get_pin other pool", store.get_pin("pool-b", "s1")),
        None
    );
    assert_eq!(
        one!("get_pin other session", store.get_pin(pool, "s2")),
        None
    );

    // Two gateways move the same session at once: exactly one wins, both see the winner.
    let to_e2 = pin("e2", 2);
    let to_e3 = pin("e3", 2);
    let (left, right) = tokio::join!(
        store.swap_pin(pool, "s1", Some(&moved), &to_e2),
        store.swap_pin(pool, "s1", Some(&moved), &to_e3),
    );
    let left = left.unwrap_or_else(|e| panic!("racing swap_pin failed: {e}"));
    let right = right.unwrap_or_else(|e| panic!("racing swap_pin failed: {e}"));
    assert_eq!(left.pin, right.pin, "both racers must see the same winner");
    assert!(left.pin == to_e2 || left.pin == to_e3, "winner {left:?}");
    assert!(
        left.applied != right.applied,
        "exactly one applies: {left:?} {right:?}"
    );
    assert_eq!(
        one!("get_pin after race", store.get_pin(pool, "s1")),
        Some(left.pin.clone())
    );
    // Two turns of one session making the same move at once: one move, not two.
    let to_e4 = pin("e4", 3);
    let (left, right) = tokio::join!(
        store.swap_pin(pool, "s1", Some(&left.pin), &to_e4),
        store.swap_pin(pool, "s1", Some(&left.pin), &to_e4),
    );
    let left = left.unwrap_or_else(|e| panic!("racing swap_pin failed: {e}"));
    let right = right.unwrap_or_else(|e| panic!("racing swap_pin failed: {e}"));
    assert_eq!((&left.pin, &right.pin), (&to_e4, &to_e4));
    assert!(
        left.applied != right.applied,
        "exactly one applies: {left:?} {right:?}"
    );
    // The same for the very first pin of a session.
    let (left, right) = tokio::join!(
        store.swap_pin(pool, "fresh", None, &to_e2),
        store.swap_pin(pool, "fresh", None, &to_e3),
    );
    let left = left.unwrap_or_else(|e| panic!("racing swap_pin failed: {e}"));
    let right = right.unwrap_or_else(|e| panic!("racing swap_pin failed: {e}"));
    assert_eq!(left.pin, right.pin, "both racers must see the same winner");
    assert!(
        left.applied != right.applied,
        "exactly one applies: {left:?} {right:?}"
    );
    assert_eq!(
        one!("get_pin after race", store.get_pin(pool, "fresh")),
        Some(left.pin)
    );

    // Session keys that could break a naive key scheme stay distinct and round-trip.
    let long = "x".repeat(10 * MAX_KEY_PART_LEN);
    let mut long_other_tail = long.clone();
    long_other_tail.push('y');
    let odd_sessions: Vec<(&str, String)> = vec![
        ("a", "b:c".to_string()),
        ("a:b", "c".to_string()),
        ("a", "b%3Ac".to_string()),
        ("a", String::new()),
        ("a", "*".to_string()),
        ("a", "{tag}?[x]".to_string()),
        ("a", "with space\n\r\0 and \u{1F600}".to_string()),
        ("a", "line\nbreak\0nul\u{7f}\u{ff}".to_string()),
        ("a", "ümlaut-キー".to_string()),
        ("a", long.clone()),
        ("a", long_other_tail),
        ("a", format!("{long}#deadbeef")),
        (long.as_str(), "s".to_string()),
    ];
    for (i, (pool, session)) in odd_sessions.iter().enumerate() {
        let endpoint = format!("odd-{i}");
        let set = one!(
            "swap_pin odd key",
            store.swap_pin(pool, session, None, &pin(&endpoint, 0))
        );
        assert_eq!(
            set,
            applied(&pin(&endpoint, 0)),
            "pool {pool:?} session {session:?} collided"
        );
    }
    for (i, (pool, session)) in odd_sessions.iter().enumerate() {
        let got = one!("get_pin odd key", store.get_pin(pool, session));
        assert_eq!(
            got,
            Some(pin(&format!("odd-{i}"), 0)),
            "pool {pool:?} session {session:?}"
        );
        one!("touch_pin odd key", store.touch_pin(pool, session));
    }
}

/// Pins expire after the store's `pin_ttl`, and a swap expecting a pin that has since expired
/// applies (no pin is in force). `store` must be fresh and built with `pin_ttl` set to `pin_ttl`,
/// which should be short (tens of milliseconds): this waits several times `pin_ttl`.
pub async fn pin_expiry_suite<S: Store>(store: &S, pin_ttl: Duration) {
    let first = pin("e0", 0);
    let set = store
        .swap_pin("p", "s", None, &first)
        .await
        .unwrap_or_else(|e| panic!("swap_pin failed: {e}"));
    assert_eq!(set, applied(&first));
    tokio::time::sleep(pin_ttl * 4).await;
    assert_eq!(
        store
            .get_pin("p", "s")
            .await
            .unwrap_or_else(|e| panic!("get_pin failed: {e}")),
        None,
        "a pin must expire after pin_ttl"
    );
    let moved = pin("e1", 1);
    let swapped_at = std::time::Instant::now();
    assert_eq!(
        store
            .swap_pin("p", "s", Some(&first), &moved)
            .await
            .unwrap_or_else(|e| panic!("swap_pin failed: {e}")),
        applied(&moved),
        "with no pin in force the swap applies"
    );
    let read = store
        .get_pin("p", "s")
        .await
        .unwrap_or_else(|e| panic!("get_pin failed: {e}"));
    // The new pin has the same short TTL: read back in time, it must be the one swapped in.
    if swapped_at.elapsed() < pin_ttl {
        assert_eq!(read, Some(moved));
    } else {
        assert!(read.is_none() || read == Some(moved), "{read:?}");
    }
}

/// Stored responses: put/get/status, chains, forks, overwrite, team isolation, update_if_active,
/// delete, long histories. Use a fresh store (or a fresh key prefix) per call.
pub async fn response_suite<S: Store>(store: &S) {
    let a = "team-a";
    let b = "team-b";
    macro_rules! one {
        ($what:expr, $op:expr) => {
            at_most_one_round_trip(store, $what, $op)
                .await
                .unwrap_or_else(|e| panic!("{} failed: {e}", $what))
        };
    }

    // put / get, byte-exact Response (key order included), team isolation.
    let r1 = record(a, "resp_1", None, 40);
    one!("put", store.put(&r1));
    let got = one!("get", store.get(a, "resp_1")).expect("resp_1 stored");
    assert_eq!(got, r1);
    assert_eq!(got.response.to_string(), r1.response.to_string());
    assert_eq!(one!("get other team", store.get(b, "resp_1")), None);
    assert_eq!(one!("get unknown", store.get(a, "resp_nope")), None);

    // A linear chain.
    let r2 = record(a, "resp_2", Some("resp_1"), 40);
    let r3 = record(a, "resp_3", Some("resp_2"), 40);
    one!("put", store.put(&r2));
    one!("put", store.put(&r3));
    assert_eq!(
        one!("history", store.history(a, "resp_3")).map(|h| h.items),
        Some(items_of(&[&r1, &r2, &r3]))
    );
    assert_eq!(
        one!("history root", store.history(a, "resp_1")).map(|h| h.items),
        Some(items_of(&[&r1]))
    );
    assert_eq!(
        one!("history root id", store.history(a, "resp_3")).map(|h| h.root_id),
        Some("resp_1".to_string()),
        "the chain's root names the conversation"
    );
    // The status is the newest response's, whatever its predecessors'.
    let mut running = record(a, "resp_running", Some("resp_3"), 40);
    running.response["status"] = json!("in_progress");
    one!("put", store.put(&running));
    assert_eq!(
        one!("history status", store.history(a, "resp_running")).map(|h| h.status),
        Some("in_progress".to_string())
    );
    assert_eq!(
        one!("history status", store.history(a, "resp_3")).map(|h| h.status),
        Some("completed".to_string())
    );
    assert_eq!(
        one!("history other team", store.history(b, "resp_3")).map(|h| h.items),
        None
    );
    assert_eq!(
        one!("history unknown", store.history(a, "resp_nope")).map(|h| h.items),
        None
    );

    // A fork: two responses continuing resp_1 each see their own branch.
    let r2_fork = record(a, "resp_2_fork", Some("resp_1"), 40);
    one!("put", store.put(&r2_fork));
    assert_eq!(
        one!("history fork", store.history(a, "resp_2_fork")).map(|h| h.items),
        Some(items_of(&[&r1, &r2_fork]))
    );
    assert_eq!(
        one!("history fork root", store.history(a, "resp_2_fork")).map(|h| h.root_id),
        Some("resp_1".to_string()),
        "forks share their root"
    );
    assert_eq!(
        one!("history", store.history(a, "resp_3")).map(|h| h.items),
        Some(items_of(&[&r1, &r2, &r3]))
    );

    // Overwrite replaces the record.
    let mut r3_new = record(a, "resp_3", Some("resp_2"), 40);
    r3_new.output_items = vec![
        json!({"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"}),
    ];
    r3_new.response["output"] = Value::Array(r3_new.output_items.clone());
    one!("put overwrite", store.put(&r3_new));
    assert_eq!(one!("get", store.get(a, "resp_3")), Some(r3_new.clone()));
    assert_eq!(
        one!("history", store.history(a, "resp_3")).map(|h| h.items),
        Some(items_of(&[&r1, &r2, &r3_new]))
    );

    // A record whose Response output differs from its output items round-trips unchanged.
    let mut odd = record(a, "resp_odd", None, 10);
    odd.response["output"] = json!([{"id": "something_else"}]);
    one!("put", store.put(&odd));
    assert_eq!(one!("get", store.get(a, "resp_odd")), Some(odd.clone()));
    let mut empty = record(a, "resp_empty", None, 0);
    empty.input_items.clear();
    empty.output_items.clear();
    empty.response["output"] = json!([]);
    one!("put", store.put(&empty));
    assert_eq!(one!("get", store.get(a, "resp_empty")), Some(empty.clone()));
    assert_eq!(
        one!("history", store.history(a, "resp_empty")).map(|h| h.items),
        Some(Vec::new())
    );

    // Another team continuing team A's response sees only its own items.
    let foreign = record(b, "resp_b", Some("resp_1"), 40);
    one!("put", store.put(&foreign));
    assert_eq!(
        one!("history foreign chain", store.history(b, "resp_b")).map(|h| h.items),
        Some(items_of(&[&foreign]))
    );

    // update_if_active: applies while queued / in_progress, then never again.
    let running = with_status(record(a, "resp_bg", Some("resp_3"), 40), "queued");
    one!("put", store.put(&running));
    let status = |team| store.status(team, "resp_bg");
    assert_eq!(one!("status", status(a)).as_deref(), Some("queued"));
    assert_eq!(one!("status other team", status(b)), None);
    assert_eq!(one!("status unknown", store.status(a, "resp_nope")), None);
    assert!(
        one!("append while queued", store.append_events("resp_bg", &[])),
        "a queued response runs on"
    );
    let mut progress = running.response.clone();
    progress["status"] = json!("in_progress");
    assert!(one!(
        "update queued",
        store.update_if_active(a, "resp_bg", &progress, &[])
    ));
    let finished_items = record(a, "resp_bg", None, 40).output_items;
    let mut finished = progress.clone();
    finished["status"] = json!("completed");
    finished["output"] = Value::Array(finished_items.clone());
    assert!(!one!(
        "update other team",
        store.update_if_active(b, "resp_bg", &finished, &finished_items)
    ));
    assert!(!one!(
        "update unknown",
        store.update_if_active(a, "resp_nope", &finished, &finished_items)
    ));
    assert_eq!(one!("status", status(a)).as_deref(), Some("in_progress"));
    assert!(one!(
        "update in_progress",
        store.update_if_active(a, "resp_bg", &finished, &finished_items)
    ));
    assert_eq!(one!("status", status(a)).as_deref(), Some("completed"));
    let got = one!("get", store.get(a, "resp_bg")).expect("resp_bg stored");
    assert_eq!(got.response, finished);
    assert_eq!(got.response.to_string(), finished.to_string());
    assert_eq!(got.output_items, finished_items);
    assert_eq!(got.input_items, running.input_items);
    assert_eq!(got.previous_response_id.as_deref(), Some("resp_3"));
    let mut cancelled = finished.clone();
    cancelled["status"] = json!("cancelled");
    assert!(!one!(
        "update completed",
        store.update_if_active(a, "resp_bg", &cancelled, &[])
    ));
    assert_eq!(
        one!("get", store.get(a, "resp_bg")).map(|r| r.response),
        Some(finished.clone())
    );
    let mut bg_history = items_of(&[&r1, &r2, &r3_new]);
    bg_history.extend(running.input_items.iter().cloned());
    bg_history.extend(finished_items.iter().cloned());
    assert_eq!(
        one!("history after update", store.history(a, "resp_bg")).map(|h| h.items),
        Some(bg_history)
    );

    // Event logs: appended in order, read from a position, gone with their response.
    let frames = |range: std::ops::Range<usize>| -> Vec<String> {
        range
            .map(|n| format!("event: e\ndata: {{\"sequence_number\":{n}}}\n\n"))
            .collect()
    };
    assert_eq!(
        one!("events of none", store.events("resp_2", 0)),
        Vec::<String>::new()
    );
    // resp_2 has ended: appended, and the writer is told it no longer runs.
    assert!(!one!(
        "append events",
        store.append_events("resp_2", &frames(0..3))
    ));
    assert!(!one!(
        "append more events",
        store.append_events("resp_2", &frames(3..5))
    ));
    assert!(!one!("append nothing", store.append_events("resp_2", &[])));
    assert!(!one!(
        "append to none",
        store.append_events("resp_nope", &frames(0..1))
    ));
    assert_eq!(
        one!("events of none", store.events("resp_nope", 0)),
        Vec::<String>::new()
    );
    assert_eq!(one!("all events", store.events("resp_2", 0)), frames(0..5));
    assert_eq!(
        one!("events from 3", store.events("resp_2", 3)),
        frames(3..5)
    );
    assert_eq!(
        one!("events past the end", store.events("resp_2", 9)),
        Vec::<String>::new()
    );

    // delete: only by the owner; a deleted predecessor cuts the chain there.
    assert!(!one!("delete other team", store.delete(b, "resp_2")));
    assert!(one!("get", store.get(a, "resp_2")).is_some());
    assert!(one!("delete", store.delete(a, "resp_2")));
    assert_eq!(one!("get deleted", store.get(a, "resp_2")), None);
    assert!(!one!("delete again", store.delete(a, "resp_2")));
    assert_eq!(
        one!("events of deleted", store.events("resp_2", 0)),
        Vec::<String>::new()
    );
    assert_eq!(
        one!("history past deleted", store.history(a, "resp_3")).map(|h| h.items),
        Some(items_of(&[&r3_new]))
    );
    assert_eq!(
        one!("history past deleted root", store.history(a, "resp_3")).map(|h| h.root_id),
        Some("resp_3".to_string()),
        "a cut chain is rooted at its oldest surviving response"
    );
    assert_eq!(
        one!("history fork", store.history(a, "resp_2_fork")).map(|h| h.items),
        Some(items_of(&[&r1, &r2_fork]))
    );

    // A 100-turn conversation: full history, oldest first, in one round trip.
    let mut chain: Vec<ResponseRecord> = Vec::new();
    for turn in 0..100 {
        let prev = chain.last().map(|r| r.id.clone());
        let rec = record(a, &format!("resp_long_{turn}"), prev.as_deref(), 200);
        one!("put", store.put(&rec));
        chain.push(rec);
    }
    let all: Vec<&ResponseRecord> = chain.iter().collect();
    let history = one!("history of 100 turns", store.history(a, "resp_long_99"))
        .map(|h| h.items)
        .expect("resp_long_99 stored");
    assert_eq!(history.len(), 200);
    assert_eq!(history, items_of(&all));
    assert_eq!(history[0]["id"], "resp_long_0_in");
    assert_eq!(history[199]["id"], "resp_long_99_out");
    let halfway =
        one!("history of 50 turns", store.history(a, "resp_long_49")).expect("resp_long_49 stored");
    assert_eq!(halfway.items, items_of(&all[..50]));
    assert_eq!(halfway.root_id, "resp_long_0");
}
