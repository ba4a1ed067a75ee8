//! One exchange with a provider's JSON API, as the Equinix and Ironic clients make it: send,
//! read the answer whole with a bound on its size (a server, or something in the middle,
//! cannot make a client hold more than `max` bytes of one body), and decode a successful one.
//! What failed comes back as a [`Failure`], which each client turns into its own typed error.

use std::time::Duration;

use serde::de::DeserializeOwned;

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

/// Why an exchange did not yield the JSON asked for.
#[derive(Debug)]
pub enum Failure {
    /// No connection could be made: the request was never sent.
    Connect(String),
    /// Sending or receiving failed after the request may have arrived, or it timed out.
    Transport(String),
    /// The body was larger than the bound.
    TooLarge(usize),
    /// The server answered with an unsuccessful status.
    Status(BoundedAnswer),
    /// The body was not the JSON expected.
    Decode(String),
}

/// Sends `request`, reads the answer (at most `max` bytes of body), and decodes a successful
/// one as `T` (an empty body as JSON `null`).
pub async fn exchange_json<T: DeserializeOwned>(
    request: reqwest::RequestBuilder,
    max: usize,
) -> Result<T, Failure> {
    let resp = request.send().await.map_err(|e| {
        if e.is_connect() {
            Failure::Connect(reqwest_causes(e))
        } else {
            Failure::Transport(reqwest_causes(e))
        }
    })?;
    let answer = read_bounded(resp, max).await?;
    if !answer.status.is_success() {
        return Err(Failure::Status(answer));
    }
    let body: &[u8] = if answer.body.is_empty() {
        b"null"
    } else {
        &answer.body
    };
    serde_json::from_slice(body).map_err(|e| Failure::Decode(e.to_string()))
}

/// Reads `resp` whole, refusing a body of more than `max` bytes.
async fn read_bounded(mut resp: reqwest::Response, max: usize) -> Result<BoundedAnswer, Failure> {
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
        .map_err(|e| Failure::Transport(format!("reading the body: {}", reqwest_causes(e))))?
    {
        if body.len() + chunk.len() > max {
            return Err(Failure::TooLarge(max));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(BoundedAnswer {
        status,
        retry_after,
        body,
    })
}
