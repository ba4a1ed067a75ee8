//! A real, standalone OpenStack Ironic on a loopback port, for tests and benchmarks (feature
//! `testing`).
//!
//! The all-in-one `ironic` process (API and conductor in one, `rpc_transport = none`) runs from
//! the virtualenv `scripts/test-deps.sh` installs (`SHEPHERD_IRONIC_VENV`, default
//! `~/.cache/shepherd/ironic-venv`), with a SQLite database and a lock directory of its own, no
//! DHCP and no automated cleaning, and either no authentication or HTTP basic. It runs until
//! the [`IronicServer`] is dropped; start-up is bounded. There is no skip path: a missing
//! virtualenv fails the test with the command that installs it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use shepherd_provider::testing::free_loopback_port;

/// How long Ironic may take to answer and to register its conductor.
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// The microversion the test helpers speak (node history needs 1.78).
const ADMIN_VERSION: &str = "1.81";

/// The newest microversion at which a node is created `available` (1.11 made it `enroll`).
const AVAILABLE_ON_CREATE_VERSION: &str = "1.10";

/// How Shepherd (and the helpers) authenticate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TestAuth {
    /// `auth_strategy = noauth`.
    None,
    /// `auth_strategy = http_basic` with one user.
    Basic {
        /// User name.
        user: String,
        /// Password.
        password: String,
    },
}

/// A running Ironic.
pub struct IronicServer {
    dir: tempfile::TempDir,
    port: u16,
    auth: TestAuth,
    child: Option<Child>,
    http: reqwest::Client,
    /// Ironic's database, as an SQLAlchemy URL (`[database] connection`).
    database: String,
    /// How many fake nodes were enrolled, so that each gets a name of its own.
    fake_named: std::sync::atomic::AtomicUsize,
}

/// The virtualenv holding Ironic.
pub fn venv() -> PathBuf {
    std::env::var_os("SHEPHERD_IRONIC_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/shepherd/ironic-venv")
        })
}

/// Creates Ironic's schema in the database `conf` names (`ironic-dbsync create_schema`).
fn create_schema(conf: &Path) {
    succeeded(
        "running ironic-dbsync create_schema",
        Command::new(venv().join("bin/ironic-dbsync"))
            .arg("--config-file")
            .arg(conf)
            .arg("create_schema")
            .output(),
    );
}

/// An empty SQLite database of Ironic's with its schema, made once per process and copied
/// for each Ironic: `ironic-dbsync` takes about 2 s of a core, and a test run starts dozens.
fn sqlite_schema() -> &'static [u8] {
    static SCHEMA: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    SCHEMA.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("shepherd-ironic-schema-")
            .tempdir()
            .unwrap();
        let db = dir.path().join("ironic.sqlite");
        let conf = dir.path().join("ironic.conf");
        std::fs::write(
            &conf,
            format!("[database]\nconnection = sqlite:///{}\n", db.display()),
        )
        .unwrap();
        create_schema(&conf);
        std::fs::read(&db).unwrap()
    })
}

/// Starts the all-in-one `ironic` process on `dir`'s `ironic.conf`, in a process group of its
/// own, its output appended to `dir`'s `stdout.log`.
fn spawn(dir: &Path) -> Child {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("stdout.log"))
        .unwrap();
    Command::new(venv().join("bin/ironic"))
        .arg("--config-file")
        .arg(dir.join("ironic.conf"))
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .process_group(0)
        .spawn()
        .expect("starting ironic")
}

impl IronicServer {
    /// Starts Ironic with `auth`, its `fake-hardware` and `redfish` hardware types enabled,
    /// and waits until its API answers and its conductor serves `fake-hardware`.
    pub async fn start(auth: TestAuth) -> IronicServer {
        Self::start_with(auth, "", None).await
    }

    /// [`IronicServer::start`] with Ironic's database in the (empty) Postgres database
    /// `postgres_url` (`postgres://user@host:port/name`) instead of SQLite, as production
    /// Ironics keep theirs: its conductor then works on many nodes at once without
    /// "database is locked".
    pub async fn start_on_postgres(auth: TestAuth, postgres_url: &str) -> IronicServer {
        let rest = postgres_url
            .strip_prefix("postgres://")
            .or_else(|| postgres_url.strip_prefix("postgresql://"))
            .unwrap_or_else(|| panic!("not a postgres:// URL: {postgres_url}"));
        // Without the BMDB driver's query parameters (`statement-cache-capacity`), which libpq
        // refuses.
        let database = format!(
            "postgresql+psycopg2://{}",
            rest.split('?').next().unwrap_or(rest)
        );
        Self::start_with(auth, "", Some(database)).await
    }

    /// [`IronicServer::start`] with its conductor in `conductor_group` (`""`: none): it serves
    /// only the nodes of that group, as a conductor of one rack does.
    pub async fn start_in_conductor_group(auth: TestAuth, conductor_group: &str) -> IronicServer {
        Self::start_with(auth, conductor_group, None).await
    }

    /// Ironic in `conductor_group`, on `database` (an SQLAlchemy URL; `None`: SQLite in its
    /// directory).
    async fn start_with(
        auth: TestAuth,
        conductor_group: &str,
        database: Option<String>,
    ) -> IronicServer {
        let venv = venv();
        let ironic = venv.join("bin/ironic");
        assert!(
            ironic.exists(),
            "{} is missing: run scripts/test-deps.sh (installs Ironic into a virtualenv)",
            ironic.display()
        );
        let dir = tempfile::Builder::new()
            .prefix("shepherd-ironic-")
            .tempdir()
            .unwrap();
        let port = free_loopback_port();
        let auth_lines = match &auth {
            TestAuth::None => "auth_strategy = noauth\n".to_string(),
            TestAuth::Basic { user, password } => {
                let hash = succeeded(
                    "running the virtualenv's python for bcrypt",
                    Command::new(venv.join("bin/python"))
                        .args([
                            "-c",
                            "import bcrypt,sys; print(bcrypt.hashpw(sys.argv[1].encode(), bcrypt.gensalt(4)).decode())",
                            password,
                        ])
                        .output(),
                );
                let users = dir.path().join("htpasswd");
                std::fs::write(
                    &users,
                    format!("{user}:{}\n", String::from_utf8_lossy(&hash.stdout).trim()),
                )
                .unwrap();
                format!(
                    "auth_strategy = http_basic\nhttp_basic_auth_user_file = {}\n",
                    users.display()
                )
            }
        };
        let d = dir.path().display();
        let on_sqlite = database.is_none();
        let database =
            database.unwrap_or_else(|| format!("sqlite:///{d}/ironic.sqlite?timeout=30"));
        let config = format!(
            "[DEFAULT]\n{auth_lines}\
             enabled_hardware_types = fake-hardware,redfish\n\
             enabled_deploy_interfaces = fake,ramdisk,direct\n\
             enabled_boot_interfaces = fake,pxe,redfish-virtual-media\n\
             enabled_power_interfaces = fake,redfish\n\
             enabled_management_interfaces = fake,redfish\n\
             enabled_inspect_interfaces = fake,no-inspect\n\
             enabled_network_interfaces = noop\n\
             enabled_raid_interfaces = fake,no-raid\n\
             enabled_vendor_interfaces = fake,no-vendor\n\
             enabled_bios_interfaces = fake,no-bios\n\
             enabled_console_interfaces = fake,no-console\n\
             enabled_rescue_interfaces = fake,no-rescue\n\
             enabled_firmware_interfaces = fake,no-firmware\n\
             rpc_transport = none\n\
             host = shepherd-test-{port}\n\
             log_file = {d}/ironic.log\n\
             [api]\nhost_ip = 127.0.0.1\nport = {port}\napi_workers = 1\n\
             [dhcp]\ndhcp_provider = none\n\
             [conductor]\nautomated_clean = false\nsync_power_state_interval = 5\n\
             conductor_group = {conductor_group}\n\
             [database]\nconnection = {database}\n\
             [oslo_concurrency]\nlock_path = {d}/locks\n\
             [pxe]\ntftp_root = {d}/tftp\ntftp_master_path = {d}/tftp/master\n\
             images_path = {d}/images\ninstance_master_path = {d}/images/master\n\
             [deploy]\nhttp_root = {d}/http\nhttp_url = http://127.0.0.1:1\n"
        );
        let conf = dir.path().join("ironic.conf");
        std::fs::write(&conf, config).unwrap();
        if on_sqlite {
            std::fs::write(dir.path().join("ironic.sqlite"), sqlite_schema()).unwrap();
        } else {
            create_schema(&conf);
        }
        let child = spawn(dir.path());
        let server = IronicServer {
            dir,
            port,
            auth,
            child: Some(child),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
            database,
            fake_named: Default::default(),
        };
        server.wait_ready().await;
        server
    }

    async fn wait_ready(&self) {
        let started = Instant::now();
        loop {
            // The API answers before the conductor has registered its drivers; node creation
            // fails until it has.
            if let Ok((200, drivers)) = self.get("/v1/drivers").await {
                let names: Vec<&str> = drivers["drivers"]
                    .as_array()
                    .map(|d| d.iter().filter_map(|d| d["name"].as_str()).collect())
                    .unwrap_or_default();
                if names.contains(&"fake-hardware") {
                    return;
                }
            }
            assert!(
                started.elapsed() < START_TIMEOUT,
                "Ironic did not come up within {START_TIMEOUT:?}; its log:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The credentials Ironic accepts.
    pub fn auth(&self) -> crate::Auth {
        match &self.auth {
            TestAuth::None => crate::Auth::None,
            TestAuth::Basic { user, password } => crate::Auth::Basic {
                user: user.clone(),
                password: password.clone(),
            },
        }
    }

    /// The end of Ironic's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let mut text = String::new();
        for f in ["stdout.log", "ironic.log"] {
            let all = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
            let lines: Vec<&str> = all.lines().collect();
            text += &lines[lines.len().saturating_sub(40)..].join("\n");
            text.push('\n');
        }
        text
    }

    /// Whether Ironic's log mentions `text`.
    pub fn log_contains(&self, text: &str) -> bool {
        ["stdout.log", "ironic.log"].iter().any(|f| {
            std::fs::read_to_string(self.dir.path().join(f))
                .unwrap_or_default()
                .contains(text)
        })
    }

    /// Stops Ironic (the whole process group), keeping its database.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The whole group: Ironic's API and conductor may run in processes of their own.
            // killpg(2), not `kill -KILL -PID`: procps' kill reads a bare negative number
            // after the signal as a signal of its own and ends every process it may.
            let pgid = child.id() as libc::pid_t;
            if pgid > 1 {
                // SAFETY: killpg has no memory-safety preconditions; the group is our child's.
                unsafe {
                    libc::killpg(pgid, libc::SIGKILL);
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts Ironic again on the same port and database after [`IronicServer::stop`].
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "stop Ironic before restarting it");
        self.child = Some(spawn(self.dir.path()));
        self.wait_ready().await;
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.request_at(method, path, ADMIN_VERSION)
    }

    fn request_at(
        &self,
        method: reqwest::Method,
        path: &str,
        version: &str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url()))
            .header("X-OpenStack-Ironic-API-Version", version);
        if let TestAuth::Basic { user, password } = &self.auth {
            req = req.basic_auth(user, Some(password));
        }
        req
    }

    async fn send(req: reqwest::RequestBuilder) -> Result<(u16, Value), reqwest::Error> {
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let body = resp.bytes().await?;
        Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
    }

    /// An administrator's GET: the status and the JSON body (`null` if none).
    pub async fn get(&self, path: &str) -> Result<(u16, Value), reqwest::Error> {
        Self::send(self.request(reqwest::Method::GET, path)).await
    }

    /// An administrator's request with a JSON body.
    pub async fn send_json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> (u16, Value) {
        Self::send(self.request(method, path).json(&body))
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// Enrolls one node from `body` (driver, interfaces, fields) and brings it to `available`
    /// through `manage` and `provide`; returns its uuid. One request at a time: concurrent
    /// enrolment against Ironic's SQLite database loses nodes.
    pub async fn enroll(&self, body: Value) -> String {
        let (status, node) = self
            .send_json(reqwest::Method::POST, "/v1/nodes", body)
            .await;
        assert_eq!(status, 201, "enrolling a node: {node}");
        node["uuid"].as_str().unwrap().to_string()
    }

    /// Applies JSON patch `ops` to node `id` as the administrator; returns the node.
    pub async fn patch_node(&self, id: &str, ops: Value) -> Value {
        let path = format!("/v1/nodes/{id}");
        let (status, node) = self.send_json(reqwest::Method::PATCH, &path, ops).await;
        assert_eq!(status, 200, "patching node {id}: {node}");
        node
    }

    /// Adds a port (a network interface with MAC address `mac`) to node `id`.
    pub async fn add_port(&self, id: &str, mac: &str) {
        let body = json!({"node_uuid": id, "address": mac});
        let (status, port) = self
            .send_json(reqwest::Method::POST, "/v1/ports", body)
            .await;
        assert_eq!(status, 201, "adding port {mac} to {id}: {port}");
    }

    /// Moves `nodes` through `target` (`manage`, `provide`, …) and waits until each is in
    /// `state`.
    pub async fn provision_all(&self, nodes: &[String], target: &str, state: &str) {
        for id in nodes {
            let (status, body) = self
                .send_json(
                    reqwest::Method::PUT,
                    &format!("/v1/nodes/{id}/states/provision"),
                    json!({ "target": target }),
                )
                .await;
            assert_eq!(status, 202, "{target} of {id}: {body}");
        }
        for id in nodes {
            self.wait_for_state(id, state).await;
        }
    }

    /// Waits (up to 60 s) until node `id` is in provision state `state`.
    pub async fn wait_for_state(&self, id: &str, state: &str) {
        let path = format!("/v1/nodes/{id}");
        self.wait_for_field(&path, "provision_state", state).await
    }

    /// Waits (up to 60 s) until node `id` is in the failed provision state `state` with its
    /// `last_error` set. Ironic shows a failed deploy without one for a moment: its
    /// `set_failed_state` saves the state, powers the node off (which clears `last_error`),
    /// then writes the error again.
    pub async fn wait_for_failure(&self, id: &str, state: &str) {
        let path = format!("/v1/nodes/{id}");
        let what = format!("provision_state {state} with a last_error");
        self.wait_until(&path, &what, |node| {
            node["provision_state"] == state
                && !node["last_error"].as_str().unwrap_or_default().is_empty()
        })
        .await
    }

    /// Waits (up to 60 s) until allocation `name` is in state `state`.
    pub async fn wait_for_allocation_state(&self, name: &str, state: &str) {
        let path = format!("/v1/allocations/{name}");
        self.wait_for_field(&path, "state", state).await
    }

    /// Waits (up to 60 s) until the resource at `path` has `want` in its field `field`.
    async fn wait_for_field(&self, path: &str, field: &str, want: &str) {
        let what = format!("{field} {want}");
        self.wait_until(path, &what, |found| found[field] == want)
            .await
    }

    /// Waits (up to 60 s, reading every 100 ms) until the resource at `path` is `done`;
    /// `what` names the awaited condition in the failure.
    async fn wait_until(&self, path: &str, what: &str, done: impl Fn(&Value) -> bool) {
        let started = Instant::now();
        loop {
            let (_, found) = self.get(path).await.unwrap();
            if done(&found) {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{path} did not reach {what}: {found}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `n` nodes of the `fake-hardware` type, every interface fake, `available`; `extra` gives
    /// each node's `extra` from its index. Each is created at microversion 1.10, the last at
    /// which a new node starts `available` rather than `enroll` (so it needs no `manage` and
    /// `provide`, each an asynchronous transition through the conductor: ten times the time
    /// at 1,000 nodes), then given its resource class, which 1.10 does not know.
    pub async fn fake_nodes(&self, n: usize, extra: impl Fn(usize) -> Value) -> Vec<String> {
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            let name = self
                .fake_named
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let body = json!({
                "name": format!("fake-{name}"),
                "driver": "fake-hardware",
                "extra": extra(i),
                "properties": {"cpus": 4, "memory_mb": 8192, "local_gb": 40, "cpu_arch": "x86_64"},
            });
            let (status, node) = Self::send(
                self.request_at(
                    reqwest::Method::POST,
                    "/v1/nodes",
                    AVAILABLE_ON_CREATE_VERSION,
                )
                .json(&body),
            )
            .await
            .unwrap_or_else(|e| panic!("enrolling a fake node: {e}"));
            assert_eq!(status, 201, "enrolling a fake node: {node}");
            assert_eq!(node["provision_state"], "available", "{node}");
            let id = node["uuid"].as_str().unwrap().to_string();
            self.patch_node(
                &id,
                json!([{"op": "add", "path": "/resource_class", "value": "shepherd-test"}]),
            )
            .await;
            ids.push(id);
        }
        self.power_off(&ids).await;
        ids
    }

    /// Records `nodes` as powered off, as a real node's BMC would report: Ironic allocates only
    /// nodes with a power state, and a fake node starts without one. Written into Ironic's
    /// database in one statement (the fake power interface reports what the database holds):
    /// a power request per node through the API would cost a conductor task each, minutes
    /// at 1,000 nodes.
    pub async fn power_off(&self, nodes: &[String]) {
        self.set_in_database(nodes, "power_state", Some("power off"));
    }

    /// Sets column `column` of `nodes` to `value` (`None`: NULL) in Ironic's database, in one
    /// statement, as only Ironic itself could (a node moved to a conductor group no conductor
    /// serves, a node locked by another conductor, say).
    pub fn set_in_database(&self, nodes: &[String], column: &str, value: Option<&str>) {
        assert!(
            column.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "a column name: {column}"
        );
        let rows: Vec<Value> = nodes.iter().map(|u| json!({"v": value, "u": u})).collect();
        let update = format!("update nodes set {column} = :v where uuid = :u");
        self.execute_in_database(&update, &Value::Array(rows));
    }

    /// Runs `statement` (SQL with `:name` parameters taken from `params`: an object, or a list
    /// of objects for one execution each) in one transaction on Ironic's database, as only
    /// Ironic itself could.
    pub fn execute_in_database(&self, statement: &str, params: &Value) {
        let script = "import json, sys\nfrom sqlalchemy import create_engine, text\n\
             with create_engine(sys.argv[1]).begin() as c:\n    \
             c.execute(text(sys.argv[2]), json.loads(sys.argv[3]))\n";
        succeeded(
            "writing into Ironic's database",
            Command::new(venv().join("bin/python"))
                .args(["-c", script])
                .arg(&self.database)
                .arg(statement)
                .arg(params.to_string())
                .output(),
        );
    }

    /// One node as the administrator sees it.
    pub async fn node(&self, id: &str) -> Value {
        let (status, node) = self.get(&format!("/v1/nodes/{id}")).await.unwrap();
        assert_eq!(status, 200, "node {id}: {node}");
        node
    }

    /// Node `id`'s history events (Ironic 1.78): "Starting deployment …" marks each deploy.
    pub async fn history(&self, id: &str) -> Vec<String> {
        let (_, body) = self.get(&format!("/v1/nodes/{id}/history")).await.unwrap();
        body["history"]
            .as_array()
            .map(|h| {
                h.iter()
                    .filter_map(|e| e["event"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Waits until node `id` is `active` and asserts that Ironic started exactly one deploy of
    /// it.
    pub async fn assert_deployed_once(&self, id: &str) {
        self.wait_for_state(id, "active").await;
        assert_eq!(self.deploys_started(id).await, 1, "node {id} deployed once");
    }

    /// How many deploys Ironic started for node `id`, from its history.
    pub async fn deploys_started(&self, id: &str) -> usize {
        self.history(id)
            .await
            .iter()
            .filter(|e| e.starts_with("Starting deployment"))
            .count()
    }

    /// Node `id`'s `instance_info` as Ironic stored it (its API masks the config drive), read
    /// from Ironic's database.
    pub fn stored_instance_info(&self, id: &str) -> Value {
        self.stored_instance_infos()
            .remove(id)
            .unwrap_or(Value::Null)
    }

    /// Every node's `instance_info` as Ironic stored it, by node uuid, in one read of
    /// Ironic's database.
    pub fn stored_instance_infos(&self) -> std::collections::HashMap<String, Value> {
        let out = succeeded(
            "reading Ironic's database",
            Command::new(venv().join("bin/python"))
                .args([
                    "-c",
                    "import json, sys\nfrom sqlalchemy import create_engine, text\n\
                     with create_engine(sys.argv[1]).connect() as c:\n    \
                     rows = c.execute(text('select uuid, instance_info from nodes')).all()\n\
                     print(json.dumps({u: json.loads(i) if i else None for u, i in rows}))\n",
                ])
                .arg(&self.database)
                .output(),
        );
        serde_json::from_slice(&out.stdout).expect("Ironic's instance_info as JSON")
    }

    /// Puts node `id` into (or out of) maintenance.
    pub async fn set_maintenance(&self, id: &str, on: bool, reason: &str) {
        let path = format!("/v1/nodes/{id}/maintenance");
        let (status, body) = if on {
            self.send_json(reqwest::Method::PUT, &path, json!({ "reason": reason }))
                .await
        } else {
            Self::send(self.request(reqwest::Method::DELETE, &path))
                .await
                .unwrap()
        };
        assert_eq!(status, 202, "maintenance of {id}: {body}");
    }
}

/// A node of Ironic's `redfish` hardware type for [`IronicServer::adopt_redfish_node`].
pub struct RedfishNode<'a> {
    /// The BMC's base URL (`https://127.0.0.1:PORT`).
    pub address: &'a str,
    /// The system's path (`/redfish/v1/Systems/ID`).
    pub system_id: &'a str,
    /// The BMC password of user `admin`.
    pub password: &'a str,
    /// The file with the certificate Ironic verifies the BMC against.
    pub ca: &'a Path,
    /// The MAC of the node's port (PXE boot needs one to validate).
    pub mac: &'a str,
    /// Where the deploy kernel and ramdisk are served (`http://127.0.0.1:PORT`).
    pub images: &'a str,
    /// The node's `extra`.
    pub extra: Value,
}

impl IronicServer {
    /// Enrolls a `redfish` node (ramdisk deploy, PXE boot, power and management over the
    /// given BMC), brings it to `manageable` (Ironic reads its power state over Redfish) and
    /// then to `active` with Ironic's `adopt` (no deploy runs); returns its uuid. The
    /// node's `instance_uuid` is set, so with our deployment in `extra` it is an orphan of
    /// ours that Shepherd adopts.
    pub async fn adopt_redfish_node(&self, node: RedfishNode<'_>) -> String {
        let (kernel, ramdisk) = (
            format!("{}/deploy.kernel", node.images),
            format!("{}/deploy.ramdisk", node.images),
        );
        let id = self
            .enroll(json!({
                "name": "redfish-0",
                "driver": "redfish",
                "deploy_interface": "ramdisk",
                "boot_interface": "pxe",
                "resource_class": "shepherd-test",
                "driver_info": {
                    "redfish_address": node.address,
                    "redfish_system_id": node.system_id,
                    "redfish_username": "admin",
                    "redfish_password": node.password,
                    "redfish_verify_ca": node.ca.display().to_string(),
                    "deploy_kernel": kernel,
                    "deploy_ramdisk": ramdisk,
                },
                "instance_info": {"kernel": kernel, "ramdisk": ramdisk},
                "instance_uuid": uuid::Uuid::new_v4().to_string(),
                "extra": node.extra,
            }))
            .await;
        let (status, body) = self
            .send_json(
                reqwest::Method::POST,
                "/v1/ports",
                json!({"node_uuid": id, "address": node.mac}),
            )
            .await;
        assert_eq!(status, 201, "a port for {id}: {body}");
        let one = std::slice::from_ref(&id);
        self.provision_all(one, "manage", "manageable").await;
        self.provision_all(one, "adopt", "active").await;
        id
    }
}

/// A plain HTTP server on loopback serving a deploy kernel and ramdisk (empty files: Ironic
/// only checks they can be fetched), for nodes whose boot interface validates them.
pub struct ImageServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl ImageServer {
    /// Starts the server.
    pub async fn start() -> ImageServer {
        let app = axum::Router::new().fallback(|| async { "" });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        ImageServer { url, task }
    }
}

impl Drop for ImageServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Drop for IronicServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The SSH public key the tests' deployments install.
pub const TEST_KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBr2dFCaBHNnDyb0BdXhYrT4Hp4KHLrUeL2vE3GFmBCX shepherd@test";

/// A deployment's settings as the tests use them: nodes of resource class `shepherd-test`,
/// the address from the node (not inspection), orphans adopted at once.
pub fn test_config(deployment: &str) -> crate::IronicConfig {
    let mut c = crate::IronicConfig::new(deployment, TEST_KEY);
    c.selector.resource_class = Some("shepherd-test".into());
    c.address_from_inventory = false;
    c.orphan_grace = Duration::ZERO;
    c
}

/// A provider of the Ironic at `url`, retrying as `retry` says.
pub async fn test_provider(
    url: &str,
    auth: crate::Auth,
    retry: crate::RetryPolicy,
    config: crate::IronicConfig,
) -> Result<std::sync::Arc<crate::IronicProvider>, crate::ConnectError> {
    let metrics = std::sync::Arc::new(shepherd_provider::metrics::CallMetrics::default());
    let client = crate::Client::new(url, auth, retry, metrics).expect("a client of a test URL");
    let provider = crate::IronicProvider::connect(client, config).await?;
    Ok(std::sync::Arc::new(provider))
}

/// What most tests start from: a real Ironic with `n` fake-hardware nodes (their ids), a fresh
/// SQLite BMDB with a provisioner's session, and a provider of deployment `site-a` retrying as
/// `retry` says.
pub async fn site(
    n: usize,
    retry: crate::RetryPolicy,
) -> (
    IronicServer,
    Vec<String>,
    shepherd_bmdb::testing::TestDb,
    shepherd_bmdb::Session,
    std::sync::Arc<crate::IronicProvider>,
) {
    let ironic = IronicServer::start(TestAuth::None).await;
    let nodes = ironic.fake_nodes(n, |_| json!({})).await;
    let t = shepherd_bmdb::testing::sqlite().await;
    let processor = shepherd_bmdb::Processor::ShepherdProvisioner;
    let s = shepherd_bmdb::testing::session(&t.db, processor).await;
    let config = test_config("site-a");
    let p = test_provider(&ironic.url(), ironic.auth(), retry, config)
        .await
        .expect("a provider of the test Ironic");
    (ironic, nodes, t, s, p)
}

/// The BMDB's Ironic machines: provider id → the provider status recorded.
pub async fn recorded(
    db: &shepherd_bmdb::Bmdb,
) -> std::collections::BTreeMap<String, Option<shepherd_bmdb::ProviderStatus>> {
    shepherd_bmdb::testing::provided_by(db, shepherd_bmdb::ProviderKind::Ironic)
        .await
        .into_iter()
        .map(|(_, p)| (p.provider_id, p.status))
        .collect()
}

/// Faults a [`FaultProxy`] injects into the requests it forwards.
#[derive(Debug, Default)]
pub struct Faults {
    /// The next this many requests are answered 503 without reaching Ironic.
    pub unavailable: std::sync::atomic::AtomicU32,
    /// The next this many power requests are answered 409 NodeLocked without reaching Ironic.
    pub node_locked: std::sync::atomic::AtomicU32,
    /// Every request waits this long (milliseconds) before it is forwarded.
    pub delay_ms: std::sync::atomic::AtomicU64,
    /// The next this many reads of one allocation (`GET /v1/allocations/ID`) show it failed
    /// by Ironic itself (`error`, "Unexpected exception during allocation"), whatever Ironic
    /// answered: a fault a claim tries again after.
    pub allocations_failed_by_ironic: std::sync::atomic::AtomicU32,
    /// A patch of a node is forwarded only once the node has an instance (its allocation is
    /// placed), or after 30 s: a claim's first look then always finds its allocation placed.
    pub hold_node_patches_until_placed: std::sync::atomic::AtomicBool,
    /// Requests seen: (method, path).
    pub seen: std::sync::Mutex<Vec<(String, String)>>,
}

/// A loopback HTTP proxy in front of an [`IronicServer`] that injects [`Faults`]: Ironic's own
/// answers otherwise, bytes for bytes.
pub struct FaultProxy {
    addr: std::net::SocketAddr,
    /// What to inject; change it while the proxy runs.
    pub faults: std::sync::Arc<Faults>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy to `ironic`.
    pub async fn start(ironic: &IronicServer) -> FaultProxy {
        use std::sync::atomic::Ordering::SeqCst;
        let faults = std::sync::Arc::new(Faults::default());
        let upstream = ironic.url();
        let http = reqwest::Client::new();
        let state = (faults.clone(), upstream, http);
        let handler = |axum::extract::State((faults, upstream, http)): axum::extract::State<(
            std::sync::Arc<Faults>,
            String,
            reqwest::Client,
        )>,
                       method: axum::http::Method,
                       uri: axum::http::Uri,
                       headers: axum::http::HeaderMap,
                       body: axum::body::Bytes| async move {
            let path = uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or("/")
                .to_string();
            faults
                .seen
                .lock()
                .unwrap()
                .push((method.to_string(), path.clone()));
            let delay = faults.delay_ms.load(SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let node_patch = method == axum::http::Method::PATCH
                && path.starts_with("/v1/nodes/")
                && path["/v1/nodes/".len()..].split('/').count() == 1;
            if node_patch && faults.hold_node_patches_until_placed.load(SeqCst) {
                let node = format!("{upstream}{path}");
                let placed = async || {
                    let n: serde_json::Value =
                        http.get(&node).send().await.ok()?.json().await.ok()?;
                    n["instance_uuid"].is_string().then_some(())
                };
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                while placed().await.is_none() && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let take = |counter: &std::sync::atomic::AtomicU32| {
                counter
                    .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            };
            let reply = |status: u16, body: String| {
                axum::http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(axum::body::Body::from(body))
                    .unwrap()
            };
            if take(&faults.unavailable) {
                return reply(
                    503,
                    r#"{"error_message": "injected: service unavailable"}"#.into(),
                );
            }
            if path.contains("/states/power") && take(&faults.node_locked) {
                let fault = serde_json::json!({"faultcode": "Client", "faultstring": "Node x is locked by host injected, please retry after the current operation is completed.", "debuginfo": null});
                return reply(
                    409,
                    serde_json::json!({"error_message": fault.to_string()}).to_string(),
                );
            }
            let allocation_read =
                method == axum::http::Method::GET && path.starts_with("/v1/allocations/");
            let method = reqwest::Method::from_bytes(method.as_str().as_bytes()).unwrap();
            let mut req = http
                .request(method, format!("{upstream}{path}"))
                .body(body.to_vec());
            for name in [
                "authorization",
                "content-type",
                "x-openstack-ironic-api-version",
                "accept",
            ] {
                if let Some(v) = headers.get(name).and_then(|v| v.to_str().ok()) {
                    req = req.header(name, v);
                }
            }
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let bytes = resp.bytes().await.unwrap_or_default();
                    let mut body = String::from_utf8_lossy(&bytes).into_owned();
                    if status == 200
                        && allocation_read
                        && take(&faults.allocations_failed_by_ironic)
                    {
                        let mut a: serde_json::Value = serde_json::from_str(&body).unwrap();
                        a["state"] = "error".into();
                        a["node_uuid"] = serde_json::Value::Null;
                        a["last_error"] = "Unexpected exception during allocation: injected".into();
                        body = a.to_string();
                    }
                    reply(status, body)
                }
                Err(e) => reply(502, format!("{{\"error_message\": \"proxy: {e}\"}}")),
            }
        };
        let app = axum::Router::new().fallback(handler).with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FaultProxy { addr, faults, task }
    }

    /// `http://127.0.0.1:PORT` of the proxy.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests seen whose path contains `part`.
    pub fn seen(&self, part: &str) -> usize {
        self.faults
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| p.contains(part))
            .count()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The output of a command that must have run and succeeded; otherwise panics saying `what`
/// failed, with its exit status and the ends of its stdout and stderr (Python's deprecation
/// warnings come first, the error last).
fn succeeded(what: &str, output: std::io::Result<std::process::Output>) -> std::process::Output {
    let output = output.unwrap_or_else(|e| panic!("{what}: {e}"));
    let end = |bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes);
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    };
    assert!(
        output.status.success(),
        "{what}: {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        end(&output.stdout),
        end(&output.stderr)
    );
    output
}
