//! `shepherd run --provider ironic` as the Ironic tests start it.

use std::process::{Command, Stdio};

use shepherd_ironic::testing::IronicServer;

use super::shepherd;

/// The password of the Ironic user the tests' `shepherd run` authenticates as.
pub const PASSWORD: &str = "s3cret-ironic-pass";

/// `shepherd run --provider ironic` against `ironic` with HTTP basic credentials (the password
/// from the environment), taking nodes of resource class `shepherd-test` as deployment `e2e`.
/// The caller adds the SSH user, the agent's endpoint and how long a reboot takes.
pub fn ironic_run(
    db: &str,
    ironic: &IronicServer,
    key: &std::path::Path,
    agent: &std::path::Path,
    target: &str,
) -> Command {
    let mut cmd = shepherd();
    cmd.args(["run", "--provider", "ironic", "--migrate", "--database", db])
        .args(["--ironic-url", &ironic.url()])
        .args(["--ironic-user", "shepherd"])
        .env("SHEPHERD_IRONIC_PASSWORD", PASSWORD)
        .args(["--ironic-deployment", "e2e"])
        .args(["--ironic-resource-class", "shepherd-test"])
        .args(["--ironic-address-from-inventory", "false"])
        .args(["--ironic-deploy-wait", "3s"])
        .arg(format!("--ssh-key={}", key.display()))
        .args(["--ssh-connect-timeout", "10s"])
        .arg(format!("--agent-executable={}", agent.display()))
        .arg(format!("--agent-target-path={target}"))
        .args(["--provisioner-max-machines", "0"])
        .args(["--provisioner-chunk-size", "50"])
        .args(["--provisioner-reconcile-rate", "2s,1"])
        .args(["--provisioner-creation-rate", "1ms,50"])
        .args(["--initializer-parallelism", "8"])
        .args(["--initializer-db-rate", "20ms,16"])
        .args(["--session-interval", "2s"])
        .stdout(Stdio::null());
    cmd
}
