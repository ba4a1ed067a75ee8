//! Strict extractors: a JSON body or a query string that does not parse is one problem
//! (`invalid-request`, or `too-large` for a body over the limit) naming what is wrong, and
//! nothing is changed.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use futures::StreamExt;
use serde::de::DeserializeOwned;

use super::problem::{Kind, Problem};

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 64 << 10;

/// A body over the limit is still read and dropped up to this many bytes before the answer,
/// so that a client that sent a little too much reads a clean 413 instead of a reset
/// connection; beyond it the connection is closed.
const DRAINED_AT_MOST: usize = 1 << 20;

/// A JSON body of `T`, at most [`MAX_BODY_BYTES`].
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Problem> {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(';')
                    .next()
                    .is_some_and(|m| m.trim() == "application/json")
            });
        if !json {
            let detail = "the body must be JSON (content-type: application/json)";
            return Err(Problem::new(Kind::InvalidRequest, detail));
        }
        let mut chunks = req.into_body().into_data_stream();
        let (mut body, mut read) = (Vec::new(), 0usize);
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| Problem::new(Kind::InvalidRequest, e.to_string()))?;
            read += chunk.len();
            if read <= MAX_BODY_BYTES {
                body.extend_from_slice(&chunk);
            } else if read > DRAINED_AT_MOST {
                break;
            }
        }
        if read > MAX_BODY_BYTES {
            let detail = format!("the body is larger than {} bytes", MAX_BODY_BYTES);
            return Err(Problem::new(Kind::TooLarge, detail));
        }
        match axum::Json::<T>::from_bytes(&body) {
            Ok(axum::Json(body)) => Ok(ApiJson(body)),
            Err(rejection) => Err(Problem::new(Kind::InvalidRequest, rejection.body_text())),
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
