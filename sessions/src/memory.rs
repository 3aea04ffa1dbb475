//! `MemoryStore`: the in-process backend, for a single gateway replica and for tests.
//!
//! Records and session pins live in mutex-guarded maps with an expiry instant each. Expired
//! entries are invisible at once and are purged in a sweep at most once per sweep interval,
//! piggybacked on writes, so no background task is needed. Pins are keyed like in Redis
//! ([`pin_key`]), so a client's session key costs bounded memory however long it is.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use serde_json::Value;

use crate::pins::pin_key;
use crate::rate::{gcra_step, RateDecision, RateLimit};
use crate::record::{is_active_status, response_status};
use crate::{History, ResponseRecord, SessionPin, Store, StoreError, StoreOptions, MAX_CHAIN_LEN};

/// How often, at most, a write sweeps expired records out of the map.
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// A stored record and when it stops being visible.
struct Entry {
    rec: ResponseRecord,
    expires_at: Instant,
}

/// A session pin and when it stops being in force.
struct PinEntry {
    pin: SessionPin,
    expires_at: Instant,
}

/// The maps and their sweep bookkeeping, guarded together.
struct Records {
    by_id: HashMap<String, Entry>,
    pins: HashMap<String, PinEntry>,
    next_sweep: Instant,
}

impl Records {
    /// The live entry for `id` owned by `team`, if any.
    fn live_mut(&mut self, team: &str, id: &str, now: Instant) -> Option<&mut Entry> {
        self.by_id
            .get_mut(id)
            .filter(|e| e.expires_at > now && e.rec.team == team)
    }

    /// The pin under `key` if it is still in force.
    fn live_pin_mut(&mut self, key: &str, now: Instant) -> Option<&mut PinEntry> {
        self.pins.get_mut(key).filter(|e| e.expires_at > now)
    }

    /// Drop expired entries if the sweep interval has passed.
    fn maybe_sweep(&mut self, now: Instant) {
        if now >= self.next_sweep {
            self.by_id.retain(|_, e| e.expires_at > now);
            self.pins.retain(|_, e| e.expires_at > now);
            self.next_sweep = now + SWEEP_INTERVAL;
        }
    }
}

/// In-process store; contents are lost when the process exits.
pub struct MemoryStore {
    records: Mutex<Records>,
    /// GCRA counters: key -> theoretical arrival time in ms since `epoch`.
    rates: Mutex<HashMap<String, f64>>,
    epoch: Instant,
    ttl: Duration,
    pin_ttl: Duration,
}

impl MemoryStore {
    /// An empty store; `opts.ttl` and `opts.pin_ttl` are used, the key prefix is not.
    pub fn new(opts: StoreOptions) -> Self {
        MemoryStore {
            records: Mutex::new(Records {
                by_id: HashMap::new(),
                pins: HashMap::new(),
                next_sweep: Instant::now() + SWEEP_INTERVAL,
            }),
            rates: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
            ttl: opts.ttl,
            pin_ttl: opts.pin_ttl,
        }
    }

    /// Number of session pins held, including expired ones not yet swept.
    pub fn pin_count(&self) -> usize {
        self.lock().pins.len()
    }

    /// Number of records held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Whether the store holds no records at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
        let mut records = self.lock();
        records.maybe_sweep(now);
        records.by_id.insert(
            rec.id.clone(),
            Entry {
                rec: rec.clone(),
                expires_at,
            },
        );
        Ok(())
    }

    async fn get(&self, team: &str, id: &str) -> Result<Option<ResponseRecord>, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        Ok(records.live_mut(team, id, now).map(|e| e.rec.clone()))
    }

    async fn history(&self, team: &str, id: &str) -> Result<Option<History>, StoreError> {
        let now = Instant::now();
        let expires_at = self.expiry_from(now);
        let mut records = self.lock();
        // Walk newest to oldest, collecting each response's items in reverse, then flip once.
        let mut reversed: Vec<Value> = Vec::new();
        let mut next = Some(id.to_string());
        let mut walked = 0usize;
        let mut root_id = id.to_string();
        while let Some(current) = next.take() {
            let Some(entry) = records.live_mut(team, &current, now) else {
                if walked == 0 {
                    return Ok(None);
                }
                break;
            };
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
            reversed.extend(entry.rec.output_items.iter().rev().cloned());
            reversed.extend(entry.rec.input_items.iter().rev().cloned());
            next = entry.rec.previous_response_id.clone();
        }
        reversed.reverse();
        Ok(Some(History {
            items: reversed,
            root_id,
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
        let Some(entry) = records.live_mut(team, id, now) else {
            return Ok(false);
        };
        if !is_active_status(response_status(&entry.rec.response)) {
            return Ok(false);
        }
        entry.rec.response = response.clone();
        entry.rec.output_items = output_items.to_vec();
        entry.expires_at = expires_at;
        Ok(true)
    }

    async fn delete(&self, team: &str, id: &str) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        if records.live_mut(team, id, now).is_none() {
            return Ok(false);
        }
        records.by_id.remove(id);
        Ok(true)
    }

    async fn get_pin(&self, pool: &str, session: &str) -> Result<Option<SessionPin>, StoreError> {
        let key = pin_key("", pool, session);
        let now = Instant::now();
        let mut records = self.lock();
        Ok(records.live_pin_mut(&key, now).map(|e| e.pin.clone()))
    }

    async fn swap_pin(
        &self,
        pool: &str,
        session: &str,
        expected: Option<&SessionPin>,
        new: &SessionPin,
    ) -> Result<SessionPin, StoreError> {
        let key = pin_key("", pool, session);
        let now = Instant::now();
        let expires_at = expiry_after(now, self.pin_ttl);
        let mut records = self.lock();
        records.maybe_sweep(now);
        if let Some(entry) = records.live_pin_mut(&key, now) {
            entry.expires_at = expires_at;
            if Some(&entry.pin) != expected {
                return Ok(entry.pin.clone());
            }
        }
        records.pins.insert(
            key,
            PinEntry {
                pin: new.clone(),
                expires_at,
            },
        );
        Ok(new.clone())
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
        if steps.iter().all(|(d, _)| d.allowed()) {
            for (limit, (_, tat)) in limits.iter().zip(&steps) {
                rates.insert(limit.key.clone(), *tat);
            }
        }
        Ok(steps.into_iter().map(|(d, _)| d).collect())
    }

    fn round_trips(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{pin, pin_expiry_suite, record, suite};

    #[tokio::test]
    async fn passes_the_store_suite() {
        suite(&MemoryStore::default()).await;
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
    async fn pins_expire_after_their_own_ttl() {
        let pin_ttl = Duration::from_millis(20);
        let store = MemoryStore::new(StoreOptions {
            pin_ttl,
            ..StoreOptions::default()
        });
        pin_expiry_suite(&store, pin_ttl).await;
    }

    #[tokio::test]
    async fn swaps_and_touches_refresh_a_pins_ttl_and_reads_do_not() {
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
        assert_eq!(expiry(&store), soon);
        store.touch_pin("p", "s").await.unwrap();
        assert!(expiry(&store) > soon);

        shorten(&store);
        let lost = store
            .swap_pin("p", "s", Some(&pin("other", 0)), &pin("e1", 1))
            .await
            .unwrap();
        assert_eq!(lost, pin("e0", 0));
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
