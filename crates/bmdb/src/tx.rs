//! [`Tx`]: one database transaction and the typed queries that run inside it.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::model::*;
use crate::sql::{self, tags::TagTable, Conn, StatusCounts};
use crate::summary::{FleetCounts, MachineSummary};
use crate::{Error, Retrieval};

/// An open transaction. Obtained inside [`crate::Bmdb::transact`], [`crate::Session::transact`]
/// or [`crate::Work::finish`]; every typed query of the BMDB is a method here, so callers never
/// write SQL and the same code runs on SQLite and Postgres.
pub struct Tx {
    pub(crate) inner: Conn,
}

/// The public key length of an ed25519 agent key.
pub const AGENT_KEY_LEN: usize = 32;

impl Tx {
    pub(crate) async fn commit(self) -> Result<(), Error> {
        match self.inner {
            Conn::Sqlite(c) => c.tx.commit().await?,
            Conn::Postgres(c) => c.commit().await?,
        }
        Ok(())
    }

    pub(crate) async fn rollback(self) -> Result<(), Error> {
        match self.inner {
            Conn::Sqlite(c) => c.tx.rollback().await?,
            Conn::Postgres(c) => c.rollback().await?,
        }
        Ok(())
    }

    /// The transaction's notion of the current time (the database clock on Postgres).
    pub async fn now(&mut self) -> Result<DateTime<Utc>, Error> {
        sql::views::now(&mut self.inner).await
    }

    /// Adds a new machine with a fresh id and returns the id.
    pub async fn create_machine(&mut self) -> Result<Uuid, Error> {
        let id = Uuid::new_v4();
        sql::tags::create_machine(&mut self.inner, id).await?;
        Ok(id)
    }

    /// Whether a machine with this id exists.
    pub async fn machine_exists(&mut self, id: Uuid) -> Result<bool, Error> {
        sql::tags::machine_exists(&mut self.inner, id).await
    }

    /// Machine ids in id order, starting after `after`, at most `limit` of them (for paging).
    pub async fn machine_ids(
        &mut self,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<Uuid>, Error> {
        sql::tags::machine_ids(&mut self.inner, after, limit).await
    }

    /// Sets (or replaces) the `machine_provided` tag.
    pub async fn set_provided(&mut self, id: Uuid, p: &Provided) -> Result<(), Error> {
        p.validate()?;
        sql::tags::set_provided(&mut self.inner, id, p).await
    }

    /// The `machine_provided` tag of a machine.
    pub async fn provided(&mut self, id: Uuid) -> Result<Option<Provided>, Error> {
        sql::tags::provided(&mut self.inner, id).await
    }

    /// Every machine the BMDB says `provider` provided, ordered by provider id.
    pub async fn provided_by(
        &mut self,
        provider: Provider,
    ) -> Result<Vec<(Uuid, Provided)>, Error> {
        sql::tags::provided_by(&mut self.inner, provider).await
    }

    /// The machine a provider knows by `provider_id`, if any.
    pub async fn machine_by_provider_id(
        &mut self,
        provider: Provider,
        provider_id: &str,
    ) -> Result<Option<Uuid>, Error> {
        sql::tags::machine_by_provider_id(&mut self.inner, provider, provider_id).await
    }

    /// Records that the agent was started now with this ed25519 public key.
    pub async fn set_agent_started(&mut self, id: Uuid, public_key: &[u8]) -> Result<(), Error> {
        self.set_agent_started_at(id, None, public_key).await
    }

    /// Like [`Tx::set_agent_started`] with an explicit start time (`None` = now).
    pub async fn set_agent_started_at(
        &mut self,
        id: Uuid,
        at: Option<DateTime<Utc>>,
        public_key: &[u8],
    ) -> Result<(), Error> {
        if public_key.len() != AGENT_KEY_LEN {
            return Err(Error::InvalidArgument {
                what: "agent public key",
                problem: format!("must be {AGENT_KEY_LEN} bytes, got {}", public_key.len()),
            });
        }
        sql::tags::set_agent_started(&mut self.inner, id, at, public_key).await
    }

    /// The `agent_started` tag of a machine.
    pub async fn agent_started(&mut self, id: Uuid) -> Result<Option<AgentStarted>, Error> {
        sql::tags::agent_started(&mut self.inner, id).await
    }

    /// Removes the `agent_started` tag; true if there was one.
    pub async fn delete_agent_started(&mut self, id: Uuid) -> Result<bool, Error> {
        sql::tags::delete_tag(&mut self.inner, TagTable::AgentStarted, id).await
    }

    /// Whether `key` is the public key recorded for the machine's started agent.
    pub async fn agent_key_matches(&mut self, id: Uuid, key: &[u8]) -> Result<bool, Error> {
        sql::tags::agent_key_matches(&mut self.inner, id, key).await
    }

    /// Records a heartbeat now.
    pub async fn set_heartbeat(&mut self, id: Uuid) -> Result<(), Error> {
        sql::tags::set_heartbeat(&mut self.inner, id, None).await
    }

    /// Records a heartbeat at an explicit time.
    pub async fn set_heartbeat_at(&mut self, id: Uuid, at: DateTime<Utc>) -> Result<(), Error> {
        sql::tags::set_heartbeat(&mut self.inner, id, Some(at)).await
    }

    /// The last heartbeat of a machine's agent.
    pub async fn heartbeat(&mut self, id: Uuid) -> Result<Option<DateTime<Utc>>, Error> {
        sql::tags::heartbeat(&mut self.inner, id).await
    }

    /// Removes the heartbeat tag; true if there was one.
    pub async fn delete_heartbeat(&mut self, id: Uuid) -> Result<bool, Error> {
        sql::tags::delete_tag(&mut self.inner, TagTable::AgentHeartbeat, id).await
    }

    /// Stores the serialized hardware report.
    pub async fn set_hardware_report(&mut self, id: Uuid, raw: &[u8]) -> Result<(), Error> {
        sql::tags::set_hardware_report(&mut self.inner, id, raw).await
    }

    /// The serialized hardware report of a machine.
    pub async fn hardware_report(&mut self, id: Uuid) -> Result<Option<Vec<u8>>, Error> {
        sql::tags::hardware_report(&mut self.inner, id).await
    }

    /// Sets the OS installation request.
    pub async fn set_os_installation_request(
        &mut self,
        id: Uuid,
        r: &OsInstallationRequest,
    ) -> Result<(), Error> {
        sql::tags::set_os_installation_request(&mut self.inner, id, r).await
    }

    /// The OS installation request of a machine.
    pub async fn os_installation_request(
        &mut self,
        id: Uuid,
    ) -> Result<Option<OsInstallationRequest>, Error> {
        sql::tags::os_installation_request(&mut self.inner, id).await
    }

    /// Sets the OS installation report.
    pub async fn set_os_installation_report(
        &mut self,
        id: Uuid,
        r: &OsInstallationReport,
    ) -> Result<(), Error> {
        sql::tags::set_os_installation_report(&mut self.inner, id, r).await
    }

    /// The OS installation report of a machine.
    pub async fn os_installation_report(
        &mut self,
        id: Uuid,
    ) -> Result<Option<OsInstallationReport>, Error> {
        sql::tags::os_installation_report(&mut self.inner, id).await
    }

    /// The serialized installation request of a machine unless a report with its generation
    /// exists (the request an agent still has to act on).
    pub async fn pending_installation_request(
        &mut self,
        id: Uuid,
    ) -> Result<Option<Vec<u8>>, Error> {
        let Some(request) = self.os_installation_request(id).await? else {
            return Ok(None);
        };
        let fulfilled = self
            .os_installation_report(id)
            .await?
            .is_some_and(|r| r.generation == request.generation);
        Ok((!fulfilled).then_some(request.request_raw))
    }

    /// The agent-report rule (SPEC §12): if `key` is the agent key of `machine`, stores
    /// `report`, records the heartbeat and returns the pending installation request; else
    /// writes nothing. [`crate::Session::agent_heartbeat`] is its entry point; Postgres's
    /// one-statement path for a bare heartbeat is the same rule in SQL.
    pub async fn record_agent_heartbeat(
        &mut self,
        machine: Uuid,
        key: &[u8],
        report: &AgentReport,
    ) -> Result<AgentHeartbeat, Error> {
        if !self.agent_key_matches(machine, key).await? {
            return Ok(AgentHeartbeat::Unauthorized);
        }
        if let Some(raw) = &report.hardware {
            self.set_hardware_report(machine, raw).await?;
        }
        if let Some(installation) = &report.installation {
            self.set_os_installation_report(machine, installation)
                .await?;
        }
        self.set_heartbeat(machine).await?;
        Ok(AgentHeartbeat::Recorded {
            pending_request: self.pending_installation_request(machine).await?,
        })
    }

    /// Pins `key` as the machine's SSH host key unless one is pinned already. Fails with
    /// [`Error::HostKeyPinned`], writing nothing, when another key is pinned.
    pub async fn pin_ssh_host_key(&mut self, id: Uuid, key: &str) -> Result<SshHostKey, Error> {
        sql::tags::pin_ssh_host_key(&mut self.inner, id, key).await
    }

    /// The pinned SSH host key of a machine.
    pub async fn ssh_host_key(&mut self, id: Uuid) -> Result<Option<SshHostKey>, Error> {
        sql::tags::ssh_host_key(&mut self.inner, id).await
    }

    /// Forgets the pinned SSH host key (an operator re-keyed the machine on purpose).
    pub async fn delete_ssh_host_key(&mut self, id: Uuid) -> Result<bool, Error> {
        sql::tags::delete_tag(&mut self.inner, TagTable::SshHostKey, id).await
    }

    /// Machines `process` may claim under `retrieval`, in id order, at most `limit`.
    pub async fn eligible_machines(
        &mut self,
        process: Process,
        retrieval: &Retrieval,
        limit: i64,
    ) -> Result<Vec<Uuid>, Error> {
        sql::claims::eligible(&mut self.inner, process, retrieval, limit).await
    }

    /// How many machines [`Tx::eligible_machines`] would return without a limit.
    pub async fn count_eligible(
        &mut self,
        process: Process,
        retrieval: &Retrieval,
    ) -> Result<i64, Error> {
        sql::claims::count_eligible(&mut self.inner, process, retrieval).await
    }

    /// Up to `limit` machines after `after` in id order, each as one row of tags; only those
    /// of `provider` if given.
    pub async fn machine_summaries(
        &mut self,
        after: Option<Uuid>,
        provider: Option<Provider>,
        limit: i64,
    ) -> Result<Vec<MachineSummary>, Error> {
        sql::views::machine_summaries(&mut self.inner, after, provider, limit).await
    }

    /// One machine as one row of tags; `None` if it does not exist.
    pub async fn machine_summary(&mut self, id: Uuid) -> Result<Option<MachineSummary>, Error> {
        sql::views::machine_summary(&mut self.inner, id).await
    }

    /// Fleet-wide counts for the statistics gauges; heartbeats older than `stale_after` count
    /// as stale.
    pub async fn fleet_counts(
        &mut self,
        stale_after: chrono::Duration,
    ) -> Result<FleetCounts, Error> {
        let stale_after = stale_after.to_std().unwrap_or_default();
        sql::views::fleet_counts(&mut self.inner, stale_after).await
    }

    /// Up to `limit` raw hardware reports of provided machines after machine `after`, with
    /// the machine's provider and location.
    pub async fn hardware_reports(
        &mut self,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<(Uuid, Provider, Option<String>, Vec<u8>)>, Error> {
        sql::views::hardware_reports(&mut self.inner, after, limit).await
    }

    /// Work held by a session: (machine, process), in machine order.
    pub async fn session_work(&mut self, session: Uuid) -> Result<Vec<(Uuid, Process)>, Error> {
        sql::sessions::session_work(&mut self.inner, session).await
    }

    /// A machine's work history, oldest first.
    pub async fn machine_history(&mut self, id: Uuid) -> Result<Vec<HistoryEntry>, Error> {
        sql::endings::machine_history(&mut self.inner, id).await
    }

    /// History entries of all machines with id above `after_id`, oldest first, at most `limit`.
    pub async fn history_after(
        &mut self,
        after_id: i64,
        limit: i64,
    ) -> Result<Vec<HistoryEntry>, Error> {
        sql::endings::history_after(&mut self.inner, after_id, limit).await
    }

    /// Records that the recoverer rebooted the machine now, the `in_a_row`th time since its
    /// agent last heartbeated.
    pub async fn set_recovery(&mut self, id: Uuid, in_a_row: i64) -> Result<(), Error> {
        sql::tags::set_recovery(&mut self.inner, id, in_a_row).await
    }

    /// The `machine_recovery` tag.
    pub async fn recovery(&mut self, id: Uuid) -> Result<Option<Recovery>, Error> {
        sql::tags::recovery(&mut self.inner, id).await
    }

    /// The provider's machines, and how many of them heartbeated within `fresh_within`.
    pub async fn count_heartbeating(
        &mut self,
        provider: Provider,
        fresh_within: std::time::Duration,
    ) -> Result<(i64, i64), Error> {
        sql::claims::count_heartbeating(&mut self.inner, provider, fresh_within).await
    }

    /// Work currently held on a machine.
    pub async fn machine_work(&mut self, id: Uuid) -> Result<Vec<ActiveWork>, Error> {
        sql::endings::machine_work(&mut self.inner, id).await
    }

    /// Backoffs recorded for a machine (active or expired).
    pub async fn machine_backoffs(&mut self, id: Uuid) -> Result<Vec<BackoffEntry>, Error> {
        sql::endings::machine_backoffs(&mut self.inner, id).await
    }

    /// One session by id.
    pub async fn session(&mut self, id: Uuid) -> Result<Option<SessionInfo>, Error> {
        sql::sessions::session(&mut self.inner, id).await
    }

    /// All sessions, oldest first.
    pub async fn sessions(&mut self) -> Result<Vec<SessionInfo>, Error> {
        sql::sessions::sessions(&mut self.inner).await
    }

    /// Counts for `shepherd bmdb status`.
    pub async fn status_counts(&mut self) -> Result<StatusCounts, Error> {
        sql::views::status_counts(&mut self.inner).await
    }

    /// What the database engine's own consistency checks find wrong (empty when healthy).
    pub async fn integrity_problems(&mut self) -> Result<Vec<String>, Error> {
        sql::views::integrity_problems(&mut self.inner).await
    }

    /// Test support: inserts a work row without claiming (to build arbitrary fleets).
    #[cfg(feature = "testing")]
    pub async fn insert_work_raw(
        &mut self,
        machine: Uuid,
        session: Uuid,
        process: Process,
    ) -> Result<(), Error> {
        sql::endings::insert_work_raw(&mut self.inner, machine, session, process).await
    }

    /// Test support: appends a work history entry with any time (to build old history).
    #[cfg(feature = "testing")]
    pub async fn insert_history_raw(
        &mut self,
        machine: Uuid,
        process: Process,
        event: WorkEvent,
        at: DateTime<Utc>,
        cause: Option<&str>,
    ) -> Result<(), Error> {
        sql::endings::insert_history_raw(&mut self.inner, machine, process, event, at, cause).await
    }

    /// Test support: writes a fleet-count snapshot point at any time (a chart's history).
    #[cfg(feature = "testing")]
    pub async fn insert_fleet_snapshot_raw(
        &mut self,
        at: DateTime<Utc>,
        series: &str,
        machines: i64,
    ) -> Result<(), Error> {
        sql::overview::insert_snapshot_raw(&mut self.inner, at, series, machines).await
    }

    /// Test support: deletes a session row (its work cascades) behind its owner's back, as a
    /// partition plus another replica's garbage collection would.
    #[cfg(feature = "testing")]
    pub async fn delete_session_raw(&mut self, session: Uuid) -> Result<(), Error> {
        sql::sessions::delete_session(&mut self.inner, session).await
    }

    /// Keeps `process` off the machine until `until`, with `cause` for operators. A
    /// `last_interval` of 0 marks a wait that is not a failure, so the process's next failure
    /// backs off from its own initial interval.
    pub async fn set_backoff(
        &mut self,
        machine: Uuid,
        process: Process,
        until: DateTime<Utc>,
        last_interval: i64,
        cause: &str,
    ) -> Result<(), Error> {
        sql::endings::set_backoff(
            &mut self.inner,
            machine,
            process,
            until,
            last_interval,
            cause,
        )
        .await
    }

    /// Ends the machine's backoffs for `process` (every process if `None`) now; returns how
    /// many there were.
    pub async fn clear_backoffs(
        &mut self,
        machine: Uuid,
        process: Option<Process>,
    ) -> Result<u64, Error> {
        sql::endings::clear_backoffs(&mut self.inner, machine, process).await
    }

    /// The machine's maintenance, if an operator put it in maintenance.
    pub async fn maintenance(&mut self, id: Uuid) -> Result<Option<Maintenance>, Error> {
        sql::operator::maintenance(&mut self.inner, id).await
    }

    /// The operators' history of a machine, oldest first.
    pub async fn machine_actions(&mut self, id: Uuid) -> Result<Vec<ActionEntry>, Error> {
        sql::operator::machine_actions(&mut self.inner, id).await
    }

    /// The decommissioning record of a machine id, if it was decommissioned.
    pub async fn decommissioned(&mut self, id: Uuid) -> Result<Option<Decommissioned>, Error> {
        sql::operator::decommissioned(&mut self.inner, id).await
    }

    /// The provider ids of `provider` an operator decommissioned, in id order, each with
    /// whether the provider is to tear the machine down.
    pub async fn decommissioned_ids(
        &mut self,
        provider: Provider,
    ) -> Result<Vec<(String, bool)>, Error> {
        sql::operator::decommissioned_ids(&mut self.inner, provider).await
    }

    /// Whether an operator decommissioned this provider id.
    pub async fn is_decommissioned(
        &mut self,
        provider: Provider,
        provider_id: &str,
    ) -> Result<bool, Error> {
        sql::operator::is_decommissioned(&mut self.inner, provider, provider_id).await
    }

    /// Records the fleet counts as this minute's snapshot (unless another process already
    /// did) and forgets snapshots older than eight days.
    pub async fn record_fleet_snapshot(&mut self, counts: &FleetCounts) -> Result<(), Error> {
        let keep_after = self.now().await? - chrono::Duration::days(8);
        let series = counts.series();
        sql::overview::record_snapshot(&mut self.inner, &series, keep_after).await
    }

    /// Fleet count snapshots of the last `span`, oldest first: (minute, series, machines).
    pub async fn fleet_snapshots(
        &mut self,
        span: chrono::Duration,
    ) -> Result<Vec<(DateTime<Utc>, String, i64)>, Error> {
        let after = self.now().await? - span;
        sql::overview::snapshots(&mut self.inner, after).await
    }

    /// Finished and Failed work per minute and process over the last `span`, oldest first.
    pub async fn work_endings_per_minute(
        &mut self,
        span: chrono::Duration,
    ) -> Result<Vec<(DateTime<Utc>, Process, WorkEvent, i64)>, Error> {
        let after = self.now().await? - span;
        sql::overview::endings_per_minute(&mut self.inner, after).await
    }

    /// The `limit` most frequent failure causes of the last `span`, with their counts.
    pub async fn top_failure_causes(
        &mut self,
        span: chrono::Duration,
        limit: i64,
    ) -> Result<Vec<(String, i64)>, Error> {
        let after = self.now().await? - span;
        sql::overview::top_failure_causes(&mut self.inner, after, limit).await
    }
}
