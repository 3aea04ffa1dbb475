//! The rows of a run: every replay `agentgate-bench run` makes, and the label each is reported
//! under.
//!
//! A row is one replay on a fresh fleet, fixed by four settings and the traffic replayed:
//! - the routing policy (`--policies`);
//! - the fleet layout (`--topology`, see [`super::topology`]);
//! - for P/D layouts, the disaggregation threshold (`--pd-threshold`; one row per value, or
//!   one row with the gateway's default);
//! - flow control on or off (`--flow-control`, see [`super::flow`]);
//! - the traffic: the whole workload, or only the interactive team (`--interactive-alone`).
//!
//! Order: policy outermost, then layout, then threshold; within each of these *setups*, each
//! `--flow-control` setting in the order given, then (with `--interactive-alone`) the
//! interactive team alone with the first setting. So the rows one isolation check compares
//! ([`super::isolation_checks`]) sit next to each other.
//!
//! Labels are unique in a run and say only what varies:
//!
//! ```text
//! label   = setup [" interactive-alone" | " flow-off"]
//! setup   = POLICY                                  every layout is agg
//!         | POLICY "@" TOPOLOGY ["/t=" THRESHOLD]   otherwise (threshold: P/D rows of a sweep)
//! ```
//!
//! `flow-off` marks rows replayed without flow control (whether or not `on` is compared too),
//! `interactive-alone` the interactive team's rows. Examples: `session`, `session flow-off`,
//! `session interactive-alone`, `session@agg`, `session@pd:2x2/t=2048`,
//! `session@pd:2x2/t=2048 flow-off`.

use agentgate_sim::Role;

use super::flow::FlowMode;
use super::topology::Topology;
use super::Args;

/// One replay of the comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// Routing policy.
    pub policy: String,
    /// Fleet layout.
    pub topology: Topology,
    /// `threshold_tokens` for a P/D layout; None = the gateway's default (always None for agg).
    pub threshold: Option<u64>,
    /// Flow control on or off.
    pub flow: FlowMode,
    /// Only the interactive team's sessions.
    pub interactive_alone: bool,
    /// The policy, layout and threshold part of the label (see the module doc).
    pub setup: String,
    /// Row label (see the module doc).
    pub label: String,
}

impl Row {
    /// `all` or `interactive-alone`.
    pub fn traffic(&self) -> &'static str {
        if self.interactive_alone {
            "interactive-alone"
        } else {
            "all"
        }
    }

    /// The simulated role of each replica of this row's fleet.
    pub fn roles(&self, agg_replicas: usize) -> Vec<Role> {
        self.topology.roles(agg_replicas)
    }
}

/// Requests a fleet runs at once: the replicas that serve requests (role `both` or `decode`,
/// as the gateway's flow control counts them; every replica if none does) x `max_num_seqs`.
pub fn request_slots(roles: &[Role], max_num_seqs: usize) -> usize {
    let serving = roles.iter().filter(|r| **r != Role::Prefill).count();
    let serving = if serving == 0 { roles.len() } else { serving };
    serving.saturating_mul(max_num_seqs)
}

/// Every row of a run, in order (see the module doc).
pub fn rows(args: &Args) -> Vec<Row> {
    let plain = args.topology.iter().all(|t| *t == Topology::Agg);
    let first = args.flow_control.first().copied().unwrap_or(FlowMode::On);
    let mut rows = Vec::new();
    for policy in &args.policies {
        for topology in &args.topology {
            let sweep: Vec<Option<u64>> = if topology.is_pd() && !args.pd_threshold.is_empty() {
                args.pd_threshold.iter().copied().map(Some).collect()
            } else {
                vec![None]
            };
            for threshold in sweep {
                let setup = match (plain, threshold) {
                    (true, _) => policy.clone(),
                    (false, None) => format!("{policy}@{topology}"),
                    (false, Some(t)) => format!("{policy}@{topology}/t={t}"),
                };
                let row = |flow: FlowMode, interactive_alone: bool| {
                    let label = if interactive_alone {
                        format!("{setup} interactive-alone")
                    } else if flow == FlowMode::Off {
                        format!("{setup} flow-off")
                    } else {
                        setup.clone()
                    };
                    Row {
                        policy: policy.clone(),
                        topology: *topology,
                        threshold,
                        flow,
                        interactive_alone,
                        setup: setup.clone(),
                        label,
                    }
                };
                for &flow in &args.flow_control {
                    rows.push(row(flow, false));
                }
                if args.interactive_alone {
                    rows.push(row(first, true));
                }
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::tests::args;

    fn labels(args: &Args) -> Vec<String> {
        rows(args).into_iter().map(|r| r.label).collect()
    }

    const PD: Topology = Topology::Pd {
        prefill: 2,
        decode: 2,
    };

    #[test]
    fn one_dimension_keeps_its_labels() {
        let policies = Args {
            policies: vec!["session".into(), "round_robin".into()],
            ..args()
        };
        assert_eq!(labels(&policies), ["session", "round_robin"]);

        let flow = Args {
            policies: vec!["session".into(), "round_robin".into()],
            flow_control: vec![FlowMode::On, FlowMode::Off],
            interactive_alone: true,
            ..args()
        };
        assert_eq!(
            labels(&flow),
            [
                "session",
                "session flow-off",
                "session interactive-alone",
                "round_robin",
                "round_robin flow-off",
                "round_robin interactive-alone"
            ]
        );
        assert!(rows(&flow)
            .iter()
            .filter(|r| r.interactive_alone)
            .all(|r| r.flow == FlowMode::On && r.traffic() == "interactive-alone"));
        let off_first = Args {
            flow_control: vec![FlowMode::Off, FlowMode::On],
            interactive_alone: true,
            ..args()
        };
        let alone = rows(&off_first).pop().unwrap();
        assert_eq!(
            alone.flow,
            FlowMode::Off,
            "alone runs with the first setting"
        );
        assert_eq!(alone.label, "session interactive-alone");

        let layouts = Args {
            topology: vec![Topology::Agg, PD],
            pd_threshold: vec![0, 2048],
            ..args()
        };
        let rows = rows(&layouts);
        let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            ["session@agg", "session@pd:2x2/t=0", "session@pd:2x2/t=2048"]
        );
        assert_eq!(
            rows[0].threshold, None,
            "agg runs once, without a threshold"
        );
        assert_eq!(rows[2].threshold, Some(2048));
        let default = Args {
            topology: vec![PD],
            ..args()
        };
        let default = super::rows(&default);
        assert_eq!(default.len(), 1);
        assert_eq!(default[0].label, "session@pd:2x2");
        assert_eq!(default[0].threshold, None);
    }

    #[test]
    fn several_dimensions_combine_in_one_order_with_unique_labels() {
        let all = Args {
            policies: vec!["session".into(), "prefix".into()],
            topology: vec![Topology::Agg, PD],
            pd_threshold: vec![512, 4096],
            flow_control: vec![FlowMode::On, FlowMode::Off],
            interactive_alone: true,
            ..args()
        };
        let rows = rows(&all);
        // 2 policies x (agg + 2 thresholds) x (2 flow settings + alone).
        assert_eq!(rows.len(), 2 * 3 * 3);
        let labels: Vec<&str> = rows.iter().take(9).map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "session@agg",
                "session@agg flow-off",
                "session@agg interactive-alone",
                "session@pd:2x2/t=512",
                "session@pd:2x2/t=512 flow-off",
                "session@pd:2x2/t=512 interactive-alone",
                "session@pd:2x2/t=4096",
                "session@pd:2x2/t=4096 flow-off",
                "session@pd:2x2/t=4096 interactive-alone",
            ]
        );
        let unique: std::collections::BTreeSet<&str> =
            rows.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(unique.len(), rows.len());
        assert!(rows
            .iter()
            .all(|r| r.label.starts_with(&r.setup) && r.setup.starts_with(&r.policy)));
        assert_eq!(rows[9].setup, "prefix@agg");
    }

    #[test]
    fn request_slots_count_the_replicas_that_serve_requests() {
        assert_eq!(request_slots(&Topology::Agg.roles(4), 8), 32);
        assert_eq!(request_slots(&PD.roles(4), 8), 16, "decode replicas only");
        assert_eq!(
            request_slots(&[Role::Prefill], 8),
            8,
            "none serve: all count"
        );
        assert_eq!(request_slots(&[], 8), 0);
    }
}
