//! Prefill/decode disaggregation between simulated replicas.
//!
//! **vLLM flavor (NIXL connector protocol).** A request with `kv_transfer_params.do_remote_decode
//! = true` runs as prefill only: its full prompt blocks stay pinned and the response carries
//! `kv_transfer_params {do_remote_prefill: true, do_remote_decode: false, remote_engine_id,
//! remote_block_ids, remote_host, remote_port, tp_size}`, where `remote_host:remote_port` is this
//! sim's HTTP address. A request carrying those params "pulls" the blocks with
//! `POST http://remote_host:remote_port/sim/kv/pull {"block_ids": [...]}`, which unpins them and
//! returns their hashes; after a delay of `blocks * block_size * kv_bytes_per_token /
//! kv_transfer_gbps` (scaled by `--time-scale`) they count as cached and decoding starts.
//!
//! **SGLang flavor (bootstrap protocol).** Both legs get the same body with `bootstrap_host`,
//! `bootstrap_port` and `bootstrap_room`. A `--role prefill` replica runs prefill and pins the
//! blocks under the room; a `--role decode` replica long-polls
//! `GET http://bootstrap_host:bootstrap_port/sim/bootstrap/{room}` until the prefill leg is done.
//! Convention: the bootstrap port is the prefill sim's HTTP port, or `--bootstrap-port`, on which
//! the prefill sim serves the same routes.
//!
//! Either way, if the transfer cannot complete (prefill replica unreachable, blocks unknown or
//! expired after `--kv-transfer-timeout-s`, or different blocks than the decode prompt), the decode
//! request fails with HTTP 500 in the engine's error shape; a streamed SGLang decode request,
//! whose headers go out at once (as SGLang's HTTP server sends them before the request is
//! scheduled), gets that error as an `{"error": {...}}` event, then `[DONE]`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use serde_json::Value;
use tokio::sync::watch;

/// State of one bootstrap room on the prefill replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomStatus {
    /// The prefill leg has not finished yet.
    Pending,
    /// Blocks are pinned and ready to fetch.
    Ready,
    /// The prefill leg failed.
    Failed,
}

/// Bootstrap rooms known to a prefill replica.
#[derive(Debug, Default)]
pub struct Rooms {
    rooms: Mutex<HashMap<u64, (Instant, watch::Sender<RoomStatus>)>>,
}

impl Rooms {
    /// Watch a room's status, creating it as pending if unknown.
    pub fn subscribe(&self, room: u64) -> watch::Receiver<RoomStatus> {
        let Ok(mut rooms) = self.rooms.lock() else {
            return watch::channel(RoomStatus::Failed).1;
        };
        if rooms.len() > 10_000 {
            let cutoff = Instant::now() - Duration::from_secs(600);
            rooms.retain(|_, (created, _)| *created > cutoff);
        }
        rooms
            .entry(room)
            .or_insert_with(|| (Instant::now(), watch::channel(RoomStatus::Pending).0))
            .1
            .subscribe()
    }

    /// Set a room's status.
    pub fn mark(&self, room: u64, status: RoomStatus) {
        let receiver = self.subscribe(room);
        drop(receiver);
        if let Ok(rooms) = self.rooms.lock() {
            if let Some((_, sender)) = rooms.get(&room) {
                sender.send_replace(status);
            }
        }
    }

    /// Forget a room.
    pub fn remove(&self, room: u64) {
        if let Ok(mut rooms) = self.rooms.lock() {
            rooms.remove(&room);
        }
    }
}

/// Simulated wall-clock delay of moving `blocks` KV blocks between replicas.
pub fn transfer_delay(
    blocks: usize,
    block_size: usize,
    bytes_per_token: u64,
    gbps: f64,
    time_scale: f64,
) -> Duration {
    if time_scale <= 0.0 || gbps <= 0.0 {
        return Duration::ZERO;
    }
    let bytes = blocks as f64 * block_size as f64 * bytes_per_token as f64;
    Duration::from_secs_f64((bytes / (gbps * 1e9) * time_scale).min(3600.0))
}

/// Fetch pinned blocks from a vLLM-flavor prefill sim; returns their hashes.
pub async fn pull_blocks(
    client: &reqwest::Client,
    host: &str,
    port: u16,
    block_ids: &[u32],
) -> Result<Vec<u64>, String> {
    // vLLM reports `remote_host` as a bare IP address: an IPv6 one goes in brackets in a URL.
    let url = match host.contains(':') && !host.starts_with('[') {
        true => format!("http://[{host}]:{port}/sim/kv/pull"),
        false => format!("http://{host}:{port}/sim/kv/pull"),
    };
    let response = client
        .post(&url)
        .json(&serde_json::json!({ "block_ids": block_ids }))
        .send()
        .await
        .map_err(|e| {
            format!("KV transfer from {host}:{port} failed: cannot reach the prefill replica ({e})")
        })?;
    hashes_from(response, host, port).await
}

/// Wait for and fetch the blocks of a bootstrap room from an SGLang-flavor prefill sim.
pub async fn fetch_room(
    client: &reqwest::Client,
    host: &str,
    port: u16,
    room: u64,
    timeout: Duration,
) -> Result<Vec<u64>, String> {
    let url = format!(
        "http://{host}:{port}/sim/bootstrap/{room}?timeout_ms={}",
        timeout.as_millis()
    );
    let response = client
        .get(&url)
        .timeout(timeout + Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| format!("KV transfer for bootstrap room {room} from {host}:{port} failed: cannot reach the prefill replica ({e})"))?;
    hashes_from(response, host, port).await
}

async fn hashes_from(
    response: reqwest::Response,
    host: &str,
    port: u16,
) -> Result<Vec<u64>, String> {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        let reason = body
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("no reason given");
        return Err(format!(
            "KV transfer from {host}:{port} failed with status {status}: {reason}"
        ));
    }
    let hashes = body
        .get("block_hashes")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            format!("KV transfer from {host}:{port} failed: answer has no block_hashes")
        })?;
    Ok(hashes.iter().filter_map(Value::as_u64).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_delay_scales_with_size_and_time_scale() {
        let one = transfer_delay(10, 16, 1000, 1.0, 1.0);
        let two = transfer_delay(20, 16, 1000, 1.0, 1.0);
        assert_eq!(two, one * 2);
        assert_eq!(transfer_delay(10, 16, 1000, 1.0, 0.0), Duration::ZERO);
    }

    #[tokio::test]
    async fn room_waiters_see_the_prefill_finish() {
        let rooms = Rooms::default();
        let mut waiter = rooms.subscribe(5);
        assert_eq!(*waiter.borrow(), RoomStatus::Pending);
        rooms.mark(5, RoomStatus::Ready);
        let status = waiter
            .wait_for(|s| *s != RoomStatus::Pending)
            .await
            .map(|s| *s);
        assert_eq!(status.ok(), Some(RoomStatus::Ready));
    }
}
