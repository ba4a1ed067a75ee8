//! A fleet of real machines: three QEMU VMs booted from the Debian guest image
//! (`scripts/vm-image.sh`), managed by the real `shepherd server` and `shepherd run` binaries,
//! with power control through Redfish: the sushy-tools fake driver, whose power changes a
//! follower turns into QMP resets of the VMs. The first VM has an empty second disk, booted
//! first with network boot into the base system as the fallback, and gets an OS installed. The VMs reach nothing but their forwarded sshd
//! and the server (QEMU's user-mode network, `restrict=on`), so all traffic stays on this host.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::sushy::{start_emulator, CertForm, FakeSystem};
use common::vm::{
    image_server, power_follower, run_for_guests, server_for_guests, vm_site, GuestImage, Vm,
    VmSpec, IMAGES_IN_GUEST, TARGET_DISK_BYTES,
};
use common::{shepherd, wait_for, ChildGuard};
use serde_json::Value;
use shepherd_bmdb::{testing, Bmdb};
use uuid::Uuid;

const VMS: u8 = 3;
const MEMORY_MIB: u32 = 256;

async fn machine_of(db: &Bmdb, vm: &Vm) -> Uuid {
    common::machine_named(db, &vm.name)
        .await
        .unwrap_or_else(|| panic!("{} was not provisioned", vm.name))
}

/// Fails unless `pinned` (an OpenSSH public key line) is one of the host keys the guest made
/// for itself; returns its type and key, without the comment.
fn assert_guest_has_key(vm: &Vm, image: &GuestImage, pinned: &str) -> String {
    let key: Vec<&str> = pinned.split_whitespace().take(2).collect();
    let guest_keys = vm.ssh(image, "cat /etc/ssh/ssh_host_*_key.pub");
    let found = guest_keys
        .lines()
        .any(|l| l.split_whitespace().take(2).eq(key.iter().copied()));
    assert!(
        found,
        "{}: pinned {key:?}, the guest has {guest_keys}",
        vm.name
    );
    key.join(" ")
}

/// The Redfish id of a VM's fake system.
fn system_id(vm: &Vm) -> String {
    format!("8b5e2a5c-0000-4000-8000-{:012x}", vm.index)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_fleet_is_taken_over_installed_recovered_and_pins_host_keys() {
    let (dir, image, t, server_port) = vm_site().await;
    let (images_port, downloads) = image_server(&image).await;
    let mut vms: Vec<Vm> = (1..=VMS)
        .map(|index| {
            Vm::start(
                dir.path(),
                VmSpec {
                    image: &image,
                    index,
                    server_port,
                    memory_mib: MEMORY_MIB,
                    install_target: (index == 1).then_some(images_port),
                },
            )
        })
        .collect();

    let certs = dir.path().join("certs");
    let _server = server_for_guests(&t.url, server_port, dir.path());

    // Start `run` only once every VM answers SSH: a failed first attempt would wait out the
    // initializer's backoff.
    tokio::task::block_in_place(|| {
        for vm in &mut vms {
            vm.wait_for_ssh(Duration::from_secs(300));
        }
    });
    // Their BMCs: one emulator, a fake system per VM, power changes followed by QMP.
    let (follower, resets) = power_follower(
        vms.iter()
            .map(|vm| (vm.name.clone(), vm.qmp.clone()))
            .collect(),
    )
    .await;
    let ids: Vec<String> = vms.iter().map(system_id).collect();
    let systems: Vec<FakeSystem> = vms
        .iter()
        .zip(&ids)
        .map(|(vm, uuid)| FakeSystem {
            uuid,
            name: &vm.name,
        })
        .collect();
    let bmc = start_emulator(dir.path(), CertForm::SelfSigned, &systems, Some(&follower));
    let inventory = dir.path().join("inventory.json");
    let entries: Vec<Value> = vms
        .iter()
        .map(|vm| {
            serde_json::json!({"ID": vm.name, "Addr": vm.ssh_addr(), "Location": "qemu",
                "BMC": {"URL": bmc.url, "Username": "admin", "PasswordFile": bmc.password_file,
                        "CA": bmc.ca, "System": format!("/redfish/v1/Systems/{}", system_id(vm))}})
        })
        .collect();
    std::fs::write(&inventory, serde_json::to_string(&entries).unwrap()).unwrap();
    let run_log = dir.path().join("run.log");
    let _run = ChildGuard(Some(
        run_for_guests(&t.url, &inventory, &certs, &image.key)
            .args(["--initializer-parallelism", &VMS.to_string()])
            .args(["--initializer-db-rate", "100ms,8"])
            .args(["--provisioner-reconcile-rate", "1s,1"])
            .args(["--recovery-heartbeat-older-than", "10s"])
            .args(["--recovery-no-heartbeat-after", "90s"])
            .args(["--recovery-brake-interval", "2s"])
            .args(["--recoverer-db-rate", "1s,1"])
            // Longer than a VM takes to boot, so the initializer finds it up.
            .args(["--bmc-reboot-wait", "60s"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&run_log).unwrap())
            .spawn()
            .unwrap(),
    ));

    // Every VM is taken over and heartbeats over TLS.
    let db = t.db.clone();
    let log = || std::fs::read_to_string(&run_log).unwrap_or_default();
    // TCG boots take a minute or two, longer on a busy host.
    let every_vm = "every VM to heartbeat";
    testing::eventually_every(
        every_vm,
        Duration::from_secs(420),
        Duration::from_secs(1),
        async || {
            let c = db.status_counts().await.unwrap();
            let tail: String = log().lines().rev().take(10).collect::<Vec<_>>().join("\n");
            testing::when(c.heartbeating == i64::from(VMS), (c, tail))
        },
    )
    .await;

    let mut pinned = vec![];
    for vm in &vms {
        let m = machine_of(&db, vm).await;
        let shown = common::machine_json(&t.url, m);
        // The host key pinned is the one this VM made on its first boot.
        let key = shown["ssh_host_key"]
            .as_str()
            .unwrap_or_else(|| panic!("{shown}\n{}", log()));
        pinned.push(assert_guest_has_key(vm, &image, key));

        // The hardware report describes the VM as QEMU was configured.
        let hw = &shown["hardware_report"];
        assert_eq!(hw["cpu_threads"], 1, "{}: {hw}", vm.name);
        let memory = hw["memory_bytes"].as_i64().unwrap();
        assert!(
            memory > i64::from(MEMORY_MIB - 64) << 20 && memory <= i64::from(MEMORY_MIB) << 20,
            "{}: {memory} bytes of memory",
            vm.name
        );
        let macs: Vec<&str> = hw["nics"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|n| n["mac"].as_str())
            .collect();
        assert_eq!(macs, [vm.mac.as_str()], "{}: {hw}", vm.name);
        let mut disks: Vec<i64> = hw["block_devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["capacity_bytes"].as_i64().unwrap())
            .collect();
        let mut want = vec![std::fs::metadata(&image.disk).unwrap().len() as i64];
        if vm.index == 1 {
            want.push(TARGET_DISK_BYTES as i64);
        }
        disks.sort();
        want.sort();
        assert_eq!(disks, want, "{}: {hw}", vm.name);
    }
    pinned.sort();
    pinned.dedup();
    assert_eq!(
        pinned.len(),
        usize::from(VMS),
        "every VM has its own host key"
    );

    // Heartbeats keep coming at the short interval the takeover environment set.
    let m = machine_of(&db, &vms[0]).await;
    let beat = async || {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    };
    let first = beat().await.unwrap();
    wait_for("a later heartbeat", 15, async || {
        beat().await.filter(|h| *h > first)
    })
    .await;
    assert!(
        resets.lock().unwrap().is_empty(),
        "a healthy fleet was reset"
    );
    // An OS is installed onto the first VM's second disk: the agent downloads the image,
    // checks its sha256, writes it, reports success and reboots; the BIOS now boots the target
    // disk, and the installed OS runs.
    let installing = &vms[0];
    let m = machine_of(&db, installing).await;
    common::succeeds(
        shepherd()
            .args(["machines", "install", &m.to_string(), "--database", &t.url])
            .args([
                "--image",
                &format!("http://{IMAGES_IN_GUEST}/installable.img"),
            ])
            .args([
                "--sha256",
                &image.installable_sha256,
                "--device",
                "/dev/vdb",
            ]),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let since = Instant::now();
    let mut beats = Vec::new();
    let report = loop {
        let shown = common::machine_json(&t.url, m);
        if !shown["installation_report"].is_null() {
            break shown["installation_report"].clone();
        }
        beats.push(format!(
            "+{}s {}",
            since.elapsed().as_secs(),
            shown["heartbeat_at"]
        ));
        if Instant::now() > deadline {
            panic!(
                "no installation report: {shown}\nheartbeats seen during the install: {beats:?}\n\
                 serial console: {}\nserver log: {}\nrun log: {}",
                installing.serial_log(),
                std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default(),
                log()
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert_eq!(report["result"], "Success", "{report}");
    assert_eq!(report["generation"], 1);
    assert_eq!(downloads.lock().unwrap()["/installable.img"], 1);
    wait_for("the installed OS to run", 120, async || {
        installing
            .serial_log()
            .contains("shepherd installed OS: running")
            .then_some(())
    })
    .await;

    // At once: one VM's agent dies, and another VM is reinstalled (a fresh copy of its
    // image, so new host keys). Both go silent and are power-cycled through Redfish (a real
    // reset, through QMP).
    vms[2].reinstall();
    let killed = chrono::Utc::now();
    let (victim, reinstalled) = (&vms[1], &vms[2]);
    let m = machine_of(&db, victim).await;
    let agent_key = common::machine_json(&t.url, m)["agent_key"].clone();
    victim.ssh(&image, "pkill -x agent");
    let mut want = vec![victim.name.clone(), reinstalled.name.clone()];
    want.sort();
    wait_for("both Redfish resets", 180, async || {
        let mut got = resets.lock().unwrap().clone();
        got.sort();
        (got == want).then_some(())
    })
    .await;

    // The killed agent's VM is taken over again with a new agent key, and heartbeats resume.
    let beat = async |m: Uuid| {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    };
    wait_for("heartbeats after the recovery", 240, async || {
        beat(m).await.filter(|h| *h > killed)
    })
    .await;
    let shown = common::machine_json(&t.url, m);
    victim.assert_recovered_once(&shown, &agent_key);

    // The reinstalled VM presents another host key: its takeover is refused until an operator
    // who checked the change forgets the pin; then it is taken over and pins the new key.
    let r = machine_of(&db, reinstalled).await;
    let old_key = common::machine_json(&t.url, r)["ssh_host_key"].clone();
    // Attempts while the reinstalled VM's sshd restarts may fail to connect at all (reset by
    // peer) and back off too: wait for the attempt that meets the new key.
    let cause = wait_for("the takeover to meet the new host key", 240, async || {
        common::machine_json(&t.url, r)["backoffs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["process"] == "ShepherdAgentStart" && b["active"] == true)
            .map(|b| b["cause"].as_str().unwrap().to_string())
            .filter(|cause| cause.contains("host key mismatch"))
    })
    .await;
    assert!(cause.contains("host key mismatch"), "{cause}");
    assert_eq!(
        common::machine_json(&t.url, r)["ssh_host_key"],
        old_key,
        "the pin stays"
    );
    assert!(
        beat(r).await.is_none(),
        "no agent runs on the reinstalled VM"
    );
    common::succeeds(shepherd().args([
        "machines",
        "forget-host-key",
        &r.to_string(),
        "--database",
        &t.url,
    ]));
    wait_for("heartbeats from the reinstalled VM", 120, async || {
        beat(r).await
    })
    .await;
    let new_key = common::machine_json(&t.url, r)["ssh_host_key"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(Value::from(new_key.clone()), old_key);
    assert_guest_has_key(reinstalled, &image, &new_key);
    assert_eq!(
        resets.lock().unwrap().len(),
        2,
        "only the two silent VMs were reset"
    );

    t.cleanup().await;
}
