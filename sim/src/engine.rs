//! The engine loop: one tokio task owning the KV cache and the scheduler (continuous batching
//! with chunked prefill, as vLLM's V1 scheduler).
//!
//! Each iteration takes the new commands and runs one *step* with a token budget
//! (`max_num_batched_tokens`, 0 = unlimited):
//!
//! 1. decoding sequences that need a new block grow into it; when none is free, a running
//!    sequence is preempted (its blocks freed, requeued, recomputed later) and counted: the
//!    newest under `fcfs`, the lowest-priority newest under `priority`;
//! 2. running sequences, in admission order, take their tokens from the budget: one per
//!    decoding sequence, a chunk of the rest of the prompt per prefilling one (at most
//!    `long_prefill_token_threshold` when set); once the budget is spent the rest wait a step;
//! 3. if nothing was preempted, waiting sequences are admitted, in arrival order (`fcfs`) or
//!    by (priority, arrival) (`priority`, lower values first), while fewer than
//!    `max_num_seqs` run, budget is left and their blocks fit; their cached prefix counts as
//!    computed and they take a first chunk.
//!
//! The step lasts `prefill_tokens / prefill_tokens_per_s + decode_ms_per_token *
//! (1 + (decoding - 1) / max_num_seqs)` simulated seconds (decode slows down as the batch
//! grows, up to 2x at a full batch); the loop sleeps until the step's simulated end, in wall time
//! (`clock * time_scale` after the start, so a late timer shortens the next sleep), before delivering
//! the step's tokens. A sequence whose prompt is done in a step samples its first token at the
//! step's end. A prompt shares at most the cached blocks before its last token (vLLM's
//! `max_cache_hit_length = num_tokens - 1`), so that token's block is always prefilled; a
//! prompt whose every block came from a prefill replica still takes one token of the budget
//! but adds no prefill time.
//!
//! With `time_scale == 0` nothing sleeps and each admitted sequence runs to completion inside its
//! step, delivering all its tokens in one event (no budget); timings for the metrics are computed
//! the same way.
//!
//! A sequence's tokens are its prompt followed by its planned output. At admission it shares the
//! cached blocks of its longest cached prefix (and any transferred from a prefill replica); its
//! other blocks are private. Like vLLM's prefix caching (and SGLang's radix cache under chunked
//! prefill), each block is hashed and cached ([`KvCache::promote`]) once its KV is computed: a
//! prompt's blocks chunk by chunk, generated tokens' blocks as they fill. A request admitted while
//! another is still prefilling the same prefix hits only the blocks computed so far, and the
//! computed blocks of a sequence that is cancelled or preempted stay cached. (vLLM caches a
//! chunk's blocks when it schedules them, so a request admitted later in the same step shares
//! them too; the simulator does not yet, which charges a burst of requests on one prefix up to
//! one chunk each more than vLLM would.) At `time_scale == 0`
//! a sequence's blocks are cached when it finishes, in one pass.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::cache::{extend_chain, KvCache};
use crate::faults::FaultState;
use crate::metrics::Stats;

/// Where a prefill-only sequence leaves its blocks for the decode replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handoff {
    /// vLLM NIXL style: keyed by the block ids returned in `remote_block_ids`.
    Blocks,
    /// SGLang style: keyed by `bootstrap_room`.
    Room(u64),
}

/// Key of a set of pinned blocks waiting to be fetched by a decode replica.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PinKey {
    /// Block ids, as in `remote_block_ids`.
    Blocks(Vec<u32>),
    /// A bootstrap room.
    Room(u64),
}

/// A request as the scheduler sees it.
#[derive(Debug)]
pub struct SeqRequest {
    /// Token ids of the sequence: the prompt, then the planned output tokens (output tokens
    /// without a known id are generated but never cached).
    pub tokens: Vec<u32>,
    /// How many of `tokens` are the prompt.
    pub prompt_len: usize,
    /// Chained hashes of the prompt's full blocks.
    pub hashes: Vec<u64>,
    /// Tokens to generate (at least 1).
    pub output_tokens: usize,
    /// Leading blocks already transferred from a prefill replica (counted as cached).
    pub imported_blocks: usize,
    /// Keep the full blocks pinned for a decode replica instead of freeing them.
    pub handoff: Option<Handoff>,
    /// Scheduling priority under [`SchedulingPolicy::Priority`]: lower runs first (vLLM's
    /// convention; the HTTP side converts SGLang's).
    pub priority: i64,
    /// Where the scheduler reports progress.
    pub events: mpsc::UnboundedSender<SeqEvent>,
}

/// Progress of one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqEvent {
    /// `count` more output tokens were generated.
    Tokens {
        /// Tokens generated in this step.
        count: usize,
    },
    /// The sequence finished.
    Done {
        /// Prompt tokens served from the cache (or transferred) at first admission.
        cached_tokens: usize,
        /// Block ids left pinned for a decode replica (prefill-only sequences).
        handoff_block_ids: Vec<u32>,
    },
}

/// Commands from the HTTP side to the engine loop.
#[derive(Debug)]
pub enum Command {
    /// Queue a new sequence.
    Submit(SeqRequest),
    /// Drop every cached block (refused while any is in use).
    ResetCache {
        /// Reply channel: whether the cache was cleared.
        reply: oneshot::Sender<bool>,
    },
}

/// Scheduler parameters.
#[derive(Debug, Clone)]
pub struct EngineParams {
    /// Maximum running sequences.
    pub max_num_seqs: usize,
    /// Prefill throughput in tokens per simulated second.
    pub prefill_tokens_per_s: f64,
    /// Decode time per token at batch size 1, simulated milliseconds.
    pub decode_ms_per_token: f64,
    /// Wall seconds per simulated second (0 = no delays).
    pub time_scale: f64,
    /// How long handed-off blocks stay pinned.
    pub pin_timeout: Duration,
    /// Tokens one step may compute (vLLM `--max-num-batched-tokens`); 0 = no limit, whole
    /// prompts in one step.
    pub max_num_batched_tokens: usize,
    /// Largest prefill chunk of one sequence per step (vLLM `--long-prefill-token-threshold`);
    /// 0 = only the step budget limits it.
    pub long_prefill_token_threshold: usize,
    /// Order of the waiting queue and choice of preemption victim.
    pub policy: SchedulingPolicy,
}

/// How waiting sequences are ordered (vLLM `--scheduling-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// Arrival order; the newest running sequence is preempted first.
    #[default]
    Fcfs,
    /// By (priority, arrival); the lowest-priority, newest running sequence is preempted first.
    Priority,
}

#[derive(Debug)]
struct Seq {
    request: SeqRequest,
    /// Chained hashes of the full blocks of the sequence so far (prompt blocks first).
    hashes: Vec<u64>,
    /// How many of `hashes` are prompt blocks.
    prompt_blocks: usize,
    /// How many leading `hashes` this sequence holds in the cache: its cache hit at admission,
    /// then each block as its KV is computed. The rest of its blocks are private.
    stored: usize,
    generated: usize,
    private_blocks: usize,
    holds_blocks: bool,
    /// Tokens of the context whose KV is computed (cache hits count).
    computed: usize,
    /// Admitted and still computing its context; it samples a token when that is done.
    prefilling: bool,
    /// Arrival order, breaking priority ties.
    order: u64,
    arrival: f64,
    first_token_at: Option<f64>,
    last_token_at: f64,
    cached_tokens: Option<usize>,
    counted_prompt: bool,
}

#[derive(Debug)]
struct Pin {
    hashes: Vec<u64>,
    deadline: Instant,
}

/// Scheduler and cache state, shared with the HTTP side for metrics and inspection.
#[derive(Debug)]
pub struct Core {
    /// The KV cache.
    pub cache: KvCache,
    /// Counters and histograms.
    pub stats: Stats,
    params: EngineParams,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    pins: HashMap<PinKey, Vec<Pin>>,
    clock: f64,
    started: Instant,
    hash_buffer: Vec<u8>,
    arrivals: u64,
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Simulated seconds the step lasts.
    pub duration: f64,
    /// Events to deliver after the step.
    pub deliveries: Vec<(mpsc::UnboundedSender<SeqEvent>, SeqEvent)>,
    /// Whether any sequence was admitted or advanced.
    pub progressed: bool,
}

impl Core {
    /// A scheduler over `cache`.
    pub fn new(cache: KvCache, params: EngineParams) -> Self {
        Core {
            cache,
            stats: Stats::default(),
            params,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pins: HashMap::new(),
            clock: 0.0,
            started: Instant::now(),
            hash_buffer: Vec::new(),
            arrivals: 0,
        }
    }

    /// Sequences running now.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The wall instant the simulated clock stands for (`time_scale > 0`): when the step that
    /// was just computed ends.
    pub fn wall_deadline(&self) -> Instant {
        self.started
            + Duration::from_secs_f64(self.clock.max(0.0) * self.params.time_scale.max(0.0))
    }

    /// Sequences waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a step has anything to do.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Apply one command.
    pub fn apply(&mut self, command: Command) {
        match command {
            Command::Submit(mut request) => {
                if self.params.time_scale > 0.0 {
                    let wall = self.started.elapsed().as_secs_f64() / self.params.time_scale;
                    self.clock = self.clock.max(wall);
                }
                let hashes = std::mem::take(&mut request.hashes);
                self.arrivals += 1;
                let seq = Seq {
                    request,
                    prompt_blocks: hashes.len(),
                    hashes,
                    stored: 0,
                    generated: 0,
                    private_blocks: 0,
                    holds_blocks: false,
                    computed: 0,
                    prefilling: false,
                    order: self.arrivals,
                    arrival: self.clock,
                    first_token_at: None,
                    last_token_at: self.clock,
                    cached_tokens: None,
                    counted_prompt: false,
                };
                match self.params.policy {
                    SchedulingPolicy::Fcfs => self.waiting.push_back(seq),
                    SchedulingPolicy::Priority => self.enqueue_by_priority(seq),
                }
            }
            Command::ResetCache { reply } => {
                let _ = reply.send(self.cache.reset());
            }
        }
    }

    pub(crate) fn take_pin(&mut self, key: &PinKey) -> Option<Vec<u64>> {
        let pins = self.pins.get_mut(key)?;
        let pin = pins.pop();
        if pins.is_empty() {
            self.pins.remove(key);
        }
        let pin = pin?;
        self.cache.release(&pin.hashes, 0);
        Some(pin.hashes)
    }

    fn expire_pins(&mut self, now: Instant) {
        if self.pins.is_empty() {
            return;
        }
        let mut expired = Vec::new();
        self.pins.retain(|_, pins| {
            pins.retain(|pin| {
                if pin.deadline <= now {
                    expired.push(pin.hashes.clone());
                    false
                } else {
                    true
                }
            });
            !pins.is_empty()
        });
        for hashes in expired {
            self.cache.release(&hashes, 0);
        }
    }

    fn drop_cancelled(&mut self) {
        let mut index = 0;
        while index < self.running.len() {
            if self.running[index].request.events.is_closed() {
                let seq = self.running.remove(index);
                self.release_blocks(&seq);
            } else {
                index += 1;
            }
        }
        self.waiting.retain(|seq| !seq.request.events.is_closed());
    }

    fn release_blocks(&mut self, seq: &Seq) {
        if seq.holds_blocks {
            let stored = seq.hashes.get(..seq.stored).unwrap_or_default();
            self.cache.release(stored, seq.private_blocks);
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cache.block_size())
    }

    /// Admit what fits, run one step, and return its duration and events.
    pub fn step(&mut self, slow_factor: f64) -> StepOutcome {
        self.drop_cancelled();
        self.expire_pins(Instant::now());
        if self.params.time_scale <= 0.0 {
            self.step_instant(slow_factor)
        } else {
            self.step_scheduled(slow_factor)
        }
    }

    /// Take the head of the waiting queue into the running batch if its blocks fit: the prefix
    /// hit (and any blocks transferred from a prefill replica) is shared from the cache and
    /// counts as computed; the rest are private blocks, left to prefill and cached as their KV
    /// is computed. `needed_tokens` is how many tokens its blocks must hold.
    fn admit_next(&mut self, needed_tokens: impl Fn(&Seq) -> usize) -> bool {
        let block_size = self.cache.block_size();
        let Some(seq) = self.waiting.front() else {
            return false;
        };
        let imported = seq.request.imported_blocks.min(seq.prompt_blocks);
        // The last token is always computed, however much is cached (vLLM's
        // `max_cache_hit_length = num_tokens - 1`; SGLang matches at most all but one token):
        // a fully cached prompt shares the blocks before its last token only.
        let hit_limit = (seq.request.prompt_len + seq.generated).saturating_sub(1) / block_size;
        let shared = self
            .cache
            .cached_prefix_blocks(&seq.hashes)
            .min(hit_limit)
            .max(imported);
        let private = self.blocks_for(needed_tokens(seq)).saturating_sub(shared);
        let Some(acquired) = self.cache.acquire(
            seq.hashes.get(..shared).unwrap_or_default(),
            &seq.request.tokens,
            private,
        ) else {
            return false;
        };
        let Some(mut seq) = self.waiting.pop_front() else {
            return false;
        };
        let prompt_len = seq.request.prompt_len;
        let context = prompt_len + seq.generated;
        seq.stored = shared;
        let hit_tokens = (shared * block_size).min(context);
        if !seq.counted_prompt {
            // (A preempted sequence admitted again finds its own blocks: vLLM counts those
            // lookups apart, not in `vllm:prefix_cache_queries` and `_hits`.)
            self.stats.prefix_queries += prompt_len as u64;
            self.stats.prefix_hits += (acquired.hit_blocks * block_size).min(prompt_len) as u64;
            seq.counted_prompt = true;
            seq.cached_tokens = Some(hit_tokens.min(prompt_len));
            self.stats.prompt_tokens += prompt_len as u64;
        }
        seq.computed = hit_tokens;
        seq.prefilling = true;
        seq.private_blocks = private;
        seq.holds_blocks = true;
        self.running.push(seq);
        true
    }

    /// `time_scale == 0`: every admitted sequence prefills and runs to completion in one step.
    fn step_instant(&mut self, slow_factor: f64) -> StepOutcome {
        let mut outcome = StepOutcome::default();
        let mut prefill_tokens = 0usize;
        while self.running.len() < self.params.max_num_seqs.max(1)
            && self.admit_next(|seq| seq.request.prompt_len + seq.request.output_tokens)
        {
            if let Some(seq) = self.running.last_mut() {
                let context = seq.request.prompt_len + seq.generated;
                prefill_tokens += context - seq.computed;
                self.stats.prefill_tokens_computed += (context - seq.computed) as u64;
            }
            outcome.progressed = true;
        }
        let prefill_s = prefill_tokens as f64 / self.params.prefill_tokens_per_s.max(1e-9);
        let per_token_s = self.decode_step_s(self.running.len()) * slow_factor.max(1.0);
        let mut longest = 0usize;
        for mut seq in std::mem::take(&mut self.running) {
            let count = seq
                .request
                .output_tokens
                .saturating_sub(seq.generated)
                .max(1);
            longest = longest.max(count);
            let ttft = self.clock + prefill_s - seq.arrival;
            self.stats.ttft.observe(ttft.max(0.0), 1);
            self.stats.itl.observe(per_token_s, (count - 1) as u64);
            self.stats
                .e2e
                .observe(ttft.max(0.0) + per_token_s * (count - 1) as f64, 1);
            self.stats.generation_tokens += count as u64;
            seq.generated += count;
            let filled = seq.request.prompt_len + seq.generated;
            cache_filled_blocks(&mut self.cache, &mut seq, filled, &mut self.hash_buffer);
            outcome
                .deliveries
                .push((seq.request.events.clone(), SeqEvent::Tokens { count }));
            self.finish(seq, &mut outcome);
        }
        outcome.duration = prefill_s + per_token_s * longest.saturating_sub(1) as f64;
        self.stats.busy_seconds += outcome.duration;
        self.clock += outcome.duration;
        outcome
    }

    /// Decode time of one step with `decoding` sequences in it, before the slow-down factor.
    fn decode_step_s(&self, decoding: usize) -> f64 {
        if decoding == 0 {
            return 0.0;
        }
        self.params.decode_ms_per_token / 1000.0
            * (1.0 + (decoding - 1) as f64 / self.params.max_num_seqs.max(1) as f64)
    }

    /// The running sequence to preempt when blocks run out: the newest (FCFS), or the lowest
    /// priority, newest among equals (priority policy).
    fn preemption_victim(&self) -> Option<usize> {
        match self.params.policy {
            SchedulingPolicy::Fcfs => self.running.len().checked_sub(1),
            SchedulingPolicy::Priority => self
                .running
                .iter()
                .enumerate()
                .max_by_key(|(_, seq)| (seq.request.priority, seq.order))
                .map(|(index, _)| index),
        }
    }

    /// Put a preempted sequence back: at the front (FCFS) or in priority order.
    fn requeue(&mut self, mut seq: Seq) {
        self.release_blocks(&seq);
        seq.holds_blocks = false;
        seq.private_blocks = 0;
        seq.stored = 0;
        seq.computed = 0;
        seq.prefilling = false;
        self.stats.preemptions += 1;
        match self.params.policy {
            SchedulingPolicy::Fcfs => self.waiting.push_front(seq),
            SchedulingPolicy::Priority => self.enqueue_by_priority(seq),
        }
    }

    fn enqueue_by_priority(&mut self, seq: Seq) {
        let key = (seq.request.priority, seq.order);
        let at = self
            .waiting
            .partition_point(|w| (w.request.priority, w.order) <= key);
        self.waiting.insert(at, seq);
    }

    /// Grow every decoding sequence into the block its next token needs, preempting per the
    /// policy when the cache is full. Returns whether anything was preempted.
    fn grow_decoding(&mut self) -> bool {
        let mut preempted = false;
        let mut index = 0;
        while index < self.running.len() {
            let seq = &self.running[index];
            if seq.prefilling {
                index += 1;
                continue;
            }
            let context = seq.request.prompt_len + seq.generated + 1;
            let have = seq.stored + seq.private_blocks;
            let need = self.blocks_for(context).saturating_sub(have);
            if need == 0 || self.cache.grow_private(need) {
                if need > 0 {
                    self.running[index].private_blocks += need;
                }
                index += 1;
                continue;
            }
            let Some(victim) = self.preemption_victim() else {
                break;
            };
            let seq = self.running.remove(victim);
            self.requeue(seq);
            preempted = true;
            // retry the same sequence (or the one that moved into its place)
            if victim < index {
                index -= 1;
            }
        }
        preempted
    }

    /// One step of continuous batching with chunked prefill (see the module doc).
    fn step_scheduled(&mut self, slow_factor: f64) -> StepOutcome {
        let mut outcome = StepOutcome::default();
        let preempted = self.grow_decoding();
        let mut budget = match self.params.max_num_batched_tokens {
            0 => usize::MAX,
            limit => limit,
        };
        let cap = match self.params.long_prefill_token_threshold {
            0 => usize::MAX,
            limit => limit,
        };
        let chunk = |seq: &Seq, budget: usize| {
            let context = seq.request.prompt_len + seq.generated;
            // a prompt whose every block was transferred still takes one token of the budget,
            // as vLLM recomputes its last token (the step's prefill time counts only
            // uncomputed tokens)
            let remaining = context.saturating_sub(seq.computed).max(1);
            remaining.min(cap).min(budget)
        };
        // running sequences first, in admission order: decodes take one token, prefills a chunk
        let mut planned = Vec::with_capacity(self.running.len());
        for seq in &self.running {
            let tokens = if budget == 0 {
                0
            } else if seq.prefilling {
                chunk(seq, budget)
            } else {
                1
            };
            budget -= tokens;
            planned.push(tokens);
        }
        // then new sequences, while the batch, the budget and the cache allow
        if !preempted {
            while budget > 0
                && self.running.len() < self.params.max_num_seqs.max(1)
                && self.admit_next(|seq| seq.request.prompt_len + seq.generated + 1)
            {
                let tokens = self.running.last().map_or(0, |seq| chunk(seq, budget));
                budget -= tokens;
                planned.push(tokens);
            }
        }

        let mut prefill_tokens = 0usize;
        let mut decoding = 0usize;
        for (seq, &tokens) in self.running.iter().zip(&planned) {
            if tokens == 0 {
                continue;
            }
            if seq.prefilling {
                let context = seq.request.prompt_len + seq.generated;
                prefill_tokens += tokens.min(context.saturating_sub(seq.computed));
            } else {
                decoding += 1;
            }
        }
        let prefill_s = prefill_tokens as f64 / self.params.prefill_tokens_per_s.max(1e-9);
        outcome.duration = (prefill_s + self.decode_step_s(decoding)) * slow_factor.max(1.0);
        self.stats.busy_seconds += outcome.duration;
        self.stats.prefill_tokens_computed += prefill_tokens as u64;
        let end = self.clock + outcome.duration;
        let mut finished = Vec::new();
        for (index, (seq, &tokens)) in self.running.iter_mut().zip(&planned).enumerate() {
            if tokens == 0 {
                continue;
            }
            outcome.progressed = true;
            let context = seq.request.prompt_len + seq.generated;
            if seq.prefilling {
                seq.computed = (seq.computed + tokens).min(context);
                let computed = seq.computed;
                cache_filled_blocks(&mut self.cache, seq, computed, &mut self.hash_buffer);
                if seq.computed < context {
                    continue;
                }
                seq.prefilling = false;
            } else {
                seq.computed = context;
            }
            // the step samples one token
            seq.generated += 1;
            let filled = seq.request.prompt_len + seq.generated;
            cache_filled_blocks(&mut self.cache, seq, filled, &mut self.hash_buffer);
            match seq.first_token_at {
                None => {
                    seq.first_token_at = Some(end);
                    self.stats.ttft.observe(end - seq.arrival, 1);
                }
                Some(_) => self.stats.itl.observe(end - seq.last_token_at, 1),
            }
            seq.last_token_at = end;
            self.stats.generation_tokens += 1;
            outcome
                .deliveries
                .push((seq.request.events.clone(), SeqEvent::Tokens { count: 1 }));
            if seq.generated >= seq.request.output_tokens.max(1) {
                self.stats.e2e.observe(end - seq.arrival, 1);
                finished.push(index);
            }
        }
        for index in finished.into_iter().rev() {
            let seq = self.running.remove(index);
            self.finish(seq, &mut outcome);
        }
        self.clock = end;
        outcome
    }

    fn finish(&mut self, seq: Seq, outcome: &mut StepOutcome) {
        let mut handoff_block_ids = Vec::new();
        match &seq.request.handoff {
            Some(handoff) if seq.holds_blocks => {
                // the prompt's blocks stay pinned for the decode replica; the rest is freed
                let stored = seq.hashes.get(..seq.stored).unwrap_or_default();
                let (prompt, output) = stored.split_at(seq.prompt_blocks.min(stored.len()));
                self.cache.release(output, seq.private_blocks);
                handoff_block_ids = self.cache.slots_of(prompt);
                let key = match handoff {
                    Handoff::Blocks => PinKey::Blocks(handoff_block_ids.clone()),
                    Handoff::Room(room) => PinKey::Room(*room),
                };
                let pin = Pin {
                    hashes: prompt.to_vec(),
                    deadline: Instant::now() + self.params.pin_timeout,
                };
                self.pins.entry(key).or_default().push(pin);
            }
            _ => self.release_blocks(&seq),
        }
        self.stats.requests_finished += 1;
        outcome.deliveries.push((
            seq.request.events,
            SeqEvent::Done {
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                handoff_block_ids,
            },
        ));
    }
}

/// Cache the blocks that the first `filled` tokens of `seq` fill (prompt tokens whose KV a
/// chunk computed, or the context after a sampled token) and that it still holds as private
/// blocks, hashing output blocks as they fill (tokens without a known id are never cached).
fn cache_filled_blocks(cache: &mut KvCache, seq: &mut Seq, filled: usize, buffer: &mut Vec<u8>) {
    let block_size = cache.block_size();
    let filled = filled.min(seq.request.tokens.len());
    let end = (filled / block_size).min(seq.stored + seq.private_blocks);
    if end <= seq.stored {
        return;
    }
    if seq.hashes.len() < end {
        let covered = seq
            .request
            .tokens
            .get(..end * block_size)
            .unwrap_or_default();
        extend_chain(&mut seq.hashes, covered, block_size, buffer);
    }
    let Some(hashes) = seq.hashes.get(..end) else {
        return;
    };
    cache.promote(hashes, seq.stored, &seq.request.tokens);
    seq.private_blocks -= end - seq.stored;
    seq.stored = end;
}

/// Run the engine loop until every command sender is dropped.
pub async fn run(
    core: Arc<Mutex<Core>>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    faults: Arc<FaultState>,
    time_scale: f64,
) {
    let mut pending = Vec::new();
    let mut idle = true;
    loop {
        if idle {
            match tokio::time::timeout(Duration::from_millis(200), commands.recv()).await {
                Ok(Some(command)) => pending.push(command),
                Ok(None) => break,
                Err(_) => {}
            }
        }
        while let Ok(command) = commands.try_recv() {
            pending.push(command);
        }
        let (outcome, deadline) = {
            let Ok(mut core) = core.lock() else { break };
            for command in pending.drain(..) {
                core.apply(command);
            }
            let outcome = core.step(faults.global_slow_factor());
            idle = !core.has_work() || !outcome.progressed;
            (outcome, core.wall_deadline())
        };
        if time_scale > 0.0 && outcome.duration > 0.0 {
            // Sleep until the wall instant of the step's simulated end, not for its length: a
            // timer that fires late (they round up to the millisecond) or a busy CPU then
            // shortens the next sleep instead of slowing the simulated clock for good.
            tokio::time::sleep_until(deadline).await;
        } else if !idle {
            tokio::task::yield_now().await;
        }
        for (events, event) in outcome.deliveries {
            let _ = events.send(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::chain_hashes;

    fn params(max_num_seqs: usize, time_scale: f64) -> EngineParams {
        EngineParams {
            max_num_seqs,
            prefill_tokens_per_s: 1000.0,
            decode_ms_per_token: 10.0,
            time_scale,
            pin_timeout: Duration::from_secs(60),
            max_num_batched_tokens: 0,
            long_prefill_token_threshold: 0,
            policy: SchedulingPolicy::Fcfs,
        }
    }

    fn request(
        seed: u32,
        prompt_len: usize,
        output: usize,
    ) -> (SeqRequest, mpsc::UnboundedReceiver<SeqEvent>) {
        let tokens: Vec<u32> = (0..prompt_len as u32).map(|i| seed * 10_000 + i).collect();
        let hashes = chain_hashes(&tokens, 4);
        let (events, rx) = mpsc::unbounded_channel();
        let request = SeqRequest {
            prompt_len: tokens.len(),
            tokens,
            hashes,
            output_tokens: output,
            imported_blocks: 0,
            handoff: None,
            priority: 0,
            events,
        };
        (request, rx)
    }

    /// A request whose planned output ids are known, so its output blocks can be cached.
    fn request_with_output(
        seed: u32,
        prompt_len: usize,
        output: usize,
    ) -> (SeqRequest, mpsc::UnboundedReceiver<SeqEvent>) {
        let (mut request, rx) = request(seed, prompt_len, output);
        request
            .tokens
            .extend((0..output as u32).map(|i| seed * 10_000 + 5_000 + i));
        (request, rx)
    }

    fn cached_tokens(
        deliveries: Vec<(mpsc::UnboundedSender<SeqEvent>, SeqEvent)>,
    ) -> Option<usize> {
        deliveries.into_iter().find_map(|(_, event)| match event {
            SeqEvent::Done { cached_tokens, .. } => Some(cached_tokens),
            _ => None,
        })
    }

    fn drain(core: &mut Core) -> Vec<(mpsc::UnboundedSender<SeqEvent>, SeqEvent)> {
        let mut all = Vec::new();
        for _ in 0..1000 {
            if !core.has_work() {
                break;
            }
            all.extend(core.step(1.0).deliveries);
        }
        all
    }

    #[test]
    fn batching_respects_max_num_seqs_and_queues_the_rest() {
        let mut core = Core::new(KvCache::new(4, 100, None), params(2, 1.0));
        let mut receivers = Vec::new();
        for seed in 0..3 {
            let (req, rx) = request(seed + 1, 8, 3);
            core.apply(Command::Submit(req));
            receivers.push(rx);
        }
        let first = core.step(1.0);
        assert_eq!(core.num_running(), 2);
        assert_eq!(core.num_waiting(), 1);
        // two prompts of 8 uncached tokens at 1000 tokens/s, no decoding yet
        assert!((first.duration - 0.016).abs() < 1e-9);
        let second = core.step(1.0);
        // two sequences decoding: 10 ms * (1 + 1/2)
        assert!((second.duration - 0.015).abs() < 1e-9);
        drain(&mut core);
        assert_eq!(core.stats.generation_tokens, 9);
        assert_eq!(core.stats.requests_finished, 3);
        assert_eq!(core.cache.used_blocks(), 0);
    }

    fn deliver_all(deliveries: Vec<(mpsc::UnboundedSender<SeqEvent>, SeqEvent)>) {
        for (tx, event) in deliveries {
            let _ = tx.send(event);
        }
    }

    fn first_token_step(rx: &mut mpsc::UnboundedReceiver<SeqEvent>) -> bool {
        matches!(rx.try_recv(), Ok(SeqEvent::Tokens { .. }))
    }

    fn deliver(outcome: StepOutcome) {
        deliver_all(outcome.deliveries);
    }

    #[test]
    fn long_prompts_prefill_in_chunks_beside_running_decodes() {
        let mut p = params(4, 1.0);
        p.max_num_batched_tokens = 8;
        let mut core = Core::new(KvCache::new(4, 100, None), p);
        let (short, mut short_rx) = request(1, 4, 10);
        core.apply(Command::Submit(short));
        deliver(core.step(1.0));
        assert!(first_token_step(&mut short_rx), "4 tokens fit one step");
        let (long, mut long_rx) = request(2, 20, 2);
        core.apply(Command::Submit(long));
        // the decode takes 1 token of the budget, the new prompt 7, then 7, then its last 6
        let mut steps = 0;
        loop {
            steps += 1;
            let outcome = core.step(1.0);
            assert!(
                outcome.duration <= (8.0 / 1000.0) + 0.0101,
                "{}",
                outcome.duration
            );
            deliver(outcome);
            assert!(
                first_token_step(&mut short_rx),
                "the decode runs every step"
            );
            if first_token_step(&mut long_rx) {
                break;
            }
            assert!(steps < 3, "20 tokens take 3 chunks");
        }
        assert_eq!(steps, 3);
        assert_eq!(core.stats.prefill_tokens_computed, 24);
    }

    #[test]
    fn prompt_blocks_are_cached_as_chunks_compute_them() {
        let done = |rx: &mut mpsc::UnboundedReceiver<SeqEvent>| {
            std::iter::from_fn(|| rx.try_recv().ok()).find_map(|event| match event {
                SeqEvent::Done { cached_tokens, .. } => Some(cached_tokens),
                _ => None,
            })
        };
        let mut p = params(4, 1.0);
        p.max_num_batched_tokens = 8;
        p.long_prefill_token_threshold = 4;
        let mut core = Core::new(KvCache::new(4, 100, None), p);
        // 48 tokens: 12 blocks, one computed per step
        let (first, mut first_rx) = request(1, 48, 2);
        core.apply(Command::Submit(first));
        deliver(core.step(1.0));
        assert_eq!(core.cache.cached_hashes().len(), 1);
        // the same prompt arriving now finds the one computed block, not the eleven to come
        let (second, mut second_rx) = request(1, 48, 2);
        core.apply(Command::Submit(second));
        deliver_all(drain(&mut core));
        assert_eq!(done(&mut first_rx), Some(0));
        assert_eq!(done(&mut second_rx), Some(4));
        assert_eq!(core.cache.cached_hashes().len(), 12);
        // a sequence cancelled mid-prefill leaves the blocks it computed, and only those
        let (third, third_rx) = request(2, 48, 2);
        core.apply(Command::Submit(third));
        deliver(core.step(1.0));
        drop(third_rx);
        deliver(core.step(1.0));
        assert_eq!(core.cache.cached_hashes().len(), 13);
        let (again, mut again_rx) = request(2, 48, 2);
        core.apply(Command::Submit(again));
        deliver_all(drain(&mut core));
        assert_eq!(done(&mut again_rx), Some(4));
    }

    #[test]
    fn the_long_prefill_threshold_leaves_budget_for_short_prompts() {
        // a long prompt is prefilling with a budget of 8; does a short one start at once?
        let short_starts_at_once = |threshold: usize| {
            let mut p = params(4, 1.0);
            p.max_num_batched_tokens = 8;
            p.long_prefill_token_threshold = threshold;
            let mut core = Core::new(KvCache::new(4, 100, None), p);
            let (long, _long_rx) = request(1, 40, 2);
            core.apply(Command::Submit(long));
            deliver(core.step(1.0));
            let (short, mut short_rx) = request(2, 4, 2);
            core.apply(Command::Submit(short));
            deliver(core.step(1.0));
            first_token_step(&mut short_rx)
        };
        assert!(short_starts_at_once(4), "4 of the budget were left");
        assert!(
            !short_starts_at_once(0),
            "without the threshold the long prompt takes the whole budget"
        );
    }

    #[test]
    fn priority_policy_admits_by_priority_and_preempts_the_lowest() {
        let mut p = params(1, 1.0);
        p.policy = SchedulingPolicy::Priority;
        let mut core = Core::new(KvCache::new(4, 100, None), p);
        let (first, _first_rx) = request(1, 4, 3);
        core.apply(Command::Submit(first));
        core.step(1.0);
        let (mut low, mut low_rx) = request(2, 4, 1);
        low.priority = 5;
        let (mut high, mut high_rx) = request(3, 4, 1);
        high.priority = -1;
        core.apply(Command::Submit(low));
        core.apply(Command::Submit(high));
        for _ in 0..3 {
            deliver(core.step(1.0));
        }
        assert!(
            first_token_step(&mut high_rx),
            "the later, higher-priority request runs first"
        );
        assert!(!first_token_step(&mut low_rx));

        // 4 blocks of 4 tokens: when the cache runs out the low-priority sequence goes
        let mut p = params(4, 1.0);
        p.policy = SchedulingPolicy::Priority;
        let mut core = Core::new(KvCache::new(4, 4, None), p);
        let (mut low, _low_rx) = request(4, 6, 6);
        low.priority = 3;
        let (mut high, _high_rx) = request(5, 6, 6);
        high.priority = 0;
        core.apply(Command::Submit(low));
        core.apply(Command::Submit(high));
        core.step(1.0);
        assert_eq!(core.num_running(), 2);
        while core.stats.preemptions == 0 && core.has_work() {
            core.step(1.0);
        }
        assert_eq!(core.waiting.front().map(|s| s.request.priority), Some(3));
    }

    #[test]
    fn prefill_time_counts_only_uncached_tokens() {
        let mut core = Core::new(KvCache::new(4, 100, None), params(4, 1.0));
        let (req, _rx1) = request(1, 16, 1);
        core.apply(Command::Submit(req));
        let cold = core.step(1.0);
        let (req, mut rx2) = request(1, 16, 1);
        core.apply(Command::Submit(req));
        let warm = core.step(1.0);
        assert!(warm.duration < cold.duration);
        for (tx, event) in warm.deliveries {
            let _ = tx.send(event);
        }
        let mut done = None;
        while let Ok(event) = rx2.try_recv() {
            if let SeqEvent::Done { cached_tokens, .. } = event {
                done = Some(cached_tokens);
            }
        }
        // The same 16 tokens again: all but the block of the last token, which vLLM always
        // recomputes.
        assert_eq!(done, Some(12));
        assert_eq!(core.stats.prefix_hits, 12);
        assert_eq!(core.stats.prefix_queries, 32);
    }

    #[test]
    fn running_out_of_blocks_preempts_the_newest_sequence() {
        // 4 blocks of 4 tokens; two sequences of 6 prompt tokens each need 2 blocks, then a third
        let mut core = Core::new(KvCache::new(4, 4, None), params(4, 1.0));
        let mut receivers = Vec::new();
        for seed in 1..=2 {
            let (req, rx) = request(seed, 6, 6);
            core.apply(Command::Submit(req));
            receivers.push(rx);
        }
        core.step(1.0);
        assert_eq!(core.num_running(), 2);
        drain(&mut core);
        assert!(core.stats.preemptions >= 1);
        assert_eq!(core.stats.requests_finished, 2);
        assert_eq!(core.stats.generation_tokens, 12);
    }

    #[test]
    fn instant_mode_finishes_in_one_step_and_pins_handoffs() {
        let mut core = Core::new(KvCache::new(4, 100, None), params(4, 0.0));
        let (mut req, mut rx) = request(1, 10, 5);
        req.handoff = Some(Handoff::Room(7));
        let hashes = req.hashes.clone();
        core.apply(Command::Submit(req));
        let outcome = core.step(1.0);
        assert!(!core.has_work());
        for (tx, event) in outcome.deliveries {
            let _ = tx.send(event);
        }
        assert_eq!(rx.try_recv().ok(), Some(SeqEvent::Tokens { count: 5 }));
        assert!(matches!(rx.try_recv(), Ok(SeqEvent::Done { .. })));
        assert_eq!(
            core.cache.used_blocks(),
            2,
            "the two full blocks stay pinned"
        );
        assert_eq!(core.take_pin(&PinKey::Room(7)), Some(hashes));
        assert_eq!(core.cache.used_blocks(), 0);
        assert_eq!(core.take_pin(&PinKey::Room(7)), None);
    }

    #[test]
    fn output_blocks_are_cached_as_they_fill_and_stay_cached() {
        for time_scale in [0.0, 1.0] {
            let mut core = Core::new(KvCache::new(4, 100, None), params(4, time_scale));
            // 10 prompt + 9 output tokens: blocks 0..4 are full (16 tokens), the tail is private
            let (req, _rx) = request_with_output(1, 10, 9);
            let sequence = req.tokens.clone();
            core.apply(Command::Submit(req));
            let mut steps = 0;
            while core.has_work() {
                core.step(1.0);
                steps += 1;
                if time_scale > 0.0 && steps == 3 {
                    // 10 + 3 generated tokens fill 3 blocks, no more
                    assert_eq!(core.cache.cached_hashes().len(), 3);
                }
            }
            assert_eq!(core.cache.used_blocks(), 0, "everything released");
            let full = chain_hashes(&sequence, 4);
            assert_eq!(full.len(), 4);
            assert_eq!(
                core.cache.cached_prefix_blocks(&full),
                4,
                "kept after finishing"
            );

            // the next turn repeats prompt and output, then adds more: it hits all 16 tokens
            let mut next_tokens = sequence.clone();
            next_tokens.extend([7, 8, 9]);
            let (mut next, _rx) = request(2, 0, 2);
            next.hashes = chain_hashes(&next_tokens, 4);
            next.prompt_len = next_tokens.len();
            next.tokens = next_tokens;
            core.apply(Command::Submit(next));
            let first = core.step(1.0);
            let done = if time_scale > 0.0 {
                cached_tokens(drain(&mut core))
            } else {
                cached_tokens(first.deliveries)
            };
            assert_eq!(done, Some(16));
            assert_eq!(core.stats.prefill_tokens_computed, 10 + (22 - 16));
        }
    }

    #[test]
    fn identical_outputs_share_their_blocks() {
        let mut core = Core::new(KvCache::new(4, 8, None), params(4, 1.0));
        let (a, _rx_a) = request_with_output(1, 8, 8);
        let (b, _rx_b) = request_with_output(1, 8, 8);
        core.apply(Command::Submit(a));
        core.apply(Command::Submit(b));
        core.step(1.0);
        // two sequences of 16 tokens in an 8-block cache: the shared prompt blocks plus one
        // private tail each, and the output blocks dedupe as they fill
        drain(&mut core);
        assert_eq!(core.stats.requests_finished, 2);
        assert_eq!(core.stats.preemptions, 0);
        assert_eq!(core.cache.cached_hashes().len(), 4);
        assert_eq!(core.cache.used_blocks(), 0);
    }

    #[test]
    fn preempted_sequences_keep_their_cached_output_blocks() {
        // 5 blocks of 4 tokens; two sequences that each need 4 blocks at the end
        let mut core = Core::new(KvCache::new(4, 5, None), params(4, 1.0));
        let (a, _rx_a) = request_with_output(1, 6, 10);
        let (b, _rx_b) = request_with_output(2, 6, 10);
        let (seq_a, seq_b) = (a.tokens.clone(), b.tokens.clone());
        core.apply(Command::Submit(a));
        core.apply(Command::Submit(b));
        drain(&mut core);
        assert!(core.stats.preemptions >= 1);
        assert_eq!(core.stats.requests_finished, 2);
        assert_eq!(core.stats.generation_tokens, 20);
        assert_eq!(core.cache.used_blocks(), 0);
        // the sequence that finished last is fully cached
        let cached = [&seq_a, &seq_b]
            .map(|tokens| core.cache.cached_prefix_blocks(&chain_hashes(tokens, 4)));
        assert!(cached.contains(&4), "{cached:?}");
    }

    #[test]
    fn handoffs_pin_only_the_prompt_blocks_and_busy_time_adds_up() {
        let mut core = Core::new(KvCache::new(4, 100, None), params(4, 0.0));
        // 11 prompt tokens + 1 generated token fill a third block, which is not handed off
        let (mut req, _rx) = request_with_output(1, 11, 1);
        req.handoff = Some(Handoff::Blocks);
        let prompt_hashes = req.hashes.clone();
        core.apply(Command::Submit(req));
        let outcome = core.step(1.0);
        assert_eq!(core.cache.cached_hashes().len(), 3);
        assert_eq!(
            core.cache.used_blocks(),
            2,
            "only the prompt blocks stay pinned"
        );
        let ids = core.cache.slots_of(&prompt_hashes);
        assert_eq!(core.take_pin(&PinKey::Blocks(ids)), Some(prompt_hashes));
        // 11 tokens at 1000 tokens/s, a single token decodes within the prefill step
        assert!((outcome.duration - 0.011).abs() < 1e-9);
        assert!((core.stats.busy_seconds - outcome.duration).abs() < 1e-12);
        assert_eq!(core.stats.prefill_tokens_computed, 11);
    }

    #[test]
    fn cancelled_sequences_release_their_blocks() {
        let mut core = Core::new(KvCache::new(4, 100, None), params(4, 1.0));
        let (req, rx) = request(1, 10, 50);
        core.apply(Command::Submit(req));
        core.step(1.0);
        assert!(core.cache.used_blocks() > 0);
        drop(rx);
        core.step(1.0);
        assert_eq!(core.num_running(), 0);
        assert_eq!(core.cache.used_blocks(), 0);
    }
}
