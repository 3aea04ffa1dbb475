//! End-to-end: the gateway over simulated engines and a real Redis.

use serde_json::{json, Value};

use agentgate_sessions::Store;
use agentgate_tests::*;

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// POST `body` to `url`: the status and the JSON answer.
async fn post_json(url: String, body: Value) -> (u16, Value) {
    let resp = client().post(url).json(&body).send().await.unwrap();
    (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
}

async fn create(base: &str, body: Value) -> (u16, Value) {
    let resp = post_response(base, &body).await;
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("json body"))
}

/// A turn continuing a chain whose earlier response Redis evicted is refused, naming it, instead
/// of running on a history cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_with_an_evicted_response_is_refused_not_cut_short() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("evicted_link");
    let fleet = Fleet::of(1).store(redis.url(), &prefix).start().await;
    let base = fleet.base_url();
    let mut ids: Vec<String> = Vec::new();
    for turn in 0..3 {
        let mut body =
            json!({"model": "sim-model", "input": format!("turn {turn}"), "max_output_tokens": 16});
        if let Some(p) = ids.last() {
            body["previous_response_id"] = json!(p);
        }
        let (status, r) = create(&base, body).await;
        assert_eq!(status, 200, "{r}");
        ids.push(r["id"].as_str().unwrap().to_string());
    }
    assert!(redis.delete(&format!("{prefix}resp:{}", ids[1])));
    let body = json!({"model": "sim-model", "input": "and then?", "previous_response_id": ids[2]});
    let (status, e) = create(&base, body).await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["code"], "previous_response_not_found");
    assert_eq!(e["error"]["param"], "previous_response_id");
    assert!(
        e["error"]["message"].as_str().unwrap().contains(&ids[1]),
        "{e}"
    );
    // Listing what the last response was given says the same, naming no parameter.
    let listed = client()
        .get(format!("{base}/v1/responses/{}/input_items", ids[2]))
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 404);
    let e: Value = listed.json().await.unwrap();
    assert_eq!(e["error"]["code"], "previous_response_not_found", "{e}");
    assert_eq!(e["error"]["param"], Value::Null, "{e}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_turn_conversation_on_redis_costs_constant_store_round_trips() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("hundred_turns");
    // Counts the round trips of turns alone: no background exchange with other gateways.
    let fleet = Fleet::of(1)
        .store(redis.url(), &prefix)
        .extra("[flow]\nexchange_interval_ms = 0\n")
        .start()
        .await;
    let base = fleet.base_url();
    let store = &fleet.gateway().state().store;

    let mut prev: Option<String> = None;
    let mut trips = Vec::new();
    let mut last_input_tokens = 0;
    for turn in 0..100 {
        let before = store.round_trips();
        let mut body = json!({"model": "sim-model", "input": format!("turn {turn}: tell me more"), "max_output_tokens": 16});
        if let Some(p) = &prev {
            body["previous_response_id"] = json!(p);
        }
        let (status, r) = create(&base, body).await;
        assert_eq!(status, 200, "turn {turn}: {r}");
        trips.push(store.round_trips() - before);
        let input_tokens = r["usage"]["input_tokens"].as_u64().unwrap();
        assert!(
            input_tokens > last_input_tokens,
            "turn {turn}: history must grow the prompt"
        );
        last_input_tokens = input_tokens;
        prev = Some(r["id"].as_str().unwrap().to_string());
    }
    // Under the default `session` policy, turn 1 reads the (absent) session pin, pins the chain
    // under its root and writes the response; every later turn loads its history in one round
    // trip, reads the pin and writes once. Turn 2 also reads the record of the chain's root,
    // its predecessor (a response made in a conversation is not continued by its id). However
    // long the conversation, the cost stays put.
    assert_eq!(trips[0], 3, "turn 1 store round trips");
    assert_eq!(trips[1], 4, "turn 2 store round trips");
    assert!(
        trips[2..].iter().all(|&t| t == 3),
        "round trips per turn: {trips:?}"
    );
    println!(
        "store round trips: turn 1 = {}, turn 100 = {}",
        trips[0], trips[99]
    );

    // The stored chain holds every item: 100 inputs and 100 outputs.
    let items = store
        .history("default", prev.as_deref().unwrap())
        .await
        .unwrap()
        .unwrap()
        .items;
    assert_eq!(items.len(), 200);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_serve_alternate_turns_identically() {
    let redis = TestRedis::start();
    let shared = unique_prefix("two_gateways");
    let mut fleet = Fleet::of(1)
        .store(redis.url(), &shared)
        .gateways(2)
        .start()
        .await;
    let solo_prefix = unique_prefix("two_gateways_solo");
    let solo_toml = config_toml(&fleet.urls(), Some((redis.url(), &solo_prefix)), "");
    fleet.add_gateway(&solo_toml).await;
    let gateways = fleet.gateways();
    let (a, b, solo) = (&gateways[0], &gateways[1], &gateways[2]);

    let mut alt_prev: Option<String> = None;
    let mut solo_prev: Option<String> = None;
    for turn in 0..6 {
        let text = format!("question {turn} about the build");
        let gw = if turn % 2 == 0 { a } else { b };
        let mut body = json!({"model": "sim-model", "input": text, "max_output_tokens": 32});
        if let Some(p) = &alt_prev {
            body["previous_response_id"] = json!(p);
        }
        let (s1, r1) = create(&gw.base_url(), body.clone()).await;
        assert_eq!(s1, 200, "{r1}");
        let mut body2 = json!({"model": "sim-model", "input": text, "max_output_tokens": 32});
        if let Some(p) = &solo_prev {
            body2["previous_response_id"] = json!(p);
        }
        let (s2, r2) = create(&solo.base_url(), body2).await;
        assert_eq!(s2, 200, "{r2}");
        assert_eq!(output_text(&r1), output_text(&r2), "turn {turn} differs");
        assert_eq!(r1["usage"]["input_tokens"], r2["usage"]["input_tokens"]);
        alt_prev = Some(r1["id"].as_str().unwrap().into());
        solo_prev = Some(r2["id"].as_str().unwrap().into());
    }
    // Either gateway can read what the other stored.
    let id = alt_prev.unwrap();
    for gw in [a, b] {
        let r = client()
            .get(format!("{}/v1/responses/{id}", gw.base_url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_see_their_own_history() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("forks");
    let fleet = Fleet::of(1).store(redis.url(), &prefix).start().await;
    let base = fleet.base_url();
    let (_, root) = create(
        &base,
        json!({"model": "sim-model", "input": "root question"}),
    )
    .await;
    let root_id = root["id"].as_str().unwrap();
    let (_, left) = create(
        &base,
        json!({"model": "sim-model", "input": "left branch", "previous_response_id": root_id}),
    )
    .await;
    let (_, right) = create(&base, json!({"model": "sim-model", "input": "right branch with more words in it", "previous_response_id": root_id})).await;
    let store = &fleet.gateway().state().store;
    let texts = |items: Vec<Value>| -> Vec<String> {
        items
            .iter()
            .filter(|i| i["role"] == "user")
            .map(|i| i["content"][0]["text"].as_str().unwrap_or("").to_string())
            .collect()
    };
    let l = texts(
        store
            .history("default", left["id"].as_str().unwrap())
            .await
            .unwrap()
            .unwrap()
            .items,
    );
    let r = texts(
        store
            .history("default", right["id"].as_str().unwrap())
            .await
            .unwrap()
            .unwrap()
            .items,
    );
    assert_eq!(l, vec!["root question", "left branch"]);
    assert_eq!(
        r,
        vec!["root question", "right branch with more words in it"]
    );
    fleet.shutdown().await;
}

/// A session key is its team's: another team sending the same session header has a session
/// of its own, placed afresh, and neither finds nor moves the first team's pin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teams_sending_the_same_session_key_hold_separate_pins() {
    let teams = format!(
        "[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{}\"]\n[[teams]]\nname = \"b\"\napi_key_sha256 = [\"{}\"]\n",
        agentgate::auth::hash_key("key-a"),
        agentgate::auth::hash_key("key-b")
    );
    let fleet = Fleet::of(2).extra(&teams).start().await;
    let base = fleet.base_url();
    let turn = |key: &'static str| {
        let base = base.clone();
        async move {
            let resp = client()
                .post(format!("{base}/v1/responses"))
                .bearer_auth(key)
                .header("x-session-id", "shared-name")
                .json(&json!({"model": "sim-model", "input": "hello", "store": false}))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            header(&resp, agentgate::responses::ROUTE_REASON_HEADER)
        }
    };
    assert_ne!(turn("key-a").await, "pin");
    assert_eq!(turn("key-a").await, "pin");
    assert_ne!(
        turn("key-b").await,
        "pin",
        "the other team's first turn followed the first team's pin"
    );
    assert_eq!(turn("key-b").await, "pin");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teams_cannot_see_each_others_responses() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("tenants");
    let teams = format!(
        "[[teams]]\nname = \"a\"\napi_key_sha256 = [\"{}\"]\n[[teams]]\nname = \"b\"\napi_key_sha256 = [\"{}\"]\n",
        agentgate::auth::hash_key("key-a"),
        agentgate::auth::hash_key("key-b")
    );
    let fleet = Fleet::of(1)
        .store(redis.url(), &prefix)
        .extra(&teams)
        .start()
        .await;
    let base = fleet.base_url();
    let c = client();
    let r = json_body(
        c.post(format!("{base}/v1/responses"))
            .bearer_auth("key-a")
            .json(&json!({"model": "sim-model", "input": "secret plans"})),
    )
    .await;
    let id = r["id"].as_str().unwrap();
    let get_as = |key: &'static str| {
        c.get(format!("{base}/v1/responses/{id}"))
            .bearer_auth(key)
            .send()
    };
    assert_eq!(get_as("key-a").await.unwrap().status(), 200);
    assert_eq!(get_as("key-b").await.unwrap().status(), 404);
    let chain = c
        .post(format!("{base}/v1/responses"))
        .bearer_auth("key-b")
        .json(&json!({"model": "sim-model", "input": "and?", "previous_response_id": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(chain.status(), 400);
    let err: Value = chain.json().await.unwrap();
    assert_eq!(err["error"]["code"], "previous_response_not_found");
    let del = c
        .delete(format!("{base}/v1/responses/{id}"))
        .bearer_auth("key-b")
        .send()
        .await
        .unwrap();
    assert_eq!(del.status(), 404);
    let wrong = c
        .get(format!("{base}/v1/responses/{id}"))
        .bearer_auth("key-c")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let body: Value = wrong.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_events_are_ordered_and_gapless() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let resp = post_response(
        &base,
        &json!({"model": "sim-model", "input": "stream please", "stream": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = read_sse(resp).await;
    let names = event_kinds(&events);
    assert_eq!(
        &names[..4],
        &[
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(names.last(), Some(&"response.completed"));
    assert_sequence_numbers(&events);
    for e in &events {
        assert_eq!(e.data["type"], json!(e.event));
    }
    let deltas: String = events
        .iter()
        .filter(|e| e.event == "response.output_text.delta")
        .map(|e| e.data["delta"].as_str().unwrap())
        .collect();
    let done = events
        .iter()
        .find(|e| e.event == "response.output_text.done")
        .unwrap();
    assert_eq!(deltas, done.data["text"].as_str().unwrap());
    let final_resp = &events.last().unwrap().data["response"];
    assert_eq!(output_text(final_resp), deltas);
    // The streamed response was stored and can be retrieved.
    let id = final_resp["id"].as_str().unwrap();
    let got = retrieve(&base, id).await;
    assert_eq!(output_text(&got), deltas);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_route_is_served() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    for route in agentgate::openapi::ROUTES {
        let path = route
            .path
            .replace("{model}", "sim-model")
            .replace("{item_id}", "msg_0")
            .replace("{id}", "x0");
        let url = format!("{base}{path}");
        let request = match route.method {
            "get" => client().get(&url),
            "delete" => client().delete(&url),
            "post" => client().post(&url).json(&json!({})),
            other => panic!("undocumented method {other}"),
        };
        let resp = request.send().await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap();
        // Answered by the route's handler (often with an error for these made-up ids and empty
        // bodies), not by the router's fallbacks.
        assert_ne!(status, 405, "{} {path}: {body}", route.method);
        assert!(
            !body.contains("unknown_url"),
            "{} {path} is not routed: {body}",
            route.method
        );
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let fleet = Fleet::of(1)
        .extra("[server]\nmax_body_bytes = 4096\n")
        .start()
        .await;
    let base = fleet.base_url();
    let c = client();
    let raw = |body: &'static str| {
        c.post(format!("{base}/v1/responses"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let r = raw("{not json").await.unwrap();
    assert_eq!(r.status(), 400);
    let big = "x".repeat(10_000);
    let r = post_response(&base, &json!({"model": "sim-model", "input": big})).await;
    assert_eq!(r.status(), 413);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_too_large");
    let (s, e) = create(&base, json!({"model": "nope", "input": "x"})).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("model_not_found"))
    );
    let (s, e) = create(
        &base,
        json!({"model": "sim-model", "input": "x", "previous_response_id": "resp_missing"}),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(
        e,
        json!({"error": {"message": "Previous response with id 'resp_missing' not found.", "type": "invalid_request_error", "param": "previous_response_id", "code": "previous_response_not_found"}})
    );
    let (s, e) = create(
        &base,
        json!({"model": "sim-model", "input": "x", "background": true, "store": false}),
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("background")));
    let r = c
        .get(format!("{base}/v1/responses/resp_nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = c.get(format!("{base}/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_false_is_not_retrievable_or_chainable() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let (s, r) = create(
        &base,
        json!({"model": "sim-model", "input": "ephemeral", "store": false}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(r["store"], false);
    let id = r["id"].as_str().unwrap();
    assert_eq!(
        client()
            .get(format!("{base}/v1/responses/{id}"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    let (s, e) = create(
        &base,
        json!({"model": "sim-model", "input": "more", "previous_response_id": id}),
    )
    .await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("previous_response_not_found"))
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_started_with_an_api_key_get_it_from_the_environment() {
    let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
        api_key: Some("engine-secret".into()),
        ..slow_sim_config(1.0)
    })
    .await
    .unwrap();
    // Without the key the engine refuses the gateway.
    let refused = client()
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(&json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    std::env::set_var("AGENTGATE_TEST_ENGINE_KEY", "engine-secret");
    let gw = start_gateway(&config_toml(
        &[sim.base_url()],
        None,
        "[upstream]\napi_key_env = \"AGENTGATE_TEST_ENGINE_KEY\"\n",
    ))
    .await;
    let (s, r) = create(&gw.base_url(), json!({"model": "sim-model", "input": "hi"})).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["status"], "completed");
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_engine_is_503_with_retry_after() {
    let (_closed, port) = closed_port();
    let gw = start_gateway(&config_toml(
        &[format!("http://127.0.0.1:{port}")],
        None,
        "",
    ))
    .await;
    let resp = post_response(
        &gw.base_url(),
        &json!({"model": "sim-model", "input": "anyone?"}),
    )
    .await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "upstream_unavailable");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_items_paginate_over_the_whole_conversation() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let mut prev: Option<String> = None;
    for turn in 0..4 {
        let mut body = json!({"model": "sim-model", "input": format!("turn {turn}")});
        if let Some(p) = &prev {
            body["previous_response_id"] = json!(p);
        }
        let (_, r) = create(&base, body).await;
        prev = Some(r["id"].as_str().unwrap().into());
    }
    let id = prev.unwrap();
    // 3 earlier turns (input + output each) + this turn's input = 7 items.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut url = format!("{base}/v1/responses/{id}/input_items?limit=3&order=asc");
        if let Some(a) = &after {
            url.push_str(&format!("&after={a}"));
        }
        let page = get_json(&url).await;
        for item in page["data"].as_array().unwrap() {
            seen.push(item["id"].as_str().unwrap().to_string());
        }
        if !page["has_more"].as_bool().unwrap() {
            break;
        }
        after = page["last_id"].as_str().map(str::to_string);
    }
    assert_eq!(seen.len(), 7);
    let unique: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!(unique.len(), 7);
    let desc = get_json(&format!("{base}/v1/responses/{id}/input_items")).await;
    assert_eq!(desc["first_id"].as_str().unwrap(), seen[6]);
    // Backwards from an item: the ones just before it, and whether there are more.
    let back = get_json(&format!(
        "{base}/v1/responses/{id}/input_items?order=asc&limit=2&before={}",
        seen[5]
    ))
    .await;
    let ids: Vec<&str> = back["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| it["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [seen[3].as_str(), seen[4].as_str()]);
    assert_eq!(back["has_more"], true);
    let between = get_json(&format!(
        "{base}/v1/responses/{id}/input_items?order=asc&after={}&before={}",
        seen[0], seen[3]
    ))
    .await;
    assert_eq!(between["data"].as_array().unwrap().len(), 2);
    assert_eq!(between["has_more"], false);
    let bad = client()
        .get(format!("{base}/v1/responses/{id}/input_items?limit=101"))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_engine_fails_before_its_first_token_runs_elsewhere() {
    // The replica drops each request before its first token (as a replica that dies while
    // they queue or prefill), or ends it in its stream first thing (as vLLM ends the requests
    // it aborts when it drains or its engine fails).
    for fault in [json!({"cut_after": 0}), json!({"abort_after": 0})] {
        fails_before_its_first_token(fault).await;
    }
}

async fn fails_before_its_first_token(fault: Value) {
    // The default policy: a session's turns stay where it ran, pinned and cached there.
    let fleet = Fleet::of(2).start().await;
    let base = fleet.base_url();
    let turn = |i: usize, previous: Option<&str>, stream: bool| {
        let mut body = json!({"model": "sim-model", "input": format!("turn {i}"), "stream": stream, "max_output_tokens": 16});
        if let Some(p) = previous {
            body["previous_response_id"] = json!(p);
        }
        body
    };
    let resp = post_response(&base, &turn(0, None, false)).await;
    let home = served_endpoint(&resp);
    let mut previous = resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .map(str::to_string);
    let (home_index, elsewhere) = match home.as_str() {
        "sim/0" => (0, "sim/1"),
        _ => (1, "sim/0"),
    };
    // The session's replica now fails each request before its first token.
    set_sim_fault(&fleet.sims()[home_index], fault.clone()).await;
    for i in 1..5 {
        let stream = i % 2 == 0;
        let resp = post_response(&base, &turn(i, previous.as_deref(), stream)).await;
        if resp.status() != 200 {
            panic!("{fault} turn {i}: {}", resp.text().await.unwrap());
        }
        let served = served_endpoint(&resp);
        let response = if stream {
            let events = read_sse(resp).await;
            assert_sequence_numbers(&events);
            events.last().unwrap().data["response"].clone()
        } else {
            resp.json::<Value>().await.unwrap()
        };
        previous = response["id"].as_str().map(str::to_string);
        let status = &response["status"];
        assert!(
            status == "completed" || status == "incomplete",
            "{fault} turn {i}: {status}"
        );
        if !stream {
            // (A stream's headers went out before its first token.)
            assert_eq!(
                served, elsewhere,
                "{fault} turn {i}: the header names where it ran"
            );
        }
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_failing_mid_stream_ends_with_response_failed() {
    // A broken connection, and vLLM's way of ending a request it aborted (a last chunk with
    // finish_reason "abort", then [DONE]): both after some output.
    for fault in [json!({"cut_after": 3}), json!({"abort_after": 3})] {
        let sim = start_sim("sim-model").await;
        set_sim_fault(&sim, fault.clone()).await;
        let fleet = Fleet::over(vec![sim]).start().await;
        let base = fleet.base_url();
        let resp = post_response(&base, &json!({"model": "sim-model", "input": "this will break", "stream": true, "max_output_tokens": 64})).await;
        assert_eq!(resp.status(), 200);
        let events = read_sse(resp).await;
        let last = events.last().expect("events");
        assert_eq!(
            last.event,
            "response.failed",
            "{fault}: {:?}",
            events.iter().map(|e| &e.event).collect::<Vec<_>>()
        );
        let response = &last.data["response"];
        assert_eq!(response["status"], "failed");
        assert_eq!(response["error"]["code"], "server_error", "{fault}");
        assert!(response["error"]["message"].as_str().is_some());
        if fault.get("abort_after").is_some() {
            // What arrived is kept, marked incomplete, and nothing chains on it as an answer.
            assert_eq!(response["output"][0]["status"], "incomplete", "{response}");
        }
        assert_sequence_numbers(&events);
        // The failed response is stored as failed, not lost.
        let id = response["id"].as_str().unwrap();
        assert_eq!(retrieve(&base, id).await["status"], "failed");
        // Non-streaming: a clear 502 in OpenAI's shape.
        let (s, e) = create(
            &base,
            json!({"model": "sim-model", "input": "this will break too", "max_output_tokens": 64}),
        )
        .await;
        assert_eq!(s, 502, "{fault}: {e}");
        assert_eq!(e["error"]["code"], "upstream_error");
        fleet.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_replica_is_skipped_before_the_stream_starts() {
    let bad = start_sim("sim-model").await;
    let good = start_sim("sim-model").await;
    set_sim_fault(&bad, json!({"status": 503})).await;
    let fleet = Fleet::over(vec![bad, good]).start().await;
    for _ in 0..4 {
        let resp = post_response(
            &fleet.base_url(),
            &json!({"model": "sim-model", "input": "hello"}),
        )
        .await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()[agentgate::responses::ENDPOINT_HEADER],
            "sim/1"
        );
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_response_runs_detached_and_can_be_cancelled() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("background");
    // 200 ms per token: the cancel lands mid-run.
    let fleet = Fleet::over(vec![slow_sim(200.0).await])
        .store(redis.url(), &prefix)
        .start()
        .await;
    let base = fleet.base_url();
    let (s, r) = create(&base, json!({"model": "sim-model", "input": "long job", "background": true, "max_output_tokens": 2000})).await;
    assert_eq!(s, 200);
    assert_eq!(r["status"], "queued");
    assert_eq!(r["background"], true);
    let id = r["id"].as_str().unwrap();
    let c = cancel(&base, id).await;
    assert_eq!(c["status"], "cancelled");
    let got = retrieve(&base, id).await;
    assert_eq!(got["status"], "cancelled");

    // A short background job completes and is pollable.
    let (_, r) = create(&base, json!({"model": "sim-model", "input": "short job", "background": true, "max_output_tokens": 16})).await;
    let id = r["id"].as_str().unwrap().to_string();
    let mut status = String::new();
    for _ in 0..600 {
        let got = retrieve(&base, &id).await;
        status = got["status"].as_str().unwrap().to_string();
        if status != "queued" && status != "in_progress" {
            assert!(!output_text(&got).is_empty());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(status == "completed" || status == "incomplete", "{status}");
    // Cancelling a finished response changes nothing and answers with it as it ended.
    let again = client()
        .post(format!("{base}/v1/responses/{id}/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["id"], id.as_str());
    assert_eq!(again["status"], status.as_str());
    assert_eq!(retrieve(&base, &id).await["status"], status.as_str());
    fleet.shutdown().await;
}

/// A simulator that holds every first token back for a minute, behind a gateway with one
/// background slot (and `background` settings added to that section), on `store` if given.
async fn one_stalled_background_slot(
    background: &str,
    store: Option<(&str, &str)>,
) -> (agentgate_sim::SimHandle, agentgate::Gateway) {
    let sim = start_sim("sim-model").await;
    set_sim_fault(&sim, json!({"stall_ms": 60_000})).await;
    let gw = start_gateway(&config_toml(
        &[sim.base_url()],
        store,
        &format!(
            "[server]\nshutdown_grace_s = 0.2\n[background]\nmax_concurrent = 1\n{background}"
        ),
    ))
    .await;
    (sim, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_past_the_waiting_limit_are_refused() {
    // Runs hold their first token back: one runs, one waits, a third is one too many. On
    // Redis, whose writes take a round trip, so that concurrent creates overlap.
    let redis = TestRedis::start();
    let prefix = unique_prefix("background_limit");
    let (sim, gw) =
        one_stalled_background_slot("max_queued = 1\n", Some((redis.url(), &prefix))).await;
    let base = gw.base_url();
    let job = json!({"model": "sim-model", "input": "job", "background": true});
    let (s1, first) = create(&base, job.clone()).await;
    let (s2, second) = create(&base, job.clone()).await;
    assert_eq!((s1, s2), (200, 200), "{first} {second}");
    let refused = post_response(&base, &job).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(header(&refused, "retry-after"), "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(
        body["error"]["code"], "too_many_background_responses",
        "{body}"
    );
    // A cancelled one makes room again, for one of a burst of creates.
    let waiting = second["id"].as_str().unwrap();
    assert_eq!(cancel(&base, waiting).await["status"], "cancelled");
    let held = || gw.state().background.lock().map_or(0, |runs| runs.len());
    for _ in 0..1500 {
        if held() == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(held(), 1, "the cancelled run left the registry");
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let (base, job) = (base.clone(), job.clone());
            tokio::spawn(async move { post_response(&base, &job).await.status().as_u16() })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in burst {
        statuses.push(task.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 429, 429, 429, 429, 429]);
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_team_cannot_take_every_background_place() {
    let teams: String = ["a", "b"]
        .iter()
        .map(|t| {
            format!(
                "[[teams]]\nname = \"{t}\"\napi_key_sha256 = [\"{}\"]\n",
                agentgate::auth::hash_key(&format!("sk-{t}"))
            )
        })
        .collect();
    let (sim, gw) = one_stalled_background_slot(&format!("max_per_team = 2\n{teams}"), None).await;
    let base = gw.base_url();
    let job = json!({"model": "sim-model", "input": "job", "background": true});
    let create_as = |team: &'static str| {
        let (base, job) = (base.clone(), job.clone());
        async move {
            let resp = client()
                .post(format!("{base}/v1/responses"))
                .bearer_auth(format!("sk-{team}"))
                .json(&job)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    assert_eq!(create_as("a").await.0, 200);
    assert_eq!(create_as("a").await.0, 200);
    let (s, refused) = create_as("a").await;
    assert_eq!(s, 429, "{refused}");
    assert_eq!(refused["error"]["code"], "too_many_background_responses");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("of your team"),
        "{refused}"
    );
    assert_eq!(create_as("b").await.0, 200, "another team still gets in");
    gw.shutdown().await;
    sim.shutdown().await;
}

/// Streams following background responses are bounded per team: one past the bound is a
/// 429 with Retry-After, and a stream the client closes gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_may_follow_only_so_many_background_responses_at_once() {
    let (sim, gw) = one_stalled_background_slot("max_follows_per_team = 1\n", None).await;
    let base = gw.base_url();
    let job = json!({"model": "sim-model", "input": "job", "background": true});
    let (s, created) = create(&base, job).await;
    assert_eq!(s, 200, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let open_follow = || {
        client()
            .get(format!("{base}/v1/responses/{id}?stream=true"))
            .send()
    };
    let first = open_follow().await.unwrap();
    assert_eq!(first.status(), 200);
    let refused = open_follow().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(header(&refused, "retry-after"), "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_follows", "{body}");
    drop(first);
    let mut status = 429;
    for _ in 0..150 {
        let again = open_follow().await.unwrap();
        status = again.status().as_u16();
        if status == 200 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(status, 200, "the closed stream gave its place back");
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_loaded_pool_serves_concurrent_turns_and_releases_its_counts() {
    let fleet = Fleet::of(2).policy("least_loaded").start().await;
    let pool = fleet.pool();
    assert_eq!(pool.policy, agentgate::pools::Policy::LeastLoaded);
    let base = fleet.base_url();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let base = base.clone();
        tasks.push(tokio::spawn(async move {
            let resp = post_response(&base, &json!({"model": "sim-model", "input": format!("parallel {i}"), "stream": i % 2 == 0})).await;
            let status = resp.status().as_u16();
            resp.bytes().await.unwrap();
            status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // A stream the client abandons still finishes on the engine and releases its slot.
    let resp = post_response(
        &base,
        &json!({"model": "sim-model", "input": "abandoned", "stream": true}),
    )
    .await;
    drop(resp);
    eventually("every slot is released", || {
        pool.endpoints().iter().all(|e| e.in_flight_requests() == 0)
    })
    .await;
    for ep in pool.endpoints().iter() {
        assert_eq!(
            (ep.in_flight_requests(), ep.in_flight_tokens()),
            (0, 0),
            "{}",
            ep.name
        );
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_streamed_background_response_ends_its_stream_cleanly() {
    // 200 ms per token: the cancel lands mid-run.
    let fleet = Fleet::over(vec![slow_sim(200.0).await]).start().await;
    let base = fleet.base_url();
    let mut resp = post_response(&base, &json!({"model": "sim-model", "input": "a long streamed job", "background": true, "stream": true, "max_output_tokens": 4000})).await;
    assert_eq!(resp.status(), 200);
    // Read until the first text delta, so the run is mid-generation.
    let (mut text, id) = read_until_generating(&mut resp).await;
    let cancelled = cancel(&base, &id).await;
    assert_eq!(cancelled["status"], "cancelled");
    read_until(&mut resp, &mut text, |_| false).await;
    let events = parse_sse(&text);
    // Announced as queued, then running.
    let statuses: Vec<(&str, &Value)> = events[..3]
        .iter()
        .map(|e| (e.event.as_str(), &e.data["response"]["status"]))
        .collect();
    assert_eq!(
        statuses,
        [
            ("response.created", &json!("queued")),
            ("response.queued", &json!("queued")),
            ("response.in_progress", &json!("in_progress")),
        ]
    );
    let last = events.last().unwrap();
    assert_eq!(last.event, "response.failed");
    assert_eq!(last.data["response"]["status"], "cancelled");
    assert_eq!(last.data["response"]["error"]["code"], "response_cancelled");
    assert_sequence_numbers(&events);
    let got = retrieve(&base, &id).await;
    assert_eq!(got["status"], "cancelled");
    assert_eq!(last.data["response"], got, "the stream ends as stored");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cancelled_through_another_gateway_ends_its_stream_as_cancelled() {
    // 100 ms per token, answers of 2000 to 6000 tokens: the cancel lands mid-run, on the
    // gateway that does not run it.
    let sim = long_answer_sim(100.0, 4000).await;
    let fleet = Fleet::over(vec![sim])
        .shared_memory()
        .gateways(2)
        .start()
        .await;
    let (a, b) = two_base_urls(&fleet);
    // Minutes of generation, were the run to go on.
    let mut resp = post_response(&a, &json!({"model": "sim-model", "input": "a streamed job", "background": true, "stream": true, "max_output_tokens": 4000})).await;
    let (mut text, id) = read_until_generating(&mut resp).await;
    assert_eq!(cancel(&b, &id).await["status"], "cancelled");
    // The run on `a` learns it from the store at its next event-log write and stops, ending as
    // the record says.
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        read_until(&mut resp, &mut text, |_| false),
    )
    .await
    .expect("the run stops instead of generating its 4000 tokens");
    let events = parse_sse(&text);
    assert_sequence_numbers(&events);
    let last = events.last().unwrap();
    assert_eq!(last.event, "response.failed");
    assert_eq!(last.data["response"]["status"], "cancelled");
    assert_eq!(last.data["response"], retrieve(&a, &id).await);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_run_cancelled_through_another_gateway_gives_back_its_place() {
    // Every first token is held back for a minute: the first run keeps the one run slot of
    // gateway `a`, and the next waits for it.
    let sim = start_sim("sim-model").await;
    set_sim_fault(&sim, json!({"stall_ms": 60_000})).await;
    let fleet = Fleet::over(vec![sim])
        .shared_memory()
        .extra("[server]\nshutdown_grace_s = 0.2\n[background]\nmax_concurrent = 1\n")
        .gateways(2)
        .start()
        .await;
    let (a, b) = two_base_urls(&fleet);
    let job = json!({"model": "sim-model", "input": "job", "background": true});
    let (_, running) = create(&a, job.clone()).await;
    let (_, waiting) = create(&a, job.clone()).await;
    let runs = || {
        fleet.gateways()[0]
            .state()
            .background
            .lock()
            .map_or(0, |runs| runs.len())
    };
    assert_eq!(runs(), 2);
    // Cancelled through `b`, which does not run it: `a` learns it from the store, while its
    // slot is still held, and the waiting run leaves.
    let id = waiting["id"].as_str().unwrap();
    assert_eq!(cancel(&b, id).await["status"], "cancelled");
    eventually("the waiting run on `a` stops", || runs() == 1).await;
    assert_eq!(retrieve(&a, id).await["status"], "cancelled");
    let id = running["id"].as_str().unwrap();
    assert_eq!(retrieve(&a, id).await["status"], "in_progress");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_background_response_is_announced_while_it_waits_and_ends_when_cancelled() {
    // The first run holds the only background slot: its first token never comes.
    let (sim, gw) = one_stalled_background_slot("", None).await;
    let base = gw.base_url();
    let (s, busy) = create(
        &base,
        json!({"model": "sim-model", "input": "job", "background": true}),
    )
    .await;
    assert_eq!(s, 200, "{busy}");
    wait_until_running(&base, busy["id"].as_str().unwrap()).await;
    let mut resp = post_response(
        &base,
        &json!({"model": "sim-model", "input": "waits", "background": true, "stream": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    // The client hears at once that its response exists and waits.
    let mut text = String::new();
    read_until(&mut resp, &mut text, |text| parse_sse(text).len() >= 2).await;
    let events = parse_sse(&text);
    assert_eq!(events[0].event, "response.created");
    assert_eq!(events[1].event, "response.queued");
    assert_eq!(events[1].data["response"]["status"], "queued");
    let id = events[0].data["response"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(retrieve(&base, &id).await["status"], "queued");

    // Cancelled while it waits: the stream ends, saying so.
    assert_eq!(cancel(&base, &id).await["status"], "cancelled");
    read_until(&mut resp, &mut text, |_| false).await;
    let events = parse_sse(&text);
    assert_cancelled_while_queued(&events);
    // A follower replays the same events from the log.
    let followed = follow(&base, &id, None).await;
    assert_eq!(
        followed.iter().map(|e| &e.data).collect::<Vec<_>>(),
        events.iter().map(|e| &e.data).collect::<Vec<_>>()
    );
    // It counts as a response that ended cancelled, though it never ran.
    let cancelled = "agentgate_responses_total{pool=\"sim\",status=\"cancelled\",code=\"\"} 1";
    let m = metrics_text(&base).await;
    assert!(m.lines().any(|l| l == cancelled), "{m}");
    cancel(&base, busy["id"].as_str().unwrap()).await;
    gw.shutdown().await;
    sim.shutdown().await;
}

/// Wait until background response `id` runs (holds a slot): a run created later could
/// otherwise take the slot first.
async fn wait_until_running(base: &str, id: &str) {
    for _ in 0..500 {
        if retrieve(base, id).await["status"] == "in_progress" {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("background response {id} never started running");
}

/// Read `resp`'s stream into `text` until `enough` says so, or to its end.
async fn read_until(
    resp: &mut reqwest::Response,
    text: &mut String,
    enough: impl Fn(&str) -> bool,
) {
    while !enough(text) {
        match resp.chunk().await.unwrap() {
            Some(chunk) => text.push_str(std::str::from_utf8(&chunk).unwrap()),
            None => return,
        }
    }
}

/// Read a streamed response until its first text delta (it is mid-generation then): the text
/// so far and the response's id.
async fn read_until_generating(resp: &mut reqwest::Response) -> (String, String) {
    let mut text = String::new();
    read_until(resp, &mut text, |text| {
        text.contains("response.output_text.delta")
    })
    .await;
    let id = parse_sse(&text)[0].data["response"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    (text, id)
}

/// The events of a background response cancelled before it ran: announced, then cancelled.
fn assert_cancelled_while_queued(events: &[Event]) {
    let kinds = event_kinds(events);
    assert_eq!(
        kinds,
        ["response.created", "response.queued", "response.failed"]
    );
    assert_sequence_numbers(events);
    assert_eq!(events[2].data["response"]["status"], "cancelled");
}

/// `vllm:num_requests_running` as `sim` reports it.
async fn running_on(sim: &str) -> f64 {
    let text = metrics_text(sim).await;
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("vllm:num_requests_running")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_nobody_can_read_later_stops_when_its_client_leaves() {
    // 200 ms per token: a 4000-token answer would take minutes.
    let sim = slow_sim(200.0).await;
    let sim_url = sim.base_url();
    let fleet = Fleet::over(vec![sim]).start().await;
    let base = fleet.base_url();
    let pool = fleet.pool();
    let long = |stream| json!({"model": "sim-model", "input": "a long answer", "store": false, "stream": stream, "max_output_tokens": 4000});
    let idle = |pool: &std::sync::Arc<agentgate::pools::Pool>| {
        pool.endpoints().iter().all(|e| e.in_flight_requests() == 0)
    };

    // Streamed: the client reads the first words, then goes.
    let mut resp = post_response(&base, &long(true)).await;
    let mut text = String::new();
    read_until(&mut resp, &mut text, |text| {
        text.contains("response.output_text.delta")
    })
    .await;
    drop(resp);
    eventually("the gateway lets the turn go", || idle(&pool)).await;
    let mut running = running_on(&sim_url).await;
    for _ in 0..500 {
        if running == 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        running = running_on(&sim_url).await;
    }
    assert_eq!(running, 0.0, "the engine request was not dropped");

    // Not streamed: the client stops waiting.
    let gave_up = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(500))
        .build()
        .unwrap()
        .post(format!("{base}/v1/responses"))
        .json(&long(false))
        .send()
        .await;
    assert!(gave_up.is_err());
    eventually("the gateway lets the turn go", || idle(&pool)).await;
    let ended = metrics_text(&base).await;
    assert!(
        ended.contains("code=\"client_disconnected\"} 2"),
        "{}",
        ended
            .lines()
            .filter(|l| l.contains("client_disconnected"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncation_auto_drops_the_middle_of_a_conversation_that_outgrew_the_context() {
    let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        model: "sim-model".into(),
        time_scale: 0.0,
        max_model_len: Some(400),
        ..Default::default()
    })
    .await
    .unwrap();
    let fleet = Fleet::over(vec![sim]).start().await;
    let base = fleet.base_url();
    let words = "alpha beta gamma delta epsilon zeta eta theta iota kappa ".repeat(4);
    let mut prev: Option<String> = None;
    let mut overflowed = false;
    for turn in 0..20 {
        let mut body = json!({"model": "sim-model", "input": format!("turn {turn} {words}"), "max_output_tokens": 16});
        if let Some(p) = &prev {
            body["previous_response_id"] = json!(p);
        }
        let (s, r) = create(&base, body.clone()).await;
        if s == 400 {
            assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
            assert_eq!(r["error"]["param"], "input", "{r}");
            // Streamed, the same refusal is a created response that fails, as OpenAI streams
            // it (Codex compacts on that event; a 400 it takes for a request it cannot send).
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            let resp = post_response(&base, &streamed).await;
            assert_eq!(resp.status(), 200);
            let events = read_sse(resp).await;
            assert_sequence_numbers(&events);
            let kinds = event_kinds(&events);
            assert_eq!(
                kinds,
                [
                    "response.created",
                    "response.in_progress",
                    "response.failed"
                ]
            );
            let failed = &events[2].data["response"];
            assert_eq!(
                failed["error"]["code"], "context_length_exceeded",
                "{failed}"
            );
            let m = metrics_text(&base).await;
            assert!(
                m.contains("status=\"failed\",code=\"context_length_exceeded\"} 1"),
                "counted as a response that failed"
            );
            // The same turn with truncation: auto goes through.
            body["truncation"] = json!("auto");
            let (s, r) = create(&base, body.clone()).await;
            assert_eq!(s, 200, "{r}");
            assert_eq!(r["truncation"], "auto");
            assert!(r["usage"]["input_tokens"].as_u64().unwrap() < 400);
            // An output budget that fills the window alone is that parameter's fault: no
            // truncation would help, and nothing asks the client to compact.
            body["max_output_tokens"] = json!(400);
            let (s, r) = create(&base, body).await;
            assert_eq!(s, 400, "{r}");
            assert_eq!(
                (&r["error"]["param"], &r["error"]["code"]),
                (&json!("max_output_tokens"), &json!("invalid_value")),
                "{r}"
            );
            overflowed = true;
            break;
        }
        assert_eq!(s, 200, "{r}");
        prev = Some(r["id"].as_str().unwrap().into());
    }
    assert!(overflowed, "the conversation never outgrew the context");

    // Sent whole as this turn's input (nothing stored, as Codex sends it): the middle goes all
    // the same, each tool call with its output.
    let mut body = twelve_tool_calls(&words);
    let (s, r) = create(&base, body.clone()).await;
    assert_eq!(s, 400, "{r}");
    body["truncation"] = json!("auto");
    let (s, r) = create(&base, body).await;
    assert_eq!(s, 200, "{r}");
    assert!(r["usage"]["input_tokens"].as_u64().unwrap() < 400);
    fleet.shutdown().await;
}

/// A stateless turn (nothing stored, as Codex sends it) whose input is a task, twelve shell
/// calls each with `output` as its output, and a question.
fn twelve_tool_calls(output: &str) -> Value {
    let mut input = vec![json!({"role": "user", "content": "the task"})];
    for n in 0..12 {
        let call = format!("c{n}");
        input.push(
            json!({"type": "function_call", "call_id": call, "name": "shell", "arguments": "{}"}),
        );
        input.push(json!({"type": "function_call_output", "call_id": call, "output": output}));
    }
    input.push(json!({"role": "user", "content": "and now?"}));
    json!({"model": "sim-model", "input": input, "store": false, "max_output_tokens": 16,
           "tools": [{"type": "function", "name": "shell"}]})
}

/// A simulated SGLang replica (of context `max_model_len`, default its KV capacity) and a
/// gateway whose one pool is it.
async fn sglang_behind_a_gateway(
    max_model_len: Option<usize>,
) -> (agentgate_sim::SimHandle, agentgate::Gateway) {
    let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
        flavor: agentgate_sim::Flavor::Sglang,
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        model: "sim-model".into(),
        time_scale: 0.0,
        max_model_len,
        ..Default::default()
    })
    .await
    .unwrap();
    let gw = start_gateway(&format!(
        "[[pools]]\nname = \"p\"\nmodel = \"sim-model\"\nflavor = \"sglang\"\nendpoints = [\"{}\"]\n",
        sim.base_url()
    ))
    .await;
    (sim, gw)
}

/// SGLang starts a streaming request's stream and then reports the prompt over its context
/// window in it: `truncation: auto` still drops the middle and runs the request again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncation_auto_applies_when_sglang_reports_the_overflow_in_its_stream() {
    let (sim, gw) = sglang_behind_a_gateway(Some(400)).await;
    let base = gw.base_url();
    let words = "alpha beta gamma delta epsilon zeta eta theta iota kappa ".repeat(4);
    let mut body = twelve_tool_calls(&words);
    let (s, r) = create(&base, body.clone()).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["error"]["code"], "context_length_exceeded", "{r}");
    body["truncation"] = json!("auto");
    let (s, r) = create(&base, body.clone()).await;
    assert_eq!(s, 200, "{r}");
    assert!(r["usage"]["input_tokens"].as_u64().unwrap() < 400);
    body["stream"] = json!(true);
    let events = read_sse(post_response(&base, &body).await).await;
    assert_sequence_numbers(&events);
    let last = events.last().unwrap();
    assert!(
        matches!(
            last.event.as_str(),
            "response.completed" | "response.incomplete"
        ),
        "{:?}",
        event_kinds(&events)
    );
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_policy_keeps_a_conversation_where_its_cache_is() {
    let fleet = Fleet::of(3).policy("prefix").start().await;
    let base = fleet.base_url();
    let system = "You are a careful coding agent working in a large repository. ".repeat(40);
    // Stateless turns (full history each time, no session key): only the prefix index can
    // keep them together.
    let mut history: Vec<Value> = Vec::new();
    let (mut endpoints, mut reasons) = (Vec::new(), Vec::new());
    let mut cached = Vec::new();
    for turn in 0..5 {
        history
            .push(json!({"role": "user", "content": format!("step {turn}: read the next file")}));
        let resp = post_response(&base, &json!({"model": "sim-model", "instructions": system, "input": history, "store": false, "max_output_tokens": 32})).await;
        assert_eq!(resp.status(), 200);
        endpoints.push(header(&resp, agentgate::responses::ENDPOINT_HEADER));
        reasons.push(header(&resp, agentgate::responses::ROUTE_REASON_HEADER));
        let r: Value = resp.json().await.unwrap();
        cached.push(
            r["usage"]["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
        for item in r["output"].as_array().unwrap() {
            history.push(item.clone());
        }
    }
    assert!(
        endpoints.iter().all(|e| e == &endpoints[0]),
        "turns moved: {endpoints:?}"
    );
    assert!(
        cached[1..].iter().all(|&c| c > 0),
        "later turns must hit the cache: {cached:?}"
    );
    // The first turn is placed by load on an idle fleet, the others by their prefix.
    assert_eq!(reasons, ["load", "prefix", "prefix", "prefix", "prefix"]);
    // A streamed turn carries the same headers.
    history.push(json!({"role": "user", "content": "one more step"}));
    let resp = post_response(&base, &json!({"model": "sim-model", "instructions": system, "input": history, "store": false, "max_output_tokens": 32, "stream": true})).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        (
            header(&resp, agentgate::responses::ENDPOINT_HEADER),
            header(&resp, agentgate::responses::ROUTE_REASON_HEADER)
        ),
        (endpoints[0].clone(), "prefix".to_string())
    );
    let events = resp.text().await.unwrap();
    assert!(
        ["event: response.completed", "event: response.incomplete"]
            .iter()
            .any(|end| events.contains(end)),
        "{events}"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_does_not_report_cached_tokens_leaves_the_prefix_index_alone() {
    // Held chunks of the one endpoint after each of: conversation A, conversation B, A's next
    // turn (which the index predicts mostly cached), all stateless.
    async fn held_after_a_b_a(reports: bool) -> (Fleet, [usize; 3]) {
        let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "sim-model".into(),
            time_scale: 0.0,
            prompt_tokens_details: reports,
            ..Default::default()
        })
        .await
        .unwrap();
        let fleet = Fleet::over(vec![sim]).policy("prefix").start().await;
        let base = fleet.base_url();
        let index = fleet.pool();
        let index = index.picker.prefix_index().expect("prefix policy");
        let turn = |system: &str, turns: usize| {
            let input: Vec<Value> = (0..turns)
                .map(|t| json!({"role": "user", "content": format!("step {t}")}))
                .collect();
            json!({"model": "sim-model", "instructions": system.repeat(200), "input": input,
                   "store": false, "max_output_tokens": 16})
        };
        let mut held = [0; 3];
        for (i, body) in [
            turn("Conversation A reads files. ", 1),
            turn("Conversation B writes tests. ", 1),
            turn("Conversation A reads files. ", 2),
        ]
        .into_iter()
        .enumerate()
        {
            let (s, r) = create(&base, body).await;
            assert_eq!(s, 200, "{r}");
            held[i] = index.held_chunks(0);
        }
        (fleet, held)
    }

    // Silent engine: its silence says nothing, so nothing is forgotten.
    let (fleet, [_, b, a2]) = held_after_a_b_a(false).await;
    assert!(a2 >= b, "chunks forgotten on no evidence: {b} then {a2}");
    fleet.shutdown().await;

    // An engine that reports: once it has, its silence means nothing was cached. After its
    // cache is emptied, A's next turn finds nothing, and the index forgets what it over-counted.
    let (fleet, [_, _, a2]) = held_after_a_b_a(true).await;
    let sim = fleet.sims()[0].base_url();
    let reset = client()
        .post(format!("{sim}/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert!(reset.status().is_success());
    let base = fleet.base_url();
    let (s, r) = create(&base, json!({"model": "sim-model", "instructions": "Conversation A reads files. ".repeat(200),
        "input": [{"role": "user", "content": "step 0"}, {"role": "user", "content": "step 1"}, {"role": "user", "content": "step 2"}],
        "store": false, "max_output_tokens": 16})).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 0);
    let pool = fleet.pool();
    let after = pool.picker.prefix_index().unwrap().held_chunks(0);
    assert!(after < a2, "nothing forgotten: {a2} then {after}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_pins_in_redis_keep_a_session_on_one_replica_across_gateways() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("session_pins");
    let fleet = Fleet::of(3)
        .policy("session")
        .store(redis.url(), &prefix)
        .gateways(2)
        .start()
        .await;
    let (a, b) = (&fleet.gateways()[0], &fleet.gateways()[1]);
    let mut seen = Vec::new();
    for turn in 0..6 {
        let gw = if turn % 2 == 0 { a } else { b };
        let resp = client()
            .post(format!("{}/v1/responses", gw.base_url()))
            .header("session-id", "thread-42")
            .json(&json!({"model": "sim-model", "input": format!("turn {turn}"), "store": false, "prompt_cache_key": "thread-42"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        seen.push((
            header(&resp, agentgate::responses::ENDPOINT_HEADER),
            header(&resp, agentgate::responses::ROUTE_REASON_HEADER),
        ));
    }
    assert_ne!(seen[0].1, "pin", "the first turn has no pin yet: {seen:?}");
    assert!(seen.iter().all(|(e, _)| e == &seen[0].0), "{seen:?}");
    assert!(seen[1..].iter().all(|(_, r)| r == "pin"), "{seen:?}");

    // The pinned replica fails: the next turn moves, and both gateways follow the new pin.
    let pinned = seen[0]
        .0
        .trim_start_matches("sim/")
        .parse::<usize>()
        .unwrap();
    set_sim_fault(&fleet.sims()[pinned], json!({"status": 503})).await;
    let (mut moved, mut causes) = (Vec::new(), Vec::new());
    for gw in [a, b, a] {
        let resp = client()
            .post(format!("{}/v1/responses", gw.base_url()))
            .header("session-id", "thread-42")
            .json(&json!({"model": "sim-model", "input": "after the failure", "store": false}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        moved.push((
            header(&resp, agentgate::responses::ENDPOINT_HEADER),
            header(&resp, agentgate::responses::ROUTE_REASON_HEADER),
        ));
        causes.push(
            resp.headers()
                .get(agentgate::responses::PIN_MOVED_HEADER)
                .map(|v| v.to_str().unwrap().to_string()),
        );
    }
    // The first turn tried its pinned replica, which failed it; the others follow the new pin.
    assert_eq!(causes, [Some("failed".to_string()), None, None]);
    assert_ne!(moved[0].0, seen[0].0);
    assert_ne!(moved[0].1, "pin", "{moved:?}");
    assert!(moved.iter().all(|(e, _)| e == &moved[0].0), "{moved:?}");
    assert_eq!(moved[1].1, "pin");
    let pin = a
        .state()
        .store
        .get_pin("sim", "h:thread-42")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((pin.endpoint.as_str(), pin.moves), (moved[0].0.as_str(), 1));
    let moves = |gw: &agentgate::Gateway| gw.state().metrics.pin_moves.get(["sim", "failed"]);
    assert_eq!(
        (moves(a), moves(b)),
        (1, 0),
        "the move is counted where it was made"
    );
    fleet.shutdown().await;
}

/// One turn (not stored) of session `session`: the endpoint that served it, the route reason,
/// and why the session's pin moved, if it did.
async fn session_turn(base: &str, session: &str) -> (String, String, Option<String>) {
    let resp = client()
        .post(format!("{base}/v1/responses"))
        .header("x-session-id", session)
        .json(&json!({"model": "sim-model", "input": "next step", "store": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    (
        header(&resp, agentgate::responses::ENDPOINT_HEADER),
        header(&resp, agentgate::responses::ROUTE_REASON_HEADER),
        resp.headers()
            .get(agentgate::responses::PIN_MOVED_HEADER)
            .map(|v| v.to_str().unwrap().to_string()),
    )
}

/// Replace the pin of session `renamed` in pool `sim`, `from` by `to`, as another writer would.
async fn overwrite_pin(
    store: &agentgate_sessions::AnyStore,
    from: &agentgate_sessions::SessionPin,
    to: &agentgate_sessions::SessionPin,
) {
    let swap = store
        .swap_pin("sim", "h:renamed", Some(from), to)
        .await
        .unwrap();
    assert!(swap.applied, "{swap:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_whose_endpoint_name_now_stands_for_another_engine_is_gone() {
    let fleet = Fleet::of(2).start().await;
    let base = fleet.base_url();
    let turn = || session_turn(&base, "renamed");
    let store = fleet.gateway().state().store.clone();
    let (served, _, _) = turn().await;
    let pin = store.get_pin("sim", "h:renamed").await.unwrap().unwrap();
    let url = fleet
        .pool()
        .endpoints()
        .iter()
        .find(|e| e.name == served)
        .unwrap()
        .base_url
        .clone();
    assert_eq!(
        pin.url.as_deref(),
        Some(url.as_str()),
        "the pin records the engine"
    );
    // The same name, set when it stood for another engine (an edited endpoint list, a restart).
    let stale = agentgate_sessions::SessionPin {
        url: Some("http://127.0.0.1:9".into()),
        ..pin.clone()
    };
    overwrite_pin(&store, &pin, &stale).await;
    let (_, _, moved) = turn().await;
    assert_eq!(
        moved.as_deref(),
        Some("unavailable"),
        "the stale pin does not hold"
    );
    let now = store.get_pin("sim", "h:renamed").await.unwrap().unwrap();
    assert_eq!(now.moves, 1);
    let served_now = fleet
        .pool()
        .endpoints()
        .iter()
        .find(|e| e.name == now.endpoint)
        .unwrap()
        .base_url
        .clone();
    assert_eq!(now.url, Some(served_now.clone()));
    // A pin from before pins recorded a URL holds by its name, and gets the URL (not a move).
    let old = agentgate_sessions::SessionPin {
        url: None,
        ..now.clone()
    };
    overwrite_pin(&store, &now, &old).await;
    let (served, _, moved) = turn().await;
    assert_eq!((served, moved), (now.endpoint.clone(), None));
    let upgraded = store.get_pin("sim", "h:renamed").await.unwrap().unwrap();
    assert_eq!(
        (upgraded.moves, upgraded.url.clone()),
        (1, Some(served_now.clone()))
    );
    // The engine renamed (an endpoints file listing it under a new name) still holds the
    // session: the pin follows its URL and takes the new name (not a move).
    let renamed = agentgate_sessions::SessionPin {
        endpoint: "its-old-name".into(),
        ..upgraded.clone()
    };
    overwrite_pin(&store, &upgraded, &renamed).await;
    let (served, _, moved) = turn().await;
    assert_eq!((served, moved), (now.endpoint.clone(), None));
    let followed = store.get_pin("sim", "h:renamed").await.unwrap().unwrap();
    assert_eq!(
        (followed.endpoint, followed.moves, followed.url),
        (now.endpoint.clone(), 1, Some(served_now))
    );
    let metrics = &fleet.gateway().state().metrics;
    assert_eq!(metrics.pin_moves.get(["sim", "unavailable"]), 1);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_lives_its_ttl_after_the_sessions_last_turn_not_after_its_first() {
    let fleet = Fleet::of(2).extra("[store]\npin_ttl_s = 6\n").start().await;
    let base = fleet.base_url();
    let turn = || async { session_turn(&base, "busy").await.1 };
    let store = fleet.gateway().state().store.clone();
    turn().await;
    let first = store.get_pin("sim", "h:busy").await.unwrap().unwrap();
    // A turn 4 s later stays on the pin and refreshes it.
    tokio::time::sleep(std::time::Duration::from_millis(4000)).await;
    assert_eq!(turn().await, "pin");
    // Past the TTL counted from the first turn (7.5 s), well within it counted from the second
    // (3.5 s, whatever the turn took).
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let pin = store.get_pin("sim", "h:busy").await.unwrap();
    assert_eq!(
        pin,
        Some(first),
        "the session's pin expired while it was busy"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chained_conversation_without_session_headers_is_pinned_by_its_root() {
    let fleet = Fleet::of(3).policy("session").start().await;
    let base = fleet.base_url();
    let mut previous: Option<String> = None;
    let mut first_id = String::new();
    let mut seen = Vec::new();
    for turn in 0..5 {
        let mut body =
            json!({"model": "sim-model", "input": format!("turn {turn}"), "max_output_tokens": 16});
        if let Some(prev) = &previous {
            body["previous_response_id"] = json!(prev);
        }
        let resp = post_response(&base, &body).await;
        assert_eq!(resp.status(), 200);
        seen.push((
            header(&resp, agentgate::responses::ENDPOINT_HEADER),
            header(&resp, agentgate::responses::ROUTE_REASON_HEADER),
        ));
        let r: Value = resp.json().await.unwrap();
        let id = r["id"].as_str().unwrap().to_string();
        if turn == 0 {
            first_id = id.clone();
        }
        previous = Some(id);
    }
    assert!(seen.iter().all(|(e, _)| e == &seen[0].0), "{seen:?}");
    assert!(seen[1..].iter().all(|(_, r)| r == "pin"), "{seen:?}");
    let pin = fleet
        .gateway()
        .state()
        .store
        .get_pin("sim", &format!("root:{first_id}"))
        .await
        .unwrap()
        .expect("the chain is pinned under its root");
    assert_eq!(pin.endpoint, seen[0].0);
    // A fork from the first turn belongs to the same conversation.
    let resp = post_response(
        &base,
        &json!({"model": "sim-model", "input": "a fork", "previous_response_id": first_id}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()[agentgate::responses::ENDPOINT_HEADER],
        seen[0].0.as_str()
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_store_cannot_keep_fails_instead_of_completing() {
    let mut redis = TestRedis::start_private();
    let prefix = unique_prefix("unstored");
    let fleet = Fleet::of(1).store(redis.url(), &prefix).start().await;
    let base = fleet.base_url();
    let body = json!({"model": "sim-model", "input": "hello", "max_output_tokens": 16});
    let (s, first) = create(&base, body.clone()).await;
    assert_eq!(s, 200, "{first}");

    // The store is gone: the answer is generated, but an id that cannot be retrieved or
    // continued is not handed out as if it could.
    redis.stop();
    let (s, e) = create(&base, body.clone()).await;
    assert_eq!(s, 503, "{e}");
    assert_eq!(e["error"]["code"], "store_unavailable", "{e}");
    // Long enough to complete (and so to have had a completion time).
    let streamed =
        json!({"model": "sim-model", "input": "hello", "max_output_tokens": 4096, "stream": true});
    let text = post_response(&base, &streamed).await.text().await.unwrap();
    let last = text
        .lines()
        .rfind(|l| l.starts_with("data: "))
        .and_then(|l| serde_json::from_str::<Value>(&l["data: ".len()..]).ok())
        .expect("a terminal event");
    assert_eq!(last["type"], "response.failed", "{text}");
    assert_eq!(last["response"]["error"]["code"], "store_unavailable");
    assert_eq!(
        last["response"]["completed_at"],
        Value::Null,
        "not completed"
    );
    // Not stored, not asked to be: nothing is lost.
    let mut ephemeral = body.clone();
    ephemeral["store"] = json!(false);
    let (s, r) = create(&base, ephemeral).await;
    assert_eq!((s, r["status"].as_str()), (200, Some("incomplete")), "{r}");

    let m = metrics_text(&base).await;
    let count = |series: &str| {
        m.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0)
    };
    assert_eq!(
        count(
            "agentgate_responses_total{pool=\"sim\",status=\"failed\",code=\"store_unavailable\"}"
        ),
        2.0,
        "{m}"
    );
    assert_eq!(
        count("agentgate_responses_total{pool=\"sim\",status=\"incomplete\",code=\"\"}"),
        2.0,
        "the first turn and the store: false one: {m}"
    );

    // Back: stored and chained again.
    redis.restart();
    let (s, again) = create(&base, body).await;
    assert_eq!(s, 200, "{again}");
    let next = json!({"model": "sim-model", "input": "and then?", "max_output_tokens": 16,
                      "previous_response_id": again["id"]});
    let (s, r) = create(&base, next).await;
    assert_eq!(s, 200, "{r}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_run_that_cannot_store_its_result_ends_its_stream_as_failed() {
    let mut redis = TestRedis::start_private();
    let prefix = unique_prefix("unstored-background");
    // 50 ms per token: the store goes while the run generates.
    let fleet = Fleet::over(vec![slow_sim(50.0).await])
        .store(redis.url(), &prefix)
        .extra("[server]\nshutdown_grace_s = 0.2\n")
        .start()
        .await;
    let base = fleet.base_url();
    let mut resp = post_response(&base, &json!({"model": "sim-model", "input": "a job", "background": true, "stream": true, "max_output_tokens": 16})).await;
    assert_eq!(resp.status(), 200);
    let (mut text, _) = read_until_generating(&mut resp).await;
    redis.stop();
    // Generated to its end (its engine slot is free); the store write then fails and is
    // retried for minutes, until the shutdown.
    let pool = fleet.pool();
    eventually("the run has finished generating", || {
        pool.endpoints().iter().all(|e| e.in_flight_requests() == 0)
    })
    .await;
    let shutdown = tokio::spawn(fleet.shutdown());
    read_until(&mut resp, &mut text, |_| false).await;
    shutdown.await.unwrap();
    let events = parse_sse(&text);
    let last = events.last().unwrap();
    // Not `response.completed`: the id it names can be neither retrieved nor continued.
    assert_eq!(last.event, "response.failed", "{text}");
    assert_eq!(last.data["response"]["error"]["code"], "store_unavailable");
    assert_sequence_numbers(&events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_result_is_kept_once_the_store_takes_writes_again() {
    let redis = TestRedis::start_private();
    let prefix = unique_prefix("background_store_outage");
    // 200 ms per token: the run is still decoding when the store starts refusing writes.
    let fleet = Fleet::over(vec![slow_sim(200.0).await])
        .store(redis.url(), &prefix)
        .start()
        .await;
    let base = fleet.base_url();
    let body = json!({"model": "sim-model", "input": "a job", "background": true,
                      "max_output_tokens": 16});
    let (s, r) = create(&base, body).await;
    assert_eq!(s, 200, "{r}");
    let id = r["id"].as_str().unwrap().to_string();

    // The store refuses writes while the run finishes: past the three tries a waiting client
    // gets, the record must not be left active.
    redis.refuse_writes(true);
    let write_errors = || async {
        metrics_text(&base)
            .await
            .lines()
            .find_map(|l| l.strip_prefix("agentgate_store_write_errors_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let mut errors = 0.0;
    for _ in 0..600 {
        errors = write_errors().await;
        if errors >= 3.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        errors >= 3.0,
        "the final write fails three times ({errors})"
    );
    let status = retrieve(&base, &id).await["status"].clone();
    assert!(status == "queued" || status == "in_progress", "{status}");

    redis.refuse_writes(false);
    let mut got = Value::Null;
    for _ in 0..600 {
        got = retrieve(&base, &id).await;
        if got["status"] != "queued" && got["status"] != "in_progress" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        got["status"] == "completed" || got["status"] == "incomplete",
        "{got}"
    );
    assert!(!output_text(&got).is_empty(), "{got}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_memory_store_drops_its_least_recently_used_responses_past_its_bound() {
    let fleet = Fleet::of(1)
        .extra("[store]\nmemory_max_mb = 1\n")
        .start()
        .await;
    let base = fleet.base_url();
    let gauge = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(-1.0)
    };
    // A conversation continued throughout, and unrelated one-off requests of about 160 KB of
    // input each that push past the 1 MiB bound.
    let big = "lorem ipsum dolor sit amet ".repeat(6_000);
    let one_off = json!({"model": "sim-model", "input": big, "max_output_tokens": 16});
    let turn = |previous: Option<&str>| {
        let mut body = json!({"model": "sim-model", "input": "and then?", "max_output_tokens": 16});
        if let Some(id) = previous {
            body["previous_response_id"] = json!(id);
        }
        body
    };
    let (s, first) = create(&base, turn(None)).await;
    assert_eq!(s, 200, "{first}");
    let mut conversation = vec![first["id"].as_str().unwrap().to_string()];
    let mut one_offs = Vec::new();
    for _ in 0..8 {
        let (s, r) = create(&base, one_off.clone()).await;
        assert_eq!(s, 200, "{r}");
        one_offs.push(r["id"].as_str().unwrap().to_string());
        let (s, r) = create(&base, turn(conversation.last().map(String::as_str))).await;
        assert_eq!(s, 200, "{r}");
        conversation.push(r["id"].as_str().unwrap().to_string());
    }
    let m = metrics_text(&base).await;
    assert!(gauge(&m, "agentgate_store_evictions_total ") > 0.0, "{m}");
    let bytes = gauge(&m, "agentgate_store_memory_bytes ");
    assert!(bytes > 0.0 && bytes <= (1 << 20) as f64, "{bytes}");
    let status = |id: String| {
        let url = format!("{base}/v1/responses/{id}");
        async move { client().get(url).send().await.unwrap().status().as_u16() }
    };
    assert_eq!(
        status(one_offs[0].clone()).await,
        404,
        "the oldest one-off went"
    );
    assert_eq!(status(one_offs[5].clone()).await, 200, "the newest stays");
    for id in &conversation {
        assert_eq!(
            status(id.clone()).await,
            200,
            "the conversation's last turns stay"
        );
    }
    fleet.shutdown().await;
}

/// SGLang parses every earlier tool call's arguments as a JSON object and renders no tools under
/// `tool_choice: "none"`: a call cut short still replays (as an object), and a compaction turn
/// keeps the prompt's prefix (its tools) cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_replays_cut_calls_and_compacts_on_a_cached_prefix() {
    let (sim, gw) = sglang_behind_a_gateway(None).await;
    let base = gw.base_url();
    let tools = json!([{"type": "function", "name": "shell", "description": "Run a command.",
                        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]);
    let (s, first) = create(
        &base,
        json!({"model": "sim-model", "tools": tools, "max_output_tokens": 16, "input": [
            {"role": "user", "content": "list the files"},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{\"cmd\": \"l"},
            {"type": "function_call_output", "call_id": "c1", "output": "(cut short)"},
            {"role": "user", "content": "try again"},
        ]}),
    )
    .await;
    assert_eq!(s, 200, "{first}");
    let body = json!({"model": "sim-model", "tools": tools, "previous_response_id": first["id"],
                      "input": [{"role": "user", "content": "summarize"}, {"type": "compaction_trigger"}]});
    let (s, compacted) = create(&base, body).await;
    assert_eq!(s, 200, "{compacted}");
    let prompt = first["usage"]["input_tokens"].as_u64().unwrap();
    let cached = compacted["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached + 16 >= prompt,
        "cached {cached} of the first turn's {prompt}"
    );
    gw.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_turn_streams_one_item_that_later_turns_read_back() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let tools = json!([{"type": "function", "name": "shell", "parameters": {"type": "object"}}]);
    let (s, first) = create(
        &base,
        json!({"model": "sim-model", "input": "fix the parser", "tools": tools,
               "max_output_tokens": 16}),
    )
    .await;
    assert_eq!(s, 200, "{first}");

    // Codex's remote compaction: a streamed turn whose input ends with the trigger.
    let body = json!({"model": "sim-model", "stream": true, "tools": tools,
                      "previous_response_id": first["id"],
                      "input": [{"role": "user", "content": "and the docs"},
                                {"type": "compaction_trigger"}]});
    let events = read_sse(post_response(&base, &body).await).await;
    assert_sequence_numbers(&events);
    let kinds = event_kinds(&events);
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let done = &events[4].data["response"];
    let output = done["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{done}");
    assert_eq!(output[0]["type"], "compaction");
    assert_eq!(events[3].data["item"], output[0]);

    // Its item as the history of a new turn, and the stored compaction turn chained on: both
    // run, and the summary is in their prompts.
    let ask = json!({"role": "user", "content": "go on"});
    let (s, fresh) = create(&base, json!({"model": "sim-model", "input": [ask]})).await;
    assert_eq!(s, 200, "{fresh}");
    let (s, replayed) = create(
        &base,
        json!({"model": "sim-model", "input": [output[0].clone(), ask.clone()]}),
    )
    .await;
    assert_eq!(s, 200, "{replayed}");
    let fresh_tokens = fresh["usage"]["input_tokens"].as_u64().unwrap();
    let summary_tokens = done["usage"]["output_tokens"].as_u64().unwrap();
    assert!(
        replayed["usage"]["input_tokens"].as_u64().unwrap() > fresh_tokens + summary_tokens / 2,
        "{replayed}"
    );
    let (s, chained) = create(
        &base,
        json!({"model": "sim-model", "input": [ask], "previous_response_id": done["id"]}),
    )
    .await;
    assert_eq!(s, 200, "{chained}");

    // Too long for the engine (its context is 65,536 tokens): the compaction summarizes less
    // (the oldest tool call and its output go) instead of failing.
    let big = "lorem ipsum dolor sit amet ".repeat(5_000);
    let input = json!([
        {"role": "user", "content": "read the three files"},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": big},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": big},
        {"type": "function_call", "call_id": "c3", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": big},
        {"type": "compaction_trigger"},
    ]);
    let (s, tokens) = {
        let url = format!("{base}/v1/responses/input_tokens");
        let resp = client()
            .post(url)
            .json(&json!({"model": "sim-model", "input": input, "tools": tools}))
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    };
    assert_eq!(s, 200, "{tokens}");
    assert!(
        tokens["input_tokens"].as_u64().unwrap() > 65_536,
        "{tokens}"
    );
    // A model that is not a string is an error, not the first pool's model.
    let resp = client()
        .post(format!("{base}/v1/responses/input_tokens"))
        .json(&json!({"model": 123, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(
        resp.json::<Value>().await.unwrap()["error"]["param"],
        "model"
    );
    // Fields a create would refuse are refused by the count too, naming the field.
    for (field, value) in [
        ("truncation", json!("bogus")),
        ("parallel_tool_calls", json!("yes")),
    ] {
        let resp = client()
            .post(format!("{base}/v1/responses/input_tokens"))
            .json(&json!({"model": "sim-model", "input": "x", field: value}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{field}");
        assert_eq!(resp.json::<Value>().await.unwrap()["error"]["param"], field);
    }
    let (s, shrunk) = create(
        &base,
        json!({"model": "sim-model", "input": input, "tools": tools, "store": false}),
    )
    .await;
    assert_eq!(s, 200, "{shrunk}");
    assert_eq!(shrunk["output"][0]["type"], "compaction", "{shrunk}");
    assert!(shrunk["usage"]["input_tokens"].as_u64().unwrap() < 65_536);

    let m = metrics_text(&base).await;
    assert!(
        m.lines()
            .any(|l| l
                .starts_with("agentgate_compactions_total{pool=\"sim\",status=\"completed\"} ")),
        "{m}"
    );

    // The compact endpoint's refusals.
    let compact = |body: Value| {
        let url = format!("{base}/v1/responses/compact");
        async move {
            let resp = client().post(url).json(&body).send().await.unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    };
    let (s, e) = compact(json!({"model": "sim-model"})).await;
    assert_eq!(
        (s, e["error"]["param"].as_str()),
        (400, Some("input")),
        "{e}"
    );
    let (s, e) = compact(json!({"model": "sim-model", "input": "x", "stream": true})).await;
    assert_eq!(
        (s, e["error"]["param"].as_str()),
        (400, Some("stream")),
        "{e}"
    );
    let (s, e) = compact(json!({"model": "sim-model", "previous_response_id": "resp_gone"})).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("previous_response_not_found")),
        "{e}"
    );
    fleet.shutdown().await;
}

/// `GET /v1/responses/{id}?stream=true[&starting_after=N]` on `base`, read to its end.
async fn follow(base: &str, id: &str, starting_after: Option<u64>) -> Vec<Event> {
    let mut url = format!("{base}/v1/responses/{id}?stream=true");
    if let Some(n) = starting_after {
        url.push_str(&format!("&starting_after={n}"));
    }
    let resp = client().get(url).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    read_sse(resp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_streams_again_from_any_gateway() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("follow");
    // About 20 ms per token at time scale 1: the run lasts a second or so.
    let fleet = Fleet::of(1)
        .time_scale(1.0)
        .store(redis.url(), &prefix)
        .gateways(2)
        .extra("[background]\nmax_concurrent = 1\n")
        .start()
        .await;
    let (a, b) = two_base_urls(&fleet);
    let body = json!({"model": "sim-model", "input": "a long story", "background": true,
                      "max_output_tokens": 48});
    let (s, created) = create(&a, body.clone()).await;
    assert_eq!(s, 200, "{created}");
    let id = created["id"].as_str().unwrap().to_string();

    // Followed on the other gateway while it runs: every event from the first, in order,
    // ending with the terminal event, whose response is the stored one.
    let events = follow(&b, &id, None).await;
    assert_sequence_numbers(&events);
    assert_eq!(events[0].event, "response.created");
    let last = events.last().unwrap();
    assert!(
        last.event == "response.completed" || last.event == "response.incomplete",
        "{}",
        last.event
    );
    assert_eq!(last.data["response"], retrieve(&a, &id).await);
    let deltas: String = events
        .iter()
        .filter(|e| e.event == "response.output_text.delta")
        .map(|e| e.data["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, output_text(&last.data["response"]));

    // Resumed after an event: the rest, the same events.
    let after = 5;
    let rest = follow(&a, &id, Some(after)).await;
    assert_eq!(rest.len(), events.len() - 6);
    for (resumed, original) in rest.iter().zip(&events[6..]) {
        assert_eq!(resumed.data, original.data);
    }
    // Resumed after the last event (a client reconnecting once it had the end): nothing.
    let end = last.data["sequence_number"].as_u64().unwrap();
    assert_eq!(follow(&a, &id, Some(end)).await.len(), 0);

    // A log evicted before its follower came: the stream ends with the stored response.
    assert!(
        redis.delete(&format!("{prefix}events:{id}")),
        "the log was there"
    );
    let evicted = follow(&b, &id, None).await;
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    assert_eq!(evicted[0].event, last.event);
    assert_eq!(evicted[0].data["response"], retrieve(&a, &id).await);

    // Cancelled while still queued behind another run: nothing was generated, and the stream
    // ends with the stored response (status cancelled).
    let (_, busy) = create(&a, body.clone()).await;
    wait_until_running(&a, busy["id"].as_str().unwrap()).await;
    let (_, waiting) = create(&a, body).await;
    let waiting = waiting["id"].as_str().unwrap().to_string();
    assert_eq!(cancel(&b, &waiting).await["status"], "cancelled");
    assert_cancelled_while_queued(&follow(&b, &waiting, None).await);
    cancel(&a, busy["id"].as_str().unwrap()).await;
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_in_instructions_added_to_a_conversation_is_refused() {
    let fleet = Fleet::of(1).start().await;
    let base = fleet.base_url();
    let (s, e) = post_json(
        format!("{base}/v1/conversations"),
        json!({"items": [{"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "style guide"},
            {"type": "input_image", "image_url": "https://x/y.png"}]}]}),
    )
    .await;
    assert_eq!(s, 400, "{e}");
    assert_eq!(e["error"]["param"], "items[0].content[1].type", "{e}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_conversation_takes_no_more_items_and_no_more_turns() {
    let fleet = Fleet::of(1)
        .extra("[store]\nconversation_max_items = 20\n")
        .start()
        .await;
    let base = fleet.base_url();
    let message = |n: usize| json!({"role": "user", "content": format!("note {n}")});
    let (s, conv) = post_json(
        format!("{base}/v1/conversations"),
        json!({"items": (0..19).map(message).collect::<Vec<_>>()}),
    )
    .await;
    assert_eq!(s, 200, "{conv}");
    let id = conv["id"].as_str().unwrap().to_string();
    let add = |n: usize| {
        post_json(
            format!("{base}/v1/conversations/{id}/items"),
            json!({"items": (0..n).map(message).collect::<Vec<_>>()}),
        )
    };
    let turn = || async {
        let body = json!({"model": "sim-model", "input": "next", "conversation": id,
                          "max_output_tokens": 16});
        create(&base, body).await
    };
    let (s, full) = add(2).await;
    assert_eq!(s, 400, "{full}");
    assert_eq!(full["error"]["code"], "conversation_full");
    assert_eq!(full["error"]["param"], "items");
    assert_eq!(add(1).await.0, 200, "the twentieth fits");
    let (s, refused) = turn().await;
    assert_eq!(s, 400, "{refused}");
    assert_eq!(
        (&refused["error"]["code"], &refused["error"]["param"]),
        (&json!("conversation_full"), &json!("conversation"))
    );
    // Counting a prompt's tokens in it adds nothing: not refused.
    let (s, counted) = post_json(
        format!("{base}/v1/responses/input_tokens"),
        json!({"model": "sim-model", "input": "next", "conversation": id}),
    )
    .await;
    assert_eq!(s, 200, "{counted}");
    assert!(counted["input_tokens"].as_u64().unwrap() > 0, "{counted}");
    // Room for one more: a turn goes, its input and answer taking it past the bound.
    let first = get_json(&format!(
        "{base}/v1/conversations/{id}/items?order=asc&limit=1"
    ))
    .await;
    let item = first["data"][0]["id"].as_str().unwrap();
    let deleted = client()
        .delete(format!("{base}/v1/conversations/{id}/items/{item}"))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status().as_u16(), 200);
    let (s, answered) = turn().await;
    assert_eq!(s, 200, "{answered}");
    assert_eq!(add(1).await.0, 400);
    let items = get_json(&format!("{base}/v1/conversations/{id}/items?limit=100")).await;
    assert_eq!(items["data"].as_array().unwrap().len(), 21);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_is_served_by_either_gateway_and_grows_with_each_turn() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("conversations");
    let fleet = Fleet::of(2)
        .store(redis.url(), &prefix)
        .gateways(2)
        .start()
        .await;
    let (a, b) = two_base_urls(&fleet);
    let (s, conv) = post_json(
        format!("{a}/v1/conversations"),
        json!({"items": [{"role": "user", "content": "My name is Ada."}]}),
    )
    .await;
    assert_eq!(s, 200, "{conv}");
    let id = conv["id"].as_str().unwrap().to_string();
    // Turns alternate between the gateways; each sees every earlier item.
    let mut inputs = Vec::new();
    let mut endpoints = Vec::new();
    for (n, gw) in [&b, &a, &b].into_iter().enumerate() {
        let resp = post_response(
            gw,
            &json!({"model": "sim-model", "input": format!("turn {n}"), "conversation": id,
                   "max_output_tokens": 16}),
        )
        .await;
        assert_eq!(resp.status().as_u16(), 200);
        endpoints.push((
            served_endpoint(&resp),
            header(&resp, "x-agentgate-route-reason"),
        ));
        let r: Value = resp.json().await.unwrap();
        assert_eq!(r["conversation"], json!({"id": id}));
        inputs.push(r["usage"]["input_tokens"].as_u64().unwrap());
        // Every turn of one conversation goes to the same replica.
        assert!(
            n == 0 || r["usage"]["input_tokens_details"]["cached_tokens"].as_u64() > Some(0),
            "{endpoints:?} {}",
            r["usage"]
        );
    }
    assert!(inputs.windows(2).all(|w| w[1] > w[0]), "{inputs:?}");
    // Keyed by the conversation id: pinned after the first turn, on both gateways.
    assert!(
        endpoints.windows(2).all(|w| w[0].0 == w[1].0)
            && endpoints[1..].iter().all(|e| e.1 == "pin"),
        "{endpoints:?}"
    );
    let items = get_json(&format!(
        "{a}/v1/conversations/{id}/items?order=asc&limit=100"
    ))
    .await;
    let roles: Vec<&str> = items["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        [
            "user",
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant"
        ]
    );
    fleet.shutdown().await;
}

/// One turn at a time in a conversation, across gateways: while a response runs in it,
/// another response or an item append is refused `conversation_locked` on either gateway; the
/// next turn may start the moment the running one's terminal event is read, and a refused
/// request leaves the conversation unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_runs_one_turn_at_a_time_across_gateways() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("conversation_lock");
    // 50 ms per token: the first turn runs for about ten seconds (each refusal below waits
    // 0.8 s for the lock first).
    let sim = long_answer_sim(50.0, 20_000).await;
    let fleet = Fleet::over(vec![sim])
        .store(redis.url(), &prefix)
        .gateways(2)
        .start()
        .await;
    let (a, b) = two_base_urls(&fleet);
    let new_conversation = || async {
        let (s, conv) = post_json(
            format!("{a}/v1/conversations"),
            json!({"items": [{"role": "user", "content": "Plan a parser."}]}),
        )
        .await;
        assert_eq!(s, 200, "{conv}");
        conv["id"].as_str().unwrap().to_string()
    };
    let id = new_conversation().await;
    let turn = |input: &str, tokens: u32| {
        json!({"model": "sim-model", "input": input, "conversation": id,
               "max_output_tokens": tokens})
    };
    let mut long = turn("a long answer", 200);
    long["stream"] = json!(true);
    let running = post_response(&a, &long).await;
    assert_eq!(running.status(), 200);

    let locked = |(status, body): (u16, Value)| {
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["code"], "conversation_locked", "{body}");
        assert_eq!(body["error"]["param"], "conversation", "{body}");
    };
    locked(create(&b, turn("meanwhile", 16)).await);
    locked(create(&a, turn("meanwhile", 16)).await);
    // A request at fault is told its fault, not that the conversation is busy.
    let mut wrong = turn("meanwhile", 16);
    wrong["model"] = json!("no-such-model");
    let (s, r) = create(&b, wrong).await;
    assert_eq!(
        (s, r["error"]["code"].as_str()),
        (400, Some("model_not_found")),
        "{r}"
    );
    let mut wrong = turn("meanwhile", 16);
    wrong["input"] = json!([{"type": "input_text", "text": "a part, not an item"}]);
    let (s, r) = create(&b, wrong).await;
    assert_eq!(
        (s, r["error"]["param"].as_str()),
        (400, Some("input[0]")),
        "{r}"
    );
    locked(
        post_json(
            format!("{b}/v1/conversations/{id}/items"),
            json!({"items": [{"role": "user", "content": "meanwhile"}]}),
        )
        .await,
    );
    // Another conversation is not held up.
    let other = new_conversation().await;
    let (s, r) = create(
        &b,
        json!({"model": "sim-model", "input": "elsewhere", "conversation": other,
               "max_output_tokens": 16}),
    )
    .await;
    assert_eq!(s, 200, "{r}");

    let events = read_sse(running).await;
    let last = &events.last().unwrap().event;
    assert!(
        last == "response.completed" || last == "response.incomplete",
        "{last}"
    );
    let (s, r) = create(&b, turn("next", 16)).await;
    assert_eq!(s, 200, "the lock outlived the turn: {r}");
    let (s, r) = post_json(
        format!("{a}/v1/conversations/{id}/items"),
        json!({"items": [{"role": "user", "content": "added"}]}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    // A request refused after taking the lock gives it back before it is answered.
    let mut unknown = turn("wrong model", 16);
    unknown["model"] = json!("no-such-model");
    let (s, r) = create(&a, unknown).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["error"]["code"], "model_not_found", "{r}");
    let (s, r) = create(&a, turn("last", 16)).await;
    assert_eq!(s, 200, "{r}");

    // Nothing refused reached the conversation.
    let items = get_json(&format!(
        "{a}/v1/conversations/{id}/items?order=asc&limit=100"
    ))
    .await;
    let texts: Vec<(&str, &str)> = items["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["role"] == "user")
        .map(|i| {
            (
                i["role"].as_str().unwrap(),
                i["content"][0]["text"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        texts,
        [
            ("user", "Plan a parser."),
            ("user", "a long answer"),
            ("user", "next"),
            ("user", "added"),
            ("user", "last")
        ]
    );
    assert_eq!(items["data"].as_array().unwrap().len(), 8);
    fleet.shutdown().await;
}

/// Deleting a background response that waits for a run slot on another gateway gives its
/// conversation back at once: the conversation's next turn is not refused `conversation_locked`
/// while the run that would notice the deletion still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_queued_background_response_frees_its_conversation_on_every_gateway() {
    let redis = TestRedis::start();
    let prefix = unique_prefix("delete_unlocks");
    let sim = long_answer_sim(50.0, 20_000).await;
    let fleet = Fleet::over(vec![sim])
        .store(redis.url(), &prefix)
        .extra("[background]\nmax_concurrent = 1\n")
        .gateways(2)
        .start()
        .await;
    let (a, b) = two_base_urls(&fleet);
    // The one run slot on the first gateway is taken by a long answer.
    let (s, busy) = create(
        &a,
        json!({"model": "sim-model", "input": "a long answer", "background": true,
               "max_output_tokens": 400}),
    )
    .await;
    assert_eq!(s, 200, "{busy}");
    let (s, conv) = post_json(
        format!("{a}/v1/conversations"),
        json!({"items": [{"role": "user", "content": "Plan a parser."}]}),
    )
    .await;
    assert_eq!(s, 200, "{conv}");
    let conv = conv["id"].as_str().unwrap().to_string();
    let turn = |input: &str, background: bool| {
        json!({"model": "sim-model", "input": input, "conversation": conv,
               "max_output_tokens": 16, "background": background})
    };
    let created = std::time::Instant::now();
    let (s, queued) = create(&a, turn("waits for a slot", true)).await;
    assert_eq!(s, 200, "{queued}");
    assert_eq!(queued["status"], "queued", "{queued}");
    // Held while it waits.
    let (s, r) = create(&b, turn("meanwhile", false)).await;
    assert_eq!(s, 400, "{r}");
    assert_eq!(r["error"]["code"], "conversation_locked", "{r}");

    let deleted = reqwest::Client::new()
        .delete(format!(
            "{b}/v1/responses/{}",
            queued["id"].as_str().unwrap()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    let (s, r) = create(&b, turn("next", false)).await;
    assert_eq!(
        s, 200,
        "the deleted response still holds the conversation: {r}"
    );
    // Nor does the queued run take it back when it next renews it (every 10 s).
    tokio::time::sleep(std::time::Duration::from_secs(11).saturating_sub(created.elapsed())).await;
    let (s, r) = create(&b, turn("later", false)).await;
    assert_eq!(s, 200, "the queued run took the conversation back: {r}");

    let (s, r) = post_json(
        format!("{a}/v1/responses/{}/cancel", busy["id"].as_str().unwrap()),
        json!({}),
    )
    .await;
    assert_eq!(s, 200, "{r}");
    fleet.shutdown().await;
}

/// A retrieve stores a background response failed only when its run's lease lapsed: one no
/// lease was ever taken for (run by a gateway from before leases, during a rolling upgrade) is
/// left as it is, and so is one whose lease is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_lapsed_run_lease_fails_a_background_response() {
    let fleet = Fleet::of(1)
        .extra("[background]\norphaned_after_s = 1\n")
        .start()
        .await;
    let base = fleet.base_url();
    let store = fleet.gateway().state().store.clone();
    let created = agentgate::response_object::now_secs() - 60;
    let queued = |n: u32| {
        let id = format!("resp_{}{n:08x}", "0".repeat(40));
        let response = json!({"id": id, "object": "response", "status": "queued",
                              "background": true, "created_at": created, "output": []});
        agentgate_sessions::ResponseRecord {
            id,
            team: agentgate::auth::OPEN_TEAM.into(),
            previous_response_id: None,
            input_items: Vec::new(),
            output_items: Vec::new(),
            response,
        }
    };
    let (legacy, lapsed, alive) = (queued(1), queued(2), queued(3));
    for rec in [&legacy, &lapsed, &alive] {
        store.put(rec).await.unwrap();
    }
    store
        .hold_run(&lapsed.id, std::time::Duration::from_millis(50))
        .await
        .unwrap();
    store
        .hold_run(&alive.id, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let status = |id: String| {
        let base = base.clone();
        async move { get_json(&format!("{base}/v1/responses/{id}")).await }
    };
    assert_eq!(status(legacy.id.clone()).await["status"], "queued");
    assert_eq!(status(alive.id.clone()).await["status"], "queued");
    let lost = status(lapsed.id.clone()).await;
    assert_eq!(
        (&lost["status"], &lost["error"]["code"]),
        (&json!("failed"), &json!("server_error")),
        "{lost}"
    );
    fleet.shutdown().await;
}

/// The base URLs of a fleet's first two gateways.
fn two_base_urls(fleet: &Fleet) -> (String, String) {
    (
        fleet.gateways()[0].base_url(),
        fleet.gateways()[1].base_url(),
    )
}

/// One simulated replica decoding `decode_ms` real milliseconds per token, behind a gateway
/// with `extra` config.
async fn slow_fleet(decode_ms: f64, extra: &str) -> Fleet {
    Fleet::over(vec![slow_sim(decode_ms).await])
        .extra(extra)
        .start()
        .await
}

/// One simulated replica decoding `decode_ms` real milliseconds per token.
async fn slow_sim(decode_ms: f64) -> agentgate_sim::SimHandle {
    agentgate_sim::spawn(slow_sim_config(decode_ms))
        .await
        .unwrap()
}

/// [`slow_sim`] whose answers, unless capped, are about `tokens` long.
async fn long_answer_sim(decode_ms: f64, tokens: usize) -> agentgate_sim::SimHandle {
    agentgate_sim::spawn(agentgate_sim::SimConfig {
        default_output_tokens: tokens,
        ..slow_sim_config(decode_ms)
    })
    .await
    .unwrap()
}

/// The configuration of [`slow_sim`], for tests that change more of it.
fn slow_sim_config(decode_ms: f64) -> agentgate_sim::SimConfig {
    agentgate_sim::SimConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        model: "sim-model".into(),
        decode_ms_per_token: decode_ms,
        time_scale: 1.0,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_closes_when_shutdown_starts_and_the_run_finishes() {
    // 200 ms per token: the run outlives the follow.
    let fleet = slow_fleet(200.0, "[server]\nshutdown_grace_s = 120\n").await;
    let base = fleet.base_url();
    let body = json!({"model": "sim-model", "input": "a story", "background": true,
                      "max_output_tokens": 16});
    let (s, created) = create(&base, body).await;
    assert_eq!(s, 200, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let mut resp = client()
        .get(format!("{base}/v1/responses/{id}?stream=true"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    // The follow is under way (its first event is out) before the shutdown starts.
    let mut text = String::new();
    while !text.contains("\n\n") {
        let chunk = resp
            .chunk()
            .await
            .unwrap()
            .expect("the follow's first event");
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let state = fleet.gateway().state().clone();
    let shutdown = tokio::spawn(fleet.shutdown());
    // The follow ends at the start of the shutdown, before the run's terminal event (it would
    // otherwise follow to the end: the grace is two minutes); the run still finishes.
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let events = parse_sse(&text);
    let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"response.created"), "{kinds:?}");
    let terminal = [
        "response.completed",
        "response.incomplete",
        "response.failed",
    ];
    assert!(kinds.iter().all(|k| !terminal.contains(k)), "{kinds:?}");
    shutdown.await.unwrap();
    let record = state
        .store
        .get(agentgate::auth::OPEN_TEAM, &id)
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(
        record.response["status"], "incomplete",
        "the run went on to its token limit: {}",
        record.response
    );
}

/// The drain signal is raised even when nothing watches it yet: a follow whose task only starts
/// watching after the shutdown began must still see it (it would otherwise follow the run to
/// its end and hold the shutdown for the whole grace).
#[tokio::test]
async fn the_drain_signal_holds_for_follows_that_start_watching_late() {
    let fleet = Fleet::of(1).start().await;
    let state = fleet.gateway().state().clone();
    assert_eq!(state.draining.receiver_count(), 0);
    fleet.shutdown().await;
    assert!(*state.draining.subscribe().borrow());
}

/// A stored turn whose client has left runs on to be stored; a shutdown waits for it within
/// the grace instead of exiting under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_turns_whose_client_has_left() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fleet = slow_fleet(40.0, "[server]\nshutdown_grace_s = 60\n").await;
    let base = fleet.base_url();
    let body = json!({"model": "sim-model", "input": "a story", "stream": true,
                      "max_output_tokens": 30});
    // Read up to the first events for the id, then close the connection.
    let mut socket = tokio::net::TcpStream::connect(base.trim_start_matches("http://"))
        .await
        .unwrap();
    let body = body.to_string();
    let request = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut text = String::new();
    let mut buf = [0u8; 4096];
    while !text.contains("response.in_progress") {
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed early: {text}");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(socket);
    let created = text
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .and_then(|d| serde_json::from_str::<Value>(d).ok())
        .unwrap();
    let id = created["response"]["id"].as_str().unwrap().to_string();
    let state = fleet.gateway().state().clone();
    fleet.shutdown_gateways().await;
    // It ran to the end (its token limit) within the grace, stored under the id its client saw.
    let record = state
        .store
        .get(agentgate::auth::OPEN_TEAM, &id)
        .await
        .unwrap()
        .expect("stored before the shutdown ended");
    assert_eq!(
        record.response["status"], "incomplete",
        "{}",
        record.response
    );
    assert_eq!(record.response["usage"]["output_tokens"], 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_cut_short_by_shutdown_end_as_failed() {
    // Two real seconds per token: no answer finishes within the test.
    let fleet = slow_fleet(
        2_000.0,
        "[server]\nshutdown_grace_s = 0.2\n[background]\nmax_concurrent = 1\n",
    )
    .await;
    let base = fleet.base_url();
    let body = json!({"model": "sim-model", "input": "write a long story", "background": true,
                      "max_output_tokens": 2000});
    let (s, running) = create(&base, body.clone()).await;
    assert_eq!(
        (s, running["status"].as_str()),
        (200, Some("queued")),
        "{running}"
    );
    // the second waits for the only slot
    let (s, queued) = create(&base, body).await;
    assert_eq!(s, 200, "{queued}");
    let mut running_id = running["id"].as_str().unwrap().to_string();
    let mut queued_id = queued["id"].as_str().unwrap().to_string();
    // One of them takes the slot (on a busy machine not always the first).
    let status = |body: Value| body["status"].as_str().unwrap_or_default().to_string();
    let mut statuses = Vec::new();
    for _ in 0..500 {
        statuses = vec![
            status(retrieve(&base, &running_id).await),
            status(retrieve(&base, &queued_id).await),
        ];
        if statuses.iter().any(|s| s == "in_progress") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    if statuses[1] == "in_progress" {
        std::mem::swap(&mut running_id, &mut queued_id);
        statuses.reverse();
    }
    assert_eq!(statuses, ["in_progress", "queued"]);
    // and a stream in the foreground
    let streamed = json!({"model": "sim-model", "input": "another long story", "stream": true,
                          "max_output_tokens": 2000});
    let resp = post_response(&base, &streamed).await;
    assert_eq!(resp.status(), 200);
    let stream = tokio::spawn(async move { resp.text().await.unwrap_or_default() });

    // None can finish within the grace: the stream ends with response.failed and both
    // background responses are recorded as failed, not left running or queued for clients to
    // poll for ever.
    let state = fleet.gateway().state().clone();
    fleet.shutdown().await;
    let text = stream.await.unwrap();
    let last = text
        .lines()
        .rfind(|l| l.starts_with("data: "))
        .and_then(|l| serde_json::from_str::<Value>(&l["data: ".len()..]).ok())
        .expect("a terminal event");
    assert_eq!(last["type"], "response.failed", "{last}");
    assert_eq!(last["response"]["error"]["code"], "server_shutdown");
    for id in [&running_id, &queued_id] {
        let record = state
            .store
            .get(agentgate::auth::OPEN_TEAM, id)
            .await
            .unwrap()
            .expect("still stored");
        assert_eq!(
            record.response["status"], "failed",
            "{id}: {}",
            record.response
        );
        assert_eq!(record.response["error"]["code"], "server_shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_in_utf8_keeps_its_session_on_one_replica() {
    let fleet = Fleet::of(4).start().await;
    let base = fleet.base_url();
    let session = "sesión-42";
    let value = reqwest::header::HeaderValue::from_bytes(session.as_bytes()).unwrap();
    let mut turns = Vec::new();
    for _ in 0..3 {
        let resp = client()
            .post(format!("{base}/v1/responses"))
            .header("x-session-id", value.clone())
            .json(&json!({"model": "sim-model", "input": "next step", "store": false}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        turns.push((
            header(&resp, agentgate::responses::ENDPOINT_HEADER),
            header(&resp, agentgate::responses::ROUTE_REASON_HEADER),
        ));
    }
    assert!(turns.iter().all(|(e, _)| e == &turns[0].0), "{turns:?}");
    assert!(turns[1..].iter().all(|(_, r)| r == "pin"), "{turns:?}");
    let pin = fleet
        .gateway()
        .state()
        .store
        .get_pin("sim", &format!("h:{session}"))
        .await
        .unwrap();
    assert_eq!(pin.map(|p| p.endpoint), Some(turns[0].0.clone()));
    fleet.shutdown().await;
}
