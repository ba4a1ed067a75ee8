//! The operator HTTP endpoint: `/metrics` in the Prometheus text format on `run` and `server`
//! (on by default, on localhost), plus whatever else the command mounts (the web UI).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{CONTENT_TYPE, WWW_AUTHENTICATE};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use std::time::Duration;

use shepherd_bmdb::Bmdb;
use tokio_util::sync::CancellationToken;

use crate::api::auth::Authenticator;
use crate::fleet_stats::FleetStats;
use crate::web::WebSettings;
use shepherd_loops::fleet::FleetSettings;
use shepherd_tasks::Tasks;

/// What a process shows operators: its metrics registry (the BMDB counters of design.md §16, the
/// fleet statistics gauges, its background tasks' status, and whatever the command adds) and
/// the web UI's settings. `run`, `server` and the demo each build one and serve it.
pub struct OperatorEndpoint {
    /// The metrics registry; commands register their own metrics into it before serving.
    pub registry: Registry,
    /// The fleet statistics, refreshed by a background task; the overview shows their
    /// hardware totals.
    pub stats: FleetStats,
    /// The process's background tasks, shown at `/tasks`.
    pub tasks: Tasks,
    /// The web UI's settings.
    pub web: WebSettings,
}

impl OperatorEndpoint {
    /// Registers the BMDB counters, the fleet statistics and the tasks' metrics, and starts
    /// the fleet statistics' refresh every `stats_interval` until `cancel`, reported as the
    /// task `fleet-statistics`.
    pub fn start(
        db: &Bmdb,
        web: WebSettings,
        stats_interval: Duration,
        tasks: Tasks,
        cancel: CancellationToken,
    ) -> OperatorEndpoint {
        let mut registry = Registry::default();
        db.metrics().register(&mut registry);
        let stats = FleetStats::default();
        stats.register(&mut registry);
        tasks.register(&mut registry);
        tokio::spawn(stats.clone().run(
            db.clone(),
            web.thresholds,
            stats_interval,
            tasks.task("fleet-statistics"),
            cancel,
        ));
        OperatorEndpoint {
            registry,
            stats,
            tasks,
            web,
        }
    }

    /// The endpoint of a process that runs the loops of `fleet` (`run`, the demo): its web UI
    /// also shows the recovery brake, and the registry also holds the brake's gauges and the
    /// recoverer's counters.
    pub fn for_fleet(
        db: &Bmdb,
        fleet: &FleetSettings,
        refresh: Duration,
        stats_interval: Duration,
        cancel: CancellationToken,
    ) -> OperatorEndpoint {
        let web = WebSettings {
            refresh,
            thresholds: fleet.recovery,
            brake: Some(fleet.recovery_brake_metrics.clone()),
        };
        let tasks = fleet.tasks.clone();
        let mut endpoint = OperatorEndpoint::start(db, web, stats_interval, tasks, cancel);
        fleet
            .recovery_brake_metrics
            .register(&mut endpoint.registry);
        fleet.recoverer_metrics.register(&mut endpoint.registry);
        fleet.provisioner_metrics.register(&mut endpoint.registry);
        endpoint
    }

    /// `/metrics` and the web UI over `db`.
    pub fn router(self, db: Bmdb) -> Router {
        let web = crate::web::router(db, self.web, self.stats, self.tasks, None);
        router(self.registry, None).merge(web)
    }
}

/// `/metrics` over `registry`; with `auth`, only for requests with a credential it accepts
/// (a local API token or the identity provider's token, any role), which is how Prometheus's
/// `authorization: {credentials_file: …}` sends one.
pub fn router(registry: Registry, auth: Option<Arc<Authenticator>>) -> Router {
    let registry = Arc::new(registry);
    let metrics = Router::new().route(
        "/metrics",
        get(move || {
            let registry = registry.clone();
            async move {
                let mut body = String::new();
                match prometheus_client::encoding::text::encode(&mut body, &registry) {
                    Ok(()) => (
                        [(
                            CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        body,
                    ),
                    Err(e) => (
                        [(CONTENT_TYPE, "text/plain")],
                        format!("encoding metrics: {e}"),
                    ),
                }
            }
        }),
    );
    match auth {
        None => metrics,
        Some(auth) => metrics.route_layer(axum::middleware::from_fn_with_state(
            auth,
            require_credential,
        )),
    }
}

/// Lets through only requests whose credential `auth` accepts.
async fn require_credential(
    State(auth): State<Arc<Authenticator>>,
    req: Request,
    next: Next,
) -> Response {
    match auth.authenticate(req.headers()).await {
        Ok(who) => match auth.admit(&who) {
            Ok(()) => next.run(req).await,
            Err(_) => crate::rate_limit::slow_down(),
        },
        Err(problem) => {
            // The stranger learns nothing of which check failed; the log does.
            tracing::debug!(detail = %shepherd_bmdb::one_line(&problem.detail), "/metrics refused");
            let answer = (
                StatusCode::UNAUTHORIZED,
                [(WWW_AUTHENTICATE, "Bearer")],
                "invalid credentials\n",
            );
            answer.into_response()
        }
    }
}

/// A listener that could not be opened: the flag that named it, its address and why.
#[derive(Debug, thiserror::Error)]
#[error("{setting}: {addr}: {error}")]
pub struct ListenError {
    setting: String,
    addr: SocketAddr,
    error: std::io::Error,
}

/// Serves `app` over plain HTTP on `addr` until `cancel`, each peer limited to `rate`;
/// returns the bound address (port 0 picks one) once listening. `setting` names the flag in
/// errors.
pub async fn serve(
    addr: SocketAddr,
    setting: &str,
    app: Router,
    rate: crate::rate_limit::RateSpec,
    cancel: CancellationToken,
) -> Result<SocketAddr, ListenError> {
    let failed = |error| ListenError {
        setting: setting.to_string(),
        addr,
        error,
    };
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(failed)?;
    let bound = listener.local_addr().map_err(failed)?;
    let app = crate::rate_limit::per_peer(app, rate);
    let app = crate::security_headers::secured(app, false);
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "HTTP server failed");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shepherd_bmdb::{Processor, Session, SessionConfig};
    use shepherd_loops::limiter::RateSpec;
    use shepherd_loops::periodic::{self, Pass};

    /// A periodic pass with a defect: it panics every time.
    struct PanickingPass;

    #[async_trait::async_trait]
    impl Pass for PanickingPass {
        const PROCESSOR: Processor = Processor::ShepherdProvisioner;
        type Report = String;
        type Error = shepherd_bmdb::Error;
        fn rate(&self) -> RateSpec {
            RateSpec::new(Duration::from_millis(50), 1)
        }
        async fn pass(&self, _: &Session) -> Result<String, shepherd_bmdb::Error> {
            panic!("injected: a bug in the pass")
        }
    }

    async fn get_text(url: &str) -> String {
        let answer = reqwest::get(url).await.unwrap();
        assert!(answer.status().is_success(), "{url}: {}", answer.status());
        answer.text().await.unwrap()
    }

    #[tokio::test]
    async fn a_panicking_task_is_shown_failed_on_tasks_in_tasks_json_and_in_the_metrics() {
        let t = shepherd_bmdb::testing::sqlite().await;
        let cancel = CancellationToken::new();
        let tasks = Tasks::new(Duration::from_secs(3600));
        let web = WebSettings {
            refresh: Duration::ZERO,
            thresholds: Default::default(),
            brake: None,
        };
        let endpoint = OperatorEndpoint::start(
            &t.db,
            web,
            Duration::from_secs(60),
            tasks.clone(),
            cancel.clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let app = endpoint.router(t.db.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });

        let session = SessionConfig::new("test", Processor::ShepherdProvisioner);
        let handle = tasks.task("provisioner");
        let (db, stop) = (t.db.clone(), cancel.clone());
        let looping =
            tokio::spawn(
                async move { periodic::run(&PanickingPass, db, session, handle, stop).await },
            );
        shepherd_bmdb::testing::eventually(
            "two panicked passes",
            Duration::from_secs(10),
            async || {
                let s = tasks
                    .statuses()
                    .into_iter()
                    .find(|s| s.name == "provisioner")
                    .unwrap();
                let n = s.count(shepherd_tasks::Outcome::Panicked);
                shepherd_bmdb::testing::when(n >= 2, n)
            },
        )
        .await;
        assert!(
            !looping.is_finished(),
            "the loop goes on after a panicked pass"
        );

        let json: serde_json::Value =
            serde_json::from_str(&get_text(&format!("{base}/tasks.json")).await).unwrap();
        let task = json["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "provisioner")
            .unwrap();
        assert_eq!(task["state"], "failed", "{task}");
        assert_eq!(task["last_panic"]["message"], "injected: a bug in the pass");

        let page = get_text(&format!("{base}/tasks")).await;
        assert!(
            page.contains(r#"data-task="provisioner" data-outcome="panicked" data-state="failed""#),
            "{page}"
        );
        assert!(page.contains("injected: a bug in the pass"), "{page}");

        let metrics = get_text(&format!("{base}/metrics")).await;
        let panicked = metrics
            .lines()
            .find(|l| {
                l.starts_with(
                    r#"shepherd_task_passes_total{task="provisioner",outcome="panicked"}"#,
                )
            })
            .unwrap_or_else(|| panic!("no panicked series in\n{metrics}"));
        let n: f64 = panicked.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(n >= 2.0, "{panicked}");

        cancel.cancel();
        looping.await.unwrap();
        t.cleanup().await;
    }
}
