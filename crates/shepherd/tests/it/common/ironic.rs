//! `shepherd run --provider ironic` as the Ironic tests start it.

use std::process::{Command, Stdio};

use shepherd_ironic::testing::{IronicServer, RedfishNode};

use super::shepherd;

/// The password of the Ironic user the tests' `shepherd run` authenticates as.
pub const PASSWORD: &str = "s3cret-ironic-pass";

/// `shepherd run --provider ironic` against `ironic` with HTTP basic credentials (the password
/// from the environment), taking nodes of resource class `shepherd-test` as deployment `e2e`.
/// The agent `agent` goes to `target` and heartbeats to `agent_endpoint`; the caller adds
/// the SSH user and how long a reboot takes.
pub fn ironic_run(
    db: &str,
    ironic: &IronicServer,
    key: &std::path::Path,
    agent: &std::path::Path,
    target: &str,
    agent_endpoint: &str,
) -> Command {
    let mut cmd = shepherd();
    cmd.args(["run", "--provider", "ironic", "--migrate", "--database", db])
        .args(["--ironic-url", &ironic.url()])
        .args(["--ironic-user", "shepherd"])
        .env("SHEPHERD_IRONIC_PASSWORD", PASSWORD)
        .args(["--ironic-deployment", "e2e"])
        .args(["--ironic-resource-class", "shepherd-test"])
        .args(["--ironic-address-from-inventory", "false"])
        .arg(format!("--ssh-key={}", key.display()))
        .args(["--ssh-connect-timeout", "10s"])
        .arg(format!("--agent-executable={}", agent.display()))
        .arg(format!("--agent-target-path={target}"))
        .args(
            super::Pace {
                chunk_size: 50,
                reconcile_rate: "2s,1",
                creation_rate: "1ms,50",
                workers: 8,
                claim_rate: "20ms,16",
                endpoint: agent_endpoint,
                ..super::Pace::default()
            }
            .args(),
        )
        .stdout(Stdio::null());
    cmd
}

/// Adopts the sushy system `system` behind emulator `bmc` into `ironic` as an active node of
/// deployment `e2e` whose SSH address is `ssh_address`, its port `mac`, its deploy images at
/// `images`; returns the node's uuid.
pub async fn adopt_e2e_node(
    ironic: &IronicServer,
    bmc: &super::sushy::Emulator,
    system: &str,
    mac: &str,
    images: &str,
    ssh_address: &str,
) -> String {
    let password = std::fs::read_to_string(&bmc.password_file).expect("the BMC password");
    ironic
        .adopt_redfish_node(RedfishNode {
            address: &bmc.url,
            system_id: &format!("/redfish/v1/Systems/{system}"),
            password: password.trim(),
            ca: &bmc.ca,
            mac,
            images,
            extra: serde_json::json!({"ssh_address": ssh_address, "shepherd_deployment": "e2e"}),
        })
        .await
}
