//! `MemoryStore`: the in-process backend, for a single gateway replica, for several gateways
//! in one process handed the same store ([`MemoryStore::shared_in_process`]), and for tests.
//!
//! Records and session pins live in mutex-guarded maps with an expiry instant each. Expired
//! entries are invisible at once and are purged in a sweep at most once per sweep interval,
//! piggybacked on writes, so no background task is needed. Pins are keyed like in Redis
//! ([`pin_key`]), so a client's session key costs bounded memory however long it is.
//!
//! **Memory bound.** A TTL alone does not bound memory: thirty days of a busy gateway's
//! conversations do not fit in RAM. Each record's size is estimated as serde_json holds it (a
//! `Value` node per JSON value, each object key and string's bytes, see `record_bytes`), and
//! when the records together pass `StoreOptions::max_memory_bytes` the least recently used go
//! first, as Redis does with `maxmemory-policy allkeys-lru`. "Used" means what refreshes a TTL:
//! written, or loaded as part of a history, so a conversation still being continued keeps its
//! whole chain while abandoned ones make room. A record goes together with every record that
//! continues it (`previous_response_id`, followed down through a child index), so a later turn
//! never silently loses the beginning of its history: a dropped record answers like an expired
//! one (404 on retrieve, `previous_response_not_found` when continued). A chain whose
//! predecessor is gone without a deletion (dropped while a later turn ran, or expired while a
//! later turn kept itself alive) answers [`StoreError::Lost`] when continued, as the Redis store
//! does for a predecessor without a deletion marker. [`MemoryStore::evicted`] counts them. Never dropped: the last record written, even when it alone is over the bound,
//! background responses still queued or running, and the records these continue.
//! Conversations (Conversations API) count toward the same bound and take their turn in the
//! same least-recently-used order (used: created, read, or written).
//!
//! Session pins are bounded apart from them: every new session key a client sends makes a pin
//! that lives for the pin TTL, so a client inventing keys could otherwise fill memory within
//! that hour. Pins may take an eighth of the bound (estimated as their key, endpoint name and URL and
//! [`PIN_ENTRY_BYTES`]); past it the expired ones go, then those set or touched least recently
//! (they expire soonest) until the pins take three quarters of their share. A session whose
//! pin went is routed afresh, as after its TTL; [`MemoryStore::pins_dropped`] counts them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use serde_json::Value;

use crate::exchange::{FEED_LEN, FEED_READ_MAX, FORGET_AFTER};
use crate::pins::pin_key;
use crate::rate::{gcra_step, RateDecision, RateLimit};
use crate::record::{is_active_status, response_status};
use crate::{
    ConversationRecord, FeedRead, History, PeerState, PinSwap, ResponseRecord, SessionPin, Store,
    StoreError, StoreOptions, MAX_CHAIN_LEN,
};

/// How often, at most, a write sweeps expired records out of the map.
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// A stored record and when it stops being visible.
struct Entry {
    /// Shared, so reads take it under the lock and copy its items after releasing it.
    rec: Arc<ResponseRecord>,
    expires_at: Instant,
    /// Estimated size (`record_bytes`).
    bytes: u64,
    /// Tick of its last use: the position in `Records::lru` that counts.
    used: u64,
    /// Its event log ([`Store::append_events`]); its bytes count in `bytes`.
    events: Vec<String>,
    /// Once the response has ended: when its event log goes
    /// ([`StoreOptions::ended_log_ttl`]).
    log_until: Option<Instant>,
    /// Its predecessor was gone without a deletion (dropped for memory, or expired) when it
    /// was written (while its turn ran): its history cannot be rebuilt whole.
    parent_lost: bool,
    /// Its predecessor was deleted (before or after it was written): its history starts here,
    /// for as long as it lives, however many deletions came since (as the Redis store's
    /// deletion marker, which lives as long as the chain).
    parent_deleted: bool,
}

/// A conversation, its items, and when it stops being visible.
struct ConversationEntry {
    record: ConversationRecord,
    /// Shared, so a read takes them under the lock and copies them after releasing it.
    items: Arc<Vec<Value>>,
    expires_at: Instant,
    /// Responses whose items were appended (a retried append adds nothing twice).
    joined: HashSet<String>,
    /// Estimated size: its items and metadata ([`value_bytes`]).
    bytes: u64,
    /// Tick of its last use: its position in `Records::lru` (under its [`conversation_lru_key`]).
    used: u64,
}

/// A session pin and when it stops being in force.
struct PinEntry {
    pin: SessionPin,
    expires_at: Instant,
}

/// Estimated bytes of a pin beyond its key, endpoint name and URL: the map slot, three string
/// headers, the expiry and the move count.
pub const PIN_ENTRY_BYTES: u64 = 120;

/// The share of the memory bound pins may take: `max_bytes / PINS_SHARE`.
const PINS_SHARE: u64 = 8;

fn pin_bytes(key: &str, pin: &SessionPin) -> u64 {
    (key.len() + pin.endpoint.len() + pin.url.as_ref().map_or(0, String::len)) as u64
        + PIN_ENTRY_BYTES
}

/// The maps and their sweep and memory bookkeeping, guarded together.
struct Records {
    by_id: HashMap<String, Entry>,
    pins: HashMap<String, PinEntry>,
    /// Estimated size of `pins` ([`pin_bytes`]).
    pin_bytes: u64,
    /// Pins dropped for memory.
    pins_dropped: u64,
    next_sweep: Instant,
    /// [`StoreOptions::ended_log_ttl`].
    ended_log_ttl: Duration,
    /// Record ids by use, oldest first. A record is pushed again on each use; only the
    /// occurrence whose tick equals its entry's `used` counts, the others are skipped.
    lru: VecDeque<(u64, String)>,
    /// Last tick handed out.
    tick: u64,
    /// Sum of the entries' `bytes`.
    bytes: u64,
    /// Most `bytes` before records are dropped; 0: no bound.
    max_bytes: u64,
    /// Records dropped for memory.
    evicted: u64,
    /// Record id -> the ids of the stored records continuing it.
    children: HashMap<String, HashSet<String>>,
    /// Conversations by id (they count toward the memory bound and take their turn in `lru`).
    conversations: HashMap<String, ConversationEntry>,
    /// Ids of the last [`DELETED_REMEMBERED`] records deleted, oldest first, and the same as a
    /// set: a history walk reaching one starts there; reaching any other record that is gone
    /// (dropped for memory, expired, never stored) it answers `Lost`, as the Redis store
    /// answers a predecessor gone without a deletion marker. The records continuing a deleted
    /// one carry the deletion themselves ([`Entry::parent_deleted`]), so the bound only
    /// limits how long after a deletion a turn that continues the deleted record may still
    /// be written and read as cut there: past it, as a loss (an error, never a history
    /// silently cut short).
    deleted_ids: VecDeque<String>,
    deleted_set: HashSet<String>,
}

/// Ids of deleted records that are remembered.
const DELETED_REMEMBERED: usize = 16_384;

impl Records {
    /// The live entry for `id` owned by `team`, if any.
    fn live_mut(&mut self, team: &str, id: &str, now: Instant) -> Option<&mut Entry> {
        self.by_id
            .get_mut(id)
            .filter(|e| e.expires_at > now && e.rec.team == team)
    }

    /// The live conversation `id` owned by `team`, if any.
    fn conversation_mut(
        &mut self,
        team: &str,
        id: &str,
        now: Instant,
    ) -> Option<&mut ConversationEntry> {
        self.conversations
            .get_mut(id)
            .filter(|e| e.expires_at > now && e.record.team == team)
    }

    /// Mark conversation `id` as just used (it competes for memory with the responses).
    fn touch_conversation(&mut self, id: &str, expires_at: Instant) {
        if let Some(entry) = self.conversations.get_mut(id) {
            self.tick += 1;
            entry.used = self.tick;
            entry.expires_at = expires_at;
            self.lru.push_back((self.tick, conversation_lru_key(id)));
            self.compact_lru(false);
        }
    }

    /// Re-estimate conversation `id`'s size after it changed, then keep to the bound.
    fn resize_conversation(&mut self, id: &str) {
        if let Some(entry) = self.conversations.get_mut(id) {
            let bytes = conversation_bytes(&entry.record, &entry.items, &entry.joined);
            self.bytes = self.bytes - entry.bytes + bytes;
            entry.bytes = bytes;
        }
        self.evict();
    }

    fn remove_conversation(&mut self, id: &str) -> bool {
        match self.conversations.remove(id) {
            Some(entry) => {
                self.bytes -= entry.bytes;
                true
            }
            None => false,
        }
    }

    /// Whether an `lru` occurrence is the one that counts for its response or conversation.
    fn lru_current(&self, used: u64, key: &str) -> bool {
        match key.strip_prefix(CONVERSATION_LRU_PREFIX) {
            Some(id) => self.conversations.get(id).is_some_and(|e| e.used == used),
            None => self.by_id.get(key).is_some_and(|e| e.used == used),
        }
    }

    /// The pin under `key` if it is still in force.
    fn live_pin_mut(&mut self, key: &str, now: Instant) -> Option<&mut PinEntry> {
        self.pins.get_mut(key).filter(|e| e.expires_at > now)
    }

    /// Drop the pins `doomed` picks; returns how many.
    fn drop_pins(&mut self, mut doomed: impl FnMut(&str, &PinEntry) -> bool) -> u64 {
        let mut freed = 0;
        let mut dropped = 0;
        self.pins.retain(|key, e| {
            if doomed(key, e) {
                freed += pin_bytes(key, &e.pin);
                dropped += 1;
                false
            } else {
                true
            }
        });
        self.pin_bytes -= freed;
        dropped
    }

    /// Set the pin under `key`, then keep the pins to their share of the bound.
    fn insert_pin(&mut self, key: String, entry: PinEntry, now: Instant) {
        let bytes = pin_bytes(&key, &entry.pin);
        if let Some(old) = self.pins.get(&key) {
            self.pin_bytes -= pin_bytes(&key, &old.pin);
        }
        self.pins.insert(key.clone(), entry);
        self.pin_bytes += bytes;
        let share = self.max_bytes / PINS_SHARE;
        if share == 0 || self.pin_bytes <= share {
            return;
        }
        self.drop_pins(|_, e| e.expires_at <= now);
        if self.pin_bytes <= share * 3 / 4 {
            return;
        }
        // The pins expiring soonest are those set or touched least recently: drop about as many
        // as leave three quarters of the share, never the one just set.
        let len = self.pins.len();
        let keep = (len as u128 * u128::from(share * 3 / 4) / u128::from(self.pin_bytes)) as usize;
        let count = len - keep.clamp(1, len);
        if count == 0 {
            return;
        }
        let mut expiries: Vec<Instant> = self.pins.values().map(|e| e.expires_at).collect();
        let line = *expiries.select_nth_unstable(count - 1).1;
        let mut at_line = count - expiries.iter().filter(|&&at| at < line).count();
        self.pins_dropped += self.drop_pins(|k, e| {
            if k == key || e.expires_at > line {
                false
            } else if e.expires_at < line {
                true
            } else if at_line > 0 {
                at_line -= 1;
                true
            } else {
                false
            }
        });
    }

    /// Drop expired entries if the sweep interval has passed.
    fn maybe_sweep(&mut self, now: Instant) {
        if now >= self.next_sweep {
            self.drop_pins(|_, e| e.expires_at <= now);
            let bytes = &mut self.bytes;
            self.by_id.retain(|_, e| {
                let live = e.expires_at > now;
                if !live {
                    *bytes -= e.bytes;
                } else if e.log_until.is_some_and(|until| until <= now) {
                    let freed = events_bytes(&e.events);
                    e.events = Vec::new();
                    e.log_until = None;
                    e.bytes -= freed;
                    *bytes -= freed;
                }
                live
            });
            self.conversations.retain(|_, e| {
                let live = e.expires_at > now;
                if !live {
                    *bytes -= e.bytes;
                }
                live
            });
            let by_id = &self.by_id;
            self.children.retain(|parent, children| {
                children.retain(|child| by_id.contains_key(child));
                by_id.contains_key(parent) && !children.is_empty()
            });
            self.compact_lru(true);
            self.next_sweep = now + SWEEP_INTERVAL;
        }
    }

    /// Store `rec` (replacing a record with its id), then drop the least recently used records
    /// while over the bound.
    fn insert(&mut self, rec: Arc<ResponseRecord>, bytes: u64, expires_at: Instant) {
        self.tick += 1;
        let id = rec.id.clone();
        let now = Instant::now();
        let parent_lost = rec
            .previous_response_id
            .as_ref()
            .is_some_and(|parent| self.is_lost(parent, &rec.team, now));
        let parent_deleted = rec
            .previous_response_id
            .as_ref()
            .is_some_and(|parent| self.deleted_set.contains(parent));
        // Written again under an id once deleted: present now.
        if self.deleted_set.remove(&id) {
            self.deleted_ids.retain(|deleted| *deleted != id);
        }
        if let Some(parent) = &rec.previous_response_id {
            self.children
                .entry(parent.clone())
                .or_default()
                .insert(id.clone());
        }
        let events = self
            .by_id
            .get_mut(&id)
            .map(|old| std::mem::take(&mut old.events))
            .unwrap_or_default();
        let bytes = bytes + events_bytes(&events);
        // A log carried over to an ended response goes once a client can no longer resume.
        let log_until = (!events.is_empty() && !is_active_status(response_status(&rec.response)))
            .then(|| expiry_after(now, self.ended_log_ttl));
        let entry = Entry {
            rec,
            expires_at,
            bytes,
            used: self.tick,
            log_until,
            events,
            parent_lost,
            parent_deleted,
        };
        if let Some(old) = self.by_id.insert(id.clone(), entry) {
            self.bytes -= old.bytes;
        }
        self.bytes += bytes;
        self.lru.push_back((self.tick, id));
        self.evict();
    }

    /// Mark `id` as just used.
    fn mark_used(&mut self, id: &str) {
        if let Some(entry) = self.by_id.get_mut(id) {
            self.tick += 1;
            entry.used = self.tick;
            self.lru.push_back((self.tick, id.to_string()));
            self.compact_lru(false);
        }
    }

    /// Re-estimate `id`'s size after its record or event log changed in place.
    fn resize(&mut self, id: &str) {
        if let Some(entry) = self.by_id.get_mut(id) {
            let bytes = record_bytes(&entry.rec) + events_bytes(&entry.events);
            self.bytes = self.bytes - entry.bytes + bytes;
            entry.bytes = bytes;
        }
    }

    /// Remove `id` (its own list of continuations stays until it is dropped or swept).
    fn remove(&mut self, id: &str) -> Option<Entry> {
        let entry = self.by_id.remove(id)?;
        self.bytes -= entry.bytes;
        if let Some(parent) = &entry.rec.previous_response_id {
            if let Some(siblings) = self.children.get_mut(parent) {
                siblings.remove(id);
                if siblings.is_empty() {
                    self.children.remove(parent);
                }
            }
        }
        Some(entry)
    }

    /// While over the bound, drop the least recently used record with the records continuing
    /// it; never the last one written nor an active background response, nor a record that
    /// one of those continues.
    fn evict(&mut self) {
        if self.max_bytes == 0 {
            return;
        }
        let mut kept = Vec::new();
        // Records found to lead to a protected one this call: kept without walking their
        // continuations again (a long chain ending in a running background response would
        // otherwise cost its length squared on every write).
        let mut leads_to_protected: HashSet<String> = HashSet::new();
        while self.bytes > self.max_bytes {
            let Some((used, id)) = self.lru.pop_front() else {
                break;
            };
            if !self.lru_current(used, &id) {
                continue;
            }
            if let Some(conversation) = id.strip_prefix(CONVERSATION_LRU_PREFIX) {
                if used == self.tick {
                    kept.push((used, id));
                } else if self.remove_conversation(conversation) {
                    self.evicted += 1;
                }
                continue;
            }
            if leads_to_protected.contains(&id) {
                kept.push((used, id));
                continue;
            }
            let family = self.descendants(&id);
            if let Some(protected) = family.iter().find(|member| self.protected(member)) {
                // The records from it back up to `id` all lead to it.
                let mut at = Some(protected.clone());
                while let Some(member) = at.take() {
                    if !leads_to_protected.insert(member.clone()) || member == id {
                        break;
                    }
                    at = self
                        .by_id
                        .get(&member)
                        .and_then(|e| e.rec.previous_response_id.clone());
                }
                kept.push((used, id));
                continue;
            }
            for member in family {
                if self.remove(&member).is_some() {
                    self.evicted += 1;
                }
                self.children.remove(&member);
            }
        }
        for entry in kept.into_iter().rev() {
            self.lru.push_front(entry);
        }
        self.compact_lru(false);
    }

    /// Remember that `id` was deleted (the last [`DELETED_REMEMBERED`] ids).
    fn remember_deleted(&mut self, id: String) {
        if self.deleted_set.insert(id.clone()) {
            self.deleted_ids.push_back(id);
        }
        while self.deleted_ids.len() > DELETED_REMEMBERED {
            if let Some(old) = self.deleted_ids.pop_front() {
                self.deleted_set.remove(&old);
            }
        }
    }

    /// Whether `id`, wanted as a predecessor by a record of `team`, is gone without a
    /// deletion: expired (swept or not), dropped for memory, or never stored here. A deleted
    /// record, or a live or expired one of another team, is not lost: the history starts
    /// after it.
    fn is_lost(&self, id: &str, team: &str, now: Instant) -> bool {
        match self.by_id.get(id) {
            Some(entry) => entry.rec.team == team && entry.expires_at <= now,
            None => !self.deleted_set.contains(id),
        }
    }

    /// Whether eviction must keep `id`: the last record written, or a background response
    /// still queued or running (its run writes its result there).
    fn protected(&self, id: &str) -> bool {
        self.by_id.get(id).is_some_and(|e| {
            e.used == self.tick || is_active_status(response_status(&e.rec.response))
        })
    }

    /// `id` and every stored record continuing it, down the child index.
    fn descendants(&self, id: &str) -> Vec<String> {
        let mut family = vec![id.to_string()];
        let mut seen: HashSet<&str> = HashSet::from([id]);
        let mut at = 0;
        while let Some(member) = family.get(at) {
            if let Some(children) = self.children.get(member) {
                for child in children {
                    // A chain may loop (ids are the client's to give as predecessors).
                    if seen.insert(child) {
                        family.push(child.clone());
                    }
                }
            }
            at += 1;
        }
        family
    }

    /// Drop the skipped occurrences from `lru` once they outnumber the records (or `always`).
    fn compact_lru(&mut self, always: bool) {
        if always || self.lru.len() > 2 * (self.by_id.len() + self.conversations.len()) + 1024 {
            let lru = std::mem::take(&mut self.lru);
            self.lru = lru
                .into_iter()
                .filter(|(used, key)| self.lru_current(*used, key))
                .collect();
        }
    }
}

/// Estimated heap bytes of a record as stored: its ids, and every JSON value it holds.
fn record_bytes(rec: &ResponseRecord) -> u64 {
    const ENTRY: u64 = std::mem::size_of::<Entry>() as u64;
    let ids =
        rec.id.len() + rec.team.len() + rec.previous_response_id.as_ref().map_or(0, String::len);
    let items: u64 = rec
        .input_items
        .iter()
        .chain(&rec.output_items)
        .map(value_bytes)
        .sum();
    // The id is held twice: as the map key and in the record; and once more in `lru`.
    ENTRY + 3 * ids as u64 + items + value_bytes(&rec.response)
}

/// Prefix of a conversation's entries in `Records::lru` (response ids never start with it).
const CONVERSATION_LRU_PREFIX: &str = "\u{1}conv:";

/// The `Records::lru` entry name of conversation `id`.
fn conversation_lru_key(id: &str) -> String {
    format!("{CONVERSATION_LRU_PREFIX}{id}")
}

/// Estimated heap bytes of a conversation: its ids, metadata, items and joined responses.
fn conversation_bytes(
    record: &ConversationRecord,
    items: &[Value],
    joined: &HashSet<String>,
) -> u64 {
    const ENTRY: u64 = std::mem::size_of::<ConversationEntry>() as u64;
    const KEY: u64 = std::mem::size_of::<String>() as u64;
    let ids = (record.id.len() + record.team.len()) as u64;
    let joined: u64 = joined.iter().map(|r| KEY + r.len() as u64).sum();
    ENTRY
        + 2 * ids
        + value_bytes(&record.metadata)
        + items.iter().map(value_bytes).sum::<u64>()
        + joined
}

/// Heap bytes of an event log.
fn events_bytes(events: &[String]) -> u64 {
    const STRING: u64 = std::mem::size_of::<String>() as u64;
    events.iter().map(|e| STRING + e.len() as u64).sum()
}

/// Estimated heap bytes of a JSON value as serde_json holds it: one `Value` per node, each
/// string's and object key's bytes, and a map entry's bookkeeping.
fn value_bytes(value: &Value) -> u64 {
    const NODE: u64 = std::mem::size_of::<Value>() as u64;
    const KEY: u64 = std::mem::size_of::<String>() as u64;
    NODE + match value {
        Value::String(s) => s.len() as u64,
        Value::Array(items) => items.iter().map(value_bytes).sum(),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| KEY + k.len() as u64 + value_bytes(v))
            .sum(),
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

/// One pool's exchange board: gateway id -> (published at, state).
type Board = HashMap<String, (Instant, String)>;

/// One pool's feed: the number of its last entry, and its last [`FEED_LEN`] entries
/// (number, gateway, entry).
#[derive(Default)]
struct Feed {
    last: u64,
    entries: VecDeque<(u64, String, String)>,
}

/// In-process store; contents are lost when the process exits.
pub struct MemoryStore {
    records: Mutex<Records>,
    /// GCRA counters: key -> theoretical arrival time in ms since `epoch`.
    rates: Mutex<HashMap<String, f64>>,
    /// Exchange boards (`.0`) and feeds (`.1`) by pool.
    exchanges: Mutex<(HashMap<String, Board>, HashMap<String, Feed>)>,
    /// Conversation locks: (team, conversation id) -> (owner, expiry).
    conversation_locks: Mutex<HashMap<(String, String), (String, Instant)>>,
    /// Background runs' leases: response id -> when the lease expires.
    run_leases: Mutex<HashMap<String, Instant>>,
    /// `run_leases` is pruned once it holds this many (twice what the last prune left), so
    /// pruning costs each lease O(1) over time rather than a scan of them all per renewal.
    prune_leases_at: std::sync::atomic::AtomicUsize,
    epoch: Instant,
    ttl: Duration,
    pin_ttl: Duration,
    /// Handed to several gateways of this process ([`MemoryStore::shared_in_process`]).
    shared: bool,
}

impl MemoryStore {
    /// An empty store; `opts.ttl` and `opts.pin_ttl` are used, the key prefix is not.
    pub fn new(opts: StoreOptions) -> Self {
        MemoryStore {
            records: Mutex::new(Records {
                by_id: HashMap::new(),
                pins: HashMap::new(),
                pin_bytes: 0,
                pins_dropped: 0,
                next_sweep: Instant::now() + SWEEP_INTERVAL,
                ended_log_ttl: opts.ended_log_ttl.min(opts.ttl),
                lru: VecDeque::new(),
                tick: 0,
                bytes: 0,
                max_bytes: opts.max_memory_bytes,
                evicted: 0,
                children: HashMap::new(),
                conversations: HashMap::new(),
                deleted_ids: VecDeque::new(),
                deleted_set: HashSet::new(),
            }),
            rates: Mutex::new(HashMap::new()),
            exchanges: Mutex::default(),
            conversation_locks: Mutex::new(HashMap::new()),
            run_leases: Mutex::new(HashMap::new()),
            prune_leases_at: std::sync::atomic::AtomicUsize::new(1024),
            epoch: Instant::now(),
            ttl: opts.ttl,
            pin_ttl: opts.pin_ttl,
            shared: false,
        }
    }

    /// The same store, to be handed (behind one `Arc`) to several gateways running in this
    /// process: they then exchange state through it as gateways in separate processes do
    /// through Redis ([`AnyStore::is_shared`](crate::AnyStore::is_shared)). Gateways in separate
    /// processes cannot share it; this is for in-process fleets such as the benchmark's.
    pub fn shared_in_process(mut self) -> Self {
        self.shared = true;
        self
    }

    /// Whether [`MemoryStore::shared_in_process`] marked the store as shared.
    pub fn is_shared_in_process(&self) -> bool {
        self.shared
    }

    /// Number of session pins held, including expired ones not yet swept.
    pub fn pin_count(&self) -> usize {
        self.lock().pins.len()
    }

    /// Pins dropped to keep the pins within their share of the memory bound.
    pub fn pins_dropped(&self) -> u64 {
        self.lock().pins_dropped
    }

    /// Number of records held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Estimated bytes of the records held (`record_bytes`), expired ones not yet swept
    /// included.
    pub fn memory_bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Records dropped so far to stay within `StoreOptions::max_memory_bytes`.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    /// Whether the store holds no records at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `read` of the team's conversation `id`, which counts as a use: its TTL is refreshed, as
    /// Redis refreshes it on every conversation operation. `None` when there is none.
    fn read_conversation<T>(
        &self,
        team: &str,
        id: &str,
        read: impl FnOnce(&ConversationEntry) -> T,
    ) -> Option<T> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        let found = records.conversation_mut(team, id, now).map(|e| read(e));
        if found.is_some() {
            records.touch_conversation(id, expires_at);
        }
        found
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // A panic while holding the lock cannot leave a half-written entry (every mutation is a
        // single map operation), so the data is still consistent.
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn expiry_from(&self, now: Instant) -> Instant {
        expiry_after(now, self.ttl)
    }
}

/// `now + ttl`, saturating at a century for absurd TTLs.
fn expiry_after(now: Instant, ttl: Duration) -> Instant {
    now.checked_add(ttl)
        .unwrap_or(now + Duration::from_secs(100 * 365 * 24 * 3600))
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new(StoreOptions::default())
    }
}

impl Store for MemoryStore {
    async fn put(&self, rec: &ResponseRecord) -> Result<(), StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        // Copied and measured before the lock: other store calls do not wait for it.
        let rec = Arc::new(rec.clone());
        let bytes = record_bytes(&rec);
        let mut records = self.lock();
        records.maybe_sweep(now);
        records.insert(rec, bytes, expires_at);
        Ok(())
    }

    async fn get(&self, team: &str, id: &str) -> Result<Option<ResponseRecord>, StoreError> {
        let now = Instant::now();
        let rec = {
            let mut records = self.lock();
            records.live_mut(team, id, now).map(|e| Arc::clone(&e.rec))
        };
        Ok(rec.map(|rec| (*rec).clone()))
    }

    async fn status(&self, team: &str, id: &str) -> Result<Option<String>, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        Ok(records
            .live_mut(team, id, now)
            .map(|e| response_status(&e.rec.response).to_string()))
    }

    async fn history(&self, team: &str, id: &str) -> Result<Option<History>, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        // Walk newest to oldest under the lock, taking each record (shared, no copy); their
        // items are copied, oldest first, once the lock is released.
        let mut walked_records: Vec<Arc<ResponseRecord>> = Vec::new();
        let mut next = Some(id.to_string());
        let mut walked = 0usize;
        let mut root_id = id.to_string();
        let mut chain = Vec::new();
        let mut status = String::new();
        let mut parent_lost = false;
        let mut parent_deleted = false;
        while let Some(current) = next.take() {
            let Some(entry) = records.live_mut(team, &current, now) else {
                if walked == 0 {
                    return Ok(None);
                }
                // As the Redis store answers a predecessor gone without a deletion marker.
                let gone = !records.by_id.contains_key(&current);
                if !(parent_deleted && gone)
                    && ((parent_lost && gone) || records.is_lost(&current, team, now))
                {
                    return Err(StoreError::Lost {
                        id: id.to_string(),
                        missing: current,
                    });
                }
                break;
            };
            parent_lost = entry.parent_lost;
            parent_deleted = entry.parent_deleted;
            walked += 1;
            root_id.clone_from(&current);
            if walked > MAX_CHAIN_LEN {
                return Err(StoreError::Corrupt {
                    id: id.to_string(),
                    reason: format!(
                        "previous_response_id chain longer than {MAX_CHAIN_LEN} (a cycle?)"
                    ),
                });
            }
            entry.expires_at = expires_at;
            if walked == 1 {
                status = entry.rec.status().to_string();
            }
            walked_records.push(Arc::clone(&entry.rec));
            next = entry.rec.previous_response_id.clone();
            chain.push(current);
        }
        // Oldest first, so the newest turn is the most recently used.
        for used in chain.iter().rev() {
            records.mark_used(used);
        }
        drop(records);
        let mut items = Vec::new();
        for rec in walked_records.iter().rev() {
            items.extend(rec.input_items.iter().cloned());
            items.extend(rec.output_items.iter().cloned());
        }
        Ok(Some(History {
            items,
            root_id,
            status,
        }))
    }

    async fn update_if_active(
        &self,
        team: &str,
        id: &str,
        response: &Value,
        output_items: &[Value],
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        let ended_log_ttl = records.ended_log_ttl;
        let Some(entry) = records.live_mut(team, id, now) else {
            return Ok(false);
        };
        if !is_active_status(response_status(&entry.rec.response)) {
            return Ok(false);
        }
        let rec = Arc::make_mut(&mut entry.rec);
        rec.response = response.clone();
        rec.output_items = output_items.to_vec();
        entry.expires_at = expires_at;
        if !is_active_status(response_status(response)) {
            entry.log_until = Some(expiry_after(now, ended_log_ttl));
        }
        records.resize(id);
        records.mark_used(id);
        records.evict();
        Ok(true)
    }

    async fn delete(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        if records.live_mut(team, id, now).is_none() {
            return Ok(false);
        }
        records.remove(id);
        if let Some(children) = records.children.remove(id) {
            for child in children {
                if let Some(entry) = records.by_id.get_mut(&child) {
                    entry.parent_deleted = true;
                }
            }
        }
        records.remember_deleted(id.to_string());
        Ok(true)
    }

    async fn append_events(&self, id: &str, events: &[String]) -> Result<bool, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        let ended_log_ttl = records.ended_log_ttl;
        let Some(entry) = records.by_id.get_mut(id).filter(|e| e.expires_at > now) else {
            return Ok(false);
        };
        entry.events.extend_from_slice(events);
        entry.expires_at = expires_at;
        let active = is_active_status(response_status(&entry.rec.response));
        entry.log_until = (!active).then(|| expiry_after(now, ended_log_ttl));
        // Only the appended events are measured (a run appends every 100 ms: measuring its
        // whole record and log each time would grow with both).
        let added = events_bytes(events);
        entry.bytes += added;
        records.bytes += added;
        records.evict();
        Ok(active)
    }

    async fn events(&self, id: &str, from: usize) -> Result<Vec<String>, StoreError> {
        let now = Instant::now();
        let records = self.lock();
        Ok(records
            .by_id
            .get(id)
            .filter(|e| e.expires_at > now && e.log_until.is_none_or(|until| until > now))
            .and_then(|e| e.events.get(from..))
            .map(<[String]>::to_vec)
            .unwrap_or_default())
    }

    async fn create_conversation(
        &self,
        conversation: &ConversationRecord,
        items: &[Value],
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        records.maybe_sweep(now);
        records.remove_conversation(&conversation.id);
        let joined = HashSet::new();
        let bytes = conversation_bytes(conversation, items, &joined);
        records.bytes += bytes;
        records.conversations.insert(
            conversation.id.clone(),
            ConversationEntry {
                record: conversation.clone(),
                items: Arc::new(items.to_vec()),
                expires_at,
                joined,
                bytes,
                used: 0,
            },
        );
        records.touch_conversation(&conversation.id, expires_at);
        records.evict();
        Ok(())
    }

    async fn get_conversation(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<ConversationRecord>, StoreError> {
        Ok(self.read_conversation(team, id, |e| e.record.clone()))
    }

    async fn set_conversation_metadata(
        &self,
        team: &str,
        id: &str,
        metadata: &Value,
    ) -> Result<Option<ConversationRecord>, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        let updated = records.conversation_mut(team, id, now).map(|e| {
            e.record.metadata = metadata.clone();
            e.record.clone()
        });
        if updated.is_some() {
            records.touch_conversation(id, expires_at);
            records.resize_conversation(id);
        }
        Ok(updated)
    }

    async fn delete_conversation(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        if records.conversation_mut(team, id, now).is_none() {
            return Ok(false);
        }
        Ok(records.remove_conversation(id))
    }

    async fn conversation_len(&self, team: &str, id: &str) -> Result<Option<usize>, StoreError> {
        Ok(self.read_conversation(team, id, |e| e.items.len()))
    }

    async fn conversation_items(
        &self,
        team: &str,
        id: &str,
    ) -> Result<Option<Vec<Value>>, StoreError> {
        let items = self.read_conversation(team, id, |e| Arc::clone(&e.items));
        Ok(items.map(|items| (*items).clone()))
    }

    async fn append_conversation_items(
        &self,
        team: &str,
        id: &str,
        response: &str,
        items: &[Value],
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        let Some(entry) = records.conversation_mut(team, id, now) else {
            return Ok(false);
        };
        // Measured by what this append adds: a conversation's whole list is not walked on
        // every turn.
        let mut added = 0;
        if response.is_empty() || entry.joined.insert(response.to_string()) {
            Arc::make_mut(&mut entry.items).extend_from_slice(items);
            added += items.iter().map(value_bytes).sum::<u64>();
            if !response.is_empty() {
                added += std::mem::size_of::<String>() as u64 + response.len() as u64;
            }
        }
        entry.bytes += added;
        records.bytes += added;
        records.touch_conversation(id, expires_at);
        records.evict();
        Ok(true)
    }

    async fn delete_conversation_item(
        &self,
        team: &str,
        id: &str,
        item_id: &str,
    ) -> Result<Option<bool>, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        let removed = records.conversation_mut(team, id, now).map(|e| {
            // The first with that id, as Redis' LREM does.
            let at = e
                .items
                .iter()
                .position(|item| item.get("id").and_then(Value::as_str) == Some(item_id));
            at.map(|at| Arc::make_mut(&mut e.items).remove(at))
                .is_some()
        });
        if removed.is_some() {
            records.touch_conversation(id, expires_at);
            records.resize_conversation(id);
        }
        Ok(removed)
    }

    async fn lock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
        ttl: Duration,
        renew_only: bool,
    ) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut locks = self
            .conversation_locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Locks whose holder vanished without releasing them expire; drop those first once
        // there are many, so the map stays as small as the turns running.
        if locks.len() >= 1024 {
            locks.retain(|_, (_, expires_at)| *expires_at > now);
        }
        let key = (team.to_string(), id.to_string());
        let free = match locks.get(&key) {
            Some((holder, expires_at)) if *expires_at > now => holder == owner,
            _ => !renew_only,
        };
        if free {
            locks.insert(key, (owner.to_string(), expiry_after(now, ttl)));
        }
        Ok(free)
    }

    async fn unlock_conversation(
        &self,
        team: &str,
        id: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        let mut locks = self
            .conversation_locks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = (team.to_string(), id.to_string());
        if locks.get(&key).is_some_and(|(holder, _)| holder == owner) {
            locks.remove(&key);
        }
        Ok(())
    }

    async fn hold_run(&self, id: &str, ttl: Duration) -> Result<(), StoreError> {
        let now = Instant::now();
        // A lapsed lease (given up, or its run vanished) is kept as long as its response, as
        // Redis keeps its mark: it tells a lost run from one no lease was ever taken for. Once
        // there are many, those whose response is gone are dropped, so the map stays as small
        // as the store. (The records' lock is never taken while this one is held.)
        let prune = {
            let leases = self
                .run_leases
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let due = self
                .prune_leases_at
                .load(std::sync::atomic::Ordering::Relaxed);
            (leases.len() >= due).then(|| {
                leases
                    .iter()
                    .filter(|(_, expires_at)| **expires_at <= now)
                    .map(|(id, _)| id.clone())
                    .collect::<Vec<String>>()
            })
        };
        let pruned = prune.is_some();
        let gone: Vec<String> = match prune {
            Some(lapsed) => {
                let records = self.lock();
                lapsed
                    .into_iter()
                    .filter(|id| records.by_id.get(id).is_none_or(|e| e.expires_at <= now))
                    .collect()
            }
            None => Vec::new(),
        };
        let mut leases = self
            .run_leases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if pruned {
            for id in gone {
                if leases.get(&id).is_some_and(|expires_at| *expires_at <= now) {
                    leases.remove(&id);
                }
            }
            self.prune_leases_at.store(
                (2 * leases.len()).max(1024),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        leases.insert(id.to_string(), expiry_after(now, ttl));
        Ok(())
    }

    async fn run_held(&self, id: &str) -> Result<Option<bool>, StoreError> {
        let leases = self
            .run_leases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Ok(leases
            .get(id)
            .map(|expires_at| *expires_at > Instant::now()))
    }

    async fn end_run(&self, id: &str) -> Result<(), StoreError> {
        // Kept, lapsed, as Redis keeps its mark that a lease was taken (see `hold_run`).
        if let Some(expires_at) = self
            .run_leases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get_mut(id)
        {
            *expires_at = Instant::now();
        }
        Ok(())
    }

    async fn get_pin(&self, pool: &str, session: &str) -> Result<Option<SessionPin>, StoreError> {
        let key = pin_key("", pool, session);
        let now = Instant::now();
        let expires_at = expiry_after(now, self.pin_ttl);
        let mut records = self.lock();
        Ok(records.live_pin_mut(&key, now).map(|e| {
            e.expires_at = expires_at;
            e.pin.clone()
        }))
    }

    async fn swap_pin(
        &self,
        pool: &str,
        session: &str,
        expected: Option<&SessionPin>,
        new: &SessionPin,
    ) -> Result<PinSwap, StoreError> {
        let key = pin_key("", pool, session);
        let now = Instant::now();
        let expires_at = expiry_after(now, self.pin_ttl);
        let mut records = self.lock();
        records.maybe_sweep(now);
        if let Some(entry) = records.live_pin_mut(&key, now) {
            entry.expires_at = expires_at;
            if !expected.is_some_and(|e| e.same_as(&entry.pin)) {
                return Ok(PinSwap {
                    pin: entry.pin.clone(),
                    applied: false,
                });
            }
        }
        records.insert_pin(
            key,
            PinEntry {
                pin: new.clone(),
                expires_at,
            },
            now,
        );
        Ok(PinSwap {
            pin: new.clone(),
            applied: true,
        })
    }

    async fn touch_pin(&self, pool: &str, session: &str) -> Result<(), StoreError> {
        let key = pin_key("", pool, session);
        let now = Instant::now();
        let expires_at = expiry_after(now, self.pin_ttl);
        if let Some(entry) = self.lock().live_pin_mut(&key, now) {
            entry.expires_at = expires_at;
        }
        Ok(())
    }

    async fn rate_limit(&self, limits: &[RateLimit]) -> Result<Vec<RateDecision>, StoreError> {
        let now = self.epoch.elapsed().as_secs_f64() * 1000.0;
        let mut rates = self.rates.lock().unwrap_or_else(PoisonError::into_inner);
        // Counters whose budget is full again hold no information.
        if rates.len() > 1024 {
            rates.retain(|_, tat| *tat > now);
        }
        let steps: Vec<(RateDecision, f64)> = limits
            .iter()
            .map(|l| gcra_step(rates.get(&l.key).copied(), now, l))
            .collect();
        let passed = steps.iter().all(|(d, _)| d.allowed());
        if passed {
            for (limit, (_, tat)) in limits.iter().zip(&steps) {
                rates.insert(limit.key.clone(), *tat);
            }
        }
        // Refused by one limit, the others were not charged either: they say so.
        Ok(steps
            .into_iter()
            .zip(limits)
            .map(|((d, _), l)| match passed || !d.allowed() {
                true => d,
                false => crate::rate::uncharged(rates.get(&l.key).copied(), now, l),
            })
            .collect())
    }

    async fn rate_charge(&self, limits: &[RateLimit]) -> Result<(), StoreError> {
        let now = self.epoch.elapsed().as_secs_f64() * 1000.0;
        let mut rates = self.rates.lock().unwrap_or_else(PoisonError::into_inner);
        for limit in limits {
            let tat = crate::rate::charged_tat(rates.get(&limit.key).copied(), now, limit);
            rates.insert(limit.key.clone(), tat);
        }
        Ok(())
    }

    async fn rate_refund(&self, limits: &[RateLimit]) -> Result<(), StoreError> {
        let now = self.epoch.elapsed().as_secs_f64() * 1000.0;
        let mut rates = self.rates.lock().unwrap_or_else(PoisonError::into_inner);
        for limit in limits {
            match crate::rate::refunded_tat(rates.get(&limit.key).copied(), now, limit) {
                Some(tat) => rates.insert(limit.key.clone(), tat),
                None => rates.remove(&limit.key),
            };
        }
        Ok(())
    }

    async fn exchange(
        &self,
        pool: &str,
        gateway: &str,
        state: &str,
        fresh: Duration,
    ) -> Result<Vec<PeerState>, StoreError> {
        let now = Instant::now();
        let mut exchanges = self
            .exchanges
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let board = exchanges.0.entry(pool.to_string()).or_default();
        board.insert(gateway.to_string(), (now, state.to_string()));
        board.retain(|_, (at, _)| now.saturating_duration_since(*at) <= FORGET_AFTER);
        Ok(board
            .iter()
            .filter(|(id, (at, _))| {
                id.as_str() != gateway && now.saturating_duration_since(*at) <= fresh
            })
            .map(|(_, (at, state))| PeerState {
                age: now.saturating_duration_since(*at),
                state: state.clone(),
            })
            .collect())
    }

    async fn feed(
        &self,
        pool: &str,
        gateway: &str,
        entries: &[String],
        cursor: Option<u64>,
    ) -> Result<FeedRead, StoreError> {
        let mut exchanges = self
            .exchanges
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let feed = exchanges.1.entry(pool.to_string()).or_default();
        for entry in entries {
            feed.last += 1;
            feed.entries
                .push_back((feed.last, gateway.to_string(), entry.clone()));
        }
        while feed.entries.len() > FEED_LEN {
            feed.entries.pop_front();
        }
        let counted = cursor.filter(|&c| c <= feed.last);
        let after = counted.unwrap_or(0);
        let first = feed.entries.front().map_or(feed.last + 1, |e| e.0);
        let mut read = FeedRead {
            // Nothing kept: nothing to read up to the end.
            cursor: if feed.entries.is_empty() {
                feed.last
            } else {
                after
            },
            skipped: counted.map_or(0, |after| first.saturating_sub(after + 1)),
            ..FeedRead::default()
        };
        for (n, by, entry) in feed
            .entries
            .iter()
            .filter(|(n, _, _)| *n > after)
            .take(FEED_READ_MAX)
        {
            read.cursor = *n;
            if by != gateway {
                read.entries.push((by.clone(), entry.clone()));
            }
        }
        Ok(read)
    }

    fn round_trips(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{pin, pin_expiry_suite, record, suite};
    use serde_json::json;

    #[tokio::test]
    async fn passes_the_store_suite() {
        suite(&MemoryStore::default()).await;
    }

    /// A store bounded to about `records` records the size of `record(.., 1_000)`.
    fn bounded(records: u64) -> MemoryStore {
        let one = record_bytes(&record("t", "r00", Some("r00"), 1_000));
        MemoryStore::new(StoreOptions {
            max_memory_bytes: records * one + one / 2,
            ..StoreOptions::default()
        })
    }

    #[tokio::test]
    async fn past_its_memory_bound_the_least_recently_used_records_go() {
        let store = bounded(4);
        let bound = store.lock().max_bytes;
        // Two conversations: a, then b; a is continued after b started.
        store.put(&record("t", "a1", None, 1_000)).await.unwrap();
        store.put(&record("t", "b1", None, 1_000)).await.unwrap();
        store
            .put(&record("t", "b2", Some("b1"), 1_000))
            .await
            .unwrap();
        store.history("t", "a1").await.unwrap();
        store
            .put(&record("t", "a2", Some("a1"), 1_000))
            .await
            .unwrap();
        assert_eq!((store.len(), store.evicted()), (4, 0));
        // Two more records: b's two go, a's chain stays whole.
        store.put(&record("t", "c1", None, 1_000)).await.unwrap();
        store
            .put(&record("t", "c2", Some("c1"), 1_000))
            .await
            .unwrap();
        assert_eq!(store.evicted(), 2);
        assert!(store.memory_bytes() <= bound);
        assert_eq!(store.get("t", "b1").await.unwrap(), None);
        assert_eq!(store.get("t", "b2").await.unwrap(), None);
        let history = store.history("t", "a2").await.unwrap().unwrap();
        assert_eq!(history.root_id, "a1");
        assert_eq!(history.items.len(), 4);
        // A deleted record frees its bytes; the sum stays exact through every change.
        let before = store.memory_bytes();
        assert!(store.delete("t", "c1").await.unwrap());
        let c1 = record_bytes(&record("t", "c1", None, 1_000));
        assert_eq!(store.memory_bytes(), before - c1);
        let sum: u64 = store.lock().by_id.values().map(|e| e.bytes).sum();
        assert_eq!(store.memory_bytes(), sum);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ended_responses_event_log_goes_after_its_own_ttl() {
        let store = MemoryStore::new(StoreOptions {
            ended_log_ttl: Duration::from_millis(50),
            ..StoreOptions::default()
        });
        let mut rec = record("t", "bg", None, 10);
        rec.response["status"] = json!("in_progress");
        store.put(&rec).await.unwrap();
        let frames = ["event: a\n\n".to_string(), "event: b\n\n".to_string()];
        assert!(store.append_events("bg", &frames).await.unwrap());
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(
            store.events("bg", 0).await.unwrap(),
            frames,
            "kept while it runs"
        );
        let mut done = rec.response.clone();
        done["status"] = json!("completed");
        assert!(store
            .update_if_active("t", "bg", &done, &rec.output_items)
            .await
            .unwrap());
        assert_eq!(store.events("bg", 1).await.unwrap(), frames[1..]);
        // Counted by what each append added, the log's bytes are what measuring it whole says.
        {
            let records = store.lock();
            let entry = &records.by_id["bg"];
            assert_eq!(
                entry.bytes,
                record_bytes(&entry.rec) + events_bytes(&entry.events)
            );
        }
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(store.events("bg", 0).await.unwrap().is_empty());
        assert!(
            store.get("t", "bg").await.unwrap().is_some(),
            "the response stays"
        );
    }

    #[tokio::test]
    async fn a_chain_cut_by_a_deletion_stays_cut_after_many_other_deletions() {
        let store = MemoryStore::default();
        store.put(&record("a", "r1", None, 10)).await.unwrap();
        store.put(&record("a", "r2", Some("r1"), 10)).await.unwrap();
        store.put(&record("a", "r3", Some("r2"), 10)).await.unwrap();
        assert!(store.delete("a", "r2").await.unwrap());
        // Continued after the deletion, from the deleted record (a turn that ran meanwhile).
        store.put(&record("a", "s3", Some("r2"), 10)).await.unwrap();
        // Another team deletes more records than the store remembers deletions of.
        for i in 0..=DELETED_REMEMBERED {
            let id = format!("x{i}");
            store.put(&record("b", &id, None, 10)).await.unwrap();
            assert!(store.delete("b", &id).await.unwrap());
        }
        for tip in ["r3", "s3"] {
            let history = store.history("a", tip).await.unwrap().unwrap();
            assert_eq!(
                history.root_id, tip,
                "the history starts after the deleted r2"
            );
        }
    }

    #[tokio::test]
    async fn a_lapsed_run_lease_is_kept_while_its_response_is() {
        let store = MemoryStore::default();
        store.put(&record("t", "kept", None, 10)).await.unwrap();
        for id in ["kept", "gone"] {
            store.hold_run(id, Duration::from_secs(30)).await.unwrap();
            store.end_run(id).await.unwrap();
        }
        // Many runs later, the map is pruned: the lapsed lease of a stored response stays,
        // that of a response the store does not hold goes.
        for i in 0..1_100 {
            store
                .hold_run(&format!("run{i}"), Duration::from_secs(30))
                .await
                .unwrap();
        }
        assert_eq!(store.run_held("kept").await.unwrap(), Some(false));
        assert_eq!(store.run_held("gone").await.unwrap(), None);
        assert_eq!(store.run_held("run7").await.unwrap(), Some(true));
    }

    #[tokio::test]
    async fn a_turn_written_after_its_predecessor_was_dropped_has_a_lost_history() {
        let store = bounded(2);
        store.put(&record("t", "a1", None, 1_000)).await.unwrap();
        store.history("t", "a1").await.unwrap();
        // While a2's turn runs, other traffic drops a1 for memory.
        for id in ["x1", "x2"] {
            store.put(&record("t", id, None, 1_000)).await.unwrap();
        }
        assert_eq!(store.get("t", "a1").await.unwrap(), None);
        store
            .put(&record("t", "a2", Some("a1"), 1_000))
            .await
            .unwrap();
        let err = store.history("t", "a2").await.unwrap_err();
        assert!(
            matches!(&err, StoreError::Lost { id, missing } if id == "a2" && missing == "a1"),
            "{err}"
        );
        // However many records went after it before the turn was written.
        store.put(&record("t", "f1", None, 1_000)).await.unwrap();
        for i in 0..5_000 {
            store
                .put(&record("t", &format!("y{i}"), None, 1_000))
                .await
                .unwrap();
        }
        store
            .put(&record("t", "f2", Some("f1"), 1_000))
            .await
            .unwrap();
        assert!(matches!(
            store.history("t", "f2").await,
            Err(StoreError::Lost { .. })
        ));
        // A deleted predecessor is where the history starts, as before.
        store.put(&record("t", "d1", None, 1_000)).await.unwrap();
        assert!(store.delete("t", "d1").await.unwrap());
        store
            .put(&record("t", "d2", Some("d1"), 1_000))
            .await
            .unwrap();
        let history = store.history("t", "d2").await.unwrap().unwrap();
        assert_eq!(history.root_id, "d2");
        // A predecessor that expired (while a later turn kept itself alive), swept or not.
        for sweep in [false, true] {
            let store = MemoryStore::default();
            store.put(&record("t", "e1", None, 1)).await.unwrap();
            store.put(&record("t", "e2", Some("e1"), 1)).await.unwrap();
            store.lock().by_id.get_mut("e1").unwrap().expires_at = Instant::now();
            if sweep {
                store.lock().next_sweep = Instant::now();
                store.put(&record("t", "x", None, 1)).await.unwrap();
                assert!(!store.lock().by_id.contains_key("e1"), "swept");
            }
            let err = store.history("t", "e2").await.unwrap_err();
            assert!(matches!(err, StoreError::Lost { .. }), "{err}");
        }
    }

    #[tokio::test]
    async fn an_idle_conversation_goes_whole_and_active_background_responses_stay() {
        let store = bounded(4);
        // A background response still queued, then an idle conversation x1 <- x2 <- x3.
        let mut queued = record("t", "bg", None, 1_000);
        queued.response["status"] = json!("queued");
        store.put(&queued).await.unwrap();
        store.put(&record("t", "x1", None, 1_000)).await.unwrap();
        store
            .put(&record("t", "x2", Some("x1"), 1_000))
            .await
            .unwrap();
        store
            .put(&record("t", "x3", Some("x2"), 1_000))
            .await
            .unwrap();
        // Past the bound: the queued response is the least recently used but stays; the
        // conversation's root is next, and the turns continuing it go with it.
        store.put(&record("t", "y1", None, 1_000)).await.unwrap();
        assert!(store.get("t", "bg").await.unwrap().is_some());
        for id in ["x1", "x2", "x3"] {
            assert_eq!(store.get("t", id).await.unwrap(), None, "{id}");
        }
        assert_eq!(store.evicted(), 3);
        let sum: u64 = store.lock().by_id.values().map(|e| e.bytes).sum();
        assert_eq!(store.memory_bytes(), sum);
    }

    #[tokio::test]
    async fn a_conversation_measured_by_its_appends_weighs_what_measuring_it_whole_says() {
        let store = MemoryStore::default();
        let record = ConversationRecord {
            id: "c".into(),
            team: "t".into(),
            created_at: 1,
            metadata: json!({"topic": "sizes"}),
        };
        let items =
            |n: usize| vec![json!({"type": "message", "role": "user", "content": "x".repeat(n)})];
        store
            .create_conversation(&record, &items(10))
            .await
            .unwrap();
        for (response, n) in [("resp_1", 100), ("", 7), ("resp_1", 5), ("resp_2", 900)] {
            store
                .append_conversation_items("t", "c", response, &items(n))
                .await
                .unwrap();
        }
        store
            .delete_conversation_item("t", "c", "none")
            .await
            .unwrap();
        let records = store.lock();
        let entry = &records.conversations["c"];
        assert_eq!(entry.items.len(), 4, "a response's items join once");
        assert_eq!(
            entry.bytes,
            conversation_bytes(&entry.record, &entry.items, &entry.joined)
        );
    }

    #[tokio::test]
    async fn conversations_count_toward_the_bound_and_go_least_recently_used() {
        let store = bounded(2);
        let conversation = |id: &str| ConversationRecord {
            id: id.into(),
            team: "t".into(),
            created_at: 1,
            metadata: json!({}),
        };
        let items = record("t", "r", None, 3_000).input_items;
        store
            .create_conversation(&conversation("c_old"), &items)
            .await
            .unwrap();
        store
            .create_conversation(&conversation("c_used"), &items)
            .await
            .unwrap();
        store.put(&record("t", "r1", None, 1_000)).await.unwrap();
        // Reading a conversation is a use: c_used is now the most recent.
        store.conversation_items("t", "c_used").await.unwrap();
        store.put(&record("t", "r2", None, 1_000)).await.unwrap();
        assert_eq!(store.get_conversation("t", "c_old").await.unwrap(), None);
        assert!(store
            .get_conversation("t", "c_used")
            .await
            .unwrap()
            .is_some());
        // Appends grow it; a second append for the same response adds nothing.
        let before = store.memory_bytes();
        store
            .append_conversation_items("t", "c_used", "resp_9", &items)
            .await
            .unwrap();
        let grown = store.memory_bytes();
        assert!(grown > before);
        store
            .append_conversation_items("t", "c_used", "resp_9", &items)
            .await
            .unwrap();
        assert_eq!(
            store
                .conversation_items("t", "c_used")
                .await
                .unwrap()
                .map(|i| i.len()),
            Some(2 * items.len())
        );
        let records = store.lock();
        let sum: u64 = records.by_id.values().map(|e| e.bytes).sum::<u64>()
            + records.conversations.values().map(|e| e.bytes).sum::<u64>();
        assert_eq!(records.bytes, sum);
    }

    #[tokio::test]
    async fn a_looping_chain_is_evicted_without_looping() {
        let store = bounded(2);
        store
            .put(&record("t", "a", Some("b"), 1_000))
            .await
            .unwrap();
        store
            .put(&record("t", "b", Some("a"), 1_000))
            .await
            .unwrap();
        store.put(&record("t", "c", None, 1_000)).await.unwrap();
        store.put(&record("t", "d", None, 1_000)).await.unwrap();
        assert_eq!(store.get("t", "a").await.unwrap(), None);
        assert_eq!(store.get("t", "b").await.unwrap(), None);
        assert_eq!(store.evicted(), 2);
    }

    #[tokio::test]
    async fn a_chain_a_running_background_response_continues_stays() {
        let store = bounded(3);
        store.put(&record("t", "x1", None, 1_000)).await.unwrap();
        let mut running = record("t", "x2", Some("x1"), 1_000);
        running.response["status"] = json!("in_progress");
        store.put(&running).await.unwrap();
        for id in ["y1", "y2", "y3"] {
            store.put(&record("t", id, None, 1_000)).await.unwrap();
        }
        let history = store.history("t", "x2").await.unwrap().unwrap();
        assert_eq!(history.root_id, "x1", "x2's run keeps its whole history");
    }

    #[tokio::test]
    async fn evicting_a_root_takes_its_continuations_with_it() {
        let store = bounded(3);
        store.put(&record("t", "x1", None, 1_000)).await.unwrap();
        store
            .put(&record("t", "x2", Some("x1"), 1_000))
            .await
            .unwrap();
        // x1 least recently used, x2 newer, then two unrelated records push past the bound.
        store.put(&record("t", "z1", None, 1_000)).await.unwrap();
        store.put(&record("t", "z2", None, 1_000)).await.unwrap();
        assert_eq!(store.get("t", "x1").await.unwrap(), None);
        assert_eq!(
            store.get("t", "x2").await.unwrap(),
            None,
            "no truncated chain left"
        );
        assert_eq!(store.history("t", "x2").await.unwrap(), None);
        assert_eq!(store.evicted(), 2);
    }

    #[tokio::test]
    async fn the_last_record_written_stays_even_alone_over_the_bound() {
        let store = bounded(1);
        store.put(&record("t", "small", None, 1_000)).await.unwrap();
        store
            .put(&record("t", "huge", None, 100_000))
            .await
            .unwrap();
        assert_eq!(store.len(), 1);
        assert!(store.get("t", "huge").await.unwrap().is_some());
        // A background record growing in place counts its new size.
        let store = bounded(2);
        let mut queued = record("t", "bg", None, 1_000);
        queued.response["status"] = json!("in_progress");
        store.put(&queued).await.unwrap();
        store.put(&record("t", "other", None, 1_000)).await.unwrap();
        let done = record("t", "bg", None, 50_000);
        assert!(store
            .update_if_active("t", "bg", &done.response, &done.output_items)
            .await
            .unwrap());
        assert_eq!(store.get("t", "other").await.unwrap(), None);
        assert_eq!(
            store.memory_bytes(),
            record_bytes(&store.lock().by_id["bg"].rec)
        );
    }

    #[tokio::test]
    async fn reuse_does_not_grow_the_use_list_without_bound() {
        let store = bounded(4);
        store.put(&record("t", "a1", None, 10)).await.unwrap();
        for _ in 0..10_000 {
            store.history("t", "a1").await.unwrap();
        }
        assert!(store.lock().lru.len() <= 2 + 1024);
    }

    #[tokio::test]
    async fn expired_records_are_invisible() {
        let store = MemoryStore::new(StoreOptions {
            ttl: Duration::from_millis(1),
            ..StoreOptions::default()
        });
        store.put(&record("t", "r1", None, 1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(store.get("t", "r1").await.unwrap(), None);
        assert_eq!(store.history("t", "r1").await.unwrap(), None);
        assert!(!store.delete("t", "r1").await.unwrap());
    }

    #[tokio::test]
    async fn history_refreshes_the_ttl_of_the_whole_chain() {
        let store = MemoryStore::default();
        store.put(&record("t", "r1", None, 1)).await.unwrap();
        store.put(&record("t", "r2", Some("r1"), 1)).await.unwrap();
        let soon = Instant::now() + Duration::from_secs(1);
        store.lock().by_id.get_mut("r1").unwrap().expires_at = soon;
        store.history("t", "r2").await.unwrap();
        assert!(store.lock().by_id["r1"].expires_at > soon);
    }

    #[tokio::test]
    async fn sweep_drops_expired_records() {
        let store = MemoryStore::new(StoreOptions {
            ttl: Duration::from_millis(1),
            ..StoreOptions::default()
        });
        store.put(&record("t", "r1", None, 1)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        store.lock().next_sweep = Instant::now();
        store.put(&record("t", "r2", None, 1)).await.unwrap();
        assert_eq!(store.len(), 1);
    }

    #[tokio::test]
    async fn pins_are_kept_to_their_share_of_the_bound() {
        let store = MemoryStore::new(StoreOptions {
            max_memory_bytes: 80_000,
            ..StoreOptions::default()
        });
        let share = 80_000 / PINS_SHARE;
        store
            .swap_pin("pool", "kept", None, &pin("e0", 0))
            .await
            .unwrap();
        for i in 0..1_000 {
            let session = format!("session-{i}");
            store
                .swap_pin("pool", &session, None, &pin("e1", 0))
                .await
                .unwrap();
            store.touch_pin("pool", "kept").await.unwrap();
            let held = store.lock().pin_bytes;
            assert!(held <= share, "pins take {held} bytes, over their {share}");
        }
        // The sessions still active keep their pins, the oldest idle ones went.
        assert_eq!(
            store.get_pin("pool", "kept").await.unwrap(),
            Some(pin("e0", 0))
        );
        let last = store.get_pin("pool", "session-999").await.unwrap();
        assert_eq!(last, Some(pin("e1", 0)));
        assert_eq!(store.get_pin("pool", "session-0").await.unwrap(), None);
        let dropped = store.pins_dropped();
        assert!(dropped > 900, "{dropped} of 1,001 pins dropped");
        assert_eq!(store.pin_count() as u64 + dropped, 1_001);
    }

    #[tokio::test]
    async fn pins_expire_after_their_own_ttl() {
        let pin_ttl = Duration::from_millis(20);
        let store = MemoryStore::new(StoreOptions {
            pin_ttl,
            ..StoreOptions::default()
        });
        pin_expiry_suite(&store, pin_ttl).await;
    }

    #[tokio::test]
    async fn swaps_reads_and_touches_refresh_a_pins_ttl() {
        let store = MemoryStore::default();
        store.swap_pin("p", "s", None, &pin("e0", 0)).await.unwrap();
        let key = pin_key("", "p", "s");
        let soon = Instant::now() + Duration::from_secs(1);
        let expiry = |store: &MemoryStore| store.lock().pins[&key].expires_at;
        let shorten = |store: &MemoryStore| {
            store.lock().pins.get_mut(&key).unwrap().expires_at = soon;
        };

        shorten(&store);
        store.get_pin("p", "s").await.unwrap();
        assert!(expiry(&store) > soon);
        shorten(&store);
        store.touch_pin("p", "s").await.unwrap();
        assert!(expiry(&store) > soon);

        shorten(&store);
        let lost = store
            .swap_pin("p", "s", Some(&pin("other", 0)), &pin("e1", 1))
            .await
            .unwrap();
        assert_eq!((lost.pin, lost.applied), (pin("e0", 0), false));
        assert!(expiry(&store) > soon);

        store.touch_pin("p", "never-pinned").await.unwrap();
        assert_eq!(store.pin_count(), 1);
    }

    #[tokio::test]
    async fn sweep_drops_expired_pins() {
        let store = MemoryStore::new(StoreOptions {
            pin_ttl: Duration::from_millis(1),
            ..StoreOptions::default()
        });
        store
            .swap_pin("p", "old", None, &pin("e0", 0))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        store.lock().next_sweep = Instant::now();
        store
            .swap_pin("p", "new", None, &pin("e0", 0))
            .await
            .unwrap();
        assert_eq!(store.pin_count(), 1);
    }

    #[tokio::test]
    async fn cyclic_chain_is_reported_not_looped() {
        let store = MemoryStore::default();
        store.put(&record("t", "a", Some("b"), 1)).await.unwrap();
        store.put(&record("t", "b", Some("a"), 1)).await.unwrap();
        let err = store.history("t", "a").await.unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    }
}
