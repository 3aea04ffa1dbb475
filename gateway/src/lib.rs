//! agentgate: an OpenAI Responses API gateway in front of vLLM / SGLang engine fleets.
//!
//! This crate owns the HTTP surface and the wiring:
//!
//! - [`config`]: the TOML configuration and its validation;
//! - [`auth`]: API key -> team;
//! - [`flow`]: flow control before routing: one `FlowController` per pool (priority bands,
//!   fair queuing across teams, turn-first order, shedding, rate limits kept in the store);
//!   [`reload`] applies changes to the config file's `[[bands]]`, `[[teams]]` and `[flow]`;
//! - [`request`]: typed views and validation over raw JSON request bodies;
//! - [`responses`]: the Responses API handlers (create, compact, retrieve and follow a
//!   background response's events, delete, cancel, input items, input tokens); [`turn`] runs
//!   one turn against an engine and persists it (and logs a background response's events),
//!   splitting a long prompt into a prefill leg and a decode leg when the pool has prefill
//!   endpoints; [`conversations`]: the Conversations API, whose items a response created with
//!   `conversation` reads and extends;
//! - [`response_object`]: the Response object skeleton and ids;
//! - [`pools`]: engine pools per model, each routing with the picker its `policy` names
//!   (`agentgate-scheduler`) over the endpoints that are available; the prefix index is sized
//!   from the engines' reported KV capacity;
//! - [`probe`]: live endpoint state, kept by background tasks: health probes take failing
//!   endpoints out and return them, `/metrics` scrapes feed load and saturation, and
//!   [`discovery`] applies a watched endpoints file without dropping in-flight requests;
//! - [`metrics`]: the gateway's own Prometheus metrics (`GET /metrics`);
//! - [`handlers`]: models and health; [`openapi`]: the OpenAPI document of all of the above;
//! - [`app`]: shared state, router and server start/stop.
//!
//! Request path: authenticate -> validate -> load history from the store (one round trip: the
//! `previous_response_id` chain, or the conversation's items) ->
//! identify the session -> translate for the engine flavor (`agentgate-adapters`) -> admit
//! (flow control: band, shedding, rate limits, queue until the pool has room) -> pick an
//! endpoint (session pin from the store, else prefix match and load, per the pool's policy;
//! for P/D pools the decode endpoint first, then a prefill endpoint when the uncached part of
//! the prompt is over the threshold) -> stream chat chunks back as Responses events -> persist the response as a delta
//! (`agentgate-sessions`), and append its items to its conversation.

pub mod app;
pub mod auth;
pub mod config;
pub mod conversations;
pub mod discovery;
pub mod error;
pub mod exchange;
pub mod flow;
pub mod handlers;
pub mod metrics;
pub mod openapi;
pub mod pools;
pub mod probe;
pub mod reload;
pub mod request;
pub mod response_object;
pub mod responses;
pub mod route_feed;
pub mod turn;

pub use app::{AppState, Gateway};
pub use config::Config;
