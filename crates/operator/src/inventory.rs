//! What the BMDB knows about machines, shaped for operators; shared by the CLI
//! (`shepherd machines …`) and the web UI, so both show the same states and fields.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use shepherd_bmdb::{
    ActionEntry, ActiveWork, AgentStarted, BackoffEntry, BareHistoryEntry, BareMetal, Bmdb,
    Decommissioned, HistoryEntry, Lifecycle, MachineSummary, Maintenance, OsInstallationReport,
    OsInstallationRequest, ProviderKind, Recovery, SessionInfo, SshHostKey,
};
use shepherd_proto::agent::{cpu, EfiSupport};
use shepherd_proto::bmaas::{os_installation_request, AgentHardwareReport};
use shepherd_proto::Message;
use uuid::Uuid;

/// Machines read per query while paging.
const PAGE: i64 = 500;

/// A filtered page of machines.
#[derive(Debug)]
pub struct Listing {
    /// Matching machines, in id order.
    pub machines: Vec<MachineSummary>,
    /// Where the next page starts, if the scan stopped before the end of the table.
    pub next: Option<Uuid>,
    /// When the states were derived (the database's clock).
    pub now: DateTime<Utc>,
    /// How old a last heartbeat must be to count as stale.
    pub stale_after: chrono::Duration,
}

impl Listing {
    /// The lifecycle state of one of the listed machines.
    pub fn state_of(&self, m: &MachineSummary) -> Lifecycle {
        m.lifecycle(self.now, self.stale_after)
    }
}

/// Lists up to `limit` machines after `after` that match the filters. At most `scan_budget`
/// machines are read per call, so a filter matching few machines of a large fleet answers in
/// bounded time; `next` then continues the scan.
pub async fn list(
    db: &Bmdb,
    provider: Option<ProviderKind>,
    state: Option<Lifecycle>,
    after: Option<Uuid>,
    limit: usize,
    scan_budget: usize,
    stale_after: chrono::Duration,
) -> Result<Listing, shepherd_bmdb::Error> {
    // States are derived with the database's clock, as the loops and the counts derive them.
    let mut now = None;
    let mut machines = Vec::new();
    let mut cursor = after;
    let mut scanned = 0;
    loop {
        let c = cursor;
        let (page, page_now) = db
            .read(move |tx| {
                Box::pin(async move {
                    Ok((
                        tx.machine_summaries(c, provider, PAGE).await?,
                        tx.now().await?,
                    ))
                })
            })
            .await?;
        let now = *now.get_or_insert(page_now);
        let full_page = page.len() as i64 == PAGE;
        for s in page {
            scanned += 1;
            cursor = Some(s.machine_id);
            if state.is_none_or(|st| s.lifecycle(now, stale_after) == st) {
                machines.push(s);
                if machines.len() >= limit {
                    return Ok(Listing {
                        machines,
                        next: cursor,
                        now,
                        stale_after,
                    });
                }
            }
        }
        if !full_page {
            return Ok(Listing {
                machines,
                next: None,
                now,
                stale_after,
            });
        }
        if scanned >= scan_budget {
            return Ok(Listing {
                machines,
                next: cursor,
                now,
                stale_after,
            });
        }
    }
}

/// Everything about one machine.
#[derive(Debug)]
pub struct Detail {
    /// Tags as one row.
    pub summary: MachineSummary,
    /// The `agent_started` tag.
    pub agent: Option<AgentStarted>,
    /// The pinned SSH host key.
    pub host_key: Option<SshHostKey>,
    /// The decoded hardware report, or why it could not be decoded.
    pub hardware: Option<Result<AgentHardwareReport, String>>,
    /// The installation request tag.
    pub request: Option<OsInstallationRequest>,
    /// The installation report tag.
    pub report: Option<OsInstallationReport>,
    /// Active work with the session holding it.
    pub work: Vec<(ActiveWork, Option<SessionInfo>)>,
    /// Backoffs, expired ones included.
    pub backoffs: Vec<BackoffEntry>,
    /// How the recoverer has been rebooting it.
    pub recovery: Option<Recovery>,
    /// The whole work history, oldest first.
    pub history: Vec<HistoryEntry>,
    /// Maintenance, if an operator put the machine in maintenance.
    pub maintenance: Option<Maintenance>,
    /// What operators did to it, oldest first.
    pub actions: Vec<ActionEntry>,
    /// Where it stands on its way from a BMC to its installed OS, if it came bare.
    pub bare: Option<BareMetal>,
    /// The steps of that way, oldest first (the last [`MAX_BARE_STEPS`]).
    pub bare_steps: Vec<BareHistoryEntry>,
    /// When the states were derived (the database's clock).
    pub now: DateTime<Utc>,
    /// How old a last heartbeat must be to count as stale.
    pub stale_after: chrono::Duration,
}

impl Detail {
    /// The machine's lifecycle state.
    pub fn state(&self) -> Lifecycle {
        self.summary.lifecycle(self.now, self.stale_after)
    }
}

/// Most bare-metal steps shown of one machine: a machine reimaged a hundred times shows its
/// first hundred-odd steps and says so by their count.
pub const MAX_BARE_STEPS: i64 = 500;

/// Loads one machine; `None` if it does not exist.
pub async fn detail(
    db: &Bmdb,
    id: Uuid,
    stale_after: chrono::Duration,
) -> Result<Option<Detail>, shepherd_bmdb::Error> {
    db.read(move |tx| {
        Box::pin(async move {
            let Some(summary) = tx.machine_summary(id).await? else {
                return Ok(None);
            };
            let now = tx.now().await?;
            let mut work = Vec::new();
            for w in tx.machine_work(id).await? {
                let s = tx.session(w.session_id).await?;
                work.push((w, s));
            }
            Ok(Some(Detail {
                summary,
                agent: tx.agent_started(id).await?,
                host_key: tx.ssh_host_key(id).await?,
                hardware: tx.hardware_report(id).await?.map(|raw| {
                    AgentHardwareReport::decode(raw.as_slice())
                        .map_err(|e| format!("undecodable report: {e}"))
                }),
                request: tx.os_installation_request(id).await?,
                report: tx.os_installation_report(id).await?,
                work,
                backoffs: tx.machine_backoffs(id).await?,
                recovery: tx.recovery(id).await?,
                history: tx.machine_history(id).await?,
                maintenance: tx.maintenance(id).await?,
                actions: tx.machine_actions(id).await?,
                bare: tx.bare_metal(id).await?,
                bare_steps: tx.bare_history(id, MAX_BARE_STEPS).await?,
                now,
                stale_after,
            }))
        })
    })
    .await
}

/// The fleet counts, computed at most once per `ttl` however many readers ask: counting is
/// O(fleet) and a page or an API request must not be. Readers that come while the counts are
/// being computed wait for that computation.
pub struct CountsCache {
    db: Bmdb,
    stale_after: chrono::Duration,
    ttl: std::time::Duration,
    cached: tokio::sync::Mutex<
        Option<(
            std::time::Instant,
            std::sync::Arc<shepherd_bmdb::FleetCounts>,
        )>,
    >,
}

impl CountsCache {
    /// Counts of `db`, stale heartbeats being older than `stale_after`, reused for `ttl`.
    pub fn new(db: Bmdb, stale_after: chrono::Duration, ttl: std::time::Duration) -> Self {
        CountsCache {
            db,
            stale_after,
            ttl,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    /// The counts, at most `ttl` old.
    pub async fn get(
        &self,
    ) -> Result<std::sync::Arc<shepherd_bmdb::FleetCounts>, shepherd_bmdb::Error> {
        let mut cached = self.cached.lock().await;
        if let Some((at, counts)) = cached.as_ref() {
            if at.elapsed() < self.ttl {
                return Ok(counts.clone());
            }
        }
        let stale_after = self.stale_after;
        let counts = self
            .db
            .read(move |tx| Box::pin(async move { tx.fleet_counts(stale_after).await }))
            .await?;
        let counts = std::sync::Arc::new(counts);
        *cached = Some((std::time::Instant::now(), counts.clone()));
        Ok(counts)
    }
}

/// Hex of bytes (keys).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A MAC address as people write it (`02:00:00:00:00:09`).
pub fn mac(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The one-line JSON form of a machine (`machines list --json`).
pub fn summary_json(s: &MachineSummary, state: Lifecycle) -> Value {
    let p = s.provided.as_ref();
    json!({
        "machine_id": s.machine_id.to_string(),
        "state": state.label(),
        "provider": p.map(|p| p.provider.to_string()),
        "provider_id": p.map(|p| p.provider_id.clone()),
        "address": p.and_then(|p| p.ip_address.clone()),
        "location": p.and_then(|p| p.location.clone()),
        "status": p.and_then(|p| p.status.map(|s| s.to_string())),
        "heartbeat_at": s.heartbeat_at.map(|h| h.to_rfc3339()),
    })
}

/// A decoded installation request, for people.
pub fn describe_request(r: &OsInstallationRequest) -> String {
    match shepherd_proto::bmaas::OsInstallationRequest::decode(r.request_raw.as_slice()) {
        Ok(q) => match q.r#type {
            Some(os_installation_request::Type::Image(i)) => format!(
                "image {} (sha256 {}) onto {}",
                i.url, i.sha256, i.target_device
            ),
            Some(os_installation_request::Type::Metropolis(b)) => {
                format!("metropolis parameters ({} bytes)", b.len())
            }
            None => "no installation type".into(),
        },
        Err(e) => format!("undecodable request: {e}"),
    }
}

/// The JSON form of everything about a machine (`machines show --json`).
pub fn detail_json(d: &Detail) -> Value {
    let mut v = summary_json(&d.summary, d.state());
    v["provider_facts"] = json!(d.summary.provided.as_ref().map(|p| p
        .facts
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(v)))
        .collect::<serde_json::Map<_, _>>()));
    v["agent_started_at"] = json!(d.agent.as_ref().map(|a| a.started_at.to_rfc3339()));
    v["agent_key"] = json!(d.agent.as_ref().map(|a| hex(&a.public_key)));
    v["ssh_host_key"] = json!(d.host_key.as_ref().map(|k| k.key.clone()));
    v["installation_request"] = json!(d.request.as_ref().map(|r| json!({
        "generation": r.generation,
        "request": describe_request(r),
    })));
    v["installation_report"] = json!(d
        .report
        .as_ref()
        .map(|r| json!({"generation": r.generation, "result": r.result.to_string()})));
    v["hardware_report"] = match &d.hardware {
        None => Value::Null,
        Some(Ok(r)) => hardware_json(r),
        Some(Err(e)) => json!({ "error": e }),
    };
    v["work"] = each(&d.work, |(w, s)| {
        json!({
            "process": w.process.to_string(),
            "session_id": w.session_id.to_string(),
            "session_component": s.as_ref().map(|s| s.component_name.clone()),
        })
    });
    v["backoffs"] = each(&d.backoffs, |b| {
        json!({"process": b.process.to_string(), "until": b.until.to_rfc3339(),
               "active": b.until > d.now, "cause": b.cause})
    });
    v["recovery"] = json!(d.recovery.as_ref().map(|r| json!({
        "rebooted_at": r.rebooted_at.to_rfc3339(),
        "in_a_row": r.in_a_row,
    })));
    v["maintenance"] = json!(d.maintenance.as_ref().map(|m| json!({
        "since": m.since.to_rfc3339(), "by": m.by, "reason": m.reason,
    })));
    v["history"] = each(&d.history, |h| {
        json!({"at": h.at.to_rfc3339(), "process": h.process.to_string(),
               "event": h.event.to_string(), "cause": h.cause})
    });
    v["operator_actions"] = each(&d.actions, action_json);
    v["bare_metal"] = json!(d.bare.as_ref().map(|b| json!({
        "phase": b.phase.to_string(),
        "since": b.phase_at.to_rfc3339(),
        "attempts": b.attempts,
        "wipe_allowed_by": b.wipe_by,
    })));
    v["bare_steps"] = Value::Array(bare_steps_json(&d.bare_steps, d.now));
    v
}

/// A bare machine's steps as JSON, each with the seconds spent in the phase it entered (until
/// the next step, or until `now` for the last).
pub fn bare_steps_json(steps: &[BareHistoryEntry], now: DateTime<Utc>) -> Vec<Value> {
    steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let until = steps.get(i + 1).map_or(now, |next| next.at);
            let seconds = (until - s.at).num_milliseconds() as f64 / 1000.0;
            json!({"at": s.at.to_rfc3339(), "phase": s.phase.to_string(),
                   "seconds": seconds, "detail": s.detail})
        })
        .collect()
}

/// One entry of the operators' history as JSON.
pub fn action_json(a: &ActionEntry) -> Value {
    json!({"at": a.at.to_rfc3339(), "action": a.action.slug(),
           "process": a.process.map(|p| p.to_string()), "by": a.by, "reason": a.reason,
           "request_id": a.request_id})
}

/// One line of a machine's history, the loops' and the operators' entries together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryLine {
    /// When.
    pub at: DateTime<Utc>,
    /// Who: the process, or `operator NAME`.
    pub who: String,
    /// What happened: the event, or the operator's action.
    pub what: String,
    /// Why: the failure's cause, or the operator's reason.
    pub why: String,
}

/// One history line as JSON (`machines history` through the API, and the API's answer).
pub fn history_line_json(l: &HistoryLine) -> Value {
    json!({ "at": l.at.to_rfc3339(), "who": l.who, "what": l.what, "why": l.why })
}

/// A machine's whole history, oldest first: work entries and operators' actions merged by
/// time (a work entry first where both have the same time).
pub fn history_lines(history: &[HistoryEntry], actions: &[ActionEntry]) -> Vec<HistoryLine> {
    let mut lines: Vec<(DateTime<Utc>, u8, i64, HistoryLine)> = history
        .iter()
        .map(|h| {
            let line = HistoryLine {
                at: h.at,
                who: h.process.to_string(),
                what: h.event.to_string(),
                why: h.cause.clone().unwrap_or_default(),
            };
            (h.at, 0, h.id, line)
        })
        .chain(actions.iter().map(|a| {
            let what = match a.process {
                Some(p) => format!("{} {p}", a.action.slug()),
                None => a.action.slug().to_string(),
            };
            let why = match &a.request_id {
                Some(request) => format!("{} [API request {request}]", a.reason)
                    .trim_start()
                    .to_string(),
                None => a.reason.clone(),
            };
            let line = HistoryLine {
                at: a.at,
                who: format!("operator {}", a.by),
                what,
                why,
            };
            (a.at, 1, a.id, line)
        }))
        .collect();
    lines.sort_by_key(|l| (l.0, l.1, l.2));
    lines.into_iter().map(|(_, _, _, l)| l).collect()
}

/// A machine's whole history (see [`history_lines`]) and its decommissioning record, if the
/// machine was decommissioned; read whether or not the machine still exists.
pub async fn history(
    db: &Bmdb,
    id: Uuid,
) -> Result<(Vec<HistoryLine>, Option<Decommissioned>), shepherd_bmdb::Error> {
    db.read(move |tx| {
        Box::pin(async move {
            let lines = history_lines(
                &tx.machine_history(id).await?,
                &tx.machine_actions(id).await?,
            );
            Ok((lines, tx.decommissioned(id).await?))
        })
    })
    .await
}

/// The whole decoded hardware report, every field of upstream's `Node`, plus the totals
/// operators look at first (cores, threads).
pub fn hardware_json(r: &AgentHardwareReport) -> Value {
    let Some(report) = &r.report else {
        return json!({ "warnings": r.warning });
    };
    json!({
        "manufacturer": report.manufacturer,
        "product": report.product,
        "serial_number": report.serial_number,
        "efi_support": report.efi_support().as_str_name(),
        "cpu_cores": report.cpu.iter().map(|c| c.cores).sum::<i32>(),
        "cpu_threads": report.cpu.iter().map(|c| c.hardware_threads).sum::<i32>(),
        "cpus": each(&report.cpu, |c| {
            let x86 = match &c.architecture {
                Some(cpu::Architecture::X8664(x)) => {
                    json!({"family": x.family, "model": x.model, "stepping": x.stepping})
                }
                None => Value::Null,
            };
            json!({
                "vendor": c.vendor,
                "model": c.model,
                "cores": c.cores,
                "hardware_threads": c.hardware_threads,
                "x86_64": x86,
            })
        }),
        "memory_bytes": report.memory_installed_bytes,
        "memory_usable_ratio": report.memory_usable_ratio,
        "nics": each(&report.network_interface, |n| json!({
            "mac": mac(&n.mac),
            "driver": n.driver,
            "link_up": n.link_up,
            "speed_bytes": n.current_speed_bytes,
            "supported_speed_bytes": n.supported_speed_bytes,
        })),
        "block_devices": each(&report.block_device, |b| json!({
            "vendor": b.vendor,
            "model": b.device_model,
            "serial_number": b.serial_number,
            "wwn": hex(&b.wwn),
            "protocol": b.protocol().as_str_name(),
            "rotational": b.rotational,
            "capacity_bytes": b.capacity_bytes,
            "logical_block_size_bytes": b.logical_block_size_bytes,
            "physical_block_size_bytes": b.physical_block_size_bytes,
            "critical_warning": b.critical_warning,
            "media_errors": b.media_errors,
            "available_spare_ratio": b.available_spare_ratio,
            "usage_ratio": b.usage_ratio,
        })),
        "warnings": r.warning,
    })
}

/// Bytes as GiB with one decimal ("64.0 GiB").
pub fn gib(bytes: i64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// The whole decoded hardware report as labelled lines for people (`machines show`, the web
/// UI): one line per CPU, disk and NIC.
pub fn hardware_lines(r: &AgentHardwareReport) -> Vec<(&'static str, String)> {
    let mut lines = Vec::new();
    if let Some(n) = &r.report {
        let efi = match n.efi_support() {
            EfiSupport::Enabled => "EFI enabled",
            EfiSupport::Supported => "EFI supported, not enabled",
            EfiSupport::Unsupported => "no EFI",
            EfiSupport::Unknown | EfiSupport::Invalid => "EFI unknown",
        };
        lines.push((
            "system",
            format!(
                "{} {} (serial {}), {efi}",
                n.manufacturer, n.product, n.serial_number
            ),
        ));
        for c in &n.cpu {
            let mut line = format!(
                "{} ({}): {} cores, {} threads",
                c.model, c.vendor, c.cores, c.hardware_threads
            );
            if let Some(cpu::Architecture::X8664(x)) = &c.architecture {
                line += &format!(
                    ", family {} model {} stepping {}",
                    x.family, x.model, x.stepping
                );
            }
            lines.push(("cpu", line));
        }
        lines.push((
            "memory",
            format!(
                "{} installed, {:.1} % usable",
                gib(n.memory_installed_bytes),
                n.memory_usable_ratio * 100.0
            ),
        ));
        for b in &n.block_device {
            let mut line = format!(
                "{} {} {} (serial {}, wwn {}), {}, {}",
                b.vendor.trim(),
                b.device_model.trim(),
                gib(b.capacity_bytes),
                b.serial_number,
                if b.wwn.is_empty() {
                    "-".to_string()
                } else {
                    hex(&b.wwn)
                },
                b.protocol().as_str_name(),
                if b.rotational {
                    "rotational"
                } else {
                    "solid state"
                },
            );
            if b.critical_warning {
                line += ", CRITICAL WARNING";
            }
            if let Some(e) = b.media_errors {
                line += &format!(", {e} media errors");
            }
            lines.push(("disk", line));
        }
        for i in &n.network_interface {
            let speeds: Vec<String> = i
                .supported_speed_bytes
                .iter()
                .map(|s| format!("{} Mbit/s", s * 8 / 1_000_000))
                .collect();
            lines.push((
                "nic",
                format!(
                    "{} driver {}, link {} at {} Mbit/s, supports [{}]",
                    mac(&i.mac),
                    if i.driver.is_empty() { "-" } else { &i.driver },
                    if i.link_up { "up" } else { "down" },
                    i.current_speed_bytes * 8 / 1_000_000,
                    speeds.join(", ")
                ),
            ));
        }
    }
    for w in &r.warning {
        lines.push(("warning", w.clone()));
    }
    lines
}

/// A JSON array of `f` applied to each of `items`.
fn each<T>(items: &[T], f: impl Fn(&T) -> Value) -> Value {
    Value::Array(items.iter().map(f).collect())
}
