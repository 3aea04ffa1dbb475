//! `--topology` and `--pd-threshold`: the fleet layouts a run compares, and one row per layout.
//!
//! A topology is the set of simulated replicas behind the gateway and the role its pool gives
//! each of them:
//! - `agg`: `--replicas` aggregated replicas (role `both`), listed in the pool as plain URLs;
//! - `pd:PxD`: P prefill-role replicas then D decode-role replicas, listed in the pool as
//!   endpoint tables `{url, role}` in that order (endpoints `bench/0` .. `bench/P-1` prefill,
//!   `bench/P` .. `bench/P+D-1` decode). Every replica has the same simulated hardware as an
//!   aggregated one: `--kv-blocks` blocks of `--block-size` tokens, `--max-num-seqs`, and the
//!   simulator's default prefill speed, decode time per token and KV transfer bandwidth. The gateway
//!   picks a decode endpoint first and has the prompt prefilled on a prefill endpoint only when
//!   more than `[pools.disaggregation] threshold_tokens` of it are not cached on that decode
//!   endpoint (`gateway/src/turn.rs`).
//!
//! `--pd-threshold T1,T2,..` sets `threshold_tokens` (default: the gateway's), one replay per
//! value: a sweep. It applies to P/D topologies only; an `agg` layout does not depend on it and
//! is replayed once.
//!
//! Every policy is replayed on every layout (and threshold); the rows and their labels
//! (`session@agg`, `session@pd:2x2/t=2048`) are in [`super::rows()`].

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use agentgate::config::{EndpointEntry, EndpointTable};
use agentgate_sim::Role;

/// A fleet layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// `--replicas` aggregated replicas.
    Agg,
    /// `prefill` prefill-role replicas and `decode` decode-role replicas.
    Pd {
        /// Prefill-role replicas (at least 1).
        prefill: usize,
        /// Decode-role replicas (at least 1).
        decode: usize,
    },
}

impl FromStr for Topology {
    type Err = String;

    fn from_str(text: &str) -> Result<Topology, String> {
        let text = text.trim();
        if text == "agg" {
            return Ok(Topology::Agg);
        }
        let bad = || {
            format!(
                "unknown topology `{text}`: use `agg` (--replicas aggregated replicas) or \
                 `pd:PxD` (P prefill and D decode replicas, each at least 1), e.g. pd:2x2"
            )
        };
        let (prefill, decode) = text
            .strip_prefix("pd:")
            .and_then(|sizes| sizes.split_once('x'))
            .ok_or_else(bad)?;
        let count = |n: &str| n.parse::<usize>().ok().filter(|&n| n >= 1);
        match (count(prefill), count(decode)) {
            (Some(prefill), Some(decode)) => Ok(Topology::Pd { prefill, decode }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Agg => f.write_str("agg"),
            Topology::Pd { prefill, decode } => write!(f, "pd:{prefill}x{decode}"),
        }
    }
}

impl Topology {
    /// Whether the layout has prefill replicas.
    pub fn is_pd(&self) -> bool {
        matches!(self, Topology::Pd { .. })
    }

    /// The simulated role of each replica, in replica (and endpoint) order.
    pub fn roles(&self, agg_replicas: usize) -> Vec<Role> {
        match *self {
            Topology::Agg => vec![Role::Both; agg_replicas],
            Topology::Pd { prefill, decode } => std::iter::repeat_n(Role::Prefill, prefill)
                .chain(std::iter::repeat_n(Role::Decode, decode))
                .collect(),
        }
    }
}

/// The gateway's name of a role (`role` in an endpoint table).
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Both => "both",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// Check `--topology` and `--pd-threshold` against each other and the other options.
pub fn validate(
    topologies: &[Topology],
    thresholds: &[u64],
    kill_replica: bool,
) -> Result<(), String> {
    if topologies.is_empty() {
        return Err("--topology needs at least one layout, e.g. agg,pd:2x2".into());
    }
    let mut seen = BTreeSet::new();
    for topology in topologies {
        if !seen.insert(topology.to_string()) {
            return Err(format!("--topology lists `{topology}` twice"));
        }
    }
    let mut seen = BTreeSet::new();
    for threshold in thresholds {
        if !seen.insert(threshold) {
            return Err(format!("--pd-threshold lists {threshold} twice"));
        }
    }
    let pd = topologies.iter().any(Topology::is_pd);
    if !thresholds.is_empty() && !pd {
        return Err(
            "--pd-threshold applies to prefill/decode layouts only; add one, e.g. --topology agg,pd:2x2"
                .into(),
        );
    }
    if kill_replica && pd {
        return Err(
            "--kill-replica is not supported with a pd:PxD topology (replica 0 would be a prefill \
             replica, which serves no request the kill figures could count); use agg"
                .into(),
        );
    }
    Ok(())
}

/// Lay a P/D topology over a gateway configuration built for `roles.len()` endpoints: the
/// pool's endpoints become tables `{url, role}`, and `threshold` (if any) becomes
/// `[pools.disaggregation] threshold_tokens`. An all-`both` layout is left as plain URLs.
/// Returns the threshold the pool will use.
pub fn configure(
    config: &mut agentgate::Config,
    roles: &[Role],
    threshold: Option<u64>,
) -> Result<u64, String> {
    let Some(pool) = config.pools.first_mut() else {
        return Err("the gateway configuration has no pool".into());
    };
    if pool.endpoints.len() != roles.len() {
        return Err(format!(
            "the gateway pool lists {} endpoints for {} replicas",
            pool.endpoints.len(),
            roles.len()
        ));
    }
    if roles.iter().any(|r| *r != Role::Both) {
        pool.endpoints = pool
            .endpoints
            .iter()
            .zip(roles)
            .map(|(entry, role)| {
                EndpointEntry::Table(EndpointTable {
                    url: entry.url().to_string(),
                    role: Some(role_name(*role).to_string()),
                    bootstrap_port: None,
                    labels: Default::default(),
                })
            })
            .collect();
    }
    if let Some(threshold) = threshold {
        pool.disaggregation.threshold_tokens = threshold;
    }
    let effective = pool.disaggregation.threshold_tokens;
    config
        .validate()
        .map_err(|e| format!("the gateway rejects the P/D pool: {e}"))?;
    Ok(effective)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::store::StoreTarget;

    #[test]
    fn topologies_parse_print_and_reject_nonsense() {
        assert_eq!("agg".parse::<Topology>(), Ok(Topology::Agg));
        let pd: Topology = "pd:2x3".parse().unwrap();
        assert_eq!(
            pd,
            Topology::Pd {
                prefill: 2,
                decode: 3
            }
        );
        assert_eq!(pd.to_string(), "pd:2x3");
        assert_eq!(
            pd.roles(9),
            [
                Role::Prefill,
                Role::Prefill,
                Role::Decode,
                Role::Decode,
                Role::Decode
            ]
        );
        assert_eq!(Topology::Agg.roles(2), [Role::Both, Role::Both]);
        for bad in [
            "pd:0x2",
            "pd:2x0",
            "pd:2",
            "pd:axb",
            "pd:2x2x2",
            "2x2",
            "aggregated",
            "",
        ] {
            let message = bad.parse::<Topology>().unwrap_err();
            assert!(message.contains("pd:PxD"), "{bad}: {message}");
        }
    }

    #[test]
    fn options_are_checked_against_each_other() {
        let pd = Topology::Pd {
            prefill: 1,
            decode: 1,
        };
        assert!(validate(&[Topology::Agg], &[], true).is_ok());
        assert!(validate(&[Topology::Agg, pd], &[0, 8192], false).is_ok());
        let cases: [(&[Topology], &[u64], bool, &str); 5] = [
            (&[], &[], false, "--topology"),
            (&[pd, pd], &[], false, "twice"),
            (&[pd], &[1, 1], false, "twice"),
            (&[Topology::Agg], &[2048], false, "prefill/decode"),
            (&[Topology::Agg, pd], &[], true, "--kill-replica"),
        ];
        for (topologies, thresholds, kill, expected) in cases {
            let message = validate(topologies, thresholds, kill).unwrap_err();
            assert!(message.contains(expected), "{message}");
        }
    }

    fn config(replicas: usize) -> agentgate::Config {
        let urls: Vec<String> = (0..replicas)
            .map(|i| format!("http://127.0.0.1:{}", 1000 + i))
            .collect();
        let flow =
            crate::run::flow::FlowSetup::new(crate::run::flow::FlowMode::On, 8, 1, 0.5, false);
        crate::run::gateway_config("session", &urls, &[], &StoreTarget::Memory, &flow).unwrap()
    }

    #[test]
    fn pd_layouts_become_endpoint_tables_with_roles_and_the_threshold() {
        let pd = Topology::Pd {
            prefill: 1,
            decode: 2,
        };
        let mut c = config(3);
        let threshold = configure(&mut c, &pd.roles(4), Some(8192)).unwrap();
        assert_eq!(threshold, 8192);
        let pool = &c.pools[0];
        assert_eq!(pool.disaggregation.threshold_tokens, 8192);
        let roles: Vec<Option<&str>> = pool
            .endpoints
            .iter()
            .map(|e| match e {
                EndpointEntry::Table(t) => t.role.as_deref(),
                EndpointEntry::Url(_) => None,
            })
            .collect();
        assert_eq!(roles, [Some("prefill"), Some("decode"), Some("decode")]);
        assert_eq!(pool.endpoints[2].url(), "http://127.0.0.1:1002");

        let mut c = config(3);
        let default = configure(&mut c, &pd.roles(4), None).unwrap();
        assert_eq!(
            default,
            agentgate_scheduler::disagg::DEFAULT_THRESHOLD_TOKENS,
            "no --pd-threshold: the gateway's default"
        );

        let mut c = config(2);
        configure(&mut c, &Topology::Agg.roles(2), None).unwrap();
        assert!(
            c.pools[0]
                .endpoints
                .iter()
                .all(|e| matches!(e, EndpointEntry::Url(_))),
            "aggregated replicas stay plain URLs"
        );
        let message = configure(&mut config(2), &pd.roles(4), None).unwrap_err();
        assert!(message.contains("2 endpoints for 3 replicas"), "{message}");
    }
}
