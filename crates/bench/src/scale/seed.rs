//! A large fleet written straight into a BMDB, fast: machines provided by the simulated
//! provider (`sim-NNNNN`, as `SimFleet` names them) in a spread of lifecycle states, in
//! transactions of a thousand.

use anyhow::Result;
use chrono::Duration as Delta;
use shepherd_bmdb::{Bmdb, Process, Provided, ProviderKind};
use uuid::Uuid;

/// Machines per seeding transaction.
const CHUNK: usize = 1000;

/// Writes `n` machines provided by the simulated provider and nothing more: a backlog for the
/// initializer. Returns their ids in provider-id order.
pub async fn provided(db: &Bmdb, n: usize) -> Result<Vec<Uuid>> {
    write(db, n, false).await
}

/// Writes `n` machines: a tenth only provided, six tenths heartbeating, a tenth stale (last
/// heartbeat an hour ago), a tenth with an agent that never heartbeated, a tenth in backoff.
/// Returns their ids in provider-id order.
pub async fn fleet(db: &Bmdb, n: usize) -> Result<Vec<Uuid>> {
    write(db, n, true).await
}

/// Writes `n` provided machines, in the states of [`fleet`] if `states`, else no more.
async fn write(db: &Bmdb, n: usize, states: bool) -> Result<Vec<Uuid>> {
    let mut ids = Vec::with_capacity(n);
    for start in (0..n).step_by(CHUNK) {
        let end = (start + CHUNK).min(n);
        let chunk = db
            .transact(move |tx| {
                Box::pin(async move {
                    let now = tx.now().await?;
                    let mut ids = Vec::with_capacity(end - start);
                    for i in start..end {
                        let id = tx.create_machine().await?;
                        let mut provided = Provided::new(ProviderKind::Sim, format!("sim-{i:05}"));
                        let addr = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
                        if states {
                            provided.ip_address = Some(addr);
                            provided.location = Some(format!("rack-{}", i % 100));
                        } else {
                            // Exactly what `SimFleet` lists, so the updater has nothing to write.
                            provided.ip_address = Some(format!("{addr}:22"));
                        }
                        tx.set_provided(id, &provided).await?;
                        let key = [(i % 251) as u8 + 1; 32];
                        if !states {
                            ids.push(id);
                            continue;
                        }
                        match i % 10 {
                            0 => {}
                            1..=6 => {
                                tx.set_agent_started(id, &key).await?;
                                tx.set_heartbeat(id).await?;
                            }
                            7 => {
                                tx.set_agent_started(id, &key).await?;
                                tx.set_heartbeat_at(id, now - Delta::hours(1)).await?;
                            }
                            8 => tx.set_agent_started(id, &key).await?,
                            _ => {
                                let until = now + Delta::hours(1);
                                let cause = "ssh: connection refused";
                                tx.set_backoff(id, Process::ShepherdAgentStart, until, 60, cause)
                                    .await?
                            }
                        }
                        ids.push(id);
                    }
                    Ok(ids)
                })
            })
            .await?;
        ids.extend(chunk);
    }
    Ok(ids)
}
