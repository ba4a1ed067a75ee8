//! Loops that make one pass at a time at a configured rate over a session they keep (the
//! provisioner, the updater, history retention), as opposed to the per-machine runner. Every
//! pass is reported to the loop's [`TaskHandle`]: its start, its end and how it ended.

use std::panic::AssertUnwindSafe;

use async_trait::async_trait;
use futures::FutureExt;
use shepherd_bmdb::{Bmdb, Processor, Session, SessionConfig};
use tokio_util::sync::CancellationToken;

use crate::limiter::{Limiter, RateSpec};
use shepherd_tasks::{panic_message, Outcome, TaskHandle};

/// One pass of a periodic loop.
#[async_trait]
pub trait Pass: Send + Sync {
    /// The processor label of the loop's sessions.
    const PROCESSOR: Processor;
    /// What a pass did, shown as the task's summary.
    type Report: std::fmt::Display + Send;
    /// Why a pass failed.
    type Error: PassError;
    /// How often passes start.
    fn rate(&self) -> RateSpec;
    /// One pass; an error is reported and the next pass tries again.
    async fn pass(&self, session: &Session) -> Result<Self::Report, Self::Error>;
}

/// Why a pass of a periodic loop failed.
pub trait PassError: std::error::Error + Send + Sync {
    /// Whether the BMDB is unavailable (down, failing over, this process's session lost): an
    /// outage the loop waits out, not a failure of its own.
    fn bmdb_unavailable(&self) -> bool;
}

impl PassError for shepherd_bmdb::Error {
    fn bmdb_unavailable(&self) -> bool {
        self.is_transient()
    }
}

/// Makes passes at `p`'s rate until `cancel`, keeping a session (re-created when it expires,
/// its processor `P::PROCESSOR`) and closing it at the end; each pass is reported to `task`. A
/// failed pass is logged and reported; the next one tries again. So is a pass that panicked
/// (a defect): the task shows failed with the panic's message, and the next pass comes at the
/// loop's rate, so that one bad pass neither ends the loop silently nor spins.
pub async fn run<P: Pass>(
    p: &P,
    db: Bmdb,
    session_config: SessionConfig,
    task: TaskHandle,
    cancel: CancellationToken,
) {
    let limiter = Limiter::new(p.rate());
    let session_config = SessionConfig {
        processor: P::PROCESSOR,
        ..session_config
    };
    let name = task.name();
    let mut session: Option<Session> = None;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = limiter.wait() => {}
        }
        task.started();
        let s = match db.live_session(&session_config, session.take()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "{name} cannot start a session");
                task.ended(Outcome::Waited, format!("no session: {e}"));
                continue;
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => {
                task.ended(Outcome::Waited, "canceled: the process is stopping");
                session = Some(s);
                break;
            }
            r = AssertUnwindSafe(p.pass(&s)).catch_unwind() => match r {
                Err(payload) => {
                    let message = panic_message(&*payload);
                    tracing::error!(panic = %message, "{name} pass panicked; the next pass tries again");
                    task.ended(Outcome::Panicked, message);
                }
                Ok(Ok(report)) => task.ended(Outcome::Succeeded, report.to_string()),
                Ok(Err(e)) if e.bmdb_unavailable() => {
                    tracing::warn!(
                        error = %e,
                        "{name} pass stopped: the BMDB is unavailable; trying again next pass"
                    );
                    task.ended(Outcome::Waited, e.to_string());
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "{name} pass failed");
                    task.ended(Outcome::Failed, e.to_string());
                }
            },
        }
        session = Some(s);
    }
    if let Some(s) = session {
        let _ = s.close().await;
    }
}
