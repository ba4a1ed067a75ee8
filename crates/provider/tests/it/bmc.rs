//! Redfish power control against a scripted BMC on loopback: BMCs that offer only some reset
//! types, answer 500 or hang, and the TLS certificates BMCs really ship.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use shepherd_provider::redfish::{Bmc, BmcEntry};
use shepherd_provider::testing::bmc::{Answer, BmcCerts, Script, ScriptedBmc};

fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

async fn reset(e: &BmcEntry) -> anyhow::Result<&'static str> {
    Ok(Bmc::new(e, Duration::from_secs(10))?.reset().await?)
}

#[tokio::test]
async fn off_then_on_when_nothing_restarts_and_the_state_is_confirmed() {
    let dir = tempfile::tempdir().unwrap();
    let bmc = ScriptedBmc::start(Script::allowing(&["On", "ForceOff"])).await;
    let client = Bmc::new(&bmc.entry(dir.path()), Duration::from_secs(10)).unwrap();
    assert_eq!(client.reset().await.unwrap(), "ForceOff, then On");
    assert_eq!(bmc.resets(), ["ForceOff", "On"]);
    assert_eq!(client.power_state().await.unwrap().as_deref(), Some("On"));
}

#[tokio::test]
async fn power_cycle_is_preferred_to_a_graceful_restart() {
    let dir = tempfile::tempdir().unwrap();
    let bmc = ScriptedBmc::start(Script::allowing(&[
        "On",
        "ForceOff",
        "GracefulRestart",
        "PowerCycle",
    ]))
    .await;
    assert_eq!(reset(&bmc.entry(dir.path())).await.unwrap(), "PowerCycle");
    assert_eq!(bmc.resets(), ["PowerCycle"]);
}

#[tokio::test]
async fn a_system_that_only_allows_on_is_refused_with_a_cause() {
    let dir = tempfile::tempdir().unwrap();
    let bmc = ScriptedBmc::start(Script::allowing(&["On"])).await;
    let text = format!("{:#}", reset(&bmc.entry(dir.path())).await.unwrap_err());
    assert!(text.contains("allows no reset that power-cycles"), "{text}");
    assert!(bmc.resets().is_empty(), "nothing was sent");
}

#[tokio::test]
async fn a_bmc_answering_500_fails_with_one_line_naming_the_status() {
    let dir = tempfile::tempdir().unwrap();
    let bmc = ScriptedBmc::start(Script {
        answer: Answer::Status("500 Internal Server Error"),
        ..Script::allowing(&["ForceRestart"])
    })
    .await;
    let text = format!("{:#}", reset(&bmc.entry(dir.path())).await.unwrap_err());
    assert!(
        text.contains("/redfish/v1/Systems/1: 500 Internal Server Error")
            && text.contains("firmware says no"),
        "{text}"
    );
    assert!(!text.contains('\n'), "one line: {text:?}");
}

#[tokio::test]
async fn a_hanging_bmc_fails_at_the_timeout_with_that_cause() {
    let dir = tempfile::tempdir().unwrap();
    let bmc = ScriptedBmc::start(Script {
        answer: Answer::Hang,
        ..Script::allowing(&["ForceRestart"])
    })
    .await;
    let started = Instant::now();
    let client = Bmc::new(&bmc.entry(dir.path()), Duration::from_secs(1)).unwrap();
    let text = format!("{:#}", client.reset().await.unwrap_err());
    assert!(text.to_lowercase().contains("timed out"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the timeout did not bound the wait"
    );
    assert!(bmc.resets().is_empty());
}

#[tokio::test]
async fn a_ca_file_trusts_that_certificate_or_that_ca_for_the_bmc() {
    let dir = tempfile::tempdir().unwrap();
    let certs = BmcCerts::generate();
    let self_signed = file(dir.path(), "bmc.pem", &certs.self_signed_pem);
    let site_ca = file(dir.path(), "ca.pem", &certs.ca_pem);

    // The self-signed CA:TRUE certificate most BMCs ship, given as CA: trusted as it is,
    // although it names no address (before: refused with CaUsedAsEndEntity).
    let bmc = ScriptedBmc::start(Script {
        tls: Some(certs.self_signed_server.clone()),
        ..Script::allowing(&["ForceRestart"])
    })
    .await;
    let mut e = bmc.entry(dir.path());
    e.ca = Some(self_signed.clone());
    assert_eq!(reset(&e).await.unwrap(), "ForceRestart");
    assert_eq!(bmc.resets(), ["ForceRestart"]);
    // Without it, the system's trust store does not trust that certificate.
    e.ca = None;
    let text = format!("{:#}", reset(&e).await.unwrap_err());
    assert!(text.contains("invalid peer certificate"), "{text}");
    // With another CA, neither: it did not issue this certificate (which, being a CA
    // certificate itself, cannot be a server's under a chain check anyway).
    e.ca = Some(site_ca.clone());
    let text = format!("{:#}", reset(&e).await.unwrap_err());
    assert!(text.contains("invalid peer certificate"), "{text}");
    // Insecure trusts anything.
    e.ca = None;
    e.insecure = true;
    assert_eq!(reset(&e).await.unwrap(), "ForceRestart");

    // A certificate for 127.0.0.1 issued by the site CA, given as CA: the chain is checked.
    let bmc = ScriptedBmc::start(Script {
        tls: Some(certs.ca_signed_server.clone()),
        ..Script::allowing(&["ForceRestart"])
    })
    .await;
    let mut e = bmc.entry(dir.path());
    e.ca = Some(site_ca);
    assert_eq!(reset(&e).await.unwrap(), "ForceRestart");
    // The self-signed certificate is no CA of this one.
    e.ca = Some(self_signed);
    let text = format!("{:#}", reset(&e).await.unwrap_err());
    assert!(text.contains("UnknownIssuer"), "{text}");
    // The chain is right but the name is not (the certificate names 127.0.0.1 only).
    let mut e = bmc.entry(dir.path());
    e.url = bmc.url.replace("127.0.0.1", "localhost");
    e.ca = Some(file(dir.path(), "ca2.pem", &certs.ca_pem));
    let text = format!("{:#}", reset(&e).await.unwrap_err());
    assert!(text.contains("not valid for name \"localhost\""), "{text}");
}
