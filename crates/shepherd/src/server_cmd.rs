//! `shepherd server`: the agent-facing BMaaS server.

mod server_flags;

pub use server_flags::ServerArgs;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use shepherd_bmdb::{Bmdb, OpenOptions, Processor, SessionConfig};
use shepherd_operator::{api, audit, metrics_http, rate_limit, security_headers, web};
use shepherd_server::{
    load_https_config, load_server_config, serve_with_metrics, BmaasService, ConnectionMetrics,
    HeartbeatWrites, Reporter, ServerLimits, SessionPool,
};
use shepherd_tasks::TaskKind;

use crate::plumbing::shutdown_on_signals;

/// The server's heartbeat counts (registered in `registry`) and their reporter to the BMDB.
fn start_heartbeat_writes(
    db: &Bmdb,
    limits: &ServerLimits,
    operator: &mut metrics_http::OperatorEndpoint,
) -> (Arc<HeartbeatWrites>, Reporter) {
    let writes = Arc::new(HeartbeatWrites::new(limits.max_heartbeats_in_flight));
    writes.register(&mut operator.registry);
    let task = operator
        .tasks
        .task(shepherd_server::heartbeat_writes::REPORT_TASK);
    let reporter = Reporter::start(db, &writes, "bmsrv", task);
    (writes, reporter)
}

/// Serves the operator API's `app` on `addr` over HTTPS (`tls`) until `cancel`.
async fn serve_api(
    addr: SocketAddr,
    tls: Arc<rustls::ServerConfig>,
    app: axum::Router,
    cancel: tokio_util::sync::CancellationToken,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("api-listen: {addr}"))?;
    crate::plumbing::announce(&format!(
        "shepherd server: operator API at https://{}/api/v1",
        listener.local_addr()?
    ));
    let limits = shepherd_server::https::HttpsLimits::default();
    let app = security_headers::secured(app, true);
    tokio::spawn(shepherd_server::https::serve(
        "API", listener, tls, app, limits, cancel,
    ));
    Ok(())
}

/// The operator API's routes, and with sign-in the web UI behind it (served over HTTPS).
fn api_app(
    args: &ServerArgs,
    db: &Bmdb,
    operator: &mut metrics_http::OperatorEndpoint,
    auth: &Arc<api::auth::Authenticator>,
    audit: &audit::AuditTrail,
    sign_in: Option<&Arc<api::signin::SignIn>>,
) -> axum::Router {
    let settings = api::ApiSettings {
        rate: args.peer_rate(),
        ..api::ApiSettings::default()
    };
    let web_rate = settings.rate;
    let stale_after = args.thresholds.thresholds().stale_after();
    let tasks = operator.tasks.clone();
    let registry = &mut operator.registry;
    let mut app = api::router(
        db.clone(),
        stale_after,
        tasks,
        settings,
        auth.clone(),
        audit.clone(),
        registry,
    );
    if let Some(sign_in) = sign_in {
        // People sign in: the web UI is served here, over HTTPS, behind sign-in.
        let (web, stats) = (operator.web.clone(), operator.stats.clone());
        let pages = web::router(
            db.clone(),
            web,
            stats,
            operator.tasks.clone(),
            Some(sign_in.clone()),
        );
        // The API's guard limits each peer on its own routes; the sign-in and the pages are
        // limited alike here, before a session lookup or a token request is made for them.
        let web = api::signin::routes(sign_in.clone()).merge(pages);
        app = app.merge(rate_limit::per_peer(web, web_rate));
    }
    app
}

/// The web UI's sign-in over the identity provider, the authenticator, the BMDB and the
/// audit trail; its counters go to `registry`.
fn sign_in_with(
    settings: api::signin::SignInSettings,
    (oidc, auth, db, audit): (
        Arc<api::oidc::OidcVerifier>,
        Arc<api::auth::Authenticator>,
        Bmdb,
        audit::AuditTrail,
    ),
    registry: &mut prometheus_client::registry::Registry,
) -> Result<Arc<api::signin::SignIn>> {
    let sign_in = api::signin::SignIn::new(settings, oidc, auth, db, audit, registry);
    Ok(Arc::new(sign_in?))
}

/// Starts the task that writes the uses of `auth`'s tokens, until `cancel` (then once more).
fn start_token_uses(
    auth: &Arc<api::auth::Authenticator>,
    tasks: &shepherd_tasks::Tasks,
    cancel: &tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let (auth, cancel) = (auth.clone(), cancel.clone());
    let task = tasks.task(api::auth::USES_TASK);
    tokio::spawn(async move { auth.record_uses(task, cancel).await })
}

/// Runs the server until SIGINT/SIGTERM.
pub async fn run(database: &str, args: ServerArgs) -> Result<()> {
    let limits = args.checked_limits()?;
    let oidc = args.oidc()?.map(Arc::new);
    if oidc.is_some() && args.api_listen.is_none() {
        bail!("oidc-issuer: the identity provider is for the operator API; give api-listen too");
    }
    let sign_in = args.sign_in_settings()?;
    crate::fds::raise_limit_for(limits.max_connections + limits.max_pending_handshakes);
    let (cert, key) = args.tls_files()?;
    let tls = load_server_config(&cert, &key)?;
    let db = Bmdb::open_with(database, &OpenOptions::migrating(args.process.migrate)).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen: {}", args.listen))?;
    crate::plumbing::announce(&format!(
        "shepherd server: listening on {}",
        listener.local_addr()?
    ));
    let pool = Arc::new(SessionPool::new(
        db.clone(),
        SessionConfig::new("bmsrv", Processor::Bmsrv),
        args.sessions,
    ));
    let cancel = shutdown_on_signals();
    let web = web::WebSettings {
        refresh: args.web_refresh,
        thresholds: args.thresholds.thresholds(),
        brake: None,
    };
    let mut operator = metrics_http::OperatorEndpoint::start(
        &db,
        web,
        args.process.stats_interval,
        args.process.tasks(),
        cancel.clone(),
    );
    let every = args.process.schema_check_interval;
    let schema = crate::schema_watch::start(&db, every, &cancel, &operator.tasks);
    let heartbeat_batches = operator
        .tasks
        .task_of("heartbeat-batches", TaskKind::Batches);
    db.report_heartbeat_batches_to(Arc::new(heartbeat_batches));
    let connections = ConnectionMetrics::default();
    connections.register(&mut operator.registry);
    let (writes, reporter) = start_heartbeat_writes(&db, &limits, &mut operator);
    let auth = api::auth::Authenticator::new(db.clone(), oidc.clone());
    let auth = Arc::new(auth.with_identity_rate(args.peer_rate()));
    let token_uses = start_token_uses(&auth, &operator.tasks, &cancel);
    if let Some(oidc) = &oidc {
        if let Err(why) = oidc.prefetch().await {
            tracing::warn!(%why, "the identity provider's keys cannot be fetched yet; its tokens are refused until they can");
        }
    }
    let audit_task = operator.tasks.task_of(audit::TASK, TaskKind::Batches);
    let registry = &mut operator.registry;
    let audit = audit::AuditTrail::start(db.clone(), registry, audit_task, cancel.clone());
    let sign_in = match (&oidc, sign_in) {
        (Some(oidc), Some(settings)) => {
            let parts = (oidc.clone(), auth.clone(), db.clone(), audit.clone());
            Some(sign_in_with(settings, parts, &mut operator.registry)?)
        }
        _ => None,
    };
    if let Some(addr) = args.api_listen {
        let app = api_app(&args, &db, &mut operator, &auth, &audit, sign_in.as_ref());
        let tls = Arc::new(load_https_config(&cert, &key)?);
        serve_api(addr, tls, app, cancel.clone()).await?;
    }
    let metrics_auth = args.metrics_require_token.then(|| auth.clone());
    let open_web = sign_in.is_none();
    let mut http_app = metrics_http::router(operator.registry, metrics_auth);
    if open_web {
        let web = web::router(
            db.clone(),
            operator.web,
            operator.stats,
            operator.tasks,
            None,
        );
        http_app = http_app.merge(web);
    }
    let http = metrics_http::serve(
        args.http_listen,
        "http-listen",
        http_app,
        args.peer_rate(),
        cancel.clone(),
    )
    .await?;
    crate::plumbing::announce(&match open_web {
        true => format!(
            "shepherd server: web UI at http://{http}/machines, metrics at http://{http}/metrics"
        ),
        false => format!("shepherd server: metrics at http://{http}/metrics"),
    });
    let result = serve_with_metrics(
        listener,
        Arc::new(tls),
        BmaasService::new(pool.clone(), writes),
        limits,
        connections,
        cancel.clone(),
    )
    .await;
    // The background tasks stop however serving ended; the uses of tokens noted last are
    // written before the database closes.
    cancel.cancel();
    let _ = token_uses.await;
    // Every heartbeat was answered: the last report, then the writer's row goes.
    let _ = reporter.stop().await;
    pool.close().await;
    db.close().await;
    if let Ok(Err(e)) = schema.await {
        return Err(e.into());
    }
    Ok(result?)
}
