//! Whether the pool can take more work: the signal that gates every dispatch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::HeldTurn;

/// The controller's own load, handed to the [`CapacitySignal`] on every question.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlowLoad {
    /// Requests dispatched by this controller and not yet finished.
    pub in_flight: u64,
    /// Their estimated tokens.
    pub in_flight_tokens: u64,
    /// Requests waiting, over all bands.
    pub queued: usize,
}

/// Whether the pool can take another request now.
///
/// The controller asks before each dispatch and when a sheddable request arrives. Methods are
/// called with the controller's lock held: they must be quick and must not call back into the
/// controller. A signal fed by periodic metrics scrapes changes without any permit being
/// released, so the gateway calls [`FlowController::notify`](super::FlowController::notify)
/// after each scrape. A scraped signal stays "can dispatch" until the next scrape; combining it
/// with a cap on `load.in_flight` keeps one scrape interval from releasing the whole queue.
pub trait CapacitySignal: Send + Sync {
    /// `true` while the pool is not saturated.
    fn can_dispatch(&self, load: &FlowLoad) -> bool;

    /// How many requests the pool may have in flight now, when the signal counts requests;
    /// bands' reserves ([`BandSpec::reserve`](super::BandSpec::reserve)) are shares of it.
    /// `None` (the default): the signal has no such figure and reserves hold nothing back.
    fn capacity(&self) -> Option<u64> {
        None
    }

    /// Whether `endpoint` (`None`: some endpoint) can start one more request of a band that
    /// leaves `held_share` of each endpoint's slots to the bands above it, with `promised`
    /// requests already sent its way (for `None`: sent to endpoints this way) that it does not
    /// count yet. Asked for queued requests that expect to go to `endpoint` (their session's
    /// pin), which then wait for it while others go ahead, and for requests of bands below a
    /// reserve. With `kv_bound` (a band without a reserve of its own) the endpoint must also
    /// have room in its KV cache, if the signal tracks it; a band with a reserve is never held
    /// for that. `true` (the default) when the signal does not track endpoints or does not know
    /// this one.
    fn has_room(
        &self,
        endpoint: Option<&str>,
        held_share: f64,
        promised: u64,
        kv_bound: bool,
    ) -> bool {
        let _ = (endpoint, held_share, promised, kv_bound);
        true
    }

    /// Whether another gateway holds a turn for `endpoint` that outranks `turn`
    /// ([`HeldTurn::outranks`]) and waits for the same room (see `agentgate::exchange`): the
    /// turn here then leaves the room to it, for at most [`yield_limit`](Self::yield_limit).
    /// `false` (the default) when the signal knows of no other gateway.
    fn warmer_elsewhere(&self, endpoint: &str, turn: &HeldTurn) -> bool {
        let _ = (endpoint, turn);
        false
    }

    /// Longest a queued turn leaves its endpoint's room to warmer turns elsewhere before it
    /// takes the room anyway, so a turn the other gateway cannot place after all holds
    /// nothing up for long.
    fn yield_limit(&self) -> Duration {
        Duration::ZERO
    }

    /// How saturated the pool is, in `0..=1`, for probabilistic shedding
    /// ([`ShedCurve::Linear`](super::ShedCurve::Linear)). Defaults to 1 when
    /// [`can_dispatch`](Self::can_dispatch) says no, 0 otherwise.
    fn saturation(&self, load: &FlowLoad) -> f64 {
        if self.can_dispatch(load) {
            0.0
        } else {
            1.0
        }
    }
}

/// At most `limit` requests in flight through the controller; saturation is
/// `in_flight / limit`. The limit can change at run time ([`MaxInFlight::set_limit`], then
/// [`FlowController::notify`](super::FlowController::notify)).
#[derive(Debug)]
pub struct MaxInFlight {
    limit: AtomicU64,
}

impl MaxInFlight {
    /// At most `limit` in flight (0 dispatches nothing).
    pub fn new(limit: u64) -> Self {
        MaxInFlight {
            limit: AtomicU64::new(limit),
        }
    }

    /// The current limit.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Change the limit.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }
}

impl CapacitySignal for MaxInFlight {
    fn can_dispatch(&self, load: &FlowLoad) -> bool {
        load.in_flight < self.limit()
    }

    fn capacity(&self) -> Option<u64> {
        Some(self.limit())
    }

    fn saturation(&self, load: &FlowLoad) -> f64 {
        match self.limit() {
            0 => 1.0,
            limit => (load.in_flight as f64 / limit as f64).min(1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_in_flight_counts_against_its_limit() {
        let cap = MaxInFlight::new(2);
        let load = |in_flight| FlowLoad {
            in_flight,
            ..FlowLoad::default()
        };
        assert!(cap.can_dispatch(&load(1)));
        assert!(!cap.can_dispatch(&load(2)));
        assert_eq!(cap.saturation(&load(1)), 0.5);
        assert_eq!(cap.saturation(&load(5)), 1.0);
        cap.set_limit(0);
        assert!(!cap.can_dispatch(&load(0)));
        assert_eq!(cap.saturation(&load(0)), 1.0);
    }
}
