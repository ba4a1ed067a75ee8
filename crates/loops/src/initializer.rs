//! The Initializer (design.md §8): takes over newly provided machines by starting the agent on them
//! and records the agent's key, pinning the machine's SSH host key on first success.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::{
    Backoff, BarePhase, Provided, ProviderStatus, Retrieval, Session, SshHostKey, TagWrites,
    AGENT_KEY_LEN,
};
use shepherd_proto::agent::{takeover_response, TakeoverInit, TakeoverResponse};
use shepherd_proto::Message;
use uuid::Uuid;

use crate::runner::{MachineTask, OnError};
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::transport::{AgentRun, Step, Transport, TransportError};
use shepherd_provider::{look_up, LookupFailed, Provider};

/// Most stderr shown in logs per takeover.
const MAX_LOGGED_STDERR: usize = 2048;

/// Initializer settings (design.md §17 defaults where there are any).
#[derive(Clone)]
pub struct InitializerConfig {
    /// The agent executable uploaded to each machine.
    pub agent: Arc<Vec<u8>>,
    /// Where it goes on the machine (`/root/agent`).
    pub target_path: String,
    /// The BMaaS endpoint agents heartbeat to (required).
    pub bmaas_endpoint: String,
    /// DER of the CA that signs the BMaaS server's certificate, if not a public one.
    pub ca_certificate: Option<Vec<u8>>,
    /// Bound on connect + upload + run (60 s).
    pub exec_timeout: Duration,
    /// Backoff after a failed takeover (5 min → 4 h, ×1.2).
    pub backoff: Backoff,
}

impl std::fmt::Debug for InitializerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InitializerConfig")
            .field("agent_bytes", &self.agent.len())
            .field("target_path", &self.target_path)
            .field("bmaas_endpoint", &self.bmaas_endpoint)
            .field("exec_timeout", &self.exec_timeout)
            .finish_non_exhaustive()
    }
}

impl InitializerConfig {
    /// Upstream's defaults for everything but the agent and the endpoint.
    pub fn new(agent: Vec<u8>, bmaas_endpoint: impl Into<String>) -> Self {
        InitializerConfig {
            agent: Arc::new(agent),
            target_path: "/root/agent".into(),
            bmaas_endpoint: bmaas_endpoint.into(),
            ca_certificate: None,
            exec_timeout: Duration::from_secs(60),
            backoff: Backoff::exponential(
                Duration::from_secs(5 * 60),
                Duration::from_secs(4 * 3600),
                1.2,
            ),
        }
    }

    /// The start-up checks of design.md §8; the message names the bad setting.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.agent.is_empty() {
            return Err(InvalidSetting::new("agent executable", "is empty"));
        }
        if !self.target_path.starts_with('/') {
            return Err(InvalidSetting::new(
                "agent target path",
                format!("{:?} is not an absolute path", self.target_path),
            ));
        }
        if self.bmaas_endpoint.trim().is_empty() {
            return Err(InvalidSetting::new("BMaaS endpoint", "is required"));
        }
        if self.exec_timeout.is_zero() {
            return Err(InvalidSetting::new(
                "SSH exec timeout",
                "must be more than zero",
            ));
        }
        Ok(())
    }
}

/// What was wrong with the agent's answer to a `TakeoverInit`.
#[derive(Debug, thiserror::Error)]
pub enum ResponseError {
    /// The answer does not decode.
    #[error("agent response is not a TakeoverResponse: {0}")]
    Undecodable(shepherd_proto::DecodeError),
    /// The answer says nothing.
    #[error("agent response carries neither success nor error")]
    Empty,
    /// The agent reported an error.
    #[error("agent reported an error: {0}")]
    Reported(String),
    /// The agent echoed another `TakeoverInit` than it was sent.
    #[error("agent echoed a different TakeoverInit than it was sent")]
    WrongEcho,
    /// The agent's key is no ed25519 public key.
    #[error("agent key is {0} bytes, want a {AGENT_KEY_LEN}-byte ed25519 public key")]
    KeyLength(usize),
}

/// The agent ran but did not take the machine over.
#[derive(Debug, thiserror::Error)]
pub struct AgentFailure {
    /// How it exited, if it exited normally.
    pub exit_status: Option<u32>,
    /// What was wrong with its answer.
    pub response: ResponseError,
}

impl std::fmt::Display for AgentFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.exit_status {
            Some(0) | None => write!(f, "{}", self.response),
            Some(status) => write!(f, "agent exited with status {status}: {}", self.response),
        }
    }
}

/// Why a takeover failed; [`Initializer`]'s error policy decides per kind.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverFailure {
    /// The BMDB failed.
    #[error(transparent)]
    Bmdb(shepherd_bmdb::Error),
    /// The finishing commit found another host key pinned for the machine meanwhile (another
    /// takeover pinned it): someone may be in the middle.
    #[error("host key mismatch: {presented} presented, {pinned} pinned meanwhile")]
    HostKeyPinnedMeanwhile {
        /// The key pinned now.
        pinned: String,
        /// The key this takeover saw.
        presented: String,
    },
    /// The machine has no `machine_provided` tag.
    #[error("machine has no provided tag")]
    NotProvided,
    /// The provider could not be asked about the machine.
    #[error(transparent)]
    Lookup(#[from] LookupFailed),
    /// The provider knows the machine but has no address for it yet (still provisioning).
    #[error("the provider has no address for this machine")]
    NoAddress,
    /// The provider is still provisioning the machine (an Ironic deploy in progress): it is
    /// asked again soon, nobody waits for it.
    #[error("the provider is still provisioning this machine")]
    NotReady,
    /// The provider says the machine failed (an Ironic deploy that failed or timed out), with
    /// its cause; an operator must look.
    #[error("the provider says the machine failed: {0}")]
    FailedAtProvider(String),
    /// The machine presented another host key than the pinned one: reinstalled, or someone in
    /// the middle. An operator decides (`shepherd machines forget-host-key`).
    #[error(transparent)]
    HostKeyMismatch(TransportError),
    /// No SSH session could be had (refused, unreachable, timed out): often a machine still
    /// booting.
    #[error(transparent)]
    Unreachable(TransportError),
    /// No SSH session could be had with a bare machine that its BMC just booted (into its
    /// live environment or its installed OS): it is asked again soon, while the bare-metal
    /// loop bounds how long it may take.
    #[error("still booting: {0}")]
    Booting(TransportError),
    /// Uploading or running the agent failed.
    #[error(transparent)]
    Transport(TransportError),
    /// The agent ran, but its answer was no takeover.
    #[error(transparent)]
    Agent(#[from] AgentFailure),
    /// The work's lease ended before a step could start, or cut one off: the machine may be
    /// another replica's now.
    #[error(transparent)]
    LeaseLost(TransportError),
}

impl From<shepherd_bmdb::Error> for TakeoverFailure {
    /// The BMDB's refusal to pin another host key is the machine's, not the BMDB's.
    fn from(e: shepherd_bmdb::Error) -> Self {
        match e {
            shepherd_bmdb::Error::HostKeyPinned { pinned, presented } => {
                TakeoverFailure::HostKeyPinnedMeanwhile { pinned, presented }
            }
            e => TakeoverFailure::Bmdb(e),
        }
    }
}

impl From<TransportError> for TakeoverFailure {
    /// Sorts the transport's failure by what the initializer does next.
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::HostKeyMismatch(_) => TakeoverFailure::HostKeyMismatch(e),
            TransportError::LeaseLost { .. } => TakeoverFailure::LeaseLost(e),
            TransportError::Unreachable(_)
            | TransportError::TimedOut {
                step: shepherd_provider::transport::Step::Connect,
                ..
            } => TakeoverFailure::Unreachable(e),
            e => TakeoverFailure::Transport(e),
        }
    }
}

/// The backoff of a machine the provider has not given an address yet: it is usually being
/// provisioned, so it is asked again soon.
const NO_ADDRESS_BACKOFF: (Duration, Duration) =
    (Duration::from_secs(30), Duration::from_secs(5 * 60));

/// The backoff of a bare machine its BMC booted that does not answer SSH yet: from 5 s, ×1.5,
/// at most a minute (the bare-metal loop gives up on it after its own timeout).
const BOOTING_BACKOFF: (Duration, Duration) = (Duration::from_secs(5), Duration::from_secs(60));

/// How a failed takeover ends, given the configured `backoff`. A BMDB outage is not the
/// machine's fault: the work is released as it is; nor is a provider whose API is
/// unavailable: released, and the worker waits before its next claim. A machine without an address, or still
/// provisioning, is asked again soon; one whose lease ended is fenced (canceled, counted); one presenting another host key than the pinned one
/// (at connect, or pinned meanwhile by another takeover), or failed at its provider, waits
/// the longest backoff (an operator must look); anything else, a BMDB error about the data
/// included, backs off as configured.
pub fn takeover_policy(backoff: Backoff, error: &TakeoverFailure) -> OnError {
    match error {
        TakeoverFailure::LeaseLost(_) => OnError::Fenced,
        TakeoverFailure::Bmdb(e) if e.is_transient() => OnError::Cancel,
        TakeoverFailure::Lookup(l) if l.error.is_unavailable() => OnError::Wait,
        TakeoverFailure::HostKeyMismatch(_)
        | TakeoverFailure::HostKeyPinnedMeanwhile { .. }
        | TakeoverFailure::FailedAtProvider(_) => {
            OnError::Backoff(Backoff::constant(backoff.maximum).with_jitter(backoff.jitter))
        }
        TakeoverFailure::NoAddress | TakeoverFailure::NotReady => OnError::Backoff(
            Backoff::exponential(NO_ADDRESS_BACKOFF.0, NO_ADDRESS_BACKOFF.1, 2.0)
                .with_jitter(backoff.jitter),
        ),
        TakeoverFailure::Booting(_) => OnError::Backoff(
            Backoff::exponential(BOOTING_BACKOFF.0, BOOTING_BACKOFF.1, 1.5)
                .with_jitter(backoff.jitter.max(0.1)),
        ),
        _ => OnError::Backoff(backoff),
    }
}

/// The initializer for one provider.
pub struct Initializer<P: Provider> {
    provider: Arc<P>,
    transport: Arc<dyn Transport>,
    config: InitializerConfig,
}

impl<P: Provider> Initializer<P> {
    /// An initializer; fails if the configuration does not pass [`InitializerConfig::validate`].
    pub fn new(
        provider: Arc<P>,
        transport: Arc<dyn Transport>,
        config: InitializerConfig,
    ) -> Result<Self, InvalidSetting> {
        config.validate()?;
        Ok(Initializer {
            provider,
            transport,
            config,
        })
    }
}

/// Checks the agent's answer: a success that echoes `sent` and carries an ed25519 public key.
pub fn verify_response(sent: &TakeoverInit, stdout: &[u8]) -> Result<Vec<u8>, ResponseError> {
    verify_takeover(sent, stdout).map(|started| started.key)
}

/// What a verified takeover answer says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// The agent's ed25519 public key.
    pub key: Vec<u8>,
    /// The live proof it showed (design.md §21), if any.
    pub live_proof: Option<String>,
}

/// [`verify_response`], with the live proof the agent showed.
pub fn verify_takeover(sent: &TakeoverInit, stdout: &[u8]) -> Result<Started, ResponseError> {
    let response = TakeoverResponse::decode(stdout).map_err(ResponseError::Undecodable)?;
    match response.result {
        None => Err(ResponseError::Empty),
        Some(takeover_response::Result::Error(e)) => Err(ResponseError::Reported(e.message)),
        Some(takeover_response::Result::Success(ok)) => {
            if ok.init_message.as_ref() != Some(sent) {
                return Err(ResponseError::WrongEcho);
            }
            if ok.key.len() != AGENT_KEY_LEN {
                return Err(ResponseError::KeyLength(ok.key.len()));
            }
            for w in &ok.warning {
                tracing::warn!(warning = %w, "agent warning");
            }
            Ok(Started {
                key: ok.key,
                live_proof: Some(ok.live_proof).filter(|p| !p.is_empty()),
            })
        }
    }
}

/// What the BMDB knows of a machine a takeover starts from, read in one transaction.
struct Known {
    provided: Option<Provided>,
    /// Its bare-metal phase, if it came bare.
    bare: Option<BarePhase>,
    /// The host key pinned at an earlier takeover.
    pinned: Option<SshHostKey>,
    /// The work's fencing token (`Tx::claim_generation`), sent in the `TakeoverInit`.
    generation: u64,
}

/// This host's clock in milliseconds since the Unix epoch, for `TakeoverInit`: the agent
/// checks the server certificate's dates against it when its own clock is wrong.
fn unix_millis_now() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn trimmed_stderr(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    match text.char_indices().nth(MAX_LOGGED_STDERR) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

#[async_trait]
impl<P: Provider + 'static> MachineTask for Initializer<P> {
    type Error = TakeoverFailure;

    fn retrieval(&self) -> Retrieval {
        Retrieval::AgentStart {
            provider: self.provider.kind(),
        }
    }

    /// See [`takeover_policy`].
    fn error_policy(&self, error: &TakeoverFailure) -> OnError {
        takeover_policy(self.config.backoff, error)
    }

    /// A bare machine that is still booting.
    fn is_expected(&self, error: &TakeoverFailure) -> bool {
        matches!(error, TakeoverFailure::Booting(_))
    }

    async fn process_machine(
        &self,
        session: &Session,
        machine: Uuid,
    ) -> Result<TagWrites, TakeoverFailure> {
        let known = session
            .read(move |tx| {
                Box::pin(async move {
                    Ok(Known {
                        provided: tx.provided(machine).await?,
                        bare: tx.bare_metal(machine).await?.map(|b| b.phase),
                        pinned: tx.ssh_host_key(machine).await?,
                        generation: tx.claim_generation(machine).await?,
                    })
                })
            })
            .await?;
        let (pinned, generation) = (known.pinned, known.generation);
        let booting = matches!(known.bare, Some(BarePhase::LiveBoot | BarePhase::DiskBoot));
        let provided = known.provided.ok_or(TakeoverFailure::NotProvided)?;
        tracing::Span::current().record("provider_id", provided.provider_id.as_str());
        let at_provider = look_up(&*self.provider, &provided.provider_id).await?;
        if at_provider.failed {
            return Err(TakeoverFailure::FailedAtProvider(
                at_provider
                    .cause
                    .unwrap_or_else(|| "the provider gave no cause".into()),
            ));
        }
        let addr = at_provider
            .addr
            .filter(|a| !a.is_empty())
            .ok_or(TakeoverFailure::NoAddress)?;
        if at_provider.status == Some(ProviderStatus::Provisioning) {
            return Err(TakeoverFailure::NotReady);
        }

        let init = TakeoverInit {
            machine_id: machine.to_string(),
            bmaas_endpoint: self.config.bmaas_endpoint.clone(),
            ca_certificate: self.config.ca_certificate.clone().unwrap_or_default(),
            issued_at_unix_millis: unix_millis_now(),
            claim_generation: generation,
        };
        let stdin = init.encode_to_vec();
        let output = self
            .transport
            .run_agent(AgentRun {
                addr: &addr,
                pinned_host_key: pinned.as_ref().map(|p| p.key.as_str()),
                agent: &self.config.agent,
                target_path: &self.config.target_path,
                stdin: &stdin,
                timeout: self.config.exec_timeout,
                lease: &session.lease(),
            })
            .await
            .map_err(|e| match e {
                // A machine that boots may refuse, reset or drop connections until its sshd
                // is up: any failure to connect is its boot.
                e @ (TransportError::Unreachable(_)
                | TransportError::TimedOut {
                    step: Step::Connect,
                    ..
                }
                | TransportError::Failed {
                    step: Step::Connect,
                    ..
                }) if booting => TakeoverFailure::Booting(e),
                e => TakeoverFailure::from(e),
            })?;
        let stderr = trimmed_stderr(&output.stderr);
        if !stderr.is_empty() {
            tracing::info!(%addr, stderr = %stderr, "agent stderr");
        }
        let started = verify_takeover(&init, &output.stdout).map_err(|response| AgentFailure {
            exit_status: output.exit_status,
            response,
        })?;
        tracing::info!(%addr, live_proof = started.live_proof.is_some(), "agent started");

        // The bare-metal loop installs only through an agent that showed its live boot's
        // proof (design.md §21); the initializer records what it showed.
        let mut tags = TagWrites::none().agent_started(started.key);
        if let Some(proof) = started.live_proof {
            tags = tags.live_proof(proof);
        }
        Ok(match output.host_key {
            // Refused (Error::HostKeyPinned) when another takeover pinned another key.
            host_key if !host_key.is_empty() => tags.pin_ssh_host_key(host_key),
            _ => tags,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shepherd_proto::agent::{TakeoverError, TakeoverSuccess};
    use shepherd_provider::transport::Step;
    use shepherd_provider::ProviderError;
    use shepherd_ssh::SshError;

    fn init() -> TakeoverInit {
        TakeoverInit {
            machine_id: "m".into(),
            bmaas_endpoint: "bmaas:443".into(),
            ca_certificate: vec![1, 2],
            ..Default::default()
        }
    }

    fn success(init: Option<TakeoverInit>, key_len: usize) -> Vec<u8> {
        TakeoverResponse {
            result: Some(takeover_response::Result::Success(TakeoverSuccess {
                init_message: init,
                key: vec![7; key_len],
                warning: vec![],
                live_proof: String::new(),
            })),
        }
        .encode_to_vec()
    }

    #[test]
    fn each_kind_of_takeover_failure_ends_its_own_way() {
        let configured = InitializerConfig::new(vec![1], "e:443").backoff;
        let policy = |e: TakeoverFailure| takeover_policy(configured, &e);
        let outage = shepherd_bmdb::Error::Unavailable {
            target: "db".into(),
            cause: "connection refused".into(),
        };
        assert_eq!(policy(outage.into()), OnError::Cancel);
        assert_eq!(
            policy(shepherd_bmdb::Error::SessionExpired.into()),
            OnError::Cancel
        );
        // A provider that cannot be reached is nobody's fault: released, and the loop waits;
        // a provider that answered about the machine is the machine's.
        let lookup = |error| {
            TakeoverFailure::Lookup(shepherd_provider::LookupFailed {
                provider_id: "node-1".into(),
                error,
            })
        };
        let down = ProviderError::Unavailable("connection refused".into());
        assert_eq!(policy(lookup(down)), OnError::Wait);
        let refused = ProviderError::Api("refused (HTTP 400)".into());
        assert_eq!(policy(lookup(refused)), OnError::Backoff(configured));
        let longest = OnError::Backoff(Backoff::constant(configured.maximum));
        let mismatch = TakeoverFailure::from(TransportError::at(
            Step::Connect,
            SshError::HostKeyMismatch {
                pinned: "a".into(),
                presented: "b".into(),
            },
        ));
        assert!(matches!(mismatch, TakeoverFailure::HostKeyMismatch(_)));
        assert_eq!(policy(mismatch), longest);
        let pinned_meanwhile = TakeoverFailure::from(shepherd_bmdb::Error::HostKeyPinned {
            pinned: "a".into(),
            presented: "b".into(),
        });
        assert!(
            matches!(
                pinned_meanwhile,
                TakeoverFailure::HostKeyPinnedMeanwhile { .. }
            ),
            "{pinned_meanwhile}"
        );
        assert_eq!(policy(pinned_meanwhile), longest);
        // A BMDB error about the data is no reason to wait the longest.
        let unknown = shepherd_bmdb::Error::UnknownName {
            kind: "Process",
            name: "ShepherdFuture".into(),
            known: String::new(),
        };
        assert_eq!(policy(unknown.into()), OnError::Backoff(configured));
        let OnError::Backoff(soon) = policy(TakeoverFailure::NoAddress) else {
            panic!("no address must back off");
        };
        assert!(soon.maximum <= configured.initial, "{soon:?}");
        let refused = TakeoverFailure::from(TransportError::at(
            Step::Connect,
            SshError::Connect {
                addr: "192.0.2.1:22".into(),
                error: std::io::ErrorKind::ConnectionRefused.into(),
            },
        ));
        assert!(
            matches!(refused, TakeoverFailure::Unreachable(_)),
            "{refused}"
        );
        assert_eq!(policy(refused), OnError::Backoff(configured));
        // A bare machine its BMC just booted is asked again within seconds, not minutes.
        let booting = TakeoverFailure::Booting(TransportError::at(
            Step::Connect,
            SshError::Connect {
                addr: "192.0.2.1:22".into(),
                error: std::io::ErrorKind::ConnectionReset.into(),
            },
        ));
        let OnError::Backoff(soon) = policy(booting) else {
            panic!("a booting machine backs off");
        };
        assert!(soon.initial <= Duration::from_secs(5), "{soon:?}");
        assert!(soon.maximum <= Duration::from_secs(60), "{soon:?}");
        let upload = TakeoverFailure::from(TransportError::at(
            Step::Upload,
            SshError::Sftp {
                path: "/root/agent".into(),
                message: "no space".into(),
            },
        ));
        assert!(matches!(upload, TakeoverFailure::Transport(_)), "{upload}");
        assert_eq!(policy(upload), OnError::Backoff(configured));
        let garbled = TakeoverFailure::from(AgentFailure {
            exit_status: Some(1),
            response: ResponseError::Empty,
        });
        assert_eq!(
            garbled.to_string(),
            "agent exited with status 1: agent response carries neither success nor error"
        );
        assert_eq!(policy(garbled), OnError::Backoff(configured));
    }

    #[test]
    fn responses_are_verified() {
        assert_eq!(
            verify_response(&init(), &success(Some(init()), 32)).unwrap(),
            vec![7; 32]
        );
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"garbage\xff\xff".to_vec(), "not a TakeoverResponse"),
            (Vec::new(), "neither success nor error"),
            (
                TakeoverResponse {
                    result: Some(takeover_response::Result::Error(TakeoverError {
                        message: "disk on fire".into(),
                    })),
                }
                .encode_to_vec(),
                "agent reported an error: disk on fire",
            ),
            (success(None, 32), "different TakeoverInit"),
            (
                success(
                    Some(TakeoverInit {
                        machine_id: "other".into(),
                        ..init()
                    }),
                    32,
                ),
                "different TakeoverInit",
            ),
            (success(Some(init()), 31), "31 bytes"),
            (success(Some(init()), 0), "0 bytes"),
        ];
        for (stdout, want) in cases {
            let err = format!("{:#}", verify_response(&init(), &stdout).unwrap_err());
            assert!(err.contains(want), "want {want:?} in {err:?}");
        }
    }

    #[test]
    fn config_is_checked() {
        let ok = InitializerConfig::new(vec![1], "bmaas:443");
        ok.validate().unwrap();
        let cases = [
            (
                InitializerConfig {
                    agent: Arc::new(vec![]),
                    ..ok.clone()
                },
                "agent executable",
            ),
            (
                InitializerConfig {
                    target_path: "agent".into(),
                    ..ok.clone()
                },
                "target path",
            ),
            (
                InitializerConfig {
                    bmaas_endpoint: " ".into(),
                    ..ok.clone()
                },
                "BMaaS endpoint",
            ),
            (
                InitializerConfig {
                    exec_timeout: Duration::ZERO,
                    ..ok.clone()
                },
                "exec timeout",
            ),
        ];
        for (config, want) in cases {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(want), "want {want:?} in {err:?}");
        }
    }

    #[test]
    fn default_backoff_is_upstreams() {
        let b = InitializerConfig::new(vec![1], "x").backoff;
        assert_eq!(
            b,
            Backoff::exponential(Duration::from_secs(300), Duration::from_secs(14400), 1.2)
        );
    }

    #[test]
    fn logged_stderr_is_trimmed_and_bounded() {
        assert_eq!(trimmed_stderr(b"  hi\n"), "hi");
        let long = "é".repeat(5000);
        let t = trimmed_stderr(long.as_bytes());
        assert_eq!(t.chars().count(), MAX_LOGGED_STDERR + 1);
    }
}
