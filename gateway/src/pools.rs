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
//! The first two are *fixed* for the process's lifetime; discovery replaces only the third part
//! of the list ([`Pool::apply_discovered`]). Each pool routes with the [`Picker`] its `policy`
//! names (`agentgate-scheduler`), behind a gate that keeps unavailable endpoints (unhealthy or
//! retired) out of every pick and breaks session pins to them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use agentgate_adapters::{EngineClient, Flavor};
pub use agentgate_scheduler::{Endpoint, PickRequest, Picker, Policy};
use agentgate_scheduler::{PrefixIndex, PrefixIndexConfig, Role, Saturation};

use crate::config::{Config, PoolConfig, SimulateConfig};
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
}

impl Pool {
    /// The current endpoint list.
    pub fn endpoints(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.endpoints
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replace the endpoint list (requests already routed keep their endpoint).
    pub fn set_endpoints(&self, endpoints: Vec<Arc<Endpoint>>) {
        *self
            .endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(endpoints);
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
        for e in diff
            .removed
            .iter()
            .chain(diff.relabelled.iter().map(|(old, _)| old))
        {
            e.retire();
            if e.in_flight_requests() > 0 {
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

/// A new endpoint takes `e.slot`: drop whatever the prefix index learnt for that slot.
fn forget_slot(index: &PrefixIndex, e: &Endpoint) {
    index.clear(e.slot);
}

/// All pools, indexed by every model name and alias clients may use.
pub struct Pools {
    pools: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    /// In-process simulated replicas, kept alive for the gateway's lifetime.
    sims: Vec<agentgate_sim::SimHandle>,
}

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
            let mut urls: Vec<String> = pc
                .endpoints
                .iter()
                .map(|u| u.trim_end_matches('/').to_string())
                .collect();
            if let Some(sim) = &pc.simulate {
                for r in 0..sim.replicas {
                    let handle = agentgate_sim::spawn(sim_config(pc, sim, r)).await?;
                    tracing::info!(pool = %pc.name, replica = r, url = %handle.base_url(), "simulated replica started");
                    urls.push(handle.base_url());
                    sims.push(handle);
                }
            }
            let role = pc.role();
            let fixed: Vec<Arc<Endpoint>> = urls
                .into_iter()
                .enumerate()
                .map(|(j, base_url)| {
                    Arc::new(
                        Endpoint::new(format!("{}/{}", pc.name, j), base_url)
                            .with_slot(j)
                            .with_role(role)
                            .with_labels(pc.labels.clone()),
                    )
                })
                .collect();
            let defaults = discovery::Defaults {
                role,
                labels: pc.labels.clone(),
            };
            let discovered = match &pc.endpoints_file {
                None => Vec::new(),
                Some(path) => match FileDiscovery::read(path).map_err(invalid)? {
                    Some(list) => {
                        let diff = discovery::diff(&pc.name, &fixed, &[], &list, &defaults, &[])
                            .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
                        tracing::info!(pool = %pc.name, file = %path.display(), endpoints = diff.endpoints.len(), "endpoints file read");
                        diff.endpoints
                    }
                    None => {
                        tracing::warn!(pool = %pc.name, file = %path.display(), "endpoints file not found; watching for it");
                        Vec::new()
                    }
                },
            };
            let fixed_count = fixed.len();
            let mut endpoints = fixed;
            endpoints.extend(discovered);
            let policy = Policy::parse(&pc.policy).map_err(invalid)?;
            for name in std::iter::once(&pc.model).chain(pc.aliases.iter()) {
                by_model.insert(name.clone(), i);
            }
            let index_config = PrefixIndexConfig {
                bytes_per_token: pc.prefix_bytes_per_token,
                ..PrefixIndexConfig::default()
            };
            let saturation = config.routing.saturation(pc.flavor);
            let mut scoring = pc.scoring.resolve(policy);
            scoring.saturation = saturation;
            let picker = policy.picker(index_config, &scoring).map_err(invalid)?;
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

fn sim_config(pool: &PoolConfig, sim: &SimulateConfig, replica: usize) -> agentgate_sim::SimConfig {
    let flavor = match pool.flavor {
        Flavor::Sglang => agentgate_sim::Flavor::Sglang,
        _ => agentgate_sim::Flavor::Vllm,
    };
    agentgate_sim::SimConfig {
        flavor,
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        model: pool.model.clone(),
        block_size: sim.block_size as _,
        kv_blocks: sim.kv_blocks as _,
        max_num_seqs: sim.max_num_seqs as _,
        prefill_tokens_per_s: sim.prefill_tokens_per_s,
        decode_ms_per_token: sim.decode_ms_per_token,
        time_scale: sim.time_scale,
        seed: Some(replica as u64 + 1),
        ..Default::default()
    }
}
