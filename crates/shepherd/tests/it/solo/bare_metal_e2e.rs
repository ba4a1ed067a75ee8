//! Servers with nothing but a BMC (design.md §21): two libvirt domains with blank disks, behind
//! sushy-tools' libvirt driver (Redfish power, boot override and virtual media, as Ironic's and
//! Metal3's CI use it), go from powered off with empty disks to heartbeating from the OS
//! installed on their disks, driven by two `shepherd run` replicas on Postgres and the real
//! `shepherd server`, with Shepherd's own live image (`scripts/live-image.sh`). One replica is
//! killed while the machines boot their live environment; the other carries on, and each
//! machine is still inserted, powered on, asked to install and installed exactly once.
//!
//! Asserted from the domains themselves: the disk holds the image (its sha256), the last boot
//! was from the disk, and the virtual CD is empty. A third domain's disk holds a partition
//! table, and its inventory entry does not allow a wipe: its agent refuses to write it, the
//! disk is untouched (its sha256 before and after), and the machine fails with that cause,
//! powered off with its CD empty; so do a domain whose hints match both its disks, one whose
//! `Disk` is a path to no disk (`/dev/sdz`) and one whose hints match none. The images come in
//! the forms distributions ship: the stock image as compressed qcow2, the test image as zstd
//! and as xz, and the server of the xz one stops in the middle of its first download and then
//! starts again: that machine backs off and finishes with no wipe permission and no failure.
//! The second domain has two disks, and its entry names the
//! one to install onto by root device hints (its serial); the other, a SCSI disk the kernel
//! names before the virtual CD, holds an installed OS's config drive: the live environment
//! reads the CD's all the same, and that disk is untouched. A domain with Secure Boot on, being
//! reimaged (its disk holds an installed OS that lets Shepherd in, and its entry allows a
//! wipe), refuses the live image's unsigned loader and boots its disk instead: the OS that
//! answers is asked nothing, and after two live boots the machine fails with that cause, its
//! disk as it was. A last domain installs a Debian cloud image as distributions build theirs
//! (`scripts/cloud-image.sh`: cloud-init, no key, no network), with a static address in its
//! entry: cloud-init takes the config drive the agent added, and the machine heartbeats from
//! it at that address, Shepherd logged in as root. With `SHEPHERD_BARE_FIGURES` set, no replica is killed, and
//! the run's figures are printed as `key = value` lines (`scripts/bare-figures.sh` writes them
//! to bench/results/baremetal.md).

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::libvirt::{Domain, DomainSpec, Firmware};
use common::sushy::{start_libvirt_emulator, CertForm};
use common::vm::{run_for_guests, serve_files, server_for_guests, Built, Served, IMAGES_IN_GUEST};
use common::{announced_all, free_port, ChildGuard};
use shepherd_bmdb::{testing, BareHistoryEntry, BarePhase, Bmdb};
use uuid::Uuid;

/// Machines that get their OS installed.
const MACHINES: u8 = 3;
/// The index of the domain whose disk holds a partition table.
const PARTITIONED: u8 = MACHINES + 1;
/// The index of the domain with two disks that its entry's hints both match: refused too.
const AMBIGUOUS: u8 = PARTITIONED + 1;
/// The index of the domain whose entry's `Disk` is a path that names no disk.
const NO_SUCH_DISK: u8 = AMBIGUOUS + 1;
/// The index of the domain whose entry's hints match none of its disks.
const NO_MATCH: u8 = NO_SUCH_DISK + 1;
/// The index of the domain with Secure Boot on whose disk holds an installed OS that lets
/// Shepherd in: its firmware refuses the live image's unsigned loader and boots the disk.
const FELL_THROUGH: u8 = NO_MATCH + 1;
/// The index of the domain that installs the stock cloud image (cloud-init, no key) with a
/// static network.
const CLOUD: u8 = FELL_THROUGH + 1;
/// The domains.
const DOMAINS: u8 = CLOUD;
/// The static address the cloud image's entry gives it: QEMU's user network forwards SSH to
/// this address.
const CLOUD_ADDRESS: &str = "10.0.2.15/24";
/// The index of the domain whose image (xz) its server stops serving halfway through its
/// first download, and refuses the two requests after.
const INTERRUPTED: u8 = 3;
/// The index of the domain with two disks, whose entry names its disk by root device hints.
const HINTED: u8 = 2;
/// The index of the domain whose entry allows a wipe, and whose disk holds signatures past
/// the end of the image that only a wipe clears; it boots by UEFI, and installs the stock
/// image, which only the config drive Shepherd's agent adds lets Shepherd into.
const WIPED: u8 = 1;

/// What `scripts/live-image.sh` built: the live image, the OS images the tests install (with
/// a config drive of its own, and one as a stock cloud image is, without), and the key the
/// first lets in (copied with mode 0400, as `shepherd run` wants it); and the Debian cloud
/// image of `scripts/cloud-image.sh`.
struct LiveBuild {
    iso: PathBuf,
    target: PathBuf,
    stock: PathBuf,
    key: PathBuf,
    cloud: PathBuf,
}

impl LiveBuild {
    fn locate(dir: &Path) -> LiveBuild {
        let built = Built::locate("SHEPHERD_LIVE_DIR", "live", "live.iso", "the live image");
        LiveBuild {
            iso: built.path("live.iso"),
            target: built.path("target.img"),
            stock: built.path("target-stock.img"),
            key: built.private_key("test_id_ed25519", &dir.join("id_ed25519")),
            cloud: Built::locate(
                "SHEPHERD_CLOUD_DIR",
                "cloud",
                "cloud.img",
                "the cloud image",
            )
            .path("cloud.img"),
        }
    }
}

/// An OS image in the form it is served: its route, its bytes, and the raw image the disk
/// must hold after.
struct Form {
    route: &'static str,
    served: Vec<u8>,
    raw: PathBuf,
}

impl Form {
    /// `raw` as qcow2 with compressed clusters, by qemu-img (as distributions make theirs).
    fn qcow2(raw: &Path, dir: &Path, route: &'static str) -> Form {
        let to = dir.join("image.qcow2");
        let status = std::process::Command::new("qemu-img")
            .args(["convert", "-c", "-f", "raw", "-O", "qcow2"])
            .arg(raw)
            .arg(&to)
            .status()
            .expect("qemu-img (qemu-utils) is installed by scripts/test-deps.sh");
        assert!(status.success());
        Form {
            route,
            served: std::fs::read(&to).unwrap(),
            raw: raw.to_path_buf(),
        }
    }

    /// `raw` compressed with zstd.
    fn zstd(raw: &Path, route: &'static str) -> Form {
        let bytes = std::fs::read(raw).unwrap();
        Form {
            route,
            served: zstd::encode_all(bytes.as_slice(), 3).unwrap(),
            raw: raw.to_path_buf(),
        }
    }

    /// `raw` compressed with xz.
    fn xz(raw: &Path, route: &'static str) -> Form {
        use std::io::Write;
        let mut xz = liblzma::write::XzEncoder::new(Vec::new(), 3);
        xz.write_all(&std::fs::read(raw).unwrap()).unwrap();
        Form {
            route,
            served: xz.finish().unwrap(),
            raw: raw.to_path_buf(),
        }
    }
}

/// A replica: the process, its web UI's machine list and its metrics' addresses.
struct Replica {
    _child: ChildGuard,
    machines_page: String,
    metrics: String,
}

/// `shepherd run` over `inventory` on `url`, serving live images on loopback `media_port`
/// with the certificate in `certs`, its log in `log`; returns once it serves its web UI.
fn replica(
    url: &str,
    inventory: &Path,
    build: &LiveBuild,
    certs: &Path,
    media_port: u16,
    log: &Path,
) -> Replica {
    let mut child = ChildGuard(Some(
        run_for_guests(url, inventory, certs, &build.key)
            // Three guests emulated on two cores take seconds over a key exchange.
            .args(["--ssh-connect-timeout", "15s"])
            .args(["--session-interval", "2s"])
            .args([
                "--initializer-parallelism",
                "2",
                "--initializer-db-rate",
                "200ms,4",
            ])
            .args(["--provisioner-reconcile-rate", "1s,1"])
            .arg("--bare-live-image")
            .arg(&build.iso)
            .args(["--bare-media-listen", &format!("127.0.0.1:{media_port}")])
            .args([
                "--bare-media-url",
                &format!("https://127.0.0.1:{media_port}"),
            ])
            .arg("--bare-media-cert")
            .arg(certs.join("media/server.pem"))
            .arg("--bare-media-key")
            .arg(certs.join("media/server.key"))
            .args(["--bare-boot-wait", "10s", "--bare-db-rate", "200ms,4"])
            // The interrupted machine's image server is back at once: a short backoff.
            .args(["--bare-retry-wait", "5s"])
            // The cloud image is a few hundred MiB, written by an emulated CPU.
            .args(["--bare-live-boot-timeout=6m", "--bare-install-timeout=12m"])
            .args(["--bare-disk-boot-timeout=6m", "--bare-live-boot-attempts=2"])
            .args(["--bare-agent-env", "SHEPHERD_AGENT_HEARTBEAT_INTERVAL=2s"])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    ));
    let prefixes = ["shepherd run: web UI at ", "shepherd run: metrics at "];
    let [machines_page, metrics] = announced_all(child.child(), &prefixes).try_into().unwrap();
    Replica {
        _child: child,
        machines_page,
        metrics,
    }
}

/// The machine recorded for `domain`, once the provisioner has recorded it.
async fn machine_of(db: &Bmdb, domain: &Domain) -> Option<Uuid> {
    common::machine_named(db, &domain.name).await
}

/// The machine's bare-metal phase, and whether it heartbeated since its agent was started.
async fn state(db: &Bmdb, m: Uuid) -> (Option<BarePhase>, bool) {
    let read = db.read(move |tx| {
        Box::pin(async move {
            let bare = tx.bare_metal(m).await?;
            Ok((bare.map(|b| b.phase), tx.heartbeat(m).await?.is_some()))
        })
    });
    read.await.unwrap()
}

/// The machine's bare-metal steps.
async fn steps(db: &Bmdb, machine: Uuid) -> Vec<BareHistoryEntry> {
    db.read(move |tx| Box::pin(async move { tx.bare_history(machine, 1000).await }))
        .await
        .unwrap()
}

/// When, in seconds since the Unix epoch, each domain's sshd began to greet after each time
/// it stopped: polled from a thread of its own until `stop`.
fn watch_sshd(ports: Vec<u16>, stop: Arc<Mutex<bool>>) -> Arc<Mutex<BTreeMap<u16, Vec<f64>>>> {
    let seen = Arc::new(Mutex::new(BTreeMap::<u16, Vec<f64>>::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        let mut up: BTreeMap<u16, bool> = BTreeMap::new();
        while !*stop.lock().unwrap() {
            for &port in &ports {
                let greets = common::vm::ssh_greets(port);
                let was = up.insert(port, greets).unwrap_or(false);
                if greets && !was {
                    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH);
                    let now = now.unwrap().as_secs_f64();
                    record.lock().unwrap().entry(port).or_default().push(now);
                }
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    seen
}

fn at(entry: &BareHistoryEntry) -> f64 {
    entry.at.timestamp_micros() as f64 / 1e6
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blank_vms_go_from_their_bmcs_to_heartbeating_from_their_installed_os() {
    let figures = std::env::var_os("SHEPHERD_BARE_FIGURES").is_some();
    let dir = tempfile::tempdir().unwrap();
    let build = LiveBuild::locate(dir.path());
    let Some(t) = testing::postgres().await else {
        return;
    };
    let server_port = free_port();
    // The image each domain installs, by index; the others install the raw test image.
    let forms: BTreeMap<u8, Form> = [
        (WIPED, Form::qcow2(&build.stock, dir.path(), "/stock.qcow2")),
        (HINTED, Form::zstd(&build.target, "/target.img.zst")),
        (INTERRUPTED, Form::xz(&build.target, "/target.img.xz")),
        (CLOUD, Form::zstd(&build.cloud, "/cloud.img.zst")),
    ]
    .into_iter()
    .collect();
    let mut served: Vec<Served> = forms
        .iter()
        .map(|(index, form)| Served {
            bytes: form.served.clone(),
            route: form.route,
            cut_once: *index == INTERRUPTED,
        })
        .collect();
    served.push(Served {
        bytes: std::fs::read(&build.target).unwrap(),
        route: "/target.img",
        cut_once: false,
    });
    let (images_port, downloads) = serve_files(served).await;
    let domains: Vec<Domain> = (1..=DOMAINS)
        .map(|index| {
            Domain::define(
                dir.path(),
                &DomainSpec {
                    index,
                    disk_bytes: match index {
                        CLOUD => 768 << 20,
                        _ => 256 << 20,
                    },
                    // The second machine has a second disk, which its hints leave out.
                    second_disk_bytes: matches!(index, HINTED | AMBIGUOUS).then_some(64 << 20),
                    // The wiped machine boots by UEFI, the one the boot falls through on by
                    // UEFI with Secure Boot on, the others from a BIOS.
                    firmware: match index {
                        WIPED => Firmware::Uefi,
                        FELL_THROUGH => Firmware::SecureBoot,
                        _ => Firmware::Bios,
                    },
                    memory_mib: 512,
                    server_port,
                    images_port,
                },
            )
        })
        .collect();
    // The hinted machine's other disk holds an installed OS's config drive (a FAT partition
    // labelled CONFIG-2, as the test OS image has, with no live proof), on a disk the kernel
    // names before the virtual CD: its live environment must still read the CD's.
    let hinted = &domains[usize::from(HINTED) - 1];
    let (other_disk, _) = hinted.second_disk.as_ref().unwrap();
    let os_image = std::fs::read(&build.target).unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(other_disk)
            .unwrap();
        f.write_all(&os_image).unwrap();
    }
    let other_disk_sha256 = sha256_hex(&std::fs::read(other_disk).unwrap());
    // The machine being reimaged holds an installed OS (the test OS image, which boots with
    // Secure Boot on and lets Shepherd in), and its entry allows the wipe a reimage needs.
    let fell_through = &domains[usize::from(FELL_THROUGH) - 1];
    std::fs::write(&fell_through.disk, &os_image).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&fell_through.disk)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let fell_through_disks = as_they_are(&[&fell_through.disk]);
    let partitioned = &domains[usize::from(PARTITIONED) - 1];
    write_partition_table(&partitioned.disk);
    let wiped = &domains[usize::from(WIPED) - 1];
    let stale = write_stale_signatures(&wiped.disk);
    let partitioned_disks = as_they_are(&[&partitioned.disk]);
    let ambiguous = &domains[usize::from(AMBIGUOUS) - 1];
    let ambiguous_disks =
        as_they_are(&[&ambiguous.disk, &ambiguous.second_disk.as_ref().unwrap().0]);
    let no_such_disk = &domains[usize::from(NO_SUCH_DISK) - 1];
    let no_match = &domains[usize::from(NO_MATCH) - 1];
    let unmatched_disks = as_they_are(&[&no_such_disk.disk, &no_match.disk]);
    let uuids: Vec<String> = domains.iter().map(|d| d.uuid.clone()).collect();
    let bmc = start_libvirt_emulator(dir.path(), CertForm::SelfSigned, &uuids);
    let _server = server_for_guests(&t.url, server_port, dir.path());
    let certs = dir.path().join("certs");
    shepherd_server::dev_certs(&certs.join("media"), &["127.0.0.1".to_string()]).unwrap();
    let inventory = dir.path().join("inventory.json");
    let entries: Vec<serde_json::Value> = domains
        .iter()
        .map(|d| {
            // The hinted machine's disk is named by its serial (in another case than the
            // disk's: Ironic's hints are compared in lower case) among two whole disks.
            // The ambiguous machine's hints match both its disks.
            let disk = match &d.second_disk {
                Some(_) if d.name == ambiguous.name => serde_json::json!({"size": "<= 1"}),
                Some(_) => {
                    serde_json::json!({"serial": d.disk_serial.to_lowercase(), "size": "<= 1"})
                }
                None if d.name == no_such_disk.name => serde_json::json!("/dev/sdz"),
                None if d.name == no_match.name => serde_json::json!({"serial": "not-there"}),
                None => serde_json::json!("/dev/vda"),
            };
            let index = domains.iter().position(|o| o.name == d.name).unwrap() as u8 + 1;
            let (route, sha256) = match forms.get(&index) {
                Some(form) => (form.route, sha256_hex(&form.served)),
                None => (
                    "/target.img",
                    sha256_hex(&std::fs::read(&build.target).unwrap()),
                ),
            };
            let images = IMAGES_IN_GUEST.trim_end_matches(":80");
            let mut bare = serde_json::json!({"ImageURL": format!("http://{images}{route}"),
                "ImageSHA256": sha256, "Disk": disk,
                "Wipe": d.name == wiped.name || d.name == fell_through.name});
            if index == CLOUD {
                bare["Network"] = serde_json::json!({"Address": CLOUD_ADDRESS,
                    "Gateway": "10.0.2.2", "DNS": ["10.0.2.3"], "MAC": d.mac});
            }
            serde_json::json!({"ID": d.name, "Addr": d.ssh_addr(), "Location": "libvirt",
                "BMC": {"URL": bmc.url, "Username": "admin", "PasswordFile": bmc.password_file,
                        "CA": bmc.ca, "System": format!("/redfish/v1/Systems/{}", d.uuid)},
                "Bare": bare})
        })
        .collect();
    std::fs::write(&inventory, serde_json::to_string(&entries).unwrap()).unwrap();
    let stop = Arc::new(Mutex::new(false));
    let greetings = watch_sshd(domains.iter().map(|d| d.ssh_port).collect(), stop.clone());

    let logs: Vec<PathBuf> = ["run-a.log", "run-b.log"]
        .iter()
        .map(|n| dir.path().join(n))
        .collect();
    let mut a = Some(replica(
        &t.url,
        &inventory,
        &build,
        &certs,
        free_port(),
        &logs[0],
    ));
    let b = replica(&t.url, &inventory, &build, &certs, free_port(), &logs[1]);
    let db = t.db.clone();
    let tail = || {
        let mut text = String::new();
        for log in &logs {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = log.lines().rev().take(15).collect();
            text += &lines.into_iter().rev().collect::<Vec<_>>().join("\n");
            text += "\n---\n";
        }
        text
    };

    // Replica A is killed once a machine boots its live environment.
    if !figures {
        testing::eventually_every(
            "a machine to boot its live environment",
            Duration::from_secs(300),
            Duration::from_millis(500),
            async || {
                let mut phases = vec![];
                for d in &domains {
                    if let Some(m) = machine_of(&db, d).await {
                        phases.push(state(&db, m).await.0);
                    }
                }
                let booting = phases.contains(&Some(BarePhase::LiveBoot));
                testing::when(booting, (phases, tail()))
            },
        )
        .await;
        drop(a.take());
    }

    let cloud = &domains[usize::from(CLOUD) - 1];
    let installed: Vec<&Domain> = domains[..usize::from(MACHINES)]
        .iter()
        .chain([cloud])
        .collect();
    // Four reach heartbeating from their installed OS, and the other five fail; the
    // first heartbeat of each after its disk boot is noted as it comes.
    let mut heartbeat_at: BTreeMap<Uuid, f64> = BTreeMap::new();
    testing::eventually_every(
        "four machines to heartbeat from their installed OS, and the other five to fail",
        Duration::from_secs(1500),
        Duration::from_millis(250),
        async || {
            let mut done = 0;
            let mut seen = vec![];
            let mut refused = true;
            for d in [partitioned, ambiguous, no_such_disk, no_match, fell_through] {
                let failed = match machine_of(&db, d).await {
                    Some(m) => state(&db, m).await.0 == Some(BarePhase::Failed),
                    None => false,
                };
                refused &= failed;
            }
            for d in installed.iter().copied() {
                let Some(m) = machine_of(&db, d).await else {
                    continue;
                };
                let (phase, beat) = state(&db, m).await;
                if matches!(phase, Some(BarePhase::DiskBoot | BarePhase::Done)) && beat {
                    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH);
                    heartbeat_at.entry(m).or_insert(now.unwrap().as_secs_f64());
                }
                done += usize::from(phase == Some(BarePhase::Done));
                assert_ne!(phase, Some(BarePhase::Failed), "{}", tail());
                seen.push(phase);
            }
            testing::when(done == installed.len() && refused, (seen, tail()))
        },
    )
    .await;
    *stop.lock().unwrap() = true;

    let emulator_log = std::fs::read_to_string(&bmc.log).unwrap_or_default();
    let mut parts = vec![];
    for (index, d) in (1..).zip(&domains[..usize::from(MACHINES)]) {
        let m = machine_of(&db, d).await.unwrap();
        let steps = steps(&db, m).await;
        let step = |phase: BarePhase| steps.iter().find(|s| s.phase == phase).unwrap();
        let phases: Vec<BarePhase> = steps.iter().map(|s| s.phase).collect();
        let the_way: Vec<BarePhase> = BarePhase::ALL
            .iter()
            .copied()
            .filter(|p| *p != BarePhase::Failed)
            .collect();
        // The interrupted machine went back from Installing to LiveBoot while its image's
        // server was down; its way is otherwise the same.
        let mut once = vec![];
        for phase in &phases {
            if index != INTERRUPTED || !once.contains(phase) {
                once.push(*phase);
            }
        }
        if index == INTERRUPTED {
            interrupted_and_asked_again(&steps);
        }
        assert_eq!(
            once, the_way,
            "{}: each step once, in order: {steps:#?}",
            d.name
        );
        // The BMC was asked to insert the live image once.
        let insert = format!(
            "POST /redfish/v1/Systems/{}/VirtualMedia/Cd/Actions/VirtualMedia.InsertMedia",
            d.uuid
        );
        let inserts = emulator_log.lines().filter(|l| l.contains(&insert)).count();
        assert_eq!(inserts, 1, "{}: {emulator_log}", d.name);
        // The disk holds the image, but for its MBR's second entry: the config drive the
        // agent added, in the disk's last 64 MiB.
        let stock = d.name == wiped.name;
        let image = std::fs::read(forms.get(&index).map_or(&build.target, |f| &f.raw)).unwrap();
        let disk = std::fs::read(&d.disk).unwrap();
        assert!(
            disk[..462] == image[..462] && disk[478..image.len()] == image[478..],
            "{}: the disk holds the image",
            d.name
        );
        let entry = |at: usize| u32::from_le_bytes(disk[at..at + 4].try_into().unwrap());
        assert_eq!(
            (entry(462 + 8), entry(462 + 12)),
            ((256 - 64) << 11, 64 << 11),
            "{}: the config drive's partition",
            d.name
        );
        let ejecting = step(BarePhase::Ejecting);
        let drive =
            "then added a config drive (FAT, label config-2, 64 MiB) as partition 2 of its MBR";
        assert!(ejecting.detail.contains(drive), "{ejecting:?}");
        if let Some((second, _)) = &d.second_disk {
            assert_eq!(
                sha256_hex(&std::fs::read(second).unwrap()),
                other_disk_sha256,
                "{}: the disk the hints leave out is untouched",
                d.name
            );
            let console = d.serial_log();
            assert!(
                console.contains("shepherd live environment: config drive on /dev/sr0"),
                "{}: its live environment read the CD's config drive: {console}",
                d.name
            );
            let asked = step(BarePhase::Installing);
            assert!(
                asked.detail.contains(&format!(
                    r#"onto the hints {{"serial":"{}","size":"<= 1"}}"#,
                    d.disk_serial.to_lowercase()
                )),
                "{asked:?}"
            );
        }
        if d.name == wiped.name {
            for (offset, what) in &stale {
                let at = *offset as usize;
                assert!(
                    disk[at..at + 8].iter().all(|b| *b == 0),
                    "{}: {what} is cleared",
                    d.name
                );
            }
            let cleared = "the agent cleared a Linux RAID member (md 1.0) on /dev/vda1; \
                           an MBR partition table and a GPT partition table's backup header \
                           on /dev/vda, then wrote the image onto /dev/vda";
            assert!(ejecting.detail.contains(cleared), "{ejecting:?}");
        }
        // The stock image, with no key of its own, let Shepherd in by the config drive the
        // agent added.
        if stock {
            let console = d.serial_log();
            assert!(
                console.contains("shepherd installed OS: config drive on /dev/vda2"),
                "{}: {console}",
                d.name
            );
        }
        // The last boot was from the disk, and the virtual CD is empty.
        let serial = d.serial_log();
        let last_boot = serial
            .lines()
            .rfind(|l| l.contains(": starting (kernel"))
            .unwrap_or_default()
            // The firmware's output may leave a carriage return before it.
            .trim()
            .to_string();
        assert!(
            last_boot.starts_with("shepherd installed OS"),
            "{}: the last boot: {last_boot:?}\n{serial}",
            d.name
        );
        // Each boot kept the mode the system shows (the entries name none): sushy-tools
        // shows UEFI for a domain with a UEFI loader, and no mode for one without.
        let kept = match d.firmware {
            Firmware::Bios => "in the firmware's own mode (the BMC shows none)",
            Firmware::Uefi | Firmware::SecureBoot => "in the system's UEFI mode",
        };
        // (The live boot of a machine replica A had powered on before it was killed says
        // only that.)
        let live = step(BarePhase::LiveBoot);
        let again = live.detail.contains("it was on already: powered on before");
        assert!(live.detail.contains(kept) || again, "{}: {live:?}", d.name);
        let disk = step(BarePhase::DiskBoot);
        assert!(disk.detail.contains(kept), "{}: {disk:?}", d.name);
        let firmware = d.firmware.shown();
        assert!(
            last_boot.contains(&format!("booted by {firmware})")),
            "{}: the installed OS booted by {firmware}: {last_boot:?}",
            d.name
        );
        assert_eq!(
            serial
                .matches("shepherd live environment: starting")
                .count(),
            1,
            "{serial}"
        );
        let xml = d.xml();
        assert!(
            !xml.contains("device='cdrom'"),
            "{}: the CD is not empty: {xml}",
            d.name
        );
        assert!(d.is_running(), "{}", d.name);
        // The installed OS's agent reported the machine's hardware: its NIC.
        let shown = common::machine_json(&t.url, m);
        assert_eq!(
            reported_macs(&shown),
            [d.mac.as_str()],
            "{}: {shown}",
            d.name
        );
        // `machines show` and the web UI list its steps with the time spent in each.
        let shown_steps: Vec<(&str, f64)> = shown["bare_steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["phase"].as_str().unwrap(), s["seconds"].as_f64().unwrap()))
            .collect();
        let names: Vec<String> = phases.iter().map(|p| p.to_string()).collect();
        assert_eq!(shown_steps.iter().map(|s| s.0).collect::<Vec<_>>(), names);
        assert!(
            shown_steps[..names.len() - 1].iter().all(|s| s.1 > 0.0),
            "{shown}"
        );
        assert_eq!(shown["bare_metal"]["phase"], "Done", "{shown}");
        let page = b
            .machines_page
            .replace("/machines", &format!("/machines/{m}"));
        let page = common::get_text(&page).await;
        for name in &names {
            let row = format!(r#"<tr data-phase="{name}">"#);
            assert!(
                page.contains(&row),
                "{}: no {row} on its page: {page}",
                d.name
            );
        }

        use BarePhase::*;
        let entered = |phase| at(step(phase));
        let greeted = greetings
            .lock()
            .unwrap()
            .get(&d.ssh_port)
            .cloned()
            .unwrap_or_default();
        let first_greeting_after = |t: f64| greeted.iter().copied().find(|g| *g >= t).unwrap();
        let heartbeat = heartbeat_at[&m];
        // The interrupted machine's installation waited for its image's server.
        if index == INTERRUPTED {
            continue;
        }
        parts.push([
            heartbeat - entered(Bare),
            first_greeting_after(entered(LiveBoot)) - entered(LiveBoot),
            entered(Ejecting) - entered(Installing),
            heartbeat - entered(DiskBoot),
        ]);
    }
    // Each machine downloaded its image once (the interrupted one twice: the download that
    // broke off, and the one after its server came back), besides the qcow2 tables' ranges.
    // The agents that refused did so before they fetched anything.
    let whole: BTreeMap<String, usize> = downloads.lock().unwrap().clone();
    let want: BTreeMap<String, usize> = forms
        .values()
        .map(|f| {
            (
                f.route.to_string(),
                1 + usize::from(f.route.ends_with(".xz")),
            )
        })
        .collect();
    assert_eq!(whole, want);
    refused(
        &db,
        partitioned,
        &["/dev/vda holds an MBR partition table", "wipe"],
        &partitioned_disks,
    )
    .await;
    // Hints that match both disks: the cause lists both, by name and serial.
    let both = [
        "2 whole disks match the hints".to_string(),
        "/dev/vda (".to_string(),
        format!("serial {}", ambiguous.disk_serial),
        "/dev/sda (".to_string(),
        format!("serial {}", ambiguous.second_disk.as_ref().unwrap().1),
    ];
    let both: Vec<&str> = both.iter().map(String::as_str).collect();
    refused(&db, ambiguous, &both, &ambiguous_disks).await;
    // A path to no disk, and hints that match none: the cause lists the disks seen, nothing
    // is written (nothing went into the live environment's /dev either: the disk boot never
    // came).
    for (d, wanted) in [(no_such_disk, "/dev/sdz"), (no_match, "the hints")] {
        let cause = [
            format!("no whole disk is {wanted}"),
            "the whole disks this machine has: /dev/vda (".to_string(),
            format!("serial {}", d.disk_serial),
            "nothing was written".to_string(),
        ];
        let cause: Vec<&str> = cause.iter().map(String::as_str).collect();
        let disk = unmatched_disks
            .iter()
            .filter(|(p, _)| *p == d.disk)
            .cloned()
            .collect::<Vec<_>>();
        refused(&db, d, &cause, &disk).await;
    }
    fell_through_twice(&db, fell_through, &fell_through_disks).await;
    cloud_init_let_shepherd_in(&db, cloud, &build.key, &t.url).await;
    // The surviving replica counted what it did: both machines' last steps, the other two's
    // failures (all after the other was killed).
    let metrics = common::get_text(&b.metrics).await;
    let entered = |phase: &str| {
        let name = format!("shepherd_bare_metal_phases_entered_total{{phase=\"{phase}\"}}");
        common::sample(&metrics, &name)
    };
    if !figures {
        assert_eq!(entered("Done"), Some(f64::from(MACHINES + 1)), "{metrics}");
        assert_eq!(entered("Failed"), Some(5.0), "{metrics}");
    }
    if figures {
        let mean = |i: usize| parts.iter().map(|p| p[i]).sum::<f64>() / parts.len() as f64;
        let (total, live, install, disk) = (mean(0), mean(1), mean(2), mean(3));
        println!("bare_to_heartbeating_s = {total:.1}");
        println!("live_boot_to_ssh_s = {live:.1}");
        println!("install_s = {install:.1}");
        println!("disk_boot_to_heartbeat_s = {disk:.1}");
        println!(
            "bare_overhead_ratio = {:.2}",
            total / (live + install + disk)
        );
        let mb = std::fs::metadata(&build.iso).unwrap().len() as f64 / 1e6;
        println!("live_image_mb = {mb:.1}");
    }
}

/// The interrupted machine's installation: its image's server failed it after the agent had
/// begun writing, so Shepherd backed off and asked again, allowing itself to write the disk
/// again without any wipe permission; and it never failed.
fn interrupted_and_asked_again(steps: &[BareHistoryEntry]) {
    let installing: Vec<&BareHistoryEntry> = steps
        .iter()
        .filter(|s| s.phase == BarePhase::Installing)
        .collect();
    assert!(installing.len() >= 2, "asked again: {steps:#?}");
    let began = "began writing the disk, so Shepherd may write it again during this live boot";
    assert!(
        steps
            .iter()
            .any(|s| s.phase == BarePhase::LiveBoot && s.detail.contains(began)),
        "{steps:#?}"
    );
    let last = installing.last().unwrap();
    assert!(
        last.detail.contains("Shepherd itself"),
        "the last request allows the rewrite: {last:?}"
    );
    assert!(
        installing[0]
            .detail
            .contains("the disk is written only if it is blank"),
        "the first request allows no wipe: {:?}",
        installing[0]
    );
    assert!(
        !steps.iter().any(|s| s.phase == BarePhase::Failed),
        "{steps:#?}"
    );
}

/// The stock cloud image, which holds no key and no network of its own, booted from the disk
/// its agent wrote: cloud-init read the config drive the agent added, brought up the entry's
/// static address (no DHCP lease), and let Shepherd in as root with its key, so the agent
/// heartbeats from it and reported its NIC.
async fn cloud_init_let_shepherd_in(db: &Bmdb, d: &Domain, key: &Path, url: &str) {
    let m = machine_of(db, d).await.unwrap();
    let steps = steps(db, m).await;
    let ejecting = steps
        .iter()
        .find(|s| s.phase == BarePhase::Ejecting)
        .unwrap();
    let drive = "then added a config drive (FAT, label config-2, 64 MiB) as partition 3 of its MBR";
    assert!(ejecting.detail.contains(drive), "{ejecting:?}");
    let console = d.serial_log();
    assert!(
        console.contains("Datasource DataSourceConfigDrive"),
        "{}: cloud-init read a config drive: {console}",
        d.name
    );
    let out = std::process::Command::new("ssh")
        .args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"])
        .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"])
        .arg("-i")
        .arg(key)
        .args(["-p", &d.ssh_port.to_string(), "root@127.0.0.1"])
        .arg("id -u; hostname; ip -o -4 addr show scope global; ip -4 route show default")
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}: {shown}{}",
        d.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.first(), Some(&"0"), "{}: root: {shown}", d.name);
    assert_eq!(lines.get(1), Some(&d.name.as_str()), "{shown}");
    let address = lines.get(2).copied().unwrap_or_default();
    assert!(
        address.contains(&format!("inet {CLOUD_ADDRESS}")) && !address.contains("dynamic"),
        "{}: the entry's static address, not a lease: {shown}",
        d.name
    );
    assert!(
        lines
            .get(3)
            .is_some_and(|r| r.starts_with("default via 10.0.2.2")),
        "{}: the entry's gateway: {shown}",
        d.name
    );
    let reported = common::machine_json(url, m);
    assert_eq!(
        reported_macs(&reported),
        [d.mac.as_str()],
        "{}: {reported}",
        d.name
    );
}

/// The MACs of the NICs in the hardware report of `machines show`'s JSON `shown`.
fn reported_macs(shown: &serde_json::Value) -> Vec<&str> {
    shown["hardware_report"]["nics"]
        .as_array()
        .map(|nics| nics.iter().filter_map(|n| n["mac"].as_str()).collect())
        .unwrap_or_default()
}

/// Secure Boot refused the live image's loader each time, so the firmware booted the disk's
/// installed OS, which let Shepherd in: its agent, showing no proof of the live boot, was
/// asked nothing, the machine was ejected and booted again, and failed after its second live
/// boot with that cause; its disk is as it was, though its entry allows a wipe.
async fn fell_through_twice(db: &Bmdb, d: &Domain, disks: &[(PathBuf, String)]) {
    let cause = [
        "the CD boot fell through to the installed OS",
        "2 times",
        "Secure Boot",
        "nothing was written",
    ];
    refused(db, d, &cause, disks).await;
    let m = machine_of(db, d).await.unwrap();
    let steps = steps(db, m).await;
    let fell = "the CD boot fell through to the installed OS: what answered SSH showed no proof \
                of this live boot, so no installation was asked of it (live boot 1 of 2)";
    let fell_then = steps
        .iter()
        .any(|s| s.phase == BarePhase::Bare && s.detail.contains(fell));
    let asked = steps.iter().any(|s| s.phase == BarePhase::Installing);
    assert!(fell_then && !asked, "{}: {steps:#?}", d.name);
    let request = db.read(move |tx| Box::pin(async move { tx.os_installation_request(m).await }));
    assert_eq!(request.await.unwrap(), None, "{}", d.name);
    let console = d.serial_log();
    assert!(
        console.matches("shepherd installed OS: starting").count() >= 2
            && !console.contains("shepherd live environment: starting"),
        "{}: the installed OS booted each time, the live environment never: {console}",
        d.name
    );
}

/// Each of `disks` with the sha256 of what it holds now.
fn as_they_are(disks: &[&Path]) -> Vec<(PathBuf, String)> {
    disks
        .iter()
        .map(|d| (d.to_path_buf(), sha256_hex(&std::fs::read(d).unwrap())))
        .collect()
}

/// `d`'s agent refused its installation before it wrote anything: the machine failed with a
/// cause that says each of `cause`, it never went on to eject, it is left off with its CD
/// empty, and each of its `disks` holds what it held before.
async fn refused(db: &Bmdb, d: &Domain, cause: &[&str], disks: &[(PathBuf, String)]) {
    let m = machine_of(db, d).await.unwrap();
    let steps = steps(db, m).await;
    let failed = steps.last().unwrap();
    assert_eq!(failed.phase, BarePhase::Failed, "{}: {steps:#?}", d.name);
    for part in cause {
        assert!(
            failed.detail.contains(part),
            "{}: {part:?} in {steps:#?}",
            d.name
        );
    }
    assert!(
        !steps.iter().any(|s| s.phase == BarePhase::Ejecting),
        "{}: {steps:#?}",
        d.name
    );
    assert!(!d.is_running(), "{}: it is left off", d.name);
    assert!(
        !d.xml().contains("device='cdrom'"),
        "{}: its CD is empty",
        d.name
    );
    for (disk, sha256) in disks {
        let now = sha256_hex(&std::fs::read(disk).unwrap());
        assert_eq!(&now, sha256, "{}: {} is untouched", d.name, disk.display());
    }
}

/// Writes an MBR with one Linux partition at `disk`'s start, as a disk with an OS has.
fn write_partition_table(disk: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    let mut mbr = [0u8; 512];
    // Partition 1: type 0x83, from sector 2048, 65536 sectors.
    mbr[446 + 4] = 0x83;
    mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    mbr[446 + 12..446 + 16].copy_from_slice(&65536u32.to_le_bytes());
    mbr[510..].copy_from_slice(&[0x55, 0xaa]);
    let mut f = std::fs::OpenOptions::new().write(true).open(disk).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(&mbr).unwrap();
}

/// Leaves on `disk` (256 MiB) what a disk that was once an md 1.0 RAID member under a GPT
/// keeps past an image's end: an MBR whose one partition lies from 128 MiB to 248 MiB with an
/// md 1.0 superblock at its end, and a GPT's backup header in the disk's last sector. Returns
/// where each lies, and what it is.
fn write_stale_signatures(disk: &Path) -> [(u64, &'static str); 2] {
    use std::os::unix::fs::FileExt;
    let (start, sectors) = (262_144u32, 245_760u32);
    let mut mbr = [0u8; 512];
    mbr[446 + 4] = 0x83;
    mbr[446 + 8..446 + 12].copy_from_slice(&start.to_le_bytes());
    mbr[446 + 12..446 + 16].copy_from_slice(&sectors.to_le_bytes());
    mbr[510..].copy_from_slice(&[0x55, 0xaa]);
    let md_10 = (u64::from(start) + ((u64::from(sectors) - 16) & !7)) * 512;
    let backup_gpt = (256 << 20) - 512;
    let f = std::fs::OpenOptions::new().write(true).open(disk).unwrap();
    f.write_all_at(&mbr, 0).unwrap();
    f.write_all_at(&[0xfc, 0x4e, 0x2b, 0xa9, 1, 0, 0, 0], md_10)
        .unwrap();
    f.write_all_at(b"EFI PART", backup_gpt).unwrap();
    [
        (md_10, "the md 1.0 superblock"),
        (backup_gpt, "the backup GPT header"),
    ]
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
