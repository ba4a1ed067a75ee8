//! Machines and the facts about them (tags, design.md §2): one upsert and one read per tag, as
//! methods of [`Tx`].

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::engine::{from_columns, Arg, Columns, DbTime, Dialects, FromColumns, Result, Tx};
use crate::model::*;
use crate::Error;

const CREATE_MACHINE: Dialects = Dialects {
    postgres: "INSERT INTO machines (machine_id, created_at) VALUES ($1, now())",
    sqlite: "INSERT INTO machines (machine_id, created_at) VALUES ($1, $2)",
};

const SET_AGENT_STARTED: Dialects = Dialects {
    postgres: "INSERT INTO machine_agent_started (machine_id, started_at, public_key, live_proof)
               VALUES ($1, coalesce($2, now()), $3, $4)
               ON CONFLICT (machine_id) DO UPDATE
               SET started_at = excluded.started_at, public_key = excluded.public_key,
                   live_proof = excluded.live_proof",
    sqlite: "INSERT INTO machine_agent_started (machine_id, started_at, public_key, live_proof)
             VALUES ($1, coalesce($2, $5), $3, $4)
             ON CONFLICT (machine_id) DO UPDATE
             SET started_at = excluded.started_at, public_key = excluded.public_key,
                 live_proof = excluded.live_proof",
};

const SET_HEARTBEAT: Dialects = Dialects {
    postgres: "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
               VALUES ($1, coalesce($2, now()))
               ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
    sqlite: "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
             VALUES ($1, coalesce($2, $3))
             ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
};

const SET_RECOVERY: Dialects = Dialects {
    postgres:
        "INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row) VALUES ($1, now(), $2)
               ON CONFLICT (machine_id) DO UPDATE
               SET rebooted_at = excluded.rebooted_at, in_a_row = excluded.in_a_row",
    sqlite: "INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row) VALUES ($1, $3, $2)
             ON CONFLICT (machine_id) DO UPDATE
             SET rebooted_at = excluded.rebooted_at, in_a_row = excluded.in_a_row",
};

const PIN_SSH_HOST_KEY: Dialects = Dialects {
    postgres:
        "INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at) VALUES ($1, $2, now())
               ON CONFLICT (machine_id) DO NOTHING",
    sqlite: "INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at) VALUES ($1, $2, $3)
             ON CONFLICT (machine_id) DO NOTHING",
};

/// A `machine_provided` row: the machine and its provided tag (also the provided half of an
/// operator's summary row).
pub(crate) struct ProvidedRow(pub(crate) Uuid, pub(crate) Provided);

impl FromColumns for ProvidedRow {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        let status: Option<String> = r.get("status")?;
        let facts: Option<String> = r.get("facts")?;
        Ok(ProvidedRow(
            r.get("machine_id")?,
            Provided {
                provider: r.parsed("provider")?,
                provider_id: r.get("provider_id")?,
                reservation_id: r.get("reservation_id")?,
                ip_address: r.get("ip_address")?,
                location: r.get("location")?,
                status: status.map(|s| s.parse()).transpose()?,
                facts: ProviderFacts::from_column(facts.as_deref())?,
            },
        ))
    }
}

/// A tag table: the closed list [`Tx::delete_tag`] may name.
#[derive(Debug, Clone, Copy)]
enum TagTable {
    AgentStarted,
    AgentHeartbeat,
    SshHostKey,
    OsInstallationRequest,
    OsInstallationReport,
}

impl TagTable {
    fn name(self) -> &'static str {
        match self {
            TagTable::AgentStarted => "machine_agent_started",
            TagTable::AgentHeartbeat => "machine_agent_heartbeat",
            TagTable::SshHostKey => "machine_ssh_host_key",
            TagTable::OsInstallationRequest => "machine_os_installation_request",
            TagTable::OsInstallationReport => "machine_os_installation_report",
        }
    }
}

impl Tx {
    /// Adds a new machine with a fresh id and returns the id.
    pub async fn create_machine(&mut self) -> Result<Uuid> {
        let id = Uuid::new_v4();
        self.conn()
            .execute(&CREATE_MACHINE, &[Arg::Uuid(id), Arg::Now])
            .await?;
        Ok(id)
    }

    /// Whether a machine with this id exists.
    pub async fn machine_exists(&mut self, id: Uuid) -> Result<bool> {
        let sql = "SELECT EXISTS (SELECT 1 FROM machines WHERE machine_id = $1)";
        Ok(self.conn().value(sql, &[Arg::Uuid(id)]).await? == Some(true))
    }

    /// Machine ids in id order, starting after `after`, at most `limit` of them (for paging).
    pub async fn machine_ids(&mut self, after: Option<Uuid>, limit: i64) -> Result<Vec<Uuid>> {
        let sql = "SELECT machine_id FROM machines WHERE $1 IS NULL OR machine_id > $1
                   ORDER BY machine_id LIMIT $2";
        self.conn()
            .values(sql, &[Arg::OptUuid(after), Arg::Int(limit)])
            .await
    }

    /// Sets (or replaces) the `machine_provided` tag.
    pub async fn set_provided(&mut self, id: Uuid, p: &Provided) -> Result<()> {
        p.validate()?;
        let sql = "INSERT INTO machine_provided
                       (machine_id, provider, provider_id, reservation_id, ip_address, location,
                        status, facts)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                   ON CONFLICT (machine_id) DO UPDATE SET provider = excluded.provider,
                      provider_id = excluded.provider_id, reservation_id = excluded.reservation_id,
                      ip_address = excluded.ip_address, location = excluded.location,
                      status = excluded.status, facts = excluded.facts";
        let facts = p.facts.to_column();
        let args = [
            Arg::Uuid(id),
            Arg::Text(p.provider.as_str()),
            Arg::Text(&p.provider_id),
            Arg::OptText(p.reservation_id.as_deref()),
            Arg::OptText(p.ip_address.as_deref()),
            Arg::OptText(p.location.as_deref()),
            Arg::OptText(p.status.map(|s| s.as_str())),
            Arg::OptText(facts.as_deref()),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }

    /// The `machine_provided` tag of a machine.
    pub async fn provided(&mut self, id: Uuid) -> Result<Option<Provided>> {
        let sql = "SELECT * FROM machine_provided WHERE machine_id = $1";
        let row: Option<ProvidedRow> = self.conn().row(sql, &[Arg::Uuid(id)]).await?;
        Ok(row.map(|ProvidedRow(_, p)| p))
    }

    /// Every machine the BMDB says `provider` provided, ordered by provider id.
    pub async fn provided_by(&mut self, provider: ProviderKind) -> Result<Vec<(Uuid, Provided)>> {
        let sql = "SELECT * FROM machine_provided WHERE provider = $1 ORDER BY provider_id";
        let rows: Vec<ProvidedRow> = self
            .conn()
            .rows(sql, &[Arg::Text(provider.as_str())])
            .await?;
        Ok(rows.into_iter().map(|ProvidedRow(id, p)| (id, p)).collect())
    }

    /// The machine a provider knows by `provider_id`, if any.
    pub async fn machine_by_provider_id(
        &mut self,
        provider: ProviderKind,
        provider_id: &str,
    ) -> Result<Option<Uuid>> {
        let sql =
            "SELECT machine_id FROM machine_provided WHERE provider = $1 AND provider_id = $2";
        let args = [Arg::Text(provider.as_str()), Arg::Text(provider_id)];
        self.conn().value(sql, &args).await
    }

    /// Records that the agent was started now with this ed25519 public key, showing no live
    /// proof.
    pub async fn set_agent_started(&mut self, id: Uuid, public_key: &[u8]) -> Result<()> {
        self.set_agent_started_at(id, None, public_key).await
    }

    /// Like [`Tx::set_agent_started`] with an explicit start time (`None` = now).
    pub async fn set_agent_started_at(
        &mut self,
        id: Uuid,
        at: Option<DateTime<Utc>>,
        public_key: &[u8],
    ) -> Result<()> {
        self.start_agent(id, at, public_key, None).await
    }

    /// Records that the agent was started now with this public key, showing `live_proof` (the
    /// proof of its live environment's config drive, design.md §21) or none.
    pub async fn set_agent_started_with_proof(
        &mut self,
        id: Uuid,
        public_key: &[u8],
        live_proof: Option<&str>,
    ) -> Result<()> {
        self.start_agent(id, None, public_key, live_proof).await
    }

    async fn start_agent(
        &mut self,
        id: Uuid,
        at: Option<DateTime<Utc>>,
        public_key: &[u8],
        live_proof: Option<&str>,
    ) -> Result<()> {
        if public_key.len() != AGENT_KEY_LEN {
            return Err(Error::InvalidArgument {
                what: "agent public key",
                problem: format!("must be {AGENT_KEY_LEN} bytes, got {}", public_key.len()),
            });
        }
        let args = [
            Arg::Uuid(id),
            Arg::OptTime(at),
            Arg::Bytes(public_key),
            Arg::OptText(live_proof),
            Arg::Now,
        ];
        self.conn().execute(&SET_AGENT_STARTED, &args).await?;
        Ok(())
    }

    /// The `agent_started` tag of a machine.
    pub async fn agent_started(&mut self, id: Uuid) -> Result<Option<AgentStarted>> {
        let sql = "SELECT started_at, public_key FROM machine_agent_started WHERE machine_id = $1";
        self.conn().row(sql, &[Arg::Uuid(id)]).await
    }

    /// The proof the started agent showed that it runs in the live environment of its
    /// machine's current live boot (design.md §21), from that boot's config drive; `None`
    /// where it showed none (as an installed OS does) or no agent was started.
    pub async fn agent_live_proof(&mut self, id: Uuid) -> Result<Option<String>> {
        let sql = "SELECT live_proof FROM machine_agent_started WHERE machine_id = $1";
        Ok(self.conn().value(sql, &[Arg::Uuid(id)]).await?.flatten())
    }

    /// Removes the `agent_started` tag; true if there was one.
    pub async fn delete_agent_started(&mut self, id: Uuid) -> Result<bool> {
        self.delete_tag(TagTable::AgentStarted, id).await
    }

    /// Whether `key` is the public key recorded for the machine's started agent.
    pub async fn agent_key_matches(&mut self, id: Uuid, key: &[u8]) -> Result<bool> {
        let sql = "SELECT EXISTS (SELECT 1 FROM machine_agent_started
                                   WHERE machine_id = $1 AND public_key = $2)";
        let args = [Arg::Uuid(id), Arg::Bytes(key)];
        Ok(self.conn().value(sql, &args).await? == Some(true))
    }

    /// Whether an agent whose heartbeat was refused (its key did not match) may have a key
    /// that is about to be recorded: the machine's agent start is under way (the takeover's
    /// ending, which records the key, has not committed), the machine has no agent key
    /// recorded at all (a takeover whose ending was lost with its lease started this agent,
    /// and the next takeover replaces it), or `key` matches by now. Only a key other than
    /// the one recorded, or a machine the BMDB does not have, is wrong.
    pub async fn agent_key_pending(&mut self, id: Uuid, key: &[u8]) -> Result<bool> {
        let sql = "SELECT EXISTS (SELECT 1 FROM work
                                   WHERE machine_id = $1 AND process = 'ShepherdAgentStart')
                       OR (EXISTS (SELECT 1 FROM machines WHERE machine_id = $1)
                           AND NOT EXISTS (SELECT 1 FROM machine_agent_started
                                            WHERE machine_id = $1))";
        let pending = self.conn().value(sql, &[Arg::Uuid(id)]).await? == Some(true);
        Ok(pending || self.agent_key_matches(id, key).await?)
    }

    /// Records a heartbeat now.
    pub async fn set_heartbeat(&mut self, id: Uuid) -> Result<()> {
        self.write_heartbeat(id, None).await
    }

    /// Records a heartbeat at an explicit time.
    pub async fn set_heartbeat_at(&mut self, id: Uuid, at: DateTime<Utc>) -> Result<()> {
        self.write_heartbeat(id, Some(at)).await
    }

    async fn write_heartbeat(&mut self, id: Uuid, at: Option<DateTime<Utc>>) -> Result<()> {
        let args = [Arg::Uuid(id), Arg::OptTime(at), Arg::Now];
        self.conn().execute(&SET_HEARTBEAT, &args).await?;
        Ok(())
    }

    /// The last heartbeat of a machine's agent.
    pub async fn heartbeat(&mut self, id: Uuid) -> Result<Option<DateTime<Utc>>> {
        let sql = "SELECT heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = $1";
        let at: Option<DbTime> = self.conn().value(sql, &[Arg::Uuid(id)]).await?;
        Ok(at.map(|t| t.0))
    }

    /// Removes the heartbeat tag; true if there was one.
    pub async fn delete_heartbeat(&mut self, id: Uuid) -> Result<bool> {
        self.delete_tag(TagTable::AgentHeartbeat, id).await
    }

    /// Records that the recoverer rebooted the machine now, the `in_a_row`th time since its
    /// agent last heartbeated.
    pub async fn set_recovery(&mut self, id: Uuid, in_a_row: i64) -> Result<()> {
        let in_a_row = i32::try_from(in_a_row).unwrap_or(i32::MAX);
        let args = [Arg::Uuid(id), Arg::Int32(in_a_row), Arg::Now];
        self.conn().execute(&SET_RECOVERY, &args).await?;
        Ok(())
    }

    /// The `machine_recovery` tag.
    pub async fn recovery(&mut self, id: Uuid) -> Result<Option<Recovery>> {
        let sql = "SELECT rebooted_at, in_a_row FROM machine_recovery WHERE machine_id = $1";
        let row: Option<(DbTime, i32)> = self.conn().row(sql, &[Arg::Uuid(id)]).await?;
        Ok(row.map(|(at, in_a_row)| Recovery {
            rebooted_at: at.0,
            in_a_row: in_a_row.into(),
        }))
    }

    /// Stores the serialized hardware report.
    pub async fn set_hardware_report(&mut self, id: Uuid, raw: &[u8]) -> Result<()> {
        let sql = "INSERT INTO machine_hardware_report (machine_id, report_raw) VALUES ($1, $2)
                   ON CONFLICT (machine_id) DO UPDATE SET report_raw = excluded.report_raw";
        self.conn()
            .execute(sql, &[Arg::Uuid(id), Arg::Bytes(raw)])
            .await?;
        Ok(())
    }

    /// The serialized hardware report of a machine.
    pub async fn hardware_report(&mut self, id: Uuid) -> Result<Option<Vec<u8>>> {
        let sql = "SELECT report_raw FROM machine_hardware_report WHERE machine_id = $1";
        self.conn().value(sql, &[Arg::Uuid(id)]).await
    }

    /// Sets the OS installation request.
    pub async fn set_os_installation_request(
        &mut self,
        id: Uuid,
        r: &OsInstallationRequest,
    ) -> Result<()> {
        let sql =
            "INSERT INTO machine_os_installation_request (machine_id, generation, request_raw)
                   VALUES ($1, $2, $3)
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = excluded.generation, request_raw = excluded.request_raw";
        let args = [
            Arg::Uuid(id),
            Arg::Int(r.generation),
            Arg::Bytes(&r.request_raw),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }

    /// The OS installation request of a machine.
    pub async fn os_installation_request(
        &mut self,
        id: Uuid,
    ) -> Result<Option<OsInstallationRequest>> {
        let table = TagTable::OsInstallationRequest;
        self.tag_row(table, "generation, request_raw", id).await
    }

    /// Sets the OS installation report.
    pub async fn set_os_installation_report(
        &mut self,
        id: Uuid,
        r: &OsInstallationReport,
    ) -> Result<()> {
        let sql = "INSERT INTO machine_os_installation_report
                       (machine_id, generation, result, report_raw)
                   VALUES ($1, $2, $3, $4)
                   ON CONFLICT (machine_id) DO UPDATE SET generation = excluded.generation,
                      result = excluded.result, report_raw = excluded.report_raw";
        let args = [
            Arg::Uuid(id),
            Arg::Int(r.generation),
            Arg::Text(r.result.as_str()),
            Arg::Bytes(&r.report_raw),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }

    /// The OS installation report of a machine.
    pub async fn os_installation_report(
        &mut self,
        id: Uuid,
    ) -> Result<Option<OsInstallationReport>> {
        let table = TagTable::OsInstallationReport;
        self.tag_row(table, "generation, result, report_raw", id)
            .await
    }

    /// The serialized installation request of a machine unless a report with its generation
    /// exists (the request an agent still has to act on).
    pub async fn pending_installation_request(&mut self, id: Uuid) -> Result<Option<Vec<u8>>> {
        let Some(request) = self.os_installation_request(id).await? else {
            return Ok(None);
        };
        let fulfilled = self
            .os_installation_report(id)
            .await?
            .is_some_and(|r| r.generation == request.generation);
        Ok((!fulfilled).then_some(request.request_raw))
    }

    /// The agent-report rule (design.md §12): if `key` is the agent key of `machine`, stores
    /// `report`, records the heartbeat and returns the pending installation request; else
    /// writes nothing. [`crate::Session::agent_heartbeat`] is its entry point; Postgres's
    /// one-statement path for a batch of bare heartbeats (`sql/sessions.rs`) is the same rule
    /// in SQL.
    pub async fn record_agent_heartbeat(
        &mut self,
        machine: Uuid,
        key: &[u8],
        report: &AgentReport,
    ) -> Result<AgentHeartbeat> {
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
    pub async fn pin_ssh_host_key(&mut self, id: Uuid, key: &str) -> Result<SshHostKey> {
        let args = [Arg::Uuid(id), Arg::Text(key), Arg::Now];
        self.conn().execute(&PIN_SSH_HOST_KEY, &args).await?;
        let pinned = self.ssh_host_key(id).await?.ok_or(Error::MachineGone(id))?;
        if pinned.key != key {
            return Err(Error::HostKeyPinned {
                pinned: pinned.key,
                presented: key.to_string(),
            });
        }
        Ok(pinned)
    }

    /// The pinned SSH host key of a machine.
    pub async fn ssh_host_key(&mut self, id: Uuid) -> Result<Option<SshHostKey>> {
        let sql = "SELECT key, first_seen_at FROM machine_ssh_host_key WHERE machine_id = $1";
        self.conn().row(sql, &[Arg::Uuid(id)]).await
    }

    /// Forgets the pinned SSH host key (an operator re-keyed the machine on purpose).
    pub async fn delete_ssh_host_key(&mut self, id: Uuid) -> Result<bool> {
        self.delete_tag(TagTable::SshHostKey, id).await
    }

    /// Deletes the machine's installation request and report (the installation is done or
    /// undone); true if there was either.
    pub async fn delete_os_installation(&mut self, id: Uuid) -> Result<bool> {
        let request = self.delete_tag(TagTable::OsInstallationRequest, id).await?;
        let report = self.delete_tag(TagTable::OsInstallationReport, id).await?;
        Ok(request || report)
    }

    /// `columns` of one machine's row of a tag, if it has one.
    async fn tag_row<T: FromColumns>(
        &mut self,
        table: TagTable,
        columns: &str,
        id: Uuid,
    ) -> Result<Option<T>> {
        let sql = format!(
            "SELECT {columns} FROM {} WHERE machine_id = $1",
            table.name()
        );
        self.conn().row(sql.as_str(), &[Arg::Uuid(id)]).await
    }

    /// Deletes one machine's row of a tag; true if there was one.
    async fn delete_tag(&mut self, table: TagTable, id: Uuid) -> Result<bool> {
        let sql = format!("DELETE FROM {} WHERE machine_id = $1", table.name());
        Ok(self.conn().execute(&sql, &[Arg::Uuid(id)]).await? > 0)
    }
}

from_columns! {
    AgentStarted { started_at: time, public_key: get }
    SshHostKey { key: get, first_seen_at: time }
    OsInstallationRequest { generation: get, request_raw: get }
    OsInstallationReport { generation: get, result: parsed, report_raw: get }
}
