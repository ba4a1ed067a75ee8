//! `shepherd machines list/show/history` and `shepherd sessions list` over a BMDB seeded with a
//! machine in every lifecycle state.

use std::collections::BTreeMap;
use std::process::{Command, Output};

use chrono::{Duration, Utc};
use serde_json::Value;
use shepherd_bmdb::*;
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

/// Seeds one machine per state; returns (machine id → expected state) and the session kept
/// alive for the in-work machine.
async fn seed(db: &Bmdb) -> (BTreeMap<String, &'static str>, Session) {
    let session = db
        .start_session(SessionConfig::new(
            "shepherd-initializer",
            Processor::ShepherdInitializer,
        ))
        .await
        .unwrap();
    let sid = session.id();
    let states = db
        .transact(move |tx| {
            Box::pin(async move {
                let mut out = Vec::new();
                let provided = async |tx: &mut Tx, n: usize| -> Result<Uuid, Error> {
                    let id = tx.create_machine().await?;
                    tx.set_provided(
                        id,
                        &Provided {
                            provider: if n == 0 {
                                Provider::Sim
                            } else {
                                Provider::Static
                            },
                            provider_id: format!("box-{n}"),
                            reservation_id: None,
                            ip_address: Some(format!("10.0.0.{n}")),
                            location: Some("rack-1".into()),
                            status: None,
                        },
                    )
                    .await?;
                    Ok(id)
                };
                out.push((tx.create_machine().await?, "unprovided"));
                out.push((provided(tx, 0).await?, "provided"));
                let id = provided(tx, 1).await?;
                tx.set_agent_started(id, &[1; 32]).await?;
                out.push((id, "agent starting"));
                let id = provided(tx, 2).await?;
                tx.set_agent_started(id, &[2; 32]).await?;
                tx.set_heartbeat(id).await?;
                out.push((id, "heartbeating"));
                let id = provided(tx, 3).await?;
                tx.set_agent_started(id, &[3; 32]).await?;
                tx.set_heartbeat_at(id, Utc::now() - Duration::minutes(11))
                    .await?;
                out.push((id, "stale"));
                let id = provided(tx, 4).await?;
                tx.set_backoff_raw(
                    id,
                    Process::ShepherdAgentStart,
                    Utc::now() + Duration::minutes(5),
                    300,
                )
                .await?;
                out.push((id, "in backoff"));
                let id = provided(tx, 5).await?;
                tx.insert_work_raw(id, sid, Process::ShepherdAgentStart)
                    .await?;
                out.push((id, "in work"));
                for (n, generation, report, state) in
                    [(6, 2, None, "installing"), (7, 3, Some(3), "installed")]
                {
                    let id = provided(tx, n).await?;
                    tx.set_agent_started(id, &[n as u8; 32]).await?;
                    tx.set_heartbeat(id).await?;
                    tx.set_os_installation_request(
                        id,
                        &OsInstallationRequest {
                            generation,
                            request_raw: vec![],
                        },
                    )
                    .await?;
                    if let Some(g) = report {
                        tx.set_os_installation_report(
                            id,
                            &OsInstallationReport {
                                generation: g,
                                result: InstallationResult::Success,
                                report_raw: vec![],
                            },
                        )
                        .await?;
                    }
                    out.push((id, state));
                }
                Ok(out)
            })
        })
        .await
        .unwrap();
    (
        states
            .into_iter()
            .map(|(id, s)| (id.to_string(), s))
            .collect(),
        session,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_are_listed_filtered_and_shown() {
    let t = testing::sqlite().await;
    let url = t.url.clone();
    let (want, session) = seed(&t.db).await;

    let listed = json(&shepherd(&url, &["machines", "list", "--json"]));
    let got: BTreeMap<String, &str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["machine_id"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, want);
    let ids: Vec<&String> = want.keys().collect();
    assert_eq!(listed[0]["machine_id"], *ids[0], "listed in id order");

    // Filters and paging.
    let stale = json(&shepherd(
        &url,
        &["machines", "list", "--json", "--state", "stale"],
    ));
    assert_eq!(stale.as_array().unwrap().len(), 1);
    assert_eq!(stale[0]["provider_id"], "box-3");
    assert_eq!(stale[0]["address"], "10.0.0.3");
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
    assert_eq!(shown["installation_request_generation"], 3);
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
    session.close().await.unwrap();
    t.cleanup().await;
}
