//! `shepherd machines list/show/history` and `shepherd sessions list` over a BMDB seeded with a
//! machine in every lifecycle state.

use crate::common;

use std::collections::BTreeMap;
use std::process::{Command, Output};

use serde_json::Value;
use shepherd_bmdb::*;
use shepherd_proto::Message;
use uuid::Uuid;

fn shepherd(url: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shepherd"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SHEPHERD_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args).args(["--database", url]).output().unwrap()
}

fn json(o: &Output) -> Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Each element of the JSON array `list`, seen through `view`.
fn each<'a, T, C: FromIterator<T>>(list: &'a Value, view: impl Fn(&'a Value) -> T) -> C {
    list.as_array()
        .expect("a JSON array")
        .iter()
        .map(view)
        .collect()
}

/// A JSON string's text.
fn text(v: &Value) -> &str {
    v.as_str().expect("a JSON string")
}

/// What the tests start from: a fresh BMDB and its URL, seeded with one machine per state
/// (machine id → expected state label, and the machines), and the session that keeps the
/// in-work machine in work.
type Seeded = (
    testing::TestDb,
    String,
    BTreeMap<String, &'static str>,
    Vec<testing::SeededMachine>,
    Session,
);

async fn seeded() -> Seeded {
    let t = testing::sqlite().await;
    let url = t.url.clone();
    let (seeded, session) = testing::seed_every_state(&t.db).await;
    let want = seeded
        .iter()
        .map(|m| (m.id.to_string(), m.state.label()))
        .collect();
    (t, url, want, seeded, session)
}

/// [`seeded`], and the machine in backoff.
async fn seeded_in_backoff() -> (testing::TestDb, String, Uuid, Session) {
    let (t, url, _, seeded, session) = seeded().await;
    let m = seeded.iter().find(|m| m.state == Lifecycle::InBackoff);
    (t, url, m.unwrap().id, session)
}

/// Closes the seeding session and removes the database.
async fn done(session: Session, t: testing::TestDb) {
    session.close().await.unwrap();
    t.cleanup().await;
}

/// Replaces what differs between runs (machine and session ids, times) with stable
/// placeholders, so the output can be compared with a checked-in golden file.
fn normalize(out: &str, seeded: &[testing::SeededMachine], session: &Session) -> String {
    let mut out = out.to_string();
    for m in seeded {
        out = out.replace(&m.id.to_string(), &format!("<machine {}>", m.state.slug()));
    }
    out = out.replace(&session.id().to_string(), "<session>");
    let time = regex_lite::Regex::new(r#""\d{4}-\d\d-\d\dT[0-9:.]+(\+00:00|Z)""#).unwrap();
    time.replace_all(&out, "\"<time>\"").into_owned()
}

/// Compares with `tests/golden/NAME`; `UPDATE_GOLDEN=1` rewrites the file instead.
fn golden(name: &str, got: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with UPDATE_GOLDEN=1 to create it)",
            path.display()
        )
    });
    assert_eq!(got, want, "output differs from {}", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_are_listed_filtered_and_shown() {
    let (t, url, want, seeded, session) = seeded().await;

    let listed = json(&shepherd(&url, &["machines", "list", "--json"]));
    let got: BTreeMap<String, &str> = each(&listed, |m| {
        (text(&m["machine_id"]).to_string(), text(&m["state"]))
    });
    assert_eq!(got, want);
    let ids: Vec<&String> = want.keys().collect();
    assert_eq!(listed[0]["machine_id"], *ids[0], "listed in id order");

    // Golden files pin the JSON shapes (ids and times replaced by placeholders); the list is
    // put in seeding order since ids are random.
    let mut by_seed: Vec<Value> = listed.as_array().unwrap().clone();
    by_seed.sort_by_key(|m| {
        seeded
            .iter()
            .position(|s| m["machine_id"] == s.id.to_string())
    });
    golden(
        "machines_list.json",
        &normalize(
            &serde_json::to_string_pretty(&by_seed).unwrap(),
            &seeded,
            &session,
        ),
    );
    for state in [
        Lifecycle::InWork,
        Lifecycle::InBackoff,
        Lifecycle::Installed,
    ] {
        let m = seeded.iter().find(|m| m.state == state).unwrap();
        let out = shepherd(&url, &["machines", "show", &m.id.to_string(), "--json"]);
        assert!(out.status.success());
        golden(
            &format!("machines_show_{}.json", state.slug()),
            &normalize(&String::from_utf8(out.stdout).unwrap(), &seeded, &session),
        );
    }

    // Filters and paging.
    let stale = json(&shepherd(
        &url,
        &["machines", "list", "--json", "--state", "stale"],
    ));
    assert_eq!(stale.as_array().unwrap().len(), 1);
    assert_eq!(stale[0]["provider_id"], "box-3");
    assert_eq!(stale[0]["address"], "10.0.0.3");
    // Stale means what the site's recoverer means: silent for longer than its threshold.
    let patient = [
        "machines",
        "list",
        "--json",
        "--state",
        "stale",
        "--recovery-heartbeat-older-than",
        "30m",
    ];
    assert_eq!(json(&shepherd(&url, &patient)).as_array().unwrap().len(), 0);
    let box3 = stale[0]["machine_id"].as_str().unwrap();
    let shown = json(&shepherd(
        &url,
        &[
            "machines",
            "show",
            box3,
            "--json",
            "--recovery-heartbeat-older-than",
            "30m",
        ],
    ));
    assert_eq!(shown["state"], "heartbeating", "{shown}");
    let sim = json(&shepherd(
        &url,
        &["machines", "list", "--json", "--provider", "Sim"],
    ));
    assert_eq!(sim.as_array().unwrap().len(), 1);
    let first = json(&shepherd(
        &url,
        &["machines", "list", "--json", "--limit", "4"],
    ));
    let rest = json(&shepherd(
        &url,
        &["machines", "list", "--json", "--after", ids[3]],
    ));
    assert_eq!(
        first.as_array().unwrap().len() + rest.as_array().unwrap().len(),
        want.len()
    );
    assert_eq!(rest[0]["machine_id"], *ids[4]);
    let bad = shepherd(&url, &["machines", "list", "--provider", "Nope"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("provider \"Nope\""));

    // The table has a header and one line per machine.
    let table = shepherd(&url, &["machines", "list"]);
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.starts_with("MACHINE_ID"), "{text}");
    assert_eq!(text.lines().count(), want.len() + 1);

    // Details: the machine in work names its session; the installed one its installation.
    let in_work = want.iter().find(|(_, s)| **s == "in work").unwrap().0;
    let shown = json(&shepherd(&url, &["machines", "show", in_work, "--json"]));
    assert_eq!(shown["work"][0]["session_id"], session.id().to_string());
    assert_eq!(shown["work"][0]["process"], "ShepherdAgentStart");
    let installed = want.iter().find(|(_, s)| **s == "installed").unwrap().0;
    let shown = json(&shepherd(&url, &["machines", "show", installed, "--json"]));
    assert_eq!(shown["installation_report"]["result"], "Success");
    assert_eq!(shown["installation_request"]["generation"], 3);
    let missing = shepherd(&url, &["machines", "show", &Uuid::new_v4().to_string()]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("does not exist"));

    // Sessions.
    let out = shepherd(&url, &["sessions", "list"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(&session.id().to_string()) && text.contains("live"),
        "{text}"
    );
    done(session, t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_requests_bump_the_generation_and_bad_ones_are_refused() {
    let (t, url, _, seeded, session) = seeded().await;
    let sha = "ab".repeat(32);
    let installed = seeded
        .iter()
        .find(|m| m.state == Lifecycle::Installed)
        .unwrap()
        .id;
    let heartbeating = seeded
        .iter()
        .find(|m| m.state == Lifecycle::Heartbeating)
        .unwrap()
        .id;
    let install = |id: Uuid, image: &str, sha: &str, device: &str| {
        shepherd(
            &url,
            &[
                "machines",
                "install",
                &id.to_string(),
                "--image",
                image,
                "--sha256",
                sha,
                "--device",
                device,
                "--by",
                "dave",
                "--reason",
                "new image",
            ],
        )
    };
    for (id, want) in [(heartbeating, 1), (installed, 4), (heartbeating, 2)] {
        let out = install(id, "https://images.example/os.img", &sha, "/dev/sda");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&format!("generation {want}")),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let shown = json(&shepherd(
            &url,
            &["machines", "show", &id.to_string(), "--json"],
        ));
        assert_eq!(shown["installation_request"]["generation"], want);
        assert_eq!(shown["state"], "installing");
        assert_eq!(
            shown["installation_request"]["request"],
            format!("image https://images.example/os.img (sha256 {sha}) onto /dev/sda")
        );
        // Each request is in the machine's operators' history, with who asked and why.
        let actions = shown["operator_actions"].as_array().unwrap();
        let last = actions.last().expect("the install action is recorded");
        assert_eq!(last["action"], "install", "{last}");
        assert_eq!(last["by"], "dave", "{last}");
        assert_eq!(last["reason"], "new image", "{last}");
    }
    // The request is what the BMaaS server hands the agent.
    let request =
        t.db.read(move |tx| {
            Box::pin(async move { tx.pending_installation_request(heartbeating).await })
        })
        .await
        .unwrap()
        .expect("pending");
    let request = shepherd_proto::bmaas::OsInstallationRequest::decode(request.as_slice()).unwrap();
    assert_eq!(request.generation, 2);

    for (args, err) in [
        (
            ("ftp://x/os.img", sha.as_str(), "/dev/sda"),
            "not an http(s) URL",
        ),
        (("https://x/os.img", "abc", "/dev/sda"), "not 64 hex digits"),
        (
            ("https://x/os.img", sha.as_str(), ""),
            "device: must not be empty",
        ),
    ] {
        let out = install(heartbeating, args.0, args.1, args.2);
        common::refused(&out, err);
    }
    let missing = install(Uuid::new_v4(), "https://x/os.img", &sha, "/dev/sda");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("does not exist"));
    let shown = json(&shepherd(
        &url,
        &["machines", "show", &heartbeating.to_string(), "--json"],
    ));
    assert_eq!(
        shown["installation_request"]["generation"], 2,
        "refused requests change nothing"
    );
    done(session, t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_clears_backoffs_so_the_loops_take_the_machine_again() {
    let (t, url, m, session) = seeded_in_backoff().await;
    // A second backoff, as the recoverer leaves one when it gives up on a machine.
    t.db.transact(move |tx| {
        Box::pin(async move {
            let until = tx.now().await? + chrono::TimeDelta::days(36_500);
            tx.set_backoff(
                m,
                Process::ShepherdRecovery,
                until,
                0,
                "left alone after 6 reboots",
            )
            .await
        })
    })
    .await
    .unwrap();
    let active = |url: &str| {
        let shown = json(&shepherd(
            url,
            &["machines", "show", &m.to_string(), "--json"],
        ));
        let mut processes: Vec<String> = shown["backoffs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["active"] == true)
            .map(|b| b["process"].as_str().unwrap().to_string())
            .collect();
        processes.sort();
        processes
    };
    assert_eq!(active(&url), ["ShepherdAgentStart", "ShepherdRecovery"]);

    let out = shepherd(
        &url,
        &[
            "machines",
            "retry",
            &m.to_string(),
            "--process",
            "ShepherdRecovery",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 backoff(s) cleared"));
    assert_eq!(
        active(&url),
        ["ShepherdAgentStart"],
        "only the named process"
    );

    let out = shepherd(&url, &["machines", "retry", &m.to_string()]);
    assert!(out.status.success());
    assert!(active(&url).is_empty());
    let shown = json(&shepherd(
        &url,
        &["machines", "show", &m.to_string(), "--json"],
    ));
    assert_ne!(shown["state"], "in backoff", "{shown}");
    let out = shepherd(&url, &["machines", "retry", &m.to_string()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("no backoff to clear"));

    for (args, err) in [
        (vec![Uuid::new_v4().to_string()], "does not exist"),
        (
            vec![m.to_string(), "--process".into(), "Nope".into()],
            "--process",
        ),
    ] {
        let mut full = vec!["machines".to_string(), "retry".into()];
        full.extend(args);
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        let out = shepherd(&url, &full);
        common::refused(&out, err);
    }
    done(session, t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_host_key_drops_the_pin_and_ends_the_takeover_backoff() {
    let (t, url, m, session) = seeded_in_backoff().await;
    let old_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOld old";
    t.db.transact(move |tx| Box::pin(async move { tx.pin_ssh_host_key(m, old_key).await }))
        .await
        .unwrap();
    let shown = json(&shepherd(
        &url,
        &["machines", "show", &m.to_string(), "--json"],
    ));
    assert!(shown["ssh_host_key"].as_str().unwrap().contains("AAAAIOld"));
    assert_eq!(shown["state"], "in backoff");

    let out = shepherd(&url, &["machines", "forget-host-key", &m.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("forgot host key ssh-ed25519"));
    let shown = json(&shepherd(
        &url,
        &["machines", "show", &m.to_string(), "--json"],
    ));
    assert_eq!(shown["ssh_host_key"], Value::Null);
    assert!(
        !shown["backoffs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["process"] == "ShepherdAgentStart" && b["active"] == true),
        "{shown}"
    );
    let out = shepherd(&url, &["machines", "forget-host-key", &m.to_string()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("no host key pinned"));
    let out = shepherd(
        &url,
        &["machines", "forget-host-key", &Uuid::new_v4().to_string()],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    done(session, t).await;
}

/// Maintenance and decommission from the CLI: a reason is required, each action is shown in
/// `machines show`, the history and the state filter, and a decommissioned machine's history
/// outlives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_actions_are_recorded_and_shown() {
    let (t, url, _, seeded, session) = seeded().await;
    let m = seeded
        .iter()
        .find(|m| m.state == Lifecycle::Heartbeating)
        .unwrap()
        .id
        .to_string();
    let show = |url: &str| json(&shepherd(url, &["machines", "show", &m, "--json"]));

    let out = shepherd(&url, &["machines", "maintenance", "on", &m]);
    common::refused(&out, "--reason is needed");
    let out = shepherd(
        &url,
        &[
            "machines",
            "maintenance",
            "on",
            &m,
            "--reason",
            "disk swap",
            "--by",
            "carol",
        ],
    );
    ok(&out);
    assert!(String::from_utf8_lossy(&out.stdout).contains("in maintenance"));
    let shown = show(&url);
    assert_eq!(shown["state"], "maintenance", "{shown}");
    assert_eq!(shown["maintenance"]["by"], "carol");
    assert_eq!(shown["maintenance"]["reason"], "disk swap");
    assert_eq!(shown["operator_actions"][0]["action"], "maintenance-on");
    let listed = json(&shepherd(
        &url,
        &["machines", "list", "--state", "maintenance", "--json"],
    ));
    let ids: Vec<&str> = each(&listed, |r| text(&r["machine_id"]));
    assert_eq!(ids, [m.as_str()]);
    let out = shepherd(
        &url,
        &["machines", "maintenance", "off", &m, "--by", "carol"],
    );
    ok(&out);
    assert_eq!(show(&url)["state"], "heartbeating");

    let out = shepherd(&url, &["machines", "decommission", &m, "--by", "carol"]);
    common::refused(&out, "--reason is needed");
    let out = shepherd(
        &url,
        &[
            "machines",
            "decommission",
            &m,
            "--reason",
            "returned to vendor",
            "--by",
            "dave",
            "--undeploy",
        ],
    );
    ok(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("tears it down at its provider"), "{said}");
    let id: Uuid = m.parse().unwrap();
    let record = session
        .read(move |tx| Box::pin(async move { tx.decommissioned(id).await }))
        .await
        .unwrap()
        .expect("a decommissioning record");
    assert!(record.undeploy, "{record:?}");
    let out = shepherd(&url, &["machines", "show", &m]);
    common::refused(&out, "decommissioned");
    says(
        &url,
        &["machines", "history", &m],
        &[
            "operator carol       maintenance-on  disk swap",
            "operator carol       maintenance-off",
            "operator dave        decommission    returned to vendor",
        ],
    );
    let out = shepherd(&url, &["machines", "recommission", &m, "--by", "dave"]);
    ok(&out);
    let out = shepherd(&url, &["machines", "recommission", &m, "--by", "dave"]);
    common::refused(&out, "is not decommissioned");
    let out = shepherd(&url, &["machines", "history", &Uuid::new_v4().to_string()]);
    common::refused(&out, "does not exist");
    done(session, t).await;
}

/// A reason cannot forge the history: one with a newline or an escape sequence is refused
/// with a one-line error and nothing written, and one already stored (written before that
/// check, or by another tool) prints escaped, on its own line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reason_cannot_add_lines_to_the_history_or_move_the_terminal() {
    let (t, url, _, seeded, session) = seeded().await;
    let m = seeded[0].id;
    let id = m.to_string();
    let forged = "disk swap\n2030-01-01T00:00:00Z  operator oidc:admin  decommission";
    for reason in [forged, "tidy \x1b[2K\x1b[1Aup", "a\r\nb", "a\u{2028}b"] {
        let args = ["machines", "maintenance", "on", &id, "--by", "carol"];
        let out = shepherd(&url, &[&args[..], &["--reason", reason]].concat());
        common::refused(&out, "reason: holds the character");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr).trim().lines().count(),
            1
        );
    }
    let history = |url: &str| {
        let out = shepherd(url, &["machines", "history", &id]);
        ok(&out);
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(!history(&url).contains("carol"), "{}", history(&url));

    let stored = Operator {
        by: "mallory".into(),
        reason: forged.into(),
        request_id: None,
    };
    session.maintenance_on(m, &stored).await.unwrap();
    let printed = history(&url);
    let line = printed.lines().find(|l| l.contains("mallory")).unwrap();
    assert!(line.contains("disk swap\\n2030-01-01"), "{printed}");
    assert!(!printed.lines().any(|l| l.starts_with("2030")), "{printed}");
    done(session, t).await;
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Runs `shepherd ARGS`, which must succeed and print every line of `wants`.
fn says(url: &str, args: &[&str], wants: &[&str]) {
    let out = shepherd(url, args);
    ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for want in wants {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
}

/// `machines show` carries the whole decoded hardware report: CPU vendor, disks with vendor,
/// serial and WWN, NIC drivers and speeds, EFI support, the usable-memory ratio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_prints_the_whole_hardware_report() {
    use shepherd_proto::agent::*;
    let t = testing::sqlite().await;
    let url = t.url.clone();
    let report = shepherd_proto::bmaas::AgentHardwareReport {
        report: Some(Node {
            manufacturer: "Supermicro".into(),
            product: "AS-1114S".into(),
            serial_number: "S42".into(),
            memory_installed_bytes: 256 << 30,
            memory_usable_ratio: 0.975,
            efi_support: EfiSupport::Enabled as i32,
            cpu: vec![Cpu {
                vendor: "AuthenticAMD".into(),
                model: "AMD EPYC 7402P".into(),
                cores: 24,
                hardware_threads: 48,
                architecture: Some(cpu::Architecture::X8664(cpu::X8664 {
                    family: 23,
                    model: 49,
                    stepping: 0,
                })),
            }],
            block_device: vec![BlockDevice {
                vendor: "Samsung".into(),
                device_model: "PM9A3".into(),
                serial_number: "DISK7".into(),
                wwn: vec![0x00, 0x25, 0x38, 0xb1],
                capacity_bytes: 960 << 30,
                protocol: block_device::Protocol::Nvme as i32,
                ..Default::default()
            }],
            network_interface: vec![NetworkInterface {
                mac: vec![2, 0, 0, 0, 0, 7],
                driver: "mlx5_core".into(),
                supported_speed_bytes: vec![3_125_000_000],
                link_up: true,
                current_speed_bytes: 3_125_000_000,
            }],
        }),
        warning: vec!["no SMART data".into()],
    }
    .encode_to_vec();
    let id = testing::machine_with_agent(&t.db, &[7; 32]).await;
    t.db.transact(move |tx| {
        let report = report.clone();
        Box::pin(async move { tx.set_hardware_report(id, &report).await })
    })
    .await
    .unwrap();
    let m = id.to_string();
    let shown = json(&shepherd(&url, &["machines", "show", &m, "--json"]));
    let hw = &shown["hardware_report"];
    assert_eq!(hw["efi_support"], "EFI_SUPPORT_ENABLED");
    assert_eq!(hw["memory_usable_ratio"].as_f64().unwrap() as f32, 0.975);
    assert_eq!(hw["cpus"][0]["vendor"], "AuthenticAMD");
    assert_eq!(hw["cpus"][0]["x86_64"]["family"], 23);
    let disk = &hw["block_devices"][0];
    assert_eq!(
        (&disk["vendor"], &disk["serial_number"], &disk["wwn"]),
        (&"Samsung".into(), &"DISK7".into(), &"002538b1".into())
    );
    assert_eq!(hw["nics"][0]["driver"], "mlx5_core");
    assert_eq!(hw["nics"][0]["supported_speed_bytes"][0], 3_125_000_000i64);
    says(
        &url,
        &["machines", "show", &m],
        &[
            "Supermicro AS-1114S (serial S42), EFI enabled",
            "AMD EPYC 7402P (AuthenticAMD): 24 cores, 48 threads, family 23 model 49 stepping 0",
            "256.0 GiB installed, 97.5 % usable",
            "Samsung PM9A3 960.0 GiB (serial DISK7, wwn 002538b1), PROTOCOL_NVME, solid state",
            "02:00:00:00:00:07 driver mlx5_core, link up at 25000 Mbit/s, supports [25000 Mbit/s]",
            "no SMART data",
        ],
    );
    t.cleanup().await;
}

/// Operator views list expired backoffs too, marked as such, and only an active one puts the
/// machine in backoff (upstream's machine dump: active by default, expired on request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_and_active_backoffs_are_told_apart() {
    let t = testing::sqlite().await;
    let url = t.url.clone();
    let m =
        t.db.transact(|tx| {
            Box::pin(async move {
                let id = tx.create_machine().await?;
                tx.set_provided(id, &Provided::new(ProviderKind::Static, "bo-1"))
                    .await?;
                let now = tx.now().await?;
                tx.set_backoff(
                    id,
                    Process::ShepherdAgentStart,
                    now - chrono::TimeDelta::seconds(5),
                    60,
                    "expired cause",
                )
                .await?;
                Ok(id)
            })
        })
        .await
        .unwrap()
        .to_string();
    let shown = json(&shepherd(&url, &["machines", "show", &m, "--json"]));
    assert_eq!(shown["backoffs"][0]["active"], false, "{shown}");
    assert_eq!(shown["backoffs"][0]["cause"], "expired cause");
    assert_eq!(shown["state"], "provided");
    let id: Uuid = m.parse().unwrap();
    t.db.transact(move |tx| {
        Box::pin(async move {
            let until = tx.now().await? + chrono::TimeDelta::hours(1);
            tx.set_backoff(id, Process::ShepherdRecovery, until, 60, "active cause")
                .await
        })
    })
    .await
    .unwrap();
    let shown = json(&shepherd(&url, &["machines", "show", &m, "--json"]));
    let flags: Vec<(&str, bool)> = each(&shown["backoffs"], |b| {
        (text(&b["process"]), b["active"].as_bool().unwrap())
    });
    assert_eq!(
        flags,
        [("ShepherdAgentStart", false), ("ShepherdRecovery", true)]
    );
    assert_eq!(shown["state"], "in backoff");
    t.cleanup().await;
}
