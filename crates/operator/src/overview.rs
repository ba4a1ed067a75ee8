//! The web UI's overview page: the fleet at a glance. Machines by state over the last day (a
//! chart of the minute snapshots the fleet statistics write), takeovers and failures per
//! minute over the last hour, the most frequent failure causes of the last day and hardware
//! totals per location. Charts are SVG rendered here; the page needs no JavaScript.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use chrono::{DateTime, Duration, Utc};
use maud::{html, Markup, PreEscaped};
use shepherd_bmdb::{
    Bmdb, FleetCounts, HeartbeatTrouble, HeartbeatWriter, Process, RecentFailure, WorkEvent,
};

use crate::cause_shapes::{self, CauseShape};
use crate::fleet_stats::HardwareByLocation;
use crate::inventory::gib;

/// How far back the state chart reaches.
const CHART_SPAN: Duration = Duration::hours(24);
/// How far back the per-minute bars reach.
const BARS_SPAN: Duration = Duration::minutes(60);
/// Failure cause shapes listed.
const TOP_CAUSES: usize = 10;
/// Distinct failure causes read to group by shape: bounded, so that a day of failures with a
/// distinct cause each costs the page no more than this.
const CAUSES_READ: i64 = 10_000;
/// Ended heartbeat troubles listed.
const TROUBLES_SHOWN: i64 = 5;

/// Everything the overview shows, read at one moment.
#[derive(Debug, Clone)]
pub struct Overview {
    /// The database's clock when it was read.
    pub now: DateTime<Utc>,
    /// The fleet counts now.
    pub counts: FleetCounts,
    /// Minute snapshots of the last day: (minute, series, machines).
    pub snapshots: Vec<(DateTime<Utc>, String, i64)>,
    /// Work endings per minute of the last hour.
    pub endings: Vec<(DateTime<Utc>, Process, WorkEvent, i64)>,
    /// The most frequent shapes of failure cause of the last day.
    pub causes: Vec<CauseShape>,
    /// Hardware totals per provider and location, from the fleet statistics' last refresh.
    pub hardware: std::sync::Arc<HardwareByLocation>,
    /// The BMaaS servers' last reports of the heartbeats they received.
    pub writers: Vec<HeartbeatWriter>,
    /// The heartbeat troubles that ended last.
    pub troubles: Vec<HeartbeatTrouble>,
}

/// Reads the overview in one read transaction (the hardware totals come from the fleet
/// statistics, which sum the reports on their own schedule).
pub async fn load(
    db: &Bmdb,
    counts: FleetCounts,
    hardware: std::sync::Arc<HardwareByLocation>,
) -> Result<Overview, shepherd_bmdb::Error> {
    let ((now, snapshots, endings, causes), (writers, troubles)) = db
        .read(|tx| {
            Box::pin(async move {
                Ok((
                    (
                        tx.now().await?,
                        tx.fleet_snapshots(CHART_SPAN).await?,
                        tx.work_endings_per_minute(BARS_SPAN).await?,
                        tx.top_failure_causes(CHART_SPAN, CAUSES_READ).await?,
                    ),
                    (
                        tx.heartbeat_writers().await?,
                        tx.recent_heartbeat_troubles(TROUBLES_SHOWN).await?,
                    ),
                ))
            })
        })
        .await?;
    Ok(Overview {
        now,
        counts,
        snapshots,
        endings,
        causes: cause_shapes::group(&causes, TOP_CAUSES),
        hardware,
        writers,
        troubles,
    })
}

/// Colours of the chart's series, by name; the rest are grey.
fn colour(series: &str) -> &'static str {
    match series {
        "machines" => "#111827",
        "provided" => "#6b7280",
        "agent started" => "#6366f1",
        "heartbeating" => "#059669",
        "stale" => "#ea580c",
        "installing" => "#ca8a04",
        "installed" => "#16a34a",
        "install failed" => "#b91c1c",
        "in work" => "#2563eb",
        "in backoff" => "#dc2626",
        "maintenance" => "#d97706",
        _ => "#9ca3af",
    }
}

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 240.0;
const LEFT: f64 = 56.0;
const BOTTOM: f64 = 24.0;
const TOP: f64 = 8.0;
/// Length of one series' dash where several series share a line.
const DASH: f64 = 8.0;

/// A round top for a y axis holding `max`: twice the smallest 1, 2 or 5 × 10ⁿ at least half
/// of it, so the axis's three gridlines carry whole numbers.
fn axis_top(max: i64) -> f64 {
    let half = (max.max(1) as f64) / 2.0;
    let mut step = 1.0;
    loop {
        for m in [1.0, 2.0, 5.0] {
            if m * step >= half {
                return 2.0 * m * step;
            }
        }
        step *= 10.0;
    }
}

/// The y axis: three gridlines with their values, for `max` at the top.
fn y_axis(svg: &mut String, max: f64) {
    for i in 0..=2 {
        let v = max * f64::from(i) / 2.0;
        let y = TOP + (HEIGHT - TOP - BOTTOM) * (1.0 - f64::from(i) / 2.0);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" x2="{WIDTH}" y1="{y:.1}" y2="{y:.1}" stroke="#e5e7eb"/><text x="{x:.1}" y="{ty:.1}" font-size="11" text-anchor="end" fill="#6b7280">{v:.0}</text>"##,
            x = LEFT - 6.0,
            ty = y + 4.0,
        );
    }
}

/// Labels under the x axis: the time at each end.
fn x_labels(svg: &mut String, from: DateTime<Utc>, to: DateTime<Utc>) {
    let y = HEIGHT - 6.0;
    let _ = write!(
        svg,
        r##"<text x="{LEFT}" y="{y}" font-size="11" fill="#6b7280">{}</text><text x="{WIDTH}" y="{y}" font-size="11" text-anchor="end" fill="#6b7280">{} UTC</text>"##,
        from.format("%m-%d %H:%M"),
        to.format("%m-%d %H:%M"),
    );
}

/// Machines by state over time: one polyline per series, x from the first snapshot (at most a
/// day back) to now.
pub fn state_chart(o: &Overview) -> Markup {
    if o.snapshots.is_empty() {
        return html! { p.muted id="state-chart" { "No snapshots yet: the fleet statistics record one a minute." } };
    }
    let from = o.snapshots[0].0.max(o.now - CHART_SPAN);
    let span = (o.now - from).num_seconds().max(60) as f64;
    let max = axis_top(o.snapshots.iter().map(|s| s.2).max().unwrap_or(0));
    let mut by_series: BTreeMap<&str, Vec<(DateTime<Utc>, i64)>> = BTreeMap::new();
    for (at, series, n) in &o.snapshots {
        by_series.entry(series).or_default().push((*at, *n));
    }
    let x = |t: DateTime<Utc>| LEFT + (WIDTH - LEFT) * ((t - from).num_seconds() as f64 / span);
    let y = |n: i64| TOP + (HEIGHT - TOP - BOTTOM) * (1.0 - n as f64 / max);
    let mut svg = String::new();
    y_axis(&mut svg, max);
    // Series drawn on the same points would hide each other: each of a group of k such series
    // is drawn dashed, its dashes shifted, so the line shows all their colours in turn.
    let mut lines: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (series, points) in &by_series {
        let line: Vec<String> = points
            .iter()
            .map(|(t, n)| format!("{:.1},{:.1}", x(*t), y(*n)))
            .collect();
        lines.entry(line.join(" ")).or_default().push(series);
    }
    for (points, group) in &lines {
        for (i, series) in group.iter().enumerate() {
            let dashes = match group.len() {
                1 => String::new(),
                k => format!(
                    r#" stroke-dasharray="{DASH} {}" stroke-dashoffset="{}""#,
                    DASH * (k - 1) as f64,
                    -DASH * i as f64
                ),
            };
            let _ = write!(
                svg,
                r#"<polyline data-series="{series}" fill="none" stroke="{}" stroke-width="2"{dashes} points="{points}"/>"#,
                colour(series),
            );
        }
    }
    x_labels(&mut svg, from, o.now);
    let current: BTreeMap<&str, i64> = o.counts.series().into_iter().collect();
    html! {
        svg id="state-chart" xmlns="http://www.w3.org/2000/svg" width=(WIDTH) height=(HEIGHT)
            viewBox={"0 0 " (WIDTH) " " (HEIGHT)} role="img" aria-label="Machines by state over time" {
            (PreEscaped(svg))
        }
        p.legend {
            @for series in by_series.keys() {
                span data-legend=(series) {
                    span.swatch style={"background:" (colour(series))} {}
                    (series) " " strong { (current.get(series).copied().unwrap_or(0)) }
                }
            }
        }
    }
}

/// Takeovers (agent starts finished) and failures (any process) per minute of the last hour,
/// as pairs of bars.
pub fn minute_bars(o: &Overview) -> Markup {
    let from = o.now - BARS_SPAN;
    let minutes = BARS_SPAN.num_minutes() as usize;
    let mut takeovers = vec![0i64; minutes + 1];
    let mut failures = vec![0i64; minutes + 1];
    for (at, process, event, n) in &o.endings {
        let i = ((*at - from).num_minutes().max(0) as usize).min(minutes);
        match (process, event) {
            (Process::ShepherdAgentStart, WorkEvent::Finished) => takeovers[i] += n,
            (_, WorkEvent::Failed) => failures[i] += n,
            _ => {}
        }
    }
    let max = axis_top(
        takeovers
            .iter()
            .chain(&failures)
            .copied()
            .max()
            .unwrap_or(0),
    );
    let slot = (WIDTH - LEFT) / (minutes + 1) as f64;
    let bar = (slot / 2.0 - 1.0).max(1.0);
    let base = HEIGHT - BOTTOM;
    let h = |n: i64| (HEIGHT - TOP - BOTTOM) * n as f64 / max;
    let mut svg = String::new();
    y_axis(&mut svg, max);
    for i in 0..=minutes {
        let x0 = LEFT + slot * i as f64;
        for (k, (values, fill, kind)) in [
            (&takeovers, "#16a34a", "takeovers"),
            (&failures, "#dc2626", "failures"),
        ]
        .into_iter()
        .enumerate()
        {
            let n = values[i];
            if n > 0 {
                let _ = write!(
                    svg,
                    r#"<rect data-kind="{kind}" data-n="{n}" x="{:.1}" y="{:.1}" width="{bar:.1}" height="{:.1}" fill="{fill}"><title>{n} {kind}</title></rect>"#,
                    x0 + k as f64 * (bar + 1.0),
                    base - h(n),
                    h(n),
                );
            }
        }
    }
    x_labels(&mut svg, from, o.now);
    let total = |v: &[i64]| v.iter().sum::<i64>();
    html! {
        svg id="minute-bars" xmlns="http://www.w3.org/2000/svg" width=(WIDTH) height=(HEIGHT)
            viewBox={"0 0 " (WIDTH) " " (HEIGHT)} role="img" aria-label="Takeovers and failures per minute" {
            (PreEscaped(svg))
        }
        p.legend {
            span { span.swatch style="background:#16a34a" {} "takeovers " strong data-total="takeovers" { (total(&takeovers)) } }
            span { span.swatch style="background:#dc2626" {} "failures " strong data-total="failures" { (total(&failures)) } }
            span.muted { "in the last hour" }
        }
    }
}

/// Failures read for the page of one cause shape: the most recent this many (machine, cause)
/// pairs of the last day.
const FAILURES_READ: i64 = 20_000;
/// Machines listed on the page of one cause shape.
const FAILURES_LISTED: usize = 1000;

/// The [`FAILURES_READ`] most recent failures of the last day, and the time: what the page of
/// each cause shape picks from ([`RecentFailures::of_shape`]). One read serves every shape, so
/// the web UI keeps it a while rather than read 20,000 rows per page view.
pub async fn recent_failures(db: &Bmdb) -> Result<RecentFailures, shepherd_bmdb::Error> {
    let (failures, now) = db
        .read(|tx| {
            Box::pin(async move {
                let failures = tx.recent_failures(CHART_SPAN, FAILURES_READ).await?;
                Ok((failures, tx.now().await?))
            })
        })
        .await?;
    Ok(RecentFailures { failures, now })
}

/// The machines whose work failed recently, as [`recent_failures`] read them, and when.
pub struct RecentFailures {
    failures: Vec<RecentFailure>,
    /// The database's time of the read.
    pub now: DateTime<Utc>,
}

impl RecentFailures {
    /// Those whose cause has `shape`, at most [`FAILURES_LISTED`].
    pub fn of_shape(&self, shape: &str) -> Vec<RecentFailure> {
        self.failures
            .iter()
            .filter(|f| cause_shapes::mask(&f.cause) == shape)
            .take(FAILURES_LISTED)
            .cloned()
            .collect()
    }
}

/// The page of one cause shape: its machines, with their causes as written.
pub fn failures_body(shape: &str, failures: &[RecentFailure], now: DateTime<Utc>) -> Markup {
    html! {
        p { "Machines whose work failed in the last 24 hours with a cause of the shape " code { (shape) } "." }
        @if failures.is_empty() { p.muted id="failures" { "None." } } @else {
            table id="failures" { thead { tr { th { "Machine" } th { "Failures" } th { "Last" } th { "Cause" } } }
                tbody { @for f in failures { tr data-machine=(f.machine_id) {
                    td.mono { a href={"/machines/" (f.machine_id)} { (f.machine_id) } }
                    td { (f.failures) }
                    td { span title=(f.last.to_rfc3339()) { (f.last.format("%Y-%m-%d %H:%M:%S")) }
                        " (" (humantime::format_duration(std::time::Duration::from_secs((now - f.last).num_seconds().max(0) as u64))) " ago)" }
                    td.mono { (f.cause) }
                } } } }
            @if failures.len() == FAILURES_LISTED { p.muted { "The first " (FAILURES_LISTED) " machines." } }
        }
    }
}

/// The whole page body.
/// The BMaaS servers' write backlog and refused heartbeats, and their last troubles: while a
/// server is in trouble, agents' silence is excused (ARCHITECTURE.md).
fn heartbeat_writers(o: &Overview) -> Markup {
    let ago = |t: DateTime<Utc>| format!("{} s ago", (o.now - t).num_seconds().max(0));
    html! {
        @if o.writers.is_empty() { p.muted id="heartbeat-writers" { "No BMaaS server is reporting." } } @else {
            table id="heartbeat-writers" {
                thead { tr { th { "Server" } th { "State" } th { "Backlog" } th { "Refused" } th { "Last report" } } }
                tbody { @for w in &o.writers { tr data-writer=(w.writer_id) data-trouble=(w.in_trouble(o.now)) {
                    td.mono { "bmsrv " (w.writer_id.simple().to_string()[..8]) }
                    td { @if w.is_stale(o.now) { "stopped reporting" } @else if w.in_trouble(o.now) {
                        "refusing or late since " (ago(w.in_doubt.start)) } @else { "clean" } }
                    td { (w.backlog) } td { (w.refused) } td { (ago(w.in_doubt.end)) }
                } } }
            }
        }
        @if !o.troubles.is_empty() {
            table id="heartbeat-troubles" {
                thead { tr { th { "Trouble" } th { "Refused" } th { "Cause" } } }
                tbody { @for t in &o.troubles { tr {
                    td { (ago(t.window.start)) " to " (ago(t.window.end)) } td { (t.refused) } td.mono { (t.cause) }
                } } }
            }
        }
    }
}

pub fn body(o: &Overview) -> Markup {
    html! {
        h2 { "Machines by state, last 24 hours" }
        (state_chart(o))
        h2 { "Takeovers and failures per minute" }
        (minute_bars(o))
        h2 { "Top failure causes, last 24 hours" }
        @if o.causes.is_empty() { p.muted id="causes" { "No failures." } } @else {
            p.muted { "Causes of one shape (addresses, ids and numbers aside) count together." }
            table id="causes" { thead { tr { th { "Failures" } th { "Cause" } th {} } }
                tbody { @for c in &o.causes { tr data-shape=(c.shape) {
                    td { (c.failures) }
                    td.mono { (c.shape) @if c.example != c.shape { br; span.muted { "e.g. " (c.example) } } }
                    td { a href=(cause_shapes::machines_link(&c.shape)) { "machines" } }
                } } } }
        }
        h2 { "Heartbeat writers" }
        (heartbeat_writers(o))
        h2 { "Hardware by provider and location" }
        @if o.hardware.is_empty() { p.muted id="hardware-totals" { "No hardware reports yet." } } @else {
            table id="hardware-totals" {
                thead { tr { th { "Provider" } th { "Location" } th { "Machines" } th { "Cores" } th { "Threads" } th { "Memory" } th { "Disk" } } }
                tbody { @for ((provider, location), t) in o.hardware.iter() { tr data-provider=(provider.as_str()) data-location=(location) {
                    td { (provider.as_str()) } td { (location) } td { (t.machines) } td { (t.cores) } td { (t.threads) }
                    td { (gib(t.memory_bytes)) } td { (gib(t.disk_bytes)) }
                } } }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An overview whose snapshots are `series` (name, value) at two minutes.
    fn overview_of(series: &[(&str, i64)]) -> Overview {
        let now = Utc::now();
        let snapshots = [now - Duration::minutes(2), now - Duration::minutes(1)]
            .into_iter()
            .flat_map(|at| series.iter().map(move |(s, n)| (at, s.to_string(), *n)))
            .collect();
        Overview {
            now,
            counts: FleetCounts::default(),
            snapshots,
            endings: Vec::new(),
            causes: Vec::new(),
            hardware: Default::default(),
            writers: Vec::new(),
            troubles: Vec::new(),
        }
    }

    #[test]
    fn series_on_the_same_points_are_all_visible() {
        let o = overview_of(&[
            ("machines", 3000),
            ("provided", 3000),
            ("heartbeating", 3000),
            ("stale", 4),
        ]);
        let svg = state_chart(&o).into_string();
        let polyline = |series: &str| {
            let at = svg.find(&format!(r#"data-series="{series}""#)).unwrap();
            svg[at..at + svg[at..].find("/>").unwrap()].to_string()
        };
        let offsets: Vec<String> = ["heartbeating", "machines", "provided"]
            .iter()
            .map(|s| {
                let line = polyline(s);
                assert!(line.contains(r#"stroke-dasharray="8 16""#), "{line}");
                line.split("stroke-dashoffset=")
                    .nth(1)
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect();
        let mut distinct = offsets.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "{offsets:?}");
        assert!(
            !polyline("stale").contains("dasharray"),
            "a series alone is solid"
        );
    }

    #[test]
    fn axis_tops_are_round_and_hold_the_maximum() {
        for (max, top) in [
            (0, 2.0),
            (1, 2.0),
            (3, 4.0),
            (13, 20.0),
            (400, 400.0),
            (401, 1000.0),
        ] {
            assert_eq!(axis_top(max), top, "{max}");
        }
    }

    /// Each server's state reads as an operator needs it: clean, in trouble since when, or
    /// stopped reporting; ended troubles are listed with their cause.
    #[test]
    fn heartbeat_writers_show_backlog_refusals_and_troubles() {
        let mut o = overview_of(&[]);
        let ago = |secs: i64| o.now - Duration::seconds(secs);
        let writer = |n: u128, doubt: std::ops::Range<DateTime<Utc>>| HeartbeatWriter {
            writer_id: uuid::Uuid::from_u128(n),
            backlog: 40,
            refused: 7,
            in_doubt: doubt,
        };
        o.writers = vec![
            writer(1, ago(1)..ago(1)),
            writer(2, ago(90)..ago(1)),
            writer(3, ago(60)..ago(60)),
        ];
        o.troubles = vec![HeartbeatTrouble {
            writer_id: uuid::Uuid::from_u128(2),
            window: ago(600)..ago(300),
            refused: 12,
            cause: "database".into(),
        }];
        let html = heartbeat_writers(&o).into_string();
        let row = |n: u128| {
            let at = html.find(&uuid::Uuid::from_u128(n).to_string()).unwrap();
            html[at..at + html[at..].find("</tr>").unwrap()].to_string()
        };
        assert!(row(1).contains(r#"data-trouble="false""#) && row(1).contains("clean"));
        let troubled = row(2);
        assert!(
            troubled.contains("refusing or late since 90 s ago"),
            "{troubled}"
        );
        assert!(troubled.contains("<td>40</td><td>7</td>"), "{troubled}");
        assert!(row(3).contains("stopped reporting"), "{}", row(3));
        assert!(html.contains("600 s ago to 300 s ago") && html.contains("database"));
    }
}
