//! Small handlers: models and health.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::Json;
use serde_json::{json, Value};

use agentgate_sessions::Store;

use crate::app::AppState;
use crate::error::HttpError;

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "agentgate"})
}

/// `GET /v1/models`: every model name (and alias) the pools serve.
pub async fn list_models(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, HttpError> {
    state.keys.authenticate(&headers)?;
    let data: Vec<Value> = state
        .pools
        .model_names()
        .iter()
        .map(|m| model_object(m))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `GET /v1/models/{model}`.
pub async fn get_model(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(model): Path<String>,
) -> Result<Json<Value>, HttpError> {
    state.keys.authenticate(&headers)?;
    if state.pools.for_model(&model).is_some() {
        Ok(Json(model_object(&model)))
    } else {
        Err(HttpError::new(
            404,
            "invalid_request_error",
            format!("The model '{model}' does not exist or you do not have access to it."),
            Some("model"),
            Some("model_not_found"),
        ))
    }
}

/// `GET /health/live`: the process is up.
pub async fn live() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /health/ready`: the store answers and some pool has an available endpoint. A pool
/// without any (its endpoints file emptied, every replica failing its probe) is named in
/// `pools_without_endpoints` but does not take the replica out of service: its requests
/// get 503 `upstream_unavailable` while every other model is still served.
pub async fn ready(State(state): State<Arc<AppState>>) -> Result<Json<Value>, HttpError> {
    state
        .store
        .get("", "resp_health_probe")
        .await
        .map_err(|e| {
            HttpError::server(503, format!("store unavailable: {e}"), "store_unavailable")
                .with_retry_after(1)
        })?;
    let pools = state.pools.all();
    let empty: Vec<&str> = pools
        .iter()
        .filter(|p| !p.endpoints().iter().any(|e| e.is_available()))
        .map(|p| p.name.as_str())
        .collect();
    if empty.len() == pools.len() {
        return Err(HttpError::server(
            503,
            format!("no pool has an available endpoint ({})", empty.join(", ")),
            "no_endpoints",
        )
        .with_retry_after(1));
    }
    Ok(Json(
        json!({"status": "ready", "pools_without_endpoints": empty}),
    ))
}
