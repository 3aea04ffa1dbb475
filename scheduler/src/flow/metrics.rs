//! Flow-control counters and queue-wait histograms, as a point-in-time [`FlowSnapshot`] the
//! gateway renders as Prometheus text.
//!
//! Counters are monotonic over the controller's life and survive reconfiguration; a band or
//! team removed from the configuration drops out of the snapshot.

use std::time::Duration;

/// Upper bounds, in seconds, of the queue-wait histogram buckets (a `+Inf` bucket follows).
/// They reach past the longest queue TTLs in use (the implicit band waits up to
/// `upstream.first_byte_timeout_s`, 600 s by default).
pub const WAIT_BUCKETS_SECONDS: [f64; 18] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0,
];

/// Queue waits of dispatched requests, in the fixed [`WAIT_BUCKETS_SECONDS`] buckets.
#[derive(Debug, Clone, PartialEq)]
pub struct WaitHistogram {
    /// Per-bucket counts (not cumulative); the last entry is the `+Inf` bucket.
    counts: [u64; WAIT_BUCKETS_SECONDS.len() + 1],
    sum_seconds: f64,
    count: u64,
}

impl Default for WaitHistogram {
    fn default() -> Self {
        WaitHistogram {
            counts: [0; WAIT_BUCKETS_SECONDS.len() + 1],
            sum_seconds: 0.0,
            count: 0,
        }
    }
}

impl WaitHistogram {
    /// Record one wait.
    pub fn observe(&mut self, wait: Duration) {
        let secs = wait.as_secs_f64();
        let bucket = WAIT_BUCKETS_SECONDS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(WAIT_BUCKETS_SECONDS.len());
        self.counts[bucket] += 1;
        self.sum_seconds += secs;
        self.count += 1;
    }

    /// Prometheus buckets: `(le, cumulative count)`, ending with `(f64::INFINITY, count)`.
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        WAIT_BUCKETS_SECONDS
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            }))
    }

    /// Number of waits recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the recorded waits, in seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_seconds
    }

    /// The upper bound (seconds) of the bucket holding quantile `q` (0..=1): an upper
    /// estimate, `None` when empty, `f64::INFINITY` when it falls past the last bound.
    pub fn quantile_upper_bound(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        self.cumulative()
            .find(|&(_, cumulative)| cumulative >= rank)
            .map(|(le, _)| le)
    }
}

/// One band's queue and counters.
#[derive(Debug, Clone, PartialEq)]
pub struct BandSnapshot {
    /// Band name.
    pub name: String,
    /// Band priority.
    pub priority: i32,
    /// Requests waiting now.
    pub queued: usize,
    /// Request bytes waiting now.
    pub queued_bytes: u64,
    /// Requests dispatched.
    pub dispatched: u64,
    /// Requests shed on arrival while saturated.
    pub shed: u64,
    /// Requests of the band refused by their team's rate limits.
    pub rate_limited: u64,
    /// Requests refused because the queue was full.
    pub queue_full: u64,
    /// Requests that waited the whole TTL.
    pub timed_out: u64,
    /// Requests whose client left while they waited.
    pub cancelled: u64,
    /// Queue waits of dispatched requests.
    pub wait: WaitHistogram,
}

/// One team's queue and counters.
#[derive(Debug, Clone, PartialEq)]
pub struct TeamSnapshot {
    /// Team name.
    pub name: String,
    /// Requests waiting now, over all bands.
    pub queued: usize,
    /// Requests dispatched and not yet finished.
    pub in_flight: u64,
    /// The team's requests in flight at the other gateways in front of the pool, as last
    /// exchanged (they count toward its `max_concurrent`).
    pub peer_in_flight: u64,
    /// Whether a request of the team waits at another gateway, as last exchanged.
    pub peer_waiting: bool,
    /// Requests dispatched.
    pub dispatched_requests: u64,
    /// Tokens dispatched: the estimate at dispatch, replaced by the actual count when the
    /// request reports it ([`Permit::finish`](super::Permit::finish)).
    pub dispatched_tokens: u64,
    /// Tokens of the requests that finished: each one's actual count, or its estimate when it
    /// reported none. Only grows, unlike `dispatched_tokens`, whose estimates shrink to the
    /// actual counts.
    pub finished_tokens: u64,
    /// Requests shed on arrival while saturated.
    pub shed: u64,
    /// Requests refused by the team's rate limits.
    pub rate_limited: u64,
    /// Requests refused because the band's queue was full.
    pub queue_full: u64,
    /// Requests that waited the whole TTL.
    pub timed_out: u64,
    /// Requests whose client left while they waited.
    pub cancelled: u64,
    /// Queue waits of the team's dispatched requests, over all bands.
    pub wait: WaitHistogram,
}

/// Queue waits by turn kind, over all bands.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnWaits {
    /// Continuing turns of active sessions.
    pub continuing: WaitHistogram,
    /// New sessions (including those promoted by aging).
    pub new: WaitHistogram,
    /// New-session requests dispatched after aging promoted them.
    pub promoted: u64,
    /// Requests held for a slot on their session's endpoint, then dispatched when it had room.
    pub held: u64,
    /// Requests held for their session's endpoint until `pin_wait` ran out, then dispatched to
    /// be placed elsewhere ([`Permit::outwaited_pin`](super::Permit::outwaited_pin)).
    pub outwaited: u64,
}

/// Everything the controller counts, at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowSnapshot {
    /// Requests dispatched and not yet finished.
    pub in_flight: u64,
    /// Estimated tokens of the in-flight requests.
    pub in_flight_tokens: u64,
    /// Bands, highest priority first.
    pub bands: Vec<BandSnapshot>,
    /// Teams, in configuration order.
    pub teams: Vec<TeamSnapshot>,
    /// Queue waits by turn kind.
    pub turns: TurnWaits,
}

impl FlowSnapshot {
    /// The band named `name`.
    pub fn band(&self, name: &str) -> Option<&BandSnapshot> {
        self.bands.iter().find(|b| b.name == name)
    }

    /// The team named `name`.
    pub fn team(&self, name: &str) -> Option<&TeamSnapshot> {
        self.teams.iter().find(|t| t.name == name)
    }

    /// Requests waiting now, over all bands.
    pub fn queued(&self) -> usize {
        self.bands.iter().map(|b| b.queued).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = WaitHistogram::default();
        h.observe(Duration::ZERO);
        h.observe(Duration::from_millis(10));
        h.observe(Duration::from_millis(300));
        // A wait within the default implicit band's TTL (600 s) has a bucket of its own.
        h.observe(Duration::from_secs(500));
        h.observe(Duration::from_secs(4000));
        let buckets: Vec<_> = h.cumulative().collect();
        assert_eq!(buckets.len(), WAIT_BUCKETS_SECONDS.len() + 1);
        assert_eq!(buckets[0], (0.005, 1));
        assert_eq!(buckets[1], (0.01, 2));
        assert_eq!(buckets[6], (0.5, 3));
        assert_eq!(buckets[13], (120.0, 3));
        assert_eq!(buckets[14], (300.0, 3));
        assert_eq!(buckets[15], (600.0, 4));
        assert_eq!(buckets[18], (f64::INFINITY, 5));
        assert_eq!(h.count(), 5);
        assert!((h.sum_seconds() - 4500.31).abs() < 1e-9);
        assert_eq!(h.quantile_upper_bound(0.5), Some(0.5));
        assert_eq!(h.quantile_upper_bound(0.8), Some(600.0));
        assert_eq!(h.quantile_upper_bound(1.0), Some(f64::INFINITY));
        assert_eq!(WaitHistogram::default().quantile_upper_bound(0.5), None);
    }
}
