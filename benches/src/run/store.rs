//! The conversation store the gateways of a run share (`--store`, `--gateways`, `--redis-url`).
//!
//! By default one gateway with no `--redis-url` keeps its state in memory, as a single gateway
//! would (`--store redis` gives it a Redis all the same). With
//! `--gateways N` (N > 1) every gateway of a policy must see the same stored responses (a turn
//! may continue, by `previous_response_id`, a response another gateway stored), the same
//! session pins and each other's exchanged state, so they share one store:
//!
//! - `redis` (the default with several gateways): the Redis `--redis-url` names, or a private
//!   `redis-server` this run starts on a free 127.0.0.1 port (no persistence) and kills at the
//!   end. Each policy replay uses its own key prefix, so replays never see each other's pins or
//!   responses, and state left in a shared Redis expires after [`TTL_DAYS`]. Redis answers on
//!   its own clock, so the run follows the wall clock.
//! - `memory`: one in-process store per policy replay, handed to all its gateways
//!   ([`agentgate_sessions::MemoryStore::shared_in_process`]). It implements the same store
//!   contract (the store suite runs on both), so the gateways work as one fleet, and the run
//!   can follow the virtual clock: same-seed runs with several gateways repeat each other and
//!   compare request for request with one gateway's. What it leaves out is Redis itself: its
//!   round trips and its clock.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Days stored responses live in a Redis the run does not own.
pub const TTL_DAYS: f64 = 1.0;

/// `--store`: what the gateways of a run keep their state in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// In-process memory, one store per policy replay shared by its gateways.
    Memory,
    /// Redis, one key prefix per policy replay.
    Redis,
}

/// Where the gateways of one policy replay keep their state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreTarget {
    /// In memory: the gateway's own store, or with several gateways one store they are all
    /// handed (nothing in their configuration).
    Memory,
    /// A Redis at `url`, keys under `key_prefix`.
    Redis {
        /// `redis://HOST:PORT/DB`.
        url: String,
        /// Prefix of every key of this replay.
        key_prefix: String,
    },
}

impl StoreTarget {
    /// The `[store]` section of a gateway configuration (empty for the in-memory store).
    pub fn toml(&self) -> String {
        match self {
            StoreTarget::Memory => String::new(),
            StoreTarget::Redis { url, key_prefix } => format!(
                "[store]\nurl = {}\nkey_prefix = {}\nttl_days = {TTL_DAYS:?}\n\n",
                toml_string(url),
                toml_string(key_prefix)
            ),
        }
    }
}

/// Check that the gateway accepts `url` as its store URL.
pub fn check_url(url: &str) -> Result<(), String> {
    let target = StoreTarget::Redis {
        url: url.to_string(),
        key_prefix: "agentgate-bench:".into(),
    };
    let text = format!(
        "{}[[pools]]\nname = \"p\"\nmodel = \"m\"\nendpoints = [\"http://127.0.0.1:9\"]\n",
        target.toml()
    );
    agentgate::Config::parse(&text)
        .map(|_| ())
        .map_err(|e| format!("--redis-url {url} cannot be used: {e}"))
}

/// A TOML basic string (JSON string escapes are valid TOML escapes).
fn toml_string(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// The run's shared store: nothing, a Redis given by URL, or a private `redis-server`.
pub struct SharedStore {
    url: Option<String>,
    server: Option<Child>,
    run_tag: String,
    replays: AtomicU64,
}

impl SharedStore {
    /// Prepare the store of `kind` for `gateways` gateways per policy: for Redis, `redis_url`
    /// if given, else a private `redis-server`.
    pub async fn open(
        kind: StoreKind,
        gateways: usize,
        redis_url: Option<&str>,
    ) -> Result<SharedStore, String> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let run_tag = format!("{}-{nanos}", std::process::id());
        let (url, server) = match (kind, redis_url) {
            // refused earlier by the argument checks; kept so this cannot pick one silently
            (StoreKind::Memory, Some(_)) => {
                return Err("--store memory and --redis-url exclude each other".into())
            }
            (StoreKind::Memory, None) => (None, None),
            (StoreKind::Redis, Some(url)) => (Some(url.to_string()), None),
            (StoreKind::Redis, None) => {
                let (url, child) = start_redis_server().await.map_err(|reason| {
                    format!(
                        "a Redis store for {gateways} gateway(s) per policy needs redis-server, and {reason}; \
                         install redis-server (e.g. `apt-get install redis-server`), pass \
                         --redis-url redis://HOST:PORT/DB, or use --store memory"
                    )
                })?;
                (Some(url), Some(child))
            }
        };
        Ok(SharedStore {
            url,
            server,
            run_tag,
            replays: AtomicU64::new(0),
        })
    }

    /// `"redis"` or `"memory"`, for the summary.
    pub fn kind(&self) -> &'static str {
        if self.url.is_some() {
            "redis"
        } else {
            "memory"
        }
    }

    /// The store of one policy replay: a key prefix no other replay uses.
    pub fn for_replay(&self, policy: &str) -> StoreTarget {
        match &self.url {
            None => StoreTarget::Memory,
            Some(url) => {
                let n = self.replays.fetch_add(1, Ordering::Relaxed);
                StoreTarget::Redis {
                    url: url.clone(),
                    key_prefix: format!("agentgate-bench:{}:{n}:{policy}:", self.run_tag),
                }
            }
        }
    }
}

impl Drop for SharedStore {
    fn drop(&mut self) {
        if let Some(child) = self.server.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Start `redis-server` on a free 127.0.0.1 port without persistence and wait until it answers
/// PING; retries on another port if the chosen one was taken meanwhile.
async fn start_redis_server() -> Result<(String, Child), String> {
    let mut last = String::new();
    for _ in 0..3 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .map_err(|e| format!("no free port on 127.0.0.1 ({e})"))?;
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("redis-server cannot be started from PATH ({e})"))?;
        if answers_ping(port, &mut child, Duration::from_secs(10)).await {
            return Ok((format!("redis://127.0.0.1:{port}/0"), child));
        }
        let _ = child.kill();
        let _ = child.wait();
        last = format!("redis-server on port {port} did not answer PING");
    }
    Err(last)
}

/// Poll PING until `+PONG`, the child exits, or `timeout` passes.
async fn answers_ping(port: u16, child: &mut Child, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return false;
        }
        if let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            let mut reply = [0u8; 7];
            let exchange = async {
                stream.write_all(b"PING\r\n").await?;
                stream.read_exact(&mut reply).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), exchange).await {
                if &reply == b"+PONG\r\n" {
                    return true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_gateway_stays_in_memory_and_each_replay_gets_its_own_prefix() {
        let memory = SharedStore::open(StoreKind::Memory, 1, None).await.unwrap();
        assert_eq!(memory.kind(), "memory");
        assert_eq!(memory.for_replay("session"), StoreTarget::Memory);
        assert_eq!(StoreTarget::Memory.toml(), "");

        let given = SharedStore::open(StoreKind::Redis, 1, Some("redis://127.0.0.1:1/0"))
            .await
            .unwrap();
        assert_eq!(given.kind(), "redis");
        let (a, b) = (given.for_replay("session"), given.for_replay("session"));
        assert_ne!(a, b, "two replays of one policy must not share keys");
        let StoreTarget::Redis { url, key_prefix } = &a else {
            panic!("expected Redis, got {a:?}");
        };
        assert_eq!(url, "redis://127.0.0.1:1/0");
        assert!(key_prefix.contains(":session:"), "{key_prefix}");
    }

    #[test]
    fn store_section_parses_as_the_gateways_configuration() {
        let target = StoreTarget::Redis {
            url: "redis://127.0.0.1:6379/0".into(),
            key_prefix: "odd \"prefix\" \\ :".into(),
        };
        let text = format!(
            "{}[[pools]]\nname = \"p\"\nmodel = \"m\"\nendpoints = [\"http://127.0.0.1:1\"]\n",
            target.toml()
        );
        let config = agentgate::Config::parse(&text).unwrap();
        assert_eq!(
            config.store.url.as_deref(),
            Some("redis://127.0.0.1:6379/0")
        );
        assert_eq!(config.store.key_prefix, "odd \"prefix\" \\ :");
        assert_eq!(config.store.ttl_days, TTL_DAYS);
    }

    #[test]
    fn a_url_the_gateway_rejects_is_named_in_the_error() {
        assert!(check_url("redis://127.0.0.1:6379/0").is_ok());
        let message = check_url("http://127.0.0.1:6379").unwrap_err();
        assert!(
            message.contains("--redis-url http://127.0.0.1:6379"),
            "{message}"
        );
        assert!(message.contains("store.url"), "{message}");
    }
}
