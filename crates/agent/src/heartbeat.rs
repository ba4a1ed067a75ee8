//! Agent mode: heartbeat forever, report hardware once, install when asked.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use shepherd_disks::RootDeviceHints;
use shepherd_proto::bmaas::{
    os_installation_report, os_installation_request, AgentHardwareReport, HeartbeatRequest,
    OsInstallationReport,
};
use shepherd_proto::hints;
use shepherd_proto::shepherd::agent::AgentState;
use shepherd_retry::{Delays, Streak};
use tokio::sync::oneshot::Receiver;

use crate::clock::CertificateTime;
use crate::connection::{AgentClient, HeartbeatError, ServerConnector};
use crate::install::{Attempt, InstallError};
use crate::{hardware, identity, install, state, RunArgs};

/// Default cap on the delay between failed heartbeats.
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(60);

/// Waits between failed heartbeats: from 1 s, doubling, at most `max`, jittered so that a
/// fleet that lost its server does not come back in lockstep.
pub fn retry_delays(max: Duration) -> Delays {
    Delays::new(Duration::from_secs(1), max)
}

/// Where a failed heartbeat is told: the real agent prints one line per failure (its own
/// stderr is the machine's log); agents run in-process by the hundred (the demo, benchmarks)
/// count failures by status code instead, for a summary.
#[derive(Clone, Default)]
pub enum FailureReport {
    /// One line on stderr per failure.
    #[default]
    Print,
    /// Counted into these tallies, shared by many agents.
    Count(std::sync::Arc<HeartbeatFailures>),
}

/// Failed heartbeats of many in-process agents: those the server answered, by gRPC status
/// code, and those that got no answer (the connection failed or the answer was too late).
#[derive(Debug, Default)]
pub struct HeartbeatFailures {
    by_code: std::sync::Mutex<std::collections::HashMap<tonic::Code, u64>>,
    no_answer: AtomicU64,
    /// Heartbeats answered that the agent's key was about to be recorded: no failures.
    key_pending: AtomicU64,
}

impl HeartbeatFailures {
    fn count(&self, error: &HeartbeatError) {
        match error {
            HeartbeatError::Answered(status) => {
                let mut by_code = self.by_code.lock().expect("failure tallies");
                *by_code.entry(status.code()).or_default() += 1;
            }
            HeartbeatError::NoAnswer(_) => {
                self.no_answer.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The failures the server answered so far, by status code (`Unavailable`,
    /// `Unauthenticated` …), in the codes' order.
    pub fn by_code(&self) -> Vec<(tonic::Code, u64)> {
        let by_code = self.by_code.lock().expect("failure tallies");
        let mut counts: Vec<_> = by_code.iter().map(|(c, n)| (*c, *n)).collect();
        counts.sort_by_key(|(code, _)| *code as i32);
        counts
    }

    /// The heartbeats that got no answer so far.
    pub fn no_answer(&self) -> u64 {
        self.no_answer.load(Ordering::Relaxed)
    }

    /// The heartbeats answered that the agent's key was about to be recorded (sent right
    /// after a takeover, before the initializer recorded it); they are no failures.
    pub fn key_pending(&self) -> u64 {
        self.key_pending.load(Ordering::Relaxed)
    }

    /// All failures so far.
    pub fn total(&self) -> u64 {
        self.by_code().iter().map(|(_, n)| n).sum::<u64>() + self.no_answer()
    }
}

/// What an agent does with its connection between heartbeats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BetweenHeartbeats {
    /// Keeps it for the next heartbeat: a server keeps an idle connection for longer (120 s
    /// by default) than agents wait between heartbeats (30 s), so one connection serves them
    /// all.
    #[default]
    Keep,
    /// Closes it after each heartbeat and connects for the next: for a server whose idle
    /// timeout is shorter than the heartbeat interval, which closes every connection unused
    /// before the next heartbeat anyway, while both ends hold its buffers until then.
    Close,
}

/// Everything the heartbeat loop needs; built from the state file by `run`, or directly by
/// an in-process simulation.
#[derive(Clone)]
pub struct AgentConfig {
    /// The machine this agent speaks for.
    pub machine_id: String,
    /// BMaaS server, `host:port`.
    pub endpoint: String,
    /// DER of the CA to trust; empty means web PKI roots.
    pub ca_der: Vec<u8>,
    /// The time the server certificate's dates are checked at (`clock.rs`).
    pub certificate_time: CertificateTime,
    /// The agent's ed25519 private key, PKCS#8 DER.
    pub pkcs8: Vec<u8>,
    /// Time between heartbeats.
    pub heartbeat_interval: Duration,
    /// Whether the connection is kept between heartbeats.
    pub between_heartbeats: BetweenHeartbeats,
    /// Shell command run after a successful installation was reported.
    pub reboot_command: String,
    /// The hardware report sent with the first heartbeat.
    pub hardware_report: AgentHardwareReport,
    /// Cap on the delay between failed heartbeats.
    pub retry_max: Duration,
    /// Where failed heartbeats are told.
    pub failures: FailureReport,
}

/// Runs the agent until killed.
pub async fn run(args: RunArgs) -> ExitCode {
    let result = async {
        let st = state::load(&args.state).map_err(|e| e.to_string())?;
        let init = st.init.clone().ok_or("state has no init message")?;
        let config = AgentConfig {
            machine_id: init.machine_id,
            endpoint: init.bmaas_endpoint,
            ca_der: init.ca_certificate,
            certificate_time: CertificateTime::from_takeover(init.issued_at_unix_millis),
            pkcs8: st.private_key_pkcs8.clone(),
            heartbeat_interval: args.heartbeat_interval,
            between_heartbeats: BetweenHeartbeats::Keep,
            reboot_command: args.reboot_command.clone(),
            hardware_report: hardware::report(),
            retry_max: args.retry_max,
            failures: FailureReport::Print,
        };
        run_agent(config, Some((args.state.clone(), st)))
            .await
            .map_err(|e| e.to_string())
    };
    match result.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shepherd-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Why the agent could not start heartbeating: its settings cannot make a connection. Once
/// it heartbeats, nothing stops it; failures are retried.
#[derive(Debug)]
pub enum AgentError {
    /// Its client certificate could not be made.
    Identity(identity::IdentityError),
    /// The endpoint or the TLS settings are unusable.
    Settings(crate::connection::SettingsError),
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentError::Identity(e) => e.fmt(f),
            AgentError::Settings(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for AgentError {}

/// Heartbeats forever. With `persist`, the highest installed generation is saved to the state
/// file, so a restarted agent does not install the same request again.
pub async fn run_agent(
    mut config: AgentConfig,
    mut persist: Option<(std::path::PathBuf, AgentState)>,
) -> Result<(), AgentError> {
    let cert = identity::client_certificate(&config.pkcs8, &config.machine_id)
        .map_err(AgentError::Identity)?;
    let key = rustls_pki_types::PrivatePkcs8KeyDer::from(config.pkcs8.clone()).into();
    let connector = ServerConnector::checking_dates_at(
        &config.endpoint,
        &config.ca_der,
        cert,
        key,
        config.certificate_time,
    )
    .map_err(AgentError::Settings)?;
    let mut client = AgentClient::new(connector);
    let mut installed_generation = persist
        .as_ref()
        .map(|(_, st)| st.installed_generation)
        .unwrap_or(0);
    // Sent until a heartbeat carrying it succeeds, then dropped: an idle agent holds none.
    let mut hardware_report = Some(std::mem::take(&mut config.hardware_report));
    let mut installation_report: Option<OsInstallationReport> = None;
    // An installation runs beside the heartbeats, so a long download does not make the
    // machine look silent (and get it power-cycled mid-write by the recoverer).
    let mut installing: Option<(i64, Receiver<Attempt>)> = None;
    let mut reboot_after_ack = false;
    // Installations in a row that failed for the image's server, told in each report so
    // that Shepherd waits longer before asking again.
    let mut unavailable_in_a_row = 0u32;
    // Whether the running installation reboots the machine once reported (Shepherd's bare
    // machines are booted from their disk by their BMC instead).
    let mut reboot_when_installed = true;
    let mut failures = Streak::new(retry_delays(config.retry_max));
    loop {
        let request = HeartbeatRequest {
            machine_id: config.machine_id.clone(),
            hardware_report: hardware_report.clone(),
            installation_report: installation_report.clone(),
        };
        let answer = client.heartbeat(request).await;
        if config.between_heartbeats == BetweenHeartbeats::Close {
            client.close();
        }
        let wait = match answer {
            Ok(response) => {
                failures.succeeded();
                hardware_report = None;
                installation_report = None;
                if reboot_after_ack {
                    reboot_after_ack = false;
                    install::reboot(&config.reboot_command).await;
                }
                if let Some(req) = response.installation_request {
                    if req.generation > installed_generation && installing.is_none() {
                        let outcome = match req.r#type {
                            Some(os_installation_request::Type::Image(image)) => {
                                reboot_when_installed = !image.no_reboot;
                                installing = Some((req.generation, install::spawn(image)));
                                Ok(())
                            }
                            Some(os_installation_request::Type::Metropolis(_)) => {
                                Err(InstallError::Unsupported(
                                    "Metropolis installation requests are not supported by this agent",
                                ))
                            }
                            None => Err(InstallError::Unsupported(
                                "installation request names no installation type",
                            )),
                        };
                        if let Err(error) = outcome {
                            installation_report = Some(finish_installation(
                                &mut persist,
                                req.generation,
                                Attempt::failed(error),
                                &mut unavailable_in_a_row,
                            ));
                            installed_generation = req.generation;
                            continue; // report right away
                        }
                    }
                }
                config.heartbeat_interval
            }
            Err(error) => wait_after_failure(&error, &mut failures, &config.failures),
        };
        // Sleep until the next heartbeat, or until a running installation ends: its report
        // goes out at once, and the reboot follows the server's acknowledgement.
        let ended = match installing.as_mut() {
            Some((_, task)) => tokio::select! {
                r = task => Some(r.unwrap_or_else(|_| Attempt::failed(InstallError::NotRun("its thread ended without an outcome".into())))),
                _ = tokio::time::sleep(wait) => None,
            },
            None => {
                tokio::time::sleep(wait).await;
                None
            }
        };
        if let Some(attempt) = ended {
            let (generation, _) = installing.take().expect("an installation was running");
            reboot_after_ack = attempt.outcome.is_ok() && reboot_when_installed;
            installation_report = Some(finish_installation(
                &mut persist,
                generation,
                attempt,
                &mut unavailable_in_a_row,
            ));
            installed_generation = generation;
        }
    }
}

/// How long to wait after a heartbeat that failed with `error`, told as `report` says. A
/// key-pending answer (the key this agent answered its takeover with is about to be recorded)
/// is no failure: the wait is the one the server asked for. A server that refused the
/// heartbeat (shed, or its BMDB failed) says how long to stay away, and that wait replaces the
/// agent's own backoff (gRPC's "server pushback"): the server keeps its trouble going for
/// twice that, so an agent refused at every attempt never looks silent to the recoverer. With
/// no answer, the agent's own schedule, jittered.
fn wait_after_failure(
    error: &HeartbeatError,
    failures: &mut Streak,
    report: &FailureReport,
) -> Duration {
    if let HeartbeatError::Answered(status) = error {
        if hints::key_pending(status) {
            if let FailureReport::Count(tallies) = report {
                tallies.key_pending.fetch_add(1, Ordering::Relaxed);
            }
            let asked = hints::retry_after(status).unwrap_or(Duration::from_secs(1));
            return Delays::new(asked, asked).delay(0);
        }
    }
    let asked = match error {
        HeartbeatError::Answered(status) => hints::retry_after(status),
        HeartbeatError::NoAnswer(_) => None,
    };
    let own = failures.failed();
    let delay = asked.map_or(own, |a| Delays::new(a, a).delay(0));
    match report {
        FailureReport::Print => {
            eprintln!("shepherd-agent: heartbeat failed ({error}); retrying in {delay:?}")
        }
        FailureReport::Count(tallies) => tallies.count(error),
    }
    delay
}

/// Records that `generation` was installed (or failed) so a restarted agent does not install
/// it again, and returns the report for the server.
fn finish_installation(
    persist: &mut Option<(std::path::PathBuf, AgentState)>,
    generation: i64,
    attempt: Attempt,
    unavailable_in_a_row: &mut u32,
) -> OsInstallationReport {
    let Attempt { chosen, outcome } = attempt;
    let unavailable = outcome
        .as_ref()
        .err()
        .is_some_and(InstallError::is_unavailable);
    *unavailable_in_a_row = if unavailable {
        unavailable_in_a_row.saturating_add(1)
    } else {
        0
    };
    if let Some((path, st)) = persist.as_mut() {
        st.installed_generation = generation;
        if let Err(e) = state::save(path, st) {
            eprintln!("shepherd-agent: saving state: {e}");
        }
    }
    let chosen_disk = chosen
        .as_ref()
        .and_then(RootDeviceHints::identifying)
        .map(|hints| hints.to_json())
        .unwrap_or_default();
    OsInstallationReport {
        generation,
        chosen_disk,
        result: Some(match outcome {
            Ok(installed) => {
                os_installation_report::Result::Success(os_installation_report::Success {
                    written_onto: format!(
                        "{} ({} bytes of a {} image)",
                        installed.disk, installed.written, installed.format
                    ),
                    wiped: installed
                        .around
                        .wiped
                        .filter(|w| !w.cleared.is_empty())
                        .map(|w| w.to_string())
                        .unwrap_or_default(),
                    config_drive: installed
                        .around
                        .config_drive
                        .map(|d| d.to_string())
                        .unwrap_or_default(),
                })
            }
            Err(error) => os_installation_report::Result::Error(os_installation_report::Error {
                error: error.to_string(),
                unavailable,
                disk_written: error.disk_written(),
                unavailable_in_a_row: *unavailable_in_a_row,
            }),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However many heartbeats failed before, a refusal's retry-after hint sets the wait,
    /// within half of it and all of it; with no answer the agent's own backoff grows. Before,
    /// the longer of the two was taken, and an agent shed a few times in a row stayed away
    /// for longer than the server kept its trouble going.
    #[test]
    fn a_refusals_hint_replaces_the_agents_own_backoff() {
        let mut failures = Streak::new(retry_delays(Duration::from_secs(60)));
        let report = FailureReport::Count(std::sync::Arc::default());
        let no_answer = || HeartbeatError::NoAnswer("connection refused".into());
        for _ in 0..6 {
            wait_after_failure(&no_answer(), &mut failures, &report);
        }
        let asked = Duration::from_secs(5);
        let shed = HeartbeatError::Answered(hints::unavailable("shed", asked, false));
        for _ in 0..20 {
            let wait = wait_after_failure(&shed, &mut failures, &report);
            assert!(wait >= asked / 2 && wait <= asked, "{wait:?}");
        }
        let wait = wait_after_failure(&no_answer(), &mut failures, &report);
        assert!(wait >= Duration::from_secs(30), "{wait:?}");
    }

    /// An in-process agent whose server is gone counts its failed heartbeats instead of
    /// printing them, as no answer (not as a status the server sent), and keeps retrying.
    #[tokio::test]
    async fn counted_failures_are_tallied_by_code() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = closed.local_addr().expect("address").to_string();
        drop(closed);
        let (pkcs8, _) = identity::generate().expect("key");
        let tallies = std::sync::Arc::new(HeartbeatFailures::default());
        let config = AgentConfig {
            machine_id: "m-1".into(),
            endpoint,
            ca_der: Vec::new(),
            certificate_time: CertificateTime::wall_clock(),
            pkcs8,
            heartbeat_interval: Duration::from_millis(10),
            between_heartbeats: BetweenHeartbeats::Keep,
            reboot_command: "true".into(),
            hardware_report: AgentHardwareReport::default(),
            retry_max: Duration::from_millis(10),
            failures: FailureReport::Count(tallies.clone()),
        };
        let agent = tokio::spawn(run_agent(config, None));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tallies.total() < 2 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agent.abort();
        assert!(tallies.total() >= 2, "retried: {:?}", tallies.by_code());
        assert_eq!(
            tallies.no_answer(),
            tallies.total(),
            "a refused connection is no answer, not the server's: {:?}",
            tallies.by_code()
        );
    }
}
