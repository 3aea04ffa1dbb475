//! Configuration: the TOML file `agentgate serve --config FILE` reads, its defaults and validation.
//!
//! Every key is documented in the README's configuration reference; the files in `examples/`
//! show them in context (`quickstart.toml` the common ones, `fleet.toml` live endpoint state,
//! `teams.toml` flow control, `pd.toml` prefill/decode).
//! Unknown keys are rejected, and a bad value fails at start with the key's path and the reason,
//! so a typo never silently changes behaviour.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use agentgate_adapters::Flavor;
use agentgate_scheduler::Role;

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[server]`: listener and request limits.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[store]`: where conversation state lives.
    #[serde(default)]
    pub store: StoreConfig,
    /// `[tools]`: how tools the engines cannot run are treated.
    #[serde(default)]
    pub tools: ToolsConfig,
    /// `[compaction]`: how a conversation is compacted (`compaction_trigger`,
    /// `POST /v1/responses/compact`).
    #[serde(default)]
    pub compaction: CompactionConfig,
    /// `[routing]`: how sessions are identified.
    #[serde(default)]
    pub routing: RoutingConfig,
    /// `[upstream]`: timeouts for engine connections.
    #[serde(default)]
    pub upstream: UpstreamConfig,
    /// `[background]`: detached (`background: true`) responses.
    #[serde(default)]
    pub background: BackgroundConfig,
    /// `[[pools]]`: the engine pools, one model each.
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// `[[teams]]`: API keys and the team each belongs to.
    #[serde(default)]
    pub teams: Vec<TeamConfig>,
    /// `[[bands]]`: flow-control priority bands; none means one implicit band `default`.
    #[serde(default)]
    pub bands: Vec<BandConfig>,
    /// `[flow]`: flow control (admission before routing: bands, fairness, shedding, rate limits).
    #[serde(default)]
    pub flow: FlowToml,
    /// The file this configuration was read from ([`Config::load`]), watched for changes to
    /// `[[bands]]`, `[[teams]]` and `[flow]`.
    #[serde(skip)]
    pub source: Option<PathBuf>,
    /// [`Config::source`] as it was just before it was read: the baseline its watcher compares
    /// against, so an edit made while the gateway starts is still seen as one.
    #[serde(skip)]
    pub source_stamp: Option<FileStamp>,
    /// The sections of the file a reload does not apply (all but `[[bands]]`, `[[teams]]` and
    /// `[flow]`, whose `exchange_interval_ms` is read at start only), as parsed: a reload that
    /// changes them says they wait for the next start.
    #[serde(skip)]
    pub restart_sections: toml::Table,
}

/// What identifies a version of a watched file without reading it: its modification time and
/// length and, on Unix, its inode and status-change time (so a file renamed over it, or a
/// `chmod` that makes an unreadable file readable, counts as a change too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStamp {
    modified: Option<std::time::SystemTime>,
    len: u64,
    inode: u64,
    changed: (i64, i64),
}

impl FileStamp {
    /// The stamp of `path` now; `None` when it cannot be examined (missing, no permission on
    /// its folder).
    pub fn of(path: &Path) -> Option<FileStamp> {
        let meta = std::fs::metadata(path).ok()?;
        #[cfg(unix)]
        let (inode, changed) = {
            use std::os::unix::fs::MetadataExt;
            (meta.ino(), (meta.ctime(), meta.ctime_nsec()))
        };
        #[cfg(not(unix))]
        let (inode, changed) = (0, (0, 0));
        Some(FileStamp {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode,
            changed,
        })
    }
}

/// `[server]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the gateway listens on.
    pub listen: SocketAddr,
    /// Largest request body accepted, in bytes; larger bodies get 413.
    pub max_body_bytes: usize,
    /// How often the config file is checked for changes (its file stamp: modification and status-change times, length, inode), in
    /// milliseconds; a change reloads `[[bands]]`, `[[teams]]` and `[flow]`. 0 disables it.
    pub reload_interval_ms: u64,
    /// Send and receive buffer of every client connection, in bytes; 0 leaves the kernel's
    /// autotuning. Autotuning sizes buffers by measured real time, so concurrent large requests
    /// (agent histories of several hundred KB) can complete in a different order from run to
    /// run; a fixed buffer larger than the largest request keeps them in send order.
    pub socket_buffer_bytes: u32,
    /// Request bodies up to this size, in bytes, are parsed on the request's own task; larger
    /// ones (agent histories of megabytes take tens to hundreds of milliseconds to parse) on
    /// the blocking pool, so the runtime threads go on serving streams meanwhile (0: every
    /// body there). Bodies parsed there finish in real-time order, so concurrent large
    /// requests can reach routing in a different order from run to run; a limit at or above
    /// `max_body_bytes` parses every body on its own task, which on a single-threaded runtime
    /// (the benchmark's virtual clock) keeps them in the order they arrived.
    pub parse_inline_bytes: usize,
    /// On shutdown (SIGTERM, Ctrl-C), how long turns in flight (streams, waiting requests,
    /// background runs) may take to finish once no new connection is accepted; those still
    /// going then end as failed with code `server_shutdown`, and the failure is stored.
    pub shutdown_grace_s: f64,
    /// How long a streaming client (a turn's stream, or a follow of a background response's
    /// events) may leave its events unread (its connection's buffers full) before the gateway
    /// stops sending to it and ends its stream, in seconds. The response runs on and is
    /// stored, so the client can fetch it or follow it again; a client that stalls does not
    /// hold an engine slot or a queue place.
    pub client_stall_timeout_s: f64,
    /// How long a client connection may take to send a request's headers, in seconds, counted
    /// from when the gateway starts waiting for them: a connection that sends nothing (an idle
    /// keep-alive connection, or a client that vanished without closing it) or trickles its
    /// headers is closed after this long. Requests already received are not affected. Above
    /// the clients' own idle limit for pooled connections (reqwest's is 90 s), so a client
    /// does not reuse a connection as the gateway closes it.
    pub header_read_timeout_s: f64,
    /// TCP keep-alive of client connections: seconds of silence before the first probe (then
    /// every 10 s, 3 probes), so connections whose client vanished without closing them (a NAT
    /// or load balancer dropping the flow, a machine gone to sleep) are found dead and closed
    /// while the gateway waits on a request body or streams to them. 0 disables it.
    pub tcp_keepalive_s: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 32 * 1024 * 1024,
            reload_interval_ms: 1_000,
            socket_buffer_bytes: 0,
            parse_inline_bytes: 256 * 1024,
            shutdown_grace_s: 25.0,
            client_stall_timeout_s: 60.0,
            header_read_timeout_s: 120.0,
            tcp_keepalive_s: 60.0,
        }
    }
}

impl ServerConfig {
    /// [`ServerConfig::shutdown_grace_s`] as a duration.
    pub fn shutdown_grace(&self) -> Duration {
        seconds(self.shutdown_grace_s)
    }

    /// [`ServerConfig::client_stall_timeout_s`] as a duration.
    pub fn client_stall_timeout(&self) -> Duration {
        seconds(self.client_stall_timeout_s)
    }

    /// [`ServerConfig::header_read_timeout_s`] as a duration.
    pub fn header_read_timeout(&self) -> Duration {
        seconds(self.header_read_timeout_s)
    }

    /// [`ServerConfig::tcp_keepalive_s`] as a duration, `None` when disabled.
    pub fn tcp_keepalive(&self) -> Option<Duration> {
        (self.tcp_keepalive_s > 0.0).then(|| seconds(self.tcp_keepalive_s))
    }
}

/// Default of `[store] conversation_max_items`: far more than any model's context holds as
/// history, so only a conversation grown past use is refused.
pub const DEFAULT_CONVERSATION_MAX_ITEMS: usize = 10_000;

/// `[store]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `redis://host:port/db`; absent means the in-memory store (state lost on restart).
    pub url: Option<String>,
    /// How long stored responses live, in days.
    pub ttl_days: f64,
    /// Prefix of every Redis key, so several deployments can share one Redis.
    pub key_prefix: String,
    /// In-memory store only: MiB its responses may take (estimated) before the least recently
    /// used are dropped; 0: no bound.
    pub memory_max_mb: u64,
    /// How long a session pin lives after the session's last turn, in seconds.
    pub pin_ttl_s: f64,
    /// Most items a conversation may hold before appends to it and responses in it are
    /// refused (a response's own items may take it past this by one turn); 0: no bound.
    pub conversation_max_items: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: None,
            ttl_days: 30.0,
            key_prefix: "agentgate:".into(),
            memory_max_mb: 1024,
            pin_ttl_s: 3600.0,
            conversation_max_items: DEFAULT_CONVERSATION_MAX_ITEMS,
        }
    }
}

/// What to do with hosted tools (`web_search`, `file_search`, ...) that no engine can run.
#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum HostedTools {
    /// Drop them from the request and log a line.
    #[default]
    Drop,
    /// Refuse the request with 400 (`param: "tools"`).
    Reject,
}

/// `[routing]` section: how sessions are identified, and the live endpoint state routing reads
/// (health probes, engine metrics scrapes, saturation limits, endpoints-file polling).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// Request header that names a session (checked before the agents' native headers).
    pub session_header: String,
    /// Also read the native session headers of Claude Code, Codex and OpenCode.
    pub native_session_headers: bool,
    /// How often each endpoint's `/metrics` is scraped, in milliseconds; 0 disables scraping
    /// (and with it the staleness rule).
    pub scrape_interval_ms: u64,
    /// A scrape older than this counts as saturated, in milliseconds; default 5x
    /// `scrape_interval_ms`, and at least twice `scrape_interval_ms + probe_timeout_ms` (the
    /// longest two scrapes of an endpoint can be apart, when another endpoint times out).
    pub metrics_staleness_ms: Option<u64>,
    /// How often each endpoint's `/health` is probed, in milliseconds; 0 disables probing.
    pub health_interval_ms: u64,
    /// Longest wait for one metrics scrape, in milliseconds.
    pub probe_timeout_ms: u64,
    /// Longest wait for one health probe (`/health`, then `/v1/models`), in milliseconds.
    /// SGLang's `/health` runs a one-token generation and answers a second or more later.
    pub health_timeout_ms: u64,
    /// Consecutive failed probes after which an endpoint is taken out.
    pub unhealthy_after: u32,
    /// Consecutive good probes after which an unhealthy endpoint returns.
    pub healthy_after: u32,
    /// Engine queue depth (requests waiting) at which an endpoint is saturated.
    pub saturation_queue_depth: f64,
    /// Engine KV-cache usage (0..=1) at which an endpoint with requests waiting is saturated.
    pub saturation_kv_usage: f64,
    /// How often an `endpoints_file` is checked for changes (its file stamp: modification and status-change times, length, inode), in milliseconds.
    pub discovery_interval_ms: u64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        let saturation = agentgate_scheduler::Saturation::default();
        RoutingConfig {
            session_header: "x-session-id".into(),
            native_session_headers: true,
            scrape_interval_ms: 1_000,
            metrics_staleness_ms: None,
            health_interval_ms: 2_000,
            probe_timeout_ms: 1_000,
            health_timeout_ms: 5_000,
            unhealthy_after: 2,
            healthy_after: 1,
            saturation_queue_depth: saturation.max_waiting,
            saturation_kv_usage: saturation.max_kv_usage,
            discovery_interval_ms: 1_000,
        }
    }
}

impl RoutingConfig {
    /// The scrape interval, or None when scraping is disabled.
    pub fn scrape_interval(&self) -> Option<Duration> {
        (self.scrape_interval_ms > 0).then(|| Duration::from_millis(self.scrape_interval_ms))
    }

    /// The health probe interval, or None when probing is disabled.
    pub fn health_interval(&self) -> Option<Duration> {
        (self.health_interval_ms > 0).then(|| Duration::from_millis(self.health_interval_ms))
    }

    /// Age past which a scrape counts as stale, or None when scraping is disabled.
    pub fn metrics_staleness(&self) -> Option<Duration> {
        self.scrape_interval()?;
        let ms = self.metrics_staleness_ms.unwrap_or_else(|| {
            let gap = self
                .scrape_interval_ms
                .saturating_add(self.probe_timeout_ms);
            self.scrape_interval_ms
                .saturating_mul(5)
                .max(gap.saturating_mul(2))
        });
        Some(Duration::from_millis(ms))
    }

    /// The saturation limits for a pool whose engines speak `flavor`: engines without known
    /// metrics (`openai`) are never scraped, so the staleness rule does not apply to them.
    pub fn saturation(&self, flavor: Flavor) -> agentgate_scheduler::Saturation {
        agentgate_scheduler::Saturation {
            max_waiting: self.saturation_queue_depth,
            max_kv_usage: self.saturation_kv_usage,
            staleness: if flavor == Flavor::Openai {
                None
            } else {
                self.metrics_staleness()
            },
        }
    }
}

/// `[tools]` section.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ToolsConfig {
    /// `drop` (default) or `reject`.
    pub hosted: HostedTools,
}

/// `[compaction]` section (see `agentgate_adapters::compaction`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompactionConfig {
    /// The user message that asks the model for the summary.
    pub prompt: String,
    /// Most tokens the summary may take.
    pub max_output_tokens: u64,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        let defaults = agentgate_adapters::CompactionOptions::default();
        CompactionConfig {
            prompt: defaults.prompt,
            max_output_tokens: defaults.max_output_tokens,
        }
    }
}

/// `[upstream]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP connect timeout to an engine, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Longest wait for the first byte of an engine's answer (queueing plus prefill), in seconds.
    pub first_byte_timeout_s: f64,
    /// Longest silence between two streamed events, in seconds (keep-alive comments and chunks
    /// without choices, usage or an error do not break it).
    pub idle_timeout_s: f64,
    /// The environment variable holding the bearer key sent to every engine (vLLM and SGLang
    /// started with `--api-key`, an OpenAI-compatible service); read at start, so the key
    /// stays out of the file. None: no key is sent.
    pub api_key_env: Option<String>,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 2_000,
            first_byte_timeout_s: 600.0,
            idle_timeout_s: 120.0,
            api_key_env: None,
        }
    }
}

impl UpstreamConfig {
    /// The engines' key, from the variable `api_key_env` names (None when it names none).
    fn api_key(&self) -> Result<Option<String>, ConfigError> {
        let Some(name) = &self.api_key_env else {
            return Ok(None);
        };
        match std::env::var(name) {
            Ok(key) if !key.trim().is_empty() => Ok(Some(key.trim().to_string())),
            Ok(_) => Err(err(
                "upstream.api_key_env",
                format!("the environment variable {name} is empty"),
            )),
            Err(_) => Err(err(
                "upstream.api_key_env",
                format!("the environment variable {name} is not set (or not UTF-8)"),
            )),
        }
    }
}

/// `[background]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackgroundConfig {
    /// Background responses run at most this many at once per gateway process; the rest wait
    /// in `queued`, so detached work never crowds out interactive requests.
    pub max_concurrent: usize,
    /// Background responses that may wait for a run slot per gateway process; one more is
    /// refused with 429 `too_many_background_responses` (each waiting run holds its request
    /// in memory until it starts).
    pub max_queued: usize,
    /// Background responses one team may hold per gateway process, running and waiting, so
    /// one team cannot take every place of `max_concurrent + max_queued`; 0: no bound beyond
    /// those.
    pub max_per_team: usize,
    /// A background response still `queued` or `in_progress` whose gateway has not renewed
    /// its run's lease in the store for this long (the gateway died, or lost the store) is
    /// stored `failed` (code `server_error`) by the next read of it on any gateway; the
    /// running gateway renews the lease every third of it.
    pub orphaned_after_s: f64,
    /// A background response's event log (every streamed event, which a client resumes a
    /// stream from) is kept this long once the response has ended, at most `store.ttl_days`;
    /// a stream resumed later ends with the stored response.
    pub event_log_ttl_s: f64,
    /// Streams one team may hold open at once per gateway process following background
    /// responses' events (`GET /v1/responses/{id}?stream=true`); one more is refused with 429
    /// `too_many_follows`. Each polls the store every 200 ms; 0: no bound.
    pub max_follows_per_team: usize,
}

impl BackgroundConfig {
    /// [`BackgroundConfig::orphaned_after_s`] as a duration.
    pub fn orphaned_after(&self) -> Duration {
        seconds(self.orphaned_after_s)
    }
}

impl Default for BackgroundConfig {
    fn default() -> Self {
        BackgroundConfig {
            max_concurrent: 4,
            max_queued: 1024,
            max_per_team: 0,
            orphaned_after_s: 30.0,
            event_log_ttl_s: 3600.0,
            max_follows_per_team: 64,
        }
    }
}

/// `[[pools]]` entry: engines serving one model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Pool name, for logs and metrics.
    pub name: String,
    /// Model name the engines serve (sent upstream as `model`).
    pub model: String,
    /// Other model names clients may use for this pool (e.g. the name a coding agent is set to).
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Engine protocol flavor: `vllm`, `sglang` or `openai`.
    #[serde(default = "default_flavor")]
    pub flavor: Flavor,
    /// Engines: base URLs (`http://10.0.0.5:8000`) or tables `{url, role, bootstrap_port,
    /// labels}` (see [`EndpointEntry`]).
    #[serde(default)]
    pub endpoints: Vec<EndpointEntry>,
    /// Routing policy: `session` (default), `prefix`, `least_loaded` or `round_robin`.
    #[serde(default = "default_policy")]
    pub policy: String,
    /// For the `prefix` policy: bytes of prompt text per engine token (sizes the prefix index
    /// from the engine's KV capacity; about 4 for BPE tokenizers on English and code).
    #[serde(default = "default_bytes_per_token")]
    pub prefix_bytes_per_token: usize,
    /// Start simulated replicas in-process for this pool (no GPU needed).
    #[serde(default)]
    pub simulate: Option<SimulateConfig>,
    /// `[pools.scoring]`: scorer weights and the pin rule's constants for the `prefix` and
    /// `session` policies; unset keys keep the policy's defaults.
    #[serde(default)]
    pub scoring: ScoringToml,
    /// Role of the pool's endpoints: `both` (default), `prefill` or `decode`. An endpoints-file
    /// entry may override it with the `llm-d.ai/role` label.
    #[serde(default = "default_role")]
    pub role: String,
    /// Labels given to every endpoint of the pool (an endpoints-file entry's own labels win).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// A watched endpoints file (YAML or JSON, `endpoints: [{name, address, port, labels}]`),
    /// reloaded when it changes. A relative path is resolved against the config file's folder.
    #[serde(default)]
    pub endpoints_file: Option<PathBuf>,
    /// `[pools.disaggregation]`: when requests of a pool with prefill endpoints are prefilled
    /// remotely, and how sub-agent calls are recognised.
    #[serde(default)]
    pub disaggregation: DisaggregationConfig,
    /// Send each request's flow-control band priority to the engines in the body's
    /// `priority` field, so an engine's own queue orders by band too: vLLM started with
    /// `--scheduling-policy priority` (lower runs first: the gateway sends minus the band's
    /// priority), SGLang with `--enable-priority-scheduling` (higher first: sent as is).
    /// vLLM refuses a non-zero priority without that flag, so this is off by default.
    #[serde(default)]
    pub engine_priority: bool,
    /// The model takes images: an image a tool returns (a screenshot tool, Codex's
    /// `view_image`) is sent to it as an image (vLLM and SGLang). Off, a text-only model is
    /// told `[image]` instead, which it can read; images a user sends go to the engine either
    /// way.
    #[serde(default)]
    pub vision: bool,
    /// Images may be given by `http(s)` URL, which the engine fetches (vLLM, SGLang); false:
    /// only inline `data:` URLs are taken, so clients cannot make the engines fetch addresses
    /// inside their network (a user's other image is refused with 400, a tool's is named
    /// `[image]`).
    #[serde(default = "default_true")]
    pub remote_images: bool,
    /// The `reasoning_effort` values the pool's engines take, for releases that take fewer
    /// than OpenAI's seven (vLLM and SGLang before late 2025: `["low", "medium", "high"]`):
    /// another effort is sent as the nearest of these (`none` and `minimal` as `low`, `xhigh`
    /// as `high`). Unset: every effort is sent as asked.
    #[serde(default)]
    pub reasoning_efforts: Option<Vec<String>>,
}

fn default_true() -> bool {
    true
}

/// The label carrying an SGLang prefill endpoint's bootstrap port (an endpoints-file entry
/// may set it; a config table's `bootstrap_port` sets it).
pub const BOOTSTRAP_PORT_LABEL: &str = "agentgate.io/bootstrap-port";

/// Labels an endpoint may carry: names not empty, and a [`BOOTSTRAP_PORT_LABEL`] that is a
/// port number (a bad one would send every split request's decode leg to the wrong port).
pub fn check_labels<'a>(
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<(), String> {
    for (name, value) in labels {
        if name.trim().is_empty() {
            return Err("label names must not be empty".into());
        }
        if name == BOOTSTRAP_PORT_LABEL && !value.trim().parse::<u16>().is_ok_and(|p| p > 0) {
            return Err(format!(
                "{BOOTSTRAP_PORT_LABEL} must be a port number (1-65535), not `{value}`"
            ));
        }
    }
    Ok(())
}

/// One entry of a pool's `endpoints`: a base URL, or a table naming its role and more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointEntry {
    /// `"http://10.0.0.5:8000"`: the pool's role and labels.
    Url(String),
    /// `{url = "...", role = "prefill", bootstrap_port = 8998, labels = {...}}`.
    Table(EndpointTable),
}

/// The table form of an [`EndpointEntry`].
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EndpointTable {
    /// Engine base URL.
    pub url: String,
    /// `both`, `prefill` or `decode`; default the pool's `role`.
    #[serde(default)]
    pub role: Option<String>,
    /// SGLang prefill endpoints: the port of the engine's bootstrap server
    /// (`--disaggregation-bootstrap-port`); default `disaggregation.bootstrap_port`, else
    /// SGLang's default, 8998.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Labels of this endpoint, laid over the pool's.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl EndpointEntry {
    /// The base URL.
    pub fn url(&self) -> &str {
        match self {
            EndpointEntry::Url(url) => url,
            EndpointEntry::Table(t) => &t.url,
        }
    }

    /// The endpoint's role (`default` when the entry names none or an unknown one; validation
    /// rejects unknown names).
    pub fn role(&self, default: Role) -> Role {
        match self {
            EndpointEntry::Table(EndpointTable {
                role: Some(name), ..
            }) => Role::parse(name).unwrap_or(default),
            _ => default,
        }
    }

    /// The pool's labels with the entry's laid over them, and its bootstrap port as
    /// [`BOOTSTRAP_PORT_LABEL`].
    pub fn labels(&self, pool: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut labels = pool.clone();
        if let EndpointEntry::Table(t) = self {
            labels.extend(t.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
            if let Some(port) = t.bootstrap_port {
                labels.insert(BOOTSTRAP_PORT_LABEL.to_string(), port.to_string());
            }
        }
        labels
    }
}

impl From<&str> for EndpointEntry {
    fn from(url: &str) -> Self {
        EndpointEntry::Url(url.to_string())
    }
}

impl<'de> Deserialize<'de> for EndpointEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntryVisitor;
        impl<'de> serde::de::Visitor<'de> for EntryVisitor {
            type Value = EndpointEntry;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a base URL string or a table {url, role, bootstrap_port, labels}")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<EndpointEntry, E> {
                Ok(EndpointEntry::Url(v.to_string()))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<EndpointEntry, A::Error> {
                EndpointTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(EndpointEntry::Table)
            }
        }
        d.deserialize_any(EntryVisitor)
    }
}

/// `[pools.disaggregation]` (formulas in `agentgate_scheduler::disagg`). Applies to pools with
/// prefill endpoints; a pool without any runs every request whole.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggregationConfig {
    /// Prefill remotely only when more than this many prompt tokens are not cached on the
    /// chosen decode endpoint.
    pub threshold_tokens: u64,
    /// Header naming the parent session of a sub-agent's call (its value: the parent's
    /// session id as the parent sends it in its session header).
    pub parent_header: String,
    /// Also recognise sub-agents by Codex's, Claude Code's and OpenCode's native headers.
    pub native_parent_headers: bool,
    /// Recognise sub-agents whose headers name no parent by the prefix their prompt shares
    /// with an active session (`agentgate_scheduler::prefix_lineage`).
    pub parent_by_prefix: bool,
    /// Tokens a prompt must share with its parent's beyond any prefix shared by unrelated
    /// sessions (a team's system prompt and tools).
    pub parent_prefix_min_tokens: u64,
    /// A parent found by prefix must have sent a request within this many seconds.
    pub parent_active_s: u64,
    /// SGLang: bootstrap port of prefill endpoints that do not set their own; default SGLang's
    /// own, 8998.
    pub bootstrap_port: Option<u16>,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        DisaggregationConfig {
            threshold_tokens: agentgate_scheduler::disagg::DEFAULT_THRESHOLD_TOKENS,
            parent_header: agentgate_scheduler::lineage::DEFAULT_PARENT_HEADER.into(),
            native_parent_headers: true,
            parent_by_prefix: true,
            parent_prefix_min_tokens: agentgate_scheduler::prefix_lineage::DEFAULT_MIN_TOKENS,
            parent_active_s: agentgate_scheduler::prefix_lineage::DEFAULT_ACTIVE_S,
            bootstrap_port: None,
        }
    }
}

impl PoolConfig {
    /// The pool's role (`both` when the configured name is unknown; validation rejects that).
    pub fn role(&self) -> Role {
        Role::parse(&self.role).unwrap_or_default()
    }
}

fn default_role() -> String {
    Role::Both.name().into()
}

/// `[pools.scoring]` (see `agentgate_scheduler::pipeline` for the formulas).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoringToml {
    /// Weight per scorer: `session_pin`, `prefix`, `queue`, `kv_usage`, `in_flight_tokens`.
    #[serde(default)]
    pub weights: std::collections::BTreeMap<String, f64>,
    /// Anti-herding: an endpoint above this many times the mean in-flight count loses its
    /// prefix score.
    pub herd_factor: Option<f64>,
    /// Anti-herding: slack added to that threshold, in requests.
    pub herd_slack: Option<f64>,
    /// Pin rule: prefill tokens charged per request waiting in an engine's queue.
    pub queue_penalty_tokens: Option<f64>,
    /// Pin rule: prefill tokens by which moving must win before a pin breaks.
    pub pin_hysteresis_tokens: Option<f64>,
}

impl ScoringToml {
    /// The policy's defaults with this table's values laid over them.
    pub fn resolve(
        &self,
        policy: agentgate_scheduler::Policy,
    ) -> agentgate_scheduler::ScoringConfig {
        let mut s = agentgate_scheduler::ScoringConfig::for_policy(policy);
        for (name, weight) in &self.weights {
            s.weights.insert(name.clone(), *weight);
        }
        if let Some(v) = self.herd_factor {
            s.herd_factor = v;
        }
        if let Some(v) = self.herd_slack {
            s.herd_slack = v;
        }
        if let Some(v) = self.queue_penalty_tokens {
            s.queue_penalty_tokens = v;
        }
        if let Some(v) = self.pin_hysteresis_tokens {
            s.pin_hysteresis_tokens = v;
        }
        s
    }
}

fn default_bytes_per_token() -> usize {
    4
}

fn default_policy() -> String {
    "session".into()
}

fn default_flavor() -> Flavor {
    Flavor::Vllm
}

/// `[pools.simulate]`: in-process simulated replicas (see `agentgate-sim --help` for the model).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulateConfig {
    /// How many replicas to start.
    pub replicas: usize,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity per replica, in blocks.
    pub kv_blocks: u64,
    /// Most sequences running at once per replica.
    pub max_num_seqs: u32,
    /// Prefill speed, tokens per simulated second.
    pub prefill_tokens_per_s: f64,
    /// Decode time per token at batch size 1, simulated milliseconds.
    pub decode_ms_per_token: f64,
    /// Wall seconds per simulated second (0 = no delays).
    pub time_scale: f64,
    /// How many prefill-only replicas to start (besides `replicas`, which are aggregated).
    pub prefill_replicas: usize,
    /// How many decode-only replicas to start.
    pub decode_replicas: usize,
}

/// Most simulated replicas one pool may start.
pub const MAX_SIMULATED_REPLICAS: usize = 64;

impl SimulateConfig {
    /// Every replica to start, of every role.
    pub fn total_replicas(&self) -> usize {
        self.replicas
            .saturating_add(self.prefill_replicas)
            .saturating_add(self.decode_replicas)
    }
}

impl Default for SimulateConfig {
    fn default() -> Self {
        SimulateConfig {
            replicas: 2,
            block_size: 16,
            kv_blocks: 4096,
            max_num_seqs: 64,
            prefill_tokens_per_s: 20_000.0,
            decode_ms_per_token: 20.0,
            time_scale: 1.0,
            prefill_replicas: 0,
            decode_replicas: 0,
        }
    }
}

/// SHA-256 of the empty string: never a team's key.
const EMPTY_KEY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// `[[teams]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeamConfig {
    /// Team name (appears in logs and metrics; keys never do).
    pub name: String,
    /// SHA-256 hex digests of the team's API keys (`agentgate hash-key KEY` prints one).
    #[serde(default)]
    pub api_key_sha256: Vec<String>,
    /// The band the team's requests run in unless the client asks for a lower one; required
    /// when more than one `[[bands]]` entry is configured.
    #[serde(default)]
    pub default_band: Option<String>,
    /// Further bands the team may ask for (header `x-agentgate-band` or a mapped
    /// `service_tier`); none may rank above `default_band`, which is always allowed.
    #[serde(default)]
    pub bands: Vec<String>,
    /// Share of a band relative to the other teams waiting in it (dispatched tokens).
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Requests per minute; absent means no limit.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Input + output tokens per minute (estimated at admission); absent means no limit.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Most requests of the team running at once per pool; absent means no limit.
    #[serde(default)]
    pub max_concurrent: Option<u32>,
}

impl TeamConfig {
    /// A team with these key digests and every flow-control setting at its default.
    pub fn new(name: impl Into<String>, api_key_sha256: Vec<String>) -> Self {
        TeamConfig {
            name: name.into(),
            api_key_sha256,
            default_band: None,
            bands: Vec::new(),
            weight: default_weight(),
            requests_per_minute: None,
            tokens_per_minute: None,
            max_concurrent: None,
        }
    }
}

fn default_weight() -> f64 {
    1.0
}

/// Name of the band used when no `[[bands]]` are configured.
pub const IMPLICIT_BAND: &str = "default";

/// `[[bands]]` entry: one flow-control priority band.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandConfig {
    /// Band name (`interactive`, `batch`, ...), unique.
    pub name: String,
    /// Higher is dispatched first; unique (the order between bands is strict).
    pub priority: i32,
    /// While the pool is saturated, new requests of this band are refused at once (429 with
    /// `Retry-After`) instead of queued.
    #[serde(default)]
    pub sheddable: bool,
    /// Most requests waiting in the band; more get 429 `queue_full`. 0: never queue.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// Most bytes of requests waiting in the band (each counts its body, or its engine
    /// request when larger, which holds a stored chain's history); more get 429
    /// `queue_full`, except a request that would wait alone.
    #[serde(default = "default_max_queued_bytes")]
    pub max_queued_bytes: u64,
    /// Longest wait in the queue, in milliseconds, before 503 `queue_timeout`.
    #[serde(default = "default_queue_ttl_ms")]
    pub queue_ttl_ms: u64,
    /// Share of the pool's request slots (0 to below 1) that lower bands leave free for this
    /// band and the ones above it; this band's requests are placed on an endpoint with a free
    /// slot when one exists. 0: nothing held back.
    #[serde(default)]
    pub reserve: f64,
}

fn default_max_queued() -> usize {
    10_000
}

fn default_max_queued_bytes() -> u64 {
    1 << 30
}

fn default_queue_ttl_ms() -> u64 {
    60_000
}

impl BandConfig {
    /// The band used when no `[[bands]]` are configured: `default`, not sheddable, the
    /// defaults of every other key except the queue TTL, which is `queue_ttl_ms`: a gateway
    /// without bands lets a request wait as long as it would have waited for the engine's
    /// first byte.
    pub fn implicit(queue_ttl_ms: u64) -> Self {
        BandConfig {
            name: IMPLICIT_BAND.into(),
            priority: 0,
            sheddable: false,
            max_queued: default_max_queued(),
            max_queued_bytes: default_max_queued_bytes(),
            queue_ttl_ms: queue_ttl_ms.max(1),
            reserve: 0.0,
        }
    }
}

/// `[flow]` section: flow control (see `crate::flow`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlowToml {
    /// Admit requests through flow control (bands, fairness, shedding, rate limits). Off:
    /// every request goes straight to routing, in arrival order.
    pub enabled: bool,
    /// The gateway's own saturation limit: requests in flight per endpoint (the pool holds
    /// this many per available endpoint). Work beyond it waits in the gateway's queues, where
    /// bands and fairness apply, instead of in the engines' FIFO queues. 0: no limit (only the
    /// engines' scraped queue depth, KV usage and staleness gate dispatch).
    pub max_in_flight_per_endpoint: u64,
    /// Most requests of a band below one with a `reserve` that may be waiting for their first
    /// token on one endpoint (this gateway's count); 0: no limit. vLLM's scheduler gives the
    /// prompts already running their prefill chunks before a newly admitted prompt, so with
    /// `--max-num-batched-tokens B` and `--long-prefill-token-threshold T`, `B / T` long
    /// prefills leave nothing of a step for a higher band's new request. Below `B / T` a step
    /// always has a chunk for it; at 1 it shares each step with at most one lower-band chunk,
    /// so its steps take about twice as long as alone.
    pub max_prefilling_per_endpoint: u64,
    /// Largest share of an engine's KV capacity (`vllm:cache_config_info`, `sglang:max_total_num_tokens`) the prompts this
    /// gateway has in flight there may span together, each shared prefix counted once (policies
    /// with a prefix index: `prefix`, `session`), for bands without a reserve of their own; 0:
    /// no limit. Past it the endpoint takes no
    /// more queued work: what the engine could not hold at once waits in the gateway, where the
    /// turns of sessions whose context is still cached go first, instead of in the engine,
    /// where each admitted prompt evicts the contexts of the requests queued behind it. The
    /// KV the engine reports in use beyond what the gateways account for, and the working set
    /// other gateways publish (`exchange_interval_ms`), count against it too: give every
    /// gateway in front of the same engines the same value.
    pub max_kv_working_set: f64,
    /// A session with a request in flight within this many seconds is active: its next turn
    /// goes ahead of new sessions of the same team.
    pub turn_window_s: f64,
    /// Head start of continuing turns over new sessions, seconds: a continuing turn is ordered
    /// as if it had arrived this much earlier, so no new session waits more than this behind
    /// arrival order; 0 turns turn-first ordering off.
    pub aging_s: f64,
    /// Grow the head start to twice the band's typical queue wait when that is longer than
    /// `aging_s` (a moving average over about the last 16 dispatches).
    pub aging_follows_wait: bool,
    /// Longest a queued request waits, once passed over, for a free slot on the endpoint its
    /// session is pinned to while requests for other endpoints go ahead, seconds; then it is
    /// dispatched to an endpoint with room for its band, if there is one. Applies in bands
    /// without a `reserve`; 0 dispatches in queue order whatever the endpoint.
    pub pin_wait_s: f64,
    /// How often, in milliseconds, the gateway exchanges with the other gateways in front of
    /// the same pools, through the store, what it holds there: its KV working set on each
    /// endpoint and its warmest queued turn for it, and the sessions it just served (see
    /// `crate::exchange`). 0: no exchange; several gateways then see each other's KV only in
    /// the engines' scraped usage, and each orders only its own queue. Read at start (a
    /// reload does not change it); give every gateway in front of the same pools the same
    /// value.
    pub exchange_interval_ms: u64,
    /// Responses `service_tier` values mapped to bands, e.g. `{ flex = "batch" }`. Unmapped
    /// values (`auto`, `default`, ...) run in the team's default band.
    pub service_tier: BTreeMap<String, String>,
    /// Probabilistic shedding: saturation (see `crate::flow`) at which sheddable requests
    /// start being shed. Unset with `shed_full`: shed every sheddable request while saturated.
    pub shed_start: Option<f64>,
    /// Probabilistic shedding: saturation at which every sheddable request is shed.
    pub shed_full: Option<f64>,
    /// `Retry-After` sent with shed, queue-full and queue-timeout rejections, in seconds.
    pub retry_after_s: f64,
    /// Output tokens assumed for a request without `max_output_tokens`, in its cost (fair
    /// queuing and `tokens_per_minute`).
    pub default_max_output_tokens: u64,
}

impl Default for FlowToml {
    fn default() -> Self {
        FlowToml {
            enabled: true,
            max_in_flight_per_endpoint: 64,
            max_prefilling_per_endpoint: 0,
            max_kv_working_set: 0.6,
            turn_window_s: 60.0,
            aging_s: 10.0,
            aging_follows_wait: true,
            pin_wait_s: 10.0,
            exchange_interval_ms: 100,
            service_tier: BTreeMap::new(),
            shed_start: None,
            shed_full: None,
            retry_after_s: 1.0,
            default_max_output_tokens: 1024,
        }
    }
}

/// A configuration problem: the key it concerns and what is wrong.
#[derive(Debug)]
pub struct ConfigError {
    /// Dotted path of the offending key (`pools[0].endpoints[1]`); empty for the file as a
    /// whole (it cannot be read).
    pub key: String,
    /// What is wrong and how to fix it.
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.key.is_empty() {
            // (The file as a whole: the caller names it.)
            true => f.write_str(&self.reason),
            false => write!(f, "config key `{}`: {}", self.key, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        reason: reason.into(),
    }
}

impl Config {
    /// Read, parse and validate a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let stamp = FileStamp::of(path);
        let text =
            std::fs::read_to_string(path).map_err(|e| err("", format!("cannot read file: {e}")))?;
        Config::from_file_text(path, &text, stamp)
    }

    /// Parse and validate `text`, read from `path` when it had `stamp`.
    pub fn from_file_text(
        path: &Path,
        text: &str,
        stamp: Option<FileStamp>,
    ) -> Result<Config, ConfigError> {
        let mut config = Config::parse(text)?;
        config.restart_sections = config.restart_signature();
        config.source = Some(path.to_path_buf());
        config.source_stamp = stamp;
        let base = path.parent().unwrap_or(Path::new(""));
        for pool in &mut config.pools {
            if let Some(file) = pool.endpoints_file.as_mut() {
                if file.is_relative() {
                    *file = base.join(&*file);
                }
            }
        }
        Ok(config)
    }

    /// The settings a reload cannot apply, as parsed (defaults filled in), one entry per
    /// section (`[server]`, `[[pools]]`, ...) and `flow.exchange_interval_ms`: two files that
    /// say the same thing differently (`30` and `30.0`, a default written out) compare equal.
    fn restart_signature(&self) -> toml::Table {
        let sections: [(&str, String); 8] = [
            ("server", format!("{:?}", self.server)),
            ("store", format!("{:?}", self.store)),
            ("tools", format!("{:?}", self.tools)),
            ("compaction", format!("{:?}", self.compaction)),
            ("routing", format!("{:?}", self.routing)),
            ("upstream", format!("{:?}", self.upstream)),
            ("background", format!("{:?}", self.background)),
            ("pools", format!("{:?}", self.pools)),
        ];
        let mut table: toml::Table = sections
            .into_iter()
            .map(|(name, parsed)| (name.to_string(), toml::Value::String(parsed)))
            .collect();
        table.insert(
            "flow.exchange_interval_ms".into(),
            toml::Value::Integer(i64::try_from(self.flow.exchange_interval_ms).unwrap_or(i64::MAX)),
        );
        table
    }

    /// Parse and validate configuration text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let key = e
                .span()
                .map(|s| locate_key(text, s.start))
                .unwrap_or_else(|| "(file)".into());
            err(key, e.message().to_string())
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Check cross-field rules the types cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.server.max_body_bytes < 1024 {
            return Err(err("server.max_body_bytes", "must be at least 1024"));
        }
        if let Some(url) = &self.store.url {
            if url.starts_with("rediss://") {
                return Err(err(
                    "store.url",
                    "rediss:// (Redis over TLS) is not supported by this build; use redis:// \
                     (a TLS tunnel such as stunnel beside the gateway can carry it)",
                ));
            }
            if !url.starts_with("redis://") {
                return Err(err(
                    "store.url",
                    "must be a redis:// URL such as redis://127.0.0.1:6379/0 (omit it for the in-memory store)",
                ));
            }
        }
        if self.compaction.prompt.trim().is_empty() {
            return Err(err("compaction.prompt", "must not be empty"));
        }
        if self.compaction.max_output_tokens == 0 {
            return Err(err("compaction.max_output_tokens", "must be at least 1"));
        }
        // Bounded so that a TTL in milliseconds stays a valid Redis expiry.
        if !(self.store.ttl_days > 0.0 && self.store.ttl_days <= 36_500.0) {
            return Err(err(
                "store.ttl_days",
                "must be a positive number of days, at most 36500",
            ));
        }
        if !(self.store.pin_ttl_s > 0.0 && self.store.pin_ttl_s <= 1e9) {
            return Err(err(
                "store.pin_ttl_s",
                "must be a positive number of seconds, at most 1e9",
            ));
        }
        if (1..20).contains(&self.store.conversation_max_items) {
            return Err(err(
                "store.conversation_max_items",
                "must be 0 (no bound) or at least 20 (a conversation may be created with 20 items)",
            ));
        }
        // Empty: no configured header (only the native ones, when on, and the body's keys).
        if !self
            .routing
            .session_header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(err(
                "routing.session_header",
                "must be a header name (letters, digits, '-' and '_'), or empty to read none",
            ));
        }
        let r = &self.routing;
        if r.scrape_interval_ms > 0 {
            if let Some(staleness) = r.metrics_staleness_ms {
                let gap = r.scrape_interval_ms.saturating_add(r.probe_timeout_ms);
                if staleness < gap {
                    return Err(err(
                        "routing.metrics_staleness_ms",
                        format!(
                            "must be at least routing.scrape_interval_ms + routing.probe_timeout_ms ({gap} ms): a scrape round lasts until its slowest endpoint answers or times out, so two scrapes of an endpoint can be that far apart, and a shorter limit would count healthy endpoints saturated whenever one endpoint is unreachable"
                        ),
                    ));
                }
            }
        }
        self.upstream.api_key()?;
        if self.upstream.connect_timeout_ms == 0 {
            return Err(err("upstream.connect_timeout_ms", "must be at least 1"));
        }
        if r.probe_timeout_ms == 0 {
            return Err(err("routing.probe_timeout_ms", "must be at least 1"));
        }
        if r.health_timeout_ms == 0 {
            return Err(err("routing.health_timeout_ms", "must be at least 1"));
        }
        if r.unhealthy_after == 0 {
            return Err(err("routing.unhealthy_after", "must be at least 1"));
        }
        if r.healthy_after == 0 {
            return Err(err("routing.healthy_after", "must be at least 1"));
        }
        if !(r.saturation_queue_depth.is_finite() && r.saturation_queue_depth > 0.0) {
            return Err(err(
                "routing.saturation_queue_depth",
                "must be a positive number of waiting requests",
            ));
        }
        if !(r.saturation_kv_usage > 0.0 && r.saturation_kv_usage <= 1.0) {
            return Err(err(
                "routing.saturation_kv_usage",
                "must be a fraction in (0, 1], e.g. 0.98",
            ));
        }
        if r.discovery_interval_ms == 0 {
            return Err(err("routing.discovery_interval_ms", "must be at least 1"));
        }
        if self.background.orphaned_after_s < 1.0 {
            // Renewed every third of it: shorter would have every run's lease renewed many
            // times a second, and lapse at the first slow store reply.
            return Err(err(
                "background.orphaned_after_s",
                "must be at least 1 (seconds)",
            ));
        }
        if self.background.max_concurrent == 0 {
            return Err(err("background.max_concurrent", "must be at least 1"));
        }
        if self.background.max_concurrent > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(err(
                "background.max_concurrent",
                format!("must be at most {}", tokio::sync::Semaphore::MAX_PERMITS),
            ));
        }
        let grace = self.server.shutdown_grace_s;
        if !(grace.is_finite() && (0.0..=MAX_SECONDS).contains(&grace)) {
            return Err(err(
                "server.shutdown_grace_s",
                "must be a number of seconds from 0 to 1e9",
            ));
        }
        // Linux takes at most 32767 s before the first probe.
        let keepalive = self.server.tcp_keepalive_s;
        if !(keepalive.is_finite() && (0.0..=32_767.0).contains(&keepalive)) {
            return Err(err(
                "server.tcp_keepalive_s",
                "must be a number of seconds from 0 to 32767",
            ));
        }
        for (key, value) in [
            (
                "upstream.first_byte_timeout_s",
                self.upstream.first_byte_timeout_s,
            ),
            ("upstream.idle_timeout_s", self.upstream.idle_timeout_s),
            (
                "server.client_stall_timeout_s",
                self.server.client_stall_timeout_s,
            ),
            (
                "server.header_read_timeout_s",
                self.server.header_read_timeout_s,
            ),
            (
                "background.orphaned_after_s",
                self.background.orphaned_after_s,
            ),
            (
                "background.event_log_ttl_s",
                self.background.event_log_ttl_s,
            ),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= MAX_SECONDS) {
                return Err(err(
                    key,
                    "must be a positive number of seconds, at most 1e9",
                ));
            }
        }
        if self.pools.is_empty() {
            return Err(err(
                "pools",
                "at least one [[pools]] entry is needed (see examples/quickstart.toml)",
            ));
        }
        let mut models = std::collections::HashSet::new();
        let mut pool_names = std::collections::HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let at = |k: &str| format!("pools[{i}].{k}");
            if pool.name.trim().is_empty() {
                return Err(err(at("name"), "must not be empty"));
            }
            // Flow control, session pins and endpoint names (`{pool}/{j}`) are keyed by it.
            if !pool_names.insert(pool.name.clone()) {
                return Err(err(at("name"), "pool names must be unique"));
            }
            if pool.model.trim().is_empty() {
                return Err(err(at("model"), "must not be empty"));
            }
            for name in std::iter::once(&pool.model).chain(pool.aliases.iter()) {
                if !models.insert(name.clone()) {
                    return Err(err(
                        at("model"),
                        format!(
                            "model name `{name}` is served by two pools; each name needs one pool"
                        ),
                    ));
                }
            }
            if pool.prefix_bytes_per_token == 0 {
                return Err(err(at("prefix_bytes_per_token"), "must be at least 1"));
            }
            let policy = agentgate_scheduler::Policy::parse(&pool.policy)
                .map_err(|reason| err(at("policy"), reason))?;
            // Checked under every policy: the baselines do not score, but a P/D pool's prefill
            // picker uses the pin rule's numbers whatever the policy, and a typo should not
            // wait for a policy change to surface.
            let scoring = pool.scoring.resolve(policy);
            scoring
                .validate()
                .map_err(|reason| err(at("scoring"), reason))?;
            policy
                .picker(agentgate_scheduler::PrefixIndexConfig::default(), &scoring)
                .map_err(|reason| err(at("scoring"), reason))?;
            Role::parse(&pool.role).map_err(|reason| err(at("role"), reason))?;
            for (j, effort) in pool.reasoning_efforts.iter().flatten().enumerate() {
                use agentgate_adapters::REASONING_EFFORTS as EFFORTS;
                if !EFFORTS.contains(&effort.as_str()) {
                    return Err(err(
                        at(&format!("reasoning_efforts[{j}]")),
                        format!(
                            "`{effort}` is not a reasoning effort (one of {})",
                            EFFORTS.join(", ")
                        ),
                    ));
                }
            }
            if pool.engine_priority && pool.flavor == Flavor::Openai {
                return Err(err(
                    at("engine_priority"),
                    "only vLLM and SGLang take a request priority: use flavor \"vllm\" or \"sglang\" for an engine started with priority scheduling",
                ));
            }
            check_labels(&pool.labels).map_err(|reason| err(at("labels"), reason))?;
            if pool.labels.contains_key(crate::discovery::ROLE_LABEL) {
                return Err(err(
                    at("labels"),
                    format!(
                        "{} is read from each endpoint's own labels; set the pool's `role` instead",
                        crate::discovery::ROLE_LABEL
                    ),
                ));
            }
            if let Some(file) = &pool.endpoints_file {
                if file.as_os_str().is_empty() {
                    return Err(err(
                        at("endpoints_file"),
                        "must be a path to a YAML or JSON endpoints file",
                    ));
                }
            }
            let simulated = pool
                .simulate
                .as_ref()
                .map_or(0, SimulateConfig::total_replicas);
            if pool.endpoints.is_empty() && simulated == 0 && pool.endpoints_file.is_none() {
                return Err(err(
                    at("endpoints"),
                    "a pool needs engine endpoints, an endpoints_file or [pools.simulate] replicas",
                ));
            }
            for (j, entry) in pool.endpoints.iter().enumerate() {
                let ep = entry.url();
                if let EndpointEntry::Table(t) = entry {
                    let key = |k: &str| format!("pools[{i}].endpoints[{j}].{k}");
                    if let Some(role) = &t.role {
                        Role::parse(role).map_err(|reason| err(key("role"), reason))?;
                    }
                    if t.bootstrap_port == Some(0) {
                        return Err(err(
                            key("bootstrap_port"),
                            "must be a port number (1-65535)",
                        ));
                    }
                    check_labels(&t.labels).map_err(|reason| err(key("labels"), reason))?;
                }
                if ep.starts_with("https://") && !cfg!(feature = "upstream-tls") {
                    return Err(err(
                        format!("pools[{i}].endpoints[{j}]"),
                        "https:// engines need a build with TLS: `cargo build --release --features upstream-tls`",
                    ));
                }
                let Some(engine) = engine_of(ep) else {
                    return Err(err(
                        format!("pools[{i}].endpoints[{j}]"),
                        format!("`{ep}` is not an http:// base URL such as http://10.0.0.5:8000"),
                    ));
                };
                // One engine listed twice would count twice (load, capacity, cache affinity).
                let first = pool.endpoints[..j]
                    .iter()
                    .position(|e| engine_of(e.url()).as_ref() == Some(&engine));
                if let Some(first) = first {
                    return Err(err(
                        format!("pools[{i}].endpoints[{j}]"),
                        format!("`{ep}` is listed already, as endpoints[{first}]"),
                    ));
                }
            }
            // An SGLang server in `--disaggregation-mode decode` cannot prefill: a pool of
            // them alone could serve nothing.
            if pool.flavor == Flavor::Sglang
                && pool.endpoints_file.is_none()
                && simulated == 0
                && !pool.endpoints.is_empty()
                && pool
                    .endpoints
                    .iter()
                    .all(|e| e.role(pool.role()) == Role::Decode)
            {
                return Err(err(
                    at("endpoints"),
                    "every endpoint is an SGLang decode server, which cannot prefill: add prefill endpoints (role = \"prefill\") or ones of role \"both\"",
                ));
            }
            let pd = &pool.disaggregation;
            let parent_header = pd.parent_header.trim();
            if !parent_header.is_empty()
                && !parent_header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(err(
                    at("disaggregation.parent_header"),
                    "must be a header name (letters, digits, '-' and '_'), or empty to read none",
                ));
            }
            if pd.parent_active_s == 0 {
                return Err(err(
                    at("disaggregation.parent_active_s"),
                    "must be at least 1 (set parent_by_prefix = false to find no parent by prefix)",
                ));
            }
            if pd.bootstrap_port == Some(0) {
                return Err(err(
                    at("disaggregation.bootstrap_port"),
                    "must be a port number (1-65535)",
                ));
            }
            if let Some(sim) = &pool.simulate {
                if sim.total_replicas() > MAX_SIMULATED_REPLICAS {
                    return Err(err(
                        at("simulate"),
                        format!(
                            "at most {MAX_SIMULATED_REPLICAS} simulated replicas per pool \
                             (replicas + prefill_replicas + decode_replicas)"
                        ),
                    ));
                }
                for (_, replica) in crate::pools::simulated_replicas(pool) {
                    replica.validate().map_err(|e| {
                        // the simulator names its command-line flags; here they are keys
                        let key = e.flag.trim_start_matches("--").replace('-', "_");
                        err(at(&format!("simulate.{key}")), e.reason)
                    })?;
                }
            }
        }
        let mut names = std::collections::HashSet::new();
        let mut key_owners: std::collections::HashMap<String, &str> =
            std::collections::HashMap::new();
        for (i, team) in self.teams.iter().enumerate() {
            if team.name.trim().is_empty() {
                return Err(err(format!("teams[{i}].name"), "must not be empty"));
            }
            if !names.insert(team.name.clone()) {
                return Err(err(format!("teams[{i}].name"), "team names must be unique"));
            }
            for (j, h) in team.api_key_sha256.iter().enumerate() {
                if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(err(
                        format!("teams[{i}].api_key_sha256[{j}]"),
                        "must be a 64-character hex SHA-256 digest (`agentgate hash-key KEY` prints one)",
                    ));
                }
                if h.eq_ignore_ascii_case(EMPTY_KEY_SHA256) {
                    return Err(err(
                        format!("teams[{i}].api_key_sha256[{j}]"),
                        "is the digest of an empty key (was the key's variable unset when it was hashed?)",
                    ));
                }
                let owner = key_owners.insert(h.to_ascii_lowercase(), &team.name);
                if let Some(owner) = owner.filter(|owner| *owner != team.name) {
                    return Err(err(
                        format!("teams[{i}].api_key_sha256[{j}]"),
                        format!("is already a key of team `{owner}`: a key names one team"),
                    ));
                }
            }
        }
        self.validate_flow()
    }

    /// The store TTL as a duration.
    pub fn store_ttl(&self) -> Duration {
        seconds(self.store.ttl_days * 86_400.0)
    }

    /// The options the store is opened with, from `[store]`.
    pub fn store_options(&self) -> agentgate_sessions::StoreOptions {
        agentgate_sessions::StoreOptions {
            ttl: self.store_ttl(),
            key_prefix: self.store.key_prefix.clone(),
            max_memory_bytes: self.store.memory_max_mb.saturating_mul(1 << 20),
            pin_ttl: seconds(self.store.pin_ttl_s),
            ended_log_ttl: seconds(self.background.event_log_ttl_s),
        }
    }

    /// The engine client's settings, from `[upstream]`.
    pub fn client_options(&self) -> agentgate_adapters::ClientOptions {
        agentgate_adapters::ClientOptions {
            connect_timeout: Duration::from_millis(self.upstream.connect_timeout_ms),
            first_byte_timeout: seconds(self.upstream.first_byte_timeout_s),
            idle_timeout: seconds(self.upstream.idle_timeout_s),
            // (Checked by `validate`: a variable gone since reads as no key.)
            api_key: self.upstream.api_key().ok().flatten(),
            ..agentgate_adapters::ClientOptions::default()
        }
    }
}

/// Shortest `flow.pin_wait_s` other than 0: a held turn looks for room again this often.
const MIN_PIN_WAIT_S: f64 = 0.01;

/// Smallest team weight: fair queuing divides a request's cost by it, and a weight near the
/// smallest float would make that cost infinite.
const MIN_TEAM_WEIGHT: f64 = 1e-6;

/// Longest duration any `*_s` key accepts (about 31 years): far beyond any useful timeout, and
/// small enough that a deadline `now + it` never overflows the clock.
const MAX_SECONDS: f64 = 1e9;

/// Seconds as a duration; validation keeps them finite and non-negative, anything else
/// saturates.
fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(if s > 0.0 {
        Duration::MAX
    } else {
        Duration::ZERO
    })
}

/// The flow-control sections (`[[bands]]`, the flow keys of `[[teams]]`, `[flow]`): their
/// validation and the scheduler's policy built from them. These sections reload without a
/// restart (see `crate::reload`).
impl Config {
    /// The configured bands, or the implicit band `default` when none are.
    pub fn flow_bands(&self) -> Vec<BandConfig> {
        if self.bands.is_empty() {
            let first_byte_ms = (self.upstream.first_byte_timeout_s * 1000.0) as u64;
            vec![BandConfig::implicit(first_byte_ms)]
        } else {
            self.bands.clone()
        }
    }

    /// Whether no team lists an API key: the gateway runs open and every request is team
    /// `default` (see `crate::auth`).
    pub fn runs_open(&self) -> bool {
        self.teams.iter().all(|t| t.api_key_sha256.is_empty())
    }

    /// The scheduler's flow-control policy. Each team's allowed bands are its default band
    /// plus `bands`. When the gateway runs open and no team is named `default`, that team is
    /// added with the highest band as its default and every band allowed, so clients may
    /// still ask for a lower band.
    pub fn flow_config(&self) -> agentgate_scheduler::FlowConfig {
        use agentgate_scheduler::flow::{BandSpec, FlowConfig, ShedCurve, TeamSpec};
        let bands = self.flow_bands();
        let mut by_priority: Vec<&BandConfig> = bands.iter().collect();
        by_priority.sort_by_key(|b| std::cmp::Reverse(b.priority));
        let highest = by_priority
            .first()
            .map_or(IMPLICIT_BAND.to_string(), |b| b.name.clone());
        let specs = bands
            .iter()
            .map(|b| BandSpec {
                name: b.name.clone(),
                priority: b.priority,
                sheddable: b.sheddable,
                max_queued: b.max_queued,
                max_queued_bytes: b.max_queued_bytes,
                queue_ttl: Duration::from_millis(b.queue_ttl_ms),
                reserve: b.reserve,
            })
            .collect();
        let mut teams: Vec<TeamSpec> = self
            .teams
            .iter()
            .map(|t| {
                let default_band = t.default_band.clone().unwrap_or_else(|| highest.clone());
                let mut allowed_bands = Vec::new();
                if !t.bands.is_empty() {
                    allowed_bands.push(default_band.clone());
                    for b in &t.bands {
                        if !allowed_bands.contains(b) {
                            allowed_bands.push(b.clone());
                        }
                    }
                }
                TeamSpec {
                    name: t.name.clone(),
                    default_band,
                    allowed_bands,
                    weight: t.weight,
                    max_concurrent: t.max_concurrent,
                    rpm: t.requests_per_minute,
                    tpm: t.tokens_per_minute,
                }
            })
            .collect();
        let open_team = crate::auth::OPEN_TEAM;
        if self.runs_open() && !teams.iter().any(|t| t.name == open_team) {
            let mut team = TeamSpec::new(open_team, highest.clone());
            if by_priority.len() > 1 {
                team.allowed_bands = by_priority.iter().map(|b| b.name.clone()).collect();
            }
            teams.push(team);
        }
        let f = &self.flow;
        let shed_curve = match (f.shed_start, f.shed_full) {
            (Some(start), Some(full)) => ShedCurve::Linear { start, full },
            _ => ShedCurve::Always,
        };
        FlowConfig {
            bands: specs,
            teams,
            turn_window: seconds(f.turn_window_s),
            aging: seconds(f.aging_s),
            aging_follows_wait: f.aging_follows_wait,
            pin_wait: seconds(f.pin_wait_s),
            shed_curve,
            retry_after: seconds(f.retry_after_s),
        }
    }

    /// Check `[[bands]]`, the flow keys of `[[teams]]` and `[flow]`, naming the key at fault.
    fn validate_flow(&self) -> Result<(), ConfigError> {
        let f = &self.flow;
        let seconds_ok = |s: f64| s.is_finite() && (0.0..=MAX_SECONDS).contains(&s);
        for (key, value) in [
            ("flow.turn_window_s", f.turn_window_s),
            ("flow.aging_s", f.aging_s),
            ("flow.pin_wait_s", f.pin_wait_s),
            ("flow.retry_after_s", f.retry_after_s),
        ] {
            if !seconds_ok(value) {
                return Err(err(key, "must be a number of seconds, 0 or more"));
            }
        }
        if f.pin_wait_s > 0.0 && f.pin_wait_s < MIN_PIN_WAIT_S {
            return Err(err(
                "flow.pin_wait_s",
                format!("must be 0 (no wait) or at least {MIN_PIN_WAIT_S} (each waiting turn looks again that often)"),
            ));
        }
        if f.default_max_output_tokens == 0 {
            return Err(err("flow.default_max_output_tokens", "must be at least 1"));
        }
        if f.exchange_interval_ms > 60_000 {
            return Err(err(
                "flow.exchange_interval_ms",
                "must be at most 60000 (a minute); 0 turns the exchange off",
            ));
        }
        if !(f.max_kv_working_set.is_finite() && (0.0..=1.0).contains(&f.max_kv_working_set)) {
            return Err(err(
                "flow.max_kv_working_set",
                format!(
                    "must be a share of the KV capacity between 0 (no limit) and 1, got {}",
                    f.max_kv_working_set
                ),
            ));
        }
        match (f.shed_start, f.shed_full) {
            (Some(_), None) => {
                return Err(err(
                    "flow.shed_full",
                    "must be set with flow.shed_start (or remove both to shed every sheddable request while saturated)",
                ))
            }
            (None, Some(_)) => {
                return Err(err(
                    "flow.shed_start",
                    "must be set with flow.shed_full (or remove both to shed every sheddable request while saturated)",
                ))
            }
            (Some(start), Some(full)) => {
                let ok = (0.0..=1.0).contains(&start) && (0.0..=1.0).contains(&full) && start < full;
                if !ok {
                    return Err(err(
                        "flow.shed_start",
                        format!("need 0 <= shed_start < shed_full <= 1, got {start} and {full}"),
                    ));
                }
            }
            (None, None) => {}
        }
        let mut seen = std::collections::HashSet::new();
        let mut priorities: std::collections::HashMap<i32, &str> = std::collections::HashMap::new();
        for (i, band) in self.bands.iter().enumerate() {
            let at = |k: &str| format!("bands[{i}].{k}");
            if band.name.trim().is_empty() {
                return Err(err(at("name"), "must not be empty"));
            }
            if !seen.insert(band.name.as_str()) {
                return Err(err(
                    at("name"),
                    format!("band `{}` is defined more than once", band.name),
                ));
            }
            if let Some(other) = priorities.insert(band.priority, &band.name) {
                return Err(err(
                    at("priority"),
                    format!(
                        "band `{}` has the same priority ({}) as band `{other}`; priorities must differ, the order between bands is strict",
                        band.name, band.priority
                    ),
                ));
            }
            if band.queue_ttl_ms == 0 {
                return Err(err(
                    at("queue_ttl_ms"),
                    "must be at least 1 (use max_queued = 0 for a band that never queues)",
                ));
            }
            if !(0.0..1.0).contains(&band.reserve) {
                return Err(err(
                    at("reserve"),
                    format!(
                        "must be at least 0 and below 1 (a share of the pool's request slots), got {}",
                        band.reserve
                    ),
                ));
            }
        }
        let bands = self.flow_bands();
        let band = |name: &str| bands.iter().find(|b| b.name == name);
        let names = || {
            bands
                .iter()
                .map(|b| b.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (i, team) in self.teams.iter().enumerate() {
            let at = |k: &str| format!("teams[{i}].{k}");
            let default = match &team.default_band {
                None if bands.len() > 1 => {
                    return Err(err(
                        at("default_band"),
                        format!(
                            "required when several [[bands]] are configured (one of: {})",
                            names()
                        ),
                    ))
                }
                None => &bands[0],
                Some(name) => band(name).ok_or_else(|| {
                    err(
                        at("default_band"),
                        format!(
                            "`{name}` is not a configured band (configured: {})",
                            names()
                        ),
                    )
                })?,
            };
            for (j, name) in team.bands.iter().enumerate() {
                let Some(b) = band(name) else {
                    return Err(err(
                        format!("teams[{i}].bands[{j}]"),
                        format!(
                            "`{name}` is not a configured band (configured: {})",
                            names()
                        ),
                    ));
                };
                if b.priority > default.priority {
                    return Err(err(
                        format!("teams[{i}].bands[{j}]"),
                        format!(
                            "band `{name}` (priority {}) ranks above the team's default band `{}` (priority {}); a team may ask only for bands at or below its default",
                            b.priority, default.name, default.priority
                        ),
                    ));
                }
            }
            if !(team.weight.is_finite() && team.weight >= MIN_TEAM_WEIGHT) {
                return Err(err(
                    at("weight"),
                    format!("must be a number of at least {MIN_TEAM_WEIGHT}"),
                ));
            }
            for (key, zero) in [
                ("requests_per_minute", team.requests_per_minute == Some(0)),
                ("tokens_per_minute", team.tokens_per_minute == Some(0)),
                ("max_concurrent", team.max_concurrent == Some(0)),
            ] {
                if zero {
                    return Err(err(at(key), "must be at least 1; omit it for no limit"));
                }
            }
        }
        for (tier, name) in &f.service_tier {
            if tier.trim().is_empty() {
                return Err(err(
                    "flow.service_tier",
                    "service tier names must not be empty",
                ));
            }
            if band(name).is_none() {
                return Err(err(
                    format!("flow.service_tier.{tier}"),
                    format!(
                        "`{name}` is not a configured band (configured: {})",
                        names()
                    ),
                ));
            }
        }
        self.flow_config()
            .validate()
            .map_err(|e| err("flow", e.to_string()))
    }
}

/// Best-effort dotted key path for a byte offset in TOML text, for error messages.
/// The engine an endpoint URL names: scheme, host (lower case), port (the scheme's default when
/// none is given) and the path of its API root ([`agentgate_adapters::root_url`]); `None`
/// for a URL that is not an http(s) base URL with a host (a query, a fragment or a malformed
/// authority included).
pub(crate) fn engine_of(url: &str) -> Option<(String, String, u16, String)> {
    let parsed = reqwest::Url::parse(agentgate_adapters::root_url(url)).ok()?;
    let scheme = parsed.scheme();
    if !matches!(scheme, "http" | "https")
        || parsed.query().is_some()
        || parsed.fragment().is_some()
    {
        return None;
    }
    let host = parsed
        .host_str()
        .filter(|h| !h.is_empty())?
        .to_ascii_lowercase();
    let port = parsed.port_or_known_default()?;
    let path = parsed.path().trim_end_matches('/').to_string();
    Some((scheme.to_string(), host, port, path))
}

fn locate_key(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    // Up to the end of the line holding the offset (an unknown key's span starts at the key).
    let end = text
        .get(offset..)
        .and_then(|rest| rest.find('\n'))
        .map_or(text.len(), |n| offset + n);
    let upto = text.get(..end).unwrap_or(before);
    let mut table = String::new();
    let mut key = String::new();
    for line in upto.lines() {
        let t = line.trim();
        if t.starts_with('#') {
            continue;
        }
        if t.starts_with('[') {
            table = t.trim_matches(|c| c == '[' || c == ']').trim().to_string();
            key.clear();
        } else if let Some((k, _)) = t.split_once('=') {
            key = k.trim().to_string();
        }
    }
    let line = before.matches('\n').count() + 1;
    match (table.is_empty(), key.is_empty()) {
        (true, true) => format!("line {line}"),
        (true, false) => format!("{key} (line {line})"),
        (false, true) => format!("{table} (line {line})"),
        (false, false) => format!("{table}.{key} (line {line})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[[pools]]
name = "main"
model = "m"
endpoints = ["http://127.0.0.1:8000"]
"#;

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::parse(MINIMAL).unwrap();
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.store.url, None);
        assert_eq!(c.pools[0].flavor, Flavor::Vllm);
        assert_eq!(c.store_ttl(), Duration::from_secs(30 * 86_400));
    }

    #[test]
    fn only_the_sections_a_reload_cannot_apply_are_kept_apart() {
        let at = |flow: &str| {
            Config::from_file_text(
                Path::new("c.toml"),
                &format!("{MINIMAL}\n[flow]\n{flow}"),
                None,
            )
            .unwrap()
            .restart_sections
        };
        let base = at("retry_after_s = 1\n");
        assert!(base.contains_key("pools") && !base.contains_key("flow"));
        // The rest of [flow] reloads; its exchange interval is read at start only.
        assert_eq!(at("retry_after_s = 2\n"), base);
        assert_ne!(at("exchange_interval_ms = 500\n"), base);
        // The same settings written differently are no change: a default written out, a
        // float for an integer-valued one.
        let same = |extra: &str| {
            Config::from_file_text(Path::new("c.toml"), &format!("{extra}{MINIMAL}"), None)
                .unwrap()
                .restart_sections
        };
        assert_eq!(
            same("[store]\nttl_days = 30.0\n[server]\nreload_interval_ms = 1000\n"),
            same("")
        );
        assert_ne!(same("[store]\nttl_days = 7\n"), same(""));
    }

    #[test]
    fn unknown_key_names_the_key() {
        let e = Config::parse(&format!("{MINIMAL}\nlisten_port = 3\n")).unwrap_err();
        assert!(e.to_string().contains("listen_port"), "{e}");
        // The key and line of the unknown key itself, not of the line before it (a comment
        // there is not a key).
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n# listen = \"x\"\nmax_body_byte = 1\n{MINIMAL}"
        );
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "server.max_body_byte (line 4)", "{e}");
    }

    #[test]
    fn bad_endpoint_names_its_path() {
        let text = MINIMAL.replace("http://127.0.0.1:8000", "127.0.0.1:8000");
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "pools[0].endpoints[0]");
        for bad in [
            "http://h:99999",
            "http://:8000",
            "http://a b:80",
            "http://h:80?x=1",
            "http://h:80:90",
            "http://::1:8000",
            "http://[::1]junk",
        ] {
            let e = Config::parse(&MINIMAL.replace("http://127.0.0.1:8000", bad)).unwrap_err();
            assert_eq!(e.key, "pools[0].endpoints[0]", "{bad}");
        }
        // One engine listed twice would count twice.
        let twice = MINIMAL.replace(
            "[\"http://127.0.0.1:8000\"]",
            "[\"http://127.0.0.1:8000\", \"http://127.0.0.1:8000/\"]",
        );
        let e = Config::parse(&twice).unwrap_err();
        assert_eq!(e.key, "pools[0].endpoints[1]", "{e}");
        for (a, b) in [
            ("http://10.0.0.5:8000", "http://10.0.0.5:8000/v1"),
            ("http://h", "http://h:80"),
            ("http://H:8000", "http://h:8000"),
        ] {
            let same = MINIMAL.replace(
                "[\"http://127.0.0.1:8000\"]",
                &format!("[\"{a}\", \"{b}\"]"),
            );
            assert!(Config::parse(&same).is_err(), "{a} and {b} name one engine");
        }
        for good in ["http://[::1]:8000", "http://h:8000/v1", "http://engine"] {
            assert!(
                Config::parse(&MINIMAL.replace("http://127.0.0.1:8000", good)).is_ok(),
                "{good}"
            );
        }
    }

    #[test]
    fn settings_that_cannot_work_are_refused() {
        let e =
            Config::parse(&format!("[upstream]\nconnect_timeout_ms = 0\n{MINIMAL}")).unwrap_err();
        assert_eq!(e.key, "upstream.connect_timeout_ms");
        let e = Config::parse(&format!(
            "[upstream]\napi_key_env = \"AGENTGATE_UNSET_VARIABLE_FOR_TESTS\"\n{MINIMAL}"
        ))
        .unwrap_err();
        assert_eq!(e.key, "upstream.api_key_env");
        assert!(
            e.reason.contains("AGENTGATE_UNSET_VARIABLE_FOR_TESTS"),
            "{e}"
        );
        let e = Config::parse(&format!(
            "[background]\nmax_concurrent = 9223372036854775807\n{MINIMAL}"
        ))
        .unwrap_err();
        assert_eq!(e.key, "background.max_concurrent");
        // Two pools of one name: flow control, pins and endpoint names are keyed by it.
        let text = format!("{MINIMAL}\n{MINIMAL}").replace(
            "model = \"m\"\nendpoints = [\"http://127.0.0.1:8000\"]\n\n",
            "model = \"m2\"\nendpoints = [\"http://127.0.0.1:8000\"]\n\n",
        );
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "pools[1].name", "{e}");
        // SGLang decode servers alone cannot prefill anything.
        let decode_only = format!("{MINIMAL}flavor = \"sglang\"\nrole = \"decode\"\n");
        let e = Config::parse(&decode_only).unwrap_err();
        assert_eq!(e.key, "pools[0].endpoints", "{e}");
        assert!(Config::parse(&decode_only.replace("sglang", "vllm")).is_ok());
    }

    #[test]
    fn bad_value_type_names_the_key() {
        let text = format!("[server]\nmax_body_bytes = \"big\"\n{MINIMAL}");
        let e = Config::parse(&text).unwrap_err();
        assert!(e.key.contains("server.max_body_bytes"), "{e}");
    }

    #[test]
    fn duplicate_model_is_refused() {
        let text = format!("{MINIMAL}\n{MINIMAL}").replacen(
            "name = \"main\"\nmodel",
            "name = \"x\"\nmodel",
            1,
        );
        let e = Config::parse(&text).unwrap_err();
        assert!(e.reason.contains("two pools"), "{e}");
    }

    #[test]
    fn policies_parse_and_unknown_ones_are_named() {
        for policy in ["round_robin", "least_loaded", "prefix", "session"] {
            let ok = MINIMAL.replace(
                "model = \"m\"",
                &format!("model = \"m\"\npolicy = \"{policy}\""),
            );
            assert_eq!(Config::parse(&ok).unwrap().pools[0].policy, policy);
        }
        let e =
            Config::parse(&MINIMAL.replace("model = \"m\"", "model = \"m\"\npolicy = \"fastest\""))
                .unwrap_err();
        assert_eq!(e.key, "pools[0].policy");
        assert!(e.reason.contains("unknown policy"), "{e}");
    }

    #[test]
    fn store_ttls_map_to_the_store_options_and_stay_valid_redis_expiries() {
        let c = Config::parse(MINIMAL).unwrap();
        assert_eq!(c.store_options().pin_ttl, Duration::from_secs(3600));
        let c = Config::parse(&format!("[store]\npin_ttl_s = 1.5\n{MINIMAL}")).unwrap();
        assert_eq!(c.store_options().pin_ttl, Duration::from_millis(1500));
        for (line, key) in [
            ("pin_ttl_s = 0", "store.pin_ttl_s"),
            ("pin_ttl_s = 1e12", "store.pin_ttl_s"),
            ("pin_ttl_s = nan", "store.pin_ttl_s"),
            ("ttl_days = 1e9", "store.ttl_days"),
            ("ttl_days = -1", "store.ttl_days"),
            (
                "conversation_max_items = 19",
                "store.conversation_max_items",
            ),
            ("url = \"rediss://127.0.0.1:6380\"", "store.url"),
            ("url = \"http://127.0.0.1:6379\"", "store.url"),
        ] {
            let e = Config::parse(&format!("[store]\n{line}\n{MINIMAL}")).unwrap_err();
            assert_eq!(e.key, key, "{line}");
        }
    }

    #[test]
    fn the_empty_keys_digest_is_refused() {
        let text = format!(
            "{MINIMAL}\n[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{}\"]\n",
            crate::auth::hash_key("")
        );
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "teams[0].api_key_sha256[0]", "{e}");
    }

    #[test]
    fn bad_key_hash_is_refused() {
        let text = format!("{MINIMAL}\n[[teams]]\nname = \"a\"\napi_key_sha256 = [\"abc\"]\n");
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "teams[0].api_key_sha256[0]");
        // One key, two teams: which team would it be?
        let key = "ab".repeat(32);
        let text = format!(
            "{MINIMAL}\n[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{key}\"]\n\
             [[teams]]\nname = \"b\"\napi_key_sha256 = [\"{}\"]\n",
            key.to_uppercase()
        );
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "teams[1].api_key_sha256[0]");
        assert!(e.reason.contains("team `a`"), "{}", e.reason);
        // Listed twice under one team, it still names one team.
        let text = format!(
            "{MINIMAL}\n[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{key}\", \"{key}\"]\n"
        );
        assert!(Config::parse(&text).is_ok());
    }

    #[test]
    fn live_state_keys_have_defaults_and_map_to_saturation() {
        let c = Config::parse(MINIMAL).unwrap();
        let r = &c.routing;
        assert_eq!(r.scrape_interval(), Some(Duration::from_secs(1)));
        assert_eq!(r.metrics_staleness(), Some(Duration::from_secs(5)));
        assert_eq!(r.health_interval(), Some(Duration::from_secs(2)));
        assert_eq!((r.unhealthy_after, r.healthy_after), (2, 1));
        assert_eq!(c.pools[0].role(), Role::Both);
        assert!(c.pools[0].labels.is_empty());
        assert_eq!(c.pools[0].endpoints_file, None);

        let text = format!(
            "[routing]\nscrape_interval_ms = 200\nmetrics_staleness_ms = 300\nprobe_timeout_ms = 100\nhealth_interval_ms = 0\n\
             saturation_queue_depth = 8\nsaturation_kv_usage = 0.9\n{MINIMAL}role = \"decode\"\n\
             labels = {{ zone = \"a\" }}\n"
        );
        let c = Config::parse(&text).unwrap();
        assert_eq!(c.routing.health_interval(), None);
        assert_eq!(c.pools[0].role(), Role::Decode);
        assert_eq!(c.pools[0].labels["zone"], "a");
        let sat = c.routing.saturation(Flavor::Vllm);
        assert_eq!(sat.max_waiting, 8.0);
        assert_eq!(sat.max_kv_usage, 0.9);
        assert_eq!(sat.staleness, Some(Duration::from_millis(300)));
        assert_eq!(
            c.routing.saturation(Flavor::Openai).staleness,
            None,
            "engines without metrics are never stale"
        );
        // A short interval's default outlasts a round that waits out the probe timeout.
        let fast =
            Config::parse(&format!("[routing]\nscrape_interval_ms = 200\n{MINIMAL}")).unwrap();
        assert_eq!(
            fast.routing.metrics_staleness(),
            Some(Duration::from_millis(2400))
        );
        let off = Config::parse(&format!("[routing]\nscrape_interval_ms = 0\n{MINIMAL}")).unwrap();
        assert_eq!(off.routing.saturation(Flavor::Sglang).staleness, None);
    }

    #[test]
    fn bad_live_state_values_name_their_key() {
        for (routing, key) in [
            (
                "scrape_interval_ms = 1000\nmetrics_staleness_ms = 10",
                "routing.metrics_staleness_ms",
            ),
            // Longer than the interval, but a round waiting out an unreachable endpoint's
            // probe timeout would leave the others' scrapes older than it.
            (
                "scrape_interval_ms = 200\nmetrics_staleness_ms = 1000",
                "routing.metrics_staleness_ms",
            ),
            ("unhealthy_after = 0", "routing.unhealthy_after"),
            ("healthy_after = 0", "routing.healthy_after"),
            ("probe_timeout_ms = 0", "routing.probe_timeout_ms"),
            ("health_timeout_ms = 0", "routing.health_timeout_ms"),
            (
                "saturation_queue_depth = 0",
                "routing.saturation_queue_depth",
            ),
            ("saturation_kv_usage = 1.5", "routing.saturation_kv_usage"),
            ("discovery_interval_ms = 0", "routing.discovery_interval_ms"),
            ("session_header = \" \"", "routing.session_header"),
            ("session_header = \"x session\"", "routing.session_header"),
        ] {
            let e = Config::parse(&format!("[routing]\n{routing}\n{MINIMAL}")).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        // Empty: no configured session header.
        let c = Config::parse(&format!("[routing]\nsession_header = \"\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.routing.session_header, "");
        let e = Config::parse(&format!("{MINIMAL}role = \"encode\"\n")).unwrap_err();
        assert_eq!(e.key, "pools[0].role");
        assert!(e.reason.contains("both, prefill, decode"), "{e}");
        let e = Config::parse(&format!("{MINIMAL}labels = {{ \"\" = \"x\" }}\n")).unwrap_err();
        assert_eq!(e.key, "pools[0].labels");
        let e = Config::parse(&format!("{MINIMAL}endpoints_file = 3\n")).unwrap_err();
        assert!(e.key.contains("endpoints_file"), "{e}");
    }

    #[test]
    fn timeouts_must_be_finite_and_at_most_1e9_seconds() {
        for (section, line, key) in [
            (
                "upstream",
                "idle_timeout_s = 1e19",
                "upstream.idle_timeout_s",
            ),
            (
                "upstream",
                "first_byte_timeout_s = 2e9",
                "upstream.first_byte_timeout_s",
            ),
            (
                "upstream",
                "first_byte_timeout_s = 0",
                "upstream.first_byte_timeout_s",
            ),
            (
                "server",
                "shutdown_grace_s = 1e300",
                "server.shutdown_grace_s",
            ),
            ("server", "shutdown_grace_s = -1", "server.shutdown_grace_s"),
            (
                "server",
                "client_stall_timeout_s = 0",
                "server.client_stall_timeout_s",
            ),
            (
                "server",
                "header_read_timeout_s = 0",
                "server.header_read_timeout_s",
            ),
            (
                "background",
                "orphaned_after_s = 0",
                "background.orphaned_after_s",
            ),
            (
                "background",
                "orphaned_after_s = 0.001",
                "background.orphaned_after_s",
            ),
            ("server", "tcp_keepalive_s = -1", "server.tcp_keepalive_s"),
            (
                "server",
                "tcp_keepalive_s = 40000",
                "server.tcp_keepalive_s",
            ),
        ] {
            let e = Config::parse(&format!("[{section}]\n{line}\n{MINIMAL}")).unwrap_err();
            assert_eq!(e.key, key, "{line}: {e}");
        }
        let c = Config::parse(&format!("[upstream]\nidle_timeout_s = 1e9\n{MINIMAL}")).unwrap();
        assert_eq!(
            c.client_options().idle_timeout,
            Duration::from_secs(1_000_000_000)
        );
    }

    #[test]
    fn endpoints_file_alone_makes_a_pool_and_resolves_beside_the_config() {
        let text = "[[pools]]\nname = \"main\"\nmodel = \"m\"\nendpoints_file = \"eps.yaml\"\n";
        let c = Config::parse(text).unwrap();
        assert_eq!(
            c.pools[0].endpoints_file.as_deref(),
            Some(Path::new("eps.yaml"))
        );
        let dir = std::env::temp_dir().join(format!("agentgate-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gateway.toml");
        std::fs::write(&file, text).unwrap();
        let c = Config::load(&file).unwrap();
        assert_eq!(c.pools[0].endpoints_file, Some(dir.join("eps.yaml")));
        std::fs::remove_dir_all(&dir).unwrap();
        let none = "[[pools]]\nname = \"main\"\nmodel = \"m\"\n";
        let e = Config::parse(none).unwrap_err();
        assert!(e.reason.contains("endpoints_file"), "{e}");
    }

    #[test]
    fn without_bands_there_is_one_implicit_band_and_the_open_team() {
        let c = Config::parse(MINIMAL).unwrap();
        assert!(c.flow.enabled);
        assert_eq!(c.flow.max_in_flight_per_endpoint, 64);
        assert_eq!(c.server.reload_interval_ms, 1_000);
        let f = c.flow_config();
        assert_eq!(f.bands.len(), 1);
        assert_eq!(f.bands[0].name, IMPLICIT_BAND);
        assert!(!f.bands[0].sheddable);
        assert_eq!(
            f.bands[0].queue_ttl,
            Duration::from_secs_f64(c.upstream.first_byte_timeout_s),
            "without bands a request may wait in the gateway as long as for the engine"
        );
        assert_eq!(f.teams.len(), 1);
        assert_eq!(f.teams[0].name, crate::auth::OPEN_TEAM);
        assert_eq!(f.turn_window, Duration::from_secs(60));
        assert_eq!(f.aging, Duration::from_secs(10));
        // Existing team entries keep working: the implicit band is their default.
        let keyed = format!(
            "{MINIMAL}[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{}\"]\n",
            "ab".repeat(32)
        );
        let f = Config::parse(&keyed).unwrap().flow_config();
        assert_eq!(f.teams.len(), 1, "keys configured: no open team");
        assert_eq!(f.teams[0].default_band, IMPLICIT_BAND);
        assert_eq!(f.validate(), Ok(()));
    }

    const BANDS: &str = "[[bands]]\nname = \"interactive\"\npriority = 10\n\
        [[bands]]\nname = \"batch\"\npriority = 0\nsheddable = true\nqueue_ttl_ms = 500\n";

    #[test]
    fn bands_teams_and_flow_map_to_the_scheduler_policy() {
        let text = format!(
            "{MINIMAL}{BANDS}[flow]\nturn_window_s = 30\naging_s = 0\nshed_start = 0.5\n\
             shed_full = 0.9\nretry_after_s = 2.5\nservice_tier = {{ flex = \"batch\" }}\n\
             [[teams]]\nname = \"chat\"\ndefault_band = \"interactive\"\nbands = [\"batch\"]\n\
             weight = 2.5\nrequests_per_minute = 60\ntokens_per_minute = 1000\nmax_concurrent = 4\n\
             [[teams]]\nname = \"bulk\"\ndefault_band = \"batch\"\n"
        );
        let c = Config::parse(&text).unwrap();
        let f = c.flow_config();
        let batch = f.band("batch").unwrap();
        assert!(batch.sheddable);
        assert_eq!(batch.queue_ttl, Duration::from_millis(500));
        let chat = f.team("chat").unwrap();
        assert_eq!(chat.allowed_bands, ["interactive", "batch"]);
        assert_eq!(chat.weight, 2.5);
        assert_eq!(
            (chat.rpm, chat.tpm, chat.max_concurrent),
            (Some(60), Some(1000), Some(4))
        );
        assert!(f.team("bulk").unwrap().allows("batch"));
        assert!(!f.team("bulk").unwrap().allows("interactive"));
        // No keys: the open team may use every band, from the highest down.
        let open = f.team(crate::auth::OPEN_TEAM).unwrap();
        assert_eq!(open.default_band, "interactive");
        assert!(open.allows("batch"));
        assert_eq!(f.turn_window, Duration::from_secs(30));
        assert_eq!(f.aging, Duration::ZERO);
        assert_eq!(f.retry_after, Duration::from_millis(2500));
        assert_eq!(
            f.shed_curve,
            agentgate_scheduler::flow::ShedCurve::Linear {
                start: 0.5,
                full: 0.9
            }
        );
        assert_eq!(c.flow.service_tier["flex"], "batch");
    }

    #[test]
    fn bad_flow_values_name_their_key() {
        let team =
            |extra: &str| format!("[[teams]]\nname = \"t\"\ndefault_band = \"batch\"\n{extra}\n");
        for (extra, key) in [
            (
                "[[bands]]\nname = \"batch\"\npriority = 3\n".to_string(),
                "bands[2].name",
            ),
            (
                "[[bands]]\nname = \"other\"\npriority = 10\n".to_string(),
                "bands[2].priority",
            ),
            (
                "[[bands]]\nname = \" \"\npriority = 3\n".to_string(),
                "bands[2].name",
            ),
            (
                "[[bands]]\nname = \"x\"\npriority = 3\nqueue_ttl_ms = 0\n".to_string(),
                "bands[2].queue_ttl_ms",
            ),
            (
                "[[teams]]\nname = \"t\"\n".to_string(),
                "teams[0].default_band",
            ),
            (
                "[[teams]]\nname = \"t\"\ndefault_band = \"gold\"\n".to_string(),
                "teams[0].default_band",
            ),
            (team("bands = [\"interactive\"]"), "teams[0].bands[0]"),
            (team("bands = [\"gold\"]"), "teams[0].bands[0]"),
            (team("weight = 0"), "teams[0].weight"),
            (team("weight = 1e-310"), "teams[0].weight"),
            (
                team("requests_per_minute = 0"),
                "teams[0].requests_per_minute",
            ),
            (team("tokens_per_minute = 0"), "teams[0].tokens_per_minute"),
            (team("max_concurrent = 0"), "teams[0].max_concurrent"),
            (
                "[flow]\nservice_tier = { flex = \"gold\" }\n".to_string(),
                "flow.service_tier.flex",
            ),
            ("[flow]\nshed_start = 0.5\n".to_string(), "flow.shed_full"),
            (
                "[flow]\nshed_start = 0.9\nshed_full = 0.5\n".to_string(),
                "flow.shed_start",
            ),
            ("[flow]\naging_s = -1\n".to_string(), "flow.aging_s"),
            ("[flow]\npin_wait_s = 1e-7\n".to_string(), "flow.pin_wait_s"),
            (
                "[flow]\nturn_window_s = nan\n".to_string(),
                "flow.turn_window_s",
            ),
            (
                "[flow]\ndefault_max_output_tokens = 0\n".to_string(),
                "flow.default_max_output_tokens",
            ),
        ] {
            let e = Config::parse(&format!("{MINIMAL}{BANDS}{extra}")).unwrap_err();
            assert_eq!(e.key, key, "{extra}: {e}");
        }
        let e = Config::parse(&format!("{MINIMAL}{BANDS}[flow]\nshed = 1\n")).unwrap_err();
        assert!(e.to_string().contains("shed"), "{e}");
        let e = Config::parse(&format!(
            "{MINIMAL}{BANDS}{}",
            team("bands = [\"interactive\"]")
        ))
        .unwrap_err();
        assert!(
            e.reason.contains("ranks above the team's default band"),
            "{e}"
        );
    }

    #[test]
    fn settings_an_engine_or_the_flow_would_silently_ignore_are_refused() {
        let refused = |text: String, key: &str| {
            let e = Config::parse(&text).unwrap_err();
            assert!(e.key.starts_with(key), "{key}: {e}");
        };
        // A bootstrap port label that is no port, in a pool's labels or an endpoint's.
        refused(
            MINIMAL.replace(
                "endpoints = [",
                "labels = { \"agentgate.io/bootstrap-port\" = \"89980\" }\nendpoints = [",
            ),
            "pools[0].labels",
        );
        refused(
            MINIMAL.replace(
                "endpoints = [\"http://127.0.0.1:8000\"]",
                "endpoints = [{ url = \"http://127.0.0.1:8000\", labels = { \"agentgate.io/bootstrap-port\" = \"abc\" } }]",
            ),
            "pools[0].endpoints[0].labels",
        );
        // The role label belongs to endpoints; the pool has `role`.
        refused(
            MINIMAL.replace(
                "endpoints = [",
                "labels = { \"llm-d.ai/role\" = \"decode\" }\nendpoints = [",
            ),
            "pools[0].labels",
        );
        // An effort no engine knows.
        refused(
            MINIMAL.replace(
                "endpoints = [",
                "reasoning_efforts = [\"low\", \"turbo\"]\nendpoints = [",
            ),
            "pools[0].reasoning_efforts[1]",
        );
        // Priorities only vLLM and SGLang take.
        refused(
            MINIMAL.replace(
                "endpoints = [",
                "flavor = \"openai\"\nengine_priority = true\nendpoints = [",
            ),
            "pools[0].engine_priority",
        );
        assert!(Config::parse(&MINIMAL.replace(
            "endpoints = [",
            "labels = { \"agentgate.io/bootstrap-port\" = \"8998\" }\nendpoints = [",
        ))
        .is_ok());
    }

    #[test]
    fn endpoints_may_be_tables_with_a_role_and_a_bootstrap_port() {
        let text = "[[pools]]\nname = \"pd\"\nmodel = \"m\"\nflavor = \"sglang\"\n\
            labels = { zone = \"a\", tier = \"x\" }\n\
            endpoints = [\"http://10.0.0.1:8000\", { url = \"http://10.0.0.2:8000\", role = \"prefill\", \
            bootstrap_port = 8998, labels = { tier = \"y\" } }]\n";
        let c = Config::parse(text).unwrap();
        let pool = &c.pools[0];
        assert_eq!(
            pool.endpoints[0],
            EndpointEntry::from("http://10.0.0.1:8000")
        );
        assert_eq!(pool.endpoints[0].role(Role::Both), Role::Both);
        let table = &pool.endpoints[1];
        assert_eq!(table.url(), "http://10.0.0.2:8000");
        assert_eq!(table.role(Role::Both), Role::Prefill);
        let labels = table.labels(&pool.labels);
        assert_eq!(labels["zone"], "a");
        assert_eq!(labels["tier"], "y", "the entry's labels win");
        assert_eq!(labels[BOOTSTRAP_PORT_LABEL], "8998");
        assert_eq!(pool.disaggregation, DisaggregationConfig::default());
        assert_eq!(pool.disaggregation.threshold_tokens, 2048);
        assert_eq!(
            pool.disaggregation.parent_header,
            "x-agentgate-parent-session"
        );
        assert!(pool.disaggregation.parent_by_prefix);
        assert_eq!(
            (
                pool.disaggregation.parent_prefix_min_tokens,
                pool.disaggregation.parent_active_s
            ),
            (4096, 300)
        );
        let text = "[[pools]]\nname = \"p\"\nmodel = \"m\"\nendpoints = [\"http://h:1\"]\n\
            [pools.disaggregation]\nparent_by_prefix = false\nparent_prefix_min_tokens = 8192\n\
            parent_active_s = 60\n";
        let pd = &Config::parse(text).unwrap().pools[0].disaggregation;
        assert_eq!(
            (
                pd.parent_by_prefix,
                pd.parent_prefix_min_tokens,
                pd.parent_active_s
            ),
            (false, 8192, 60)
        );
    }

    #[test]
    fn bad_endpoint_tables_and_disaggregation_keys_name_their_key() {
        let pool = |endpoints: &str, extra: &str| {
            format!("[[pools]]\nname = \"p\"\nmodel = \"m\"\nendpoints = [{endpoints}]\n{extra}")
        };
        for (endpoints, extra, key) in [
            (
                "{ url = \"http://h:1\", role = \"mixed\" }",
                "",
                "pools[0].endpoints[0].role",
            ),
            (
                "{ url = \"http://h:1\", bootstrap_port = 0 }",
                "",
                "pools[0].endpoints[0].bootstrap_port",
            ),
            (
                "{ url = \"http://h:1\", labels = { \"\" = \"v\" } }",
                "",
                "pools[0].endpoints[0].labels",
            ),
            ("{ url = \"h:1\" }", "", "pools[0].endpoints[0]"),
            // Scoring is checked whatever the policy.
            (
                "\"http://h:1\"",
                "policy = \"round_robin\"\n[pools.scoring]\nweights = { prefx = 3.0 }\n",
                "pools[0].scoring",
            ),
            (
                "\"http://h:1\"",
                "policy = \"least_loaded\"\n[pools.scoring]\npin_hysteresis_tokens = nan\n",
                "pools[0].scoring",
            ),
            (
                "\"http://h:1\"",
                "[pools.disaggregation]\nparent_header = \"x parent\"\n",
                "pools[0].disaggregation.parent_header",
            ),
            (
                "\"http://h:1\"",
                "[pools.disaggregation]\nbootstrap_port = 0\n",
                "pools[0].disaggregation.bootstrap_port",
            ),
            (
                "\"http://h:1\"",
                "[pools.disaggregation]\nparent_active_s = 0\n",
                "pools[0].disaggregation.parent_active_s",
            ),
        ] {
            let e = Config::parse(&pool(endpoints, extra)).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        // Unknown keys in a table, or a value of the wrong kind, fail at parse time.
        for endpoints in ["{ url = \"http://h:1\", port = 3 }", "3"] {
            let e = Config::parse(&pool(endpoints, "")).unwrap_err();
            assert!(e.key.contains("endpoints"), "{e}");
        }
        let e = Config::parse(&pool(
            "\"http://h:1\"",
            "[pools.disaggregation]\nthreshold = 5\n",
        ))
        .unwrap_err();
        assert!(e.reason.contains("threshold"), "{e}");
    }

    #[test]
    fn simulated_prefill_and_decode_replicas_count_as_endpoints() {
        let text = "[[pools]]\nname = \"pd\"\nmodel = \"m\"\n\
            [pools.simulate]\nreplicas = 0\nprefill_replicas = 2\ndecode_replicas = 2\n";
        let c = Config::parse(text).unwrap();
        let sim = c.pools[0].simulate.as_ref().unwrap();
        assert_eq!(
            (sim.replicas, sim.prefill_replicas, sim.decode_replicas),
            (0, 2, 2)
        );
        assert_eq!(sim.total_replicas(), 4);
        let none = text
            .replace("prefill_replicas = 2", "prefill_replicas = 0")
            .replace("decode_replicas = 2", "decode_replicas = 0");
        let e = Config::parse(&none).unwrap_err();
        assert_eq!(e.key, "pools[0].endpoints");
    }

    /// Everything the gateway derives from a validated configuration before it serves (the
    /// pure parts of `AppState::new` and `Pools::start`: no sockets, no store).
    fn derive_startup_settings(config: &Config) -> Result<(), String> {
        config.store_ttl();
        config.client_options();
        config
            .flow_config()
            .validate()
            .map_err(|e| format!("flow: {e}"))?;
        let _ = (
            config.routing.scrape_interval(),
            config.routing.health_interval(),
            config.routing.metrics_staleness(),
        );
        for pool in &config.pools {
            for (_, replica) in crate::pools::simulated_replicas(pool) {
                replica.validate().map_err(|e| format!("simulate: {e}"))?;
            }
            crate::pools::pool_routing(config, pool).map_err(|e| format!("routing: {e}"))?;
        }
        Ok(())
    }

    /// Every value of every example configuration replaced in turn by a value of every TOML
    /// type (and the floats that are not numbers): each variant is refused by validation with
    /// a message, or everything the gateway derives from it at startup works.
    #[test]
    fn mutated_examples_are_refused_or_usable() {
        fn leaves(v: &toml::Value, at: Vec<String>, out: &mut Vec<Vec<String>>) {
            match v {
                toml::Value::Table(t) => {
                    for (k, child) in t {
                        let mut p = at.clone();
                        p.push(k.clone());
                        out.push(p.clone());
                        leaves(child, p, out);
                    }
                }
                toml::Value::Array(items) => {
                    for (i, child) in items.iter().enumerate() {
                        let mut p = at.clone();
                        p.push(i.to_string());
                        out.push(p.clone());
                        leaves(child, p, out);
                    }
                }
                _ => {}
            }
        }
        fn at<'a>(v: &'a mut toml::Value, path: &[String]) -> &'a mut toml::Value {
            path.iter().fold(v, |v, k| match v {
                toml::Value::Table(t) => t.get_mut(k).unwrap(),
                toml::Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
                _ => unreachable!(),
            })
        }
        let replacements = [
            toml::Value::String("x".into()),
            toml::Value::String(String::new()),
            toml::Value::Integer(-1),
            toml::Value::Integer(0),
            toml::Value::Integer(i64::MAX),
            toml::Value::Float(0.5),
            toml::Value::Float(-1.5),
            toml::Value::Float(f64::INFINITY),
            toml::Value::Float(f64::NAN),
            toml::Value::Boolean(true),
            toml::Value::Array(Vec::new()),
            toml::Value::Table(toml::Table::new()),
        ];
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let (mut variants, mut usable) = (0, 0);
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let base = toml::Value::Table(text.parse::<toml::Table>().unwrap());
            let mut paths = Vec::new();
            leaves(&base, Vec::new(), &mut paths);
            for p in &paths {
                for r in &replacements {
                    let mut v = base.clone();
                    *at(&mut v, p) = r.clone();
                    variants += 1;
                    let what = format!("{} {} = {r:?}", path.display(), p.join("."));
                    let Ok(config) = Config::deserialize(v) else {
                        continue;
                    };
                    if let Err(e) = config.validate() {
                        assert!(!e.to_string().is_empty(), "{what}");
                        continue;
                    }
                    usable += 1;
                    let startup = std::panic::catch_unwind(|| derive_startup_settings(&config));
                    assert!(
                        matches!(startup, Ok(Ok(()))),
                        "{what}: validated, then failed at startup: {startup:?}"
                    );
                }
            }
        }
        assert!(
            variants > 1000 && usable > 0,
            "{variants} variants, {usable} usable"
        );
    }

    #[test]
    fn examples_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                n += 1;
            }
        }
        assert!(n >= 1);
    }
}
