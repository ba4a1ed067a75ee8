//! The debug web UI (design.md §12): server-rendered HTML over the BMDB, no JavaScript. The fleet
//! at a glance (`overview.rs`), machines list with filters and paging, machine detail, sessions. Pages refresh themselves so an
//! operator can watch machines move through states. Read-only, unless people sign in
//! (`api/signin.rs`): then every page needs a sign-in, and the machine page offers the
//! actions the signed-in role may take (`web/actions.rs`).

mod actions;
mod audit_page;
mod page;

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{Html, Redirect};
use axum::routing::get;
use axum::{Extension, Json, Router};
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use serde::Deserialize;
use shepherd_bmdb::{Bmdb, FleetCounts, Lifecycle, ProviderKind, RecoveryThresholds, SessionInfo};
use shepherd_loops::brake::{BrakeMetrics, BrakeStatus};
use shepherd_tasks::Tasks;
use uuid::Uuid;

use crate::api::signin::{SignIn, WebUser};
use crate::fleet_stats::FleetStats;
use crate::inventory::{self, Detail};
use crate::overview::Overview;
use page::{bad_request, not_found, page, parse_id, Look, PageError};

/// Machines per page unless the URL asks otherwise.
const DEFAULT_PAGE: usize = 100;
/// Largest page a URL may ask for.
const MAX_PAGE: usize = 1000;
/// Machines scanned per request when a state filter matches few of them.
const SCAN_BUDGET: usize = 20_000;
/// How long the fleet counts on the machines page are reused. Counting is O(fleet), and a
/// page must not be: however many requests come, the counts are computed at most this often.
const COUNTS_TTL: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the overview is reused: it reads a day of snapshots and an hour of history.
const OVERVIEW_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// The overview last read, and when.
type CachedOverview = Option<(std::time::Instant, Arc<Overview>)>;

struct Ui {
    db: Bmdb,
    /// The fleet counts, at most [`COUNTS_TTL`] old.
    counts: inventory::CountsCache,
    /// How pages look: their refresh, whether people sign in.
    look: Look,
    /// How old a last heartbeat must be to count as stale (the recoverer's threshold).
    stale_after: chrono::Duration,
    /// The recovery brake of the recoverer in this process, if one runs here.
    brake: Option<BrakeMetrics>,
    /// The fleet statistics of this process (their hardware totals).
    stats: FleetStats,
    /// The background tasks of this process.
    tasks: Tasks,
    /// Like `counts`, for the overview.
    overview: tokio::sync::Mutex<CachedOverview>,
    /// Like `overview`, the recent failures the pages of cause shapes pick from.
    recent_failures: tokio::sync::Mutex<CachedFailures>,
}

/// The recent failures last read, and when.
type CachedFailures = Option<(std::time::Instant, Arc<crate::overview::RecentFailures>)>;

/// What `cell` holds if it is younger than `ttl`, else what `load` reads (then kept). The
/// lock is held while loading, so that page views that come meanwhile wait for that one read
/// rather than each make their own.
async fn kept_for<T, F, Fut>(
    cell: &tokio::sync::Mutex<Option<(std::time::Instant, Arc<T>)>>,
    ttl: std::time::Duration,
    load: F,
) -> Result<Arc<T>, PageError>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<T, PageError>>,
{
    let mut cached = cell.lock().await;
    if let Some((at, kept)) = cached.as_ref() {
        if at.elapsed() < ttl {
            return Ok(kept.clone());
        }
    }
    let loaded = Arc::new(load().await?);
    *cached = Some((std::time::Instant::now(), loaded.clone()));
    Ok(loaded)
}

/// How the web UI shows things.
#[derive(Debug, Clone)]
pub struct WebSettings {
    /// Pages reload themselves this often (zero: never).
    pub refresh: std::time::Duration,
    /// The recoverer's thresholds, which also define a stale heartbeat on every page.
    pub thresholds: RecoveryThresholds,
    /// The recovery brake of the recoverer in this process, if one runs here: the machines
    /// page says whether it is braked.
    pub brake: Option<BrakeMetrics>,
}

/// The UI's routes (`/`, `/overview`, `/machines`, `/machines/{id}`, `/sessions`,
/// `/sessions/{id}`, `/tasks`), shown as `web` says; `stats` are this process's fleet
/// statistics, whose hardware totals the overview shows, and `tasks` its background tasks.
/// With `sign_in`, every page needs a signed-in user, and the machine page takes actions
/// (`POST /machines/{id}/actions`); without it, the UI is read-only.
pub fn router(
    db: Bmdb,
    web: WebSettings,
    stats: FleetStats,
    tasks: Tasks,
    sign_in: Option<Arc<SignIn>>,
) -> Router {
    let pages = Router::new()
        .route("/", get(|| async { Redirect::to("/machines") }))
        .route("/overview", get(overview))
        .route("/machines", get(machines))
        .route("/machines/{id}", get(machine))
        .route("/sessions", get(sessions))
        .route("/sessions/{id}", get(session))
        .route("/tasks", get(tasks_page))
        .route("/tasks.json", get(tasks_json))
        .route("/failures", get(failures));
    let acting_db = db.clone();
    let look = Look {
        refresh: web.refresh.as_secs(),
        signed_in: sign_in.is_some(),
    };
    let pages = pages.with_state(Arc::new(Ui {
        counts: inventory::CountsCache::new(db.clone(), web.thresholds.stale_after(), COUNTS_TTL),
        db,
        look,
        stale_after: web.thresholds.stale_after(),
        brake: web.brake,
        stats,
        tasks,
        overview: tokio::sync::Mutex::new(None),
        recent_failures: tokio::sync::Mutex::new(None),
    }));
    match sign_in {
        None => pages,
        Some(sign_in) => pages
            .merge(actions::routes(acting_db.clone()))
            .merge(audit_page::routes(acting_db, look))
            .route_layer(axum::middleware::from_fn_with_state(
                sign_in,
                crate::api::signin::require_session,
            )),
    }
}

impl Ui {
    /// The fleet counts, at most [`COUNTS_TTL`] old.
    async fn fleet_counts(&self) -> Result<Arc<FleetCounts>, PageError> {
        Ok(self.counts.get().await?)
    }
}

async fn overview(State(ui): State<Arc<Ui>>) -> Result<Html<String>, PageError> {
    let o = kept_for(&ui.overview, OVERVIEW_TTL, || async {
        let counts = (*ui.fleet_counts().await?).clone();
        Ok(crate::overview::load(&ui.db, counts, ui.stats.hardware()).await?)
    })
    .await?;
    Ok(page(
        "Overview",
        ui.look,
        html! { (fleet_counts(&o.counts)) (crate::overview::body(&o)) },
    ))
}

fn state_badge(state: Lifecycle) -> Markup {
    html! { span class={"state s-" (state.slug())} data-state=(state.slug()) { (state.label()) } }
}

fn time(t: DateTime<Utc>, now: DateTime<Utc>) -> Markup {
    let ago = now - t;
    let rel = if ago.num_seconds() >= 0 {
        format!(
            "{} ago",
            humantime::format_duration(std::time::Duration::from_secs(ago.num_seconds() as u64))
        )
    } else {
        format!(
            "in {}",
            humantime::format_duration(std::time::Duration::from_secs((-ago.num_seconds()) as u64))
        )
    };
    html! { span title=(t.to_rfc3339()) { (rel) } }
}

fn opt(v: Option<&str>) -> Markup {
    match v {
        Some(s) => html! { (s) },
        None => html! { span.muted { "–" } },
    }
}

/// Query of the page of one failure cause shape.
#[derive(Debug, Deserialize)]
struct FailuresQuery {
    shape: Option<String>,
}

/// The machines that failed with a cause of one shape (linked from the overview).
async fn failures(
    State(ui): State<Arc<Ui>>,
    Query(q): Query<FailuresQuery>,
) -> Result<Html<String>, PageError> {
    let Some(shape) = q.shape.filter(|s| !s.is_empty()) else {
        return Err(bad_request(
            "shape: which cause shape (the overview links each)".into(),
        ));
    };
    let recent = kept_for(&ui.recent_failures, OVERVIEW_TTL, || async {
        Ok(crate::overview::recent_failures(&ui.db).await?)
    })
    .await?;
    let body = crate::overview::failures_body(&shape, &recent.of_shape(&shape), recent.now);
    Ok(page("Machines by failure cause", ui.look, body))
}

/// Query of the machines list. Strings, so bad values get a page naming them rather than a
/// bare rejection.
#[derive(Debug, Deserialize, Default)]
struct ListQuery {
    provider: Option<String>,
    state: Option<String>,
    after: Option<String>,
    limit: Option<String>,
}

fn non_empty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

async fn machines(
    State(ui): State<Arc<Ui>>,
    Query(q): Query<ListQuery>,
) -> Result<Html<String>, PageError> {
    let provider: Option<ProviderKind> = non_empty(&q.provider)
        .map(|p| p.parse().map_err(|e| bad_request(format!("provider: {e}"))))
        .transpose()?;
    let state: Option<Lifecycle> = non_empty(&q.state)
        .map(|s| s.parse().map_err(|e| bad_request(format!("state: {e}"))))
        .transpose()?;
    let after: Option<Uuid> = non_empty(&q.after)
        .map(|a| {
            a.parse()
                .map_err(|e| bad_request(format!("after: {a:?} is not a machine id: {e}")))
        })
        .transpose()?;
    let limit = match non_empty(&q.limit) {
        None => DEFAULT_PAGE,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
            _ => {
                return Err(bad_request(format!(
                    "limit: {l:?} is not a number from 1 to {MAX_PAGE}"
                )))
            }
        },
    };
    let stale_after = ui.stale_after;
    let listing = inventory::list(
        &ui.db,
        provider,
        state,
        after,
        limit,
        SCAN_BUDGET,
        stale_after,
    )
    .await?;
    let counts = ui.fleet_counts().await?;
    let link = |after: Option<Uuid>| {
        let mut params = vec![];
        if let Some(p) = provider {
            params.push(format!("provider={p}"));
        }
        if let Some(s) = state {
            params.push(format!("state={}", s.slug()));
        }
        if let Some(a) = after {
            params.push(format!("after={a}"));
        }
        if limit != DEFAULT_PAGE {
            params.push(format!("limit={limit}"));
        }
        format!("/machines?{}", params.join("&"))
    };
    let now = listing.now;
    let body = html! {
        @if let Some(b) = &ui.brake { (brake_banner(b.status())) }
        (fleet_counts(&counts))
        form method="get" action="/machines" {
            label { "Provider " select name="provider" id="provider" {
                option value="" selected[provider.is_none()] { "any" }
                @for (p, _) in &counts.provided {
                    option value=(p.to_string()) selected[provider == Some(*p)] { (p.to_string()) }
                }
            } }
            " "
            label { "State " select name="state" id="state" {
                option value="" selected[state.is_none()] { "any" }
                @for s in Lifecycle::ALL {
                    option value=(s.slug()) selected[state == Some(s)] { (s.label()) }
                }
            } }
            " "
            button type="submit" id="filter" { "Filter" }
        }
        table id="machines" {
            thead { tr {
                th { "Machine" } th { "State" } th { "Provider" } th { "Provider ID" }
                th { "Address" } th { "Location" } th { "Status" } th { "Last heartbeat" }
            } }
            tbody {
                @for m in &listing.machines {
                    @let p = m.provided.as_ref();
                    @let st = listing.state_of(m);
                    tr data-machine=(m.machine_id) data-state=(st.slug()) {
                        td.mono { a href={"/machines/" (m.machine_id)} { (m.machine_id) } }
                        td { (state_badge(st)) }
                        td { (opt(p.map(|p| p.provider.as_str()))) }
                        td.mono { (opt(p.map(|p| p.provider_id.as_str()))) }
                        td.mono { (opt(p.and_then(|p| p.ip_address.as_deref()))) }
                        td { (opt(p.and_then(|p| p.location.as_deref()))) }
                        td { (opt(p.and_then(|p| p.status.map(|s| s.as_str())))) }
                        td { @match m.heartbeat_at { Some(h) => (time(h, now)), None => span.muted { "never" } } }
                    }
                }
            }
        }
        @if listing.machines.is_empty() { p.muted id="empty" { "No machines match." } }
        p.pager {
            @if after.is_some() { a href=(link(None)) id="first" { "« First page" } }
            @if let Some(next) = listing.next { a href=(link(Some(next))) id="next" { "Next page »" } }
        }
    };
    Ok(page("Machines", ui.look, body))
}

/// Whether the recoverer is stopped by its brake, and why.
fn brake_banner(b: BrakeStatus) -> Markup {
    let pct = |s: f64| format!("{:.0}%", s * 100.0);
    html! {
        @if !b.counted {
            p.error id="brake" data-engaged="true" {
                "Recovery brake engaged: the machines without a recent heartbeat have not been counted yet; no machine is rebooted until they are."
            }
        } @else if b.engaged {
            p.error id="brake" data-engaged="true" {
                "Recovery brake engaged: " (b.silent) " machines (" (pct(b.share)) ") have no recent heartbeat, more than the "
                (pct(b.allowed_share)) " allowed. The BMaaS server or the network is the likelier cause; no machine is rebooted until the share falls ("
                (b.due) " due for recovery wait)."
            }
        } @else {
            p.muted id="brake" data-engaged="false" {
                "Recovery brake released: " (b.silent) " machines (" (pct(b.share)) ") have no recent heartbeat, " (b.due) " are due for recovery; it engages above " (pct(b.allowed_share)) "."
            }
        }
    }
}

fn fleet_counts(c: &FleetCounts) -> Markup {
    let provided: i64 = c.provided.iter().map(|(_, n)| n).sum();
    let work: i64 = c.work.iter().map(|(_, n)| n).sum();
    let backoffs: i64 = c.backoffs.iter().map(|(_, n)| n).sum();
    html! {
        p.counts id="counts" {
            span { "machines " strong data-count="machines" { (c.machines) } }
            span { "provided " strong data-count="provided" { (provided) } }
            span { "agent started " strong data-count="agent-started" { (c.agent_started) } }
            span { "heartbeating " strong data-count="heartbeating" { (c.heartbeating) } }
            span { "stale " strong data-count="stale" { (c.stale) } }
            span { "installing " strong data-count="installing" { (c.pending_install) } }
            span { "installed " strong data-count="installed" { (c.installed) } }
            span { "in work " strong data-count="work" { (work) } }
            span { "in backoff " strong data-count="backoffs" { (backoffs) } }
            span { "in maintenance " strong data-count="maintenance" { (c.maintenance) } }
            span { "decommissioned " strong data-count="decommissioned" { (c.decommissioned) } }
            span { "missing " strong data-count="missing" { (c.missing) } }
        }
        @if c.missing > 0 {
            p.warn id="missing" data-missing=(c.missing) {
                (c.missing) " machine(s) are no longer listed by their provider: their work has stopped, and provisioning goes on while they stay within --provisioner-max-missing (10 % by default); beyond it every provisioner pass refuses to act. "
                "If they were removed on purpose, retire each with " code { "shepherd machines decommission ID" } "; "
                code { "shepherd machines list" } " shows their provider status."
            }
        }
    }
}

/// The id in a page's path; a bad one is a bad request that names what it should have been.
async fn machine(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
    user: Option<Extension<WebUser>>,
) -> Result<Html<String>, PageError> {
    let id = parse_id(&id, "machine")?;
    let Some(d) = inventory::detail(&ui.db, id, ui.stale_after).await? else {
        return Err(not_found(format!("machine {id} does not exist")));
    };
    let bare = d.bare.is_some();
    let buttons = user.map(|Extension(user)| actions::buttons(id, &user, bare));
    // A page with forms does not reload itself under a reason being typed.
    let look = match &buttons {
        Some(b) if !b.0.is_empty() => Look {
            refresh: 0,
            ..ui.look
        },
        _ => ui.look,
    };
    let body = html! { (machine_body(&d)) @if let Some(b) = buttons { (b) } };
    Ok(page(&format!("Machine {id}"), look, body))
}

fn machine_body(d: &Detail) -> Markup {
    let now = d.now;
    let s = &d.summary;
    html! {
        p { "State: " span id="state" { (state_badge(d.state())) } }
        @if let Some(m) = &d.maintenance {
            p.warn id="maintenance" {
                "In maintenance since " (time(m.since, now)) " by " strong { (m.by) } ": " (m.reason)
                " — no loop claims it. " span.mono { "shepherd machines maintenance off " (s.machine_id) }
            }
        }
        h2 { "machine_provided" }
        @match &s.provided {
            None => p.muted id="provided" { "Not provided." },
            Some(p) => dl id="provided" {
                dt { "provider" } dd { (p.provider.as_str()) }
                dt { "provider id" } dd.mono data-field="provider_id" { (p.provider_id) }
                dt { "reservation id" } dd { (opt(p.reservation_id.as_deref())) }
                dt { "address" } dd.mono data-field="address" { (opt(p.ip_address.as_deref())) }
                dt { "location" } dd data-field="location" { (opt(p.location.as_deref())) }
                dt { "status" } dd { (opt(p.status.map(|s| s.as_str()))) }
                dt { "provider facts" } dd data-field="provider_facts" {
                    @if p.facts.is_empty() { span.muted { "none" } }
                    @for (name, value) in p.facts.iter() {
                        span.mono { (name) " = " (value) } br;
                    }
                }
            },
        }
        h2 { "agent_started / heartbeat" }
        dl id="agent" {
            dt { "agent started" } dd { @match &d.agent { Some(a) => (time(a.started_at, now)), None => span.muted { "no" } } }
            dt { "agent key" } dd.mono data-field="agent_key" { (opt(d.agent.as_ref().map(|a| inventory::hex(&a.public_key)).as_deref())) }
            dt { "last heartbeat" } dd { @match s.heartbeat_at { Some(h) => (time(h, now)), None => span.muted { "never" } } }
            dt { "SSH host key" } dd.mono { (opt(d.host_key.as_ref().map(|k| k.key.as_str()))) }
        }
        h2 { "Hardware report" }
        @match &d.hardware {
            None => p.muted id="hardware" { "No report." },
            Some(Err(e)) => p.error id="hardware" { (e) },
            Some(Ok(r)) => div id="hardware" { (hardware(r)) },
        }
        h2 { "OS installation" }
        dl id="installation" {
            dt { "request" } dd data-field="request" { @match &d.request {
                Some(r) => { "generation " (r.generation) ": " (inventory::describe_request(r)) },
                None => span.muted { "none" },
            } }
            dt { "report" } dd data-field="report" { @match &d.report {
                Some(r) => { "generation " (r.generation) ": " (r.result.to_string()) },
                None => span.muted { "none" },
            } }
        }
        (bare_metal(d))
        h2 { "Recovery" }
        @match &d.recovery {
            None => p.muted id="recovery" { "Never rebooted by the recoverer." },
            Some(r) => dl id="recovery" {
                dt { "last reboot" } dd { (time(r.rebooted_at, now)) }
                dt { "reboots in a row" } dd data-field="in_a_row" { (r.in_a_row) }
            },
        }
        h2 { "Active work" }
        @if d.work.is_empty() { p.muted id="work" { "None." } } @else {
            table id="work" { thead { tr { th { "Process" } th { "Session" } th { "Component" } } }
                tbody { @for (w, sess) in &d.work { tr {
                    td { (w.process.to_string()) }
                    td.mono { a href={"/sessions/" (w.session_id)} { (w.session_id) } }
                    td { (opt(sess.as_ref().map(|s| s.component_name.as_str()))) }
                } } } }
        }
        h2 { "Backoffs" }
        @if d.backoffs.is_empty() { p.muted id="backoffs" { "None." } } @else {
            table id="backoffs" { thead { tr { th { "Process" } th { "Until" } th { "Cause" } } }
                tbody { @for b in &d.backoffs { tr data-active=(b.until > now) {
                    td { (b.process.to_string()) }
                    td { (time(b.until, now)) @if b.until <= now { " (expired)" } }
                    td.mono { (b.cause) }
                } } } }
        }
        h2 { "Work history" }
        @if d.history.is_empty() { p.muted id="history" { "None." } } @else {
            table id="history" { thead { tr { th { "At" } th { "Process" } th { "Event" } th { "Session" } th { "Cause" } } }
                tbody { @for h in &d.history { tr {
                    td { span title=(h.at.to_rfc3339()) { (h.at.format("%Y-%m-%d %H:%M:%S%.3f")) } }
                    td { (h.process.to_string()) }
                    td { (h.event.to_string()) }
                    td.mono { @match h.session_id { Some(s) => a href={"/sessions/" (s)} { (s.simple().to_string()[..8]) }, None => span.muted { "–" } } }
                    td.mono { (opt(h.cause.as_deref())) }
                } } } }
        }
        h2 { "Operators' actions" }
        @if d.actions.is_empty() { p.muted id="actions" { "None." } } @else {
            table id="actions" { thead { tr { th { "At" } th { "Action" } th { "By" } th { "Reason" } th { "API request" } } }
                tbody { @for a in &d.actions { tr data-action=(a.action.slug()) {
                    td { span title=(a.at.to_rfc3339()) { (a.at.format("%Y-%m-%d %H:%M:%S%.3f")) } }
                    td { (a.action.slug()) @if let Some(p) = a.process { " " (p.to_string()) } }
                    td { (a.by) }
                    td { (a.reason) }
                    td.mono { (opt(a.request_id.as_deref())) }
                } } } }
        }
    }
}

/// A bare machine's way from its BMC to its installed OS: where it stands, and each step with
/// the time it spent in the phase it entered.
fn bare_metal(d: &Detail) -> Markup {
    let Some(b) = &d.bare else {
        return html! {};
    };
    let steps = inventory::bare_steps_json(&d.bare_steps, d.now);
    html! {
        h2 { "Bare metal" }
        p id="bare-metal" {
            "Phase " strong data-field="bare_phase" { (b.phase.to_string()) } " since " (time(b.phase_at, d.now))
            ", live boot " (b.attempts) "."
            @if let Some(who) = &b.wipe_by { " Its disk may be overwritten: allowed by " (who) "." }
        }
        table id="bare-steps" { thead { tr { th { "At" } th { "Phase entered" } th { "Time in it" } th { "What was done or found" } } }
            tbody { @for (s, j) in d.bare_steps.iter().zip(&steps) { tr data-phase=(s.phase.to_string()) {
                td { span title=(s.at.to_rfc3339()) { (s.at.format("%Y-%m-%d %H:%M:%S%.3f")) } }
                td { (s.phase.to_string()) }
                td { (format!("{:.1} s", j["seconds"].as_f64().unwrap_or_default())) }
                td.mono { (s.detail) }
            } } } }
    }
}

fn hardware(r: &shepherd_proto::bmaas::AgentHardwareReport) -> Markup {
    html! {
        dl {
            @for (label, line) in inventory::hardware_lines(r) {
                dt { (label) } dd data-field=(label) { (line) }
            }
        }
    }
}

async fn sessions(State(ui): State<Arc<Ui>>) -> Result<Html<String>, PageError> {
    let (list, now) = ui
        .db
        .read(|tx| Box::pin(async move { Ok((tx.sessions().await?, tx.now().await?)) }))
        .await?;
    Ok(page(
        "Sessions",
        ui.look,
        html! {
            @if list.is_empty() { p.muted { "No sessions." } } @else {
                table id="sessions" { thead { tr { th { "Session" } th { "Component" } th { "Processor" } th { "Deadline" } th { "Runtime" } } }
                    tbody { @for s in &list { tr data-session=(s.session_id) {
                        td.mono { a href={"/sessions/" (s.session_id)} { (s.session_id) } }
                        td { (s.component_name) } td { (s.processor) }
                        td { (deadline(s, now)) }
                        td.mono { (s.runtime_info) }
                    } } } }
            }
        },
    ))
}

/// This process's background tasks: when each last ran, how it ended and what it did, its
/// state (failed after a failure or a recent panic; stale without a success for longer than
/// `--task-stale-after`) and its last panic.
async fn tasks_page(State(ui): State<Arc<Ui>>) -> Html<String> {
    let now = Utc::now();
    let stale_after = ui.tasks.stale_after();
    let statuses = ui.tasks.statuses();
    page(
        "Tasks",
        ui.look,
        html! {
            p.muted { "The background tasks of this process. A task is stale after "
                (humantime::format_duration(stale_after)) " without a success, and failed after a failure or a panic within that time. "
                a href="/tasks.json" { "As JSON" } "." }
            @if statuses.is_empty() { p.muted { "No background tasks run in this process." } } @else {
                table id="tasks" { thead { tr { th { "Task" } th { "State" } th { "Last end" } th { "Outcome" } th { "What it did" } th { "Last success" } th { "Done" } th { "Last panic" } } }
                    tbody { @for t in &statuses {
                        @let state = t.state(now, stale_after).label();
                        tr data-task=(t.name) data-outcome=(t.last_outcome.map_or("none", |o| o.label())) data-state=(state) {
                            td { (t.name) " " span.muted { (t.kind.label()) } }
                            td { span class={"state s-" (state)} { (state) } }
                            td { @match (t.running, t.last_start) {
                                (true, Some(start)) => { "running since " (time(start, now)) },
                                (_, _) => @match t.last_end { Some(end) => (time(end, now)), None => span.muted { "not yet" } },
                            } }
                            td { @match t.last_outcome { Some(o) => span class={"outcome o-" (o.label())} { (o.label()) }, None => span.muted { "–" } } }
                            td { (t.last_summary) }
                            td { @match t.last_success { Some(at) => (time(at, now)), None => span.muted { "never" } } }
                            td { (t.passes) }
                            td { @match &t.last_panic { Some(p) => { (time(p.at, now)) ": " (p.message) }, None => span.muted { "none" } } }
                        }
                    } }
                }
            }
        },
    )
}

/// `/tasks.json`: what `/tasks` shows, as `shepherd tasks --at` reads it.
async fn tasks_json(State(ui): State<Arc<Ui>>) -> Json<serde_json::Value> {
    Json(crate::task_view::tasks_json(&ui.tasks, Utc::now()))
}

fn deadline(s: &SessionInfo, now: DateTime<Utc>) -> Markup {
    html! { (time(s.deadline, now)) @if s.deadline <= now { " (expired)" } }
}

async fn session(
    State(ui): State<Arc<Ui>>,
    Path(id): Path<String>,
) -> Result<Html<String>, PageError> {
    let id = parse_id(&id, "session")?;
    let (info, work, now) = ui
        .db
        .read(move |tx| {
            Box::pin(async move {
                Ok((
                    tx.session(id).await?,
                    tx.session_work(id).await?,
                    tx.now().await?,
                ))
            })
        })
        .await?;
    let Some(s) = info else {
        return Err(not_found(format!(
            "session {id} does not exist (closed sessions are removed)"
        )));
    };
    Ok(page(
        &format!("Session {id}"),
        ui.look,
        html! {
            dl id="session" {
                dt { "component" } dd data-field="component" { (s.component_name) }
                dt { "processor" } dd { (s.processor) }
                dt { "runtime" } dd.mono { (s.runtime_info) }
                dt { "started" } dd { (time(s.created_at, now)) }
                dt { "keep-alive interval" } dd { (s.interval_seconds) " s" }
                dt { "deadline" } dd { (deadline(&s, now)) }
            }
            h2 { "Work held" }
            @if work.is_empty() { p.muted id="work" { "None." } } @else {
                table id="work" { thead { tr { th { "Machine" } th { "Process" } } }
                    tbody { @for (m, p) in &work { tr {
                        td.mono { a href={"/machines/" (m)} { (m) } }
                        td { (p.to_string()) }
                    } } } }
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// What a page keeps (the overview, the recent failures every cause-shape page picks
    /// from) is read once per TTL however many views come, and read again after it.
    #[tokio::test]
    async fn a_kept_read_is_made_once_per_ttl() {
        let cell = tokio::sync::Mutex::new(None);
        let reads = AtomicU64::new(0);
        let read = || async { Ok::<_, PageError>(reads.fetch_add(1, Ordering::Relaxed)) };
        let ttl = std::time::Duration::from_secs(3600);
        for _ in 0..100 {
            assert_eq!(*kept_for(&cell, ttl, read).await.unwrap(), 0);
        }
        assert_eq!(reads.load(Ordering::Relaxed), 1);
        let expired = std::time::Duration::ZERO;
        assert_eq!(*kept_for(&cell, expired, read).await.unwrap(), 1);
        // A failed read keeps nothing: the next view tries again.
        let failing = || async {
            Err::<u64, _>(PageError(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "down".into(),
            ))
        };
        assert!(kept_for(&cell, expired, failing).await.is_err());
        assert_eq!(*kept_for(&cell, ttl, read).await.unwrap(), 1);
    }
}
