//! The Initializer against a real OpenSSH sshd: the real test agent is uploaded over SFTP and
//! run, its key lands in `agent_started`, the host key is pinned, and broken agents or a
//! changed host key fail the work with the right cause, a backoff, and no tag.

use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_loops::testing::test_agent_path;
use shepherd_provider::static_provider::StaticProvider;
use shepherd_provider::transport::SshTransport;
use shepherd_provider::{record_new_machine, Availability, ProviderMachine};
use shepherd_ssh::testing::{random_key, Sshd};
use shepherd_ssh::{Auth, SshClient, SshConfig};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct Site {
    sshd: Sshd,
    key: shepherd_ssh::PrivateKey,
    provider: Arc<StaticProvider>,
    _inventory: tempfile::TempDir,
}

/// An sshd and a static inventory of `ids`, all pointing at it, recorded in the BMDB.
async fn site(db: &Bmdb, ids: &[&str]) -> (Site, Vec<Uuid>) {
    let key = random_key();
    let sshd = Sshd::start(&[key.public_key()]);
    let inventory = tempfile::tempdir().unwrap();
    let path = inventory.path().join("inventory.json");
    let entries: Vec<_> = ids
        .iter()
        .map(|id| serde_json::json!({"ID": id, "Addr": sshd.addr(), "Location": "lab"}))
        .collect();
    std::fs::write(&path, serde_json::to_vec(&entries).unwrap()).unwrap();
    let provider = Arc::new(
        StaticProvider::new(&format!("file://{}", path.display()), ProviderKind::Static).unwrap(),
    );
    let mut machines = Vec::new();
    for id in ids {
        machines.push(add_machine(db, id, &sshd.addr()).await);
    }
    (
        Site {
            sshd,
            key,
            provider,
            _inventory: inventory,
        },
        machines,
    )
}

/// Records a provided machine, as the provisioner would.
async fn add_machine(db: &Bmdb, id: &str, addr: &str) -> Uuid {
    let session = db
        .start_session(SessionConfig::new("test", Processor::Unknown))
        .await
        .unwrap();
    let m = ProviderMachine::new(id, Some(addr.to_string()), Availability::KnownUnused);
    let machine = record_new_machine(&session, ProviderKind::Static, &m)
        .await
        .unwrap()
        .machine;
    session.close().await.unwrap();
    machine
}

fn transport(site: &Site) -> Arc<SshTransport> {
    let mut config = SshConfig::new(Auth::Key(Arc::new(site.key.clone())));
    config.user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    config.connect_timeout = Duration::from_secs(10);
    Arc::new(SshTransport::new(Arc::new(SshClient::new(config))))
}

fn agent_config(site: &Site, agent: Vec<u8>, name: &str) -> InitializerConfig {
    let mut config = InitializerConfig::new(agent, "bmaas.example:443");
    config.target_path = site.sshd.dir().join(name).display().to_string();
    config.exec_timeout = Duration::from_secs(20);
    config
}

/// A shell script that runs the test agent with a misbehaviour.
fn misbehaving(mode: &str) -> Vec<u8> {
    format!(
        "#!/bin/sh\nexec '{}' --misbehave {mode}\n",
        test_agent_path().display()
    )
    .into_bytes()
}

/// Runs the initializer until `machine`'s history has `events` entries ending the work.
async fn run_until_ended(
    db: &Bmdb,
    init: Initializer<StaticProvider>,
    machine: Uuid,
    ends: usize,
) -> Vec<HistoryEntry> {
    let cancel = CancellationToken::new();
    let config = RunnerConfig::new(
        1,
        RateSpec::new(Duration::from_millis(10), 10),
        SessionConfig::new("initializer-test", Processor::ShepherdInitializer),
    );
    let runner = tokio::spawn(run(db.clone(), Arc::new(init), config, cancel.clone()));
    let history = testing::eventually("the work to end", Duration::from_secs(60), async || {
        let h = db
            .read(move |tx| Box::pin(async move { tx.machine_history(machine).await }))
            .await
            .unwrap();
        let ended = h.iter().filter(|e| e.event != WorkEvent::Started).count();
        testing::when(ended >= ends, h)
    })
    .await;
    cancel.cancel();
    runner.await.unwrap();
    history
}

async fn tags(
    db: &Bmdb,
    machine: Uuid,
) -> (Option<AgentStarted>, Option<SshHostKey>, Vec<BackoffEntry>) {
    db.read(move |tx| {
        Box::pin(async move {
            let started = tx.agent_started(machine).await?;
            let pinned = tx.ssh_host_key(machine).await?;
            Ok((started, pinned, tx.machine_backoffs(machine).await?))
        })
    })
    .await
    .unwrap()
}

async fn takeover_pins_host_key_and_refuses_a_changed_one(db: Bmdb) {
    let (mut site, machines) = site(&db, &["box-1"]).await;
    let m = machines[0];
    let agent = std::fs::read(test_agent_path()).unwrap();
    let init = Initializer::new(
        site.provider.clone(),
        transport(&site),
        agent_config(&site, agent.clone(), "agent"),
    )
    .unwrap();
    let history = run_until_ended(&db, init, m, 1).await;
    assert_eq!(
        history.last().unwrap().event,
        WorkEvent::Finished,
        "{history:?}"
    );
    let (started, host_key, backoffs) = tags(&db, m).await;
    let started = started.expect("agent_started written");
    assert_eq!(started.public_key.len(), 32);
    assert_eq!(host_key.expect("host key pinned").key, site.sshd.host_key());
    assert!(backoffs.is_empty());
    // The uploaded agent is the real one, executable.
    assert_eq!(std::fs::read(site.sshd.dir().join("agent")).unwrap(), agent);

    // The machine is reinstalled (new host key) and its agent goes away.
    let old_host_key = site.sshd.host_key();
    site.sshd.change_host_key();
    db.transact(move |tx| Box::pin(async move { tx.delete_agent_started(m).await.map(|_| ()) }))
        .await
        .unwrap();
    let init = Initializer::new(
        site.provider.clone(),
        transport(&site),
        agent_config(&site, agent, "agent"),
    )
    .unwrap();
    let history = run_until_ended(&db, init, m, 2).await;
    let last = history.last().unwrap();
    assert_eq!(last.event, WorkEvent::Failed, "{history:?}");
    let cause = last.cause.clone().unwrap_or_default();
    assert!(cause.contains("host key mismatch"), "{cause}");
    assert!(cause.contains(&site.sshd.host_key()), "{cause}");
    let (started, host_key, backoffs) = tags(&db, m).await;
    assert!(started.is_none());
    assert_eq!(
        host_key.unwrap().key,
        old_host_key,
        "the pin is not replaced"
    );
    assert_eq!(backoffs.len(), 1);
    // Not the first step of the usual backoff (5 min) but its longest (4 h): retrying sooner
    // cannot help until an operator has looked (and `forget-host-key` ends the wait).
    assert_eq!(backoffs[0].last_interval_seconds, 4 * 3600);
}

async fn misbehaving_agents_fail_with_the_right_cause(db: Bmdb) {
    let cases = [
        ("garbage", "not a TakeoverResponse"),
        (
            "error",
            "agent reported an error: test agent: refusing on purpose",
        ),
        ("wrong-echo", "echoed a different TakeoverInit"),
        ("short-key", "16 bytes"),
        ("exit-1", "agent exited with status 1"),
        ("hang", "command did not finish within"),
    ];
    let ids: Vec<String> = cases
        .iter()
        .map(|(mode, _)| format!("box-{mode}"))
        .collect();
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let (site, _) = site(&db, &[]).await;
    // The inventory lists every machine, but each is recorded (made eligible) only when its
    // case runs; machines of earlier cases are in backoff by then.
    let entries: Vec<_> = id_refs
        .iter()
        .map(|id| serde_json::json!({"ID": id, "Addr": site.sshd.addr()}))
        .collect();
    std::fs::write(
        site._inventory.path().join("inventory.json"),
        serde_json::to_vec(&entries).unwrap(),
    )
    .unwrap();
    for ((mode, want), id) in cases.iter().zip(&id_refs) {
        let m = &add_machine(&db, id, &site.sshd.addr()).await;
        let mut config = agent_config(&site, misbehaving(mode), &format!("agent-{mode}"));
        if *mode == "hang" {
            config.exec_timeout = Duration::from_secs(2);
        }
        let init = Initializer::new(site.provider.clone(), transport(&site), config).unwrap();
        let history = run_until_ended(&db, init, *m, 1).await;
        let last = history.last().unwrap();
        assert_eq!(last.event, WorkEvent::Failed, "{mode}: {history:?}");
        let cause = last.cause.clone().unwrap_or_default();
        assert!(cause.contains(want), "{mode}: want {want:?} in {cause:?}");
        let (started, host_key, backoffs) = tags(&db, *m).await;
        assert!(started.is_none(), "{mode}: agent_started written");
        assert!(
            host_key.is_none(),
            "{mode}: host key pinned after a failure"
        );
        assert_eq!(backoffs.len(), 1, "{mode}");
        assert_eq!(backoffs[0].last_interval_seconds, 300, "{mode}");
    }
}

shepherd_bmdb::conformance_tests!(
    takeover_pins_host_key_and_refuses_a_changed_one,
    misbehaving_agents_fail_with_the_right_cause
);
