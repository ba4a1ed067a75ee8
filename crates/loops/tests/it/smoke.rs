//! Provisioner, initializer and recoverer against a dummy provider, on both BMDB backends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::*;
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{
    Provisioner, ProvisionerConfig, ProvisionerError, ProvisionerMetrics,
};
use shepherd_loops::reconcile::Limits;
use shepherd_loops::recoverer::Recoverer;
use shepherd_loops::runner::{self, RunnerConfig};
use shepherd_loops::testing::LocalTestAgent;
use shepherd_loops::updater::Updater;
use shepherd_provider::transport::{AgentOutput, AgentRun, Transport, TransportError};
use shepherd_provider::{
    record_new_machine, Availability, Provider, ProviderError, ProviderMachine, Rebooter, Recorded,
};
use shepherd_tasks::Tasks;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A provider with fixed capacity: `dummy-N` machines start unused and become used when
/// created. Creations of ids in `fail_create` and reboots of ids in `fail_reboot` fail.
#[derive(Default)]
struct Dummy {
    machines: Mutex<BTreeMap<String, Availability>>,
    fail_create: BTreeSet<String>,
    fail_reboot: BTreeSet<String>,
    reboots: Mutex<Vec<String>>,
    /// Creating this id expires the creating session after the machine exists at the
    /// provider and before the BMDB records it, as a database failover does.
    expire_session_on: Option<String>,
    /// Once this id is created and recorded, the session's keep-alive stops and the creation
    /// returns only when its lease has ended, as after a pause or a partition.
    lose_lease_after: Option<String>,
    /// How long each creation takes.
    create_delay: Duration,
    /// Creating this id finds the provider's API unavailable.
    unavailable_on: Option<String>,
    /// Creations begun, in flight now, and the most ever in flight at once.
    begun: std::sync::atomic::AtomicUsize,
    in_flight: std::sync::atomic::AtomicUsize,
    most_in_flight: std::sync::atomic::AtomicUsize,
}

impl Dummy {
    /// The ids of the machines created so far.
    fn used(&self) -> Vec<String> {
        let machines = self.machines.lock().unwrap();
        let used = machines
            .iter()
            .filter(|(_, a)| **a == Availability::KnownUsed);
        used.map(|(id, _)| id.clone()).collect()
    }

    fn with_capacity(n: usize) -> Self {
        let d = Dummy::default();
        for i in 0..n {
            d.machines
                .lock()
                .unwrap()
                .insert(format!("dummy-{i:03}"), Availability::KnownUnused);
        }
        d
    }

    fn machine(id: &str, a: Availability) -> ProviderMachine {
        ProviderMachine::new(id, Some("192.0.2.10".into()), a)
    }
}

#[async_trait]
impl Provider for Dummy {
    fn kind(&self) -> ProviderKind {
        ProviderKind::None
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        Ok(self
            .machines
            .lock()
            .unwrap()
            .iter()
            .map(|(id, a)| Self::machine(id, *a))
            .collect())
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        let a = self
            .machines
            .lock()
            .unwrap()
            .get(id)
            .copied()
            .ok_or_else(|| ProviderError::NotFound(id.into()))?;
        Ok(Self::machine(id, a))
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        use std::sync::atomic::Ordering::SeqCst;
        let id = unused.id.clone().unwrap();
        self.begun.fetch_add(1, SeqCst);
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.most_in_flight.fetch_max(now, SeqCst);
        tokio::time::sleep(self.create_delay).await;
        self.in_flight.fetch_sub(1, SeqCst);
        if self.unavailable_on.as_ref() == Some(&id) {
            return Err(ProviderError::Unavailable("injected outage".into()));
        }
        if self.fail_create.contains(&id) {
            return Err(ProviderError::Api("injected creation failure".into()));
        }
        self.machines
            .lock()
            .unwrap()
            .insert(id.clone(), Availability::KnownUsed);
        if self.expire_session_on.as_ref() == Some(&id) {
            session.close().await.unwrap();
        }
        let machine = Self::machine(&id, Availability::KnownUsed);
        let recorded = record_new_machine(session, self.kind(), &machine).await?;
        if self.lose_lease_after.as_ref() == Some(&id) {
            session.stop_keepalive();
            session.lease().lost().await;
        }
        Ok(recorded)
    }
}

#[async_trait]
impl Rebooter for Dummy {
    async fn reboot(&self, _lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
        let id = machine.id.clone().unwrap();
        if self.fail_reboot.contains(&id) {
            return Err(ProviderError::Api("BMC did not answer".into()));
        }
        self.reboots.lock().unwrap().push(id);
        Ok(())
    }
}

fn fast() -> RateSpec {
    RateSpec::new(Duration::from_millis(1), 100)
}

/// A provisioner that manages at most `max_machines` (0: all), creating `chunk_size` per pass,
/// with no pacing to wait for.
fn unpaced(max_machines: usize, chunk_size: usize) -> ProvisionerConfig {
    ProvisionerConfig {
        limits: Limits::new(max_machines, chunk_size),
        reconcile_rate: fast(),
        creation_rate: fast(),
        creation_parallelism: 1,
    }
}

async fn provided_ids(db: &Bmdb) -> Vec<String> {
    db.read(|tx| Box::pin(async move { tx.provided_by(ProviderKind::None).await }))
        .await
        .unwrap()
        .into_iter()
        .map(|(_, p)| p.provider_id)
        .collect()
}

async fn provisioner_stops_at_max(db: Bmdb) {
    let provider = Arc::new(Dummy::with_capacity(100));
    let p = Provisioner::new(provider.clone(), unpaced(10, 4));
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let mut created = vec![];
    for _ in 0..5 {
        created.push(p.iterate(&s).await.unwrap().created);
    }
    assert_eq!(created, vec![4, 4, 2, 0, 0]);
    assert_eq!(provided_ids(&db).await.len(), 10);

    // The long-running loop form reaches the same state, reports its passes as a task, and
    // stops on cancellation.
    let cancel = CancellationToken::new();
    let tasks = Tasks::default();
    let run = tokio::spawn({
        let (db, cancel, task) = (db.clone(), cancel.clone(), tasks.task("provisioner"));
        async move {
            shepherd_loops::periodic::run(
                &p,
                db,
                SessionConfig::new("provisioner", Processor::ShepherdProvisioner),
                task,
                cancel,
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    cancel.cancel();
    run.await.unwrap();
    assert_eq!(provided_ids(&db).await.len(), 10);
    let status = tasks.statuses().pop().unwrap();
    assert!(status.passes >= 1, "{status:?}");
    assert!(status.last_success.is_some(), "{status:?}");
    assert!(
        status.last_summary.contains("10 managed") || status.last_summary.contains("canceled"),
        "{status:?}"
    );
}

/// A decommissioned machine the provider still lists as ours is left alone — neither brought
/// back nor a discrepancy — until an operator recommissions it; then it comes back as a new
/// machine.
/// A pass stops at the first creation the BMDB cannot record (here the session expired, as
/// in a database failover), while a creation the provider refused for one machine is skipped.
async fn provisioner_stops_at_the_first_failure_of_the_bmdb(db: Bmdb) {
    let mut dummy = Dummy::with_capacity(10);
    dummy.fail_create.insert("dummy-000".into());
    dummy.expire_session_on = Some("dummy-002".into());
    let provider = Arc::new(dummy);
    let metrics = ProvisionerMetrics::default();
    let p = Provisioner::new(provider.clone(), unpaced(0, 10)).with_metrics(metrics.clone());
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let err = p.iterate(&s).await.unwrap_err();
    let counted = ["created", "failed", "unrecorded"].map(|o| metrics.creations(o));
    assert_eq!(counted, [1, 1, 1], "created, failed, unrecorded");
    match &err {
        ProvisionerError::BmdbFailed { created: 1, error } => {
            assert!(error.is_bmdb_failure());
            assert!(error.to_string().contains("dummy-002"), "{error}");
            assert!(error.to_string().contains("session expired"), "{error}");
        }
        other => panic!("{other:?}: {err:#}"),
    }
    let used = provider.used();
    assert_eq!(
        used,
        ["dummy-001", "dummy-002"],
        "nothing created after the BMDB failed"
    );
    assert_eq!(provided_ids(&db).await, ["dummy-001"]);
}

/// A pass whose session's lease ends creates nothing more at the provider: the lease is
/// checked before every creation.
async fn provisioner_creates_nothing_once_its_lease_ended(db: Bmdb) {
    let dummy = Dummy {
        lose_lease_after: Some("dummy-001".into()),
        ..Dummy::with_capacity(5)
    };
    let provider = Arc::new(dummy);
    let p = Provisioner::new(provider.clone(), unpaced(0, 10));
    let s =
        testing::session_every(&db, Processor::ShepherdProvisioner, Duration::from_secs(1)).await;
    let err = p.iterate(&s).await.unwrap_err();
    assert!(matches!(err, ProvisionerError::LeaseLost(_)), "{err:#}");
    let used = provider.used();
    assert_eq!(
        used,
        ["dummy-000", "dummy-001"],
        "nothing created after the lease"
    );
}

async fn provisioner_leaves_decommissioned_machines_alone(db: Bmdb) {
    let provider = Arc::new(Dummy::with_capacity(3));
    let p = Provisioner::new(provider.clone(), unpaced(0, 10));
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    assert_eq!(p.iterate(&s).await.unwrap().created, 3);
    let machine = |provider_id: &'static str| {
        let db = db.clone();
        async move {
            db.read(move |tx| {
                Box::pin(async move {
                    tx.machine_by_provider_id(ProviderKind::None, provider_id)
                        .await
                })
            })
            .await
            .unwrap()
        }
    };
    let old = machine("dummy-001").await.unwrap();
    let operator = testing::session(&db, Processor::ShepherdOperator).await;
    let who = Operator::new("bob", "chassis returned to the vendor").unwrap();
    assert!(matches!(
        operator.decommission(old, &who, false).await.unwrap(),
        ActionOutcome::Done(Some(_))
    ));
    for _ in 0..3 {
        let r = p.iterate(&s).await.unwrap();
        assert_eq!((r.managed, r.created, r.decommissioned), (2, 0, 1));
    }
    assert_eq!(provided_ids(&db).await, vec!["dummy-000", "dummy-002"]);
    // A creation racing the decommission is refused by the BMDB itself.
    let err = record_new_machine(
        &s,
        ProviderKind::None,
        &Dummy::machine("dummy-001", Availability::KnownUnused),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("decommissioned"), "{err}");

    // Recommissioned, the machine (listed as possibly ours, as after a provider-side wipe)
    // is brought back under a new machine id.
    assert!(matches!(
        operator.recommission(old, &who).await.unwrap(),
        ActionOutcome::Done(_)
    ));
    provider
        .machines
        .lock()
        .unwrap()
        .insert("dummy-001".into(), Availability::PossiblyUsed);
    assert_eq!(p.iterate(&s).await.unwrap().created, 1);
    let new = machine("dummy-001").await.unwrap();
    assert_ne!(new, old);
    assert_eq!(provided_ids(&db).await.len(), 3);
}

/// Maintenance keeps the loops that act on a machine away, not the updater: the machine's
/// facts still follow the provider.
async fn the_updater_refreshes_machines_in_maintenance(db: Bmdb) {
    let provider = Arc::new(Dummy::with_capacity(2));
    let p = Provisioner::new(provider.clone(), unpaced(0, 10));
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    assert_eq!(p.iterate(&s).await.unwrap().created, 2);
    let id = db
        .read(|tx| {
            Box::pin(async move {
                tx.machine_by_provider_id(ProviderKind::None, "dummy-000")
                    .await
            })
        })
        .await
        .unwrap()
        .unwrap();
    let operator = testing::session(&db, Processor::ShepherdOperator).await;
    let who = Operator::new("bob", "RAM test").unwrap();
    operator.maintenance_on(id, &who).await.unwrap();
    provider.machines.lock().unwrap().remove("dummy-000");
    let updater = Updater::new(provider.clone(), fast());
    updater.iterate(&s).await.unwrap();
    let tag = db
        .read(move |tx| Box::pin(async move { tx.provided(id).await }))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(tag.status, Some(ProviderStatus::Missing));
}

async fn failed_creations_do_not_stop_the_others(db: Bmdb) {
    let provider = Arc::new(Dummy {
        fail_create: ["dummy-001".to_string(), "dummy-002".to_string()].into(),
        ..Dummy::with_capacity(6)
    });
    let p = Provisioner::new(provider, unpaced(0, 4));
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let r = p.iterate(&s).await.unwrap();
    assert_eq!((r.created, r.failed), (2, 2));
    assert_eq!(provided_ids(&db).await, vec!["dummy-000", "dummy-003"]);
}

/// A machine the BMDB records that the provider no longer lists: with nothing listed at all
/// the listing looks broken and nothing is done; with other machines listed, it is one
/// machine removed at the provider, and the pass goes on without it.
async fn a_missing_machine_stops_nothing_but_an_empty_listing_stops_all(db: Bmdb) {
    db.transact(|tx| {
        Box::pin(async move {
            let id = tx.create_machine().await?;
            tx.set_provided(id, &Provided::new(ProviderKind::None, "ghost"))
                .await
        })
    })
    .await
    .unwrap();
    let provisioner = |capacity| {
        Provisioner::new(
            Arc::new(Dummy::with_capacity(capacity)),
            ProvisionerConfig {
                reconcile_rate: fast(),
                creation_rate: fast(),
                creation_parallelism: 1,
                ..Default::default()
            },
        )
    };
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let err = provisioner(0).iterate(&s).await.unwrap_err().to_string();
    assert!(
        err.contains("listing looks broken") && err.contains("ghost"),
        "{err}"
    );
    assert_eq!(provided_ids(&db).await, vec!["ghost"]);
    let r = provisioner(3).iterate(&s).await.unwrap();
    assert_eq!((r.created, r.missing), (3, 1), "{r:?}");
    assert_eq!(provided_ids(&db).await.len(), 4);
}

/// Machines provided by the dummy, with agent state: (provider id, started minutes ago,
/// heartbeat minutes ago).
async fn fleet(
    db: &Bmdb,
    provider: &Dummy,
    spec: &[(&str, i64, Option<i64>)],
) -> BTreeMap<String, Uuid> {
    let spec: Vec<(String, i64, Option<i64>)> = spec
        .iter()
        .map(|(a, b, c)| (a.to_string(), *b, *c))
        .collect();
    for (id, ..) in &spec {
        provider
            .machines
            .lock()
            .unwrap()
            .insert(id.clone(), Availability::KnownUsed);
    }
    db.transact(move |tx| {
        let spec = spec.clone();
        Box::pin(async move {
            let now = tx.now().await?;
            let mut ids = BTreeMap::new();
            for (pid, started, hb) in spec {
                let id = tx.create_machine().await?;
                tx.set_provided(id, &Provided::new(ProviderKind::None, &pid))
                    .await?;
                tx.set_agent_started_at(
                    id,
                    Some(now - chrono::Duration::minutes(started)),
                    &[1; AGENT_KEY_LEN],
                )
                .await?;
                if let Some(hb) = hb {
                    tx.set_heartbeat_at(id, now - chrono::Duration::minutes(hb))
                        .await?;
                }
                ids.insert(pid, id);
            }
            Ok(ids)
        })
    })
    .await
    .unwrap()
}

async fn recoverer_reboots_silent_machines(db: Bmdb) {
    let provider = Arc::new(Dummy {
        fail_reboot: ["broken-bmc".to_string()].into(),
        ..Dummy::default()
    });
    let ids = fleet(
        &db,
        &provider,
        &[
            ("never-heartbeated", 45, None),
            ("went-silent", 120, Some(20)),
            ("healthy", 120, Some(1)),
            ("just-started", 5, None),
            ("broken-bmc", 60, None),
        ],
    )
    .await;
    let task = Arc::new(
        Recoverer::new(provider.clone(), RecoveryThresholds::default()).with_backoff(
            Backoff::exponential(Duration::from_secs(60), Duration::from_secs(600), 2.0),
        ),
    );
    let cancel = CancellationToken::new();
    let session = SessionConfig::new("recoverer", Processor::ShepherdRecoverer);
    let config = RunnerConfig::new(3, fast(), session);
    let run = tokio::spawn(runner::run(db.clone(), task, config, cancel.clone()));
    for _ in 0..200 {
        let failed = db
            .read({
                let id = ids["broken-bmc"];
                move |tx| Box::pin(async move { tx.machine_backoffs(id).await })
            })
            .await
            .unwrap();
        if provider.reboots.lock().unwrap().len() >= 2 && !failed.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    cancel.cancel();
    run.await.unwrap();

    let mut rebooted = provider.reboots.lock().unwrap().clone();
    rebooted.sort();
    assert_eq!(rebooted, vec!["never-heartbeated", "went-silent"]);
    for (name, cleared) in [
        ("never-heartbeated", true),
        ("went-silent", true),
        ("healthy", false),
        ("just-started", false),
        ("broken-bmc", false),
    ] {
        let id = ids[name];
        let (started, hb) = db
            .read(move |tx| {
                Box::pin(async move { Ok((tx.agent_started(id).await?, tx.heartbeat(id).await?)) })
            })
            .await
            .unwrap();
        assert_eq!(started.is_none(), cleared, "{name} agent tag");
        if cleared {
            assert!(hb.is_none(), "{name} heartbeat tag");
        }
    }
    // The failed reboot is in backoff with its cause, and history says so.
    let id = ids["broken-bmc"];
    let backoffs = db
        .read(move |tx| Box::pin(async move { tx.machine_backoffs(id).await }))
        .await
        .unwrap();
    let events = testing::history_as(&db, |e| (e.machine_id, e.event)).await;
    assert_eq!(backoffs.len(), 1);
    assert_eq!(
        (backoffs[0].process, backoffs[0].last_interval_seconds),
        (Process::ShepherdRecovery, 60)
    );
    assert!(
        backoffs[0].cause.contains("BMC did not answer"),
        "{}",
        backoffs[0].cause
    );
    let last = events.iter().rev().find(|(m, _)| *m == id);
    assert_eq!(last, Some(&(id, WorkEvent::Failed)));
    // All workers closed their sessions on cancellation.
    let sessions = db
        .read(|tx| Box::pin(async move { tx.sessions().await }))
        .await
        .unwrap();
    assert!(sessions.is_empty(), "{sessions:?}");
}

/// Runs an initializer over `provider` and `transport` with `parallelism` workers until the
/// returned token is cancelled.
fn start_initializer(
    db: &Bmdb,
    provider: Arc<Dummy>,
    transport: impl Transport + 'static,
    parallelism: usize,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let init = Initializer::new(
        provider,
        Arc::new(transport),
        InitializerConfig::new(vec![0x7f], "bmaas.example:443"),
    )
    .unwrap();
    let cancel = CancellationToken::new();
    let run = tokio::spawn(runner::run(
        db.clone(),
        Arc::new(init),
        RunnerConfig::new(
            parallelism,
            fast(),
            SessionConfig::new("initializer", Processor::ShepherdInitializer),
        ),
        cancel.clone(),
    ));
    (cancel, run)
}

async fn initializer_starts_the_agent_on_all_provided(db: Bmdb) {
    let provider = Arc::new(Dummy::with_capacity(100));
    let p = Provisioner::new(provider.clone(), unpaced(10, 4));
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    for _ in 0..3 {
        p.iterate(&s).await.unwrap();
    }
    s.close().await.unwrap();

    let (cancel, run) = start_initializer(&db, provider.clone(), LocalTestAgent, 3);
    let machines =
        testing::eventually("every agent started", Duration::from_secs(30), async || {
            let started = db
                .read(|tx| {
                    Box::pin(async move {
                        let mut started = Vec::new();
                        for (id, _) in tx.provided_by(ProviderKind::None).await? {
                            if let Some(a) = tx.agent_started(id).await? {
                                started.push((id, a.public_key));
                            }
                        }
                        Ok(started)
                    })
                })
                .await
                .unwrap();
            if started.len() == 10 {
                Ok(started)
            } else {
                Err(started.len())
            }
        })
        .await;
    cancel.cancel();
    run.await.unwrap();
    let keys: BTreeSet<_> = machines.iter().map(|(_, k)| k.clone()).collect();
    assert_eq!(keys.len(), 10, "every agent has its own key");
    for (id, _) in machines {
        let history = db
            .read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
            .await
            .unwrap();
        let events: Vec<_> = history.iter().map(|h| h.event).collect();
        assert_eq!(
            events,
            vec![WorkEvent::Started, WorkEvent::Finished],
            "{id}"
        );
    }
}

/// Runs the real test agent, but first pins another host key for the machine, as a replica
/// that took the same machine over meanwhile would: the finishing commit must then refuse.
struct PinnedMeanwhile {
    db: Bmdb,
}

#[async_trait]
impl Transport for PinnedMeanwhile {
    async fn run_agent(&self, run: AgentRun<'_>) -> Result<AgentOutput, TransportError> {
        use shepherd_proto::Message;
        let init = shepherd_proto::agent::TakeoverInit::decode(run.stdin).unwrap();
        let machine: Uuid = init.machine_id.parse().unwrap();
        self.db
            .transact(move |tx| {
                Box::pin(async move {
                    tx.pin_ssh_host_key(machine, "ssh-ed25519 AAAApinnedMeanwhile")
                        .await
                        .map(|_| ())
                })
            })
            .await
            .unwrap();
        let out = LocalTestAgent.run_agent(run).await?;
        Ok(AgentOutput {
            host_key: "ssh-ed25519 AAAApresented".into(),
            ..out
        })
    }
}

/// A finish whose commit refuses (here: the host key was pinned meanwhile) ends the work as
/// Failed with that cause and a backoff, not as a Canceled with no cause.
async fn a_refused_commit_fails_the_work_with_its_cause(db: Bmdb) {
    let machine = db
        .transact(|tx| {
            Box::pin(async move {
                let id = tx.create_machine().await?;
                tx.set_provided(id, &Provided::new(ProviderKind::None, "dummy-000"))
                    .await?;
                Ok(id)
            })
        })
        .await
        .unwrap();
    let (cancel, run) = start_initializer(
        &db,
        Arc::new(Dummy::with_capacity(1)),
        PinnedMeanwhile { db: db.clone() },
        1,
    );
    let history = |db: Bmdb| async move {
        db.read(move |tx| Box::pin(async move { tx.machine_history(machine).await }))
            .await
            .unwrap()
    };
    testing::eventually("the work to end", Duration::from_secs(30), async || {
        let h = history(db.clone()).await;
        if h.len() < 2 {
            Err(h)
        } else {
            Ok(())
        }
    })
    .await;
    cancel.cancel();
    run.await.unwrap();
    let history = history(db.clone()).await;
    let ended = &history[1];
    assert_eq!(ended.event, WorkEvent::Failed, "{history:?}");
    let cause = ended.cause.as_deref().unwrap_or_default();
    assert!(cause.contains("pinned meanwhile"), "{cause}");
    let backoffs = db
        .read(move |tx| Box::pin(async move { tx.machine_backoffs(machine).await }))
        .await
        .unwrap();
    assert!(
        backoffs
            .iter()
            .any(|b| b.process == Process::ShepherdAgentStart
                && b.cause.contains("pinned meanwhile")),
        "{backoffs:?}"
    );
    let started = db
        .read(move |tx| Box::pin(async move { tx.agent_started(machine).await }))
        .await
        .unwrap();
    assert!(started.is_none(), "nothing of the refused commit was kept");
}

/// 20 unused machines whose creations take 30 ms each (creating `unavailable_on` finds the
/// provider unavailable), and a provisioner creating up to 4 at a time.
fn four_at_a_time(unavailable_on: Option<&str>) -> (Arc<Dummy>, Provisioner<Dummy>) {
    let mut d = Dummy::with_capacity(20);
    d.create_delay = Duration::from_millis(30);
    d.unavailable_on = unavailable_on.map(str::to_string);
    let provider = Arc::new(d);
    let mut config = unpaced(0, 20);
    config.creation_parallelism = 4;
    (provider.clone(), Provisioner::new(provider, config))
}

/// With `creation_parallelism` 4, creations overlap, never more than 4 at once, and each
/// machine is created and recorded once.
async fn creations_overlap_up_to_the_parallelism(db: Bmdb) {
    use std::sync::atomic::Ordering::SeqCst;
    let (provider, p) = four_at_a_time(None);
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let r = p.iterate(&s).await.unwrap();
    assert_eq!((r.created, r.failed), (20, 0), "{r:?}");
    assert_eq!(provider.most_in_flight.load(SeqCst), 4);
    assert_eq!(provider.begun.load(SeqCst), 20);
    let mut recorded = provided_ids(&db).await;
    recorded.sort();
    assert_eq!(recorded, provider.used());
    s.close().await.unwrap();
}

/// Once a creation finds the provider unavailable, no new creation starts; those already in
/// flight finish and are recorded (none is cut off halfway), and the pass reports the outage.
async fn an_outage_stops_new_creations_and_those_in_flight_are_recorded(db: Bmdb) {
    use std::sync::atomic::Ordering::SeqCst;
    let (provider, p) = four_at_a_time(Some("dummy-005"));
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let err = p.iterate(&s).await.unwrap_err();
    assert!(
        matches!(err, ProvisionerError::ProviderUnavailable { .. }),
        "{err}"
    );
    // dummy-005 is the sixth begun; at most three more were in flight when it failed.
    let begun = provider.begun.load(SeqCst);
    assert!((6..=9).contains(&begun), "{begun} creations begun");
    let mut recorded = provided_ids(&db).await;
    recorded.sort();
    assert_eq!(
        recorded,
        provider.used(),
        "every creation that ran is recorded"
    );
    assert_eq!(recorded.len(), begun - 1, "all but the failed one");
    s.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(
    creations_overlap_up_to_the_parallelism,
    an_outage_stops_new_creations_and_those_in_flight_are_recorded,
    a_refused_commit_fails_the_work_with_its_cause,
    provisioner_stops_at_max,
    provisioner_stops_at_the_first_failure_of_the_bmdb,
    provisioner_creates_nothing_once_its_lease_ended,
    provisioner_leaves_decommissioned_machines_alone,
    the_updater_refreshes_machines_in_maintenance,
    initializer_starts_the_agent_on_all_provided,
    failed_creations_do_not_stop_the_others,
    a_missing_machine_stops_nothing_but_an_empty_listing_stops_all,
    recoverer_reboots_silent_machines,
);
