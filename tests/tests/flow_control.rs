//! End-to-end: flow control in front of real simulated replicas.
//!
//! Each test owns its pool's saturation: engine metrics are not scraped, so the test sets
//! every endpoint's load report itself (a deep engine queue saturates it) and asks the
//! controllers to look again, exactly as a scrape does. Requests that must stay in flight are
//! held by the simulator's first-token stall. Every wait is bounded polling on the
//! controller's snapshot; no assertion depends on how long anything took.

use std::time::Duration;
use tokio::time::Instant;

use reqwest::header::HeaderMap;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use agentgate::auth::hash_key;
use agentgate::flow::{FlowSnapshot, LoadReport};
use agentgate::Gateway;
use agentgate_tests::*;

/// No scraping (the test sets load reports) and no health probing.
const STILL: &str = "[routing]\nscrape_interval_ms = 0\nhealth_interval_ms = 0\n";

/// Two bands: `interactive` above `batch`.
const BANDS: &str = "[[bands]]\nname = \"interactive\"\npriority = 10\n\
    [[bands]]\nname = \"batch\"\npriority = 0\n";

fn key(team: &str) -> String {
    format!("sk-{team}")
}

/// A `[[teams]]` entry for `team` with key `sk-TEAM` and `extra` keys.
fn team(name: &str, extra: &str) -> String {
    format!(
        "[[teams]]\nname = \"{name}\"\napi_key_sha256 = [\"{}\"]\n{extra}\n",
        hash_key(&key(name))
    )
}

/// Teams `chat` (default band `interactive`) and `bulk` (default band `batch`).
fn chat_and_bulk() -> String {
    team("chat", "default_band = \"interactive\"") + &team("bulk", "default_band = \"batch\"")
}

fn snapshot(gw: &Gateway) -> FlowSnapshot {
    gw.state()
        .flow
        .controller("sim")
        .expect("the pool has a controller")
        .snapshot()
}

fn queued(gw: &Gateway, band: &str) -> usize {
    snapshot(gw).band(band).map_or(0, |b| b.queued)
}

/// Make every endpoint of the pool saturated (a deep engine queue) or not, then let flow
/// control look again, as after a metrics scrape.
fn saturate(gw: &Gateway, saturated: bool) {
    let pool = gw.state().pools.for_model("sim-model").unwrap();
    for e in pool.endpoints().iter() {
        e.set_load_report(LoadReport {
            at: Instant::now(),
            waiting: if saturated { 1000.0 } else { 0.0 },
            running: 0.0,
            kv_usage: None,
            gateway_in_flight: 0,
            peer_in_flight: 0,
        });
    }
    gw.state().flow.notify();
}

/// Hold every request's first token on `sim` for a minute: dispatched requests stay in flight.
async fn stall(sim: &agentgate_sim::SimHandle) {
    set_sim_fault(sim, json!({"stall_ms": 60_000})).await;
}

/// A finished call: status, headers, JSON body.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }
}

/// `POST /v1/responses` as `team` (no key when `None`) with extra headers.
async fn call(base: &str, team: Option<&str>, body: Value, headers: &[(&str, &str)]) -> Answer {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/responses"))
        .json(&body);
    if let Some(team) = team {
        req = req.bearer_auth(key(team));
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        headers,
        body,
    }
}

/// [`call`] in a task.
fn spawn_call(
    base: &str,
    team: Option<&str>,
    body: Value,
    headers: &[(&str, &str)],
) -> JoinHandle<Answer> {
    let base = base.to_string();
    let team = team.map(str::to_string);
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    tokio::spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        call(&base, team.as_deref(), body, &headers).await
    })
}

fn hello() -> Value {
    json!({"model": "sim-model", "input": "hello there", "max_output_tokens": 16})
}

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_queued_takes_its_request_out() {
    let fleet = Fleet::of(1).extra(STILL).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    saturate(gw, true);
    let plain = spawn_call(&base, None, hello(), &[]);
    let mut streaming_body = hello();
    streaming_body["stream"] = json!(true);
    let streaming = spawn_call(&base, None, streaming_body, &[]);
    eventually("both requests wait", || queued(gw, "default") == 2).await;
    plain.abort();
    streaming.abort();
    eventually("the queue is empty", || queued(gw, "default") == 0).await;
    let s = snapshot(gw);
    let band = s.band("default").unwrap();
    assert_eq!((band.cancelled, band.dispatched), (2, 0));
    assert_eq!(band.queued_bytes, 0);
    let team = s.team("default").unwrap();
    assert_eq!((team.queued, team.in_flight, team.cancelled), (0, 0, 2));
    // Room again: nothing left to dispatch, and a new request goes straight through.
    saturate(gw, false);
    let answer = call(&base, None, hello(), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-agentgate-band"), Some("default"));
    let s = snapshot(gw);
    assert_eq!(s.band("default").unwrap().dispatched, 1);
    eventually("the permit is released", || snapshot(gw).in_flight == 0).await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_band_goes_first_when_room_opens() {
    let extra = format!(
        "{STILL}[flow]\nmax_in_flight_per_endpoint = 1\n{BANDS}{}",
        chat_and_bulk(),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    saturate(gw, true);
    // The batch request arrives first, the interactive one after it.
    let low = spawn_call(&base, Some("bulk"), hello(), &[]);
    eventually("the batch request waits", || queued(gw, "batch") == 1).await;
    let high = spawn_call(&base, Some("chat"), hello(), &[]);
    eventually("the interactive request waits", || {
        queued(gw, "interactive") == 1
    })
    .await;
    let m = metrics_text(&base).await;
    for line in [
        "agentgate_flow_queued_requests{pool=\"sim\",band=\"batch\"} 1",
        "agentgate_flow_queued_requests{pool=\"sim\",band=\"interactive\"} 1",
        "agentgate_flow_team_queued_requests{pool=\"sim\",team=\"bulk\"} 1",
        "agentgate_flow_capacity_requests{pool=\"sim\"} 0",
    ] {
        assert!(has_line(&m, line), "{line} missing in\n{m}");
    }
    // Room for one request, which then stays in flight: it must be the interactive one.
    stall(fleet.sim()).await;
    saturate(gw, false);
    eventually("one request is dispatched", || snapshot(gw).in_flight == 1).await;
    let s = snapshot(gw);
    assert_eq!(s.band("interactive").unwrap().dispatched, 1);
    assert_eq!(s.band("batch").unwrap().dispatched, 0);
    assert_eq!(s.band("batch").unwrap().queued, 1, "batch waits behind");
    assert_eq!(s.team("chat").unwrap().in_flight, 1);
    high.abort();
    low.abort();
    fleet.shutdown_gateways().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sheddable_band_is_shed_only_while_saturated() {
    let extra = format!(
        "{STILL}{}{}",
        BANDS.replace("priority = 0\n", "priority = 0\nsheddable = true\n"),
        chat_and_bulk(),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    // Not saturated: a burst of sheddable requests is served, none shed.
    let burst: Vec<_> = (0..12)
        .map(|_| spawn_call(&base, Some("bulk"), hello(), &[]))
        .collect();
    for task in burst {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-agentgate-band"), Some("batch"));
    }
    assert_eq!(snapshot(gw).band("batch").unwrap().shed, 0);

    // Saturated: refused at once with 429 and Retry-After; a non-sheddable band queues.
    saturate(gw, true);
    let shed = call(&base, Some("bulk"), hello(), &[]).await;
    assert_eq!(shed.status, 429, "{}", shed.body);
    assert_eq!(shed.code(), "overloaded_shed");
    assert_eq!(shed.header("retry-after"), Some("1"));
    assert!(shed.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("band `batch` is sheddable"));
    let waiting = spawn_call(&base, Some("chat"), hello(), &[]);
    eventually("the interactive request waits", || {
        queued(gw, "interactive") == 1
    })
    .await;
    let s = snapshot(gw);
    assert_eq!(s.band("batch").unwrap().shed, 1);
    assert_eq!(s.team("bulk").unwrap().shed, 1);
    assert_eq!(s.band("interactive").unwrap().shed, 0);

    // Room again: the queued request runs, and sheddable requests are served again.
    saturate(gw, false);
    assert_eq!(waiting.await.unwrap().status, 200);
    assert_eq!(call(&base, Some("bulk"), hello(), &[]).await.status, 200);
    assert_eq!(snapshot(gw).band("batch").unwrap().shed, 1);
    let m = metrics_text(&base).await;
    for line in [
        "agentgate_flow_band_requests_total{pool=\"sim\",band=\"batch\",outcome=\"shed\"} 1",
        "agentgate_flow_team_requests_total{pool=\"sim\",team=\"bulk\",outcome=\"shed\"} 1",
    ] {
        assert!(has_line(&m, line), "{line} missing in\n{m}");
    }
    eventually("every permit is released", || snapshot(gw).in_flight == 0).await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429_and_a_queue_ttl_is_503_with_retry_after() {
    let extra = format!(
        "{STILL}[flow]\nretry_after_s = 2\n\
         [[bands]]\nname = \"one\"\npriority = 1\nmax_queued = 1\n\
         [[bands]]\nname = \"short\"\npriority = 0\nqueue_ttl_ms = 200\n{}{}",
        team("few", "default_band = \"one\""),
        team("hasty", "default_band = \"short\""),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    saturate(gw, true);
    let first = spawn_call(&base, Some("few"), hello(), &[]);
    eventually("the first request waits", || queued(gw, "one") == 1).await;
    let full = call(&base, Some("few"), hello(), &[]).await;
    assert_eq!(full.status, 429, "{}", full.body);
    assert_eq!(full.code(), "queue_full");
    assert_eq!(full.header("retry-after"), Some("2"));
    assert_eq!(full.body["error"]["type"], "rate_limit_error");
    // A request that waits its band's whole TTL is answered then.
    let timed_out = call(&base, Some("hasty"), hello(), &[]).await;
    assert_eq!(timed_out.status, 503, "{}", timed_out.body);
    assert_eq!(timed_out.code(), "queue_timeout");
    assert_eq!(timed_out.header("retry-after"), Some("2"));
    assert_eq!(timed_out.body["error"]["type"], "server_error");
    let s = snapshot(gw);
    let one = s.band("one").unwrap();
    assert_eq!((one.queued, one.queue_full, one.dispatched), (1, 1, 0));
    let short = s.band("short").unwrap();
    assert_eq!((short.queued, short.timed_out, short.dispatched), (0, 1, 0));
    assert_eq!(s.team("hasty").unwrap().timed_out, 1);
    // The first one is still served once there is room.
    saturate(gw, false);
    assert_eq!(first.await.unwrap().status, 200);
    eventually("every permit is released", || snapshot(gw).in_flight == 0).await;
    fleet.shutdown().await;
}

/// A turn continuing a stored chain sends a few bytes but holds the chain's history, loaded
/// from the store, while it waits: the queue's byte cap counts that, not the body (and lets
/// it wait when nothing else does: it could never wait otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_turn_counts_the_history_it_holds_against_the_byte_cap() {
    let extra = format!(
        "{STILL}[[bands]]\nname = \"small\"\npriority = 1\nmax_queued_bytes = 100000\n\
         queue_ttl_ms = 3000\n{}",
        team("chain", "default_band = \"small\""),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let mut long = hello();
    long["input"] = json!("a long history of tool output ".repeat(8_000));
    let first = call(&base, Some("chain"), long, &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let id = first.body["id"].as_str().unwrap().to_string();
    saturate(gw, true);
    let mut next = hello();
    next["previous_response_id"] = json!(id);
    // Behind a turn of its own, as small as the chained one's body, it does not fit.
    let waiting = spawn_call(&base, Some("chain"), hello(), &[]);
    eventually("the short turn waits", || queued(gw, "small") == 1).await;
    let refused = call(&base, Some("chain"), next.clone(), &[]).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.code(), "queue_full");
    saturate(gw, false);
    assert_eq!(waiting.await.unwrap().status, 200);
    // Alone it waits for room.
    saturate(gw, true);
    let alone = spawn_call(&base, Some("chain"), next, &[]);
    eventually("the chained turn waits", || queued(gw, "small") == 1).await;
    saturate(gw, false);
    assert_eq!(alone.await.unwrap().status, 200);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_may_ask_for_a_lower_band_never_a_higher_one() {
    let extra = format!(
        "{STILL}[flow]\nservice_tier = {{ flex = \"batch\", priority = \"interactive\" }}\n\
         {BANDS}{}{}",
        team(
            "chat",
            "default_band = \"interactive\"\nbands = [\"batch\"]"
        ),
        team("bulk", "default_band = \"batch\""),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let plain = call(&base, Some("chat"), hello(), &[]).await;
    assert_eq!(plain.status, 200, "{}", plain.body);
    assert_eq!(plain.header("x-agentgate-band"), Some("interactive"));
    assert!(plain.header("x-agentgate-queue-wait-ms").is_some());
    assert!(
        plain.header("x-ratelimit-limit-requests").is_none(),
        "no limits, no rate-limit headers"
    );
    let by_header = call(
        &base,
        Some("chat"),
        hello(),
        &[("x-agentgate-band", "batch")],
    )
    .await;
    assert_eq!(by_header.status, 200, "{}", by_header.body);
    assert_eq!(by_header.header("x-agentgate-band"), Some("batch"));
    let mut flex = hello();
    flex["service_tier"] = json!("flex");
    let by_tier = call(&base, Some("chat"), flex, &[]).await;
    assert_eq!(by_tier.header("x-agentgate-band"), Some("batch"));
    let mut auto = hello();
    auto["service_tier"] = json!("auto");
    let unmapped = call(&base, Some("chat"), auto, &[]).await;
    assert_eq!(unmapped.header("x-agentgate-band"), Some("interactive"));

    let upgrade = call(
        &base,
        Some("bulk"),
        hello(),
        &[("x-agentgate-band", "interactive")],
    )
    .await;
    assert_eq!(upgrade.status, 403, "{}", upgrade.body);
    assert_eq!(upgrade.code(), "band_not_allowed");
    assert_eq!(upgrade.body["error"]["param"], "x-agentgate-band");
    assert_eq!(upgrade.body["error"]["type"], "invalid_request_error");
    let mut priority = hello();
    priority["service_tier"] = json!("priority");
    let upgrade = call(&base, Some("bulk"), priority, &[]).await;
    assert_eq!(upgrade.status, 403);
    assert_eq!(upgrade.body["error"]["param"], "service_tier");
    // `fast` is OpenAI's other name for `priority`: it takes that mapping.
    let mut fast = hello();
    fast["service_tier"] = json!("fast");
    let upgrade = call(&base, Some("bulk"), fast.clone(), &[]).await;
    assert_eq!(upgrade.status, 403, "{}", upgrade.body);
    assert_eq!(upgrade.body["error"]["param"], "service_tier");
    let by_fast = call(&base, Some("chat"), fast, &[]).await;
    assert_eq!(by_fast.status, 200, "{}", by_fast.body);
    assert_eq!(by_fast.header("x-agentgate-band"), Some("interactive"));
    assert_eq!(by_fast.body["service_tier"], "priority");
    let unknown = call(
        &base,
        Some("chat"),
        hello(),
        &[("x-agentgate-band", "gold")],
    )
    .await;
    assert_eq!((unknown.status, unknown.code()), (400, "unknown_band"));

    let s = snapshot(gw);
    assert_eq!(s.band("interactive").unwrap().dispatched, 3);
    assert_eq!(s.band("batch").unwrap().dispatched, 2);
    eventually("every permit is released", || snapshot(gw).in_flight == 0).await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_answer_429_with_openai_headers() {
    let extra = format!(
        "{STILL}{}{}",
        team(
            "small",
            "requests_per_minute = 2\ntokens_per_minute = 100000"
        ),
        team("tiny", "tokens_per_minute = 20"),
    ) + &team("roomy", "requests_per_minute = 10");
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    for remaining in ["1", "0"] {
        let ok = call(&base, Some("small"), hello(), &[]).await;
        assert_eq!(ok.status, 200, "{}", ok.body);
        assert_eq!(ok.header("x-ratelimit-limit-requests"), Some("2"));
        assert_eq!(ok.header("x-ratelimit-remaining-requests"), Some(remaining));
        assert_eq!(ok.header("x-ratelimit-limit-tokens"), Some("100000"));
        assert!(ok.header("x-ratelimit-reset-requests").is_some());
        assert!(ok.header("x-ratelimit-remaining-tokens").is_some());
        assert!(ok.header("x-ratelimit-reset-tokens").is_some());
    }
    let limited = call(&base, Some("small"), hello(), &[]).await;
    assert_eq!(limited.status, 429, "{}", limited.body);
    assert_eq!(limited.code(), "rate_limit_exceeded_requests");
    assert_eq!(limited.body["error"]["type"], "requests");
    assert_eq!(limited.header("x-ratelimit-limit-requests"), Some("2"));
    assert_eq!(limited.header("x-ratelimit-remaining-requests"), Some("0"));
    // One request comes back every 30 s.
    let retry: u64 = limited.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
    // Over the whole tokens-per-minute budget: never fits, so no Retry-After.
    let too_large = call(&base, Some("tiny"), hello(), &[]).await;
    assert_eq!(too_large.status, 429, "{}", too_large.body);
    assert_eq!(too_large.code(), "request_too_large");
    assert_eq!(too_large.header("retry-after"), None);
    assert_eq!(too_large.header("x-ratelimit-limit-tokens"), Some("20"));
    // A background response is charged when it is created: over the limits, refused there.
    let mut background = hello();
    background["background"] = json!(true);
    let refused = call(&base, Some("small"), background.clone(), &[]).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.code(), "rate_limit_exceeded_requests");
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    let queued = call(&base, Some("roomy"), background, &[]).await;
    assert_eq!(queued.status, 200, "{}", queued.body);
    assert_eq!(queued.body["status"], "queued");
    assert_eq!(queued.header("x-ratelimit-remaining-requests"), Some("9"));
    let s = snapshot(gw);
    assert_eq!(s.team("small").unwrap().rate_limited, 2);
    assert_eq!(s.team("tiny").unwrap().rate_limited, 1);
    assert_eq!(s.team("small").unwrap().dispatched_requests, 2);
    let m = metrics_text(&base).await;
    for line in [
        "agentgate_flow_team_requests_total{pool=\"sim\",team=\"small\",outcome=\"rate_limited\"} 2",
        "agentgate_flow_team_requests_total{pool=\"sim\",team=\"tiny\",outcome=\"rate_limited\"} 1",
        "agentgate_flow_band_requests_total{pool=\"sim\",band=\"default\",outcome=\"rate_limited\"} 3",
    ] {
        assert!(has_line(&m, line), "{line} missing in\n{m}");
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_share_a_team_budget() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("flow_shared_budget");
    let extra = format!("{STILL}{}", team("shared", "requests_per_minute = 3"));
    let mut fleet = Fleet::of(1)
        .store(redis.url(), &prefix)
        .extra(&extra)
        .gateways(2)
        .start()
        .await;
    let (a, b) = (&fleet.gateways()[0], &fleet.gateways()[1]);
    let mut remaining = Vec::new();
    for gw in [a, b, a] {
        let ok = call(&gw.base_url(), Some("shared"), hello(), &[]).await;
        assert_eq!(ok.status, 200, "{}", ok.body);
        remaining.push(
            ok.header("x-ratelimit-remaining-requests")
                .unwrap()
                .to_string(),
        );
    }
    assert_eq!(
        remaining,
        ["2", "1", "0"],
        "one budget across both gateways"
    );
    for gw in [b, a] {
        let limited = call(&gw.base_url(), Some("shared"), hello(), &[]).await;
        assert_eq!(limited.status, 429, "{}", limited.body);
        assert_eq!(limited.code(), "rate_limit_exceeded_requests");
        assert!(limited.header("retry-after").is_some());
    }
    // Another deployment (key prefix) on the same Redis has its own budget.
    let other_prefix = unique_prefix("flow_other_budget");
    let other_toml = config_toml(&fleet.urls(), Some((redis.url(), &other_prefix)), &extra);
    let other = fleet.add_gateway(&other_toml).await;
    let ok = call(&other.base_url(), Some("shared"), hello(), &[]).await;
    assert_eq!(ok.header("x-ratelimit-remaining-requests"), Some("2"));
    fleet.shutdown().await;
}

/// A team's `max_concurrent` holds across two gateways on one Redis: with its one request
/// running on the first, its request on the second waits; when the first ends, the slot goes
/// to that older request, not to a newer one waiting on the first gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_hold_a_team_to_one_concurrency_cap() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("flow_shared_concurrency");
    let extra = format!(
        "{}{}",
        exchange_every_200_ms(),
        team("capped", "max_concurrent = 1")
    );
    let fleet = Fleet::of(1)
        .store(redis.url(), &prefix)
        .extra(&extra)
        .gateways(2)
        .start()
        .await;
    let (a, b) = (&fleet.gateways()[0], &fleet.gateways()[1]);
    let team_on = |gw: &Gateway| snapshot(gw).team("capped").unwrap().clone();
    // Every first token is held back, the first request's until the queues are checked.
    set_sim_fault(fleet.sim(), json!({"stall_ms": 60_000})).await;
    let first = spawn_call(&a.base_url(), Some("capped"), hello(), &[]);
    eventually("b counts the team's request on a", || {
        team_on(b).peer_in_flight == 1
    })
    .await;
    let text = metrics_text(&b.base_url()).await;
    assert!(
        has_line(
            &text,
            "agentgate_flow_team_peer_in_flight_requests{pool=\"sim\",team=\"capped\"} 1"
        ),
        "{text}"
    );
    let second = spawn_call(&b.base_url(), Some("capped"), hello(), &[]);
    eventually("the second request waits on b", || team_on(b).queued == 1).await;
    assert_eq!(team_on(b).in_flight, 0);
    // Once a has heard of it, a newer request is queued on a.
    eventually("a hears of the request waiting on b", || {
        team_on(a).peer_waiting
    })
    .await;
    let third = spawn_call(&a.base_url(), Some("capped"), hello(), &[]);
    eventually("the third request waits on a", || team_on(a).queued == 1).await;
    // The first request goes on; the next ones are held 1.5 s.
    set_sim_fault(fleet.sim(), json!({"stall_ms": 1_500})).await;
    assert_eq!(first.await.unwrap().status, 200);
    // The slot goes to the older request on b while the newer one on a still waits.
    eventually("the second request runs on b", || team_on(b).in_flight == 1).await;
    assert_eq!(team_on(a).queued, 1, "the newer request on a waits");
    let second = second.await.unwrap();
    assert_eq!(second.status, 200, "{}", second.body);
    let third = third.await.unwrap();
    assert_eq!(third.status, 200, "{}", third.body);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuing_turn_goes_before_a_new_session() {
    let extra = format!("{STILL}[flow]\nmax_in_flight_per_endpoint = 1\naging_s = 600\n");
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let first = call(&base, None, hello(), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let first_id = first.body["id"].as_str().unwrap().to_string();
    saturate(gw, true);
    // A new session arrives first, then the next turn of the session that just ran.
    let new = spawn_call(&base, None, hello(), &[]);
    eventually("the new session waits", || queued(gw, "default") == 1).await;
    let mut next = hello();
    next["previous_response_id"] = json!(first_id);
    let continuing = spawn_call(&base, None, next, &[]);
    eventually("the continuing turn waits", || queued(gw, "default") == 2).await;
    let before = snapshot(gw).turns;
    assert_eq!((before.continuing.count(), before.new.count()), (0, 1));
    stall(fleet.sim()).await;
    saturate(gw, false);
    eventually("one request is dispatched", || snapshot(gw).in_flight == 1).await;
    let s = snapshot(gw);
    assert_eq!(
        s.turns.continuing.count(),
        1,
        "the continuing turn went first"
    );
    assert_eq!(s.turns.new.count(), 1);
    assert_eq!(s.turns.promoted, 0);
    assert_eq!(s.band("default").unwrap().queued, 1);
    new.abort();
    continuing.abort();
    fleet.shutdown_gateways().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_weight_teams_split_dispatched_tokens_while_both_backlogged() {
    let extra = format!(
        "{STILL}[flow]\nmax_in_flight_per_endpoint = 1\n{}{}",
        team("heavy", "weight = 1"),
        team("light", "weight = 1"),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    saturate(gw, true);
    // The heavy team offers ten times the light team's load, interleaved.
    let mut tasks = Vec::new();
    for i in 0..66 {
        let team = if i % 11 == 5 { "light" } else { "heavy" };
        tasks.push(spawn_call(&base, Some(team), hello(), &[]));
    }
    eventually("every request waits", || queued(gw, "default") == 66).await;
    let s = snapshot(gw);
    assert_eq!(s.team("heavy").unwrap().queued, 60);
    assert_eq!(s.team("light").unwrap().queued, 6);
    // Room for ten requests, which then stay in flight.
    stall(fleet.sim()).await;
    gw.state().flow.set_max_in_flight_per_endpoint(10);
    saturate(gw, false);
    eventually("ten requests are dispatched", || {
        snapshot(gw).in_flight == 10
    })
    .await;
    let s = snapshot(gw);
    let (heavy, light) = (s.team("heavy").unwrap(), s.team("light").unwrap());
    assert!(
        heavy.queued > 0 && light.queued > 0,
        "both still backlogged"
    );
    let total = (heavy.dispatched_tokens + light.dispatched_tokens) as f64;
    let share = heavy.dispatched_tokens as f64 / total;
    assert!(
        (0.45..=0.55).contains(&share),
        "heavy got {share:.3} of {total} tokens ({} vs {} requests)",
        heavy.dispatched_requests,
        light.dispatched_requests
    );
    let m = metrics_text(&base).await;
    for team in ["heavy", "light"] {
        let line = format!(
            "agentgate_flow_team_requests_total{{pool=\"sim\",team=\"{team}\",outcome=\"dispatched\"}} 5"
        );
        assert!(has_line(&m, &line), "{line} missing in\n{m}");
    }
    for task in tasks {
        task.abort();
    }
    fleet.shutdown_gateways().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_run_in_the_lowest_band() {
    let extra = format!(
        "{STILL}{BANDS}{}",
        team(
            "chat",
            "default_band = \"interactive\"\nbands = [\"batch\"]"
        ),
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let mut body = hello();
    body["background"] = json!(true);
    let queued = call(&base, Some("chat"), body, &[]).await;
    assert_eq!(queued.status, 200, "{}", queued.body);
    let id = queued.body["id"].as_str().unwrap().to_string();
    let status = final_status(&base, "chat", &id).await;
    assert!(status == "completed" || status == "incomplete", "{status}");
    let s = snapshot(gw);
    assert_eq!(s.band("batch").unwrap().dispatched, 1);
    assert_eq!(s.band("interactive").unwrap().dispatched, 0);
    eventually("the permit is released", || snapshot(gw).in_flight == 0).await;
    fleet.shutdown().await;
}

/// The status of background response `id` of `team` once it is neither queued nor in
/// progress (or after 15 s), with its error code when it has one.
async fn final_status(base: &str, team: &str, id: &str) -> String {
    let client = reqwest::Client::new();
    let mut status = String::new();
    for _ in 0..1500 {
        let r = json_body(
            client
                .get(format!("{base}/v1/responses/{id}"))
                .bearer_auth(key(team)),
        )
        .await;
        status = r["status"].as_str().unwrap_or_default().to_string();
        if status != "queued" && status != "in_progress" {
            if let Some(code) = r["error"]["code"].as_str() {
                status = format!("{status} ({code})");
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    status
}

/// A fresh folder named after `name` for a config file `gateway.toml` in front of `sim`:
/// `(folder, file, config text)`, the text without any `[[teams]]` yet.
fn watched_config(
    sim: &agentgate_sim::SimHandle,
    name: &str,
    extra: &str,
) -> (std::path::PathBuf, std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(unique_prefix(name).replace(':', "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gateway.toml");
    (dir, file, config_toml(&[sim.base_url()], None, extra))
}

/// Write `text` to `file` and start a gateway on it, watching it for changes.
async fn start_watching(file: &std::path::Path, text: &str) -> Gateway {
    write_atomically(file, text);
    let config = agentgate::Config::load(file).expect("valid config");
    Gateway::start(config, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("gateway starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_keeps_queued_requests() {
    let sim = start_sim("sim-model").await;
    let (dir, file, base_toml) = watched_config(
        &sim,
        "agentgate-flow-reload",
        &format!("{STILL}[server]\nreload_interval_ms = 20\n{BANDS}"),
    );
    let alpha = team("alpha", "default_band = \"batch\"");
    let gw = start_watching(&file, &format!("{base_toml}{alpha}")).await;
    let base = gw.base_url();
    saturate(&gw, true);
    let waiting: Vec<_> = (0..3)
        .map(|_| spawn_call(&base, Some("alpha"), hello(), &[]))
        .collect();
    eventually("three requests wait", || queued(&gw, "batch") == 3).await;
    assert_eq!(call(&base, Some("beta"), hello(), &[]).await.status, 401);

    // A new team with its key, a new weight, a new band: the queue stays as it was.
    let beta = team("beta", "default_band = \"interactive\"");
    let alpha_heavier = team("alpha", "default_band = \"batch\"\nweight = 3");
    let more_bands = "[[bands]]\nname = \"scavenger\"\npriority = -5\nsheddable = true\n";
    write_atomically(
        &file,
        &format!("{base_toml}{more_bands}{alpha_heavier}{beta}"),
    );
    let reloads = |result: &str| gw.state().metrics.config_reloads.get([result]);
    eventually("the file is reloaded", || reloads("ok") == 1).await;
    let s = snapshot(&gw);
    assert_eq!(
        s.band("batch").unwrap().queued,
        3,
        "queued requests are kept"
    );
    assert!(s.band("scavenger").is_some());
    assert!(s.team("beta").is_some());

    // A broken file changes nothing.
    write_atomically(
        &file,
        &format!("{base_toml}{alpha}[[teams]]\nname = \"\"\n"),
    );
    eventually("the broken file is refused", || reloads("error") == 1).await;
    assert_eq!(snapshot(&gw).band("batch").unwrap().queued, 3);

    saturate(&gw, false);
    for task in waiting {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-agentgate-band"), Some("batch"));
    }
    let beta_answer = call(&base, Some("beta"), hello(), &[]).await;
    assert_eq!(beta_answer.status, 200, "{}", beta_answer.body);
    assert_eq!(beta_answer.header("x-agentgate-band"), Some("interactive"));
    let m = metrics_text(&base).await;
    assert!(
        has_line(&m, "agentgate_config_reloads_total{result=\"ok\"} 1"),
        "{m}"
    );
    eventually("every permit is released", || snapshot(&gw).in_flight == 0).await;
    gw.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_waiting_for_a_run_slot_takes_its_band_after_a_reload() {
    let sim = start_sim("sim-model").await;
    let (dir, file, base_toml) = watched_config(
        &sim,
        "agentgate-background-reload",
        &format!(
            "{STILL}[server]\nreload_interval_ms = 20\n[background]\nmax_concurrent = 1\n{BANDS}"
        ),
    );
    let with_batch = team(
        "alpha",
        "default_band = \"interactive\"\nbands = [\"batch\"]",
    );
    let gw = start_watching(&file, &format!("{base_toml}{with_batch}")).await;
    let base = gw.base_url();
    saturate(&gw, true);
    let mut body = hello();
    body["background"] = json!(true);
    let mut ids = Vec::new();
    for _ in 0..2 {
        let queued = call(&base, Some("alpha"), body.clone(), &[]).await;
        assert_eq!(queued.status, 200, "{}", queued.body);
        ids.push(queued.body["id"].as_str().unwrap().to_string());
    }
    // The first holds the run slot, queued in `batch`; the second waits for the slot.
    eventually("the first waits in its band", || queued(&gw, "batch") == 1).await;

    // The team loses `batch`: both run in the band that is now its lowest.
    write_atomically(
        &file,
        &format!(
            "{base_toml}{}",
            team("alpha", "default_band = \"interactive\"")
        ),
    );
    let reloads = |result: &str| gw.state().metrics.config_reloads.get([result]);
    eventually("the file is reloaded", || reloads("ok") == 1).await;
    saturate(&gw, false);
    for id in &ids {
        let status = final_status(&base, "alpha", id).await;
        assert!(
            status == "completed" || status == "incomplete",
            "{id}: {status}"
        );
    }
    assert_eq!(snapshot(&gw).band("interactive").unwrap().dispatched, 2);
    eventually("every permit is released", || snapshot(&gw).in_flight == 0).await;
    gw.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_would_open_a_keyed_gateway_is_refused() {
    let sim = start_sim("sim-model").await;
    let (dir, file, base_toml) = watched_config(
        &sim,
        "agentgate-open-reload",
        "[server]\nreload_interval_ms = 20\n",
    );
    let gw = start_watching(&file, &format!("{base_toml}{}", team("alpha", ""))).await;
    let base = gw.base_url();
    // The team is still there, its key lost in the edit.
    write_atomically(&file, &format!("{base_toml}[[teams]]\nname = \"alpha\"\n"));
    let reloads = |result: &str| gw.state().metrics.config_reloads.get([result]);
    eventually("the edit is refused", || reloads("error") == 1).await;
    assert_eq!(reloads("ok"), 0);
    assert_eq!(call(&base, None, hello(), &[]).await.status, 401);
    assert_eq!(call(&base, Some("alpha"), hello(), &[]).await.status, 200);
    gw.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_sections_it_cannot_apply_says_so() {
    let sim = start_sim("sim-model").await;
    let (dir, file, base_toml) = watched_config(
        &sim,
        "agentgate-restart-sections",
        "[server]\nreload_interval_ms = 20\n",
    );
    let alpha = team("alpha", "");
    let gw = start_watching(&file, &format!("{base_toml}{alpha}")).await;
    let reloads = |result: &str| gw.state().metrics.config_reloads.get([result]);
    // A new team and a second endpoint in the pool: the team applies, the pool waits for a
    // restart, and the reload says so instead of passing for a full one.
    let other = start_sim("sim-model").await;
    let two_endpoints = config_toml(
        &[sim.base_url(), other.base_url()],
        None,
        "[server]\nreload_interval_ms = 20\n",
    );
    write_atomically(
        &file,
        &format!("{two_endpoints}{alpha}{}", team("beta", "")),
    );
    eventually("the edit is applied", || reloads("restart_needed") == 1).await;
    assert_eq!(reloads("ok"), 0);
    let answer = call(&gw.base_url(), Some("beta"), hello(), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    // Still not what runs: said again at the next edit.
    write_atomically(&file, &format!("{two_endpoints}{alpha}"));
    eventually("the next edit is applied", || {
        reloads("restart_needed") == 2
    })
    .await;
    // The pool as it runs again: a full reload.
    write_atomically(&file, &format!("{base_toml}{alpha}"));
    eventually("the file matches what runs", || reloads("ok") == 1).await;
    assert_eq!(reloads("restart_needed"), 2);
    gw.shutdown().await;
    sim.shutdown().await;
    other.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_edit_made_while_the_gateway_starts_is_applied() {
    let sim = start_sim("sim-model").await;
    let (dir, file, base_toml) = watched_config(
        &sim,
        "agentgate-early-edit",
        "[server]\nreload_interval_ms = 20\n",
    );
    let alpha = team("alpha", "");
    write_atomically(&file, &format!("{base_toml}{alpha}"));
    let config = agentgate::Config::load(&file).expect("valid config");
    // Edited after it was read, before the gateway is up.
    write_atomically(&file, &format!("{base_toml}{alpha}{}", team("beta", "")));
    let gw = Gateway::start(config, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("gateway starts");
    let reloads = |result: &str| gw.state().metrics.config_reloads.get([result]);
    eventually("the edit is applied", || reloads("ok") == 1).await;
    let answer = call(&gw.base_url(), Some("beta"), hello(), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    gw.shutdown().await;
    sim.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_fall_back_to_each_gateway_when_the_store_is_down() {
    let mut redis = TestRedis::start_private();
    let prefix = unique_prefix("flow_fail_open");
    let extra = format!("{STILL}{}", team("limited", "requests_per_minute = 1"));
    let fleet = Fleet::of(1)
        .store(redis.url(), &prefix)
        .extra(&extra)
        .start()
        .await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let first = call(&base, Some("limited"), hello(), &[]).await;
    assert_eq!(first.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(call(&base, Some("limited"), hello(), &[]).await.status, 429);
    // The store is gone: the gateway keeps the limits itself, from a full budget, rather than
    // refusing requests or admitting them without limits.
    redis.stop();
    let mut body = hello();
    body["store"] = json!(false);
    let admitted = call(&base, Some("limited"), body.clone(), &[]).await;
    assert_eq!(admitted.status, 200, "{}", admitted.body);
    assert_eq!(admitted.header("x-ratelimit-remaining-requests"), Some("0"));
    assert!(gw.state().metrics.rate_limit_store_errors.get([]) >= 1);
    let refused = call(&base, Some("limited"), body, &[]).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    fleet.shutdown().await;
}

/// Start `n` simulated vLLM replicas with the given scheduling policy, no simulated delays.
async fn start_sims(
    n: usize,
    policy: agentgate_sim::config::SchedulingPolicyArg,
) -> Vec<agentgate_sim::SimHandle> {
    let mut sims = Vec::new();
    for _ in 0..n {
        let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "sim-model".into(),
            time_scale: 0.0,
            scheduling_policy: policy,
            ..Default::default()
        })
        .await
        .expect("simulator starts");
        sims.push(sim);
    }
    sims
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_keeps_a_free_replica_for_the_higher_band() {
    use agentgate_sim::config::SchedulingPolicyArg;
    let sims = start_sims(4, SchedulingPolicyArg::Priority).await;
    // 4 replicas x 1 slot; a quarter held for interactive: batch may run 3
    let bands = BANDS.replace("priority = 10\n", "priority = 10\nreserve = 0.25\n");
    let extra = format!(
        "engine_priority = true\n{STILL}[flow]\nmax_in_flight_per_endpoint = 1\n{bands}{}",
        chat_and_bulk(),
    );
    let fleet = Fleet::over(sims).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    for sim in fleet.sims() {
        stall(sim).await;
    }
    // the first batch job's prompt is the one the interactive request will send: the prefix
    // index then pulls the interactive request towards that job's (busy) replica
    let shared: String = (0..3000).map(|i| format!("w{} ", i % 97)).collect();
    let body = |input: &str| json!({"model": "sim-model", "input": input, "max_output_tokens": 16});
    // A request counts on its replica once routing has placed it (a permit counts at once).
    // The first job is placed before the others are sent, which then route at the same time:
    // each placement sees the ones before it, so no two share a replica.
    let pool = fleet.pool();
    let placed = || -> u64 {
        pool.endpoints()
            .iter()
            .map(|e| e.in_flight_requests())
            .sum()
    };
    let mut batch = vec![spawn_call(&base, Some("bulk"), body(&shared), &[])];
    eventually("the first batch job runs", || placed() == 1).await;
    for i in 1..4 {
        batch.push(spawn_call(
            &base,
            Some("bulk"),
            body(&format!("job {i}")),
            &[],
        ));
    }
    eventually("three batch requests run and one waits", || {
        snapshot(gw).in_flight == 3 && queued(gw, "batch") == 1 && placed() == 3
    })
    .await;
    // the interactive request finds the one free slot at once, on the replica without a batch
    // job, although its prompt is cached where the first job runs
    let chat = spawn_call(&base, Some("chat"), body(&shared), &[]);
    eventually("the interactive request runs", || {
        snapshot(gw).band("interactive").unwrap().dispatched == 1
    })
    .await;
    eventually("every replica runs exactly one request", || {
        pool.endpoints().iter().all(|e| e.in_flight_requests() == 1)
    })
    .await;
    assert_eq!(
        queued(gw, "batch"),
        1,
        "batch still leaves the reserve free"
    );
    chat.abort();
    for call in batch {
        call.abort();
    }
    fleet.shutdown_gateways().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn band_priorities_reach_the_engines_when_the_pool_forwards_them() {
    use agentgate_sim::config::SchedulingPolicyArg;
    let extra = |forward: bool| {
        format!(
            "engine_priority = {forward}\n{STILL}{BANDS}{}",
            team("chat", "default_band = \"interactive\""),
        )
    };
    // A vLLM engine without priority scheduling refuses a non-zero priority and names it: the
    // interactive band (priority 10) arrives as -10 (vLLM runs lower values first).
    let fcfs = start_sims(1, SchedulingPolicyArg::Fcfs).await;
    let gw = start_gateway(&config_toml(&[fcfs[0].base_url()], None, &extra(true))).await;
    let answer = call(&gw.base_url(), Some("chat"), hello(), &[]).await;
    assert_ne!(answer.status, 200);
    let message = answer.body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("priority -10"), "{}", answer.body);
    gw.shutdown().await;
    // Not forwarded: the same engine serves it.
    let gw = start_gateway(&config_toml(&[fcfs[0].base_url()], None, &extra(false))).await;
    let answer = call(&gw.base_url(), Some("chat"), hello(), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    gw.shutdown().await;
    // Forwarded to an engine with priority scheduling: served.
    let priority = start_sims(1, SchedulingPolicyArg::Priority).await;
    let gw = start_gateway(&config_toml(&[priority[0].base_url()], None, &extra(true))).await;
    let answer = call(&gw.base_url(), Some("chat"), hello(), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_turn_waits_for_its_replica_while_other_teams_go_ahead() {
    // 2 replicas x 1 slot; a held turn moves after 3 s
    let extra = format!(
        "{STILL}[flow]\nmax_in_flight_per_endpoint = 1\npin_wait_s = 3\n{BANDS}{}{}",
        team("bulk", "default_band = \"batch\""),
        team("crew", "default_band = \"batch\""),
    );
    let fleet = Fleet::of(2).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let session = [("x-session-id", "agent-1")];
    let first = call(&base, Some("bulk"), hello(), &session).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let home = first
        .header(agentgate::responses::ENDPOINT_HEADER)
        .unwrap()
        .to_string();
    let id = first.body["id"].as_str().unwrap().to_string();
    let next = |input: &str| {
        json!({"model": "sim-model", "input": input, "previous_response_id": id,
               "max_output_tokens": 16})
    };
    let pool = fleet.pool();
    let in_flight_on = |name: &str| {
        pool.endpoints()
            .iter()
            .find(|e| e.name == name)
            .map_or(0, |e| e.in_flight_requests())
    };
    let home_url = pool
        .endpoints()
        .iter()
        .find(|e| e.name == home)
        .map(|e| e.base_url.clone())
        .unwrap();
    let home_sim = fleet.sims().iter().find(|s| s.base_url() == home_url);
    stall(home_sim.expect("the replica behind the endpoint")).await;
    // A sub-agent turn of the session fills its replica's one slot.
    let busy = spawn_call(&base, Some("bulk"), next("look at a.rs"), &session);
    eventually("the session's replica is busy", || in_flight_on(&home) == 1).await;
    // The session's next turn waits in the gateway for its replica, not in that engine...
    let held = spawn_call(&base, Some("bulk"), next("now b.rs"), &session);
    eventually("the turn is held", || queued(gw, "batch") == 1).await;
    // ...while another team's new session arriving after it is served at once by the other
    // replica.
    let other = call(&base, Some("crew"), hello(), &[("x-session-id", "crew-1")]).await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert_ne!(
        other.header(agentgate::responses::ENDPOINT_HEADER),
        Some(home.as_str())
    );
    assert_eq!(queued(gw, "batch"), 1, "the pinned turn still waits");
    assert_eq!(in_flight_on(&home), 1);
    // A new session of the same team does not overtake the held turn: turn-first order holds
    // while the turn waits for its replica.
    let fresh = json!({"model": "sim-model", "input": "start over", "max_output_tokens": 16});
    let fresh = spawn_call(&base, Some("bulk"), fresh, &[("x-session-id", "agent-2")]);
    eventually("the new session waits behind the turn", || {
        queued(gw, "batch") == 2
    })
    .await;
    // Its replica still full after pin_wait_s, it moves to the free one (and is served there).
    let held = held.await.unwrap();
    assert_eq!(held.status, 200, "{}", held.body);
    assert_ne!(
        held.header(agentgate::responses::ENDPOINT_HEADER),
        Some(home.as_str())
    );
    assert!(
        held.header(agentgate::flow::QUEUE_WAIT_HEADER)
            .and_then(|ms| ms.parse::<u64>().ok())
            .is_some_and(|ms| ms >= 3000),
        "it waited pin_wait_s first: {:?}",
        held.headers
    );
    let fresh = fresh.await.unwrap();
    assert_eq!(fresh.status, 200, "{}", fresh.body);
    busy.abort();
    fleet.shutdown_gateways().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_band_below_a_reserve_leaves_prefill_room_for_the_band_above() {
    // 1 replica x 4 slots, a quarter held for interactive: batch may run 3, of which at most
    // `limit` still waiting for a first token (0: no such limit)
    let bands = BANDS.replace("priority = 10\n", "priority = 10\nreserve = 0.25\n");
    for limit in [1, 0] {
        let extra = format!(
            "{STILL}[flow]\nmax_in_flight_per_endpoint = 4\nmax_prefilling_per_endpoint = {limit}\n{bands}{}",
            chat_and_bulk(),
        );
        let fleet = Fleet::of(1).extra(&extra).start().await;
        let gw = fleet.gateway();
        let base = fleet.base_url();
        // Nothing gets its first token: every request stays prefilling.
        stall(&fleet.sims()[0]).await;
        let first = spawn_call(&base, Some("bulk"), hello(), &[]);
        // Admitted, and placed on the replica (it counts as prefilling there from then on).
        let endpoint = fleet.pool().endpoints()[0].clone();
        eventually("the first batch request runs", || {
            snapshot(gw).in_flight == 1 && endpoint.prefilling_requests() == 1
        })
        .await;
        let second = spawn_call(&base, Some("bulk"), hello(), &[]);
        if limit == 1 {
            eventually("the second waits", || queued(gw, "batch") == 1).await;
        } else {
            eventually("the second runs", || snapshot(gw).in_flight == 2).await;
        }
        // The interactive band is not held by it.
        let chat = spawn_call(&base, Some("chat"), hello(), &[]);
        eventually("the interactive request runs", || {
            snapshot(gw).band("interactive").unwrap().dispatched == 1
        })
        .await;
        let expected = if limit == 1 { (2, 1) } else { (3, 0) };
        let s = snapshot(gw);
        assert_eq!(
            (s.in_flight, queued(gw, "batch")),
            expected,
            "limit {limit}"
        );
        for call in [first, second, chat] {
            call.abort();
        }
        fleet.shutdown_gateways().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sessions_of_a_band_with_a_reserve_spread_over_the_replicas() {
    // Chat sessions one after another, sharing a long system prompt: placed by prefix alone
    // they all follow the first to the replica that cached the prompt; in a band with a
    // reserve they spread, so each replica's reserve holds its share of them.
    let instructions = "You are a helpful assistant for the support desk. ".repeat(80);
    for reserve in [true, false] {
        let bands = if reserve {
            BANDS.replace("priority = 10\n", "priority = 10\nreserve = 0.25\n")
        } else {
            BANDS.to_string()
        };
        let extra = format!("{STILL}{bands}{}", chat_and_bulk());
        let fleet = Fleet::of(2).extra(&extra).start().await;
        let base = fleet.base_url();
        let mut per_replica = std::collections::BTreeMap::<String, usize>::new();
        for session in 0..8 {
            let body = json!({
                "model": "sim-model",
                "instructions": instructions,
                "input": format!("question {session}"),
                "max_output_tokens": 16,
            });
            let id = format!("chat-{session}");
            let answer = call(&base, Some("chat"), body, &[("x-session-id", id.as_str())]).await;
            assert_eq!(answer.status, 200, "{:?}", answer.body);
            let endpoint = answer
                .header(agentgate::responses::ENDPOINT_HEADER)
                .expect("endpoint header")
                .to_string();
            *per_replica.entry(endpoint).or_default() += 1;
        }
        let fewest = if per_replica.len() < 2 {
            0
        } else {
            per_replica.values().copied().min().unwrap_or(0)
        };
        if reserve {
            assert!(fewest >= 3, "spread: {per_replica:?}");
        } else {
            assert_eq!(fewest, 0, "by prefix, all on one replica: {per_replica:?}");
        }
        fleet.shutdown_gateways().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_kv_working_set_is_full_takes_the_next_session_once_it_drains() {
    // Metrics are not scraped here: the test sets the KV capacity the engine would report.
    let extra = format!("{STILL}[flow]\nmax_kv_working_set = 0.5\n");
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let gw = fleet.gateway();
    let base = fleet.base_url();
    let endpoint = fleet.pool().endpoints()[0].clone();
    endpoint.set_kv_capacity_tokens(4_000);
    // The first request holds its first token back until the faults are cleared; what follows
    // happens meanwhile.
    set_sim_fault(fleet.sim(), json!({"stall_ms": 60_000})).await;
    // About 3,000 tokens of prompt: more than half the replica's KV.
    let long = json!({
        "model": "sim-model",
        "input": "all work and no play makes a dull agent ".repeat(300),
        "max_output_tokens": 16,
    });
    let first = spawn_call(&base, None, long, &[("x-session-id", "first")]);
    eventually("the first prompt counts in the working set", || {
        endpoint.working_set_tokens() >= 2_000
    })
    .await;
    let second = spawn_call(&base, None, hello(), &[("x-session-id", "second")]);
    eventually("the next session waits in the gateway", || {
        queued(gw, "default") == 1
    })
    .await;
    assert_eq!(endpoint.in_flight_requests(), 1);
    let metrics = metrics_text(&base).await;
    let gauge = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(
        gauge("agentgate_endpoint_kv_capacity_tokens"),
        Some(4_000.0)
    );
    assert!(gauge("agentgate_endpoint_kv_working_set_tokens").is_some_and(|t| t >= 2_000.0));
    // The first request ends: the working set drains and the second goes.
    clear_sim_faults(fleet.sim()).await;
    assert_eq!(first.await.expect("first call").status, 200);
    let answer = second.await.expect("second call");
    assert_eq!(answer.status, 200, "{}", answer.body);
    let waited: f64 = answer
        .header(agentgate::flow::QUEUE_WAIT_HEADER)
        .and_then(|v| v.parse().ok())
        .expect("queue wait header");
    assert!(waited > 0.0, "it waited in the gateway: {waited}");
    eventually("nothing is left in the working set", || {
        endpoint.working_set_tokens() == 0
    })
    .await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_exchange_their_working_sets_and_sessions() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("flow_exchange");
    let fleet = Fleet::of(1)
        .store(redis.url(), &prefix)
        .extra(&exchange_every_200_ms())
        .gateways(2)
        .start()
        .await;
    exchange_working_sets_and_sessions(fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_handed_one_memory_store_exchange_as_over_redis() {
    let fleet = Fleet::of(1)
        .shared_memory()
        .extra(&exchange_every_200_ms())
        .gateways(2)
        .start()
        .await;
    exchange_working_sets_and_sessions(fleet).await;
}

/// Two gateways of `fleet` (policy `prefix`, two engines) share one store: a prompt the first
/// routed is found by the second's prefix index, which sends the next prompt sharing it to
/// the same engine for its prefix, though it never routed it itself.
async fn share_routing_decisions(fleet: Fleet) {
    let (a, b) = (&fleet.gateways()[0], &fleet.gateways()[1]);
    let shared = "You are a careful coding agent working in a large repository. ".repeat(120);
    let prompt = |tail: &str| json!({"model": "sim-model", "input": format!("{shared}{tail}"), "max_output_tokens": 16});
    let first = call(&a.base_url(), None, prompt("first question"), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let endpoint = first.header("x-agentgate-endpoint").unwrap().to_string();
    let received = || async {
        let text = metrics_text(&b.base_url()).await;
        has_line(
            &text,
            "agentgate_prefix_routes_shared_total{pool=\"sim\",direction=\"received\"} 1",
        )
    };
    eventually_async("b received a's route", received).await;
    let on_a = metrics_text(&a.base_url()).await;
    assert!(
        has_line(
            &on_a,
            "agentgate_prefix_routes_shared_total{pool=\"sim\",direction=\"sent\"} 1"
        ),
        "a counts what it sent, and receives nothing of its own back: {on_a}"
    );
    assert_eq!(
        metric_sum(
            &on_a
                .lines()
                .filter(|l| l.contains("direction=\"received\""))
                .collect::<Vec<_>>()
                .join("\n"),
            "agentgate_prefix_routes_shared_total"
        ),
        0.0,
        "{on_a}"
    );
    let second = call(&b.base_url(), None, prompt("second question"), &[]).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        (
            second.header("x-agentgate-endpoint"),
            second.header("x-agentgate-route-reason")
        ),
        (Some(endpoint.as_str()), Some("prefix")),
        "b places the prompt where a sent its prefix"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_share_their_routing_decisions() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("route_feed");
    let fleet = Fleet::of(2)
        .policy("prefix")
        .store(redis.url(), &prefix)
        .extra(&exchange_every_200_ms())
        .gateways(2)
        .start()
        .await;
    share_routing_decisions(fleet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_handed_one_memory_store_share_their_routing_decisions() {
    let fleet = Fleet::of(2)
        .policy("prefix")
        .shared_memory()
        .extra(&exchange_every_200_ms())
        .gateways(2)
        .start()
        .await;
    share_routing_decisions(fleet).await;
}

/// Gateways whose configs list the same engines in another order (as during a rolling config
/// change; configured endpoints are named by their position) still exchange about the same
/// engines: the board names endpoints by their engine's URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_listing_the_engines_in_another_order_exchange_about_the_same_engines() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("flow_exchange_order");
    let sims = [start_sim("sim-model").await, start_sim("sim-model").await];
    let urls: Vec<String> = sims.iter().map(|s| s.base_url()).collect();
    let reversed: Vec<String> = urls.iter().rev().cloned().collect();
    let extra = exchange_every_200_ms();
    let a = start_gateway(&config_toml(&urls, Some((redis.url(), &prefix)), &extra)).await;
    let b = start_gateway(&config_toml(
        &reversed,
        Some((redis.url(), &prefix)),
        &extra,
    ))
    .await;
    let endpoints = |gw: &Gateway| {
        gw.state()
            .pools
            .for_model("sim-model")
            .unwrap()
            .endpoints()
            .to_vec()
    };
    for sim in &sims {
        // (Held until the faults are cleared.)
        set_sim_fault(sim, json!({"stall_ms": 60_000})).await;
    }
    let mut long = hello();
    long["input"] = json!("tell me about the weather in spring ".repeat(300));
    let held = spawn_call(&a.base_url(), None, long, &[("x-session-id", "ordered")]);
    eventually("a counts the turn's prompt", || {
        endpoints(&a).iter().any(|e| e.working_set_tokens() > 0)
    })
    .await;
    let busy = endpoints(&a)
        .into_iter()
        .find(|e| e.working_set_tokens() > 0)
        .unwrap();
    let working_set = busy.working_set_tokens();
    eventually("b counts it on the same engine, and only there", || {
        endpoints(&b).iter().all(|e| {
            e.peer_working_set_tokens()
                == if e.base_url == busy.base_url {
                    working_set
                } else {
                    0
                }
        })
    })
    .await;
    let same_engine_on_b = endpoints(&b)
        .into_iter()
        .find(|e| e.base_url == busy.base_url)
        .unwrap();
    assert_ne!(same_engine_on_b.name, busy.name, "named apart by position");
    for sim in &sims {
        clear_sim_faults(sim).await;
    }
    assert_eq!(held.await.unwrap().status, 200);
    a.shutdown().await;
    b.shutdown().await;
}

fn exchange_every_200_ms() -> String {
    format!("{STILL}[flow]\nexchange_interval_ms = 200\n")
}

/// Two gateways of `fleet` share one store: a turn in flight on the first shows up as the
/// second's peer working set and in its `/metrics`, the session counts as continuing on the
/// second, and the working set is forgotten when the turn ends.
async fn exchange_working_sets_and_sessions(fleet: Fleet) {
    let (a, b) = (&fleet.gateways()[0], &fleet.gateways()[1]);
    let endpoint =
        |gw: &Gateway| gw.state().pools.for_model("sim-model").unwrap().endpoints()[0].clone();
    let (on_a, on_b) = (endpoint(a), endpoint(b));
    // A turn held in flight on gateway a until the faults are cleared.
    set_sim_fault(fleet.sim(), json!({"stall_ms": 60_000})).await;
    let session = [("x-session-id", "exchanged-session")];
    // A prompt of several prefix-index chunks (a chunk that is not full is not counted).
    let mut long = hello();
    long["input"] = json!("tell me about the weather in spring ".repeat(300));
    let held = spawn_call(&a.base_url(), None, long, &session);
    eventually("a counts the turn's prompt", || {
        on_a.working_set_tokens() > 0
    })
    .await;
    let working_set = on_a.working_set_tokens();
    eventually("b learns a's working set", || {
        on_b.peer_working_set_tokens() == working_set
    })
    .await;
    assert_eq!(on_a.peer_working_set_tokens(), 0, "b has nothing in flight");
    let metrics = reqwest::get(format!("{}/metrics", b.base_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(&format!(
            "agentgate_endpoint_peer_kv_working_set_tokens{{pool=\"sim\",endpoint=\"{}\"}} {working_set}",
            on_b.name
        )),
        "{metrics}"
    );
    // The session ran on a: its next turn is a continuing one on b, though b never saw it.
    clear_sim_faults(fleet.sim()).await;
    let next = call(&b.base_url(), None, hello(), &session).await;
    assert_eq!(next.status, 200, "{}", next.body);
    let turns = snapshot(b).turns;
    assert_eq!(
        (turns.continuing.count(), turns.new.count()),
        (1, 0),
        "b knows the session from a"
    );
    // a's turn ends: b stops counting it.
    let done = held.await.unwrap();
    assert_eq!(done.status, 200, "{}", done.body);
    eventually("a's turn is released", || on_a.working_set_tokens() == 0).await;
    eventually("b forgets it", || on_b.peer_working_set_tokens() == 0).await;
    fleet.shutdown_gateways().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_gets_a_refusal_in_its_stream_where_it_retries_it() {
    // Codex takes an HTTP 429 for final; a stream that fails with `rate_limit_exceeded` it
    // retries after the delay the message names.
    let extra = format!("{STILL}{}", team("limited", "requests_per_minute = 1"));
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let base = fleet.base_url();
    let first = call(&base, Some("limited"), hello(), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let mut streamed = hello();
    streamed["stream"] = json!(true);
    let send = |originator: Option<&'static str>| {
        let mut req = reqwest::Client::new()
            .post(format!("{base}/v1/responses"))
            .bearer_auth(key("limited"))
            .json(&streamed);
        if let Some(o) = originator {
            req = req.header("originator", o);
        }
        req.send()
    };
    let resp = send(Some("codex_exec")).await.unwrap();
    if resp.status() != 200 {
        panic!("{}: {}", resp.status(), resp.text().await.unwrap());
    }
    assert_eq!(resp.headers()["x-ratelimit-remaining-requests"], "0");
    let events = read_sse(resp).await;
    let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.failed"
        ]
    );
    let error = &events[2].data["response"]["error"];
    assert_eq!(error["code"], "rate_limit_exceeded");
    let message = error["message"].as_str().unwrap();
    let secs: u64 = message
        .rsplit_once("try again in ")
        .and_then(|(_, rest)| rest.strip_suffix("s."))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no delay in {message:?}"));
    assert!((1..=60).contains(&secs), "{message}");
    // Nothing was stored under the refused response's id.
    let id = events[0].data["response"]["id"].as_str().unwrap();
    let stored = reqwest::Client::new()
        .get(format!("{base}/v1/responses/{id}"))
        .bearer_auth(key("limited"))
        .send()
        .await
        .unwrap();
    assert_eq!(stored.status(), 404);
    // Any other client gets the HTTP 429 with Retry-After.
    let other = send(None).await.unwrap();
    assert_eq!(other.status(), 429);
    assert!(other.headers().get("retry-after").is_some());
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counting_input_tokens_spends_the_teams_request_budget() {
    // It generates nothing but has an engine tokenize the prompt: a request like any other for
    // requests per minute (no tokens charged).
    let extra = format!(
        "{STILL}{}",
        team(
            "limited",
            "requests_per_minute = 2\ntokens_per_minute = 100"
        )
    );
    let fleet = Fleet::of(1).extra(&extra).start().await;
    let count = || async {
        reqwest::Client::new()
            .post(format!("{}/v1/responses/input_tokens", fleet.base_url()))
            .bearer_auth(key("limited"))
            .json(&json!({"model": "sim-model", "input": "count these words ".repeat(200)}))
            .send()
            .await
            .unwrap()
    };
    let first = count().await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-ratelimit-remaining-requests"], "1");
    assert!(
        first.json::<Value>().await.unwrap()["input_tokens"]
            .as_u64()
            .unwrap()
            > 100
    );
    assert_eq!(count().await.status(), 200);
    let refused = count().await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().get("retry-after").is_some());
    fleet.shutdown().await;
}
