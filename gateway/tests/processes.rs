//! Two `agentgate` processes on one Redis, started from the built binary the way an operator
//! runs them: one config file, `agentgate serve --config F --listen 127.0.0.1:0`, SIGTERM to
//! stop. What they must share lives only in the store, so this is the test that nothing of it
//! hides in process memory: a team's request budget, a conversation's turns and its stored
//! responses.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use agentgate_sessions::testing::{unique_prefix, TestRedis};
use serde_json::{json, Value};

/// A gateway process; killed if the test ends without stopping it.
struct Process {
    child: Child,
    base: String,
}

impl Process {
    /// Start `agentgate serve` on `config` and wait for the address it logs.
    fn start(config: &std::path::Path) -> Process {
        let mut child = Command::new(env!("CARGO_BIN_EXE_agentgate"))
            .arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the agentgate binary starts");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        // Keep reading so the process never blocks on a full pipe; the first address wins.
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !sent {
                    let url = line.split("listening on ").nth(1);
                    if let Some(url) = url.and_then(|rest| rest.split_whitespace().next()) {
                        let _ = tx.send(url.to_string());
                        sent = true;
                    }
                }
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("agentgate logs its listening address");
        Process { child, base }
    }

    /// SIGTERM, then wait for the exit.
    fn stop(mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM {pid}");
        self.child.wait().expect("agentgate exits")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config_file(text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", unique_prefix("agentgate_processes")));
    std::fs::write(&path, text).expect("write the config");
    path
}

async fn post(
    base: &str,
    key: Option<&str>,
    body: Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/responses"))
        .json(&body);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.json().await.expect("JSON body");
    (status, headers, body)
}

fn remaining(headers: &reqwest::header::HeaderMap) -> &str {
    headers
        .get("x-ratelimit-remaining-requests")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("missing")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_share_budgets_and_conversations_through_redis() {
    let redis = TestRedis::start();
    let sim = agentgate_sim::spawn(agentgate_sim::SimConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        model: "sim-model".to_string(),
        ..Default::default()
    })
    .await
    .expect("simulator starts");
    let config = config_file(&format!(
        "[store]\nurl = \"{}\"\nkey_prefix = \"{}\"\n\n\
         [[pools]]\nname = \"sim\"\nmodel = \"sim-model\"\nendpoints = [\"{}\"]\n\n\
         [[teams]]\nname = \"shared\"\napi_key_sha256 = [\"{}\"]\nrequests_per_minute = 3\n\n\
         [[teams]]\nname = \"chat\"\napi_key_sha256 = [\"{}\"]\n",
        redis.url(),
        unique_prefix("processes"),
        sim.base_url(),
        agentgate::auth::hash_key("sk-shared"),
        agentgate::auth::hash_key("sk-chat"),
    ));
    let a = Process::start(&config);
    let b = Process::start(&config);
    let hello = json!({"model": "sim-model", "input": "hello there", "max_output_tokens": 16});

    // One team budget: three requests a minute across both processes.
    let mut seen = Vec::new();
    for gw in [&a, &b, &a] {
        let (status, headers, body) = post(&gw.base, Some("sk-shared"), hello.clone()).await;
        assert_eq!(status, 200, "{body}");
        seen.push(remaining(&headers).to_string());
    }
    assert_eq!(seen, ["2", "1", "0"], "one budget across both processes");
    let (status, headers, body) = post(&b.base, Some("sk-shared"), hello.clone()).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded_requests");
    assert!(headers.get("retry-after").is_some());

    // One conversation: a turn on one process continues on the other, and either retrieves it.
    let (status, _, first) = post(&a.base, Some("sk-chat"), hello.clone()).await;
    assert_eq!(status, 200, "{first}");
    let first_id = first["id"].as_str().expect("response id").to_string();
    let mut next = hello.clone();
    next["previous_response_id"] = json!(first_id);
    let (status, _, second) = post(&b.base, Some("sk-chat"), next).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], json!(first_id));
    let stored: Value = reqwest::Client::new()
        .get(format!("{}/v1/responses/{first_id}", b.base))
        .bearer_auth("sk-chat")
        .send()
        .await
        .expect("retrieve")
        .json()
        .await
        .expect("JSON body");
    assert_eq!(stored["id"], json!(first_id));
    assert_eq!(stored["output"], first["output"]);

    // SIGTERM is a clean stop.
    assert!(a.stop().success());
    assert!(b.stop().success());
    let _ = std::fs::remove_file(&config);
    sim.shutdown().await;
}
