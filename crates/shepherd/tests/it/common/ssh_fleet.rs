//! A static-provider fleet of real sshds, one per machine, for the fault tests that run
//! `shepherd run` replicas against it. Every replica has an SSH key of its own, so that the
//! machines' side-effect log (with [`SshFleet::logging`]) says which replica did what.

use std::process::{Child, Stdio};
use std::time::Duration;

use super::{shepherd, Pace};

/// The machines, their inventory, and one key per replica name.
pub struct SshFleet {
    sshds: Vec<shepherd_ssh::testing::Sshd>,
    inventory: std::path::PathBuf,
    keys: Vec<(String, String)>,
    dir: tempfile::TempDir,
}

/// What one SSH command did on a machine, from the side-effect log.
#[derive(Debug, Clone, PartialEq)]
pub struct SideEffect {
    /// When it started (wall clock, seconds since the epoch).
    pub at: f64,
    /// The machine (its sshd's index).
    pub machine: usize,
    /// Which replica's key ran it.
    pub replica: String,
    /// The command (`sftp` for an upload).
    pub command: String,
}

/// A `ForceCommand` that logs every command a client starts (time, the sshd's port, the key
/// it authenticated with, the command) before running it; the SFTP subsystem waits `upload_delay_ms` first, a
/// slow machine or link.
fn wrapper(log: &std::path::Path, upload_delay_ms: u64) -> String {
    format!(
        r#"#!/bin/sh
key=$(cut -d' ' -f3 "$SSH_USER_AUTH" | head -c 40)
port=$(echo "$SSH_CONNECTION" | cut -d' ' -f4)
printf '%s %s %s %s\n' "$(date +%s.%N)" "$port" "$key" "${{SSH_ORIGINAL_COMMAND:-sftp}}" >> '{log}'
case "$SSH_ORIGINAL_COMMAND" in
  ""|sftp|internal-sftp)
    sleep {delay}
    exec /usr/lib/openssh/sftp-server ;;
  *) exec /bin/sh -c "$SSH_ORIGINAL_COMMAND" ;;
esac
"#,
        log = log.display(),
        delay = upload_delay_ms as f64 / 1000.0,
    )
}

impl SshFleet {
    /// `machines` sshds whose test agent takes `delay_ms` to answer, trusting a key for each
    /// of `replicas`.
    pub fn start(machines: usize, delay_ms: u64, replicas: &[&str]) -> SshFleet {
        Self::start_with(machines, delay_ms, replicas, None)
    }

    /// [`SshFleet::start`], every command logged (see [`SshFleet::side_effects`]) and every
    /// upload delayed by `upload_delay_ms`.
    pub fn logging(
        machines: usize,
        delay_ms: u64,
        replicas: &[&str],
        upload_delay_ms: u64,
    ) -> SshFleet {
        Self::start_with(machines, delay_ms, replicas, Some(upload_delay_ms))
    }

    fn start_with(
        machines: usize,
        delay_ms: u64,
        replicas: &[&str],
        logged: Option<u64>,
    ) -> SshFleet {
        let dir = tempfile::tempdir().unwrap();
        let mut keys = Vec::new();
        let mut publics = Vec::new();
        for name in replicas {
            let path = dir.path().join(format!("id_{name}"));
            let key = shepherd_ssh::load_or_generate_key(&path).unwrap();
            let openssh = key.public_key().to_openssh().unwrap();
            let base64 = openssh.split(' ').nth(1).unwrap().to_string();
            keys.push((name.to_string(), base64[..40].to_string()));
            publics.push(key);
        }
        let mut config = format!("SetEnv SHEPHERD_TEST_AGENT_DELAY_MS={delay_ms}\n");
        if let Some(upload_delay) = logged {
            let script = dir.path().join("wrapper.sh");
            std::fs::write(&script, wrapper(&dir.path().join("effects"), upload_delay)).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
            // The directory must be traversable by the logged-in user's shell.
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
            config += &format!("ExposeAuthInfo yes\nForceCommand {}\n", script.display());
        }
        let authorized: Vec<_> = publics.iter().map(|k| k.public_key()).collect();
        let sshds: Vec<_> = (0..machines)
            .map(|_| shepherd_ssh::testing::Sshd::start_with(&authorized, &config))
            .collect();
        let entries: Vec<_> = sshds
            .iter()
            .enumerate()
            .map(|(i, s)| serde_json::json!({"ID": format!("box-{i:03}"), "Addr": s.addr()}))
            .collect();
        let inventory = dir.path().join("inventory.json");
        std::fs::write(&inventory, serde_json::to_vec(&entries).unwrap()).unwrap();
        SshFleet {
            sshds,
            inventory,
            keys,
            dir,
        }
    }

    /// `shepherd run` on `url` as replica `name`, its log in `name.log`, with `pace`'s flags
    /// (one worker unless the caller says otherwise: every "machine" here shares this host's
    /// filesystem, so two workers of one replica would upload to one path at once).
    pub fn replica_with(&self, url: &str, name: &str, pace: Pace) -> Child {
        let target = self.dir.path().join(format!("agent-{name}"));
        shepherd()
            .args([
                "run",
                "--provider",
                "static",
                "--migrate",
                "--database",
                url,
            ])
            .arg(format!(
                "--static-inventory=file://{}",
                self.inventory.display()
            ))
            .arg(format!(
                "--agent-executable={}",
                shepherd_loops::testing::test_agent_path().display()
            ))
            .arg(format!("--agent-target-path={}", target.display()))
            .arg(format!(
                "--ssh-key={}",
                self.dir.path().join(format!("id_{name}")).display()
            ))
            .args([
                "--ssh-user",
                &std::env::var("USER").unwrap_or_else(|_| "root".into()),
            ])
            .args(pace.args())
            .args(["--ssh-connect-timeout", "10s"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.path().join(format!("{name}.log"))).unwrap())
            .spawn()
            .unwrap()
    }

    /// [`SshFleet::replica_with`] at the default pace with one worker.
    pub fn replica(&self, url: &str, name: &str) -> Child {
        let pace = Pace {
            workers: 1,
            ..Pace::default()
        };
        self.replica_with(url, name, pace)
    }

    /// The last lines of replica `name`'s log, for failure messages.
    pub fn log(&self, name: &str) -> String {
        let log = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")));
        let log = log.unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        tail.join("\n")
    }

    /// Every command the machines ran so far, in the order they were started (a fleet
    /// started with [`SshFleet::logging`]).
    pub fn side_effects(&self) -> Vec<SideEffect> {
        let log = std::fs::read_to_string(self.dir.path().join("effects")).unwrap_or_default();
        let mut effects: Vec<SideEffect> = log
            .lines()
            .filter_map(|line| {
                let mut words = line.splitn(4, ' ');
                let at: f64 = words.next()?.parse().ok()?;
                let port = words.next()?;
                let key = words.next()?;
                let command = words.next()?.to_string();
                let replica = self.keys.iter().find(|(_, k)| k == key)?.0.clone();
                let addr = format!("127.0.0.1:{port}");
                let machine = self.sshds.iter().position(|s| s.addr() == addr)?;
                Some(SideEffect {
                    at,
                    machine,
                    replica,
                    command,
                })
            })
            .collect();
        effects.sort_by(|a, b| a.at.total_cmp(&b.at));
        effects
    }
}

/// Waits until the BMDB at `url` is migrated (a replica started with `--migrate` does it).
pub async fn open_when_migrated(url: &str) -> shepherd_bmdb::Bmdb {
    let migrated = "shepherd run to migrate the BMDB";
    shepherd_bmdb::testing::eventually(migrated, Duration::from_secs(30), async || {
        shepherd_bmdb::Bmdb::open(url).await
    })
    .await
}
