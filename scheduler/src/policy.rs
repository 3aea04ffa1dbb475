//! Routing policy names, as written in a pool's `policy` key.

use crate::picker::{LeastLoaded, Picker, RoundRobin};

/// A routing policy a pool can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// [`RoundRobin`].
    RoundRobin,
    /// [`LeastLoaded`].
    LeastLoaded,
}

impl Policy {
    /// Every name the configuration accepts today.
    pub const NAMES: &'static [&'static str] = &["round_robin", "least_loaded"];

    /// Parse a policy name; the error says which names exist and, for the session- and
    /// cache-aware policies, that they are not available in this build.
    pub fn parse(name: &str) -> Result<Policy, String> {
        match name {
            "round_robin" => Ok(Policy::RoundRobin),
            "least_loaded" => Ok(Policy::LeastLoaded),
            "prefix" | "session" => Err(format!(
                "policy `{name}` (session- and cache-aware routing) is not available in this build; use one of: {}",
                Self::NAMES.join(", ")
            )),
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
        }
    }

    /// A fresh picker implementing the policy.
    pub fn picker(self) -> Box<dyn Picker> {
        match self {
            Policy::RoundRobin => Box::new(RoundRobin::default()),
            Policy::LeastLoaded => Box::new(LeastLoaded),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_future_policies_fail_clearly() {
        for name in Policy::NAMES {
            assert_eq!(Policy::parse(name).unwrap().name(), *name);
        }
        assert!(Policy::parse("prefix")
            .unwrap_err()
            .contains("not available"));
        assert!(Policy::parse("random")
            .unwrap_err()
            .contains("unknown policy"));
    }
}
