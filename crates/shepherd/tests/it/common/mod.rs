//! Helpers shared by the CLI integration tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command};
use std::time::Duration;

/// The `shepherd` binary with no `SHEPHERD_*` variables inherited from the caller, and its HTTP
/// endpoints on free ports (default ports would collide between tests running in parallel).
pub fn shepherd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shepherd"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SHEPHERD_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("SHEPHERD_METRICS_LISTEN", "127.0.0.1:0");
    cmd.env("SHEPHERD_HTTP_LISTEN", "127.0.0.1:0");
    cmd
}

/// Starts `cmd` (a `shepherd server`, see [`server`]), its log in `log` (or dropped), and
/// returns it with the address it announced it listens on.
pub fn start_server(mut cmd: Command, log: Option<&std::path::Path>) -> (ChildGuard, String) {
    let stderr = match log {
        Some(path) => std::process::Stdio::from(std::fs::File::create(path).unwrap()),
        None => std::process::Stdio::null(),
    };
    let mut server = ChildGuard(Some(
        cmd.stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap(),
    ));
    let addr = announced(server.child(), "shepherd server: listening on ");
    (server, addr)
}

/// `shepherd server` creating and migrating the BMDB at `url`, listening on a free loopback
/// port (it prints which), with development certificates in `dir/certs`.
pub fn server(url: &str, dir: &std::path::Path) -> Command {
    let mut cmd = shepherd();
    cmd.args(["server", "--migrate", "--database", url])
        .args(["--listen", "127.0.0.1:0", "--dev-certs"])
        .arg(dir.join("certs"));
    cmd
}

/// Starts [`server`] with the flags `extra`, its log discarded, and waits until it printed a
/// line starting with each of `prefixes`; returns it and the rest of each line.
pub fn started_server(
    url: &str,
    dir: &std::path::Path,
    extra: &[&str],
    prefixes: &[&'static str],
) -> (ChildGuard, Vec<String>) {
    let child = server(url, dir)
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut server = ChildGuard(Some(child));
    let lines = announced_all(server.child(), prefixes);
    (server, lines)
}

/// A machine for `--provider static`: a real sshd that trusts the operator key at
/// `dir/id_ed25519`, listed in the inventory at `dir/inventory.json`.
pub struct SshdMachine {
    /// The machine.
    pub sshd: shepherd_ssh::testing::Sshd,
    /// The operator's private key, for `--ssh-key`.
    pub key_path: std::path::PathBuf,
    /// The inventory, for `--static-inventory=file://…`.
    pub inventory: std::path::PathBuf,
}

/// Starts an sshd and writes an inventory holding `entry` (`ID`, `Location`, …) with the
/// sshd's address as `Addr`.
pub fn sshd_machine(dir: &std::path::Path, mut entry: serde_json::Value) -> SshdMachine {
    let key_path = dir.join("id_ed25519");
    let key = shepherd_ssh::load_or_generate_key(&key_path).unwrap();
    let sshd = shepherd_ssh::testing::Sshd::start(&[key.public_key()]);
    entry["Addr"] = sshd.addr().to_string().into();
    let inventory = dir.join("inventory.json");
    std::fs::write(&inventory, serde_json::to_vec(&[entry]).unwrap()).unwrap();
    SshdMachine {
        sshd,
        key_path,
        inventory,
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    shepherd_loops::testing::free_loopback_port()
}

/// Waits (up to 30 s) for `child` to print a stdout line starting with `prefix` and returns the
/// rest of that line. The child's stdout keeps being drained afterwards, so it never blocks.
pub fn announced(child: &mut Child, prefix: &'static str) -> String {
    announced_all(child, &[prefix]).remove(0)
}

/// Like [`announced`] for several lines: the rest of the first line starting with each prefix,
/// in the order of `prefixes`.
pub fn announced_all(child: &mut Child, prefixes: &[&'static str]) -> Vec<String> {
    let stdout = child.stdout.take().expect("child stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    let wanted = prefixes.to_vec();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            for (i, prefix) in wanted.iter().enumerate() {
                if let Some(rest) = line.strip_prefix(prefix) {
                    let _ = tx.send((i, rest.to_string()));
                }
            }
        }
    });
    let mut found: Vec<Option<String>> = vec![None; prefixes.len()];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while found.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, rest)) => {
                found[i].get_or_insert(rest);
            }
            Err(_) => panic!("the child never printed all of {prefixes:?}"),
        }
    }
    found.into_iter().map(Option::unwrap).collect()
}

/// A child process killed (SIGKILL) on drop unless it was waited for.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    /// The child.
    pub fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child still held")
    }

    /// Sends SIGTERM and waits for the child to exit.
    pub fn terminate(mut self) -> std::process::Output {
        let child = self.0.take().expect("child still held");
        signal(&child, "TERM");
        child.wait_with_output().unwrap()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `cmd` to its end and fails the test, with its standard error, unless it succeeded.
pub fn succeeds(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed: {err}");
    out
}

/// The body of a GET of `url` (a page or metrics of a process the test started).
pub async fn get_text(url: &str) -> String {
    let response = reqwest::get(url).await.unwrap();
    response.text().await.unwrap()
}

/// Fails the test unless the command `o` came from failed and said `want` on standard error.
pub fn refused(o: &std::process::Output, want: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "succeeded; stderr: {err}");
    assert!(err.contains(want), "want {want:?} in: {err}");
}

/// Sends `SIG{name}` to `child`.
pub fn signal(child: &Child, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{name} failed");
}

/// Polls `f` every half second until it returns `Some`, for at most `secs`.
pub async fn wait_for<T>(what: &str, secs: u64, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let (within, every) = (Duration::from_secs(secs), Duration::from_millis(500));
    let poll = async || f().await.ok_or("not yet");
    shepherd_bmdb::testing::eventually_every(what, within, every, poll).await
}

/// The machine the BMDB records for `provider_id` of the static provider, once it does.
pub async fn machine_named(db: &shepherd_bmdb::Bmdb, provider_id: &str) -> Option<uuid::Uuid> {
    let id = provider_id.to_string();
    let static_kind = shepherd_bmdb::ProviderKind::Static;
    db.read(move |tx| {
        let id = id.clone();
        Box::pin(async move { tx.machine_by_provider_id(static_kind, &id).await })
    })
    .await
    .unwrap()
}

/// The value of one sample of a Prometheus text exposition, if present.
pub fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
}

pub mod history;
pub mod ironic;
pub mod libvirt;
pub mod oidc;
pub mod patroni;
pub mod private_postgres;
pub mod ssh_fleet;
pub mod sushy;
pub mod vm;

/// An agent identity: a fresh ed25519 key and a self-signed certificate of it.
pub struct TestAgent {
    /// The key pair.
    pub key: rcgen::KeyPair,
    /// Its self-signed certificate (PEM).
    pub cert_pem: String,
}

impl TestAgent {
    /// A new identity.
    pub fn new() -> TestAgent {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let cert_pem = rcgen::CertificateParams::new(vec!["agent".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem();
        TestAgent { key, cert_pem }
    }

    /// A heartbeat client for the server at `addr` (trusting the PEM CA `ca`, presenting this
    /// identity), connecting lazily with `timeout` on connects and requests.
    pub fn client(
        &self,
        addr: &str,
        ca: &[u8],
        timeout: Duration,
    ) -> shepherd_proto::bmaas::agent_callback_client::AgentCallbackClient<tonic::transport::Channel>
    {
        use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
        let channel = Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca))
                    .domain_name("localhost")
                    .identity(Identity::from_pem(&self.cert_pem, self.key.serialize_pem())),
            )
            .unwrap()
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect_lazy();
        shepherd_proto::bmaas::agent_callback_client::AgentCallbackClient::new(channel)
    }

    /// A new machine in `db` whose recorded agent key is this identity's.
    pub async fn machine(&self, db: &shepherd_bmdb::Bmdb) -> uuid::Uuid {
        shepherd_bmdb::testing::machine_with_agent(db, self.key.public_key_raw()).await
    }
}

/// How fast `shepherd run`'s loops go in a test: much faster than in production, so that a
/// fleet converges in seconds. Every test that starts `shepherd run` takes its pacing flags
/// from here, changing only the fields it is about.
#[derive(Debug, Clone, Copy)]
pub struct Pace<'a> {
    /// `--initializer-parallelism`.
    pub workers: usize,
    /// `--initializer-db-rate`.
    pub claim_rate: &'a str,
    /// `--provisioner-reconcile-rate`.
    pub reconcile_rate: &'a str,
    /// `--provisioner-creation-rate`.
    pub creation_rate: &'a str,
    /// `--provisioner-chunk-size`.
    pub chunk_size: usize,
    /// `--provisioner-max-machines` (0: no limit).
    pub max_machines: usize,
    /// `--session-interval`.
    pub session_interval: &'a str,
    /// `--agent-endpoint`.
    pub endpoint: &'a str,
}

impl Default for Pace<'_> {
    fn default() -> Self {
        Pace {
            workers: 2,
            claim_rate: "1ms,8",
            reconcile_rate: "200ms,1",
            creation_rate: "1ms,100",
            chunk_size: 100,
            max_machines: 0,
            session_interval: "2s",
            endpoint: "bmaas.test:443",
        }
    }
}

impl Pace<'_> {
    /// The flags.
    pub fn args(&self) -> Vec<String> {
        [
            ("--initializer-parallelism", self.workers.to_string()),
            ("--initializer-db-rate", self.claim_rate.into()),
            ("--provisioner-reconcile-rate", self.reconcile_rate.into()),
            ("--provisioner-creation-rate", self.creation_rate.into()),
            ("--provisioner-chunk-size", self.chunk_size.to_string()),
            ("--provisioner-max-machines", self.max_machines.to_string()),
            ("--session-interval", self.session_interval.into()),
            ("--agent-endpoint", self.endpoint.into()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_string(), value])
        .collect()
    }
}

/// `shepherd run --provider sim` on `url` over `machines` simulated machines whose takeovers
/// take `takeover` each, paced by `pace`; the caller adds its own flags and output.
pub fn sim_replica(url: &str, machines: usize, takeover: &str, pace: Pace) -> Command {
    let mut cmd = shepherd();
    cmd.args(["run", "--provider", "sim", "--database", url])
        .args(["--sim-machines", &machines.to_string()])
        .args(["--sim-takeover-time", takeover])
        .args(pace.args());
    cmd
}

/// [`sim_replica`] at the default pace, migrating the BMDB first, with its log in `log`.
pub fn sim_run(url: &str, machines: usize, takeover: &str, log: &std::path::Path) -> Command {
    let mut cmd = sim_replica(url, machines, takeover, Pace::default());
    cmd.arg("--migrate")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    cmd
}

/// `shepherd machines show ID --json` on the BMDB at `url`.
pub fn machine_json(url: &str, m: uuid::Uuid) -> serde_json::Value {
    let id = m.to_string();
    let args = ["machines", "show", &id, "--json", "--database", url];
    let out = succeeds(shepherd().args(args));
    serde_json::from_slice(&out.stdout).unwrap()
}
