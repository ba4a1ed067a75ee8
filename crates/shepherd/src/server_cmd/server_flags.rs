//! The flags of `shepherd server`: its listeners and certificates, the limits on what agents
//! and strangers may hold, the operator API with its identity provider and web sign-in.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use shepherd_operator::{api, rate_limit};
use shepherd_server::{dev_certs, ServerLimits};

/// Settings of `shepherd server`.
#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Configuration, migration, schema checks, statistics and background tasks.
    #[command(flatten)]
    pub process: crate::flags::ProcessArgs,
    /// The recoverer's thresholds, so that this server's web UI and gauges call the same
    /// machines stale (and eligible for recovery) as the site's `shepherd run` does.
    #[command(flatten)]
    pub thresholds: crate::flags::ThresholdArgs,
    /// Address agents connect to (port 0 picks a free port; the chosen address is printed).
    #[arg(long, env = "SHEPHERD_SERVER_LISTEN", default_value = "0.0.0.0:4443")]
    pub listen: SocketAddr,
    /// Server certificate chain (PEM).
    #[arg(long, env = "SHEPHERD_SERVER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "SHEPHERD_SERVER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Generate (once) and use a development CA and server certificate in this directory.
    #[arg(long, env = "SHEPHERD_SERVER_DEV_CERTS")]
    pub dev_certs: Option<PathBuf>,
    /// Names (DNS or IP) the development server certificate is valid for, comma-separated.
    #[arg(
        long,
        env = "SHEPHERD_SERVER_DEV_CERT_NAMES",
        value_delimiter = ',',
        default_value = "localhost"
    )]
    pub dev_cert_names: Vec<String>,
    /// Where the debug web UI and `/metrics` are served (plain HTTP: keep it on localhost or
    /// behind a TLS proxy); port 0 picks a free port.
    #[arg(long, env = "SHEPHERD_HTTP_LISTEN", default_value = "127.0.0.1:9465")]
    pub http_listen: SocketAddr,
    /// Where the operator API (`/api/v1`, HTTPS with the server certificate) is served; off
    /// unless given. Port 0 picks a free port.
    #[arg(long, env = "SHEPHERD_API_LISTEN")]
    pub api_listen: Option<SocketAddr>,
    /// Requests per second allowed to one identity and to one peer (an IPv4 address, an IPv6
    /// /64): on the operator API, the sign-in and the pages, `/metrics`.
    #[arg(long, env = "SHEPHERD_API_RATE", default_value_t = 50.0)]
    pub api_rate: f64,
    /// Requests one identity or peer may make at once before `--api-rate` applies.
    #[arg(long, env = "SHEPHERD_API_BURST", default_value_t = 100.0)]
    pub api_burst: f64,
    /// Operator API: the OpenID Connect issuer whose JWT access tokens are accepted besides
    /// local tokens (`https://id.example.com/realms/ops`, exactly as its tokens name it).
    #[arg(long, env = "SHEPHERD_OIDC_ISSUER")]
    pub oidc_issuer: Option<String>,
    /// Operator API: the audience the identity provider's tokens must be for.
    #[arg(long, env = "SHEPHERD_OIDC_AUDIENCE", default_value = "")]
    pub oidc_audience: String,
    /// Operator API: the token claims that hold roles, comma-separated or repeated (`groups`
    /// for people's sign-ins, `scope` for pipelines' client-credentials tokens).
    #[arg(
        long,
        env = "SHEPHERD_OIDC_ROLE_CLAIM",
        value_enum,
        value_delimiter = ',',
        default_value = "groups"
    )]
    pub oidc_role_claim: Vec<api::oidc::RoleClaim>,
    /// Operator API: the clients (the token's `azp` or `client_id`) whose `scope` may carry
    /// roles; needed with `--oidc-role-claim scope`.
    #[arg(long, env = "SHEPHERD_OIDC_SCOPE_CLIENTS", value_delimiter = ',')]
    pub oidc_scope_clients: Vec<String>,
    /// Operator API: a claim value and the role it gives (`shepherd-admins=admin`); repeat
    /// for each. A token gets the highest role of its values; with none, it may do nothing.
    #[arg(long = "oidc-role", env = "SHEPHERD_OIDC_ROLES", value_delimiter = ',', value_parser = api::oidc::parse_role_mapping)]
    pub oidc_roles: Vec<(String, shepherd_bmdb::Role)>,
    /// Operator API: clock allowance for a token's `exp` and `nbf` (at most 5m).
    #[arg(long, env = "SHEPHERD_OIDC_LEEWAY", default_value = "60s", value_parser = crate::flags::duration)]
    pub oidc_leeway: Duration,
    /// Operator API: a CA (PEM) to trust for the identity provider's certificate, besides
    /// the system's.
    #[arg(long, env = "SHEPHERD_OIDC_CA")]
    pub oidc_ca: Option<PathBuf>,
    /// Web UI sign-in: the client id the identity provider knows the web UI by. With it, the
    /// web UI is served on the API listener behind sign-in (authorization code with PKCE),
    /// its machine pages take actions, and `http-listen` serves only `/metrics`.
    #[arg(long, env = "SHEPHERD_WEB_CLIENT_ID")]
    pub web_client_id: Option<String>,
    /// Web UI sign-in: scopes to ask for besides `openid`, comma-separated (those that put
    /// the role claim into the ID token, such as `groups`).
    #[arg(long, env = "SHEPHERD_WEB_SCOPES", value_delimiter = ',')]
    pub web_scopes: Vec<String>,
    /// Web UI sign-in: a file holding the client's secret, if the provider gave it one (a
    /// file, so that the secret is not in the process list).
    #[arg(long, env = "SHEPHERD_WEB_CLIENT_SECRET_FILE")]
    pub web_client_secret_file: Option<PathBuf>,
    /// Web UI sign-in: how long a login at the provider lasts for the web UI (at most 7d):
    /// sign-ins ask the provider for one younger than this (`max_age`).
    #[arg(long, env = "SHEPHERD_WEB_SESSION_LIFETIME", default_value = "8h", value_parser = crate::flags::duration)]
    pub web_session_lifetime: Duration,
    /// Web UI sign-in: how long one sign-in lasts before the browser passes through the
    /// provider again (without a prompt while the person's login there is younger than
    /// web-session-lifetime) and comes back with the role the provider gives now.
    #[arg(long, env = "SHEPHERD_WEB_ROLE_REFRESH", default_value = "5m", value_parser = crate::flags::duration)]
    pub web_role_refresh: Duration,
    /// Web UI sign-in: where browsers reach the API listener (`https://shepherd.example.com:8443`);
    /// the redirect URI to register at the provider is this and `/signin/callback`.
    #[arg(long, env = "SHEPHERD_WEB_URL")]
    pub web_url: Option<String>,
    /// `/metrics` answers only requests with an API credential (a local token, any role),
    /// as Prometheus sends with `authorization: {credentials_file: …}`.
    #[arg(long, env = "SHEPHERD_METRICS_REQUIRE_TOKEN")]
    pub metrics_require_token: bool,
    /// How often web UI pages reload themselves; 0s turns it off.
    #[arg(long, env = "SHEPHERD_WEB_REFRESH", default_value = "5s", value_parser = crate::flags::duration)]
    pub web_refresh: std::time::Duration,
    /// BMDB sessions shared by all requests.
    #[arg(long, env = "SHEPHERD_SERVER_SESSIONS", default_value_t = 4)]
    pub sessions: usize,

    /// A TLS handshake must finish within this.
    #[arg(long, env = "SHEPHERD_SERVER_HANDSHAKE_TIMEOUT", default_value = "5s", value_parser = crate::flags::duration)]
    pub handshake_timeout: Duration,
    /// TLS handshakes in progress, in all.
    #[arg(
        long,
        env = "SHEPHERD_SERVER_MAX_PENDING_HANDSHAKES",
        default_value_t = 1024
    )]
    pub max_pending_handshakes: usize,
    /// TLS handshakes in progress from one peer (an IPv4 address or an IPv6 /64).
    #[arg(
        long,
        env = "SHEPHERD_SERVER_MAX_PENDING_HANDSHAKES_PER_PEER",
        default_value_t = 16
    )]
    pub max_pending_handshakes_per_peer: usize,
    /// Established agent connections, in all (each holds a file descriptor).
    #[arg(
        long,
        env = "SHEPHERD_SERVER_MAX_CONNECTIONS",
        default_value_t = 20_000
    )]
    pub max_connections: usize,
    /// Established connections from one peer (agents behind one NAT share an address).
    #[arg(
        long,
        env = "SHEPHERD_SERVER_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 1024
    )]
    pub max_connections_per_peer: usize,
    /// Agent heartbeats written at once; more are answered Unavailable with a "retry after"
    /// hint instead of queueing (a slow BMDB sheds load; memory stays bounded).
    #[arg(
        long,
        env = "SHEPHERD_SERVER_MAX_HEARTBEATS_IN_FLIGHT",
        default_value_t = 2048
    )]
    pub max_heartbeats_in_flight: usize,
    /// Close a connection that made no request for this long (a few agent heartbeat intervals).
    #[arg(long, env = "SHEPHERD_SERVER_IDLE_TIMEOUT", default_value = "2m", value_parser = crate::flags::duration)]
    pub idle_timeout: Duration,
    /// Close a connection that made no authorized agent request this long after its handshake.
    #[arg(long, env = "SHEPHERD_SERVER_UNAUTHENTICATED_TIMEOUT", default_value = "30s", value_parser = crate::flags::duration)]
    pub unauthenticated_timeout: Duration,
    /// HTTP/2 ping interval on quiet connections.
    #[arg(long, env = "SHEPHERD_SERVER_KEEPALIVE_INTERVAL", default_value = "1m", value_parser = crate::flags::duration)]
    pub keepalive_interval: Duration,
    /// Close a connection whose ping is not answered within this.
    #[arg(long, env = "SHEPHERD_SERVER_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = crate::flags::duration)]
    pub keepalive_timeout: Duration,
}

impl ServerArgs {
    /// The identity provider's verifier, if one is configured; the message names the setting.
    pub fn oidc(&self) -> Result<Option<api::oidc::OidcVerifier>> {
        let Some(issuer) = &self.oidc_issuer else {
            return Ok(None);
        };
        let ca_pem = match &self.oidc_ca {
            Some(path) => {
                Some(std::fs::read(path).with_context(|| format!("oidc-ca: {}", path.display()))?)
            }
            None => None,
        };
        let settings = api::oidc::OidcSettings {
            issuer: issuer.clone(),
            audience: self.oidc_audience.clone(),
            role_claims: self.oidc_role_claim.clone(),
            scope_clients: self.oidc_scope_clients.clone(),
            roles: self.oidc_roles.clone(),
            leeway: self.oidc_leeway,
            ca_pem,
        };
        Ok(Some(api::oidc::OidcVerifier::new(settings)?))
    }

    /// The web UI's sign-in settings, if it is configured; the message names the setting.
    pub(super) fn sign_in_settings(&self) -> Result<Option<api::signin::SignInSettings>> {
        let Some(client_id) = &self.web_client_id else {
            return Ok(None);
        };
        if self.oidc_issuer.is_none() || self.api_listen.is_none() {
            bail!("web-client-id: web sign-in needs oidc-issuer and api-listen too");
        }
        let Some(public_url) = &self.web_url else {
            bail!("web-client-id: give web-url too (where browsers reach api-listen)");
        };
        let client_secret = match &self.web_client_secret_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("web-client-secret-file: {}", path.display()))?;
                Some(text.trim().to_string())
            }
            None => None,
        };
        let settings = api::signin::SignInSettings {
            client_id: client_id.clone(),
            client_secret,
            public_url: public_url.clone(),
            scopes: self.web_scopes.clone(),
            times: api::signin::SignInTimes {
                lifetime: self.web_session_lifetime,
                role_refresh: self.web_role_refresh,
            },
        };
        settings.validate()?;
        Ok(Some(settings))
    }

    /// The server's certificate and key files: as given, or made under `--dev-certs` (whose
    /// CA for the agents is printed).
    pub(super) fn tls_files(&self) -> Result<(PathBuf, PathBuf)> {
        match (&self.tls_cert, &self.tls_key, &self.dev_certs) {
            (Some(cert), Some(key), None) => Ok((cert.clone(), key.clone())),
            (None, None, Some(dir)) => {
                let certs = dev_certs(dir, &self.dev_cert_names)?;
                eprintln!(
                    "shepherd server: development CA for agents: {}",
                    certs.ca_pem.display()
                );
                Ok((certs.cert_pem, certs.key_pem))
            }
            (None, None, None) => bail!("tls-cert and tls-key (or dev-certs) are required"),
            _ => bail!("give either tls-cert and tls-key, or dev-certs"),
        }
    }

    /// What each peer, and each identity on every surface together, may send: `--api-rate`
    /// after `--api-burst`, on both listeners.
    pub(super) fn peer_rate(&self) -> rate_limit::RateSpec {
        rate_limit::RateSpec {
            per_second: self.api_rate,
            burst: self.api_burst,
        }
    }

    /// The connection limits, once the settings that need nothing opened are checked.
    pub(super) fn checked_limits(&self) -> Result<ServerLimits> {
        self.process
            .check_web_listen("http-listen", self.http_listen)?;
        if !(self.api_rate > 0.0 && self.api_burst >= 1.0) {
            bail!("api-rate must be above 0 and api-burst at least 1");
        }
        self.limits()
    }

    /// The connection limits, checked; the message names the setting.
    pub fn limits(&self) -> Result<ServerLimits> {
        let limits = ServerLimits {
            handshake_timeout: self.handshake_timeout,
            max_pending_handshakes: self.max_pending_handshakes,
            max_pending_handshakes_per_peer: self.max_pending_handshakes_per_peer,
            max_connections: self.max_connections,
            max_connections_per_peer: self.max_connections_per_peer,
            idle_timeout: self.idle_timeout,
            unauthenticated_timeout: self.unauthenticated_timeout,
            keepalive_interval: self.keepalive_interval,
            keepalive_timeout: self.keepalive_timeout,
            max_heartbeats_in_flight: self.max_heartbeats_in_flight,
            ..ServerLimits::default()
        };
        limits.validate()?;
        Ok(limits)
    }
}
