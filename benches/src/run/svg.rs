//! Hand-written SVG line charts: TTFT CDF per row, cache hit ratio over time, per-replica load
//! over time. Each chart has titled, ticked axes and a legend.

use std::fmt::Write;

use super::replay::Outcome;
use super::summary::PolicyRun;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// (x, y) points in data units, in x order.
    pub points: Vec<(f64, f64)>,
}

/// One plot area with its axes.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Title above the plot.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic x axis (non-positive x values are dropped).
    pub x_log: bool,
    /// Fixed y range; None fits the data from 0.
    pub y_range: Option<(f64, f64)>,
    /// The lines.
    pub series: Vec<Series>,
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const WIDTH: f64 = 960.0;
const PANEL_HEIGHT: f64 = 340.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 290.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// "Nice" tick values (1, 2 or 5 times a power of ten) covering [lo, hi].
pub fn linear_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    if hi <= lo || !lo.is_finite() || !hi.is_finite() {
        return vec![lo];
    }
    let raw = (hi - lo) / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    // k * step, rounded to the step's own precision so 3 * 0.2 prints and compares as 0.6.
    let decimals = (-step.log10().floor()).max(0.0) as i32;
    let unit = 10f64.powi(decimals);
    (first..=last)
        .map(|k| (k as f64 * step * unit).round() / unit)
        .collect()
}

fn tick_label(value: f64) -> String {
    let abs = value.abs();
    if abs >= 1e6 {
        format!("{:.1}M", value / 1e6)
    } else if abs >= 1e4 {
        format!("{:.0}k", value / 1e3)
    } else if abs >= 100.0 || value.fract() == 0.0 {
        format!("{value:.0}")
    } else if abs >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// Render panels stacked vertically under one title.
pub fn render(title: &str, panels: &[Panel]) -> String {
    let height = 40.0 + PANEL_HEIGHT * panels.len().max(1) as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">{}</text>\n",
        WIDTH / 2.0,
        escape(title)
    );
    for (index, panel) in panels.iter().enumerate() {
        render_panel(&mut out, panel, 40.0 + PANEL_HEIGHT * index as f64);
    }
    out.push_str("</svg>\n");
    out
}

fn render_panel(out: &mut String, panel: &Panel, y0: f64) {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = PANEL_HEIGHT - TOP - BOTTOM;
    let (px0, py0) = (LEFT, y0 + TOP);
    let fx = |x: f64| if panel.x_log { x.log10() } else { x };
    let points: Vec<(f64, f64)> = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite() && (!panel.x_log || *x > 0.0))
        .collect();
    let (mut x_lo, mut x_hi) = points
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (x, _)| {
            (lo.min(fx(*x)), hi.max(fx(*x)))
        });
    if !x_lo.is_finite() {
        (x_lo, x_hi) = (0.0, 1.0);
    }
    if panel.x_log {
        x_lo = x_lo.floor();
        x_hi = x_hi.ceil().max(x_lo + 1.0);
    } else if x_hi <= x_lo {
        x_hi = x_lo + 1.0;
    }
    let (y_lo, y_hi) = panel.y_range.unwrap_or_else(|| {
        let max = points.iter().map(|(_, y)| *y).fold(0.0, f64::max);
        let top = if max > 0.0 { max } else { 1.0 };
        let ticks = linear_ticks(0.0, top, 5);
        let step = match (ticks.first(), ticks.get(1)) {
            (Some(a), Some(b)) if b > a => b - a,
            _ => top,
        };
        (0.0, (top / step).ceil() * step)
    });
    let sx = |x: f64| px0 + (fx(x) - x_lo) / (x_hi - x_lo) * plot_w;
    let sy = |y: f64| py0 + plot_h - (y - y_lo) / (y_hi - y_lo).max(f64::EPSILON) * plot_h;

    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"14\">{}</text>",
        px0 + plot_w / 2.0,
        py0 - 12.0,
        escape(&panel.title)
    );
    // Grid and ticks.
    let x_ticks: Vec<f64> = if panel.x_log {
        (x_lo as i32..=x_hi as i32).map(|e| 10f64.powi(e)).collect()
    } else {
        linear_ticks(x_lo, x_hi, 8)
    };
    for x in x_ticks {
        let at = sx(x);
        let _ = writeln!(
            out,
            "<line x1=\"{at:.1}\" y1=\"{py0:.1}\" x2=\"{at:.1}\" y2=\"{:.1}\" stroke=\"#e0e0e0\"/>\n\
             <text x=\"{at:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            py0 + plot_h,
            py0 + plot_h + 16.0,
            tick_label(x)
        );
    }
    for y in linear_ticks(y_lo, y_hi, 5) {
        let at = sy(y);
        let _ = writeln!(
            out,
            "<line x1=\"{px0:.1}\" y1=\"{at:.1}\" x2=\"{:.1}\" y2=\"{at:.1}\" stroke=\"#e0e0e0\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            px0 + plot_w,
            px0 - 6.0,
            at + 4.0,
            tick_label(y)
        );
    }
    let _ = writeln!(
        out,
        "<rect x=\"{px0:.1}\" y=\"{py0:.1}\" width=\"{plot_w:.1}\" height=\"{plot_h:.1}\" fill=\"none\" stroke=\"#333\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 {:.1} {:.1})\">{}</text>",
        px0 + plot_w / 2.0,
        py0 + plot_h + 38.0,
        escape(&panel.x_label),
        px0 - 55.0,
        py0 + plot_h / 2.0,
        px0 - 55.0,
        py0 + plot_h / 2.0,
        escape(&panel.y_label)
    );
    // Lines and legend.
    for (index, series) in panel.series.iter().enumerate() {
        let color = COLORS.get(index % COLORS.len()).copied().unwrap_or("#000");
        let path: Vec<String> = series
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!panel.x_log || *x > 0.0))
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(y.clamp(y_lo, y_hi))))
            .collect();
        if !path.is_empty() {
            let _ = writeln!(
                out,
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
                path.join(" ")
            );
        }
        let ly = py0 + 10.0 + 20.0 * index as f64;
        let lx = px0 + plot_w + 15.0;
        let _ = writeln!(
            out,
            "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"3\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            escape(&series.name)
        );
    }
}

/// At most `limit` points, evenly thinned, keeping the last.
fn thin(points: Vec<(f64, f64)>, limit: usize) -> Vec<(f64, f64)> {
    if points.len() <= limit || limit < 2 {
        return points;
    }
    let step = points.len() as f64 / (limit - 1) as f64;
    let mut out: Vec<(f64, f64)> = (0..limit - 1)
        .filter_map(|i| points.get((i as f64 * step) as usize).copied())
        .collect();
    if let Some(last) = points.last() {
        out.push(*last);
    }
    out
}

/// TTFT CDF, one line per row (see `run::rows`), log-scaled time axis.
pub fn ttft_cdf(runs: &[PolicyRun]) -> String {
    let series = runs
        .iter()
        .map(|run| {
            let mut ttft: Vec<f64> = run.records.iter().filter_map(|r| r.ttft_ms).collect();
            ttft.sort_by(f64::total_cmp);
            let n = ttft.len() as f64;
            let points = ttft
                .iter()
                .enumerate()
                .map(|(i, v)| (v.max(0.01), (i + 1) as f64 / n))
                .collect();
            Series {
                name: run.summary.label.clone(),
                points: thin(points, 500),
            }
        })
        .collect();
    render(
        "Time to first token",
        &[Panel {
            title: "CDF of TTFT per row".into(),
            x_label: "TTFT (simulated ms, log scale)".into(),
            y_label: "fraction of requests".into(),
            x_log: true,
            y_range: Some((0.0, 1.0)),
            series,
        }],
    )
}

/// Number of time bins of the over-time charts.
const BINS: usize = 40;

/// Prompt-token cache hit ratio of the requests sent in each time bin, one line per row.
pub fn cache_hit_over_time(runs: &[PolicyRun]) -> String {
    let end = runs
        .iter()
        .flat_map(|run| run.records.iter().map(|r| r.sent_s))
        .fold(0.0, f64::max);
    let width = (end / BINS as f64).max(1e-3);
    // A decode replica reports the KV it received from a prefill replica as cached: P/D rows'
    // client-side ratios are not cache reuse (see `run::pd`), so they are left out.
    let series = runs
        .iter()
        .filter(|run| run.summary.pd.is_none())
        .map(|run| {
            let mut prompt = vec![0u64; BINS];
            let mut cached = vec![0u64; BINS];
            for record in &run.records {
                if record.outcome != Outcome::Success {
                    continue;
                }
                let bin = ((record.sent_s / width) as usize).min(BINS - 1);
                if let (Some(p), Some(c)) = (prompt.get_mut(bin), cached.get_mut(bin)) {
                    *p += record.input_tokens;
                    *c += record.cached_tokens;
                }
            }
            let points = prompt
                .iter()
                .zip(&cached)
                .enumerate()
                .filter(|(_, (p, _))| **p > 0)
                .map(|(bin, (p, c))| ((bin as f64 + 0.5) * width, *c as f64 / *p as f64))
                .collect();
            Series {
                name: run.summary.label.clone(),
                points,
            }
        })
        .collect();
    render(
        "Prefix-cache hit ratio over time",
        &[Panel {
            title: "cached / prompt tokens of the requests sent in each interval".into(),
            x_label: "simulated time (s)".into(),
            y_label: "cache hit ratio".into(),
            x_log: false,
            y_range: Some((0.0, 1.0)),
            series,
        }],
    )
}

/// Requests running + waiting on each replica over time, one panel per row.
pub fn replica_load(runs: &[PolicyRun]) -> String {
    let panels: Vec<Panel> = runs
        .iter()
        .map(|run| {
            let replicas = run
                .samples
                .iter()
                .map(|s| s.replicas.len())
                .max()
                .unwrap_or(0);
            let series = (0..replicas)
                .map(|replica| Series {
                    name: format!("replica {replica}"),
                    points: run
                        .samples
                        .iter()
                        .filter_map(|s| {
                            s.replicas
                                .get(replica)
                                .map(|m| (s.t_s, m.running + m.waiting))
                        })
                        .collect(),
                })
                .collect();
            Panel {
                title: format!(
                    "{}: requests running + waiting per replica",
                    run.summary.label
                ),
                x_label: "simulated time (s)".into(),
                y_label: "requests".into(),
                x_log: false,
                y_range: None,
                series,
            }
        })
        .collect();
    render("Per-replica load over time", &panels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_numbers_covering_the_range() {
        assert_eq!(
            linear_ticks(0.0, 1.0, 5),
            vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
        );
        let ticks = linear_ticks(0.0, 730.0, 8);
        assert_eq!(ticks.first(), Some(&0.0));
        assert_eq!(ticks.get(1), Some(&100.0));
    }

    #[test]
    fn chart_is_well_formed_svg_with_legend_and_escaped_text() {
        let svg = render(
            "a < b",
            &[Panel {
                title: "t".into(),
                x_label: "x".into(),
                y_label: "y".into(),
                x_log: true,
                y_range: Some((0.0, 1.0)),
                series: vec![Series {
                    name: "round_robin".into(),
                    points: vec![(0.0, 0.1), (10.0, 0.5), (1000.0, 1.0)],
                }],
            }],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt; b"));
        assert!(svg.contains(">round_robin</text>"));
        assert_eq!(svg.matches("<polyline").count(), 1);
        // log axis: decades 10^1..10^3 labelled, the zero point dropped
        assert!(svg.contains(">1000</text>"));
        let points = svg
            .split("points=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap();
        assert_eq!(points.split(' ').count(), 2);
    }
}
