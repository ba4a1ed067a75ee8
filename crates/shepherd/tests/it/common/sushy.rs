//! The sushy-tools Redfish emulator (its fake driver, or its libvirt driver; HTTPS, basic
//! auth), installed by `scripts/test-deps.sh` into a virtualenv.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shepherd_provider::testing::bmc::BmcCerts;

use super::free_port;

fn emulator_binary() -> PathBuf {
    let venv = std::env::var_os("SHEPHERD_SUSHY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/shepherd/sushy-venv")
        });
    let path = venv.join("bin/sushy-emulator");
    assert!(
        path.exists(),
        "{} is missing: run scripts/test-deps.sh (installs sushy-tools in a virtualenv)",
        path.display()
    );
    path
}

/// A running sushy-emulator; killed on drop.
pub struct Emulator {
    child: Child,
    /// Its base URL (`https://127.0.0.1:PORT`).
    pub url: String,
    /// What Shepherd is given as the BMC's `CA`.
    pub ca: PathBuf,
    /// The file holding the BMC password of user `admin`.
    pub password_file: PathBuf,
    /// Its log (standard error).
    pub log: PathBuf,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which certificate the emulator presents.
#[derive(Clone, Copy)]
pub enum CertForm {
    /// Self-signed with `CA:TRUE`, as most BMCs ship; given to Shepherd as `CA` (pinned).
    SelfSigned,
    /// Issued for 127.0.0.1 by a site CA; the CA is given to Shepherd as `CA`.
    CaSigned,
}

/// Writes the emulator's certificate and key, and what Shepherd is given as `CA`; returns
/// their paths (certificate, key, CA).
fn bmc_certs(dir: &Path, form: CertForm) -> (PathBuf, PathBuf, PathBuf) {
    let certs = BmcCerts::generate();
    let (cert, key, ca) = match form {
        CertForm::SelfSigned => (
            &certs.self_signed_pem,
            &certs.self_signed_key_pem,
            &certs.self_signed_pem,
        ),
        CertForm::CaSigned => (
            &certs.ca_signed_pem,
            &certs.ca_signed_key_pem,
            &certs.ca_pem,
        ),
    };
    let paths = (
        dir.join("bmc.pem"),
        dir.join("bmc.key"),
        dir.join("bmc-ca.pem"),
    );
    std::fs::write(&paths.0, cert).unwrap();
    std::fs::write(&paths.1, key).unwrap();
    std::fs::write(&paths.2, ca).unwrap();
    paths
}

/// A fake system of the emulator.
pub struct FakeSystem<'a> {
    /// Its Redfish id.
    pub uuid: &'a str,
    /// Its name.
    pub name: &'a str,
}

/// sushy-emulator with fake `systems` (all On), HTTPS with a certificate of `form`, and basic
/// auth for admin / the password in `password_file`. With `notify`, every power change is
/// PUT there as JSON (the fake driver's external notifier), so something real can follow it.
pub fn start_emulator(
    dir: &Path,
    form: CertForm,
    systems: &[FakeSystem<'_>],
    notify: Option<&str>,
) -> Emulator {
    let systems: Vec<String> = systems
        .iter()
        .map(|s| {
            format!(
                "{{'uuid': '{}', 'name': '{}', 'power_state': 'On', 'external_notifier': {}, 'nics': [{{'mac': '00:5c:52:31:3a:9c', 'ip': '172.22.0.100'}}]}}",
                s.uuid,
                s.name,
                if notify.is_some() { "True" } else { "False" }
            )
        })
        .collect();
    let driver = format!(
        "SUSHY_EMULATOR_FAKE_DRIVER = True\n\
         SUSHY_EMULATOR_FAKE_SYSTEMS = [{}]\n\
         EXTERNAL_NOTIFICATION_URL = '{}'\n",
        systems.join(", "),
        notify.unwrap_or("http://127.0.0.1:9"),
    );
    start(dir, form, &driver, &["--fake"])
}

/// sushy-emulator with its libvirt driver on `qemu:///system`, showing only the domains of
/// `uuids` (the test's own), HTTPS with a certificate of `form` and basic auth as
/// [`start_emulator`]. Its log says what it did with each system's virtual media.
pub fn start_libvirt_emulator(dir: &Path, form: CertForm, uuids: &[String]) -> Emulator {
    let allowed: Vec<String> = uuids.iter().map(|u| format!("'{u}'")).collect();
    let driver = format!(
        "SUSHY_EMULATOR_LIBVIRT_URI = 'qemu:///system'\n\
         SUSHY_EMULATOR_ALLOWED_INSTANCES = [{}]\n",
        allowed.join(", ")
    );
    start(dir, form, &driver, &[])
}

/// Starts the emulator with `driver`'s configuration lines and `args`.
fn start(dir: &Path, form: CertForm, driver: &str, args: &[&str]) -> Emulator {
    let bin = emulator_binary();
    let python = bin.parent().unwrap().join("python");
    let password = "bmc-secret-42";
    let hash = super::succeeds(Command::new(&python).args([
        "-c",
        "import bcrypt,sys; print(bcrypt.hashpw(sys.argv[1].encode(), bcrypt.gensalt(4)).decode())",
        password,
    ]));
    let htpasswd = dir.join("htpasswd");
    std::fs::write(
        &htpasswd,
        format!("admin:{}", String::from_utf8_lossy(&hash.stdout).trim()),
    )
    .unwrap();
    let password_file = dir.join("bmc-password");
    std::fs::write(&password_file, format!("{password}\n")).unwrap();
    let (cert_pem, key_pem, ca) = bmc_certs(dir, form);
    let port = free_port();
    let config = dir.join("emulator.conf");
    std::fs::create_dir_all(dir.join("state")).unwrap();
    std::fs::write(
        &config,
        format!(
            "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n\
             SUSHY_EMULATOR_LISTEN_PORT = {port}\n\
             {driver}\
             SUSHY_EMULATOR_AUTH_FILE = '{}'\n\
             SUSHY_EMULATOR_SSL_CERT = '{}'\n\
             SUSHY_EMULATOR_SSL_KEY = '{}'\n\
             SUSHY_EMULATOR_STATE_DIR = '{}'\n",
            htpasswd.display(),
            cert_pem.display(),
            key_pem.display(),
            dir.join("state").display(),
        ),
    )
    .unwrap();
    let log = dir.join("emulator.log");
    let mut child = Command::new(&bin)
        .args(["--config"])
        .arg(&config)
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        let exited = child.try_wait().unwrap();
        if exited.is_some() || Instant::now() > deadline {
            panic!(
                "sushy-emulator did not start ({exited:?}): {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Emulator {
        child,
        url: format!("https://127.0.0.1:{port}"),
        ca,
        password_file,
        log,
    }
}
