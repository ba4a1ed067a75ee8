//! The operator API's OpenAPI 3.1 document, generated from the code: one operation per rule of
//! the policy table (`policy.rs`), with the role it needs; the request body's schema derived
//! (utoipa) from the very type its route deserializes; the listing's query parameters from
//! its query type; every refusal a problem detail (`problem.rs`). Served at
//! `/api/v1/openapi.json`, committed as `docs/openapi.json`, and a test fails when they differ.

use utoipa::openapi::path::{
    HttpMethod, OperationBuilder, Parameter, ParameterBuilder, ParameterIn,
};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, InfoBuilder, OpenApi, OpenApiBuilder, Paths, RefOr, Required,
};
use utoipa::{IntoParams, PartialSchema};

use super::handlers::{
    AuditQuery, DecommissionBody, InstallBody, ListQuery, MaintenanceBody, NewTokenBody,
    ReimageBody, RetryBody, RevokeSessionsBody, TokensQuery,
};
use super::policy::{Rule, POLICY};
use super::problem::ProblemBody;

/// What the document says of one route: a summary and the schema of its body, if it takes one.
struct Described {
    summary: &'static str,
    body: Option<RefOr<Schema>>,
}

/// A body of nothing but an optional reason (forgetting a host key, recommissioning).
fn reason_only() -> RefOr<Schema> {
    let reason = ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some("Why, for the machine's history."));
    ObjectBuilder::new()
        .property("reason", reason)
        .additional_properties(Some(
            utoipa::openapi::schema::AdditionalProperties::FreeForm(false),
        ))
        .into()
}

/// The description of `rule`; `None` for a rule this table lacks (a test fails on that).
fn describe(rule: &Rule) -> Option<Described> {
    let (summary, body) = match (rule.method, rule.path) {
        ("GET", "/api/v1/machines") => ("Machines, a page in machine-id order", None),
        ("GET", "/api/v1/machines/{id}") => ("Everything about one machine", None),
        ("GET", "/api/v1/machines/{id}/history") => ("A machine's whole history", None),
        ("GET", "/api/v1/sessions") => ("The BMDB's sessions", None),
        ("GET", "/api/v1/overview") => ("The fleet's counts by state", None),
        ("GET", "/api/v1/tasks") => ("This server's background tasks", None),
        ("GET", "/api/v1/whoami") => ("The identity the request proved", None),
        ("GET", "/api/v1/openapi.json") => ("This document", None),
        ("POST", "/api/v1/machines/{id}/maintenance") => (
            "Takes a machine out of the loops' hands, or gives it back",
            Some(MaintenanceBody::schema()),
        ),
        ("POST", "/api/v1/machines/{id}/retry") => {
            ("Ends a machine's backoffs now", Some(RetryBody::schema()))
        }
        ("POST", "/api/v1/machines/{id}/forget-host-key") => (
            "Forgets a machine's pinned SSH host key",
            Some(reason_only()),
        ),
        ("POST", "/api/v1/machines/{id}/install") => (
            "Asks a machine's agent to install an image",
            Some(InstallBody::schema()),
        ),
        ("POST", "/api/v1/machines/{id}/decommission") => (
            "Removes a machine from the BMDB and bars its provider id",
            Some(DecommissionBody::schema()),
        ),
        ("POST", "/api/v1/machines/{id}/recommission") => {
            ("Lifts a decommissioning's bar", Some(reason_only()))
        }
        ("POST", "/api/v1/machines/{id}/reimage") => (
            "Sends a machine that came bare back to its live environment to install its OS again",
            Some(ReimageBody::schema()),
        ),
        ("GET", "/api/v1/tokens") => (
            "A page of API tokens by name (never a secret), with `next` if more follow",
            None,
        ),
        ("POST", "/api/v1/tokens") => (
            "Makes an API token; its secret is in the answer only",
            Some(NewTokenBody::schema()),
        ),
        ("DELETE", "/api/v1/tokens/{name}") => ("Revokes an API token", None),
        ("POST", "/api/v1/tokens/revoke-sessions") => (
            "Revokes every web sign-in of one person",
            Some(RevokeSessionsBody::schema()),
        ),
        ("GET", "/api/v1/audit") => ("The security audit trail, newest first, a page", None),
        _ => return None,
    };
    Some(Described { summary, body })
}

/// A required path parameter `name`, a string.
fn path_parameter(name: &str, description: &str) -> Parameter {
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Path)
        .required(Required::True)
        .description(Some(description))
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .build()
}

fn method_of(rule: &Rule) -> HttpMethod {
    match rule.method {
        "POST" => HttpMethod::Post,
        "DELETE" => HttpMethod::Delete,
        _ => HttpMethod::Get,
    }
}

/// The document.
pub fn document() -> OpenApi {
    let mut paths = Paths::new();
    for rule in POLICY {
        let Some(described) = describe(rule) else {
            continue;
        };
        let json = |schema: RefOr<Schema>| ContentBuilder::new().schema(Some(schema)).build();
        let problem = ResponseBuilder::new()
            .description("Refused or failed: a problem detail (RFC 9457) with a stable type")
            .content("application/problem+json", json(ProblemBody::schema()));
        let answer = ResponseBuilder::new()
            .description("The answer")
            .content("application/json", json(ObjectBuilder::new().into()));
        let mut operation = OperationBuilder::new()
            .summary(Some(described.summary))
            .description(Some(format!(
                "Needs the role {}.",
                rule.role.as_str().to_lowercase()
            )))
            .response("200", answer)
            .response("default", problem);
        if rule.path.contains("{id}") {
            operation = operation.parameter(path_parameter("id", "The machine's id (a UUID)"));
        }
        if rule.path.contains("{name}") {
            operation = operation.parameter(path_parameter("name", "The token's name"));
        }
        let query = Some(ParameterIn::Query);
        match (rule.method, rule.path) {
            ("GET", "/api/v1/machines") => {
                operation = operation.parameters(Some(ListQuery::into_params(|| query.clone())));
            }
            ("GET", "/api/v1/tokens") => {
                operation = operation.parameters(Some(TokensQuery::into_params(|| query.clone())));
            }
            ("GET", "/api/v1/audit") => {
                operation = operation.parameters(Some(AuditQuery::into_params(|| query.clone())));
            }
            _ => {}
        }
        if let Some(body) = described.body {
            let body = RequestBodyBuilder::new()
                .content("application/json", json(body))
                .required(Some(Required::True));
            operation = operation.request_body(Some(body.build()));
        }
        paths.add_path_operation(rule.path, vec![method_of(rule)], operation.build());
    }
    let bearer = HttpBuilder::new()
        .scheme(HttpAuthScheme::Bearer)
        .description(Some(
            "A Shepherd API token (shp_…) or the identity provider's JWT",
        ))
        .build();
    let components = ComponentsBuilder::new()
        .security_scheme("bearer", SecurityScheme::Http(bearer))
        .build();
    let info = InfoBuilder::new()
        .title("Shepherd operator API")
        .version("1")
        .description(Some(
            "Machines, their history and operators' actions, sessions, tokens.",
        ))
        .build();
    OpenApiBuilder::new()
        .info(info)
        .paths(paths)
        .components(Some(components))
        .security(Some([SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]))
        .build()
}

/// `GET /api/v1/openapi.json`: the document, made once.
pub async fn served() -> axum::Json<serde_json::Value> {
    static DOCUMENT: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();
    let document = DOCUMENT
        .get_or_init(|| serde_json::to_value(document()).unwrap_or(serde_json::Value::Null));
    axum::Json(document.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_is_described() {
        for rule in POLICY {
            assert!(
                describe(rule).is_some(),
                "{rule:?} is not in the OpenAPI document"
            );
        }
    }
}
