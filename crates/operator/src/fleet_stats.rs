//! Fleet statistics gauges (design.md §12), refreshed periodically from count queries: machines by
//! state, eligibility for the loops, active work and backoffs by process, hardware totals by
//! location. Every process that serves `/metrics` refreshes its own copy; the queries are
//! counts, so a few replicas doing so costs little.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Bmdb, Process, ProviderKind, RecoveryThresholds, Retrieval};
use shepherd_proto::bmaas::AgentHardwareReport;
use shepherd_proto::Message;
use shepherd_tasks::{Outcome, TaskHandle};
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
struct PlaceLabel {
    provider: String,
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
    install_failed: Gauge,
    maintenance: Gauge,
    decommissioned: Gauge,
    missing: Gauge,
    eligible: Family<ProcessLabel, Gauge>,
    work: Family<ProcessLabel, Gauge>,
    backoffs: Family<ProcessLabel, Gauge>,
    hw_machines: Family<PlaceLabel, Gauge>,
    hw_cores: Family<PlaceLabel, Gauge>,
    hw_threads: Family<PlaceLabel, Gauge>,
    hw_memory: Family<PlaceLabel, Gauge>,
    hw_disk: Family<PlaceLabel, Gauge>,
    refreshed: Gauge<f64, std::sync::atomic::AtomicU64>,
    refresh_failures: Gauge<i64, AtomicI64>,
    /// The hardware totals of the last refresh, for the web UI's overview.
    hardware: Arc<Mutex<Arc<HardwareByLocation>>>,
    /// The minute (Unix time ÷ 60) of this process's last snapshot write.
    snapshot_minute: Arc<Mutex<Option<i64>>>,
}

/// Hardware totals by provider and location.
pub type HardwareByLocation = BTreeMap<(ProviderKind, String), HardwareTotals>;

/// The processes the per-process gauges always carry (at 0 when idle): the loops' own.
const LOOP_PROCESSES: [Process; 3] = [
    Process::ShepherdAccess,
    Process::ShepherdAgentStart,
    Process::ShepherdRecovery,
];

/// The processes a fleet can be eligible for.
const CLAIMING_PROCESSES: [Process; 2] = [Process::ShepherdAgentStart, Process::ShepherdRecovery];

/// Sets `family` to `values`, every one of `keys` present (0 when `values` lacks it), so a
/// series never vanishes when its count drops to zero.
fn set_all<K: Copy + PartialEq + std::fmt::Display, L>(
    family: &Family<L, Gauge>,
    keys: &[K],
    values: &[(K, i64)],
    label: impl Fn(String) -> L,
) where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    for k in keys {
        let n = values.iter().find(|(v, _)| v == k).map_or(0, |(_, n)| *n);
        family.get_or_create(&label(k.to_string())).set(n);
    }
}

impl FleetStats {
    /// Adds every gauge to `registry` under `shepherd_fleet_*`. Every series with a fixed
    /// label set (providers, processes) exists from the start, at 0, as upstream's did, so
    /// alerts can compare with 0 and notice a missing series; hardware series appear per
    /// location as reports arrive.
    pub fn register(&self, registry: &mut Registry) {
        self.set_fixed_series(&[], &[], &[], &[]);
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
            "OS installation requests without a report of their generation",
            self.pending_install.clone(),
        );
        r.register(
            "machines_installed",
            "OS installation requests with a report of their generation, whatever its result",
            self.installed.clone(),
        );
        r.register(
            "machines_install_failed",
            "Of machines_installed, the requests whose report of their generation is an error",
            self.install_failed.clone(),
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
            "machines_missing",
            "Provided machines their provider no longer lists (status Missing): their work stops until they come back or are decommissioned",
            self.missing.clone(),
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
            "Provided machines with a hardware report, by provider and location",
            self.hw_machines.clone(),
        );
        r.register(
            "hardware_cpu_cores",
            "CPU cores reported, by provider and location",
            self.hw_cores.clone(),
        );
        r.register(
            "hardware_cpu_threads",
            "Hardware threads reported, by provider and location",
            self.hw_threads.clone(),
        );
        r.register(
            "hardware_memory_bytes",
            "Memory installed, by provider and location",
            self.hw_memory.clone(),
        );
        r.register(
            "hardware_disk_bytes",
            "Block device capacity, by provider and location",
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

    /// Sets the gauges whose label sets are fixed: every provider and process present.
    fn set_fixed_series(
        &self,
        provided: &[(ProviderKind, i64)],
        eligible: &[(Process, i64)],
        work: &[(Process, i64)],
        backoffs: &[(Process, i64)],
    ) {
        let provider = |provider| ProviderLabel { provider };
        let process = |process| ProcessLabel { process };
        set_all(&self.provided, ProviderKind::ALL, provided, provider);
        set_all(&self.eligible, &CLAIMING_PROCESSES, eligible, process);
        set_all(&self.work, &LOOP_PROCESSES, work, process);
        set_all(&self.backoffs, &LOOP_PROCESSES, backoffs, process);
    }

    /// The hardware totals by location of the last refresh (empty before the first).
    pub fn hardware(&self) -> Arc<HardwareByLocation> {
        self.hardware.lock().expect("hardware totals lock").clone()
    }

    /// Re-reads every statistic from the database; returns a one-line summary of what it read.
    pub async fn refresh(
        &self,
        db: &Bmdb,
        thresholds: RecoveryThresholds,
    ) -> Result<String, shepherd_bmdb::Error> {
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
        // minute writes it; a failure costs only the point). Refreshes more often than once a
        // minute write only in a minute this process has not written in yet.
        let minute = unix_seconds() as i64 / 60;
        let fresh_minute = {
            let mut last = self.snapshot_minute.lock().expect("snapshot minute lock");
            let fresh = *last != Some(minute);
            *last = Some(minute);
            fresh
        };
        if fresh_minute {
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
        }

        self.machines.set(counts.machines);
        self.agent_started.set(counts.agent_started);
        self.heartbeating.set(counts.heartbeating);
        self.stale.set(counts.stale);
        self.pending_install.set(counts.pending_install);
        self.installed.set(counts.installed);
        self.install_failed.set(counts.install_failed);
        self.maintenance.set(counts.maintenance);
        self.decommissioned.set(counts.decommissioned);
        self.missing.set(counts.missing);
        self.set_fixed_series(
            &counts.provided,
            &eligible.into_iter().collect::<Vec<_>>(),
            &counts.work,
            &counts.backoffs,
        );
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
        for ((provider, location), t) in hardware {
            let l = PlaceLabel {
                provider: provider.to_string(),
                location,
            };
            self.hw_machines.get_or_create(&l).set(t.machines);
            self.hw_cores.get_or_create(&l).set(t.cores);
            self.hw_threads.get_or_create(&l).set(t.threads);
            self.hw_memory.get_or_create(&l).set(t.memory_bytes);
            self.hw_disk.get_or_create(&l).set(t.disk_bytes);
        }
        self.refreshed.set(unix_seconds());
        Ok(format!(
            "{} machines, {} heartbeating, {} stale",
            counts.machines, counts.heartbeating, counts.stale
        ))
    }

    /// Refreshes every `interval` until `cancel`; each refresh is reported to `task`
    /// (`driver::repeat`: a panic is reported and the next refresh comes as usual), and
    /// failures are logged and counted, never fatal.
    pub async fn run(
        self,
        db: Bmdb,
        thresholds: RecoveryThresholds,
        interval: Duration,
        task: TaskHandle,
        cancel: CancellationToken,
    ) {
        let refresh = || async {
            match self.refresh(&db, thresholds).await {
                Ok(summary) => {
                    self.refresh_failures.set(0);
                    (Outcome::Succeeded, summary)
                }
                Err(e) => {
                    self.refresh_failures.inc();
                    tracing::warn!(error = %e, "refreshing fleet statistics failed");
                    (Outcome::of_bmdb_error(&e), e.to_string())
                }
            }
        };
        let pause = || tokio::time::sleep(interval);
        shepherd_tasks::driver::repeat(&task, &cancel, refresh, pause).await;
    }
}

/// Seconds since the Unix epoch on this host's clock.
fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
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

/// Sums the hardware reports of provided machines by provider and location ("unknown" when
/// the machine has none), as upstream's statistics did; undecodable reports are skipped with
/// a warning.
pub async fn hardware_totals(db: &Bmdb) -> Result<HardwareByLocation, shepherd_bmdb::Error> {
    let mut totals = HardwareByLocation::new();
    let mut after: Option<Uuid> = None;
    loop {
        let a = after;
        let page = db
            .read(move |tx| Box::pin(async move { tx.hardware_reports(a, REPORT_PAGE).await }))
            .await?;
        let full = page.len() as i64 == REPORT_PAGE;
        for (id, provider, location, raw) in page {
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
                .entry((provider, location.unwrap_or_else(|| "unknown".into())))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Fresh statistics and the registry they are registered in.
    fn registered() -> (FleetStats, Registry) {
        let stats = FleetStats::default();
        let mut registry = Registry::default();
        stats.register(&mut registry);
        (stats, registry)
    }

    async fn refresh(stats: &FleetStats, db: &Bmdb) {
        stats
            .refresh(db, RecoveryThresholds::default())
            .await
            .unwrap();
    }

    fn exposition(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    const FIXED: [&str; 5] = [
        r#"shepherd_fleet_machines_provided{provider="Static"} 0"#,
        r#"shepherd_fleet_machines_eligible{process="ShepherdRecovery"} 0"#,
        r#"shepherd_fleet_active_work{process="ShepherdAgentStart"} 0"#,
        r#"shepherd_fleet_active_backoffs{process="ShepherdRecovery"} 0"#,
        r#"shepherd_fleet_active_backoffs{process="ShepherdAgentStart"} 0"#,
    ];

    /// The value of the series `name{labels}` in an exposition, if present.
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    /// A hand-built fleet with one machine in each of upstream's statistics scenarios (as
    /// upstream's bmdb_stats test builds it); every gauge counts what upstream's did.
    #[tokio::test]
    async fn gauges_count_a_fleet_of_every_state() {
        use chrono::Duration as D;
        let t = shepherd_bmdb::testing::sqlite().await;
        t.db.transact(|tx| {
            Box::pin(async move {
                let now = tx.now().await?;
                // (started ago, heartbeat ago, request generation, report generation)
                type Scenario = (Option<i64>, Option<i64>, Option<i64>, Option<i64>);
                let fleet: [Scenario; 9] = [
                    (None, None, None, None),               // provided, needs its agent started
                    (Some(40), None, None, None),           // never heartbeated: recovery
                    (Some(40), None, None, None),           // never heartbeated: recovery
                    (Some(40), None, None, None),           // never heartbeated: recovery
                    (Some(30), Some(1), None, None),        // healthy
                    (Some(30), Some(1), Some(10), None),    // healthy, install pending
                    (Some(30), Some(1), Some(10), Some(9)), // healthy, install pending
                    (Some(40), None, Some(10), None),       // pending install and recovery
                    (Some(30), Some(20), Some(10), Some(10)), // installed, silent
                ];
                for (n, (started, beat, request, report)) in fleet.into_iter().enumerate() {
                    let id = tx.create_machine().await?;
                    let mut provided =
                        shepherd_bmdb::Provided::new(ProviderKind::Equinix, n.to_string());
                    if n == 0 {
                        // The provider stopped listing it.
                        provided.status = Some(shepherd_bmdb::ProviderStatus::Missing);
                    }
                    tx.set_provided(id, &provided).await?;
                    if let Some(m) = started {
                        tx.set_agent_started_at(id, Some(now - D::minutes(m)), &[n as u8 + 1; 32])
                            .await?;
                    }
                    if let Some(m) = beat {
                        tx.set_heartbeat_at(id, now - D::minutes(m)).await?;
                    }
                    shepherd_bmdb::testing::record_installation(tx, id, request, report).await?;
                }
                Ok(())
            })
        })
        .await
        .unwrap();
        let (stats, registry) = registered();
        refresh(&stats, &t.db).await;
        let text = exposition(&registry);
        for (series, want) in [
            ("shepherd_fleet_machines", 9.0),
            (
                r#"shepherd_fleet_machines_provided{provider="Equinix"}"#,
                9.0,
            ),
            ("shepherd_fleet_machines_heartbeating", 3.0),
            ("shepherd_fleet_machines_stale", 1.0),
            ("shepherd_fleet_machines_missing", 1.0),
            ("shepherd_fleet_machines_pending_install", 3.0),
            ("shepherd_fleet_machines_installed", 1.0),
            (
                r#"shepherd_fleet_machines_eligible{process="ShepherdAgentStart"}"#,
                1.0,
            ),
            (
                r#"shepherd_fleet_machines_eligible{process="ShepherdRecovery"}"#,
                4.0,
            ),
            (
                r#"shepherd_fleet_active_work{process="ShepherdAgentStart"}"#,
                0.0,
            ),
            (
                r#"shepherd_fleet_active_backoffs{process="ShepherdRecovery"}"#,
                0.0,
            ),
        ] {
            assert_eq!(value(&text, series), Some(want), "{series}:\n{text}");
        }
        t.cleanup().await;
    }

    /// Hardware totals against a hand-built fleet (upstream's hw_stats test): threads and
    /// memory summed per provider and location; a machine without a provided tag is not
    /// counted; with no reports there are no hardware series at all.
    #[tokio::test]
    async fn hardware_totals_per_provider_and_location() {
        use shepherd_proto::agent::{Cpu, Node};
        let t = shepherd_bmdb::testing::sqlite().await;
        let (stats, registry) = registered();
        refresh(&stats, &t.db).await;
        assert!(!exposition(&registry).contains("shepherd_fleet_hardware_machines{"));

        let report = |threads: i32, gib: i64| {
            AgentHardwareReport {
                report: Some(Node {
                    memory_installed_bytes: gib << 30,
                    memory_usable_ratio: 1.0,
                    cpu: vec![Cpu {
                        cores: threads,
                        hardware_threads: threads,
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                warning: vec![],
            }
            .encode_to_vec()
        };
        let fleet = [
            (Some("dark-bramble"), true),
            (Some("dark-bramble"), true),
            (Some("dark-bramble"), true),
            (Some("brittle-hollow"), true),
            (Some("timber-hearth"), true),
            (Some("timber-hearth"), true),
            (None, false),
        ];
        t.db.transact(move |tx| {
            let r = report(32, 256);
            Box::pin(async move {
                for (n, (location, provided)) in fleet.into_iter().enumerate() {
                    let id = tx.create_machine().await?;
                    if provided {
                        let mut p =
                            shepherd_bmdb::Provided::new(ProviderKind::Equinix, n.to_string());
                        p.location = location.map(str::to_string);
                        tx.set_provided(id, &p).await?;
                    }
                    tx.set_hardware_report(id, &r).await?;
                }
                Ok(())
            })
        })
        .await
        .unwrap();
        refresh(&stats, &t.db).await;
        let text = exposition(&registry);
        for (location, threads, gib) in [
            ("dark-bramble", 96.0, 768.0),
            ("brittle-hollow", 32.0, 256.0),
            ("timber-hearth", 64.0, 512.0),
        ] {
            let place = format!(r#"{{location="{location}",provider="Equinix"}}"#);
            let alt = format!(r#"{{provider="Equinix",location="{location}"}}"#);
            let get = |name: &str| {
                value(&text, &format!("{name}{place}")).or(value(&text, &format!("{name}{alt}")))
            };
            assert_eq!(
                get("shepherd_fleet_hardware_cpu_threads"),
                Some(threads),
                "{text}"
            );
            assert_eq!(
                get("shepherd_fleet_hardware_memory_bytes"),
                Some(gib * f64::from(1u32 << 30)),
                "{text}"
            );
        }
        assert!(
            !text.contains("unknown"),
            "an unprovided machine was counted:\n{text}"
        );
        t.cleanup().await;
    }

    /// Series with a fixed label set read 0 before any data and after their count drops to
    /// 0, instead of vanishing; hardware series exist only for locations with reports.
    #[tokio::test]
    async fn fixed_series_are_present_at_zero() {
        let (stats, registry) = registered();
        let before = exposition(&registry);
        for line in FIXED {
            assert!(
                before.contains(line),
                "{line} missing before any refresh:\n{before}"
            );
        }

        let t = shepherd_bmdb::testing::sqlite().await;
        let id = shepherd_bmdb::testing::machine_with_agent(&t.db, &[7; 32]).await;
        t.db.transact(move |tx| {
            Box::pin(async move {
                let until = tx.now().await? + chrono::Duration::hours(1);
                tx.set_provided(
                    id,
                    &shepherd_bmdb::Provided::new(ProviderKind::Static, "s1"),
                )
                .await?;
                tx.set_backoff(id, Process::ShepherdAgentStart, until, 60, "refused")
                    .await
            })
        })
        .await
        .unwrap();
        refresh(&stats, &t.db).await;
        let busy = exposition(&registry);
        assert!(
            busy.contains(r#"shepherd_fleet_active_backoffs{process="ShepherdAgentStart"} 1"#),
            "{busy}"
        );
        assert!(busy.contains(r#"shepherd_fleet_machines_provided{provider="Static"} 1"#));
        assert!(
            !busy.contains("shepherd_fleet_hardware_machines{"),
            "{busy}"
        );

        t.db.transact(move |tx| {
            Box::pin(async move { tx.clear_backoffs(id, None).await.map(|_| ()) })
        })
        .await
        .unwrap();
        refresh(&stats, &t.db).await;
        let after = exposition(&registry);
        for line in FIXED.iter().filter(|l| !l.contains("Static")) {
            assert!(
                after.contains(line),
                "{line} missing after the count dropped:\n{after}"
            );
        }
        t.cleanup().await;
    }
}
