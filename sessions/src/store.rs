//! The `Store` trait every backend implements (stored responses and session pins), and
//! `AnyStore`, the enum the gateway holds.

use std::future::Future;
use std::time::Duration;

use serde_json::Value;

use crate::rate::{RateDecision, RateLimit};
use crate::{
    ConversationRecord, FeedRead, History, MemoryStore, PeerState, PinSwap, RedisStore,
    ResponseRecord, SessionPin, StoreError, StoreOptions,
};

/// Stored responses, the conversation histories they form, and session -> endpoint pins.
pub trait Store: Send + Sync + 'static {
    /// Create or overwrite a record (and refresh its TTL).
    fn put(&self, rec: &ResponseRecord) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The record, if it exists and belongs to `team`.
    fn get(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<ResponseRecord>, StoreError>> + Send;

    /// The record's `status` (`queued`, `in_progress`, `completed`, ...), if it exists and
    /// belongs to `team`: what [`Store::get`] would say of it, without reading its items.
    fn status(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<String>, StoreError>> + Send;

    /// All items of the chain ending at `id`, oldest first: for each response from the root to
    /// `id`, its input_items then its output_items; and the id of the oldest response walked
    /// (the chain's root, which names the conversation for session routing). `None` if `id` is
    /// unknown or not the team's.
    ///
    /// One backend round trip however long the chain. The walk stops at the first predecessor
    /// that was deleted or belongs to another team: the history then starts at the response
    /// after it. A predecessor gone without a deletion (expired, evicted, lost with the store)
    /// is [`StoreError::Lost`]: a history without it would be silently cut short. Every
    /// response walked gets its TTL refreshed, so a conversation in use does not lose its
    /// beginning.
    fn history(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<History>, StoreError>> + Send;

    /// Replace `response` and `output_items` only if the stored `response.status` is still
    /// "queued" or "in_progress" (atomic compare-and-set; used by background runs and cancel).
    /// Returns whether it applied; `false` also when `id` is unknown or not the team's.
    fn update_if_active(
        &self,
        team: &str,
        id: &str,
        response: &Value,
        output_items: &[Value],
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Delete (with its event log); returns whether it existed (for this team).
    fn delete(&self, team: &str, id: &str)
        -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Append streamed events (SSE frames, in sequence order) to the event log of response
    /// `id`, which lives as long as the response while it runs (the TTL is refreshed), and
    /// [`StoreOptions::ended_log_ttl`](crate::StoreOptions::ended_log_ttl) once it has ended
    /// (appended to, or updated by [`Store::update_if_active`], as ended). Background responses
    /// log theirs, so `GET /v1/responses/{id}?stream=true` can replay and follow them from any
    /// gateway replica. One round trip; the caller has checked the response is its team's.
    /// Returns whether the response is still queued or in progress: `false` when it was
    /// cancelled or has ended (or is gone, and nothing was appended), which tells a run still
    /// logging, on any gateway replica, to stop.
    fn append_events(
        &self,
        id: &str,
        events: &[String],
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The logged events of response `id` from position `from` (an event's position is its
    /// `sequence_number`) to the end; empty when there are none. One round trip; the caller has
    /// checked the response is its team's.
    fn events(
        &self,
        id: &str,
        from: usize,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// Create a conversation with its first items (replacing one with the same id). One round
    /// trip.
    fn create_conversation(
        &self,
        conversation: &ConversationRecord,
        items: &[Value],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The conversation, if it exists and belongs to `team` (refreshing its TTL). One round
    /// trip.
    fn get_conversation(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<ConversationRecord>, StoreError>> + Send;

    /// Replace the conversation's metadata; the updated record, `None` if it is not the team's.
    /// One round trip.
    fn set_conversation_metadata(
        &self,
        team: &str,
        id: &str,
        metadata: &Value,
    ) -> impl Future<Output = Result<Option<ConversationRecord>, StoreError>> + Send;

    /// Delete the conversation and its items; whether it existed (for this team). One round
    /// trip.
    fn delete_conversation(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Every item of the conversation, oldest first (refreshing its TTL); `None` if it is not
    /// the team's. One round trip.
    fn conversation_items(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<Vec<Value>>, StoreError>> + Send;

    /// How many items the conversation holds; `None` if it is not the team's. One round trip.
    fn conversation_len(
        &self,
        team: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<usize>, StoreError>> + Send;

    /// Append items (each with an `id`) at the end; false if the conversation is not the
    /// team's. `response` names the response whose items these are (empty for none): a second
    /// append for the same response adds nothing, so a retried write whose first try landed
    /// does not duplicate them. One round trip.
    fn append_conversation_items(
        &self,
        team: &str,
        id: &str,
        response: &str,
        items: &[Value],
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Remove the item with `item_id`: `None` if the conversation is not the team's, else
    /// whether the item was there. One round trip.
    fn delete_conversation_item(
        &self,
        team: &str,
        id: &str,
        item_id: &str,
    ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send;

    /// Hold conversation `id`'s lock (the team's) for `owner`, for `ttl`: taken when free or
    /// expired (unless `renew_only`), renewed when `owner` holds it already; false while
    /// another owner holds it (or, `renew_only`, when `owner` does not). A turn running in a
    /// conversation holds it from reading the items to appending its own, so two turns never
    /// build on the same snapshot; it renews with `renew_only`, so a lock released for it
    /// (its response cancelled) or expired is not taken again. One round trip.
    fn lock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
        ttl: Duration,
        renew_only: bool,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Release conversation `id`'s lock if `owner` holds it (else nothing). One round trip.
    fn unlock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Hold (take or renew) the lease of background response `id`'s run for `ttl`. The gateway
    /// running a background response holds it from before the response is stored until the
    /// run ends, renewing it while the run lasts; a response still `queued` or `in_progress`
    /// whose lease is gone lost its run with its gateway. One round trip.
    fn hold_run(
        &self,
        id: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Whether background response `id`'s run lease is held: `None` when no lease was ever
    /// taken for it (a gateway from before leases runs it, or none does yet), so that only a
    /// lease that lapsed counts as a lost run. One round trip.
    fn run_held(&self, id: &str) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send;

    /// Give up background response `id`'s run lease (its run ended). One round trip.
    fn end_run(&self, id: &str) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The pin of `session` in `pool`, if one is in force, its TTL refreshed: a pin is read for
    /// each turn of its session, so it lasts `pin_ttl` after the session's last turn. One
    /// round trip.
    fn get_pin(
        &self,
        pool: &str,
        session: &str,
    ) -> impl Future<Output = Result<Option<SessionPin>, StoreError>> + Send;

    /// Set the pin only if the current pin equals `expected` (None = no pin yet); returns the
    /// pin now in force (the new one if it applied, else the one another gateway set first)
    /// and whether this call set it. Refreshes the TTL. One round trip.
    ///
    /// A pin that expired since the caller read it constrains nothing: when no pin is in force
    /// `new` applies whatever `expected` says. Two swaps racing from the same `expected` still
    /// have exactly one winner, and both return it.
    fn swap_pin(
        &self,
        pool: &str,
        session: &str,
        expected: Option<&SessionPin>,
        new: &SessionPin,
    ) -> impl Future<Output = Result<PinSwap, StoreError>> + Send;

    /// Refresh a pin's TTL (one round trip; called at most once per turn). No effect if the
    /// session has no pin.
    fn touch_pin(
        &self,
        pool: &str,
        session: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Check and charge rate limits, all-or-nothing (see [`crate::rate`]): one decision per
    /// limit, in order; nothing is charged unless every decision allows. One round trip.
    fn rate_limit(
        &self,
        limits: &[RateLimit],
    ) -> impl Future<Output = Result<Vec<RateDecision>, StoreError>> + Send;

    /// Charge every limit its cost whatever its budget (see [`crate::rate::charged_tat`]):
    /// usage found out after admission, which may take a budget into debt. One round trip.
    fn rate_charge(
        &self,
        limits: &[RateLimit],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Give back every limit's cost, charged earlier by [`Store::rate_limit`] for a request
    /// refused after it was charged (see [`crate::rate::refunded_tat`]); a budget never
    /// grows past full. One round trip.
    fn rate_refund(
        &self,
        limits: &[RateLimit],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Publish `state`, gateway `gateway`'s view of `pool`, on the pool's exchange board and
    /// return the other gateways' states published within `fresh` (see [`crate::exchange`]),
    /// each with its age. Older states are not returned (and are deleted once
    /// [`crate::exchange::FORGET_AFTER`] old). One round trip.
    fn exchange(
        &self,
        pool: &str,
        gateway: &str,
        state: &str,
        fresh: Duration,
    ) -> impl Future<Output = Result<Vec<PeerState>, StoreError>> + Send;

    /// Append `entries`, written by gateway `gateway`, to `pool`'s feed, and read the other
    /// gateways' entries past `cursor`, at most [`crate::exchange::FEED_READ_MAX`] (see
    /// [`crate::exchange`]'s "The feed"; `None`: from the oldest kept). A gateway id holds
    /// no space. One round trip.
    fn feed(
        &self,
        pool: &str,
        gateway: &str,
        entries: &[String],
        cursor: Option<u64>,
    ) -> impl Future<Output = Result<FeedRead, StoreError>> + Send;

    /// Round trips to the backend made so far (Redis commands/scripts sent; 0 for memory).
    fn round_trips(&self) -> u64;
}

/// Enum dispatch so the gateway can hold one concrete type.
pub enum AnyStore {
    /// In-process store (one gateway replica, or the gateways of one process it is shared by).
    Memory(MemoryStore),
    /// Redis store shared by all gateway replicas.
    Redis(RedisStore),
}

impl AnyStore {
    /// Open a Redis store when `url` is given (`redis://host:port/db`), an in-memory store otherwise.
    pub async fn open(url: Option<&str>, opts: StoreOptions) -> Result<AnyStore, StoreError> {
        match url {
            Some(url) => Ok(AnyStore::Redis(RedisStore::connect(url, opts).await?)),
            None => Ok(AnyStore::Memory(MemoryStore::new(opts))),
        }
    }

    /// A new in-memory store to hand (behind one `Arc`) to several gateways of this process
    /// ([`MemoryStore::shared_in_process`]).
    pub fn shared_in_process(opts: StoreOptions) -> AnyStore {
        AnyStore::Memory(MemoryStore::new(opts).shared_in_process())
    }

    /// Whether other gateways can share this store: Redis always; the in-memory store only
    /// when it was made for several gateways of one process
    /// ([`MemoryStore::shared_in_process`]).
    pub fn is_shared(&self) -> bool {
        match self {
            AnyStore::Memory(memory) => memory.is_shared_in_process(),
            AnyStore::Redis(_) => true,
        }
    }

    /// Short backend name for logs and metrics: "memory" or "redis".
    pub fn backend_name(&self) -> &'static str {
        match self {
            AnyStore::Memory(_) => "memory",
            AnyStore::Redis(_) => "redis",
        }
    }
}

impl Store for AnyStore {
    async fn put(&self, rec: &ResponseRecord) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.put(rec).await,
            AnyStore::Redis(s) => s.put(rec).await,
        }
    }

    async fn get(&self, team: &str, id: &str) -> Result<Option<ResponseRecord>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.get(team, id).await,
            AnyStore::Redis(s) => s.get(team, id).await,
        }
    }

    async fn status(&self, team: &str, id: &str) -> Result<Option<String>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.status(team, id).await,
            AnyStore::Redis(s) => s.status(team, id).await,
        }
    }

    async fn history(&self, team: &str, id: &str) -> Result<Option<History>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.history(team, id).await,
            AnyStore::Redis(s) => s.history(team, id).await,
        }
    }

    async fn update_if_active(
        &self,
        team: &str,
        id: &str,
        response: &Value,
        output_items: &[Value],
    ) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => s.update_if_active(team, id, response, output_items).await,
            AnyStore::Redis(s) => s.update_if_active(team, id, response, output_items).await,
        }
    }

    async fn delete(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => s.delete(team, id).await,
            AnyStore::Redis(s) => s.delete(team, id).await,
        }
    }

    async fn append_events(&self, id: &str, events: &[String]) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => s.append_events(id, events).await,
            AnyStore::Redis(s) => s.append_events(id, events).await,
        }
    }

    async fn events(&self, id: &str, from: usize) -> Result<Vec<String>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.events(id, from).await,
            AnyStore::Redis(s) => s.events(id, from).await,
        }
    }

    async fn create_conversation(
        &self,
        conversation: &ConversationRecord,
        items: &[Value],
    ) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.create_conversation(conversation, items).await,
            AnyStore::Redis(s) => s.create_conversation(conversation, items).await,
        }
    }

    async fn get_conversation(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<ConversationRecord>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.get_conversation(team, id).await,
            AnyStore::Redis(s) => s.get_conversation(team, id).await,
        }
    }

    async fn set_conversation_metadata(
        &self,
        team: &str,
        id: &str,
        metadata: &Value,
    ) -> Result<Option<ConversationRecord>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.set_conversation_metadata(team, id, metadata).await,
            AnyStore::Redis(s) => s.set_conversation_metadata(team, id, metadata).await,
        }
    }

    async fn delete_conversation(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => s.delete_conversation(team, id).await,
            AnyStore::Redis(s) => s.delete_conversation(team, id).await,
        }
    }

    async fn conversation_items(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<Vec<Value>>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.conversation_items(team, id).await,
            AnyStore::Redis(s) => s.conversation_items(team, id).await,
        }
    }

    async fn conversation_len(&self, team: &str, id: &str) -> Result<Option<usize>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.conversation_len(team, id).await,
            AnyStore::Redis(s) => s.conversation_len(team, id).await,
        }
    }

    async fn append_conversation_items(
        &self,
        team: &str,
        id: &str,
        response: &str,
        items: &[Value],
    ) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => s.append_conversation_items(team, id, response, items).await,
            AnyStore::Redis(s) => s.append_conversation_items(team, id, response, items).await,
        }
    }

    async fn delete_conversation_item(
        &self,
        team: &str,
        id: &str,
        item_id: &str,
    ) -> Result<Option<bool>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.delete_conversation_item(team, id, item_id).await,
            AnyStore::Redis(s) => s.delete_conversation_item(team, id, item_id).await,
        }
    }

    async fn lock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
        ttl: Duration,
        renew_only: bool,
    ) -> Result<bool, StoreError> {
        match self {
            AnyStore::Memory(s) => s.lock_conversation(team, id, owner, ttl, renew_only).await,
            AnyStore::Redis(s) => s.lock_conversation(team, id, owner, ttl, renew_only).await,
        }
    }

    async fn unlock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.unlock_conversation(team, id, owner).await,
            AnyStore::Redis(s) => s.unlock_conversation(team, id, owner).await,
        }
    }

    async fn hold_run(&self, id: &str, ttl: Duration) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.hold_run(id, ttl).await,
            AnyStore::Redis(s) => s.hold_run(id, ttl).await,
        }
    }

    async fn run_held(&self, id: &str) -> Result<Option<bool>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.run_held(id).await,
            AnyStore::Redis(s) => s.run_held(id).await,
        }
    }

    async fn end_run(&self, id: &str) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.end_run(id).await,
            AnyStore::Redis(s) => s.end_run(id).await,
        }
    }

    async fn get_pin(&self, pool: &str, session: &str) -> Result<Option<SessionPin>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.get_pin(pool, session).await,
            AnyStore::Redis(s) => s.get_pin(pool, session).await,
        }
    }

    async fn swap_pin(
        &self,
        pool: &str,
        session: &str,
        expected: Option<&SessionPin>,
        new: &SessionPin,
    ) -> Result<PinSwap, StoreError> {
        match self {
            AnyStore::Memory(s) => s.swap_pin(pool, session, expected, new).await,
            AnyStore::Redis(s) => s.swap_pin(pool, session, expected, new).await,
        }
    }

    async fn touch_pin(&self, pool: &str, session: &str) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.touch_pin(pool, session).await,
            AnyStore::Redis(s) => s.touch_pin(pool, session).await,
        }
    }

    async fn rate_limit(&self, limits: &[RateLimit]) -> Result<Vec<RateDecision>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.rate_limit(limits).await,
            AnyStore::Redis(s) => s.rate_limit(limits).await,
        }
    }

    async fn rate_charge(&self, limits: &[RateLimit]) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.rate_charge(limits).await,
            AnyStore::Redis(s) => s.rate_charge(limits).await,
        }
    }

    async fn rate_refund(&self, limits: &[RateLimit]) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.rate_refund(limits).await,
            AnyStore::Redis(s) => s.rate_refund(limits).await,
        }
    }

    async fn exchange(
        &self,
        pool: &str,
        gateway: &str,
        state: &str,
        fresh: Duration,
    ) -> Result<Vec<PeerState>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.exchange(pool, gateway, state, fresh).await,
            AnyStore::Redis(s) => s.exchange(pool, gateway, state, fresh).await,
        }
    }

    async fn feed(
        &self,
        pool: &str,
        gateway: &str,
        entries: &[String],
        cursor: Option<u64>,
    ) -> Result<FeedRead, StoreError> {
        match self {
            AnyStore::Memory(s) => s.feed(pool, gateway, entries, cursor).await,
            AnyStore::Redis(s) => s.feed(pool, gateway, entries, cursor).await,
        }
    }

    fn round_trips(&self) -> u64 {
        match self {
            AnyStore::Memory(s) => s.round_trips(),
            AnyStore::Redis(s) => s.round_trips(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::suite;

    #[tokio::test]
    async fn open_without_url_is_a_memory_store_that_passes_the_suite() {
        let store = AnyStore::open(None, StoreOptions::default()).await.unwrap();
        assert_eq!(store.backend_name(), "memory");
        suite(&store).await;
        assert_eq!(store.round_trips(), 0);
    }
}
