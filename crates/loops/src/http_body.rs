//! Reading a provider API's answer with a bound on its size, as the Equinix and Ironic
//! clients do: a server (or something in the middle) cannot make a client hold more than
//! `max` bytes of one body.

use std::time::Duration;

use crate::causes::reqwest_causes;

/// An answer read whole: its status, its `Retry-After` (in seconds, if sent) and its body.
#[derive(Debug)]
pub struct BoundedAnswer {
    /// The HTTP status.
    pub status: reqwest::StatusCode,
    /// How long the server asked us to wait before retrying.
    pub retry_after: Option<Duration>,
    /// The body.
    pub body: Vec<u8>,
}

/// Why an answer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The connection failed while the body was read.
    #[error("reading the body: {0}")]
    Transport(String),
    /// The body is larger than allowed.
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
}

/// Reads `resp` whole, refusing a body of more than `max` bytes.
pub async fn read_bounded(
    mut resp: reqwest::Response,
    max: usize,
) -> Result<BoundedAnswer, ReadError> {
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ReadError::Transport(reqwest_causes(e)))?
    {
        if body.len() + chunk.len() > max {
            return Err(ReadError::TooLarge(max));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(BoundedAnswer {
        status,
        retry_after,
        body,
    })
}
