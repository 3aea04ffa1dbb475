//! Engine-side numbers: scraping the replicas' Prometheus `/metrics` (vLLM names plus the
//! simulator's own counters) at the end of a run and periodically while it runs.

use std::time::Duration;

use serde::Serialize;

use super::clock::SimClock;

/// Simulated seconds the engine spent running steps (prefill or decode), when the sim exposes it.
pub const BUSY_SECONDS: &str = "agentgate_sim_engine_busy_seconds_total";
/// Prompt tokens the engine actually prefilled (not served from cache), when the sim exposes it.
pub const PREFILL_COMPUTED: &str = "agentgate_sim_prefill_tokens_computed_total";

/// The counters and gauges of one replica at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ReplicaMetrics {
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: f64,
    /// `vllm:prefix_cache_hits_total`.
    pub prefix_cache_hits: f64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: f64,
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// [`BUSY_SECONDS`], if exposed.
    pub busy_seconds: Option<f64>,
    /// [`PREFILL_COMPUTED`], if exposed.
    pub prefill_computed: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (0..1: share of KV blocks held by requests).
    pub kv_usage: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: f64,
}

/// Sum of a metric over every series of that name in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // The name must end here: a label set or the value follows.
        let value_text = if let Some(labels) = rest.strip_prefix('{') {
            match labels.rfind('}') {
                Some(end) => labels.get(end + 1..).unwrap_or(""),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            rest
        } else {
            continue;
        };
        if let Some(value) = value_text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}

/// Parse the numbers this benchmark reads from one replica's exposition.
pub fn parse_replica(text: &str) -> ReplicaMetrics {
    let get = |name: &str| metric_sum(text, name).unwrap_or(0.0);
    ReplicaMetrics {
        prompt_tokens: get("vllm:prompt_tokens_total"),
        prefix_cache_hits: get("vllm:prefix_cache_hits_total"),
        generation_tokens: get("vllm:generation_tokens_total"),
        running: get("vllm:num_requests_running"),
        waiting: get("vllm:num_requests_waiting"),
        busy_seconds: metric_sum(text, BUSY_SECONDS),
        prefill_computed: metric_sum(text, PREFILL_COMPUTED),
        kv_usage: get("vllm:kv_cache_usage_perc"),
        preemptions: get("vllm:num_preemptions_total"),
    }
}

/// GET `base_url/metrics` and parse it.
pub async fn scrape(client: &reqwest::Client, base_url: &str) -> Result<ReplicaMetrics, String> {
    let url = format!("{base_url}/metrics");
    let response = client
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| format!("cannot scrape {url}: {e}"))?;
    let text = response
        .text()
        .await
        .map_err(|e| format!("cannot read {url}: {e}"))?;
    Ok(parse_replica(&text))
}

/// Engine totals over the fleet at the end of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FleetMetrics {
    /// Prompt tokens the engines admitted.
    pub prompt_tokens: u64,
    /// Prompt tokens the engines found in their prefix caches.
    pub prefix_cache_hits: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Prompt tokens actually prefilled (the sim's counter, else prompt - hits).
    pub prefill_tokens_computed: u64,
    /// Whether `prefill_tokens_computed` comes from the sim's own counter.
    pub prefill_counter_exposed: bool,
    /// Simulated engine busy seconds summed over replicas (None when the sim does not expose it).
    pub busy_seconds: Option<f64>,
    /// Sequences preempted for lack of KV blocks (`vllm:num_preemptions_total`), summed.
    pub preemptions: u64,
    /// Per replica, in replica order.
    pub replicas: Vec<ReplicaMetrics>,
}

/// Scrape every replica once and add up the fleet's totals.
pub async fn scrape_fleet(
    client: &reqwest::Client,
    urls: &[String],
) -> Result<FleetMetrics, String> {
    let mut replicas = Vec::with_capacity(urls.len());
    for url in urls {
        replicas.push(scrape(client, url).await?);
    }
    Ok(fleet_totals(replicas))
}

/// Add up per-replica numbers.
pub fn fleet_totals(replicas: Vec<ReplicaMetrics>) -> FleetMetrics {
    let sum = |f: fn(&ReplicaMetrics) -> f64| replicas.iter().map(f).sum::<f64>();
    let prompt_tokens = sum(|r| r.prompt_tokens).round() as u64;
    let prefix_cache_hits = sum(|r| r.prefix_cache_hits).round() as u64;
    let exposed = !replicas.is_empty() && replicas.iter().all(|r| r.prefill_computed.is_some());
    let prefill_tokens_computed = if exposed {
        sum(|r| r.prefill_computed.unwrap_or(0.0)).round() as u64
    } else {
        prompt_tokens.saturating_sub(prefix_cache_hits)
    };
    let busy_seconds = (!replicas.is_empty() && replicas.iter().all(|r| r.busy_seconds.is_some()))
        .then(|| sum(|r| r.busy_seconds.unwrap_or(0.0)));
    FleetMetrics {
        prompt_tokens,
        prefix_cache_hits,
        generation_tokens: sum(|r| r.generation_tokens).round() as u64,
        prefill_tokens_computed,
        prefill_counter_exposed: exposed,
        busy_seconds,
        preemptions: sum(|r| r.preemptions).round() as u64,
        replicas,
    }
}

/// Every replica's metrics at one simulated moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Simulated seconds since the replay started.
    pub t_s: f64,
    /// Per replica, in replica order (a failed scrape repeats zeros).
    pub replicas: Vec<ReplicaMetrics>,
}

/// Each of `replicas` replicas' mean running + waiting requests over `samples`: its load as
/// its engine saw it, averaged over the run (a failed scrape, as after a kill, counts as 0).
/// Empty without samples.
pub fn mean_load(samples: &[Sample], replicas: usize) -> Vec<f64> {
    if samples.is_empty() {
        return Vec::new();
    }
    let mut sums = vec![0.0; replicas];
    for sample in samples {
        for (sum, replica) in sums.iter_mut().zip(&sample.replicas) {
            *sum += replica.running + replica.waiting;
        }
    }
    let n = samples.len() as f64;
    sums.into_iter().map(|sum| sum / n).collect()
}

/// Scrapes the fleet periodically in the background until stopped.
pub struct Sampler {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

/// Wall time between two samples.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);

impl Sampler {
    /// Start sampling `urls` every half second of wall time.
    pub fn start(client: reqwest::Client, urls: Vec<String>, clock: SimClock) -> Sampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                let t_s = clock.now_s();
                let mut replicas = Vec::with_capacity(urls.len());
                for url in &urls {
                    replicas.push(scrape(&client, url).await.unwrap_or_default());
                }
                samples.push(Sample { t_s, replicas });
            }
            samples
        });
        Sampler { stop, task }
    }

    /// Stop and return the samples taken.
    pub async fn stop(self) -> Vec<Sample> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_load_averages_running_and_waiting_per_replica() {
        let replica = |running: f64, waiting: f64| ReplicaMetrics {
            running,
            waiting,
            ..ReplicaMetrics::default()
        };
        let samples = [
            Sample {
                t_s: 0.0,
                replicas: vec![replica(4.0, 2.0), replica(1.0, 0.0)],
            },
            // A failed scrape of the second replica reads as zeros.
            Sample {
                t_s: 1.0,
                replicas: vec![replica(2.0, 0.0), replica(0.0, 0.0)],
            },
        ];
        assert_eq!(mean_load(&samples, 2), [4.0, 0.5]);
        assert!(mean_load(&[], 2).is_empty());
    }

    const EXPOSITION: &str = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0
vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 1000.0
vllm:prompt_tokens_total_extra{engine=\"0\"} 5.0
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 600.0
vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 50.0
vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 2.0
";

    #[test]
    fn parses_vllm_names_and_optional_sim_counters() {
        let metrics = parse_replica(EXPOSITION);
        assert_eq!(metrics.running, 3.0);
        assert_eq!(metrics.waiting, 1.0);
        assert_eq!(
            metrics.prompt_tokens, 1000.0,
            "a longer name is another metric"
        );
        assert_eq!(metrics.prefix_cache_hits, 600.0);
        assert_eq!(metrics.busy_seconds, None);
        let with_busy =
            format!("{EXPOSITION}{BUSY_SECONDS} 2.5\n{PREFILL_COMPUTED}{{a=\"b\"}} 400\n");
        let metrics = parse_replica(&with_busy);
        assert_eq!(metrics.busy_seconds, Some(2.5));
        assert_eq!(metrics.prefill_computed, Some(400.0));
    }

    #[test]
    fn fleet_falls_back_to_prompt_minus_hits() {
        let one = parse_replica(EXPOSITION);
        let fleet = fleet_totals(vec![one, one]);
        assert_eq!(fleet.prompt_tokens, 2000);
        assert_eq!(fleet.prefill_tokens_computed, 800);
        assert!(!fleet.prefill_counter_exposed);
        assert_eq!(fleet.busy_seconds, None);
        assert_eq!(fleet.preemptions, 4);
    }
}
