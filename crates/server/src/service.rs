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
use shepherd_proto::Message;
use tonic::{Request, Response, Status};
use uuid::Uuid;

use crate::peer::{Authorized, Peer};
use crate::pool::SessionPool;

/// Largest request accepted (a hardware report of a big machine is tens of KiB).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// The same answer for an unknown machine and a wrong key, so callers cannot probe ids.
const UNAUTHENTICATED: &str = "unknown machine or wrong agent key";

/// The agent-facing service.
pub struct BmaasService {
    pool: Arc<SessionPool>,
}

impl BmaasService {
    /// A service writing through `pool`.
    pub fn new(pool: Arc<SessionPool>) -> Self {
        BmaasService { pool }
    }
}

fn unavailable(e: BmdbError) -> Status {
    tracing::warn!(error = %e, "heartbeat transaction failed");
    Status::unavailable("database unavailable, retry later")
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
        let session = self.pool.get().await.map_err(unavailable)?;
        let report = AgentReport {
            hardware,
            installation,
        };
        let pending = match session
            .agent_heartbeat(machine, &key, &report)
            .await
            .map_err(unavailable)?
        {
            AgentHeartbeat::Unauthorized => return Err(Status::unauthenticated(UNAUTHENTICATED)),
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
