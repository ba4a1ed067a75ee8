//! A real machine behind a real Ironic: a QEMU VM booted from the Debian guest image
//! (`scripts/vm-image.sh`) is a node of Ironic's `redfish` hardware type, whose BMC is
//! sushy-tools' fake driver with a follower that turns its power changes into QMP commands
//! (power off pauses the VM, power on resets and resumes it). `shepherd run --provider ironic`
//! takes the VM over with the real agent, which heartbeats through `shepherd server`; when the
//! agent dies, the recoverer reboots the node through Ironic's power API (Ironic powers the
//! system off and on over Redfish, the VM really restarts) and the VM is taken over again.
//! The VM reaches nothing but its forwarded sshd and the server (QEMU's user-mode network,
//! `restrict=on`), so all traffic stays on this host.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::ironic::{adopt_e2e_node, ironic_run, PASSWORD};
use common::sushy::{start_emulator, CertForm, FakeSystem};
use common::vm::{power_follower, server_for_guests, vm_site, Vm, VmSpec, SERVER_IN_GUEST};
use common::{wait_for, ChildGuard};
use shepherd_bmdb::{testing, Bmdb, ProviderKind};
use shepherd_ironic::testing::{ImageServer, IronicServer, TestAuth};
use uuid::Uuid;

const MEMORY_MIB: u32 = 256;

/// The Redfish id of the VM's fake system.
const SYSTEM: &str = "5d0c9a3e-0000-4000-8000-00000000000a";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_behind_ironic_is_rebooted_through_ironic_when_its_agent_dies_and_taken_over_again() {
    let (dir, image, t, server_port) = vm_site().await;
    let mut vm = Vm::start(
        dir.path(),
        VmSpec {
            image: &image,
            index: 1,
            server_port,
            memory_mib: MEMORY_MIB,
            install_target: None,
        },
    );

    let certs = dir.path().join("certs");
    let server = server_for_guests(&t.url, server_port, dir.path());

    // The VM's BMC, and the VM handed to Ironic as a running machine (`adopt`: the `redfish`
    // type has no fake deploy, and a real deploy would need a network boot) that belongs to
    // deployment `e2e`, as an operator hands Shepherd a machine already running.
    let (follower, resets) =
        power_follower(HashMap::from([(vm.name.clone(), vm.qmp.clone())])).await;
    let bmc = start_emulator(
        dir.path(),
        CertForm::CaSigned,
        &[FakeSystem {
            uuid: SYSTEM,
            name: &vm.name,
        }],
        Some(&follower),
    );
    let ironic = IronicServer::start(TestAuth::Basic {
        user: "shepherd".into(),
        password: PASSWORD.into(),
    })
    .await;
    let images = ImageServer::start().await;
    let node = adopt_e2e_node(&ironic, &bmc, SYSTEM, &vm.mac, &images.url, &vm.ssh_addr()).await;
    // Start `run` only once the VM answers SSH: a failed first attempt would wait out the
    // initializer's backoff.
    tokio::task::block_in_place(|| vm.wait_for_ssh(Duration::from_secs(300)));

    let run_log = dir.path().join("run.log");
    let run = ironic_run(
        &t.url,
        &ironic,
        &image.key,
        &shepherd_loops::testing::agent_path(),
        "/root/agent",
        SERVER_IN_GUEST,
    )
    .args(["--ironic-deploy-wait", "3s"])
    .arg(format!("--agent-ca={}", certs.join("ca.pem").display()))
    .args(["--ssh-user", "root", "--ssh-exec-timeout", "120s"])
    .args(["--recovery-heartbeat-older-than", "10s"])
    .args(["--recovery-no-heartbeat-after", "90s"])
    .args(["--recovery-brake-interval", "2s"])
    .args(["--recoverer-db-rate", "1s,1"])
    // Longer than the VM takes to boot, so the initializer finds it up.
    .args(["--ironic-reboot-wait", "60s"])
    .stderr(std::fs::File::create(&run_log).unwrap())
    .spawn()
    .unwrap();
    let run = ChildGuard(Some(run));
    let log = || std::fs::read_to_string(&run_log).unwrap_or_default();

    let db: Bmdb = t.db.clone();
    let beat = async |m: Uuid| {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    };
    let machine = wait_for("the VM's agent to heartbeat", 300, async || {
        let (m, _) = testing::provided_by(&db, ProviderKind::Ironic)
            .await
            .into_iter()
            .find(|(_, p)| p.provider_id == node)?;
        beat(m).await.map(|_| m)
    })
    .await;
    let shown = common::machine_json(&t.url, machine);
    assert_eq!(shown["provider_facts"]["driver"], "redfish", "{shown}");
    assert_eq!(
        shown["provider_facts"]["resource_class"], "shepherd-test",
        "{shown}"
    );
    let memory = shown["hardware_report"]["memory_bytes"].as_i64().unwrap();
    assert!(
        memory > i64::from(MEMORY_MIB - 64) << 20 && memory <= i64::from(MEMORY_MIB) << 20,
        "the agent reports the VM's memory: {shown}"
    );
    let agent_key = shown["agent_key"].clone();
    assert!(resets.lock().unwrap().is_empty(), "a healthy VM was reset");

    // The agent dies: the node is power-cycled through Ironic (off, then on, over Redfish:
    // the VM really restarts), and the VM is taken over again by a new agent.
    let killed = chrono::Utc::now();
    vm.ssh(&image, "pkill -x agent");
    wait_for("Ironic to power-cycle the VM", 240, async || {
        (!resets.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    wait_for("heartbeats after the recovery", 300, async || {
        beat(machine).await.filter(|h| *h > killed)
    })
    .await;
    let shown = common::machine_json(&t.url, machine);
    vm.assert_recovered_once(&shown, &agent_key);
    assert_eq!(
        *resets.lock().unwrap(),
        [vm.name.clone()],
        "one power cycle, of this VM"
    );
    assert!(
        ironic.log_contains(&node),
        "Ironic acted on the node: {}",
        ironic.log_tail()
    );

    let out = run.terminate();
    assert!(out.status.success(), "{}", log());
    assert!(
        !log().contains(PASSWORD),
        "the Ironic password is in the log"
    );
    server.terminate();
    t.cleanup().await;
}
