//! Behaviour of the [`FlowController`] through its public API, on tokio's paused clock.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::*;

const SEC: Duration = Duration::from_secs(1);

/// `interactive` (priority 10, TTL 30 s) and `batch` (priority 0, TTL 60 s); team `agents`
/// defaults to interactive and may use batch, team `bulk` only batch.
fn config() -> FlowConfig {
    let mut interactive = BandSpec::new("interactive", 10);
    interactive.queue_ttl = 30 * SEC;
    let mut batch = BandSpec::new("batch", 0);
    batch.queue_ttl = 60 * SEC;
    let mut agents = TeamSpec::new("agents", "interactive");
    agents.allowed_bands = vec!["interactive".into(), "batch".into()];
    FlowConfig::new(
        vec![interactive, batch],
        vec![agents, TeamSpec::new("bulk", "batch")],
    )
}

/// [`config`] with `batch` sheddable.
fn sheddable_config() -> FlowConfig {
    let mut config = config();
    config.bands[1].sheddable = true;
    config
}

fn controller(config: FlowConfig, limit: u64) -> (FlowController, Arc<MaxInFlight>) {
    let capacity = Arc::new(MaxInFlight::new(limit));
    let controller = FlowController::new(config, capacity.clone()).expect("valid config");
    (controller, capacity)
}

/// Poll `future` once: its output if it is ready, `None` (and the future dropped) otherwise.
async fn poll_once<F: Future>(future: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = future => Some(out),
        () = std::future::ready(()) => None,
    }
}

/// Let spawned tasks run until `queued` requests wait.
async fn wait_queued(controller: &FlowController, queued: usize) {
    for _ in 0..100 {
        if controller.snapshot().queued() == queued {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!(
        "expected {queued} queued, snapshot: {:#?}",
        controller.snapshot()
    );
}

type Granted = mpsc::UnboundedSender<(String, Permit)>;

/// Admit `ticket` in a task that hands its permit, labelled, to `granted`.
fn spawn_admit(
    controller: &FlowController,
    ticket: Ticket,
    label: impl Into<String>,
    granted: &Granted,
) -> JoinHandle<Result<(), Rejection>> {
    let controller = controller.clone();
    let granted = granted.clone();
    let label = label.into();
    tokio::spawn(async move {
        let permit = controller.admit(ticket).await?;
        let _ = granted.send((label, permit));
        Ok(())
    })
}

/// With at most one request in flight, release each permit as soon as it arrives (after
/// `on_grant`) and return the labels in dispatch order.
async fn drain_in_order(
    granted: &mut mpsc::UnboundedReceiver<(String, Permit)>,
    count: usize,
    mut on_grant: impl FnMut(&str, Permit),
) -> Vec<String> {
    let mut order = Vec::new();
    for _ in 0..count {
        let (label, permit) = granted.recv().await.expect("a permit");
        order.push(label.clone());
        on_grant(&label, permit);
    }
    order
}

#[tokio::test(start_paused = true)]
async fn higher_bands_go_first() {
    let (flow, capacity) = controller(config(), 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("bulk", 10), "b1", &tx);
    spawn_admit(&flow, Ticket::new("agents", 10), "i1", &tx);
    spawn_admit(&flow, Ticket::new("agents", 10).band("batch"), "b2", &tx);
    spawn_admit(&flow, Ticket::new("agents", 10), "i2", &tx);
    wait_queued(&flow, 4).await;
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.band("interactive").unwrap().queued, 2);
    assert_eq!(snapshot.band("batch").unwrap().queued, 2);
    capacity.set_limit(1);
    flow.notify();
    let order = drain_in_order(&mut rx, 4, |_, permit| drop(permit)).await;
    assert_eq!(order, ["i1", "i2", "b1", "b2"]);
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.queued(), 0);
    assert_eq!(snapshot.in_flight, 0);
    for band in &snapshot.bands {
        assert_eq!(band.dispatched, 2);
        assert_eq!(band.wait.count(), 2);
        assert_eq!(band.shed, 0);
    }
    assert_eq!(snapshot.team("agents").unwrap().wait.count(), 3);
    assert_eq!(snapshot.team("bulk").unwrap().wait.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_requests_tokens_count_at_most_max_request_tokens() {
    let (flow, _) = controller(config(), 4);
    let permit = flow.admit(Ticket::new("bulk", u64::MAX / 2)).await.unwrap();
    assert_eq!(permit.cost_tokens(), MAX_REQUEST_TOKENS);
    assert_eq!(flow.snapshot().in_flight_tokens, MAX_REQUEST_TOKENS);
    permit.finish(u64::MAX);
    let snapshot = flow.snapshot();
    let bulk = snapshot.team("bulk").unwrap();
    assert_eq!(bulk.dispatched_tokens, MAX_REQUEST_TOKENS);
    assert_eq!(bulk.finished_tokens, MAX_REQUEST_TOKENS);
    assert_eq!(snapshot.in_flight_tokens, 0);
    // A budget judges the estimate as asked: over all of it, never admitted.
    let mut config = config();
    let mut rich = TeamSpec::new("rich", "batch");
    rich.tpm = Some(2 * MAX_REQUEST_TOKENS);
    config.teams.push(rich);
    let (flow, _) = controller(config, 4);
    let refused = flow.admit(Ticket::new("rich", u64::MAX / 2)).await;
    assert_eq!(refused.map(|_| ()).unwrap_err().code(), "request_too_large");
}

/// Offer `offers` (team, requests, cost range) all at once, dispatch one at a time, and return
/// each team's dispatched tokens up to the moment the first team ran out of queued requests.
async fn tokens_while_backlogged(
    config: FlowConfig,
    offers: &[(&str, usize, std::ops::RangeInclusive<u64>)],
) -> Vec<u64> {
    let (flow, capacity) = controller(config, 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut rng = fastrand::Rng::with_seed(7);
    let total: usize = offers.iter().map(|o| o.1).sum();
    // Interleave arrivals in proportion, so no team is simply first in line.
    let mut arrivals: Vec<(f64, &str, u64)> = Vec::new();
    for (team, count, costs) in offers {
        for k in 0..*count {
            let at = (k as f64 + 0.5) / *count as f64;
            arrivals.push((at, team, rng.u64(costs.clone())));
        }
    }
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (_, team, cost) in arrivals {
        spawn_admit(&flow, Ticket::new(team, cost), team, &tx);
    }
    wait_queued(&flow, total).await;
    let mut left: Vec<usize> = offers.iter().map(|o| o.1).collect();
    let mut tokens = vec![0u64; offers.len()];
    let mut backlogged = true;
    capacity.set_limit(1);
    flow.notify();
    drain_in_order(&mut rx, total, |label, permit| {
        let i = offers.iter().position(|o| o.0 == label).unwrap();
        if backlogged {
            tokens[i] += permit.cost_tokens();
        }
        left[i] -= 1;
        if left[i] == 0 {
            backlogged = false;
        }
    })
    .await;
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.in_flight, 0);
    assert_eq!(snapshot.queued(), 0);
    tokens
}

#[tokio::test(start_paused = true)]
async fn equal_weights_split_dispatched_tokens_evenly_under_ten_times_the_load() {
    let mut config = config();
    config.teams.push(TeamSpec::new("heavy", "interactive"));
    config.teams.push(TeamSpec::new("light", "interactive"));
    let tokens = tokens_while_backlogged(
        config,
        &[("heavy", 400, 100..=900), ("light", 40, 100..=900)],
    )
    .await;
    let share = tokens[0] as f64 / (tokens[0] + tokens[1]) as f64;
    assert!(
        (0.45..=0.55).contains(&share),
        "heavy got {share:.3} of {tokens:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn weights_two_to_one_split_tokens_two_to_one() {
    let mut config = config();
    let mut gold = TeamSpec::new("gold", "interactive");
    gold.weight = 2.0;
    config.teams.push(gold);
    config.teams.push(TeamSpec::new("silver", "interactive"));
    let tokens = tokens_while_backlogged(
        config,
        &[("gold", 300, 50..=500), ("silver", 300, 50..=500)],
    )
    .await;
    let ratio = tokens[0] as f64 / tokens[1] as f64;
    assert!((1.8..=2.2).contains(&ratio), "gold/silver = {ratio:.3}");
}

#[tokio::test(start_paused = true)]
async fn continuing_turns_go_before_new_sessions() {
    let (flow, capacity) = controller(config(), 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 10), "new1", &tx);
    spawn_admit(&flow, Ticket::new("agents", 10), "new2", &tx);
    spawn_admit(
        &flow,
        Ticket::new("agents", 10).continuing(true),
        "cont1",
        &tx,
    );
    spawn_admit(
        &flow,
        Ticket::new("agents", 10).continuing(true),
        "cont2",
        &tx,
    );
    wait_queued(&flow, 4).await;
    capacity.set_limit(1);
    flow.notify();
    let mut kinds = Vec::new();
    let order = drain_in_order(&mut rx, 4, |_, permit| kinds.push(permit.turn_kind())).await;
    assert_eq!(order, ["cont1", "cont2", "new1", "new2"]);
    assert_eq!(
        kinds,
        [
            TurnKind::Continuing,
            TurnKind::Continuing,
            TurnKind::New,
            TurnKind::New
        ]
    );
    let turns = flow.snapshot().turns;
    assert_eq!((turns.continuing.count(), turns.new.count()), (2, 2));
    assert_eq!(turns.promoted, 0);
}

#[tokio::test(start_paused = true)]
async fn recent_session_activity_decides_the_turn_kind() {
    let (flow, capacity) = controller(config(), 1);
    let turn_window = flow.config().turn_window;
    // `stale` finished a turn longer ago than the window, `recent` within it.
    drop(flow.admit(Ticket::new("agents", 1).session("stale")).await);
    tokio::time::advance(turn_window + SEC).await;
    drop(flow.admit(Ticket::new("agents", 1).session("recent")).await);
    capacity.set_limit(0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stale = Ticket::new("agents", 1).session("stale").continuing(true);
    spawn_admit(&flow, stale, "stale", &tx);
    let recent = Ticket::new("agents", 1).session("recent");
    spawn_admit(&flow, recent, "recent", &tx);
    let unknown = Ticket::new("agents", 1).session("unknown").continuing(true);
    spawn_admit(&flow, unknown, "unknown", &tx);
    wait_queued(&flow, 3).await;
    capacity.set_limit(1);
    flow.notify();
    let mut kinds = Vec::new();
    let order = drain_in_order(&mut rx, 3, |_, permit| kinds.push(permit.turn_kind())).await;
    // A known session's activity overrides the flag; an unknown one falls back to it.
    assert_eq!(order, ["recent", "unknown", "stale"]);
    assert_eq!(
        kinds,
        [TurnKind::Continuing, TurnKind::Continuing, TurnKind::New]
    );
}

#[tokio::test(start_paused = true)]
async fn aging_promotes_a_starved_new_session() {
    let mut config = config();
    config.aging = 5 * SEC;
    let (flow, _capacity) = controller(config, 1);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let continuing = || Ticket::new("agents", 10).continuing(true);
    spawn_admit(&flow, continuing(), "c0", &tx);
    let (_, mut held) = rx.recv().await.unwrap();
    spawn_admit(&flow, Ticket::new("agents", 10), "new", &tx);
    wait_queued(&flow, 1).await;
    // A continuing turn is always waiting; one slot frees every second.
    let mut order = Vec::new();
    for k in 1..=7 {
        spawn_admit(&flow, continuing(), format!("c{k}"), &tx);
        wait_queued(&flow, 2).await;
        tokio::time::advance(SEC).await;
        drop(held);
        let (label, permit) = rx.recv().await.unwrap();
        if label == "new" {
            assert!(permit.promoted());
            // c6 arrived 5 s after it: the head start is used up.
            assert_eq!(permit.waited(), 6 * SEC);
            assert_eq!(permit.turn_kind(), TurnKind::New);
        } else {
            assert!(!permit.promoted());
        }
        order.push(label);
        held = permit;
    }
    assert_eq!(order, ["c1", "c2", "c3", "c4", "c5", "new", "c6"]);
    assert_eq!(flow.snapshot().turns.promoted, 1);
}

#[tokio::test(start_paused = true)]
async fn aging_zero_is_arrival_order() {
    let mut config = config();
    config.aging = Duration::ZERO;
    let (flow, capacity) = controller(config, 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 10), "new", &tx);
    spawn_admit(
        &flow,
        Ticket::new("agents", 10).continuing(true),
        "cont",
        &tx,
    );
    wait_queued(&flow, 2).await;
    capacity.set_limit(1);
    flow.notify();
    let order = drain_in_order(&mut rx, 2, |_, permit| drop(permit)).await;
    assert_eq!(order, ["new", "cont"]);
}

#[tokio::test(start_paused = true)]
async fn sheddable_bands_are_shed_only_while_saturated() {
    let (flow, capacity) = controller(sheddable_config(), 20);
    // Not saturated: nothing is shed, even in a sheddable band.
    let mut held = Vec::new();
    for _ in 0..20 {
        held.push(flow.admit(Ticket::new("bulk", 10)).await.unwrap());
    }
    assert_eq!(flow.snapshot().band("batch").unwrap().shed, 0);
    // Saturated: the sheddable band is refused at once, the other band queues.
    let shed = poll_once(flow.admit(Ticket::new("bulk", 10))).await;
    match shed {
        Some(Err(Rejection::Shed { band, retry_after })) => {
            assert_eq!(band, "batch");
            assert_eq!(retry_after, SEC);
        }
        other => panic!("expected shed, got {other:?}"),
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 10), "interactive", &tx);
    wait_queued(&flow, 1).await;
    held.pop();
    let (label, permit) = rx.recv().await.unwrap();
    assert_eq!(label, "interactive");
    assert_eq!(permit.band(), "interactive");
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.band("batch").unwrap().shed, 1);
    assert_eq!(snapshot.band("interactive").unwrap().shed, 0);
    assert_eq!(snapshot.team("bulk").unwrap().shed, 1);
    assert_eq!(snapshot.team("agents").unwrap().shed, 0);
    // Capacity back: the sheddable band is admitted again.
    capacity.set_limit(100);
    assert!(flow.admit(Ticket::new("bulk", 10)).await.is_ok());
}

/// A capacity signal set from the test.
struct Manual {
    open: AtomicBool,
    saturation_bits: AtomicU64,
}

impl Manual {
    fn new(open: bool, saturation: f64) -> Arc<Self> {
        Arc::new(Manual {
            open: AtomicBool::new(open),
            saturation_bits: AtomicU64::new(saturation.to_bits()),
        })
    }

    fn set(&self, open: bool, saturation: f64) {
        self.open.store(open, Ordering::Relaxed);
        self.saturation_bits
            .store(saturation.to_bits(), Ordering::Relaxed);
    }
}

impl CapacitySignal for Manual {
    fn can_dispatch(&self, _load: &FlowLoad) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    fn saturation(&self, _load: &FlowLoad) -> f64 {
        f64::from_bits(self.saturation_bits.load(Ordering::Relaxed))
    }
}

#[tokio::test(start_paused = true)]
async fn probabilistic_shedding_follows_the_curve() {
    let mut config = sheddable_config();
    config.shed_curve = ShedCurve::Linear {
        start: 0.5,
        full: 0.9,
    };
    let signal = Manual::new(false, 0.3);
    let flow = FlowController::new(config, signal.clone()).unwrap();
    fastrand::seed(11);
    let shed_at = |saturation: f64| {
        signal.set(false, saturation);
        let flow = flow.clone();
        async move {
            let mut shed = 0;
            for _ in 0..1000 {
                // Requests that are not shed queue; dropping them right away cancels them.
                if let Some(Err(Rejection::Shed { .. })) =
                    poll_once(flow.admit(Ticket::new("bulk", 1))).await
                {
                    shed += 1;
                }
            }
            shed
        }
    };
    assert_eq!(shed_at(0.3).await, 0);
    let half = shed_at(0.7).await;
    assert!(
        (400..=600).contains(&half),
        "shed {half} of 1000 at p = 0.5"
    );
    assert_eq!(shed_at(0.95).await, 1000);
    // Not saturated: never shed, whatever the saturation figure says.
    signal.set(true, 1.0);
    for _ in 0..100 {
        assert!(flow.admit(Ticket::new("bulk", 1)).await.is_ok());
    }
    assert_eq!(flow.snapshot().queued(), 0);
}

#[tokio::test(start_paused = true)]
async fn notify_dispatches_when_capacity_returns_without_a_release() {
    let signal = Manual::new(false, 1.0);
    let flow = FlowController::new(config(), signal.clone()).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 10), "a", &tx);
    spawn_admit(&flow, Ticket::new("agents", 10), "b", &tx);
    wait_queued(&flow, 2).await;
    signal.set(true, 0.0);
    tokio::task::yield_now().await;
    assert_eq!(flow.snapshot().queued(), 2, "nothing moves until notified");
    flow.notify();
    let (first, _p1) = rx.recv().await.unwrap();
    let (second, _p2) = rx.recv().await.unwrap();
    assert_eq!((first.as_str(), second.as_str()), ("a", "b"));
    assert_eq!(flow.snapshot().in_flight, 2);
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_times_out_at_its_ttl() {
    let (flow, capacity) = controller(config(), 0);
    let start = Instant::now();
    let rejection = flow.admit(Ticket::new("agents", 10)).await.unwrap_err();
    assert_eq!(start.elapsed(), 30 * SEC);
    match &rejection {
        Rejection::Timeout { band, waited, .. } => {
            assert_eq!(band, "interactive");
            assert_eq!(*waited, 30 * SEC);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(rejection.http_status(), 503);
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.band("interactive").unwrap().timed_out, 1);
    assert_eq!(snapshot.team("agents").unwrap().timed_out, 1);
    assert_eq!(snapshot.queued(), 0);
    // Dispatched before the TTL: a permit, with the wait it had.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let handle = spawn_admit(&flow, Ticket::new("agents", 10), "late", &tx);
    wait_queued(&flow, 1).await;
    tokio::time::advance(29 * SEC).await;
    capacity.set_limit(1);
    flow.notify();
    let (_, permit) = rx.recv().await.unwrap();
    assert_eq!(permit.waited(), 29 * SEC);
    assert!(handle.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_takes_its_request_out_of_the_queue() {
    let (flow, capacity) = controller(config(), 0);
    let (tx, _rx) = mpsc::unbounded_channel();
    let handle = spawn_admit(&flow, Ticket::new("agents", 10).bytes(100), "gone", &tx);
    wait_queued(&flow, 1).await;
    handle.abort();
    assert!(handle.await.unwrap_err().is_cancelled());
    let snapshot = flow.snapshot();
    let band = snapshot.band("interactive").unwrap();
    assert_eq!((band.queued, band.queued_bytes, band.cancelled), (0, 0, 1));
    assert_eq!(snapshot.team("agents").unwrap().queued, 0);
    // Dispatched, but the client left before taking the permit: the slot comes back.
    let handle = spawn_admit(&flow, Ticket::new("agents", 10), "gone too", &tx);
    wait_queued(&flow, 1).await;
    capacity.set_limit(1);
    flow.notify();
    assert_eq!(flow.snapshot().in_flight, 1);
    handle.abort();
    assert!(handle.await.unwrap_err().is_cancelled());
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.in_flight, 0);
    assert_eq!(snapshot.team("agents").unwrap().in_flight, 0);
    assert!(flow.admit(Ticket::new("agents", 10)).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaks_under_concurrent_cancellation() {
    let mut config = config();
    config.teams[0].max_concurrent = Some(3);
    let (flow, _capacity) = controller(config, 4);
    let mut handles = Vec::new();
    for i in 0..400u64 {
        let flow = flow.clone();
        let team = if i % 3 == 0 { "bulk" } else { "agents" };
        let ticket = Ticket::new(team, 1 + i % 50)
            .session(format!("s{}", i % 17))
            .continuing(i % 2 == 0);
        handles.push(tokio::spawn(async move {
            if let Ok(permit) = flow.admit(ticket).await {
                tokio::task::yield_now().await;
                if i % 5 == 0 {
                    permit.finish(i);
                }
            }
        }));
    }
    for (i, handle) in handles.iter().enumerate() {
        if i % 4 == 1 {
            handle.abort();
        }
    }
    for handle in handles {
        let _ = handle.await;
    }
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.in_flight, 0);
    assert_eq!(snapshot.in_flight_tokens, 0);
    assert_eq!(snapshot.queued(), 0);
    let mut accounted = 0;
    for team in &snapshot.teams {
        assert_eq!((team.in_flight, team.queued), (0, 0), "{team:?}");
        assert_eq!(team.shed + team.timed_out + team.queue_full, 0, "{team:?}");
        accounted += team.dispatched_requests + team.cancelled;
    }
    // Every request was either dispatched or cancelled while queued; aborted tasks that had
    // not reached the queue yet count as neither.
    assert!((300..=400).contains(&accounted), "{accounted}");
    // The slots all came back.
    let mut permits = Vec::new();
    for _ in 0..4 {
        permits.push(flow.admit(Ticket::new("bulk", 1)).await.unwrap());
    }
}

#[tokio::test(start_paused = true)]
async fn queue_caps_refuse_what_does_not_fit() {
    let mut config = config();
    let mut small = BandSpec::new("small", 5);
    small.max_queued = 2;
    small.max_queued_bytes = 1000;
    let mut direct = BandSpec::new("direct", 3);
    direct.max_queued = 0;
    config.bands.extend([small, direct]);
    let mut team = TeamSpec::new("t", "small");
    team.allowed_bands = vec!["small".into(), "direct".into()];
    config.teams.push(team);
    let (flow, capacity) = controller(config, 0);
    let (tx, _rx) = mpsc::unbounded_channel();
    // Alone in the queue a request over the byte cap waits (it could never wait otherwise).
    let lone = spawn_admit(&flow, Ticket::new("t", 1).bytes(5000), "lone", &tx);
    wait_queued(&flow, 1).await;
    lone.abort();
    wait_queued(&flow, 0).await;
    let _a = spawn_admit(&flow, Ticket::new("t", 1).bytes(600), "a", &tx);
    wait_queued(&flow, 1).await;
    let too_big = poll_once(flow.admit(Ticket::new("t", 1).bytes(500))).await;
    match too_big {
        Some(Err(Rejection::QueueFull { band, limit, .. })) => {
            assert_eq!((band.as_str(), limit), ("small", QueueLimit::Bytes));
        }
        other => panic!("expected queue full (bytes), got {other:?}"),
    }
    let _b = spawn_admit(&flow, Ticket::new("t", 1).bytes(300), "b", &tx);
    wait_queued(&flow, 2).await;
    let too_many = poll_once(flow.admit(Ticket::new("t", 1).bytes(1))).await;
    assert!(matches!(
        too_many,
        Some(Err(Rejection::QueueFull {
            limit: QueueLimit::Requests,
            ..
        }))
    ));
    // A band that never queues: refused while nothing can be dispatched...
    let direct = poll_once(flow.admit(Ticket::new("t", 1).band("direct"))).await;
    assert!(matches!(direct, Some(Err(Rejection::QueueFull { .. }))));
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.band("small").unwrap().queue_full, 2);
    assert_eq!(snapshot.band("direct").unwrap().queue_full, 1);
    assert_eq!(snapshot.team("t").unwrap().queue_full, 3);
    assert_eq!(snapshot.band("small").unwrap().queued_bytes, 900);
    // ...and dispatched at once when it can be.
    capacity.set_limit(3);
    let permit = poll_once(flow.admit(Ticket::new("t", 1).band("direct"))).await;
    assert_eq!(permit.unwrap().unwrap().band(), "direct");
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_for_a_full_queue_costs_its_team_nothing() {
    let mut config = config();
    config.bands[1].max_queued = 1;
    let mut direct = BandSpec::new("direct", -1);
    direct.max_queued = 0;
    config.bands.push(direct);
    config.teams[1].rpm = Some(2);
    config.teams[1].allowed_bands = vec!["batch".into(), "direct".into()];
    let (flow, capacity) = controller(config, 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _queued = spawn_admit(&flow, Ticket::new("bulk", 10), "queued", &tx);
    wait_queued(&flow, 1).await;
    // Clients retrying against a full queue: each refusal is for the queue, none spends the
    // team's budget of two requests a minute.
    for _ in 0..3 {
        let refused = flow.admit(Ticket::new("bulk", 10)).await.unwrap_err();
        assert!(
            matches!(
                refused,
                Rejection::QueueFull {
                    limit: QueueLimit::Requests,
                    ..
                }
            ),
            "{refused:?}"
        );
    }
    assert_eq!(flow.snapshot().team("bulk").unwrap().queue_full, 3);
    // A band that never queues refuses as freely, however empty its queue.
    refused_three_times_in_direct(&flow).await;
    capacity.set_limit(2);
    flow.notify();
    let (label, _permit) = rx.recv().await.unwrap();
    assert_eq!(label, "queued");
    let second = flow.admit(Ticket::new("bulk", 10)).await.unwrap();
    assert_eq!(
        second.rate_status().unwrap().requests.unwrap().remaining,
        0,
        "the second request of the minute"
    );
}

/// Three requests of `bulk` in the band `direct`, which never queues: each refused as full.
async fn refused_three_times_in_direct(flow: &FlowController) {
    for _ in 0..3 {
        let refused = flow
            .admit(Ticket::new("bulk", 10).band("direct"))
            .await
            .unwrap_err();
        assert!(
            matches!(refused, Rejection::QueueFull { .. }),
            "{refused:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_for_a_full_queue_after_its_charge_gets_it_back() {
    let mut config = config();
    let mut direct = BandSpec::new("direct", -1);
    direct.max_queued = 0;
    config.bands.push(direct);
    config.teams[1].rpm = Some(2);
    config.teams[1].max_concurrent = Some(1);
    config.teams[1].allowed_bands = vec!["batch".into(), "direct".into()];
    // The pool has room: the queue is judged after the charge, once the team's cap holds the
    // request back.
    let (flow, _capacity) = controller(config, 10);
    let running = flow.admit(Ticket::new("bulk", 10)).await.unwrap();
    refused_three_times_in_direct(&flow).await;
    drop(running);
    let second = flow.admit(Ticket::new("bulk", 10)).await.unwrap();
    assert_eq!(
        second.rate_status().unwrap().requests.unwrap().remaining,
        0,
        "the refusals spent none of the minute's two requests"
    );
}

#[tokio::test(start_paused = true)]
async fn a_team_may_downgrade_its_band_but_not_upgrade_it() {
    let (flow, _capacity) = controller(config(), 10);
    let permit = flow
        .admit(Ticket::new("agents", 1).band("batch"))
        .await
        .unwrap();
    assert_eq!(permit.band(), "batch");
    let refused = flow
        .admit(Ticket::new("bulk", 1).band("interactive"))
        .await
        .unwrap_err();
    assert!(matches!(refused, Rejection::BandNotAllowed { .. }));
    assert_eq!(refused.http_status(), 403);
    assert_eq!(
        flow.band_for("agents", Some("batch")),
        Ok("batch".to_string())
    );
    assert_eq!(flow.band_for("agents", None), Ok("interactive".to_string()));
    assert!(flow.band_for("bulk", Some("interactive")).is_err());
    assert_eq!(flow.background_band("agents").as_deref(), Some("batch"));
    let unknown = flow.admit(Ticket::new("nobody", 1)).await.unwrap_err();
    assert!(matches!(unknown, Rejection::UnknownTeam { .. }));
    assert_eq!(flow.snapshot().team("bulk").unwrap().dispatched_requests, 0);
}

#[tokio::test(start_paused = true)]
async fn max_concurrent_caps_a_team_without_holding_back_others() {
    let mut config = config();
    config.teams[0].max_concurrent = Some(1);
    let (flow, _capacity) = controller(config, 10);
    let first = flow.admit(Ticket::new("agents", 1)).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 1), "agents", &tx);
    wait_queued(&flow, 1).await;
    // A lower band's request of another team goes ahead of the capped team.
    let other = flow.admit(Ticket::new("bulk", 1)).await.unwrap();
    assert_eq!(other.band(), "batch");
    assert_eq!(flow.snapshot().queued(), 1);
    drop(first);
    let (label, _second) = rx.recv().await.unwrap();
    assert_eq!(label, "agents");
    assert_eq!(flow.snapshot().team("agents").unwrap().in_flight, 1);
}

#[tokio::test(start_paused = true)]
async fn time_a_team_spends_held_back_by_its_own_cap_earns_it_no_credit() {
    let mut config = config();
    config.teams[1].max_concurrent = Some(1);
    config.teams.push(TeamSpec::new("other", "batch"));
    let (flow, _capacity) = controller(config, 2);
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..8 {
        spawn_admit(&flow, Ticket::new("bulk", 10), format!("bulk{i}"), &tx);
    }
    wait_queued(&flow, 7).await;
    for i in 0..40 {
        spawn_admit(&flow, Ticket::new("other", 10), format!("other{i}"), &tx);
    }
    wait_queued(&flow, 46).await;
    // `bulk` holds its one slot; `other` is served twenty times meanwhile.
    let mut held = Vec::new();
    let order = drain_in_order(&mut rx, 21, |label, permit| {
        if label.starts_with("bulk") {
            held.push(permit);
        }
    })
    .await;
    assert_eq!(order.iter().filter(|l| l.starts_with("bulk")).count(), 1);
    // Its cap lifted, `bulk` shares the band from now on: it does not take every slot until
    // it has caught up on the twenty.
    let mut lifted = flow.config();
    lifted.teams[1].max_concurrent = None;
    flow.reconfigure(lifted).unwrap();
    drop(held);
    let order = drain_in_order(&mut rx, 8, |_, _| {}).await;
    let others = order.iter().filter(|l| l.starts_with("other")).count();
    assert!((3..=5).contains(&others), "{order:?}");
}

/// The team's requests in flight at the other gateways count toward its `max_concurrent`
/// here; when they finish (the next exchange says so), a waiting request goes.
#[tokio::test(start_paused = true)]
async fn max_concurrent_counts_the_teams_requests_at_other_gateways() {
    let mut config = config();
    config.teams[0].max_concurrent = Some(2);
    let (flow, _capacity) = controller(config, 10);
    let running = |n: u64| {
        HashMap::from([(
            "agents".to_string(),
            PeerTeam {
                in_flight: n,
                waiting: 0,
                oldest_waiting: None,
            },
        )])
    };
    assert!(flow.set_peer_teams(running(1)));
    assert!(!flow.set_peer_teams(running(1)), "unchanged");
    let _first = flow.admit(Ticket::new("agents", 1)).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 1), "agents", &tx);
    wait_queued(&flow, 1).await;
    let load = flow.team_load();
    assert_eq!(load.len(), 1);
    assert_eq!(load[0].0, "agents");
    assert_eq!(load[0].1.in_flight, 1);
    assert_eq!(load[0].1.waiting, 1);
    assert!(load[0].1.oldest_waiting.is_some(), "one waits here");
    let team = flow.snapshot().team("agents").unwrap().clone();
    assert_eq!((team.in_flight, team.peer_in_flight), (1, 1));
    // The other gateway's request finished.
    assert!(flow.set_peer_teams(HashMap::new()));
    flow.notify();
    let (label, _second) = rx.recv().await.unwrap();
    assert_eq!(label, "agents");
    assert_eq!(flow.snapshot().team("agents").unwrap().in_flight, 2);
}

/// A capped team's last free slot goes to an older request of the team waiting at another
/// gateway: this gateway leaves it for up to the yield limit, once per such request, then
/// takes it back; while the team has room for both, nothing is left.
#[tokio::test(start_paused = true)]
async fn a_teams_last_free_slot_is_left_to_an_older_request_at_another_gateway() {
    let mut config = config();
    config.teams[0].max_concurrent = Some(3);
    // Exchanging every 100 ms: a slot is left for up to 400 ms.
    let signal = Arc::new(Peers {
        cap: MaxInFlight::new(10),
        room: AtomicBool::new(true),
        elsewhere: std::sync::Mutex::new(None),
    });
    let flow = FlowController::new(config, signal.clone()).unwrap();
    // Another gateway has had one request of the team waiting for longer.
    let older = HashMap::from([(
        "agents".to_string(),
        PeerTeam {
            in_flight: 0,
            waiting: 1,
            oldest_waiting: Some((Instant::now() - Duration::from_secs(5), "g2/1".into())),
        },
    )]);
    assert!(flow.set_peer_teams(older));
    // Room for it and for two here.
    let first = flow.admit(Ticket::new("agents", 1)).await.unwrap();
    let _second = flow.admit(Ticket::new("agents", 1)).await.unwrap();
    // The last slot is left to it.
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 1), "third", &tx);
    wait_queued(&flow, 1).await;
    tokio::task::yield_now().await;
    assert_eq!(
        flow.snapshot().queued(),
        1,
        "the slot is left to the older request"
    );
    // That gateway never took it: after the yield limit it is taken back here.
    tokio::time::advance(signal.yield_limit()).await;
    flow.notify();
    assert_eq!(rx.recv().await.unwrap().0, "third");
    // Not left to the same request again.
    drop(first);
    let _fourth = tokio::time::timeout(
        Duration::from_millis(1),
        flow.admit(Ticket::new("agents", 1)),
    )
    .await
    .expect("dispatched at once")
    .unwrap();
}

#[tokio::test(start_paused = true)]
async fn tokens_used_beyond_the_estimate_are_charged_when_the_request_finishes() {
    let mut config = config();
    config.teams[1].tpm = Some(10_000);
    let (flow, _capacity) = controller(config, 10);
    let permit = flow.admit(Ticket::new("bulk", 1000)).await.unwrap();
    assert_eq!(
        permit.rate_status().unwrap().tokens.unwrap().remaining,
        9000
    );
    // Admitted with an estimate of 1,000 tokens; the engine wrote past it.
    permit.finish(5000);
    tokio::task::yield_now().await;
    let next = flow.admit(Ticket::new("bulk", 1000)).await.unwrap();
    assert_eq!(next.rate_status().unwrap().tokens.unwrap().remaining, 4000);
    // Used less than estimated: nothing comes back (OpenAI charges the estimate too).
    next.finish(10);
    tokio::task::yield_now().await;
    let last = flow.admit(Ticket::new("bulk", 1000)).await.unwrap();
    assert_eq!(last.rate_status().unwrap().tokens.unwrap().remaining, 3000);
}

#[tokio::test(start_paused = true)]
async fn rate_limits_refuse_and_reset() {
    let mut config = config();
    config.teams[1].rpm = Some(2);
    config.teams[1].tpm = Some(10_000);
    let (flow, _capacity) = controller(config, 10);
    let first = flow.admit(Ticket::new("bulk", 1000)).await.unwrap();
    let status = first.rate_status().unwrap();
    assert_eq!(status.requests.unwrap().remaining, 1);
    assert_eq!(status.tokens.unwrap().remaining, 9000);
    let headers = status.headers();
    assert!(headers.contains(&("x-ratelimit-remaining-requests", "1".to_string())));
    assert!(headers.contains(&("x-ratelimit-limit-tokens", "10000".to_string())));
    let second = flow.admit(Ticket::new("bulk", 1000)).await.unwrap();
    assert_eq!(second.rate_status().unwrap().requests.unwrap().remaining, 0);
    let refused = flow.admit(Ticket::new("bulk", 1000)).await.unwrap_err();
    let Rejection::RateLimited(limited) = &refused else {
        panic!("expected rate limited, got {refused:?}");
    };
    assert_eq!(limited.kind, RateKind::Requests);
    assert_eq!(limited.retry_after, 30 * SEC);
    assert_eq!(refused.retry_after_secs(), Some(30));
    assert_eq!(refused.http_status(), 429);
    assert_eq!(refused.code(), "rate_limit_exceeded_requests");
    // Teams without limits are not checked.
    assert!(flow
        .admit(Ticket::new("agents", 1000))
        .await
        .unwrap()
        .rate_status()
        .is_none());
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.team("bulk").unwrap().rate_limited, 1);
    assert_eq!(snapshot.band("batch").unwrap().rate_limited, 1);
    assert_eq!(snapshot.band("interactive").unwrap().rate_limited, 0);
    assert_eq!(snapshot.team("bulk").unwrap().dispatched_requests, 2);
    tokio::time::advance(30 * SEC).await;
    assert!(flow.admit(Ticket::new("bulk", 1000)).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_request_charged_ahead_is_admitted_without_a_second_charge() {
    let mut config = config();
    config.teams[1].rpm = Some(2);
    let (flow, _capacity) = controller(config, 10);
    let ticket = Ticket::new("bulk", 1000);
    let charged = flow.charge(&ticket).await.unwrap();
    assert_eq!(charged.as_ref().unwrap().requests.unwrap().remaining, 1);
    let permit = flow.admit_charged(ticket, charged).await.unwrap();
    assert_eq!(permit.rate_status().unwrap().requests.unwrap().remaining, 1);
    // One request of the two is left, whichever way it comes.
    assert!(flow.admit(Ticket::new("bulk", 1000)).await.is_ok());
    let refused = flow.charge(&Ticket::new("bulk", 1000)).await.unwrap_err();
    assert_eq!(refused.code(), "rate_limit_exceeded_requests");
    assert_eq!(flow.snapshot().team("bulk").unwrap().rate_limited, 1);
    // Teams without limits are not charged.
    assert_eq!(
        flow.charge(&Ticket::new("agents", 1000)).await.unwrap(),
        None
    );

    // What would be shed is refused before the charge, as by `admit`.
    let mut config = sheddable_config();
    config.teams[1].rpm = Some(2);
    let (flow, _capacity) = controller(config, 1);
    let busy = flow.admit(Ticket::new("bulk", 10)).await.unwrap();
    let refused = flow.charge(&Ticket::new("bulk", 10)).await.unwrap_err();
    assert!(matches!(refused, Rejection::Shed { .. }), "{refused:?}");
    // The shed one cost nothing: the second of the two requests a minute is still there.
    drop(busy);
    let charged = flow.charge(&Ticket::new("bulk", 10)).await.unwrap();
    assert_eq!(charged.unwrap().requests.unwrap().remaining, 0);
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.team("bulk").unwrap().shed, 1);
    assert_eq!(snapshot.team("bulk").unwrap().rate_limited, 0);
}

#[tokio::test(start_paused = true)]
async fn reconfiguration_keeps_queued_requests() {
    let mut config = config();
    config.bands.push(BandSpec::new("old", 5));
    config.teams[0].allowed_bands.push("old".into());
    config.teams.push(TeamSpec::new("gone", "batch"));
    let (flow, capacity) = controller(config, 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 1).band("old"), "old", &tx);
    spawn_admit(&flow, Ticket::new("agents", 1), "interactive", &tx);
    spawn_admit(&flow, Ticket::new("agents", 1).band("batch"), "batch", &tx);
    let gone = spawn_admit(&flow, Ticket::new("gone", 1), "gone", &tx);
    wait_queued(&flow, 4).await;
    // An invalid config changes nothing.
    let mut invalid = flow.config();
    invalid.teams[0].default_band = "missing".into();
    assert!(flow.reconfigure(invalid).is_err());
    assert_eq!(flow.snapshot().band("old").unwrap().queued, 1);
    // Drop band `old` and team `gone`.
    let new = self::config();
    flow.reconfigure(new.clone()).unwrap();
    assert_eq!(flow.config(), new);
    assert!(matches!(
        gone.await.unwrap(),
        Err(Rejection::TeamRemoved { .. })
    ));
    let snapshot = flow.snapshot();
    assert!(snapshot.band("old").is_none());
    assert!(snapshot.team("gone").is_none());
    assert_eq!(snapshot.band("interactive").unwrap().queued, 2);
    assert_eq!(snapshot.band("batch").unwrap().queued, 1);
    assert_eq!(snapshot.team("agents").unwrap().queued, 3);
    capacity.set_limit(1);
    flow.notify();
    let mut bands = Vec::new();
    let order = drain_in_order(&mut rx, 3, |_, permit| {
        bands.push(permit.band().to_string())
    })
    .await;
    // The moved request kept its place in arrival order.
    assert_eq!(order, ["old", "interactive", "batch"]);
    assert_eq!(bands, ["interactive", "interactive", "batch"]);
}

#[tokio::test(start_paused = true)]
async fn a_band_accepted_before_a_reconfiguration_took_it_away_becomes_the_team_default() {
    let mut config = config();
    config.bands.push(BandSpec::new("old", 5));
    config.teams[0].allowed_bands.push("old".into());
    let (flow, _capacity) = controller(config, 10);
    // Accepted (checked) under the first config, admitted after a reload dropped the band
    // and took `batch` from the team: not refused, run in the team's default band.
    let checked = |band: &str| Ticket {
        band_checked: true,
        ..Ticket::new("agents", 1).band(band)
    };
    let (old, batch) = (checked("old"), checked("batch"));
    let mut new = self::config();
    new.teams[0].allowed_bands.retain(|b| b != "batch");
    flow.reconfigure(new).unwrap();
    assert_eq!(flow.admit(old).await.unwrap().band(), "interactive");
    assert_eq!(flow.charge(&batch).await, Ok(None));
    assert_eq!(flow.admit(batch).await.unwrap().band(), "interactive");
    // A band never checked is still refused.
    let unchecked = flow.admit(Ticket::new("agents", 1).band("old")).await;
    assert!(matches!(unchecked, Err(Rejection::UnknownBand { .. })));
}

#[tokio::test(start_paused = true)]
async fn counters_of_a_band_and_a_team_removed_and_added_back_carry_on() {
    let mut with_old = config();
    with_old.bands.push(BandSpec::new("old", 5));
    with_old.teams.push(TeamSpec::new("gone", "old"));
    let (flow, _capacity) = controller(with_old.clone(), 10);
    drop(flow.admit(Ticket::new("gone", 7)).await.unwrap());
    flow.reconfigure(config()).unwrap();
    let snapshot = flow.snapshot();
    assert!(snapshot.band("old").is_none() && snapshot.team("gone").is_none());
    flow.reconfigure(with_old).unwrap();
    let snapshot = flow.snapshot();
    assert_eq!(snapshot.band("old").unwrap().dispatched, 1);
    assert_eq!(snapshot.team("gone").unwrap().dispatched_requests, 1);
    drop(flow.admit(Ticket::new("gone", 7)).await.unwrap());
    assert_eq!(flow.snapshot().band("old").unwrap().dispatched, 2);
}

#[tokio::test(start_paused = true)]
async fn reconfiguration_applies_new_limits_to_queued_requests() {
    let mut config = config();
    config.teams[0].max_concurrent = Some(1);
    let (flow, _capacity) = controller(config.clone(), 10);
    let _held = flow.admit(Ticket::new("agents", 1)).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("agents", 1), "waiting", &tx);
    wait_queued(&flow, 1).await;
    config.teams[0].max_concurrent = Some(2);
    flow.reconfigure(config).unwrap();
    let (label, _permit) = rx.recv().await.unwrap();
    assert_eq!(label, "waiting");
}

#[tokio::test(start_paused = true)]
async fn finish_replaces_the_estimate_in_fairness_and_counters() {
    let mut config = config();
    config
        .teams
        .push(TeamSpec::new("overestimates", "interactive"));
    config.teams.push(TeamSpec::new("exact", "interactive"));
    let (flow, capacity) = controller(config, 0);
    let (tx, mut rx) = mpsc::unbounded_channel();
    for i in 0..40 {
        spawn_admit(
            &flow,
            Ticket::new("overestimates", 1000),
            format!("o{i}"),
            &tx,
        );
        spawn_admit(&flow, Ticket::new("exact", 100), format!("e{i}"), &tx);
    }
    wait_queued(&flow, 80).await;
    capacity.set_limit(1);
    flow.notify();
    // Each request really uses 100 tokens: with the estimate corrected, both teams alternate
    // instead of `exact` getting ten requests per one of `overestimates`.
    let order = drain_in_order(&mut rx, 80, |_, permit| permit.finish(100)).await;
    let overestimates = order[..20].iter().filter(|l| l.starts_with('o')).count();
    assert!((9..=11).contains(&overestimates), "{order:?}");
    let snapshot = flow.snapshot();
    let team = snapshot.team("overestimates").unwrap();
    assert_eq!(team.dispatched_tokens, 100 * team.dispatched_requests);
}

#[test]
fn the_admit_future_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<FlowController>();
    assert_send_sync::<Permit>();
    let (flow, _capacity) = controller(config(), 1);
    let future = flow.admit(Ticket::new("agents", 1));
    assert_send(&future);
}

#[tokio::test(start_paused = true)]
async fn a_reserve_keeps_slots_free_for_higher_bands() {
    let mut config = config();
    // a quarter of 8 slots: batch may hold 6, interactive finds the last 2 free
    config.bands[0].reserve = 0.25;
    let (flow, capacity) = controller(config, 8);
    let mut batch = Vec::new();
    for _ in 0..6 {
        batch.push(flow.admit(Ticket::new("bulk", 1)).await.unwrap());
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, Ticket::new("bulk", 1), "b7", &tx);
    wait_queued(&flow, 1).await;
    let first = poll_once(flow.admit(Ticket::new("agents", 1))).await;
    let first = first.expect("ready at once").expect("admitted");
    let second = poll_once(flow.admit(Ticket::new("agents", 1))).await;
    assert!(second.is_some_and(|p| p.is_ok()), "the reserve holds two");
    assert_eq!(flow.snapshot().band("batch").unwrap().queued, 1);
    // a finished interactive request does not let batch into the reserve
    drop(first);
    assert_eq!(flow.snapshot().band("batch").unwrap().queued, 1);
    // a finished batch request does
    drop(batch.pop());
    let (label, _b7) = rx.recv().await.unwrap();
    assert_eq!(label, "b7");
    // shrinking the pool shrinks what batch may use with it (ceil(0.25 * 4) = 1 held)
    capacity.set_limit(4);
    flow.notify();
    assert_eq!(flow.snapshot().in_flight, 6);
}

#[tokio::test(start_paused = true)]
async fn a_reserve_never_takes_a_pools_last_slot_from_lower_bands() {
    let mut config = config();
    // ceil(0.6 * 1) = 1 would hold the one slot there is
    config.bands[0].reserve = 0.6;
    let (flow, _capacity) = controller(config, 1);
    let batch = poll_once(flow.admit(Ticket::new("bulk", 1))).await;
    assert!(
        batch.is_some_and(|p| p.is_ok()),
        "a pool of one slot serves the lower band"
    );
}

#[test]
fn reserves_outside_zero_to_one_are_refused() {
    let mut config = config();
    config.bands[0].reserve = 1.0;
    let error = config.validate().unwrap_err().to_string();
    assert!(
        error.contains("band `interactive`: reserve must be"),
        "{error}"
    );
    config.bands[0].reserve = -0.1;
    assert!(config.validate().is_err());
}

#[test]
fn durations_that_would_overflow_a_deadline_are_refused() {
    let mut config = config();
    config.aging = Duration::MAX;
    let error = config.validate().unwrap_err().to_string();
    assert!(
        error.contains("aging must be at most 1e9 seconds"),
        "{error}"
    );
    let mut config = self::config();
    config.pin_wait = Duration::from_secs(1_000_000_000);
    assert!(config.validate().is_ok());
}

#[tokio::test(start_paused = true)]
async fn the_head_start_grows_with_the_bands_typical_wait() {
    // aging 1 s, but the batch band's requests have been waiting 20 s (typical wait 12.9 s
    // after sixteen of them, head start twice that): a continuing turn 20 s younger than a new
    // session still goes first when the head start follows the wait
    let order = |follows: bool| async move {
        let mut config = config();
        config.aging = SEC;
        config.aging_follows_wait = follows;
        let (flow, capacity) = controller(config, 0);
        let (tx, mut rx) = mpsc::unbounded_channel();
        // history: sixteen requests that each waited 20 s
        for i in 0..16 {
            spawn_admit(&flow, Ticket::new("bulk", 1), format!("old{i}"), &tx);
        }
        wait_queued(&flow, 16).await;
        tokio::time::advance(20 * SEC).await;
        capacity.set_limit(1);
        flow.notify();
        drain_in_order(&mut rx, 16, |_, permit| drop(permit)).await;
        capacity.set_limit(0);
        flow.notify();
        spawn_admit(&flow, Ticket::new("bulk", 1).session("fresh"), "new", &tx);
        wait_queued(&flow, 1).await;
        tokio::time::advance(20 * SEC).await;
        let turn = Ticket::new("bulk", 1).session("warm").continuing(true);
        spawn_admit(&flow, turn, "continuing", &tx);
        wait_queued(&flow, 2).await;
        capacity.set_limit(1);
        flow.notify();
        drain_in_order(&mut rx, 2, |_, permit| drop(permit)).await
    };
    assert_eq!(order(true).await, ["continuing", "new"]);
    assert_eq!(
        order(false).await,
        ["new", "continuing"],
        "a fixed 1 s head start"
    );
}

/// [`MaxInFlight`] plus per-endpoint room: `full` endpoints take nothing more, the others
/// take one request per pump.
struct Endpoints {
    cap: MaxInFlight,
    full: std::sync::Mutex<Vec<String>>,
    asked_share: AtomicU64,
}

impl Endpoints {
    /// No request slots yet; `endpoint` full.
    fn with_full(endpoint: &str) -> Arc<Self> {
        Arc::new(Endpoints {
            cap: MaxInFlight::new(0),
            full: std::sync::Mutex::new(vec![endpoint.into()]),
            asked_share: AtomicU64::new(0),
        })
    }
}

impl CapacitySignal for Endpoints {
    fn can_dispatch(&self, load: &FlowLoad) -> bool {
        self.cap.can_dispatch(load)
    }

    fn has_room(&self, endpoint: Option<&str>, held_share: f64, promised: u64, _: bool) -> bool {
        self.asked_share
            .store(held_share.to_bits(), Ordering::Relaxed);
        let full = self.full.lock().unwrap();
        promised == 0 && !full.iter().any(|e| Some(e.as_str()) == endpoint)
    }
}

#[tokio::test(start_paused = true)]
async fn a_turn_waits_for_its_pinned_endpoint_while_others_go_ahead() {
    let signal = Endpoints::with_full("e0");
    let mut config = config();
    config.pin_wait = 10 * SEC;
    let flow = FlowController::new(config, signal.clone()).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let turn = |endpoint: &str| Ticket::new("bulk", 10).continuing(true).affinity(endpoint);
    spawn_admit(&flow, turn("e0"), "to-e0", &tx);
    tokio::time::advance(Duration::from_millis(1)).await;
    spawn_admit(&flow, turn("e1"), "to-e1", &tx);
    tokio::time::advance(Duration::from_millis(1)).await;
    spawn_admit(&flow, turn("e1"), "to-e1-again", &tx);
    wait_queued(&flow, 3).await;
    // Room for two: the oldest waits for e0, the next goes to e1, and e1 takes no second one
    // in the same pump (it has not counted the first yet).
    signal.cap.set_limit(2);
    flow.notify();
    let (label, first) = rx.recv().await.unwrap();
    assert_eq!(label, "to-e1");
    assert_eq!(first.outwaited_pin(), None);
    assert_eq!(flow.snapshot().queued(), 2);
    // Routing has placed it: e1 is full now too.
    signal.full.lock().unwrap().push("e1".into());
    // batch has interactive above it, which holds no reserve here
    assert_eq!(
        f64::from_bits(signal.asked_share.load(Ordering::Relaxed)),
        0.0
    );
    // Held for 10 s since it was first passed over, the e0 turn goes, to be placed elsewhere.
    tokio::time::sleep(10 * SEC).await;
    let (label, second) = rx.recv().await.unwrap();
    assert_eq!(label, "to-e0");
    assert_eq!(second.outwaited_pin(), Some(0.0));
    let turns = flow.snapshot().turns;
    assert_eq!((turns.held, turns.outwaited), (0, 1));
    // With pin_wait 0 nothing is held: queue order.
    let mut config = self::config();
    config.pin_wait = Duration::ZERO;
    flow.reconfigure(config).unwrap();
    signal.cap.set_limit(3);
    flow.notify();
    let (label, _third) = rx.recv().await.unwrap();
    assert_eq!(label, "to-e1-again");
}

#[tokio::test(start_paused = true)]
async fn a_team_pinned_to_busy_endpoints_still_gets_its_share_by_moving() {
    let signal = Endpoints::with_full("e0");
    let flow = FlowController::new(config(), signal.clone()).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let turn = |team: &str, endpoint: &str| {
        Ticket::new(team, 10)
            .band("batch")
            .continuing(true)
            .affinity(endpoint)
    };
    // Team agents' sessions all sit on the busy e0, team bulk's on e1, which has room.
    spawn_admit(&flow, turn("agents", "e0"), "agents-1", &tx);
    for i in 1..=3 {
        tokio::time::advance(Duration::from_millis(1)).await;
        spawn_admit(&flow, turn("bulk", "e1"), format!("bulk-{i}"), &tx);
    }
    wait_queued(&flow, 4).await;
    signal.cap.set_limit(1);
    flow.notify();
    let (label, _b1) = rx.recv().await.unwrap();
    assert_eq!(label, "bulk-1", "agents' turn waits for e0 at first");
    // Past pin_wait, a slot on e1 goes by fair queuing: agents has had nothing, so its turn
    // moves there ahead of bulk's next, whose endpoint has room.
    tokio::time::sleep(10 * SEC).await;
    signal.cap.set_limit(2);
    flow.notify();
    let (label, moved) = rx.recv().await.unwrap();
    assert_eq!(label, "agents-1");
    assert_eq!(moved.outwaited_pin(), Some(0.0));
}

#[tokio::test(start_paused = true)]
async fn a_held_turn_goes_by_moving_before_it_would_time_out_though_its_team_has_turns_with_room() {
    let signal = Endpoints::with_full("e0");
    let mut config = config();
    config.pin_wait = 10 * SEC;
    config.aging = 10 * SEC;
    let flow = FlowController::new(config, signal.clone()).unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let turn = |endpoint: &str| Ticket::new("bulk", 10).continuing(true).affinity(endpoint);
    spawn_admit(&flow, turn("e0"), "held", &tx);
    tokio::time::advance(Duration::from_millis(1)).await;
    spawn_admit(&flow, turn("e1"), "first-e1", &tx);
    wait_queued(&flow, 2).await;
    signal.cap.set_limit(1);
    flow.notify();
    let (label, running) = rx.recv().await.unwrap();
    assert_eq!(label, "first-e1", "the held turn waits for e0 at first");
    // The team keeps sending turns whose endpoint has room.
    tokio::time::advance(Duration::from_millis(1)).await;
    spawn_admit(&flow, turn("e1"), "next-e1", &tx);
    wait_queued(&flow, 2).await;
    // Past pin_wait and its head start, a turn whose endpoint has room still goes first.
    tokio::time::sleep(11 * SEC).await;
    drop(running);
    let (label, running) = rx.recv().await.unwrap();
    assert_eq!(label, "next-e1");
    tokio::time::advance(Duration::from_millis(1)).await;
    spawn_admit(&flow, turn("e1"), "last-e1", &tx);
    wait_queued(&flow, 2).await;
    // At half its band's TTL (batch: 60 s) the held turn goes before it, by moving: a team
    // sending turns for other endpoints does not keep it waiting until it times out.
    tokio::time::sleep(20 * SEC).await;
    drop(running);
    let (label, moved) = rx.recv().await.unwrap();
    assert_eq!(label, "held");
    assert!(moved.outwaited_pin().is_some());
}

#[tokio::test(start_paused = true)]
async fn the_most_recently_active_session_goes_first_until_the_head_start_runs_out() {
    let mut config = config();
    config.aging = 10 * SEC;
    let (flow, capacity) = controller(config, 2);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let turn = |session: &str| Ticket::new("bulk", 10).session(session).continuing(true);
    // s1's turn finishes before s2's: s2's context is the more recently used.
    let s1 = flow.admit(turn("s1")).await.unwrap();
    let s2 = flow.admit(turn("s2")).await.unwrap();
    tokio::time::advance(SEC).await;
    drop(s1);
    tokio::time::advance(SEC).await;
    drop(s2);
    capacity.set_limit(0);
    spawn_admit(&flow, turn("s1"), "s1", &tx);
    wait_queued(&flow, 1).await;
    tokio::time::advance(SEC).await;
    spawn_admit(&flow, turn("s2"), "s2", &tx);
    wait_queued(&flow, 2).await;
    capacity.set_limit(1);
    flow.notify();
    let (label, s2) = rx.recv().await.unwrap();
    assert_eq!(
        label, "s2",
        "the warmer session's turn goes ahead of the older one"
    );
    assert_eq!(s2.turn_kind(), TurnKind::Continuing);
    // s2 finishes again and queues its next turn; s1 has now waited past the head start, so
    // it goes first after all.
    capacity.set_limit(0);
    drop(s2);
    spawn_admit(&flow, turn("s2"), "s2-again", &tx);
    wait_queued(&flow, 2).await;
    tokio::time::advance(10 * SEC).await;
    capacity.set_limit(1);
    flow.notify();
    let (label, _s1) = rx.recv().await.unwrap();
    assert_eq!(
        label, "s1",
        "a turn waiting past the head start goes in arrival order"
    );
}

/// A continuing turn queued for the full `e0` (pin_wait 10 s), then a second later a new
/// session of the same team, then room for one request: not on e0, so nothing goes yet.
/// Returns the signal, the controller, where permits arrive and the turn's admit task.
async fn a_turn_held_for_its_endpoint_ahead_of_a_new_session() -> (
    Arc<Endpoints>,
    FlowController,
    mpsc::UnboundedReceiver<(String, Permit)>,
    JoinHandle<Result<(), Rejection>>,
) {
    let signal = Endpoints::with_full("e0");
    let mut config = config();
    config.pin_wait = 10 * SEC;
    let flow = FlowController::new(config, signal.clone()).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let turn = Ticket::new("bulk", 10).continuing(true).affinity("e0");
    let held = spawn_admit(&flow, turn, "turn", &tx);
    wait_queued(&flow, 1).await;
    tokio::time::advance(SEC).await;
    spawn_admit(&flow, Ticket::new("bulk", 10), "new", &tx);
    wait_queued(&flow, 2).await;
    signal.cap.set_limit(1);
    flow.notify();
    (signal, flow, rx, held)
}

#[tokio::test(start_paused = true)]
async fn a_continuing_turn_waiting_for_its_endpoint_keeps_its_head_start_over_new_sessions() {
    // There is room, but not on e0: the new session, which arrived after the turn, does not
    // take it ahead of the turn.
    let (signal, flow, mut rx, _held) = a_turn_held_for_its_endpoint_ahead_of_a_new_session().await;
    tokio::task::yield_now().await;
    assert_eq!(flow.snapshot().queued(), 2);
    assert!(rx.try_recv().is_err());
    // Once the turn has waited out pin_wait it moves to the room, and the new session follows
    // when there is more.
    tokio::time::sleep(10 * SEC).await;
    let (label, moved) = rx.recv().await.unwrap();
    assert_eq!(label, "turn");
    assert_eq!(moved.outwaited_pin(), Some(0.0));
    signal.cap.set_limit(2);
    flow.notify();
    let (label, new) = rx.recv().await.unwrap();
    assert_eq!(label, "new");
    assert!(!new.promoted());
}

#[tokio::test(start_paused = true)]
async fn a_request_leaving_the_queue_lets_the_ones_it_held_back_go() {
    let (_signal, flow, mut rx, held) = a_turn_held_for_its_endpoint_ahead_of_a_new_session().await;
    tokio::task::yield_now().await;
    assert!(
        rx.try_recv().is_err(),
        "the new session waits behind the held turn"
    );
    // The turn's client leaves: the new session goes at once, with no other event.
    held.abort();
    let (label, _new) = tokio::time::timeout(SEC, rx.recv())
        .await
        .expect("dispatched when the turn left")
        .unwrap();
    assert_eq!(label, "new");
    assert_eq!(flow.snapshot().queued(), 0);
}

/// [`MaxInFlight`] plus what other gateways hold: `e0` has room while `room` is set, and
/// `elsewhere` is the turn another gateway holds for it.
struct Peers {
    cap: MaxInFlight,
    room: AtomicBool,
    elsewhere: std::sync::Mutex<Option<HeldTurn>>,
}

impl CapacitySignal for Peers {
    fn can_dispatch(&self, load: &FlowLoad) -> bool {
        self.cap.can_dispatch(load)
    }

    fn has_room(&self, _: Option<&str>, _: f64, promised: u64, _: bool) -> bool {
        promised == 0 && self.room.load(Ordering::Relaxed)
    }

    fn warmer_elsewhere(&self, endpoint: &str, turn: &HeldTurn) -> bool {
        endpoint == "e0"
            && self
                .elsewhere
                .lock()
                .unwrap()
                .is_some_and(|held| held.outranks(turn))
    }

    fn yield_limit(&self) -> Duration {
        Duration::from_millis(400)
    }
}

#[tokio::test(start_paused = true)]
async fn a_turn_leaves_its_endpoints_room_to_a_turn_held_by_another_gateway_that_outranks_it() {
    let signal = Arc::new(Peers {
        cap: MaxInFlight::new(1),
        room: AtomicBool::new(true),
        elsewhere: std::sync::Mutex::new(None),
    });
    let flow = FlowController::new(config(), signal.clone()).unwrap();
    let turn = |session: &str| {
        Ticket::new("bulk", 10)
            .session(session)
            .continuing(true)
            .affinity("e0")
    };
    let elsewhere = |priority: i32, warmth: Warmth| {
        *signal.elsewhere.lock().unwrap() = Some(HeldTurn { priority, warmth });
    };
    // s1 ran a turn here; its next one finds no room on e0 and waits, as warm as that turn's
    // end.
    drop(flow.admit(turn("s1")).await.unwrap());
    let s1_active = Instant::now();
    signal.room.store(false, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel();
    spawn_admit(&flow, turn("s1"), "s1", &tx);
    wait_queued(&flow, 1).await;
    assert_eq!(
        flow.held(),
        HashMap::from([(
            "e0".to_string(),
            HeldTurn {
                priority: 0,
                warmth: Warmth::Since(s1_active)
            }
        )]),
        "what this gateway tells the others it holds"
    );
    // Another gateway holds a turn of a session active more recently: the room is left to it
    // for up to the yield limit, then taken.
    tokio::time::advance(SEC).await;
    elsewhere(0, Warmth::Since(Instant::now()));
    signal.room.store(true, Ordering::Relaxed);
    flow.notify();
    tokio::time::advance(Duration::from_millis(300)).await;
    flow.notify();
    tokio::task::yield_now().await;
    assert!(rx.try_recv().is_err(), "left to the warmer turn elsewhere");
    assert_eq!(flow.snapshot().queued(), 1);
    tokio::time::advance(Duration::from_millis(150)).await;
    flow.notify();
    let (label, permit) = rx.recv().await.unwrap();
    assert_eq!(label, "s1", "taken once the yield limit has passed");
    drop(permit);
    // A colder turn of the same band, or a warmer one of a lower band, takes nothing from a
    // turn here; a colder one of a higher band does.
    for (priority, warmth, yields) in [
        (0, Warmth::Since(s1_active), false),
        (-1, Warmth::Aged, false),
        (10, Warmth::Since(s1_active), true),
    ] {
        signal.cap.set_limit(0);
        let label = format!("{priority} {warmth:?}");
        spawn_admit(&flow, turn("s1"), label.clone(), &tx);
        wait_queued(&flow, 1).await;
        elsewhere(priority, warmth);
        signal.cap.set_limit(1);
        flow.notify();
        tokio::task::yield_now().await;
        let first = rx.try_recv();
        assert_eq!(first.is_err(), yields, "{label}");
        let got = match first {
            Ok((got, _permit)) => got,
            Err(_) => {
                tokio::time::advance(Duration::from_millis(500)).await;
                flow.notify();
                rx.recv().await.unwrap().0
            }
        };
        assert_eq!(got, label);
    }
}

#[tokio::test(start_paused = true)]
async fn activity_seen_by_another_gateway_makes_a_session_continuing_and_warm_here() {
    let (flow, _capacity) = controller(config(), 1);
    let start = Instant::now();
    drop(
        flow.admit(Ticket::new("bulk", 10).session("local"))
            .await
            .unwrap(),
    );
    tokio::time::advance(SEC).await;
    // "remote" never ran here; another gateway finished a turn of it just now.
    flow.note_activity([
        ("remote".to_string(), Instant::now()),
        ("elsewhere-only".to_string(), Instant::now()),
    ]);
    let permit = flow
        .admit(Ticket::new("bulk", 10).session("remote"))
        .await
        .unwrap();
    assert_eq!(
        permit.turn_kind(),
        TurnKind::Continuing,
        "active at another gateway within the turn window"
    );
    drop(permit);
    // Only this gateway's own events are passed on, latest per session: what it learnt from
    // others does not echo back.
    let mut recent = flow.recent_activity(start);
    recent.sort();
    let sessions: Vec<&str> = recent.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(sessions, ["local", "remote"]);
    assert_eq!(
        recent[1].1,
        Instant::now(),
        "remote's own turn here, just now"
    );
    assert!(flow.recent_activity(Instant::now() + SEC).is_empty());
    // Activity older than the turn window says nothing: the session stays unknown here, so a
    // turn carrying earlier ones is continuing (a known but idle session's would be new).
    tokio::time::advance(60 * SEC).await;
    flow.note_activity([("stale".to_string(), Instant::now() - 61 * SEC)]);
    let permit = flow
        .admit(Ticket::new("bulk", 10).session("stale").continuing(true))
        .await
        .unwrap();
    assert_eq!(permit.turn_kind(), TurnKind::Continuing);
}
