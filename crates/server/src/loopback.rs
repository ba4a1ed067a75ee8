//! A BMaaS server on loopback with development certificates: what the demo, the benchmarks and
//! the tests run, so that each starts, stops and restarts a server the same way. `shepherd
//! server` builds its own from the operator's certificates and flags.

use std::path::Path;
use std::sync::Arc;

use shepherd_bmdb::{Bmdb, Processor, SessionConfig};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::serve::InvalidLimit;
use crate::service::{SlowHeartbeats, SlowHeartbeatsCell};
use crate::tls::TlsError;
use crate::{
    dev_certs, load_server_config, serve_with_metrics, BmaasService, ConnectionMetrics,
    HeartbeatWrites, Reporter, ServerLimits, SessionPool,
};

/// Why a loopback server could not start, serve or stop.
#[derive(Debug, thiserror::Error)]
pub enum LoopbackError {
    /// The development certificates could not be made or loaded.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The loopback port could not be had.
    #[error("127.0.0.1:{port}: {error}")]
    Bind {
        /// The port (0: any).
        port: u16,
        /// Why.
        error: std::io::Error,
    },
    /// The limits make no sense.
    #[error(transparent)]
    Limits(#[from] InvalidLimit),
    /// The serving task panicked.
    #[error("the server task ended abnormally")]
    Panicked(#[from] tokio::task::JoinError),
}

type Result<T> = std::result::Result<T, LoopbackError>;

/// A running (or stopped, between [`LoopbackServer::stop`] and [`LoopbackServer::restart`])
/// BMaaS server on `127.0.0.1`, trusted by agents through its development CA.
pub struct LoopbackServer {
    port: u16,
    ca_pem: String,
    ca_der: Vec<u8>,
    tls: Arc<rustls::ServerConfig>,
    pool: Arc<SessionPool>,
    limits: ServerLimits,
    /// Its connections, counted across restarts.
    metrics: ConnectionMetrics,
    /// Its heartbeats in flight, refused and late, reported to the BMDB until it closes.
    writes: Arc<HeartbeatWrites>,
    reporter: Reporter,
    /// The heartbeat fault injected, if any.
    slow: SlowHeartbeatsCell,
    running: Option<(
        CancellationToken,
        JoinHandle<std::result::Result<(), InvalidLimit>>,
    )>,
}

impl LoopbackServer {
    /// Creates (or reuses) development certificates for `localhost` in `certs_dir` and serves
    /// on a free loopback port with `sessions` BMDB sessions shared by all requests.
    pub async fn start(
        db: &Bmdb,
        certs_dir: &Path,
        sessions: usize,
        limits: ServerLimits,
    ) -> Result<LoopbackServer> {
        let certs = dev_certs(certs_dir, &["localhost".into()])?;
        let tls = Arc::new(load_server_config(&certs.cert_pem, &certs.key_pem)?);
        let unreadable = |error| TlsError::File {
            setting: "dev-certs",
            path: certs.ca_pem.clone(),
            error,
        };
        let ca_pem = std::fs::read_to_string(&certs.ca_pem).map_err(unreadable)?;
        let ca_der = rustls_pemfile::certs(&mut ca_pem.as_bytes())
            .next()
            .ok_or_else(|| TlsError::Empty {
                setting: "dev-certs",
                path: certs.ca_pem.clone(),
                what: "certificate",
            })?
            .map_err(unreadable)?
            .to_vec();
        let pool = Arc::new(SessionPool::new(
            db.clone(),
            SessionConfig::new("bmsrv", Processor::Bmsrv),
            sessions,
        ));
        let bind = |error| LoopbackError::Bind { port: 0, error };
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(bind)?;
        let writes = Arc::new(HeartbeatWrites::new(limits.max_heartbeats_in_flight));
        // The demo's and tests' server: its reporter's task is shown nowhere.
        let task = shepherd_tasks::Tasks::default().task(crate::heartbeat_writes::REPORT_TASK);
        let reporter = Reporter::start(db, &writes, "bmsrv", task);
        let mut server = LoopbackServer {
            port: listener.local_addr().map_err(bind)?.port(),
            ca_pem,
            ca_der,
            tls,
            pool,
            limits,
            metrics: ConnectionMetrics::default(),
            writes,
            reporter,
            slow: SlowHeartbeatsCell::default(),
            running: None,
        };
        server.serve(listener);
        Ok(server)
    }

    fn serve(&mut self, listener: TcpListener) {
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve_with_metrics(
            listener,
            self.tls.clone(),
            BmaasService::new(self.pool.clone(), self.writes.clone())
                .with_slow_heartbeats(self.slow.clone()),
            self.limits,
            self.metrics.clone(),
            cancel.clone(),
        ));
        self.running = Some((cancel, task));
    }

    /// Its connections so far: rejections, closes, connections now (a test waits on these
    /// instead of sleeping).
    pub fn connection_metrics(&self) -> &ConnectionMetrics {
        &self.metrics
    }

    /// Holds heartbeats before their write as `slow` says, from now on: the fault of a slow
    /// BMDB, for the demo and tests.
    pub fn slow_heartbeats(&self, slow: SlowHeartbeats) {
        *self.slow.lock().expect("slow heartbeats poisoned") = Some(slow);
    }

    /// Its heartbeats in flight, refused and late.
    pub fn heartbeat_writes(&self) -> &Arc<HeartbeatWrites> {
        &self.writes
    }

    /// The address agents are given: `localhost:PORT`, the name the certificate is valid for.
    pub fn endpoint(&self) -> String {
        format!("localhost:{}", self.port)
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The development CA certificate (PEM) agents must trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The development CA certificate (DER), as a `TakeoverInit` carries it.
    pub fn ca_der(&self) -> &[u8] {
        &self.ca_der
    }

    /// The BMDB sessions the server's requests share.
    pub fn pool(&self) -> &Arc<SessionPool> {
        &self.pool
    }

    /// Stops serving: open connections are asked to close and the port is released.
    pub async fn stop(&mut self) -> Result<()> {
        let Some((cancel, task)) = self.running.take() else {
            return Ok(());
        };
        cancel.cancel();
        Ok(task.await??)
    }

    /// Serves again on the same port (agents reconnect to the address they were given).
    pub async fn restart(&mut self) -> Result<()> {
        self.stop().await?;
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .map_err(|error| LoopbackError::Bind {
                port: self.port,
                error,
            })?;
        self.serve(listener);
        Ok(())
    }

    /// Stops serving, writes its last heartbeat report (and removes its row) and closes the
    /// server's BMDB sessions.
    pub async fn close(mut self) -> Result<()> {
        let stopped = self.stop().await;
        let reported = self.reporter.stop().await;
        self.pool.close().await;
        stopped?;
        Ok(reported?)
    }
}
