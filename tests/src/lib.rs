//! Shared helpers for agentgate's end-to-end tests: start simulated engines, gateways on a real
//! Redis, and read Responses SSE streams.

use std::net::SocketAddr;

use futures_util::StreamExt;
use serde_json::Value;

pub use agentgate_sessions::testing::{unique_prefix, TestRedis};

/// Start one simulated vLLM replica with no simulated delays.
pub async fn start_sim(model: &str) -> agentgate_sim::SimHandle {
    start_sim_with(model, 0.0).await
}

/// Start one simulated vLLM replica with the given time scale.
pub async fn start_sim_with(model: &str, time_scale: f64) -> agentgate_sim::SimHandle {
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
pub async fn start_gateway(toml: &str) -> agentgate::Gateway {
    let config = agentgate::Config::parse(toml).expect("valid test config");
    agentgate::Gateway::start(config, SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("gateway starts")
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
