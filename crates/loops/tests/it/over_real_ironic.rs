//! The Ironic provider against a real, standalone Ironic on loopback (fake-hardware nodes):
//! reservation, deploy with a config drive, orphans adopted without a second deploy, nodes of
//! other clients left alone, maintenance, reboot, refused credentials.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use shepherd_bmdb::{testing, Bmdb, Processor, ProviderKind, ProviderStatus, Session};
use shepherd_ironic::testing::{
    recorded, site, test_config, test_provider, FaultProxy, IronicServer, TestAuth,
};
use shepherd_ironic::{
    ApiError, Auth, Client, ConnectError, IronicConfig, IronicError, IronicProvider, RetryPolicy,
};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{
    IterationReport, Provisioner, ProvisionerConfig, ProvisionerError,
};
use shepherd_loops::reconcile::Limits;
use shepherd_loops::testing::{unpaced_parallel_provisioner, unpaced_provisioner as provisioner};
use shepherd_loops::updater::Updater;
use shepherd_provider::metrics::CallMetrics;
use shepherd_provider::{Provider, ProviderError, ProviderMachine, Rebooter};

/// Holds one test's turn: the tests of this file run one at a time, and with no other
/// turn-taking test of the crate ([`crate::alone`]). Each starts its own
/// Ironic, whose conductor on SQLite fails work with "database is locked" when the machine
/// is starved (an allocation left `allocating` for good), which says nothing of Shepherd.
async fn one_at_a_time() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    crate::alone().await
}

fn quick_retries() -> RetryPolicy {
    let ms = Duration::from_millis;
    RetryPolicy::new(3, ms(50), ms(200), ms(20_000))
}

fn config(deployment: &str) -> IronicConfig {
    test_config(deployment)
}

async fn provider(ironic: &IronicServer, config: IronicConfig) -> Arc<IronicProvider> {
    let url = ironic.url();
    test_provider(&url, ironic.auth(), quick_retries(), config)
        .await
        .unwrap()
}

async fn session(db: &Bmdb) -> Session {
    testing::session(db, Processor::ShepherdProvisioner).await
}

#[tokio::test]
async fn available_nodes_are_reserved_deployed_once_with_our_key_and_recorded() {
    let _one = one_at_a_time().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic
        .fake_nodes(
            5,
            |i| json!({"ssh_address": format!("127.0.0.1:{}", 2200 + i)}),
        )
        .await;
    // A node of another resource class is not ours to take.
    let other = ironic
        .enroll(json!({"driver": "fake-hardware", "resource_class": "someone-else"}))
        .await;
    ironic
        .provision_all(std::slice::from_ref(&other), "manage", "manageable")
        .await;
    ironic
        .provision_all(std::slice::from_ref(&other), "provide", "available")
        .await;

    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    let p = provider(&ironic, config("site-a")).await;
    let report = iterate_placing(&provisioner(p.clone(), 3), &s).await;
    assert_eq!((report.created, report.failed), (3, 0), "{report:?}");
    let report = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!((report.created, report.managed), (2, 3), "{report:?}");

    let seen = recorded(&t.db).await;
    assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), {
        let mut n = nodes.clone();
        n.sort();
        n
    });
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
        let node = ironic.node(id).await;
        assert_eq!(node["extra"]["shepherd_deployment"], "site-a");
        assert!(node["instance_uuid"].is_string());
        assert_eq!(
            ironic.deploys_started(id).await,
            1,
            "node {id} deployed once"
        );
        let stored = ironic.stored_instance_info(id);
        assert_eq!(
            stored["configdrive"]["meta_data"]["public_keys"]["shepherd"],
            shepherd_ironic::testing::TEST_KEY,
            "the config drive Ironic stored for {id} carries Shepherd's key: {stored}"
        );
        // The instance's id, not the node's: a redeploy is a new instance to cloud-init.
        assert_eq!(
            stored["configdrive"]["meta_data"]["uuid"], node["instance_uuid"],
            "{stored}"
        );
    }
    let other_node = ironic.node(&other).await;
    assert_eq!(other_node["provision_state"], "available");
    assert!(other_node["instance_uuid"].is_null());

    // The node's hardware facts are recorded with it.
    let facts_of = |id: String| {
        let db = t.db.clone();
        async move {
            testing::provided_by(&db, shepherd_bmdb::ProviderKind::Ironic)
                .await
                .into_iter()
                .find(|(_, p)| p.provider_id == id)
                .map(|(_, p)| p.facts)
                .unwrap()
        }
    };
    let facts = facts_of(nodes[2].clone()).await;
    assert_eq!(
        facts.get("resource_class"),
        Some("shepherd-test"),
        "{facts:?}"
    );
    assert_eq!(facts.get("driver"), Some("fake-hardware"), "{facts:?}");
    assert_eq!(facts.get("cpus"), Some("4"), "{facts:?}");
    assert_eq!(facts.get("memory_mb"), Some("8192"), "{facts:?}");
    // An administrator changes the node's properties (a DIMM added) at Ironic.
    ironic
        .patch_node(
            &nodes[2],
            json!([{"op": "replace", "path": "/properties/memory_mb", "value": 16384}]),
        )
        .await;

    // Addresses come from the named field; the updater sees them deployed and running, and
    // refreshes the hardware facts.
    let machine = p.get_machine(&nodes[2]).await.unwrap();
    assert_eq!(machine.addr.as_deref(), Some("127.0.0.1:2202"));
    Updater::new(p.clone(), RateSpec::new(Duration::from_millis(1), 1))
        .iterate(&s)
        .await
        .unwrap();
    assert!(recorded(&t.db)
        .await
        .values()
        .all(|s| *s == Some(ProviderStatus::Running)));
    let facts = facts_of(nodes[2].clone()).await;
    assert_eq!(facts.get("memory_mb"), Some("16384"), "{facts:?}");
    assert_eq!(facts.get("cpus"), Some("4"), "{facts:?}");
    s.close().await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn orphans_are_adopted_without_a_second_deploy_and_other_clients_nodes_are_left_alone() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(4, quick_retries()).await;

    // nodes[0]: reserved and deployed by this deployment, but its BMDB insert never happened.
    // nodes[1]: reserved by this deployment, the replica died before asking for the deploy.
    // nodes[2]: reserved by another client (no deployment of ours).
    // nodes[3]: another deployment of Shepherd.
    let reserve = |id: &String, deployment: Option<&str>| {
        let mut ops = vec![json!({"op": "add", "path": "/instance_uuid", "value": uuid_v4()})];
        if let Some(d) = deployment {
            // As a replica of that deployment reserves: its id and when.
            ops.push(json!({"op": "add", "path": "/extra/shepherd_deployment", "value": d}));
            ops.push(json!({"op": "add", "path": "/extra/shepherd_reserved_at", "value": chrono::Utc::now().to_rfc3339()}));
        }
        (format!("/v1/nodes/{id}"), serde_json::Value::Array(ops))
    };
    for (id, deployment) in [
        (&nodes[0], Some("site-a")),
        (&nodes[1], Some("site-a")),
        (&nodes[2], None),
        (&nodes[3], Some("site-b")),
    ] {
        let (path, ops) = reserve(id, deployment);
        let (status, body) = ironic.send_json(reqwest::Method::PATCH, &path, ops).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = ironic
        .send_json(
            reqwest::Method::PUT,
            &format!("/v1/nodes/{}/states/provision", nodes[0]),
            json!({"target": "active"}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    ironic.wait_for_state(&nodes[0], "active").await;

    // Within the grace period they may be another replica's creations in progress: skipped.
    let mut patient = config("site-a");
    patient.orphan_grace = Duration::from_secs(600);
    let report = provisioner(provider(&ironic, patient).await, 10)
        .iterate(&s)
        .await
        .unwrap();
    assert_eq!(
        (report.created, report.taken, report.failed),
        (0, 2, 0),
        "orphans changed moments ago are left to their creator: {report:?}"
    );
    let report = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!(
        (report.created, report.failed),
        (2, 0),
        "both orphans adopted: {report:?}"
    );
    let seen = recorded(&t.db).await;
    let mut want = vec![nodes[0].clone(), nodes[1].clone()];
    want.sort();
    assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), want);
    ironic.wait_for_state(&nodes[1], "active").await;
    assert_eq!(
        ironic.deploys_started(&nodes[0]).await,
        1,
        "the deployed orphan is not deployed again"
    );
    assert_eq!(
        ironic.deploys_started(&nodes[1]).await,
        1,
        "the reserved orphan is deployed once"
    );
    for other in &nodes[2..] {
        let node = ironic.node(other).await;
        assert_eq!(node["provision_state"], "available", "{other} left alone");
        assert_eq!(ironic.deploys_started(other).await, 0);
    }
    // Passes after that change nothing.
    let report = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!(
        (report.created, report.adopted, report.managed),
        (0, 0, 2),
        "{report:?}"
    );

    // A second Shepherd replica of the same deployment racing for the same node: Ironic's
    // compare-and-set on instance_uuid lets one win.
    s.close().await.unwrap();
    t.cleanup().await;
}

fn uuid_v4() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Two replicas of one deployment, each working through the same listing of 12 nodes at once:
/// each node is created by one and refused to the other, allocated once and deployed once.
/// Ironic keeps its database in Postgres here, as production Ironics do: the test Ironic on
/// SQLite fails concurrent writes now and then ("database is locked"), which would fail claims
/// for a reason that is the test setup's, not Shepherd's.
#[tokio::test]
async fn two_replicas_racing_for_the_same_nodes_deploy_each_node_once() {
    let _one = one_at_a_time().await;
    let Some(url) = testing::fresh_postgres_database().await else {
        return;
    };
    let ironic = IronicServer::start_on_postgres(TestAuth::None, &url).await;
    let nodes = ironic.fake_nodes(12, |_| json!({})).await;
    let t = testing::sqlite().await;
    let (a, b) = (
        provider(&ironic, config("site-a")).await,
        provider(&ironic, config("site-a")).await,
    );
    let (sa, sb) = (session(&t.db).await, session(&t.db).await);
    // Each replica lists the nodes before the other takes any, then both create every one.
    let (la, lb) = (
        a.list_machines().await.unwrap(),
        b.list_machines().await.unwrap(),
    );
    let creations = |p: Arc<IronicProvider>, s: Session, listed: Vec<ProviderMachine>| async move {
        let mut results = Vec::new();
        for m in &listed {
            results.push(p.create_machine(&s, m).await);
        }
        (results, s)
    };
    let ((ra, sa), (rb, sb)) = tokio::join!(creations(a, sa, la), creations(b, sb, lb));
    let taken = ra
        .iter()
        .chain(&rb)
        .filter(|r| matches!(r, Err(ProviderError::Taken(_) | ProviderError::NotYet(_))))
        .count();
    let created = ra.iter().chain(&rb).filter(|r| r.is_ok()).count();
    let other: Vec<_> = ra
        .iter()
        .chain(&rb)
        .filter_map(|r| match r {
            Err(ProviderError::Taken(_) | ProviderError::NotYet(_)) | Ok(_) => None,
            Err(e) => Some(e.to_string()),
        })
        .collect();
    assert!(
        other.is_empty(),
        "no other failures: {other:?}\n{}",
        ironic.log_tail()
    );
    assert_eq!(
        (created, taken),
        (12, 12),
        "each node created by one replica, refused to the other"
    );
    assert_eq!(recorded(&t.db).await.len(), 12);
    // Each node held by one allocation, named after the deployment and the node.
    let held = allocations(&ironic).await;
    assert_eq!(held.len(), 12, "{held:?}");
    for id in &nodes {
        let name = shepherd_ironic::provider::allocation_name("site-a", id);
        assert_eq!(held[&name]["node_uuid"], id.as_str());
    }
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
        assert_eq!(ironic.deploys_started(id).await, 1, "node {id}");
    }
    sa.close().await.unwrap();
    sb.close().await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn maintenance_is_marked_and_never_power_cycled_and_reboots_go_through_ironic() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(2, quick_retries()).await;
    iterate_placing(&provisioner(p.clone(), 10), &s).await;
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
    }
    ironic
        .set_maintenance(&nodes[0], true, "fan replaced")
        .await;
    Updater::new(p.clone(), RateSpec::new(Duration::from_millis(1), 1))
        .iterate(&s)
        .await
        .unwrap();
    let seen = recorded(&t.db).await;
    assert_eq!(seen[&nodes[0]], Some(ProviderStatus::Maintenance));
    assert_eq!(seen[&nodes[1]], Some(ProviderStatus::Running));

    let in_maintenance = p.get_machine(&nodes[0]).await.unwrap();
    let err = p.reboot(&s.lease(), &in_maintenance).await.unwrap_err();
    assert!(
        err.to_string().contains("maintenance") && err.to_string().contains("fan replaced"),
        "{err}"
    );
    let before = ironic.node(&nodes[0]).await;

    let healthy = p.get_machine(&nodes[1]).await.unwrap();
    p.reboot(&s.lease(), &healthy).await.unwrap();
    assert_eq!(
        ironic.node(&nodes[0]).await["power_state"],
        before["power_state"]
    );
    // Gone from Ironic: not found, and the updater marks it Missing.
    let (status, _) = ironic
        .send_json(
            reqwest::Method::DELETE,
            &format!("/v1/nodes/{}/maintenance", nodes[0]),
            json!({}),
        )
        .await;
    assert_eq!(status, 202);
    s.close().await.unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn credentials_are_checked_at_start_up_and_the_password_is_never_shown() {
    let _one = one_at_a_time().await;
    let ironic = IronicServer::start(TestAuth::Basic {
        user: "shepherd".into(),
        password: "correct horse".into(),
    })
    .await;
    ironic.fake_nodes(1, |_| json!({})).await;
    let metrics = Arc::new(CallMetrics::default());
    let wrong = Client::new(
        &ironic.url(),
        Auth::Basic {
            user: "shepherd".into(),
            password: "battery staple".into(),
        },
        quick_retries(),
        metrics.clone(),
    )
    .unwrap();
    let err = match IronicProvider::connect(wrong, config("site-a")).await {
        Err(e) => e,
        Ok(_) => panic!("a wrong password was accepted"),
    };
    assert!(
        matches!(err, ConnectError::Api(ApiError::Unauthorized { .. })),
        "{err}"
    );
    // With its causes, as `shepherd run` prints it.
    let said = format!("{:#}", anyhow::Error::from(err));
    assert!(said.contains("refused the credentials"), "{said}");
    assert_eq!(
        said.matches("refused the credentials").count(),
        1,
        "said once: {said}"
    );
    assert!(!said.contains("battery"), "{said}");
    // Not retried: one attempt of the call Ironic refused (a retrying client would have made
    // `quick_retries`' three, whatever the time they took).
    let refused = metrics.count("list_nodes", shepherd_provider::metrics::CallResult::Error);
    assert_eq!(refused, 1, "a refused credential is not retried");
    let none = Client::new(&ironic.url(), Auth::None, quick_retries(), metrics).unwrap();
    assert!(IronicProvider::connect(none, config("site-a"))
        .await
        .is_err());

    let p = provider(&ironic, config("site-a")).await;
    let listed = p.list_machines().await.unwrap();
    assert_eq!(listed.len(), 1);
}

#[tokio::test]
async fn decommissioned_nodes_are_released_and_torn_down_only_when_asked() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(2, quick_retries()).await;
    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!(r.created, 2, "{r:?}");
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
    }
    let machines: std::collections::BTreeMap<String, uuid::Uuid> =
        testing::provided_by(&t.db, ProviderKind::Ironic)
            .await
            .into_iter()
            .map(|(m, p)| (p.provider_id, m))
            .collect();
    let operator = testing::session(&t.db, Processor::ShepherdOperator).await;
    let who = shepherd_bmdb::Operator::new("alice", "rack moved").unwrap();
    operator
        .decommission(machines[&nodes[0]], &who, false)
        .await
        .unwrap();
    operator
        .decommission(machines[&nodes[1]], &who, true)
        .await
        .unwrap();

    // A replica whose session has ended hands nothing back: the release is not asked for, and
    // the refused step is counted.
    let ended = session(&t.db).await;
    let lease = ended.lease();
    ended.close().await.unwrap();
    let machine = p.get_machine(&nodes[1]).await.unwrap();
    let refused = p.hand_back(&lease, &machine, true).await.unwrap_err();
    assert!(matches!(refused, ProviderError::LeaseLost(_)), "{refused}");
    let fenced =
        t.db.metrics()
            .steps_fenced(Processor::ShepherdProvisioner, "release node");
    assert_eq!(fenced, 1);
    let untouched = ironic.node(&nodes[1]).await;
    assert_eq!(untouched["provision_state"], "active", "{untouched}");
    assert!(!untouched["instance_uuid"].is_null(), "{untouched}");

    // Passes hand both back: the first only released (still deployed: our marks removed,
    // while its allocation stays until the node is torn down, as Ironic will not end the
    // allocation of an active node), the second torn down by Ironic, which ends its
    // allocation; neither is taken again.
    let mut handed_back = 0;
    testing::eventually(
        "both nodes handed back",
        Duration::from_secs(60),
        async || {
            let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
            assert_eq!(r.created, 0, "a decommissioned node was taken again: {r:?}");
            handed_back += r.handed_back;
            let (kept, torn) = (ironic.node(&nodes[0]).await, ironic.node(&nodes[1]).await);
            let released =
                |n: &serde_json::Value| n["instance_uuid"].is_null() && n["extra"] == json!({});
            let unmarked = kept["extra"] == json!({});
            if unmarked && released(&torn) && torn["provision_state"] == "available" {
                Ok(())
            } else {
                let brief = |n: &serde_json::Value| {
                    format!(
                        "{} instance {} extra {} last_error {}",
                        n["provision_state"], n["instance_uuid"], n["extra"], n["last_error"]
                    )
                };
                Err((brief(&kept), brief(&torn)))
            }
        },
    )
    .await;
    assert_eq!(handed_back, 2);
    let kept = ironic.node(&nodes[0]).await;
    assert_eq!(kept["provision_state"], "active");
    let name = shepherd_ironic::provider::allocation_name("site-a", &nodes[0]);
    let (status, allocation) = ironic
        .get(&format!("/v1/allocations/{name}"))
        .await
        .unwrap();
    assert_eq!(status, 200, "{allocation}");
    assert_eq!(
        allocation["uuid"], kept["instance_uuid"],
        "the active node keeps its allocation"
    );
    let name = shepherd_ironic::provider::allocation_name("site-a", &nodes[1]);
    let (status, _) = ironic
        .get(&format!("/v1/allocations/{name}"))
        .await
        .unwrap();
    assert_eq!(status, 404, "tearing the node down ended its allocation");
    assert_eq!(ironic.deploys_started(&nodes[1]).await, 1);
    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!((r.created, r.decommissioned), (0, 1), "{r:?}");
    assert!(recorded(&t.db).await.is_empty());
    operator.close().await.unwrap();
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A node on Ironic's `direct` deploy interface writes an image, so a start without
/// `--ironic-image` is refused at once, naming the flag; with an image it starts.
#[tokio::test]
async fn a_direct_deploy_node_without_an_image_is_refused_at_start_up() {
    let _one = one_at_a_time().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    let client = || {
        let metrics = Arc::new(CallMetrics::default());
        Client::new(&ironic.url(), Auth::None, quick_retries(), metrics).unwrap()
    };
    // One node as the fake deploy leaves it, one on `direct`.
    let nodes = ironic.fake_nodes(2, |_| json!({})).await;
    let direct = json!([{"op": "replace", "path": "/deploy_interface", "value": "direct"}]);
    ironic.patch_node(&nodes[1], direct).await;
    let refused = IronicProvider::connect(client(), config("site-a")).await;
    let err = refused
        .err()
        .expect("started without an image for a direct-deploy node");
    let said = format!("{:#}", anyhow::Error::from(err));
    assert!(said.contains("ironic-image"), "{said}");
    assert!(
        said.contains(&nodes[1]) && said.contains("\"direct\""),
        "{said}"
    );
    let mut with_image = config("site-a");
    with_image.image = Some(shepherd_ironic::Image {
        url: "http://127.0.0.1:1/image.raw".into(),
        checksum: "0123456789abcdef0123456789abcdef".into(),
    });
    IronicProvider::connect(client(), with_image)
        .await
        .expect("with an image it starts");

    // --ironic-image-from-node: refused while the node names no image, naming the remedy;
    // once the operator sets one in its instance_info it starts, and a claim leaves it be.
    let mut from_node = config("site-a");
    from_node.image_from_node = true;
    let err = IronicProvider::connect(client(), from_node.clone())
        .await
        .err()
        .expect("started for a direct-deploy node that names no image");
    let said = format!("{:#}", anyhow::Error::from(err));
    assert!(
        said.contains("ironic-image-from-node") && said.contains("instance_info"),
        "{said}"
    );
    let image = json!([
        {"op": "add", "path": "/instance_info/image_source", "value": "http://127.0.0.1:1/node.raw"},
        {"op": "add", "path": "/instance_info/image_checksum", "value": "fedcba9876543210fedcba9876543210"},
    ]);
    ironic.patch_node(&nodes[1], image).await;
    let p = Arc::new(
        IronicProvider::connect(client(), from_node)
            .await
            .expect("with the node's own image it starts"),
    );
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    let r = iterate_placing(&provisioner(p, 10), &s).await;
    assert_eq!((r.created, r.failed), (2, 0), "{r:?}");
    let node = ironic.node(&nodes[1]).await;
    assert_eq!(
        node["instance_info"]["image_source"], "http://127.0.0.1:1/node.raw",
        "the node's own image is the one deployed: {node}"
    );
    s.close().await.unwrap();
    t.cleanup().await;
}

/// What a provisioner pass created before an allocation Ironic left unplaced past the
/// provider's wait stopped it, if that is what stopped it. A busy conductor (another node's
/// deploy, a loaded CI machine) does that: the pass stops as Ironic unavailable, the
/// allocation is deleted, and the next pass claims the node again.
pub(crate) fn stopped_unplaced(error: &ProvisionerError) -> Option<usize> {
    match error {
        ProvisionerError::ProviderUnavailable {
            created,
            error: ProviderError::Unavailable(failure),
        } if matches!(
            failure.downcast_ref::<IronicError>(),
            Some(IronicError::AllocationStuck { .. })
        ) =>
        {
            Some(*created)
        }
        _ => None,
    }
}

/// Passes of `provisioner` until one is not stopped by an unplaced allocation
/// ([`stopped_unplaced`]), at most ten: the last pass's report, counting what each created.
async fn iterate_placing<P: Provider>(
    provisioner: &Provisioner<P>,
    s: &Session,
) -> IterationReport {
    let mut created = 0;
    for _ in 0..10 {
        match provisioner.iterate(s).await {
            Ok(mut r) => {
                r.created += created;
                return r;
            }
            Err(e) => created += stopped_unplaced(&e).unwrap_or_else(|| panic!("{e}")),
        }
    }
    panic!("ten passes in a row stopped by allocations Ironic did not place");
}

/// Deletes node `id` from Ironic, as an operator would (maintenance first: Ironic deletes a
/// deployed node only then).
async fn delete_node(ironic: &IronicServer, id: &str) {
    ironic.set_maintenance(id, true, "retired").await;
    let path = format!("/v1/nodes/{id}");
    let (status, body) = ironic
        .send_json(reqwest::Method::DELETE, &path, json!(null))
        .await;
    assert_eq!(status, 204, "deleting {id}: {body}");
}

/// An operator deletes one of the nodes Shepherd holds: the provisioner's passes go on
/// bringing the other nodes in (the deleted one counted missing) instead of halting. Two
/// deleted of five is more than the default allowance: the pass refuses, naming the remedy.
#[tokio::test]
async fn a_held_node_deleted_at_ironic_stops_nothing_else() {
    let _one = one_at_a_time().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    let held = ironic.fake_nodes(3, |_| json!({})).await;
    let p = provider(&ironic, config("site-a")).await;
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    let r = iterate_placing(&provisioner(p.clone(), 50), &s).await;
    assert_eq!(r.created, 3, "{r:?}\n{}", ironic.log_tail());
    ironic.wait_for_state(&held[0], "active").await;
    delete_node(&ironic, &held[0]).await;
    let fresh = ironic.fake_nodes(2, |_| json!({})).await;
    let r = iterate_placing(&provisioner(p.clone(), 50), &s).await;
    assert_eq!((r.created, r.missing, r.managed), (2, 1, 2), "{r:?}");
    let recorded_now = recorded(&t.db).await;
    for id in &fresh {
        assert!(
            recorded_now.contains_key(id),
            "{id} brought in: {recorded_now:?}"
        );
    }
    // An operator deletes a second node: two of five recorded machines missing at once is
    // more than the default allows (10 %, and always one): the listing looks broken, nothing
    // is done.
    delete_node(&ironic, &held[1]).await;
    let last = ironic.fake_nodes(1, |_| json!({})).await;
    let err = provisioner(p.clone(), 50).iterate(&s).await.err();
    let err = err.expect("two of five missing refused").to_string();
    assert!(
        err.contains("2 of 5") && err.contains("decommission"),
        "{err}"
    );
    assert!(!recorded(&t.db).await.contains_key(&last[0]));
    // With an allowance of two (`--provisioner-max-missing 2`) the pass goes on.
    let mut limits = Limits::new(0, 50);
    limits.max_missing = "2".parse().unwrap();
    let unpaced = RateSpec::new(Duration::from_millis(1), 1000);
    let config = ProvisionerConfig {
        limits,
        reconcile_rate: unpaced,
        creation_rate: unpaced,
        creation_parallelism: 1,
    };
    let allowing_two = Provisioner::new(p.clone(), config);
    let r = iterate_placing(&allowing_two, &s).await;
    assert_eq!((r.created, r.missing), (1, 2), "{r:?}");
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A provider whose calls are counted in the returned metrics.
async fn counted_provider(
    ironic: &IronicServer,
    config: IronicConfig,
) -> (Arc<IronicProvider>, Arc<CallMetrics>) {
    let metrics = Arc::new(CallMetrics::default());
    let client = Client::new(
        &ironic.url(),
        ironic.auth(),
        quick_retries(),
        metrics.clone(),
    )
    .unwrap();
    let p = IronicProvider::connect(client, config).await.unwrap();
    (Arc::new(p), metrics)
}

/// Every allocation Ironic holds, by name.
async fn allocations(
    ironic: &IronicServer,
) -> std::collections::BTreeMap<String, serde_json::Value> {
    let (status, body) = ironic.get("/v1/allocations").await.unwrap();
    assert_eq!(status, 200, "{body}");
    body["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["name"].as_str().unwrap_or_default().to_string(),
                a.clone(),
            )
        })
        .collect()
}

/// Creates an allocation as another client (or a replica that stopped) would, and waits until
/// Ironic has placed it or failed it.
async fn allocate_by_hand(ironic: &IronicServer, body: serde_json::Value) -> serde_json::Value {
    let (status, created) = ironic
        .send_json(reqwest::Method::POST, "/v1/allocations", body)
        .await;
    assert_eq!(status, 201, "{created}");
    let id = created["uuid"].as_str().unwrap().to_string();
    testing::eventually(
        "the allocation placed",
        Duration::from_secs(30),
        async || {
            let (_, a) = ironic.get(&format!("/v1/allocations/{id}")).await.unwrap();
            if a["state"] == "allocating" {
                Err(a)
            } else {
                Ok(a)
            }
        },
    )
    .await
}

/// Claims go through Ironic's Allocation API: an allocation per node, named after the
/// deployment and the node, with the selector's traits, visible in Ironic; the node's instance
/// is the allocation. A failed allocation of ours left behind is deleted and the node claimed
/// on the next pass; nodes without the traits are not taken.
#[tokio::test]
async fn claims_go_through_named_allocations_with_traits_and_failed_ones_are_cleaned() {
    let _one = one_at_a_time().await;
    let ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic.fake_nodes(3, |_| json!({})).await;
    for id in &nodes[..2] {
        let (status, body) = ironic
            .send_json(
                reqwest::Method::PUT,
                &format!("/v1/nodes/{id}/traits/CUSTOM_GPU"),
                json!(null),
            )
            .await;
        assert_eq!(status, 204, "{body}");
    }
    // A claim of nodes[1] that failed earlier and was left behind under our name.
    let leftover = allocate_by_hand(
        &ironic,
        json!({
            "name": shepherd_ironic::provider::allocation_name("site-a", &nodes[1]),
            "resource_class": "no-such-class",
            "candidate_nodes": [nodes[1]],
        }),
    )
    .await;
    assert_eq!(leftover["state"], "error", "{leftover}");

    let mut gpu = config("site-a");
    gpu.selector.traits = vec!["CUSTOM_GPU".into()];
    let (p, metrics) = counted_provider(&ironic, gpu).await;
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    // The first pass claims nodes[0] and deletes the failed allocation in nodes[1]'s way;
    // a later one claims nodes[1]. (The test Ironic, on SQLite, sometimes fails a POST or a
    // DELETE under load: that claim is deferred and a later pass makes it.)
    let mut passes = Vec::new();
    for _ in 0..5 {
        let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
        passes.push((r.created, r.taken, r.deferred, r.managed));
        if r.managed + r.created == 2 {
            break;
        }
    }
    use shepherd_provider::metrics::CallResult;
    let calls = |call| {
        (
            metrics.count(call, CallResult::Ok),
            metrics.count(call, CallResult::Error),
        )
    };
    let said = format!(
        "(created, taken, deferred, managed) per pass: {passes:?}; (ok, error) create {:?} delete {:?} get {:?}",
        calls("create_allocation"),
        calls("delete_allocation"),
        calls("get_allocation"),
    );
    assert_eq!(passes[0].0, 1, "{said}");
    assert_eq!(passes.iter().map(|p| p.0).sum::<usize>(), 2, "{said}");
    let held = allocations(&ironic).await;
    assert_eq!(held.len(), 2, "{held:?}");
    for id in &nodes[..2] {
        let name = shepherd_ironic::provider::allocation_name("site-a", id);
        let a = &held[&name];
        assert_eq!(a["state"], "active", "{a}");
        assert_eq!(a["node_uuid"], id.as_str(), "{a}");
        assert_eq!(a["traits"], json!(["CUSTOM_GPU"]), "{a}");
        assert_eq!(a["extra"]["shepherd_deployment"], "site-a", "{a}");
        let node = ironic.node(id).await;
        assert_eq!(
            node["instance_uuid"], a["uuid"],
            "the node's instance is the allocation"
        );
        assert_eq!(node["extra"]["shepherd_deployment"], "site-a");
        ironic.wait_for_state(id, "active").await;
        assert_eq!(ironic.deploys_started(id).await, 1);
    }
    let untouched = ironic.node(&nodes[2]).await;
    assert!(
        untouched["instance_uuid"].is_null(),
        "a node without the trait is not taken"
    );
    // Requests: one allocation refused by the leftover's name (a POST the test Ironic failed
    // under load counts as one more); two granted (and as many again at most for the two
    // retries of an allocation the test Ironic, on SQLite, sometimes fails on its own); the
    // nodes were never reserved by patching their instance.
    let (granted, refused) = calls("create_allocation");
    assert!((1..=passes.len() as u64).contains(&refused), "{said}");
    assert!((2..=6).contains(&granted), "{said}");
    // The leftover is deleted once, and so is each allocation granted that Ironic then failed
    // on its own (every one granted beyond the two held), and at most each one a failed POST
    // made anyway (every refusal beyond the leftover's); a deletion the test Ironic failed
    // is made again on a later pass (its name is still in the way).
    let (deleted, not_deleted) = calls("delete_allocation");
    let leftover_and_failed = 1 + (granted - 2);
    assert!(
        (leftover_and_failed..=leftover_and_failed + (refused - 1)).contains(&deleted),
        "{said}"
    );
    assert!(not_deleted < passes.len() as u64, "{said}");
    assert_eq!(metrics.count("reserve_node", CallResult::Ok), 0);
    s.close().await.unwrap();
    t.cleanup().await;
}

/// Across the change to allocations (a rolling upgrade): a node an older Shepherd reserved by
/// patching its instance stays ours; a claim cut short after its allocation (the replica
/// stopped before marking the node) is adopted and deployed once; another client's allocation
/// is left alone.
#[tokio::test]
async fn reservations_from_before_allocations_and_claims_cut_short_are_adopted() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(3, quick_retries()).await;
    // nodes[0]: reserved and deployed by a Shepherd from before allocations; its BMDB row is
    // lost, so it is an orphan too.
    let ops = json!([
        {"op": "add", "path": "/instance_uuid", "value": uuid_v4()},
        {"op": "add", "path": "/extra/shepherd_deployment", "value": "site-a"},
    ]);
    ironic.patch_node(&nodes[0], ops).await;
    ironic.provision_all(&nodes[..1], "active", "active").await;
    // nodes[1]: allocated under our name, never marked. nodes[2]: another client's.
    for (id, name) in [
        (
            &nodes[1],
            shepherd_ironic::provider::allocation_name("site-a", &nodes[1]),
        ),
        (&nodes[2], "metalsmith-web-1".to_string()),
    ] {
        let a = allocate_by_hand(
            &ironic,
            json!({"name": name, "resource_class": "shepherd-test", "candidate_nodes": [id]}),
        )
        .await;
        assert_eq!(a["state"], "active", "{a}");
    }

    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!((r.created, r.failed), (2, 0), "{r:?}");
    let mut want = vec![nodes[0].clone(), nodes[1].clone()];
    want.sort();
    assert_eq!(
        recorded(&t.db).await.keys().cloned().collect::<Vec<_>>(),
        want
    );
    ironic.wait_for_state(&nodes[1], "active").await;
    assert_eq!(
        ironic.deploys_started(&nodes[0]).await,
        1,
        "not deployed again"
    );
    assert_eq!(ironic.deploys_started(&nodes[1]).await, 1, "deployed once");
    assert_eq!(
        ironic.node(&nodes[1]).await["extra"]["shepherd_deployment"],
        "site-a"
    );
    let foreign = ironic.node(&nodes[2]).await;
    assert_eq!(
        foreign["provision_state"], "available",
        "another client's node left alone"
    );
    assert_eq!(foreign["extra"], json!({}));
    // The old reservation is served like a new one: looked up, and handed back on request.
    let m = p.get_machine(&nodes[0]).await.unwrap();
    assert_eq!(m.status, Some(ProviderStatus::Running));
    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!((r.created, r.managed), (0, 2), "{r:?}");
    s.close().await.unwrap();
    t.cleanup().await;
}

/// The BMDB's machine of each node, by node id.
async fn machine_of_node(db: &Bmdb) -> std::collections::BTreeMap<String, uuid::Uuid> {
    testing::provided_by(db, ProviderKind::Ironic)
        .await
        .into_iter()
        .map(|(m, p)| (p.provider_id, m))
        .collect()
}

/// An operator undeploys a node Shepherd holds (`baremetal node undeploy`): Ironic tears it
/// down and ends its allocation. The machine counts missing and provisioning goes on; once the
/// node is available again it is claimed as a new machine: the old machine is removed (its
/// history kept), and the node deployed a second time, for a new instance.
#[tokio::test]
async fn an_undeployed_node_comes_back_as_a_new_machine() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(3, quick_retries()).await;
    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!(r.created, 3, "{r:?}");
    for id in &nodes {
        ironic.wait_for_state(id, "active").await;
    }
    let before = machine_of_node(&t.db).await;
    let first_instance = ironic.node(&nodes[0]).await["instance_uuid"].clone();
    // `baremetal node undeploy`.
    ironic
        .provision_all(&nodes[..1], "deleted", "available")
        .await;

    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!(
        (r.created, r.managed, r.missing),
        (1, 2, 1),
        "the undeployed node counted missing, then claimed again: {r:?}"
    );
    let after = machine_of_node(&t.db).await;
    assert_eq!(after.len(), 3);
    assert_ne!(after[&nodes[0]], before[&nodes[0]], "a new machine");
    for id in &nodes[1..] {
        assert_eq!(after[id], before[id], "the others are unchanged");
    }
    let old = before[&nodes[0]];
    let exists =
        t.db.read(move |tx| Box::pin(async move { tx.machine_exists(old).await }))
            .await
            .unwrap();
    assert!(!exists, "the machine of the former claim is removed");
    ironic.wait_for_state(&nodes[0], "active").await;
    assert_eq!(ironic.deploys_started(&nodes[0]).await, 2);
    let node = ironic.node(&nodes[0]).await;
    assert_ne!(node["instance_uuid"], first_instance, "a new instance");
    let stored = ironic.stored_instance_info(&nodes[0]);
    assert_eq!(
        stored["configdrive"]["meta_data"]["uuid"],
        node["instance_uuid"]
    );
    // Later passes see three machines of ours and nothing missing.
    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!((r.created, r.managed, r.missing), (0, 3, 0), "{r:?}");
    s.close().await.unwrap();
    t.cleanup().await;
}

/// With `--ironic-network-data`, each config drive carries `network_data` built from the
/// node's ports: a link per MAC address, configured by DHCP.
#[tokio::test]
async fn network_data_comes_from_the_nodes_ports() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, _) = site(1, quick_retries()).await;
    let mac = "52:54:00:ab:cd:01";
    ironic.add_port(&nodes[0], mac).await;
    let mut with_network = config("site-a");
    with_network.network_data = true;
    let r = provisioner(provider(&ironic, with_network).await, 10)
        .iterate(&s)
        .await
        .unwrap();
    assert_eq!(r.created, 1, "{r:?}");
    let stored = ironic.stored_instance_info(&nodes[0]);
    let network = &stored["configdrive"]["network_data"];
    assert_eq!(network["links"][0]["ethernet_mac_address"], mac, "{stored}");
    assert_eq!(network["networks"][0]["type"], "ipv4_dhcp", "{network}");
    assert_eq!(network["networks"][0]["link"], network["links"][0]["id"]);
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A node whose deploy Ironic refuses (the `ramdisk` deploy interface with a boot interface
/// that cannot boot a ramdisk: the deploy does not validate) is given back and skipped, and the skip is in the BMDB: another replica,
/// or this one restarted (a fresh provider), leaves it alone instead of claiming it again;
/// once the skip ends it is tried again.
#[tokio::test]
async fn a_refused_deploy_is_skipped_by_every_replica_and_after_a_restart() {
    let _one = one_at_a_time().await;
    use shepherd_provider::metrics::CallResult;
    let (ironic, nodes, t, s, _) = site(2, quick_retries()).await;
    let ramdisk = json!([{"op": "replace", "path": "/deploy_interface", "value": "ramdisk"}]);
    ironic.patch_node(&nodes[1], ramdisk).await;
    let mut skipping = config("site-a");
    skipping.refused_penalty = Duration::from_secs(10);
    let (a, _) = counted_provider(&ironic, skipping.clone()).await;
    let r = iterate_placing(&provisioner(a, 10), &s).await;
    assert_eq!((r.created, r.refused), (1, 1), "{r:?}");
    let node = ironic.node(&nodes[1]).await;
    assert!(
        node["instance_uuid"].is_null() && node["provision_state"] == "available",
        "the refused node is given back: {node}"
    );
    let skips = t
        .db
        .read(|tx| Box::pin(async move { tx.skipped_provider_ids(ProviderKind::Ironic).await }))
        .await
        .unwrap();
    assert_eq!(skips.len(), 1, "{skips:?}");
    assert_eq!(skips[0].provider_id, nodes[1]);
    assert!(skips[0].cause.contains("deploy_node"), "{skips:?}");

    // Another replica, or this one restarted: nothing of the first provider's memory.
    let (b, calls) = counted_provider(&ironic, skipping).await;
    let s2 = session(&t.db).await;
    let r = iterate_placing(&provisioner(b.clone(), 10), &s2).await;
    assert_eq!((r.created, r.refused, r.skipped), (0, 0, 1), "{r:?}");
    let claims = |result| calls.count("create_allocation", result);
    assert_eq!(
        (claims(CallResult::Ok), claims(CallResult::Error)),
        (0, 0),
        "the skipped node is not claimed again"
    );

    // Once the skip ends, the node is a candidate again (and refused again).
    testing::eventually("the skip ended", Duration::from_secs(60), async || {
        let r = iterate_placing(&provisioner(b.clone(), 10), &s2).await;
        if r.refused == 1 {
            Ok(r)
        } else {
            Err(r)
        }
    })
    .await;
    s.close().await.unwrap();
    s2.close().await.unwrap();
    t.cleanup().await;
}

/// A node another conductor holds locked (a periodic task, an operation in flight) makes
/// Ironic's allocation fail with "could not reserve any of 1 suitable nodes" after Ironic's
/// own retries: that is Ironic being busy, not the node being unfit, so the claim counts as
/// taken for this pass and is not skipped; once the lock is gone the next pass deploys it.
#[tokio::test]
async fn a_node_locked_by_a_conductor_is_tried_again_next_pass_not_skipped() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(1, quick_retries()).await;
    ironic.set_in_database(&nodes, "reservation", Some("another-conductor"));
    let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    let skips = t
        .db
        .read(|tx| Box::pin(async move { tx.skipped_provider_ids(ProviderKind::Ironic).await }))
        .await
        .unwrap();
    assert!(skips.is_empty(), "a locked node is not skipped: {skips:?}");
    assert_eq!((r.created, r.refused, r.deferred), (0, 0, 1), "{r:?}");

    ironic.set_in_database(&nodes, "reservation", None);
    let r = iterate_placing(&provisioner(p, 10), &s).await;
    assert_eq!((r.created, r.skipped), (1, 0), "{r:?}");
    s.close().await.unwrap();
    t.cleanup().await;
}

/// Production Ironics keep their database in Postgres (or MySQL), where the conductor works
/// on many nodes at once: with four creations in flight, every node of an Ironic on Postgres
/// is allocated and deployed exactly once, with our config drive.
#[tokio::test]
async fn an_ironic_on_postgres_takes_overlapping_creations() {
    let _one = one_at_a_time().await;
    let Some(url) = testing::fresh_postgres_database().await else {
        return;
    };
    let ironic = IronicServer::start_on_postgres(TestAuth::None, &url).await;
    let nodes = ironic.fake_nodes(8, |_| json!({})).await;
    let p = provider(&ironic, config("site-a")).await;
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    let four = unpaced_parallel_provisioner(p, 10, 4);
    testing::eventually("every node created", Duration::from_secs(60), async || {
        iterate_placing(&four, &s).await;
        let recorded = recorded(&t.db).await;
        testing::when(recorded.len() == nodes.len(), recorded.len())
    })
    .await;
    let stored = ironic.stored_instance_infos();
    for id in &nodes {
        ironic.assert_deployed_once(id).await;
        assert!(
            stored[id]["configdrive"].is_object(),
            "{id}: {}",
            stored[id]
        );
    }
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A real Ironic with one node, a [`FaultProxy`] in front of it, a provider of deployment
/// `site-a` through the proxy, and a fresh BMDB with a provisioner's session.
async fn one_node_behind_a_proxy() -> (
    IronicServer,
    Vec<String>,
    FaultProxy,
    Arc<IronicProvider>,
    testing::TestDb,
    Session,
) {
    let ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic.fake_nodes(1, |_| json!({})).await;
    let proxy = FaultProxy::start(&ironic).await;
    let url = proxy.url();
    let p = test_provider(&url, ironic.auth(), quick_retries(), config("site-a"))
        .await
        .unwrap();
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    (ironic, nodes, proxy, p, t, s)
}

/// After a pass its lease stopped: with Ironic's answers quick again, a pass under a live
/// session creates the machine of `node` and deploys it exactly once.
async fn a_live_pass_deploys_it_once(
    ironic: &IronicServer,
    proxy: &FaultProxy,
    p: Arc<IronicProvider>,
    t: testing::TestDb,
    node: &str,
) {
    proxy.faults.delay_ms.store(0, SeqCst);
    let s = session(&t.db).await;
    let r = iterate_placing(&provisioner(p, 10), &s).await;
    assert_eq!((r.created, r.failed), (1, 0), "{r:?}");
    ironic.assert_deployed_once(node).await;
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A creation whose session's lease ends while Ironic places its allocation takes no further
/// step at Ironic: the node is neither marked nor deployed (another replica may own the work
/// by now) and the pass stops. A later pass, under a live session, adopts the claim cut short
/// and deploys the node exactly once.
#[tokio::test]
async fn a_creation_takes_no_step_at_ironic_after_its_lease_ends() {
    let _one = one_at_a_time().await;
    use shepherd_loops::provisioner::ProvisionerError;
    let (ironic, nodes, proxy, p, t, s) = one_node_behind_a_proxy().await;
    // Every request takes a while, so the lease can end while the allocation is placed.
    proxy.faults.delay_ms.store(300, SeqCst);
    let seen = |method: &str, path: &str| {
        proxy
            .faults
            .seen
            .lock()
            .unwrap()
            .iter()
            .any(|(m, p)| m == method && p.starts_with(path))
    };
    let end_the_lease = async {
        testing::eventually(
            "the allocation asked for",
            Duration::from_secs(30),
            async || testing::when(seen("POST", "/v1/allocations"), ()),
        )
        .await;
        s.close().await.unwrap();
    };
    let first = provisioner(p.clone(), 10);
    let (pass, ()) = tokio::join!(first.iterate(&s), end_the_lease);
    assert!(
        matches!(pass, Err(ProvisionerError::LeaseLost(_))),
        "{pass:?}"
    );
    let node_path = format!("/v1/nodes/{}", nodes[0]);
    assert!(!seen("PATCH", &node_path), "marked after the lease ended");
    assert!(
        !seen("PUT", &format!("{node_path}/states/provision")),
        "deployed after the lease ended"
    );
    assert!(recorded(&t.db).await.is_empty());

    a_live_pass_deploys_it_once(&ironic, &proxy, p, t, &nodes[0]).await;
}

/// A claim whose allocation Ironic failed on its own tries again with a new allocation, but
/// only while its lease holds: once the lease ends after the failure, no second allocation is
/// asked for (the node may be another replica's claim by now), and the pass stops. A later
/// pass, under a live session, deploys the node exactly once.
#[tokio::test]
async fn a_claim_tries_no_new_allocation_after_its_lease_ends() {
    let _one = one_at_a_time().await;
    use shepherd_loops::provisioner::ProvisionerError;
    let (ironic, nodes, proxy, _, t, s) = one_node_behind_a_proxy().await;
    // With an image to write, a claim marks the node only once its allocation is placed, so
    // it reads the allocation: the read the fault answers.
    let mut with_image = config("site-a");
    with_image.image = Some(shepherd_ironic::Image {
        url: "http://127.0.0.1:1/image.raw".into(),
        checksum: "0123456789abcdef0123456789abcdef".into(),
    });
    let p = test_provider(&proxy.url(), ironic.auth(), quick_retries(), with_image)
        .await
        .unwrap();
    // The first read of the allocation shows it failed by Ironic itself, which a claim tries
    // again after; every request takes a while, so the lease ends before the next attempt.
    proxy.faults.allocations_failed_by_ironic.store(1, SeqCst);
    proxy.faults.delay_ms.store(300, SeqCst);
    let allocations_asked = || {
        let seen = proxy.faults.seen.lock().unwrap();
        seen.iter()
            .filter(|(m, p)| m == "POST" && p.starts_with("/v1/allocations"))
            .count()
    };
    let end_the_lease = async {
        testing::eventually(
            "the allocation shown failed by Ironic",
            Duration::from_secs(30),
            async || {
                let served = proxy.faults.allocations_failed_by_ironic.load(SeqCst) == 0;
                testing::when(served, ())
            },
        )
        .await;
        s.close().await.unwrap();
    };
    let first = provisioner(p.clone(), 10);
    let (pass, ()) = tokio::join!(first.iterate(&s), end_the_lease);
    assert!(
        matches!(pass, Err(ProvisionerError::LeaseLost(_))),
        "{pass:?}"
    );
    assert_eq!(
        allocations_asked(),
        1,
        "a new allocation was asked for after the lease ended"
    );
    // The step refused is counted (which one depends on when the close lands: the failed
    // allocation's deletion, or the next attempt's creation).
    let fenced = |step| {
        t.db.metrics()
            .steps_fenced(Processor::ShepherdProvisioner, step)
    };
    assert_eq!(fenced("delete allocation") + fenced("create allocation"), 1);
    assert!(recorded(&t.db).await.is_empty());

    a_live_pass_deploys_it_once(&ironic, &proxy, p, t, &nodes[0]).await;
}

/// An allocation of ours that Ironic never finished (left `allocating`: its conductor died,
/// or its database failed mid-way) and whose claimant gave up waiting is deleted by the next
/// claim of the node, and the claim after it goes through: a lost allocation does not keep the
/// node from being claimed for good.
#[tokio::test]
async fn an_allocation_of_ours_stuck_allocating_is_deleted_and_the_node_claimed() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, p) = site(1, quick_retries()).await;
    // An allocation of our name that fits no node ends in `error`; rewritten to
    // `allocating`, made ten minutes ago, it is one that Ironic lost.
    let name = shepherd_ironic::provider::allocation_name("site-a", &nodes[0]);
    let body = json!({"name": name, "resource_class": "no-such-class"});
    let (status, made) = ironic
        .send_json(reqwest::Method::POST, "/v1/allocations", body)
        .await;
    assert_eq!(status, 201, "{made}");
    ironic.wait_for_allocation_state(&name, "error").await;
    let ten_minutes_ago = (chrono::Utc::now() - chrono::TimeDelta::minutes(10)).naive_utc();
    ironic.execute_in_database(
        "update allocations set state = 'allocating', created_at = :at where name = :name",
        &json!({"at": ten_minutes_ago.to_string(), "name": name}),
    );

    let first = iterate_placing(&provisioner(p.clone(), 10), &s).await;
    assert_eq!((first.created, first.deferred), (0, 1), "{first:?}");
    let (status, _) = ironic
        .get(&format!("/v1/allocations/{name}"))
        .await
        .unwrap();
    assert_eq!(status, 404, "the lost allocation is deleted");
    let second = iterate_placing(&provisioner(p, 10), &s).await;
    assert_eq!(second.created, 1, "{second:?}");
    ironic.assert_deployed_once(&nodes[0]).await;
    s.close().await.unwrap();
    t.cleanup().await;
}

/// Ironic keeps conductor groups lower-cased (and finds no conductor for a node enrolled as
/// `Rack-A`): `--ironic-conductor-group Rack-A` takes the nodes of group `rack-a`, served by
/// a conductor of that group, and a node of another group stays untouched.
#[tokio::test]
async fn a_conductor_group_given_in_another_case_matches() {
    let _one = one_at_a_time().await;
    let ironic = IronicServer::start_in_conductor_group(TestAuth::None, "rack-a").await;
    let mut nodes = Vec::new();
    for i in 0..3 {
        let id = ironic
            .enroll(json!({
                "name": format!("rack-a-{i}"),
                "driver": "fake-hardware",
                "conductor_group": "rack-a",
                "resource_class": "shepherd-test",
            }))
            .await;
        nodes.push(id);
    }
    ironic.provision_all(&nodes, "manage", "manageable").await;
    ironic.provision_all(&nodes, "provide", "available").await;
    ironic.power_off(&nodes).await;
    assert_eq!(ironic.node(&nodes[0]).await["conductor_group"], "rack-a");
    // The third moves to another rack (whose conductor is elsewhere).
    ironic.set_in_database(&nodes[2..], "conductor_group", Some("rack-b"));

    let mut c = config("site-a");
    c.selector.conductor_group = Some("Rack-A".into());
    let p = provider(&ironic, c).await;
    let t = testing::sqlite().await;
    let s = session(&t.db).await;
    // Just after `provide` the conductor may still hold a node locked: that claim is tried
    // again by the next pass.
    let mut created = 0;
    for _ in 0..10 {
        let r = iterate_placing(&provisioner(p.clone(), 10), &s).await;
        assert_eq!((r.failed, r.refused), (0, 0), "{r:?}");
        created += r.created;
        if created == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(created, 2);
    let claimed: Vec<String> = machine_of_node(&t.db).await.into_keys().collect();
    let mut want = nodes[..2].to_vec();
    want.sort();
    assert_eq!(claimed, want, "the nodes of rack-a, and only them");
    let other = ironic.node(&nodes[2]).await;
    assert!(other["instance_uuid"].is_null(), "{other}");
    for id in &nodes[..2] {
        ironic.wait_for_state(id, "active").await;
    }
    s.close().await.unwrap();
    t.cleanup().await;
}

/// The requests the proxy forwarded for node `id`'s claim, as (method, path) with the node's
/// id and any allocation's id left out, listings and the version document aside.
fn claim_requests(proxy: &FaultProxy, id: &str) -> Vec<String> {
    let seen = proxy.faults.seen.lock().unwrap().clone();
    seen.into_iter()
        .filter(|(_, path)| !path.starts_with("/v1/nodes?") && path != "/v1" && path != "/")
        .map(|(method, path)| {
            let path = path.replace(id, "N");
            let path = match path.strip_prefix("/v1/allocations/") {
                Some(_) => "/v1/allocations/A".to_string(),
                None => path,
            };
            format!("{method} {path}")
        })
        .collect()
}

/// A claim whose allocation is placed by the time it first looks costs three requests: the
/// allocation, one patch that marks the node (its answer shows the node's instance is the
/// allocation: placed) and the deploy; no read of the allocation. The claim mark names the
/// allocation.
#[tokio::test]
async fn a_claim_placed_by_its_first_look_is_one_allocation_one_patch_and_the_deploy() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, proxy, p, t, s) = one_node_behind_a_proxy().await;
    proxy
        .faults
        .hold_node_patches_until_placed
        .store(true, SeqCst);
    proxy.faults.seen.lock().unwrap().clear();
    let r = iterate_placing(&provisioner(p, 10), &s).await;
    assert_eq!((r.created, r.failed), (1, 0), "{r:?}");
    assert_eq!(
        claim_requests(&proxy, &nodes[0]),
        [
            "POST /v1/allocations",
            "PATCH /v1/nodes/N",
            "PUT /v1/nodes/N/states/provision"
        ]
    );
    let node = ironic.node(&nodes[0]).await;
    assert_eq!(
        node["extra"]["shepherd_claim"], node["instance_uuid"],
        "{node}"
    );
    assert_eq!(node["extra"]["shepherd_deployment"], "site-a", "{node}");
    ironic.assert_deployed_once(&nodes[0]).await;
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A claim marks its node before it has seen its allocation placed; when the allocation then
/// fails (here: Ironic finds no node of the class asked for), the marks are removed again and
/// the node is neither ours nor deployed.
#[tokio::test]
async fn marks_written_before_an_allocation_that_fails_are_removed() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, proxy, p, t, s) = one_node_behind_a_proxy().await;
    let mut unused = p.list_machines().await.unwrap().remove(0);
    assert!(unused.facts.insert("resource_class", "no-such-class"));
    let created = p.create_machine(&s, &unused).await;
    let Err(ProviderError::Refused { error, .. }) = &created else {
        panic!("{created:?}");
    };
    // Ironic's own typed error, behind the trait.
    assert!(
        matches!(
            error.downcast_ref::<IronicError>(),
            Some(IronicError::NotAllocated { .. })
        ),
        "{error:?}"
    );
    // The marking patch, then the one that removes the marks.
    let requests = claim_requests(&proxy, &nodes[0]);
    let patches = requests.iter().filter(|r| *r == "PATCH /v1/nodes/N");
    assert_eq!(patches.count(), 2, "{requests:?}");
    let node = ironic.node(&nodes[0]).await;
    let extra = node["extra"].as_object().unwrap();
    assert!(extra.keys().all(|k| !k.starts_with("shepherd_")), "{node}");
    assert!(node["instance_uuid"].is_null(), "{node}");
    assert_eq!(ironic.deploys_started(&nodes[0]).await, 0);
    s.close().await.unwrap();
    t.cleanup().await;
}

/// A provider whose listing is taken before another replica's whole pass: what a replica sees
/// when another creates machines while it works through its own (stale) listing.
struct ListedBeforeAnotherPass {
    inner: Arc<IronicProvider>,
    other: Provisioner<IronicProvider>,
    other_session: Session,
}

#[async_trait::async_trait]
impl Provider for ListedBeforeAnotherPass {
    fn kind(&self) -> ProviderKind {
        self.inner.kind()
    }

    /// The subject of the test: the provisioner asks it before each creation.
    fn id_once_created<'m>(&self, unused: &'m ProviderMachine) -> Option<&'m str> {
        self.inner.id_once_created(unused)
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        let listed = self.inner.list_machines().await?;
        let r = iterate_placing(&self.other, &self.other_session).await;
        assert_eq!(r.created, 3, "{r:?}");
        Ok(listed)
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<shepherd_provider::Recorded, ProviderError> {
        self.inner.create_machine(session, unused).await
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        self.inner.get_machine(id).await
    }
}

/// Two replicas: one works through a listing taken before the other created every node. Each
/// candidate the BMDB has recorded since is passed over without a request to Ironic (no
/// allocation refused on its name, no read of the winner's allocation).
#[tokio::test]
async fn candidates_recorded_since_the_listing_cost_ironic_nothing() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, t, s, a) = site(3, quick_retries()).await;
    let (b, b_calls) = counted_provider(&ironic, config("site-a")).await;
    let stale = ListedBeforeAnotherPass {
        inner: b,
        other: provisioner(a, 10),
        other_session: s,
    };
    let config = ProvisionerConfig {
        limits: Limits::new(0, 10),
        reconcile_rate: RateSpec::new(Duration::from_millis(1), 1),
        creation_rate: RateSpec::new(Duration::from_millis(1), 1000),
        creation_parallelism: 1,
    };
    let replica_b = Provisioner::new(Arc::new(stale), config);
    let s_b = session(&t.db).await;
    let r = iterate_placing(&replica_b, &s_b).await;
    assert_eq!((r.created, r.taken, r.failed), (0, 3, 0), "{r:?}");
    use shepherd_provider::metrics::CallResult;
    for call in ["create_allocation", "get_allocation", "mark_node"] {
        assert_eq!(b_calls.count(call, CallResult::Ok), 0, "{call}");
        assert_eq!(b_calls.count(call, CallResult::Error), 0, "{call}");
    }
    for id in &nodes {
        ironic.assert_deployed_once(id).await;
    }
    s_b.close().await.unwrap();
    t.cleanup().await;
}

/// A claim whose allocation is deleted before the claim has seen it placed (another replica
/// found it failed and cleared it out of the name's way, or an operator deleted it) counts as
/// taken, leaves no marks behind, and the next pass claims the node.
#[tokio::test]
async fn an_allocation_deleted_while_its_claim_waits_is_claimed_again_next_pass() {
    let _one = one_at_a_time().await;
    let (ironic, nodes, proxy, p, t, s) = one_node_behind_a_proxy().await;
    // Every request waits at the proxy, so the allocation is deleted (directly at Ironic)
    // before the claim looks at it again.
    proxy.faults.delay_ms.store(400, SeqCst);
    let name = shepherd_ironic::provider::allocation_name("site-a", &nodes[0]);
    let delete_it = async {
        let placed = testing::eventually(
            "the allocation placed",
            Duration::from_secs(30),
            async || {
                let (status, a) = ironic
                    .get(&format!("/v1/allocations/{name}"))
                    .await
                    .unwrap();
                testing::when(status == 200 && a["state"] == "active", a)
            },
        )
        .await;
        let path = format!("/v1/allocations/{}", placed["uuid"].as_str().unwrap());
        let (status, body) = ironic
            .send_json(reqwest::Method::DELETE, &path, json!(null))
            .await;
        assert_eq!(status, 204, "{body}");
    };
    let first = provisioner(p.clone(), 10);
    let (pass, ()) = tokio::join!(first.iterate(&s), delete_it);
    let r = pass.unwrap();
    assert_eq!((r.created, r.deferred, r.failed), (0, 1, 0), "{r:?}");
    let node = ironic.node(&nodes[0]).await;
    let extra = node["extra"].as_object().unwrap();
    assert!(extra.keys().all(|k| !k.starts_with("shepherd_")), "{node}");

    proxy.faults.delay_ms.store(0, SeqCst);
    let r = iterate_placing(&provisioner(p, 10), &s).await;
    assert_eq!((r.created, r.failed), (1, 0), "{r:?}");
    ironic.assert_deployed_once(&nodes[0]).await;
    s.close().await.unwrap();
    t.cleanup().await;
}
