//! Recovery end to end, in one process with real parts: a real sshd as the machine, the real
//! agent binary started over SSH by the initializer, the real BMaaS server over TLS, and the
//! recoverer. The agent is killed; with short thresholds the recoverer reboots the machine
//! (observable through the test provider), clears its agent tags, the initializer takes it
//! over again with a fresh key, and heartbeats resume.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shepherd_bmdb::*;
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provider::{
    record_new_machine, Availability, Provider as ProviderTrait, ProviderError, ProviderMachine,
    Recorded, Recoverer as RecovererTrait,
};
use shepherd_loops::recoverer::Recoverer;
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_loops::static_provider::StaticProvider;
use shepherd_loops::testing::agent_path;
use shepherd_loops::transport::SshTransport;
use shepherd_server::*;
use shepherd_ssh::testing::{random_key, Sshd};
use shepherd_ssh::{Auth, SshClient, SshConfig};
use tokio_util::sync::CancellationToken;

/// The static provider plus a "reboot" that kills the machine's agent process, as a power
/// cycle would, and records that it happened.
struct RebootableStatic {
    inner: StaticProvider,
    agent_path: String,
    reboots: Mutex<Vec<String>>,
}

#[async_trait]
impl ProviderTrait for RebootableStatic {
    fn kind(&self) -> Provider {
        self.inner.kind()
    }
    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        self.inner.list_machines().await
    }
    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        self.inner.get_machine(id).await
    }
    async fn create_machine(
        &self,
        s: &Session,
        m: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        self.inner.create_machine(s, m).await
    }
}

#[async_trait]
impl RecovererTrait for RebootableStatic {
    async fn reboot(&self, machine: &ProviderMachine) -> Result<(), ProviderError> {
        kill_agent(&self.agent_path);
        self.reboots
            .lock()
            .unwrap()
            .push(machine.id.clone().unwrap_or_default());
        Ok(())
    }
}

fn kill_agent(path: &str) {
    let _ = std::process::Command::new("pkill")
        .args(["-f", path])
        .status();
}

async fn wait_for<T>(what: &str, secs: u64, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn silent_agent_is_recovered_and_taken_over_again(db: Bmdb) {
    let dir = tempfile::tempdir().unwrap();
    // The server.
    let certs = dev_certs(&dir.path().join("certs"), &["localhost".into()]).unwrap();
    let tls = load_server_config(&certs.cert_pem, &certs.key_pem).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let pool = Arc::new(SessionPool::new(
        db.clone(),
        SessionConfig::new("bmsrv", Processor::Bmsrv),
        2,
    ));
    let cancel = CancellationToken::new();
    let server = tokio::spawn(serve(
        listener,
        Arc::new(tls),
        BmaasService::new(pool.clone()),
        ServerLimits::default(),
        cancel.clone(),
    ));
    let ca_pem = std::fs::read_to_string(&certs.ca_pem).unwrap();
    let ca_der = rustls_pemfile_der(&ca_pem);

    // The machine: an sshd whose sessions tell the agent to heartbeat every 300 ms.
    let key = random_key();
    let sshd = Sshd::start_with(
        &[key.public_key()],
        "SetEnv SHEPHERD_AGENT_HEARTBEAT_INTERVAL=300ms",
    );
    let target = sshd.dir().join("agent").display().to_string();
    let inventory = dir.path().join("inventory.json");
    std::fs::write(
        &inventory,
        format!(r#"[{{"ID": "box-1", "Addr": "{}"}}]"#, sshd.addr()),
    )
    .unwrap();
    let provider = Arc::new(RebootableStatic {
        inner: StaticProvider::new(&format!("file://{}", inventory.display()), Provider::Static)
            .unwrap(),
        agent_path: target.clone(),
        reboots: Mutex::new(Vec::new()),
    });
    let session = db
        .start_session(SessionConfig::new("test", Processor::Unknown))
        .await
        .unwrap();
    let m = record_new_machine(
        &session,
        Provider::Static,
        &ProviderMachine::new("box-1", Some(sshd.addr()), Availability::KnownUnused),
    )
    .await
    .unwrap()
    .machine;
    session.close().await.unwrap();

    // The loops.
    let mut ssh = SshConfig::new(Auth::Key(Arc::new(key)));
    ssh.user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    ssh.connect_timeout = Duration::from_secs(10);
    let mut init = InitializerConfig::new(
        std::fs::read(agent_path()).unwrap(),
        format!("localhost:{port}"),
    );
    init.target_path = target.clone();
    init.ca_certificate = Some(ca_der);
    init.backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(2), 1.5);
    let initializer = Initializer::new(
        provider.clone(),
        Arc::new(SshTransport::new(Arc::new(SshClient::new(ssh)))),
        init,
    )
    .unwrap();
    let recoverer = Recoverer::new(
        provider.clone(),
        RecoveryThresholds {
            no_heartbeat_after_start: Duration::from_secs(5),
            heartbeat_older_than: Duration::from_secs(2),
        },
    )
    .with_backoff(Backoff::exponential(
        Duration::from_secs(1),
        Duration::from_secs(2),
        1.5,
    ));
    let runner = |name: &str, processor| RunnerConfig {
        parallelism: 1,
        db_rate: RateSpec::new(Duration::from_millis(100), 1),
        session: SessionConfig::new(name, processor),
    };
    let loops = tokio::spawn({
        let (db, cancel) = (db.clone(), cancel.clone());
        let (ri, rr) = (
            runner("initializer", Processor::ShepherdInitializer),
            runner("recoverer", Processor::ShepherdRecoverer),
        );
        async move {
            tokio::join!(
                run(db.clone(), Arc::new(initializer), ri, cancel.clone()),
                run(db, Arc::new(recoverer), rr, cancel),
            );
        }
    });

    let heartbeat = async || {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    };
    let agent_key = async || {
        db.read(move |tx| Box::pin(async move { tx.agent_started(m).await }))
            .await
            .unwrap()
            .map(|a| a.public_key)
    };
    let first_key = wait_for("the first takeover", 30, agent_key).await;
    let first_beat = wait_for("the first heartbeat", 30, heartbeat).await;
    // Heartbeats keep coming, and nothing is recovered while they do.
    wait_for("a later heartbeat", 10, async || {
        heartbeat().await.filter(|h| *h > first_beat)
    })
    .await;
    assert!(provider.reboots.lock().unwrap().is_empty());

    // The agent dies. The recoverer reboots the machine, the initializer takes it over again.
    kill_agent(&target);
    wait_for("the reboot", 30, async || {
        (!provider.reboots.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    let second_key = wait_for("a second takeover", 30, async || {
        agent_key().await.filter(|k| *k != first_key)
    })
    .await;
    let rebooted_at = chrono::Utc::now();
    wait_for("heartbeats from the new agent", 30, async || {
        heartbeat().await.filter(|h| *h > rebooted_at)
    })
    .await;
    assert_eq!(second_key.len(), 32);
    assert_eq!(*provider.reboots.lock().unwrap(), vec!["box-1".to_string()]);

    cancel.cancel();
    loops.await.unwrap();
    server.await.unwrap().unwrap();
    pool.close().await;
    kill_agent(&target);
    let history = db
        .read(move |tx| Box::pin(async move { tx.machine_history(m).await }))
        .await
        .unwrap();
    let count = |p, e| {
        history
            .iter()
            .filter(|h| h.process == p && h.event == e)
            .count()
    };
    assert_eq!(
        count(Process::ShepherdRecovery, WorkEvent::Finished),
        1,
        "{history:?}"
    );
    assert_eq!(
        count(Process::ShepherdAgentStart, WorkEvent::Finished),
        2,
        "{history:?}"
    );
}

fn rustls_pemfile_der(pem: &str) -> Vec<u8> {
    use base64::Engine;
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .unwrap()
}

shepherd_bmdb::conformance_tests!(silent_agent_is_recovered_and_taken_over_again);
