//! Who may do what through the operator API: the one table that says it. Every route the API
//! serves has a row; the middleware refuses a route without one, so a route added without a
//! rule is closed, not open.

use axum::http::Method;
use shepherd_bmdb::Role;

/// One rule: requests of `method` on `path` (the route's template) need at least `role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The HTTP method.
    pub method: &'static str,
    /// The route as the router writes it (`/api/v1/machines/{id}`).
    pub path: &'static str,
    /// The least role allowed.
    pub role: Role,
}

const fn rule(method: &'static str, path: &'static str, role: Role) -> Rule {
    Rule { method, path, role }
}

/// The policy. Reads are for viewers; actions on machines for operators; tokens, taking
/// machines out of the BMDB (decommission and its undo) and reimaging them for admins.
#[rustfmt::skip] // a table: one rule per line
pub const POLICY: &[Rule] = &[
    rule("GET", "/api/v1/machines", Role::Viewer),
    rule("GET", "/api/v1/machines/{id}", Role::Viewer),
    rule("GET", "/api/v1/machines/{id}/history", Role::Viewer),
    rule("GET", "/api/v1/sessions", Role::Viewer),
    rule("GET", "/api/v1/overview", Role::Viewer),
    rule("GET", "/api/v1/tasks", Role::Viewer),
    rule("GET", "/api/v1/whoami", Role::Viewer),
    rule("GET", "/api/v1/openapi.json", Role::Viewer),
    rule("POST", "/api/v1/machines/{id}/maintenance", Role::Operator),
    rule("POST", "/api/v1/machines/{id}/retry", Role::Operator),
    rule("POST", "/api/v1/machines/{id}/forget-host-key", Role::Operator),
    rule("POST", "/api/v1/machines/{id}/install", Role::Operator),
    rule("POST", "/api/v1/machines/{id}/decommission", Role::Admin),
    rule("POST", "/api/v1/machines/{id}/recommission", Role::Admin),
    rule("POST", "/api/v1/machines/{id}/reimage", Role::Admin),
    rule("GET", "/api/v1/tokens", Role::Admin),
    rule("POST", "/api/v1/tokens", Role::Admin),
    rule("DELETE", "/api/v1/tokens/{name}", Role::Admin),
    rule("POST", "/api/v1/tokens/revoke-sessions", Role::Admin),
    rule("GET", "/api/v1/audit", Role::Admin),
];

/// A proven identity and what it may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Who, as the operators' history records it (`token:ci`, `oidc:SUBJECT@ISSUER`).
    pub name: String,
    /// What it may do.
    pub role: Role,
}

/// A role name that is none of the three.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("role {0:?}: one of viewer, operator, admin")]
pub struct UnknownRole(pub String);

/// A role as people write it: `viewer`, `operator` or `admin`, in any case.
pub fn parse_role(text: &str) -> Result<Role, UnknownRole> {
    Role::ALL
        .iter()
        .copied()
        .find(|r| r.as_str().eq_ignore_ascii_case(text))
        .ok_or_else(|| UnknownRole(text.to_string()))
}

/// The least role `method` on the route `path` needs; `None` for a route the policy does not
/// name, which nobody may use.
pub fn required(method: &Method, path: &str) -> Option<Role> {
    POLICY
        .iter()
        .find(|r| r.method == method.as_str() && r.path == path)
        .map(|r| r.role)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_is_there_once_and_unknown_routes_are_closed() {
        for (i, r) in POLICY.iter().enumerate() {
            let again = POLICY[i + 1..]
                .iter()
                .any(|o| o.method == r.method && o.path == r.path);
            assert!(!again, "{r:?} twice");
        }
        assert_eq!(required(&Method::GET, "/api/v1/secret"), None);
        assert_eq!(required(&Method::POST, "/api/v1/machines"), None);
        assert_eq!(
            required(&Method::DELETE, "/api/v1/tokens/{name}"),
            Some(Role::Admin)
        );
    }
}
