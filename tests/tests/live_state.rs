//! End-to-end: live endpoint state over real simulated replicas. A replica whose `/health`
//! fails, or that serves another model, is taken out and returns when it recovers; an endpoints file adds and removes
//! replicas at run time without cutting a request in flight; `/metrics` shows both.

use std::sync::Arc;

use serde_json::{json, Value};

use agentgate::pools::{Endpoint, Pool};
use agentgate_sessions::Store;
use agentgate_tests::*;

fn endpoint(pool: &Pool, name: &str) -> Option<Arc<Endpoint>> {
    pool.endpoints().iter().find(|e| e.name == name).cloned()
}

/// One short non-streaming turn: (status, the endpoint that served it).
async fn turn(base: &str) -> (u16, String) {
    let resp = post_response(
        base,
        &json!({"model": "sim-model", "input": "hello", "max_output_tokens": 16}),
    )
    .await;
    let status = resp.status().as_u16();
    let served = served_endpoint(&resp);
    let _: Value = resp.json().await.expect("json body");
    (status, served)
}

/// `GET /metrics`, checking its status and the Prometheus text content type.
async fn scrape_metrics(base: &str) -> String {
    let resp = reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics");
    assert_eq!(resp.status().as_u16(), 200);
    let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    resp.text().await.unwrap()
}

const FAST_PROBES: &str = "[routing]\nhealth_interval_ms = 50\nscrape_interval_ms = 50\n\
    unhealthy_after = 2\nhealthy_after = 1\ndiscovery_interval_ms = 50\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_replica_is_taken_out_and_returns_when_it_recovers() {
    let fleet = Fleet::of(3)
        .extra(&format!("policy = \"round_robin\"\n{FAST_PROBES}"))
        .start()
        .await;
    let sims = fleet.sims();
    let base = fleet.base_url();
    let pool = fleet.pool();
    let sick = endpoint(&pool, "sim/1").unwrap();
    eventually("every endpoint has a load report", || {
        pool.endpoints().iter().all(|e| e.load_report().is_some())
    })
    .await;

    set_sim_fault(&sims[1], json!({"unhealthy": true})).await;
    eventually("sim/1 is taken out", || !sick.is_available()).await;
    assert!(!sick.is_healthy() && !sick.is_retired());
    for _ in 0..9 {
        let (status, served) = turn(&base).await;
        assert_eq!(status, 200);
        assert!(
            served == "sim/0" || served == "sim/2",
            "served by {served:?} while sim/1 is unhealthy"
        );
    }
    let m = scrape_metrics(&base).await;
    for line in [
        "agentgate_endpoint_healthy{pool=\"sim\",endpoint=\"sim/1\"} 0",
        "agentgate_endpoint_healthy{pool=\"sim\",endpoint=\"sim/0\"} 1",
        "agentgate_pool_available_endpoints{pool=\"sim\"} 2",
        "agentgate_endpoint_health_transitions_total{pool=\"sim\",endpoint=\"sim/1\",state=\"unhealthy\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} missing in\n{m}");
    }
    let ready = reqwest::get(format!("{base}/health/ready")).await.unwrap();
    assert_eq!(ready.status().as_u16(), 200, "two replicas still serve");

    clear_sim_faults(&sims[1]).await;
    eventually("sim/1 returns", || sick.is_available()).await;
    let mut served_by_sick = false;
    for _ in 0..6 {
        let (status, served) = turn(&base).await;
        assert_eq!(status, 200);
        served_by_sick |= served == "sim/1";
    }
    assert!(served_by_sick, "round robin reaches the recovered replica");

    // Every replica down: not ready, and requests are refused rather than sent to them.
    for sim in sims {
        set_sim_fault(sim, json!({"unhealthy": true})).await;
    }
    eventually("every endpoint is taken out", || {
        pool.endpoints().iter().all(|e| !e.is_available())
    })
    .await;
    let ready = reqwest::get(format!("{base}/health/ready")).await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    assert_eq!(turn(&base).await.0, 503);

    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_serving_another_model_is_taken_out() {
    // Healthy by its own account, but every request for the pool's model would get 404.
    let sims = vec![start_sim("sim-model").await, start_sim("other-model").await];
    let fleet = Fleet::over(sims)
        .extra(&format!("policy = \"round_robin\"\n{FAST_PROBES}"))
        .start()
        .await;
    let pool = fleet.pool();
    let wrong = endpoint(&pool, "sim/1").unwrap();
    eventually("sim/1 is taken out", || !wrong.is_available()).await;
    assert!(endpoint(&pool, "sim/0").unwrap().is_available());
    for _ in 0..4 {
        assert_eq!(turn(&fleet.base_url()).await, (200, "sim/0".to_string()));
    }
    fleet.shutdown().await;
}

/// The prefix index forgets what an engine held when the engine restarts (its counters start
/// over), not when it merely failed its probes for a while (too busy to answer them): its
/// cache is intact then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_back_from_a_restart_is_indexed_as_holding_nothing() {
    let mut fleet = Fleet::of(2).extra(FAST_PROBES).start().await;
    let base = fleet.base_url();
    let pool = fleet.pool();
    let resp = post_response(
        &base,
        &json!({"model": "sim-model", "input": "a long prompt to index ".repeat(200),
                "max_output_tokens": 16}),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 200);
    let served = endpoint(&pool, &served_endpoint(&resp)).unwrap();
    let index = pool
        .picker
        .prefix_index()
        .expect("policy session keeps an index");
    assert!(index.held_chunks(served.slot) > 0);

    let held = index.held_chunks(served.slot);

    // It fails its probes and comes back, the same engine: the index still holds its cache.
    let i = served
        .name
        .trim_start_matches("sim/")
        .parse::<usize>()
        .unwrap();
    set_sim_fault(&fleet.sims()[i], json!({"unhealthy": true})).await;
    eventually("the replica is taken out", || !served.is_available()).await;
    clear_sim_faults(&fleet.sims()[i]).await;
    eventually("the replica returns", || served.is_available()).await;
    // Two whole scrape rounds after its return, which would tell a restart.
    let metrics = &fleet.gateway().state().metrics;
    let scrapes = metrics.probe_duration.count(["sim", "metrics"]);
    eventually("two more scrape rounds", || {
        metrics.probe_duration.count(["sim", "metrics"]) >= scrapes + 6
    })
    .await;
    assert_eq!(index.held_chunks(served.slot), held);

    // It restarts: its cache is gone, and the index forgets it too.
    fleet.restart_sim(i).await;
    eventually("the index forgets the restarted engine's cache", || {
        index.held_chunks(served.slot) == 0
    })
    .await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_file_adds_and_retires_replicas_without_cutting_requests() {
    let fixed = start_sim("sim-model").await;
    let extra = start_sim("sim-model").await;
    let dir = std::env::temp_dir().join(unique_prefix("agentgate-live-state").replace(':', "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("endpoints.yaml");
    write_atomically(&file, "endpoints: []\n");
    let gw = start_gateway(&config_toml(
        &[fixed.base_url()],
        None,
        &format!(
            "policy = \"round_robin\"\nendpoints_file = \"{}\"\n{FAST_PROBES}",
            file.display()
        ),
    ))
    .await;
    let base = gw.base_url();
    let pool = gw.state().pools.for_model("sim-model").unwrap();
    assert_eq!(pool.endpoints().len(), 1);

    // Added: the new replica gets the next slot and takes traffic.
    let port = extra.addr().port();
    write_atomically(
        &file,
        &format!(
            "endpoints:\n  - name: file-b\n    address: 127.0.0.1\n    port: {port}\n    labels:\n      zone: b\n"
        ),
    );
    eventually("file-b is added", || endpoint(&pool, "file-b").is_some()).await;
    let b = endpoint(&pool, "file-b").unwrap();
    assert_eq!(b.slot, 1);
    assert_eq!(b.labels["zone"], "b");
    assert_eq!(b.base_url, extra.base_url());

    // A file that does not parse changes nothing.
    write_atomically(&file, "endpoints: [{name: broken\n");
    eventually("the bad file is counted", || {
        gw.state().metrics.discovery_reloads.get(["sim", "error"]) >= 1
    })
    .await;
    let still = endpoint(&pool, "file-b").expect("file-b survives a bad file");
    assert!(
        Arc::ptr_eq(&still, &b),
        "an unchanged endpoint keeps its state"
    );

    // Hold requests on file-b before their first token, and start one there.
    set_sim_fault(&extra, json!({"stall_ms": 5000})).await;
    let mut held = None;
    for _ in 0..8 {
        let task = tokio::spawn(turn_owned(base.clone()));
        eventually("the request is placed", || {
            task.is_finished() || b.in_flight_requests() > 0
        })
        .await;
        if b.in_flight_requests() > 0 {
            held = Some(task);
            break;
        }
        let (status, served) = task.await.unwrap();
        assert_eq!((status, served.as_str()), (200, "sim/0"));
    }
    let held = held.expect("round robin reaches file-b");

    // Removed while that request runs: retired at once, the request still finishes there.
    write_atomically(&file, "endpoints: []\n");
    eventually("file-b is removed", || endpoint(&pool, "file-b").is_none()).await;
    assert!(b.is_retired() && !b.is_available());
    assert_eq!(b.in_flight_requests(), 1, "the request is still running");
    for _ in 0..3 {
        assert_eq!(turn(&base).await, (200, "sim/0".to_string()));
    }
    let (status, served) = held.await.unwrap();
    assert_eq!((status, served.as_str()), (200, "file-b"));
    assert_eq!(b.in_flight_requests(), 0);

    let m = scrape_metrics(&base).await;
    assert!(
        m.contains("agentgate_pool_endpoints{pool=\"sim\"} 1\n"),
        "{m}"
    );
    assert!(
        !m.contains("endpoint=\"file-b\""),
        "a removed endpoint leaves the gauges and the event series (its routing decisions)"
    );
    assert!(
        gw.state().metrics.discovery_reloads.get(["sim", "ok"]) >= 2,
        "{m}"
    );

    // Added again: a new endpoint (fresh state), in the slot the old one freed.
    write_atomically(
        &file,
        &format!("endpoints:\n  - {{name: file-b, address: 127.0.0.1, port: {port}}}\n"),
    );
    eventually("file-b is back", || endpoint(&pool, "file-b").is_some()).await;
    let b2 = endpoint(&pool, "file-b").unwrap();
    assert!(!Arc::ptr_eq(&b, &b2));
    assert_eq!(b2.slot, 1);
    assert!(b2.is_available());

    gw.shutdown().await;
    fixed.shutdown().await;
    extra.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

async fn turn_owned(base: String) -> (u16, String) {
    turn(&base).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_capacity_is_read_from_either_engines_metrics() {
    for (flavor, name) in [
        (agentgate_sim::Flavor::Vllm, "vllm"),
        (agentgate_sim::Flavor::Sglang, "sglang"),
    ] {
        let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
            flavor,
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "sim-model".into(),
            kv_blocks: 1_000,
            block_size: 16,
            ..Default::default()
        })
        .await
        .unwrap();
        let config = format!(
            "{FAST_PROBES}[[pools]]\nname = \"p\"\nmodel = \"sim-model\"\nflavor = \"{name}\"\n\
             endpoints = [\"{}\"]\n",
            sim.base_url()
        );
        let gw = start_gateway(&config).await;
        let pool = gw.state().pools.all()[0].clone();
        let ep = pool.endpoints()[0].clone();
        eventually(&format!("{name}: the KV capacity is known"), || {
            ep.kv_capacity_tokens() == 16_000
        })
        .await;
        // The prefix index forgets past what the engine holds.
        let index = pool
            .picker
            .prefix_index()
            .expect("the session policy indexes");
        assert_eq!(
            index.capacity_chunks(ep.slot) as u64,
            16_000 / index.tokens_per_chunk(),
            "{name}"
        );
        gw.shutdown().await;
        sim.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_moved_to_an_endpoint_that_fails_before_output_moves_back() {
    let fleet = Fleet::of(2).extra(FAST_PROBES).start().await;
    let sims = fleet.sims();
    let base = fleet.base_url();
    let pool = fleet.pool();
    let session_turn = || async {
        let resp = reqwest::Client::new()
            .post(format!("{base}/v1/responses"))
            .header("x-session-id", "s-1")
            .json(&json!({"model": "sim-model", "input": "next step", "store": false, "max_output_tokens": 16}))
            .send()
            .await
            .unwrap();
        let served = served_endpoint(&resp);
        let body: Value = resp.json().await.unwrap();
        // (Done: completed, or incomplete at its output limit.)
        let done = matches!(body["status"].as_str(), Some("completed" | "incomplete"));
        (done, served)
    };
    let store = &fleet.gateway().state().store;
    let pin = || async { store.get_pin("sim", "h:s-1").await.unwrap().unwrap() };
    let (done, home) = session_turn().await;
    assert!(done);
    let (home_i, other_i) = if home == "sim/0" { (0, 1) } else { (1, 0) };
    assert_eq!((pin().await.endpoint, pin().await.moves), (home.clone(), 0));

    // The pinned replica is taken out; the other one answers, then fails every request before
    // its first token.
    set_sim_fault(&sims[home_i], json!({"unhealthy": true})).await;
    let home_ep = endpoint(&pool, &home).unwrap();
    eventually("the pinned replica is taken out", || {
        !home_ep.is_available()
    })
    .await;
    set_sim_fault(&sims[other_i], json!({"cut_after": 0})).await;
    let (done, _) = session_turn().await;
    assert!(!done);
    // The session never ran there: its pin is where it was, and no move is counted.
    let held = pin().await;
    assert_eq!((held.endpoint.as_str(), held.moves), (home.as_str(), 0));
    let moves = || {
        ["unavailable", "failed", "wait", "saturated", "outscored"]
            .iter()
            .map(|cause| {
                fleet
                    .gateway()
                    .state()
                    .metrics
                    .pin_moves
                    .get(["sim", cause])
            })
            .sum::<u64>()
    };
    assert_eq!(moves(), 0);

    // Once the other replica serves, the session moves there: one move.
    clear_sim_faults(&sims[other_i]).await;
    let (done, served) = session_turn().await;
    assert!(done);
    assert_ne!(served, home);
    let moved = pin().await;
    assert_eq!((moved.endpoint.as_str(), moved.moves), (served.as_str(), 1));
    assert_eq!(moves(), 1);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_health_check_answers_late_stays_in() {
    // SGLang's `/health` runs a one-token generation and answers a second or more later:
    // longer than a metrics scrape may take (probe_timeout_ms, 1000 by default), within
    // health_timeout_ms (5000 by default).
    let fleet = Fleet::of(2).extra(FAST_PROBES).start().await;
    let pool = fleet.pool();
    let slow = endpoint(&pool, "sim/1").unwrap();
    set_sim_fault(&fleet.sims()[1], json!({"health_stall_ms": 1200})).await;
    let metrics = &fleet.gateway().state().metrics;
    let before = metrics.probe_duration.count(["sim", "health"]);
    // Three whole health rounds with the late answers (two probes a round, and the round under
    // way when the fault was set may have missed it).
    eventually("three health rounds", || {
        metrics.probe_duration.count(["sim", "health"]) >= before + 8
    })
    .await;
    assert!(slow.is_available() && slow.is_healthy());
    assert_eq!(
        metrics.probe_failures.get(["sim", "sim/1", "health"]),
        0,
        "no health probe of sim/1 failed"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_endpoints_file_is_refused_at_start_leaves_the_others_serving() {
    let sim = start_sim("sim-model").await;
    let other = start_sim("other-model").await;
    let dir = std::env::temp_dir().join(unique_prefix("agentgate-bad-file").replace(':', "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("endpoints.yaml");
    // One engine listed twice: refused.
    let port = other.addr().port();
    write_atomically(
        &file,
        &format!(
            "endpoints:\n- {{name: a, address: 127.0.0.1, port: {port}}}\n\
             - {{name: b, address: 127.0.0.1, port: {port}}}\n"
        ),
    );
    let gw = start_gateway(&format!(
        "{}\n[[pools]]\nname = \"other\"\nmodel = \"other-model\"\nendpoints_file = \"{}\"\n",
        config_toml(&[sim.base_url()], None, FAST_PROBES),
        file.display()
    ))
    .await;
    let base = gw.base_url();
    let ready = reqwest::get(format!("{base}/health/ready")).await.unwrap();
    assert_eq!(ready.status().as_u16(), 200, "sim-model is still served");
    let body: Value = ready.json().await.unwrap();
    assert_eq!(body["pools_without_endpoints"], json!(["other"]));
    assert_eq!(turn(&base).await.0, 200);
    let refused = post_response(&base, &json!({"model": "other-model", "input": "hi"})).await;
    assert_eq!(refused.status().as_u16(), 503);

    // Fixed, the file is taken up.
    write_atomically(
        &file,
        &format!("endpoints:\n- {{name: a, address: 127.0.0.1, port: {port}}}\n"),
    );
    let pool = gw.state().pools.for_model("other-model").unwrap();
    eventually("the fixed file is read", || {
        pool.endpoints().iter().any(|e| e.is_available())
    })
    .await;
    let served = post_response(&base, &json!({"model": "other-model", "input": "hi"})).await;
    assert_eq!(served.status().as_u16(), 200);
    let body: Value = reqwest::get(format!("{base}/health/ready"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["pools_without_endpoints"], json!([]));
    gw.shutdown().await;
    std::fs::remove_dir_all(&dir).ok();
}
