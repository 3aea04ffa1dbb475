//! Sub-agent lineage found by shared prefix, for calls whose headers name no parent.
//!
//! A sub-agent forked from a session starts with that session's context: its prompt shares a
//! long prefix with the parent's latest prompt. [`PrefixLineage`] recognises such a call and
//! names the parent, so the call is placed as one whose headers named it
//! ([`lineage`](mod@crate::lineage)): prefill where the parent's prefix is, decode spread over
//! the decode endpoints by load. The
//! difficulty is a team's common prefix (system prompt, tool schemas, a repository's agent
//! notes): every session of the team starts with it, and it must not make every new session a
//! sub-agent of whichever session was first. Three things tell the two apart: a team prefix is
//! contained by unrelated sessions (*shared*), a parent's context by the parent and its
//! sub-agents only (one *family*); a sub-agent's match reaches at least `min_tokens` beyond
//! what is shared; and the parent is active.
//!
//! # Rule
//!
//! Per pool, two bounded tables, fed with the chained chunk hashes the prefix index uses
//! ([`crate::prefix_index`]; `h_i` stands for the whole prefix `c_0 ..= c_i`):
//!
//! ```text
//! sessions   session key -> (family, time of its last request)
//! chunks     h_i -> Owned(session, family) | Shared        for i = k-1, 2k-1, 3k-1, ...
//! ```
//!
//! where `k = stride_chunks` (default 8: one recorded point per 512 tokens of prompt at the
//! default 64 tokens per chunk). A request of session `s` with chunk hashes `h_0 .. h_{n-1}`
//! at time `t`:
//!
//! 1. **Eligible** for a parent when its headers name none, it has no pin of its own, its key
//!    names a session (see below), and `s` is not in `sessions` (its first request here).
//! 2. **Walk** the recorded points `i < n` in order, with `S = 0` (chunks covered by the
//!    deepest shared point) and no candidate. A point not in `chunks` is passed over: `h_i`
//!    stands for the whole prefix, so a deeper point that is there still matches all the way
//!    (the shallower one may merely have been forgotten first).
//!
//!    ```text
//!    Shared        S = i + 1; the candidate is dropped
//!    Owned(o, f)   o = s or f = s: no parent (the match is s's own history)
//!                  o active, t - last(o) <= active_s: candidate (o, f, D = i + 1)
//!                  else: skipped (a shallower active owner may stand)
//!    ```
//! 3. **Parent**: the candidate's `o`, provided `(D - S) * tokens_per_chunk >= min_tokens`.
//! 4. **Record** (every request with a session key, eligible or not) under family `F`: the
//!    family of the parent the headers name (that session's own family when it is known, else
//!    its key), else the inferred parent's chunk family `f`, else `s` itself:
//!
//!    ```text
//!    absent        -> Owned(s, F)
//!    Owned(o, f)   -> unchanged when f = F; Owned(s, F) when o = s; else Shared
//!    Shared        -> Shared
//!    sessions[s]   = (F, t)
//!    ```
//!
//! Why:
//!
//! - **Shared** marks are how a team prefix stops counting: once two sessions of different
//!   families have contained a chunk it is shared for as long as the table remembers it,
//!   whether or not those sessions are still active, and a match counts only beyond it.
//! - **Families** keep a burst together: a sub-agent's prompt contains its parent's context,
//!   and recording it under the parent's family leaves that context owned by the parent, so
//!   every sibling of a burst finds the parent, not only the first. A sub-agent's own suffix
//!   is owned by the sub-agent itself, so a sub-agent of *it* finds it (the deepest owner),
//!   not the root.
//! - **First request only, family not kept.** Inference is per request: a session is
//!   considered once, on its first request, and its later requests (which have their own pin
//!   by then) are recorded under its own family, marking what it shares with its parent as
//!   shared. This bounds the one mistake the rule cannot avoid: the first two sessions to
//!   share a team prefix longer than `min_tokens`, on a gateway that has not yet seen it
//!   shared, look exactly like a parent and its sub-agent. The second is misread, and so is
//!   any new session arriving before a misread session sends its next request (or the first
//!   goes quiet), which marks the prefix shared for good. (Keeping a misread session in its parent's family would instead misread every
//!   new session for as long as the first stays active.) A misread session is merely placed
//!   as a sub-agent: prefilled where the other session's prefix is cached (which holds the
//!   team prefix too) and decoded where load is lowest. The price on real sub-agents: once
//!   they have run a second turn, the parent's context up to their spawn is shared, and a
//!   later burst from the same parent is found by what the parent added since (its turns, the
//!   first burst's reports), when that is at least `min_tokens`.
//! - **Active** (`active_s`, default [`DEFAULT_ACTIVE_S`] s since the parent's last request
//!   was placed): a fan-out follows the parent's turn; a session that went quiet is no longer
//!   where its context is worth reusing, and its chunks age out of the engines' caches.
//! - **`min_tokens`** (default [`DEFAULT_MIN_TOKENS`]): a match a little deeper than the
//!   shared part (a common first user message, a few tool results) is no sign of a fork, and
//!   reusing it saves little.
//!
//! A request without a session key is neither considered nor recorded: the gateway cannot
//! tell its first request from its later ones, so the rule could not bound its mistakes, and
//! it has no pins a sub-agent could follow. A request whose key is only its own response id
//! (no session header, `prompt_cache_key` or `conversation`, no `previous_response_id`;
//! [`Observation::named`] false) is recorded, since its chained turns keep that key and it may
//! be a parent, but never given a parent: a client that resends its whole history each turn
//! without naming its session sends exactly such requests, each extending the previous one's
//! prompt, and they belong on the conversation's decode endpoint rather than spread as
//! sub-agents. The tables are per gateway process, like the prefix index: a parent whose
//! requests went to another gateway replica is not found here.
//!
//! # Bounds and cost
//!
//! Both tables are two generations of hash maps: a lookup reads both, a record moves the
//! entry to the young one, and when the young one holds half the table's bound
//! (`max_sessions`, `max_chunks`) the old one is dropped and the young one takes its place.
//! Memory therefore stays under the bounds (defaults [`DEFAULT_MAX_SESSIONS`] sessions and
//! [`DEFAULT_MAX_CHUNKS`] points, a few MB), and an entry not touched for two generations is
//! forgotten, roughly least recently used first. A forgotten owner is inactive; a forgotten
//! shared mark is learnt again from the next two families that contain the chunk.
//!
//! A request costs `n / k` lookups and `n / k` updates of hash maps under the pool's table
//! lock: for a 200k-token prompt (3125 chunks) about 390 of each.
//! Session ids are keyed 64-bit hashes of the session keys (random key per table).

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use crate::lineage::Lineage;

/// Default `min_tokens`: matched tokens needed beyond the shared part.
pub const DEFAULT_MIN_TOKENS: u64 = 4096;
/// Default `active_s`: a parent must have placed a request within this many seconds.
pub const DEFAULT_ACTIVE_S: u64 = 300;
/// Default `stride_chunks`: one chunk hash in this many is recorded.
pub const DEFAULT_STRIDE_CHUNKS: usize = 8;
/// Default `max_sessions`.
pub const DEFAULT_MAX_SESSIONS: usize = 32_768;
/// Default `max_chunks`.
pub const DEFAULT_MAX_CHUNKS: usize = 131_072;
/// The [`Lineage::source`] of a parent found by prefix.
pub const SOURCE: &str = "prefix";

/// Settings of a [`PrefixLineage`] (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixLineageConfig {
    /// Tokens one chunk hash stands for ([`crate::PrefixIndex::tokens_per_chunk`]).
    pub tokens_per_chunk: u64,
    /// One chunk hash in this many is recorded (at least 1).
    pub stride_chunks: usize,
    /// Matched tokens needed beyond the shared part.
    pub min_tokens: u64,
    /// How recently a parent must have placed a request.
    pub active: Duration,
    /// Most sessions remembered.
    pub max_sessions: usize,
    /// Most recorded chunk hashes remembered.
    pub max_chunks: usize,
}

impl Default for PrefixLineageConfig {
    fn default() -> Self {
        PrefixLineageConfig {
            tokens_per_chunk: 64,
            stride_chunks: DEFAULT_STRIDE_CHUNKS,
            min_tokens: DEFAULT_MIN_TOKENS,
            active: Duration::from_secs(DEFAULT_ACTIVE_S),
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_chunks: DEFAULT_MAX_CHUNKS,
        }
    }
}

/// What one request brings to [`PrefixLineage::observe`].
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// The request's session key.
    pub session: &'a str,
    /// Its lineage from headers, if any.
    pub lineage: Option<&'a Lineage>,
    /// Whether the session (the sub-agent's own key, for a lineage from headers) has a pin.
    pub pinned: bool,
    /// Whether the session key names a session the client will use again (a header,
    /// `prompt_cache_key`, `conversation`, a `previous_response_id` chain), rather than only
    /// this request. A request with an unnamed key is recorded but never given a parent.
    pub named: bool,
    /// Chunk hashes of the rendered prompt.
    pub prefix: &'a [u64],
}

/// One session as the table remembers it.
#[derive(Debug, Clone)]
struct Session {
    key: Box<str>,
    family: u64,
    last: Instant,
}

/// One recorded chunk hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Contained by sessions of one family; `session` recorded it first.
    Owned { session: u64, family: u64 },
    /// Contained by sessions of two families or more.
    Shared,
}

/// A bounded map: two generations, the old one dropped when the young one is full.
#[derive(Debug)]
struct Generations<V> {
    young: HashMap<u64, V>,
    old: HashMap<u64, V>,
    /// Entries per generation.
    half: usize,
}

impl<V> Generations<V> {
    fn new(bound: usize) -> Self {
        Generations {
            young: HashMap::new(),
            old: HashMap::new(),
            half: (bound / 2).max(1),
        }
    }

    fn peek(&self, key: u64) -> Option<&V> {
        self.young.get(&key).or_else(|| self.old.get(&key))
    }

    /// The entry, moved to the young generation; None when absent.
    fn touch(&mut self, key: u64) -> Option<&mut V> {
        if !self.young.contains_key(&key) {
            let value = self.old.remove(&key)?;
            self.insert(key, value);
        }
        self.young.get_mut(&key)
    }

    fn insert(&mut self, key: u64, value: V) {
        if !self.young.contains_key(&key) && self.young.len() >= self.half {
            self.old = std::mem::take(&mut self.young);
        }
        self.old.remove(&key);
        self.young.insert(key, value);
    }

    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

#[derive(Debug)]
struct Tables {
    sessions: Generations<Session>,
    chunks: Generations<Chunk>,
}

/// A parent found: its session key and the family its context is recorded under.
struct Found {
    key: String,
    family: u64,
}

/// The per-pool tables of the rule (see the module doc).
pub struct PrefixLineage {
    config: PrefixLineageConfig,
    ids: RandomState,
    tables: Mutex<Tables>,
}

impl std::fmt::Debug for PrefixLineage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (sessions, chunks) = self.sizes();
        f.debug_struct("PrefixLineage")
            .field("config", &self.config)
            .field("sessions", &sessions)
            .field("chunks", &chunks)
            .finish()
    }
}

impl PrefixLineage {
    /// Empty tables.
    pub fn new(config: PrefixLineageConfig) -> Self {
        PrefixLineage {
            config,
            ids: RandomState::new(),
            tables: Mutex::new(Tables {
                sessions: Generations::new(config.max_sessions),
                chunks: Generations::new(config.max_chunks),
            }),
        }
    }

    /// The settings.
    pub fn config(&self) -> &PrefixLineageConfig {
        &self.config
    }

    /// Look the request's parent up (when it is eligible) and record its prompt, in one step
    /// so that concurrent siblings see each other. Returns the lineage found, with source
    /// [`SOURCE`], the parent's session key and the request's own; None when the request is
    /// not eligible or no parent qualifies.
    pub fn observe(&self, request: &Observation<'_>) -> Option<Lineage> {
        self.observe_at(request, Instant::now())
    }

    /// [`PrefixLineage::observe`] at a given time.
    pub fn observe_at(&self, request: &Observation<'_>, now: Instant) -> Option<Lineage> {
        let own_key = request
            .lineage
            .and_then(|l| l.own.as_deref())
            .unwrap_or(request.session);
        let me = self.id(own_key);
        let mut tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
        let eligible = request.lineage.is_none()
            && !request.pinned
            && request.named
            && tables.sessions.peek(me).is_none();
        let found = if eligible {
            self.find_parent(&tables, me, request.prefix, now)
        } else {
            None
        };
        let family = match (request.lineage, &found) {
            (Some(l), _) => {
                let parent = self.id(&l.parent);
                tables.sessions.peek(parent).map_or(parent, |p| p.family)
            }
            (None, Some(found)) => found.family,
            (None, None) => me,
        };
        self.record(&mut tables, me, family, request.prefix);
        let session = Session {
            key: own_key.into(),
            family,
            last: now,
        };
        match tables.sessions.touch(me) {
            Some(entry) => *entry = session,
            None => tables.sessions.insert(me, session),
        }
        found.map(|found| Lineage {
            parent: found.key,
            own: Some(own_key.to_string()),
            source: SOURCE,
        })
    }

    /// How many sessions and recorded chunk hashes are remembered.
    pub fn sizes(&self) -> (usize, usize) {
        let tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
        (tables.sessions.len(), tables.chunks.len())
    }

    fn id(&self, key: &str) -> u64 {
        self.ids.hash_one(key)
    }

    /// Positions of the recorded points among `n` chunk hashes: `k-1, 2k-1, ...`.
    fn points(&self, n: usize) -> impl Iterator<Item = usize> {
        let k = self.config.stride_chunks.max(1);
        (k - 1..n).step_by(k)
    }

    /// Steps 2 and 3 of the rule.
    fn find_parent(&self, tables: &Tables, me: u64, prefix: &[u64], now: Instant) -> Option<Found> {
        let active = |session: u64| {
            tables
                .sessions
                .peek(session)
                .filter(|s| now.saturating_duration_since(s.last) <= self.config.active)
        };
        let mut shared = 0usize;
        let mut candidate: Option<(u64, u64, usize)> = None;
        for i in self.points(prefix.len()) {
            match tables.chunks.peek(prefix[i]) {
                None => {}
                Some(Chunk::Shared) => {
                    shared = i + 1;
                    candidate = None;
                }
                Some(&Chunk::Owned { session, family }) => {
                    if session == me || family == me {
                        return None;
                    }
                    if active(session).is_some() {
                        candidate = Some((session, family, i + 1));
                    }
                }
            }
        }
        let (owner, family, depth) = candidate?;
        let beyond = (depth - shared) as u64 * self.config.tokens_per_chunk;
        if beyond < self.config.min_tokens {
            return None;
        }
        let key = active(owner)?.key.to_string();
        Some(Found { key, family })
    }

    /// Step 4 of the rule, for the chunks.
    fn record(&self, tables: &mut Tables, me: u64, family: u64, prefix: &[u64]) {
        for i in self.points(prefix.len()) {
            let hash = prefix[i];
            match tables.chunks.touch(hash) {
                None => tables.chunks.insert(
                    hash,
                    Chunk::Owned {
                        session: me,
                        family,
                    },
                ),
                Some(chunk) => {
                    if let Chunk::Owned { session, family: f } = *chunk {
                        if session == me {
                            *chunk = Chunk::Owned {
                                session: me,
                                family,
                            };
                        } else if f != family {
                            *chunk = Chunk::Shared;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_index::chunk_hashes;

    const CHUNK: usize = 256;

    /// Chunk hashes of a prompt made of `(segment, chunks)` parts: the same segment name and
    /// length give the same text, so prompts share exactly the chunks of their common leading
    /// parts.
    fn prompt(parts: &[(&str, usize)]) -> Vec<u64> {
        let mut text = Vec::new();
        for (name, chunks) in parts {
            for j in 0..*chunks {
                let mut chunk = format!("{name}:{j};").into_bytes();
                chunk.resize(CHUNK, b'.');
                text.extend_from_slice(&chunk);
            }
        }
        chunk_hashes("m", &text, CHUNK)
    }

    /// Defaults: 64 tokens per chunk, a point per 8 chunks, 4096 tokens (64 chunks) beyond the
    /// shared part, 300 s.
    fn table() -> PrefixLineage {
        PrefixLineage::new(PrefixLineageConfig::default())
    }

    fn first(t: &PrefixLineage, session: &str, prefix: &[u64], at: Instant) -> Option<String> {
        let request = Observation {
            session,
            lineage: None,
            pinned: false,
            named: true,
            prefix,
        };
        t.observe_at(&request, at).map(|l| {
            assert_eq!((l.source, l.own.as_deref()), (SOURCE, Some(session)));
            l.parent
        })
    }

    fn later(t: &PrefixLineage, session: &str, prefix: &[u64], at: Instant) {
        let request = Observation {
            session,
            lineage: None,
            pinned: true,
            named: true,
            prefix,
        };
        assert_eq!(t.observe_at(&request, at), None, "pinned: never considered");
    }

    fn secs(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    #[test]
    fn every_sibling_of_a_burst_finds_the_parent_and_a_nested_one_finds_its_own() {
        let t = table();
        let t0 = Instant::now();
        let ctx = ("parent-context", 400);
        first(&t, "h:parent", &prompt(&[ctx]), t0);
        for i in 0..5 {
            let task = format!("task-{i}");
            let child = prompt(&[ctx, (&task, 20)]);
            let got = first(&t, &format!("h:child-{i}"), &child, secs(t0, 2));
            assert_eq!(got.as_deref(), Some("h:parent"), "sibling {i}");
        }
        // A sub-agent of child 0, forked from its context, finds child 0 (the deepest owner).
        let nested = prompt(&[ctx, ("task-0", 20), ("grandchild", 10)]);
        assert_eq!(
            first(&t, "h:grandchild", &nested, secs(t0, 3)).as_deref(),
            Some("h:child-0")
        );
        // The parent's own next turn has its pin: not considered, and nothing changes.
        later(&t, "h:parent", &prompt(&[ctx, ("turn-2", 30)]), secs(t0, 4));
        let late = prompt(&[ctx, ("task-late", 20)]);
        assert_eq!(
            first(&t, "h:child-late", &late, secs(t0, 5)).as_deref(),
            Some("h:parent")
        );
        // A session seen before is not considered again, pinned or not.
        assert_eq!(first(&t, "h:child-1", &late, secs(t0, 6)), None);
    }

    #[test]
    fn a_shared_team_prefix_names_no_parent_and_a_match_must_reach_min_tokens_beyond_it() {
        let t = table();
        let t0 = Instant::now();
        // A team prefix of 10240 tokens. Session A, then B long after A went quiet: no parent
        // (A is not active), and the team prefix is now contained by two families: shared.
        let team = ("team-system-and-tools", 160);
        first(&t, "h:a", &prompt(&[team, ("a", 64)]), t0);
        assert_eq!(
            first(&t, "h:b", &prompt(&[team, ("b", 64)]), secs(t0, 400)),
            None
        );
        later(
            &t,
            "h:a",
            &prompt(&[team, ("a", 64), ("a-2", 8)]),
            secs(t0, 401),
        );
        // Both active again; a new session of the team matches 10240 tokens, all shared.
        for (i, own) in ["c", "d", "e"].into_iter().enumerate() {
            let p = prompt(&[team, (own, 64)]);
            assert_eq!(
                first(&t, &format!("h:{own}"), &p, secs(t0, 402 + i as u64)),
                None
            );
        }
        // A's own context beyond the team prefix: 64 chunks (4096 tokens) are enough, 56
        // chunks (3584 tokens) are not.
        let deep = prompt(&[team, ("a", 64), ("g", 16)]);
        assert_eq!(
            first(&t, "h:g", &deep, secs(t0, 410)).as_deref(),
            Some("h:a")
        );
        let short = prompt(&[team, ("a", 56), ("f", 16)]);
        assert_eq!(first(&t, "h:f", &short, secs(t0, 411)), None);
    }

    #[test]
    fn an_inactive_parent_is_not_found() {
        let t = table();
        let t0 = Instant::now();
        let ctx = ("context", 200);
        first(&t, "h:p", &prompt(&[ctx]), t0);
        let child = prompt(&[ctx, ("late", 8)]);
        assert_eq!(first(&t, "h:too-late", &child, secs(t0, 301)), None);
        // At exactly the window it still counts (the late child made the context shared, so a
        // fresh table shows it).
        let t = table();
        first(&t, "h:p", &prompt(&[ctx]), t0);
        assert_eq!(
            first(&t, "h:in-time", &child, secs(t0, 300)).as_deref(),
            Some("h:p")
        );
        // The inactive owner of a deeper chunk is skipped for an active shallower one: the
        // deeper chunk was the in-time child's (family p), the shallower part p's own.
        later(&t, "h:p", &prompt(&[ctx]), secs(t0, 900));
        let deeper = prompt(&[ctx, ("late", 8), ("more", 8)]);
        assert_eq!(
            first(&t, "h:nested", &deeper, secs(t0, 901)).as_deref(),
            Some("h:p")
        );
    }

    #[test]
    fn the_first_pair_sharing_an_unseen_team_prefix_is_misread_until_the_second_turn() {
        let t = table();
        let t0 = Instant::now();
        let team = ("team", 160);
        first(&t, "h:a", &prompt(&[team, ("a", 8)]), t0);
        // Nothing has marked the team prefix shared yet: B and C look like A's sub-agents.
        let b = prompt(&[team, ("b", 8)]);
        assert_eq!(first(&t, "h:b", &b, secs(t0, 1)).as_deref(), Some("h:a"));
        let c = prompt(&[team, ("c", 8)]);
        assert_eq!(first(&t, "h:c", &c, secs(t0, 2)).as_deref(), Some("h:a"));
        // B's second turn is recorded in its own family: the team prefix is shared from now on.
        later(
            &t,
            "h:b",
            &prompt(&[team, ("b", 8), ("b-2", 8)]),
            secs(t0, 3),
        );
        for own in ["d", "e", "f"] {
            let p = prompt(&[team, (own, 8)]);
            assert_eq!(first(&t, &format!("h:{own}"), &p, secs(t0, 4)), None);
        }
    }

    #[test]
    fn sub_agents_named_by_headers_keep_the_parents_context_owned() {
        let t = table();
        let t0 = Instant::now();
        let ctx = ("context", 200);
        first(&t, "h:p", &prompt(&[ctx]), t0);
        // Three turns of a sub-agent the headers name: recorded in p's family every time.
        let header = Lineage {
            parent: "h:p".into(),
            own: Some("h:named".into()),
            source: "header",
        };
        for turn in 0..3 {
            let request = Observation {
                session: "h:named",
                lineage: Some(&header),
                pinned: turn > 0,
                named: true,
                prefix: &prompt(&[ctx, ("named", 8 + turn)]),
            };
            assert_eq!(t.observe_at(&request, secs(t0, 1 + turn as u64)), None);
        }
        let child = prompt(&[ctx, ("unnamed", 8)]);
        assert_eq!(
            first(&t, "h:unnamed", &child, secs(t0, 5)).as_deref(),
            Some("h:p")
        );
        // An inferred sub-agent's second turn is recorded in its own family: the context up
        // to the burst is shared now, and a later sub-agent needs what the parent added since.
        later(
            &t,
            "h:unnamed",
            &prompt(&[ctx, ("unnamed", 16)]),
            secs(t0, 6),
        );
        let again = prompt(&[ctx, ("again", 8)]);
        assert_eq!(first(&t, "h:again", &again, secs(t0, 7)), None);
        later(&t, "h:p", &prompt(&[ctx, ("reports", 80)]), secs(t0, 8));
        let wave = prompt(&[ctx, ("reports", 80), ("wave-2", 8)]);
        assert_eq!(
            first(&t, "h:wave-2", &wave, secs(t0, 9)).as_deref(),
            Some("h:p")
        );
    }

    #[test]
    fn own_history_short_prompts_and_no_match_name_no_parent() {
        let t = table();
        let t0 = Instant::now();
        // Shorter than one stride: nothing is recorded or matched.
        assert_eq!(first(&t, "h:tiny", &prompt(&[("x", 7)]), t0), None);
        assert_eq!(t.sizes(), (1, 0));
        assert_eq!(first(&t, "h:none", &[], t0), None);
        // A session forgotten by the session table but not by the chunk table: its own history.
        let small = PrefixLineage::new(PrefixLineageConfig {
            max_sessions: 2,
            ..PrefixLineageConfig::default()
        });
        let own = prompt(&[("own", 200)]);
        first(&small, "h:s", &own, t0);
        first(&small, "h:x", &prompt(&[("x", 8)]), t0);
        first(&small, "h:y", &prompt(&[("y", 8)]), t0);
        first(&small, "h:z", &prompt(&[("z", 8)]), t0);
        assert_eq!(
            first(&small, "h:s", &prompt(&[("own", 200), ("t", 8)]), t0),
            None
        );
        // Unrelated prompts.
        assert_eq!(first(&t, "h:other", &prompt(&[("other", 200)]), t0), None);
        // A key that is only the request's own id: recorded, never given a parent. A fork of
        // it, named, finds it.
        let history = prompt(&[("conversation", 200), ("reply", 8)]);
        let unnamed = Observation {
            session: "root:resp_2",
            lineage: None,
            pinned: false,
            named: false,
            prefix: &history,
        };
        assert_eq!(t.observe_at(&unnamed, t0), None);
        let fork = prompt(&[("conversation", 200), ("reply", 8), ("fork", 8)]);
        assert_eq!(
            first(&t, "h:fork", &fork, t0).as_deref(),
            Some("root:resp_2")
        );
    }

    #[test]
    fn memory_is_bounded_and_a_long_prompt_records_one_point_per_stride() {
        let t = table();
        // 200k tokens: 3125 chunks, a point every 8.
        let long = prompt(&[("long", 3125)]);
        first(&t, "h:long", &long, Instant::now());
        assert_eq!(t.sizes(), (1, 3125 / 8));
        let small = PrefixLineage::new(PrefixLineageConfig {
            max_sessions: 16,
            max_chunks: 256,
            ..PrefixLineageConfig::default()
        });
        let t0 = Instant::now();
        for i in 0..500 {
            let p = prompt(&[(&format!("s{i}"), 80)]);
            first(&small, &format!("h:s{i}"), &p, t0);
            let (sessions, chunks) = small.sizes();
            assert!(sessions <= 16 && chunks <= 256, "{sessions} {chunks}");
        }
        // The recent ones are remembered: a fork of the last session finds it.
        let fork = prompt(&[("s499", 80), ("fork", 8)]);
        assert_eq!(
            first(&small, "h:fork", &fork, t0).as_deref(),
            Some("h:s499")
        );
        // Generations of 40 points: P's 50 points span two, and 31 more points of another
        // session push P's first 40 out. The 10 deepest still say the prompt matches.
        let t = PrefixLineage::new(PrefixLineageConfig {
            max_chunks: 80,
            ..PrefixLineageConfig::default()
        });
        let ctx = ("context", 400);
        first(&t, "h:p", &prompt(&[ctx]), t0);
        first(&t, "h:q", &prompt(&[("q", 248)]), t0);
        assert_eq!(t.sizes(), (2, 41));
        let child = prompt(&[ctx, ("child", 8)]);
        assert_eq!(first(&t, "h:child", &child, t0).as_deref(), Some("h:p"));
    }
}
