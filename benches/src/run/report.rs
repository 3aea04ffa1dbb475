//! `report.md`: the run's parameters and command line, the comparison table (one row per policy,
//! layout, threshold, flow-control setting and traffic; see `run::rows`), per-team figures,
//! flow control (bands, teams, turn kinds, fairness, the interactive team's isolation) with a
//! short reading, how requests were spread over gateways, what killing a replica did
//! (`--kill-replica`), the prefill/decode comparison (`--topology` with a `pd:PxD` layout), a
//! one-paragraph reading, and how much the figures move with the time scale.

use std::collections::BTreeSet;
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

/// The comparison as a Markdown table, one row per replay.
pub fn table(policies: &[PolicySummary]) -> String {
    let mut out = String::new();
    out.push_str(
        "| row | requests | errors | shed | cache hit | available reuse | infinite reuse | captured | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | output tok/s | prefill computed | preempted | GPU s / M tok |\n",
    );
    out.push_str(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in policies {
        let gpu = p
            .gpu_seconds_per_million_tokens
            .map_or_else(|| "n/a".to_string(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} |",
            p.label,
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
            p.engine.preemptions,
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
        "| row | team | requests | errors | shed | cache hit | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in policies {
        for (team, t) in &p.teams {
            let _ = writeln!(
                out,
                "| {} | {team} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                p.label,
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

/// A paragraph reading the table: reuse captured, latency and prefill work by row. Rows that
/// replay only part of the workload (`interactive-alone`) are compared in the flow-control
/// section, not here.
pub fn reading(summary: &RunSummary) -> String {
    let whole: Vec<PolicySummary> = summary
        .policies
        .iter()
        .filter(|p| p.traffic == "all")
        .cloned()
        .collect();
    let policies = &whole;
    let Some(first) = policies.first() else {
        return "No policy was run.".into();
    };
    // Each row replays its own requests (closed-loop sessions send more turns where they are
    // served faster), so each is set against its own ideal cache.
    let mut text = format!(
        "An ideal single cache with the whole fleet's capacity, replaying each row's prompts, \
         would have served {} of the prompt tokens from cache ({} with unlimited capacity)",
        pct(first.available_reuse_ratio),
        pct(first.infinite_reuse_ratio)
    );
    text.push_str(if policies.len() > 1 {
        " for the first row. "
    } else {
        ". "
    });
    let captured: Vec<String> = policies
        .iter()
        .map(|p| {
            format!(
                "{} hit {} ({:.0}% of its ideal cache's {})",
                p.label,
                pct(p.cache_hit_ratio),
                p.captured_reuse * 100.0,
                pct(p.available_reuse_ratio)
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
            .map(|p| (p.label.clone(), key(p)))
    };
    if policies.len() > 1 {
        // Latencies count answered requests only: a row that failed or refused a larger share
        // of them dropped its slowest, so only the rows that lost the smallest share are
        // ranked on them (rows send different numbers of requests).
        let lost = |p: &PolicySummary| {
            (p.errors + p.shed + p.rate_limited) as f64 / p.requests.max(1) as f64
        };
        let answered = || policies.iter().filter(|p| p.successes > 0);
        let fewest = answered().map(lost).fold(f64::INFINITY, f64::min);
        let ranked: Vec<&PolicySummary> = answered().filter(|p| lost(p) <= fewest).collect();
        let fastest = |key: fn(&PolicySummary) -> f64| {
            ranked
                .iter()
                .min_by(|a, b| key(a).total_cmp(&key(b)))
                .map(|p| (p.label.clone(), key(p)))
        };
        if let (Some((best50, v50)), Some((best99, v99))) =
            (fastest(|p| p.ttft_p50_ms), fastest(|p| p.ttft_p99_ms))
        {
            let among = match ranked.len() < policies.len() {
                true => " (among the rows that lost the fewest requests)",
                false => "",
            };
            let _ = write!(
                text,
                "Median time to first token is lowest with {best50} ({} ms) and the 99th \
                 percentile with {best99} ({} ms){among}. ",
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
    let failed: u64 = policies
        .iter()
        .map(|p| p.errors + p.shed + p.rate_limited)
        .sum();
    if failed > 0 {
        let _ = write!(
            text,
            "{failed} requests failed or were refused in total; their latencies are excluded. "
        );
    }
    let bound = policies
        .iter()
        .map(|p| p.no_eviction_kv_blocks)
        .max()
        .unwrap_or(0);
    if bound > 0 {
        if summary.kv_blocks as u64 >= bound {
            let _ = write!(
                text,
                "No replica can have evicted anything: each had {} KV blocks, and {bound} would \
                 hold everything any replica was sent. ",
                summary.kv_blocks
            );
        } else {
            let _ = write!(
                text,
                "Replicas may have evicted cached blocks; with `--kv-blocks {bound}` or more none \
                 could have. "
            );
        }
    }
    text.push_str(
        "\"Preempted\" counts running sequences the engines preempted for lack of KV blocks \
         (`vllm:num_preemptions_total`); each computes its tokens again once readmitted. ",
    );
    if !summary.engine_busy_counter {
        text.push_str(
            "The replicas do not expose simulated engine busy time, so GPU seconds are not \
             reported and prefill computed is prompt tokens minus cache hits. ",
        );
    }
    text.trim_end().to_string()
}

fn time_scale_section(summary: &RunSummary) -> String {
    if summary.clock == "virtual" {
        return "This run followed the virtual clock (`--clock virtual`): one thread on a paused \
                clock that jumps to the next timer whenever every task waits. Only the simulated \
                engines' step times pass and the gateway's own CPU time counts as zero. A run with \
                the same seed gives the same figures, but for rare exceptions (see \
                benches/README.md). On the wall clock, \
                `--compare-time-scale` shows how much they move between two time scales.\n"
            .to_string();
    }
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
         | row | cache hit | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | output tok/s |\n\
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
        let Some(base) = summary.policies.iter().find(|p| p.label == other.label) else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {} ({}) | {} ({}) | {} ({}) | {} ({}) | {:.0} ({}) |",
            other.label,
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

fn optional_pct(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_string(), pct)
}

fn optional_ratio(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}"))
}

/// How the gateways shared the work: the assignment rule and the requests each received.
fn gateway_section(summary: &RunSummary) -> String {
    let mut out = format!(
        "{} gateways per policy over the same replicas, sharing one {} store (responses and \
         session pins). Turn t (0-based) of session s (its index in the workload, sub-agents \
         included) was sent to gateway (s + t) mod {}: every session alternates between gateways \
         from one turn to the next, so its history and its pin reach the next gateway only \
         through the store.\n\n| row | requests per gateway | requests per replica |\n|---|---|---|\n",
        summary.gateways, summary.store, summary.gateways
    );
    for p in &summary.policies {
        let list = |counts: &[u64]| {
            counts
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} |",
            p.label,
            list(&p.requests_per_gateway),
            list(&p.requests_per_replica)
        );
    }
    out
}

fn optional_ms(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_string(), ms)
}

fn optional_times(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}x"))
}

/// Whether the report has anything to say about flow control: a row with flow control on and
/// bands, several flow settings, or several teams.
fn has_flow_section(summary: &RunSummary) -> bool {
    summary.flow_control.len() > 1
        || summary
            .policies
            .iter()
            .any(|p| (p.flow_control == "on" && !p.bands.is_empty()) || p.teams.len() > 1)
}

/// The flow-control section: configuration, isolation check, per-row saturation, bands, teams,
/// turn kinds, fairness, and a short reading.
pub fn flow_section(summary: &RunSummary) -> Option<String> {
    if !has_flow_section(summary) {
        return None;
    }
    let multi_team = summary.policies.iter().any(|p| p.teams.len() > 1);
    let slots: BTreeSet<usize> = summary.policies.iter().map(|p| p.request_slots).collect();
    let slots = if slots.len() > 1 {
        let list: Vec<String> = slots.iter().map(usize::to_string).collect();
        format!(
            "{} request slots over the fleet, depending on the row's layout",
            list.join(" or ")
        )
    } else {
        let n = slots.first().copied().unwrap_or(summary.request_slots);
        format!("{n} request slots over the fleet")
    };
    let mut out = format!(
        "{} The gateway's per-endpoint cap is the replicas' batch width ({} sequences, {}{}), \
         so what the engines cannot run waits in the gateway. ",
        if summary.flow_control.len() > 1 {
            format!(
                "Flow control {} were compared.",
                summary.flow_control.join(" and ")
            )
        } else {
            format!("Flow control was {}.", summary.flow_control.join(""))
        },
        summary.max_num_seqs,
        slots,
        if summary.gateways > 1 {
            format!(", divided among {} gateways", summary.gateways)
        } else {
            String::new()
        }
    );
    if multi_team {
        let _ = write!(
            out,
            "Bands: `interactive` (priority 100, queue TTL {:.0} s) above `batch` (priority 10, \
             TTL {:.0} s, {}); team `interactive` runs in `interactive`, every other team in \
             `batch`, each with its own API key and weight 1. ",
            super::flow::INTERACTIVE_TTL_S,
            super::flow::BATCH_TTL_S,
            if summary.batch_sheddable {
                "sheddable"
            } else {
                "not sheddable"
            }
        );
    } else {
        out.push_str("One team: the gateway's implicit band `default`. ");
    }
    out.push_str(
        "Queue waits are the gateway's `x-agentgate-queue-wait-ms` of admitted requests; \
         \"saturated\" is the share of samples (every 20 ms on the run's clock) in which the pool had \
         requests queued or its in-flight requests at capacity, and \"shed while not saturated\" \
         counts refusals with no saturated sample from just before their send to just after \
         their answer.\n\n",
    );
    if !summary.interactive_isolation.is_empty() {
        out.push_str(
            "Interactive isolation (team `interactive`, TTFT p99 in simulated ms; goals: flow on \
             at most 2x alone, flow off at least 5x flow on, the agents offering at least twice \
             the fleet's request slots):\n\n\
             | setup | alone | flow on | flow off | on / alone | off / on | agents' offered load |\n\
             |---|---:|---:|---:|---:|---:|---:|\n",
        );
        for c in &summary.interactive_isolation {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                c.setup,
                optional_ms(c.alone_ttft_p99_ms),
                optional_ms(c.flow_on_ttft_p99_ms),
                optional_ms(c.flow_off_ttft_p99_ms),
                optional_times(c.on_over_alone),
                optional_times(c.off_over_on),
                c.agents_offered_load
                    .map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}")),
            );
        }
        out.push('\n');
    }
    out.push_str(
        "| row | flow control | saturated | shed | rate limited | shed while not saturated |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for p in &summary.policies {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            p.label,
            p.flow_control,
            optional_pct(p.saturated_fraction),
            p.shed,
            p.rate_limited,
            p.shed_unsaturated
                .map_or_else(|| "n/a".to_string(), |v| v.to_string()),
        );
    }
    out.push_str(
        "\nQueue wait of continuing turns (after the first of a session, or a sub-agent's) and of \
         new sessions, median in simulated ms over every admitted request; then, because waits \
         drift with the backlog, each new session sent while the pool was saturated against its \
         team's continuing turns sent within 15 s of it (turn-first order applies within a team; \
         goal under saturation: continuing at most 0.5x new):\n\n\
         | row | team | continuing | new | new sessions paired | new, paired | continuing around them | continuing / new |\n\
         |---|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in summary.policies.iter().filter(|p| p.flow_control == "on") {
        let all = std::iter::once(("(all)", &p.turns));
        let teams = p.teams.iter().map(|(name, t)| (name.as_str(), &t.turns));
        for (team, t) in all.chain(teams) {
            let m = t.matched.as_ref();
            let _ = writeln!(
                out,
                "| {} | {team} | {} | {} | {} | {} | {} | {} |",
                p.label,
                optional_ms(t.continuing.queue_wait_p50_ms),
                optional_ms(t.new.queue_wait_p50_ms),
                m.map_or(0, |m| m.pairs),
                optional_ms(m.map(|m| m.new_queue_wait_p50_ms)),
                optional_ms(m.map(|m| m.continuing_queue_wait_p50_ms)),
                m.and_then(|m| m.continuing_over_new)
                    .map_or_else(|| "n/a".to_string(), |r| format!("{r:.2}")),
            );
        }
    }
    if summary.policies.iter().any(|p| !p.bands.is_empty()) {
        out.push_str(
            "\n| row | band | requests | shed | rate limited | errors | TTFT p50 ms | TTFT p99 ms | queue wait p50 ms | queue wait p99 ms | longest wait ms | queue TTL ms |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for p in &summary.policies {
            for (band, b) in &p.bands {
                let _ = writeln!(
                    out,
                    "| {} | {band} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    p.label,
                    b.requests,
                    b.shed,
                    b.rate_limited,
                    b.errors,
                    optional_ms(b.ttft_p50_ms),
                    optional_ms(b.ttft_p99_ms),
                    optional_ms(b.queue_wait_p50_ms),
                    optional_ms(b.queue_wait_p99_ms),
                    optional_ms(b.queue_wait_max_ms),
                    optional_ms(b.queue_ttl_ms),
                );
            }
        }
    }
    out.push_str(
        "\n| row | team | requests | dispatched tokens | token share | offered load | shed | rate limited | queue wait p50 ms | queue wait p99 ms | TTFT p99 ms |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in &summary.policies {
        for (team, t) in &p.teams {
            let _ = writeln!(
                out,
                "| {} | {team} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} |",
                p.label,
                t.requests,
                t.dispatched_tokens,
                pct(t.dispatched_token_share),
                t.offered_load,
                t.shed,
                t.rate_limited,
                optional_ms(t.queue_wait_p50_ms),
                optional_ms(t.queue_wait_p99_ms),
                ms(t.ttft_p99_ms),
            );
        }
    }
    out.push_str(
        "\n\"Offered load\" is the team's mean requests outstanding (sent, not yet answered) over \
         the replayed span, per request slot of the fleet: above 1 the team alone asks for more \
         than the fleet runs at once. \"Token share\" is its share of the input + output tokens \
         of every successful request.\n",
    );
    if summary.policies.iter().any(|p| !p.fairness.is_empty()) {
        out.push_str(
            "\nFairness within a band, over the time every team of the band had a request queued \
             (goal with equal weights: each team 45-55% of the tokens dispatched then):\n\n\
             | row | band | both backlogged s | team | dispatched requests | dispatched tokens | share |\n\
             |---|---|---:|---|---:|---:|---:|\n",
        );
        for p in &summary.policies {
            for (band, f) in &p.fairness {
                for (team, share) in &f.teams {
                    let _ = writeln!(
                        out,
                        "| {} | {band} | {:.1} | {team} | {} | {} | {} |",
                        p.label,
                        f.backlogged_s,
                        share.dispatched_requests,
                        share.dispatched_tokens,
                        optional_pct(share.share),
                    );
                }
            }
        }
    }
    out.push('\n');
    out.push_str(&flow_reading(summary));
    out.push('\n');
    Some(out)
}

/// A few sentences on the flow-control figures, against the goals they are measured for.
pub fn flow_reading(summary: &RunSummary) -> String {
    let mut text = String::new();
    for c in &summary.interactive_isolation {
        if let (Some(on), Some(ratio)) = (c.flow_on_ttft_p99_ms, c.on_over_alone) {
            let _ = write!(
                text,
                "With {}, the interactive team's TTFT p99 beside the batch load was {} ms with \
                 flow control, {ratio:.2}x its {} ms alone ({} the 2x goal)",
                c.setup,
                ms(on),
                optional_ms(c.alone_ttft_p99_ms),
                if ratio <= 2.0 { "within" } else { "outside" },
            );
            match c.off_over_on {
                Some(off) => {
                    let _ = write!(
                        text,
                        ", and {off:.2}x better than without flow control ({} the 5x goal)",
                        if off >= 5.0 { "meeting" } else { "short of" }
                    );
                }
                None => text.push_str("; flow control off was not run"),
            }
            if let Some(load) = c.agents_offered_load {
                let _ = write!(
                    text,
                    "; the agents kept {load:.2}x the fleet's request slots outstanding{}",
                    if load >= 2.0 {
                        ""
                    } else {
                        ", less than the 2x the goal is stated for (raise --mixed-batch-load)"
                    }
                );
            }
            let unanswered = [
                ("alone", c.alone_unanswered),
                ("with flow control", c.flow_on_unanswered),
                ("without flow control", c.flow_off_unanswered),
            ];
            for (setting, count) in unanswered {
                if let Some(n @ 1..) = count {
                    let _ = write!(
                        text,
                        "; {n} interactive requests {setting} got no answer and are not in its p99"
                    );
                }
            }
            text.push_str(". ");
        }
    }
    for p in &summary.policies {
        for (band, f) in &p.fairness {
            let shares: Vec<String> = f
                .teams
                .iter()
                .map(|(team, s)| format!("{team} {}", optional_pct(s.share)))
                .collect();
            let fair = f
                .teams
                .values()
                .all(|s| s.share.is_some_and(|v| (0.45..=0.55).contains(&v)));
            let _ = write!(
                text,
                "In {}, while every team of band {band} was backlogged ({:.0} s), dispatched \
                 tokens split {} ({} 45-55% each). ",
                p.label,
                f.backlogged_s,
                shares.join(" / "),
                if fair { "within" } else { "not within" }
            );
        }
    }
    for p in summary.policies.iter().filter(|p| p.flow_control == "on") {
        for (team, t) in &p.teams {
            let Some(m) = &t.turns.matched else {
                continue;
            };
            if let Some(ratio) = m.continuing_over_new {
                let _ = write!(
                    text,
                    "In {}, {} new sessions of team {team} sent while the pool was saturated \
                     waited {} ms at the median, and the team's continuing turns sent around them \
                     {} ms ({ratio:.2}x; goal: at most 0.5x). ",
                    p.label,
                    m.pairs,
                    ms(m.new_queue_wait_p50_ms),
                    ms(m.continuing_queue_wait_p50_ms),
                );
            }
        }
    }
    let unsaturated: u64 = summary
        .policies
        .iter()
        .filter_map(|p| p.shed_unsaturated)
        .sum();
    let refused: u64 = summary
        .policies
        .iter()
        .filter(|p| p.flow_control == "on")
        .map(|p| p.shed + p.rate_limited)
        .sum();
    let _ = write!(
        text,
        "Flow control refused {refused} requests in all; {unsaturated} of them while the pool \
         was not saturated (goal: none)."
    );
    text
}

/// What killing a replica did, per policy.
fn kill_section(summary: &RunSummary) -> Option<String> {
    let at = summary.kill_replica_s?;
    let window = summary
        .policies
        .iter()
        .find_map(|p| p.kill.as_ref().map(|k| k.window_s))
        .unwrap_or(super::kill::WINDOW_S);
    let mut out = format!(
        "Replica {} was killed at {at} simulated seconds: its port stopped accepting connections \
         and every connection to it closed at once, breaking the streams in flight (the gateway \
         was not told). \"In flight\" counts the requests the gateway was streaming from it at \
         that moment (by the `x-agentgate-endpoint` header); \"engine\" is what its own gauges \
         reported just before. \"After\" counts requests sent after the kill. Cache hit ratios \
         are over the successful requests sent in the {window:.0} s before the kill, the \
         {window:.0} s after it, and from then on to the end; \"captured\" divides each by the \
         pooled-cache oracle's hit ratio on the same requests (an ideal cache with the whole \
         fleet's capacity before the kill and the surviving replicas' after it), so reuse has \
         recovered when captured late is back near captured before.\n\n\
         | row | killed at s | engine in flight | in flight | errors in flight | requests after | errors after | shed after | other errors | hit before | hit right after | hit late | captured before | captured right after | captured late |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        super::kill::KILLED_REPLICA
    );
    for p in &summary.policies {
        let Some(k) = &p.kill else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            p.label,
            k.killed_at_s
                .map_or_else(|| "not reached".to_string(), |t| format!("{t:.1}")),
            k.engine_in_flight
                .map_or_else(|| "n/a".to_string(), |n| n.to_string()),
            k.in_flight,
            k.errors_in_flight,
            k.requests_after,
            k.errors_after,
            k.shed_after,
            k.errors_other,
            optional_pct(k.hit_ratio_before),
            optional_pct(k.hit_ratio_after_60s),
            optional_pct(k.hit_ratio_late),
            optional_ratio(k.captured_before),
            optional_ratio(k.captured_after_60s),
            optional_ratio(k.captured_late),
        );
    }
    let misrouted: u64 = summary
        .policies
        .iter()
        .filter_map(|p| p.kill.as_ref())
        .map(|k| k.routed_to_killed_after)
        .sum();
    if misrouted > 0 {
        let _ = writeln!(
            out,
            "\n{misrouted} requests sent after the kill were still reported as served by the killed \
             replica."
        );
    }
    Some(out)
}

/// The replicas behind each row: `--replicas` per policy, or the layouts compared.
fn fleet(summary: &RunSummary) -> String {
    if summary.topologies.iter().all(|t| t == "agg") {
        return format!("{} replicas per policy", summary.replicas);
    }
    let layouts: Vec<String> = summary
        .topologies
        .iter()
        .map(
            |t| match t.strip_prefix("pd:").and_then(|s| s.split_once('x')) {
                Some((p, d)) => format!("{p} prefill + {d} decode replicas ({t})"),
                None => format!("{} aggregated replicas ({t})", summary.replicas),
            },
        )
        .collect();
    format!("Per row, {}", layouts.join(" or "))
}

/// The whole `report.md`.
pub fn render(summary: &RunSummary) -> String {
    let mut out = format!("# agentgate-bench run: {}\n\n", summary.workload);
    let _ = writeln!(out, "```sh\n{}\n```\n", summary.command);
    let _ = writeln!(
        out,
        "{}, each with {} KV blocks of {} tokens, behind {} gateway{} ({} \
         store); {} sessions (sub-agents included) over {} simulated seconds {}; \
         seed {}. Times are simulated milliseconds; every policy starts from cold caches.\n",
        fleet(summary),
        summary.kv_blocks,
        summary.block_size,
        summary.gateways,
        if summary.gateways == 1 { "" } else { "s" },
        summary.store,
        summary.sessions,
        summary.duration_s,
        if summary.clock == "virtual" {
            "on the virtual clock".to_string()
        } else {
            format!("at time scale {}", summary.time_scale)
        },
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
    if let Some(flow) = flow_section(summary) {
        out.push_str("### Flow control\n\n");
        out.push_str(&flow);
        out.push('\n');
    }
    if summary.gateways > 1 {
        out.push_str("### Gateways\n\n");
        out.push_str(&gateway_section(summary));
        out.push('\n');
    }
    if let Some(kill) = kill_section(summary) {
        out.push_str("### Replica kill\n\n");
        out.push_str(&kill);
        out.push('\n');
    }
    if let Some(pd) = super::pd::report_section(summary) {
        out.push_str(&pd);
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
