//! `agentgate-sim`: an engine simulator that stands in for vLLM and SGLang replicas.
//!
//! It speaks the engines' HTTP APIs (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//! `/health`, `/metrics`, `/tokenize`) with their field names, SSE framing, error shapes and
//! metric names, and behind them models what matters for routing: a paged prefix cache and the
//! time it takes to prefill and decode.
//!
//! How the parts fit, for one chat request:
//! 1. [`template`] renders `tools` and `messages` into one prompt string (append-only: a later turn
//!    of the same conversation renders to a string that starts with the earlier one);
//! 2. [`tokenizer`] turns it into token ids (one token per word or punctuation mark, long words
//!    split every 12 characters, id = stable hash of the piece);
//! 3. [`cache::chain_hashes`] hashes the prompt's full blocks into a chain, like vLLM;
//! 4. [`generate`] decides the whole output up front, deterministically from `--seed`, the
//!    request's `seed` and the prompt: text, a tool call with schema-valid arguments, or JSON for
//!    `response_format`, as one piece per token, including the template markup the chat template
//!    renders around reasoning and tool calls, so the output's token ids are exactly what the next
//!    turn's prompt repeats;
//! 5. [`engine`] (one tokio task owning the [`cache::KvCache`] and the scheduler) admits the
//!    sequence under continuous batching, charges prefill time for the *uncached* tokens only,
//!    decodes one token per step for every running sequence, caches each block that generated
//!    tokens fill (so the next turn hits through the answer), preempts when blocks run out, and
//!    reports tokens back in events; `cached_tokens` in `usage` is what the cache already held;
//! 6. [`server`] turns those events into a JSON response or SSE chunks, applying [`faults`].
//!
//! Times are simulated seconds; `--time-scale` maps them to wall time (0 = no sleeping at all, and
//! each request then completes within a single engine step). [`metrics`] reports latencies in
//! simulated seconds. [`pd`] implements prefill/decode disaggregation for both flavors, and
//! [`kv_events`] publishes vLLM's KV-event stream when `--kv-events` is given.
//!
//! Faults (for reliability tests), per request with the header `x-sim-fault:
//! status=503,stall_ms=200,cut_after=3,slow=4`, or for all requests with `POST /sim/faults` and a
//! JSON body `{"status":503,"stall_ms":200,"cut_after":3,"slow":4,"unhealthy":true}` (cleared by
//! `DELETE /sim/faults`, read by `GET /sim/faults`); see [`faults`]. `unhealthy` makes `/health`
//! answer 503; `abort_after` ends a stream the way vLLM ends an aborted request. `POST /reset_prefix_cache` (vLLM) or `/flush_cache` (SGLang) empties the cache.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let config = agentgate_sim::SimConfig { listen: "127.0.0.1:0".parse().unwrap(), time_scale: 0.0, ..Default::default() };
//! let sim = agentgate_sim::spawn(config).await?;
//! println!("replica at {}", sim.base_url());
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

pub mod cache;
pub mod config;
pub mod engine;
pub mod faults;
pub mod generate;
pub mod kv_events;
pub mod metrics;
pub mod pd;
pub mod server;
pub mod template;
pub mod tokenizer;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use config::{Flavor, Role, SimConfig};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// A running simulated replica.
#[derive(Debug)]
pub struct SimHandle {
    addr: SocketAddr,
    core: Arc<Mutex<engine::Core>>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    engine: JoinHandle<()>,
}

impl SimHandle {
    /// The bound HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound HTTP address (same as [`SimHandle::addr`]).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT` (or the bound IP when it is not a wildcard).
    pub fn base_url(&self) -> String {
        format!("http://{}", advertised(self.addr))
    }

    /// Every block hash currently in the KV cache.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.core
            .lock()
            .map(|core| core.cache.cached_hashes())
            .unwrap_or_default()
    }

    /// Stop serving and stop the engine (open streams are cut after a short grace period).
    pub async fn shutdown(self) {
        self.shutdown.send_replace(true);
        for server in self.servers {
            let abort = server.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), server)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        self.engine.abort();
    }
}

fn advertised(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
    } else {
        addr
    }
}

/// A listener on `addr` whose accepted connections have `buffer_bytes` send and receive buffers
/// (they inherit the listener's; 0 leaves the kernel's autotuning). The gateway listens with it
/// too (`[server] socket_buffer_bytes`).
pub fn listen_tcp(addr: SocketAddr, buffer_bytes: u32) -> std::io::Result<tokio::net::TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    if buffer_bytes > 0 {
        socket.set_send_buffer_size(buffer_bytes)?;
        socket.set_recv_buffer_size(buffer_bytes)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Start a replica: bind `config.listen` (port 0 picks one), start the engine loop and serve.
pub async fn spawn(config: SimConfig) -> std::io::Result<SimHandle> {
    config
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let listener = listen_tcp(config.listen, config.socket_buffer_bytes)?;
    let addr = listener.local_addr()?;
    let mut listeners = vec![listener];
    if let Some(port) = config.bootstrap_port {
        let bootstrap = SocketAddr::new(config.listen.ip(), port);
        listeners.push(listen_tcp(bootstrap, config.socket_buffer_bytes)?);
    }
    let sink = match &config.kv_events {
        Some(endpoint) => Some(kv_events::start_publisher(
            endpoint,
            &config.kv_events_topic,
        )?),
        None => None,
    };
    let cache = cache::KvCache::new(config.block_size, config.kv_blocks, sink);
    let params = engine::EngineParams {
        max_num_seqs: config.max_num_seqs,
        prefill_tokens_per_s: config.prefill_tokens_per_s,
        decode_ms_per_token: config.decode_ms_per_token,
        time_scale: config.time_scale.max(0.0),
        pin_timeout: Duration::from_secs_f64(config.kv_transfer_timeout_s.max(0.0)),
        max_num_batched_tokens: config.max_num_batched_tokens,
        long_prefill_token_threshold: config.long_prefill_token_threshold,
        policy: match config.scheduling_policy {
            config::SchedulingPolicyArg::Fcfs => engine::SchedulingPolicy::Fcfs,
            config::SchedulingPolicyArg::Priority => engine::SchedulingPolicy::Priority,
        },
    };
    let core = Arc::new(Mutex::new(engine::Core::new(cache, params)));
    let faults = Arc::new(faults::FaultState::default());
    let (commands, receiver) = mpsc::unbounded_channel();
    let engine = tokio::spawn(engine::run(
        core.clone(),
        receiver,
        faults.clone(),
        config.time_scale.max(0.0),
    ));
    let state = Arc::new(server::AppState::new(
        config,
        commands,
        core.clone(),
        faults,
        advertised(addr),
    ));
    let router = server::router(state);
    let (shutdown, shutdown_rx) = watch::channel(false);
    let mut servers = Vec::new();
    for listener in listeners {
        let router = router.clone();
        let mut stop = shutdown_rx.clone();
        servers.push(tokio::spawn(async move {
            // Streams are many small writes: without TCP_NODELAY, Nagle plus the peer's
            // delayed ACK adds ~40 ms to every streamed response.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
                let _ = stop.wait_for(|stop| *stop).await;
            });
            if let Err(error) = serve.await {
                tracing::warn!(%error, "simulator server stopped");
            }
        }));
    }
    Ok(SimHandle {
        addr,
        core,
        shutdown,
        servers,
        engine,
    })
}
