//! What the demo shows: progress bars per lifecycle state while the fleet converges, then a
//! summary table of what the BMDB recorded, what was injected and how heartbeats went.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use shepherd_bmdb::{Bmdb, Process, StatusCounts, WorkEvent};
use shepherd_server::{HeartbeatWrites, Refusal};
use shepherd_sim::{HeartbeatFailures, SimCounters, SimFleet};
use tokio_util::sync::CancellationToken;

/// One progress bar per lifecycle state, or plain lines where stderr is not a terminal.
struct Bars {
    multi: MultiProgress,
    provided: ProgressBar,
    started: ProgressBar,
    heartbeating: ProgressBar,
    status: ProgressBar,
    plain: bool,
    last_plain: Instant,
}

impl Bars {
    fn new(n: u64) -> Self {
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(8));
        let plain = multi.is_hidden();
        let style =
            ProgressStyle::with_template("{prefix:>14} [{bar:40.green/white}] {pos:>6}/{len}")
                .expect("static template")
                .progress_chars("█▉▊▋▌▍▎▏ ");
        let bar = |name: &str| {
            let b = multi.add(ProgressBar::new(n).with_style(style.clone()));
            b.set_prefix(name.to_string());
            b
        };
        let (provided, started, heartbeating) =
            (bar("provided"), bar("agent started"), bar("heartbeating"));
        let status = multi.add(ProgressBar::new_spinner());
        Bars {
            multi,
            provided,
            started,
            heartbeating,
            status,
            plain,
            last_plain: Instant::now(),
        }
    }

    fn update(&mut self, c: &StatusCounts, sim: &SimCounters, elapsed: Duration) {
        self.provided.set_position(c.provided as u64);
        self.started.set_position(c.agent_started as u64);
        self.heartbeating.set_position(c.heartbeating as u64);
        let work: i64 = c.work.iter().map(|(_, n)| n).sum();
        let backoffs: i64 = c.backoffs.iter().map(|(_, n)| n).sum();
        let line = format!(
            "{:>5.1}s  working on {work} · in backoff {backoffs} · takeovers {} · reboots {}",
            elapsed.as_secs_f64(),
            sim.takeovers,
            sim.reboots,
        );
        if self.plain {
            if self.last_plain.elapsed() >= Duration::from_secs(2) {
                self.last_plain = Instant::now();
                eprintln!(
                    "provided {} · agent started {} · heartbeating {} · {line}",
                    c.provided, c.agent_started, c.heartbeating
                );
            }
        } else {
            self.status.set_message(line);
        }
    }

    fn finish(&self) {
        for b in [
            &self.provided,
            &self.started,
            &self.heartbeating,
            &self.status,
        ] {
            b.finish();
        }
        let _ = self.multi.clear();
    }
}

/// Work history counts per (process, event).
pub(super) async fn history_counts(db: &Bmdb) -> Result<BTreeMap<(Process, WorkEvent), u64>> {
    let mut counts = BTreeMap::new();
    let mut after = 0;
    loop {
        let page = db
            .read(move |tx| Box::pin(async move { tx.history_after(after, 10_000).await }))
            .await?;
        let Some(last) = page.last() else { break };
        after = last.id;
        for h in &page {
            *counts.entry((h.process, h.event)).or_default() += 1;
        }
    }
    Ok(counts)
}

/// How the demo's run ended.
pub(super) struct Outcome {
    /// Every agent started and heartbeating.
    pub(super) converged: bool,
    /// Why not, if not: "interrupted" or "timed out".
    pub(super) reason: &'static str,
    /// How long it ran.
    pub(super) elapsed: Duration,
}

/// Shows progress until every one of the fleet's `machines` agents heartbeats, the demo is
/// interrupted or `timeout` (`--timeout`) passes.
pub(super) async fn watch(
    (machines, timeout): (usize, Duration),
    db: &Bmdb,
    fleet: &SimFleet,
    cancel: &CancellationToken,
    started: Instant,
) -> Result<Outcome> {
    let mut bars = Bars::new(machines as u64);
    let n = machines as i64;
    let (converged, reason) = loop {
        let counts = db.status_counts().await?;
        bars.update(&counts, &fleet.counters(), started.elapsed());
        if counts.heartbeating == n && counts.agent_started == n {
            break (true, "");
        }
        if cancel.is_cancelled() {
            break (false, "interrupted");
        }
        if started.elapsed() > timeout {
            break (false, "timed out");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let elapsed = started.elapsed();
    bars.finish();
    Ok(Outcome {
        converged,
        reason,
        elapsed,
    })
}

/// The summary's rows: what the BMDB recorded, what the simulation injected, how the agents'
/// heartbeats went, and the time to converge.
pub(super) async fn summary(
    db: &Bmdb,
    fleet: &SimFleet,
    heartbeat_failures: &HeartbeatFailures,
    writes: &HeartbeatWrites,
    outcome: &Outcome,
) -> Result<Vec<(String, String)>> {
    let counts = db.status_counts().await?;
    let history = history_counts(db).await?;
    let sim = fleet.counters();
    let reports = db
        .read(|tx| {
            Box::pin(async move {
                let mut n = 0;
                for id in tx.machine_ids(None, i64::MAX).await? {
                    n += tx.hardware_report(id).await?.is_some() as u64;
                }
                Ok(n)
            })
        })
        .await?;
    let h = |p, e| history.get(&(p, e)).copied().unwrap_or(0);
    let rows: Vec<(&str, String)> = vec![
        ("machines provided", counts.provided.to_string()),
        ("agents started", counts.agent_started.to_string()),
        ("agents heartbeating", counts.heartbeating.to_string()),
        (
            "takeovers finished",
            h(Process::ShepherdAgentStart, WorkEvent::Finished).to_string(),
        ),
        (
            "takeovers failed (retried)",
            h(Process::ShepherdAgentStart, WorkEvent::Failed).to_string(),
        ),
        (
            "  injected connect failures",
            sim.connect_failures.to_string(),
        ),
        ("  injected garbage answers", sim.bad_agents.to_string()),
        (
            "recoveries (reboots)",
            h(Process::ShepherdRecovery, WorkEvent::Finished).to_string(),
        ),
        ("  injected silent agents", sim.silent_agents.to_string()),
        ("  of healthy machines", sim.healthy_reboots.to_string()),
        (
            "work canceled at shutdown",
            (h(Process::ShepherdAgentStart, WorkEvent::Canceled)
                + h(Process::ShepherdRecovery, WorkEvent::Canceled))
            .to_string(),
        ),
        ("hardware reports stored", reports.to_string()),
        (
            "agent heartbeats failed",
            heartbeat_failures.total().to_string(),
        ),
    ];
    // One row per status the failed heartbeats were answered with; Unavailable (the server
    // could not write) always, since it should be 0.
    let mut by_code = heartbeat_failures.by_code();
    if !by_code
        .iter()
        .any(|(code, _)| *code == tonic::Code::Unavailable)
    {
        by_code.push((tonic::Code::Unavailable, 0));
    }
    let mut rows: Vec<(String, String)> =
        rows.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    rows.extend(
        by_code
            .into_iter()
            .map(|(code, n)| (format!("  answered {code:?}"), n.to_string())),
    );
    rows.push((
        "  no answer (connection failed)".into(),
        heartbeat_failures.no_answer().to_string(),
    ));
    rows.push((
        "heartbeats before the key was recorded".into(),
        heartbeat_failures.key_pending().to_string(),
    ));
    for (row, cause) in [
        ("heartbeats shed by the server", Refusal::Shed),
        ("heartbeats the BMDB refused", Refusal::Database),
    ] {
        rows.push((row.into(), writes.refusals(cause).to_string()));
    }
    rows.push((
        "heartbeats recorded late (over 5 s)".into(),
        writes.late().to_string(),
    ));
    let secs = outcome.elapsed.as_secs_f64();
    let converged_in = if outcome.converged {
        format!("{secs:.1} s")
    } else {
        format!("did not converge: {} after {secs:.1} s", outcome.reason)
    };
    rows.push(("time to converge".into(), converged_in));
    Ok(rows)
}

/// Prints `rows` as a two-column table.
pub(super) fn print_table(rows: Vec<(String, String)>) {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("{:<width$}  value", "summary");
    println!("{:-<width$}  {:-<8}", "", "");
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
}
