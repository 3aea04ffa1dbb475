//! Configuration: the TOML file `agentgate serve --config FILE` reads, its defaults and validation.
//!
//! Every key is documented in `examples/quickstart.toml` and the README's configuration reference.
//! Unknown keys are rejected, and a bad value fails at start with the key's path and the reason,
//! so a typo never silently changes behaviour.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use agentgate_adapters::Flavor;

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
}

/// `[server]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the gateway listens on.
    pub listen: SocketAddr,
    /// Largest request body accepted, in bytes; larger bodies get 413.
    pub max_body_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 32 * 1024 * 1024,
        }
    }
}

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
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: None,
            ttl_days: 30.0,
            key_prefix: "agentgate:".into(),
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

/// `[routing]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// Request header that names a session (checked before the agents' native headers).
    pub session_header: String,
    /// Also read the native session headers of Claude Code, Codex and OpenCode.
    pub native_session_headers: bool,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            session_header: "x-session-id".into(),
            native_session_headers: true,
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

/// `[upstream]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// TCP connect timeout to an engine, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Longest wait for the first byte of an engine's answer (queueing plus prefill), in seconds.
    pub first_byte_timeout_s: f64,
    /// Longest silence between two streamed chunks, in seconds.
    pub idle_timeout_s: f64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            connect_timeout_ms: 2_000,
            first_byte_timeout_s: 600.0,
            idle_timeout_s: 120.0,
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
}

impl Default for BackgroundConfig {
    fn default() -> Self {
        BackgroundConfig { max_concurrent: 4 }
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
    /// Engine base URLs, e.g. `http://10.0.0.5:8000`.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Routing policy: `round_robin` (default), `least_loaded` or `prefix`.
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
    "round_robin".into()
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
        }
    }
}

/// `[[teams]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeamConfig {
    /// Team name (appears in logs and metrics; keys never do).
    pub name: String,
    /// SHA-256 hex digests of the team's API keys (`agentgate hash-key KEY` prints one).
    #[serde(default)]
    pub api_key_sha256: Vec<String>,
}

/// A configuration problem: the key it concerns and what is wrong.
#[derive(Debug)]
pub struct ConfigError {
    /// Dotted path of the offending key (`pools[0].endpoints[1]`), or the file.
    pub key: String,
    /// What is wrong and how to fix it.
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "config key `{}`: {}", self.key, self.reason)
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
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(path.display().to_string(), format!("cannot read file: {e}")))?;
        Config::parse(&text)
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
            if !url.starts_with("redis://") && !url.starts_with("rediss://") {
                return Err(err(
                    "store.url",
                    "must be a redis:// URL such as redis://127.0.0.1:6379/0 (omit it for the in-memory store)",
                ));
            }
        }
        if self.store.ttl_days.is_nan() || self.store.ttl_days <= 0.0 {
            return Err(err("store.ttl_days", "must be a positive number of days"));
        }
        if self.routing.session_header.trim().is_empty()
            || !self
                .routing
                .session_header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(err(
                "routing.session_header",
                "must be a header name (letters, digits, '-' and '_')",
            ));
        }
        if self.background.max_concurrent == 0 {
            return Err(err("background.max_concurrent", "must be at least 1"));
        }
        if self.upstream.first_byte_timeout_s <= 0.0 || self.upstream.idle_timeout_s <= 0.0 {
            return Err(err("upstream", "timeouts must be positive"));
        }
        if self.pools.is_empty() {
            return Err(err(
                "pools",
                "at least one [[pools]] entry is needed (see examples/quickstart.toml)",
            ));
        }
        let mut models = std::collections::HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let at = |k: &str| format!("pools[{i}].{k}");
            if pool.name.trim().is_empty() {
                return Err(err(at("name"), "must not be empty"));
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
            policy
                .picker(
                    agentgate_scheduler::PrefixIndexConfig::default(),
                    &pool.scoring.resolve(policy),
                )
                .map_err(|reason| err(at("scoring"), reason))?;
            let simulated = pool.simulate.as_ref().map_or(0, |s| s.replicas);
            if pool.endpoints.is_empty() && simulated == 0 {
                return Err(err(
                    at("endpoints"),
                    "a pool needs engine endpoints or [pools.simulate] replicas",
                ));
            }
            for (j, ep) in pool.endpoints.iter().enumerate() {
                if ep.starts_with("https://") && !cfg!(feature = "upstream-tls") {
                    return Err(err(
                        format!("pools[{i}].endpoints[{j}]"),
                        "https:// engines need a build with TLS: `cargo build --release --features upstream-tls`",
                    ));
                }
                let ok = (ep.starts_with("http://") || ep.starts_with("https://"))
                    && ep.len() > "http://".len() + 1;
                if !ok {
                    return Err(err(
                        format!("pools[{i}].endpoints[{j}]"),
                        format!("`{ep}` is not an http:// base URL such as http://10.0.0.5:8000"),
                    ));
                }
            }
            if let Some(sim) = &pool.simulate {
                if sim.block_size == 0 || sim.kv_blocks == 0 || sim.max_num_seqs == 0 {
                    return Err(err(
                        at("simulate"),
                        "block_size, kv_blocks and max_num_seqs must be positive",
                    ));
                }
                if sim.time_scale < 0.0 || sim.prefill_tokens_per_s <= 0.0 {
                    return Err(err(
                        at("simulate"),
                        "time_scale must be >= 0 and prefill_tokens_per_s > 0",
                    ));
                }
            }
        }
        let mut names = std::collections::HashSet::new();
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
            }
        }
        Ok(())
    }

    /// The store TTL as a duration.
    pub fn store_ttl(&self) -> Duration {
        Duration::from_secs_f64(self.store.ttl_days * 86_400.0)
    }
}

/// Best-effort dotted key path for a byte offset in TOML text, for error messages.
fn locate_key(text: &str, offset: usize) -> String {
    let before = text.get(..offset).unwrap_or(text);
    let mut table = String::new();
    let mut key = String::new();
    for line in before.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            table = t.trim_matches(|c| c == '[' || c == ']').trim().to_string();
            key.clear();
        } else if let Some((k, _)) = t.split_once('=') {
            key = k.trim().to_string();
        }
    }
    let line = before.lines().count().max(1);
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
    fn unknown_key_names_the_key() {
        let e = Config::parse(&format!("{MINIMAL}\nlisten_port = 3\n")).unwrap_err();
        assert!(e.to_string().contains("listen_port"), "{e}");
    }

    #[test]
    fn bad_endpoint_names_its_path() {
        let text = MINIMAL.replace("http://127.0.0.1:8000", "127.0.0.1:8000");
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "pools[0].endpoints[0]");
    }

    #[test]
    fn bad_value_type_names_the_key() {
        let text = format!("[server]\nmax_body_bytes = \"big\"\n{MINIMAL}");
        let e = Config::parse(&text).unwrap_err();
        assert!(e.key.contains("server.max_body_bytes"), "{e}");
    }

    #[test]
    fn duplicate_model_is_refused() {
        let text = format!("{MINIMAL}\n{MINIMAL}")
            .replace("name = \"main\"\nmodel", "name = \"x\"\nmodel");
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
    fn bad_key_hash_is_refused() {
        let text = format!("{MINIMAL}\n[[teams]]\nname = \"a\"\napi_key_sha256 = [\"abc\"]\n");
        let e = Config::parse(&text).unwrap_err();
        assert_eq!(e.key, "teams[0].api_key_sha256[0]");
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
