//! Latency summaries: nearest-rank percentiles over recorded samples.

use serde::Serialize;
use std::time::Duration;

/// Latency distribution of one run, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Number of samples summarised.
    pub samples: usize,
    /// Median latency.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Mean latency.
    pub mean_ms: f64,
    /// Slowest sample.
    pub max_ms: f64,
}

impl LatencySummary {
    /// Summarise `samples` (sorted in place); all zeros when there are none.
    pub fn from_samples(samples: &mut [Duration]) -> Self {
        samples.sort_unstable();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let total: f64 = samples.iter().copied().map(ms).sum();
        LatencySummary {
            samples: samples.len(),
            p50_ms: percentile(samples, 50.0).map_or(0.0, ms),
            p90_ms: percentile(samples, 90.0).map_or(0.0, ms),
            p99_ms: percentile(samples, 99.0).map_or(0.0, ms),
            mean_ms: if samples.is_empty() {
                0.0
            } else {
                total / samples.len() as f64
            },
            max_ms: samples.last().copied().map_or(0.0, ms),
        }
    }
}

/// Nearest-rank percentile of sorted samples: the smallest value with at least `p`% at or below it.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let summary = LatencySummary::from_samples(&mut samples);
        assert_eq!(summary.samples, 100);
        assert_eq!(summary.p50_ms, 50.0);
        assert_eq!(summary.p90_ms, 90.0);
        assert_eq!(summary.p99_ms, 99.0);
        assert_eq!(summary.max_ms, 100.0);
        assert_eq!(summary.mean_ms, 50.5);
        assert_eq!(
            percentile(&[Duration::from_millis(7)], 99.0),
            Some(Duration::from_millis(7))
        );
        assert_eq!(LatencySummary::from_samples(&mut []).p99_ms, 0.0);
    }
}
