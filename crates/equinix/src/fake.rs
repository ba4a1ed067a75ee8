//! A fake Equinix Metal API for tests (feature `testing`): the real paths, JSON shapes, paging
//! and auth header, over real HTTP on loopback, with failures injected on request: 5xx, 429 with
//! `Retry-After`, slow answers, truncated bodies, a creation that succeeds but answers 500,
//! devices stuck in `provisioning`, devices that turn `failed`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;

use crate::model::*;

/// Something to go wrong with the next matching request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Answer with this status and a JSON error body.
    Status(u16),
    /// 429 with `Retry-After: secs`.
    TooManyRequests {
        /// Seconds to wait.
        retry_after_secs: u64,
    },
    /// Wait this long, then answer normally.
    Slow(Duration),
    /// Answer 200 with the JSON cut in half.
    Truncated,
    /// Do the work (create the device), then answer 500.
    SucceedThen500,
}

#[derive(Default)]
struct FakeState {
    token: String,
    project: String,
    devices: Vec<Device>,
    reservations: Vec<Reservation>,
    ssh_keys: Vec<SshKey>,
    failures: VecDeque<(String, Failure)>,
    requests: Vec<String>,
    reboots: Vec<String>,
    stuck_provisioning: bool,
    page_size: usize,
    next_id: u64,
}

impl Failure {
    /// Whether it replaces or delays the answer (else it spoils an answer already made).
    fn before_answer(&self) -> bool {
        !matches!(self, Failure::Truncated | Failure::SucceedThen500)
    }
}

impl FakeState {
    /// Takes the first failure queued for `route` of the given phase.
    fn failure(&mut self, route: &str, before_answer: bool) -> Option<Failure> {
        let at = self
            .failures
            .iter()
            .position(|(r, f)| r == route && f.before_answer() == before_answer)?;
        self.failures.remove(at).map(|(_, f)| f)
    }

    fn id(&mut self, kind: &str) -> String {
        self.next_id += 1;
        format!(
            "{kind}-{:08}-0000-4000-8000-{:012}",
            self.next_id, self.next_id
        )
    }
}

/// The running fake. Dropping it stops the server.
pub struct FakeEquinix {
    addr: SocketAddr,
    state: Arc<Mutex<FakeState>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeEquinix {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[derive(Deserialize)]
struct PageQuery {
    page: Option<usize>,
    per_page: Option<usize>,
}

type Shared = Arc<Mutex<FakeState>>;

fn error(status: StatusCode, msg: &str) -> Response {
    (status, Json(serde_json::json!({ "errors": [msg] }))).into_response()
}

/// Records the request, checks the token (and project), then applies an injected failure
/// that comes before the answer (`Slow` waits and lets the request through); `Some` is the
/// response to give instead of the handler's.
async fn guard(
    state: &Shared,
    headers: &HeaderMap,
    project: Option<&str>,
    route: &str,
) -> Option<Response> {
    let failure = {
        let mut s = state.lock().unwrap();
        s.requests.push(route.to_string());
        if headers.get("x-auth-token").and_then(|v| v.to_str().ok()) != Some(s.token.as_str()) {
            return Some(error(StatusCode::UNAUTHORIZED, "invalid token"));
        }
        if project.is_some_and(|p| p != s.project) {
            return Some(error(StatusCode::NOT_FOUND, "no such project"));
        }
        s.failure(route, true)?
    };
    match failure {
        Failure::Status(code) => Some(error(
            StatusCode::from_u16(code).unwrap(),
            "injected failure",
        )),
        Failure::TooManyRequests { retry_after_secs } => Some(
            (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", retry_after_secs.to_string())],
                Json(serde_json::json!({ "errors": ["rate limited"] })),
            )
                .into_response(),
        ),
        Failure::Slow(d) => {
            tokio::time::sleep(d).await;
            None
        }
        Failure::Truncated | Failure::SucceedThen500 => unreachable!("taken after the answer"),
    }
}

/// Answers `value`, spoiled by a failure injected for after the answer: cut in half
/// (`Truncated`) or replaced by a 500 although the work was done (`SucceedThen500`).
fn answer(state: &Shared, route: &str, status: StatusCode, value: serde_json::Value) -> Response {
    let text = value.to_string();
    match state.lock().unwrap().failure(route, false) {
        Some(Failure::Truncated) => {
            (status, Body::from(text[..text.len() / 2].to_string())).into_response()
        }
        Some(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "injected after success"),
        None => (status, [("content-type", "application/json")], text).into_response(),
    }
}

fn page<T: serde::Serialize>(
    items: &[T],
    q: &PageQuery,
    cap: usize,
    key: &str,
    path: &str,
) -> serde_json::Value {
    let per = q.per_page.unwrap_or(20).clamp(1, cap.max(1));
    let page = q.page.unwrap_or(1).max(1);
    let last = items.len().div_ceil(per).max(1);
    let slice: Vec<&T> = items.iter().skip((page - 1) * per).take(per).collect();
    let next = (page < last)
        .then(|| serde_json::json!({"href": format!("{path}?page={}&per_page={per}", page + 1)}));
    serde_json::json!({
        key: slice,
        "meta": {"current_page": page, "last_page": last, "total": items.len(), "next": next},
    })
}

/// A paged listing of what `items` picks from the fake's state, as JSON key `key` at `path`,
/// after the route's guard.
async fn listing<T: serde::Serialize>(
    state: &Shared,
    headers: &HeaderMap,
    (project, route, key): (&str, &'static str, &str),
    q: &PageQuery,
    items: impl FnOnce(&FakeState) -> &[T],
) -> Response {
    if let Some(r) = guard(state, headers, Some(project), route).await {
        return r;
    }
    let body = {
        let s = state.lock().unwrap();
        let path = format!("/metal/v1/projects/{project}/{}", key.replace('_', "-"));
        page(items(&s), q, s.page_size, key, &path)
    };
    answer(state, route, StatusCode::OK, body)
}

async fn list_devices(
    State(state): State<Shared>,
    Path(project): Path<String>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let what = (project.as_str(), "GET /projects/devices", "devices");
    listing(&state, &headers, what, &q, |s| &s.devices).await
}

async fn create_device(
    State(state): State<Shared>,
    Path(project): Path<String>,
    headers: HeaderMap,
    Json(req): Json<DeviceCreate>,
) -> Response {
    let route = "POST /projects/devices";
    if let Some(r) = guard(&state, &headers, Some(&project), route).await {
        return r;
    }
    let device = {
        let mut s = state.lock().unwrap();
        if !s
            .ssh_keys
            .iter()
            .any(|k| req.project_ssh_keys.contains(&k.id))
        {
            drop(s);
            return error(StatusCode::UNPROCESSABLE_ENTITY, "unknown project SSH key");
        }
        let stuck = s.stuck_provisioning;
        let Some(at) = s
            .reservations
            .iter()
            .position(|r| r.id == req.hardware_reservation_id)
        else {
            drop(s);
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no such hardware reservation",
            );
        };
        if !s.reservations[at].provisionable || s.reservations[at].device.is_some() {
            drop(s);
            return error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "hardware reservation is not provisionable",
            );
        }
        let id = s.id("dev");
        let n = s.devices.len();
        let facility = s.reservations[at].facility.clone();
        s.reservations[at].device = Some(Ref {
            id: Some(id.clone()),
            href: Some(format!("/metal/v1/devices/{id}")),
        });
        s.reservations[at].provisionable = false;
        let device = Device {
            id: id.clone(),
            hostname: req.hostname,
            state: if stuck { "provisioning" } else { "active" }.into(),
            ip_addresses: if stuck {
                vec![]
            } else {
                vec![
                    IpAddress {
                        address: format!("10.64.{}.{}", n / 250, n % 250 + 2),
                        address_family: 4,
                        public: false,
                    },
                    IpAddress {
                        address: format!("147.75.{}.{}", n / 250, n % 250 + 2),
                        address_family: 4,
                        public: true,
                    },
                ]
            },
            hardware_reservation: Some(Ref {
                id: None,
                href: Some(format!(
                    "/metal/v1/hardware-reservations/{}",
                    req.hardware_reservation_id
                )),
            }),
            metro: facility.clone().map(|f| Place {
                code: f.code[..2.min(f.code.len())].to_string(),
            }),
            facility,
        };
        s.devices.push(device.clone());
        device
    };
    answer(
        &state,
        route,
        StatusCode::CREATED,
        serde_json::to_value(device).unwrap(),
    )
}

async fn get_device(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let route = "GET /devices";
    if let Some(r) = guard(&state, &headers, None, route).await {
        return r;
    }
    let found = state
        .lock()
        .unwrap()
        .devices
        .iter()
        .find(|d| d.id == id)
        .cloned();
    match found {
        Some(d) => answer(
            &state,
            route,
            StatusCode::OK,
            serde_json::to_value(d).unwrap(),
        ),
        None => error(StatusCode::NOT_FOUND, "Not found"),
    }
}

async fn device_action(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(action): Json<Action>,
) -> Response {
    let route = "POST /devices/actions";
    if let Some(r) = guard(&state, &headers, None, route).await {
        return r;
    }
    let mut s = state.lock().unwrap();
    if !s.devices.iter().any(|d| d.id == id) {
        return error(StatusCode::NOT_FOUND, "Not found");
    }
    if action.kind != "reboot" {
        return error(StatusCode::UNPROCESSABLE_ENTITY, "unsupported action");
    }
    s.reboots.push(id);
    StatusCode::ACCEPTED.into_response()
}

async fn list_reservations(
    State(state): State<Shared>,
    Path(project): Path<String>,
    Query(q): Query<PageQuery>,
    headers: HeaderMap,
) -> Response {
    let route = "GET /projects/hardware-reservations";
    let what = (project.as_str(), route, "hardware_reservations");
    listing(&state, &headers, what, &q, |s| &s.reservations).await
}

async fn list_keys(
    State(state): State<Shared>,
    Path(project): Path<String>,
    headers: HeaderMap,
) -> Response {
    let route = "GET /projects/ssh-keys";
    if let Some(r) = guard(&state, &headers, Some(&project), route).await {
        return r;
    }
    let body = serde_json::json!({ "ssh_keys": state.lock().unwrap().ssh_keys.clone() });
    answer(&state, route, StatusCode::OK, body)
}

async fn create_key(
    State(state): State<Shared>,
    Path(project): Path<String>,
    headers: HeaderMap,
    Json(k): Json<SshKeyInput>,
) -> Response {
    let route = "POST /projects/ssh-keys";
    if let Some(r) = guard(&state, &headers, Some(&project), route).await {
        return r;
    }
    let key = {
        let mut s = state.lock().unwrap();
        let id = s.id("key");
        let key = SshKey {
            id,
            label: k.label,
            key: k.key,
        };
        s.ssh_keys.push(key.clone());
        key
    };
    answer(
        &state,
        route,
        StatusCode::CREATED,
        serde_json::to_value(key).unwrap(),
    )
}

async fn update_key(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(k): Json<SshKeyInput>,
) -> Response {
    let route = "PUT /ssh-keys";
    if let Some(r) = guard(&state, &headers, None, route).await {
        return r;
    }
    let updated = {
        let mut s = state.lock().unwrap();
        s.ssh_keys.iter_mut().find(|x| x.id == id).map(|x| {
            x.label = k.label;
            x.key = k.key;
            x.clone()
        })
    };
    match updated {
        Some(k) => answer(
            &state,
            route,
            StatusCode::OK,
            serde_json::to_value(k).unwrap(),
        ),
        None => error(StatusCode::NOT_FOUND, "Not found"),
    }
}

impl FakeEquinix {
    /// Starts the fake for `project`, accepting `token`, with `reservations` provisionable
    /// reservations (plan `c3.small.x86`, facility `da11`).
    pub async fn start(token: &str, project: &str, reservations: usize) -> FakeEquinix {
        let mut state = FakeState {
            token: token.into(),
            project: project.into(),
            page_size: 1000,
            ..Default::default()
        };
        for _ in 0..reservations {
            let id = state.id("res");
            state.reservations.push(Reservation {
                id,
                provisionable: true,
                device: None,
                plan: Plan {
                    slug: "c3.small.x86".into(),
                },
                facility: Some(Place {
                    code: "da11".into(),
                }),
            });
        }
        let state = Arc::new(Mutex::new(state));
        let app = Router::new()
            .route(
                "/metal/v1/projects/{project}/devices",
                get(list_devices).post(create_device),
            )
            .route(
                "/metal/v1/projects/{project}/hardware-reservations",
                get(list_reservations),
            )
            .route(
                "/metal/v1/projects/{project}/ssh-keys",
                get(list_keys).post(create_key),
            )
            .route("/metal/v1/ssh-keys/{id}", put(update_key))
            .route("/metal/v1/devices/{id}", get(get_device))
            .route("/metal/v1/devices/{id}/actions", post(device_action))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeEquinix {
            addr,
            state,
            server,
        }
    }

    /// The API base URL (`http://127.0.0.1:PORT/metal/v1`).
    pub fn url(&self) -> String {
        format!("http://{}/metal/v1", self.addr)
    }

    /// Queues `failure` for the next request of `route`, e.g. `"POST /projects/devices"`,
    /// `"GET /projects/devices"`, `"GET /devices"`, `"POST /devices/actions"`,
    /// `"GET /projects/hardware-reservations"`, `"GET /projects/ssh-keys"`,
    /// `"POST /projects/ssh-keys"`, `"PUT /ssh-keys"`.
    pub fn fail_next(&self, route: &str, failure: Failure) {
        self.state
            .lock()
            .unwrap()
            .failures
            .push_back((route.into(), failure));
    }

    /// Injected failures not yet consumed.
    pub fn pending_failures(&self) -> usize {
        self.state.lock().unwrap().failures.len()
    }

    /// Most items per list page (forces paging).
    pub fn set_page_size(&self, n: usize) {
        self.state.lock().unwrap().page_size = n;
    }

    /// New devices stay in `provisioning` without addresses.
    pub fn set_stuck_provisioning(&self, stuck: bool) {
        self.state.lock().unwrap().stuck_provisioning = stuck;
    }

    /// Sets a device's state (e.g. `failed`).
    pub fn set_device_state(&self, id: &str, state: &str) {
        let mut s = self.state.lock().unwrap();
        if let Some(d) = s.devices.iter_mut().find(|d| d.id == id) {
            d.state = state.into();
        }
    }

    /// Deletes a device (as if someone deprovisioned it behind our back).
    pub fn remove_device(&self, id: &str) {
        self.state.lock().unwrap().devices.retain(|d| d.id != id);
    }

    /// Adds a device that is not ours (another hostname).
    pub fn add_foreign_device(&self, hostname: &str) -> String {
        let mut s = self.state.lock().unwrap();
        let id = s.id("dev");
        s.devices.push(Device {
            id: id.clone(),
            hostname: hostname.into(),
            state: "active".into(),
            ip_addresses: vec![],
            hardware_reservation: None,
            metro: None,
            facility: None,
        });
        id
    }

    /// Every device.
    pub fn devices(&self) -> Vec<Device> {
        self.state.lock().unwrap().devices.clone()
    }

    /// Every project SSH key.
    pub fn ssh_keys(&self) -> Vec<SshKey> {
        self.state.lock().unwrap().ssh_keys.clone()
    }

    /// Device ids rebooted, in order.
    pub fn reboots(&self) -> Vec<String> {
        self.state.lock().unwrap().reboots.clone()
    }

    /// Requests seen so far (`"METHOD route"`), in order.
    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }
}
