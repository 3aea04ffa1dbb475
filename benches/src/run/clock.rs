//! Simulated time for the replay: wall time divided by the time scale, and sleeps in simulated
//! seconds. At time scale 0 nothing sleeps and "simulated" time is wall time.

use std::time::{Duration, Instant};

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
            tokio::time::sleep_until(self.instant_at(sim_s).into()).await;
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
