//! A simulated fleet (design.md §6 "sim"): in-process machines with addresses, host keys and an
//! agent that answers the takeover protocol, reboots, heartbeats written the way the BMaaS
//! server would write them, and knobs to inject failures. Used by `shepherd demo`, benchmarks
//! and multi-replica tests; nothing leaves the process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use rand::Rng;
use shepherd_bmdb::{
    AgentHeartbeat, AgentReport, Bmdb, Lease, Processor, ProviderKind, Session, SessionConfig,
};
use shepherd_proto::agent::{takeover_response, TakeoverInit, TakeoverResponse, TakeoverSuccess};
use shepherd_proto::Message;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use shepherd_agent::heartbeat::{BetweenHeartbeats, HeartbeatFailures};
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::transport::{AgentOutput, AgentRun, Step, Transport, TransportError};
use shepherd_provider::{
    record_new_machine, ApiFailure, Availability, Provider, ProviderError, ProviderMachine,
    Rebooter, Recorded,
};
use shepherd_ssh::SshError;

/// A failure the simulated provider injected.
#[derive(Debug, thiserror::Error)]
#[error("simulated provider error {0}")]
pub struct SimulatedFailure(String);

/// Failure injection and timing of the simulated fleet. Rates are probabilities per attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimKnobs {
    /// An SSH connection is refused.
    pub connect_failure: f64,
    /// The agent answers garbage instead of a TakeoverResponse.
    pub bad_agent: f64,
    /// The agent starts but never heartbeats (until the machine is rebooted and retaken).
    pub silent_agent: f64,
    /// A machine creation fails at the provider.
    pub create_failure: f64,
    /// Time a takeover takes (connect, upload, run), ±50 % jitter.
    pub takeover_time: Duration,
    /// Time a reboot takes.
    pub reboot_time: Duration,
    /// How often running agents heartbeat.
    pub heartbeat_interval: Duration,
    /// The machines exist at the provider already and are ours, as after a restart over a
    /// BMDB that records them: nothing is left to create, every machine is listed as in use.
    pub deployed: bool,
}

/// How often the simulated agents look for heartbeats that are due (at most).
const AGENT_TICK: Duration = Duration::from_millis(250);

/// Simulated heartbeats in flight at once: enough to fill a few group-commit batches.
const AGENTS_AT_ONCE: usize = 4 * shepherd_bmdb::MAX_BATCH;

impl Default for SimKnobs {
    fn default() -> Self {
        SimKnobs {
            connect_failure: 0.0,
            bad_agent: 0.0,
            silent_agent: 0.0,
            create_failure: 0.0,
            takeover_time: Duration::from_millis(50),
            reboot_time: Duration::from_millis(100),
            heartbeat_interval: Duration::from_secs(1),
            deployed: false,
        }
    }
}

impl SimKnobs {
    /// Checks that rates are probabilities and the heartbeat interval is not zero.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.heartbeat_interval.is_zero() {
            return Err(InvalidSetting::new(
                "sim heartbeat interval",
                "must be longer than zero",
            ));
        }
        for (name, rate) in [
            ("sim connect failure rate", self.connect_failure),
            ("sim bad agent rate", self.bad_agent),
            ("sim silent agent rate", self.silent_agent),
            ("sim create failure rate", self.create_failure),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(InvalidSetting::new(
                    name,
                    format!("{rate} is not between 0 and 1"),
                ));
            }
        }
        Ok(())
    }
}

/// What the simulation did, for summaries and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Takeovers attempted.
    pub takeovers: u64,
    /// Takeovers that started an agent.
    pub agents_started: u64,
    /// Injected connection failures.
    pub connect_failures: u64,
    /// Injected garbage answers.
    pub bad_agents: u64,
    /// Agents started that never heartbeat (injected).
    pub silent_agents: u64,
    /// Reboots.
    pub reboots: u64,
    /// Reboots of machines whose agent was running and not silent: what the recoverer must
    /// never do (a healthy machine whose heartbeats the BMDB did not show in time).
    pub healthy_reboots: u64,
    /// Heartbeats written.
    pub heartbeats: u64,
}

struct SimAgent {
    machine_id: Uuid,
    key: Vec<u8>,
    silent: bool,
    /// When this agent heartbeats next: at once when started, then every heartbeat interval,
    /// each agent on its own phase as real agents are.
    next_heartbeat: std::time::Instant,
    /// The real agent's heartbeat loop, when the fleet runs real agents; stops when dropped
    /// (a reboot).
    _task: Option<AgentTask>,
}

/// Aborts an in-process agent when its machine reboots or the fleet goes away.
struct AgentTask(tokio::task::AbortHandle);

impl Drop for AgentTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Where simulated machines' real agents heartbeat to (see [`SimFleet::with_real_agents`]).
#[derive(Debug, Clone)]
pub struct RealAgents {
    /// BMaaS server, `host:port`.
    pub endpoint: String,
    /// DER of the CA that signed the server's certificate.
    pub ca_der: Vec<u8>,
    /// Time between heartbeats.
    pub heartbeat_interval: Duration,
    /// Whether the agents keep their connection between heartbeats.
    pub between_heartbeats: BetweenHeartbeats,
    /// Where the agents count their failed heartbeats (they print nothing).
    pub failures: Arc<shepherd_agent::heartbeat::HeartbeatFailures>,
}

struct SimMachine {
    id: String,
    addr: String,
    used: bool,
    host_key: String,
    agent: Option<SimAgent>,
}

struct State {
    machines: Vec<SimMachine>,
    by_id: HashMap<String, usize>,
    by_addr: HashMap<String, usize>,
    counters: SimCounters,
}

/// The simulated fleet: a provider, a recoverer and a transport in one.
pub struct SimFleet {
    state: Mutex<State>,
    knobs: SimKnobs,
    real_agents: Option<RealAgents>,
    /// The BMDB through which replicas share one view of the fleet (see
    /// [`SimFleet::share_through`]).
    shared: std::sync::OnceLock<Bmdb>,
}

fn fake_host_key() -> String {
    // Shaped like an OpenSSH ed25519 key line; the sim compares it as a string only.
    let mut raw = [0u8; 32];
    rand::fill(&mut raw);
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    format!("ssh-ed25519 SIM{hex}")
}

impl SimFleet {
    /// A fleet of `n` unused machines `sim-00000`… at addresses `10.a.b.c`.
    pub fn new(n: usize, knobs: SimKnobs) -> Result<Self, InvalidSetting> {
        knobs.validate()?;
        if n >= 1 << 24 {
            return Err(InvalidSetting::new(
                "sim machines",
                format!("{n} is more than the simulated 10.0.0.0/8 holds"),
            ));
        }
        let machines: Vec<SimMachine> = (0..n)
            .map(|i| SimMachine {
                id: format!("sim-{i:05}"),
                addr: Self::address_of(i),
                used: knobs.deployed,
                host_key: fake_host_key(),
                agent: None,
            })
            .collect();
        let by_id = machines
            .iter()
            .enumerate()
            .map(|(i, m)| (m.id.clone(), i))
            .collect();
        let by_addr = machines
            .iter()
            .enumerate()
            .map(|(i, m)| (m.addr.clone(), i))
            .collect();
        Ok(SimFleet {
            state: Mutex::new(State {
                machines,
                by_id,
                by_addr,
                counters: SimCounters::default(),
            }),
            knobs,
            real_agents: None,
            shared: std::sync::OnceLock::new(),
        })
    }

    /// The SSH address of the `i`th simulated machine: `10.a.b.c:22`. A provider other than
    /// the simulator (a benchmark's Ironic nodes) names these addresses to reach the
    /// simulated machines through this fleet's transport.
    pub fn address_of(i: usize) -> String {
        format!("10.{}.{}.{}:22", i >> 16, (i >> 8) & 255, i & 255)
    }

    /// The same fleet, but each started agent runs the real agent's heartbeat code in-process
    /// (its own ed25519 key, TLS connection and hardware report) against a real BMaaS server,
    /// instead of writing heartbeats into the BMDB itself. Silent agents start no loop.
    pub fn with_real_agents(self, real: RealAgents) -> Self {
        SimFleet {
            real_agents: Some(real),
            ..self
        }
    }

    /// What happened so far.
    pub fn counters(&self) -> SimCounters {
        self.state.lock().unwrap().counters
    }

    /// Stops every running agent (as if the whole fleet lost power), so in-process agents do
    /// not outlive the server they talk to.
    pub fn stop_agents(&self) {
        let mut s = self.state.lock().unwrap();
        for m in &mut s.machines {
            m.agent = None;
        }
    }

    /// Gives the machine a new host key, as a reinstall would.
    pub fn change_host_key(&self, provider_id: &str) {
        let mut s = self.state.lock().unwrap();
        if let Some(&i) = s.by_id.get(provider_id) {
            s.machines[i].host_key = fake_host_key();
        }
    }

    /// Replicas of `shepherd run --provider sim` are separate processes, each with a fleet of
    /// its own, while the replicas of a real provider share that provider. From now on, this
    /// fleet counts a machine the BMDB records for the simulator as in use, so that every
    /// replica sees the machines the others brought in, as one provider.
    pub fn share_through(&self, db: Bmdb) {
        let _ = self.shared.set(db);
    }

    /// A machine in use is listed as ours but possibly unknown to the BMDB, as a real provider
    /// lists its own devices: one created while the BMDB could not record it (the insert
    /// failed, a database failover) is an orphan that the next pass adopts.
    fn view(m: &SimMachine) -> ProviderMachine {
        ProviderMachine::new(
            m.id.clone(),
            Some(m.addr.clone()),
            if m.used {
                Availability::PossiblyUsed
            } else {
                Availability::KnownUnused
            },
        )
    }

    /// Runs the simulated agents until `cancel`: each running, non-silent agent heartbeats
    /// when it starts and then every heartbeat interval, through the BMaaS server's own entry
    /// point ([`Session::agent_heartbeat`]: the key check and group commit), many at once.
    pub async fn run_agents(self: Arc<Self>, db: Bmdb, cancel: CancellationToken) {
        let config = SessionConfig::new("sim-agents", Processor::Bmsrv);
        let mut session: Option<Session> = None;
        let interval = self.knobs.heartbeat_interval;
        let mut tick = tokio::time::interval(interval.min(AGENT_TICK));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                _ = tick.tick() => {}
            }
            let due: Vec<(Uuid, Vec<u8>)> = {
                let now = std::time::Instant::now();
                let mut s = self.state.lock().unwrap();
                s.machines
                    .iter_mut()
                    .filter_map(|m| m.agent.as_mut())
                    .filter(|a| !a.silent && a.next_heartbeat <= now)
                    .map(|a| {
                        a.next_heartbeat = now + interval;
                        (a.machine_id, a.key.clone())
                    })
                    .collect()
            };
            if due.is_empty() {
                continue;
            }
            let s = match db.live_session(&config, session.take()).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "sim agents cannot start a session");
                    continue;
                }
            };
            let recorded = AtomicU64::new(0);
            let failed = AtomicU64::new(0);
            futures::stream::iter(due)
                .for_each_concurrent(AGENTS_AT_ONCE, |(machine, key)| {
                    let (s, recorded, failed) = (&s, &recorded, &failed);
                    async move {
                        match s
                            .agent_heartbeat(machine, &key, &AgentReport::default())
                            .await
                        {
                            Ok(AgentHeartbeat::Recorded { .. }) => {
                                recorded.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(AgentHeartbeat::Unauthorized | AgentHeartbeat::KeyPending) => {}
                            Err(_) => {
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
                .await;
            let failed = failed.into_inner();
            if failed > 0 {
                tracing::warn!(failed, "sim heartbeats failed");
            }
            self.state.lock().unwrap().counters.heartbeats += recorded.into_inner();
            session = Some(s);
        }
        if let Some(s) = session {
            let _ = s.close().await;
        }
    }

    fn roll(&self, p: f64) -> bool {
        p > 0.0 && rand::rng().random_bool(p)
    }
}

#[async_trait]
impl Provider for SimFleet {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Sim
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        if let Some(db) = self.shared.get() {
            let recorded = db
                .read(|tx| Box::pin(async move { tx.provided_by(ProviderKind::Sim).await }))
                .await
                // The BMDB is this simulated provider's own store: its failure is the API's.
                .map_err(|e| ProviderError::Api(ApiFailure::new(e)))?;
            let mut s = self.state.lock().unwrap();
            for (_, p) in recorded {
                if let Some(&i) = s.by_id.get(&p.provider_id) {
                    s.machines[i].used = true;
                }
            }
        }
        Ok(self
            .state
            .lock()
            .unwrap()
            .machines
            .iter()
            .map(Self::view)
            .collect())
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        let s = self.state.lock().unwrap();
        let i = *s
            .by_id
            .get(id)
            .ok_or_else(|| ProviderError::NotFound(id.into()))?;
        Ok(Self::view(&s.machines[i]))
    }

    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        let id = unused
            .valid_id()
            .ok_or(ProviderError::Incomplete("an id of the unused machine"))?
            .to_string();
        if self.roll(self.knobs.create_failure) {
            return Err(ProviderError::Api(ApiFailure::new(SimulatedFailure(
                format!("creating {id}"),
            ))));
        }
        let view = {
            let mut s = self.state.lock().unwrap();
            let i = *s
                .by_id
                .get(&id)
                .ok_or_else(|| ProviderError::NotFound(id.clone()))?;
            s.machines[i].used = true;
            Self::view(&s.machines[i])
        };
        Ok(record_new_machine(session, ProviderKind::Sim, &view).await?)
    }
}

#[async_trait]
impl Rebooter for SimFleet {
    async fn reboot(&self, lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
        lease.may_start("reset")?;
        let id = machine.required_id()?;
        {
            let mut s = self.state.lock().unwrap();
            let i = *s
                .by_id
                .get(id)
                .ok_or_else(|| ProviderError::NotFound(id.into()))?;
            let healthy = s.machines[i].agent.as_ref().is_some_and(|a| !a.silent);
            s.machines[i].agent = None;
            s.counters.reboots += 1;
            s.counters.healthy_reboots += u64::from(healthy);
        }
        Ok(())
    }

    fn reboot_wait(&self) -> Duration {
        self.knobs.reboot_time
    }
}

#[async_trait]
impl Transport for SimFleet {
    async fn run_agent(&self, run: AgentRun<'_>) -> Result<AgentOutput, TransportError> {
        let jitter = 0.5 + rand::random::<f64>();
        let took = self.knobs.takeover_time.mul_f64(jitter);
        if took > run.timeout {
            tokio::time::sleep(run.timeout).await;
            let after = run.timeout;
            return Err(TransportError::at(
                Step::Run,
                SshError::ExecTimeout {
                    after,
                    killed: true,
                },
            ));
        }
        tokio::time::sleep(took).await;
        let (connect_failure, bad_agent, silent) = (
            self.roll(self.knobs.connect_failure),
            self.roll(self.knobs.bad_agent),
            self.roll(self.knobs.silent_agent),
        );
        let mut s = self.state.lock().unwrap();
        s.counters.takeovers += 1;
        let unreachable = |kind: std::io::ErrorKind| {
            let error = SshError::Connect {
                addr: run.addr.to_string(),
                error: std::io::Error::new(kind, "simulated"),
            };
            TransportError::at(Step::Connect, error)
        };
        let i = *s
            .by_addr
            .get(run.addr)
            .ok_or_else(|| unreachable(std::io::ErrorKind::HostUnreachable))?;
        if connect_failure {
            s.counters.connect_failures += 1;
            return Err(unreachable(std::io::ErrorKind::ConnectionRefused));
        }
        let host_key = s.machines[i].host_key.clone();
        if let Some(pinned) = run.pinned_host_key {
            if pinned != host_key {
                let error = SshError::HostKeyMismatch {
                    pinned: pinned.to_string(),
                    presented: host_key,
                };
                return Err(TransportError::at(Step::Connect, error));
            }
        }
        if bad_agent {
            s.counters.bad_agents += 1;
            return Ok(AgentOutput {
                host_key,
                exit_status: Some(0),
                stdout: b"\xffsimulated garbage".to_vec(),
                stderr: Vec::new(),
            });
        }
        let local = |what: &str, e: &dyn std::fmt::Display| {
            TransportError::Local(format!("sim agent: {what}: {e}"))
        };
        let init =
            TakeoverInit::decode(run.stdin).map_err(|e| local("decoding TakeoverInit", &e))?;
        let machine_id: Uuid = init
            .machine_id
            .parse()
            .map_err(|e| local("machine id", &e))?;
        let (key, task) = match &self.real_agents {
            None => {
                let mut key = vec![0u8; 32];
                rand::fill(key.as_mut_slice());
                (key, None)
            }
            Some(real) => {
                let hardware = sim_hardware(&s.machines[i].id);
                let (public, task) = start_real_agent(real, &init, hardware, silent)
                    .map_err(|e| local("generating a key", &e))?;
                (public, task)
            }
        };
        s.machines[i].agent = Some(SimAgent {
            next_heartbeat: std::time::Instant::now(),
            machine_id,
            key: key.clone(),
            silent,
            _task: task,
        });
        s.counters.agents_started += 1;
        s.counters.silent_agents += u64::from(silent);
        let response = TakeoverResponse {
            result: Some(takeover_response::Result::Success(TakeoverSuccess {
                init_message: Some(init),
                key,
                warning: Vec::new(),
                live_proof: String::new(),
            })),
        };
        Ok(AgentOutput {
            host_key,
            exit_status: Some(0),
            stdout: response.encode_to_vec(),
            stderr: Vec::new(),
        })
    }
}

/// Starts `real`'s agent heartbeat code for a machine taken over with `init` (unless the
/// machine is `silent`): its public key, and the task that heartbeats.
fn start_real_agent(
    real: &RealAgents,
    init: &TakeoverInit,
    hardware: shepherd_proto::bmaas::AgentHardwareReport,
    silent: bool,
) -> Result<(Vec<u8>, Option<AgentTask>), shepherd_agent::identity::IdentityError> {
    let (pkcs8, public) = shepherd_agent::identity::generate()?;
    let config = shepherd_agent::heartbeat::AgentConfig {
        machine_id: init.machine_id.clone(),
        endpoint: real.endpoint.clone(),
        ca_der: real.ca_der.clone(),
        certificate_time: shepherd_agent::clock::CertificateTime::from_takeover(
            init.issued_at_unix_millis,
        ),
        pkcs8,
        heartbeat_interval: real.heartbeat_interval,
        between_heartbeats: real.between_heartbeats,
        reboot_command: "true".into(),
        hardware_report: hardware,
        retry_max: Duration::from_secs(5),
        failures: shepherd_agent::heartbeat::FailureReport::Count(real.failures.clone()),
    };
    let task = (!silent).then(|| {
        let handle = tokio::spawn(async move {
            if let Err(e) = shepherd_agent::heartbeat::run_agent(config, None).await {
                tracing::warn!(error = %e, "sim agent stopped");
            }
        });
        AgentTask(handle.abort_handle())
    });
    Ok((public, task))
}

/// A plausible hardware report for a simulated machine.
fn sim_hardware(id: &str) -> shepherd_proto::bmaas::AgentHardwareReport {
    use shepherd_proto::agent::{cpu, BlockDevice, Cpu, Node};
    shepherd_proto::bmaas::AgentHardwareReport {
        report: Some(Node {
            manufacturer: "Shepherd Sim".into(),
            product: "sim-server".into(),
            serial_number: id.into(),
            memory_installed_bytes: 64 << 30,
            memory_usable_ratio: 0.98,
            cpu: vec![Cpu {
                architecture: Some(cpu::Architecture::X8664(cpu::X8664 {
                    family: 25,
                    model: 1,
                    stepping: 1,
                })),
                cores: 16,
                hardware_threads: 32,
                vendor: "AuthenticAMD".into(),
                model: "Simulated EPYC".into(),
            }],
            block_device: vec![BlockDevice {
                device_model: "SIM NVMe".into(),
                capacity_bytes: 1 << 40,
                protocol: 3,
                ..Default::default()
            }],
            ..Default::default()
        }),
        warning: vec!["simulated machine".into()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_are_checked() {
        let bad = SimKnobs {
            bad_agent: 1.5,
            ..Default::default()
        };
        let err = SimFleet::new(3, bad).err().unwrap().to_string();
        assert!(err.contains("sim bad agent rate"), "{err}");
    }

    #[tokio::test]
    async fn machines_have_distinct_ids_and_addresses() {
        let fleet = SimFleet::new(70_000, SimKnobs::default()).unwrap();
        let list = fleet.list_machines().await.unwrap();
        let ids: std::collections::HashSet<_> = list.iter().map(|m| m.id.clone()).collect();
        let addrs: std::collections::HashSet<_> = list.iter().map(|m| m.addr.clone()).collect();
        assert_eq!((ids.len(), addrs.len()), (70_000, 70_000));
        assert!(list
            .iter()
            .all(|m| m.availability == Availability::KnownUnused));
        assert!(matches!(
            fleet.get_machine("nope").await,
            Err(ProviderError::NotFound(_))
        ));
    }
}
