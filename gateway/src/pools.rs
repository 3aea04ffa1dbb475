//! Engine pools: which endpoints serve which model, and the `Picker` seam that chooses one.
//!
//! A pool is the set of engine replicas serving one model (plus the aliases clients may use for
//! it). Its endpoints come from three places, in this order in its list:
//!
//! 1. the config's `endpoints` (slots `0..`),
//! 2. in-process simulated replicas (`[pools.simulate]`),
//! 3. a watched `endpoints_file` (see [`crate::discovery`]), whose entries come and go at run
//!    time.
//!
//! An entry of the config's `endpoints` is a base URL or a table `{url, role, bootstrap_port,
//! labels}`; `[pools.simulate]` starts `replicas` aggregated replicas, then `prefill_replicas`
//! prefill-only and `decode_replicas` decode-only ones, so one pool can hold endpoints of every
//! role: a pool with prefill endpoints splits long prompts between a prefill and a decode
//! endpoint ([`Disaggregation`], `agentgate_scheduler::disagg`).
//!
//! The first two are *fixed* for the process's lifetime; discovery replaces only the third part
//! of the list ([`Pool::apply_discovered`]). Each pool routes with the [`Picker`] its `policy`
//! names (`agentgate-scheduler`), behind a gate that keeps unavailable endpoints (unhealthy or
//! retired) out of every pick and breaks session pins to them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use agentgate_adapters::{EngineClient, Flavor};
pub use agentgate_scheduler::{Endpoint, PickRequest, Picker, Policy};
use agentgate_scheduler::{
    LineageConfig, PinRule, PrefillPicker, PrefixIndex, PrefixIndexConfig, PrefixLineage,
    PrefixLineageConfig, Role, Saturation, ScoringConfig,
};

use crate::config::{Config, PoolConfig, SimulateConfig, BOOTSTRAP_PORT_LABEL};
use crate::discovery::{self, DiscoveredEndpoint, FileDiscovery};

/// Engines serving one model.
#[derive(Debug)]
pub struct Pool {
    /// Pool name from the config.
    pub name: String,
    /// Model name sent upstream.
    pub model: String,
    /// Engine protocol flavor.
    pub flavor: Flavor,
    /// The replicas: a snapshot swapped whole when discovery changes the list, so a request
    /// routes over one consistent list while the next one may see another.
    endpoints: RwLock<Arc<Vec<Arc<Endpoint>>>>,
    /// How many leading endpoints of the list are fixed (config and simulated).
    fixed: usize,
    /// Routing policy.
    pub policy: Policy,
    /// The policy's picker.
    pub picker: Box<dyn Picker>,
    /// When an endpoint counts as saturated (engine queue, KV usage, stale metrics).
    pub saturation: Saturation,
    /// Default role of the pool's endpoints.
    pub role: Role,
    /// Labels every endpoint of the pool carries.
    pub labels: BTreeMap<String, String>,
    /// The watched endpoints file, if the pool has one.
    pub endpoints_file: Option<PathBuf>,
    /// How requests are split between prefill and decode endpoints, when the pool has both.
    pub disaggregation: Disaggregation,
    /// Whether requests carry their band's priority to the engines (`engine_priority`).
    pub engine_priority: bool,
    /// `[[pools]] vision`: images in tool outputs are sent as images.
    pub vision: bool,
    /// `[[pools]] remote_images`: images may be fetched by URL.
    pub remote_images: bool,
    /// `[[pools]] reasoning_efforts`: the efforts the engines take (None: any).
    pub reasoning_efforts: Option<Vec<String>>,
    /// Held across one placement: see [`Pool::place`].
    placing: Mutex<()>,
    /// An engine of the pool has reported cached prompt tokens: see [`Pool::cached_tokens`].
    engines_report_cached: AtomicBool,
    /// Its routing decisions waiting for the other gateways ([`crate::route_feed`]).
    pub routes: crate::route_feed::Outbox,
}

/// A pool's prefill/decode settings (`[pools.disaggregation]`).
#[derive(Debug, Clone)]
pub struct Disaggregation {
    /// Remote prefill only above this many prompt tokens not cached on the decode endpoint.
    pub threshold_tokens: u64,
    /// How sub-agent calls name their parent session.
    pub lineage: LineageConfig,
    /// Parents found by shared prefix for calls whose headers name none
    /// (`parent_by_prefix`; None when off or the policy keeps no prefix index).
    pub parents: Option<Arc<PrefixLineage>>,
    /// SGLang bootstrap port of prefill endpoints without their own (None: SGLang's default).
    pub bootstrap_port: Option<u16>,
    /// The prefill endpoint pick, with the pool's pin-rule constants and saturation limits.
    pub prefill: PrefillPicker,
}

/// Host and port of a base URL (`http://host:port/...`; default port 80, or 443 for https).
pub fn host_port(base_url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = base_url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit('@').next()?;
    let default_port = if scheme.eq_ignore_ascii_case("https") {
        443
    } else {
        80
    };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    Some((host.to_string(), port))
}

impl Pool {
    /// The current endpoint list.
    pub fn endpoints(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.endpoints
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The prompt with chunk hashes `prefix` was sent to `endpoint`: the picker learns it
    /// (the engine will hold the prompt once it has run it), and so will the other gateways
    /// ([`crate::route_feed`]).
    pub fn routed(&self, endpoint: &Endpoint, prefix: &[u64]) {
        self.picker.routed(endpoint.slot, prefix);
        if let Some(index) = self.picker.prefix_index() {
            self.routes
                .push(endpoint, within_capacity(index, endpoint.slot, prefix));
        }
    }

    /// Another gateway sent the prompt with chunk hashes `prefix` to the engine at `url`:
    /// record it as this gateway's own routing would. False when no endpoint of the pool has
    /// that URL. Taken with discovery held off, so a slot that discovery hands to a new engine
    /// is not credited with its old engine's prompts.
    pub fn learn_route(&self, url: &str, prefix: &[u64]) -> bool {
        let Some(index) = self.picker.prefix_index() else {
            return false;
        };
        let _no_discovery = self.placing.lock().unwrap_or_else(PoisonError::into_inner);
        let endpoints = self.endpoints();
        let Some(e) = endpoints
            .iter()
            .find(|e| e.base_url == url && !e.is_retired())
        else {
            return false;
        };
        self.picker
            .routed(e.slot, within_capacity(index, e.slot, prefix));
        true
    }

    /// Replace the endpoint list (requests already routed keep their endpoint).
    pub fn set_endpoints(&self, endpoints: Vec<Arc<Endpoint>>) {
        *self
            .endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(endpoints);
    }

    /// The cached prompt tokens of a request an engine of this pool served, as far as they can
    /// be told: `reported` when the engine reported them. vLLM and SGLang leave the count out
    /// when nothing was cached, and always unless started with `--enable-prompt-tokens-details`
    /// / `--enable-cache-report`. A pool's engines run alike, so once one has reported a
    /// count, silence means none were cached; until then it says nothing (`None`).
    pub fn cached_tokens(&self, reported: Option<u64>) -> Option<u64> {
        match reported {
            Some(tokens) => {
                self.engines_report_cached.store(true, Ordering::Relaxed);
                Some(tokens)
            }
            None => self
                .engines_report_cached
                .load(Ordering::Relaxed)
                .then_some(0),
        }
    }

    /// Run one placement, a pick and the `Endpoint::begin` that counts the request where it
    /// goes, while no other request of this pool places. Two requests routed at the same moment
    /// would otherwise both see every endpoint's counts from before the other's `begin`, and
    /// could both take the one free slot of a replica. `place` must not wait on anything.
    pub fn place<T>(&self, place: impl FnOnce() -> T) -> T {
        let _one_at_a_time = self.placing.lock().unwrap_or_else(PoisonError::into_inner);
        place()
    }

    /// Whether the pool currently has prefill endpoints (its requests may then be split).
    pub fn disaggregates(&self) -> bool {
        self.endpoints().iter().any(|e| e.role == Role::Prefill)
    }

    /// The `priority` field to send an engine of this pool for a request of a band with
    /// `band_priority`, when the pool forwards priorities (see `engine_priority` in the
    /// config): vLLM runs lower values first, SGLang higher ones.
    pub fn engine_priority_of(&self, band_priority: i32) -> Option<i64> {
        if !self.engine_priority {
            return None;
        }
        match self.flavor {
            Flavor::Vllm => Some(-i64::from(band_priority)),
            Flavor::Sglang => Some(i64::from(band_priority)),
            Flavor::Openai => None,
        }
    }

    /// Tokens per prompt chunk of the pool's prefix index (0 without one): the unit in which
    /// an endpoint's working set counts chunk hashes ([`Endpoint::working_set_tokens`]).
    pub fn tokens_per_chunk(&self) -> u64 {
        self.picker
            .prefix_index()
            .map_or(0, |index| index.tokens_per_chunk())
    }

    /// Whether `endpoint` can run a request whole (prefill and decode). An SGLang server in
    /// `--disaggregation-mode decode` cannot: every request it takes waits for its KV from a
    /// prefill server, so it only ever runs the decode leg of a split request. (A vLLM decode
    /// instance, whose KV connector is `kv_both`, prefills what it is not sent.)
    pub fn runs_whole(&self, endpoint: &Endpoint) -> bool {
        self.flavor != Flavor::Sglang || endpoint.role != Role::Decode
    }

    /// Whether `endpoint` can take the decode leg of a split request (receive a prompt's KV
    /// from a prefill endpoint). An SGLang server not started in a disaggregation mode (role
    /// `both`) ignores the bootstrap fields and prefills the prompt itself, while the prefill
    /// server holds its KV for a decode server that never comes.
    pub fn receives_kv(&self, endpoint: &Endpoint) -> bool {
        self.flavor != Flavor::Sglang || endpoint.role != Role::Both
    }

    /// Where an SGLang prefill endpoint's bootstrap server listens: the endpoint's host, and
    /// its [`BOOTSTRAP_PORT_LABEL`], else the pool's `bootstrap_port`, else SGLang's default
    /// ([`SGLANG_BOOTSTRAP_PORT`]; the bootstrap server is a listener of its own, not the HTTP
    /// port). None for other flavors (their protocol needs none) or an unparsable URL.
    pub fn bootstrap(&self, endpoint: &Endpoint) -> Option<(String, u16)> {
        if self.flavor != Flavor::Sglang {
            return None;
        }
        let (host, _) = host_port(&endpoint.base_url)?;
        let labelled = endpoint.labels.get(BOOTSTRAP_PORT_LABEL).and_then(|v| {
            let port = v.trim().parse::<u16>().ok().filter(|p| *p > 0);
            if port.is_none() {
                tracing::warn!(endpoint = %endpoint.name, value = %v, "label {BOOTSTRAP_PORT_LABEL} is not a port number; ignored");
            }
            port
        });
        let port = labelled
            .or(self.disaggregation.bootstrap_port)
            .unwrap_or(SGLANG_BOOTSTRAP_PORT);
        // SGLang joins host and port as `{host}:{port}`: an IPv6 address goes in brackets,
        // as SGLang's own router sends it.
        let host = match host.contains(':') {
            true => format!("[{host}]"),
            false => host,
        };
        Some((host, port))
    }

    /// What discovered endpoints inherit from the pool.
    pub fn discovery_defaults(&self) -> discovery::Defaults {
        discovery::Defaults {
            role: self.role,
            labels: self.labels.clone(),
        }
    }

    /// Replace the discovered part of the list with `desired` (see [`discovery::diff`]):
    /// unchanged endpoints keep their `Arc`, new ones get fresh slots (the prefix index forgets
    /// a reused slot), removed and relabelled ones are retired and, while they still have
    /// requests in flight, kept in `draining` so their slots are not reused. On error nothing
    /// changes.
    pub fn apply_discovered(
        &self,
        desired: &[DiscoveredEndpoint],
        draining: &mut Vec<Arc<Endpoint>>,
    ) -> Result<discovery::Diff, String> {
        // No request places meanwhile: one counted on a removed endpoint after the diff saw it
        // idle would share its slot with the endpoint that reuses it.
        let _no_placement = self.placing.lock().unwrap_or_else(PoisonError::into_inner);
        let snapshot = self.endpoints();
        let (fixed, current) = snapshot.split_at(self.fixed.min(snapshot.len()));
        draining.retain(|e| e.in_flight_requests() > 0);
        let diff = discovery::diff(
            &self.name,
            fixed,
            current,
            desired,
            &self.discovery_defaults(),
            draining,
        )?;
        if !diff.changed() {
            return Ok(diff);
        }
        for (old, _) in &diff.relabelled {
            // Its slot and live counts go on in the endpoint that replaces it: nothing to drain
            // (kept among the draining, an engine relabelled often while always busy would
            // add one entry per relabel that never left).
            old.retire();
        }
        for e in &diff.removed {
            e.retire();
            if e.in_flight_requests() > 0 && !draining.iter().any(|d| Arc::ptr_eq(d, e)) {
                draining.push(e.clone());
            }
        }
        if let Some(index) = self.picker.prefix_index() {
            for e in &diff.added {
                forget_slot(index, e);
            }
        }
        let mut next = fixed.to_vec();
        next.extend(diff.endpoints.iter().cloned());
        self.set_endpoints(next);
        Ok(diff)
    }
}

/// The leading chunks of `prefix` that `slot`'s share of the index can hold (what recording
/// it keeps; at least one).
fn within_capacity<'a>(index: &PrefixIndex, slot: usize, prefix: &'a [u64]) -> &'a [u64] {
    &prefix[..prefix.len().min(index.capacity_chunks(slot).max(1))]
}

/// A new endpoint takes `e.slot`: drop whatever the prefix index learnt for that slot, and
/// the capacity of the engine that had it.
fn forget_slot(index: &PrefixIndex, e: &Endpoint) {
    index.reset(e.slot);
}

/// All pools, indexed by every model name and alias clients may use.
pub struct Pools {
    pools: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    /// In-process simulated replicas, kept alive for the gateway's lifetime.
    sims: Vec<agentgate_sim::SimHandle>,
}

/// SGLang's default bootstrap port (`--disaggregation-bootstrap-port`).
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

impl Pools {
    /// Build pools from the config, starting any simulated replicas it asks for and reading
    /// each `endpoints_file` once (a missing file is watched until it appears; a malformed
    /// one fails the start). Every endpoint is scraped once, within `routing.probe_timeout_ms`:
    /// its first load report (when scraping is on) and its KV capacity, which sizes the prefix
    /// index of pools whose policy keeps one.
    pub async fn start(config: &Config, engines: &EngineClient) -> std::io::Result<Pools> {
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        let mut pools = Vec::new();
        let mut by_model = HashMap::new();
        let mut sims = Vec::new();
        for (i, pc) in config.pools.iter().enumerate() {
            let role = pc.role();
            let mut entries: Vec<(String, Role, BTreeMap<String, String>)> = pc
                .endpoints
                .iter()
                .map(|e| {
                    let url = e.url().trim_end_matches('/').to_string();
                    (url, e.role(role), e.labels(&pc.labels))
                })
                .collect();
            for (r, (replica_role, sim_config)) in simulated_replicas(pc).into_iter().enumerate() {
                let handle = agentgate_sim::spawn(sim_config).await?;
                tracing::info!(pool = %pc.name, replica = r, role = replica_role.name(), url = %handle.base_url(), "simulated replica started");
                let mut labels = pc.labels.clone();
                if pc.flavor == Flavor::Sglang && replica_role == Role::Prefill {
                    // A simulated replica serves its bootstrap routes on its HTTP port.
                    labels.insert(
                        BOOTSTRAP_PORT_LABEL.to_string(),
                        handle.addr().port().to_string(),
                    );
                }
                entries.push((handle.base_url(), replica_role, labels));
                sims.push(handle);
            }
            let fixed: Vec<Arc<Endpoint>> = entries
                .into_iter()
                .enumerate()
                .map(|(j, (base_url, role, labels))| {
                    Arc::new(
                        Endpoint::new(format!("{}/{}", pc.name, j), base_url)
                            .with_slot(j)
                            .with_role(role)
                            .with_labels(labels),
                    )
                })
                .collect();
            let defaults = discovery::Defaults {
                role,
                labels: pc.labels.clone(),
            };
            // A file that cannot be used now (unreadable, invalid, naming an engine twice) is
            // refused as it would be at run time: the pool starts with its fixed endpoints, and
            // the file's watcher takes the first version that can be used. One pool's bad file
            // does not keep the gateway, and every other model, from starting.
            let discovered = match &pc.endpoints_file {
                None => Vec::new(),
                Some(path) => {
                    let read = FileDiscovery::read(path).and_then(|list| match list {
                        Some(list) => discovery::diff(&pc.name, &fixed, &[], &list, &defaults, &[])
                            .map(|diff| Some(diff.endpoints))
                            .map_err(|e| format!("{}: {e}", path.display())),
                        None => Ok(None),
                    });
                    match read {
                        Ok(Some(endpoints)) => {
                            tracing::info!(pool = %pc.name, file = %path.display(), endpoints = endpoints.len(), "endpoints file read");
                            endpoints
                        }
                        Ok(None) => {
                            tracing::warn!(pool = %pc.name, file = %path.display(), "endpoints file not found; watching for it");
                            Vec::new()
                        }
                        Err(e) => {
                            tracing::warn!(pool = %pc.name, "endpoints file refused, starting with the pool's fixed endpoints and watching for a change: {e}");
                            Vec::new()
                        }
                    }
                }
            };
            let fixed_count = fixed.len();
            let mut endpoints = fixed;
            endpoints.extend(discovered);
            let PoolRouting {
                policy,
                picker,
                saturation,
                scoring,
            } = pool_routing(config, pc).map_err(invalid)?;
            for name in std::iter::once(&pc.model).chain(pc.aliases.iter()) {
                by_model.insert(name.clone(), i);
            }
            let pd = &pc.disaggregation;
            let parents = match picker.prefix_index() {
                Some(index) if pd.parent_by_prefix => {
                    Some(Arc::new(PrefixLineage::new(PrefixLineageConfig {
                        tokens_per_chunk: index.tokens_per_chunk(),
                        min_tokens: pd.parent_prefix_min_tokens,
                        active: Duration::from_secs(pd.parent_active_s),
                        ..PrefixLineageConfig::default()
                    })))
                }
                _ => None,
            };
            let disaggregation = Disaggregation {
                threshold_tokens: pd.threshold_tokens,
                lineage: LineageConfig {
                    parent_header: pd.parent_header.trim().to_string(),
                    native_headers: pd.native_parent_headers,
                },
                parents,
                bootstrap_port: pd.bootstrap_port,
                prefill: PrefillPicker {
                    rule: PinRule {
                        queue_penalty_tokens: scoring.queue_penalty_tokens,
                        hysteresis_tokens: scoring.pin_hysteresis_tokens,
                    },
                    saturation,
                },
            };
            let pool = Arc::new(Pool {
                name: pc.name.clone(),
                model: pc.model.clone(),
                flavor: pc.flavor,
                endpoints: RwLock::new(Arc::new(endpoints)),
                fixed: fixed_count,
                policy,
                picker,
                saturation,
                role,
                labels: pc.labels.clone(),
                endpoints_file: pc.endpoints_file.clone(),
                disaggregation,
                engine_priority: pc.engine_priority,
                vision: pc.vision,
                remote_images: pc.remote_images,
                reasoning_efforts: pc.reasoning_efforts.clone(),
                placing: Mutex::new(()),
                engines_report_cached: AtomicBool::new(false),
                routes: Default::default(),
            });
            let record_load = config.routing.scrape_interval().is_some();
            if pool.flavor != Flavor::Openai
                && (record_load || pool.picker.prefix_index().is_some())
            {
                let timeout = Duration::from_millis(config.routing.probe_timeout_ms);
                let endpoints = pool.endpoints();
                let scrapes = endpoints
                    .iter()
                    .map(|ep| crate::probe::scrape(engines, &pool, ep, timeout, record_load));
                for (ep, result) in endpoints
                    .iter()
                    .zip(futures_util::future::join_all(scrapes).await)
                {
                    if let Err(e) = result {
                        tracing::warn!(endpoint = %ep.name, "no metrics from the engine at start: {e}");
                    }
                }
            }
            pools.push(pool);
        }
        Ok(Pools {
            pools,
            by_model,
            sims,
        })
    }

    /// The pool serving a model name, if any.
    pub fn for_model(&self, model: &str) -> Option<Arc<Pool>> {
        self.by_model.get(model).map(|&i| self.pools[i].clone())
    }

    /// Every model name clients may ask for, sorted.
    pub fn model_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_model.keys().cloned().collect();
        names.sort();
        names
    }

    /// All pools.
    pub fn all(&self) -> &[Arc<Pool>] {
        &self.pools
    }

    /// Stop the simulated replicas.
    pub async fn shutdown(self) {
        for sim in self.sims {
            sim.shutdown().await;
        }
    }
}

/// How a pool routes, built from its config alone (no sockets): its policy, its picker (the
/// pool's `scoring` with the routing section's saturation limits for its flavor), those limits
/// and the resolved scoring settings.
pub struct PoolRouting {
    /// The pool's policy.
    pub policy: Policy,
    /// Its picker.
    pub picker: Box<dyn Picker>,
    /// When its endpoints count as saturated.
    pub saturation: Saturation,
    /// Its scoring settings, defaults resolved for the policy.
    pub scoring: ScoringConfig,
}

/// The routing of pool `pc` under `config` (see [`PoolRouting`]).
pub fn pool_routing(config: &Config, pc: &PoolConfig) -> Result<PoolRouting, String> {
    let policy = Policy::parse(&pc.policy)?;
    let index_config = PrefixIndexConfig {
        bytes_per_token: pc.prefix_bytes_per_token,
        ..PrefixIndexConfig::default()
    };
    let saturation = config.routing.saturation(pc.flavor);
    let mut scoring = pc.scoring.resolve(policy);
    scoring.saturation = saturation;
    let picker = policy.picker(index_config, &scoring)?;
    Ok(PoolRouting {
        policy,
        picker,
        saturation,
        scoring,
    })
}

/// The simulated replicas `[pools.simulate]` asks for, in order: the aggregated ones, then
/// the prefill-only and the decode-only ones; each with its role and its simulator settings.
pub fn simulated_replicas(pool: &PoolConfig) -> Vec<(Role, agentgate_sim::SimConfig)> {
    let Some(sim) = &pool.simulate else {
        return Vec::new();
    };
    let total = sim
        .total_replicas()
        .min(crate::config::MAX_SIMULATED_REPLICAS);
    std::iter::repeat_n(pool.role(), sim.replicas)
        .chain(std::iter::repeat_n(Role::Prefill, sim.prefill_replicas))
        .chain(std::iter::repeat_n(Role::Decode, sim.decode_replicas))
        .take(total)
        .enumerate()
        .map(|(r, role)| (role, sim_config(pool, sim, r, role)))
        .collect()
}

fn sim_config(
    pool: &PoolConfig,
    sim: &SimulateConfig,
    replica: usize,
    role: Role,
) -> agentgate_sim::SimConfig {
    let flavor = match pool.flavor {
        Flavor::Sglang => agentgate_sim::Flavor::Sglang,
        _ => agentgate_sim::Flavor::Vllm,
    };
    let role = match role {
        Role::Both => agentgate_sim::Role::Both,
        Role::Prefill => agentgate_sim::Role::Prefill,
        Role::Decode => agentgate_sim::Role::Decode,
    };
    agentgate_sim::SimConfig {
        flavor,
        role,
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        model: pool.model.clone(),
        block_size: sim.block_size as _,
        kv_blocks: sim.kv_blocks as _,
        max_num_seqs: sim.max_num_seqs as _,
        prefill_tokens_per_s: sim.prefill_tokens_per_s,
        decode_ms_per_token: sim.decode_ms_per_token,
        time_scale: sim.time_scale,
        seed: Some(replica as u64 + 1),
        // the simulated engines run priority scheduling when the pool sends priorities
        scheduling_policy: if pool.engine_priority {
            agentgate_sim::config::SchedulingPolicyArg::Priority
        } else {
            agentgate_sim::config::SchedulingPolicyArg::Fcfs
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_reads_base_urls() {
        let hp = |u: &str| host_port(u);
        assert_eq!(hp("http://10.0.0.5:8000"), Some(("10.0.0.5".into(), 8000)));
        assert_eq!(
            hp("http://10.0.0.5:8000/v1"),
            Some(("10.0.0.5".into(), 8000))
        );
        assert_eq!(hp("http://engine"), Some(("engine".into(), 80)));
        assert_eq!(hp("https://engine/"), Some(("engine".into(), 443)));
        assert_eq!(hp("http://[::1]:8100"), Some(("::1".into(), 8100)));
        assert_eq!(hp("http://user@h:9"), Some(("h".into(), 9)));
        assert_eq!(hp("engine:80"), None);
        assert_eq!(hp("http://:80"), None);
        assert_eq!(hp("http://h:99999"), None);
    }

    #[test]
    fn a_pools_scoring_table_lies_over_its_policys_defaults_with_the_routing_limits() {
        let config = Config::parse(
            "[routing]\nscrape_interval_ms = 100\nmetrics_staleness_ms = 700\nprobe_timeout_ms = 200\n\
             saturation_queue_depth = 5\n\
             [[pools]]\nname = \"p\"\nmodel = \"m\"\nflavor = \"vllm\"\npolicy = \"session\"\n\
             endpoints = [\"http://127.0.0.1:9\"]\n\
             [pools.scoring]\nweights = { prefix = 7, kv_usage = 0 }\nherd_factor = 2.5\n\
             pin_hysteresis_tokens = 1000\n",
        )
        .unwrap();
        let routing = pool_routing(&config, &config.pools[0]).unwrap();
        assert_eq!(routing.policy, Policy::Session);
        let scoring = &routing.scoring;
        assert_eq!(scoring.weight("prefix"), 7.0);
        assert_eq!(scoring.weight("kv_usage"), 0.0);
        assert_eq!(scoring.weight("session_pin"), 10.0, "a default kept");
        assert_eq!(scoring.weight("queue"), 1.0);
        assert_eq!(scoring.herd_factor, 2.5);
        assert_eq!(scoring.herd_slack, 2.0);
        assert_eq!(scoring.pin_hysteresis_tokens, 1000.0);
        // The picker judges saturation, stale metrics included, by the routing section.
        let expected = Saturation {
            max_waiting: 5.0,
            max_kv_usage: config.routing.saturation_kv_usage,
            staleness: Some(Duration::from_millis(700)),
        };
        assert_eq!(scoring.saturation, expected);
        assert_eq!(routing.saturation, expected);
    }

    #[tokio::test]
    async fn a_busy_engine_relabelled_again_and_again_leaves_nothing_to_drain() {
        let config = Config::parse(
            "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
             [[pools]]\nname = \"p\"\nmodel = \"m\"\nendpoints_file = \"/nonexistent/e.yaml\"\n",
        )
        .unwrap();
        let engines = agentgate_adapters::EngineClient::new(Default::default());
        let pools = Pools::start(&config, &engines).await.unwrap();
        let pool = pools.for_model("m").unwrap();
        let listed = |generation: u32| {
            vec![DiscoveredEndpoint {
                name: "a".into(),
                address: "127.0.0.1".into(),
                port: 9,
                labels: [("generation".to_string(), generation.to_string())].into(),
            }]
        };
        let mut draining = Vec::new();
        pool.apply_discovered(&listed(0), &mut draining).unwrap();
        // Always a request in flight on the engine, whatever its labels say.
        let _busy = pool.endpoints()[0].begin(10, 0);
        for generation in 1..20 {
            pool.apply_discovered(&listed(generation), &mut draining)
                .unwrap();
        }
        assert!(draining.is_empty(), "{} left to drain", draining.len());
        assert_eq!(pool.endpoints()[0].in_flight_requests(), 1);
        // Removed while busy: drained until its request ends.
        pool.apply_discovered(&[], &mut draining).unwrap();
        assert_eq!(draining.len(), 1);
    }

    #[tokio::test]
    async fn endpoint_tables_and_simulated_roles_make_one_mixed_pool() {
        let config = Config::parse(
            "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
             [[pools]]\nname = \"pd\"\nmodel = \"m\"\nflavor = \"sglang\"\n\
             labels = { zone = \"a\" }\n\
             endpoints = [\"http://127.0.0.1:9\", \
               { url = \"http://127.0.0.1:10/\", role = \"prefill\", bootstrap_port = 8999, labels = { accelerator = \"x\" } }, \
               { url = \"http://127.0.0.1:11\", role = \"prefill\" }]\n\
             [pools.simulate]\nreplicas = 0\nprefill_replicas = 1\ndecode_replicas = 2\ntime_scale = 0\n\
             [pools.disaggregation]\nbootstrap_port = 7000\nthreshold_tokens = 10\n\
             [[pools]]\nname = \"plain\"\nmodel = \"m2\"\nflavor = \"sglang\"\n\
             endpoints = [{ url = \"http://127.0.0.1:12\", role = \"prefill\" }, \
               { url = \"http://127.0.0.1:13\", role = \"decode\" }, \
               { url = \"http://[::1]:14\", role = \"prefill\" }]\n",
        )
        .unwrap();
        let engines = agentgate_adapters::EngineClient::new(Default::default());
        let pools = Pools::start(&config, &engines).await.unwrap();
        let pool = pools.for_model("m").unwrap();
        let eps = pool.endpoints();
        let roles: Vec<Role> = eps.iter().map(|e| e.role).collect();
        assert_eq!(
            roles,
            [
                Role::Both,
                Role::Prefill,
                Role::Prefill,
                Role::Prefill,
                Role::Decode,
                Role::Decode
            ]
        );
        assert!(pool.disaggregates());
        assert_eq!(pool.disaggregation.threshold_tokens, 10);
        assert_eq!(eps[1].base_url, "http://127.0.0.1:10");
        assert_eq!(eps[1].labels["zone"], "a");
        assert_eq!(eps[1].labels["accelerator"], "x");
        // Its own port, the pool's default; a simulated replica's HTTP port; with neither,
        // SGLang's own default.
        assert_eq!(pool.bootstrap(&eps[1]), Some(("127.0.0.1".into(), 8999)));
        let plain = pools.for_model("m2").unwrap();
        assert_eq!(
            plain.bootstrap(&plain.endpoints()[0]),
            Some(("127.0.0.1".into(), SGLANG_BOOTSTRAP_PORT))
        );
        // SGLang joins `{host}:{port}`: an IPv6 host goes in brackets.
        assert_eq!(
            plain.bootstrap(&plain.endpoints()[2]),
            Some(("[::1]".into(), SGLANG_BOOTSTRAP_PORT))
        );
        assert_eq!(pool.bootstrap(&eps[2]), Some(("127.0.0.1".into(), 7000)));
        let sim_port = host_port(&eps[3].base_url).unwrap().1;
        assert_eq!(
            pool.bootstrap(&eps[3]),
            Some(("127.0.0.1".into(), sim_port))
        );
        assert_eq!(pool.bootstrap(&eps[0]).map(|b| b.1), Some(7000));
        assert_eq!(
            eps.iter().map(|e| e.slot).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5]
        );
        // A simulated decode replica answers as one.
        let models = engines.models(&eps[4].base_url).await.unwrap();
        assert_eq!(models, ["m"]);
        pools.shutdown().await;
    }
}
