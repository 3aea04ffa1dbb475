//! Wiring: the shared [`AppState`], the router with its layers, and the server's start/stop.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{Method, Uri};
use axum::routing::{get, post};
use axum::Router;

use agentgate_adapters::{EngineClient, HostedToolPolicy, TranslateOptions};
use agentgate_sessions::AnyStore;

use crate::auth::KeyRing;
use crate::config::{Config, HostedTools};
use crate::error::HttpError;
use crate::exchange::Exchange;
use crate::flow::{FlowControl, StoreRateLimiter};
use crate::metrics::Metrics;
use crate::pools::Pools;
use crate::probe::LiveTasks;
use crate::reload::ConfigWatcher;
use crate::{conversations, handlers, metrics, responses};

/// Accept connections and serve HTTP/1.1 on each until `shutdown` fires; then stop accepting,
/// let every connection finish the request it is serving (closing idle ones) and return.
///
/// Each connection gets `TCP_NODELAY` (SSE streams are many small writes that must leave at
/// once), TCP keep-alive (`server.tcp_keepalive_s`) and a deadline for each request's headers
/// (`server.header_read_timeout_s`), so a client that vanishes or never sends a request does
/// not hold a connection, its task and its buffers for good.
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    server: crate::config::ServerConfig,
    mut shutdown: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(server.header_read_timeout());
    let keepalive = server.tcp_keepalive().map(|idle| {
        socket2::TcpKeepalive::new()
            .with_time(idle.max(Duration::from_secs(1)))
            .with_interval(Duration::from_secs(10))
            .with_retries(3)
    });
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                // a client that gave up before it was accepted: nothing to wait for
                Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionRefused
                ) => continue,
                Err(e) => {
                    // out of file descriptors and the like: wait a second for some to be freed
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        if let Some(keepalive) = &keepalive {
            if let Err(e) = socket2::SockRef::from(&tcp).set_tcp_keepalive(keepalive) {
                tracing::debug!(error = %e, "cannot set TCP keep-alive on a client connection");
            }
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let connection =
            graceful.watch(http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "client connection ended");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A background run of this process, as its registry holds it.
pub struct BackgroundRun {
    /// The team that created it.
    pub team: String,
    /// Its cancel signal.
    pub cancel: tokio::sync::watch::Sender<bool>,
}

/// Everything a handler needs, shared by all requests.
pub struct AppState {
    /// The loaded configuration.
    pub config: Config,
    /// API key -> team.
    pub keys: KeyRing,
    /// Conversation state (and the rate-limit counters).
    pub store: Arc<AnyStore>,
    /// Engine pools by model.
    pub pools: Pools,
    /// HTTP client for engines (connection reuse across requests).
    pub engines: EngineClient,
    /// Hosted-tool policy handed to the translator.
    pub hosted_tools: HostedToolPolicy,
    /// How compaction turns ask for their summary (`[compaction]`).
    pub compaction: agentgate_adapters::CompactionOptions,
    /// Background runs in this process: response id -> its cancel signal.
    pub background: Mutex<HashMap<String, BackgroundRun>>,
    /// Bounds how many background runs execute at once.
    pub background_slots: Arc<tokio::sync::Semaphore>,
    /// Foreground turns running in this process (see [`AppState::foreground_turn`]):
    /// shutdown waits for them as for background runs, since a turn whose client has left
    /// runs on to be stored.
    pub foreground: Arc<AtomicUsize>,
    /// Raised when the gateway shuts down and `[server] shutdown_grace_s` has run out:
    /// turns still going (foreground and background) end as failed (`server_shutdown`, stored).
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// Raised when the gateway starts shutting down: streams that only follow stored events
    /// (`GET /v1/responses/{id}?stream=true`) close at once, and their clients resume elsewhere.
    pub draining: tokio::sync::watch::Sender<bool>,
    /// The gateway's Prometheus metrics (`GET /metrics`).
    pub metrics: Arc<Metrics>,
    /// Flow control: one controller per pool, admission before routing.
    pub flow: FlowControl,
    /// Streams following background responses' events, per team
    /// (`[background] max_follows_per_team`).
    pub follows: Arc<Mutex<HashMap<String, usize>>>,
}

/// One team's place among the streams following background responses: given back when
/// dropped.
pub struct FollowSlot {
    follows: Arc<Mutex<HashMap<String, usize>>>,
    team: String,
}

impl FollowSlot {
    /// A place for `team`, unless it holds `[background] max_follows_per_team` already (0: no
    /// bound).
    pub fn take(state: &AppState, team: &str) -> Option<FollowSlot> {
        let limit = state.config.background.max_follows_per_team;
        let mut follows = state.follows.lock().unwrap_or_else(PoisonError::into_inner);
        let held = follows.entry(team.to_string()).or_insert(0);
        if limit > 0 && *held >= limit {
            return None;
        }
        *held += 1;
        Some(FollowSlot {
            follows: state.follows.clone(),
            team: team.to_string(),
        })
    }
}

impl Drop for FollowSlot {
    fn drop(&mut self) {
        let mut follows = self.follows.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = follows.get_mut(&self.team) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                follows.remove(&self.team);
            }
        }
    }
}

impl AppState {
    /// Open the store, start the pools and build the engine client.
    pub async fn new(config: Config) -> Result<Arc<AppState>, Box<dyn std::error::Error>> {
        let store = AnyStore::open(config.store.url.as_deref(), config.store_options())
            .await
            .map_err(|e| format!("store: {e}"))?;
        AppState::with_store(config, Arc::new(store)).await
    }

    /// Start the pools and build the engine client over an open `store`, which other gateways
    /// of this process may share (`[store]` of `config` is not read again).
    pub async fn with_store(
        config: Config,
        store: Arc<AnyStore>,
    ) -> Result<Arc<AppState>, Box<dyn std::error::Error>> {
        let keys = KeyRing::new(&config.teams);
        let engines = EngineClient::new(config.client_options());
        let pools = Pools::start(&config, &engines)
            .await
            .map_err(|e| format!("starting pools: {e}"))?;

        let hosted_tools = match config.tools.hosted {
            HostedTools::Drop => HostedToolPolicy::Drop,
            HostedTools::Reject => HostedToolPolicy::Reject,
        };
        let slots = config.background.max_concurrent;
        let metrics = Arc::new(Metrics::new());
        let limiter = Arc::new(StoreRateLimiter::new(store.clone(), metrics.clone()));
        let flow =
            FlowControl::new(&config, &pools, limiter).map_err(|e| format!("flow control: {e}"))?;
        Ok(Arc::new(AppState {
            compaction: agentgate_adapters::CompactionOptions {
                prompt: config.compaction.prompt.clone(),
                max_output_tokens: config.compaction.max_output_tokens,
            },
            config,
            keys,
            store,
            pools,
            engines,
            hosted_tools,
            background: Mutex::new(HashMap::new()),
            background_slots: Arc::new(tokio::sync::Semaphore::new(slots)),
            foreground: Arc::new(AtomicUsize::new(0)),
            stopping: tokio::sync::watch::Sender::new(false),
            draining: tokio::sync::watch::Sender::new(false),
            metrics,
            flow,
            follows: Arc::default(),
        }))
    }
}

impl AppState {
    /// How to translate a turn for `pool`'s engines.
    pub fn translate_options(&self, pool: &crate::pools::Pool) -> TranslateOptions {
        TranslateOptions {
            flavor: pool.flavor,
            hosted_tools: self.hosted_tools,
            compaction: self.compaction.clone(),
            vision: pool.vision,
            remote_images: pool.remote_images,
            reasoning_efforts: pool.reasoning_efforts.clone(),
        }
    }
}

/// The HTTP routes, one line each; `openapi.rs` documents the same list. Every `/v1` route
/// checks the API key before its body is read.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.server.max_body_bytes;
    Router::new()
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route("/v1/responses/compact", post(responses::compact))
        .route("/v1/conversations", post(conversations::create))
        .route(
            "/v1/conversations/{id}",
            get(conversations::retrieve)
                .post(conversations::update)
                .delete(conversations::delete),
        )
        .route(
            "/v1/conversations/{id}/items",
            get(conversations::list_items).post(conversations::add_items),
        )
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            get(conversations::get_item).delete(conversations::delete_item),
        )
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/v1/models", get(handlers::list_models))
        // Model names may hold slashes (`Qwen/Qwen3-8B`).
        .route("/v1/models/{*model}", get(handlers::get_model))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authenticate_first,
        ))
        .route("/health/live", get(handlers::live))
        .route("/health/ready", get(handlers::ready))
        .route("/metrics", get(metrics::handler))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::map_response(openai_shaped_rejections))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            metrics::observe_http,
        ))
        .with_state(state)
}

/// Refuse a request without a valid API key before its handler reads the body: an
/// unauthenticated client cannot make the gateway buffer a body of up to `max_body_bytes`. The
/// handlers authenticate again to learn the team (a hash lookup).
async fn authenticate_first(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match state.keys.authenticate(request.headers()) {
        Ok(_) => next.run(request).await,
        Err(refused) => refused.into_response(),
    }
}

/// axum's extractors refuse a path or query string that does not decode (`%FF` in an id, a
/// repeated `limit`) with a plain-text 4xx; give those OpenAI's error shape, like every other
/// refusal, so SDKs can read them.
async fn openai_shaped_rejections(resp: axum::response::Response) -> axum::response::Response {
    use axum::response::IntoResponse;
    let plain = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    if !(plain && resp.status().is_client_error()) {
        return resp;
    }
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let message = String::from_utf8_lossy(&bytes).trim().to_string();
    HttpError::new(
        status,
        "invalid_request_error",
        message,
        None,
        Some("invalid_request"),
    )
    .into_response()
}

async fn unknown_route(method: Method, uri: Uri) -> HttpError {
    HttpError::new(
        404,
        "invalid_request_error",
        format!("Unknown request URL: {method} {}.", uri.path()),
        None,
        Some("unknown_url"),
    )
}

async fn method_not_allowed(method: Method, uri: Uri, headers: axum::http::HeaderMap) -> HttpError {
    // OpenAI also serves the Responses API over a WebSocket on this path, which Codex's
    // built-in provider tries first; on 426 it falls back to HTTP (any other status counts as
    // a failed attempt, retried before it falls back or gives up).
    let websocket = headers
        .get(axum::http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if websocket && method == Method::GET && uri.path() == "/v1/responses" {
        return HttpError::new(
            426,
            "invalid_request_error",
            "This gateway serves the Responses API over HTTP (POST /v1/responses, streamed as server-sent events), not over a WebSocket.",
            None,
            Some("websocket_not_supported"),
        );
    }
    HttpError::new(
        405,
        "invalid_request_error",
        format!("Method {method} is not allowed on {}.", uri.path()),
        None,
        Some("method_not_allowed"),
    )
}

/// A running gateway (for tests, benchmarks and `serve`): the HTTP server and the background
/// tasks that keep endpoint state live (health probes, metrics scrapes, endpoints-file
/// watchers; see [`crate::probe`]) and reload the config file's flow-control sections (see
/// [`crate::reload`]).
pub struct Gateway {
    addr: SocketAddr,
    state: Arc<AppState>,
    shutdown: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    live: LiveTasks,
    reload: Option<ConfigWatcher>,
    exchange: Option<Exchange>,
}

/// A foreground turn counted in [`AppState::foreground`] until this is dropped.
pub struct ForegroundTurn(Arc<AtomicUsize>);

impl Drop for ForegroundTurn {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl AppState {
    /// Count a foreground turn until the returned guard is dropped (hold it in the turn's task).
    pub fn foreground_turn(&self) -> ForegroundTurn {
        self.foreground.fetch_add(1, Ordering::AcqRel);
        ForegroundTurn(self.foreground.clone())
    }

    /// Turns of this process still running: (foreground, background).
    fn turns_running(&self) -> (usize, usize) {
        let background = self
            .background
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        (self.foreground.load(Ordering::Acquire), background)
    }
}

/// Wait up to `limit` until no turn of this process (foreground or background) is left; true
/// if none is.
async fn turns_end(state: &AppState, limit: Duration) -> bool {
    // a grace too long to add to the clock waits as long as it takes
    let deadline = tokio::time::Instant::now().checked_add(limit);
    loop {
        if state.turns_running() == (0, 0) {
            return true;
        }
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Gateway {
    /// Bind `listen` (port 0 picks a free one) and serve until [`Gateway::shutdown`].
    pub async fn start(
        config: Config,
        listen: SocketAddr,
    ) -> Result<Gateway, Box<dyn std::error::Error>> {
        Gateway::serve(AppState::new(config).await?, listen).await
    }

    /// [`Gateway::start`] over an open `store` instead of the one `[store]` names: gateways of
    /// one process that are handed the same in-memory store
    /// ([`MemoryStore::shared_in_process`](agentgate_sessions::MemoryStore::shared_in_process))
    /// work as one fleet, as gateways in separate processes do over one Redis.
    pub async fn start_with_store(
        config: Config,
        listen: SocketAddr,
        store: Arc<AnyStore>,
    ) -> Result<Gateway, Box<dyn std::error::Error>> {
        Gateway::serve(AppState::with_store(config, store).await?, listen).await
    }

    async fn serve(
        state: Arc<AppState>,
        listen: SocketAddr,
    ) -> Result<Gateway, Box<dyn std::error::Error>> {
        let buffer_bytes = state.config.server.socket_buffer_bytes;
        let listener = agentgate_sim::listen_tcp(listen, buffer_bytes)
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let addr = listener.local_addr()?;
        // A scrape, a health verdict or an endpoints file can change a pool's capacity
        // without any request finishing: let flow control dispatch what it now allows.
        let flow_state = state.clone();
        let live = LiveTasks::start(
            state.pools.all(),
            &state.engines,
            &state.metrics,
            &state.config.routing,
            Arc::new(move || flow_state.flow.notify()),
        );
        let reload = ConfigWatcher::start(&state);
        let exchange = Exchange::start(&state, format!("{:016x}", fastrand::u64(..)));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = router(state.clone());
        let task = tokio::spawn(serve_connections(
            listener,
            app,
            state.config.server.clone(),
            rx,
        ));
        Ok(Gateway {
            addr,
            state,
            shutdown: tx,
            task,
            live,
            reload,
            exchange,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The shared state (store, pools) for inspection in tests.
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Wait until the server stops (it stops on [`Gateway::shutdown`]).
    pub async fn wait(self) -> std::io::Result<()> {
        let result = self.task.await.map_err(std::io::Error::other)?;
        self.live.shutdown().await;
        if let Some(reload) = self.reload {
            reload.shutdown().await;
        }
        if let Some(exchange) = self.exchange {
            exchange.shutdown().await;
        }
        result
    }

    /// Stop accepting connections and give the turns in flight (requests, streams, turns whose
    /// client has left, background runs) up to `[server] shutdown_grace_s` to finish; then end
    /// the rest as failed (`server_shutdown`, stored), and stop the background tasks.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(());
        self.state.draining.send_replace(true);
        let grace = self.state.config.server.shutdown_grace();
        let started = tokio::time::Instant::now();
        let mut task = self.task;
        let drained = tokio::time::timeout(grace, &mut task).await.is_ok();
        let left = grace.saturating_sub(started.elapsed());
        if !drained || !turns_end(&self.state, left).await {
            let (foreground, background) = self.state.turns_running();
            tracing::warn!(
                requests_drained = drained,
                foreground_turns = foreground,
                background_runs = background,
                "turns still running after server.shutdown_grace_s; ending them as failed"
            );
            self.state.stopping.send_replace(true);
            if !drained
                && tokio::time::timeout(Duration::from_secs(10), &mut task)
                    .await
                    .is_err()
            {
                task.abort();
            }
            turns_end(&self.state, Duration::from_secs(10)).await;
        }
        self.live.shutdown().await;
        if let Some(reload) = self.reload {
            reload.shutdown().await;
        }
        if let Some(exchange) = self.exchange {
            exchange.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use agentgate_sim::listen_tcp;

    /// Accepted connections inherit the listener's fixed buffers: Linux reports exactly twice
    /// the size asked for (its bookkeeping included), which autotuning would not land on.
    #[tokio::test]
    async fn accepted_connections_get_the_configured_socket_buffers() {
        // Below the smallest default net.core.rmem_max (208 KiB), which caps what is granted.
        let asked: u32 = 100_000;
        let listener = listen_tcp("127.0.0.1:0".parse().unwrap(), asked).unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let socket = tokio::net::TcpSocket::from_std_stream(accepted.into_std().unwrap());
        assert_eq!(socket.recv_buffer_size().unwrap(), 2 * asked);
        assert_eq!(socket.send_buffer_size().unwrap(), 2 * asked);
    }
}
