//! A highly available Postgres of the test's own: three PostgreSQL nodes under Patroni
//! (Debian's packages, which `scripts/test-deps.sh` installs), one etcd for Patroni's leader
//! key, and HAProxy in front routing to whichever node Patroni's REST API calls the primary,
//! the way production clusters are built. Everything listens on loopback ports picked here,
//! start-up is bounded, and every process is stopped by process group when the cluster is
//! dropped. As root (CI), etcd, Patroni and PostgreSQL run as the `postgres` user, as PostgreSQL
//! requires.
//!
//! Synchronous replication (`synchronous_mode`), a 10 s leader key, and `primary_start_timeout:
//! 0`: a primary whose postmaster dies is failed over to the synchronous standby at once,
//! rather than restarted in place.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::free_port;
use super::private_postgres::{bin_dir, is_root};

/// How long the cluster may take to elect a primary with a synchronous standby.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// One PostgreSQL node and its Patroni.
struct Node {
    name: String,
    pg_port: u16,
    rest_port: u16,
    patroni: Option<Child>,
}

/// A running cluster (see the module docs).
pub struct PatroniCluster {
    dir: tempfile::TempDir,
    etcd: Option<Child>,
    haproxy: Option<Child>,
    nodes: Vec<Node>,
    router_port: u16,
}

/// `program`, as the `postgres` user when we are root, in a process group of its own, its
/// output appended to `log`.
fn daemon(program: &str, args: &[&str], log: &Path) -> Child {
    let mut cmd = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", program]);
        c
    } else {
        Command::new(program)
    };
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {program}: {e}; run scripts/test-deps.sh"))
}

/// SIGKILL to `child`'s whole process group, then reaps it.
fn kill_group(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-s", "KILL", "--", &format!("-{}", child.id())])
        .stderr(Stdio::null())
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

/// Whether Patroni's REST API on `port` says its node is the primary (`GET /primary` is 200
/// only there), asked over a plain loopback HTTP/1.0 request.
fn is_primary(rest_port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", rest_port)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    if conn
        .write_all(b"GET /primary HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).is_ok() && head.ends_with(b"200")
}

impl PatroniCluster {
    /// Starts etcd, three Patroni nodes and HAProxy, and waits until HAProxy routes to a
    /// primary that has a synchronous standby.
    pub fn start() -> PatroniCluster {
        for tool in ["patroni", "etcd", "haproxy"] {
            assert!(
                Command::new("sh")
                    .args(["-c", &format!("command -v {tool}")])
                    .output()
                    .is_ok_and(|o| o.status.success()),
                "{tool} is missing: run scripts/test-deps.sh"
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("shepherd-patroni-")
            .tempdir()
            .unwrap();
        let d = dir.path().to_path_buf();
        let (etcd_client, etcd_peer) = (free_port(), free_port());
        let nodes: Vec<Node> = (0..3)
            .map(|i| Node {
                name: format!("node{i}"),
                pg_port: free_port(),
                rest_port: free_port(),
                patroni: None,
            })
            .collect();
        let bin = bin_dir();
        for node in &nodes {
            let config = format!(
                "scope: shepherd-test\n\
                 name: {name}\n\
                 restapi:\n  listen: 127.0.0.1:{rest}\n  connect_address: 127.0.0.1:{rest}\n\
                 etcd3:\n  hosts: 127.0.0.1:{etcd_client}\n\
                 bootstrap:\n  dcs:\n    ttl: 10\n    loop_wait: 1\n    retry_timeout: 3\n\
                 \x20   primary_start_timeout: 0\n    synchronous_mode: true\n\
                 \x20   maximum_lag_on_failover: 1048576\n\
                 \x20   postgresql:\n      use_pg_rewind: true\n      parameters:\n\
                 \x20       max_connections: 200\n        wal_log_hints: 'on'\n\
                 \x20 initdb:\n    - encoding: UTF8\n    - auth: trust\n\
                 \x20 pg_hba:\n    - local all all trust\n    - host all all 127.0.0.1/32 trust\n\
                 \x20   - host replication all 127.0.0.1/32 trust\n\
                 postgresql:\n  listen: 127.0.0.1:{pg}\n  connect_address: 127.0.0.1:{pg}\n\
                 \x20 data_dir: {d}/{name}\n  bin_dir: {bin}\n  pgpass: {d}/{name}.pgpass\n\
                 \x20 authentication:\n    superuser:\n      username: postgres\n\
                 \x20     password: shepherd-test\n    replication:\n      username: postgres\n\
                 \x20     password: shepherd-test\n\
                 \x20 parameters:\n    unix_socket_directories: {d}\n",
                name = node.name,
                rest = node.rest_port,
                pg = node.pg_port,
                d = d.display(),
                bin = bin.display(),
            );
            std::fs::write(d.join(format!("{}.yml", node.name)), config).unwrap();
        }
        let haproxy_port = free_port();
        let servers: String = nodes
            .iter()
            .map(|n| {
                format!(
                    "    server {} 127.0.0.1:{} check port {}\n",
                    n.name, n.pg_port, n.rest_port
                )
            })
            .collect();
        std::fs::write(
            d.join("haproxy.cfg"),
            format!(
                "global\n    maxconn 2000\n\
                 defaults\n    mode tcp\n    timeout connect 2s\n    timeout client 30m\n\
                 \x20   timeout server 30m\n    timeout check 1s\n\
                 listen primary\n    bind 127.0.0.1:{haproxy_port}\n\
                 \x20   option httpchk OPTIONS /primary\n    http-check expect status 200\n\
                 \x20   default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions\n\
                 {servers}"
            ),
        )
        .unwrap();
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&d)
                .status()
                .unwrap()
                .success();
            assert!(ok, "chown postgres {}", d.display());
        }
        let mut cluster = PatroniCluster {
            etcd: None,
            haproxy: None,
            nodes,
            router_port: haproxy_port,
            dir,
        };
        let etcd_dir = d.join("etcd").display().to_string();
        let client = format!("http://127.0.0.1:{etcd_client}");
        let peer = format!("http://127.0.0.1:{etcd_peer}");
        cluster.etcd = Some(daemon(
            "etcd",
            &[
                "--name",
                "e0",
                "--data-dir",
                &etcd_dir,
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("e0={peer}"),
            ],
            &d.join("etcd.log"),
        ));
        for i in 0..cluster.nodes.len() {
            cluster.start_node(i);
        }
        let config = d.join("haproxy.cfg").display().to_string();
        cluster.haproxy = Some(daemon(
            "haproxy",
            &["-f", &config, "-db"],
            &d.join("haproxy.log"),
        ));
        let started = Instant::now();
        while !cluster.healthy() {
            assert!(
                started.elapsed() < START_TIMEOUT,
                "the Patroni cluster did not elect a primary with a synchronous standby within {START_TIMEOUT:?}:\n{}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        cluster
    }

    fn start_node(&mut self, i: usize) {
        let d = self.dir.path();
        let node = &mut self.nodes[i];
        let config = d.join(format!("{}.yml", node.name)).display().to_string();
        node.patroni = Some(daemon(
            "patroni",
            &[&config],
            &d.join(format!("{}.log", node.name)),
        ));
    }

    /// Whether a primary answers through HAProxy and a synchronous standby streams from it.
    fn healthy(&self) -> bool {
        let Some(primary) = self.primary() else {
            return false;
        };
        let out = self.psql(
            self.router_port,
            "SELECT inet_server_port() || ',' || count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
        );
        out.is_some_and(|o| o == format!("{},1", self.nodes[primary].pg_port))
    }

    /// One value from `sql` on the server at `port`, or `None` if it cannot be asked.
    fn psql(&self, port: u16, sql: &str) -> Option<String> {
        let out = Command::new("psql")
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-Atc", sql])
            .env("PGCONNECT_TIMEOUT", "2")
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// The node Patroni calls the primary, if one does.
    pub fn primary(&self) -> Option<usize> {
        self.nodes.iter().position(|n| is_primary(n.rest_port))
    }

    /// The node HAProxy routes to, if it routes to a writable one.
    pub fn routed_primary(&self) -> Option<usize> {
        let out = self.psql(
            self.router_port,
            "SELECT inet_server_port() || ',' || pg_is_in_recovery()",
        )?;
        let (port, recovering) = out.split_once(',')?;
        if recovering != "false" {
            return None;
        }
        let port: u16 = port.parse().ok()?;
        self.nodes.iter().position(|n| n.pg_port == port)
    }

    /// The database URL through HAProxy: what Shepherd is given.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.router_port
        )
    }

    /// SIGKILL to the primary's postmaster (Patroni on that node lives on); returns the node.
    pub fn kill_primary_postmaster(&self) -> usize {
        let primary = self.primary().expect("a primary to kill");
        self.kill_postmaster(primary);
        primary
    }

    fn kill_postmaster(&self, node: usize) {
        let pid_file = self
            .dir
            .path()
            .join(&self.nodes[node].name)
            .join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        let pid = pid.lines().next().unwrap().trim().to_string();
        let ok = Command::new("kill")
            .args(["-s", "KILL", &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -9 of the postmaster {pid}");
    }

    /// SIGKILL to the primary's whole node: its Patroni and its postmaster, so that no one
    /// releases the leader key and the others wait for it to expire. Returns the node.
    pub fn kill_primary_node(&mut self) -> usize {
        let primary = self.primary().expect("a primary to kill");
        if let Some(p) = self.nodes[primary].patroni.as_mut() {
            kill_group(p);
        }
        self.kill_postmaster(primary);
        primary
    }

    /// `patronictl switchover`, planned: the primary hands over cleanly to the synchronous
    /// standby (in synchronous mode the only candidate Patroni accepts).
    pub fn switchover(&self) -> usize {
        let primary = self.primary().expect("a primary to switch over from");
        let config = self
            .dir
            .path()
            .join(format!("{}.yml", self.nodes[primary].name));
        let out = Command::new("patronictl")
            .arg("-c")
            .arg(&config)
            .args(["switchover", "--force", "--leader"])
            .arg(&self.nodes[primary].name)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "patronictl switchover: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        primary
    }

    /// Waits (bounded) until HAProxy routes to a writable node other than `old`; returns the
    /// moment it first did.
    pub fn wait_for_new_primary(&self, old: usize, within: Duration) -> Instant {
        let started = Instant::now();
        loop {
            if self.routed_primary().is_some_and(|p| p != old) {
                return Instant::now();
            }
            assert!(
                started.elapsed() < within,
                "HAProxy did not reach a new primary within {within:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The end of every daemon's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut names: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}.log", n.name))
            .collect();
        names.extend(["etcd.log".to_string(), "haproxy.log".to_string()]);
        names
            .iter()
            .map(|f| {
                let all = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
                let lines: Vec<&str> = all.lines().collect();
                format!(
                    "== {f}\n{}",
                    lines[lines.len().saturating_sub(15)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        if let Some(h) = self.haproxy.as_mut() {
            kill_group(h);
        }
        for node in &mut self.nodes {
            if let Some(p) = node.patroni.as_mut() {
                kill_group(p);
            }
            // A postmaster Patroni started may have left the group: stop it by its pid file.
            let pid_file = self.dir.path().join(&node.name).join("postmaster.pid");
            if let Some(pid) = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|s| s.lines().next().map(|l| l.trim().to_string()))
            {
                let _ = Command::new("kill")
                    .args(["-s", "KILL", &pid])
                    .stderr(Stdio::null())
                    .status();
            }
        }
        if let Some(e) = self.etcd.as_mut() {
            kill_group(e);
        }
    }
}
