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
//!
//! # The feed
//!
//! A state replaces the last one, so it suits what a gateway *holds*; what it *did* (the
//! routing decisions the others' prefix indexes learn from) must reach every other gateway
//! once, whether or not it reads between two writes. For that each pool also has a feed
//! ([`crate::Store::feed`]): an append-only list of entries, each numbered when it is
//! appended (1, 2, 3, ... per pool), of which the store keeps the last [`FEED_LEN`]. A reader
//! keeps a cursor, the number of the last entry it has read, and each call appends its own
//! entries and reads the next [`FEED_READ_MAX`] past its cursor (the others' are returned,
//! its own passed over) with the new cursor, in one round trip:
//!
//! - a first call (no cursor) reads from the oldest entry kept, so a gateway that starts
//!   learns the last few seconds of the others' routing;
//! - entries trimmed before the reader came back for them are counted as `skipped`;
//! - a cursor past the feed's end (the feed expired and was started again) reads from the
//!   oldest entry kept, as a first call does;
//! - a reader behind by more than [`FEED_READ_MAX`] entries catches up over the next calls,
//!   so no reply carries more than that many entries.
//!
//! Redis keeps it in a list, `{prefix}feed:{pool}`, of `"<number> <gateway> <entry>"`, and
//! the last number in `{prefix}feed-seq:{pool}`; both expire [`FORGET_AFTER`] after the last
//! append.

use std::time::Duration;

/// Age at which a state leaves the board (its gateway is gone): ten minutes, the longest
/// `fresh` a gateway asks for (ten intervals, and `[flow] exchange_interval_ms` is at most a
/// minute). `exchange.lua` keeps the same figure.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Entries a pool's feed keeps: at ten appends a second per gateway (the default exchange
/// interval), three seconds of two gateways' routing (under a second of eight's), so a reader
/// late by a few intervals misses nothing, while a pool's feed stays within tens of megabytes
/// however much its gateways route (the gateway bounds an entry; `agentgate::route_feed`).
/// The memory store keeps a pool's feed for the process's lifetime (bounded the same way);
/// Redis lets it expire.
pub const FEED_LEN: usize = 64;

/// Most entries one read goes through: a reader that fell behind catches up over several
/// calls instead of taking the whole feed (tens of megabytes) in one reply.
pub const FEED_READ_MAX: usize = 16;

/// What one call to [`crate::Store::feed`] read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedRead {
    /// The other gateways' entries past the cursor, oldest first: (gateway id, entry).
    pub entries: Vec<(String, String)>,
    /// The number of the last entry this read went through: the cursor for the next call.
    pub cursor: u64,
    /// Entries past the cursor that were trimmed before this read (any gateway's).
    pub skipped: u64,
}

/// The store key of `pool`'s feed (a list).
pub fn feed_key(prefix: &str, pool: &str) -> String {
    format!("{prefix}feed:{}", crate::pins::encode_key_part(pool))
}

/// The store key of the number of `pool`'s last feed entry.
pub fn feed_seq_key(prefix: &str, pool: &str) -> String {
    format!("{prefix}feed-seq:{}", crate::pins::encode_key_part(pool))
}

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
