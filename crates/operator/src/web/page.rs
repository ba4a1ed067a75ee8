//! How every web UI page is drawn: the layout with its navigation and style, and the page
//! shown when one cannot be.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use uuid::Uuid;

/// How a page is drawn.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Look {
    /// Seconds between automatic page refreshes; 0 turns them off.
    pub(super) refresh: u64,
    /// Whether people sign in (the navigation then links to their account).
    pub(super) signed_in: bool,
}

/// A page that could not be shown, with what to tell the operator.
#[derive(Debug)]
pub(super) struct PageError(pub(super) StatusCode, pub(super) String);

impl From<shepherd_bmdb::Error> for PageError {
    fn from(e: shepherd_bmdb::Error) -> Self {
        PageError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let title = self.0.canonical_reason().unwrap_or("error").to_string();
        let body = page(
            &title,
            Look::default(),
            html! { p.error { (self.1) } p { a href="/machines" { "Back to machines" } } },
        );
        (self.0, body).into_response()
    }
}

pub(super) fn bad_request(msg: String) -> PageError {
    PageError(StatusCode::BAD_REQUEST, msg)
}

pub(super) fn not_found(msg: String) -> PageError {
    PageError(StatusCode::NOT_FOUND, msg)
}

const STYLE: &str = "
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222;max-width:1400px}
h1{font-size:1.4rem;margin:.2rem 0 1rem} h2{font-size:1.1rem;margin:1.5rem 0 .5rem}
nav a{margin-right:1rem} table{border-collapse:collapse;width:100%;font-size:.9rem}
th,td{text-align:left;padding:.3rem .6rem;border-bottom:1px solid #e3e3e3;vertical-align:top}
th{background:#f4f4f6} tr:hover td{background:#fafafa}
code,.mono{font-family:ui-monospace,monospace;font-size:.85rem}
.state{display:inline-block;padding:.05rem .5rem;border-radius:.8rem;font-size:.8rem;white-space:nowrap}
.s-in-work{background:#dbeafe}.s-in-backoff{background:#fee2e2}.s-installed{background:#dcfce7}
.s-installing{background:#fef9c3}.s-heartbeating{background:#d1fae5}.s-stale{background:#fed7aa}
.s-agent-starting{background:#e0e7ff}.s-provided{background:#f3f4f6}.s-unprovided{background:#e5e7eb}
.s-maintenance{background:#fde68a} .s-failed{background:#fecaca} .s-waiting{background:#e0e7ff} .s-ok{background:#dcfce7} .warn{background:#fffbeb;border-left:4px solid #f59e0b;padding:.4rem .8rem}
.counts span{margin-right:1.2rem} form{margin:1rem 0} select,button{font-size:.9rem;padding:.2rem}
dl{display:grid;grid-template-columns:max-content auto;gap:.3rem 1rem} dt{color:#666}
.error{color:#b91c1c} .muted{color:#777} .pager a{margin-right:1rem}
.legend span{margin-right:1rem;white-space:nowrap} .swatch{display:inline-block;width:.8rem;height:.8rem;margin-right:.3rem;vertical-align:middle}
svg{max-width:100%;height:auto}
.o-succeeded{color:#15803d} .o-waited{color:#b45309} .o-failed{color:#b91c1c;font-weight:600}
";

pub(super) fn page(title: &str, look: Look, body: Markup) -> Html<String> {
    let refresh = look.refresh;
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    meta name="viewport" content="width=device-width, initial-scale=1";
                    @if refresh > 0 { meta http-equiv="refresh" content=(refresh); }
                    title { (title) " · Shepherd" }
                    style { (PreEscaped(STYLE)) }
                }
                body {
                    nav { a href="/overview" { "Overview" } a href="/machines" { "Machines" } a href="/sessions" { "Sessions" } a href="/tasks" { "Tasks" }
                        @if look.signed_in { a href="/account" { "Account" } } @else { a href="/metrics" { "Metrics" } } }
                    h1 { (title) }
                    (body)
                    @if refresh > 0 { p.muted { "Refreshes every " (refresh) " s." } }
                }
            }
        }
        .into_string(),
    )
}

pub(super) fn parse_id(id: &str, what: &str) -> Result<Uuid, PageError> {
    id.parse()
        .map_err(|e| bad_request(format!("{id:?} is not a {what} id: {e}")))
}
