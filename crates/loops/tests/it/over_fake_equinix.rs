//! The Equinix Metal provider against the fake API over real HTTP: SSH key ensure, provisioning
//! limits, penalized reservations, injected failures (500, 429 with Retry-After, slow and
//! truncated answers, creations that succeed but answer 500) without duplicate or orphaned
//! devices, orphan adoption after a failed BMDB insert, reboots and lookups.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::{testing, Bmdb, Processor, ProviderKind, Session};
use shepherd_equinix::fake::{Failure, FakeEquinix};
use shepherd_equinix::{Client, EquinixConfig, EquinixProvider, RetryPolicy};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig};
use shepherd_loops::reconcile::Limits;
use shepherd_provider::metrics::{CallMetrics, CallResult};
use shepherd_provider::{Availability, Provider, ProviderError, Rebooter};
use uuid::Uuid;

/// Milliseconds, for the retry policies of these tests.
fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const TOKEN: &str = "test-token";
const PROJECT: &str = "proj-1";
const KEY_A: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA0000000000000000000000000000000000000000000 shepherd";
const KEY_B: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB1111111111111111111111111111111111111111111 shepherd";

fn client(fake: &FakeEquinix, token: &str, metrics: Arc<CallMetrics>) -> Client {
    Client::new(
        &fake.url(),
        token,
        PROJECT,
        RetryPolicy::new(6, ms(20), ms(1500), ms(500)),
        metrics,
    )
    .unwrap()
}

fn config(key: &str) -> EquinixConfig {
    let mut c = EquinixConfig::new("shepherd-", key);
    c.reservation_cache = Duration::ZERO;
    c.reservation_penalty = Duration::from_millis(300);
    c.reboot_wait = Duration::from_millis(10);
    c
}

async fn provider(fake: &FakeEquinix) -> (Arc<EquinixProvider>, Arc<CallMetrics>) {
    let metrics = Arc::new(CallMetrics::default());
    let p = EquinixProvider::connect(client(fake, TOKEN, metrics.clone()), config(KEY_A))
        .await
        .unwrap();
    (Arc::new(p), metrics)
}

/// What most tests here start from: the fake API with some devices, a fresh BMDB, a
/// provisioner's session on it and the provider.
struct Rig {
    fake: FakeEquinix,
    t: testing::TestDb,
    s: Session,
    p: Arc<EquinixProvider>,
    metrics: Arc<CallMetrics>,
}

/// Closes a test's session and removes its database.
async fn done(s: Session, t: testing::TestDb) {
    s.close().await.unwrap();
    t.cleanup().await;
}

async fn rig(devices: usize) -> Rig {
    let fake = FakeEquinix::start(TOKEN, PROJECT, devices).await;
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    let (p, metrics) = provider(&fake).await;
    Rig {
        fake,
        t,
        s,
        p,
        metrics,
    }
}

fn provisioner(p: Arc<EquinixProvider>, max: usize, chunk: usize) -> Provisioner<EquinixProvider> {
    Provisioner::new(
        p,
        ProvisionerConfig {
            limits: Limits::new(max, chunk),
            reconcile_rate: RateSpec::new(Duration::from_millis(1), 1),
            creation_rate: RateSpec::new(Duration::from_millis(1), 100),
            creation_parallelism: 1,
        },
    )
}

async fn session(db: &Bmdb) -> Session {
    testing::session(db, Processor::ShepherdProvisioner).await
}

/// Every Equinix machine in the BMDB, by provider id.
async fn recorded_ids(db: &Bmdb) -> Vec<Uuid> {
    let provided = testing::provided_by(db, ProviderKind::Equinix).await;
    provided.into_iter().map(|(id, _)| id).collect()
}

/// (provider id, reservation id) of every Equinix machine in the BMDB.
async fn recorded(db: &Bmdb) -> Vec<(String, Option<String>)> {
    db.read(|tx| {
        Box::pin(async move {
            Ok(tx
                .provided_by(ProviderKind::Equinix)
                .await?
                .into_iter()
                .map(|(_, p)| (p.provider_id, p.reservation_id))
                .collect())
        })
    })
    .await
    .unwrap()
}

/// Every device has a distinct reservation and hostname, and the BMDB holds each exactly once.
async fn assert_consistent(fake: &FakeEquinix, db: &Bmdb) {
    let devices = fake.devices();
    let hostnames: BTreeSet<_> = devices.iter().map(|d| d.hostname.clone()).collect();
    assert_eq!(
        hostnames.len(),
        devices.len(),
        "duplicate devices: {devices:?}"
    );
    let rec = recorded(db).await;
    let ids: BTreeSet<_> = rec.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(ids.len(), rec.len(), "a device recorded twice");
    let device_ids: BTreeSet<_> = devices.iter().map(|d| d.id.clone()).collect();
    assert_eq!(ids, device_ids, "BMDB and provider disagree");
    for (id, reservation) in rec {
        let d = devices.iter().find(|d| d.id == id).unwrap();
        let from = d.hardware_reservation.as_ref().and_then(|r| r.id());
        assert_eq!(reservation.as_deref(), from, "reservation of {id}");
        assert!(d.hostname.starts_with("shepherd-res-"), "{}", d.hostname);
    }
}

#[tokio::test]
async fn the_project_ssh_key_is_created_updated_and_then_left_alone() {
    let fake = FakeEquinix::start(TOKEN, PROJECT, 0).await;
    let metrics = Arc::new(CallMetrics::default());
    let first = EquinixProvider::connect(client(&fake, TOKEN, metrics.clone()), config(KEY_A))
        .await
        .unwrap();
    assert_eq!(fake.ssh_keys().len(), 1);
    assert_eq!(fake.ssh_keys()[0].key, KEY_A);
    assert_eq!(fake.ssh_keys()[0].label, "shepherd");
    let second = EquinixProvider::connect(client(&fake, TOKEN, metrics.clone()), config(KEY_B))
        .await
        .unwrap();
    assert_eq!(second.ssh_key_id(), first.ssh_key_id(), "updated in place");
    assert_eq!(fake.ssh_keys().len(), 1);
    assert_eq!(fake.ssh_keys()[0].key, KEY_B);
    let writes = |r: &Vec<String>| r.iter().filter(|r| !r.starts_with("GET")).count();
    let before = writes(&fake.requests());
    EquinixProvider::connect(client(&fake, TOKEN, metrics.clone()), config(KEY_B))
        .await
        .unwrap();
    assert_eq!(
        writes(&fake.requests()),
        before,
        "an up-to-date key is not rewritten"
    );
    assert_eq!(metrics.count("create_ssh_key", CallResult::Ok), 1);
    assert_eq!(metrics.count("update_ssh_key", CallResult::Ok), 1);

    // A wrong token is a clear start-up error.
    let err = EquinixProvider::connect(client(&fake, "wrong", metrics), config(KEY_A))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("401"), "{err}");
}

#[tokio::test]
async fn provisioning_honours_the_maximum_and_the_chunk_size() {
    let Rig { fake, t, s, p, .. } = rig(10).await;
    fake.set_page_size(3); // listings span several pages
    fake.add_foreign_device("someone-else-1");
    let prov = provisioner(p.clone(), 4, 3);
    let r = prov.iterate(&s).await.unwrap();
    assert_eq!((r.managed, r.created, r.failed), (0, 3, 0));
    let r = prov.iterate(&s).await.unwrap();
    assert_eq!((r.managed, r.created), (3, 1));
    let r = prov.iterate(&s).await.unwrap();
    assert_eq!((r.managed, r.created), (4, 0), "the maximum holds");
    assert_eq!(fake.devices().len(), 5, "4 of ours and the foreign one");
    let ours: Vec<_> = fake
        .devices()
        .into_iter()
        .filter(|d| d.hostname.starts_with("shepherd-"))
        .collect();
    assert_eq!(ours.len(), 4);
    let rec = recorded(&t.db).await;
    assert_eq!(rec.len(), 4);
    // Address, location and status are recorded.
    let provided =
        t.db.read(|tx| Box::pin(async move { tx.provided_by(ProviderKind::Equinix).await }))
            .await
            .unwrap();
    for (_, p) in provided {
        assert!(
            p.ip_address.as_deref().unwrap().starts_with("147.75."),
            "{p:?}"
        );
        assert_eq!(p.location.as_deref(), Some("da"));
        assert_eq!(p.status, Some(shepherd_bmdb::ProviderStatus::Running));
    }
    done(s, t).await;
}

#[tokio::test]
async fn a_reservation_that_failed_is_skipped_for_its_penalty() {
    let Rig { fake, t, s, p, .. } = rig(3).await;
    fake.fail_next("POST /projects/devices", Failure::Status(422));
    let r = provisioner(p.clone(), 0, 10).iterate(&s).await.unwrap();
    assert_eq!((r.created, r.failed), (2, 1));
    let unused = |ms: Vec<shepherd_provider::ProviderMachine>| {
        ms.into_iter()
            .filter(|m| m.availability == Availability::KnownUnused)
            .count()
    };
    assert_eq!(unused(p.list_machines().await.unwrap()), 0, "penalized");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(unused(p.list_machines().await.unwrap()), 1, "penalty over");
    let r = provisioner(p, 0, 10).iterate(&s).await.unwrap();
    assert_eq!(r.created, 1);
    assert_consistent(&fake, &t.db).await;
    done(s, t).await;
}

#[tokio::test]
async fn injected_api_failures_lead_to_retries_not_duplicates() {
    let Rig {
        fake,
        t,
        s,
        p,
        metrics,
    } = rig(12).await;
    fake.set_page_size(5);
    for (route, f) in [
        ("GET /projects/devices", Failure::Status(500)),
        (
            "GET /projects/devices",
            Failure::TooManyRequests {
                retry_after_secs: 1,
            },
        ),
        ("GET /projects/hardware-reservations", Failure::Truncated),
        (
            "GET /projects/devices",
            Failure::Slow(Duration::from_secs(1)),
        ),
        ("POST /projects/devices", Failure::SucceedThen500),
        ("POST /projects/devices", Failure::Status(503)),
        ("POST /projects/devices", Failure::SucceedThen500),
        ("GET /devices", Failure::Status(502)),
    ] {
        fake.fail_next(route, f);
    }
    let prov = provisioner(p.clone(), 0, 100);
    for _ in 0..10 {
        if recorded(&t.db).await.len() == 12 {
            break;
        }
        let _ = prov.iterate(&s).await;
        tokio::time::sleep(Duration::from_millis(350)).await; // past the penalty
    }
    assert_eq!(fake.devices().len(), 12);
    assert_consistent(&fake, &t.db).await;
    // get_device is retried too.
    let id = fake.devices()[0].id.clone();
    assert_eq!(
        p.get_machine(&id).await.unwrap().id.as_deref(),
        Some(id.as_str())
    );
    assert_eq!(fake.pending_failures(), 0, "every injected failure was hit");
    assert!(metrics.count("list_devices", CallResult::Error) >= 3);
    assert!(metrics.count("create_device", CallResult::Error) >= 3);
    done(s, t).await;
}

/// Two replicas offered the same reservation: the API refuses the second creation (422), and
/// the loser is told the machine was taken by another client, the outcome the provisioner
/// counts quietly, rather than that creating it failed (a warning and a penalty).
#[tokio::test]
async fn a_reservation_another_replica_took_first_is_taken_not_failed() {
    let Rig { fake, t, s, p, .. } = rig(1).await;
    let (other, _) = provider(&fake).await;
    let offered = p.list_machines().await.unwrap();
    let unused = offered
        .iter()
        .find(|m| m.availability == Availability::KnownUnused)
        .expect("an unused reservation");
    p.create_machine(&s, unused).await.unwrap();
    match other.create_machine(&s, unused).await {
        Err(ProviderError::Taken(what)) => assert!(what.contains("another"), "{what}"),
        other => panic!("the loser of the race was told {other:?}"),
    }
    assert_eq!(fake.devices().len(), 1, "one device");
    assert_consistent(&fake, &t.db).await;
    done(s, t).await;
}

#[tokio::test]
async fn a_device_whose_bmdb_insert_failed_is_adopted_not_duplicated() {
    let Rig { fake, t, s, p, .. } = rig(4).await;
    let path = t.url.strip_prefix("sqlite:").unwrap().to_string();
    let raw = sqlx::SqlitePool::connect(&format!("sqlite://{path}"))
        .await
        .unwrap();
    sqlx::query(
        "CREATE TRIGGER refuse_provided BEFORE INSERT ON machine_provided
         BEGIN SELECT RAISE(ABORT, 'injected insert failure'); END",
    )
    .execute(&raw)
    .await
    .unwrap();
    let r = provisioner(p.clone(), 0, 10).iterate(&s).await.unwrap();
    assert_eq!((r.created, r.failed), (0, 4));
    assert_eq!(fake.devices().len(), 4, "the devices exist at the provider");
    assert!(recorded(&t.db).await.is_empty(), "and the BMDB has none");

    sqlx::query("DROP TRIGGER refuse_provided")
        .execute(&raw)
        .await
        .unwrap();
    raw.close().await;
    let r = provisioner(p.clone(), 0, 10).iterate(&s).await.unwrap();
    assert_eq!(r.created, 4, "adopted");
    assert_eq!(fake.devices().len(), 4, "nothing new created");
    assert_consistent(&fake, &t.db).await;
    let r = provisioner(p, 0, 10).iterate(&s).await.unwrap();
    assert_eq!((r.managed, r.created), (4, 0));
    done(s, t).await;
}

/// Three devices: two created running, then one more that stays provisioning (no address).
async fn two_running_one_provisioning() -> Rig {
    let rig = rig(3).await;
    provisioner(rig.p.clone(), 2, 10)
        .iterate(&rig.s)
        .await
        .unwrap();
    rig.fake.set_stuck_provisioning(true);
    provisioner(rig.p.clone(), 0, 10)
        .iterate(&rig.s)
        .await
        .unwrap();
    rig
}

#[tokio::test]
async fn reboots_and_lookups() {
    let Rig { fake, t, s, p, .. } = two_running_one_provisioning().await;
    let devices = fake.devices();
    assert_eq!(devices.len(), 3);

    let m = p.get_machine(&devices[0].id).await.unwrap();
    assert_eq!(m.availability, Availability::KnownUsed);
    fake.fail_next("POST /devices/actions", Failure::Status(500));
    p.reboot(&s.lease(), &m).await.unwrap();
    assert_eq!(fake.reboots(), vec![devices[0].id.clone()]);
    // A replica whose session has ended resets nothing; the refused step is counted.
    let ended = testing::session(&t.db, Processor::ShepherdRecoverer).await;
    ended.close().await.unwrap();
    let refused = p.reboot(&ended.lease(), &m).await.unwrap_err();
    assert!(matches!(refused, ProviderError::LeaseLost(_)), "{refused}");
    assert_eq!(fake.reboots(), vec![devices[0].id.clone()]);
    let fenced =
        t.db.metrics()
            .steps_fenced(Processor::ShepherdRecoverer, "reset");
    assert_eq!(fenced, 1);

    let stuck = p.get_machine(&devices[2].id).await.unwrap();
    assert_eq!(stuck.addr, None, "no address while provisioning");
    assert_eq!(
        stuck.status,
        Some(shepherd_bmdb::ProviderStatus::Provisioning)
    );
    fake.set_device_state(&devices[1].id, "failed");
    let failed = p.get_machine(&devices[1].id).await.unwrap();
    assert!(failed.failed);

    let foreign = fake.add_foreign_device("not-ours");
    assert!(matches!(
        p.get_machine(&foreign).await,
        Err(ProviderError::NotFound(_))
    ));
    assert!(matches!(
        p.get_machine("00000000-0000-0000-0000-000000000000").await,
        Err(ProviderError::NotFound(_))
    ));
    let mut gone = m.clone();
    gone.id = Some("00000000-0000-0000-0000-000000000000".into());
    assert!(matches!(
        p.reboot(&s.lease(), &gone).await,
        Err(ProviderError::NotFound(_))
    ));
    done(s, t).await;
}

#[tokio::test]
async fn the_updater_maps_states_and_marks_vanished_devices_missing() {
    use shepherd_bmdb::ProviderStatus;
    use shepherd_loops::updater::{UpdateReport, Updater};
    let Rig { fake, t, s, p, .. } = rig(3).await;
    provisioner(p.clone(), 0, 10).iterate(&s).await.unwrap();
    let devices = fake.devices();
    fake.set_device_state(&devices[0].id, "failed");
    fake.remove_device(&devices[1].id);
    let updater = Updater::new(p, RateSpec::new(Duration::from_millis(1), 1));
    let r = updater.iterate(&s).await.unwrap();
    assert_eq!(
        r,
        UpdateReport {
            updated: 1,
            missing: 1,
            unchanged: 1
        }
    );
    let status = |id: String| {
        let db = t.db.clone();
        async move {
            db.read(move |tx| {
                let id = id.clone();
                Box::pin(async move {
                    let m = tx
                        .machine_by_provider_id(ProviderKind::Equinix, &id)
                        .await?
                        .unwrap();
                    Ok(tx.provided(m).await?.unwrap())
                })
            })
            .await
            .unwrap()
        }
    };
    let failed = status(devices[0].id.clone()).await;
    assert_eq!(
        failed.status,
        Some(ProviderStatus::ProvisioningFailedPermanent)
    );
    assert!(failed.reservation_id.is_some(), "kept");
    assert_eq!(
        status(devices[1].id.clone()).await.status,
        Some(ProviderStatus::Missing)
    );
    assert_eq!(
        status(devices[2].id.clone()).await.status,
        Some(ProviderStatus::Running)
    );
    let again = updater.iterate(&s).await.unwrap();
    assert_eq!(again.unchanged, 3, "{again:?}");
    // An empty listing looks like partial data: nothing is marked Missing.
    fake.remove_device(&devices[0].id);
    fake.remove_device(&devices[2].id);
    let err = updater.iterate(&s).await.unwrap_err().to_string();
    assert!(err.contains("refusing"), "{err}");
    assert_eq!(
        status(devices[2].id.clone()).await.status,
        Some(ProviderStatus::Running)
    );
    done(s, t).await;
}

#[tokio::test]
async fn creations_wait_for_the_creation_rate() {
    let Rig { fake, t, s, p, .. } = rig(5).await;
    // A burst of 2, then one creation per hour: one iteration gets exactly two devices made
    // and then waits on the limiter (it is stopped there).
    let prov = Provisioner::new(
        p,
        ProvisionerConfig {
            limits: Limits::new(0, 10),
            reconcile_rate: RateSpec::new(Duration::from_millis(1), 1),
            creation_rate: RateSpec::new(Duration::from_secs(3600), 2),
            creation_parallelism: 1,
        },
    );
    let stopped = tokio::time::timeout(Duration::from_secs(3), prov.iterate(&s)).await;
    assert!(stopped.is_err(), "the third creation must wait an hour");
    assert_eq!(fake.devices().len(), 2);
    assert_eq!(recorded(&t.db).await.len(), 2);
    done(s, t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recoverer_reboots_silent_devices_through_the_api() {
    use shepherd_bmdb::{Process, RecoveryThresholds, WorkEvent};
    use shepherd_loops::recoverer::Recoverer;
    use shepherd_loops::testing::spawn_loop;
    let Rig { fake, t, s, p, .. } = rig(2).await;
    provisioner(p.clone(), 0, 10).iterate(&s).await.unwrap();
    s.close().await.unwrap();
    // Both agents were started two hours ago and never heartbeated; one device is gone.
    let devices = fake.devices();
    let ids: Vec<Uuid> = recorded_ids(&t.db).await;
    testing::agents_silent_for_hours(&t.db, &ids).await;
    let gone = &devices[1].id;
    fake.remove_device(gone);
    let (run, cancel) = spawn_loop(
        t.db.clone(),
        Recoverer::new(p, RecoveryThresholds::default()),
        1,
        4,
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut ended = 0;
        for id in &ids {
            let id = *id;
            let h =
                t.db.read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
                    .await
                    .unwrap();
            ended += h
                .iter()
                .filter(|e| e.process == Process::ShepherdRecovery && e.event != WorkEvent::Started)
                .count()
                .min(1);
        }
        if ended == 2 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no recovery");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    run.await.unwrap();
    assert_eq!(
        fake.reboots(),
        vec![devices[0].id.clone()],
        "the live device was rebooted"
    );
    for (id, device) in ids.iter().zip(["live", "gone"]) {
        let id = *id;
        let (history, agent) =
            t.db.read(move |tx| {
                Box::pin(
                    async move { Ok((tx.machine_history(id).await?, tx.agent_started(id).await?)) },
                )
            })
            .await
            .unwrap();
        let end = history
            .iter()
            .rev()
            .find(|e| e.event != WorkEvent::Started)
            .unwrap();
        let pid =
            t.db.read(move |tx| Box::pin(async move { tx.provided(id).await }))
                .await
                .unwrap()
                .unwrap()
                .provider_id;
        if pid == devices[0].id {
            assert_eq!(end.event, WorkEvent::Finished, "{device}");
            assert!(agent.is_none(), "agent tags cleared for a new takeover");
        } else {
            assert_eq!(end.event, WorkEvent::Failed, "{device}: {end:?}");
            assert!(agent.is_some());
        }
    }
    t.cleanup().await;
}

/// The initializer over the Equinix provider (upstream's Equinix TestInitializerSmokes): it
/// takes over every device the provider gives an address, and a device still provisioning,
/// without one, fails with "the provider has no address for this machine" and is asked again
/// soon (a short backoff), not at the initializer's long one.
#[tokio::test]
async fn the_initializer_takes_devices_over_and_waits_for_addresses() {
    use shepherd_bmdb::{Process, WorkEvent};
    use shepherd_loops::initializer::{Initializer, InitializerConfig};
    use shepherd_loops::testing::spawn_loop;
    use shepherd_loops::testing::LocalTestAgent;
    let Rig { fake, t, s, p, .. } = two_running_one_provisioning().await;
    s.close().await.unwrap();
    let stuck = fake
        .devices()
        .into_iter()
        .find(|d| d.ip_addresses.is_empty())
        .expect("one device without an address")
        .id;
    let init = Initializer::new(
        p,
        Arc::new(LocalTestAgent),
        InitializerConfig::new(vec![0x7f], "bmaas.example:443"),
    )
    .unwrap();
    let (run, cancel) = spawn_loop(t.db.clone(), init, 2, 10);
    let ids = recorded_ids(&t.db).await;
    assert_eq!(ids.len(), 3);
    let outcomes = testing::eventually("every device tried", Duration::from_secs(30), async || {
        let mut outcomes = vec![];
        for id in &ids {
            let id = *id;
            let (provided, history, agent, backoffs) =
                t.db.read(move |tx| {
                    Box::pin(async move {
                        Ok((
                            tx.provided(id).await?.unwrap(),
                            tx.machine_history(id).await?,
                            tx.agent_started(id).await?,
                            tx.machine_backoffs(id).await?,
                        ))
                    })
                })
                .await
                .unwrap();
            let Some(end) = history.iter().rev().find(|e| e.event != WorkEvent::Started) else {
                return Err(format!("{} not tried yet", provided.provider_id));
            };
            outcomes.push((provided.provider_id, end.clone(), agent, backoffs));
        }
        Ok(outcomes)
    })
    .await;
    cancel.cancel();
    run.await.unwrap();
    for (device, end, agent, backoffs) in outcomes {
        if device == stuck {
            assert_eq!(end.event, WorkEvent::Failed, "{end:?}");
            assert_eq!(
                end.cause.as_deref(),
                Some("the provider has no address for this machine")
            );
            assert!(agent.is_none());
            let b = &backoffs[0];
            assert_eq!(b.process, Process::ShepherdAgentStart);
            assert!(
                b.last_interval_seconds <= 300,
                "asked again within 5 min: {b:?}"
            );
        } else {
            assert_eq!(end.event, WorkEvent::Finished, "{device}: {end:?}");
            assert!(agent.is_some(), "{device} taken over");
        }
    }
    t.cleanup().await;
}

/// A transport failure names its cause ("connection refused"), not only reqwest's "error
/// sending request".
#[tokio::test]
async fn an_unreachable_api_says_why() {
    // A port that was just free: nothing listens there.
    let port = shepherd_loops::testing::free_loopback_port();
    let client = Client::new(
        &format!("http://127.0.0.1:{port}"),
        "token",
        "project",
        RetryPolicy::new(1, ms(1), ms(1), ms(5000)),
        Arc::new(CallMetrics::default()),
    )
    .unwrap();
    let err = client.list_devices().await.unwrap_err().to_string();
    assert!(err.to_lowercase().contains("refused"), "{err}");
}
