//! The Ironic provider when Ironic misbehaves, against a real Ironic (behind a fault-injecting
//! proxy where Ironic itself cannot be made to fail): 503s and slow answers, NodeLocked on
//! power requests, the API down at start-up and mid-run, a deploy that fails, a deploy Ironic
//! refuses, and a BMDB insert that fails after the reservation.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::over_real_ironic::stopped_unplaced;
use serde_json::json;
use shepherd_bmdb::{testing, Bmdb, Processor, ProviderStatus, Session};
use shepherd_ironic::testing::{
    recorded, test_config, test_provider, FaultProxy, IronicServer, TestAuth,
};
use shepherd_ironic::{ApiError, Auth, ConnectError, IronicProvider, RetryPolicy};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::testing::unpaced_provisioner as provisioner;
use shepherd_loops::updater::Updater;
use shepherd_provider::{Provider, ProviderError, Rebooter};

/// Attempts per request.
const ATTEMPTS: u32 = 4;

fn retries(timeout: Duration) -> RetryPolicy {
    let ms = Duration::from_millis;
    RetryPolicy::new(ATTEMPTS, ms(50), ms(200), timeout)
}

async fn provider_at(url: &str, timeout: Duration) -> Result<Arc<IronicProvider>, ConnectError> {
    test_provider(url, Auth::None, retries(timeout), test_config("site-a")).await
}

/// A provider for the Ironic at `url` (attempts bounded by `timeout`) and a fresh BMDB.
async fn provider_and_bmdb(url: &str, timeout: Duration) -> (Arc<IronicProvider>, testing::TestDb) {
    let p = provider_at(url, timeout).await.expect("a provider");
    (p, testing::sqlite().await)
}

async fn session(db: &Bmdb) -> Session {
    testing::session(db, Processor::ShepherdProvisioner).await
}

#[tokio::test]
async fn unavailable_and_slow_answers_are_retried_within_bounds_and_nothing_is_created_meanwhile() {
    let _turn = crate::beside_each_other().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic.fake_nodes(3, |_| json!({})).await;
    let proxy = FaultProxy::start(&ironic).await;
    // Two providers of one proxy: `p` gives each attempt 30 s (no answer of a working Ironic
    // takes that long, however busy the machine), `impatient` 250 ms, a twelfth of the slow
    // answers below (3 s), so that every attempt of it times out.
    const SLOW_ANSWER: Duration = Duration::from_secs(3);
    let p = provider_at(&proxy.url(), Duration::from_secs(30))
        .await
        .unwrap();
    let impatient = provider_at(&proxy.url(), SLOW_ANSWER / 12).await.unwrap();
    let t = testing::sqlite().await;
    let s = session(&t.db).await;

    // Two 503s: the listing is retried and the pass goes through.
    proxy.faults.unavailable.store(2, SeqCst);
    let r = provisioner(p.clone(), 50).iterate(&s).await.unwrap();
    assert_eq!(r.created, 3, "{r:?}");
    assert_eq!(
        proxy.faults.unavailable.load(SeqCst),
        0,
        "both 503s were seen"
    );

    // Answers slower than the attempt timeout, every time: the pass fails after its bounded
    // attempts, and nothing changes at Ironic or in the BMDB.
    let more = ironic.fake_nodes(1, |_| json!({})).await;
    proxy
        .faults
        .delay_ms
        .store(SLOW_ANSWER.as_millis() as u64, SeqCst);
    let listings = || proxy.seen("/v1/nodes?");
    let before = listings();
    let err = provisioner(impatient, 50).iterate(&s).await.unwrap_err();
    assert!(format!("{err:#}").contains("transport"), "{err:#}");
    assert_eq!(
        listings() - before,
        ATTEMPTS as usize,
        "bounded: the listing is tried as often as the policy says, no more"
    );
    assert_eq!(recorded(&t.db).await.len(), 3);
    assert!(ironic.node(&more[0]).await["instance_uuid"].is_null());
    // Back to normal: the next pass brings the new node in.
    proxy.faults.delay_ms.store(0, SeqCst);
    let r = provisioner(p.clone(), 50).iterate(&s).await.unwrap();
    assert_eq!((r.created, r.managed), (1, 3), "{r:?}");
    for id in nodes.iter().chain(&more) {
        ironic.wait_for_state(id, "active").await;
        assert_eq!(ironic.deploys_started(id).await, 1);
    }

    // NodeLocked on the power request: retried with backoff, then the reboot goes through.
    proxy.faults.node_locked.store(2, SeqCst);
    let m = p.get_machine(&nodes[0]).await.unwrap();
    p.reboot(&s.lease(), &m).await.unwrap();
    assert_eq!(
        proxy.seen("/states/power"),
        3,
        "two NodeLocked answers, then the reboot"
    );
    // More NodeLocked answers than attempts: the reboot fails, with Ironic's words.
    proxy.faults.node_locked.store(10, SeqCst);
    let err = p.reboot(&s.lease(), &m).await.unwrap_err();
    assert!(err.to_string().contains("is locked by host"), "{err}");
    s.close().await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn the_api_down_at_start_up_fails_clearly_and_down_mid_run_changes_nothing() {
    let _turn = crate::beside_each_other().await;
    // Nobody listens: start-up fails after its bounded attempts, saying so.
    let closed = format!(
        "127.0.0.1:{}",
        shepherd_loops::testing::free_loopback_port()
    );
    let started = Instant::now();
    let err = match provider_at(&format!("http://{closed}"), Duration::from_secs(2)).await {
        Err(e) => e,
        Ok(_) => panic!("connected to nothing"),
    };
    assert!(
        matches!(err, ConnectError::Api(ApiError::Connect(_))),
        "{err}"
    );
    // With its causes, as `shepherd run` prints it.
    let err = anyhow::Error::from(err);
    assert!(format!("{err:#}").contains("cannot connect"), "{err:#}");
    assert!(started.elapsed() < Duration::from_secs(10));

    let mut ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic.fake_nodes(2, |_| json!({})).await;
    let (p, t) = provider_and_bmdb(&ironic.url(), Duration::from_secs(5)).await;
    let s = session(&t.db).await;
    ironic.stop();
    let err = provisioner(p.clone(), 50).iterate(&s).await.unwrap_err();
    assert!(format!("{err:#}").contains("cannot connect"), "{err:#}");
    assert!(recorded(&t.db).await.is_empty());
    // The updater does not mark anything Missing for an API that is down.
    Updater::new(p.clone(), RateSpec::new(Duration::from_millis(1), 1))
        .iterate(&s)
        .await
        .unwrap_err();
    ironic.restart().await;
    let r = provisioner(p.clone(), 50).iterate(&s).await.unwrap();
    assert_eq!(r.created, 2, "{r:?}");
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
        assert_eq!(ironic.deploys_started(id).await, 1);
    }
    s.close().await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn a_failed_deploy_is_a_failed_machine_with_ironics_last_error_and_a_refused_one_is_released()
{
    let _turn = crate::beside_each_other().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    // A node whose deploy Ironic starts and then fails: a ramdisk deploy over PXE whose
    // kernel cannot be fetched.
    let failing = ironic
        .enroll(json!({
            "driver": "fake-hardware", "resource_class": "shepherd-test",
            "deploy_interface": "ramdisk", "boot_interface": "pxe",
            "driver_info": {"deploy_kernel": "http://127.0.0.1:1/k", "deploy_ramdisk": "http://127.0.0.1:1/r"},
            "instance_info": {"kernel": "http://127.0.0.1:1/k", "ramdisk": "http://127.0.0.1:1/r"},
        }))
        .await;
    ironic.add_port(&failing, "52:54:00:12:34:56").await;
    // A node whose deploy Ironic refuses outright (its boot interface cannot boot a ramdisk).
    let refused = ironic
        .enroll(json!({
            "driver": "fake-hardware", "resource_class": "shepherd-test",
            "deploy_interface": "ramdisk", "boot_interface": "fake",
        }))
        .await;
    let both = [failing.clone(), refused.clone()];
    ironic.provision_all(&both, "manage", "manageable").await;
    ironic.provision_all(&both, "provide", "available").await;
    ironic.power_off(&both).await;

    let (p, t) = provider_and_bmdb(&ironic.url(), Duration::from_secs(10)).await;
    let s = session(&t.db).await;
    // Just after `provide`, Ironic's conductor may still hold a node locked; its allocation
    // then fails as busy and the claim is tried again by the next pass (counted as deferred).
    let (mut created, mut refusals) = (0, 0);
    for _ in 0..10 {
        let r = match provisioner(p.clone(), 50).iterate(&s).await {
            Ok(r) => r,
            // A conductor still busy with the failing node's deploy may leave the other
            // node's allocation unplaced past the provider's wait (seen once on CI).
            Err(e) => match stopped_unplaced(&e) {
                Some(c) => {
                    created += c;
                    continue;
                }
                None => panic!("{e}; Ironic: {}", ironic.log_tail()),
            },
        };
        assert_eq!(r.failed, 0, "{r:?}");
        (created, refusals) = (created + r.created, refusals + r.refused);
        if created + refusals == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!((created, refusals), (1, 1));
    ironic.wait_for_failure(&failing, "deploy failed").await;

    // The failed deploy: the machine is failed at the provider, with Ironic's last_error.
    let m = p.get_machine(&failing).await.unwrap();
    assert!(m.failed);
    let cause = m.cause.unwrap();
    assert!(
        cause.contains("deploy failed") && cause.contains("127.0.0.1:1/k"),
        "{cause}"
    );
    Updater::new(p.clone(), RateSpec::new(Duration::from_millis(1), 1))
        .iterate(&s)
        .await
        .unwrap();
    assert_eq!(
        recorded(&t.db).await.into_iter().collect::<Vec<_>>(),
        vec![(
            failing.clone(),
            Some(ProviderStatus::ProvisioningFailedPermanent)
        )]
    );
    // The refused one was given back.
    let node = ironic.node(&refused).await;
    assert!(node["instance_uuid"].is_null(), "released: {node}");
    assert!(node["extra"].get("shepherd_deployment").is_none(), "{node}");
    // (Its skip, shared by every replica: over_real_ironic.rs, a_refused_deploy_is_skipped….)
    s.close().await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn a_node_reserved_and_deployed_whose_insert_failed_is_adopted_not_deployed_again() {
    let _turn = crate::beside_each_other().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic.fake_nodes(2, |_| json!({})).await;
    let (p, t) = provider_and_bmdb(&ironic.url(), Duration::from_secs(10)).await;

    // The session's row is gone (deleted behind its back, as another replica's garbage
    // collection would after a partition) while its lease still holds here: Ironic reserves
    // and deploys the first node, then its insert fails. That failure ends the lease here, so
    // the second creation takes no step at Ironic.
    let s = session(&t.db).await;
    let listed = p.list_machines().await.unwrap();
    let id = s.id();
    t.db.transact(move |tx| Box::pin(async move { tx.delete_session_raw(id).await }))
        .await
        .unwrap();
    let err = p.create_machine(&s, &listed[0]).await.unwrap_err();
    assert!(err.is_bmdb_failure(), "{err}");
    assert!(err.to_string().contains("a later pass adopts it"), "{err}");
    let fenced = p.create_machine(&s, &listed[1]).await.unwrap_err();
    assert!(matches!(fenced, ProviderError::LeaseLost(_)), "{fenced}");
    assert!(recorded(&t.db).await.is_empty());
    let first = listed[0].reservation.clone().unwrap();
    ironic.wait_for_state(&first, "active").await;
    let second = ironic
        .node(nodes.iter().find(|n| **n != first).unwrap())
        .await;
    assert!(second["instance_uuid"].is_null(), "untouched: {second}");
    // The next pass, with a live session, adopts the first and creates the second: both
    // recorded, each deployed once.
    let s = session(&t.db).await;
    let r = provisioner(p.clone(), 50).iterate(&s).await.unwrap();
    assert_eq!((r.created, r.failed), (2, 0), "{r:?}");
    assert_eq!(recorded(&t.db).await.len(), 2);
    for id in &nodes {
        ironic.assert_deployed_once(id).await;
    }
    s.close().await.unwrap();
    t.cleanup().await;
}
