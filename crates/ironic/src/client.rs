//! A small client of Ironic's REST API (`/v1`): the calls the provider needs, each at one
//! pinned microversion, with HTTP basic credentials or none, bounded retries (the shared
//! [`RetryPolicy`]) and per-call metrics. Errors are typed by what the caller should do next.
//!
//! Which failures a call retries depends on what a repeated request could do: reads retry any
//! transient failure; requests that change a node retry only what proves the first attempt was
//! not applied (the node was locked by a conductor, the connection was never made, 429/503).
//! Anything else is returned, and the provider reads the node to learn what happened.

use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use shepherd_provider::http_body::{Failure, JsonApi};
use shepherd_provider::metrics::CallMetrics;
use shepherd_provider::retry::AttemptError;
pub use shepherd_provider::retry::RetryPolicy;
use shepherd_provider::settings::InvalidSetting;

use crate::model::{
    Allocation, ApiVersion, ErrorBody, Node, NodeList, PatchOp, Port, PortList, ALLOCATION_FIELDS,
    NODE_FIELDS,
};

/// The microversion every request asks for. 1.81 is the oldest that has everything the
/// provider uses: the config drive as JSON (1.56), node owners (1.50), conductor groups (1.46)
/// and the inspection inventory (1.81).
pub const PINNED_VERSION: ApiVersion = ApiVersion {
    major: 1,
    minor: 81,
};

/// Largest response body accepted.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// Nodes asked for per page (Ironic's default maximum).
const PAGE_LIMIT: usize = 1000;

/// Pages read at most in one listing (a million nodes): a guard against a server that never
/// stops sending `next`.
const MAX_PAGES: usize = 1000;

/// How Shepherd authenticates to Ironic.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// Standalone Ironic with `auth_strategy = noauth`.
    None,
    /// Ironic's `http_basic` strategy.
    Basic {
        /// The user name.
        user: String,
        /// The password; never printed.
        password: String,
    },
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::None => f.write_str("None"),
            Auth::Basic { user, .. } => f
                .debug_struct("Basic")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
        }
    }
}

/// Why a 409 was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conflict {
    /// A conductor holds the node's lock for another operation; the request was not applied
    /// and may be sent again shortly.
    NodeLocked,
    /// The node already has another `instance_uuid`: another client reserved it.
    NodeAssociated,
    /// The node is moving between provision states (another client's deploy, cleaning): it
    /// cannot be changed until the transition ends.
    InTransition,
    /// Any other conflict.
    Other,
}

/// Why a call failed, by what the caller should do about it.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 404.
    #[error("not found: {message}")]
    NotFound {
        /// Ironic's explanation.
        message: String,
    },
    /// 409.
    #[error("conflict: {message}")]
    Conflict {
        /// What kind.
        kind: Conflict,
        /// Ironic's explanation.
        message: String,
    },
    /// 401 or 403: the credentials are wrong or not allowed; retrying will not help.
    #[error("Ironic refused the credentials (HTTP {status}): {message}")]
    Unauthorized {
        /// The status.
        status: StatusCode,
        /// Ironic's explanation.
        message: String,
    },
    /// Another 4xx: the request does not fit the node's state (e.g. a deploy of a node that is
    /// not `available`) or is malformed.
    #[error("refused (HTTP {status}): {message}")]
    Refused {
        /// The status.
        status: StatusCode,
        /// Ironic's explanation.
        message: String,
    },
    /// 429 or 5xx.
    #[error("unavailable (HTTP {status}): {message}")]
    Unavailable {
        /// The status.
        status: StatusCode,
        /// Ironic's explanation, or the start of the body.
        message: String,
        /// `Retry-After`, if sent.
        retry_after: Option<Duration>,
    },
    /// No connection could be made: the request was never sent.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// Sending or receiving failed after the request may have arrived, or the attempt timed
    /// out.
    #[error("transport: {0}")]
    Transport(String),
    /// The body was not the JSON expected.
    #[error("undecodable response: {0}")]
    Decode(String),
    /// The server's newest microversion is older than [`PINNED_VERSION`].
    #[error("Ironic's API is too old: it offers microversions {min} to {max}, and Shepherd needs {PINNED_VERSION} or newer")]
    TooOld {
        /// The server's oldest microversion.
        min: ApiVersion,
        /// The server's newest microversion.
        max: ApiVersion,
    },
}

impl AttemptError for ApiError {
    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Unavailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    fn is_not_found(&self) -> bool {
        matches!(self, ApiError::NotFound { .. })
    }
}

impl ApiError {
    /// Whether sending the same read again may help.
    pub fn transient(&self) -> bool {
        matches!(
            self,
            ApiError::Unavailable { .. }
                | ApiError::Connect(_)
                | ApiError::Transport(_)
                | ApiError::Decode(_)
                | ApiError::Conflict {
                    kind: Conflict::NodeLocked,
                    ..
                }
        )
    }

    /// Whether the failed request was certainly not applied, so that sending a change again
    /// cannot apply it twice.
    pub fn not_applied(&self) -> bool {
        match self {
            ApiError::Connect(_)
            | ApiError::Conflict {
                kind: Conflict::NodeLocked,
                ..
            } => true,
            ApiError::Unavailable { status, .. } => {
                *status == StatusCode::TOO_MANY_REQUESTS
                    || *status == StatusCode::SERVICE_UNAVAILABLE
            }
            _ => false,
        }
    }
}

/// A client of one Ironic API. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    /// At `http(s)://host:port`, without `/v1`.
    api: JsonApi,
    auth: Arc<Auth>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("root", &self.api.base())
            .field("auth", &self.auth)
            .finish()
    }
}

impl Client {
    /// A client of the Ironic API at `url` (`http(s)://host:port`, with or without `/v1`).
    pub fn new(
        url: &str,
        auth: Auth,
        retry: RetryPolicy,
        metrics: Arc<CallMetrics>,
    ) -> Result<Client, InvalidSetting> {
        if let Auth::Basic { user, password } = &auth {
            if user.is_empty() || password.is_empty() {
                return Err(InvalidSetting::new(
                    "ironic-user",
                    "HTTP basic authentication needs both a user and a password",
                ));
            }
        }
        let root = url.trim_end_matches('/');
        let root = root.strip_suffix("/v1").unwrap_or(root);
        let auth = Arc::new(auth);
        let credentials = auth.clone();
        let api = JsonApi::new("Ironic", "ironic-url", root, retry, metrics, MAX_BODY_BYTES)?
            .signed(move |r| {
                let r = r.header("X-OpenStack-Ironic-API-Version", PINNED_VERSION.to_string());
                match &*credentials {
                    Auth::Basic { user, password } => r.basic_auth(user, Some(password)),
                    Auth::None => r,
                }
            });
        Ok(Client { api, auth })
    }

    /// The API's address, without `/v1`.
    pub fn root(&self) -> &str {
        self.api.base()
    }

    /// Asks the server which microversions it offers and refuses one older than
    /// [`PINNED_VERSION`]; then makes one authenticated read, so that wrong credentials fail
    /// here rather than on every pass.
    pub async fn negotiate(&self) -> Result<ApiVersion, ApiError> {
        let root: serde_json::Value = self
            .api
            .call("version", Method::GET, "/v1/", None, ApiError::transient)
            .await?;
        let (min, max) = ApiVersion::range_of(&root)
            .ok_or_else(|| ApiError::Decode("GET /v1/ names no microversion range".into()))?;
        if max < PINNED_VERSION {
            return Err(ApiError::TooOld { min, max });
        }
        let _: NodeList = self
            .api
            .call(
                "list_nodes",
                Method::GET,
                "/v1/nodes?limit=1&fields=uuid",
                None,
                ApiError::transient,
            )
            .await?;
        Ok(max)
    }

    /// Every node matching `filters` (Ironic's own query parameters), with the fields the
    /// provider reads, page by page.
    pub async fn list_nodes(&self, filters: &[(&str, &str)]) -> Result<Vec<Node>, ApiError> {
        self.list_nodes_with(filters, "").await
    }

    /// [`Self::list_nodes`] with `more` fields (comma-separated) read too, such as
    /// `instance_info` at start-up (too large to read on every pass).
    pub async fn list_nodes_with(
        &self,
        filters: &[(&str, &str)],
        more: &str,
    ) -> Result<Vec<Node>, ApiError> {
        let fields = match more {
            "" => NODE_FIELDS.to_string(),
            more => format!("{NODE_FIELDS},{more}"),
        };
        let query = {
            let mut query = url::form_urlencoded::Serializer::new(String::new());
            for (k, v) in filters {
                query.append_pair(k, v);
            }
            query.append_pair("fields", &fields);
            query.append_pair("limit", &PAGE_LIMIT.to_string());
            query.finish()
        };
        let mut nodes = Vec::new();
        let mut marker: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let path = match &marker {
                None => format!("/v1/nodes?{query}"),
                Some(m) => format!("/v1/nodes?{query}&marker={m}"),
            };
            let page: NodeList = self
                .api
                .call("list_nodes", Method::GET, &path, None, ApiError::transient)
                .await?;
            let full = page.nodes.len() >= PAGE_LIMIT || page.next.is_some();
            marker = page.nodes.last().map(|n| n.uuid.clone());
            nodes.extend(page.nodes);
            if !full || marker.is_none() {
                return Ok(nodes);
            }
        }
        Err(ApiError::Decode(format!(
            "the node listing did not end after {MAX_PAGES} pages"
        )))
    }

    /// One node, with the fields the provider reads.
    pub async fn get_node(&self, id: &str) -> Result<Node, ApiError> {
        let path = format!("/v1/nodes/{}?fields={NODE_FIELDS}", segment(id));
        self.api
            .call("get_node", Method::GET, &path, None, ApiError::transient)
            .await
    }

    /// Applies a JSON patch to a node; `call` names it in metrics. Retried only when the
    /// patch was certainly not applied.
    pub async fn patch_node(
        &self,
        call: &'static str,
        id: &str,
        ops: &[PatchOp],
    ) -> Result<Node, ApiError> {
        let body = serde_json::to_value(ops).map_err(|e| ApiError::Decode(e.to_string()))?;
        let path = format!("/v1/nodes/{}", segment(id));
        // The answer is the whole node, the fields the provider reads among them.
        self.api
            .call(
                call,
                Method::PATCH,
                &path,
                Some(body),
                ApiError::not_applied,
            )
            .await
    }

    /// Creates an allocation (`body` as Ironic takes it: `name`, `resource_class`,
    /// `candidate_nodes`, `traits`, `owner`, `extra`). Ironic answers at once, usually still
    /// `allocating`; a conductor picks the node in the background. Retried only when the
    /// request was certainly not applied (a name already taken is a conflict, not a retry).
    pub async fn create_allocation(&self, body: serde_json::Value) -> Result<Allocation, ApiError> {
        self.api
            .call(
                "create_allocation",
                Method::POST,
                "/v1/allocations",
                Some(body),
                ApiError::not_applied,
            )
            .await
    }

    /// The ports of node `id` (at most a page: a node has a handful).
    pub async fn list_ports(&self, id: &str) -> Result<Vec<Port>, ApiError> {
        let path = format!(
            "/v1/ports?node={}&fields=uuid,address&limit={PAGE_LIMIT}",
            segment(id)
        );
        let page: PortList = self
            .api
            .call("list_ports", Method::GET, &path, None, ApiError::transient)
            .await?;
        Ok(page.ports)
    }

    /// One allocation, by id or name.
    pub async fn get_allocation(&self, id: &str) -> Result<Allocation, ApiError> {
        let path = format!("/v1/allocations/{}?fields={ALLOCATION_FIELDS}", segment(id));
        self.api
            .call(
                "get_allocation",
                Method::GET,
                &path,
                None,
                ApiError::transient,
            )
            .await
    }

    /// Deletes an allocation, which frees its node (Ironic refuses while the node is deployed
    /// and not in maintenance). One already gone is success.
    pub async fn delete_allocation(&self, id: &str) -> Result<(), ApiError> {
        let path = format!("/v1/allocations/{}", segment(id));
        match self
            .api
            .call::<serde_json::Value, ApiError>(
                "delete_allocation",
                Method::DELETE,
                &path,
                None,
                ApiError::not_applied,
            )
            .await
        {
            Ok(_) | Err(ApiError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Requests a provision state change (`active`, `deleted`, …) with `body` (its `target`
    /// included). Ironic answers 202 and works on it in the background.
    pub async fn set_provision_state(
        &self,
        call: &'static str,
        id: &str,
        body: serde_json::Value,
    ) -> Result<(), ApiError> {
        let path = format!("/v1/nodes/{}/states/provision", segment(id));
        let _: serde_json::Value = self
            .api
            .call(call, Method::PUT, &path, Some(body), ApiError::not_applied)
            .await?;
        Ok(())
    }

    /// Requests a power state change (`rebooting`, `power on`, …); retried while a conductor
    /// holds the node's lock.
    pub async fn set_power_state(&self, id: &str, target: &str) -> Result<(), ApiError> {
        let path = format!("/v1/nodes/{}/states/power", segment(id));
        let body = serde_json::json!({ "target": target });
        let _: serde_json::Value = self
            .api
            .call(
                "set_power_state",
                Method::PUT,
                &path,
                Some(body),
                ApiError::not_applied,
            )
            .await?;
        Ok(())
    }

    /// The node's inspection inventory (hardware found by inspection), as Ironic stores it.
    pub async fn inventory(&self, id: &str) -> Result<serde_json::Value, ApiError> {
        let path = format!("/v1/nodes/{}/inventory", segment(id));
        self.api
            .call(
                "get_inventory",
                Method::GET,
                &path,
                None,
                ApiError::transient,
            )
            .await
    }
}

impl From<Failure> for ApiError {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Connect(cause) => ApiError::Connect(cause),
            Failure::Transport(cause) => ApiError::Transport(cause),
            Failure::TooLarge(max) => ApiError::Decode(format!("body larger than {max} bytes")),
            Failure::Decode(cause) => ApiError::Decode(cause),
            Failure::Status(answer) => {
                status_error(answer.status, &answer.body, answer.retry_after)
            }
        }
    }
}

/// The typed error for an unsuccessful answer.
fn status_error(status: StatusCode, body: &[u8], retry_after: Option<Duration>) -> ApiError {
    let message = ErrorBody::message_of(body);
    match status {
        StatusCode::NOT_FOUND => ApiError::NotFound { message },
        StatusCode::CONFLICT => ApiError::Conflict {
            kind: conflict_kind(&message),
            message,
        },
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            ApiError::Unauthorized { status, message }
        }
        s if s == StatusCode::TOO_MANY_REQUESTS || s.is_server_error() => ApiError::Unavailable {
            status,
            message,
            retry_after,
        },
        _ => ApiError::Refused { status, message },
    }
}

/// Ironic says which conflict it is only in words (`NodeLocked`: "Node X is locked by host Y,
/// please retry after the current operation is completed"; `NodeAssociated`: "Node X is
/// associated with instance Y"; a node deploying: "Node X can not be updated while a state
/// transition is in progress").
fn conflict_kind(message: &str) -> Conflict {
    if message.contains("is locked by host") {
        Conflict::NodeLocked
    } else if message.contains("is associated with instance") {
        Conflict::NodeAssociated
    } else if message.contains("while a state transition is in progress") {
        Conflict::InTransition
    } else {
        Conflict::Other
    }
}

/// A node id or name as one URL path segment.
fn segment(id: &str) -> String {
    url::form_urlencoded::byte_serialize(id.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_become_errors_by_what_to_do_next() {
        let locked = br#"{"error_message": "{\"faultcode\": \"Client\", \"faultstring\": \"Node 1be2 is locked by host h1, please retry after the current operation is completed.\", \"debuginfo\": null}"}"#;
        let e = status_error(StatusCode::CONFLICT, locked, None);
        assert!(matches!(
            e,
            ApiError::Conflict {
                kind: Conflict::NodeLocked,
                ..
            }
        ));
        assert!(e.not_applied() && e.transient());
        assert!(e.to_string().contains("is locked by host h1"), "{e}");

        let taken = br#"{"error_message": "{\"faultcode\": \"Client\", \"faultstring\": \"Node f4 is associated with instance 1111.\", \"debuginfo\": null}"}"#;
        let e = status_error(StatusCode::CONFLICT, taken, None);
        assert!(matches!(
            e,
            ApiError::Conflict {
                kind: Conflict::NodeAssociated,
                ..
            }
        ));
        assert!(!e.not_applied() && !e.transient());
        let busy = br#"{"error_message": "{\"faultcode\": \"Client\", \"faultstring\": \"Node fd can not be updated while a state transition is in progress.\", \"debuginfo\": null}"}"#;
        assert!(matches!(
            status_error(StatusCode::CONFLICT, busy, None),
            ApiError::Conflict {
                kind: Conflict::InTransition,
                ..
            }
        ));

        let e = status_error(StatusCode::UNAUTHORIZED, b"Authorization failed", None);
        assert!(matches!(e, ApiError::Unauthorized { .. }));
        assert!(!e.transient());
        let e = status_error(StatusCode::BAD_GATEWAY, b"<html>", None);
        assert!(
            e.transient() && !e.not_applied(),
            "a 502 may have been applied"
        );
        let e = status_error(StatusCode::SERVICE_UNAVAILABLE, b"", None);
        assert!(e.not_applied());
        let e = status_error(StatusCode::BAD_REQUEST, b"{}", None);
        assert!(matches!(e, ApiError::Refused { .. }));
    }

    #[test]
    fn urls_and_credentials_are_checked_and_the_password_is_never_printed() {
        let metrics = Arc::new(CallMetrics::default());
        let c = Client::new(
            "http://127.0.0.1:6385/v1/",
            Auth::Basic {
                user: "shepherd".into(),
                password: "hunter2".into(),
            },
            RetryPolicy::default(),
            metrics.clone(),
        )
        .unwrap();
        assert_eq!(c.root(), "http://127.0.0.1:6385");
        assert!(!format!("{c:?}").contains("hunter2"));
        let e = Client::new(
            "ftp://x",
            Auth::None,
            RetryPolicy::default(),
            metrics.clone(),
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("ironic-url: "), "{e}");
        let e = Client::new(
            "http://x",
            Auth::Basic {
                user: "u".into(),
                password: String::new(),
            },
            RetryPolicy::default(),
            metrics,
        )
        .unwrap_err();
        assert!(e.to_string().contains("password"), "{e}");
    }
}
