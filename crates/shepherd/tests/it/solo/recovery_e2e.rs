//! Recovery end to end, in one process with real parts: a real sshd as the machine, the real
//! agent binary started over SSH by the initializer, the real BMaaS server over TLS, and the
//! recoverer.
//! - The agent is killed; with short thresholds the recoverer reboots the machine (observable
//!   through the test provider), clears its agent tags, the initializer takes it over again
//!   with a fresh key, and heartbeats resume.
//! - The BMaaS server stops while the agent runs: its heartbeats end, the recovery brake
//!   engages and nothing is rebooted; the server comes back on the same address, the agent
//!   heartbeats again and the brake releases by itself.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use common::wait_for;
use shepherd_bmdb::*;
use shepherd_loops::brake::{Brake, BrakeConfig, BrakeMetrics};
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::recoverer::Recoverer;
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_loops::testing::agent_path;
use shepherd_provider::static_provider::StaticProvider;
use shepherd_provider::transport::SshTransport;
use shepherd_provider::{
    record_new_machine, Availability, Provider, ProviderError, ProviderMachine, Rebooter, Recorded,
};
use shepherd_server::*;
use shepherd_ssh::testing::{random_key, Sshd};
use shepherd_ssh::{Auth, SshClient, SshConfig};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The static provider plus a "reboot" that kills the machine's agent process, as a power
/// cycle would, and records that it happened.
struct RebootableStatic {
    inner: StaticProvider,
    agent_path: String,
    reboots: Mutex<Vec<String>>,
}

#[async_trait]
impl Provider for RebootableStatic {
    fn kind(&self) -> ProviderKind {
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
impl Rebooter for RebootableStatic {
    async fn reboot(&self, _lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
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

/// One machine: an sshd whose sessions tell the agent to heartbeat every 300 ms, recorded in
/// the BMDB as `box-1` of a static inventory whose "reboot" kills the agent.
struct Machine {
    _sshd: Sshd,
    id: Uuid,
    target: String,
    provider: Arc<RebootableStatic>,
    ssh: Arc<SshClient>,
}

impl Machine {
    async fn record(db: &Bmdb, dir: &std::path::Path) -> Machine {
        let key = random_key();
        let sshd = Sshd::start_with(
            &[key.public_key()],
            "SetEnv SHEPHERD_AGENT_HEARTBEAT_INTERVAL=300ms",
        );
        let target = sshd.dir().join("agent").display().to_string();
        let inventory = dir.join("inventory.json");
        std::fs::write(
            &inventory,
            format!(r#"[{{"ID": "box-1", "Addr": "{}"}}]"#, sshd.addr()),
        )
        .unwrap();
        let provider = Arc::new(RebootableStatic {
            inner: StaticProvider::new(
                &format!("file://{}", inventory.display()),
                ProviderKind::Static,
            )
            .unwrap(),
            agent_path: target.clone(),
            reboots: Mutex::new(Vec::new()),
        });
        let session = db
            .start_session(SessionConfig::new("test", Processor::Unknown))
            .await
            .unwrap();
        let id = record_new_machine(
            &session,
            ProviderKind::Static,
            &ProviderMachine::new("box-1", Some(sshd.addr()), Availability::KnownUnused),
        )
        .await
        .unwrap()
        .machine;
        session.close().await.unwrap();
        let mut ssh = SshConfig::new(Auth::Key(Arc::new(key)));
        ssh.user = std::env::var("USER").unwrap_or_else(|_| "root".into());
        ssh.connect_timeout = Duration::from_secs(10);
        Machine {
            _sshd: sshd,
            id,
            target,
            provider,
            ssh: Arc::new(SshClient::new(ssh)),
        }
    }

    /// The initializer that takes this machine over for `server`.
    fn initializer(&self, server: &LoopbackServer) -> Initializer<RebootableStatic> {
        let mut init =
            InitializerConfig::new(std::fs::read(agent_path()).unwrap(), server.endpoint());
        init.target_path = self.target.clone();
        init.ca_certificate = Some(server.ca_der().to_vec());
        init.backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(2), 1.5);
        Initializer::new(
            self.provider.clone(),
            Arc::new(SshTransport::new(self.ssh.clone())),
            init,
        )
        .unwrap()
    }

    fn reboots(&self) -> Vec<String> {
        self.provider.reboots.lock().unwrap().clone()
    }
}

const THRESHOLDS: RecoveryThresholds = RecoveryThresholds {
    no_heartbeat_after_start: Duration::from_secs(5),
    heartbeat_older_than: Duration::from_secs(2),
};

/// Runs `initializer` and `recoverer` (one worker each) until `cancel`.
fn run_loops(
    db: &Bmdb,
    initializer: Initializer<RebootableStatic>,
    recoverer: Recoverer<RebootableStatic>,
    cancel: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let runner = |name: &str, processor| {
        let rate = RateSpec::new(Duration::from_millis(100), 1);
        RunnerConfig::new(1, rate, SessionConfig::new(name, processor))
    };
    let (db, cancel) = (db.clone(), cancel.clone());
    let (ri, rr) = (
        runner("initializer", Processor::ShepherdInitializer),
        runner("recoverer", Processor::ShepherdRecoverer),
    );
    tokio::spawn(async move {
        tokio::join!(
            run(db.clone(), Arc::new(initializer), ri, cancel.clone()),
            run(db, Arc::new(recoverer), rr, cancel),
        );
    })
}

async fn heartbeat(db: &Bmdb, m: Uuid) -> Option<chrono::DateTime<chrono::Utc>> {
    db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
        .await
        .unwrap()
}

async fn silent_agent_is_recovered_and_taken_over_again(db: Bmdb) {
    let dir = tempfile::tempdir().unwrap();
    let server = LoopbackServer::start(&db, &dir.path().join("certs"), 2, ServerLimits::default())
        .await
        .unwrap();
    let machine = Machine::record(&db, dir.path()).await;
    let m = machine.id;
    let target = machine.target.clone();
    let recoverer = Recoverer::new(machine.provider.clone(), THRESHOLDS).with_backoff(
        Backoff::exponential(Duration::from_secs(1), Duration::from_secs(2), 1.5),
    );
    let cancel = CancellationToken::new();
    let loops = run_loops(&db, machine.initializer(&server), recoverer, &cancel);
    let provider = machine.provider.clone();

    let beat = async || heartbeat(&db, m).await;
    let agent_key = async || {
        db.read(move |tx| Box::pin(async move { tx.agent_started(m).await }))
            .await
            .unwrap()
            .map(|a| a.public_key)
    };
    let first_key = wait_for("the first takeover", 30, agent_key).await;
    let first_beat = wait_for("the first heartbeat", 30, beat).await;
    // Heartbeats keep coming, and nothing is recovered while they do.
    wait_for("a later heartbeat", 10, async || {
        beat().await.filter(|h| *h > first_beat)
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
        beat().await.filter(|h| *h > rebooted_at)
    })
    .await;
    assert_eq!(second_key.len(), 32);
    assert_eq!(*provider.reboots.lock().unwrap(), vec!["box-1".to_string()]);

    cancel.cancel();
    loops.await.unwrap();
    server.close().await.unwrap();
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

async fn a_stopped_server_brakes_recovery_until_it_is_back(db: Bmdb) {
    let dir = tempfile::tempdir().unwrap();
    let mut server =
        LoopbackServer::start(&db, &dir.path().join("certs"), 2, ServerLimits::default())
            .await
            .unwrap();
    let machine = Machine::record(&db, dir.path()).await;
    let m = machine.id;
    // One machine: one silent machine is the whole fleet, so the brake may engage for it.
    let brake = Brake::new(
        BrakeConfig {
            max_silent_share: 0.5,
            min_silent: 1,
            interval: Duration::from_millis(200),
        },
        ProviderKind::Static,
        THRESHOLDS,
        BrakeMetrics::default(),
    );
    let cancel = CancellationToken::new();
    let braking = tokio::spawn(brake.clone().run(
        db.clone(),
        shepherd_tasks::Tasks::default().task("recovery-brake"),
        cancel.clone(),
    ));
    let recoverer = Recoverer::new(machine.provider.clone(), THRESHOLDS).with_brake(brake.clone());
    let loops = run_loops(&db, machine.initializer(&server), recoverer, &cancel);

    let first = wait_for("the first heartbeat", 60, async || heartbeat(&db, m).await).await;
    wait_for("the brake to release", 10, async || {
        (!brake.engaged()).then_some(())
    })
    .await;

    // The server stops; the agent runs on but its heartbeats cannot arrive.
    server.stop().await.unwrap();
    let stopped = chrono::Utc::now();
    wait_for("the brake to engage", 10, async || {
        brake.engaged().then_some(())
    })
    .await;
    // Well past the point where the machine is due for recovery: nothing is rebooted.
    tokio::time::sleep(THRESHOLDS.heartbeat_older_than * 2).await;
    assert!(brake.engaged());
    assert!(
        machine.reboots().is_empty(),
        "rebooted: {:?}",
        machine.reboots()
    );
    assert!(heartbeat(&db, m)
        .await
        .is_some_and(|h| h < stopped && h >= first));

    // The server comes back at the same address: heartbeats resume, the brake releases.
    server.restart().await.unwrap();
    wait_for("heartbeats through the restarted server", 30, async || {
        heartbeat(&db, m).await.filter(|h| *h > stopped)
    })
    .await;
    wait_for("the brake to release", 10, async || {
        (!brake.engaged()).then_some(())
    })
    .await;
    assert!(
        machine.reboots().is_empty(),
        "rebooted: {:?}",
        machine.reboots()
    );

    cancel.cancel();
    loops.await.unwrap();
    braking.await.unwrap();
    server.close().await.unwrap();
    kill_agent(&machine.target);
}

shepherd_bmdb::conformance_tests!(
    silent_agent_is_recovered_and_taken_over_again,
    a_stopped_server_brakes_recovery_until_it_is_back
);
