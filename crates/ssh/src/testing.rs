//! A real OpenSSH `sshd` on a loopback port, for tests and benchmarks (feature `testing`).
//!
//! The daemon gets its own directory with a generated host key, an `authorized_keys` file and a
//! config that allows bursts of parallel connections. It runs until the [`Sshd`] is dropped.
//! sshd must be installed (`scripts/test-deps.sh` does that); there is no skip path.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use russh::keys::ssh_key::private::Ed25519Keypair;
use russh::keys::ssh_key::LineEnding;
use russh::keys::{PrivateKey, PublicKey};

/// Where Debian's openssh-server puts the daemon.
pub const SSHD: &str = "/usr/sbin/sshd";

/// A running sshd.
pub struct Sshd {
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
    extra_config: String,
}

/// A fresh random ed25519 key (for clients and host keys).
pub fn random_key() -> PrivateKey {
    let mut seed = [0u8; 32];
    rand::fill(&mut seed);
    PrivateKey::from(Ed25519Keypair::from_seed(&seed))
}

impl Sshd {
    /// Starts sshd trusting `authorized` keys for the current user.
    pub fn start(authorized: &[&PublicKey]) -> Sshd {
        Self::start_with(authorized, "")
    }

    /// Like [`Sshd::start`], with extra `sshd_config` lines (e.g. `SetEnv` for sessions).
    pub fn start_with(authorized: &[&PublicKey], extra_config: &str) -> Sshd {
        assert!(
            Path::new(SSHD).exists(),
            "{SSHD} is missing: run scripts/test-deps.sh (installs openssh-server)"
        );
        let dir = tempfile::Builder::new()
            .prefix("shepherd-sshd-")
            .tempdir()
            .unwrap();
        // sshd wants its directory and keys private.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let keys: Vec<String> = authorized.iter().map(|k| k.to_openssh().unwrap()).collect();
        write_private(
            &dir.path().join("authorized_keys"),
            &(keys.join("\n") + "\n"),
        );
        std::fs::create_dir_all("/run/sshd").unwrap();
        let mut sshd = Sshd {
            dir,
            port: 0,
            child: None,
            extra_config: extra_config.to_string(),
        };
        sshd.change_host_key();
        sshd
    }

    /// Loopback address with port, as an inventory would list it.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The daemon's private directory (a good place for uploads).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The current host key, OpenSSH format.
    pub fn host_key(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("host_ed25519.pub"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Restarts the daemon on the same port with a new host key (as a reinstalled machine, or
    /// an impostor, would present).
    pub fn change_host_key(&mut self) {
        self.stop();
        let key = random_key();
        write_private(
            &self.dir.path().join("host_ed25519"),
            &key.to_openssh(LineEnding::LF).unwrap(),
        );
        std::fs::write(
            self.dir.path().join("host_ed25519.pub"),
            key.public_key().to_openssh().unwrap(),
        )
        .unwrap();
        for _ in 0..20 {
            if self.port == 0 || !self.try_start(self.port) {
                let port = free_loopback_port();
                if self.try_start(port) {
                    return;
                }
            } else {
                return;
            }
        }
        panic!("could not start sshd");
    }

    fn try_start(&mut self, port: u16) -> bool {
        let config = self.dir.path().join("sshd_config");
        let d = self.dir.path().display();
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_ed25519\n\
                 AuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\n\
                 PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PubkeyAuthentication yes\nSubsystem sftp internal-sftp\n\
                 MaxStartups 256:30:512\nMaxSessions 64\nLogLevel ERROR\n{}\n",
                self.extra_config
            ),
        )
        .unwrap();
        let child = Command::new(SSHD)
            .arg("-D")
            .arg("-f")
            .arg(&config)
            .arg("-E")
            .arg(self.dir.path().join("sshd.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning sshd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return false; // exited: port taken, most likely
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                self.port = port;
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        false
    }

    /// What sshd logged (errors only), for test failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sshd.log")).unwrap_or_default()
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback port that was free a moment ago (the kernel's pick), for a listener a test
/// starts next or as an address where nothing listens; never the same port twice in one
/// process. Tests run in parallel threads of one process: two given the same port at once
/// would start two servers on it, the second would fail to bind, and its test would talk to
/// the first server without noticing.
pub fn free_loopback_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let port = listener.local_addr().expect("its address").port();
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
}

fn write_private(path: &PathBuf, text: &str) {
    let _ = std::fs::remove_file(path);
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}
