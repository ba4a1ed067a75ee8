//! Fault suite: a Postgres outage under load. The test runs its own cluster (initdb, pg_ctl,
//! a private directory and loopback port), starts `shepherd run` (simulated fleet) and
//! `shepherd server` with agents heartbeating over TLS, stops Postgres for 20 s mid-work and
//! starts it again. Both processes recover without a restart, the logs name the cause
//! (connection refused), and the history shows nothing lost or duplicated.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::private_postgres::PrivatePostgres;
use common::{history, sim_run, ChildGuard, TestAgent};
use shepherd_bmdb::{Bmdb, Process};
use shepherd_proto::bmaas::HeartbeatRequest;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const SIM_MACHINES: i64 = 40;
const AGENTS: usize = 8;
const OUTAGE: Duration = Duration::from_secs(20);

/// Results of one agent's heartbeats: (when, succeeded).
type Beats = Arc<Mutex<Vec<(Instant, bool)>>>;

/// An agent heartbeating every 300 ms until `stop` (at most 3 minutes).
async fn agent(
    addr: String,
    ca: Vec<u8>,
    machine: Uuid,
    identity: TestAgent,
    beats: Beats,
    stop: CancellationToken,
) {
    let mut client = identity.client(&addr, &ca, Duration::from_secs(5));
    let until = Instant::now() + Duration::from_secs(180);
    while !stop.is_cancelled() && Instant::now() < until {
        let ok = client
            .heartbeat(HeartbeatRequest {
                machine_id: machine.to_string(),
                ..Default::default()
            })
            .await
            .is_ok();
        beats.lock().unwrap().push((Instant::now(), ok));
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
}

async fn agent_started(db: &Bmdb) -> i64 {
    db.status_counts()
        .await
        .map(|c| c.agent_started)
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_and_server_ride_out_a_postgres_outage() {
    let pg = PrivatePostgres::start();
    let url = pg.url();
    let dir = tempfile::tempdir().unwrap();
    let server_log = dir.path().join("server.log");
    let (mut server, addr) =
        common::start_server(common::server(&url, dir.path()), Some(&server_log));
    let ca = std::fs::read(dir.path().join("certs/ca.pem")).unwrap();
    let db = Bmdb::open(&url).await.unwrap();

    // Agents on record, heartbeating through the server.
    let stop = CancellationToken::new();
    let mut all_beats = Vec::new();
    let mut agents = Vec::new();
    for _ in 0..AGENTS {
        let identity = TestAgent::new();
        let machine = identity.machine(&db).await;
        let beats: Beats = Arc::default();
        all_beats.push(beats.clone());
        agents.push(tokio::spawn(agent(
            addr.trim().to_string(),
            ca.clone(),
            machine,
            identity,
            beats,
            stop.clone(),
        )));
    }

    // The loops, bringing a simulated fleet in.
    let run_log = dir.path().join("run.log");
    let mut run = ChildGuard(Some(
        sim_run(&url, SIM_MACHINES as usize, "400ms", &run_log)
            .spawn()
            .unwrap(),
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    while agent_started(&db).await < AGENTS as i64 + 4 {
        assert!(Instant::now() < deadline, "no takeovers before the outage");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    db.close().await;

    // The outage, mid-work.
    pg.stop_server();
    tokio::time::sleep(OUTAGE).await;
    assert!(
        run.child().try_wait().unwrap().is_none(),
        "shepherd run exited during the outage"
    );
    assert!(
        server.child().try_wait().unwrap().is_none(),
        "shepherd server exited during the outage"
    );
    pg.start_server();
    let back = Instant::now();

    // Both recover without a restart: every agent heartbeats again, every machine is taken over.
    let db = Bmdb::open(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let all_back = all_beats
            .iter()
            .all(|b| b.lock().unwrap().iter().any(|(at, ok)| *ok && *at > back));
        if all_back && agent_started(&db).await == AGENTS as i64 + SIM_MACHINES {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery after the outage: {} machines with an agent; run log:\n{}",
            agent_started(&db).await,
            std::fs::read_to_string(&run_log)
                .unwrap_or_default()
                .lines()
                .rev()
                .take(15)
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let failed_during = all_beats
        .iter()
        .flat_map(|b| b.lock().unwrap().clone())
        .filter(|(_, ok)| !ok)
        .count();
    assert!(failed_during > 0, "the outage was never seen by the agents");
    stop.cancel();
    for a in agents {
        a.await.unwrap();
    }

    // The logs name the cause, not just a pool timeout.
    for (name, log) in [("run", &run_log), ("server", &server_log)] {
        let text = std::fs::read_to_string(log).unwrap().to_lowercase();
        assert!(
            text.contains("connection refused"),
            "{name}'s log never names the cause of the outage"
        );
    }

    // Nothing lost or duplicated.
    let history = history::all(&db).await;
    let finished = history::exclusive_finishes(&history, Process::ShepherdAgentStart);
    assert_eq!(
        finished.len() as i64,
        SIM_MACHINES,
        "machines never taken over"
    );
    assert!(
        finished.values().all(|&n| n == 1),
        "a machine was taken over twice"
    );
    let provided = db.status_counts().await.unwrap().provided;
    assert_eq!(provided, SIM_MACHINES);

    for (name, p) in [("run", run), ("server", server)] {
        let out = p.terminate();
        assert!(out.status.success(), "{name} exit: {}", out.status);
    }
    db.close().await;
}
