//! `RedisStore`: the shared backend, so every gateway replica sees every stored response.
//!
//! Each response is one hash `{prefix}resp:{id}` with fields `team`, `prev` (predecessor id or
//! ""), `input` and `output` (JSON arrays of this turn's items), `response` (the Response
//! object), `status` (copied out of the Response for the scripts) and `shared` ("1" when the
//! Response's `output` equals the output items and is stored once, in `output`). Every write
//! sets the TTL. Reads that need several keys or a check-then-write run as Lua scripts, sent with
//! EVALSHA and falling back to EVAL when the server does not have the script cached.
//!
//! A history walk (`history.lua`) refreshes the TTL of every key it reads only once more than
//! a 64th of the TTL has passed since it was last set: an agent session's turns, seconds
//! apart, rewrite each key of its chain once, not once per turn (each PEXPIRE that changes a
//! TTL is a write the replicas and the AOF get), and a chain still lives at least 63/64 of the
//! TTL after its last use.
//!
//! Deleting a response leaves a marker `{prefix}deleted:{id}` for as long as the response would
//! have lived: the history walk of a response continuing it stops there (the deleted turn's
//! items are not used), while a predecessor missing without a marker was lost (evicted under
//! `maxmemory`, or gone with a restart of a Redis without persistence) and the walk answers
//! [`StoreError::Lost`] rather than a history silently cut short.
//!
//! A background response's event log is a list `{prefix}events:{id}` of SSE frames, one per
//! event in sequence order, with the response's TTL while the response runs and
//! [`StoreOptions::ended_log_ttl`] once it has ended: appended by a script that pushes only
//! while the response exists, read with LRANGE, deleted with the response.
//!
//! A conversation (Conversations API) is a hash `{prefix}conv:{id}` (`team`, `created_at`,
//! `metadata`) and a list `{prefix}conv_items:{id}` of its items as JSON, both with the TTL,
//! refreshed on every use; `conversation.lua` does each operation with the owner check. The
//! turn running in it holds `{prefix}conv_lock:{team length}:{team}:{id}`, a string naming
//! the holder, with the TTL the holder asks for (`conversation_lock.lua`: take or renew for the
//! same holder, release only by it).
//!
//! Session pins are plain string keys `{prefix}pin:{pool}:{session}` (see [`crate::pins`])
//! holding the pin as JSON, with their own TTL; a swap is one compare-and-set script, a touch
//! one PEXPIRE.
//!
//! ## The connection
//!
//! One multiplexed connection ([`ConnectionManager`]) carries every call. It reconnects by
//! itself when the connection reports a loss (reset, EOF, refused). A connection can also die
//! without a word: Redis failed over to another address, or a NAT or load balancer dropped its
//! state, and the gateway's packets go nowhere. Then every reply times out and nothing reports
//! a loss, so two things replace it:
//!
//! - a call whose reply times out (`RESPONSE_TIMEOUT`, 5 s; 7 s in all for a call that also
//!   waited for a reconnection) opens a new connection, one at a time; calls made meanwhile
//!   wait for it (calls already sent on the old one finish or time out there), and if it
//!   cannot be opened they go on with the old one; so do several calls in a row failing on
//!   the link itself (I/O errors, or `READONLY` from a primary that became a replica), while a
//!   server's refusal (out of memory, busy) leaves a working connection alone;
//! - the socket has TCP keep-alive (an idle dead peer is noticed within about a minute) and, on
//!   Linux, `TCP_USER_TIMEOUT` (data unacknowledged for [`TCP_USER_TIMEOUT`] closes it).
//!
//! The history script reads predecessor keys it derives itself, so it needs a standalone Redis
//! (or a primary with replicas), not Redis Cluster.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
use ::redis::ServerErrorKind;
use ::redis::{
    Cmd, ErrorKind, FromRedisValue, IntoConnectionInfo, Pipeline, RedisError, RedisResult,
};
use serde_json::Value;

use crate::exchange::{board_key, feed_key, feed_seq_key, FEED_LEN, FEED_READ_MAX};
use crate::pins::{decode_pin, encode_pin, pin_key};
use crate::rate::{RateDecision, RateLimit};
use crate::record::response_status;
use crate::{
    ConversationRecord, FeedRead, History, PeerState, PinSwap, ResponseRecord, SessionPin, Store,
    StoreError, StoreOptions, MAX_CHAIN_LEN,
};

/// A Lua script with its SHA1, ready for EVALSHA.
struct LuaScript {
    source: &'static str,
    sha: String,
}

impl LuaScript {
    fn new(source: &'static str) -> Self {
        let sha = ::redis::Script::new(source).get_hash().to_string();
        LuaScript { source, sha }
    }
}

/// The connection every call uses, and what it takes to open a new one.
struct Link {
    /// Write-locked while a replacement is being opened, so calls wait for it rather than
    /// going to the connection that stopped answering.
    current: Arc<tokio::sync::RwLock<ConnectionManager>>,
    client: ::redis::Client,
    config: ConnectionManagerConfig,
    /// A replacement connection is being opened.
    replacing: AtomicBool,
    /// The last replacement could not be opened (read by the calls that waited for it).
    replace_failed: AtomicBool,
    /// Connections opened to replace one whose replies timed out or that kept failing.
    replaced: AtomicU64,
    /// Calls failed in a row (any error; a success resets it).
    failures: AtomicU64,
    /// When the last replacement was started, in ms since `opened` (`u64::MAX`: never).
    replace_started_ms: AtomicU64,
    /// Bumped each time a replacement is in place: a call's failure counts against the
    /// connection it used, not a newer one (calls still pending on a connection that stopped
    /// answering time out one by one after it was replaced).
    generation: AtomicU64,
    opened: std::time::Instant,
}

/// Failed calls in a row after which the connection is replaced, at most once per
/// [`REPLACE_FAILING_EVERY`]. The connection manager reconnects by itself after a connection
/// loss, but keeps handing back the error of a reconnect the server refused (an authentication
/// failure during a credentials rotation, a full client table): without a new manager every
/// call would fail until the process restarts.
const REPLACE_AFTER_FAILURES: u64 = 3;
/// Longest a call waits for a replacement connection being opened before it fails (opening
/// one may take the connection timeout times its attempts): a store that cannot be reached
/// fails a call within about this long, or the reply timeout, rather than the sum of both.
const REPLACE_WAIT: Duration = CONNECT_TIMEOUT;
const REPLACE_FAILING_EVERY: Duration = Duration::from_secs(2);

impl Link {
    async fn open(client: ::redis::Client, config: ConnectionManagerConfig) -> RedisResult<Self> {
        let conn = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        Ok(Link {
            current: Arc::new(tokio::sync::RwLock::new(conn)),
            client,
            config,
            replacing: AtomicBool::new(false),
            replace_failed: AtomicBool::new(false),
            replaced: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            replace_started_ms: AtomicU64::new(u64::MAX),
            generation: AtomicU64::new(0),
            opened: std::time::Instant::now(),
        })
    }

    /// The connection to use and its generation. While a replacement is being opened a call
    /// waits for it at most [`REPLACE_WAIT`], then fails, as it does when the replacement
    /// could not be opened: the old connection stopped answering (or kept failing), and a call
    /// sent there would wait out its reply timeout as well.
    async fn conn(&self) -> RedisResult<(ConnectionManager, u64)> {
        let current = match self.current.try_read() {
            Ok(current) => current,
            Err(_) => {
                let unreachable = |why: &'static str| {
                    RedisError::from((ErrorKind::Io, "no connection to Redis", why.into()))
                };
                let current = tokio::time::timeout(REPLACE_WAIT, self.current.read())
                    .await
                    .map_err(|_| unreachable("a new connection is still being opened"))?;
                if self.replace_failed.load(Ordering::Acquire) {
                    return Err(unreachable("a new connection could not be opened"));
                }
                current
            }
        };
        Ok((current.clone(), self.generation.load(Ordering::Acquire)))
    }

    /// After a call on the connection of `generation`: a reply that timed out replaces the
    /// connection, and so do [`REPLACE_AFTER_FAILURES`] failed calls in a row (at most every
    /// [`REPLACE_FAILING_EVERY`]). Failures on a connection already replaced say nothing of
    /// the current one.
    fn observe<T>(self: &Arc<Self>, generation: u64, result: &RedisResult<T>) {
        let Err(err) = result else {
            self.failures.store(0, Ordering::Relaxed);
            return;
        };
        if generation != self.generation.load(Ordering::Acquire) {
            return;
        }
        if err.is_timeout() {
            self.replace("redis replies timed out");
            return;
        }
        // A server's refusal of the call (out of memory, busy with a script, a script it does
        // not have) came over a working connection, which a new one would not change. The
        // rest count: failures of the link itself, a refused reconnection, and a primary that
        // became a replica (`READONLY`).
        let refused_call = matches!(err.kind(), ErrorKind::Server(kind) if kind != ServerErrorKind::ReadOnly)
            || matches!(err.code(), Some("OOM" | "BUSY"));
        if refused_call {
            self.failures.store(0, Ordering::Relaxed);
            return;
        }
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        let now = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        let last = self.replace_started_ms.load(Ordering::Relaxed);
        let due = last == u64::MAX
            || now.saturating_sub(last) >= REPLACE_FAILING_EVERY.as_millis() as u64;
        if failures >= REPLACE_AFTER_FAILURES && due {
            self.replace("redis calls keep failing");
        }
    }

    /// Open a new connection in the background, unless one is being opened already; calls
    /// from now on wait for it, at most [`REPLACE_WAIT`] each. If it cannot be opened, the
    /// calls that waited fail and later ones go on with the old one (which reconnects by
    /// itself once Redis answers again).
    fn replace(self: &Arc<Self>, why: &'static str) {
        if self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let now = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.replace_started_ms.store(now, Ordering::Relaxed);
        let link = Arc::clone(self);
        let locked = Arc::clone(&self.current).try_write_owned();
        tokio::spawn(async move {
            let mut current = match locked {
                Ok(guard) => guard,
                Err(_) => Arc::clone(&link.current).write_owned().await,
            };
            match ConnectionManager::new_with_config(link.client.clone(), link.config.clone()).await
            {
                Ok(conn) => {
                    *current = conn;
                    link.generation.fetch_add(1, Ordering::AcqRel);
                    link.replaced.fetch_add(1, Ordering::Relaxed);
                    link.failures.store(0, Ordering::Relaxed);
                    link.replace_failed.store(false, Ordering::Release);
                    tracing::warn!("{why}; now on a new connection");
                }
                Err(err) => {
                    link.replace_failed.store(true, Ordering::Release);
                    tracing::warn!(error = %err, "{why}; no new connection either")
                }
            }
            drop(current);
            link.replacing.store(false, Ordering::Release);
        });
    }
}

/// Store backed by a Redis server.
pub struct RedisStore {
    link: Arc<Link>,
    ttl_ms: u64,
    /// [`StoreOptions::ended_log_ttl`], at most `ttl_ms`.
    ended_log_ttl_ms: u64,
    pin_ttl_ms: u64,
    key_prefix: String,
    resp_prefix: String,
    round_trips: AtomicU64,
    history_script: LuaScript,
    update_script: LuaScript,
    delete_script: LuaScript,
    append_events_script: LuaScript,
    conversation_script: LuaScript,
    swap_pin_script: LuaScript,
    get_pin_script: LuaScript,
    rate_script: LuaScript,
    exchange_script: LuaScript,
    feed_script: LuaScript,
    conversation_lock_script: LuaScript,
}

/// How long to wait for a TCP connection to Redis.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long to wait for a reply; generous because a long history is one large reply.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a call may take in all: a call made while the connection reconnects waits for the
/// reconnection, which no reply timeout covers.
const CALL_DEADLINE: Duration = Duration::from_secs(7);

/// `call`, or a timeout error once [`CALL_DEADLINE`] has passed.
async fn within_deadline<T>(
    call: impl std::future::Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    tokio::time::timeout(CALL_DEADLINE, call)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no reply from Redis within the call deadline",
            )
            .into())
        })
}
/// Connection attempts after a connection loss before a request fails (the next request tries
/// again), so requests fail within a few seconds while Redis is down instead of hanging.
const RECONNECT_ATTEMPTS: usize = 3;
/// Longest pause between two connection attempts.
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
/// TCP keep-alive on the connection: first probe after this long idle, then every
/// [`KEEPALIVE_INTERVAL`], giving up after [`KEEPALIVE_RETRIES`] unanswered.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;
/// Linux: the kernel closes the connection when data sent stays unacknowledged this long.
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(20);

impl RedisStore {
    /// Connect to `url` (`redis://host:port/db`); reconnects by itself after connection loss.
    pub async fn connect(url: &str, opts: StoreOptions) -> Result<Self, StoreError> {
        let info = url
            .into_connection_info()
            .map_err(|e| StoreError::InvalidUrl(format!("{url}: {e}")))?
            .set_tcp_settings(tcp_settings());
        let client = ::redis::Client::open(info)
            .map_err(|e| StoreError::InvalidUrl(format!("{url}: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(RECONNECT_ATTEMPTS)
            .set_max_delay(RECONNECT_MAX_DELAY);
        let link = Link::open(client, config)
            .await
            .map_err(|e| StoreError::Backend(format!("cannot connect to {url}: {e}")))?;
        let store = RedisStore {
            link: Arc::new(link),
            ttl_ms: millis(opts.ttl),
            ended_log_ttl_ms: millis(opts.ended_log_ttl.min(opts.ttl)),
            pin_ttl_ms: millis(opts.pin_ttl),
            resp_prefix: format!("{}resp:", opts.key_prefix),
            key_prefix: opts.key_prefix,
            round_trips: AtomicU64::new(0),
            history_script: LuaScript::new(include_str!("history.lua")),
            update_script: LuaScript::new(include_str!("update_if_active.lua")),
            delete_script: LuaScript::new(include_str!("delete.lua")),
            append_events_script: LuaScript::new(include_str!("append_events.lua")),
            conversation_script: LuaScript::new(include_str!("conversation.lua")),
            swap_pin_script: LuaScript::new(include_str!("swap_pin.lua")),
            get_pin_script: LuaScript::new(include_str!("get_pin.lua")),
            rate_script: LuaScript::new(include_str!("rate_limit.lua")),
            exchange_script: LuaScript::new(include_str!("exchange.lua")),
            feed_script: LuaScript::new(include_str!("feed.lua")),
            conversation_lock_script: LuaScript::new(include_str!("conversation_lock.lua")),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    /// The Redis key of response `id`.
    pub fn response_key(&self, id: &str) -> String {
        format!("{}{id}", self.resp_prefix)
    }

    /// The Redis key marking response `id` as deleted (see `delete.lua`).
    fn deleted_key(&self, id: &str) -> String {
        format!("{}deleted:{id}", self.key_prefix)
    }

    /// The Redis key of response `id`'s event log.
    pub fn events_key(&self, id: &str) -> String {
        format!("{}events:{id}", self.key_prefix)
    }

    /// The Redis keys of conversation `id`: its hash and its item list.
    fn conversation_keys(&self, id: &str) -> [String; 2] {
        [
            format!("{}conv:{id}", self.key_prefix),
            format!("{}conv_items:{id}", self.key_prefix),
        ]
    }

    /// Run one operation of `conversation.lua` on conversation `id`.
    async fn conversation_op<T: FromRedisValue>(
        &self,
        op: &str,
        team: &str,
        id: &str,
        extra: &[&[u8]],
    ) -> Result<T, StoreError> {
        let [hash, items] = self.conversation_keys(id);
        let ttl = self.ttl_ms.to_string();
        let mut args: Vec<&[u8]> = vec![op.as_bytes(), team.as_bytes(), ttl.as_bytes()];
        args.extend_from_slice(extra);
        self.run_script_keys(&self.conversation_script, &[&hash, &items], &args)
            .await
    }

    /// The Redis key of the lock of the team's conversation `id` (the team's name is
    /// length-prefixed, so no team and id pair spells another's).
    fn conversation_lock_key(&self, team: &str, id: &str) -> String {
        format!("{}conv_lock:{}:{team}:{id}", self.key_prefix, team.len())
    }

    /// The Redis key of background response `id`'s run lease.
    fn run_lease_key(&self, id: &str) -> String {
        format!("{}run_lease:{id}", self.key_prefix)
    }

    /// The Redis key saying a lease was taken for background response `id` (it lives as long
    /// as a response).
    fn run_leased_key(&self, id: &str) -> String {
        format!("{}run_leased:{id}", self.key_prefix)
    }

    /// The Redis key of the pin of `session` in `pool` (see [`crate::pins::pin_key`]).
    pub fn pin_key(&self, pool: &str, session: &str) -> String {
        pin_key(&self.key_prefix, pool, session)
    }

    /// Run `rate_limit.lua` over `limits` (not empty); `force` charges whatever the budgets.
    async fn run_rate_script(
        &self,
        limits: &[RateLimit],
        mode: Option<&str>,
    ) -> Result<Vec<i64>, StoreError> {
        let keys: Vec<String> = limits
            .iter()
            .map(|l| format!("{}rate:{}", self.key_prefix, l.key))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut args: Vec<String> = limits
            .iter()
            .flat_map(|l| {
                [
                    millis(l.period).to_string(),
                    l.limit.to_string(),
                    l.cost.to_string(),
                ]
            })
            .collect();
        if let Some(mode) = mode {
            args.push(mode.into());
        }
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.run_script_keys(&self.rate_script, &keys, &args).await
    }

    /// Cache all scripts on the server so the first calls need no EVAL fallback.
    async fn load_scripts(&self) -> Result<(), StoreError> {
        let mut pipe = ::redis::pipe();
        for script in [
            &self.history_script,
            &self.update_script,
            &self.delete_script,
            &self.append_events_script,
            &self.conversation_script,
            &self.swap_pin_script,
            &self.get_pin_script,
            &self.rate_script,
            &self.exchange_script,
            &self.feed_script,
            &self.conversation_lock_script,
        ] {
            pipe.cmd("SCRIPT").arg("LOAD").arg(script.source).ignore();
        }
        self.send_pipe(&pipe).await?;
        Ok(())
    }

    fn count_round_trip(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections opened so far to replace one whose replies timed out or that kept failing.
    pub fn connections_replaced(&self) -> u64 {
        self.link.replaced.load(Ordering::Relaxed)
    }

    /// Send one command.
    async fn send_cmd<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        self.count_round_trip();
        let (mut conn, generation) = self.link.conn().await?;
        let result = within_deadline(cmd.query_async(&mut conn)).await;
        self.link.observe(generation, &result);
        result
    }

    /// Send one pipeline.
    async fn send_pipe(&self, pipe: &Pipeline) -> RedisResult<()> {
        self.count_round_trip();
        let (mut conn, generation) = self.link.conn().await?;
        let result = within_deadline(pipe.query_async(&mut conn)).await;
        self.link.observe(generation, &result);
        result
    }

    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        Ok(self.send_cmd(cmd).await?)
    }

    /// Run `script` with EVALSHA, falling back to EVAL if the server lost its script cache.
    async fn run_script<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        key: &str,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        self.run_script_keys(script, &[key], args).await
    }

    /// [`Self::run_script`] with several keys.
    async fn run_script_keys<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let build = |verb: &str, body: &str| {
            let mut cmd = ::redis::cmd(verb);
            cmd.arg(body).arg(keys.len()).arg(keys);
            for arg in args {
                cmd.arg(*arg);
            }
            cmd
        };
        match self.send_cmd(&build("EVALSHA", &script.sha)).await {
            Ok(value) => Ok(value),
            Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.query(&build("EVAL", script.source)).await
            }
            Err(err) => Err(err.into()),
        }
    }
}

/// Keep-alive and, on Linux, a user timeout, so a connection to a peer that vanished is closed.
fn tcp_settings() -> TcpSettings {
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    let settings = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    #[cfg(target_os = "linux")]
    let settings = settings.set_user_timeout(TCP_USER_TIMEOUT);
    settings
}

/// A TTL in whole milliseconds for PEXPIRE / SET PX: at least 1, saturating.
fn millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Serialize a JSON value that came from `serde_json::Value` (cannot fail).
fn to_json(value: &impl serde::Serialize) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Backend(format!("encode JSON: {e}")))
}

/// The Response object as stored, and whether its `output` was replaced by a null placeholder
/// because it equals `output_items` (stored once, in the `output` field).
fn pack_response(response: &Value, output_items: &[Value]) -> Result<(String, bool), StoreError> {
    let shares_output = !output_items.is_empty()
        && response
            .get("output")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            == Some(output_items);
    if !shares_output {
        return Ok((to_json(response)?, false));
    }
    let mut packed = response.clone();
    if let Some(output) = packed.get_mut("output") {
        *output = Value::Null;
    }
    Ok((to_json(&packed)?, true))
}

fn decode<T: serde::de::DeserializeOwned>(
    id: &str,
    what: &str,
    bytes: &[u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        id: id.to_string(),
        reason: format!("field {what}: {e}"),
    })
}

impl Store for RedisStore {
    async fn put(&self, rec: &ResponseRecord) -> Result<(), StoreError> {
        let (response, shared) = pack_response(&rec.response, &rec.output_items)?;
        let key = self.response_key(&rec.id);
        let fields: [(&str, String); 7] = [
            ("team", rec.team.clone()),
            ("prev", rec.previous_response_id.clone().unwrap_or_default()),
            ("input", to_json(&rec.input_items)?),
            ("output", to_json(&rec.output_items)?),
            ("response", response),
            ("status", response_status(&rec.response).to_string()),
            ("shared", if shared { "1" } else { "0" }.to_string()),
        ];
        let mut pipe = ::redis::pipe();
        pipe.atomic()
            .hset_multiple(&key, &fields)
            .ignore()
            .pexpire(&key, i64::try_from(self.ttl_ms).unwrap_or(i64::MAX))
            .ignore();
        self.send_pipe(&pipe).await?;
        Ok(())
    }

    async fn status(&self, team: &str, id: &str) -> Result<Option<String>, StoreError> {
        let mut cmd = ::redis::cmd("HMGET");
        cmd.arg(self.response_key(id)).arg(&["team", "status"]);
        let fields: Vec<Option<Vec<u8>>> = self.query(&cmd).await?;
        let [stored_team, status] = fields.as_slice() else {
            return Err(StoreError::Backend(format!(
                "HMGET returned {} fields, expected 2",
                fields.len()
            )));
        };
        if stored_team.as_deref() != Some(team.as_bytes()) {
            return Ok(None);
        }
        let status = status.as_deref().ok_or_else(|| StoreError::Corrupt {
            id: id.to_string(),
            reason: "field status is missing".into(),
        })?;
        Ok(Some(String::from_utf8_lossy(status).into_owned()))
    }

    async fn get(&self, team: &str, id: &str) -> Result<Option<ResponseRecord>, StoreError> {
        let mut cmd = ::redis::cmd("HMGET");
        cmd.arg(self.response_key(id))
            .arg(&["team", "prev", "input", "output", "response", "shared"]);
        let fields: Vec<Option<Vec<u8>>> = self.query(&cmd).await?;
        let [stored_team, prev, input, output, response, shared] = fields.as_slice() else {
            return Err(StoreError::Backend(format!(
                "HMGET returned {} fields, expected 6",
                fields.len()
            )));
        };
        if stored_team.as_deref() != Some(team.as_bytes()) {
            return Ok(None);
        }
        let missing = |what: &str| StoreError::Corrupt {
            id: id.to_string(),
            reason: format!("field {what} is missing"),
        };
        let input_items: Vec<Value> = decode(
            id,
            "input",
            input.as_deref().ok_or_else(|| missing("input"))?,
        )?;
        let output_items: Vec<Value> = decode(
            id,
            "output",
            output.as_deref().ok_or_else(|| missing("output"))?,
        )?;
        let mut response: Value = decode(
            id,
            "response",
            response.as_deref().ok_or_else(|| missing("response"))?,
        )?;
        if shared.as_deref() == Some(b"1") {
            if let Some(slot) = response.get_mut("output") {
                *slot = Value::Array(output_items.clone());
            }
        }
        let previous_response_id = match prev.as_deref() {
            None | Some(b"") => None,
            Some(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        };
        Ok(Some(ResponseRecord {
            id: id.to_string(),
            team: team.to_string(),
            previous_response_id,
            input_items,
            output_items,
            response,
        }))
    }

    async fn history(&self, team: &str, id: &str) -> Result<Option<History>, StoreError> {
        let ttl = self.ttl_ms.to_string();
        let max_len = MAX_CHAIN_LEN.to_string();
        let deleted_prefix = self.deleted_key("");
        let blobs: Option<Vec<Vec<u8>>> = self
            .run_script(
                &self.history_script,
                &self.response_key(id),
                &[
                    team.as_bytes(),
                    self.resp_prefix.as_bytes(),
                    ttl.as_bytes(),
                    max_len.as_bytes(),
                    id.as_bytes(),
                    deleted_prefix.as_bytes(),
                ],
            )
            .await?;
        let Some((root, blobs)) = blobs.as_deref().and_then(<[Vec<u8>]>::split_first) else {
            return Ok(None);
        };
        if root == b"!cycle" {
            return Err(StoreError::Corrupt {
                id: id.to_string(),
                reason: format!(
                    "previous_response_id chain longer than {MAX_CHAIN_LEN} (a cycle?)"
                ),
            });
        }
        if root == b"!lost" {
            let missing = blobs
                .first()
                .map(|m| String::from_utf8_lossy(m).into_owned());
            return Err(StoreError::Lost {
                id: id.to_string(),
                missing: missing.unwrap_or_default(),
            });
        }
        let Some((status, blobs)) = blobs.split_first() else {
            return Err(StoreError::Corrupt {
                id: id.to_string(),
                reason: "the history script returned no status".into(),
            });
        };
        let mut items = Vec::new();
        for blob in blobs {
            let part: Vec<Value> = decode(id, "input/output of a predecessor", blob)?;
            items.extend(part);
        }
        Ok(Some(History {
            items,
            root_id: String::from_utf8_lossy(root).into_owned(),
            status: String::from_utf8_lossy(status).into_owned(),
        }))
    }

    async fn update_if_active(
        &self,
        team: &str,
        id: &str,
        response: &Value,
        output_items: &[Value],
    ) -> Result<bool, StoreError> {
        let (packed, shared) = pack_response(response, output_items)?;
        let output = to_json(&output_items)?;
        let ttl = self.ttl_ms.to_string();
        let ended_log_ttl = self.ended_log_ttl_ms.to_string();
        let applied: i64 = self
            .run_script_keys(
                &self.update_script,
                &[&self.response_key(id), &self.events_key(id)],
                &[
                    team.as_bytes(),
                    packed.as_bytes(),
                    output.as_bytes(),
                    response_status(response).as_bytes(),
                    if shared { b"1" } else { b"0" },
                    ttl.as_bytes(),
                    ended_log_ttl.as_bytes(),
                ],
            )
            .await?;
        Ok(applied == 1)
    }

    async fn delete(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        let ttl = self.ttl_ms.to_string();
        let deleted: i64 = self
            .run_script_keys(
                &self.delete_script,
                &[
                    &self.response_key(id),
                    &self.events_key(id),
                    &self.deleted_key(id),
                ],
                &[team.as_bytes(), ttl.as_bytes()],
            )
            .await?;
        Ok(deleted == 1)
    }

    async fn append_events(&self, id: &str, events: &[String]) -> Result<bool, StoreError> {
        let ttl = self.ttl_ms.to_string();
        let ended_log_ttl = self.ended_log_ttl_ms.to_string();
        let mut args: Vec<&[u8]> = Vec::with_capacity(events.len() + 2);
        args.push(ttl.as_bytes());
        args.push(ended_log_ttl.as_bytes());
        args.extend(events.iter().map(|e| e.as_bytes()));
        let state: i64 = self
            .run_script_keys(
                &self.append_events_script,
                &[&self.response_key(id), &self.events_key(id)],
                &args,
            )
            .await?;
        Ok(state == 1)
    }

    async fn events(&self, id: &str, from: usize) -> Result<Vec<String>, StoreError> {
        let mut cmd = ::redis::cmd("LRANGE");
        cmd.arg(self.events_key(id))
            .arg(i64::try_from(from).unwrap_or(i64::MAX))
            .arg(-1);
        self.query(&cmd).await
    }

    async fn create_conversation(
        &self,
        conversation: &ConversationRecord,
        items: &[Value],
    ) -> Result<(), StoreError> {
        let [hash, list] = self.conversation_keys(&conversation.id);
        let ttl = i64::try_from(self.ttl_ms).unwrap_or(i64::MAX);
        let fields: [(&str, String); 3] = [
            ("team", conversation.team.clone()),
            ("created_at", conversation.created_at.to_string()),
            ("metadata", to_json(&conversation.metadata)?),
        ];
        let encoded = items.iter().map(to_json).collect::<Result<Vec<_>, _>>()?;
        let mut pipe = ::redis::pipe();
        pipe.atomic()
            .del(&[&hash, &list])
            .ignore()
            .hset_multiple(&hash, &fields)
            .ignore()
            .pexpire(&hash, ttl)
            .ignore();
        if !encoded.is_empty() {
            pipe.rpush(&list, &encoded)
                .ignore()
                .pexpire(&list, ttl)
                .ignore();
        }
        self.send_pipe(&pipe).await?;
        Ok(())
    }

    async fn get_conversation(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<ConversationRecord>, StoreError> {
        let fields: Option<Vec<Option<String>>> =
            self.conversation_op("get", team, id, &[]).await?;
        let Some(fields) = fields else {
            return Ok(None);
        };
        let [created_at, metadata] = fields.as_slice() else {
            return Err(StoreError::Corrupt {
                id: id.to_string(),
                reason: format!(
                    "conversation get returned {} fields, expected 2",
                    fields.len()
                ),
            });
        };
        Ok(Some(ConversationRecord {
            id: id.to_string(),
            team: team.to_string(),
            created_at: created_at
                .as_deref()
                .and_then(|c| c.parse().ok())
                .unwrap_or(0),
            metadata: match metadata {
                Some(text) => decode(id, "metadata", text.as_bytes())?,
                None => Value::Object(Default::default()),
            },
        }))
    }

    async fn set_conversation_metadata(
        &self,
        team: &str,
        id: &str,
        metadata: &Value,
    ) -> Result<Option<ConversationRecord>, StoreError> {
        let encoded = to_json(metadata)?;
        let created_at: Option<String> = self
            .conversation_op("metadata", team, id, &[encoded.as_bytes()])
            .await?;
        Ok(created_at.map(|created_at| ConversationRecord {
            id: id.to_string(),
            team: team.to_string(),
            created_at: created_at.parse().unwrap_or(0),
            metadata: metadata.clone(),
        }))
    }

    async fn delete_conversation(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        let deleted: i64 = self.conversation_op("delete", team, id, &[]).await?;
        Ok(deleted == 1)
    }

    async fn conversation_len(&self, team: &str, id: &str) -> Result<Option<usize>, StoreError> {
        let len: Option<i64> = self.conversation_op("len", team, id, &[]).await?;
        Ok(len.map(|n| usize::try_from(n).unwrap_or(0)))
    }

    async fn conversation_items(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<Vec<Value>>, StoreError> {
        let items: Option<Vec<String>> = self.conversation_op("items", team, id, &[]).await?;
        items
            .map(|items| {
                items
                    .iter()
                    .map(|item| decode(id, "conversation item", item.as_bytes()))
                    .collect()
            })
            .transpose()
    }

    async fn append_conversation_items(
        &self,
        team: &str,
        id: &str,
        response: &str,
        items: &[Value],
    ) -> Result<bool, StoreError> {
        let encoded = items.iter().map(to_json).collect::<Result<Vec<_>, _>>()?;
        let mut args: Vec<&[u8]> = vec![response.as_bytes()];
        args.extend(encoded.iter().map(|e| e.as_bytes()));
        let appended: i64 = self.conversation_op("append", team, id, &args).await?;
        Ok(appended == 1)
    }

    async fn delete_conversation_item(
        &self,
        team: &str,
        id: &str,
        item_id: &str,
    ) -> Result<Option<bool>, StoreError> {
        let removed: i64 = self
            .conversation_op("delete_item", team, id, &[item_id.as_bytes()])
            .await?;
        Ok(match removed {
            -1 => None,
            n => Some(n == 1),
        })
    }

    async fn lock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
        ttl: Duration,
        renew_only: bool,
    ) -> Result<bool, StoreError> {
        let key = self.conversation_lock_key(team, id);
        let ttl = millis(ttl).max(1).to_string();
        let op: &[u8] = if renew_only { b"renew" } else { b"hold" };
        let held: i64 = self
            .run_script(
                &self.conversation_lock_script,
                &key,
                &[op, owner.as_bytes(), ttl.as_bytes()],
            )
            .await?;
        Ok(held == 1)
    }

    async fn unlock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        let key = self.conversation_lock_key(team, id);
        let _released: i64 = self
            .run_script(
                &self.conversation_lock_script,
                &key,
                &[b"release", owner.as_bytes()],
            )
            .await?;
        Ok(())
    }

    async fn hold_run(&self, id: &str, ttl: Duration) -> Result<(), StoreError> {
        let mut pipe = ::redis::pipe();
        pipe.cmd("SET")
            .arg(self.run_lease_key(id))
            .arg(1)
            .arg("PX")
            .arg(millis(ttl).max(1))
            .ignore()
            .cmd("SET")
            .arg(self.run_leased_key(id))
            .arg(1)
            .arg("PX")
            .arg(self.ttl_ms.max(1))
            .ignore();
        self.send_pipe(&pipe).await?;
        Ok(())
    }

    async fn run_held(&self, id: &str) -> Result<Option<bool>, StoreError> {
        let mut cmd = ::redis::cmd("MGET");
        cmd.arg(self.run_lease_key(id)).arg(self.run_leased_key(id));
        let found: Vec<Option<Vec<u8>>> = self.query(&cmd).await?;
        let [lease, leased] = found.as_slice() else {
            return Err(StoreError::Backend(format!(
                "MGET returned {} values, expected 2",
                found.len()
            )));
        };
        Ok(leased.is_some().then_some(lease.is_some()))
    }

    async fn end_run(&self, id: &str) -> Result<(), StoreError> {
        let mut cmd = ::redis::cmd("DEL");
        cmd.arg(self.run_lease_key(id));
        let _: i64 = self.query(&cmd).await?;
        Ok(())
    }

    async fn get_pin(&self, pool: &str, session: &str) -> Result<Option<SessionPin>, StoreError> {
        let key = self.pin_key(pool, session);
        let ttl = self.pin_ttl_ms.to_string();
        let stored: Option<Vec<u8>> = self
            .run_script(&self.get_pin_script, &key, &[ttl.as_bytes()])
            .await?;
        stored.map(|bytes| decode_pin(&key, &bytes)).transpose()
    }

    async fn swap_pin(
        &self,
        pool: &str,
        session: &str,
        expected: Option<&SessionPin>,
        new: &SessionPin,
    ) -> Result<PinSwap, StoreError> {
        let key = self.pin_key(pool, session);
        let expected = expected.map(encode_pin).transpose()?.unwrap_or_default();
        let new_json = encode_pin(new)?;
        let ttl = self.pin_ttl_ms.to_string();
        let (applied, in_force): (i64, Vec<u8>) = self
            .run_script(
                &self.swap_pin_script,
                &key,
                &[expected.as_bytes(), new_json.as_bytes(), ttl.as_bytes()],
            )
            .await?;
        Ok(PinSwap {
            pin: decode_pin(&key, &in_force)?,
            applied: applied == 1,
        })
    }

    async fn touch_pin(&self, pool: &str, session: &str) -> Result<(), StoreError> {
        let mut cmd = ::redis::cmd("PEXPIRE");
        cmd.arg(self.pin_key(pool, session)).arg(self.pin_ttl_ms);
        let _applied: i64 = self.query(&cmd).await?;
        Ok(())
    }

    async fn rate_limit(&self, limits: &[RateLimit]) -> Result<Vec<RateDecision>, StoreError> {
        if limits.is_empty() {
            return Ok(Vec::new());
        }
        let reply = self.run_rate_script(limits, None).await?;
        if reply.len() != 1 + 4 * limits.len() {
            return Err(StoreError::Backend(format!(
                "rate limit script returned {} values for {} limits",
                reply.len(),
                limits.len()
            )));
        }
        let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
        Ok(limits
            .iter()
            .zip(reply[1..].chunks_exact(4))
            .map(|(l, r)| RateDecision {
                limit: l.limit,
                remaining: u64::try_from(r[0]).unwrap_or(0),
                reset_after: ms(r[1]),
                retry_after: (r[2] >= 0).then(|| ms(r[2])),
                too_large: r[3] == 1,
            })
            .collect())
    }

    async fn rate_charge(&self, limits: &[RateLimit]) -> Result<(), StoreError> {
        if !limits.is_empty() {
            self.run_rate_script(limits, Some("force")).await?;
        }
        Ok(())
    }

    async fn rate_refund(&self, limits: &[RateLimit]) -> Result<(), StoreError> {
        if !limits.is_empty() {
            self.run_rate_script(limits, Some("refund")).await?;
        }
        Ok(())
    }

    async fn exchange(
        &self,
        pool: &str,
        gateway: &str,
        state: &str,
        fresh: Duration,
    ) -> Result<Vec<PeerState>, StoreError> {
        let key = board_key(&self.key_prefix, pool);
        let fresh = millis(fresh).max(1).to_string();
        let reply: Vec<Vec<u8>> = self
            .run_script(
                &self.exchange_script,
                &key,
                &[gateway.as_bytes(), state.as_bytes(), fresh.as_bytes()],
            )
            .await?;
        reply
            .chunks_exact(2)
            .map(|pair| {
                let age = std::str::from_utf8(&pair[0])
                    .ok()
                    .and_then(|a| a.parse::<u64>().ok())
                    .ok_or_else(|| {
                        StoreError::Backend(format!("exchange board {key}: unreadable age"))
                    })?;
                let state = String::from_utf8(pair[1].clone()).map_err(|_| {
                    StoreError::Backend(format!("exchange board {key}: state is not UTF-8"))
                })?;
                Ok(PeerState {
                    age: Duration::from_millis(age),
                    state,
                })
            })
            .collect()
    }

    async fn feed(
        &self,
        pool: &str,
        gateway: &str,
        entries: &[String],
        cursor: Option<u64>,
    ) -> Result<FeedRead, StoreError> {
        let key = feed_key(&self.key_prefix, pool);
        let seq_key = feed_seq_key(&self.key_prefix, pool);
        let cursor = cursor.map_or_else(|| "-1".to_string(), |c| c.to_string());
        let keep = FEED_LEN.to_string();
        let most = FEED_READ_MAX.to_string();
        let mut args: Vec<&[u8]> = vec![
            gateway.as_bytes(),
            cursor.as_bytes(),
            keep.as_bytes(),
            most.as_bytes(),
        ];
        args.extend(entries.iter().map(|e| e.as_bytes()));
        let reply: Vec<Vec<u8>> = self
            .run_script_keys(&self.feed_script, &[&key, &seq_key], &args)
            .await?;
        let unreadable = || StoreError::Backend(format!("feed {key}: unreadable reply"));
        let number = |bytes: &[u8]| {
            std::str::from_utf8(bytes)
                .ok()
                .and_then(|n| n.parse::<u64>().ok())
                .ok_or_else(unreadable)
        };
        let [cursor, skipped, rest @ ..] = reply.as_slice() else {
            return Err(unreadable());
        };
        let text = |bytes: &[u8]| String::from_utf8(bytes.to_vec()).map_err(|_| unreadable());
        Ok(FeedRead {
            cursor: number(cursor)?,
            skipped: number(skipped)?,
            entries: rest
                .chunks_exact(2)
                .map(|pair| Ok((text(&pair[0])?, text(&pair[1])?)))
                .collect::<Result<_, StoreError>>()?,
        })
    }

    fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn response_output_equal_to_output_items_is_stored_once() {
        let items = vec![json!({"id": "msg_1", "type": "message"})];
        let response = json!({"id": "resp_1", "output": items, "status": "completed"});
        let (packed, shared) = pack_response(&response, &items).unwrap();
        assert!(shared);
        assert_eq!(
            packed,
            r#"{"id":"resp_1","output":null,"status":"completed"}"#
        );
    }

    #[test]
    fn response_output_differing_from_output_items_is_stored_as_is() {
        let items = vec![json!({"id": "msg_1"})];
        let response = json!({"id": "resp_1", "output": [], "status": "in_progress"});
        let (packed, shared) = pack_response(&response, &items).unwrap();
        assert!(!shared);
        assert_eq!(packed, response.to_string());
    }
}
