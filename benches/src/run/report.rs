//! `report.md`: the run's parameters and command line, the comparison table, per-team figures, a
//! one-paragraph reading, and how much the figures move with the time scale.

use std::fmt::Write;

use super::summary::{PolicySummary, RunSummary};

fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

fn pct(value: f64) -> String {
    format!("{:.1}%", value * 100.0)
}

/// The comparison as a Markdown table, one row per policy.
pub fn table(policies: &[PolicySummary]) -> String {
    let mut out = String::new();
    out.push_str(
        "| policy | requests | errors | shed | cache hit | available reuse | infinite reuse | captured | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | output tok/s | prefill computed | GPU s / M tok |\n",
    );
    out.push_str(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in policies {
        let gpu = p
            .gpu_seconds_per_million_tokens
            .map_or_else(|| "n/a".to_string(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {:.0} | {} | {} |",
            p.policy,
            p.requests,
            p.errors,
            p.shed,
            pct(p.cache_hit_ratio),
            pct(p.available_reuse_ratio),
            pct(p.infinite_reuse_ratio),
            p.captured_reuse,
            ms(p.ttft_p50_ms),
            ms(p.ttft_p90_ms),
            ms(p.ttft_p99_ms),
            ms(p.e2e_p50_ms),
            ms(p.e2e_p99_ms),
            p.output_tokens_per_s,
            p.prefill_tokens_computed,
            gpu,
        );
    }
    out
}

fn team_table(policies: &[PolicySummary]) -> Option<String> {
    let several = policies.iter().any(|p| p.teams.len() > 1);
    if !several {
        return None;
    }
    let mut out = String::from(
        "| policy | team | requests | errors | shed | cache hit | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in policies {
        for (team, t) in &p.teams {
            let _ = writeln!(
                out,
                "| {} | {team} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                p.policy,
                t.requests,
                t.errors,
                t.shed,
                pct(t.cache_hit_ratio),
                ms(t.ttft_p50_ms),
                ms(t.ttft_p90_ms),
                ms(t.ttft_p99_ms),
                ms(t.e2e_p50_ms),
                ms(t.e2e_p99_ms),
            );
        }
    }
    Some(out)
}

/// A paragraph reading the table: reuse captured, latency and prefill work by policy.
pub fn reading(summary: &RunSummary) -> String {
    let policies = &summary.policies;
    let Some(first) = policies.first() else {
        return "No policy was run.".into();
    };
    let mut text = format!(
        "An ideal single cache with the whole fleet's capacity would have served {} of the prompt \
         tokens from cache ({} with unlimited capacity). ",
        pct(first.available_reuse_ratio),
        pct(first.infinite_reuse_ratio)
    );
    let captured: Vec<String> = policies
        .iter()
        .map(|p| {
            format!(
                "{} hit {} ({:.0}% of that)",
                p.policy,
                pct(p.cache_hit_ratio),
                p.captured_reuse * 100.0
            )
        })
        .collect();
    let _ = write!(
        text,
        "Measured at the engines' prefix caches, {}. ",
        captured.join(", ")
    );
    let by = |key: fn(&PolicySummary) -> f64| {
        policies
            .iter()
            .min_by(|a, b| key(a).total_cmp(&key(b)))
            .map(|p| (p.policy.clone(), key(p)))
    };
    if policies.len() > 1 {
        if let (Some((best50, v50)), Some((best99, v99))) =
            (by(|p| p.ttft_p50_ms), by(|p| p.ttft_p99_ms))
        {
            let _ = write!(
                text,
                "Median time to first token is lowest with {best50} ({} ms) and the 99th \
                 percentile with {best99} ({} ms). ",
                ms(v50),
                ms(v99)
            );
        }
        let prefilled = |p: &PolicySummary| {
            if p.engine.prompt_tokens == 0 {
                0.0
            } else {
                p.prefill_tokens_computed as f64 / p.engine.prompt_tokens as f64
            }
        };
        if let Some((least, share)) = by(prefilled) {
            let _ = write!(
                text,
                "{least} left the engines the smallest share of prompt tokens to prefill ({}). ",
                pct(share)
            );
        }
        let counts: Vec<u64> = policies.iter().map(|p| p.requests).collect();
        if counts.iter().min() != counts.iter().max() {
            text.push_str(
                "Request counts differ because no turn starts after the replayed span, so a \
                 slower policy fits fewer turns in it; compare ratios and percentiles. ",
            );
        }
    } else {
        let _ = write!(
            text,
            "Median time to first token was {} ms (p99 {} ms). ",
            ms(first.ttft_p50_ms),
            ms(first.ttft_p99_ms)
        );
    }
    let failed: u64 = policies.iter().map(|p| p.errors + p.shed).sum();
    if failed > 0 {
        let _ = write!(
            text,
            "{failed} requests failed or were shed in total; their latencies are excluded. "
        );
    }
    if !summary.engine_busy_counter {
        text.push_str(
            "The replicas do not expose simulated engine busy time, so GPU seconds are not \
             reported and prefill computed is prompt tokens minus cache hits. ",
        );
    }
    text.trim_end().to_string()
}

fn time_scale_section(summary: &RunSummary) -> String {
    let Some(check) = &summary.time_scale_check else {
        let other = if summary.time_scale > 0.0 {
            summary.time_scale * 2.0
        } else {
            0.1
        };
        return format!(
            "Latencies are simulated time (wall time / time scale), so the gateway's own real \
             overhead is magnified by 1 / time scale ({}). To see how much the headline figures \
             depend on the time scale, run the same command with `--compare-time-scale {other}`: \
             it replays everything a second time at that scale and tabulates the change here.\n",
            if summary.time_scale > 0.0 {
                format!("{:.0}x at {}", 1.0 / summary.time_scale, summary.time_scale)
            } else {
                "not applicable at time scale 0, where latencies are wall time".to_string()
            }
        );
    };
    let mut out = format!(
        "The same replay at time scale {} (main run: {}); change relative to the main run:\n\n\
         | policy | cache hit | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | output tok/s |\n\
         |---|---:|---:|---:|---:|---:|\n",
        check.time_scale, summary.time_scale
    );
    let change = |base: f64, other: f64| {
        if base.abs() < f64::EPSILON {
            "n/a".to_string()
        } else {
            format!("{:+.1}%", (other - base) / base * 100.0)
        }
    };
    for other in &check.policies {
        let Some(base) = summary.policies.iter().find(|p| p.policy == other.policy) else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {} ({}) | {} ({}) | {} ({}) | {} ({}) | {:.0} ({}) |",
            other.policy,
            pct(other.cache_hit_ratio),
            change(base.cache_hit_ratio, other.cache_hit_ratio),
            ms(other.ttft_p50_ms),
            change(base.ttft_p50_ms, other.ttft_p50_ms),
            ms(other.ttft_p99_ms),
            change(base.ttft_p99_ms, other.ttft_p99_ms),
            ms(other.e2e_p50_ms),
            change(base.e2e_p50_ms, other.e2e_p50_ms),
            other.output_tokens_per_s,
            change(base.output_tokens_per_s, other.output_tokens_per_s),
        );
    }
    out
}

/// The whole `report.md`.
pub fn render(summary: &RunSummary) -> String {
    let mut out = format!("# agentgate-bench run: {}\n\n", summary.workload);
    let _ = writeln!(out, "```sh\n{}\n```\n", summary.command);
    let _ = writeln!(
        out,
        "{} replicas per policy, each with {} KV blocks of {} tokens; {} sessions (sub-agents \
         included) over {} simulated seconds at time scale {}; seed {}. Times are simulated \
         milliseconds; every policy starts from cold caches.\n",
        summary.replicas,
        summary.kv_blocks,
        summary.block_size,
        summary.sessions,
        summary.duration_s,
        summary.time_scale,
        summary.seed
    );
    out.push_str("## Results\n\n");
    out.push_str(&table(&summary.policies));
    out.push('\n');
    if let Some(teams) = team_table(&summary.policies) {
        out.push_str("### Per team\n\n");
        out.push_str(&teams);
        out.push('\n');
    }
    out.push_str("## Reading\n\n");
    out.push_str(&reading(summary));
    out.push_str("\n\n## Time scale\n\n");
    out.push_str(&time_scale_section(summary));
    out.push_str(
        "\n## Charts\n\n![TTFT CDF](ttft_cdf.svg)\n\n![Cache hit ratio over time](cache_hit_ratio.svg)\n\n\
         ![Per-replica load over time](replica_load.svg)\n",
    );
    out
}
