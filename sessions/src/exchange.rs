//! The exchange board: where the gateways in front of one pool tell each other, a few times a
//! second, what they hold (the gateway's own side of it is `agentgate::exchange`).
//!
//! Each gateway publishes one opaque state per pool under its own id and reads back the
//! others' ([`crate::Store::exchange`], one round trip). The store stamps each state when it
//! is written and returns the others' with their age, measured on the store's clock alone
//! (Redis `TIME`, or the memory store's monotonic clock), so the gateways' clocks need not
//! agree. A state older than the caller's `fresh` is not returned, so a gateway that stops
//! publishing drops out of the others' view within that time; one [`FORGET_AFTER`] old is
//! deleted.
//!
//! Redis keeps a pool's board in one hash, `{prefix}board:{pool}` (pool encoded as in
//! [`crate::pins::pin_key`]), field = gateway id, value = `"<ms> <state>"`; the hash expires
//! [`FORGET_AFTER`] after the last write, so a pool nobody serves leaves nothing behind.

use std::time::Duration;

/// Age at which a state leaves the board (its gateway is gone): ten minutes, the longest
/// `fresh` a gateway asks for (ten intervals, and `[flow] exchange_interval_ms` is at most a
/// minute). `exchange.lua` keeps the same figure.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Another gateway's published state, as read from the board.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerState {
    /// How long before the read the state was published.
    pub age: Duration,
    /// The state, as that gateway published it.
    pub state: String,
}

/// The store key of `pool`'s board.
pub fn board_key(prefix: &str, pool: &str) -> String {
    format!("{prefix}board:{}", crate::pins::encode_key_part(pool))
}
