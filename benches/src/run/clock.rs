//! Simulated time for the replay: wall time divided by the time scale, and sleeps in simulated
//! seconds. At time scale 0 nothing sleeps and "simulated" time is wall time.
//!
//! # Wall and virtual clocks (`--clock`)
//!
//! Every timer in the replay, the gateways and the simulated replicas is a `tokio::time` timer,
//! so the whole run follows the runtime's clock:
//! - `wall`: the real clock, compressed by `--time-scale`. Replicas, gateways and the clients
//!   share the machine's cores, so a timer that fires late (the machine is busy) moves the
//!   figures, and the gateway's own CPU time is magnified by `1 / time scale`.
//! - `virtual`: one thread on a paused clock at time scale 1. Whenever every task waits, the
//!   clock jumps to the next timer; it never moves while a task computes. The simulated engines'
//!   step times are then the only time that passes and the gateway's CPU time counts as zero.
//!   Same-seed runs repeat each other to the request, given two settings the replay makes:
//!   fixed socket buffers (the kernel's autotuning follows real time) and request bodies parsed
//!   on their own tasks (the gateway's blocking pool finishes parses in real-time order).
//!   Rarely (one seed run in about forty) a run parts from the others, probably because the
//!   kernel delivered loopback data after the runtime found nothing to do and jumped the clock. Everything must
//!   run in this process: a Redis server (`--gateways` above 1 without `--store memory`,
//!   `--redis-url`, `--store redis`) answers on its own clock, so those runs need `wall`.

use std::time::Duration;
use tokio::time::Instant;

/// `--clock`: which clock the replay runs on (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ClockMode {
    /// The real clock, compressed by `--time-scale`.
    #[default]
    Wall,
    /// A paused clock that jumps to the next timer whenever every task waits (time scale 1).
    Virtual,
}

impl ClockMode {
    /// `wall` or `virtual`.
    pub fn as_str(self) -> &'static str {
        match self {
            ClockMode::Wall => "wall",
            ClockMode::Virtual => "virtual",
        }
    }
}

/// The replay's clock, started when the replay starts; cheap to clone.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    started: Instant,
    time_scale: f64,
}

impl SimClock {
    /// A clock starting now, running `1 / time_scale` times faster than wall time.
    pub fn start(time_scale: f64) -> Self {
        SimClock {
            started: Instant::now(),
            time_scale: time_scale.max(0.0),
        }
    }

    /// Wall seconds per simulated second (0 = no delays).
    pub fn time_scale(&self) -> f64 {
        self.time_scale
    }

    /// Simulated seconds since the start (wall seconds at time scale 0).
    pub fn now_s(&self) -> f64 {
        self.to_sim_s(self.started.elapsed())
    }

    /// Simulated seconds in a wall duration.
    pub fn to_sim_s(&self, wall: Duration) -> f64 {
        if self.time_scale > 0.0 {
            wall.as_secs_f64() / self.time_scale
        } else {
            wall.as_secs_f64()
        }
    }

    /// The wall instant at which simulated time reaches `sim_s` (now at time scale 0).
    pub fn instant_at(&self, sim_s: f64) -> Instant {
        if self.time_scale > 0.0 && sim_s.is_finite() && sim_s > 0.0 {
            self.started + Duration::from_secs_f64(sim_s * self.time_scale)
        } else {
            self.started
        }
    }

    /// Sleep for `sim_s` simulated seconds (not at all at time scale 0).
    pub async fn sleep(&self, sim_s: f64) {
        if self.time_scale > 0.0 && sim_s.is_finite() && sim_s > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(sim_s * self.time_scale)).await;
        }
    }

    /// Sleep until simulated time `sim_s` (returns at once if it has passed or at time scale 0).
    pub async fn sleep_until(&self, sim_s: f64) {
        if self.time_scale > 0.0 {
            tokio::time::sleep_until(self.instant_at(sim_s)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_wall_to_simulated_seconds() {
        let clock = SimClock::start(0.01);
        assert!((clock.to_sim_s(Duration::from_millis(10)) - 1.0).abs() < 1e-9);
        assert_eq!(
            clock.instant_at(2.0) - clock.instant_at(0.0),
            Duration::from_millis(20)
        );
        let instant = SimClock::start(0.0);
        assert!((instant.to_sim_s(Duration::from_millis(10)) - 0.01).abs() < 1e-9);
        assert_eq!(instant.instant_at(100.0), instant.instant_at(0.0));
    }
}
