//! The prefix index: which leading chunks of a prompt each endpoint's KV cache probably holds.
//!
//! The gateway never sees the engines' KV blocks (that needs KV events), so it keeps its own
//! approximate model of each replica's prefix cache, fed by its routing decisions (and, behind
//! several gateways sharing a store, by theirs: the gateway's route feed) and trimmed by what the
//! engines report back, and turns it into a prefix-match score in [0, 1] per endpoint.
//!
//! # Slots
//!
//! The index is keyed by each endpoint's stable [`Endpoint::slot`](crate::Endpoint::slot), never
//! by its position in the pool's current endpoint list, so a discovery reload that reorders,
//! adds or removes endpoints does not scramble what was learnt about the ones that stay. A slot
//! is added the first time it is recorded or sized ([`PrefixIndex::record`],
//! [`PrefixIndex::set_capacity`]); [`PrefixIndex::clear`] forgets one whose endpoint went away
//! or restarted, so the slot can be reused by the next endpoint. Slots at or above
//! [`MAX_SLOTS`] are ignored.
//!
//! # Chunk hashes
//!
//! The gateway does not tokenize. It hashes the *rendered prompt text* (the same bytes every turn
//! for the shared part of a conversation) in fixed-size byte chunks, assuming
//! [`PrefixIndexConfig::bytes_per_token`] bytes per token (default 4, typical of BPE tokenizers on
//! English text and code), so the default chunk of 256 bytes stands for about 64 tokens (four vLLM
//! blocks of 16). Only full chunks are hashed, as only full KV blocks are cached. With chunks
//! `c_0 .. c_{n-1}` (`n = floor(len / chunk_bytes)`), the chain is
//!
//! ```text
//! h_{-1} = XXH3_64(model name)            (the seed: one model's cache is no use to another)
//! h_i    = XXH3_64(c_i, seed = h_{i-1})   for i in 0..n
//! ```
//!
//! so `h_i` identifies the whole prefix `c_0 ..= c_i` under that model, like vLLM's chained block
//! hashes: two prompts share their leading `k` hashes exactly when they share their first `k`
//! chunks. Hashing streams at GB/s with one allocation (the output vector).
//!
//! # Per-slot LRU
//!
//! Each slot holds an LRU set of chunk hashes whose capacity, in chunks, follows the engine's
//! reported KV capacity (vLLM's `vllm:cache_config_info{block_size, num_gpu_blocks}`, see
//! [`kv_capacity_tokens`]):
//!
//! ```text
//! tokens_per_chunk = max(1, floor(chunk_bytes / bytes_per_token))
//! capacity_chunks  = floor(kv_tokens / tokens_per_chunk)   (kv_tokens = block_size * num_gpu_blocks)
//! ```
//!
//! so once more distinct chunks were sent there than fit, the least recently used are forgotten,
//! much as the engine evicts them. [`PrefixIndex::record`] touches a prompt's chunks last to first,
//! leaving the first chunk most recent: a prefix outlives its tail, as in vLLM (which evicts the
//! tail blocks of a freed request first), so what the index holds stays prefix-shaped.
//! A prompt longer than the capacity records only its first `capacity_chunks` chunks.
//!
//! The LRU is a slab of nodes in a doubly linked list (u32 links, free list) plus a hash map from
//! chunk hash to node: touch, insert, evict and remove are O(1).
//!
//! # Occupancy
//!
//! An index-wide logical clock ticks once per [`PrefixIndex::record`], and every chunk carries
//! the tick of the record that last touched it. [`PrefixIndex::occupancy`] reports, per slot,
//!
//! ```text
//! fraction(e) = held_chunks(e) / capacity_chunks(e)          (1 when the capacity is 0)
//! idle(e)     = clock - stamp(least recently used chunk of e)  (0 when e holds nothing)
//! ```
//!
//! An insertion into a full slot evicts its least recently used chunk, so `idle` says how cold
//! the victim of the next insertion is. Placing new prefixes where there is free room, and among
//! full slots where the victim is coldest, makes the fleet evict roughly as one LRU cache of its
//! total size would (the `kv_usage` scorer in [`crate::scorer`] does this).
//!
//! # Match and score
//!
//! ```text
//! match_len(e, h) = max { k : h_0 .. h_{k-1} all held by e }   (the scan stops at the first miss)
//! score(e, h)     = match_len(e, h) / n                       (0 when n = 0)
//! ```
//!
//! Scoring does not scan each slot's set. Next to the LRUs the index keeps a sharded map from
//! chunk hash to the bitmask of slots holding it (one map per group of 64 slots), and
//! [`PrefixIndex::match_lens`] walks the chunks once per group that has candidates, AND-ing an
//! "alive" mask: the cost is at most `n` lookups per such group, whatever the number of
//! endpoints in it, and stops at the longest match.
//!
//! # Corrections
//!
//! Responses carry `usage.input_tokens_details.cached_tokens`: how much of the prompt the
//! engine found cached *before* running it. By the time the report arrives the engine has run
//! the prompt and holds all of it (it caches what it computes), and the index recorded all of
//! it at routing, so the report says nothing wrong about this prompt. It does check the
//! prediction: when the request was picked the index believed the endpoint held `matched`
//! leading chunks, and the engine had only `reported` of them. Those it had lost were evicted
//! by traffic the index did not see (other gateway replicas, or their routes not yet received,
//! a smaller cache than modelled, a restart), and an LRU evicts the coldest first, so
//! [`PrefixIndex::correct`] forgets as many of the slot's least recently used chunks, sparing
//! the prompt just run (its most recent ones):
//!
//! ```text
//! reported = floor(n * cached_tokens / prompt_tokens)      (the engine's own token counts)
//! over     = max(0, matched - reported - slack)           slack = max(1, matched / 50)
//! forget   min(over, held(e) - min(n, held(e)))  least recently used chunks of e
//! ```
//!
//! `reported` converts the engine's cached tokens into chunks at this prompt's own ratio of
//! tokens to chunks, so the correction holds whatever bytes a token of this model and traffic
//! spans (a fixed ratio that is off by 15% would forget 15% of every match, every turn). The
//! ratio is the prompt's average, and the cached head of a prompt need not tokenize as densely
//! as its new tail: the slack (a chunk, or 2% of the match) keeps that from reading as
//! eviction. Without the prompt's token count the configured ratio stands in
//! (`floor(cached_tokens / tokens_per_chunk)`).
//!
//! The model then turns over at least as fast as the engine did; chunks forgotten in error are
//! learnt again by the next [`PrefixIndex::record`], so a correction only ever errs towards a
//! lower score. A report of more cached tokens than predicted changes nothing (another replica
//! put the prefix there; the routing record already has it).
//!
//! # Concurrency
//!
//! One mutex per slot guards its LRU; the holder maps are split in 16 read-write-locked shards.
//! Writers (record, correct, capacity changes) hold their slot's mutex while they set or clear
//! that slot's bits, so the bits converge to the LRU contents; scoring takes only shard read
//! locks, one lookup at a time. The slot table itself sits behind a read-write lock that only
//! the addition of a slot takes for writing. Occupancy figures are atomics copied out of the LRU
//! after every change, so reading them never waits for a writer. Map hashing is keyed per index with a random key, so
//! crafted prompts cannot pile chunk hashes into one bucket.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Default chunk size in bytes of rendered prompt text.
pub const DEFAULT_CHUNK_BYTES: usize = 256;
/// Default bytes of rendered prompt text per token.
pub const DEFAULT_BYTES_PER_TOKEN: usize = 4;
/// Default per-endpoint KV capacity in tokens, used until the engine reports its own.
pub const DEFAULT_CAPACITY_TOKENS: u64 = 512 * 1024;

/// Slots an index tracks at most; records for higher slots are ignored (an endpoint list reuses
/// the slots of removed endpoints, so a pool never needs this many).
pub const MAX_SLOTS: usize = 1 << 16;

/// Slots per holder bitmask.
const GROUP: usize = 64;
/// Shards per holder map.
const SHARDS: usize = 16;
/// Empty link in the LRU list.
const NIL: u32 = u32::MAX;

/// Chained chunk hashes of `prompt` under `model`: one per full `chunk_bytes` chunk (see the
/// module doc for the formula); empty when `chunk_bytes` is 0 or the prompt is shorter than a chunk.
pub fn chunk_hashes(model: &str, prompt: &[u8], chunk_bytes: usize) -> Vec<u64> {
    let mut out = Vec::new();
    chunk_hashes_into(model, prompt, chunk_bytes, &mut out);
    out
}

/// [`chunk_hashes`] into a caller-owned buffer (cleared first), to reuse its allocation.
pub fn chunk_hashes_into(model: &str, prompt: &[u8], chunk_bytes: usize, out: &mut Vec<u64>) {
    out.clear();
    if chunk_bytes == 0 {
        return;
    }
    out.reserve(prompt.len() / chunk_bytes);
    let mut parent = xxh3_64(model.as_bytes());
    for chunk in prompt.chunks_exact(chunk_bytes) {
        parent = xxh3_64_with_seed(chunk, parent);
        out.push(parent);
    }
}

/// KV capacity in tokens from vLLM's `cache_config_info{block_size, num_gpu_blocks}` labels.
pub fn kv_capacity_tokens(block_size: u64, num_gpu_blocks: u64) -> u64 {
    block_size.saturating_mul(num_gpu_blocks)
}

/// Sizes of the prefix index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixIndexConfig {
    /// Chunk size in bytes of rendered prompt text.
    pub chunk_bytes: usize,
    /// Assumed bytes of rendered prompt text per token.
    pub bytes_per_token: usize,
    /// Per-endpoint KV capacity in tokens until [`PrefixIndex::set_capacity`] says otherwise.
    pub default_capacity_tokens: u64,
}

impl Default for PrefixIndexConfig {
    fn default() -> Self {
        PrefixIndexConfig {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            bytes_per_token: DEFAULT_BYTES_PER_TOKEN,
            default_capacity_tokens: DEFAULT_CAPACITY_TOKENS,
        }
    }
}

/// Per-slot LRU sets of chunk hashes, plus a chunk -> slots map for fast scoring.
#[derive(Debug)]
pub struct PrefixIndex {
    config: PrefixIndexConfig,
    tokens_per_chunk: u64,
    default_capacity: usize,
    hash_state: ChunkHashState,
    /// Logical clock: one tick per [`PrefixIndex::record`], stamped on the chunks it touches.
    clock: AtomicU64,
    table: RwLock<Table>,
}

/// The per-slot state and the holder maps; grown (never shrunk) under the write lock.
#[derive(Debug)]
struct Table {
    slots: Vec<Slot>,
    holders: Vec<Holders>,
}

/// One slot: its LRU, and lock-free copies of the figures [`PrefixIndex::occupancy`] reads.
#[derive(Debug)]
struct Slot {
    lru: Mutex<Lru>,
    held: AtomicUsize,
    capacity: AtomicUsize,
    /// Stamp of the least recently used chunk (meaningless while empty).
    oldest: AtomicU64,
}

impl Slot {
    fn new(capacity: usize, hash_state: &ChunkHashState) -> Self {
        Slot {
            lru: Mutex::new(Lru::new(capacity, hash_state.clone())),
            held: AtomicUsize::new(0),
            capacity: AtomicUsize::new(capacity),
            oldest: AtomicU64::new(0),
        }
    }

    /// Copy the LRU's figures out; called with the LRU locked after every change.
    fn publish(&self, lru: &Lru) {
        self.held.store(lru.map.len(), Ordering::Relaxed);
        self.capacity.store(lru.capacity, Ordering::Relaxed);
        self.oldest.store(lru.oldest_stamp(), Ordering::Relaxed);
    }
}

/// How full a slot's modelled cache is, and how stale its eviction victim (see
/// [`PrefixIndex::occupancy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Occupancy {
    /// Chunks held.
    pub held_chunks: usize,
    /// Capacity in chunks.
    pub capacity_chunks: usize,
    /// Records (index-wide) since the least recently used chunk was last touched: how cold the
    /// chunk the next insertion would evict is. 0 when the slot holds nothing.
    pub idle: u64,
}

impl Occupancy {
    /// Whether an insertion would evict (a slot of capacity 0 is always full).
    pub fn is_full(&self) -> bool {
        self.held_chunks >= self.capacity_chunks
    }

    /// `held / capacity` in [0, 1]; 1 for a slot of capacity 0.
    pub fn fraction(&self) -> f64 {
        if self.capacity_chunks == 0 {
            1.0
        } else {
            (self.held_chunks as f64 / self.capacity_chunks as f64).min(1.0)
        }
    }
}

impl PrefixIndex {
    /// An empty index with room for slots `0..slots` (more are added when first used).
    pub fn new(slots: usize, config: PrefixIndexConfig) -> Self {
        let tokens_per_chunk = (config.chunk_bytes / config.bytes_per_token.max(1)).max(1) as u64;
        let index = PrefixIndex {
            config,
            tokens_per_chunk,
            default_capacity: chunks_for(config.default_capacity_tokens, tokens_per_chunk),
            hash_state: ChunkHashState::random(),
            clock: AtomicU64::new(0),
            table: RwLock::new(Table {
                slots: Vec::new(),
                holders: Vec::new(),
            }),
        };
        if slots > 0 {
            index.grow(slots - 1);
        }
        index
    }

    /// Number of slots tracked (one past the highest slot used so far).
    pub fn slots(&self) -> usize {
        self.read().slots.len()
    }

    /// The sizes the index was built with.
    pub fn config(&self) -> &PrefixIndexConfig {
        &self.config
    }

    /// Tokens one chunk stands for.
    pub fn tokens_per_chunk(&self) -> u64 {
        self.tokens_per_chunk
    }

    /// [`chunk_hashes`] with this index's chunk size.
    pub fn chunk_hashes(&self, model: &str, prompt: &[u8]) -> Vec<u64> {
        chunk_hashes(model, prompt, self.config.chunk_bytes)
    }

    /// Size a slot's LRU from its endpoint's KV capacity in tokens, evicting at once what no
    /// longer fits. Adds the slot if new; slots at or above [`MAX_SLOTS`] are ignored.
    pub fn set_capacity(&self, slot: usize, kv_tokens: u64) {
        self.grow(slot);
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return;
        };
        let mut lru = lock(&s.lru);
        let mut changes = Vec::new();
        lru.set_capacity(chunks_for(kv_tokens, self.tokens_per_chunk), &mut changes);
        apply(&table, slot, &changes);
        s.publish(&lru);
    }

    /// A slot's LRU capacity in chunks (the default capacity for a slot nothing was recorded in).
    pub fn capacity_chunks(&self, slot: usize) -> usize {
        self.occupancy(slot).capacity_chunks
    }

    /// Chunks a slot currently holds (0 for unknown slots).
    pub fn held_chunks(&self, slot: usize) -> usize {
        self.occupancy(slot).held_chunks
    }

    /// How full a slot is and how cold its eviction victim is, read without taking its LRU lock
    /// (a slot nothing was recorded in yet is empty, of the default capacity).
    pub fn occupancy(&self, slot: usize) -> Occupancy {
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return Occupancy {
                capacity_chunks: self.default_capacity,
                ..Occupancy::default()
            };
        };
        let held_chunks = s.held.load(Ordering::Relaxed);
        let idle = if held_chunks == 0 {
            0
        } else {
            self.clock
                .load(Ordering::Relaxed)
                .saturating_sub(s.oldest.load(Ordering::Relaxed))
        };
        Occupancy {
            held_chunks,
            capacity_chunks: s.capacity.load(Ordering::Relaxed),
            idle,
        }
    }

    /// Leading chunks of `hashes` a slot holds, stopping at the first miss.
    pub fn match_len(&self, slot: usize, hashes: &[u64]) -> usize {
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return 0;
        };
        let lru = lock(&s.lru);
        hashes.iter().take_while(|h| lru.contains(**h)).count()
    }

    /// [`PrefixIndex::match_len`] for each of `slots` (in any order, repeats allowed, unknown
    /// slots get 0), in one walk over the chunks per group of 64 slots.
    pub fn match_lens(&self, hashes: &[u64], slots: &[usize]) -> Vec<usize> {
        let mut lens = vec![0; slots.len()];
        let table = self.read();
        let known = table.slots.len();
        // (slot, position in `slots`), sorted so each group's slots are adjacent.
        let mut order: Vec<(usize, usize)> = slots
            .iter()
            .enumerate()
            .filter(|(_, &s)| s < known)
            .map(|(k, &s)| (s, k))
            .collect();
        order.sort_unstable();
        let mut group_lens = [0usize; GROUP];
        for members in order.chunk_by(|a, b| a.0 / GROUP == b.0 / GROUP) {
            let group = members[0].0 / GROUP;
            let Some(holders) = table.holders.get(group) else {
                continue;
            };
            let mut alive = members.iter().fold(0u64, |m, &(s, _)| m | 1 << (s % GROUP));
            group_lens.fill(0);
            let mut matched = 0;
            for h in hashes {
                let present = holders.get(*h);
                for bit in Bits(alive & !present) {
                    group_lens[bit] = matched;
                }
                alive &= present;
                if alive == 0 {
                    break;
                }
                matched += 1;
            }
            for bit in Bits(alive) {
                group_lens[bit] = matched;
            }
            for &(s, k) in members {
                lens[k] = group_lens[s % GROUP];
            }
        }
        lens
    }

    /// Prefix-match score in [0, 1] for each of `slots`: matched chunks / chunks in the prompt.
    pub fn score(&self, hashes: &[u64], slots: &[usize]) -> Vec<f64> {
        if hashes.is_empty() {
            return vec![0.0; slots.len()];
        }
        let total = hashes.len() as f64;
        self.match_lens(hashes, slots)
            .into_iter()
            .map(|m| m as f64 / total)
            .collect()
    }

    /// After routing a prompt to a slot's endpoint: insert or touch its chunks (first chunk most
    /// recent), evicting the least recently used beyond capacity. Adds the slot if new; slots at
    /// or above [`MAX_SLOTS`] are ignored.
    pub fn record(&self, slot: usize, hashes: &[u64]) {
        self.grow(slot);
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return;
        };
        let stamp = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        let mut lru = lock(&s.lru);
        let take = hashes.len().min(lru.capacity);
        let mut changes = Vec::new();
        for h in hashes[..take].iter().rev() {
            lru.touch(*h, stamp, &mut changes);
        }
        apply(&table, slot, &changes);
        s.publish(&lru);
    }

    /// The engine reported `cached_tokens` of the `prompt_tokens` (0: not reported) of the
    /// prompt `hashes`, sent to the slot's endpoint when the index believed it held
    /// `matched_chunks` leading chunks of it: forget as many of the slot's least recently used
    /// chunks as the prediction over-counted, sparing the prompt's own (see the module doc).
    /// Returns how many chunks were forgotten.
    pub fn correct(
        &self,
        slot: usize,
        hashes: &[u64],
        matched_chunks: usize,
        cached_tokens: u64,
        prompt_tokens: u64,
    ) -> usize {
        let reported = if prompt_tokens > 0 {
            let share = cached_tokens.min(prompt_tokens) as f64 / prompt_tokens as f64;
            (hashes.len() as f64 * share).floor() as usize
        } else {
            usize::try_from(cached_tokens / self.tokens_per_chunk).unwrap_or(usize::MAX)
        };
        let slack = (matched_chunks / 50).max(1);
        let over = matched_chunks.saturating_sub(reported.saturating_add(slack));
        if over == 0 {
            return 0;
        }
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return 0;
        };
        let mut lru = lock(&s.lru);
        let held = lru.map.len();
        let forget = over.min(held - hashes.len().min(held));
        let mut changes = Vec::with_capacity(forget);
        for _ in 0..forget {
            match lru.pop_lru() {
                Some(h) => changes.push((h, false)),
                None => break,
            }
        }
        apply(&table, slot, &changes);
        s.publish(&lru);
        changes.len()
    }

    /// Forget everything a slot holds (its endpoint went away, restarted or cleared its cache).
    /// The capacity stays; a new endpoint in the slot sets its own with
    /// [`PrefixIndex::set_capacity`].
    pub fn clear(&self, slot: usize) {
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return;
        };
        let mut lru = lock(&s.lru);
        let mut changes = Vec::with_capacity(lru.map.len());
        while let Some(h) = lru.pop_lru() {
            changes.push((h, false));
        }
        apply(&table, slot, &changes);
        s.publish(&lru);
    }

    /// Hand a slot to another endpoint: forget everything it holds and return it to the
    /// default capacity, until the new endpoint's engine reports its own
    /// ([`PrefixIndex::set_capacity`]); the old engine's size would be wrong for it.
    pub fn reset(&self, slot: usize) {
        self.clear(slot);
        let table = self.read();
        let Some(s) = table.slots.get(slot) else {
            return;
        };
        let mut lru = lock(&s.lru);
        let mut changes = Vec::new();
        lru.set_capacity(self.default_capacity, &mut changes);
        apply(&table, slot, &changes);
        s.publish(&lru);
    }

    /// Make sure `slot` exists (when below [`MAX_SLOTS`]).
    fn grow(&self, slot: usize) {
        if slot >= MAX_SLOTS || slot < self.read().slots.len() {
            return;
        }
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        while table.slots.len() <= slot {
            table
                .slots
                .push(Slot::new(self.default_capacity, &self.hash_state));
        }
        while table.holders.len() < table.slots.len().div_ceil(GROUP) {
            table.holders.push(Holders::new(&self.hash_state));
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Mirror LRU changes (`(hash, held)`, in order) into the holder bitmasks. Called with the
/// slot's LRU locked, so its bits follow its LRU.
fn apply(table: &Table, slot: usize, changes: &[(u64, bool)]) {
    let Some(holders) = table.holders.get(slot / GROUP) else {
        return;
    };
    let bit = 1u64 << (slot % GROUP);
    for &(h, held) in changes {
        holders.set(h, bit, held);
    }
}

/// `floor(tokens / tokens_per_chunk)`, clamped to what the LRU's u32 links can address.
fn chunks_for(tokens: u64, tokens_per_chunk: u64) -> usize {
    let chunks = tokens / tokens_per_chunk.max(1);
    usize::try_from(chunks.min(u64::from(NIL - 1))).unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Chunk hash -> bitmask of the slots (of one group of 64) holding it, in shards.
#[derive(Debug)]
struct Holders {
    shards: Box<[RwLock<HashMap<u64, u64, ChunkHashState>>]>,
}

impl Holders {
    fn new(hash_state: &ChunkHashState) -> Self {
        Holders {
            shards: (0..SHARDS)
                .map(|_| RwLock::new(HashMap::with_hasher(hash_state.clone())))
                .collect(),
        }
    }

    fn shard(&self, h: u64) -> &RwLock<HashMap<u64, u64, ChunkHashState>> {
        // SHARDS is a power of two no larger than 2^4; the top bits of an XXH3 output are uniform.
        &self.shards[(h >> 60) as usize % SHARDS]
    }

    fn get(&self, h: u64) -> u64 {
        let shard = self.shard(h).read().unwrap_or_else(PoisonError::into_inner);
        shard.get(&h).copied().unwrap_or(0)
    }

    fn set(&self, h: u64, bit: u64, held: bool) {
        let mut shard = self
            .shard(h)
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if held {
            *shard.entry(h).or_insert(0) |= bit;
        } else if let Entry::Occupied(mut e) = shard.entry(h) {
            *e.get_mut() &= !bit;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }
}

/// Iterates the set bit positions of a mask.
struct Bits(u64);

impl Iterator for Bits {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

/// One LRU list node.
#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    /// Clock value of the record that last touched the chunk.
    stamp: u64,
    prev: u32,
    next: u32,
}

/// O(1) LRU set of chunk hashes: slab-backed doubly linked list (head = most recent) + slot map.
#[derive(Debug)]
struct Lru {
    map: HashMap<u64, u32, ChunkHashState>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    capacity: usize,
}

impl Lru {
    fn new(capacity: usize, hash_state: ChunkHashState) -> Self {
        Lru {
            map: HashMap::with_hasher(hash_state),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity,
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.map.contains_key(&h)
    }

    /// Stamp of the least recently used hash (0 when empty).
    fn oldest_stamp(&self) -> u64 {
        if self.tail == NIL {
            0
        } else {
            self.nodes[self.tail as usize].stamp
        }
    }

    /// Make `h` the most recent, stamped `stamp`, inserting it (and evicting the least recent
    /// beyond capacity) if absent. Pushes `(hash, held)` for every membership change.
    fn touch(&mut self, h: u64, stamp: u64, changes: &mut Vec<(u64, bool)>) {
        if let Some(&slot) = self.map.get(&h) {
            self.nodes[slot as usize].stamp = stamp;
            self.unlink(slot);
            self.push_front(slot);
            return;
        }
        if self.capacity == 0 {
            return;
        }
        while self.map.len() >= self.capacity {
            match self.pop_lru() {
                Some(old) => changes.push((old, false)),
                None => break,
            }
        }
        let node = Node {
            hash: h,
            stamp,
            prev: NIL,
            next: NIL,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                // The capacity is clamped below NIL, so the slab never needs slot NIL.
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(h, slot);
        self.push_front(slot);
        changes.push((h, true));
    }

    /// Remove and return the least recently used hash.
    fn pop_lru(&mut self) -> Option<u64> {
        if self.tail == NIL {
            return None;
        }
        let slot = self.tail;
        let h = self.nodes[slot as usize].hash;
        self.map.remove(&h);
        self.unlink(slot);
        self.free.push(slot);
        Some(h)
    }

    fn set_capacity(&mut self, capacity: usize, changes: &mut Vec<(u64, bool)>) {
        self.capacity = capacity;
        while self.map.len() > capacity {
            match self.pop_lru() {
                Some(old) => changes.push((old, false)),
                None => break,
            }
        }
        if self.map.is_empty() {
            // Give the memory of a shrunk-to-nothing endpoint back.
            self.nodes = Vec::new();
            self.free = Vec::new();
        }
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old_head = self.head;
        {
            let node = &mut self.nodes[slot as usize];
            node.prev = NIL;
            node.next = old_head;
        }
        if old_head == NIL {
            self.tail = slot;
        } else {
            self.nodes[old_head as usize].prev = slot;
        }
        self.head = slot;
    }

    /// Hashes from most to least recent.
    #[cfg(test)]
    fn order(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut at = self.head;
        while at != NIL {
            let node = self.nodes[at as usize];
            out.push(node.hash);
            at = node.next;
        }
        out
    }
}

/// Keyed hashing for maps whose keys are already XXH3 outputs: one seeded XXH3 of the 8 bytes,
/// with a random per-index key.
#[derive(Debug, Clone)]
struct ChunkHashState {
    key: u64,
}

impl ChunkHashState {
    fn random() -> Self {
        ChunkHashState {
            key: RandomState::new().hash_one(0x5eed_u64),
        }
    }
}

impl BuildHasher for ChunkHashState {
    type Hasher = ChunkHasher;
    fn build_hasher(&self) -> ChunkHasher {
        ChunkHasher {
            key: self.key,
            state: 0,
        }
    }
}

/// Hasher built by [`ChunkHashState`].
#[derive(Debug)]
struct ChunkHasher {
    key: u64,
    state: u64,
}

impl Hasher for ChunkHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.state = xxh3_64_with_seed(bytes, self.key ^ self.state);
    }
    fn write_u64(&mut self, n: u64) {
        self.state = xxh3_64_with_seed(&n.to_le_bytes(), self.key ^ self.state);
    }
    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(bytes: usize, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..bytes).map(|_| rng.lowercase() as u8).collect()
    }

    /// A slot's hashes from most to least recent.
    fn order(index: &PrefixIndex, slot: usize) -> Vec<u64> {
        let table = index.read();
        let lru = lock(&table.slots[slot].lru);
        lru.order()
    }

    fn config(chunk_bytes: usize, capacity_tokens: u64) -> PrefixIndexConfig {
        PrefixIndexConfig {
            chunk_bytes,
            bytes_per_token: 4,
            default_capacity_tokens: capacity_tokens,
        }
    }

    #[test]
    fn hashes_chain_over_full_chunks_and_depend_on_the_model() {
        let a = text(1000, 1);
        let mut b = a.clone();
        b[700] ^= 1; // differs in chunk 2 (bytes 512..768)
        let ha = chunk_hashes("m", &a, 256);
        let hb = chunk_hashes("m", &b, 256);
        assert_eq!(ha.len(), 3, "only full chunks are hashed");
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // Chained: the same chunk after a different prefix hashes differently.
        let mut c = a.clone();
        c[0] ^= 1;
        let hc = chunk_hashes("m", &c, 256);
        assert!(ha.iter().zip(&hc).all(|(x, y)| x != y));
        // Seeded with the model name.
        let other = chunk_hashes("other-model", &a, 256);
        assert!(ha.iter().zip(&other).all(|(x, y)| x != y));
        // Growing the prompt keeps the existing hashes.
        let mut longer = a.clone();
        longer.extend(text(600, 2));
        assert_eq!(chunk_hashes("m", &longer, 256)[..3], ha[..]);
        // Degenerate inputs.
        assert!(chunk_hashes("m", &a[..255], 256).is_empty());
        assert!(chunk_hashes("m", &a, 0).is_empty());
        let mut buf = vec![1, 2, 3];
        chunk_hashes_into("m", &a, 256, &mut buf);
        assert_eq!(buf, ha);
    }

    #[test]
    fn match_len_stops_at_the_first_miss() {
        let index = PrefixIndex::new(2, config(4, 1000));
        index.record(0, &[1, 2, 3, 5]);
        assert_eq!(index.match_len(0, &[1, 2, 3, 4, 5]), 3);
        assert_eq!(index.match_len(0, &[1, 2, 3, 5]), 4);
        assert_eq!(index.match_len(0, &[9, 1, 2]), 0);
        assert_eq!(index.match_len(0, &[]), 0);
        assert_eq!(index.match_len(1, &[1, 2]), 0);
        assert_eq!(index.match_len(7, &[1, 2]), 0, "unknown slot");
    }

    #[test]
    fn lru_evicts_least_recent_and_keeps_prefixes() {
        // 4-byte chunks at 4 bytes/token: 1 token per chunk; capacity 4 chunks.
        let index = PrefixIndex::new(1, config(4, 4));
        assert_eq!(index.capacity_chunks(0), 4);
        index.record(0, &[1, 2, 3]);
        assert_eq!(order(&index, 0), vec![1, 2, 3]);
        index.record(0, &[1, 2, 10, 11]); // 3 is least recent: evicted
        assert_eq!(order(&index, 0), vec![1, 2, 10, 11]);
        assert_eq!(index.held_chunks(0), 4);
        assert_eq!(index.match_len(0, &[1, 2, 3]), 2);
        // A touch refreshes without inserting.
        index.record(0, &[11]);
        assert_eq!(order(&index, 0), vec![11, 1, 2, 10]);
        index.record(0, &[20]);
        assert_eq!(order(&index, 0), vec![20, 11, 1, 2]);
        // A prompt longer than the capacity records only its first chunks.
        index.record(0, &[30, 31, 32, 33, 34, 35]);
        assert_eq!(order(&index, 0), vec![30, 31, 32, 33]);
        assert_eq!(index.match_lens(&[30, 31, 32, 33, 34], &[0]), vec![4]);
        // Shrinking evicts at once; growing keeps contents.
        index.set_capacity(0, 2);
        assert_eq!(order(&index, 0), vec![30, 31]);
        assert_eq!(index.match_lens(&[30, 31, 32], &[0]), vec![2]);
        index.set_capacity(0, 8);
        index.record(0, &[40, 41]);
        assert_eq!(order(&index, 0), vec![40, 41, 30, 31]);
        // Capacity 0 holds nothing.
        index.set_capacity(0, 0);
        index.record(0, &[50]);
        assert_eq!(index.held_chunks(0), 0);
        assert_eq!(index.match_lens(&[40, 50], &[0]), vec![0]);
    }

    #[test]
    fn capacity_follows_kv_tokens() {
        // 256-byte chunks at 4 bytes/token = 64 tokens per chunk.
        let index = PrefixIndex::new(1, PrefixIndexConfig::default());
        assert_eq!(index.tokens_per_chunk(), 64);
        assert_eq!(index.capacity_chunks(0), 8192);
        index.set_capacity(0, kv_capacity_tokens(16, 40_000));
        assert_eq!(index.capacity_chunks(0), 10_000);
        index.set_capacity(0, 63);
        assert_eq!(index.capacity_chunks(0), 0);
        assert_eq!(kv_capacity_tokens(u64::MAX, 2), u64::MAX);
        index.set_capacity(0, u64::MAX);
        assert_eq!(index.capacity_chunks(0), (NIL - 1) as usize);
    }

    #[test]
    fn lru_slab_reuses_slots_under_churn() {
        let index = PrefixIndex::new(1, config(4, 100));
        for round in 0..50u64 {
            let hashes: Vec<u64> = (0..60).map(|i| round * 1000 + i).collect();
            index.record(0, &hashes);
            assert_eq!(index.match_len(0, &hashes), 60);
        }
        let table = index.read();
        let lru = lock(&table.slots[0].lru);
        assert_eq!(lru.map.len(), 100);
        assert!(lru.nodes.len() <= 100, "slab grew to {}", lru.nodes.len());
        assert_eq!(lru.order().len(), 100);
    }

    #[test]
    fn corrections_forget_as_many_cold_chunks_as_were_over_predicted() {
        // 4 tokens per chunk configured, 12 chunks per slot.
        let index = PrefixIndex::new(2, config(16, 48));
        let old = [100, 101, 102, 103];
        let session = [1, 2, 3, 4, 5, 6];
        index.record(0, &old);
        index.record(0, &session[..4]);
        // The next turn was picked believing 4 chunks held; routing recorded all 6.
        index.record(0, &session);
        assert_eq!(index.held_chunks(0), 10);
        // The engine had only 4 of the prompt's 24 tokens = 1 chunk: with a chunk of slack, 2
        // chunks over-predicted. The coldest go: the tail of the old prompt.
        assert_eq!(index.correct(0, &session, 4, 4, 24), 2);
        assert_eq!(index.match_len(0, &old), 2);
        assert_eq!(index.match_len(0, &session), 6, "the prompt just run stays");
        // A prediction the engine met or beat changes nothing; nor does one a chunk short (the
        // engine recomputes a prompt's last block).
        assert_eq!(index.correct(0, &session, 6, 24, 24), 0);
        assert_eq!(index.correct(0, &session, 6, 20, 24), 0);
        assert_eq!(index.correct(0, &session, 0, 0, 24), 0, "a cold first turn");
        assert_eq!(index.correct(0, &session, 6, u64::MAX, 24), 0);
        // Never more than the chunks outside the prompt just run.
        assert_eq!(index.correct(0, &session, 1000, 0, 24), 2);
        assert_eq!(index.match_len(0, &old), 0);
        assert_eq!(index.match_len(0, &session), 6);
        assert_eq!(index.correct(0, &session, 1000, 0, 24), 0);
        // Holder bits follow, and other slots are untouched.
        index.record(1, &old);
        assert_eq!(index.match_lens(&old, &[0, 1]), vec![0, 4]);
        assert_eq!(index.correct(9, &session, 6, 0, 24), 0, "unknown slot");
    }

    #[test]
    fn corrections_read_cached_tokens_at_the_prompts_own_ratio() {
        // The index assumes 4 tokens per chunk; this model's tokens span twice the bytes: the
        // 6-chunk prompt is 12 tokens, all but its last one cached.
        let index = PrefixIndex::new(1, config(16, 48));
        let old = [100, 101, 102, 103];
        let session = [1, 2, 3, 4, 5, 6];
        index.record(0, &old);
        index.record(0, &session);
        assert_eq!(index.correct(0, &session, 6, 11, 12), 0, "nothing was lost");
        assert_eq!(index.match_len(0, &old), 4);
        // Without the prompt's token count the configured ratio reads 11 tokens as 2 chunks.
        assert_eq!(index.correct(0, &session, 6, 11, 0), 3);
    }

    #[test]
    fn scores_several_endpoints() {
        let index = PrefixIndex::new(4, config(4, 1000));
        let prompt = [10, 11, 12, 13, 14, 15, 16, 17];
        index.record(0, &prompt[..2]); // shared system prompt only
        index.record(1, &prompt); // the session's replica
        index.record(2, &[10, 11, 12, 99]); // a fork of the conversation
        index.record(3, &[11, 12, 13]); // the middle without the start: no prefix match
        assert_eq!(
            index.score(&prompt, &[0, 1, 2, 3]),
            vec![0.25, 1.0, 0.375, 0.0]
        );
        // Candidates in any order, repeated or unknown.
        assert_eq!(
            index.score(&prompt, &[2, 1, 2, 42]),
            vec![0.375, 1.0, 0.375, 0.0]
        );
        assert_eq!(index.score(&[], &[0, 1]), vec![0.0, 0.0]);
        assert!(index.score(&prompt, &[]).is_empty());
        for e in 0..4 {
            assert_eq!(
                index.match_lens(&prompt, &[e]),
                vec![index.match_len(e, &prompt)]
            );
        }
        index.clear(1);
        assert_eq!(index.held_chunks(1), 0);
        assert_eq!(index.score(&prompt, &[1, 0]), vec![0.0, 0.25]);
    }

    #[test]
    fn a_slot_handed_to_another_endpoint_returns_to_the_default_capacity() {
        let index = PrefixIndex::new(2, config(16, 48)); // 12 chunks by default
        index.set_capacity(0, 16); // a small engine: 4 chunks
        index.record(0, &[1, 2, 3]);
        index.clear(0);
        assert_eq!(
            index.capacity_chunks(0),
            4,
            "a restart keeps the engine's size"
        );
        index.record(0, &[1, 2, 3]);
        index.reset(0);
        assert_eq!((index.held_chunks(0), index.capacity_chunks(0)), (0, 12));
    }

    #[test]
    fn scores_more_than_64_endpoints() {
        let index = PrefixIndex::new(130, config(4, 1000));
        let prompt: Vec<u64> = (100..110).collect();
        for e in 0..130 {
            index.record(e, &prompt[..e % 11]);
        }
        let all: Vec<usize> = (0..130).collect();
        let lens = index.match_lens(&prompt, &all);
        assert_eq!(lens, all.iter().map(|e| e % 11).collect::<Vec<_>>());
        assert_eq!(index.score(&prompt, &[129])[0], 0.8);
    }

    #[test]
    fn a_slot_nothing_was_recorded_in_is_empty_not_full() {
        let index = PrefixIndex::new(0, config(4, 200));
        let unseen = index.occupancy(7);
        assert_eq!((unseen.held_chunks, unseen.capacity_chunks), (0, 200));
        assert!(!unseen.is_full());
        assert_eq!(unseen.fraction(), 0.0);
    }

    #[test]
    fn concurrent_records_and_scores_stay_consistent() {
        // Slots spread over three groups of 64 and added while other threads score and record.
        let slots: Vec<usize> = (0..8).map(|e| e * 20).collect();
        let index = PrefixIndex::new(0, config(4, 200));
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (index, slots) = (&index, &slots);
                s.spawn(move || {
                    for round in 0..200u64 {
                        let e = slots[((t + round) % 8) as usize];
                        let hashes: Vec<u64> = (0..50).map(|i| (round % 7) * 100 + i).collect();
                        index.record(e, &hashes);
                        let _ = index.score(&hashes, slots);
                        let _ = index.occupancy(e);
                        if round % 5 == 0 {
                            index.correct(e, &hashes[..10], 50, 40, 0);
                        }
                    }
                });
            }
        });
        // Quiescent: the bitmasks agree with the LRUs.
        for round in 0..7u64 {
            let hashes: Vec<u64> = (0..50).map(|i| round * 100 + i).collect();
            let expected: Vec<usize> = slots.iter().map(|&e| index.match_len(e, &hashes)).collect();
            assert_eq!(index.match_lens(&hashes, &slots), expected);
        }
        for &e in &slots {
            let lru_len = lock(&index.read().slots[e].lru).map.len();
            assert_eq!(index.held_chunks(e), lru_len);
        }
    }

    #[test]
    fn slots_are_added_on_first_use_and_sparse_slots_score() {
        let index = PrefixIndex::new(0, config(4, 1000));
        assert_eq!(index.slots(), 0);
        assert_eq!(index.score(&[1, 2], &[0, 3]), vec![0.0, 0.0]);
        index.record(3, &[1, 2, 3, 4]);
        assert_eq!(index.slots(), 4);
        assert_eq!(index.capacity_chunks(3), 1000);
        // A slot in a later group of 64, and slots asked for out of order.
        index.record(200, &[1, 2]);
        index.set_capacity(130, 5);
        assert_eq!(index.slots(), 201);
        assert_eq!(index.capacity_chunks(130), 5);
        assert_eq!(
            index.match_lens(&[1, 2, 3, 4], &[200, 3, 0, 130, 3, 999]),
            vec![2, 4, 0, 0, 4, 0]
        );
        // Forgetting one slot leaves the others.
        index.clear(3);
        assert_eq!(index.match_lens(&[1, 2, 3, 4], &[3, 200]), vec![0, 2]);
        assert_eq!(index.capacity_chunks(3), 1000, "clear keeps the capacity");
        // Beyond the limit: ignored, never allocated.
        index.record(MAX_SLOTS, &[1]);
        index.set_capacity(usize::MAX, 10);
        assert_eq!(index.slots(), 201);
        assert_eq!(index.match_len(MAX_SLOTS, &[1]), 0);
        assert_eq!(index.occupancy(usize::MAX).held_chunks, 0);
    }

    #[test]
    fn occupancy_tracks_fill_and_the_coldest_victim() {
        // 1 token per chunk; capacity 4 chunks.
        let index = PrefixIndex::new(2, config(4, 4));
        let empty = index.occupancy(0);
        assert_eq!(
            (empty.held_chunks, empty.capacity_chunks, empty.idle),
            (0, 4, 0)
        );
        assert_eq!(empty.fraction(), 0.0);
        assert!(!empty.is_full());
        index.record(0, &[1, 2]); // clock 1
        index.record(1, &[5, 6, 7, 8]); // clock 2
        index.record(1, &[9]); // clock 3: evicts 8, victim now 7 (touched at 2)
        let a = index.occupancy(0);
        assert_eq!((a.held_chunks, a.idle), (2, 2));
        assert_eq!(a.fraction(), 0.5);
        let b = index.occupancy(1);
        assert_eq!((b.held_chunks, b.idle), (4, 1));
        assert!(b.is_full());
        index.record(0, &[1, 2, 3, 4]); // clock 4: slot 0 full, every chunk fresh
        assert_eq!(index.occupancy(0).idle, 0);
        assert_eq!(index.occupancy(1).idle, 2);
        // Corrections and clears update the figures too.
        assert_eq!(index.correct(1, &[9], 4, 1, 0), 2);
        assert_eq!(index.occupancy(1).held_chunks, 2);
        index.clear(1);
        assert_eq!(
            index.occupancy(1),
            Occupancy {
                held_chunks: 0,
                capacity_chunks: 4,
                idle: 0
            }
        );
        index.set_capacity(1, 0);
        assert!(index.occupancy(1).is_full());
        assert_eq!(index.occupancy(1).fraction(), 1.0);
    }
}
