//! The `AgentCallback` service: decode what the agent sent, hand it to the BMDB's one entry
//! point (`Session::agent_heartbeat`, which authorizes and stores it), and map the outcome to a
//! gRPC answer with the pending installation request.

use std::sync::Arc;

use shepherd_bmdb::{
    AgentHeartbeat, AgentReport, Error as BmdbError, InstallationResult,
    OsInstallationReport as ReportTag,
};
use shepherd_proto::bmaas::{
    os_installation_report, AgentHardwareReport, HeartbeatResponse, OsInstallationReport,
    OsInstallationRequest,
};
use shepherd_proto::raw::agent_callback_server::AgentCallback;
use shepherd_proto::raw::HeartbeatRequest;
use shepherd_proto::{hints, Message};
use tonic::{Request, Response, Status};
use uuid::Uuid;

use crate::heartbeat_writes::{HeartbeatWrites, SHED_WAIT};
use crate::peer::{Authorized, Peer};
use crate::pool::SessionPool;

/// Largest request accepted (a hardware report of a big machine is tens of KiB).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// The same answer for an unknown machine and a wrong key, so callers cannot probe ids.
const UNAUTHENTICATED: &str = "unknown machine or wrong agent key";

/// The answer to an agent whose key is not on record while its machine's takeover is being
/// recorded (the agent heartbeats as soon as it answered the initializer). It tells no more
/// than that a takeover of the machine is under way.
const KEY_PENDING: &str =
    "the agent key is not recorded yet: the machine's takeover is being recorded; retry shortly";

/// How long an agent whose key is about to be recorded is asked to wait: an ending batch
/// commits within a few hundred milliseconds even on a busy BMDB.
const KEY_PENDING_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What a shed heartbeat is told; the agent retries after [`SHED_WAIT`].
const SHED: &str = "too many heartbeats in flight; retry later";

/// Heartbeats held before they are written, as a slow BMDB holds them: a fault the demo and
/// the tests inject through [`crate::LoopbackServer::slow_heartbeats`]; a real server has none.
#[derive(Debug, Clone, Copy)]
pub struct SlowHeartbeats {
    /// The share of heartbeats held.
    pub share: f64,
    /// How long each is held.
    pub delay: std::time::Duration,
    /// Heartbeats arriving after this are not held.
    pub until: tokio::time::Instant,
}

/// Where a service finds the heartbeat fault to inject, if any; shared with its server.
pub type SlowHeartbeatsCell = Arc<std::sync::Mutex<Option<SlowHeartbeats>>>;

/// The agent-facing service.
pub struct BmaasService {
    pool: Arc<SessionPool>,
    writes: Arc<HeartbeatWrites>,
    slow: Option<SlowHeartbeatsCell>,
}

impl BmaasService {
    /// A service writing through `pool`, its heartbeats counted (and shed) by `writes`.
    pub fn new(pool: Arc<SessionPool>, writes: Arc<HeartbeatWrites>) -> Self {
        BmaasService {
            pool,
            writes,
            slow: None,
        }
    }

    /// The same, holding heartbeats as `slow` says (an injected fault).
    pub fn with_slow_heartbeats(mut self, slow: SlowHeartbeatsCell) -> Self {
        self.slow = Some(slow);
        self
    }

    /// How long to hold a heartbeat arriving now: the injected fault, if one is on.
    fn injected_delay(&self) -> Option<std::time::Duration> {
        let slow = (*self
            .slow
            .as_ref()?
            .lock()
            .expect("slow heartbeats poisoned"))?;
        let held = tokio::time::Instant::now() < slow.until && rand::random_bool(slow.share);
        held.then_some(slow.delay)
    }
}

/// A heartbeat the BMDB could not record: the agent is asked to come back after
/// [`SHED_WAIT`], as a shed one is, so that its next attempt falls within the same trouble
/// (`heartbeat_writes::QUIET`).
fn unavailable(e: BmdbError) -> Status {
    tracing::warn!(error = %e, "heartbeat transaction failed");
    hints::unavailable("database unavailable, retry later", SHED_WAIT, false)
}

#[tonic::async_trait]
impl AgentCallback for BmaasService {
    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let key = request
            .extensions()
            .get::<Peer>()
            .and_then(|p| p.key)
            .ok_or_else(|| {
                Status::unauthenticated("client certificate must certify an ed25519 key")
            })?;
        let req = request.into_inner();
        let machine: Uuid = req
            .machine_id
            .parse()
            .map_err(|_| Status::invalid_argument("machine_id is not a UUID"))?;
        // Reports are decoded to validate them and stored as the bytes the agent sent, so
        // fields this build does not know are kept.
        let hardware = match req.hardware_report {
            None => None,
            Some(raw) => {
                AgentHardwareReport::decode(raw.as_slice()).map_err(|e| {
                    Status::invalid_argument(format!("hardware_report does not decode: {e}"))
                })?;
                Some(raw)
            }
        };
        let installation = match req.installation_report {
            None => None,
            Some(raw) => {
                let r = OsInstallationReport::decode(raw.as_slice()).map_err(|e| {
                    Status::invalid_argument(format!("installation_report does not decode: {e}"))
                })?;
                let result = match &r.result {
                    Some(os_installation_report::Result::Success(_)) => InstallationResult::Success,
                    Some(os_installation_report::Result::Error(_)) => InstallationResult::Error,
                    None => {
                        return Err(Status::invalid_argument(
                            "installation_report has neither success nor error",
                        ))
                    }
                };
                Some(ReportTag {
                    generation: r.generation,
                    result,
                    report_raw: raw,
                })
            }
        };
        let arrival = self
            .writes
            .arrive()
            .ok_or_else(|| hints::unavailable(SHED, SHED_WAIT, false))?;
        let report = AgentReport {
            hardware,
            installation,
        };
        if let Some(delay) = self.injected_delay() {
            tokio::time::sleep(delay).await;
        }
        let written = match self.pool.get().await {
            Ok(session) => session.agent_heartbeat(machine, &key, &report).await,
            Err(e) => Err(e),
        };
        let outcome = match written {
            Ok(outcome) => {
                arrival.answered();
                outcome
            }
            Err(e) => {
                arrival.refused();
                return Err(unavailable(e));
            }
        };
        let pending = match outcome {
            AgentHeartbeat::Unauthorized => return Err(Status::unauthenticated(UNAUTHENTICATED)),
            AgentHeartbeat::KeyPending => {
                return Err(hints::unavailable(KEY_PENDING, KEY_PENDING_WAIT, true))
            }
            AgentHeartbeat::Recorded { pending_request } => pending_request,
        };
        let installation_request = pending.and_then(|raw| match OsInstallationRequest::decode(raw.as_slice()) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::error!(%machine, error = %e, "stored installation request does not decode; not sent");
                None
            }
        });
        let mut response = Response::new(HeartbeatResponse {
            installation_request,
        });
        response.extensions_mut().insert(Authorized);
        Ok(response)
    }
}
