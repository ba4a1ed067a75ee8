//! A small Equinix Metal REST client: the calls Shepherd needs, with bounded retries (jittered
//! exponential backoff, `Retry-After` honoured) on 429, 5xx, timeouts, connection errors and
//! truncated or undecodable bodies. Creations are never retried here: a retried POST could create
//! a second device, so the provider decides (it looks for the device first).

use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use shepherd_loops::http_body::{exchange_json, Failure};
use shepherd_loops::metrics::CallMetrics;
use shepherd_loops::retry::AttemptError;
pub use shepherd_loops::retry::RetryPolicy;
use shepherd_loops::settings::InvalidSetting;

use crate::model::*;

/// Largest response body accepted.
pub const MAX_BODY_BYTES: usize = 32 << 20;
/// Page size of list calls.
const PER_PAGE: u32 = 500;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 404.
    #[error("Equinix API: not found")]
    NotFound,
    /// Any other unsuccessful status.
    #[error("Equinix API: HTTP {status}: {body}")]
    Status {
        /// The status.
        status: StatusCode,
        /// The start of the response body.
        body: String,
        /// `Retry-After`, if the server sent one.
        retry_after: Option<Duration>,
    },
    /// Connecting, sending or receiving failed, or the attempt timed out.
    #[error("Equinix API: transport: {0}")]
    Transport(String),
    /// The body was not the JSON expected (or was cut short).
    #[error("Equinix API: undecodable response: {0}")]
    Decode(String),
}

impl From<Failure> for ApiError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Connect(cause) | Failure::Transport(cause) => ApiError::Transport(cause),
            Failure::TooLarge(max) => ApiError::Decode(format!("body larger than {max} bytes")),
            Failure::Decode(cause) => ApiError::Decode(cause),
            Failure::Status(answer) if answer.status == StatusCode::NOT_FOUND => ApiError::NotFound,
            Failure::Status(answer) => ApiError::Status {
                status: answer.status,
                body: String::from_utf8_lossy(&answer.body[..answer.body.len().min(300)])
                    .into_owned(),
                retry_after: answer.retry_after,
            },
        }
    }
}

impl AttemptError for ApiError {
    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    fn is_not_found(&self) -> bool {
        matches!(self, ApiError::NotFound)
    }
}

impl ApiError {
    /// Whether trying again may help.
    pub fn retryable(&self) -> bool {
        match self {
            ApiError::NotFound => false,
            ApiError::Status { status, .. } => {
                *status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
            }
            ApiError::Transport(_) | ApiError::Decode(_) => true,
        }
    }
}

/// A client for one project. The token is sent as `X-Auth-Token` and never printed.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Arc<str>,
    project: String,
    retry: RetryPolicy,
    metrics: Arc<CallMetrics>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("project", &self.project)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl Client {
    /// A client of the API at `base` (e.g. `https://api.equinix.com/metal/v1`).
    pub fn new(
        base: &str,
        token: &str,
        project: &str,
        retry: RetryPolicy,
        metrics: Arc<CallMetrics>,
    ) -> Result<Client, InvalidSetting> {
        let url = || format!("API URL {base:?}");
        let parsed =
            url::Url::parse(base).map_err(|e| InvalidSetting::new(url(), e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(InvalidSetting::new(url(), "must be http(s)"));
        }
        if token.is_empty() {
            return Err(InvalidSetting::new("API token", "is empty"));
        }
        if project.is_empty() {
            return Err(InvalidSetting::new("project id", "is empty"));
        }
        let http = reqwest::Client::builder()
            .timeout(retry.timeout)
            .user_agent(concat!("shepherd/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| InvalidSetting::new(url(), format!("no HTTP client: {e}")))?;
        Ok(Client {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: token.into(),
            project: project.to_string(),
            retry,
            metrics,
        })
    }

    /// One attempt.
    async fn attempt<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<T, ApiError> {
        let url = format!("{}{path}", self.base);
        let mut req = self
            .http
            .request(method, &url)
            .header("X-Auth-Token", &*self.token)
            .header("Accept", "application/json");
        if let Some(b) = body {
            req = req.json(b);
        }
        exchange_json(req, MAX_BODY_BYTES)
            .await
            .map_err(ApiError::from)
    }

    /// A call with retries; `call` names it in metrics and logs.
    async fn call<T: DeserializeOwned>(
        &self,
        call: &'static str,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        retry: bool,
    ) -> Result<T, ApiError> {
        self.retry
            .run(
                &self.metrics,
                "Equinix",
                call,
                |e: &ApiError| retry && e.retryable(),
                || self.attempt(method.clone(), path, body.as_ref()),
            )
            .await
    }

    async fn paged<T: DeserializeOwned, I>(
        &self,
        call: &'static str,
        path: &str,
        items: impl Fn(T) -> (Vec<I>, Meta),
    ) -> Result<Vec<I>, ApiError> {
        let mut out = Vec::new();
        let mut page = 1u32;
        loop {
            let sep = if path.contains('?') { '&' } else { '?' };
            let p = format!("{path}{sep}page={page}&per_page={PER_PAGE}");
            let (mut batch, meta) = items(self.call(call, Method::GET, &p, None, true).await?);
            let empty = batch.is_empty();
            out.append(&mut batch);
            let last = meta.last_page.unwrap_or(page);
            if empty || (meta.next.is_none() && page >= last) || page >= 10_000 {
                return Ok(out);
            }
            page += 1;
        }
    }

    /// Every device of the project.
    pub async fn list_devices(&self) -> Result<Vec<Device>, ApiError> {
        let path = format!("/projects/{}/devices", self.project);
        self.paged("list_devices", &path, |l: DeviceList| (l.devices, l.meta))
            .await
    }

    /// One device.
    pub async fn get_device(&self, id: &str) -> Result<Device, ApiError> {
        self.call(
            "get_device",
            Method::GET,
            &format!("/devices/{id}"),
            None,
            true,
        )
        .await
    }

    /// Creates a device. Not retried: the caller checks whether it exists before trying again.
    pub async fn create_device(&self, d: &DeviceCreate) -> Result<Device, ApiError> {
        let path = format!("/projects/{}/devices", self.project);
        self.call("create_device", Method::POST, &path, Some(json(d)), false)
            .await
    }

    /// Every hardware reservation of the project.
    pub async fn list_reservations(&self) -> Result<Vec<Reservation>, ApiError> {
        let path = format!("/projects/{}/hardware-reservations", self.project);
        self.paged("list_reservations", &path, |l: ReservationList| {
            (l.hardware_reservations, l.meta)
        })
        .await
    }

    /// Every SSH key of the project.
    pub async fn list_ssh_keys(&self) -> Result<Vec<SshKey>, ApiError> {
        let path = format!("/projects/{}/ssh-keys", self.project);
        let l: SshKeyList = self
            .call("list_ssh_keys", Method::GET, &path, None, true)
            .await?;
        Ok(l.ssh_keys)
    }

    /// Adds a project SSH key.
    pub async fn create_ssh_key(&self, k: &SshKeyInput) -> Result<SshKey, ApiError> {
        let path = format!("/projects/{}/ssh-keys", self.project);
        self.call("create_ssh_key", Method::POST, &path, Some(json(k)), false)
            .await
    }

    /// Replaces a project SSH key's label and key.
    pub async fn update_ssh_key(&self, id: &str, k: &SshKeyInput) -> Result<SshKey, ApiError> {
        self.call(
            "update_ssh_key",
            Method::PUT,
            &format!("/ssh-keys/{id}"),
            Some(json(k)),
            true,
        )
        .await
    }

    /// Asks for a reboot (retried: a second reboot request is harmless).
    pub async fn reboot(&self, id: &str) -> Result<(), ApiError> {
        let _: serde_json::Value = self
            .call(
                "reboot",
                Method::POST,
                &format!("/devices/{id}/actions"),
                Some(json(&Action {
                    kind: "reboot".into(),
                })),
                true,
            )
            .await?;
        Ok(())
    }
}

fn json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).expect("API inputs serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_not_printed() {
        let c = Client::new(
            "https://api.example/metal/v1",
            "sekrit-token",
            "p",
            RetryPolicy::default(),
            Arc::default(),
        )
        .unwrap();
        assert!(!format!("{c:?}").contains("sekrit"));
    }
}
