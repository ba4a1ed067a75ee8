//! A scripted BMC on loopback for tests: one system, `/redfish/v1/Systems/1`, allowing the
//! reset types it is given, whose power state follows ForceOff and On a moment after each
//! request. It can answer every request with an error status, or hang, and it can speak TLS
//! with the certificates BMCs really ship (see [`BmcCerts`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How the scripted BMC answers.
#[derive(Debug, Clone)]
pub enum Answer {
    /// As a working BMC does.
    Normal,
    /// Every request gets this status line (`500 Internal Server Error`) and a multi-line
    /// HTML body, as broken BMC firmware sends.
    Status(&'static str),
    /// Requests are read and never answered (the connection is held for a minute).
    Hang,
    /// As a working BMC does, but reads (GET) are answered only after this long: a BMC busy
    /// elsewhere, during which a test can inject a fault.
    SlowReads(Duration),
}

/// What the scripted BMC does.
#[derive(Debug, Clone)]
pub struct Script {
    /// The reset types the system allows.
    pub allowed: &'static [&'static str],
    /// How it answers.
    pub answer: Answer,
    /// TLS, with this configuration; plain HTTP if `None`.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl Script {
    /// A working plain-HTTP BMC allowing `allowed`.
    pub fn allowing(allowed: &'static [&'static str]) -> Script {
        Script {
            allowed,
            answer: Answer::Normal,
            tls: None,
        }
    }
}

/// A running scripted BMC; it stops after a few hundred connections or when dropped with the
/// test's runtime.
pub struct ScriptedBmc {
    /// Its base URL (`http://127.0.0.1:PORT` or `https://…`).
    pub url: String,
    requests: Arc<Mutex<Vec<Logged>>>,
}

/// One request the scripted BMC received.
#[derive(Debug, Clone)]
pub struct Logged {
    /// When its request arrived, in seconds since the Unix epoch.
    pub at: f64,
    /// `GET`, or the reset type POSTed.
    pub what: String,
}

impl ScriptedBmc {
    /// Starts it on a free loopback port.
    pub async fn start(script: Script) -> ScriptedBmc {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let scheme = if script.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let state = Arc::new(State {
            script,
            requests: requests.clone(),
            power: Mutex::new("On".into()),
        });
        tokio::spawn(async move {
            // Bounded: a test makes a few dozen requests at most.
            for _ in 0..500 {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    match state.script.tls.clone() {
                        None => state.serve(tcp).await,
                        Some(tls) => {
                            if let Ok(conn) = tokio_rustls::TlsAcceptor::from(tls).accept(tcp).await
                            {
                                state.serve(conn).await
                            }
                        }
                    }
                });
            }
        });
        ScriptedBmc { url, requests }
    }

    /// An inventory entry for this BMC (system 1, user `admin`, its password in a file in
    /// `dir`), trusting the system's store.
    pub fn entry(&self, dir: &std::path::Path) -> crate::redfish::BmcEntry {
        let pw = dir.join("bmc-password");
        std::fs::write(&pw, "x\n").unwrap();
        crate::redfish::BmcEntry {
            url: self.url.clone(),
            system: Some("/redfish/v1/Systems/1".into()),
            username: "admin".into(),
            password_file: Some(pw),
            password_env: None,
            ca: None,
            insecure: false,
        }
    }

    /// The reset types POSTed so far, in order.
    pub fn resets(&self) -> Vec<String> {
        let log = self.requests.lock().unwrap();
        let resets = log.iter().filter(|l| l.what != "GET");
        resets.map(|l| l.what.clone()).collect()
    }

    /// Every request so far, in order: reads as `GET`, resets by their type.
    pub fn requests(&self) -> Vec<Logged> {
        self.requests.lock().unwrap().clone()
    }
}

struct State {
    script: Script,
    requests: Arc<Mutex<Vec<Logged>>>,
    power: Mutex<String>,
}

impl State {
    /// Answers one request on `conn` and closes it.
    async fn serve<S: AsyncRead + AsyncWrite + Unpin>(self: Arc<Self>, mut conn: S) {
        let Some(request) = read_request(&mut conn).await else {
            return;
        };
        let reading = !request.starts_with("POST");
        if reading {
            self.log("GET");
        }
        let (status, body) = match self.script.answer {
            Answer::Hang => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                return;
            }
            Answer::Status(status) => (
                status,
                format!("<html>\n<body>\n<h1>{status}</h1>\n<p>firmware says no</p>\n</body>\n</html>\n"),
            ),
            Answer::Normal | Answer::SlowReads(_) if !reading => {
                self.reset(&request);
                ("204 No Content", String::new())
            }
            Answer::Normal => ("200 OK", self.system()),
            Answer::SlowReads(delay) => {
                tokio::time::sleep(delay).await;
                ("200 OK", self.system())
            }
        };
        let reply = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = conn.write_all(reply.as_bytes()).await;
        let _ = conn.shutdown().await;
    }

    fn reset(self: &Arc<Self>, request: &str) {
        let reset = [
            "ForceOff",
            "On",
            "ForceRestart",
            "PowerCycle",
            "GracefulRestart",
        ]
        .into_iter()
        .find(|r| request.contains(&format!("\"{r}\"")))
        .unwrap_or("?");
        self.log(reset);
        let next = if reset == "ForceOff" { "Off" } else { "On" };
        let state = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            *state.power.lock().unwrap() = next.to_string();
        });
    }

    fn log(&self, what: &str) {
        let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let at = at.unwrap_or_default().as_secs_f64();
        let what = what.to_string();
        self.requests.lock().unwrap().push(Logged { at, what });
    }

    fn system(&self) -> String {
        serde_json::json!({
            "PowerState": *self.power.lock().unwrap(),
            "Actions": {"#ComputerSystem.Reset": {
                "target": "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset",
                "ResetType@Redfish.AllowableValues": self.script.allowed,
            }},
        })
        .to_string()
    }
}

/// Reads one HTTP/1.1 request (head and `content-length` body), at most 16 KiB.
async fn read_request<S: AsyncRead + Unpin>(conn: &mut S) -> Option<String> {
    let mut buf = vec![0u8; 16 << 10];
    let mut n = 0;
    loop {
        let k = conn.read(&mut buf[n..]).await.ok()?;
        if k == 0 {
            return None;
        }
        n += k;
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        if let Some(head_end) = text.find("\r\n\r\n") {
            let len = text
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                })
                .unwrap_or(0);
            if n >= head_end + 4 + len {
                return Some(text);
            }
        }
        if n == buf.len() {
            return None;
        }
    }
}

/// TLS certificates in the forms BMCs ship (ECDSA P-256, which every TLS stack loads), as
/// PEM, with the server configurations that present them.
pub struct BmcCerts {
    /// Self-signed with `CA:TRUE` and only a common name, as `openssl req -x509` makes it
    /// (and as most BMCs ship): no subject alternative name, so no name check can pass.
    pub self_signed_pem: String,
    /// Its key.
    pub self_signed_key_pem: String,
    /// A server presenting [`BmcCerts::self_signed_pem`].
    pub self_signed_server: Arc<rustls::ServerConfig>,
    /// A site CA.
    pub ca_pem: String,
    /// A certificate for `127.0.0.1` issued by [`BmcCerts::ca_pem`].
    pub ca_signed_pem: String,
    /// Its key.
    pub ca_signed_key_pem: String,
    /// A server presenting [`BmcCerts::ca_signed_pem`].
    pub ca_signed_server: Arc<rustls::ServerConfig>,
}

impl BmcCerts {
    /// New certificates and keys.
    pub fn generate() -> BmcCerts {
        use rcgen::{CertificateParams, Issuer, KeyPair};
        // The self-signed `CA:TRUE` certificate many BMCs ship, and a site CA.
        let (self_signed, key, _) = self_signed_ca("bmc.example");
        let self_signed_server = server_config(&self_signed, &key);
        let (ca, ca_key, ca_params) = self_signed_ca("site BMC CA");
        let leaf_key = KeyPair::generate().unwrap();
        let leaf_params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let leaf = leaf_params
            .signed_by(&leaf_key, &Issuer::from_params(&ca_params, &ca_key))
            .unwrap();
        BmcCerts {
            self_signed_pem: self_signed.pem(),
            self_signed_key_pem: key.serialize_pem(),
            self_signed_server,
            ca_pem: ca.pem(),
            ca_signed_pem: leaf.pem(),
            ca_signed_key_pem: leaf_key.serialize_pem(),
            ca_signed_server: server_config(&leaf, &leaf_key),
        }
    }
}

/// A self-signed CA certificate named `name`, its key and the parameters it was made from.
fn self_signed_ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair, rcgen::CertificateParams) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let cert = params.self_signed(&key).unwrap();
    (cert, key, params)
}

fn server_config(cert: &rcgen::Certificate, key: &rcgen::KeyPair) -> Arc<rustls::ServerConfig> {
    let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .unwrap(),
    )
}
