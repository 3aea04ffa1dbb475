//! The paged KV-cache model: full blocks identified by chained hashes, reference counts for
//! running sequences, LRU eviction of unreferenced blocks, prefix hits counted in tokens.
//!
//! A block's hash is `xxh3_64(parent_hash_le || token_ids_le)` (the first block's parent is 0), so
//! equal hashes mean equal prefixes, as in vLLM. Every *full* block of a sequence is hashed and
//! shared: the prompt's full blocks when the sequence is admitted ([`KvCache::acquire`]), and each
//! later block as soon as generated tokens fill it ([`KvCache::promote`]), so the next turn of a
//! conversation, whose prompt repeats the previous prompt and answer, hits through the answer. Only
//! the partial tail block is *private* to a sequence and merely counted. Unreferenced hashed
//! blocks stay cached until their space is needed, evicted least-recently-freed first (a sequence
//! frees its blocks tail first, so the tail of a prefix goes before its head). Every change is
//! published through the optional [`KvEventSink`].

use std::collections::{BTreeMap, HashMap};

use crate::kv_events::{KvEvent, KvEventSink};

/// Chained hashes of the full blocks of `tokens`.
pub fn chain_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let block_size = block_size.max(1);
    let mut hashes = Vec::with_capacity(tokens.len() / block_size);
    let mut buffer = Vec::with_capacity(8 + block_size * 4);
    extend_chain(&mut hashes, tokens, block_size, &mut buffer);
    hashes
}

/// Append to `hashes` (the chain of the first `hashes.len()` blocks of `tokens`) the hashes of the
/// remaining full blocks of `tokens`; `buffer` is scratch space reused between calls.
pub fn extend_chain(
    hashes: &mut Vec<u64>,
    tokens: &[u32],
    block_size: usize,
    buffer: &mut Vec<u8>,
) {
    let block_size = block_size.max(1);
    let mut parent = hashes.last().copied().unwrap_or(0);
    let done = hashes.len().saturating_mul(block_size);
    for block in tokens
        .get(done..)
        .unwrap_or_default()
        .chunks_exact(block_size)
    {
        buffer.clear();
        buffer.extend_from_slice(&parent.to_le_bytes());
        for token in block {
            buffer.extend_from_slice(&token.to_le_bytes());
        }
        parent = xxhash_rust::xxh3::xxh3_64(buffer);
        hashes.push(parent);
    }
}

/// Newly stored blocks of one sequence, as runs of consecutive block indexes.
#[derive(Debug, Default)]
struct StoredRuns {
    /// (index of the run's first block, its hashes).
    runs: Vec<(usize, Vec<u64>)>,
}

impl StoredRuns {
    /// Record block `index` with `hash` (only when events are published: `wanted`).
    fn push(&mut self, index: usize, hash: u64, wanted: bool) {
        if !wanted {
            return;
        }
        match self.runs.last_mut() {
            Some((start, run)) if *start + run.len() == index => run.push(hash),
            _ => self.runs.push((index, vec![hash])),
        }
    }
}

#[derive(Debug)]
struct CachedBlock {
    /// Block id (slot in the simulated GPU block table).
    slot: u32,
    /// Running sequences (and pins) holding this block.
    refcount: u32,
    /// Position in the eviction order while unreferenced.
    freed_at: u64,
}

/// What [`KvCache::acquire`] did for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acquired {
    /// Leading blocks that were already cached (prefix hit).
    pub hit_blocks: usize,
}

/// The KV-cache of one replica.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    capacity: usize,
    blocks: HashMap<u64, CachedBlock>,
    evictable: BTreeMap<u64, u64>,
    /// Slots freed by eviction, reused last-freed first.
    free_slots: Vec<u32>,
    /// Slots never used yet are `next_slot..capacity` (allocated lazily, so a large capacity
    /// costs nothing up front).
    next_slot: u32,
    private_in_use: usize,
    next_stamp: u64,
    sink: Option<KvEventSink>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens.
    pub fn new(block_size: usize, capacity: usize, sink: Option<KvEventSink>) -> Self {
        KvCache {
            block_size: block_size.max(1),
            capacity,
            blocks: HashMap::new(),
            evictable: BTreeMap::new(),
            free_slots: Vec::new(),
            next_slot: 0,
            private_in_use: 0,
            next_stamp: 0,
            sink,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held by running sequences or pins (not counting unreferenced cached blocks).
    pub fn used_blocks(&self) -> usize {
        self.blocks.len() - self.evictable.len() + self.private_in_use
    }

    /// Blocks that can be handed out now (empty plus evictable).
    pub fn available_blocks(&self) -> usize {
        self.capacity.saturating_sub(self.used_blocks())
    }

    /// Fraction of blocks in use, 0.0..=1.0.
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        self.used_blocks() as f64 / self.capacity as f64
    }

    /// Every block hash currently cached (referenced or not).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.blocks.keys().copied().collect()
    }

    /// Whether a block with this hash is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Number of leading `hashes` that are cached.
    pub fn cached_prefix_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|hash| self.blocks.contains_key(hash))
            .count()
    }

    /// Block ids of cached blocks, in the order of `hashes` (unknown hashes are skipped).
    pub fn slots_of(&self, hashes: &[u64]) -> Vec<u32> {
        hashes
            .iter()
            .filter_map(|hash| self.blocks.get(hash).map(|block| block.slot))
            .collect()
    }

    /// Reference the blocks of `hashes` (whose tokens are `tokens`) plus `private` unhashed blocks,
    /// storing missing blocks and evicting as needed; `None` (and no change) if they do not fit.
    pub fn acquire(&mut self, hashes: &[u64], tokens: &[u32], private: usize) -> Option<Acquired> {
        let hit_blocks = self.cached_prefix_blocks(hashes);
        let mut newly_referenced = private;
        for hash in hashes {
            match self.blocks.get(hash) {
                Some(block) if block.refcount == 0 => newly_referenced += 1,
                Some(_) => {}
                None => newly_referenced += 1,
            }
        }
        if newly_referenced > self.available_blocks() {
            return None;
        }
        let mut removed = Vec::new();
        let mut stored = StoredRuns::default();
        for (index, hash) in hashes.iter().enumerate() {
            if !self.reference(*hash, &mut removed) {
                stored.push(index, *hash, self.sink.is_some());
            }
        }
        for _ in 0..private {
            if self.blocks.len() + self.private_in_use >= self.capacity {
                self.evict_one(&mut removed);
            }
            self.private_in_use += 1;
        }
        self.publish_removed(removed);
        self.publish_stored(stored, hashes, tokens);
        Some(Acquired { hit_blocks })
    }

    /// Cache the blocks `hashes[start..]` of a sequence whose token ids are `tokens`: blocks it
    /// held as private blocks until generated tokens filled them. Each takes over the space of one
    /// private block, or, when a block with the same hash is already cached, shares that one and
    /// frees the private block. Never evicts.
    pub fn promote(&mut self, hashes: &[u64], start: usize, tokens: &[u32]) {
        let mut removed = Vec::new();
        let mut stored = StoredRuns::default();
        for (index, hash) in hashes.iter().enumerate().skip(start) {
            self.private_in_use = self.private_in_use.saturating_sub(1);
            if !self.reference(*hash, &mut removed) {
                stored.push(index, *hash, self.sink.is_some());
            }
        }
        self.publish_removed(removed);
        self.publish_stored(stored, hashes, tokens);
    }

    /// Reference the block `hash`: true if it was cached, else store it (evicting if needed).
    fn reference(&mut self, hash: u64, removed: &mut Vec<u64>) -> bool {
        if let Some(block) = self.blocks.get_mut(&hash) {
            if block.refcount == 0 {
                self.evictable.remove(&block.freed_at);
            }
            block.refcount += 1;
            return true;
        }
        let slot = self.take_slot(removed);
        self.blocks.insert(
            hash,
            CachedBlock {
                slot,
                refcount: 1,
                freed_at: 0,
            },
        );
        false
    }

    /// Publish one `BlockStored` per run of consecutive newly stored blocks of a sequence.
    fn publish_stored(&self, stored: StoredRuns, hashes: &[u64], tokens: &[u32]) {
        if self.sink.is_none() {
            return;
        }
        for (start, run) in stored.runs {
            let parent_block_hash = start.checked_sub(1).and_then(|i| hashes.get(i)).copied();
            let first_token = start * self.block_size;
            let last_token = ((start + run.len()) * self.block_size).min(tokens.len());
            let token_ids = tokens
                .get(first_token..last_token)
                .unwrap_or_default()
                .to_vec();
            self.emit(KvEvent::BlockStored {
                block_hashes: run,
                parent_block_hash,
                token_ids,
                block_size: self.block_size as u32,
            });
        }
    }

    /// Reference `extra` more private blocks for a growing sequence; false if they do not fit.
    pub fn grow_private(&mut self, extra: usize) -> bool {
        if extra > self.available_blocks() {
            return false;
        }
        let mut removed = Vec::new();
        for _ in 0..extra {
            if self.blocks.len() + self.private_in_use >= self.capacity {
                self.evict_one(&mut removed);
            }
            self.private_in_use += 1;
        }
        self.publish_removed(removed);
        true
    }

    /// Drop one reference to each of `hashes` (freed tail first) and release `private` blocks.
    pub fn release(&mut self, hashes: &[u64], private: usize) {
        self.private_in_use = self.private_in_use.saturating_sub(private);
        for hash in hashes.iter().rev() {
            if let Some(block) = self.blocks.get_mut(hash) {
                block.refcount = block.refcount.saturating_sub(1);
                if block.refcount == 0 {
                    block.freed_at = self.next_stamp;
                    self.evictable.insert(self.next_stamp, *hash);
                    self.next_stamp += 1;
                }
            }
        }
    }

    /// Drop every cached block; refused (false) while any block is referenced.
    pub fn reset(&mut self) -> bool {
        if self.used_blocks() > 0 {
            return false;
        }
        self.blocks.clear();
        self.evictable.clear();
        self.free_slots.clear();
        self.next_slot = 0;
        self.emit(KvEvent::AllBlocksCleared);
        true
    }

    fn take_slot(&mut self, removed: &mut Vec<u64>) -> u32 {
        let slots = u32::try_from(self.capacity).unwrap_or(u32::MAX);
        if self.blocks.len() + self.private_in_use >= self.capacity
            || (self.free_slots.is_empty() && self.next_slot >= slots)
        {
            self.evict_one(removed);
        }
        if let Some(slot) = self.free_slots.pop() {
            return slot;
        }
        if self.next_slot < slots {
            self.next_slot += 1;
            return self.next_slot - 1;
        }
        0
    }

    fn evict_one(&mut self, removed: &mut Vec<u64>) {
        if let Some((_, hash)) = self.evictable.pop_first() {
            if let Some(block) = self.blocks.remove(&hash) {
                self.free_slots.push(block.slot);
            }
            removed.push(hash);
        }
    }

    fn publish_removed(&self, removed: Vec<u64>) {
        if !removed.is_empty() {
            self.emit(KvEvent::BlockRemoved {
                block_hashes: removed,
            });
        }
    }

    fn emit(&self, event: KvEvent) {
        if let Some(sink) = &self.sink {
            sink.emit(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn chained_hashes_depend_on_the_whole_prefix() {
        let a = chain_hashes(&tokens(1, 40), 16);
        assert_eq!(a.len(), 2);
        let mut other = tokens(1, 40);
        other[0] = 7;
        let b = chain_hashes(&other, 16);
        assert_ne!(
            a[1], b[1],
            "a different first block changes every later hash"
        );
        assert_eq!(chain_hashes(&tokens(1, 32), 16), a);
    }

    #[test]
    fn a_repeated_prefix_hits_and_a_new_one_does_not() {
        let mut cache = KvCache::new(4, 16, None);
        let prompt = tokens(1, 12);
        let hashes = chain_hashes(&prompt, 4);
        assert_eq!(
            cache.acquire(&hashes, &prompt, 1),
            Some(Acquired { hit_blocks: 0 })
        );
        cache.release(&hashes, 1);
        assert_eq!(cache.used_blocks(), 0);
        assert_eq!(cache.cached_hashes().len(), 3);
        assert_eq!(
            cache.acquire(&hashes, &prompt, 0),
            Some(Acquired { hit_blocks: 3 })
        );
        let other = tokens(2, 12);
        let other_hashes = chain_hashes(&other, 4);
        assert_eq!(cache.cached_prefix_blocks(&other_hashes), 0);
    }

    #[test]
    fn referenced_blocks_are_never_evicted_and_refcounts_add_up() {
        let mut cache = KvCache::new(4, 4, None);
        let prompt = tokens(1, 16);
        let hashes = chain_hashes(&prompt, 4);
        assert!(cache.acquire(&hashes, &prompt, 0).is_some());
        assert!(
            cache.acquire(&hashes, &prompt, 0).is_some(),
            "sharing needs no new blocks"
        );
        let other = tokens(2, 4);
        let other_hashes = chain_hashes(&other, 4);
        assert!(
            cache.acquire(&other_hashes, &other, 0).is_none(),
            "cache is full of referenced blocks"
        );
        cache.release(&hashes, 0);
        assert!(
            cache.acquire(&other_hashes, &other, 0).is_none(),
            "still referenced once"
        );
        cache.release(&hashes, 0);
        assert!(cache.acquire(&other_hashes, &other, 0).is_some());
        assert_eq!(
            cache.cached_prefix_blocks(&hashes),
            3,
            "only the tail block was evicted"
        );
        assert!(!cache.contains(hashes[3]));
    }

    #[test]
    fn eviction_is_least_recently_freed_first() {
        let mut cache = KvCache::new(2, 4, None);
        let a = tokens(1, 4);
        let b = tokens(2, 4);
        let (ha, hb) = (chain_hashes(&a, 2), chain_hashes(&b, 2));
        cache.acquire(&ha, &a, 0);
        cache.acquire(&hb, &b, 0);
        cache.release(&ha, 0);
        cache.release(&hb, 0);
        // touch `a` again so `b` is now the least recently freed
        cache.acquire(&ha, &a, 0);
        cache.release(&ha, 0);
        let c = tokens(3, 4);
        let hc = chain_hashes(&c, 2);
        cache.acquire(&hc, &c, 0);
        assert_eq!(cache.cached_prefix_blocks(&ha), 2);
        assert_eq!(cache.cached_prefix_blocks(&hb), 0);
    }

    #[test]
    fn promoted_blocks_take_over_private_space_or_join_a_cached_twin() {
        let mut cache = KvCache::new(4, 4, None);
        let sequence = tokens(1, 16);
        let hashes = chain_hashes(&sequence, 4);
        // the prompt is one block, the rest is held privately while it is generated
        assert!(cache.acquire(&hashes[..1], &sequence, 3).is_some());
        assert_eq!(cache.used_blocks(), 4);
        cache.promote(&hashes[..3], 1, &sequence);
        assert_eq!(
            cache.used_blocks(),
            4,
            "promotion never changes the space held"
        );
        assert_eq!(cache.cached_prefix_blocks(&hashes), 3);
        cache.release(&hashes[..3], 1);
        assert_eq!(cache.used_blocks(), 0);

        // a twin sequence reaches the same blocks: it shares them and frees its private ones
        assert!(cache.acquire(&hashes[..1], &sequence, 3).is_some());
        cache.promote(&hashes[..3], 1, &sequence);
        assert_eq!(cache.used_blocks(), 4);
        assert_eq!(cache.cached_hashes().len(), 3);
        cache.release(&hashes[..3], 1);
    }

    #[test]
    fn extending_a_chain_equals_hashing_the_whole_sequence() {
        let sequence = tokens(3, 37);
        let mut hashes = chain_hashes(&sequence[..9], 4);
        let mut buffer = Vec::new();
        extend_chain(&mut hashes, &sequence, 4, &mut buffer);
        assert_eq!(hashes, chain_hashes(&sequence, 4));
        assert_eq!(hashes.len(), 9);
    }

    #[test]
    fn private_blocks_count_as_used_and_reset_needs_an_idle_cache() {
        let mut cache = KvCache::new(4, 3, None);
        assert!(cache.grow_private(3));
        assert!(!cache.grow_private(1));
        assert!((cache.usage() - 1.0).abs() < 1e-9);
        assert!(!cache.reset());
        cache.release(&[], 3);
        assert!(cache.reset());
        assert!(cache.cached_hashes().is_empty());
    }
}
