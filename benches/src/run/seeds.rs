//! `--seeds LIST`: the whole comparison once per seed, and the goal figures per seed side by side.
//!
//! One seed is one trajectory: on the `agentic` workload a replica whose pinned sessions outgrow
//! its KV starts a cascade of recomputes on some seeds and not on others, so a change that helps
//! one seed can cost another. Only figures over many seeds say whether a change helps. With
//! `--seeds 1-10` (ranges and single seeds, comma-separated) the run replays every row once per
//! seed, in order, in this process:
//!
//! - `OUT/seed-N/` holds what `--seed N --out OUT/seed-N` writes (`summary.json`, `report.md`,
//!   the charts, `requests.jsonl`); on the virtual clock a seed's figures are the same either
//!   way (the recorded `command` is the list's, with ` [seed N]` appended);
//! - `OUT/seeds.json` and `OUT/seeds.md` put the figures the routing and flow-control goals are
//!   stated in side by side, one column per seed, with their mean, median, minimum and maximum.
//!
//! Per row, the figures are
//!
//! ```text
//! captured_reuse              cache_hit_ratio / available_reuse_ratio
//! ttft_p50_ms                 time to first token, median
//! ttft_p50_vs_round_robin     ttft_p50_ms / ttft_p50_ms of the round_robin row
//! gpu_vs_round_robin          gpu_seconds_per_million_tokens / the round_robin row's
//! busiest_replica_vs_mean     max / mean of requests_per_replica over the replicas that serve
//!                             requests (a P/D row's prefill replicas serve none)
//! busiest_load_vs_mean        the same over replica_mean_load (each replica's engine running +
//!                             waiting requests, averaged over the run's metric samples)
//! errors                      requests that failed
//! continuing_over_new         turns.matched.continuing_over_new (queue waits under saturation)
//! lowest_fair_share           the smallest team share of dispatched tokens in any band of
//!                             several teams while all of them were backlogged (`fairness`)
//! shed_unsaturated            refusals for load while the pool was not saturated
//! ```
//!
//! where "the round_robin row" is the row with the same layout, flow setting and traffic whose
//! policy is `round_robin` (its label with the policy replaced): the ratios are absent when the
//! run has no such row, and for that row itself. With `--interactive-alone` each isolation check
//! adds `on_over_alone` and `off_over_on` (see `summary::IsolationCheck`).
//!
//! Should a seed fail, `seeds.json` and `seeds.md` still sum up the seeds that finished before
//! it, and the run ends with that seed's error.

use std::path::Path;

use serde::Serialize;

use agentgate_sim::Role;

use super::summary::{PolicySummary, RunSummary};
use super::topology::Topology;

/// Most seeds one `--seeds` list may name.
pub const MAX_SEEDS: usize = 1000;

/// Parse `--seeds`: comma-separated seeds and inclusive ranges (`1-10`, `1,3,5`, `2-4,9`), each
/// seed at most once, in the order given.
pub fn parse_seeds(text: &str) -> Result<Vec<u64>, String> {
    let mut seeds = Vec::new();
    for part in text.split(',').map(str::trim) {
        let number = |s: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|_| format!("`{s}` is not a seed (a non-negative integer)"))
        };
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None if part.is_empty() => {
                return Err("empty seed list entry (expected e.g. `1-10` or `1,3,5`)".into())
            }
            None => {
                let seed = number(part)?;
                (seed, seed)
            }
        };
        if last < first {
            return Err(format!("range `{part}` runs backwards"));
        }
        if last - first >= (MAX_SEEDS - seeds.len()) as u64 {
            return Err(format!("at most {MAX_SEEDS} seeds"));
        }
        for seed in first..=last {
            if seeds.contains(&seed) {
                return Err(format!("seed {seed} is named twice"));
            }
            seeds.push(seed);
        }
    }
    Ok(seeds)
}

/// `seeds.json`.
#[derive(Debug, Clone, Serialize)]
pub struct SeedsSummary {
    /// Workload name.
    pub workload: String,
    /// The command line that produced it.
    pub command: String,
    /// Gateways per policy.
    pub gateways: usize,
    /// `memory` or `redis`.
    pub store: String,
    /// `virtual` or `wall`.
    pub clock: String,
    /// The seeds, in the order they ran; every per-seed list below follows it.
    pub seeds: Vec<u64>,
    /// Per row label, in the runs' row order.
    pub rows: Vec<RowSeeds>,
    /// Per isolation check (`--interactive-alone` on `mixed`), by setup.
    pub interactive_isolation: Vec<IsolationSeeds>,
}

/// One row's goal figures over the seeds.
#[derive(Debug, Clone, Serialize)]
pub struct RowSeeds {
    /// Row label (see `run::rows`).
    pub row: String,
    /// Label of the row the ratios compare with; null when the run has none.
    pub round_robin_row: Option<String>,
    /// Per seed: cache_hit_ratio / available_reuse_ratio.
    pub captured_reuse: Figure,
    /// Per seed: time to first token, median.
    pub ttft_p50_ms: Figure,
    /// Per seed: ttft_p50_ms over the round_robin row's.
    pub ttft_p50_vs_round_robin: Figure,
    /// Per seed: gpu_seconds_per_million_tokens over the round_robin row's.
    pub gpu_vs_round_robin: Figure,
    /// Per seed: the busiest replica's requests over the mean per replica.
    pub busiest_replica_vs_mean: Figure,
    /// Per seed: the busiest replica's mean load over the fleet's mean.
    pub busiest_load_vs_mean: Figure,
    /// Per seed: requests that failed.
    pub errors: Figure,
    /// Per seed: continuing turns' median queue wait over new sessions' (flow control).
    pub continuing_over_new: Figure,
    /// Per seed: the smallest team share of dispatched tokens in a band of several teams while
    /// all of them were backlogged.
    pub lowest_fair_share: Figure,
    /// Per seed: requests refused for load while the pool was not saturated.
    pub shed_unsaturated: Figure,
}

/// One isolation check's ratios over the seeds.
#[derive(Debug, Clone, Serialize)]
pub struct IsolationSeeds {
    /// The rows' common label part (see `summary::IsolationCheck`).
    pub setup: String,
    /// Per seed: interactive TTFT p99 with flow control on over the interactive team alone.
    pub on_over_alone: Figure,
    /// Per seed: the same with flow control off over on.
    pub off_over_on: Figure,
}

/// One figure per seed (null where a seed's run lacks it) and what they add up to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    /// Per seed, in `SeedsSummary::seeds` order.
    pub per_seed: Vec<Option<f64>>,
    /// Mean of the present values.
    pub mean: Option<f64>,
    /// Median of the present values (mean of the middle two for an even count).
    pub median: Option<f64>,
    /// Smallest present value.
    pub min: Option<f64>,
    /// Largest present value.
    pub max: Option<f64>,
}

impl Figure {
    /// Aggregate one value per seed.
    pub fn new(per_seed: Vec<Option<f64>>) -> Figure {
        let mut present: Vec<f64> = per_seed.iter().flatten().copied().collect();
        present.sort_by(f64::total_cmp);
        let n = present.len();
        let median = match n {
            0 => None,
            _ if n % 2 == 1 => Some(present[n / 2]),
            _ => Some((present[n / 2 - 1] + present[n / 2]) / 2.0),
        };
        Figure {
            mean: (n > 0).then(|| present.iter().sum::<f64>() / n as f64),
            median,
            min: present.first().copied(),
            max: present.last().copied(),
            per_seed,
        }
    }
}

/// The label of a row's round_robin counterpart: `label` (which starts with `policy`, see
/// `run::rows`) with `round_robin` as its policy; None for round_robin itself.
fn counterpart(label: &str, policy: &str) -> Option<String> {
    if policy == "round_robin" {
        return None;
    }
    label
        .strip_prefix(policy)
        .map(|rest| format!("round_robin{rest}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    }
}

/// max / mean of `per_replica` over the replicas of `row`'s layout that serve requests (every
/// replica of `agg`, the decode replicas of `pd:PxD`); None when they sum to 0.
fn busiest_serving(row: &PolicySummary, per_replica: &[f64]) -> Option<f64> {
    let roles = row
        .topology
        .parse::<Topology>()
        .map(|t| t.roles(per_replica.len()))
        .unwrap_or_default();
    let serving: Vec<f64> = per_replica
        .iter()
        .enumerate()
        .filter(|(i, _)| roles.get(*i) != Some(&Role::Prefill))
        .map(|(_, n)| *n)
        .collect();
    busiest_vs_mean(&serving)
}

/// The busiest replica's requests over the mean.
fn busiest_replica(row: &PolicySummary) -> Option<f64> {
    let requests: Vec<f64> = row.requests_per_replica.iter().map(|&n| n as f64).collect();
    busiest_serving(row, &requests)
}

/// The busiest replica's mean load over the fleet's mean.
fn busiest_load(row: &PolicySummary) -> Option<f64> {
    busiest_serving(row, &row.replica_mean_load)
}

/// max / mean of the values per replica (None when they sum to 0).
fn busiest_vs_mean(per_replica: &[f64]) -> Option<f64> {
    let total: f64 = per_replica.iter().sum();
    let max = per_replica.iter().copied().max_by(f64::total_cmp)?;
    (total > 0.0).then(|| max * per_replica.len() as f64 / total)
}

/// The smallest team share in any band of several teams (None without such a band).
fn lowest_fair_share(row: &PolicySummary) -> Option<f64> {
    row.fairness
        .values()
        .filter(|band| band.teams.len() > 1)
        .flat_map(|band| band.teams.values().filter_map(|team| team.share))
        .min_by(f64::total_cmp)
}

/// The row labelled `label` in one run.
fn row_of<'a>(summary: &'a RunSummary, label: &str) -> Option<&'a PolicySummary> {
    summary.policies.iter().find(|r| r.row == label)
}

/// Put the runs' figures side by side. `runs` are `(seed, summary)` in the order they ran.
pub fn summarize(command: &str, runs: &[(u64, RunSummary)]) -> SeedsSummary {
    let first = runs.first().map(|(_, s)| s);
    let mut labels: Vec<String> = Vec::new();
    let mut setups: Vec<String> = Vec::new();
    for (_, summary) in runs {
        for row in &summary.policies {
            if !labels.contains(&row.row) {
                labels.push(row.row.clone());
            }
        }
        for check in &summary.interactive_isolation {
            if !setups.contains(&check.setup) {
                setups.push(check.setup.clone());
            }
        }
    }
    let rows = labels
        .iter()
        .map(|label| {
            let rows: Vec<Option<&PolicySummary>> =
                runs.iter().map(|(_, s)| row_of(s, label)).collect();
            let reference = rows
                .iter()
                .flatten()
                .find_map(|r| counterpart(&r.row, &r.policy));
            let against: Vec<Option<&PolicySummary>> = runs
                .iter()
                .map(|(_, s)| reference.as_deref().and_then(|l| row_of(s, l)))
                .collect();
            let reference = reference.filter(|_| against.iter().any(Option::is_some));
            let per = |f: &dyn Fn(&PolicySummary) -> Option<f64>| {
                Figure::new(rows.iter().map(|r| r.and_then(f)).collect())
            };
            let versus = |f: &dyn Fn(&PolicySummary) -> Option<f64>| {
                Figure::new(
                    rows.iter()
                        .zip(&against)
                        .map(|(r, rr)| ratio(r.and_then(f), rr.and_then(f)))
                        .collect(),
                )
            };
            RowSeeds {
                row: label.clone(),
                round_robin_row: reference,
                captured_reuse: per(&|r| Some(r.captured_reuse)),
                ttft_p50_ms: per(&|r| Some(r.ttft_p50_ms)),
                ttft_p50_vs_round_robin: versus(&|r| Some(r.ttft_p50_ms)),
                gpu_vs_round_robin: versus(&|r| r.gpu_seconds_per_million_tokens),
                busiest_replica_vs_mean: per(&busiest_replica),
                busiest_load_vs_mean: per(&busiest_load),
                errors: per(&|r| Some(r.errors as f64)),
                continuing_over_new: per(&|r| {
                    r.turns.matched.as_ref().and_then(|m| m.continuing_over_new)
                }),
                lowest_fair_share: per(&lowest_fair_share),
                shed_unsaturated: per(&|r| r.shed_unsaturated.map(|n| n as f64)),
            }
        })
        .collect();
    let interactive_isolation = setups
        .iter()
        .map(|setup| {
            let checks: Vec<_> = runs
                .iter()
                .map(|(_, s)| s.interactive_isolation.iter().find(|c| &c.setup == setup))
                .collect();
            IsolationSeeds {
                setup: setup.clone(),
                on_over_alone: Figure::new(
                    checks
                        .iter()
                        .map(|c| c.and_then(|c| c.on_over_alone))
                        .collect(),
                ),
                off_over_on: Figure::new(
                    checks
                        .iter()
                        .map(|c| c.and_then(|c| c.off_over_on))
                        .collect(),
                ),
            }
        })
        .collect();
    SeedsSummary {
        workload: first.map(|s| s.workload.clone()).unwrap_or_default(),
        command: command.to_string(),
        gateways: first.map_or(0, |s| s.gateways),
        store: first.map(|s| s.store.clone()).unwrap_or_default(),
        clock: first.map(|s| s.clock.clone()).unwrap_or_default(),
        seeds: runs.iter().map(|(seed, _)| *seed).collect(),
        rows,
        interactive_isolation,
    }
}

/// `seeds.md`: one table per figure, a row per run row, a column per seed, then the aggregates.
pub fn render(summary: &SeedsSummary) -> String {
    let mut text = format!(
        "# {} over seeds {}\n\n`{}`\n\n{} gateway(s), {} store, {} clock. Each seed's own \
         summary is in `seed-N/`.\n",
        summary.workload,
        seed_list(&summary.seeds),
        summary.command,
        summary.gateways,
        summary.store,
        summary.clock
    );
    let header = {
        let mut h = String::from("| row |");
        for seed in &summary.seeds {
            h.push_str(&format!(" {seed} |"));
        }
        h.push_str(" mean | median | min | max |\n|---|");
        h.push_str(&"---|".repeat(summary.seeds.len() + 4));
        h.push('\n');
        h
    };
    let line = |label: &str, figure: &Figure, fmt: &dyn Fn(f64) -> String| {
        let cell = |v: Option<f64>| v.map_or_else(|| "-".to_string(), fmt);
        let mut l = format!("| {label} |");
        for v in &figure.per_seed {
            l.push_str(&format!(" {} |", cell(*v)));
        }
        for v in [figure.mean, figure.median, figure.min, figure.max] {
            l.push_str(&format!(" {} |", cell(v)));
        }
        l.push('\n');
        l
    };
    type Pick = fn(&RowSeeds) -> &Figure;
    type Format = fn(f64) -> String;
    let tables: [(&str, Pick, Format); 10] = [
        (
            "Captured reuse (cache hit ratio over the pooled oracle's)",
            |r| &r.captured_reuse,
            |v| format!("{v:.3}"),
        ),
        ("TTFT p50, ms", |r| &r.ttft_p50_ms, |v| format!("{v:.0}")),
        (
            "TTFT p50 against round_robin",
            |r| &r.ttft_p50_vs_round_robin,
            |v| format!("{v:.2}x"),
        ),
        (
            "GPU-seconds per million tokens against round_robin",
            |r| &r.gpu_vs_round_robin,
            |v| format!("{v:.2}x"),
        ),
        (
            "Busiest replica's requests against the mean per replica",
            |r| &r.busiest_replica_vs_mean,
            |v| format!("{v:.2}x"),
        ),
        (
            "Busiest replica's mean load (engine running + waiting) against the fleet's mean",
            |r| &r.busiest_load_vs_mean,
            |v| format!("{v:.2}x"),
        ),
        ("Failed requests", |r| &r.errors, count),
        (
            "Queue wait p50 under saturation, continuing turns against new sessions",
            |r| &r.continuing_over_new,
            |v| format!("{v:.2}x"),
        ),
        (
            "Lowest team share of dispatched tokens in a band while all its teams waited",
            |r| &r.lowest_fair_share,
            |v| format!("{:.1}%", v * 100.0),
        ),
        (
            "Refused for load while the pool was not saturated",
            |r| &r.shed_unsaturated,
            count,
        ),
    ];
    for (title, pick, fmt) in tables {
        let rows: Vec<&RowSeeds> = summary
            .rows
            .iter()
            .filter(|r| pick(r).per_seed.iter().any(Option::is_some))
            .collect();
        if rows.is_empty() {
            continue;
        }
        text.push_str(&format!("\n## {title}\n\n{header}"));
        for row in rows {
            text.push_str(&line(&row.row, pick(row), &fmt));
        }
    }
    if !summary.interactive_isolation.is_empty() {
        text.push_str(&format!(
            "\n## Interactive TTFT p99: flow on against alone, flow off against on\n\n{header}"
        ));
        for check in &summary.interactive_isolation {
            let ratio = |v: f64| format!("{v:.2}x");
            text.push_str(&line(
                &format!("{} on / alone", check.setup),
                &check.on_over_alone,
                &ratio,
            ));
            text.push_str(&line(
                &format!("{} off / on", check.setup),
                &check.off_over_on,
                &ratio,
            ));
        }
    }
    text
}

/// A count, with two decimals when it is a mean that is not whole (so 0.04 does not read 0).
fn count(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// `1-10`, or the seeds comma-separated when they are not one ascending run.
fn seed_list(seeds: &[u64]) -> String {
    let consecutive = seeds.windows(2).all(|w| w[0].checked_add(1) == Some(w[1]));
    match (seeds.first(), seeds.last()) {
        (Some(a), Some(b)) if consecutive && seeds.len() > 1 => format!("{a}-{b}"),
        _ => seeds
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// Write `seeds.json` and `seeds.md` into `out`.
pub fn write(out: &Path, summary: &SeedsSummary) -> Result<(), String> {
    super::write_json(out, "seeds.json", summary)?;
    super::write_file(out, "seeds.md", render(summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_lists_take_ranges_and_singles_and_refuse_the_rest() {
        assert_eq!(parse_seeds("1-3").unwrap(), [1, 2, 3]);
        assert_eq!(parse_seeds("5, 2-3 ,9").unwrap(), [5, 2, 3, 9]);
        assert_eq!(parse_seeds("7").unwrap(), [7]);
        assert!(parse_seeds("3-1").unwrap_err().contains("backwards"));
        assert!(parse_seeds("1,1").unwrap_err().contains("twice"));
        assert!(parse_seeds("1-3,2").unwrap_err().contains("twice"));
        assert!(parse_seeds("1,,2").unwrap_err().contains("empty"));
        assert!(parse_seeds("x").unwrap_err().contains("not a seed"));
        assert!(parse_seeds("-1").unwrap_err().contains("not a seed"));
        assert!(parse_seeds("0-5000").unwrap_err().contains("at most"));
    }

    #[test]
    fn figures_aggregate_what_is_present() {
        let f = Figure::new(vec![Some(3.0), None, Some(1.0), Some(2.0), Some(10.0)]);
        assert_eq!(f.mean, Some(4.0));
        assert_eq!(f.median, Some(2.5));
        assert_eq!((f.min, f.max), (Some(1.0), Some(10.0)));
        let none = Figure::new(vec![None, None]);
        assert_eq!((none.mean, none.median, none.min), (None, None, None));
        assert_eq!(busiest_vs_mean(&[30.0, 10.0, 20.0]), Some(1.5));
        assert_eq!(busiest_vs_mean(&[0.0, 0.0]), None);
        assert_eq!(seed_list(&[1, 2, 3]), "1-3");
        assert_eq!(seed_list(&[1, 3]), "1,3");
        assert_eq!(seed_list(&[u64::MAX, 0]), format!("{},0", u64::MAX));
        assert_eq!(count(0.04), "0.04");
    }

    #[test]
    fn every_row_compares_with_the_round_robin_row_of_its_setup_and_traffic() {
        let cases = [
            ("session", "session", Some("round_robin")),
            ("session flow-off", "session", Some("round_robin flow-off")),
            (
                "least_loaded interactive-alone",
                "least_loaded",
                Some("round_robin interactive-alone"),
            ),
            (
                "session@pd:2x2/t=2048 flow-off",
                "session",
                Some("round_robin@pd:2x2/t=2048 flow-off"),
            ),
            ("round_robin@agg", "round_robin", None),
        ];
        for (label, policy, expected) in cases {
            assert_eq!(counterpart(label, policy).as_deref(), expected, "{label}");
        }
    }
}
