//! `shepherd run --provider ironic` as processes against a real, standalone OpenStack Ironic
//! on loopback: two replicas share a fleet of fake-hardware nodes, each node is deployed
//! exactly once (Ironic's node history and Shepherd's audit history agree) and taken over over
//! SSH by the stand-in agent (several nodes share one sshd, so they cannot each run a real
//! agent: every node's agent would be uploaded to the same path of this one host); a real agent
//! on an Ironic node heartbeats through `shepherd server`, and when it goes silent its node is
//! rebooted through Ironic and taken over again.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use common::ironic::{adopt_e2e_node, ironic_run, PASSWORD};
use common::sushy;
use common::{wait_for, ChildGuard};
use serde_json::json;
use shepherd_bmdb::{
    testing, Bmdb, OpenOptions, Operator, Process, Processor, ProviderKind, WorkEvent,
};
use shepherd_ironic::testing::{ImageServer, IronicServer, TestAuth};
use shepherd_ssh::testing::Sshd;

/// The Redfish id of the emulated system behind the Redfish node.
const SYSTEM: &str = "7b4c1d4e-3f52-4b7e-9a51-2a0d5e6f7a01";

/// The user the tests' sshds let in: whoever runs the tests.
fn this_user() -> String {
    std::env::var("USER").unwrap_or_else(|_| "root".into())
}

/// Machine → process → events, in history order.
async fn history_by_machine(db: &Bmdb) -> BTreeMap<(uuid::Uuid, Process), Vec<WorkEvent>> {
    let mut by = BTreeMap::<_, Vec<WorkEvent>>::new();
    for e in testing::all_history(db).await {
        by.entry((e.machine_id, e.process))
            .or_default()
            .push(e.event);
    }
    by
}

/// Ironic machines of the BMDB whose agent has started: provider id → machine.
async fn started(db: &Bmdb) -> BTreeMap<String, uuid::Uuid> {
    let provided = testing::provided_by(db, ProviderKind::Ironic).await;
    db.read(move |tx| {
        let provided = provided.clone();
        Box::pin(async move {
            let mut out = BTreeMap::new();
            for (id, p) in provided {
                if tx.agent_started(id).await?.is_some() {
                    out.insert(p.provider_id, id);
                }
            }
            Ok(out)
        })
    })
    .await
    .unwrap()
}

/// Why not every node was taken over in time, for the failure message: how many were, a few
/// of the rest, the skips the BMDB holds, and the replicas' last warnings and errors.
async fn why_not_taken_over(
    db: &Bmdb,
    started: &BTreeMap<String, uuid::Uuid>,
    nodes: &[String],
    logs: &[std::path::PathBuf],
) -> String {
    let missing: Vec<_> = nodes.iter().filter(|n| !started.contains_key(*n)).collect();
    let skips = db
        .read(|tx| Box::pin(async move { tx.skipped_provider_ids(ProviderKind::Ironic).await }))
        .await;
    let mut out = format!(
        "timed out: {} of {} nodes taken over; not yet (first 5): {:?}; skips: {skips:?}",
        started.len(),
        nodes.len(),
        &missing[..missing.len().min(5)]
    );
    for (i, log) in logs.iter().enumerate() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let worst: Vec<_> = text
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect();
        let tail = &worst[worst.len().saturating_sub(15)..];
        out += &format!(
            "\nreplica {i}, last {} warnings:\n{}",
            tail.len(),
            tail.join("\n")
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_take_every_node_over_and_deploy_each_exactly_once() {
    const NODES: usize = 200;
    const SSHDS: usize = 4;
    let Some([db_url, ironic_db_url]) = testing::fresh_postgres_databases().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("id_ed25519");
    let key = shepherd_ssh::load_or_generate_key(&key_path).unwrap();
    let public = key.public_key().to_openssh().unwrap();
    // Several nodes share one sshd: the stand-in agent keeps no state on the machine.
    let sshds: Vec<Sshd> = (0..SSHDS)
        .map(|_| Sshd::start(&[key.public_key()]))
        .collect();
    // Ironic keeps its database in Postgres, as production Ironics do: on SQLite, two
    // replicas' concurrent claims made its conductor fail allocations with "database is
    // locked", and the retries slowed the last 50 takeovers to one every 3 to 10 seconds.
    let ironic = IronicServer::start_on_postgres(
        TestAuth::Basic {
            user: "shepherd".into(),
            password: PASSWORD.into(),
        },
        &ironic_db_url,
    )
    .await;
    let nodes = ironic
        .fake_nodes(NODES, |i| json!({"ssh_address": sshds[i % SSHDS].addr()}))
        .await;

    let agent = shepherd_loops::testing::test_agent_path();
    let target = dir.path().join("agent").display().to_string();
    let logs: Vec<_> = (0..2)
        .map(|i| dir.path().join(format!("run-{i}.log")))
        .collect();
    // The schema first, so that the test reads the database while the replicas start.
    Bmdb::open_with(&db_url, &OpenOptions::migrating(true))
        .await
        .unwrap()
        .close()
        .await;
    let mut replicas: Vec<ChildGuard> = logs
        .iter()
        .map(|log| {
            // The stand-in agent answers the takeover and never heartbeats.
            let endpoint = "bmaas.test:443";
            ChildGuard(Some(
                ironic_run(&db_url, &ironic, &key_path, &agent, &target, endpoint)
                    .args(["--ironic-deploy-wait", "3s"])
                    // As the flag's help advises for Ironic: fill its deploy pipeline.
                    .args(["--provisioner-parallelism", "4"])
                    .args(["--ssh-user", &this_user()])
                    .stderr(std::fs::File::create(log).unwrap())
                    .spawn()
                    .unwrap(),
            ))
        })
        .collect();

    let db = Bmdb::open_with(&db_url, &OpenOptions::migrating(true))
        .await
        .unwrap();
    // Ironic's conductor paces this: about 1.5 takeovers a second on two cores. The deadline
    // is a liveness bound, over three times what a run takes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(480);
    let taken = loop {
        for (r, log) in replicas.iter_mut().zip(&logs) {
            if let Ok(Some(status)) = r.child().try_wait() {
                panic!(
                    "a replica exited ({status}): {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
        let s = started(&db).await;
        if s.len() == NODES {
            break s;
        }
        if std::time::Instant::now() > deadline {
            panic!("{}", why_not_taken_over(&db, &s, &nodes, &logs).await);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    };

    // Every node of Ironic's is a machine of Shepherd's, exactly once.
    assert_eq!(
        taken.keys().cloned().collect::<BTreeSet<_>>(),
        nodes.iter().cloned().collect::<BTreeSet<_>>()
    );
    assert_eq!(
        testing::provided_by(&db, ProviderKind::Ironic).await.len(),
        NODES
    );
    // Ironic deployed each node exactly once, for this deployment, with our key.
    let stored = ironic.stored_instance_infos();
    for id in &nodes {
        ironic.assert_deployed_once(id).await;
        let node = ironic.node(id).await;
        assert_eq!(node["extra"]["shepherd_deployment"], "e2e");
        let drive = stored[id]["configdrive"].clone();
        assert_eq!(
            drive["meta_data"]["public_keys"]["shepherd"],
            public.as_str(),
            "{id}"
        );
    }
    // Shepherd's audit history: each takeover ran to one Finished, never two workers at once.
    for ((machine, process), events) in history_by_machine(&db).await {
        if process != Process::ShepherdAgentStart {
            continue;
        }
        for pair in events.chunks(2) {
            assert_eq!(pair[0], WorkEvent::Started, "{machine}: {events:?}");
            assert!(
                pair.len() == 2 && pair[1] != WorkEvent::Started,
                "{machine}: {events:?}"
            );
        }
        let finished = events.iter().filter(|e| **e == WorkEvent::Finished).count();
        assert_eq!(finished, 1, "{machine}: {events:?}");
    }

    // The initializer waited for the deploys (`--ironic-deploy-wait`) instead of failing on
    // them; a takeover that still came too early failed only because the deploy ran on.
    for e in testing::all_history(&db).await {
        if e.event == WorkEvent::Failed {
            let cause = e.cause.unwrap_or_default();
            assert!(cause.contains("still provisioning"), "{cause}");
        }
    }

    for r in replicas.drain(..) {
        let out = r.terminate();
        assert!(out.status.success(), "a replica failed to stop cleanly");
    }
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap();
        assert!(
            !text.contains(PASSWORD),
            "the Ironic password is in a log: {}",
            log.display()
        );
        assert!(!text.contains("\"level\":\"ERROR\""), "{text}");
    }
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_on_a_redfish_node_is_rebooted_through_ironic_and_taken_over_again() {
    let dir = tempfile::tempdir().unwrap();
    let db_url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let (server, addr) = common::start_server(common::server(&db_url, dir.path()), None);
    let port = addr.rsplit_once(':').unwrap().1.to_string();

    let key_path = dir.path().join("id_ed25519");
    let key = shepherd_ssh::load_or_generate_key(&key_path).unwrap();
    // The real agent, told by the sshd to heartbeat every 300 ms.
    let sshd = Sshd::start_with(
        &[key.public_key()],
        "SetEnv SHEPHERD_AGENT_HEARTBEAT_INTERVAL=300ms\n",
    );
    let ironic = IronicServer::start(TestAuth::Basic {
        user: "shepherd".into(),
        password: PASSWORD.into(),
    })
    .await;
    // A node of Ironic's `redfish` type whose BMC is sushy-tools, brought to `active` with
    // Ironic's `adopt` (a running machine handed to Ironic without a deploy: the `redfish`
    // type has no fake deploy interface, and a real one would need a network boot), and
    // marked as this deployment's, as an operator hands Shepherd a machine already running.
    let emu = sushy::start_emulator(
        dir.path(),
        sushy::CertForm::CaSigned,
        &[sushy::FakeSystem {
            uuid: SYSTEM,
            name: "bmc-node-0",
        }],
        None,
    );
    let images = ImageServer::start().await;
    let mac = "00:5c:52:31:3a:9c";
    let node = adopt_e2e_node(&ironic, &emu, SYSTEM, mac, &images.url, &sshd.addr()).await;
    let nodes = [node];
    let resets = || {
        std::fs::read_to_string(dir.path().join("emulator.log"))
            .unwrap_or_default()
            .matches("ComputerSystem.Reset")
            .count()
    };
    assert_eq!(resets(), 0);
    let target = sshd.dir().join("agent").display().to_string();
    let run = ironic_run(
        &db_url,
        &ironic,
        &key_path,
        &shepherd_loops::testing::agent_path(),
        &target,
        &format!("localhost:{port}"),
    )
    .args(["--ironic-deploy-wait", "3s"])
    .args(["--ssh-user", &this_user()])
    .args(["--ironic-reboot-wait", "1s"])
    .arg(format!(
        "--agent-ca={}",
        dir.path().join("certs/ca.pem").display()
    ))
    .args(["--recovery-no-heartbeat-after", "3s"])
    .args(["--recovery-heartbeat-older-than", "2s"])
    .args(["--recoverer-db-rate", "100ms,4"])
    .stderr(std::fs::File::create(dir.path().join("run.log")).unwrap())
    .spawn()
    .unwrap();
    let run = ChildGuard(Some(run));

    let db = Bmdb::open(&db_url).await.unwrap();
    let machine = wait_for("the agent heartbeating", 90, async || {
        let s = started(&db).await;
        let id = *s.get(&nodes[0])?;
        let hb = db
            .read(move |tx| Box::pin(async move { tx.heartbeat(id).await }))
            .await
            .unwrap();
        hb.map(|_| id)
    })
    .await;
    let first_key = db
        .read(move |tx| Box::pin(async move { tx.agent_started(machine).await }))
        .await
        .unwrap()
        .unwrap()
        .public_key;

    // The agent dies: the recoverer reboots the node through Ironic, and the initializer
    // takes it over again with a new agent (a new key) that heartbeats.
    // Anchored: `shepherd run` names the same path in its arguments.
    let _ = Command::new("pkill")
        .args(["-f", &format!("^{target}")])
        .status();
    wait_for("a new agent heartbeating", 120, async || {
        let (started, hb) = db
            .read(move |tx| {
                Box::pin(async move {
                    Ok((
                        tx.agent_started(machine).await?,
                        tx.heartbeat(machine).await?,
                    ))
                })
            })
            .await
            .unwrap();
        let s = started?;
        (s.public_key != first_key && hb.is_some()).then_some(())
    })
    .await;
    let recoveries = history_by_machine(&db)
        .await
        .remove(&(machine, Process::ShepherdRecovery))
        .unwrap_or_default();
    assert!(recoveries.contains(&WorkEvent::Finished), "{recoveries:?}");
    assert!(
        resets() >= 1,
        "Ironic reset the system through its Redfish BMC: {}",
        ironic.log_tail()
    );

    let out = run.terminate();
    let log = std::fs::read_to_string(dir.path().join("run.log")).unwrap();
    assert!(out.status.success(), "{log}");
    assert!(!log.contains(PASSWORD), "the Ironic password is in the log");
    server.terminate();
    let _ = Command::new("pkill")
        .args(["-f", &format!("^{target}")])
        .status();
    db.close().await;
}

/// Ironic stopped while its new nodes wait for their takeovers: the takeovers that look their
/// node up meanwhile are released (Canceled, naming the cause), nobody is charged a backoff or
/// a Failed entry, and once Ironic is back every node is taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ironic_outage_mid_takeover_charges_no_machine() {
    const NODES: usize = 6;
    let dir = tempfile::tempdir().unwrap();
    let db_url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let key_path = dir.path().join("id_ed25519");
    let key = shepherd_ssh::load_or_generate_key(&key_path).unwrap();
    let sshd = Sshd::start(&[key.public_key()]);
    let mut ironic = IronicServer::start(TestAuth::Basic {
        user: "shepherd".into(),
        password: PASSWORD.into(),
    })
    .await;
    let nodes = ironic
        .fake_nodes(NODES, |_| json!({"ssh_address": sshd.addr()}))
        .await;
    let agent = shepherd_loops::testing::test_agent_path();
    let target = dir.path().join("agent").display().to_string();
    let log = dir.path().join("run.log");
    let replica = ChildGuard(Some(
        ironic_run(
            &db_url,
            &ironic,
            &key_path,
            &agent,
            &target,
            "bmaas.test:443",
        )
        // Longer than the test: no takeover looks its node up until the test ends the wait
        // (as an operator's `machines retry` would) after every deploy finished and Ironic
        // stopped. A fixed short wait raced slow deploys on a busy CI machine (a takeover came
        // first), and a conductor killed mid-deploy fails the deploy on its return.
        .args(["--ironic-deploy-wait", "1h"])
        .args(["--ssh-user", &this_user()])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap(),
    ));
    let db = wait_for("the BMDB", 30, async || {
        Bmdb::open_with(&db_url, &OpenOptions::default()).await.ok()
    })
    .await;
    // Every node reserved and deployed; the takeovers wait `--ironic-deploy-wait` from each
    // node's creation, so Ironic stops before any of them looked its node up.
    wait_for("every node recorded", 60, async || {
        let n = testing::provided_by(&db, ProviderKind::Ironic).await.len();
        (n == NODES).then_some(())
    })
    .await;
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
    }
    assert!(
        started(&db).await.is_empty(),
        "a takeover came before the outage"
    );
    ironic.stop();
    // The deploys are done: end each node's deploy wait, so the takeovers run into the outage.
    let operator = Operator {
        by: "test".into(),
        reason: "the deploys finished".into(),
        request_id: None,
    };
    let session = testing::session(&db, Processor::ShepherdOperator).await;
    for (machine, _) in testing::provided_by(&db, ProviderKind::Ironic).await {
        session
            .retry(machine, Some(Process::ShepherdAgentStart), &operator)
            .await
            .unwrap();
    }
    let outage = wait_for("takeovers meeting the outage", 30, async || {
        let canceled: Vec<String> = testing::all_history(&db)
            .await
            .into_iter()
            .filter(|e| e.event == WorkEvent::Canceled)
            .filter_map(|e| e.cause)
            .collect();
        (!canceled.is_empty()).then_some(canceled)
    })
    .await;
    assert!(
        outage.iter().all(|c| c.contains("cannot connect")),
        "{outage:?}"
    );
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    ironic.restart().await;
    let back = std::time::Instant::now();
    for _ in 0..240 {
        if started(&db).await.len() == NODES {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    let taken = started(&db).await.len();
    assert_eq!(
        taken,
        NODES,
        "taken over {:?} after Ironic came back; history: {:#?}; log: {}",
        back.elapsed(),
        testing::all_history(&db).await,
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // Every deploy was done before any takeover ran: nothing failed, no backoff is left.
    let history = testing::all_history(&db).await;
    let failed: Vec<_> = history
        .iter()
        .filter(|e| e.event == WorkEvent::Failed)
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    let backoffs = db.status_counts().await.unwrap().backoffs;
    assert!(backoffs.iter().all(|(_, n)| *n == 0), "{backoffs:?}");
    let out = replica.terminate();
    assert!(out.status.success(), "the replica failed to stop cleanly");
    db.close().await;
}
