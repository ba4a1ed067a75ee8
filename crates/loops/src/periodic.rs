//! Loops that make one pass at a time at a configured rate over a session they keep (the
//! provisioner, the updater), as opposed to the per-machine runner.

use async_trait::async_trait;
use shepherd_bmdb::{Bmdb, Processor, Session, SessionConfig};
use tokio_util::sync::CancellationToken;

use crate::limiter::{Limiter, RateSpec};
use crate::runner::live_session;

/// One pass of a periodic loop.
#[async_trait]
pub(crate) trait Pass: Send + Sync {
    /// What the loop is called in logs.
    const NAME: &'static str;
    /// The processor label of the loop's sessions.
    const PROCESSOR: Processor;
    /// One pass; an error is logged and the next pass tries again.
    async fn pass(&self, session: &Session) -> anyhow::Result<()>;
}

/// Makes passes at `rate` until `cancel`, keeping a session (re-created when it expires) and
/// closing it at the end.
pub(crate) async fn run<P: Pass>(
    p: &P,
    rate: RateSpec,
    db: Bmdb,
    session_config: SessionConfig,
    cancel: CancellationToken,
) {
    let limiter = Limiter::new(rate);
    let session_config = SessionConfig {
        processor: P::PROCESSOR,
        ..session_config
    };
    let mut session: Option<Session> = None;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = limiter.wait() => {}
        }
        let s = match live_session(&db, &session_config, session.take()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "{} cannot start a session", P::NAME);
                continue;
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => { session = Some(s); break }
            r = p.pass(&s) => match r {
                Ok(()) => {}
                Err(e) if bmdb_unavailable(&e) => tracing::warn!(
                    error = %format!("{e:#}"),
                    "{} pass stopped: the BMDB is unavailable; trying again next pass",
                    P::NAME
                ),
                Err(e) => tracing::error!(error = %format!("{e:#}"), "{} pass failed", P::NAME),
            },
        }
        session = Some(s);
    }
    if let Some(s) = session {
        let _ = s.close().await;
    }
}

/// Whether a pass failed because the BMDB is unavailable (down, failing over, this process's
/// session lost): an outage the pass waits out, logged as a warning, not an error of its own.
fn bmdb_unavailable(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<shepherd_bmdb::Error>()
            .is_some_and(|e| e.is_transient())
            || cause
                .downcast_ref::<crate::provisioner::ProvisionerError>()
                .is_some_and(|e| {
                    matches!(e, crate::provisioner::ProvisionerError::BmdbFailed { .. })
                })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unavailable_bmdb_is_told_apart_from_a_failed_pass() {
        let expired = anyhow::Error::from(shepherd_bmdb::Error::SessionExpired);
        assert!(bmdb_unavailable(
            &expired.context("listing recorded machines")
        ));
        let stopped = anyhow::Error::from(crate::provisioner::ProvisionerError::BmdbFailed {
            created: 3,
            error: crate::provider::ProviderError::NotSupported("x"),
        });
        assert!(bmdb_unavailable(&stopped));
        let bad = anyhow::Error::from(shepherd_bmdb::Error::InvalidValue("x".into()));
        assert!(!bmdb_unavailable(&bad));
        assert!(!bmdb_unavailable(&anyhow::anyhow!(
            "provider and BMDB disagree"
        )));
    }
}
