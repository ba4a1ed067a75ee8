//! A BMaaS server on loopback with development certificates: what the demo, the benchmarks and
//! the tests run, so that each starts, stops and restarts a server the same way. `shepherd
//! server` builds its own from the operator's certificates and flags.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use shepherd_bmdb::{Bmdb, Processor, SessionConfig};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{dev_certs, load_server_config, serve, BmaasService, ServerLimits, SessionPool};

/// A running (or stopped, between [`LoopbackServer::stop`] and [`LoopbackServer::restart`])
/// BMaaS server on `127.0.0.1`, trusted by agents through its development CA.
pub struct LoopbackServer {
    port: u16,
    ca_pem: String,
    ca_der: Vec<u8>,
    tls: Arc<rustls::ServerConfig>,
    pool: Arc<SessionPool>,
    limits: ServerLimits,
    running: Option<(CancellationToken, JoinHandle<Result<()>>)>,
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
        let ca_pem = std::fs::read_to_string(&certs.ca_pem)
            .with_context(|| format!("{}", certs.ca_pem.display()))?;
        let ca_der = rustls_pemfile::certs(&mut ca_pem.as_bytes())
            .next()
            .context("the development CA file holds no certificate")??
            .to_vec();
        let pool = Arc::new(SessionPool::new(
            db.clone(),
            SessionConfig::new("bmsrv", Processor::Bmsrv),
            sessions,
        ));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let mut server = LoopbackServer {
            port: listener.local_addr()?.port(),
            ca_pem,
            ca_der,
            tls,
            pool,
            limits,
            running: None,
        };
        server.serve(listener);
        Ok(server)
    }

    fn serve(&mut self, listener: TcpListener) {
        let cancel = CancellationToken::new();
        let task = tokio::spawn(serve(
            listener,
            self.tls.clone(),
            BmaasService::new(self.pool.clone()),
            self.limits,
            cancel.clone(),
        ));
        self.running = Some((cancel, task));
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
        task.await.context("the server task panicked")?
    }

    /// Serves again on the same port (agents reconnect to the address they were given).
    pub async fn restart(&mut self) -> Result<()> {
        self.stop().await?;
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .with_context(|| format!("127.0.0.1:{} is taken", self.port))?;
        self.serve(listener);
        Ok(())
    }

    /// Stops serving and closes the server's BMDB sessions.
    pub async fn close(mut self) -> Result<()> {
        let stopped = self.stop().await;
        self.pool.close().await;
        stopped
    }
}
