//! Closed-loop HTTP load: a fixed number of workers, each sending its next request as soon as the
//! previous one finishes, over one shared connection pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::stats::LatencySummary;

/// What to send, how hard and for how long.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// Full URL every request is POSTed to.
    pub url: String,
    /// Number of requests in flight at all times.
    pub concurrency: usize,
    /// Time spent sending before measuring (connections open, caches fill).
    pub warmup: Duration,
    /// Measured window.
    pub duration: Duration,
    /// JSON bodies, used round-robin.
    pub bodies: Arc<Vec<Bytes>>,
}

/// Outcome of the measured window.
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// Successful (2xx) responses completed inside the window.
    pub completed: u64,
    /// Failed requests (transport errors or non-2xx) completed inside the window.
    pub errors: u64,
    /// Length of the measured window.
    pub window: Duration,
    /// Latency of the successful requests completed inside the window.
    pub latency: LatencySummary,
    /// The first error seen, to show what went wrong.
    pub first_error: Option<String>,
}

impl LoadReport {
    /// Successful requests per second over the window.
    pub fn requests_per_s(&self) -> f64 {
        let secs = self.window.as_secs_f64();
        if secs > 0.0 {
            self.completed as f64 / secs
        } else {
            0.0
        }
    }
}

/// Per-worker tallies, merged at the end so workers never contend on shared state.
#[derive(Default)]
struct WorkerTally {
    latencies: Vec<Duration>,
    errors: u64,
    first_error: Option<String>,
}

/// Run the plan to completion and report the measured window.
pub async fn run_closed_loop(client: reqwest::Client, plan: LoadPlan) -> LoadReport {
    let started = Instant::now();
    let measure_from = started + plan.warmup;
    let stop_at = measure_from + plan.duration;
    let mut workers = Vec::with_capacity(plan.concurrency);
    for worker in 0..plan.concurrency.max(1) {
        let client = client.clone();
        let url = plan.url.clone();
        let bodies = Arc::clone(&plan.bodies);
        workers.push(tokio::spawn(async move {
            let mut tally = WorkerTally::default();
            let mut next_body = worker;
            loop {
                let sent = Instant::now();
                if sent >= stop_at {
                    break;
                }
                let body = match bodies.get(next_body % bodies.len().max(1)) {
                    Some(body) => body.clone(),
                    None => Bytes::from_static(b"{}"),
                };
                next_body = next_body.wrapping_add(1);
                let outcome = send_one(&client, &url, body).await;
                let done = Instant::now();
                if done < measure_from || done > stop_at {
                    continue;
                }
                match outcome {
                    Ok(()) => tally.latencies.push(done - sent),
                    Err(e) => {
                        tally.errors += 1;
                        tally.first_error.get_or_insert(e);
                    }
                }
            }
            tally
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for worker in workers {
        match worker.await {
            Ok(tally) => {
                latencies.extend(tally.latencies);
                errors += tally.errors;
                if first_error.is_none() {
                    first_error = tally.first_error;
                }
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(format!("load worker failed: {e}"));
            }
        }
    }
    LoadReport {
        completed: latencies.len() as u64,
        errors,
        window: plan.duration,
        latency: LatencySummary::from_samples(&mut latencies),
        first_error,
    }
}

/// POST one JSON body and read the whole response (so the connection can be reused).
async fn send_one(client: &reqwest::Client, url: &str, body: Bytes) -> Result<(), String> {
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    let status = response.status();
    let bytes = response
        .bytes()
        .await
        .map_err(|e| format!("reading the response failed: {e}"))?;
    if status.is_success() {
        Ok(())
    } else {
        let snippet = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
        Err(format!("HTTP {status}: {snippet}"))
    }
}
