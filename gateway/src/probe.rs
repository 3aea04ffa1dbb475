//! Live endpoint state: health probes, engine metrics scrapes and endpoints-file watchers, as
//! background tasks of a running gateway ([`LiveTasks`]).
//!
//! - **Health.** Every `routing.health_interval_ms`, one loop probes every endpoint of every pool
//!   at once (`GET /health`, then `GET /v1/models`, which must list the pool's model: a
//!   replica serving another one would answer every request 404; the generic `openai` flavor
//!   has no health route, only the second), each probe bounded by `routing.health_timeout_ms`
//!   (SGLang's `/health` generates a token and answers a second or more later). A [`Streak`] per endpoint
//!   takes it out after `unhealthy_after` consecutive failures and returns it after
//!   `healthy_after` consecutive passes, so one lost probe does not flap an endpoint. Taken out
//!   is logged at warn, returned at info. Probes run beside requests and never hold them up:
//!   routing only reads the verdict ([`Endpoint::is_available`]).
//! - **Load.** Every `routing.scrape_interval_ms`, a sibling loop scrapes every endpoint's
//!   `/metrics` (vLLM and SGLang names, see `agentgate_adapters::engine_metrics`) into
//!   [`Endpoint::set_load_report`], and keeps the pool's prefix index capacity for the
//!   endpoint's slot in step with the KV capacity the engine reports. An engine whose lifetime
//!   counters went back restarted: the index forgets what it held
//!   ([`Endpoint::engine_restarted`]); one that only failed its probes a while (too busy to
//!   answer them) keeps its cache, and the index its entries. A failed scrape leaves the
//!   last report to age: past `routing.metrics_staleness_ms` the endpoint counts as saturated.
//!   The gateway's own in-flight counts need no scraping; they are exact at all times.
//! - **Discovery.** One watcher per pool with an `endpoints_file` applies each new list
//!   ([`crate::pools::Pool::apply_discovered`]) and scrapes the new endpoints at once, so they
//!   do not start out stale.
//!
//! After every round the loops call the hook given to [`LiveTasks::start`]: flow control
//! re-reads the pools' capacity, which changes with every scrape and health verdict.
//!
//! Every loop stops on [`LiveTasks::shutdown`]; dropping [`LiveTasks`] aborts them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use agentgate_adapters::{EngineClient, Flavor};
use agentgate_scheduler::{Endpoint, LoadReport};

use crate::config::RoutingConfig;
use crate::discovery::{Discovery, FileDiscovery, Update};
use crate::metrics::Metrics;
use crate::pools::Pool;

/// Scrape an endpoint's `/metrics` once within `timeout`: record its load report (when
/// `record_load`) and size the pool's prefix index slot from the reported KV capacity.
pub async fn scrape(
    engines: &EngineClient,
    pool: &Pool,
    endpoint: &Endpoint,
    timeout: Duration,
    record_load: bool,
) -> Result<(), String> {
    let in_flight_before = endpoint.in_flight_requests();
    let metrics = match tokio::time::timeout(
        timeout,
        engines.scrape_metrics(pool.flavor, &endpoint.base_url),
    )
    .await
    {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("no metrics within {timeout:?}")),
    };
    if record_load {
        endpoint.set_load_report(LoadReport {
            at: Instant::now(),
            waiting: metrics.waiting.unwrap_or(0.0),
            running: metrics.running.unwrap_or(0.0),
            kv_usage: metrics.kv_usage,
            gateway_in_flight: in_flight_before.max(endpoint.in_flight_requests()),
            peer_in_flight: endpoint.peer_in_flight(),
        });
    }
    // A counter that went back, or one that is gone (SGLang's appears only once a request
    // finished), says the engine restarted.
    let restarted = match metrics.prefix_cache_queries {
        Some(queries) => endpoint.engine_restarted(queries),
        None => endpoint.lifetime_counter_vanished(),
    };
    if restarted {
        // Its cache is empty, whatever the index last knew of it.
        if let Some(index) = pool
            .picker
            .prefix_index()
            .filter(|_| !endpoint.is_retired())
        {
            index.clear(endpoint.slot);
        }
        tracing::info!(pool = %pool.name, endpoint = %endpoint.name, "engine restarted (its counters started over); its cache is empty");
    }
    if let Some(tokens) = metrics.kv_capacity_tokens() {
        // An engine reporting an absurd capacity (a bug, a bad exporter) must not make its
        // prefix-index slot grow with every prompt it is sent.
        let tokens = tokens.min(MAX_KV_CAPACITY_TOKENS);
        endpoint.set_kv_capacity_tokens(tokens);
        if let Some(index) = pool
            .picker
            .prefix_index()
            .filter(|_| !endpoint.is_retired())
        {
            // Unknown slots (beyond the index's size) are ignored by the index. A retired
            // endpoint's slot may be another engine's by now.
            index.set_capacity(endpoint.slot, tokens);
        }
    }
    Ok(())
}

/// Largest KV capacity taken from an engine's metrics, in tokens: 2^28, some 100 times what the
/// largest nodes hold.
const MAX_KV_CAPACITY_TOKENS: u64 = 1 << 28;

/// Probe an endpoint's health once within `timeout`: its `/health` (vLLM, SGLang), then
/// whether `/v1/models` lists `model`, the pool's. A replica serving another model (a wrong
/// address, a redeploy) is healthy by its own account, yet would answer every request 404.
pub async fn health(
    engines: &EngineClient,
    flavor: Flavor,
    endpoint: &Endpoint,
    model: &str,
    timeout: Duration,
) -> Result<(), String> {
    let probe = async {
        if flavor != Flavor::Openai {
            engines
                .health(&endpoint.base_url)
                .await
                .map_err(|e| e.to_string())?;
        }
        let served = engines
            .models(&endpoint.base_url)
            .await
            .map_err(|e| e.to_string())?;
        if served.iter().any(|m| m == model) {
            return Ok(());
        }
        let mut listed = served.join(", ");
        if listed.len() > 200 {
            listed = format!("{}...", listed.chars().take(200).collect::<String>());
        }
        Err(format!(
            "it serves [{listed}], not the pool's model `{model}`"
        ))
    };
    match tokio::time::timeout(timeout, probe).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Consecutive probe outcomes of one endpoint, and when they change its verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streak {
    fails: u32,
    passes: u32,
}

impl Streak {
    /// Record a probe outcome for an endpoint now `healthy`; returns the new verdict when it
    /// changes: unhealthy after `unhealthy_after` failures in a row, healthy again after
    /// `healthy_after` passes in a row.
    pub fn observe(
        &mut self,
        ok: bool,
        healthy: bool,
        unhealthy_after: u32,
        healthy_after: u32,
    ) -> Option<bool> {
        if ok {
            self.fails = 0;
            self.passes = self.passes.saturating_add(1);
            (!healthy && self.passes >= healthy_after).then_some(true)
        } else {
            self.passes = 0;
            self.fails = self.fails.saturating_add(1);
            (healthy && self.fails >= unhealthy_after).then_some(false)
        }
    }
}

/// Called after each round that may have changed the pools' capacity (see
/// [`LiveTasks::start`]).
pub type CapacityChanged = Arc<dyn Fn() + Send + Sync>;

/// What the loops share.
struct Live {
    changed: CapacityChanged,
    pools: Vec<Arc<Pool>>,
    engines: EngineClient,
    metrics: Arc<Metrics>,
    /// Bound of one scrape.
    timeout: Duration,
    /// Bound of one health probe.
    health_timeout: Duration,
    unhealthy_after: u32,
    healthy_after: u32,
    record_load: bool,
}

/// Per-endpoint loop state, keyed by (pool, slot) and reset when another endpoint takes the
/// slot.
struct PerEndpoint<T> {
    map: HashMap<(usize, usize), (Arc<Endpoint>, T)>,
}

impl<T: Default> PerEndpoint<T> {
    fn new() -> Self {
        PerEndpoint {
            map: HashMap::new(),
        }
    }

    fn get(&mut self, pool: usize, endpoint: &Arc<Endpoint>) -> &mut T {
        let entry = self
            .map
            .entry((pool, endpoint.slot))
            .or_insert_with(|| (endpoint.clone(), T::default()));
        if !Arc::ptr_eq(&entry.0, endpoint) {
            *entry = (endpoint.clone(), T::default());
        }
        &mut entry.1
    }

    /// Forget endpoints that left their pools.
    fn retain(&mut self, live: &HashSet<(usize, usize)>) {
        self.map.retain(|k, _| live.contains(k));
    }
}

impl Live {
    /// Every endpoint of every pool, with its pool's position.
    fn targets(&self, filter: impl Fn(&Pool) -> bool) -> Vec<(usize, Arc<Pool>, Arc<Endpoint>)> {
        let mut out = Vec::new();
        for (i, pool) in self.pools.iter().enumerate().filter(|(_, p)| filter(p)) {
            for e in pool.endpoints().iter() {
                out.push((i, pool.clone(), e.clone()));
            }
        }
        out
    }

    async fn health_round(&self, streaks: &mut PerEndpoint<Streak>) {
        let targets = self.targets(|_| true);
        let probes = targets.iter().map(|(_, pool, e)| async {
            let start = Instant::now();
            let result = health(
                &self.engines,
                pool.flavor,
                e,
                &pool.model,
                self.health_timeout,
            )
            .await;
            self.metrics
                .probe_duration
                .observe([&pool.name, "health"], start.elapsed().as_secs_f64());
            result
        });
        let results = futures_util::future::join_all(probes).await;
        let mut live = HashSet::new();
        for ((i, pool, e), result) in targets.iter().zip(results) {
            // Removed while probed: no verdict on an endpoint no longer listed.
            if e.is_retired() {
                continue;
            }
            live.insert((*i, e.slot));
            if let Err(reason) = &result {
                self.metrics.probe_failed(&pool.name, e, "health");
                tracing::debug!(pool = %pool.name, endpoint = %e.name, "health probe failed: {reason}");
            }
            let verdict = streaks.get(*i, e).observe(
                result.is_ok(),
                e.is_healthy(),
                self.unhealthy_after,
                self.healthy_after,
            );
            let Some(healthy) = verdict else { continue };
            if !e.set_healthy(healthy) {
                continue;
            }
            if healthy {
                // Back from a failure. Whether it restarted (and lost its cache) the next scrape
                // tells, from its counters; without them it is taken to have: a slow engine
                // that missed its probes keeps its cache, and the index with it.
                if !e.tells_restarts() || !self.record_load {
                    if let Some(index) = pool.picker.prefix_index() {
                        index.clear(e.slot);
                    }
                }
                self.metrics.health_transition(&pool.name, e, "healthy");
                tracing::info!(pool = %pool.name, endpoint = %e.name, "endpoint healthy again; taking new work");
            } else {
                self.metrics.health_transition(&pool.name, e, "unhealthy");
                let reason = result.err().unwrap_or_default();
                tracing::warn!(pool = %pool.name, endpoint = %e.name, failures = self.unhealthy_after, "endpoint unhealthy; taken out ({reason})");
            }
        }
        streaks.retain(&live);
    }

    async fn scrape_round(&self, failing: &mut PerEndpoint<bool>) {
        let targets = self.targets(|p| p.flavor != Flavor::Openai);
        let results = futures_util::future::join_all(
            targets.iter().map(|(_, pool, e)| self.scrape_one(pool, e)),
        )
        .await;
        let mut live = HashSet::new();
        for ((i, pool, e), result) in targets.iter().zip(results) {
            live.insert((*i, e.slot));
            let was_failing = failing.get(*i, e);
            match result {
                Ok(()) if *was_failing => {
                    *was_failing = false;
                    tracing::info!(pool = %pool.name, endpoint = %e.name, "engine metrics readable again");
                }
                Ok(()) => {}
                Err(reason) => {
                    if !*was_failing {
                        tracing::warn!(pool = %pool.name, endpoint = %e.name, "cannot scrape engine metrics ({reason}); the endpoint counts as saturated once its last scrape is stale");
                    }
                    *was_failing = true;
                }
            }
        }
        failing.retain(&live);
    }

    async fn scrape_one(&self, pool: &Pool, e: &Endpoint) -> Result<(), String> {
        let start = Instant::now();
        let result = scrape(&self.engines, pool, e, self.timeout, self.record_load).await;
        self.metrics
            .probe_duration
            .observe([&pool.name, "metrics"], start.elapsed().as_secs_f64());
        if result.is_err() {
            self.metrics.probe_failed(&pool.name, e, "metrics");
        }
        result
    }
}

/// Wait for the stop signal (or for its sender to go away).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

fn ticker(every: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval(every);
    t.set_missed_tick_behavior(MissedTickBehavior::Delay);
    t
}

async fn health_loop(live: Arc<Live>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = ticker(every);
    let mut streaks = PerEndpoint::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped(&mut stop) => return,
        }
        tokio::select! {
            _ = live.health_round(&mut streaks) => {}
            _ = stopped(&mut stop) => return,
        }
        (live.changed)();
    }
}

async fn scrape_loop(live: Arc<Live>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = ticker(every);
    let mut failing = PerEndpoint::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped(&mut stop) => return,
        }
        tokio::select! {
            _ = live.scrape_round(&mut failing) => {}
            _ = stopped(&mut stop) => return,
        }
        (live.changed)();
    }
}

/// Apply every list `source` produces to `pool` until stopped.
async fn discovery_loop<D: Discovery>(
    live: Arc<Live>,
    pool: Arc<Pool>,
    mut source: D,
    mut stop: watch::Receiver<bool>,
) {
    let mut draining = Vec::new();
    let what = source.describe();
    loop {
        let update = tokio::select! {
            u = source.next() => u,
            _ = stopped(&mut stop) => return,
        };
        let list = match update {
            Update::Endpoints(list) => list,
            Update::Failed(reason) => {
                live.metrics.discovery_reload(&pool.name, "error");
                tracing::warn!(pool = %pool.name, source = %what, "endpoint list not updated: {reason}");
                continue;
            }
        };
        let diff = match pool.apply_discovered(&list, &mut draining) {
            Ok(diff) => diff,
            Err(reason) => {
                live.metrics.discovery_reload(&pool.name, "error");
                tracing::warn!(pool = %pool.name, source = %what, "endpoint list refused, keeping the current one: {reason}");
                continue;
            }
        };
        live.metrics.discovery_reload(&pool.name, "ok");
        if !diff.changed() {
            continue;
        }
        let listed = pool.endpoints();
        // A name no longer listed takes its metric series with it.
        let forget_unlisted = |name: &str| {
            if !listed.iter().any(|l| l.name == name) {
                live.metrics.forget_endpoint(&pool.name, name);
            }
        };
        for e in &diff.removed {
            tracing::info!(pool = %pool.name, endpoint = %e.name, url = %e.base_url, in_flight = e.in_flight_requests(), "endpoint removed; its requests in flight finish");
            forget_unlisted(&e.name);
        }
        for (old, e) in &diff.relabelled {
            if old.name == e.name {
                tracing::info!(pool = %pool.name, endpoint = %e.name, slot = e.slot, role = e.role.name(), labels = ?e.labels, "endpoint relabelled");
            } else {
                tracing::info!(pool = %pool.name, endpoint = %e.name, was = %old.name, url = %e.base_url, slot = e.slot, role = e.role.name(), labels = ?e.labels, "endpoint renamed");
                forget_unlisted(&old.name);
            }
        }
        for e in &diff.added {
            tracing::info!(pool = %pool.name, endpoint = %e.name, url = %e.base_url, slot = e.slot, role = e.role.name(), "endpoint added");
        }
        tracing::info!(pool = %pool.name, source = %what, added = diff.added.len(), removed = diff.removed.len(), relabelled = diff.relabelled.len(), kept = diff.kept, "endpoint list updated");
        if pool.flavor != Flavor::Openai {
            let scrapes = diff.added.iter().map(|e| live.scrape_one(&pool, e));
            futures_util::future::join_all(scrapes).await;
        }
        (live.changed)();
    }
}

/// The background tasks keeping a gateway's endpoint state live (see the module doc).
pub struct LiveTasks {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl LiveTasks {
    /// Start the health loop, the scrape loop (each unless its interval is 0) and one watcher
    /// per pool with an `endpoints_file`. `changed` is called after every health round,
    /// scrape round and applied endpoint list (flow control dispatches what the new capacity
    /// allows).
    pub fn start(
        pools: &[Arc<Pool>],
        engines: &EngineClient,
        metrics: &Arc<Metrics>,
        routing: &RoutingConfig,
        changed: CapacityChanged,
    ) -> LiveTasks {
        let (stop, rx) = watch::channel(false);
        let live = Arc::new(Live {
            changed,
            pools: pools.to_vec(),
            engines: engines.clone(),
            metrics: metrics.clone(),
            timeout: Duration::from_millis(routing.probe_timeout_ms.max(1)),
            health_timeout: Duration::from_millis(routing.health_timeout_ms.max(1)),
            unhealthy_after: routing.unhealthy_after.max(1),
            healthy_after: routing.healthy_after.max(1),
            record_load: routing.scrape_interval().is_some(),
        });
        let mut tasks = Vec::new();
        if let Some(every) = routing.health_interval() {
            tasks.push(tokio::spawn(health_loop(live.clone(), every, rx.clone())));
        }
        if let Some(every) = routing.scrape_interval() {
            tasks.push(tokio::spawn(scrape_loop(live.clone(), every, rx.clone())));
        }
        let poll = Duration::from_millis(routing.discovery_interval_ms.max(1));
        for pool in pools {
            if let Some(path) = &pool.endpoints_file {
                let source = FileDiscovery::new(path, poll);
                tasks.push(tokio::spawn(discovery_loop(
                    live.clone(),
                    pool.clone(),
                    source,
                    rx.clone(),
                )));
            }
        }
        LiveTasks { stop, tasks }
    }

    /// Stop every task and wait for them.
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for LiveTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaks_need_consecutive_outcomes_to_flip() {
        let mut s = Streak::default();
        // unhealthy_after = 2, healthy_after = 3
        assert_eq!(s.observe(false, true, 2, 3), None);
        assert_eq!(
            s.observe(true, true, 2, 3),
            None,
            "a pass resets the failures"
        );
        assert_eq!(s.observe(false, true, 2, 3), None);
        assert_eq!(s.observe(false, true, 2, 3), Some(false));
        // Further failures while unhealthy change nothing.
        assert_eq!(s.observe(false, false, 2, 3), None);
        assert_eq!(s.observe(true, false, 2, 3), None);
        assert_eq!(s.observe(true, false, 2, 3), None);
        assert_eq!(
            s.observe(false, false, 2, 3),
            None,
            "a failure resets the passes"
        );
        assert_eq!(s.observe(true, false, 2, 3), None);
        assert_eq!(s.observe(true, false, 2, 3), None);
        assert_eq!(s.observe(true, false, 2, 3), Some(true));
        assert_eq!(s.observe(true, true, 2, 3), None);
        // With 1 and 1 every outcome decides.
        let mut s = Streak::default();
        assert_eq!(s.observe(false, true, 1, 1), Some(false));
        assert_eq!(s.observe(true, false, 1, 1), Some(true));
    }

    #[test]
    fn per_endpoint_state_resets_when_a_slot_changes_hands() {
        let a = Arc::new(Endpoint::new("a", "http://127.0.0.1:1").with_slot(3));
        let b = Arc::new(Endpoint::new("b", "http://127.0.0.1:2").with_slot(3));
        let mut m: PerEndpoint<u32> = PerEndpoint::new();
        *m.get(0, &a) += 5;
        assert_eq!(*m.get(0, &a), 5);
        assert_eq!(
            *m.get(0, &b),
            0,
            "another endpoint in the same slot starts fresh"
        );
        assert_eq!(*m.get(1, &a), 0, "pools are separate");
        m.retain(&HashSet::from([(1, 3)]));
        assert_eq!(m.map.len(), 1);
    }
}
