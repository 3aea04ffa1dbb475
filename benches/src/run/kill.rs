//! `--kill-replica AT`: replica 0 crashes at simulated second AT of every policy's replay, and
//! the summary reports what that cost and how reuse recovers.
//!
//! The kill: the gateway reaches every replica through a [`Relay`]; at AT (on the replay's clock)
//! the engine's in-flight count is scraped, the relay is killed (its port refuses connections and
//! every open connection closes, breaking the streams in flight), the replica's counters are
//! scraped once more (they become its final figures) and the simulator is shut down. The gateway
//! is not told: it finds out the way it would in production, from refused connections and broken
//! streams.
//!
//! The figures ([`KillSummary`]), with `t` the simulated second the kill happened and `W` =
//! [`WINDOW_S`]:
//! - `in_flight`: requests the gateway was streaming from the killed replica at `t` (the
//!   response's `x-agentgate-endpoint` header named it, it was sent before `t` and ended at or
//!   after `t`); `errors_in_flight`: those that ended in an error. A request that was still waiting
//!   for the replica's response headers at `t` is retried on another replica by the gateway and
//!   does not count here.
//! - `errors_after` / `shed_after`: requests sent at or after `t` that ended in an error / were
//!   refused by flow control (shed or rate-limited); `routed_to_killed_after`: requests sent after `t` that the gateway still
//!   reported as served by the killed replica (0 by construction once its port is closed: a
//!   request sent there is refused at connect and retried elsewhere, at no error, so
//!   `errors_after` is the figure that shows nothing was lost).
//! - `errors_other`: every other error (before the kill, or in flight elsewhere at `t`).
//! - cache hit ratio (cached / prompt tokens of the successful requests sent in a window):
//!   `hit_ratio_before` over `[t - W, t)`, `hit_ratio_after_60s` over `[t, t + W)`,
//!   `hit_ratio_late` over `[t + W, end]`; null when no request succeeded in the window.
//!   `available_*` is the pooled-cache oracle's hit ratio on the same requests: an ideal cache
//!   with the whole fleet's capacity before the kill, and with the capacity of the replicas left
//!   after it (see `run::reuse`: the killed replica's capacity is gone, its contents with it).
//!   `captured_*` = `hit_ratio_* / available_*`: the workload's own drift over time and the lost
//!   capacity cancel out, so reuse has recovered when `captured_late` is back near
//!   `captured_before`.
//!
//! If the replay ends before AT, nothing is killed and `performed` is false.

use serde::Serialize;

use super::clock::SimClock;
use super::metrics::{self, ReplicaMetrics};
use super::relay::Relay;
use super::replay::{Outcome, RequestRecord};
use super::reuse::OracleHit;

/// Width of the hit-ratio windows around the kill, simulated seconds.
pub const WINDOW_S: f64 = 60.0;

/// The replica every `--kill-replica` run kills.
pub const KILLED_REPLICA: usize = 0;

/// What the kill did, per policy (`kill` in summary.json).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KillSummary {
    /// Simulated second the kill was scheduled at (`--kill-replica`).
    pub at_s: f64,
    /// Index of the killed replica.
    pub replica: usize,
    /// Whether the kill happened (false when the replay ended before `at_s`).
    pub performed: bool,
    /// Simulated second the kill actually happened.
    pub killed_at_s: Option<f64>,
    /// Requests running or waiting in the killed engine just before the kill (its own gauges).
    pub engine_in_flight: Option<u64>,
    /// Requests the gateway was streaming from the killed replica at the kill.
    pub in_flight: u64,
    /// Of `in_flight`, those that ended in an error.
    pub errors_in_flight: u64,
    /// Requests sent at or after the kill.
    pub requests_after: u64,
    /// Requests sent at or after the kill that ended in an error.
    pub errors_after: u64,
    /// Requests sent at or after the kill that flow control refused (shed or rate-limited).
    pub shed_after: u64,
    /// Requests sent after the kill that the gateway reported as served by the killed replica.
    pub routed_to_killed_after: u64,
    /// Errors not counted above (before the kill, or in flight on another replica).
    pub errors_other: u64,
    /// Width of the hit-ratio windows, simulated seconds.
    pub window_s: f64,
    /// Cache hit ratio of the requests sent in `[t - window, t)`.
    pub hit_ratio_before: Option<f64>,
    /// Cache hit ratio of the requests sent in `[t, t + window)`.
    pub hit_ratio_after_60s: Option<f64>,
    /// Cache hit ratio of the requests sent from `t + window` to the end.
    pub hit_ratio_late: Option<f64>,
    /// The pooled-cache oracle's hit ratio on the requests of `hit_ratio_before`.
    pub available_before: Option<f64>,
    /// The same for `hit_ratio_after_60s`.
    pub available_after_60s: Option<f64>,
    /// The same for `hit_ratio_late`.
    pub available_late: Option<f64>,
    /// `hit_ratio_before / available_before`.
    pub captured_before: Option<f64>,
    /// `hit_ratio_after_60s / available_after_60s`.
    pub captured_after_60s: Option<f64>,
    /// `hit_ratio_late / available_late`.
    pub captured_late: Option<f64>,
}

/// How the kill went, as the killer saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KillEvent {
    /// Simulated second of the kill.
    pub at_s: f64,
    /// The engine's running + waiting gauges just before it (None if the scrape failed).
    pub engine_in_flight: Option<u64>,
}

/// Compute the summary from the replay's records and the oracle's per-request view (`oracle`,
/// sorted by `seq`). `event` is None when the kill did not happen; `endpoint` is the gateway's
/// name of the killed replica.
pub fn summarize(
    records: &[RequestRecord],
    oracle: &[OracleHit],
    scheduled_s: f64,
    replica: usize,
    endpoint: &str,
    event: Option<KillEvent>,
) -> KillSummary {
    let t = event.map_or(scheduled_s, |e| e.at_s);
    let done_s = |r: &RequestRecord| r.sent_s + r.e2e_ms / 1000.0;
    let on_killed = |r: &RequestRecord| r.endpoint.as_deref() == Some(endpoint);
    let is_error = |r: &RequestRecord| matches!(r.outcome, Outcome::Error(_));
    let performed = event.is_some();

    let in_flight: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| performed && on_killed(r) && r.sent_s < t && done_s(r) >= t)
        .collect();
    let errors_in_flight = in_flight.iter().filter(|r| is_error(r)).count() as u64;
    let after: Vec<&RequestRecord> = records.iter().filter(|r| r.sent_s >= t).collect();
    let errors_after = after.iter().filter(|r| is_error(r)).count() as u64;
    let shed_after = after.iter().filter(|r| r.outcome.is_refusal()).count() as u64;
    let routed_to_killed_after = if performed {
        after.iter().filter(|r| on_killed(r)).count() as u64
    } else {
        0
    };
    let errors = records.iter().filter(|r| is_error(r)).count() as u64;
    let before = window(records, oracle, Fleet::Whole, (t - WINDOW_S).max(0.0), t);
    // Against the survivors' cache once a replica is gone; the whole fleet's if the replay
    // ended before the kill.
    let after_fleet = if performed {
        Fleet::Survivors
    } else {
        Fleet::Whole
    };
    let right_after = window(records, oracle, after_fleet, t, t + WINDOW_S);
    let late = window(records, oracle, after_fleet, t + WINDOW_S, f64::INFINITY);
    KillSummary {
        at_s: scheduled_s,
        replica,
        performed,
        killed_at_s: event.map(|e| e.at_s),
        engine_in_flight: event.and_then(|e| e.engine_in_flight),
        in_flight: in_flight.len() as u64,
        errors_in_flight,
        requests_after: after.len() as u64,
        errors_after,
        shed_after,
        routed_to_killed_after,
        errors_other: errors.saturating_sub(errors_in_flight + errors_after),
        window_s: WINDOW_S,
        hit_ratio_before: before.hit,
        hit_ratio_after_60s: right_after.hit,
        hit_ratio_late: late.hit,
        available_before: before.available,
        available_after_60s: right_after.available,
        available_late: late.available,
        captured_before: before.captured(),
        captured_after_60s: right_after.captured(),
        captured_late: late.captured(),
    }
}

/// Measured and ideal hit ratios over one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// cached / prompt tokens as the engines reported them.
    pub hit: Option<f64>,
    /// The pooled-cache oracle's hit / prompt tokens on the same requests.
    pub available: Option<f64>,
}

impl Window {
    /// hit / available, when both are known and available is positive.
    pub fn captured(&self) -> Option<f64> {
        match (self.hit, self.available) {
            (Some(hit), Some(available)) if available > 0.0 => Some(hit / available),
            _ => None,
        }
    }
}

/// Which oracle a window is compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fleet {
    /// The whole fleet's capacity.
    Whole,
    /// The capacity of the replicas left after the kill (the whole fleet's where not computed).
    Survivors,
}

/// The successful requests sent in `[from, to)`: their hit ratio, and `fleet`'s oracle's on the
/// same requests; None where there are no prompt tokens.
pub fn window(
    records: &[RequestRecord],
    oracle: &[OracleHit],
    fleet: Fleet,
    from: f64,
    to: f64,
) -> Window {
    let (mut prompt, mut cached, mut oracle_prompt, mut oracle_hit) = (0u64, 0u64, 0u64, 0u64);
    for r in records
        .iter()
        .filter(|r| r.outcome == Outcome::Success && r.sent_s >= from && r.sent_s < to)
    {
        prompt += r.input_tokens;
        cached += r.cached_tokens;
        if let Ok(i) = oracle.binary_search_by_key(&r.seq, |o| o.seq) {
            if let Some(o) = oracle.get(i) {
                oracle_prompt += o.prompt_tokens;
                oracle_hit += match fleet {
                    Fleet::Whole => o.hit_tokens,
                    Fleet::Survivors => o.survivor_hit_tokens.unwrap_or(o.hit_tokens),
                };
            }
        }
    }
    let ratio = |part: u64, whole: u64| (whole > 0).then(|| part as f64 / whole as f64);
    Window {
        hit: ratio(cached, prompt),
        available: ratio(oracle_hit, oracle_prompt),
    }
}

/// What the killer hands back.
pub enum KillOutcome {
    /// The replica was killed; `metrics` are its counters right after the kill.
    Killed {
        /// When, and the engine's in-flight count.
        event: KillEvent,
        /// The replica's final counters.
        metrics: ReplicaMetrics,
    },
    /// The replay ended first: the replica and its relay, untouched.
    NotReached {
        /// The relay in front of it.
        relay: Relay,
        /// The replica.
        sim: agentgate_sim::SimHandle,
    },
}

/// A background task that kills one replica at a simulated second unless stopped first.
pub struct Killer {
    cancel: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<KillOutcome>,
}

impl Killer {
    /// At `at_s` on `clock`, kill `relay` and shut `sim` down (see the module docs).
    pub fn start(
        clock: SimClock,
        at_s: f64,
        mut relay: Relay,
        sim: agentgate_sim::SimHandle,
        client: reqwest::Client,
    ) -> Killer {
        let (cancel, cancelled) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tokio::select! {
                _ = clock.sleep_until(at_s) => {}
                _ = cancelled => return KillOutcome::NotReached { relay, sim },
            }
            let url = sim.base_url();
            let engine_in_flight = metrics::scrape(&client, &url)
                .await
                .ok()
                .map(|m| (m.running + m.waiting).round() as u64);
            let at_s = clock.now_s();
            relay.kill().await;
            let metrics = metrics::scrape(&client, &url).await.unwrap_or_default();
            sim.shutdown().await;
            KillOutcome::Killed {
                event: KillEvent {
                    at_s,
                    engine_in_flight,
                },
                metrics,
            }
        });
        Killer { cancel, task }
    }

    /// Stop waiting (a kill already under way completes) and return what happened; None if the
    /// task failed.
    pub async fn finish(self) -> Option<KillOutcome> {
        let _ = self.cancel.send(());
        self.task.await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(sent_s: f64, e2e_s: f64, endpoint: &str, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            seq: sent_s as u64,
            session: 0,
            turn: 0,
            continuing: false,
            gateway: 0,
            endpoint: Some(endpoint.to_string()).filter(|e| !e.is_empty()),
            route_reason: None,
            pin_moved: None,
            team: "default".into(),
            band: None,
            queue_wait_ms: None,
            sent_s,
            outcome,
            ttft_ms: None,
            e2e_ms: e2e_s * 1000.0,
            input_tokens: 1000,
            cached_tokens: 0,
            output_tokens: 0,
        }
    }

    fn hits(mut r: RequestRecord, cached: u64) -> RequestRecord {
        r.cached_tokens = cached;
        r
    }

    #[test]
    fn classifies_failures_around_the_kill_and_windows_hit_ratios() {
        let err = || Outcome::Error("stream read: connection reset".into());
        let records = vec![
            // Before the kill, finished before it.
            hits(record(30.0, 5.0, "bench/0", Outcome::Success), 800),
            hits(record(95.0, 5.0, "bench/1", Outcome::Success), 600),
            record(96.0, 1.0, "bench/1", err()),
            // In flight on the killed replica at 100 s: one broke, one finished just before.
            record(98.0, 2.5, "bench/0", err()),
            hits(record(97.0, 2.0, "bench/0", Outcome::Success), 900),
            // In flight elsewhere and failed for another reason.
            record(99.0, 3.0, "bench/2", err()),
            // After the kill: a failure without an endpoint, a shed, successes.
            record(100.5, 0.1, "", err()),
            record(101.0, 0.0, "", Outcome::Shed("overloaded_shed".into())),
            hits(record(120.0, 5.0, "bench/1", Outcome::Success), 100),
            hits(record(170.0, 5.0, "bench/2", Outcome::Success), 700),
            hits(record(200.0, 5.0, "bench/0", Outcome::Success), 700),
        ];
        let event = KillEvent {
            at_s: 100.0,
            engine_in_flight: Some(3),
        };
        // The oracle would have hit 900 of 1000 tokens on every successful request, with the
        // replicas left after the kill 500.
        let oracle: Vec<OracleHit> = records
            .iter()
            .filter(|r| r.outcome == Outcome::Success)
            .map(|r| OracleHit {
                seq: r.seq,
                prompt_tokens: 1000,
                hit_tokens: 900,
                survivor_hit_tokens: Some(500),
            })
            .collect();
        let kill = summarize(&records, &oracle, 99.9, 0, "bench/0", Some(event));
        assert!(kill.performed);
        assert_eq!(kill.at_s, 99.9);
        assert_eq!(kill.killed_at_s, Some(100.0));
        assert_eq!(kill.engine_in_flight, Some(3));
        assert_eq!((kill.in_flight, kill.errors_in_flight), (1, 1));
        assert_eq!(kill.requests_after, 5);
        assert_eq!((kill.errors_after, kill.shed_after), (1, 1));
        assert_eq!(kill.routed_to_killed_after, 1, "the 200 s request");
        assert_eq!(kill.errors_other, 2, "the 96 s and 99 s errors");
        // [40, 100): successes at 95 and 97 s.
        assert_eq!(kill.hit_ratio_before, Some(1500.0 / 2000.0));
        // [100, 160): the 120 s success only.
        assert_eq!(kill.hit_ratio_after_60s, Some(0.1));
        // [160, end): 170 and 200 s.
        assert_eq!(kill.hit_ratio_late, Some(0.7));
        assert_eq!(kill.available_before, Some(0.9));
        assert_eq!(kill.available_after_60s, Some(0.5));
        assert_eq!(kill.available_late, Some(0.5));
        assert!((kill.captured_before.unwrap() - 0.75 / 0.9).abs() < 1e-12);
        assert!((kill.captured_after_60s.unwrap() - 0.2).abs() < 1e-12);
        assert!((kill.captured_late.unwrap() - 1.4).abs() < 1e-12);
        let whole = window(&records, &oracle, Fleet::Whole, 160.0, 400.0);
        assert_eq!(whole.available, Some(0.9));
        let empty = window(&records, &oracle, Fleet::Whole, 300.0, 400.0);
        assert_eq!(
            (empty.hit, empty.available, empty.captured()),
            (None, None, None)
        );
        let no_oracle = window(&records, &[], Fleet::Survivors, 0.0, 400.0);
        assert_eq!((no_oracle.available, no_oracle.captured()), (None, None));
    }

    #[test]
    fn a_kill_that_never_happened_counts_nothing_in_flight() {
        let records = vec![record(10.0, 50.0, "bench/0", Outcome::Success)];
        let kill = summarize(&records, &[], 30.0, 0, "bench/0", None);
        assert!(!kill.performed);
        assert_eq!(kill.killed_at_s, None);
        assert_eq!((kill.in_flight, kill.errors_in_flight), (0, 0));
        assert_eq!(kill.requests_after, 0);
        assert_eq!(kill.hit_ratio_before, Some(0.0));
        assert_eq!(kill.hit_ratio_after_60s, None);
    }
}
