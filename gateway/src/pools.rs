//! Engine pools: which endpoints serve which model, and the `Picker` seam that chooses one.
//!
//! A pool is the set of engine replicas serving one model (plus the aliases clients may use for
//! it). Endpoints come from the config's `endpoints` list and from in-process simulated replicas
//! (`[pools.simulate]`). The [`Picker`] trait is the seam where routing policy plugs in; the
//! default here is round robin, skipping endpoints a request has already failed on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use agentgate_adapters::Flavor;

use crate::config::{Config, PoolConfig, SimulateConfig};

/// One engine replica.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Display name (`pool/index`), safe to show in headers and logs.
    pub name: String,
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub base_url: String,
}

/// What a picker may look at when choosing an endpoint.
#[derive(Debug, Default)]
pub struct PickRequest<'a> {
    /// Endpoint indexes already tried (and failed) for this request.
    pub exclude: &'a [usize],
}

/// Chooses the endpoint of a pool that serves a request.
pub trait Picker: Send + Sync + std::fmt::Debug {
    /// Index into `endpoints`, or None when every endpoint is excluded.
    fn pick(&self, endpoints: &[Endpoint], request: &PickRequest<'_>) -> Option<usize>;
}

/// Round robin over the endpoints not yet tried.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Picker for RoundRobin {
    fn pick(&self, endpoints: &[Endpoint], request: &PickRequest<'_>) -> Option<usize> {
        let n = endpoints.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .find(|i| !request.exclude.contains(i))
    }
}

/// Engines serving one model.
#[derive(Debug)]
pub struct Pool {
    /// Pool name from the config.
    pub name: String,
    /// Model name sent upstream.
    pub model: String,
    /// Engine protocol flavor.
    pub flavor: Flavor,
    /// The replicas.
    pub endpoints: Vec<Endpoint>,
    /// Routing policy.
    pub picker: Box<dyn Picker>,
}

/// All pools, indexed by every model name and alias clients may use.
pub struct Pools {
    pools: Vec<Arc<Pool>>,
    by_model: HashMap<String, usize>,
    /// In-process simulated replicas, kept alive for the gateway's lifetime.
    sims: Vec<agentgate_sim::SimHandle>,
}

impl Pools {
    /// Build pools from the config, starting any simulated replicas it asks for.
    pub async fn start(config: &Config) -> std::io::Result<Pools> {
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
            let endpoints = urls
                .into_iter()
                .enumerate()
                .map(|(j, base_url)| Endpoint {
                    name: format!("{}/{}", pc.name, j),
                    base_url,
                })
                .collect();
            for name in std::iter::once(&pc.model).chain(pc.aliases.iter()) {
                by_model.insert(name.clone(), i);
            }
            pools.push(Arc::new(Pool {
                name: pc.name.clone(),
                model: pc.model.clone(),
                flavor: pc.flavor,
                endpoints,
                picker: Box::new(RoundRobin::default()),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(n: usize) -> Vec<Endpoint> {
        (0..n)
            .map(|i| Endpoint {
                name: format!("p/{i}"),
                base_url: format!("http://127.0.0.1:{}", 9000 + i),
            })
            .collect()
    }

    #[test]
    fn round_robin_cycles_and_skips_excluded() {
        let rr = RoundRobin::default();
        let e = eps(3);
        let picks: Vec<_> = (0..6)
            .map(|_| rr.pick(&e, &PickRequest::default()).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        for _ in 0..6 {
            let p = rr.pick(&e, &PickRequest { exclude: &[1] }).unwrap();
            assert_ne!(p, 1);
        }
        assert_eq!(
            rr.pick(
                &e,
                &PickRequest {
                    exclude: &[0, 1, 2]
                }
            ),
            None
        );
    }
}
