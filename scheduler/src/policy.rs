//! Routing policy names, as written in a pool's `policy` key.

use crate::picker::{LeastLoaded, Picker, RoundRobin};
use crate::prefix_aware::{PrefixAware, PrefixWeights};
use crate::prefix_index::PrefixIndexConfig;

/// A routing policy a pool can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// [`RoundRobin`].
    RoundRobin,
    /// [`LeastLoaded`].
    LeastLoaded,
    /// [`PrefixAware`]: prefix index plus load, no session keys.
    Prefix,
    /// Session pins (kept in the store by the caller) in front of [`PrefixAware`]: a session's
    /// turns stay on its pinned endpoint until it is crowded or gone, then re-pin by prefix and
    /// load.
    Session,
}

impl Policy {
    /// Every name the configuration accepts today.
    pub const NAMES: &'static [&'static str] =
        &["round_robin", "least_loaded", "prefix", "session"];

    /// Parse a policy name; the error lists the names that exist.
    pub fn parse(name: &str) -> Result<Policy, String> {
        match name {
            "round_robin" => Ok(Policy::RoundRobin),
            "least_loaded" => Ok(Policy::LeastLoaded),
            "prefix" => Ok(Policy::Prefix),
            "session" => Ok(Policy::Session),
            other => Err(format!(
                "unknown policy `{other}`; use one of: {}",
                Self::NAMES.join(", ")
            )),
        }
    }

    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoaded => "least_loaded",
            Policy::Prefix => "prefix",
            Policy::Session => "session",
        }
    }

    /// A fresh picker implementing the policy for a pool of `endpoints` endpoints.
    pub fn picker(self, endpoints: usize, index: PrefixIndexConfig) -> Box<dyn Picker> {
        match self {
            Policy::RoundRobin => Box::new(RoundRobin::default()),
            Policy::LeastLoaded => Box::new(LeastLoaded),
            Policy::Prefix | Policy::Session => {
                Box::new(PrefixAware::new(endpoints, index, PrefixWeights::default()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_fail_clearly() {
        for name in Policy::NAMES {
            assert_eq!(Policy::parse(name).unwrap().name(), *name);
        }
        assert!(Policy::parse("random")
            .unwrap_err()
            .contains("unknown policy"));
    }
}
