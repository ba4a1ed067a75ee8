//! QEMU VMs for the VM fleet tests: the guest image `scripts/vm-image.sh` builds, booted under
//! TCG with user-mode networking that reaches nothing but what the test forwards (its sshd on a
//! loopback port, `shepherd server` at 10.0.2.100:4443 inside the guest), and a QMP socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the guest sees `shepherd server`.
pub const SERVER_IN_GUEST: &str = "10.0.2.100:4443";
/// Where the guest sees the test's image server (plain HTTP).
pub const IMAGES_IN_GUEST: &str = "10.0.2.101:80";

/// What every VM test starts from: a scratch directory (keys, certificates, sockets, logs),
/// the guest image with its key copied there, a fresh SQLite BMDB and the loopback port
/// `shepherd server` will listen on.
pub async fn vm_site() -> (
    tempfile::TempDir,
    GuestImage,
    shepherd_bmdb::testing::TestDb,
    u16,
) {
    let dir = tempfile::tempdir().expect("scratch directory");
    let image = GuestImage::locate(dir.path());
    let t = shepherd_bmdb::testing::sqlite().await;
    (dir, image, t, super::free_port())
}

/// The built guest image and the key root accepts in it.
pub struct GuestImage {
    /// The raw boot disk.
    pub disk: PathBuf,
    /// The network boot files (iPXE script, kernel, initrd) of the same system.
    pub tftp: PathBuf,
    /// The OS image the agent installs.
    pub installable: PathBuf,
    /// Its sha256, hex.
    pub installable_sha256: String,
    /// The private key (a copy with mode 0400, as `shepherd run` wants it).
    pub key: PathBuf,
}

impl GuestImage {
    /// The image `scripts/vm-image.sh` built (the test fails, never skips, without it); the
    /// key is copied into `dir`.
    pub fn locate(dir: &Path) -> GuestImage {
        let built = Built::locate("SHEPHERD_VM_DIR", "vm", "guest.img", "the guest image");
        GuestImage {
            disk: built.path("guest.img"),
            tftp: built.path("tftp"),
            installable: built.path("installable.img"),
            installable_sha256: built.sha256_of("installable.img"),
            key: built.private_key("id_ed25519", &dir.join("vm_id_ed25519")),
        }
    }
}

/// A directory of images `scripts/test-deps.sh` built and cached (`~/.cache/shepherd/NAME`,
/// or the directory an environment variable names).
pub struct Built(PathBuf);

impl Built {
    /// The directory, which must hold `file` (the test fails, never skips, without it: it is
    /// `what` test-deps builds).
    pub fn locate(env: &str, name: &str, file: &str, what: &str) -> Built {
        let dir = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/shepherd")
                .join(name)
        });
        let needed = dir.join(file);
        assert!(
            needed.exists(),
            "{} is missing: run scripts/test-deps.sh (it builds {what})",
            needed.display()
        );
        Built(dir)
    }

    /// A file in it.
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }

    /// The sha256 written beside `file` (`FILE.sha256`).
    pub fn sha256_of(&self, file: &str) -> String {
        let text = std::fs::read_to_string(self.0.join(format!("{file}.sha256"))).unwrap();
        text.trim().to_string()
    }

    /// A copy of the private key `file` at `to`, mode 0400 as `shepherd run` wants it.
    pub fn private_key(&self, file: &str, to: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        std::fs::copy(self.0.join(file), to).unwrap();
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o400)).unwrap();
        to.to_path_buf()
    }
}

/// Size of the empty disk a VM with an install target gets.
pub const TARGET_DISK_BYTES: u64 = 64 << 20;

/// One running VM; killed on drop.
pub struct Vm {
    /// Its name (`vmN`).
    pub name: String,
    /// N.
    pub index: u8,
    /// The loopback port forwarded to its sshd.
    pub ssh_port: u16,
    /// Its NIC's MAC address.
    pub mac: String,
    /// Its QMP socket.
    pub qmp: PathBuf,
    /// Its serial console log.
    pub serial: PathBuf,
    args: Vec<String>,
    child: Child,
}

fn spawn_qemu(args: &[String]) -> Child {
    Command::new("qemu-system-x86_64")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// How a VM is made.
pub struct VmSpec<'a> {
    /// The boot disk (booted as a throwaway snapshot: every start makes new host keys).
    pub image: &'a GuestImage,
    /// Index, for the MAC address.
    pub index: u8,
    /// Loopback port of `shepherd server`, forwarded to [`SERVER_IN_GUEST`].
    pub server_port: u16,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// With `Some(port)`: an empty second disk (`/dev/vdb`, 64 MiB) to install onto, booted
    /// first, with network boot into the base system as the fallback while it holds no OS;
    /// and the test's image server on that loopback port at [`IMAGES_IN_GUEST`].
    pub install_target: Option<u16>,
}

impl Vm {
    /// Starts a VM in `dir`.
    pub fn start(dir: &Path, spec: VmSpec<'_>) -> Vm {
        assert!(
            Path::new("/usr/bin/qemu-system-x86_64").exists(),
            "qemu-system-x86_64 is missing: run scripts/test-deps.sh"
        );
        let name = format!("vm{}", spec.index);
        let ssh_port = super::free_port();
        let mac = format!("52:54:00:5e:00:{:02x}", spec.index);
        let qmp = dir.join(format!("{name}.qmp"));
        let serial = dir.join(format!("{name}.serial"));
        let mut netdev = format!(
            "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:{ssh_port}-:22,\
             guestfwd=tcp:{SERVER_IN_GUEST}-cmd:socat STDIO TCP:127.0.0.1:{}",
            spec.server_port
        );
        let mut disks = vec![format!(
            "file={},format=raw,if=none,id=d0,snapshot=on",
            spec.image.disk.display()
        )];
        let mut boot_disk = "virtio-blk-pci,drive=d0".to_string();
        let mut nic = format!("virtio-net-pci,netdev=n0,mac={mac}");
        if let Some(images) = spec.install_target {
            let target = dir.join(format!("{name}-target.img"));
            std::fs::File::create(&target)
                .unwrap()
                .set_len(TARGET_DISK_BYTES)
                .unwrap();
            disks.push(format!(
                "file={},format=raw,if=none,id=d1",
                target.display()
            ));
            netdev += &format!(
                ",tftp={},bootfile=boot.ipxe,\
                 guestfwd=tcp:{IMAGES_IN_GUEST}-cmd:socat STDIO TCP:127.0.0.1:{images}",
                spec.image.tftp.display()
            );
            boot_disk += ",bootindex=1";
            nic += ",bootindex=2";
        }
        let mut args: Vec<String> = [
            "-machine",
            "q35",
            "-accel",
            "tcg,tb-size=128",
            "-cpu",
            "qemu64",
            "-smp",
            "1",
            "-display",
            "none",
            "-monitor",
            "none",
        ]
        .map(String::from)
        .to_vec();
        args.extend([
            "-m".into(),
            spec.memory_mib.to_string(),
            "-serial".into(),
            format!("file:{}", serial.display()),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", qmp.display()),
            "-netdev".into(),
            netdev,
            "-device".into(),
            nic,
        ]);
        for d in disks {
            args.extend(["-drive".into(), d]);
        }
        // The base disk is the first PCI disk (/dev/vda), the target the second (/dev/vdb);
        // the BIOS tries the target first (it boots only the first disk it tries), then the
        // network.
        args.extend(["-device".into(), boot_disk]);
        if spec.install_target.is_some() {
            args.extend([
                "-device".into(),
                "virtio-blk-pci,drive=d1,bootindex=0".into(),
            ]);
        }
        let child = spawn_qemu(&args);
        Vm {
            name,
            index: spec.index,
            ssh_port,
            mac,
            qmp,
            serial,
            args,
            child,
        }
    }

    /// Powers the VM off and starts it again from a fresh copy of its image, at the same
    /// addresses: the same machine, reinstalled, with new host keys.
    pub fn reinstall(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.qmp);
        self.child = spawn_qemu(&self.args);
    }

    /// `127.0.0.1:PORT` of its sshd.
    pub fn ssh_addr(&self) -> String {
        format!("127.0.0.1:{}", self.ssh_port)
    }

    /// Waits until its sshd greets, for at most `limit`. (The forwarded port accepts
    /// connections before the guest listens, so the greeting is what counts.)
    pub fn wait_for_ssh(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut err = String::new();
                let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("{} exited ({status}): {err}", self.name);
            }
            if ssh_greets(self.ssh_port) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not answer SSH within {limit:?}; serial console:\n{}",
                self.name,
                self.serial_log()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Asserts what a machine `shown` (as `machines show --json` has it) on this VM looks like
    /// after one recovery: another agent key than `key_before`, one reboot in a row, and the
    /// VM booted twice.
    pub fn assert_recovered_once(&self, shown: &serde_json::Value, key_before: &serde_json::Value) {
        let key = &shown["agent_key"];
        assert_ne!(
            key, key_before,
            "a new agent took the machine over: {shown}"
        );
        assert_eq!(shown["recovery"]["in_a_row"], 1, "{shown}");
        let boots = self.serial_log().matches("shepherd-guest login:").count();
        assert!(boots >= 2, "the VM booted twice, not {boots} times");
    }

    /// What the VM wrote to its serial console so far.
    pub fn serial_log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.serial).unwrap_or_default()).into_owned()
    }

    /// Runs `command` in the guest as root over SSH with the image's key; its stdout.
    pub fn ssh(&self, image: &GuestImage, command: &str) -> String {
        let out = Command::new("ssh")
            .args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"])
            .args([
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "ConnectTimeout=10",
            ])
            .args(["-o", "LogLevel=ERROR", "-i"])
            .arg(&image.key)
            .args(["-p", &self.ssh_port.to_string(), "root@127.0.0.1", command])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {command}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether an sshd greets on the loopback `port` within a few seconds.
pub fn ssh_greets(port: u16) -> bool {
    let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(3)));
    let mut buf = [0u8; 4];
    conn.read_exact(&mut buf).is_ok() && &buf == b"SSH-"
}

/// One QMP command over the socket at `path`: greeting, capabilities, the command.
pub fn qmp(path: &Path, command: &str) -> String {
    let mut conn = UnixStream::connect(path).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap(); // greeting
    for cmd in ["qmp_capabilities", command] {
        writeln!(conn, r#"{{"execute": "{cmd}"}}"#).unwrap();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            // Events may come before the answer.
            if line.contains("\"return\"") || line.contains("\"error\"") {
                break;
            }
        }
    }
    line
}

/// The VMs a [`power_follower`] resets, and the names it reset so far.
#[derive(Clone)]
struct Follower {
    qmp_by_name: std::sync::Arc<std::collections::HashMap<String, PathBuf>>,
    resets: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// One power notification. A pending restart of a system resets the VM of its name; a
/// pending power-off pauses it (its CPUs stop, as if the power were cut), and the power-on
/// that follows resets it and lets it run: the off-then-on cycle Ironic's `redfish` power
/// interface uses for a reboot.
async fn follow(
    axum::extract::State(f): axum::extract::State<Follower>,
    axum::Json(system): axum::Json<serde_json::Value>,
) -> axum::http::StatusCode {
    let name = system["name"].as_str().unwrap_or_default().to_string();
    let pending = system["pending_power"]["power_state"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let Some(path) = f.qmp_by_name.get(&name).cloned() else {
        return axum::http::StatusCode::NO_CONTENT;
    };
    let commands: &[&str] = if pending.contains("Restart") {
        &["system_reset"]
    } else if pending == "Off" {
        &["stop"]
    } else if pending == "On" {
        &["system_reset", "cont"]
    } else {
        &[]
    };
    if !commands.is_empty() {
        tokio::task::spawn_blocking(move || {
            for command in commands {
                qmp(&path, command);
            }
        })
        .await
        .unwrap();
        if commands.contains(&"system_reset") {
            f.resets.lock().unwrap().push(name);
        }
    }
    axum::http::StatusCode::NO_CONTENT
}

/// Follows the sushy-tools fake driver's power notifications with QMP, so that a Redfish
/// restart of fake system `name` really resets the VM of that name: the way Metal3's and
/// Ironic's CI drive VMs through Redfish. Returns the URL to give the emulator and the names
/// of the VMs reset so far.
pub async fn power_follower(
    qmp_by_name: std::collections::HashMap<String, PathBuf>,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let follower = Follower {
        qmp_by_name: std::sync::Arc::new(qmp_by_name),
        resets: Default::default(),
    };
    let resets = follower.resets.clone();
    let app = axum::Router::new()
        .route("/", axum::routing::put(follow))
        .with_state(follower);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, resets)
}

/// Serves the installable image at `http://IMAGES_IN_GUEST/installable.img` through the
/// loopback port returned (give it to [`VmSpec::install_target`]); counts the downloads.
pub async fn image_server(image: &GuestImage) -> (u16, Downloads) {
    let file = Served {
        bytes: std::fs::read(&image.installable).unwrap(),
        route: "/installable.img",
        cut_once: false,
    };
    serve_files(vec![file]).await
}

/// A file [`serve_files`] serves.
pub struct Served {
    /// What it holds.
    pub bytes: Vec<u8>,
    /// Its route.
    pub route: &'static str,
    /// Its first whole download breaks off halfway, and the two requests after it are
    /// answered 503: an image server that stopped in the middle of a download, then started
    /// again.
    pub cut_once: bool,
}

/// The whole downloads (answered 200, not a byte range) begun of each route.
pub type Downloads = std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, usize>>>;

/// Serves `files` over plain HTTP on a free loopback port (returned), as a static file server
/// does: whole, or by the byte range asked (`bytes=a-b`, `bytes=a-`), with an ETag.
pub async fn serve_files(files: Vec<Served>) -> (u16, Downloads) {
    use axum::http::{header, HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    let downloads = Downloads::default();
    let mut app = axum::Router::new();
    for file in files {
        let bytes = axum::body::Bytes::from(file.bytes);
        let counted = downloads.clone();
        // The requests still to fail: the first is cut, the two after it are refused.
        let failing =
            std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(match file.cut_once {
                true => 3,
                false => 0,
            }));
        let route = file.route;
        app = app.route(
            route,
            axum::routing::get(move |headers: HeaderMap| {
                let bytes = bytes.clone();
                let (counted, failing) = (counted.clone(), failing.clone());
                async move {
                    let len = bytes.len();
                    let range = headers
                        .get(header::RANGE)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("bytes="))
                        .and_then(|v| v.split_once('-'))
                        .and_then(|(from, to)| {
                            let from: usize = from.parse().ok()?;
                            let to = to.parse().map_or(len, |to: usize| (to + 1).min(len));
                            (from < to).then_some((from, to))
                        });
                    let left = failing.load(std::sync::atomic::Ordering::SeqCst);
                    if left > 0 {
                        failing.store(left - 1, std::sync::atomic::Ordering::SeqCst);
                    }
                    let etag = [(header::ETAG, "\"v1\""), (header::ACCEPT_RANGES, "bytes")];
                    match (left, range) {
                        (1 | 2, _) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                        (3, None) => {
                            *counted
                                .lock()
                                .unwrap()
                                .entry(route.to_string())
                                .or_default() += 1;
                            let half = bytes.slice(..len / 2);
                            let broken = futures::stream::iter([
                                Ok(half),
                                Err(std::io::Error::other("the image server stopped")),
                            ]);
                            let body = axum::body::Body::from_stream(broken);
                            (etag, [(header::CONTENT_LENGTH, len.to_string())], body)
                                .into_response()
                        }
                        (_, Some((from, to))) => {
                            let range = format!("bytes {from}-{}/{len}", to - 1);
                            let headers = [(header::CONTENT_RANGE, range)];
                            (
                                StatusCode::PARTIAL_CONTENT,
                                etag,
                                headers,
                                bytes.slice(from..to),
                            )
                                .into_response()
                        }
                        (_, None) => {
                            *counted
                                .lock()
                                .unwrap()
                                .entry(route.to_string())
                                .or_default() += 1;
                            (etag, bytes).into_response()
                        }
                    }
                }
            }),
        );
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, downloads)
}

/// `shepherd run` over the static inventory at `inventory` on BMDB `url`, taking guests over
/// as root with `key` and starting agents that heartbeat to [`SERVER_IN_GUEST`], trusting the
/// CA of [`server_for_guests`]' certificates in `certs`.
pub fn run_for_guests(url: &str, inventory: &Path, certs: &Path, key: &Path) -> Command {
    let mut run = super::shepherd();
    run.args(["run", "--provider", "static", "--database", url])
        .arg("--static-inventory")
        .arg(format!("file://{}", inventory.display()))
        .arg("--agent-executable")
        .arg(shepherd_loops::testing::agent_path())
        .args(["--agent-endpoint", SERVER_IN_GUEST])
        .arg("--agent-ca")
        .arg(certs.join("ca.pem"))
        .arg("--ssh-key")
        .arg(key)
        .args(["--ssh-user", "root", "--ssh-exec-timeout", "120s"]);
    run
}

/// `shepherd server` on BMDB `url`, listening on loopback `port` (what the guests reach as
/// [`SERVER_IN_GUEST`]) with development certificates in `dir/certs` valid for that name, its
/// log in `dir/server.log`; returns once it listens.
pub fn server_for_guests(url: &str, port: u16, dir: &Path) -> super::ChildGuard {
    let mut server = super::ChildGuard(Some(
        super::shepherd()
            .args(["server", "--database", url, "--migrate"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--dev-certs")
            .arg(dir.join("certs"))
            .args([
                "--dev-cert-names",
                SERVER_IN_GUEST.split(':').next().unwrap(),
            ])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("server.log")).unwrap())
            .spawn()
            .unwrap(),
    ));
    super::announced(server.child(), "shepherd server: listening on ");
    server
}
