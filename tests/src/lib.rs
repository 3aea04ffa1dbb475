//! Shared helpers for agentgate's end-to-end tests: start simulated engines, gateways on a real
//! Redis, and read Responses SSE streams.
//!
//! Most tests run the same shape: N simulated replicas of `sim-model`, one pool `sim` over them
//! (a routing policy, a Redis store and extra TOML as the test needs), one or more gateways on
//! that config, requests, then every gateway and replica shut down. [`Fleet`] is that shape;
//! tests whose replicas or configs are unusual start them with the functions below instead.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use agentgate::pools::Pool;
use agentgate::Gateway;
use agentgate_sim::SimHandle;
use futures_util::StreamExt;
use serde_json::Value;

pub use agentgate_sessions::testing::{closed_port, unique_prefix, TestRedis};

/// Start one simulated vLLM replica with no simulated delays.
pub async fn start_sim(model: &str) -> SimHandle {
    start_sim_with(model, 0.0).await
}

/// Start one simulated vLLM replica with the given time scale.
pub async fn start_sim_with(model: &str, time_scale: f64) -> SimHandle {
    agentgate_sim::spawn(agentgate_sim::SimConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        model: model.to_string(),
        time_scale,
        ..Default::default()
    })
    .await
    .expect("simulator starts")
}

/// A gateway config TOML: one pool `sim-model` over `endpoints`, optional Redis store, extra
/// TOML appended verbatim.
pub fn config_toml(endpoints: &[String], store: Option<(&str, &str)>, extra: &str) -> String {
    let eps: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
    let store = match store {
        Some((url, prefix)) => format!("[store]\nurl = \"{url}\"\nkey_prefix = \"{prefix}\"\n"),
        None => String::new(),
    };
    format!(
        "{store}\n[[pools]]\nname = \"sim\"\nmodel = \"sim-model\"\nendpoints = [{}]\n{extra}\n",
        eps.join(", ")
    )
}

/// Start a gateway on a free loopback port.
pub async fn start_gateway(toml: &str) -> Gateway {
    let config = agentgate::Config::parse(toml).expect("valid test config");
    Gateway::start(config, SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("gateway starts")
}

/// Simulated replicas of `sim-model` behind gateways that share one config (see
/// [`FleetBuilder`]). [`Fleet::shutdown`] stops the gateways, then the replicas, each in the
/// order they started.
pub struct Fleet {
    sims: Vec<SimHandle>,
    gateways: Vec<Gateway>,
    toml: String,
}

/// How to start a [`Fleet`]: which replicas, and the pool config the gateways get:
/// [`config_toml`] over the replicas' URLs with the store and extra TOML given, and `policy =
/// "…"` put in the pool when a policy is given.
pub struct FleetBuilder {
    sims: Vec<SimHandle>,
    replicas: usize,
    time_scale: f64,
    policy: Option<String>,
    store: Option<(String, String)>,
    shared_memory: bool,
    extra: String,
    gateways: usize,
}

impl Fleet {
    /// `replicas` new simulated replicas (no simulated delays unless
    /// [`FleetBuilder::time_scale`] says otherwise), one gateway, no store, no extra TOML.
    pub fn of(replicas: usize) -> FleetBuilder {
        FleetBuilder {
            sims: Vec::new(),
            replicas,
            time_scale: 0.0,
            policy: None,
            store: None,
            shared_memory: false,
            extra: String::new(),
            gateways: 1,
        }
    }

    /// The replicas given, already running (started with a config of their own, or with faults
    /// set before any gateway probes them), in pool order.
    pub fn over(sims: Vec<SimHandle>) -> FleetBuilder {
        FleetBuilder {
            sims,
            ..Fleet::of(0)
        }
    }

    /// The first gateway.
    pub fn gateway(&self) -> &Gateway {
        self.gateways.first().expect("a fleet has a gateway")
    }

    /// Every gateway, in the order they started.
    pub fn gateways(&self) -> &[Gateway] {
        &self.gateways
    }

    /// `http://ADDR` of the first gateway.
    pub fn base_url(&self) -> String {
        self.gateway().base_url()
    }

    /// The first gateway's pool `sim` (model `sim-model`).
    pub fn pool(&self) -> Arc<Pool> {
        self.gateway()
            .state()
            .pools
            .for_model("sim-model")
            .expect("the pool serves sim-model")
    }

    /// The first replica (`sim/0` in the pool).
    pub fn sim(&self) -> &SimHandle {
        self.sims.first().expect("the fleet has a replica")
    }

    /// Every replica, in pool order (`sim/0`, `sim/1`, …).
    pub fn sims(&self) -> &[SimHandle] {
        &self.sims
    }

    /// Restart replica `i` on its address, as an engine process restarts: a new engine (of
    /// `sim-model`, no time scale) with an empty cache and its counters from zero.
    pub async fn restart_sim(&mut self, i: usize) {
        let old = self.sims.remove(i);
        let listen = old.addr();
        old.shutdown().await;
        let new = agentgate_sim::spawn(agentgate_sim::SimConfig {
            listen,
            model: "sim-model".to_string(),
            ..Default::default()
        })
        .await
        .expect("the replica starts again on its address");
        self.sims.insert(i, new);
    }

    /// The replicas' base URLs, in pool order.
    pub fn urls(&self) -> Vec<String> {
        self.sims.iter().map(|s| s.base_url()).collect()
    }

    /// The config TOML the fleet's gateways were started with.
    pub fn toml(&self) -> &str {
        &self.toml
    }

    /// Start one more gateway on `toml` (over these replicas or not), with the store `toml`
    /// names (never a fleet's [`FleetBuilder::shared_memory`] store); it is shut down with the
    /// others, after them.
    pub async fn add_gateway(&mut self, toml: &str) -> &Gateway {
        self.gateways.push(start_gateway(toml).await);
        self.gateways.last().expect("just pushed")
    }

    /// Shut down every gateway, then every replica.
    pub async fn shutdown(self) {
        for gw in self.gateways {
            gw.shutdown().await;
        }
        for sim in self.sims {
            sim.shutdown().await;
        }
    }

    /// Shut down every gateway and leave the replicas running until the test's runtime ends:
    /// for replicas holding stalled requests, which a replica's shutdown would wait on.
    pub async fn shutdown_gateways(self) {
        for gw in self.gateways {
            gw.shutdown().await;
        }
    }
}

impl FleetBuilder {
    /// Simulated time scale of the replicas this builder starts (0 = instant; 1 = real time).
    pub fn time_scale(mut self, time_scale: f64) -> Self {
        self.time_scale = time_scale;
        self
    }

    /// The pool's routing policy (`policy = "…"` ahead of its `endpoints`).
    pub fn policy(mut self, policy: &str) -> Self {
        self.policy = Some(policy.to_string());
        self
    }

    /// A Redis session store at `url` under `key_prefix`.
    pub fn store(mut self, url: &str, key_prefix: &str) -> Self {
        self.store = Some((url.to_string(), key_prefix.to_string()));
        self
    }

    /// One in-memory store all the gateways are handed
    /// ([`agentgate_sessions::MemoryStore::shared_in_process`]) instead of each its own; not
    /// with [`FleetBuilder::store`].
    pub fn shared_memory(mut self) -> Self {
        self.shared_memory = true;
        self
    }

    /// TOML appended to the config verbatim (after the pool's `endpoints`).
    pub fn extra(mut self, extra: &str) -> Self {
        self.extra = extra.to_string();
        self
    }

    /// How many gateways to start on the same config (at least one).
    pub fn gateways(mut self, gateways: usize) -> Self {
        self.gateways = gateways.max(1);
        self
    }

    /// Start the replicas, then the gateways one after another.
    pub async fn start(self) -> Fleet {
        let mut sims = self.sims;
        for _ in 0..self.replicas {
            sims.push(start_sim_with("sim-model", self.time_scale).await);
        }
        let urls: Vec<String> = sims.iter().map(|s| s.base_url()).collect();
        let store = self.store.as_ref().map(|(u, p)| (u.as_str(), p.as_str()));
        let mut toml = config_toml(&urls, store, &self.extra);
        if let Some(policy) = &self.policy {
            toml = toml.replace(
                "endpoints = [",
                &format!("policy = \"{policy}\"\nendpoints = ["),
            );
        }
        assert!(
            !(self.shared_memory && self.store.is_some()),
            "a fleet shares one memory store or names a Redis, not both"
        );
        let config = agentgate::Config::parse(&toml).expect("valid test config");
        let shared = self.shared_memory.then(|| {
            Arc::new(agentgate_sessions::AnyStore::shared_in_process(
                config.store_options(),
            ))
        });
        let mut gateways = Vec::with_capacity(self.gateways);
        for _ in 0..self.gateways {
            gateways.push(match &shared {
                Some(store) => Gateway::start_with_store(
                    config.clone(),
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    Arc::clone(store),
                )
                .await
                .expect("gateway starts"),
                None => start_gateway(&toml).await,
            });
        }
        Fleet {
            sims,
            gateways,
            toml,
        }
    }
}

/// Set the simulator's faults (`POST /sim/faults` with `spec`, e.g. `{"status": 503}`,
/// `{"cut_after": 3}`, `{"stall_ms": 60000}`); fails the test unless the simulator accepts them.
pub async fn set_sim_fault(sim: &SimHandle, spec: Value) {
    let request = reqwest::Client::new()
        .post(format!("{}/sim/faults", sim.base_url()))
        .json(&spec);
    send_faults(request, &format!("setting fault {spec}")).await;
}

/// Clear every simulator fault (`DELETE /sim/faults`).
pub async fn clear_sim_faults(sim: &SimHandle) {
    let request = reqwest::Client::new().delete(format!("{}/sim/faults", sim.base_url()));
    send_faults(request, "clearing faults").await;
}

async fn send_faults(request: reqwest::RequestBuilder, what: &str) {
    let resp = request.send().await.expect("sim faults");
    assert!(resp.status().is_success(), "{what}: {}", resp.status());
}

/// `POST {base}/v1/responses` with JSON `body`, no key, no extra headers.
pub async fn post_response(base: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/responses"))
        .json(body)
        .send()
        .await
        .expect("request")
}

/// Send `request`: the JSON body of its answer, whatever the status.
pub async fn json_body(request: reqwest::RequestBuilder) -> Value {
    request
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json body")
}

/// `GET url`: the JSON body, whatever the status.
pub async fn get_json(url: &str) -> Value {
    json_body(reqwest::Client::new().get(url)).await
}

/// `GET {base}/v1/responses/{id}`: the JSON body, whatever the status.
pub async fn retrieve(base: &str, id: &str) -> Value {
    get_json(&format!("{base}/v1/responses/{id}")).await
}

/// `POST {base}/v1/responses/{id}/cancel`: the JSON body, whatever the status.
pub async fn cancel(base: &str, id: &str) -> Value {
    json_body(reqwest::Client::new().post(format!("{base}/v1/responses/{id}/cancel"))).await
}

/// The value of header `name`; fails the test when it is absent or not visible ASCII.
pub fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .expect("visible ASCII header")
        .to_string()
}

/// The endpoint that served a request (its `x-agentgate-endpoint` header), empty when absent.
pub fn served_endpoint(resp: &reqwest::Response) -> String {
    resp.headers()
        .get(agentgate::responses::ENDPOINT_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The text of `GET {base}/metrics`.
pub async fn metrics_text(base: &str) -> String {
    reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

/// Sum of a Prometheus metric's samples (every label set) in `text`.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Poll `done` every 10 ms, for at most 15 s; fails the test with `what` if it never holds.
pub async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..1500 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// [`eventually`] for a check that awaits (a metrics scrape, a store read).
pub async fn eventually_async<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..1500 {
        if done().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Write `text` to `path` atomically (write, then rename), as operators are told to.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write the temporary file");
    std::fs::rename(&tmp, path).expect("rename it into place");
}

/// One parsed SSE event.
#[derive(Debug, Clone)]
pub struct Event {
    /// The `event:` line.
    pub event: String,
    /// The `data:` JSON.
    pub data: Value,
}

/// Read a whole SSE body into events (fails the test on malformed framing).
pub async fn read_sse(resp: reqwest::Response) -> Vec<Event> {
    let mut buf = String::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("stream chunk");
        buf.push_str(std::str::from_utf8(&chunk).expect("utf-8 SSE"));
    }
    parse_sse(&buf)
}

/// Parse SSE text into events.
pub fn parse_sse(text: &str) -> Vec<Event> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        if block.trim().is_empty() {
            continue;
        }
        let mut event = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(e) = line.strip_prefix("event: ") {
                event = e.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
        let data: Value =
            serde_json::from_str(&data).unwrap_or_else(|e| panic!("bad data {data:?}: {e}"));
        out.push(Event { event, data });
    }
    out
}

/// The event types of `events`, in order.
pub fn event_kinds(events: &[Event]) -> Vec<&str> {
    events.iter().map(|e| e.event.as_str()).collect()
}

/// Every event's `sequence_number` is its index: the stream starts at 0 and has no gaps.
pub fn assert_sequence_numbers(events: &[Event]) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            e.data["sequence_number"],
            serde_json::json!(i),
            "gap at {i}"
        );
    }
}

/// The text of a Response object's message output.
pub fn output_text(response: &Value) -> String {
    let mut s = String::new();
    for item in response["output"].as_array().into_iter().flatten() {
        if item["type"] == "message" {
            for part in item["content"].as_array().into_iter().flatten() {
                if let Some(t) = part["text"].as_str() {
                    s.push_str(t);
                }
            }
        }
    }
    s
}
