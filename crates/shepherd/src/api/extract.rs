//! Strict extractors: a JSON body or a query string that does not parse is one problem
//! (`invalid-request`, or `too-large` for a body over the limit) naming what is wrong, and
//! nothing is changed.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::problem::{Kind, Problem};

/// A JSON body of `T`.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(body)) => Ok(ApiJson(body)),
            Err(rejection) => {
                let kind = match rejection.status() {
                    StatusCode::PAYLOAD_TOO_LARGE => Kind::TooLarge,
                    _ => Kind::InvalidRequest,
                };
                Err(Problem::new(kind, rejection.body_text()))
            }
        }
    }
}

/// A query string of `T`.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(query)) => Ok(ApiQuery(query)),
            Err(rejection) => Err(Problem::new(Kind::InvalidRequest, rejection.body_text())),
        }
    }
}
