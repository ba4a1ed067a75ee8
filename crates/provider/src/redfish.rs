//! Power control through a BMC speaking Redfish (design.md §15): find the system, then
//! `ComputerSystem.Reset` with a reset type that restarts it, else ForceOff then On with the
//! power state confirmed, else a refusal naming what the system allows. HTTP basic auth; TLS
//! trusted as [`crate::bmc_tls`] says. Credentials are never logged.

use crate::causes::reqwest_causes;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::bmc_tls::{BmcTrust, TrustError};
use crate::settings::InvalidSetting;

/// Reset types in order of preference.
const RESTARTS: [&str; 3] = ["ForceRestart", "PowerCycle", "GracefulRestart"];
/// How often the power state is read while waiting for ForceOff or On to take effect.
const POWER_POLL: Duration = Duration::from_millis(500);
/// Largest BMC answer read.
const MAX_BODY_BYTES: usize = 4 << 20;

/// Why a BMC could not be used or did not power-cycle its system. Texts name the BMC by its
/// URL (never its credentials).
#[derive(Debug, thiserror::Error)]
pub enum BmcError {
    /// The inventory entry is wrong, or names a password that is not there.
    #[error(transparent)]
    Entry(#[from] InvalidSetting),
    /// The TLS trust the entry names could not be set up.
    #[error(transparent)]
    Trust(#[from] TrustError),
    /// The HTTP client could not be built.
    #[error("BMC {base}: {cause}")]
    Client {
        /// The BMC.
        base: String,
        /// Why.
        cause: String,
    },
    /// The BMC could not be reached, or its answer was cut off.
    #[error("BMC {base}: {cause}")]
    Unreachable {
        /// The BMC.
        base: String,
        /// Every cause, one line.
        cause: String,
    },
    /// The BMC answered with more than this client reads.
    #[error("BMC {0}: answer larger than {MAX_BODY_BYTES} bytes")]
    TooLarge(String),
    /// The BMC refused the credentials.
    #[error("BMC {base}: {status}: the credentials for user {user:?} were refused")]
    CredentialsRefused {
        /// The BMC.
        base: String,
        /// 401 or 403.
        status: reqwest::StatusCode,
        /// The user name.
        user: String,
    },
    /// The BMC answered a request with an error status.
    #[error("BMC {base}: {path}: {status}: {body}")]
    Status {
        /// The BMC.
        base: String,
        /// The request's path.
        path: String,
        /// The status.
        status: reqwest::StatusCode,
        /// What it said, one bounded line: a Redfish error's messages, else the answer.
        body: String,
        /// How long it asked to be left alone (`Retry-After`, in seconds), if it did.
        retry_after: Option<std::time::Duration>,
    },
    /// The BMC's answer is not the Redfish JSON expected.
    #[error("BMC {base}: {path}: not the Redfish JSON expected: {error}")]
    Undecodable {
        /// The BMC.
        base: String,
        /// The request's path.
        path: String,
        /// What did not decode.
        error: serde_json::Error,
    },
    /// The BMC does not say which system to power-cycle: it lists none, or several and the
    /// inventory names none.
    #[error("BMC {base}: lists {systems} systems, not exactly one; name it with \"System\" in the inventory")]
    WhichSystem {
        /// The BMC.
        base: String,
        /// How many it lists.
        systems: usize,
    },
    /// The system offers no reset that power-cycles it.
    #[error("BMC {base}: {path} allows no reset that power-cycles (none of {RESTARTS:?}, nor ForceOff with On; only {allowed:?})")]
    NoPowerCycle {
        /// The BMC.
        base: String,
        /// The system.
        path: String,
        /// What it allows (empty: it offers no `ComputerSystem.Reset` at all).
        allowed: Vec<String>,
    },
    /// The BMC accepted an insert, and its virtual CD does not show the image: it could not
    /// fetch it (it may distrust the media server's certificate, or not reach it).
    #[error("BMC {base}: {path} accepted the insert, and {seconds} s later does not show the image (Image {image:?}, Inserted {inserted:?}): it may not have fetched it; check that the BMC reaches the media URL and trusts its certificate")]
    NotShown {
        /// The BMC.
        base: String,
        /// The virtual CD.
        path: String,
        /// How long it was read back for.
        seconds: u32,
        /// The image it shows instead.
        image: Option<String>,
        /// What it says of `Inserted`.
        inserted: Option<bool>,
    },
    /// The BMC offers no virtual CD for the system: neither the system nor its managers list
    /// virtual media with a CD or DVD device. A configuration error: asking again will not help.
    #[error("BMC {base}: {path} has no virtual CD (no VirtualMedia device with MediaTypes CD or DVD under the system or its managers)")]
    NoVirtualMedia {
        /// The BMC.
        base: String,
        /// The system.
        path: String,
    },
    /// The virtual CD offers no action to insert or eject media.
    #[error("BMC {base}: {path} offers no {action} action")]
    NoMediaAction {
        /// The BMC.
        base: String,
        /// The virtual media device.
        path: String,
        /// `VirtualMedia.InsertMedia` or `VirtualMedia.EjectMedia`.
        action: &'static str,
    },
    /// The system offers no reset that powers it on or off.
    #[error("BMC {base}: {path} allows no {want} (only {allowed:?})")]
    NoPowerChange {
        /// The BMC.
        base: String,
        /// The system.
        path: String,
        /// `On` or `ForceOff`.
        want: &'static str,
        /// What it allows.
        allowed: Vec<String>,
    },
    /// The system did not reach the power state asked for in time.
    #[error("BMC {base}: {path} still reports power {state:?} {after:?} after asking for {want}")]
    PowerUnchanged {
        /// The BMC.
        base: String,
        /// The system.
        path: String,
        /// What it reports.
        state: String,
        /// What was asked for.
        want: &'static str,
        /// How long it was given.
        after: Duration,
    },
}

/// Where a machine's BMC is and how to log in, as written in a static inventory entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct BmcEntry {
    /// Base URL, e.g. `https://10.0.0.5` (the Redfish root is `/redfish/v1` below it).
    #[serde(rename = "URL")]
    pub url: String,
    /// The system's path (`/redfish/v1/Systems/1`); if absent the BMC must list exactly one.
    pub system: Option<String>,
    /// User name.
    pub username: String,
    /// File holding the password (first line).
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the password.
    pub password_env: Option<String>,
    /// PEM file of the certificate the BMC presents, or of the CA that issued it (default:
    /// the system's trust store); see [`crate::bmc_tls`].
    #[serde(rename = "CA")]
    pub ca: Option<PathBuf>,
    /// Skip TLS certificate verification (BMCs with self-signed certificates).
    #[serde(default)]
    pub insecure: bool,
}

impl BmcEntry {
    /// Checks the entry without contacting the BMC.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let mut url = url::Url::parse(&self.url).map_err(|e| {
            InvalidSetting::new(
                format!("BMC URL {:?}", redact_userinfo(&self.url)),
                e.to_string(),
            )
        })?;
        if !url.username().is_empty() || url.password().is_some() {
            // Never echo the credentials back: they would land in logs and the BMDB.
            let _ = url.set_username("");
            let _ = url.set_password(None);
            return Err(InvalidSetting::new(
                format!("BMC URL {url}"),
                "must not carry credentials (user:password@); give Username and PasswordFile or PasswordEnv",
            ));
        }
        if !matches!(url.scheme(), "http" | "https") {
            return Err(InvalidSetting::new(
                format!("BMC URL {:?}", self.url),
                "must be http(s)",
            ));
        }
        if let Some(system) = &self.system {
            if !system.starts_with('/') {
                return Err(InvalidSetting::new(
                    format!("BMC System {system:?}"),
                    "must be a path starting with / (e.g. /redfish/v1/Systems/1)",
                ));
            }
        }
        if self.insecure && self.ca.is_some() {
            return Err(InvalidSetting::new(
                format!("BMC {}", redact_userinfo(&self.url)),
                "give CA or Insecure, not both",
            ));
        }
        match (&self.password_file, &self.password_env) {
            (Some(_), None) | (None, Some(_)) => Ok(()),
            _ => Err(InvalidSetting::new(
                format!("BMC {}", self.url),
                "give exactly one of PasswordFile and PasswordEnv",
            )),
        }
    }

    /// Checks what the entry names on this host: the password (file or variable) is there and
    /// not empty, and the CA file holds at least one PEM certificate. Run whenever an
    /// inventory is loaded, so a broken entry stops `run` at start-up instead of failing its
    /// machine's first recovery.
    pub fn check_local(&self) -> Result<(), BmcError> {
        if self.password()?.is_empty() {
            return Err(match (&self.password_file, &self.password_env) {
                (Some(path), _) => {
                    InvalidSetting::new(format!("BMC PasswordFile {}", path.display()), "is empty")
                }
                (_, Some(var)) => InvalidSetting::new(format!("BMC PasswordEnv {var}"), "is empty"),
                _ => self.no_password_source(),
            }
            .into());
        }
        self.trust()?;
        Ok(())
    }

    fn no_password_source(&self) -> InvalidSetting {
        InvalidSetting::new(format!("BMC {}", self.url), "no password source")
    }

    /// What the BMC's TLS certificate is checked against.
    fn trust(&self) -> Result<BmcTrust, TrustError> {
        match (&self.ca, self.insecure) {
            (_, true) => Ok(BmcTrust::Anything),
            (Some(ca), false) => BmcTrust::from_ca_file(ca),
            (None, false) => Ok(BmcTrust::System),
        }
    }

    fn password(&self) -> Result<String, InvalidSetting> {
        if let Some(path) = &self.password_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                InvalidSetting::new(
                    format!("BMC password file {}", path.display()),
                    e.to_string(),
                )
            })?;
            return Ok(text.lines().next().unwrap_or_default().to_string());
        }
        if let Some(var) = &self.password_env {
            return std::env::var(var)
                .map_err(|_| InvalidSetting::new(format!("BMC PasswordEnv {var}"), "is not set"));
        }
        Err(self.no_password_source())
    }
}

#[derive(Deserialize)]
pub(crate) struct Collection {
    #[serde(rename = "Members", default)]
    pub(crate) members: Vec<OdataId>,
}

#[derive(Deserialize)]
pub(crate) struct OdataId {
    #[serde(rename = "@odata.id")]
    pub(crate) id: String,
}

#[derive(Deserialize)]
pub(crate) struct ResetAction {
    pub(crate) target: String,
    #[serde(rename = "ResetType@Redfish.AllowableValues", default)]
    pub(crate) allowed: Vec<String>,
}

#[derive(Deserialize, Default)]
pub(crate) struct Actions {
    #[serde(rename = "#ComputerSystem.Reset")]
    pub(crate) reset: Option<ResetAction>,
}

#[derive(Deserialize)]
pub(crate) struct System {
    #[serde(rename = "Actions", default)]
    pub(crate) actions: Actions,
    #[serde(rename = "PowerState", default)]
    pub(crate) power_state: Option<String>,
    #[serde(rename = "Boot", default)]
    pub(crate) boot: Boot,
}

/// What a system's `Boot` shows of its boot mode.
#[derive(Deserialize, Default)]
pub(crate) struct Boot {
    #[serde(rename = "BootSourceOverrideMode")]
    pub(crate) mode: Option<String>,
}

/// A session with one BMC.
pub struct Bmc {
    http: reqwest::Client,
    timeout: Duration,
    base: String,
    entry: BmcEntry,
    password: String,
}

impl std::fmt::Debug for Bmc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bmc")
            .field("url", &self.base)
            .field("username", &self.entry.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A BMC's answer body as one bounded line for a log or a failure cause: runs of white space
/// become one space, and what could still move text (an escape sequence) is escaped.
/// What a Redfish error answer says, one bounded line: the messages of its
/// `@Message.ExtendedInfo` (else its `message`), else the answer as it is.
fn error_line(bytes: &[u8]) -> String {
    let error = serde_json::from_slice::<serde_json::Value>(bytes).ok();
    let error = error.as_ref().map(|v| &v["error"]);
    let extended = error
        .and_then(|e| e["@Message.ExtendedInfo"].as_array())
        .map(|infos| {
            let messages = infos.iter().filter_map(|i| i["Message"].as_str());
            messages.collect::<Vec<_>>().join("; ")
        })
        .filter(|m| !m.is_empty());
    let message = error
        .and_then(|e| e["message"].as_str())
        .map(str::to_string);
    match extended.or(message) {
        Some(said) => body_line(said.as_bytes()),
        None => body_line(bytes),
    }
}

/// Whether a BMC's error `status` will be its answer again, however long one waits: it refused
/// the request as such (400, 404, 405, 406, 415, 422, 501 and every other 4xx), rather than
/// for the moment (408, 409, 425, 429, and 5xx but 501). design.md §21 lists them.
pub fn lasting(status: reqwest::StatusCode) -> bool {
    match status.as_u16() {
        408 | 409 | 425 | 429 => false,
        501 => true,
        code => (400..500).contains(&code),
    }
}

fn body_line(bytes: &[u8]) -> String {
    const MAX_CHARS: usize = 200;
    let text = String::from_utf8_lossy(bytes);
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    shepherd_bmdb::one_line_cut(&line, MAX_CHARS)
}

/// `url` with any `user:password@` removed, for messages about a URL that did not parse.
fn redact_userinfo(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// How to power-cycle a system, given the reset types it allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetPlan {
    /// One reset that restarts the system whatever its state (`ForceRestart`, `PowerCycle`,
    /// `GracefulRestart`, in that order of preference).
    Restart(&'static str),
    /// `ForceOff`, wait until the system reports Off, then `On` and wait until it reports On.
    OffThenOn,
}

/// The plan for a system allowing `allowed` (an empty list allows anything), or `None` when
/// it allows nothing that power-cycles: `On` alone changes nothing on a system that is on.
pub fn plan_reset(allowed: &[String]) -> Option<ResetPlan> {
    if allowed.is_empty() {
        return Some(ResetPlan::Restart(RESTARTS[0]));
    }
    let allows = |t: &str| allowed.iter().any(|a| a == t);
    if let Some(t) = RESTARTS.into_iter().find(|t| allows(t)) {
        return Some(ResetPlan::Restart(t));
    }
    (allows("ForceOff") && allows("On")).then_some(ResetPlan::OffThenOn)
}

impl Bmc {
    /// Prepares a client for `entry` (reads the password and CA, contacts nothing).
    pub fn new(entry: &BmcEntry, timeout: Duration) -> Result<Bmc, BmcError> {
        entry.validate()?;
        let base = entry.url.trim_end_matches('/').to_string();
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout);
        if entry.url.starts_with("https:") {
            builder = builder.use_preconfigured_tls(entry.trust()?.client_config()?);
        }
        let http = builder.build().map_err(|e| BmcError::Client {
            base: base.clone(),
            cause: reqwest_causes(e),
        })?;
        Ok(Bmc {
            http,
            timeout,
            base,
            password: entry.password()?,
            entry: entry.clone(),
        })
    }

    /// The BMC's base URL (no credentials), for messages.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn unreachable(&self, e: reqwest::Error) -> BmcError {
        BmcError::Unreachable {
            base: self.base.clone(),
            cause: reqwest_causes(e),
        }
    }

    pub(crate) async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<Vec<u8>, BmcError> {
        let url = format!("{}{path}", self.base);
        let mut req = self
            .http
            .request(method, &url)
            .basic_auth(&self.entry.username, Some(&self.password))
            .header("Accept", "application/json");
        if let Some(b) = body {
            req = req
                .header("Content-Type", "application/json")
                .body(b.to_string());
        }
        let mut resp = req.send().await.map_err(|e| self.unreachable(e))?;
        let status = resp.status();
        let retry_after = crate::retry_after::retry_after(resp.headers());
        let mut bytes = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.unreachable(e))? {
            if bytes.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(BmcError::TooLarge(self.base.clone()));
            }
            bytes.extend_from_slice(&chunk);
        }
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Err(BmcError::CredentialsRefused {
                base: self.base.clone(),
                status,
                user: self.entry.username.clone(),
            });
        }
        if !status.is_success() {
            return Err(BmcError::Status {
                base: self.base.clone(),
                path: path.to_string(),
                status,
                body: error_line(&bytes),
                retry_after,
            });
        }
        Ok(bytes)
    }

    pub(crate) async fn get<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<T, BmcError> {
        let bytes = self.request(reqwest::Method::GET, path, None).await?;
        serde_json::from_slice(&bytes).map_err(|error| BmcError::Undecodable {
            base: self.base.clone(),
            path: path.to_string(),
            error,
        })
    }

    /// The system's path: the configured one, or the only one the BMC lists.
    pub async fn system_path(&self) -> Result<String, BmcError> {
        if let Some(s) = &self.entry.system {
            return Ok(s.clone());
        }
        let systems: Collection = self.get("/redfish/v1/Systems").await?;
        match systems.members.as_slice() {
            [one] => Ok(one.id.clone()),
            many => Err(BmcError::WhichSystem {
                base: self.base.clone(),
                systems: many.len(),
            }),
        }
    }

    /// The system's power state (`On`, `Off`, …).
    pub async fn power_state(&self) -> Result<Option<String>, BmcError> {
        let path = self.system_path().await?;
        Ok(self.get::<System>(&path).await?.power_state)
    }

    /// Power-cycles the system: a reset type that restarts it, else ForceOff and On with the
    /// power state confirmed after each, else an error naming what the system allows. Returns
    /// what was done.
    pub async fn reset(&self) -> Result<&'static str, BmcError> {
        let path = self.system_path().await?;
        let system: System = self.get(&path).await?;
        let no_power_cycle = |allowed: &[String]| BmcError::NoPowerCycle {
            base: self.base.clone(),
            path: path.clone(),
            allowed: allowed.to_vec(),
        };
        let action = system.actions.reset.ok_or_else(|| no_power_cycle(&[]))?;
        let plan = plan_reset(&action.allowed).ok_or_else(|| no_power_cycle(&action.allowed))?;
        let post = |reset: &'static str| {
            self.request(
                reqwest::Method::POST,
                &action.target,
                Some(serde_json::json!({ "ResetType": reset })),
            )
        };
        match plan {
            ResetPlan::Restart(reset) => {
                post(reset).await?;
                Ok(reset)
            }
            ResetPlan::OffThenOn => {
                post("ForceOff").await?;
                self.wait_for_power(&path, "Off").await?;
                post("On").await?;
                self.wait_for_power(&path, "On").await?;
                Ok("ForceOff, then On")
            }
        }
    }

    /// Polls the system's power state until it is `want`, for at most the request timeout.
    pub(crate) async fn wait_for_power(
        &self,
        path: &str,
        want: &'static str,
    ) -> Result<(), BmcError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let state = self.get::<System>(path).await?.power_state;
            if state.as_deref() == Some(want) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BmcError::PowerUnchanged {
                    base: self.base.clone(),
                    path: path.to_string(),
                    state: state.unwrap_or_else(|| "unknown".into()),
                    want,
                    after: self.timeout,
                });
            }
            tokio::time::sleep(POWER_POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_as_such_lasts_and_a_moments_trouble_does_not() {
        let lasting_ones = [400, 403, 404, 405, 406, 415, 422, 501];
        let passing = [408, 409, 425, 429, 500, 502, 503, 504];
        for (codes, want) in [(&lasting_ones[..], true), (&passing[..], false)] {
            for code in codes {
                let status = reqwest::StatusCode::from_u16(*code).unwrap();
                assert_eq!(lasting(status), want, "{code}");
            }
        }
    }

    #[test]
    fn a_redfish_error_is_told_by_its_messages() {
        let extended = br#"{"error": {"code": "Base.1.8.GeneralError", "message": "A general error has occurred.",
            "@Message.ExtendedInfo": [{"Message": "The property Inserted is unknown."}, {"Message": "Try again."}]}}"#;
        assert_eq!(
            error_line(extended),
            "The property Inserted is unknown.; Try again."
        );
        let plain = br#"{"error": {"code": "x", "message": "Not allowed."}}"#;
        assert_eq!(error_line(plain), "Not allowed.");
        assert_eq!(
            error_line(b"<html>\n<h1>500</h1></html>"),
            "<html> <h1>500</h1></html>"
        );
    }

    #[test]
    fn reset_types_fall_back_in_order() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let restart = |t| Some(ResetPlan::Restart(t));
        assert_eq!(
            plan_reset(&v(&["On", "GracefulRestart", "ForceRestart"])),
            restart("ForceRestart")
        );
        assert_eq!(
            plan_reset(&v(&["On", "GracefulRestart", "PowerCycle"])),
            restart("PowerCycle")
        );
        assert_eq!(
            plan_reset(&v(&["On", "GracefulRestart"])),
            restart("GracefulRestart")
        );
        assert_eq!(
            plan_reset(&v(&["On", "ForceOff"])),
            Some(ResetPlan::OffThenOn)
        );
        assert_eq!(plan_reset(&v(&["On"])), None, "On alone is no power cycle");
        assert_eq!(plan_reset(&v(&["ForceOff"])), None);
        assert_eq!(plan_reset(&[]), restart("ForceRestart"));
    }

    #[test]
    fn entries_need_exactly_one_password_source() {
        let mut e = BmcEntry {
            url: "https://10.0.0.5".into(),
            system: None,
            username: "admin".into(),
            password_file: None,
            password_env: None,
            ca: None,
            insecure: false,
        };
        assert!(e.validate().is_err());
        e.password_env = Some("X".into());
        assert!(e.validate().is_ok());
        e.password_file = Some("/x".into());
        assert!(e.validate().is_err());
        e.password_file = None;
        e.url = "ftp://x".into();
        assert!(e.validate().is_err());
    }

    fn entry(url: &str, password_file: Option<PathBuf>) -> BmcEntry {
        BmcEntry {
            url: url.into(),
            system: Some("/redfish/v1/Systems/1".into()),
            username: "admin".into(),
            password_file,
            password_env: None,
            ca: None,
            insecure: false,
        }
    }

    #[test]
    fn credentials_in_the_url_are_refused_and_never_echoed() {
        let e = entry("https://root:s3cret@bmc.test", Some("/p".into()));
        let text = format!("{:#}", e.validate().unwrap_err());
        assert!(text.contains("must not carry credentials"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        let e = entry("https://root:s3cret@[bad", Some("/p".into()));
        let text = format!("{:#}", e.validate().unwrap_err());
        assert!(!text.contains("s3cret"), "{text}");
    }

    #[tokio::test]
    async fn transport_errors_name_their_cause() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        std::fs::write(&pw, "x\n").unwrap();
        let bmc = Bmc::new(
            &entry(&format!("http://127.0.0.1:{port}"), Some(pw)),
            Duration::from_secs(5),
        )
        .unwrap();
        let text = format!("{:#}", bmc.reset().await.unwrap_err());
        assert!(text.to_lowercase().contains("connection refused"), "{text}");
    }

    #[test]
    fn error_bodies_become_one_bounded_line() {
        let body = format!("<html>\n  <body>\n{}\n</body>", "oops ".repeat(100));
        let line = body_line(body.as_bytes());
        assert!(!line.contains('\n'));
        assert!(line.chars().count() <= 201, "{line}");
        assert!(line.starts_with("<html> <body> oops"), "{line}");
    }

    #[test]
    fn local_settings_are_checked_with_the_setting_named() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        let good_pw = dir.path().join("pw");
        std::fs::write(&good_pw, "secret\n").unwrap();
        let check = |e: BmcEntry| {
            format!(
                "{:#}",
                e.validate()
                    .map_err(BmcError::from)
                    .and_then(|_| e.check_local())
                    .unwrap_err()
            )
        };

        let text = check(entry("https://bmc.test", Some(dir.path().join("missing"))));
        assert!(
            text.contains("BMC password file") && text.contains("missing"),
            "{text}"
        );
        let text = check(entry("https://bmc.test", Some(empty)));
        assert!(
            text.contains("PasswordFile") && text.contains("is empty"),
            "{text}"
        );
        let mut e = entry("https://bmc.test", None);
        e.password_env = Some("SHEPHERD_TEST_SURELY_UNSET_VARIABLE".into());
        let text = check(e);
        assert!(
            text.contains("PasswordEnv SHEPHERD_TEST_SURELY_UNSET_VARIABLE: is not set"),
            "{text}"
        );
        let mut e = entry("https://bmc.test", Some(good_pw.clone()));
        e.ca = Some(garbage);
        let text = check(e);
        assert!(text.contains("holds no PEM certificate"), "{text}");
        let mut e = entry("https://bmc.test", Some(good_pw.clone()));
        e.ca = Some(dir.path().join("no-ca.pem"));
        let text = check(e);
        assert!(
            text.contains("BMC CA") && text.contains("no-ca.pem"),
            "{text}"
        );
        let mut e = entry("https://bmc.test", Some(good_pw.clone()));
        e.system = Some("redfish/v1/Systems/1".into());
        let text = check(e);
        assert!(text.contains("must be a path starting with /"), "{text}");
        assert!(entry("https://bmc.test", Some(good_pw))
            .check_local()
            .is_ok());
    }
}
