//! The gateway's own counters (rendered at `GET /metrics` once the endpoint exists).

use std::collections::HashMap;
use std::sync::Mutex;

/// Routing counters.
#[derive(Debug, Default)]
pub struct Metrics {
    decisions: Mutex<HashMap<(String, String, String), u64>>,
    moves: Mutex<HashMap<(String, String), u64>>,
}

impl Metrics {
    /// A routing decision for `endpoint` of `pool`, decided by `reason`.
    pub fn routing_decision(&self, pool: &str, endpoint: &str, reason: &str) {
        if let Ok(mut m) = self.decisions.lock() {
            *m.entry((pool.into(), endpoint.into(), reason.into()))
                .or_default() += 1;
        }
    }

    /// A session pin of `pool` moved because of `cause`.
    pub fn pin_moved(&self, pool: &str, cause: &str) {
        if let Ok(mut m) = self.moves.lock() {
            *m.entry((pool.into(), cause.into())).or_default() += 1;
        }
    }
}
