//! Errors of the operator API as problem details (RFC 9457): `application/problem+json` with a
//! stable `type` per kind of problem, so clients branch on the type, never on the wording.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

/// The kinds of problem the API answers with; each has one status and one stable type URI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No identity, or one that cannot be verified (401).
    Unauthenticated,
    /// An identity whose role may not do this (403).
    Forbidden,
    /// No such machine, token or route (404).
    NotFound,
    /// The request is malformed: bad JSON, an unknown field, a bad value (400).
    InvalidRequest,
    /// The request is well-formed but its text cannot be taken: a reason that would print as
    /// more than one line or move a terminal, or one too long (422).
    Unprocessable,
    /// The name is taken (409).
    Conflict,
    /// The body is larger than the API accepts (413).
    TooLarge,
    /// Too many requests from this identity or peer (429).
    RateLimited,
    /// The BMDB cannot answer now; nothing was written (503).
    Unavailable,
    /// A request took longer than the API allows (503).
    Timeout,
}

impl Kind {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Kind::Unauthenticated => StatusCode::UNAUTHORIZED,
            Kind::Forbidden => StatusCode::FORBIDDEN,
            Kind::NotFound => StatusCode::NOT_FOUND,
            Kind::InvalidRequest => StatusCode::BAD_REQUEST,
            Kind::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
            Kind::Conflict => StatusCode::CONFLICT,
            Kind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Kind::Unavailable | Kind::Timeout => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The stable name in the type URI (`urn:shepherd:problem:NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Unauthenticated => "unauthenticated",
            Kind::Forbidden => "forbidden",
            Kind::NotFound => "not-found",
            Kind::InvalidRequest => "invalid-request",
            Kind::Unprocessable => "unprocessable",
            Kind::Conflict => "conflict",
            Kind::TooLarge => "too-large",
            Kind::RateLimited => "rate-limited",
            Kind::Unavailable => "unavailable",
            Kind::Timeout => "timeout",
        }
    }
}

/// One problem: its kind and what to tell the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// What kind.
    pub kind: Kind,
    /// One line for people.
    pub detail: String,
}

impl Problem {
    /// A problem of `kind` saying `detail`.
    pub fn new(kind: Kind, detail: impl Into<String>) -> Problem {
        Problem {
            kind,
            detail: detail.into(),
        }
    }
}

impl From<shepherd_bmdb::Error> for Problem {
    fn from(e: shepherd_bmdb::Error) -> Problem {
        match e {
            shepherd_bmdb::Error::InvalidArgument { .. }
            | shepherd_bmdb::Error::UnknownName { .. } => {
                Problem::new(Kind::InvalidRequest, e.to_string())
            }
            _ => Problem::new(Kind::Unavailable, e.to_string()),
        }
    }
}

/// A problem as the API writes it (`application/problem+json`).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ProblemBody {
    /// `urn:shepherd:problem:NAME`: `unauthenticated`, `forbidden`, `not-found`,
    /// `invalid-request`, `unprocessable`, `conflict`, `too-large`, `rate-limited`,
    /// `unavailable`, `timeout`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status's reason phrase.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What is wrong, in one line.
    pub detail: String,
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.kind.status();
        let body = ProblemBody {
            kind: format!("urn:shepherd:problem:{}", self.kind.name()),
            title: status.canonical_reason().unwrap_or("error").to_string(),
            status: status.as_u16(),
            detail: self.detail,
        };
        let body = serde_json::to_string(&body).unwrap_or_default();
        let mut response = (status, body).into_response();
        let content_type = header::HeaderValue::from_static("application/problem+json");
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
        if self.kind == Kind::Unauthenticated {
            let challenge = header::HeaderValue::from_static("Bearer realm=\"shepherd\"");
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, challenge);
        }
        // Handlers and middleware see the kind, to count and log it.
        response.extensions_mut().insert(self.kind);
        response
    }
}
