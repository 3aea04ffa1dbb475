//! The gateway's own Prometheus metrics, served on `GET /metrics` in the text exposition format
//! (version 0.0.4).
//!
//! A small registry without dependencies: [`CounterVec`], [`GaugeVec`] and [`HistogramVec`],
//! each a metric family with a fixed list of label names (the label count is part of the type,
//! so a call site cannot pass the wrong number of values). Label values are escaped as the
//! format requires (`\\`, `"`, newline).
//!
//! Two kinds of series:
//!
//! - **HTTP**, counted by a middleware around every route ([`observe_http`]): each request
//!   by route (its template, `/v1/responses/{id}`; `unmatched` for unknown paths), method,
//!   status and the error code of an error answer
//!   (`agentgate_http_requests_total{route,method,status,code}`, `code` empty on success), and
//!   the time until the answer's head was ready
//!   (`agentgate_http_request_duration_seconds{route,method}`: a whole non-streamed answer,
//!   a stream's opening, which comes with the engine's first answer); a client that left before
//!   the head is counted with status `499`, code `client_closed`. A request refused before
//!   its stream opens (authentication, validation, flow control, an engine that failed at once)
//!   is counted here, and in no response series;
//! - **events**, counted as they happen through [`Metrics`]' methods: responses by how they
//!   ended (`agentgate_responses_total{pool,status,code}`: `completed`, `incomplete`,
//!   `cancelled` or `failed`, with a failure's error code: the engine failure's,
//!   `store_unavailable`, `compaction_failed`, `server_shutdown`, `rate_limit_exceeded` (a
//!   Codex refusal in the stream), or `client_disconnected` for a turn nobody could read later
//!   whose client left; empty otherwise), routing decisions and
//!   their reason, session pin moves and their cause, discovery reloads, endpoint health
//!   transitions, probe failures and probe latency, config reloads, response writes the store
//!   refused (`agentgate_store_write_errors_total`, each try), rate-limit store errors,
//!   routing decisions shared with the other gateways
//!   (`agentgate_prefix_routes_shared_total{pool,direction}`, `sent`, `received`, `dropped`;
//!   `agentgate_prefix_feed_skipped_total{pool}`, see [`crate::route_feed`]). The
//!   series naming an endpoint go when discovery removes it for good
//!   ([`Metrics::forget_endpoint`]);
//! - **the in-memory store**, read at scrape time: `agentgate_store_memory_bytes` and
//!   `agentgate_store_evictions_total` (absent with Redis);
//! - **flow control**, read from each pool's controller at scrape time ([`flow_state`]): queue
//!   depths, wait histograms and outcome counters per band and per team;
//! - **live endpoint state**, read from the pools at scrape time (nothing to keep in step):
//!
//! | series | meaning |
//! |---|---|
//! | `agentgate_endpoint_info{pool,endpoint,role,slot}` | 1 per endpoint in the pool's current list |
//! | `agentgate_endpoint_healthy{pool,endpoint}` | 1 when the last probes passed |
//! | `agentgate_endpoint_saturated{pool,endpoint}` | 1 when the engine's queue or KV cache is at the pool's limit, or its metrics are stale |
//! | `agentgate_endpoint_in_flight_requests{pool,endpoint}` | requests this gateway has running there |
//! | `agentgate_endpoint_in_flight_tokens{pool,endpoint}` | their prompt tokens (estimated) |
//! | `agentgate_endpoint_pending_prefill_tokens{pool,endpoint}` | uncached prompt tokens of those still before their first token |
//! | `agentgate_endpoint_kv_working_set_tokens{pool,endpoint}` | KV their prompts span together, each shared prefix once (`[flow] max_kv_working_set`) |
//! | `agentgate_endpoint_peer_kv_working_set_tokens{pool,endpoint}` | the same for the other gateways in front of the endpoint, summed, as last exchanged (`[flow] exchange_interval_ms`) |
//! | `agentgate_endpoint_kv_capacity_tokens{pool,endpoint}` | the engine's KV capacity, from `vllm:cache_config_info` or `sglang:max_total_num_tokens` (absent while unknown) |
//! | `agentgate_endpoint_engine_waiting{pool,endpoint}` | the engine's queue depth, last scrape |
//! | `agentgate_endpoint_engine_running{pool,endpoint}` | the engine's running requests, last scrape |
//! | `agentgate_endpoint_kv_usage{pool,endpoint}` | the engine's KV-cache usage 0..1, last scrape (when reported) |
//! | `agentgate_endpoint_metrics_age_seconds{pool,endpoint}` | age of the last scrape (absent before the first) |
//! | `agentgate_pool_endpoints{pool}`, `agentgate_pool_available_endpoints{pool}` | list size, and how many take new work |
//! | `agentgate_endpoint_prefill_tokens_per_second{pool,endpoint}` | measured prefill throughput (absent until measured; `agentgate_scheduler::disagg`) |
//!
//! Prefill/decode disaggregation (pools with prefill endpoints) counts its decisions
//! (`agentgate_pd_decisions_total{pool,decision,reason}`: `disaggregated` for `uncached`,
//! `sub_agent` or `decode_only_endpoint` (an SGLang decode server, which cannot prefill),
//! `local` for `cached`, `runs_whole` (an SGLang server of role `both`, which cannot receive
//! KV), `no_prefill_endpoint` or `transfer_failed` (the retry of a split whose KV transfer
//! was lost)), failed KV transfers
//! (`agentgate_pd_transfer_failures_total{pool,prefill,decode}`), fallbacks to a local prefill
//! (`agentgate_pd_fallbacks_total{pool,cause}`, cause `prefill_failed` or `transfer_failed`),
//! moves of the prefill half of session pins (`agentgate_pd_prefill_pin_moves_total{pool,cause}`),
//! calls placed as a sub-agent's by where the parent came from
//! (`agentgate_pd_sub_agent_calls_total{pool,source}`: `header`, `codex`, `claude_code`, `opencode`, or
//! `prefix` for a parent found by shared prefix, `agentgate_scheduler::prefix_lineage`)
//! and the latency of each leg (`agentgate_pd_leg_duration_seconds{pool,leg}`: `prefill` until
//! the KV cache is ready for decode, `decode` from then to the first token).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::time::Instant;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};

use agentgate_scheduler::flow::WaitHistogram;

use agentgate_scheduler::Endpoint;

use crate::app::AppState;
use crate::flow::FlowControl;
use crate::pools::Pools;

/// `Content-Type` of the text exposition format.
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Buckets (seconds) for the latency of prefill and decode legs.
pub const LEG_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Buckets (seconds) for the time until an HTTP answer's head.
pub const HTTP_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// Buckets (seconds) for probe and scrape latency.
pub const PROBE_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A float as the format writes it (`+Inf`, `-Inf`, `NaN`, else Rust's shortest form).
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        v.to_string()
    }
}

fn escape_label(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// `{a="x",b="y"}` (with `extra` appended, e.g. `le`), or nothing for no labels.
fn labels(names: &[&str], values: &[String], extra: Option<(&str, &str)>, out: &mut String) {
    let mut pairs = names
        .iter()
        .zip(values)
        .map(|(n, v)| (*n, v.as_str()))
        .chain(extra)
        .peekable();
    if pairs.peek().is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    for (name, value) in pairs {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(name);
        out.push_str("=\"");
        escape_label(value, out);
        out.push('"');
    }
    out.push('}');
}

fn header(name: &str, help: &str, kind: &str, out: &mut String) {
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn key<const N: usize>(values: [&str; N]) -> Vec<String> {
    values.iter().map(|v| v.to_string()).collect()
}

/// A counter family with `N` label names.
#[derive(Debug)]
pub struct CounterVec<const N: usize> {
    name: &'static str,
    help: &'static str,
    label_names: [&'static str; N],
    values: Mutex<BTreeMap<Vec<String>, u64>>,
}

impl<const N: usize> CounterVec<N> {
    /// An empty family.
    pub fn new(name: &'static str, help: &'static str, label_names: [&'static str; N]) -> Self {
        CounterVec {
            name,
            help,
            label_names,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    /// Add one to the series with these label values.
    pub fn inc(&self, values: [&str; N]) {
        self.inc_by(values, 1);
    }

    /// Add `n` to the series with these label values.
    pub fn inc_by(&self, values: [&str; N], n: u64) {
        let mut map = lock(&self.values);
        let v = map.entry(key(values)).or_insert(0);
        *v = v.saturating_add(n);
    }

    /// The series' value (0 if never counted).
    pub fn get(&self, values: [&str; N]) -> u64 {
        lock(&self.values).get(&key(values)).copied().unwrap_or(0)
    }

    /// Drop the series whose label values `matches` accepts.
    pub fn forget(&self, matches: impl Fn(&[String]) -> bool) {
        lock(&self.values).retain(|values, _| !matches(values));
    }

    /// Append the family in the text format.
    pub fn encode(&self, out: &mut String) {
        header(self.name, self.help, "counter", out);
        // A copy, so requests that count meanwhile do not wait for the formatting.
        let values = lock(&self.values).clone();
        for (values, v) in &values {
            out.push_str(self.name);
            labels(&self.label_names, values, None, out);
            let _ = writeln!(out, " {v}");
        }
    }
}

/// A gauge family with `N` label names.
#[derive(Debug)]
pub struct GaugeVec<const N: usize> {
    name: &'static str,
    help: &'static str,
    label_names: [&'static str; N],
    values: Mutex<BTreeMap<Vec<String>, f64>>,
}

impl<const N: usize> GaugeVec<N> {
    /// An empty family.
    pub fn new(name: &'static str, help: &'static str, label_names: [&'static str; N]) -> Self {
        GaugeVec {
            name,
            help,
            label_names,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    /// Set the series with these label values.
    pub fn set(&self, values: [&str; N], v: f64) {
        lock(&self.values).insert(key(values), v);
    }

    /// The series' value, if set.
    pub fn get(&self, values: [&str; N]) -> Option<f64> {
        lock(&self.values).get(&key(values)).copied()
    }

    /// Append the family in the text format.
    pub fn encode(&self, out: &mut String) {
        header(self.name, self.help, "gauge", out);
        let values = lock(&self.values).clone();
        for (values, v) in &values {
            out.push_str(self.name);
            labels(&self.label_names, values, None, out);
            let _ = writeln!(out, " {}", number(*v));
        }
    }
}

#[derive(Debug, Clone)]
struct Histogram {
    /// Per bucket (not cumulative), plus one for above the last bound.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// A histogram family with `N` label names and fixed bucket bounds.
#[derive(Debug)]
pub struct HistogramVec<const N: usize> {
    name: &'static str,
    help: &'static str,
    label_names: [&'static str; N],
    bounds: &'static [f64],
    values: Mutex<BTreeMap<Vec<String>, Histogram>>,
}

impl<const N: usize> HistogramVec<N> {
    /// An empty family with bucket upper bounds `bounds` (ascending; `+Inf` is implied).
    pub fn new(
        name: &'static str,
        help: &'static str,
        label_names: [&'static str; N],
        bounds: &'static [f64],
    ) -> Self {
        HistogramVec {
            name,
            help,
            label_names,
            bounds,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    /// Record one observation (NaN is ignored).
    pub fn observe(&self, values: [&str; N], v: f64) {
        if v.is_nan() {
            return;
        }
        let bucket = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        let mut map = lock(&self.values);
        let h = map.entry(key(values)).or_insert_with(|| Histogram {
            counts: vec![0; self.bounds.len() + 1],
            sum: 0.0,
            count: 0,
        });
        if let Some(c) = h.counts.get_mut(bucket) {
            *c += 1;
        }
        h.sum += v;
        h.count += 1;
    }

    /// Observations recorded for these label values.
    pub fn count(&self, values: [&str; N]) -> u64 {
        lock(&self.values).get(&key(values)).map_or(0, |h| h.count)
    }

    /// Append the family in the text format (cumulative `_bucket`s, `_sum`, `_count`).
    pub fn encode(&self, out: &mut String) {
        header(self.name, self.help, "histogram", out);
        let values = lock(&self.values).clone();
        for (values, h) in &values {
            let mut cumulative = 0;
            let bounds = self.bounds.iter().map(|b| number(*b));
            for (le, c) in bounds
                .chain(std::iter::once("+Inf".to_string()))
                .zip(&h.counts)
            {
                cumulative += c;
                let _ = write!(out, "{}_bucket", self.name);
                labels(&self.label_names, values, Some(("le", &le)), out);
                let _ = writeln!(out, " {cumulative}");
            }
            let _ = write!(out, "{}_sum", self.name);
            labels(&self.label_names, values, None, out);
            let _ = writeln!(out, " {}", number(h.sum));
            let _ = write!(out, "{}_count", self.name);
            labels(&self.label_names, values, None, out);
            let _ = writeln!(out, " {}", h.count);
        }
    }
}

/// Every metric the gateway exports.
#[derive(Debug)]
pub struct Metrics {
    /// `agentgate_routing_decisions_total{pool,endpoint,reason}`.
    pub routing_decisions: CounterVec<3>,
    /// `agentgate_session_pin_moves_total{pool,cause}`.
    pub pin_moves: CounterVec<2>,
    /// `agentgate_discovery_reloads_total{pool,result}`.
    pub discovery_reloads: CounterVec<2>,
    /// `agentgate_endpoint_health_transitions_total{pool,endpoint,state}`.
    pub health_transitions: CounterVec<3>,
    /// `agentgate_endpoint_probe_failures_total{pool,endpoint,probe}`.
    pub probe_failures: CounterVec<3>,
    /// `agentgate_endpoint_probe_duration_seconds{pool,probe}`.
    pub probe_duration: HistogramVec<2>,
    /// `agentgate_config_reloads_total{result}`.
    pub config_reloads: CounterVec<1>,
    /// `agentgate_store_write_errors_total`.
    pub store_write_errors: CounterVec<0>,
    /// `agentgate_flow_rate_limit_store_errors_total`.
    pub rate_limit_store_errors: CounterVec<0>,
    /// `agentgate_responses_total{pool,status,code}`.
    pub responses: CounterVec<3>,
    /// `agentgate_compactions_total{pool,status}`.
    pub compactions: CounterVec<2>,
    /// `agentgate_pd_decisions_total{pool,decision,reason}`.
    pub pd_decisions: CounterVec<3>,
    /// `agentgate_pd_transfer_failures_total{pool,prefill,decode}`.
    pub pd_transfer_failures: CounterVec<3>,
    /// `agentgate_pd_fallbacks_total{pool,cause}`.
    pub pd_fallbacks: CounterVec<2>,
    /// `agentgate_pd_prefill_pin_moves_total{pool,cause}`.
    pub pd_prefill_pin_moves: CounterVec<2>,
    /// `agentgate_pd_sub_agent_calls_total{pool,source}`.
    pub pd_sub_agent_calls: CounterVec<2>,
    /// `agentgate_pd_leg_duration_seconds{pool,leg}`.
    pub pd_leg_duration: HistogramVec<2>,
    /// `agentgate_prefix_routes_shared_total{pool,direction}`.
    pub prefix_routes_shared: CounterVec<2>,
    /// `agentgate_prefix_feed_skipped_total{pool}`.
    pub prefix_feed_skipped: CounterVec<1>,
    /// `agentgate_http_requests_total{route,method,status,code}`.
    pub http_requests: CounterVec<4>,
    /// `agentgate_http_request_duration_seconds{route,method}`.
    pub http_duration: HistogramVec<2>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// An empty registry.
    pub fn new() -> Self {
        let metrics = Metrics {
            routing_decisions: CounterVec::new(
                "agentgate_routing_decisions_total",
                "Requests routed to an endpoint, by the reason that decided it.",
                ["pool", "endpoint", "reason"],
            ),
            pin_moves: CounterVec::new(
                "agentgate_session_pin_moves_total",
                "Session pins moved to another endpoint, by cause (counted once the new endpoint produced output; a move whose endpoint failed before that is undone).",
                ["pool", "cause"],
            ),
            discovery_reloads: CounterVec::new(
                "agentgate_discovery_reloads_total",
                "Endpoint lists read from a discovery source, by result (ok or error).",
                ["pool", "result"],
            ),
            health_transitions: CounterVec::new(
                "agentgate_endpoint_health_transitions_total",
                "Endpoints taken out (state=unhealthy) or returned (state=healthy) by health probes.",
                ["pool", "endpoint", "state"],
            ),
            probe_failures: CounterVec::new(
                "agentgate_endpoint_probe_failures_total",
                "Failed health probes (probe=health) and metrics scrapes (probe=metrics).",
                ["pool", "endpoint", "probe"],
            ),
            probe_duration: HistogramVec::new(
                "agentgate_endpoint_probe_duration_seconds",
                "Latency of health probes and metrics scrapes, failed ones included.",
                ["pool", "probe"],
                PROBE_BUCKETS,
            ),
            config_reloads: CounterVec::new(
                "agentgate_config_reloads_total",
                "Config file reloads of [[bands]], [[teams]] and [flow], by result (ok, error, or restart_needed: applied, other sections changed too).",
                ["result"],
            ),
            store_write_errors: CounterVec::new(
                "agentgate_store_write_errors_total",
                "Writes of a finished response (or of its items to its conversation) the store refused or could not be reached for; each retry counts.",
                [],
            ),
            rate_limit_store_errors: CounterVec::new(
                "agentgate_flow_rate_limit_store_errors_total",
                "Rate-limit calls the store could not answer (limits then kept by this gateway alone for 5 s).",
                [],
            ),
            pd_decisions: CounterVec::new(
                "agentgate_pd_decisions_total",
                "Requests of pools with prefill endpoints, by whether their prompt was prefilled remotely (decision=disaggregated) or on the decode endpoint (decision=local), and why.",
                ["pool", "decision", "reason"],
            ),
            pd_transfer_failures: CounterVec::new(
                "agentgate_pd_transfer_failures_total",
                "Disaggregated requests whose decode leg failed after the prefill leg ran (usually a lost KV transfer).",
                ["pool", "prefill", "decode"],
            ),
            pd_fallbacks: CounterVec::new(
                "agentgate_pd_fallbacks_total",
                "Disaggregated requests retried with a local prefill, by cause (prefill_failed, transfer_failed).",
                ["pool", "cause"],
            ),
            pd_prefill_pin_moves: CounterVec::new(
                "agentgate_pd_prefill_pin_moves_total",
                "Prefill halves of session pins moved to another prefill endpoint, by cause.",
                ["pool", "cause"],
            ),
            compactions: CounterVec::new(
                "agentgate_compactions_total",
                "Compaction turns (compaction_trigger or /v1/responses/compact) that ended, by pool and final status; they count in agentgate_responses_total too.",
                ["pool", "status"],
            ),
            responses: CounterVec::new(
                "agentgate_responses_total",
                "Responses that ended, by pool, final status (completed, incomplete, failed, cancelled) and error code (empty unless failed).",
                ["pool", "status", "code"],
            ),
            pd_sub_agent_calls: CounterVec::new(
                "agentgate_pd_sub_agent_calls_total",
                "Calls of pools with prefill endpoints placed as a sub-agent's, by where the parent came from (header, codex, claude_code, opencode, or prefix: found by the prefix shared with an active session).",
                ["pool", "source"],
            ),
            pd_leg_duration: HistogramVec::new(
                "agentgate_pd_leg_duration_seconds",
                "Latency of disaggregated legs: prefill (until the KV cache is ready for decode) and decode (from then to the first token).",
                ["pool", "leg"],
                LEG_BUCKETS,
            ),
            http_requests: CounterVec::new(
                "agentgate_http_requests_total",
                "HTTP requests answered, by route template, method, status and the error code of an error answer (empty on success).",
                ["route", "method", "status", "code"],
            ),
            prefix_routes_shared: CounterVec::new(
                "agentgate_prefix_routes_shared_total",
                "Routing decisions shared with the other gateways through the store's route feed, by direction: sent, received (recorded in this gateway's prefix index), dropped (over the per-interval bound).",
                ["pool", "direction"],
            ),
            prefix_feed_skipped: CounterVec::new(
                "agentgate_prefix_feed_skipped_total",
                "Route feed entries the store trimmed before this gateway read them (it fell behind).",
                ["pool"],
            ),
            http_duration: HistogramVec::new(
                "agentgate_http_request_duration_seconds",
                "Time until an HTTP answer's head was ready (a stream's: its opening), by route template and method.",
                ["route", "method"],
                HTTP_BUCKETS,
            ),
        };
        // Counters of rare events show 0 from the start, so the first one is an increase
        // (`rate()` and `increase()` read a series' first sample as its start).
        metrics.store_write_errors.inc_by([], 0);
        metrics.rate_limit_store_errors.inc_by([], 0);
        for result in ["ok", "error", "restart_needed"] {
            metrics.config_reloads.inc_by([result], 0);
        }
        metrics
    }

    /// A request of a pool with prefill endpoints was placed: `decision` is `disaggregated`
    /// or `local`, `reason` why.
    pub fn pd_decision(&self, pool: &str, decision: &str, reason: &str) {
        self.pd_decisions.inc([pool, decision, reason]);
    }

    /// The decode leg of a disaggregated request failed after its prefill leg ran.
    pub fn pd_transfer_failed(&self, pool: &str, prefill: &Endpoint, decode: &Endpoint) {
        if listed(prefill) && listed(decode) {
            self.pd_transfer_failures
                .inc([pool, &prefill.name, &decode.name]);
        }
    }

    /// A disaggregated request was retried with a local prefill for `cause`.
    pub fn pd_fallback(&self, pool: &str, cause: &str) {
        self.pd_fallbacks.inc([pool, cause]);
    }

    /// The prefill half of a session's pin moved for `cause`.
    pub fn pd_prefill_pin_moved(&self, pool: &str, cause: &str) {
        self.pd_prefill_pin_moves.inc([pool, cause]);
    }

    /// A compaction turn ended (it was counted by [`Metrics::response_ended`] too).
    pub fn compaction_ended(&self, pool: &str, response: &serde_json::Value) {
        let status = response
            .get("status")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("unknown");
        self.compactions.inc([pool, status]);
    }

    /// A turn ended as `response` says: its status and, when it failed, its error code.
    pub fn response_ended(&self, pool: &str, response: &serde_json::Value) {
        let status = response
            .get("status")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("unknown");

        let code = match status {
            "failed" => response
                .pointer("/error/code")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("unknown"),
            _ => "",
        };
        self.responses.inc([pool, status, code]);
    }

    /// A call was placed as a sub-agent's; `source` says where its parent came from.
    pub fn pd_sub_agent(&self, pool: &str, source: &str) {
        self.pd_sub_agent_calls.inc([pool, source]);
    }

    /// One leg (`prefill` or `decode`) of a disaggregated request took `elapsed`.
    pub fn pd_leg(&self, pool: &str, leg: &str, elapsed: std::time::Duration) {
        self.pd_leg_duration
            .observe([pool, leg], elapsed.as_secs_f64());
    }

    /// A request was routed to `endpoint` for `reason` (`pin`, `prefix`, `load`, ...).
    pub fn routing_decision(&self, pool: &str, endpoint: &Endpoint, reason: &str) {
        if listed(endpoint) {
            self.routing_decisions.inc([pool, &endpoint.name, reason]);
        }
    }

    /// A `kind` probe (`health`, `metrics`) of `endpoint` failed.
    pub fn probe_failed(&self, pool: &str, endpoint: &Endpoint, kind: &str) {
        if listed(endpoint) {
            self.probe_failures.inc([pool, &endpoint.name, kind]);
        }
    }

    /// `endpoint` turned `healthy` or `unhealthy`.
    pub fn health_transition(&self, pool: &str, endpoint: &Endpoint, to: &str) {
        if listed(endpoint) {
            self.health_transitions.inc([pool, &endpoint.name, to]);
        }
    }

    /// A session's pin moved for `cause` (`unavailable`, `saturated`, `wait`, ...).
    pub fn pin_moved(&self, pool: &str, cause: &str) {
        self.pin_moves.inc([pool, cause]);
    }

    /// A discovery source was read: `result` is `ok` or `error`.
    pub fn discovery_reload(&self, pool: &str, result: &str) {
        self.discovery_reloads.inc([pool, result]);
    }

    /// An endpoint left `pool`'s list for good: drop the event series that name it (routing
    /// decisions, health transitions, probe failures, failed KV transfers), so endpoints
    /// replaced over months (pods renamed at each rollout) do not pile up series.
    pub fn forget_endpoint(&self, pool: &str, endpoint: &str) {
        let named = |values: &[String]| values[0] == pool && values[1] == endpoint;
        self.routing_decisions.forget(named);
        self.health_transitions.forget(named);
        self.probe_failures.forget(named);
        self.pd_transfer_failures
            .forget(|values| values[0] == pool && (values[1] == endpoint || values[2] == endpoint));
    }

    /// The text exposition of every metric, live endpoint state read from `pools` at `now`.
    pub fn render(&self, pools: &Pools, now: Instant) -> String {
        let mut out = String::with_capacity(4096);
        endpoint_state(pools, now, &mut out);
        self.routing_decisions.encode(&mut out);
        self.pin_moves.encode(&mut out);
        self.discovery_reloads.encode(&mut out);
        self.health_transitions.encode(&mut out);
        self.probe_failures.encode(&mut out);
        self.probe_duration.encode(&mut out);
        self.config_reloads.encode(&mut out);
        self.store_write_errors.encode(&mut out);
        self.rate_limit_store_errors.encode(&mut out);
        self.responses.encode(&mut out);
        self.compactions.encode(&mut out);
        self.pd_decisions.encode(&mut out);
        self.pd_transfer_failures.encode(&mut out);
        self.pd_fallbacks.encode(&mut out);
        self.pd_prefill_pin_moves.encode(&mut out);
        self.pd_sub_agent_calls.encode(&mut out);
        self.pd_leg_duration.encode(&mut out);
        self.prefix_routes_shared.encode(&mut out);
        self.prefix_feed_skipped.encode(&mut out);
        self.http_requests.encode(&mut out);
        self.http_duration.encode(&mut out);
        out
    }
}

/// Count every answer in `agentgate_http_requests_total` and time its head in
/// `agentgate_http_request_duration_seconds` (see the module docs). Labels stay bounded: the
/// route is axum's template, the method one of those routes use (`other` else), the code one
/// of the gateway's own ([`crate::error::ErrorCode`]). A client that leaves before the head
/// (while its request was queued, or a non-streamed turn ran) is counted with status `499`
/// and code `client_closed`.
pub async fn observe_http(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = match request.method().as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "DELETE" => "DELETE",
        _ => "other",
    };
    let mut pending = HttpAnswer {
        state,
        route,
        method,
        started: Instant::now(),
        answered: false,
    };
    let resp = next.run(request).await;
    let code = resp
        .extensions()
        .get::<crate::error::ErrorCode>()
        .map_or("", |c| c.0.as_str());
    pending.record(resp.status().as_str(), code);
    resp
}

/// One request [`observe_http`] counts: recorded with its answer's status, or as `499` when
/// dropped before it (the client went away).
struct HttpAnswer {
    state: Arc<AppState>,
    route: String,
    method: &'static str,
    started: Instant,
    answered: bool,
}

impl HttpAnswer {
    fn record(&mut self, status: &str, code: &str) {
        self.answered = true;
        let metrics = &self.state.metrics;
        metrics
            .http_requests
            .inc([&self.route, self.method, status, code]);
        // A client that left got no answer head: its wait is not a latency of one.
        if status != "499" {
            metrics.http_duration.observe(
                [&self.route, self.method],
                self.started.elapsed().as_secs_f64(),
            );
        }
    }
}

impl Drop for HttpAnswer {
    fn drop(&mut self) {
        if !self.answered {
            self.record("499", "client_closed");
        }
    }
}

/// A histogram family from flow-control snapshots' [`WaitHistogram`]s.
fn encode_waits(
    name: &str,
    help: &str,
    label_names: &[&str],
    series: &[(Vec<String>, &WaitHistogram)],
    out: &mut String,
) {
    header(name, help, "histogram", out);
    for (values, h) in series {
        for (le, cumulative) in h.cumulative() {
            let _ = write!(out, "{name}_bucket");
            labels(label_names, values, Some(("le", &number(le))), out);
            let _ = writeln!(out, " {cumulative}");
        }
        let _ = write!(out, "{name}_sum");
        labels(label_names, values, None, out);
        let _ = writeln!(out, " {}", number(h.sum_seconds()));
        let _ = write!(out, "{name}_count");
        labels(label_names, values, None, out);
        let _ = writeln!(out, " {}", h.count());
    }
}

/// Flow-control series, read from every pool's controller at scrape time:
///
/// | series | meaning |
/// |---|---|
/// | `agentgate_flow_capacity_requests{pool}` | requests the pool may have in flight now (0 while no endpoint is available) |
/// | `agentgate_flow_in_flight_requests{pool}` | requests admitted and not finished |
/// | `agentgate_flow_queued_requests{pool,band}`, `agentgate_flow_queued_bytes{pool,band}` | waiting now |
/// | `agentgate_flow_band_requests_total{pool,band,outcome}` | `dispatched`, `shed`, `rate_limited`, `queue_full`, `timed_out`, `cancelled` |
/// | `agentgate_flow_queue_wait_seconds{pool,band}` | queue wait of dispatched requests (histogram) |
/// | `agentgate_flow_team_queued_requests{pool,team}`, `agentgate_flow_team_in_flight_requests{pool,team}` | per team, now |
/// | `agentgate_flow_team_peer_in_flight_requests{pool,team}` | the team's requests in flight at the other gateways, as last exchanged (counted toward its `max_concurrent`) |
/// | `agentgate_flow_team_requests_total{pool,team,outcome}` | `dispatched`, `shed`, `rate_limited`, `queue_full`, `timed_out`, `cancelled` |
/// | `agentgate_flow_team_dispatched_tokens_total{pool,team}` | tokens of the team's dispatched turns, counted when each ends (its actual count; the estimate when it reported none) |
/// | `agentgate_flow_team_queue_wait_seconds{pool,team}` | queue wait of the team's dispatched requests (histogram) |
/// | `agentgate_flow_turn_wait_seconds{pool,turn}` | queue wait by turn kind, `continuing` or `new` (histogram) |
/// | `agentgate_flow_promoted_total{pool}` | new sessions sent ahead of continuing turns because they aged |
/// | `agentgate_flow_pin_holds_total{pool,outcome}` | turns held for a slot on their session's endpoint: `placed` there once it had room, `outwaited` (`pin_wait_s` ran out; placed elsewhere) |
pub fn flow_state(flow: &FlowControl, out: &mut String) {
    let capacity = GaugeVec::new(
        "agentgate_flow_capacity_requests",
        "Requests the pool may have in flight now (gateway cap, less saturated endpoints).",
        ["pool"],
    );
    let in_flight = GaugeVec::new(
        "agentgate_flow_in_flight_requests",
        "Requests admitted by flow control and not finished.",
        ["pool"],
    );
    let queued = GaugeVec::new(
        "agentgate_flow_queued_requests",
        "Requests waiting in the band's queue.",
        ["pool", "band"],
    );
    let queued_bytes = GaugeVec::new(
        "agentgate_flow_queued_bytes",
        "Bytes of the requests waiting in the band's queue (each its body, or its engine request when larger).",
        ["pool", "band"],
    );
    let band_requests = CounterVec::new(
        "agentgate_flow_band_requests_total",
        "Requests of the band by outcome: dispatched, shed, rate_limited, queue_full, timed_out, cancelled.",
        ["pool", "band", "outcome"],
    );
    let team_queued = GaugeVec::new(
        "agentgate_flow_team_queued_requests",
        "Requests of the team waiting, over all bands.",
        ["pool", "team"],
    );
    let team_in_flight = GaugeVec::new(
        "agentgate_flow_team_in_flight_requests",
        "Requests of the team admitted and not finished.",
        ["pool", "team"],
    );
    let team_peer_in_flight = GaugeVec::new(
        "agentgate_flow_team_peer_in_flight_requests",
        "Requests of the team in flight at the other gateways in front of the pool, as last exchanged (counted toward its max_concurrent).",
        ["pool", "team"],
    );
    let team_requests = CounterVec::new(
        "agentgate_flow_team_requests_total",
        "Requests of the team by outcome: dispatched, shed, rate_limited, queue_full, timed_out, cancelled.",
        ["pool", "team", "outcome"],
    );
    let team_tokens = CounterVec::new(
        "agentgate_flow_team_dispatched_tokens_total",
        "Tokens of the team's dispatched turns, counted when each ends: its actual count (the estimate when it reported none).",
        ["pool", "team"],
    );
    let promoted = CounterVec::new(
        "agentgate_flow_promoted_total",
        "New sessions dispatched ahead of waiting continuing turns because they aged.",
        ["pool"],
    );
    let pin_holds = CounterVec::new(
        "agentgate_flow_pin_holds_total",
        "Turns held for a slot on their session's endpoint: placed there once it had room, or outwaited (pin_wait_s ran out; placed elsewhere).",
        ["pool", "outcome"],
    );
    let snapshots = flow.snapshots();
    let mut band_waits = Vec::new();
    let mut team_waits = Vec::new();
    let mut turn_waits = Vec::new();
    for (pool, s) in &snapshots {
        let p = pool.as_str();
        // (No endpoint available: nothing may be in flight, and the series says 0, so an
        // alert on it fires.)
        capacity.set([p], flow.capacity(p).unwrap_or(0) as f64);
        in_flight.set([p], s.in_flight as f64);
        for b in &s.bands {
            let l = [p, b.name.as_str()];
            queued.set(l, b.queued as f64);
            queued_bytes.set(l, b.queued_bytes as f64);
            for (outcome, n) in [
                ("dispatched", b.dispatched),
                ("shed", b.shed),
                ("rate_limited", b.rate_limited),
                ("queue_full", b.queue_full),
                ("timed_out", b.timed_out),
                ("cancelled", b.cancelled),
            ] {
                band_requests.inc_by([p, &b.name, outcome], n);
            }
            band_waits.push((key(l), &b.wait));
        }
        for t in &s.teams {
            let l = [p, t.name.as_str()];
            team_queued.set(l, t.queued as f64);
            team_in_flight.set(l, t.in_flight as f64);
            team_peer_in_flight.set(l, t.peer_in_flight as f64);
            team_tokens.inc_by(l, t.finished_tokens);
            team_waits.push((key(l), &t.wait));
            for (outcome, n) in [
                ("dispatched", t.dispatched_requests),
                ("shed", t.shed),
                ("rate_limited", t.rate_limited),
                ("queue_full", t.queue_full),
                ("timed_out", t.timed_out),
                ("cancelled", t.cancelled),
            ] {
                team_requests.inc_by([p, &t.name, outcome], n);
            }
        }
        promoted.inc_by([p], s.turns.promoted);
        pin_holds.inc_by([p, "placed"], s.turns.held);
        pin_holds.inc_by([p, "outwaited"], s.turns.outwaited);
        turn_waits.push((key([p, "continuing"]), &s.turns.continuing));
        turn_waits.push((key([p, "new"]), &s.turns.new));
    }
    capacity.encode(out);
    in_flight.encode(out);
    queued.encode(out);
    queued_bytes.encode(out);
    band_requests.encode(out);
    encode_waits(
        "agentgate_flow_queue_wait_seconds",
        "Queue wait of dispatched requests, by band.",
        &["pool", "band"],
        &band_waits,
        out,
    );
    team_queued.encode(out);
    team_in_flight.encode(out);
    team_peer_in_flight.encode(out);
    team_requests.encode(out);
    team_tokens.encode(out);
    encode_waits(
        "agentgate_flow_team_queue_wait_seconds",
        "Queue wait of dispatched requests, by team.",
        &["pool", "team"],
        &team_waits,
        out,
    );
    encode_waits(
        "agentgate_flow_turn_wait_seconds",
        "Queue wait of dispatched requests, by turn kind (continuing or new).",
        &["pool", "turn"],
        &turn_waits,
        out,
    );
    promoted.encode(out);
    pin_holds.encode(out);
}

/// The live-state gauges of the module doc's table.
fn endpoint_state(pools: &Pools, now: Instant, out: &mut String) {
    let ep = ["pool", "endpoint"];
    let g = |name, help| GaugeVec::new(name, help, ep);
    let info = GaugeVec::new(
        "agentgate_endpoint_info",
        "One series per endpoint in its pool's current list.",
        ["pool", "endpoint", "role", "slot"],
    );
    let healthy = g(
        "agentgate_endpoint_healthy",
        "1 when the endpoint's last health probes passed.",
    );
    let saturated = g(
        "agentgate_endpoint_saturated",
        "1 when the engine's queue or KV cache is at the pool's limit, or its metrics are stale.",
    );
    let requests = g(
        "agentgate_endpoint_in_flight_requests",
        "Requests this gateway has in flight on the endpoint.",
    );
    let tokens = g(
        "agentgate_endpoint_in_flight_tokens",
        "Prompt tokens (estimated) of the requests in flight.",
    );
    let prefill = g(
        "agentgate_endpoint_pending_prefill_tokens",
        "Uncached prompt tokens of in-flight requests still waiting for their first token.",
    );
    let working_set = g(
        "agentgate_endpoint_kv_working_set_tokens",
        "KV tokens the prompts in flight span together, each shared prefix counted once.",
    );
    let peer_working_set = g(
        "agentgate_endpoint_peer_kv_working_set_tokens",
        "KV tokens the other gateways' prompts in flight span, as they last published.",
    );
    let kv_capacity = g(
        "agentgate_endpoint_kv_capacity_tokens",
        "The engine's KV capacity in tokens, from its cache configuration metric.",
    );
    let waiting = g(
        "agentgate_endpoint_engine_waiting",
        "Requests waiting in the engine's queue, from its last metrics scrape.",
    );
    let running = g(
        "agentgate_endpoint_engine_running",
        "Requests running in the engine, from its last metrics scrape.",
    );
    let kv = g(
        "agentgate_endpoint_kv_usage",
        "KV-cache usage (0..1) the engine reported in its last metrics scrape.",
    );
    let age = g(
        "agentgate_endpoint_metrics_age_seconds",
        "Seconds since the endpoint's last successful metrics scrape.",
    );
    let prefill_rate = g(
        "agentgate_endpoint_prefill_tokens_per_second",
        "Prefill throughput measured from the prefills the gateway timed on the endpoint.",
    );
    let pool_size = GaugeVec::new(
        "agentgate_pool_endpoints",
        "Endpoints in the pool's current list.",
        ["pool"],
    );
    let pool_available = GaugeVec::new(
        "agentgate_pool_available_endpoints",
        "Endpoints of the pool that take new work (healthy, not retired).",
        ["pool"],
    );
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    for pool in pools.all() {
        let endpoints = pool.endpoints();
        let p = pool.name.as_str();
        pool_size.set([p], endpoints.len() as f64);
        pool_available.set(
            [p],
            endpoints.iter().filter(|e| e.is_available()).count() as f64,
        );
        for e in endpoints.iter() {
            let l = [p, e.name.as_str()];
            info.set([p, &e.name, e.role.name(), &e.slot.to_string()], 1.0);
            healthy.set(l, flag(e.is_healthy()));
            saturated.set(l, flag(e.saturated(&pool.saturation, now)));
            requests.set(l, e.in_flight_requests() as f64);
            tokens.set(l, e.in_flight_tokens() as f64);
            prefill.set(l, e.pending_prefill_tokens() as f64);
            working_set.set(l, e.working_set_tokens() as f64);
            peer_working_set.set(l, e.peer_working_set_tokens() as f64);
            if e.kv_capacity_tokens() > 0 {
                kv_capacity.set(l, e.kv_capacity_tokens() as f64);
            }
            if let Some(r) = e.load_report() {
                waiting.set(l, r.waiting);
                running.set(l, r.running);
                if let Some(u) = r.kv_usage {
                    kv.set(l, u);
                }
                age.set(l, now.saturating_duration_since(r.at).as_secs_f64());
            }
            if let Some(rate) = e.prefill_tokens_per_s() {
                prefill_rate.set(l, rate);
            }
        }
    }
    pool_size.encode(out);
    pool_available.encode(out);
    info.encode(out);
    for family in [
        &healthy,
        &saturated,
        &requests,
        &tokens,
        &prefill,
        &working_set,
        &peer_working_set,
        &kv_capacity,
        &waiting,
        &running,
        &kv,
        &age,
        &prefill_rate,
    ] {
        family.encode(out);
    }
}

/// The in-memory store's size and memory evictions (nothing for Redis, whose own metrics say).
fn memory_store_state(store: &agentgate_sessions::AnyStore, out: &mut String) {
    if let agentgate_sessions::AnyStore::Memory(memory) = store {
        header(
            "agentgate_store_memory_bytes",
            "Estimated bytes of the responses the in-memory store holds (bound: store.memory_max_mb).",
            "gauge",
            out,
        );
        let _ = writeln!(
            out,
            "agentgate_store_memory_bytes {}",
            memory.memory_bytes()
        );
        header(
            "agentgate_store_evictions_total",
            "Records (responses and conversations) the in-memory store dropped, least recently used first, to stay within store.memory_max_mb.",
            "counter",
            out,
        );
        let _ = writeln!(out, "agentgate_store_evictions_total {}", memory.evicted());
    }
}

/// `GET /metrics`: the text exposition (unauthenticated, like the health checks; it names
/// pools, endpoints, bands and teams, never keys).
pub async fn handler(State(state): State<Arc<AppState>>) -> Response {
    let mut body = state.metrics.render(&state.pools, Instant::now());
    flow_state(&state.flow, &mut body);
    memory_store_state(&state.store, &mut body);
    ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], body).into_response()
}

/// Whether `endpoint` is still in its pool's list: the event series of one removed are
/// forgotten ([`Metrics::forget_endpoint`]), and a probe or request still finishing there must
/// not bring them back.
fn listed(endpoint: &Endpoint) -> bool {
    !endpoint.is_retired()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_with_escaped_labels() {
        let c = CounterVec::new("t_total", "Help with \\ and\nnewline.", ["a", "b"]);
        c.inc(["x", "q\"uo\\te\nd"]);
        c.inc_by(["x", "q\"uo\\te\nd"], 2);
        c.inc(["a", "b"]);
        assert_eq!(c.get(["x", "q\"uo\\te\nd"]), 3);
        assert_eq!(c.get(["none", "none"]), 0);
        let mut out = String::new();
        c.encode(&mut out);
        assert_eq!(
            out,
            "# HELP t_total Help with \\\\ and\\nnewline.\n# TYPE t_total counter\n\
             t_total{a=\"a\",b=\"b\"} 1\n\
             t_total{a=\"x\",b=\"q\\\"uo\\\\te\\nd\"} 3\n"
        );
    }

    #[test]
    fn counters_of_rare_events_show_zero_from_the_start() {
        let m = Metrics::new();
        let mut out = String::new();
        m.store_write_errors.encode(&mut out);
        m.rate_limit_store_errors.encode(&mut out);
        m.config_reloads.encode(&mut out);
        for line in [
            "agentgate_store_write_errors_total 0",
            "agentgate_flow_rate_limit_store_errors_total 0",
            "agentgate_config_reloads_total{result=\"restart_needed\"} 0",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
    }

    #[test]
    fn gauges_render_special_floats_and_no_braces_without_labels() {
        let g = GaugeVec::new("g", "G.", []);
        g.set([], f64::INFINITY);
        let mut out = String::new();
        g.encode(&mut out);
        assert!(out.ends_with("\ng +Inf\n"), "{out}");
        let g = GaugeVec::new("h", "H.", ["x"]);
        g.set(["1"], 0.25);
        g.set(["1"], f64::NAN);
        g.set(["2"], -1.5);
        let mut out = String::new();
        g.encode(&mut out);
        assert!(out.contains("h{x=\"1\"} NaN\nh{x=\"2\"} -1.5\n"), "{out}");
    }

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        const B: &[f64] = &[0.1, 1.0];
        let h = HistogramVec::new("lat_seconds", "L.", ["p"], B);
        for v in [0.0625, 0.09375, 0.5, 3.0, f64::NAN] {
            h.observe(["a"], v);
        }
        assert_eq!(h.count(["a"]), 4);
        let mut out = String::new();
        h.encode(&mut out);
        let body: Vec<&str> = out.lines().skip(2).collect();
        assert_eq!(
            body,
            [
                "lat_seconds_bucket{p=\"a\",le=\"0.1\"} 2",
                "lat_seconds_bucket{p=\"a\",le=\"1\"} 3",
                "lat_seconds_bucket{p=\"a\",le=\"+Inf\"} 4",
                "lat_seconds_sum{p=\"a\"} 3.65625",
                "lat_seconds_count{p=\"a\"} 4",
            ]
        );
    }

    #[tokio::test]
    async fn live_endpoint_state_is_read_at_render_time() {
        let config = crate::Config::parse(
            "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
             [[pools]]\nname = \"main\"\nmodel = \"m\"\nrole = \"decode\"\n\
             endpoints = [\"http://127.0.0.1:9\", \"http://127.0.0.1:10\"]\n",
        )
        .unwrap();
        let engines = agentgate_adapters::EngineClient::new(Default::default());
        let pools = Pools::start(&config, &engines).await.unwrap();
        let pool = pools.for_model("m").unwrap();
        let eps = pool.endpoints();
        let _guard = eps[0].begin(100, 60);
        eps[0].observe_prefill(20_000, std::time::Duration::from_secs(2));
        eps[1].set_healthy(false);
        let now = Instant::now();
        eps[0].set_load_report(agentgate_scheduler::LoadReport {
            at: now,
            waiting: 3.0,
            running: 5.0,
            kv_usage: Some(0.5),
            gateway_in_flight: 0,
            peer_in_flight: 0,
        });
        let m = Metrics::new();
        m.routing_decision("main", &eps[0], "load");
        let out = m.render(&pools, now + std::time::Duration::from_millis(1500));
        for line in [
            "agentgate_pool_endpoints{pool=\"main\"} 2",
            "agentgate_pool_available_endpoints{pool=\"main\"} 1",
            "agentgate_endpoint_info{pool=\"main\",endpoint=\"main/1\",role=\"decode\",slot=\"1\"} 1",
            "agentgate_endpoint_healthy{pool=\"main\",endpoint=\"main/0\"} 1",
            "agentgate_endpoint_healthy{pool=\"main\",endpoint=\"main/1\"} 0",
            "agentgate_endpoint_in_flight_requests{pool=\"main\",endpoint=\"main/0\"} 1",
            "agentgate_endpoint_in_flight_tokens{pool=\"main\",endpoint=\"main/0\"} 100",
            "agentgate_endpoint_pending_prefill_tokens{pool=\"main\",endpoint=\"main/0\"} 60",
            "agentgate_endpoint_engine_waiting{pool=\"main\",endpoint=\"main/0\"} 3",
            "agentgate_endpoint_engine_running{pool=\"main\",endpoint=\"main/0\"} 5",
            "agentgate_endpoint_kv_usage{pool=\"main\",endpoint=\"main/0\"} 0.5",
            "agentgate_endpoint_metrics_age_seconds{pool=\"main\",endpoint=\"main/0\"} 1.5",
            "agentgate_endpoint_saturated{pool=\"main\",endpoint=\"main/0\"} 0",
            "agentgate_endpoint_prefill_tokens_per_second{pool=\"main\",endpoint=\"main/0\"} 10000",
            "agentgate_routing_decisions_total{pool=\"main\",endpoint=\"main/0\",reason=\"load\"} 1",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing in\n{out}");
        }
        // Never scraped: no engine series for main/1.
        assert!(
            !out.contains("agentgate_endpoint_engine_waiting{pool=\"main\",endpoint=\"main/1\"}")
        );
        // Every sample line is `name{labels} value` or `name value`.
        for line in out.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(series.starts_with("agentgate_"), "{line}");
            assert!(
                value == "NaN" || value.ends_with("Inf") || value.parse::<f64>().is_ok(),
                "{line}"
            );
        }
        pools.shutdown().await;
    }

    #[tokio::test]
    async fn flow_series_are_read_from_the_controllers() {
        let config = crate::Config::parse(
            "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n\
             [[pools]]\nname = \"main\"\nmodel = \"m\"\nendpoints = [\"http://127.0.0.1:9\"]\n\
             [flow]\nmax_in_flight_per_endpoint = 1\n",
        )
        .unwrap();
        let engines = agentgate_adapters::EngineClient::new(Default::default());
        let pools = Pools::start(&config, &engines).await.unwrap();
        let limiter = Arc::new(agentgate_scheduler::LocalRateLimiter::new());
        let flow = FlowControl::new(&config, &pools, limiter).unwrap();
        let controller = flow.controller("main").unwrap();
        let permit = controller
            .admit(agentgate_scheduler::Ticket::new("default", 40))
            .await
            .unwrap();
        let mut out = String::new();
        flow_state(&flow, &mut out);
        for line in [
            "agentgate_flow_capacity_requests{pool=\"main\"} 1",
            "agentgate_flow_in_flight_requests{pool=\"main\"} 1",
            "agentgate_flow_queued_requests{pool=\"main\",band=\"default\"} 0",
            "agentgate_flow_band_requests_total{pool=\"main\",band=\"default\",outcome=\"dispatched\"} 1",
            "agentgate_flow_band_requests_total{pool=\"main\",band=\"default\",outcome=\"shed\"} 0",
            "agentgate_flow_queue_wait_seconds_bucket{pool=\"main\",band=\"default\",le=\"0.005\"} 1",
            "agentgate_flow_queue_wait_seconds_bucket{pool=\"main\",band=\"default\",le=\"+Inf\"} 1",
            "agentgate_flow_queue_wait_seconds_count{pool=\"main\",band=\"default\"} 1",
            "agentgate_flow_team_in_flight_requests{pool=\"main\",team=\"default\"} 1",
            "agentgate_flow_team_requests_total{pool=\"main\",team=\"default\",outcome=\"dispatched\"} 1",
            // Counted when the turn ends.
            "agentgate_flow_team_dispatched_tokens_total{pool=\"main\",team=\"default\"} 0",
            "agentgate_flow_team_queue_wait_seconds_count{pool=\"main\",team=\"default\"} 1",
            "agentgate_flow_turn_wait_seconds_count{pool=\"main\",turn=\"new\"} 1",
            "agentgate_flow_promoted_total{pool=\"main\"} 0",
            "agentgate_flow_pin_holds_total{pool=\"main\",outcome=\"placed\"} 0",
            "agentgate_flow_pin_holds_total{pool=\"main\",outcome=\"outwaited\"} 0",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing in\n{out}");
        }
        for line in out.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = line.rsplit_once(' ').unwrap();
            assert!(series.starts_with("agentgate_flow_"), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
        // Estimated at 40, it used 25: the counter grows by 25 (it never gives back).
        permit.finish(25);
        let mut out = String::new();
        flow_state(&flow, &mut out);
        assert!(out.contains("agentgate_flow_in_flight_requests{pool=\"main\"} 0\n"));
        let tokens =
            "agentgate_flow_team_dispatched_tokens_total{pool=\"main\",team=\"default\"} 25\n";
        assert!(out.contains(tokens), "{out}");
        pools.shutdown().await;
    }

    #[test]
    fn event_api_counts_into_the_named_series() {
        let m = Metrics::new();
        let ep = |name: &str| Endpoint::new(name, "http://127.0.0.1:9");
        m.routing_decision("main", &ep("main/0"), "prefix");
        m.routing_decision("main", &ep("main/0"), "prefix");
        m.pin_moved("main", "unavailable");
        m.discovery_reload("main", "error");
        m.pd_decision("main", "disaggregated", "uncached");
        m.pd_transfer_failed("main", &ep("main/1"), &ep("main/2"));
        m.pd_fallback("main", "transfer_failed");
        m.pd_prefill_pin_moved("main", "wait");
        m.pd_sub_agent("main", "prefix");
        m.pd_leg("main", "prefill", std::time::Duration::from_millis(30));
        for line in [
            "agentgate_pd_decisions_total{pool=\"main\",decision=\"disaggregated\",reason=\"uncached\"} 1",
            "agentgate_pd_transfer_failures_total{pool=\"main\",prefill=\"main/1\",decode=\"main/2\"} 1",
            "agentgate_pd_fallbacks_total{pool=\"main\",cause=\"transfer_failed\"} 1",
            "agentgate_pd_prefill_pin_moves_total{pool=\"main\",cause=\"wait\"} 1",
            "agentgate_pd_sub_agent_calls_total{pool=\"main\",source=\"prefix\"} 1",
            "agentgate_pd_leg_duration_seconds_bucket{pool=\"main\",leg=\"prefill\",le=\"0.05\"} 1",
            "agentgate_pd_leg_duration_seconds_bucket{pool=\"main\",leg=\"prefill\",le=\"0.025\"} 0",
            "agentgate_pd_leg_duration_seconds_count{pool=\"main\",leg=\"prefill\"} 1",
        ] {
            let mut out = String::new();
            m.pd_decisions.encode(&mut out);
            m.pd_transfer_failures.encode(&mut out);
            m.pd_fallbacks.encode(&mut out);
            m.pd_prefill_pin_moves.encode(&mut out);
            m.pd_sub_agent_calls.encode(&mut out);
            m.pd_leg_duration.encode(&mut out);
            assert!(out.lines().any(|l| l == line), "{line} missing in\n{out}");
        }
        let mut out = String::new();
        m.routing_decisions.encode(&mut out);
        m.pin_moves.encode(&mut out);
        m.discovery_reloads.encode(&mut out);
        for line in [
            "agentgate_routing_decisions_total{pool=\"main\",endpoint=\"main/0\",reason=\"prefix\"} 2",
            "agentgate_session_pin_moves_total{pool=\"main\",cause=\"unavailable\"} 1",
            "agentgate_discovery_reloads_total{pool=\"main\",result=\"error\"} 1",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing in\n{out}");
        }
    }
}
