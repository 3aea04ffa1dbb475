//! End to end: a simulator publishing vLLM KV events over ZMQ to a bound SUB socket; replaying
//! every received event must reproduce exactly the simulator's cached block set, evictions and
//! blocks filled by generated tokens included, with an instant and with a timed engine.

use std::collections::HashSet;
use std::time::Duration;

use agentgate_sim::kv_events::{decode_payload, KvEvent, KvEventBatch};
use agentgate_sim::SimConfig;
use futures_util::StreamExt;
use serde_json::json;
use zeromq::{Socket, SocketEvent, SocketRecv};

/// A decoded frame: its sequence number and payload.
type Frame = (u64, KvEventBatch);

/// Receive frames in the background so the test can poll without owning the socket.
fn spawn_receiver(mut sub: zeromq::SubSocket) -> tokio::sync::mpsc::UnboundedReceiver<Frame> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(message) = sub.recv().await {
            assert_eq!(message.len(), 3, "frames are [topic, seq, payload]");
            let seq_frame = message.get(1).expect("sequence frame");
            let seq = u64::from_be_bytes(seq_frame[..].try_into().expect("8-byte sequence"));
            let batch = decode_payload(message.get(2).expect("payload frame")).expect("decodes");
            if tx.send((seq, batch)).is_err() {
                break;
            }
        }
    });
    rx
}

/// Apply one batch to the replayed cache view; returns how many blocks it removed.
fn replay(cached: &mut HashSet<u64>, batch: &KvEventBatch) -> usize {
    let mut removed = 0;
    for event in &batch.events {
        match event {
            KvEvent::BlockStored { block_hashes, .. } => cached.extend(block_hashes),
            KvEvent::BlockRemoved { block_hashes } => {
                for hash in block_hashes {
                    removed += usize::from(cached.remove(hash));
                }
            }
            KvEvent::AllBlocksCleared => cached.clear(),
        }
    }
    removed
}

/// A prompt of `words` distinct-ish words; `family` picks a shared prefix so some requests hit.
fn prompt(family: usize, variant: usize, words: usize) -> String {
    (0..words)
        .map(|i| {
            if i < words / 2 {
                format!("fam{family}w{i}")
            } else {
                format!("v{variant}w{i}")
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_events_match_the_cache_exactly() {
    replay_scenario(0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_events_match_the_cache_of_a_timed_engine() {
    replay_scenario(0.0001).await;
}

async fn replay_scenario(time_scale: f64) {
    // The consumer binds; a simulator given a specific tcp://host:port connects, as vLLM does.
    let mut sub = zeromq::SubSocket::new();
    let mut sub_events = sub.monitor();
    let bound = sub
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind SUB socket");
    sub.subscribe("").await.expect("subscribe");

    let config = SimConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        kv_events: Some(bound.to_string()),
        kv_events_topic: "kv@sim".into(),
        block_size: 4,
        kv_blocks: 48,
        time_scale,
        ..SimConfig::default()
    };
    let sim = agentgate_sim::spawn(config).await.expect("spawn simulator");
    let base_url = format!("http://{}", sim.local_addr());

    // Wait for the publisher to connect before generating events (ZMQ PUB drops frames sent
    // before a subscriber is attached).
    let mut attached = false;
    for _ in 0..200 {
        match tokio::time::timeout(Duration::from_millis(50), sub_events.next()).await {
            Ok(Some(SocketEvent::Accepted(..))) => {
                attached = true;
                break;
            }
            Ok(None) => break,
            _ => continue,
        }
    }
    assert!(
        attached,
        "the simulator's publisher never connected to {bound}"
    );
    let mut frames = spawn_receiver(sub);

    // The connection is up, but PUB drops frames until it has registered the subscription,
    // which it does in its own time: reset the (empty) cache until a frame arrives, then
    // let the rest of those probes arrive and replay from the sequence number after them.
    let client = reqwest::Client::new();
    let mut last_probe = None;
    for _ in 0..200 {
        reset_cache(&client, &base_url).await;
        if let Ok(Some((seq, _))) =
            tokio::time::timeout(Duration::from_millis(50), frames.recv()).await
        {
            last_probe = Some(seq);
            break;
        }
    }
    let mut last_probe = last_probe.expect("the publisher's frames reach the subscriber");
    while let Ok(Some((seq, _))) =
        tokio::time::timeout(Duration::from_millis(200), frames.recv()).await
    {
        last_probe = seq;
    }
    let mut stream = Replay {
        next_seq: last_probe + 1,
        ..Replay::default()
    };
    for round in 0..40 {
        chat(&client, &base_url, &prompt(round % 5, round, 24)).await;
    }
    stream.settle(&mut frames, &sim).await;
    // two-turn conversations: the second turn hits blocks filled by the first turn's answer
    let mut hit_an_answer = false;
    for round in 0..4 {
        let first_turn = vec![json!({"role": "user", "content": prompt(7, round, 10)})];
        let answer = send(&client, &base_url, &first_turn, 9).await;
        let (prompt_tokens, output_tokens) = (
            answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
            answer["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        );
        let mut second_turn = first_turn.clone();
        second_turn.push(json!({"role": "assistant",
            "content": answer["choices"][0]["message"]["content"]}));
        second_turn.push(json!({"role": "user", "content": "more"}));
        let next = send(&client, &base_url, &second_turn, 3).await;
        let cached = next["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        hit_an_answer |= cached > prompt_tokens / 4 * 4 && cached <= prompt_tokens + output_tokens;
    }
    assert!(
        hit_an_answer,
        "second turns hit blocks of the first turns' answers"
    );
    stream.settle(&mut frames, &sim).await;
    assert!(stream.removed > 0, "the small cache evicted blocks");
    assert!(!stream.cached.is_empty(), "some blocks stay cached");

    // Clearing the cache publishes AllBlocksCleared; later stores are replayed on top of it.
    reset_cache(&client, &base_url).await;
    for round in 0..3 {
        chat(&client, &base_url, &prompt(9, round, 12)).await;
    }
    stream.settle(&mut frames, &sim).await;
    assert!(stream.cleared, "the reset was published");
    sim.shutdown().await;
}

/// Clear the simulator's prefix cache and insist it succeeds.
async fn reset_cache(client: &reqwest::Client, base_url: &str) {
    let reset = client
        .post(format!("{base_url}/reset_prefix_cache"))
        .send()
        .await
        .expect("reset request");
    assert!(
        reset.status().is_success(),
        "reset failed: {}",
        reset.status()
    );
}

/// Send one small non-streaming chat completion and insist it succeeds.
async fn chat(client: &reqwest::Client, base_url: &str, content: &str) {
    send(
        client,
        base_url,
        &[json!({"role": "user", "content": content})],
        3,
    )
    .await;
}

/// Send `messages` as a non-streaming chat completion, insist it succeeds, return the response.
async fn send(
    client: &reqwest::Client,
    base_url: &str,
    messages: &[serde_json::Value],
    max_tokens: usize,
) -> serde_json::Value {
    let body = json!({
        "model": "sim-model",
        "messages": messages,
        "max_tokens": max_tokens,
    });
    let response = client
        .post(format!("{base_url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("chat request");
    let status = response.status();
    let text = response.text().await.expect("chat body");
    assert!(status.is_success(), "chat request failed: {status} {text}");
    serde_json::from_str(&text).expect("chat response is JSON")
}

/// The cache as seen by a consumer of the event stream.
#[derive(Default)]
struct Replay {
    cached: HashSet<u64>,
    next_seq: u64,
    removed: usize,
    cleared: bool,
}

impl Replay {
    /// Consume frames until none arrive for a poll and the replayed set equals the simulator's
    /// cache (bounded number of polls); fails with the difference otherwise.
    async fn settle(
        &mut self,
        frames: &mut tokio::sync::mpsc::UnboundedReceiver<Frame>,
        sim: &agentgate_sim::SimHandle,
    ) {
        for _ in 0..100 {
            let mut progressed = false;
            while let Ok(Some((seq, batch))) =
                tokio::time::timeout(Duration::from_millis(100), frames.recv()).await
            {
                assert_eq!(seq, self.next_seq, "frames arrive in order with no gaps");
                self.next_seq += 1;
                self.removed += replay(&mut self.cached, &batch);
                self.cleared |= batch
                    .events
                    .iter()
                    .any(|e| matches!(e, KvEvent::AllBlocksCleared));
                progressed = true;
            }
            let cached: HashSet<u64> = sim.cached_block_hashes().into_iter().collect();
            if !progressed && cached == self.cached {
                return;
            }
        }
        let cached: HashSet<u64> = sim.cached_block_hashes().into_iter().collect();
        panic!(
            "replayed {} blocks, cache holds {}; missing {:?}, extra {:?}",
            self.cached.len(),
            cached.len(),
            cached.difference(&self.cached).take(5).collect::<Vec<_>>(),
            self.cached.difference(&cached).take(5).collect::<Vec<_>>()
        );
    }
}
