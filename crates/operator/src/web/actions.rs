//! Operators' actions from the machine page, for a signed-in web UI: a form per action, each
//! with a reason field and the session's CSRF token. Who may press which button is the
//! operator API's policy table (`api/policy.rs`), looked up by the action's API route, so the
//! web UI and the API can never disagree; a viewer sees no buttons, and a form sent without
//! the session's token, or from another site, changes nothing.

use std::sync::Arc;

use axum::extract::{Form, Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::post;
use axum::{Extension, Router};
use maud::{html, Markup};
use serde::Deserialize;
use shepherd_bmdb::{Bmdb, Operator, Role};
use uuid::Uuid;

use super::page::{parse_id, PageError};
use crate::actions::{self, ActionError, MachineAction, Performed};
use crate::api::policy;
use crate::api::signin::{Peer, SignIn, WebUser};

/// The actions the machine page offers: the form's name for each, its label, and the action.
const OFFERED: &[(&str, &str, MachineAction)] = &[
    (
        "maintenance-on",
        "Maintenance on",
        MachineAction::MaintenanceOn,
    ),
    (
        "maintenance-off",
        "Maintenance off",
        MachineAction::MaintenanceOff,
    ),
    ("retry", "Retry now", MachineAction::Retry { process: None }),
    (
        "forget-host-key",
        "Forget host key",
        MachineAction::ForgetHostKey,
    ),
    ("recommission", "Recommission", MachineAction::Recommission),
    (
        "decommission",
        "Decommission",
        MachineAction::Decommission { undeploy: false },
    ),
    (
        "reimage",
        "Reimage (wipes its disk)",
        MachineAction::Reimage { wipe: true },
    ),
];

/// The least role `action` needs: the policy's rule for its API route; admin if it has none.
fn needs(action: &MachineAction) -> Role {
    let (route, _) = actions::api_request(action);
    let path = format!("/api/v1/machines/{{id}}/{route}");
    policy::required(&Method::POST, &path).unwrap_or(Role::Admin)
}

/// The actions offered to `role` on a machine (none to a viewer); reimaging only on a machine
/// that came `bare`.
fn offered(role: Role, bare: bool) -> Vec<&'static (&'static str, &'static str, MachineAction)> {
    OFFERED
        .iter()
        .filter(|(_, _, action)| role >= needs(action))
        .filter(|(_, _, action)| bare || !matches!(action, MachineAction::Reimage { .. }))
        .collect()
}

/// The forms `user` may use on machine `id`: those [`offered`] to their role.
pub fn buttons(id: Uuid, user: &WebUser, bare: bool) -> Markup {
    let allowed = offered(user.principal.role, bare);
    html! {
        @if !allowed.is_empty() {
            h2 { "Actions" }
            p.muted { "As " (user.principal.name) ". Each action is recorded in the machine's history with its reason." }
            div id="actions-forms" {
                @for (name, label, _) in allowed {
                    form method="post" action={"/machines/" (id) "/actions"} data-action=(name) {
                        input type="hidden" name="csrf" value=(user.csrf);
                        input type="hidden" name="action" value=(name);
                        input type="text" name="reason" placeholder="reason" maxlength="500" size="40";
                        " "
                        button type="submit" { (label) }
                    }
                }
            }
        }
    }
}

/// `POST /machines/{id}/actions` over `db`.
pub(super) fn routes(db: Bmdb) -> Router {
    Router::new()
        .route("/machines/{id}/actions", post(act))
        .with_state(db)
}

/// A form sent from the machine page.
/// An action's form. Every field may be missing: a form without its CSRF token is refused
/// by the same styled page as one with a wrong token, not by the form parser's plain 422.
#[derive(Deserialize)]
struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    action: String,
    #[serde(default)]
    reason: String,
}

/// Whether the request comes from this site: a browser names the page's origin in `Origin`
/// on a POST; when it does, it must be this host.
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) else {
        return true;
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin_host = origin.split_once("://").map(|(_, rest)| rest);
    host.is_some() && origin_host == host
}

/// `POST /machines/{id}/actions`: performs the form's action as the signed-in user, then
/// shows the machine again.
async fn act(
    State(db): State<Bmdb>,
    Path(id): Path<String>,
    Extension(user): Extension<WebUser>,
    Extension(sign_in): Extension<Arc<SignIn>>,
    peer: Peer,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Result<Response, PageError> {
    let refused = |why: &str| {
        sign_in.note_refused_form(&user, "/machines/{id}/actions", why, &peer);
        PageError(StatusCode::FORBIDDEN, why.to_string())
    };
    if !user.csrf_matches(&form.csrf) || !same_origin(&headers) {
        return Err(refused(
            "the form is not from this session's pages; nothing was done",
        ));
    }
    let id = parse_id(&id, "machine")?;
    let Some((_, _, action)) = OFFERED.iter().find(|(name, _, _)| *name == form.action) else {
        let why = format!("{:?} is not an action", form.action);
        return Err(PageError(StatusCode::BAD_REQUEST, why));
    };
    let needed = needs(action);
    if user.principal.role < needed {
        let (who, role) = (&user.principal.name, user.principal.role);
        return Err(refused(&format!("{who} is {role}; this needs {needed}")));
    }
    let request_id = Uuid::new_v4().to_string();
    let operator = Operator::new(user.principal.name.clone(), form.reason)
        .map_err(|e| PageError(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?
        .in_request(request_id);
    match actions::perform(&db, "shepherd-web", id, action.clone(), &operator).await {
        Ok(Performed::Done(_) | Performed::Unchanged(_)) => {}
        Err(ActionError::Invalid(m)) => return Err(PageError(StatusCode::BAD_REQUEST, m)),
        Err(ActionError::NoSuchMachine(m)) => return Err(PageError(StatusCode::NOT_FOUND, m)),
        Err(ActionError::Bmdb(e)) => return Err(e.into()),
    }
    Ok(Redirect::to(&format!("/machines/{id}")).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(role: Role, bare: bool) -> Vec<&'static str> {
        offered(role, bare)
            .iter()
            .map(|(name, _, _)| *name)
            .collect()
    }

    /// Reimaging is offered to an admin on a machine that came bare, and to nobody else:
    /// the policy says admin, and a machine never recorded bare cannot be reimaged.
    #[test]
    fn reimage_is_offered_to_admins_on_bare_machines_only() {
        assert!(names(Role::Admin, true).contains(&"reimage"));
        assert!(!names(Role::Admin, false).contains(&"reimage"));
        assert!(!names(Role::Operator, true).contains(&"reimage"));
        assert!(names(Role::Operator, true).contains(&"retry"));
        assert!(names(Role::Viewer, true).is_empty());
    }
}
