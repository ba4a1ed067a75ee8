//! Rolling upgrades from the running binary's side: `run` and `server` re-read the BMDB's
//! schema window every `--schema-check-interval`. While the schema is this binary's, or a newer
//! one that still admits it (additive migrations), they keep working; once a migration no
//! longer admits it, they stop cleanly — held work canceled, sessions closed — and exit with a
//! message naming both versions and what to do. The watch is the task `schema-watch`, run by
//! the one driver of repeating tasks, so a check that fails or panics is shown at `/tasks`.

use std::sync::Mutex;
use std::time::Duration;

use shepherd_bmdb::{Bmdb, Error, SchemaWindow, SCHEMA_VERSION};
use shepherd_tasks::driver;
use shepherd_tasks::{Outcome, TaskHandle, Tasks};
use tokio_util::sync::CancellationToken;

/// The task's name at `/tasks`.
pub const TASK: &str = "schema-watch";

/// Starts [`watch`] in the background as the task [`TASK`] of `tasks`.
pub fn start(
    db: &Bmdb,
    every: Duration,
    cancel: &CancellationToken,
    tasks: &Tasks,
) -> tokio::task::JoinHandle<Result<(), Error>> {
    let task = tasks.task(TASK);
    tokio::spawn(watch(db.clone(), every, cancel.clone(), task))
}

/// Checks the schema every `every` until `cancel`, each check reported to `task`; on a schema
/// that no longer admits this binary, cancels `cancel` (the whole process winds down) and
/// returns why.
async fn watch(
    db: Bmdb,
    every: Duration,
    cancel: CancellationToken,
    task: TaskHandle,
) -> Result<(), Error> {
    let told: Mutex<Option<SchemaWindow>> = Mutex::new(None);
    let refused: Mutex<Option<Error>> = Mutex::new(None);
    let check = || async {
        let window = match db.schema_window().await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the BMDB schema; trying again later");
                let outcome = Outcome::of_bmdb_error(&e);
                return (outcome, format!("could not read the schema: {e}"));
            }
        };
        let summary = format!("schema {}, binary {SCHEMA_VERSION}", window.version);
        match window.check_this_binary() {
            Ok(()) => {
                let mut told = told.lock().unwrap();
                if window.version > SCHEMA_VERSION && *told != Some(window) {
                    tracing::info!(
                        schema = window.version,
                        oldest_compatible = window.oldest_compatible,
                        binary = SCHEMA_VERSION,
                        "running on a newer BMDB schema that still admits this binary"
                    );
                    *told = Some(window);
                }
                (Outcome::Succeeded, summary)
            }
            Err(e) => {
                tracing::error!(error = %e, "stopping: the BMDB schema no longer admits this binary");
                let why = e.to_string();
                *refused.lock().unwrap() = Some(e);
                cancel.cancel();
                (Outcome::Failed, why)
            }
        }
    };
    driver::repeat(&task, &cancel, check, || tokio::time::sleep(every)).await;
    match refused.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
