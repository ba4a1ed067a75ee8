//! One exchange with a provider's JSON API, as the Equinix and Ironic clients make it: send,
//! read the answer whole with a bound on its size (a server, or something in the middle,
//! cannot make a client hold more than `max` bytes of one body), and decode a successful one.
//! What failed comes back as a [`Failure`], which each client turns into its own typed error.
//! [`JsonApi`] is the part both clients share around it: where the API is, the HTTP client
//! with its timeout, and the retried, counted call.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::causes::reqwest_causes;
use crate::metrics::CallMetrics;
use crate::retry::{AttemptError, RetryPolicy};
use crate::settings::InvalidSetting;

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
    let retry_after = crate::retry_after::retry_after(resp.headers());
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

/// How a client prepares each request: authentication, version headers.
type Sign = Arc<dyn Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder + Send + Sync>;

/// A provider's JSON API as a client calls it: its base URL, one HTTP client whose timeout is
/// the retry policy's per-attempt timeout, how each request is signed, and the metrics every
/// call is counted in.
#[derive(Clone)]
pub struct JsonApi {
    name: &'static str,
    http: reqwest::Client,
    base: String,
    sign: Sign,
    retry: RetryPolicy,
    metrics: Arc<CallMetrics>,
    max_body: usize,
}

/// For calls that are never retried: a creation sent twice could create twice.
pub fn never<E>(_: &E) -> bool {
    false
}

impl JsonApi {
    /// The API `name` (in logs) at `base`, an http(s) URL (a trailing `/` is dropped) given
    /// as the operators' `setting`, which an error names; bodies of more than `max_body` bytes
    /// are refused.
    pub fn new(
        name: &'static str,
        setting: &str,
        base: &str,
        retry: RetryPolicy,
        metrics: Arc<CallMetrics>,
        max_body: usize,
    ) -> Result<JsonApi, InvalidSetting> {
        let invalid = |problem: String| InvalidSetting::new(setting, problem);
        let parsed = url::Url::parse(base).map_err(|e| invalid(format!("{base:?}: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(invalid(format!("{base:?}: must be http(s)")));
        }
        let http = reqwest::Client::builder()
            .timeout(retry.timeout)
            .user_agent(concat!("shepherd/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| invalid(format!("no HTTP client: {}", reqwest_causes(e))))?;
        Ok(JsonApi {
            name,
            http,
            base: base.trim_end_matches('/').to_string(),
            sign: Arc::new(|request| request),
            retry,
            metrics,
            max_body,
        })
    }

    /// Every request prepared by `sign` before it is sent (authentication, version headers).
    pub fn signed(
        self,
        sign: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder + Send + Sync + 'static,
    ) -> Self {
        JsonApi {
            sign: Arc::new(sign),
            ..self
        }
    }

    /// The base URL, without a trailing `/`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `method` on `base` + `path` with an optional JSON body, retried while `retry_if`
    /// admits the error and the policy has attempts left; `call` names it in metrics and logs.
    pub async fn call<T: DeserializeOwned, E: AttemptError + From<Failure>>(
        &self,
        call: &'static str,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
        retry_if: impl Fn(&E) -> bool,
    ) -> Result<T, E> {
        let url = format!("{}{path}", self.base);
        let attempt = || {
            let mut request = (self.sign)(self.http.request(method.clone(), &url))
                .header("Accept", "application/json");
            if let Some(b) = &body {
                request = request.json(b);
            }
            async move { exchange_json(request, self.max_body).await.map_err(E::from) }
        };
        self.retry
            .run(&self.metrics, self.name, call, retry_if, attempt)
            .await
    }
}
