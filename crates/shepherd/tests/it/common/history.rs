//! Assertions over the BMDB work history, and the sessions behind it, shared by the fault
//! tests.

use std::collections::HashMap;

use shepherd_bmdb::{Bmdb, HistoryEntry, Process, WorkEvent};
use uuid::Uuid;

/// Sessions of the process with this pid (sessions carry it in their runtime info).
pub async fn sessions_of(
    db: &Bmdb,
    pid: u32,
) -> Result<std::collections::HashSet<Uuid>, shepherd_bmdb::Error> {
    let pid = format!("pid={pid} ");
    let sessions = db
        .read(|tx| Box::pin(async move { tx.sessions().await }))
        .await?;
    Ok(sessions
        .into_iter()
        .filter(|s| s.runtime_info.contains(&pid))
        .map(|s| s.session_id)
        .collect())
}

/// Every history entry.
pub async fn all(db: &Bmdb) -> Vec<HistoryEntry> {
    shepherd_bmdb::testing::all_history(db).await
}

/// Asserts that no machine was worked on for `process` by two sessions at once (every Started
/// is followed by its end before the next Started), and returns how many times each machine's
/// work finished.
pub fn exclusive_finishes(history: &[HistoryEntry], process: Process) -> HashMap<Uuid, usize> {
    let mut open: HashMap<Uuid, Option<Uuid>> = HashMap::new();
    let mut finished: HashMap<Uuid, usize> = HashMap::new();
    for h in history.iter().filter(|h| h.process == process) {
        match h.event {
            WorkEvent::Started => {
                if let Some(Some(holder)) = open.get(&h.machine_id) {
                    panic!(
                        "machine {} started by session {:?} while session {holder} held it",
                        h.machine_id, h.session_id
                    );
                }
                open.insert(h.machine_id, Some(h.session_id.unwrap_or_default()));
            }
            end => {
                open.insert(h.machine_id, None);
                if end == WorkEvent::Finished {
                    *finished.entry(h.machine_id).or_default() += 1;
                }
            }
        }
    }
    finished
}
