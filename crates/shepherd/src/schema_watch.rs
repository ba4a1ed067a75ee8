//! Rolling upgrades from the running binary's side: `run` and `server` re-read the BMDB's
//! schema window every `--schema-check-interval`. While the schema is this binary's, or a newer
//! one that still admits it (additive migrations), they keep working; once a migration no
//! longer admits it, they stop cleanly — held work canceled, sessions closed — and exit with a
//! message naming both versions and what to do.

use std::time::Duration;

use shepherd_bmdb::{Bmdb, Error, SCHEMA_VERSION};
use tokio_util::sync::CancellationToken;

/// Checks the schema every `every` until `cancel`; on a schema that no longer admits this
/// binary, cancels `cancel` (the whole process winds down) and returns why.
pub async fn watch(db: Bmdb, every: Duration, cancel: CancellationToken) -> Result<(), Error> {
    let mut told = None;
    loop {
        match db.schema_window().await {
            Ok(w) => match w.check_this_binary() {
                Ok(()) if w.version > SCHEMA_VERSION && told != Some(w) => {
                    tracing::info!(
                        schema = w.version,
                        oldest_compatible = w.oldest_compatible,
                        binary = SCHEMA_VERSION,
                        "running on a newer BMDB schema that still admits this binary"
                    );
                    told = Some(w);
                }
                Ok(()) => {}
                Err(e) => {
                    tracing::error!(error = %e, "stopping: the BMDB schema no longer admits this binary");
                    cancel.cancel();
                    return Err(e);
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "could not read the BMDB schema; trying again later")
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
    }
}
