//! Routing policy names, as written in a pool's `policy` key, and the picker each one builds.

use crate::picker::{LeastLoaded, Picker, RoundRobin};
use crate::pipeline::{Pipeline, ScoringConfig};
use crate::prefix_index::PrefixIndexConfig;
use crate::scorer::SessionPinScorer;

/// A routing policy a pool can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// [`RoundRobin`].
    RoundRobin,
    /// [`LeastLoaded`].
    LeastLoaded,
    /// A [`Pipeline`] of the prefix and load scorers, no session pins.
    Prefix,
    /// The full [`Pipeline`]: session pins (kept in the store by the caller), sticky until
    /// saturated, then re-pinned by prefix and load.
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

    /// Whether the policy keeps sessions on pinned endpoints (the caller then reads the
    /// session's pin into [`PickRequest::pinned`](crate::PickRequest::pinned) and re-pins when
    /// the pick says the pin broke or there was none).
    pub fn uses_pins(self) -> bool {
        self == Policy::Session
    }

    /// A fresh picker implementing the policy. `scoring` configures the `prefix` and `session`
    /// pipelines (start from [`ScoringConfig::for_policy`]); the baselines ignore it and the
    /// index sizes. Fails when `scoring` does not validate, when a `prefix` pool weights the
    /// `session_pin` scorer, or when a `session` pool does not.
    pub fn picker(
        self,
        index: PrefixIndexConfig,
        scoring: &ScoringConfig,
    ) -> Result<Box<dyn Picker>, String> {
        let pin = scoring.weight(SessionPinScorer::NAME);
        match self {
            Policy::RoundRobin => Ok(Box::new(RoundRobin::default())),
            Policy::LeastLoaded => Ok(Box::new(LeastLoaded)),
            Policy::Prefix if pin > 0.0 => Err(format!(
                "the `{}` scorer needs policy `session` (this pool's policy is `prefix`)",
                SessionPinScorer::NAME
            )),
            Policy::Session if pin.is_nan() || pin <= 0.0 => Err(format!(
                "policy `session` needs a positive `{}` weight",
                SessionPinScorer::NAME
            )),
            Policy::Prefix | Policy::Session => Ok(Box::new(Pipeline::new(index, scoring)?)),
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

    #[test]
    fn each_policy_builds_its_picker_and_rejects_a_mismatched_pin_weight() {
        let index = PrefixIndexConfig::default();
        for policy in [Policy::RoundRobin, Policy::LeastLoaded] {
            let picker = policy
                .picker(index, &ScoringConfig::for_policy(policy))
                .unwrap();
            assert!(picker.prefix_index().is_none());
        }
        for policy in [Policy::Prefix, Policy::Session] {
            let picker = policy
                .picker(index, &ScoringConfig::for_policy(policy))
                .unwrap();
            assert!(picker.prefix_index().is_some());
        }
        let err = Policy::Prefix
            .picker(index, &ScoringConfig::session())
            .unwrap_err();
        assert!(err.contains("needs policy `session`"), "{err}");
        let err = Policy::Session
            .picker(index, &ScoringConfig::prefix())
            .unwrap_err();
        assert!(err.contains("positive `session_pin` weight"), "{err}");
        let mut bad = ScoringConfig::session();
        bad.weights.insert("cache".into(), 1.0);
        let err = Policy::Session.picker(index, &bad).unwrap_err();
        assert!(err.contains("unknown scorer `cache`"), "{err}");
        assert!(Policy::Session.uses_pins() && !Policy::Prefix.uses_pins());
    }
}
