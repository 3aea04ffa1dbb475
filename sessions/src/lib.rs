//! Conversation state for agentgate: stored responses kept as per-turn deltas chained by
//! `previous_response_id`, loaded back as one item history per turn.
//!
//! Two backends implement [`Store`]: [`MemoryStore`] (one process, default) and [`RedisStore`]
//! (shared by every gateway replica, so any replica can serve any turn). [`AnyStore`] picks one
//! from configuration so the gateway holds a single concrete type.
//!
//! Storage shape: each response stores only its own new input items and its output items plus
//! the id of its predecessor, so a conversation costs storage linear in its length. A history
//! load walks the predecessor pointers (server-side in Redis, one round trip) and stops at the
//! first predecessor that is missing (expired or deleted) or belongs to another team.
//!
//! Modules: [`record`] (what is stored, options), [`store`] (the trait and [`AnyStore`]),
//! [`memory`] and [`redis_store`] (the backends), [`error`], and [`testing`] (a throwaway
//! `redis-server` and the suite every backend passes), and [`pins`] (session -> endpoint pins
//! with their own TTL, kept by the same two backends so every gateway replica routes a session
//! to the same endpoint), and [`rate`] (GCRA rate-limit counters, so every gateway replica
//! enforces one budget). Conversations of the Conversations API ([`ConversationRecord`]) are
//! kept by the same backends: a record and the ordered list of its items, with the same TTL,
//! refreshed on use. The [`exchange`] board lets the gateways in front of one pool share what
//! they hold, a few times a second.

#![warn(missing_docs)]

pub mod error;
pub mod exchange;
pub mod memory;
pub mod pins;
pub mod rate;
pub mod record;
pub mod redis_store;
pub mod store;
pub mod testing;

pub use error::StoreError;
pub use exchange::{FeedRead, PeerState};
pub use memory::MemoryStore;
pub use pins::{PinSwap, SessionPin};
pub use rate::{RateDecision, RateLimit};
pub use record::{ConversationRecord, History, ResponseRecord, StoreOptions};
pub use redis_store::RedisStore;
pub use store::{AnyStore, Store};

/// The longest chain a history load will walk; longer chains are treated as corrupt (a cycle).
pub const MAX_CHAIN_LEN: usize = 100_000;
