//! The route feed: each gateway tells the others where it sent which prompt, so every
//! gateway's prefix index knows what every engine was given, not only what it gave them.
//!
//! # Why
//!
//! A pool's prefix index (`agentgate_scheduler::prefix_index`) is each gateway's model of
//! what the engines' KV caches hold, learnt from its own routing decisions. Behind a load
//! balancer that spreads requests over several gateways, each sees only its share: a prompt
//! that gateway A placed on engine E is unknown to gateway B, which places the next prompt
//! sharing that prefix by load, and the prefix is computed again elsewhere. On the Mooncake
//! conversation trace (no session keys, so every placement is the index's), `prefix` routing
//! split over two gateways captured 0.73 of the pooled oracle's reuse against 0.98 for one
//! gateway (means of seeds 1 to 5; 0.98 with the feed too); sessions lost less (their pins are in
//! the store), but their first turns and the index's view of each engine's occupancy suffered
//! the same way.
//!
//! # What
//!
//! Each routing decision the pool's picker learns from ([`Pool::routed`]) is also put in the
//! pool's outbox: the engine's URL (which every gateway agrees on) and the prompt's chained
//! chunk hashes, at most as many as the engine's cache holds. Every `[flow]
//! exchange_interval_ms`, next to the exchange board, the gateway appends its outbox to the
//! pool's feed in the store as one entry and reads the others' entries since its last read
//! ([`Store::feed`], one round trip), and records each of their routes in its own index as if
//! it had made it. An entry is text: one route per line, `<url> <hash><hash>...`, each hash
//! 16 hex digits: a route costs 16 bytes per chunk of the prompt (64 tokens at the defaults),
//! 50 KB for a prompt of 200,000 tokens, written once and read by each other gateway.
//!
//! Bounds: an outbox holds at most [`OUTBOX_HASHES`] hashes per interval (a route past that
//! is dropped and counted); the store keeps the feed's last `FEED_LEN` entries and a read
//! takes at most `FEED_READ_MAX` (a gateway behind catches up over the next rounds), and a
//! gateway that stalls long enough to miss some counts them and goes on
//! (`agentgate_sessions::exchange`). A gateway that starts reads what the feed keeps.
//! A miss only costs precision: the index's corrections from the engines' cached-token
//! reports, and the next routing decision, repair it.
//!
//! It runs whenever the exchange does (another gateway can read the store and the interval
//! is not 0), for pools whose policy keeps a prefix index (`prefix`, `session`). Metrics:
//! `agentgate_prefix_routes_shared_total{pool,direction}` (`sent`, `received`, `dropped`) and
//! `agentgate_prefix_feed_skipped_total{pool}` (entries missed).

use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};

use agentgate_sessions::Store;

use crate::app::AppState;
use crate::pools::{Endpoint, Pool};

/// Most chunk hashes an outbox holds per interval: 32,768 chunks, about two million prompt
/// tokens at the default 64 tokens per chunk (an entry of half a megabyte of hashes, plus a
/// line per route).
pub const OUTBOX_HASHES: usize = 32 * 1024;

/// Routing decisions of one pool waiting to go on its feed (kept once the exchange starts,
/// [`Outbox::enable`]).
#[derive(Debug, Default)]
pub struct Outbox {
    inner: Mutex<OutboxState>,
}

#[derive(Debug, Default)]
struct OutboxState {
    /// Set when the exchange starts: until then, and without an exchange, nothing is kept.
    on: bool,
    routes: Vec<(String, Vec<u64>)>,
    hashes: usize,
    dropped: u64,
}

impl Outbox {
    /// Keep the route of a prompt with chunk hashes `prefix` to `endpoint`, when the feed runs.
    pub fn push(&self, endpoint: &Endpoint, prefix: &[u64]) {
        let mut state = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if !state.on || prefix.is_empty() {
            return;
        }
        if state.hashes + prefix.len() > OUTBOX_HASHES {
            state.dropped += 1;
            return;
        }
        state.hashes += prefix.len();
        state
            .routes
            .push((endpoint.base_url.clone(), prefix.to_vec()));
    }

    /// Keep routes from now on (the feed runs).
    pub fn enable(&self) {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).on = true;
    }

    /// The routes kept since the last call and how many were dropped.
    fn take(&self) -> (Vec<(String, Vec<u64>)>, u64) {
        let mut state = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        state.hashes = 0;
        (
            std::mem::take(&mut state.routes),
            std::mem::take(&mut state.dropped),
        )
    }
}

/// One feed entry: a line per route.
fn encode(routes: &[(String, Vec<u64>)]) -> String {
    let size: usize = routes.iter().map(|(u, h)| u.len() + 2 + 16 * h.len()).sum();
    let mut out = String::with_capacity(size);
    for (url, hashes) in routes {
        out.push_str(url);
        out.push(' ');
        for h in hashes {
            let _ = write!(out, "{h:016x}");
        }
        out.push('\n');
    }
    out
}

/// The routes of an entry; lines that do not parse are skipped.
fn decode(entry: &str) -> impl Iterator<Item = (&str, Vec<u64>)> {
    entry.lines().filter_map(|line| {
        let (url, hex) = line.split_once(' ')?;
        if hex.len() % 16 != 0 || !hex.is_ascii() {
            return None;
        }
        let hashes = (0..hex.len())
            .step_by(16)
            .map(|at| u64::from_str_radix(&hex[at..at + 16], 16).ok())
            .collect::<Option<Vec<u64>>>()?;
        Some((url, hashes))
    })
}

/// One round for `pool`: send this gateway's routes, record the others'. `cursor` is this
/// gateway's position in the pool's feed (None before the first round).
pub async fn share(
    state: &AppState,
    pool: &Pool,
    gateway: &str,
    cursor: &mut Option<u64>,
) -> Result<(), String> {
    if pool.picker.prefix_index().is_none() {
        return Ok(());
    }
    let (routes, dropped) = pool.routes.take();
    let metrics = &state.metrics;
    metrics
        .prefix_routes_shared
        .inc_by([&pool.name, "dropped"], dropped);
    let entries: Vec<String> = if routes.is_empty() {
        Vec::new()
    } else {
        vec![encode(&routes)]
    };
    let sent = routes.len() as u64;
    let read = match state
        .store
        .feed(&pool.name, gateway, &entries, *cursor)
        .await
    {
        Ok(read) => read,
        Err(e) => {
            metrics
                .prefix_routes_shared
                .inc_by([&pool.name, "dropped"], sent);
            return Err(e.to_string());
        }
    };
    metrics
        .prefix_routes_shared
        .inc_by([&pool.name, "sent"], sent);
    metrics
        .prefix_feed_skipped
        .inc_by([&pool.name], read.skipped);
    *cursor = Some(read.cursor);
    let mut received = 0;
    for (_, entry) in &read.entries {
        for (url, hashes) in decode(entry) {
            received += u64::from(pool.learn_route(url, &hashes));
        }
    }
    metrics
        .prefix_routes_shared
        .inc_by([&pool.name, "received"], received);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_reads_back_as_its_routes_and_bad_lines_are_skipped() {
        let routes = vec![
            ("http://10.0.0.1:8000".to_string(), vec![0, u64::MAX, 42]),
            ("http://[::1]:8001".to_string(), vec![7]),
        ];
        let text = encode(&routes);
        assert_eq!(
            text.lines().nth(1),
            Some("http://[::1]:8001 0000000000000007")
        );
        let mangled = format!(
            "{text}no-hashes\nhttp://x 123\nhttp://y {}\n",
            "g".repeat(16)
        );
        let back: Vec<(String, Vec<u64>)> =
            decode(&mangled).map(|(u, h)| (u.to_string(), h)).collect();
        assert_eq!(back, routes);
    }

    #[test]
    fn an_outbox_keeps_routes_once_the_feed_runs_up_to_its_bound() {
        let endpoint = Endpoint::new("e", "http://e:1");
        let outbox = Outbox::default();
        outbox.push(&endpoint, &[1, 2]);
        assert_eq!(
            outbox.take(),
            (Vec::new(), 0),
            "nothing before the feed runs"
        );
        outbox.enable();
        outbox.push(&endpoint, &[1, 2]);
        outbox.push(&endpoint, &[]);
        outbox.push(&endpoint, &vec![3; OUTBOX_HASHES]);
        let (routes, dropped) = outbox.take();
        assert_eq!(routes, [("http://e:1".to_string(), vec![1, 2])]);
        assert_eq!(dropped, 1);
        outbox.push(&endpoint, &vec![3; OUTBOX_HASHES]);
        assert_eq!(outbox.take().0.len(), 1, "the bound is per interval");
    }
}
