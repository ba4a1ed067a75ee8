//! The operator HTTP endpoint: `/metrics` in the Prometheus text format on `run` and `server`
//! (on by default, on localhost), plus whatever else the command mounts (the web UI).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use std::time::Duration;

use shepherd_bmdb::{Bmdb, RecoveryThresholds};
use tokio_util::sync::CancellationToken;

use crate::fleet_stats::FleetStats;

/// A registry holding the BMDB counters of `db` (SPEC §16) and the fleet statistics gauges,
/// whose refresh loop is started on the runtime until `cancel`; and those statistics, whose
/// hardware totals the web UI's overview shows.
pub fn registry_with_fleet_stats(
    db: &Bmdb,
    thresholds: RecoveryThresholds,
    stats_interval: Duration,
    cancel: CancellationToken,
) -> (Registry, FleetStats) {
    let mut registry = Registry::default();
    db.metrics().register(&mut registry);
    let stats = FleetStats::default();
    stats.register(&mut registry);
    tokio::spawn(
        stats
            .clone()
            .run(db.clone(), thresholds, stats_interval, cancel),
    );
    (registry, stats)
}

/// `/metrics` over `registry`.
pub fn router(registry: Registry) -> Router {
    let registry = Arc::new(registry);
    Router::new().route(
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
    )
}

/// Serves `app` over plain HTTP on `addr` until `cancel`; returns the bound address (port 0
/// picks one) once listening. `setting` names the flag in errors.
pub async fn serve(
    addr: SocketAddr,
    setting: &str,
    app: Router,
    cancel: CancellationToken,
) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("{setting}: {addr}"))?;
    let bound = listener.local_addr()?;
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
