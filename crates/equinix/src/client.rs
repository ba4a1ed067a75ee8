//! A small Equinix Metal REST client: the calls Shepherd needs, with bounded retries (jittered
//! exponential backoff, `Retry-After` honoured) on 429, 5xx, timeouts, connection errors and
//! truncated or undecodable bodies. Creations are never retried here: a retried POST could create
//! a second device, so the provider decides (it looks for the device first).

use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use shepherd_provider::http_body::{never, Failure, JsonApi};
use shepherd_provider::metrics::CallMetrics;
use shepherd_provider::retry::AttemptError;
pub use shepherd_provider::retry::RetryPolicy;
use shepherd_provider::settings::InvalidSetting;

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
        let ApiError::Status { retry_after, .. } = self else {
            return None;
        };
        *retry_after
    }

    fn is_not_found(&self) -> bool {
        matches!(self, ApiError::NotFound)
    }
}

impl ApiError {
    /// Whether the API refused the request as it stands (422), e.g. a creation on a
    /// reservation that has a device already.
    pub fn refused(&self) -> bool {
        matches!(self, ApiError::Status { status, .. } if *status == StatusCode::UNPROCESSABLE_ENTITY)
    }

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
    api: JsonApi,
    project: String,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.api.base())
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
        if token.is_empty() {
            return Err(InvalidSetting::new("API token", "is empty"));
        }
        if project.is_empty() {
            return Err(InvalidSetting::new("project id", "is empty"));
        }
        let token: Arc<str> = token.into();
        let api = JsonApi::new("Equinix", "API URL", base, retry, metrics, MAX_BODY_BYTES)?
            .signed(move |r| r.header("X-Auth-Token", &*token));
        Ok(Client {
            api,
            project: project.to_string(),
        })
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
            let (mut batch, meta) = items(
                self.api
                    .call(call, Method::GET, &p, None, ApiError::retryable)
                    .await?,
            );
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
        self.api
            .call(
                "get_device",
                Method::GET,
                &format!("/devices/{id}"),
                None,
                ApiError::retryable,
            )
            .await
    }

    /// Creates a device. Not retried: the caller checks whether it exists before trying again.
    pub async fn create_device(&self, d: &DeviceCreate) -> Result<Device, ApiError> {
        let path = format!("/projects/{}/devices", self.project);
        self.api
            .call("create_device", Method::POST, &path, Some(json(d)), never)
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
            .api
            .call(
                "list_ssh_keys",
                Method::GET,
                &path,
                None,
                ApiError::retryable,
            )
            .await?;
        Ok(l.ssh_keys)
    }

    /// Adds a project SSH key.
    pub async fn create_ssh_key(&self, k: &SshKeyInput) -> Result<SshKey, ApiError> {
        let path = format!("/projects/{}/ssh-keys", self.project);
        self.api
            .call("create_ssh_key", Method::POST, &path, Some(json(k)), never)
            .await
    }

    /// Replaces a project SSH key's label and key.
    pub async fn update_ssh_key(&self, id: &str, k: &SshKeyInput) -> Result<SshKey, ApiError> {
        self.api
            .call(
                "update_ssh_key",
                Method::PUT,
                &format!("/ssh-keys/{id}"),
                Some(json(k)),
                ApiError::retryable,
            )
            .await
    }

    /// Asks for a reboot (retried: a second reboot request is harmless).
    pub async fn reboot(&self, id: &str) -> Result<(), ApiError> {
        let _: serde_json::Value = self
            .api
            .call(
                "reboot",
                Method::POST,
                &format!("/devices/{id}/actions"),
                Some(json(&Action {
                    kind: "reboot".into(),
                })),
                ApiError::retryable,
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
