//! Engine pools: which endpoints serve which model, and the `Picker` seam that chooses one.
//!
//! A pool is the set of engine replicas serving one model (plus the aliases clients may use for
//! it). Endpoints come from the config's `endpoints` list and from in-process simulated replicas
//! (`[pools.simulate]`). Each pool routes with the [`Picker`] its `policy` names
//! (`agentgate-scheduler`).

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use agentgate_adapters::{EngineClient, Flavor};
use agentgate_scheduler::PrefixIndexConfig;
pub use agentgate_scheduler::{Endpoint, PickRequest, Picker, Policy};

use crate::config::{Config, PoolConfig, SimulateConfig};

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
    /// Routing policy.
    pub policy: Policy,
    /// The policy's picker.
    pub picker: Box<dyn Picker>,
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
}

/// All pools, indexed by every model name and alias clients may use.
pub struct Pools {
    pools: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    /// In-process simulated replicas, kept alive for the gateway's lifetime.
    sims: Vec<agentgate_sim::SimHandle>,
}

impl Pools {
    /// Build pools from the config, starting any simulated replicas it asks for. Pools whose
    /// policy keeps a prefix index size it from each engine's reported KV capacity.
    pub async fn start(config: &Config, engines: &EngineClient) -> std::io::Result<Pools> {
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
            let endpoints: Vec<Arc<Endpoint>> = urls
                .into_iter()
                .enumerate()
                .map(|(j, base_url)| {
                    Arc::new(Endpoint::new(format!("{}/{}", pc.name, j), base_url).with_slot(j))
                })
                .collect();
            let policy = Policy::parse(&pc.policy)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            for name in std::iter::once(&pc.model).chain(pc.aliases.iter()) {
                by_model.insert(name.clone(), i);
            }
            let index_config = PrefixIndexConfig {
                bytes_per_token: pc.prefix_bytes_per_token,
                ..PrefixIndexConfig::default()
            };
            let picker = policy
                .picker(index_config, &pc.scoring.resolve(policy))
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            if let Some(index) = picker.prefix_index() {
                for ep in &endpoints {
                    match engines.scrape_metrics(pc.flavor, &ep.base_url).await {
                        Ok(m) => {
                            if let Some(tokens) = m.kv_capacity_tokens() {
                                index.set_capacity(ep.slot, tokens);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(endpoint = %ep.name, "no KV capacity from metrics ({e}); the prefix index assumes the default")
                        }
                    }
                }
            }
            pools.push(Arc::new(Pool {
                name: pc.name.clone(),
                model: pc.model.clone(),
                flavor: pc.flavor,
                endpoints: RwLock::new(Arc::new(endpoints)),
                policy,
                picker,
            }));
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
