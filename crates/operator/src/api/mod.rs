//! The operator API, `/api/v1`: JSON over HTTPS for people, the web UI and automation, served
//! by `shepherd server --api-listen`. Every request proves an identity (`auth.rs`), which the
//! one policy table (`policy.rs`) allows or refuses; every action is recorded in the
//! operators' history with that identity and the request's id. Errors are problem details
//! (`problem.rs`). The listener's bounds are in `shepherd_server::https`.

pub mod auth;
mod extract;
pub mod handlers;
pub mod oidc;
mod openapi;
pub mod policy;
pub mod problem;
pub mod signin;
mod state;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Actor, AuditEvent, AuditKind, Bmdb};
use shepherd_tasks::Tasks;

use auth::Authenticator;
use policy::Principal;
use problem::{Kind, Problem};

use crate::audit::AuditTrail;
use crate::rate_limit::{peer_key, RateLimiter};
use shepherd_bmdb::one_line;
pub use state::{Api, RequestId};

/// How long the fleet counts are reused (counting is O(fleet)).
const COUNTS_TTL: Duration = Duration::from_secs(2);

/// How the API is set up.
#[derive(Debug, Clone, Copy)]
pub struct ApiSettings {
    /// A request must be answered within this.
    pub request_timeout: Duration,
    /// Requests per second allowed to one identity, and to one peer address, with a burst.
    pub rate: RateSpec,
}

impl Default for ApiSettings {
    fn default() -> Self {
        ApiSettings {
            request_timeout: Duration::from_secs(30),
            rate: crate::rate_limit::DEFAULT_RATE,
        }
    }
}

pub use crate::rate_limit::RateSpec;

/// What the guard in front of every route holds: the API (whose authenticator it asks), the
/// settings, the counters, the rate limiters and the log of refusals.
struct Gate {
    api: Arc<Api>,
    settings: ApiSettings,
    metrics: ApiMetrics,
    per_peer: RateLimiter,
    denials: DenialLog,
}

/// The API's routes over `db`; `stale_after` is the recoverer's threshold, `tasks` this
/// process's background tasks, `auth` what verifies credentials (local tokens, and the
/// identity provider's if one is configured). The counters are registered in `registry`.
pub fn router(
    db: Bmdb,
    stale_after: chrono::Duration,
    tasks: Tasks,
    settings: ApiSettings,
    auth: Arc<Authenticator>,
    audit: AuditTrail,
    registry: &mut Registry,
) -> Router {
    let metrics = ApiMetrics::default();
    metrics.register(registry);
    let api = Arc::new(Api {
        auth,
        counts: crate::inventory::CountsCache::new(db.clone(), stale_after, COUNTS_TTL),
        db,
        stale_after,
        tasks,
    });
    let gate = Arc::new(Gate {
        api: api.clone(),
        settings,
        metrics,
        per_peer: RateLimiter::new(settings.rate),
        denials: DenialLog::new(audit),
    });
    use handlers as h;
    // Operators' actions on one machine, under `/api/v1/machines/{id}`.
    let actions = Router::new()
        .route("/maintenance", post(h::action::<h::MaintenanceBody>))
        .route("/retry", post(h::action::<h::RetryBody>))
        .route(
            "/forget-host-key",
            post(h::action::<h::Because<h::ForgetHostKey>>),
        )
        .route("/install", post(h::action::<h::InstallBody>))
        .route("/decommission", post(h::action::<h::DecommissionBody>))
        .route("/reimage", post(h::action::<h::ReimageBody>))
        .route(
            "/recommission",
            post(h::action::<h::Because<h::Recommission>>),
        );
    Router::new()
        .route("/api/v1/machines", get(h::list_machines))
        .route("/api/v1/machines/{id}", get(h::show_machine))
        .route("/api/v1/machines/{id}/history", get(h::machine_history))
        .route("/api/v1/sessions", get(h::sessions))
        .route("/api/v1/overview", get(h::overview))
        .route("/api/v1/tasks", get(h::tasks))
        .route("/api/v1/whoami", get(h::whoami))
        .route("/api/v1/openapi.json", get(openapi::served))
        .nest("/api/v1/machines/{id}", actions)
        .route("/api/v1/tokens", get(h::list_tokens).post(h::create_token))
        .route("/api/v1/tokens/{name}", delete(h::revoke_token))
        .route("/api/v1/tokens/revoke-sessions", post(h::revoke_sessions))
        .route("/api/v1/audit", get(h::audit))
        .route_layer(axum::middleware::from_fn_with_state(gate, guard))
        .fallback(|| async { Problem::new(Kind::NotFound, "no such route") })
        .with_state(api)
}

/// What every request goes through before its handler: a request id, the peer's rate, the
/// identity and its rate, the policy, and a time limit; then it is counted.
async fn guard(State(gate): State<Arc<Gate>>, mut req: Request, next: Next) -> Response {
    let request_id = RequestId(uuid::Uuid::new_v4().to_string());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let method = req.method().clone();
    // Owned, so that no borrow of the request (whose body is not `Sync`) is held across an
    // await.
    let headers = req.headers().clone();
    let mut authenticated: Option<String> = None;
    let checked = async {
        let over = |_| Problem::new(Kind::RateLimited, "too many requests; slow down");
        if let Some(peer) = &peer {
            gate.per_peer.admit(&peer_key(*peer)).map_err(over)?;
        }
        let who = gate.api.auth.authenticate(&headers).await?;
        authenticated = Some(who.name.clone());
        gate.api.auth.admit(&who)?;
        let Some(needed) = policy::required(&method, &route) else {
            return Err(Problem::new(Kind::Forbidden, "no rule allows this route"));
        };
        if who.role < needed {
            let detail = format!("{} is {}; this needs {}", who.name, who.role, needed);
            return Err(Problem::new(Kind::Forbidden, detail));
        }
        Ok(who)
    };
    let checked = checked.await;
    let mut response = match checked {
        Err(problem) => {
            let peer = peer.map(|p| p.to_string());
            let who = authenticated.as_deref();
            gate.denials
                .note(&problem, &route, peer.as_deref(), &request_id.0, who);
            match who {
                Some(_) => problem.into_response(),
                None => for_a_stranger(problem).into_response(),
            }
        }
        Ok(who) => {
            let peer = peer.map(|p| p.to_string());
            let actor = Actor::named(&who.name).in_request(peer, &route, &request_id.0);
            req.extensions_mut().insert(actor);
            req.extensions_mut().insert::<Principal>(who);
            req.extensions_mut().insert(request_id.clone());
            match tokio::time::timeout(gate.settings.request_timeout, next.run(req)).await {
                Ok(response) => response,
                Err(_) => Problem::new(Kind::Timeout, "the request took too long").into_response(),
            }
        }
    };
    let result = match response.extensions().get::<Kind>() {
        Some(kind) => kind.name(),
        None => "ok",
    };
    gate.metrics.count(&route, result);
    if let Ok(id) = HeaderValue::from_str(&request_id.0) {
        response.headers_mut().insert("x-request-id", id);
    }
    response
}

/// What a caller whose credentials were not proven is told of `problem`: that the
/// credentials are invalid, or that the API cannot check them now; nothing of what lies
/// behind (a database, an identity provider, which check failed). The log has the detail,
/// with the request id the answer carries.
fn for_a_stranger(problem: Problem) -> Problem {
    match problem.kind {
        Kind::Unauthenticated => Problem::new(Kind::Unauthenticated, "invalid credentials"),
        Kind::Unavailable | Kind::Timeout => Problem::new(
            Kind::Unavailable,
            "credentials cannot be checked now; try again later",
        ),
        _ => problem,
    }
}

/// Labels of `shepherd_api_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// The route's template (`/api/v1/machines/{id}`): bounded, never a raw path.
    route: String,
    /// `ok`, or the problem's type name (`unauthenticated`, `forbidden` …).
    result: &'static str,
}

/// The API's counters.
#[derive(Debug, Clone, Default)]
struct ApiMetrics {
    requests: Family<RequestLabels, Counter>,
}

impl ApiMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "shepherd_api_requests",
            "Operator API requests by route and result (ok, or the problem type)",
            self.requests.clone(),
        );
    }

    fn count(&self, route: &str, result: &'static str) {
        let labels = RequestLabels {
            route: route.to_string(),
            result,
        };
        self.requests.get_or_create(&labels).inc();
    }
}

/// Refused requests: each logged at debug and handed to the audit trail; logged at warn at
/// most once per interval with how many there were meanwhile, so a client hammering with a
/// bad token cannot flood the log. Requests refused for their rate are counted at once but
/// written to the trail at most once per interval, with how many there were: the limit is
/// what bounds a flood, and the trail must not be the flood's sink. The credential is never
/// logged.
pub(crate) struct DenialLog {
    warned: Mutex<Window>,
    rate_limited: Mutex<Window>,
    audit: AuditTrail,
}

/// When something was last let through, and how many were held back since.
#[derive(Default)]
struct Window(Option<Instant>, u64);

impl Window {
    /// Counts one; `Some(n)` (the number held back before it) if this one goes through.
    fn pass(&mut self, every: Duration) -> Option<u64> {
        self.1 += 1;
        if self.0.is_some_and(|at| at.elapsed() < every) {
            return None;
        }
        self.0 = Some(Instant::now());
        Some(std::mem::take(&mut self.1) - 1)
    }
}

impl DenialLog {
    const EVERY: Duration = Duration::from_secs(10);

    pub(crate) fn new(audit: AuditTrail) -> DenialLog {
        DenialLog {
            warned: Mutex::default(),
            rate_limited: Mutex::default(),
            audit,
        }
    }

    /// Notes a refusal of `request` on `route` from `peer`, by `principal` if it was proven.
    pub(crate) fn note(
        &self,
        problem: &Problem,
        route: &str,
        peer: Option<&str>,
        request: &str,
        principal: Option<&str>,
    ) {
        let (kind, detail) = (problem.kind.name(), one_line(&problem.detail));
        let shown_peer = peer.unwrap_or("unknown");
        tracing::debug!(kind, %detail, route, peer = shown_peer, request, "API request refused");
        let reason = match problem.kind {
            Kind::RateLimited => {
                let passed = self.rate_limited.lock().unwrap().pass(Self::EVERY);
                passed.map(|before| {
                    format!(
                        "{kind}: {detail} ({before} more refused for their rate before this one)"
                    )
                })
            }
            _ => Some(format!("{kind}: {detail}")),
        };
        let event = reason.map(|reason| {
            let event = AuditEvent::now(AuditKind::Refused, reason);
            let event = match principal {
                Some(who) => event.by(who),
                None => event,
            };
            event.from_request(peer, Some(route), Some(request))
        });
        match event {
            Some(event) => self.audit.refused(kind, event),
            None => self.audit.counted(kind),
        }
        let Some(refused_since_last) = self.warned.lock().unwrap().pass(Self::EVERY) else {
            return;
        };
        tracing::warn!(kind, %detail, route, peer = shown_peer, request, refused_since_last, "API request refused");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller whose credentials were not proven learns nothing of what lies behind: not
    /// the database, not which check failed.
    #[test]
    fn a_stranger_is_told_invalid_or_unavailable_only() {
        let down = Problem::new(
            Kind::Unavailable,
            "database postgres://bmdb.internal:5432/bmdb is unavailable: connection refused",
        );
        let told = for_a_stranger(down);
        assert_eq!(told.kind, Kind::Unavailable);
        assert!(!told.detail.contains("bmdb.internal"), "{}", told.detail);
        let expired = Problem::new(Kind::Unauthenticated, "token \"ci\" expired at 2026-01-01");
        assert_eq!(for_a_stranger(expired).detail, "invalid credentials");
        let limited = Problem::new(Kind::RateLimited, "too many requests");
        assert_eq!(for_a_stranger(limited.clone()), limited);
    }

    /// Refusals for their rate reach the audit trail once per window, with how many were
    /// held back before: a flood is one event per window, not one per request.
    #[test]
    fn a_window_lets_one_through_and_counts_the_rest() {
        let mut w = Window::default();
        let every = Duration::from_secs(60);
        assert_eq!(w.pass(every), Some(0));
        assert_eq!(w.pass(every), None);
        assert_eq!(w.pass(every), None);
        w.0 = Some(Instant::now() - every);
        assert_eq!(w.pass(every), Some(2));
    }

    /// A refusal's detail (anyone's text) is logged on the refusal's own line, its newline
    /// escaped: a forged second line failed before.
    #[test]
    fn a_refusal_logs_one_line_whatever_its_detail_holds() {
        let captured = tempfile::NamedTempFile::new().unwrap();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(Mutex::new(captured.reopen().unwrap()))
            .with_ansi(false)
            .finish();
        let detail = "y\n2030-01-01T00:00:00Z  WARN forged";
        tracing::subscriber::with_default(subscriber, || {
            let problem = Problem::new(Kind::Unauthenticated, detail);
            DenialLog::new(AuditTrail::none()).note(&problem, "web sign-in", None, "r-1", None);
        });
        let log = std::fs::read_to_string(captured.path()).unwrap();
        assert_eq!(log.lines().count(), 1, "{log}");
        assert!(log.contains("y\\n2030-01-01"), "{log}");
    }
}
