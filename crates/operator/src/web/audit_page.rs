//! `GET /audit`: the security audit trail for administrators signed in to the web UI,
//! newest first, a page at a time, filtered by principal and kind.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Html;
use axum::routing::get;
use axum::{Extension, Router};
use maud::html;
use serde::Deserialize;
use shepherd_bmdb::{AuditFilter, Bmdb, Role};

use super::page::{bad_request, page, Look, PageError};
use crate::api::signin::{Peer, SignIn, WebUser};

/// Events on one page.
const PAGE: usize = 100;

/// `GET /audit` over `db`, shown as `look` says.
pub(super) fn routes(db: Bmdb, look: Look) -> Router {
    Router::new()
        .route("/audit", get(audit))
        .with_state(Arc::new((db, look)))
}

/// The page's query. Strings, so bad values get a page naming them.
#[derive(Debug, Deserialize, Default)]
struct AuditQuery {
    principal: Option<String>,
    kind: Option<String>,
    before: Option<String>,
}

async fn audit(
    State(state): State<Arc<(Bmdb, Look)>>,
    Extension(user): Extension<WebUser>,
    Extension(sign_in): Extension<Arc<SignIn>>,
    peer: Peer,
    Query(q): Query<AuditQuery>,
) -> Result<Html<String>, PageError> {
    let (db, look) = (&state.0, state.1);
    if user.principal.role < Role::Admin {
        let why = format!(
            "{} is {}; the audit trail is for admins",
            user.principal.name, user.principal.role
        );
        sign_in.note_refused_form(&user, "/audit", &why, &peer);
        return Err(PageError(StatusCode::FORBIDDEN, why));
    }
    let given = |v: &Option<String>| v.clone().filter(|v| !v.is_empty());
    let kind = given(&q.kind)
        .map(|k| k.parse().map_err(|e| bad_request(format!("kind: {e}"))))
        .transpose()?;
    let before = given(&q.before)
        .map(|b| {
            b.parse::<i64>()
                .map_err(|_| bad_request("before: not an event id".into()))
        })
        .transpose()?;
    let filter = AuditFilter {
        principal: given(&q.principal),
        kind,
        since: None,
    };
    let (events, next) = db.audit_events(&filter, before, PAGE).await?;
    let older = next.map(|next| {
        let mut link = format!("/audit?before={next}");
        for (key, value) in [("principal", &filter.principal), ("kind", &q.kind)] {
            if let Some(value) = value {
                let value: String =
                    url::form_urlencoded::byte_serialize(value.as_bytes()).collect();
                link.push_str(&format!("&{key}={value}"));
            }
        }
        link
    });
    let body = html! {
        p { "Sign-ins and sign-outs, tokens made and revoked, and refused requests, newest first." }
        table id="audit" {
            tr { th { "Seen" } th { "Kind" } th { "Principal" } th { "Peer" } th { "Route" } th { "Reason" } th { "Request" } }
            @for e in &events {
                tr {
                    td { (e.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)) }
                    td { (e.kind) }
                    td { (e.principal.as_deref().unwrap_or("-")) }
                    td { (e.peer.as_deref().unwrap_or("-")) }
                    td { (e.route.as_deref().unwrap_or("-")) }
                    td { (e.reason) }
                    td { (e.request_id.as_deref().unwrap_or("-")) }
                }
            }
        }
        @if let Some(older) = older { p { a href=(older) { "Older events" } } }
    };
    Ok(page("Audit trail", look, body))
}
