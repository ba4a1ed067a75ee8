//! Fleet statistics gauges (SPEC §12), refreshed periodically from count queries: machines by
//! state, eligibility for the loops, active work and backoffs by process, hardware totals by
//! location. Every process that serves `/metrics` refreshes its own copy; the queries are
//! counts, so a few replicas doing so costs little.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Bmdb, Process, RecoveryThresholds, Retrieval};
use shepherd_proto::bmaas::AgentHardwareReport;
use shepherd_proto::Message;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLabel {
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessLabel {
    process: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LocationLabel {
    location: String,
}

/// Hardware reports read per query while summing.
const REPORT_PAGE: i64 = 1000;

/// The gauges; cheap to clone (they share their values).
#[derive(Debug, Clone, Default)]
pub struct FleetStats {
    machines: Gauge,
    provided: Family<ProviderLabel, Gauge>,
    agent_started: Gauge,
    heartbeating: Gauge,
    stale: Gauge,
    pending_install: Gauge,
    installed: Gauge,
    maintenance: Gauge,
    decommissioned: Gauge,
    eligible: Family<ProcessLabel, Gauge>,
    work: Family<ProcessLabel, Gauge>,
    backoffs: Family<ProcessLabel, Gauge>,
    hw_machines: Family<LocationLabel, Gauge>,
    hw_cores: Family<LocationLabel, Gauge>,
    hw_threads: Family<LocationLabel, Gauge>,
    hw_memory: Family<LocationLabel, Gauge>,
    hw_disk: Family<LocationLabel, Gauge>,
    refreshed: Gauge<f64, std::sync::atomic::AtomicU64>,
    refresh_failures: Gauge<i64, AtomicI64>,
    /// The hardware totals of the last refresh, for the web UI's overview.
    hardware: Arc<Mutex<Arc<HardwareByLocation>>>,
}

/// Hardware totals by location.
pub type HardwareByLocation = BTreeMap<String, HardwareTotals>;

impl FleetStats {
    /// Adds every gauge to `registry` under `shepherd_fleet_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("shepherd_fleet");
        r.register("machines", "Machines in the BMDB", self.machines.clone());
        r.register(
            "machines_provided",
            "Machines with a machine_provided tag, by provider",
            self.provided.clone(),
        );
        r.register(
            "machines_agent_started",
            "Machines whose agent was started",
            self.agent_started.clone(),
        );
        r.register(
            "machines_heartbeating",
            "Machines whose agent heartbeated within the recoverer's silence threshold (--recovery-heartbeat-older-than)",
            self.heartbeating.clone(),
        );
        r.register(
            "machines_stale",
            "Machines whose agent heartbeated, but not within the recoverer's silence threshold",
            self.stale.clone(),
        );
        r.register(
            "machines_pending_install",
            "OS installation requests without a successful report of their generation",
            self.pending_install.clone(),
        );
        r.register(
            "machines_installed",
            "OS installation requests fulfilled successfully",
            self.installed.clone(),
        );
        r.register(
            "machines_maintenance",
            "Machines an operator put in maintenance (no loop claims them)",
            self.maintenance.clone(),
        );
        r.register(
            "machines_decommissioned",
            "Provider ids an operator decommissioned (the provisioner leaves them alone)",
            self.decommissioned.clone(),
        );
        r.register(
            "machines_eligible",
            "Machines a loop could claim now, by process",
            self.eligible.clone(),
        );
        r.register(
            "active_work",
            "Work held now, by process",
            self.work.clone(),
        );
        r.register(
            "active_backoffs",
            "Backoffs not yet expired, by process",
            self.backoffs.clone(),
        );
        r.register(
            "hardware_machines",
            "Machines with a hardware report, by location",
            self.hw_machines.clone(),
        );
        r.register(
            "hardware_cpu_cores",
            "CPU cores reported, by location",
            self.hw_cores.clone(),
        );
        r.register(
            "hardware_cpu_threads",
            "Hardware threads reported, by location",
            self.hw_threads.clone(),
        );
        r.register(
            "hardware_memory_bytes",
            "Memory installed, by location",
            self.hw_memory.clone(),
        );
        r.register(
            "hardware_disk_bytes",
            "Block device capacity, by location",
            self.hw_disk.clone(),
        );
        r.register(
            "stats_refreshed_timestamp_seconds",
            "When these statistics were last refreshed (Unix time)",
            self.refreshed.clone(),
        );
        r.register(
            "stats_refresh_failures",
            "Refreshes that failed in a row (the gauges keep their last values meanwhile)",
            self.refresh_failures.clone(),
        );
    }

    /// The hardware totals by location of the last refresh (empty before the first).
    pub fn hardware(&self) -> Arc<HardwareByLocation> {
        self.hardware.lock().expect("hardware totals lock").clone()
    }

    /// Re-reads every statistic from the database.
    pub async fn refresh(&self, db: &Bmdb, thresholds: RecoveryThresholds) -> Result<()> {
        let (counts, eligible) = db
            .read(move |tx| {
                Box::pin(async move {
                    let counts = tx.fleet_counts(thresholds.stale_after()).await?;
                    let mut eligible = BTreeMap::new();
                    for (provider, _) in &counts.provided {
                        for (process, retrieval) in [
                            (
                                Process::ShepherdAgentStart,
                                Retrieval::AgentStart {
                                    provider: *provider,
                                },
                            ),
                            (
                                Process::ShepherdRecovery,
                                Retrieval::AgentRecovery {
                                    provider: *provider,
                                    thresholds,
                                },
                            ),
                        ] {
                            *eligible.entry(process).or_insert(0) +=
                                tx.count_eligible(process, &retrieval).await?;
                        }
                    }
                    Ok((counts, eligible))
                })
            })
            .await?;
        let hardware = hardware_totals(db).await?;
        // This minute's point of the overview's chart (the first process to refresh in a
        // minute writes it; a failure costs only the point).
        let snapshot = counts.clone();
        if let Err(e) = db
            .transact(move |tx| {
                let snapshot = snapshot.clone();
                Box::pin(async move { tx.record_fleet_snapshot(&snapshot).await })
            })
            .await
        {
            tracing::warn!(error = %e, "could not record the fleet counts' snapshot");
        }

        self.machines.set(counts.machines);
        self.provided.clear();
        for (p, n) in &counts.provided {
            self.provided
                .get_or_create(&ProviderLabel {
                    provider: p.to_string(),
                })
                .set(*n);
        }
        self.agent_started.set(counts.agent_started);
        self.heartbeating.set(counts.heartbeating);
        self.stale.set(counts.stale);
        self.pending_install.set(counts.pending_install);
        self.installed.set(counts.installed);
        self.maintenance.set(counts.maintenance);
        self.decommissioned.set(counts.decommissioned);
        let by_process = |family: &Family<ProcessLabel, Gauge>, values: &[(Process, i64)]| {
            family.clear();
            for (p, n) in values {
                family
                    .get_or_create(&ProcessLabel {
                        process: p.to_string(),
                    })
                    .set(*n);
            }
        };
        by_process(&self.eligible, &eligible.into_iter().collect::<Vec<_>>());
        by_process(&self.work, &counts.work);
        by_process(&self.backoffs, &counts.backoffs);
        for f in [
            &self.hw_machines,
            &self.hw_cores,
            &self.hw_threads,
            &self.hw_memory,
            &self.hw_disk,
        ] {
            f.clear();
        }
        *self.hardware.lock().expect("hardware totals lock") = Arc::new(hardware.clone());
        for (location, t) in hardware {
            let l = LocationLabel { location };
            self.hw_machines.get_or_create(&l).set(t.machines);
            self.hw_cores.get_or_create(&l).set(t.cores);
            self.hw_threads.get_or_create(&l).set(t.threads);
            self.hw_memory.get_or_create(&l).set(t.memory_bytes);
            self.hw_disk.get_or_create(&l).set(t.disk_bytes);
        }
        self.refreshed.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        );
        Ok(())
    }

    /// Refreshes every `interval` until `cancel`; failures are logged and counted, never fatal.
    pub async fn run(
        self,
        db: Bmdb,
        thresholds: RecoveryThresholds,
        interval: Duration,
        cancel: CancellationToken,
    ) {
        loop {
            match self.refresh(&db, thresholds).await {
                Ok(()) => {
                    self.refresh_failures.set(0);
                }
                Err(e) => {
                    self.refresh_failures.inc();
                    tracing::warn!(error = %e, "refreshing fleet statistics failed");
                }
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// Hardware sums of one location.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HardwareTotals {
    /// Machines with a decodable report.
    pub machines: i64,
    /// CPU cores.
    pub cores: i64,
    /// Hardware threads.
    pub threads: i64,
    /// Installed memory.
    pub memory_bytes: i64,
    /// Block device capacity.
    pub disk_bytes: i64,
}

/// Sums the hardware reports by location ("unknown" when the machine has none); undecodable
/// reports are skipped with a warning.
pub async fn hardware_totals(db: &Bmdb) -> Result<HardwareByLocation> {
    let mut totals = HardwareByLocation::new();
    let mut after: Option<Uuid> = None;
    loop {
        let a = after;
        let page = db
            .read(move |tx| Box::pin(async move { tx.hardware_reports(a, REPORT_PAGE).await }))
            .await?;
        let full = page.len() as i64 == REPORT_PAGE;
        for (id, location, raw) in page {
            after = Some(id);
            let report = match AgentHardwareReport::decode(raw.as_slice()) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(machine = %id, error = %e, "undecodable hardware report");
                    continue;
                }
            };
            let Some(node) = report.report else { continue };
            let t = totals
                .entry(location.unwrap_or_else(|| "unknown".into()))
                .or_default();
            t.machines += 1;
            t.cores += node.cpu.iter().map(|c| i64::from(c.cores)).sum::<i64>();
            t.threads += node
                .cpu
                .iter()
                .map(|c| i64::from(c.hardware_threads))
                .sum::<i64>();
            t.memory_bytes += node.memory_installed_bytes;
            t.disk_bytes += node
                .block_device
                .iter()
                .map(|b| b.capacity_bytes)
                .sum::<i64>();
        }
        if !full {
            return Ok(totals);
        }
    }
}
