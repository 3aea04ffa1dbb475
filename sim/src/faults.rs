//! Fault injection: per request via the `x-sim-fault` header, globally via `/sim/faults`.
//!
//! A fault spec is a comma-separated list of `key=value` pairs (header) or a JSON object (admin
//! endpoint) with the same keys:
//! - `status=503`: answer with this HTTP status and an engine-shaped error body;
//! - `stall_ms=2000`: hold the first token back this many wall milliseconds;
//! - `cut_after=3`: drop the connection after 3 SSE chunks (non-streaming: before the body);
//! - `abort_after=3` (streaming): after 3 SSE chunks end the request as vLLM ends one it aborts:
//!   a chunk with `finish_reason: "abort"`, the usage chunk if asked for, `data: [DONE]`;
//! - `slow=4`: run 4x slower (global: every engine step; per request: its token delivery);
//! - `unhealthy=true` (global only): `/health` answers 503;
//! - `health_stall_ms=1500` (global only): `/health` answers this many wall milliseconds late
//!   (SGLang's `/health` generates a token and answers a second or more later);
//! - `times=1` (global only): the request faults apply to the next request only (or the next
//!   N), then the global set is cleared.

use std::sync::RwLock;

use serde::{Deserialize, Serialize};

/// One set of faults; all fields optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// Fail with this HTTP status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Stall before the first token, wall milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_ms: Option<u64>,
    /// Cut the stream after this many chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_after: Option<usize>,
    /// End the stream with `finish_reason: "abort"` after this many chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_after: Option<usize>,
    /// Slow-down factor (>= 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow: Option<f64>,
    /// Report unhealthy on `/health`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unhealthy: bool,
    /// Answer `/health` this many wall milliseconds late.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_stall_ms: Option<u64>,
    /// Global only: apply to the next this many requests, then clear the global set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u32>,
    /// Whether `stall_ms` is the global one (set by [`FaultSpec::merged_with`]): such a stall
    /// follows the global faults while it lasts.
    #[serde(skip)]
    pub stall_is_global: bool,
}

impl FaultSpec {
    /// Parse the `x-sim-fault` header value (`status=503,stall_ms=100`).
    pub fn parse_header(value: &str) -> Result<FaultSpec, String> {
        let mut spec = FaultSpec::default();
        for part in value
            .split([',', ';'])
            .map(str::trim)
            .filter(|part| !part.is_empty())
        {
            let (key, raw) = part.split_once('=').unwrap_or((part, "true"));
            let bad = || {
                format!("x-sim-fault: cannot parse `{part}`; use status=503, stall_ms=N, cut_after=N, abort_after=N, slow=F or unhealthy")
            };
            match key.trim() {
                "status" => spec.status = Some(raw.trim().parse().map_err(|_| bad())?),
                "stall_ms" => spec.stall_ms = Some(raw.trim().parse().map_err(|_| bad())?),
                "cut_after" => spec.cut_after = Some(raw.trim().parse().map_err(|_| bad())?),
                "abort_after" => {
                    spec.abort_after = Some(raw.trim().parse().map_err(|_| bad())?);
                }
                "slow" => spec.slow = Some(raw.trim().parse().map_err(|_| bad())?),
                "unhealthy" => spec.unhealthy = raw.trim().parse().map_err(|_| bad())?,
                _ => return Err(bad()),
            }
        }
        Ok(spec)
    }

    /// Combine a global spec with a per-request one (the request wins where both are set).
    pub fn merged_with(&self, request: &FaultSpec) -> FaultSpec {
        FaultSpec {
            status: request.status.or(self.status),
            stall_ms: request.stall_ms.or(self.stall_ms),
            cut_after: request.cut_after.or(self.cut_after),
            abort_after: request.abort_after.or(self.abort_after),
            slow: request.slow,
            unhealthy: self.unhealthy || request.unhealthy,
            health_stall_ms: self.health_stall_ms,
            times: None,
            // (A counted set's stall is the request's own: the set is cleared once handed out.)
            stall_is_global: request.stall_ms.is_none()
                && self.stall_ms.is_some()
                && self.times.is_none(),
        }
    }

    /// Whether nothing is set.
    pub fn is_empty(&self) -> bool {
        *self == FaultSpec::default()
    }
}

/// The global faults of one replica.
#[derive(Debug, Default)]
pub struct FaultState {
    global: RwLock<FaultSpec>,
}

impl FaultState {
    /// Current global faults.
    pub fn global(&self) -> FaultSpec {
        self.global
            .read()
            .map(|spec| spec.clone())
            .unwrap_or_default()
    }

    /// The global faults a new request gets: with `times` set, one of those uses is spent
    /// (the last clears the set).
    pub fn for_request(&self) -> FaultSpec {
        let Ok(mut global) = self.global.write() else {
            return FaultSpec::default();
        };
        let spec = global.clone();
        match global.times {
            Some(0) => return FaultSpec::default(),
            Some(1) => *global = FaultSpec::default(),
            Some(n) => global.times = Some(n - 1),
            None => {}
        }
        spec
    }

    /// Replace the global faults.
    pub fn set(&self, spec: FaultSpec) {
        if let Ok(mut global) = self.global.write() {
            *global = spec;
        }
    }

    /// Engine-wide slow-down factor (1.0 when none).
    pub fn global_slow_factor(&self) -> f64 {
        self.global
            .read()
            .ok()
            .and_then(|spec| spec.slow)
            .unwrap_or(1.0)
            .max(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counted_global_set_applies_that_many_times() {
        let state = FaultState::default();
        state.set(FaultSpec {
            abort_after: Some(0),
            times: Some(2),
            ..FaultSpec::default()
        });
        assert_eq!(state.for_request().abort_after, Some(0));
        assert_eq!(state.for_request().abort_after, Some(0));
        assert!(state.for_request().is_empty());
        assert!(state.global().is_empty(), "cleared once spent");
        // Without a count it stays.
        state.set(FaultSpec {
            status: Some(503),
            ..FaultSpec::default()
        });
        for _ in 0..3 {
            assert_eq!(state.for_request().status, Some(503));
        }
    }

    #[test]
    fn header_specs_parse_and_merge() {
        let spec = FaultSpec::parse_header("status=503, stall_ms=20;cut_after=3,slow=2.5")
            .unwrap_or_default();
        assert_eq!(spec.status, Some(503));
        assert_eq!(spec.stall_ms, Some(20));
        assert_eq!(spec.cut_after, Some(3));
        assert_eq!(spec.slow, Some(2.5));
        assert!(FaultSpec::parse_header("status=abc").is_err());
        assert!(FaultSpec::parse_header("explode=1").is_err());
        let global = FaultSpec {
            status: Some(500),
            stall_ms: Some(5),
            ..FaultSpec::default()
        };
        let merged = global.merged_with(&FaultSpec {
            status: Some(429),
            ..FaultSpec::default()
        });
        assert_eq!((merged.status, merged.stall_ms), (Some(429), Some(5)));
    }
}
