//! Eligibility (design.md §5) and claiming work (design.md §4).
//!
//! One eligibility condition serves both engines; they differ in how it reads time (Postgres'
//! `now()` and intervals, SQLite's bound microseconds) and Postgres also chooses how its
//! `EXISTS` checks are planned ([`Shape`]). The claims themselves differ by design: Postgres
//! serves a batch of requests (`claim_batch.rs`) with one autocommitted statement that skips
//! rows other replicas hold, SQLite inside one `BEGIN IMMEDIATE` transaction that already
//! excludes every other writer.

use sqlx::postgres::PgArguments;
use sqlx::query::QueryAs;
use sqlx::sqlite::SqliteArguments;
use sqlx::{Acquire, PgConnection, Postgres, Sqlite};
use uuid::Uuid;

use super::engine::{
    is_sqlstate, secs_us, span_ago, Arg, Autocommit, Conn, Engine, Result, SqliteTx, Tx,
};
use super::heartbeat_writers::excused_ago;
use super::sessions;
use crate::claim_hints::{ClaimHints, HintKey};
use crate::eligibility::{exclusion_list, Retrieval};
use crate::metrics::{BmdbMetrics, ClaimSearch};
use crate::model::{Process, Processor, ProviderKind};
use crate::BarePhase;

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimOutcome {
    /// The session is gone or past its deadline.
    SessionExpired,
    /// No machine is eligible.
    Nothing,
    /// Machines were eligible, but every candidate was taken by a concurrent claimer.
    Conflict,
    /// The machine is locked for us; the backoff interval persisted by its last failure.
    Claimed {
        machine_id: Uuid,
        last_interval: Option<i64>,
    },
}

/// How a claim picks its machine. Only [`ClaimStrategy::SkipLocked`] is for production; the
/// upstream shape is kept as a benchmark baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClaimStrategy {
    /// Spread claimers over the candidates and skip rows other claimers hold (design.md §4).
    #[default]
    SkipLocked,
    /// Upstream's shape: take the first eligible machine and rely on the unique constraint.
    /// Benchmark baseline only.
    UpstreamFirstRow,
}

// ---------------------------------------------------------------------------------------------
// Eligibility

/// How the `EXISTS` checks of a Postgres eligibility condition are planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Each check stays a per-row index probe (`OFFSET 0` keeps Postgres from flattening it into
    /// a join). For queries that stop after a few rows: claims and limited listings. Without it
    /// the planner may pick merge anti-joins that read every started machine per claim.
    Probe,
    /// Checks may become hash or merge anti-joins. For queries that read every machine: counts.
    Join,
}

/// The engine an eligibility condition is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// Thresholds are parameters `$first` and `$first + 1`, in seconds.
    Postgres(Shape),
    /// The transaction's time is parameter `$first`; thresholds are `$first + 1` and
    /// `$first + 2`, in microseconds.
    Sqlite,
}

/// Whether an eligibility condition counts the work other processes hold on a machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkRows {
    /// A machine whose work a process of the exclusion set holds is not eligible: claims.
    Exclude,
    /// Work rows are left out: the holder of the machine's work asking whether the rest still
    /// holds ([`Tx::still_due`]).
    Ignore,
}

/// The WHERE condition over `machine_provided p` for `process` claiming by `retrieval`, its
/// parameters numbered from `$first` (see [`Flavor`]; bound by [`bind_pg`] / [`bind_sqlite`]).
pub(crate) fn eligibility(
    process: Process,
    retrieval: &Retrieval,
    first: usize,
    flavor: Flavor,
) -> String {
    condition(process, retrieval, first, flavor, WorkRows::Exclude)
}

/// [`eligibility`], counting work rows or not.
fn condition(
    process: Process,
    retrieval: &Retrieval,
    first: usize,
    flavor: Flavor,
    work_rows: WorkRows,
) -> String {
    let (fence, now) = match flavor {
        Flavor::Postgres(Shape::Probe) => (" OFFSET 0", "now()".to_string()),
        Flavor::Postgres(Shape::Join) => ("", "now()".to_string()),
        Flavor::Sqlite => ("", format!("${first}")),
    };
    // The time the `i`-th threshold reaches back to.
    let ago = |i: usize| match flavor {
        Flavor::Postgres(_) => format!("now() - make_interval(secs => ${}::float8)", first + i),
        Flavor::Sqlite => format!("${first} - ${}", first + 1 + i),
    };
    // The same for silence: from the start of a server's trouble, if one was going on
    // (`heartbeat_writers.rs`).
    let silent_since = |i: usize| match flavor {
        Flavor::Postgres(_) => excused_ago(Engine::Postgres, first + i, 0),
        Flavor::Sqlite => excused_ago(Engine::Sqlite, first + 1 + i, first),
    };
    let excluded = exclusion_list(process);
    let work = if excluded.is_empty() || work_rows == WorkRows::Ignore {
        String::new()
    } else {
        format!(
            "AND NOT EXISTS (SELECT 1 FROM work w WHERE w.machine_id = p.machine_id AND w.process IN ({excluded}){fence})"
        )
    };
    let common = format!(
        "p.provider = '{provider}' {work}
         AND NOT EXISTS (SELECT 1 FROM work_backoff b WHERE b.machine_id = p.machine_id
                         AND b.process = '{process}' AND b.until > {now}{fence})
         AND NOT EXISTS (SELECT 1 FROM machine_maintenance mm WHERE mm.machine_id = p.machine_id{fence})",
        provider = retrieval.provider().as_str(),
        process = process.as_str(),
    );
    match retrieval {
        Retrieval::AgentStart { .. } => format!(
            "NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id{fence})
             AND NOT EXISTS (SELECT 1 FROM machine_os_installation_request r
                             JOIN machine_os_installation_report o ON o.machine_id = r.machine_id
                             WHERE r.machine_id = p.machine_id AND o.generation = r.generation{fence})
             AND NOT EXISTS (SELECT 1 FROM machine_bare_metal bm WHERE bm.machine_id = p.machine_id
                             AND bm.phase NOT IN ({takeover}){fence})
             AND {common}",
            takeover = phase_list(&BarePhase::TAKEOVER),
        ),
        Retrieval::AgentRecovery { .. } => format!(
            "NOT EXISTS (SELECT 1 FROM machine_os_installation_request r
                             JOIN machine_os_installation_report o ON o.machine_id = r.machine_id
                             WHERE r.machine_id = p.machine_id AND o.generation = r.generation
                             AND o.result = 'Success'{fence})
             AND EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id AND (
                    (s.started_at < {never_beat}
                     AND NOT EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id{fence}))
                 OR EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id
                            AND h.heartbeat_at < {went_silent}{fence})){fence})
             AND NOT EXISTS (SELECT 1 FROM machine_bare_metal bm WHERE bm.machine_id = p.machine_id
                             AND bm.phase <> 'Done'{fence})
             AND {common}",
            never_beat = silent_since(0),
            went_silent = silent_since(1),
        ),
        Retrieval::BareMetal { .. } => format!(
            "EXISTS (SELECT 1 FROM machine_bare_metal bm WHERE bm.machine_id = p.machine_id AND (
                    bm.phase IN ('Bare', 'Inserting', 'StartingLive', 'Ejecting', 'StartingDisk')
                 OR (bm.phase = 'LiveBoot' AND (bm.phase_at < {live_boot} OR EXISTS (
                        SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id{fence})))
                 OR (bm.phase = 'Installing' AND (bm.phase_at < {install} OR EXISTS (
                        SELECT 1 FROM machine_os_installation_report o WHERE o.machine_id = p.machine_id
                        AND o.generation = bm.install_generation{fence})))
                 OR (bm.phase = 'DiskBoot' AND (bm.phase_at < {disk_boot} OR EXISTS (
                        SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id{fence}))))
                 {fence})
             AND {common}",
            live_boot = ago(0),
            install = ago(1),
            disk_boot = ago(2),
        ),
    }
}

/// SQL list literal of bare phases, e.g. `'LiveBoot', 'Done'`: values of a closed
/// enumeration, inlined like [`exclusion_list`]'s.
fn phase_list(phases: &[BarePhase]) -> String {
    phases
        .iter()
        .map(|p| format!("'{}'", p.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

type PgQueryAs<'q, O> = QueryAs<'q, Postgres, O, PgArguments>;
type SqliteQueryAs<'q, O> = QueryAs<'q, Sqlite, O, SqliteArguments<'q>>;

/// Binds a Postgres eligibility condition's parameters (see [`Flavor::Postgres`]).
fn bind_pg<'q, O>(q: PgQueryAs<'q, O>, retrieval: &Retrieval) -> PgQueryAs<'q, O> {
    thresholds(retrieval)
        .into_iter()
        .fold(q, |q, span| q.bind(span.as_secs_f64()))
}

/// The spans an eligibility condition reaches back by, in parameter order.
fn thresholds(retrieval: &Retrieval) -> Vec<std::time::Duration> {
    match retrieval {
        Retrieval::AgentStart { .. } => vec![],
        Retrieval::AgentRecovery { thresholds, .. } => vec![
            thresholds.no_heartbeat_after_start,
            thresholds.heartbeat_older_than,
        ],
        Retrieval::BareMetal { timeouts, .. } => {
            vec![timeouts.live_boot, timeouts.install, timeouts.disk_boot]
        }
    }
}

/// Binds a SQLite eligibility condition's parameters (see [`Flavor::Sqlite`]).
fn bind_sqlite<'q, O>(
    q: SqliteQueryAs<'q, O>,
    now: i64,
    retrieval: &Retrieval,
) -> SqliteQueryAs<'q, O> {
    thresholds(retrieval)
        .into_iter()
        .fold(q.bind(now), |q, span| q.bind(secs_us(span.as_secs_f64())))
}

impl Tx {
    /// The machine's claim count: bumped by every claim of it (and by `maintenance on`), so
    /// read while holding its work it is that work's fencing token, higher than any earlier
    /// holder's; 0 for a machine that does not exist.
    pub async fn claim_generation(&mut self, machine: Uuid) -> Result<u64> {
        let sql = "SELECT claim_count FROM machines WHERE machine_id = $1";
        let count: Option<i64> = self.conn().value(sql, &[Arg::Uuid(machine)]).await?;
        Ok(count.and_then(|c| u64::try_from(c).ok()).unwrap_or(0))
    }

    /// Machines `process` may claim under `retrieval`, in id order, at most `limit` (an
    /// operator's listing).
    pub async fn eligible_machines(
        &mut self,
        process: Process,
        retrieval: &Retrieval,
        limit: i64,
    ) -> Result<Vec<Uuid>> {
        match self.conn() {
            Conn::Postgres(c) => eligible_pg(c, process, retrieval, limit).await,
            Conn::Sqlite(c) => {
                let sql = eligible_sql(process, retrieval, Flavor::Sqlite);
                let q = sqlx::query_as::<_, (Uuid,)>(&sql).bind(limit);
                let rows = bind_sqlite(q, c.now, retrieval)
                    .fetch_all(&mut *c.tx)
                    .await?;
                Ok(rows.into_iter().map(|(id,)| id).collect())
            }
        }
    }

    /// Whether `machine` is still eligible for `process` under `retrieval`, apart from the
    /// work rows: asked by the holder of its work right before an act that cannot be undone
    /// (the recoverer's reset). Between a claim and that act the reason may have ended: a
    /// heartbeat recorded, a server's trouble reported that excuses the silence.
    pub(crate) async fn still_due(
        &mut self,
        machine: Uuid,
        process: Process,
        retrieval: &Retrieval,
    ) -> Result<bool> {
        let sql = |flavor| {
            format!(
                "SELECT 1 FROM machine_provided p WHERE p.machine_id = $1 AND {}",
                condition(process, retrieval, 2, flavor, WorkRows::Ignore)
            )
        };
        let row: Option<(i32,)> = match self.conn() {
            Conn::Postgres(c) => {
                let sql = sql(Flavor::Postgres(Shape::Probe));
                let q = sqlx::query_as(&sql).bind(machine);
                bind_pg(q, retrieval).fetch_optional(&mut **c).await?
            }
            Conn::Sqlite(c) => {
                let sql = sql(Flavor::Sqlite);
                let q = sqlx::query_as(&sql).bind(machine);
                bind_sqlite(q, c.now, retrieval)
                    .fetch_optional(&mut *c.tx)
                    .await?
            }
        };
        Ok(row.is_some())
    }

    /// How many machines [`Tx::eligible_machines`] would return without a limit (the loops'
    /// backlog gauges).
    pub async fn count_eligible(&mut self, process: Process, retrieval: &Retrieval) -> Result<i64> {
        let count = |flavor| {
            format!(
                "SELECT count(*) FROM machine_provided p WHERE {}",
                eligibility(process, retrieval, 1, flavor)
            )
        };
        let row: (i64,) = match self.conn() {
            Conn::Postgres(c) => {
                let sql = count(Flavor::Postgres(Shape::Join));
                bind_pg(sqlx::query_as(&sql), retrieval)
                    .fetch_one(&mut **c)
                    .await?
            }
            Conn::Sqlite(c) => {
                let sql = count(Flavor::Sqlite);
                bind_sqlite(sqlx::query_as(&sql), c.now, retrieval)
                    .fetch_one(&mut *c.tx)
                    .await?
            }
        };
        Ok(row.0)
    }

    /// The provider's machines whose agent was started (or that a recovery rebooted and
    /// whose agent is not back yet), and how many of them heartbeated within `fresh_within`:
    /// the recoverer's brake. Machines still being brought in have no agent to be silent, and
    /// are no evidence of a failing server or network.
    pub async fn count_heartbeating(
        &mut self,
        provider: ProviderKind,
        fresh_within: std::time::Duration,
    ) -> Result<(i64, i64)> {
        let fresh_after = span_ago(self.engine(), 2, 3);
        let sql = format!(
            "SELECT count(*), count(h.machine_id) FILTER (WHERE h.heartbeat_at > {fresh_after})
               FROM machine_provided p
               LEFT JOIN machine_agent_heartbeat h ON h.machine_id = p.machine_id
              WHERE p.provider = $1
                AND (EXISTS (SELECT 1 FROM machine_agent_started a
                              WHERE a.machine_id = p.machine_id)
                     OR EXISTS (SELECT 1 FROM machine_recovery r
                                 WHERE r.machine_id = p.machine_id))"
        );
        let args = [
            Arg::Text(provider.as_str()),
            Arg::Span(fresh_within),
            Arg::Now,
        ];
        let row: Option<(i64, i64)> = self.conn().row(&sql, &args).await?;
        Ok(row.unwrap_or((0, 0)))
    }

    /// Claims a machine for each of `sessions` (one request each; a session may appear more
    /// than once), in this SQLite write transaction (see [`claim_sqlite`]); the caller commits
    /// only if anything was claimed. One outcome per request, in order.
    pub(crate) async fn claim_sqlite(
        &mut self,
        sessions: &[Uuid],
        process: Process,
        retrieval: &Retrieval,
    ) -> Result<Vec<ClaimOutcome>> {
        match self.conn() {
            Conn::Sqlite(c) => {
                let mut outcomes = Vec::with_capacity(sessions.len());
                for session in sessions {
                    outcomes.push(claim_sqlite(c, *session, process, retrieval).await?);
                }
                Ok(outcomes)
            }
            Conn::Postgres(_) => unreachable!("Postgres claims run outside a transaction"),
        }
    }
}

fn eligible_sql(process: Process, retrieval: &Retrieval, flavor: Flavor) -> String {
    format!(
        "SELECT p.machine_id FROM machine_provided p WHERE {} ORDER BY p.machine_id LIMIT $1",
        eligibility(process, retrieval, 2, flavor)
    )
}

async fn eligible_pg(
    c: &mut PgConnection,
    process: Process,
    retrieval: &Retrieval,
    limit: i64,
) -> Result<Vec<Uuid>> {
    let sql = eligible_sql(process, retrieval, Flavor::Postgres(Shape::Probe));
    let q = sqlx::query_as::<_, (Uuid,)>(&sql).bind(limit);
    let rows = bind_pg(q, retrieval).fetch_all(&mut *c).await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

// ---------------------------------------------------------------------------------------------
// Claims on SQLite

/// Claims the first eligible machine from a random point. The transaction holds SQLite's write
/// lock from its first statement (`BEGIN IMMEDIATE`), so there are no concurrent claimers to
/// lose against; the caller commits only if it claimed.
async fn claim_sqlite(
    c: &mut SqliteTx,
    session: Uuid,
    process: Process,
    retrieval: &Retrieval,
) -> Result<ClaimOutcome> {
    if !sessions::alive_sqlite(c, session).await? {
        return Ok(ClaimOutcome::SessionExpired);
    }
    let Some(machine_id) = first_eligible_from_random_point(c, process, retrieval).await? else {
        return Ok(ClaimOutcome::Nothing);
    };
    let inserted = sqlx::query(
        "INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(machine_id)
    .bind(session)
    .bind(process.as_str())
    .execute(&mut *c.tx)
    .await?;
    if inserted.rows_affected() == 0 {
        return Ok(ClaimOutcome::Conflict);
    }
    sqlx::query("UPDATE machines SET claim_count = claim_count + 1 WHERE machine_id = $1")
        .bind(machine_id)
        .execute(&mut *c.tx)
        .await?;
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id)
         VALUES ($1, $2, 'Started', $3, $4)",
    )
    .bind(machine_id)
    .bind(process.as_str())
    .bind(c.now)
    .bind(session)
    .execute(&mut *c.tx)
    .await?;
    let last_interval = sqlx::query_scalar(LAST_INTERVAL)
        .bind(machine_id)
        .bind(process.as_str())
        .fetch_optional(&mut *c.tx)
        .await?;
    Ok(ClaimOutcome::Claimed {
        machine_id,
        last_interval,
    })
}

/// The backoff interval a machine's last failure of a process left.
const LAST_INTERVAL: &str =
    "SELECT last_interval_seconds FROM work_backoff WHERE machine_id = $1 AND process = $2";

/// SQLite's candidate search: the first eligible machine at (`>=`) or before (`<`) `$1`.
/// For the bare-metal rule it walks only the bare machines on their way (see [`claim_sql`]);
/// `CROSS JOIN` is how SQLite is told which table to walk.
pub(crate) fn sqlite_candidate_sql(process: Process, retrieval: &Retrieval, op: &str) -> String {
    let cond = eligibility(process, retrieval, 2, Flavor::Sqlite);
    match retrieval {
        Retrieval::BareMetal { .. } => format!(
            "SELECT p.machine_id FROM machine_bare_metal way
               CROSS JOIN machine_provided p ON p.machine_id = way.machine_id
              WHERE {open} AND way.machine_id {op} $1 AND {cond}
              ORDER BY way.machine_id LIMIT 1",
            open = open_bare("way"),
        ),
        _ => format!(
            "SELECT p.machine_id FROM machine_provided p WHERE p.machine_id {op} $1 AND {cond}
             ORDER BY p.machine_id LIMIT 1"
        ),
    }
}

/// The condition that `alias`'s bare machine is on its way, written exactly as the partial
/// index `machine_bare_metal_open` is (SQLite uses a partial index only for a query that
/// repeats its condition).
fn open_bare(alias: &str) -> String {
    let open: Vec<BarePhase> = BarePhase::ALL
        .iter()
        .copied()
        .filter(|p| p.is_open())
        .collect();
    format!("{alias}.phase IN ({})", phase_list(&open))
}

/// The first eligible machine at or after a random id, wrapping around. Starting at a random
/// point keeps a claim from re-scanning every machine processed before it (which would make a
/// pass over the fleet quadratic) and spreads retries of failing machines.
async fn first_eligible_from_random_point(
    c: &mut SqliteTx,
    process: Process,
    retrieval: &Retrieval,
) -> Result<Option<Uuid>> {
    let start = Uuid::new_v4();
    for op in [">=", "<"] {
        let sql = sqlite_candidate_sql(process, retrieval, op);
        let q = sqlx::query_as::<_, (Uuid,)>(&sql).bind(start);
        if let Some((id,)) = bind_sqlite(q, c.now, retrieval)
            .fetch_optional(&mut *c.tx)
            .await?
        {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------------
// Claims on Postgres

/// How many candidates a claim considers before giving up as conflicted. A batch of requests
/// considers two more per extra request.
const CLAIM_CANDIDATES: i64 = 32;

/// Index entries the window search looks at: room for the candidates of a whole batch. A
/// literal, not a parameter: the statement's cached generic plan must know it is small.
const CLAIM_WINDOW: i64 = 128;

/// Candidates a full search collects: one is claimed, the rest become hints.
const CLAIM_HINTS: i64 = 256;

/// Hints one claim checks. Few, so parallel claimers check different ones; those still
/// eligible but not claimed go back to the list.
const HINTS_PER_CLAIM: usize = 8;

/// What every claim of one `Bmdb` handle shares: leftover candidates and the metrics.
pub(crate) struct ClaimShared<'a> {
    pub(crate) hints: &'a ClaimHints,
    pub(crate) metrics: &'a BmdbMetrics,
    pub(crate) processor: Processor,
}

/// Where a claim statement looks for candidates.
#[derive(Debug, Clone)]
pub(crate) enum Search {
    /// Leftover candidates of an earlier full search.
    Given(Vec<Uuid>),
    /// The next `CLAIM_WINDOW` machines of the provider at or after the start point.
    Window(Uuid),
    /// Every machine of the provider, from the start point, wrapping around.
    Everywhere(Uuid),
}

impl Search {
    /// The `search` label of the claim search metric.
    fn label(&self) -> ClaimSearch {
        match self {
            Search::Given(_) => ClaimSearch::Hinted,
            Search::Window(_) => ClaimSearch::Window,
            Search::Everywhere(_) => ClaimSearch::Everywhere,
        }
    }

    /// Candidates the statement considers at most for `requests` requests; a full search keeps
    /// its extra ones as hints.
    fn limit(&self, requests: usize) -> i64 {
        let more = 2 * (requests.max(1) as i64 - 1);
        match self {
            Search::Given(_) | Search::Window(_) => CLAIM_CANDIDATES + more,
            Search::Everywhere(_) => CLAIM_HINTS + more,
        }
    }
}

/// Claims one eligible machine for each request with autocommitted statements, cheapest
/// search first, the requests of concurrent claimers served together (`claim_batch.rs`).
/// Leftover candidates of an earlier full search (`hints`) are checked first; then a small
/// window of the id index after a random point, checking each machine with index probes:
/// cheap when eligible machines are common, and it spreads parallel claimers over the fleet.
/// Requests neither serves go to the last statement, which searches the whole provider
/// (wrapping around) with a join-shaped query the planner can run as an anti-join, which stays
/// cheap when eligible machines are rare or absent, and leaves its other candidates as hints.
impl Autocommit {
    /// Claims a machine for each of `sessions` (one request each; a session may appear more
    /// than once); one outcome per request, in order. See [`claim_pg`].
    pub(crate) async fn claim(
        &mut self,
        sessions: &[Uuid],
        process: Process,
        retrieval: &Retrieval,
        strategy: ClaimStrategy,
        shared: &ClaimShared<'_>,
    ) -> Result<Vec<ClaimOutcome>> {
        match strategy {
            ClaimStrategy::SkipLocked => {
                claim_pg(self.conn(), sessions, process, retrieval, shared).await
            }
            ClaimStrategy::UpstreamFirstRow => {
                let mut outcomes = Vec::with_capacity(sessions.len());
                for session in sessions {
                    let mut tx = self.conn().begin().await?;
                    let outcome = claim_upstream(&mut tx, *session, process, retrieval).await?;
                    if matches!(outcome, ClaimOutcome::Claimed { .. }) {
                        tx.commit().await?;
                    } else {
                        tx.rollback().await?;
                    }
                    outcomes.push(outcome);
                }
                Ok(outcomes)
            }
        }
    }

    /// The executed query plan (`EXPLAIN ANALYZE`, one line a row) of a Postgres claim
    /// statement with its parameters bound as a claim of `session` binds them, in a transaction
    /// rolled back afterwards so the claim it makes is undone. For the query-plan test.
    #[cfg(feature = "testing")]
    pub(crate) async fn explain_claim(
        &mut self,
        session: Uuid,
        retrieval: &Retrieval,
        search: &Search,
        sql: &str,
    ) -> Result<Vec<String>> {
        let explain = format!("EXPLAIN (ANALYZE, TIMING OFF) {sql}");
        let mut tx = self.conn().begin().await?;
        let rows: Vec<(String,)> =
            bind_claim(sqlx::query_as(&explain), &[session], search, retrieval)
                .fetch_all(&mut *tx)
                .await?;
        tx.rollback().await?;
        Ok(rows.into_iter().map(|(line,)| line).collect())
    }
}

/// What one claim statement did for the requests it was given, and what it saw.
struct Stage {
    /// Per request, in order: claimed, or its session is gone; `None` while unserved.
    answered: Vec<Option<ClaimOutcome>>,
    /// A machine was locked but its lock insert lost a race (the constraint backstop).
    insert_lost: bool,
    /// Candidates the statement considered (up to its limit), counted only when it could not
    /// serve every live request (0 otherwise: counting would evaluate every candidate).
    candidates: i64,
    /// Eligible candidates it did not lock (for a hinted or full search).
    leftovers: Vec<Uuid>,
}

async fn claim_pg(
    conn: &mut PgConnection,
    sessions: &[Uuid],
    process: Process,
    retrieval: &Retrieval,
    shared: &ClaimShared<'_>,
) -> Result<Vec<ClaimOutcome>> {
    let mut round = ClaimRound {
        conn,
        sessions,
        outcomes: vec![None; sessions.len()],
        process,
        retrieval,
        shared,
    };
    let key = HintKey::new(process, retrieval);
    let hints = shared.hints;
    let hinted = hints.take(key, HINTS_PER_CLAIM * sessions.len());
    if !hinted.is_empty() {
        let stage = round.stage(Search::Given(hinted)).await?;
        hints.give_back(key, stage.leftovers);
    }
    let start = Uuid::new_v4();
    if round.unserved() {
        round.stage(Search::Window(start)).await?;
    }
    if round.unserved() {
        let search = Search::Everywhere(start);
        let limit = search.limit(sessions.len());
        let stage = round.stage(search).await?;
        // Requests still unserved: every candidate is being or has been claimed by others. If
        // the search was cut at its limit, more may lie beyond it; otherwise nothing is left.
        let rest = if stage.insert_lost || stage.candidates >= limit {
            ClaimOutcome::Conflict
        } else {
            ClaimOutcome::Nothing
        };
        if rest == ClaimOutcome::Nothing && round.unserved() {
            hints.clear(key);
        } else {
            hints.replace(key, stage.leftovers);
        }
        for outcome in round.outcomes.iter_mut().filter(|o| o.is_none()) {
            *outcome = Some(rest);
        }
    }
    Ok(round
        .outcomes
        .into_iter()
        .map(|o| o.unwrap_or(ClaimOutcome::Nothing))
        .collect())
}

/// One batch of claim requests on its way through the searches, widest last.
struct ClaimRound<'a, 'c> {
    conn: &'c mut PgConnection,
    sessions: &'a [Uuid],
    /// Per request: claimed, or its session is gone; `None` while unserved.
    outcomes: Vec<Option<ClaimOutcome>>,
    process: Process,
    retrieval: &'a Retrieval,
    shared: &'a ClaimShared<'a>,
}

impl ClaimRound<'_, '_> {
    fn unserved(&self) -> bool {
        self.outcomes.iter().any(Option::is_none)
    }

    /// Runs one claim statement for the requests still unanswered, answering those it served
    /// (or whose session is gone).
    async fn stage(&mut self, search: Search) -> Result<Stage> {
        let pending: Vec<usize> = (0..self.sessions.len())
            .filter(|i| self.outcomes[*i].is_none())
            .collect();
        let asking: Vec<Uuid> = pending.iter().map(|i| self.sessions[*i]).collect();
        let label = search.label();
        let stage =
            claim_statement(self.conn, &asking, self.process, self.retrieval, search).await?;
        let mut claimed = false;
        for (i, answer) in pending.into_iter().zip(&stage.answered) {
            claimed |= matches!(answer, Some(ClaimOutcome::Claimed { .. }));
            self.outcomes[i] = *answer;
        }
        let shared = self.shared;
        shared
            .metrics
            .claim_search(shared.processor, self.process, label, claimed);
        Ok(stage)
    }
}

/// How many requests one claim statement serves. A lone request (a worker that claimed with
/// no concurrent claimer of its loop: the common case on a quiet fleet) needs neither the
/// numbering of the requests nor the pairing of machines with them; without them the
/// statement is about a tenth cheaper (bench/README.md). The statement is otherwise the same
/// text, parameters and result rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Requests {
    /// One request: `$1` holds one session.
    One,
    /// A batch: `$1` holds the sessions in request order (one may appear more than once).
    Many,
}

impl Requests {
    /// The statement form for the requests in `sessions`.
    fn of(sessions: &[Uuid]) -> Self {
        if sessions.len() == 1 {
            Requests::One
        } else {
            Requests::Many
        }
    }
}

/// The candidates a claim statement considers for `search` (see [`claim_sql`]): parameters
/// `$2` (the start point or the given ids), `$3` (the limit), the thresholds from `$4`.
fn candidates_sql(process: Process, retrieval: &Retrieval, search: &Search) -> String {
    let provider = retrieval.provider().as_str();
    let probe = Flavor::Postgres(Shape::Probe);
    match search {
        Search::Given(_) => {
            let cond = eligibility(process, retrieval, 4, probe);
            format!(
                "SELECT p.machine_id FROM machine_provided p
                 WHERE p.machine_id = ANY($2::uuid[]) AND {cond} ORDER BY p.machine_id LIMIT $3"
            )
        }
        Search::Window(_) => {
            let cond = eligibility(process, retrieval, 4, probe);
            format!(
                "SELECT p.machine_id FROM (
                    SELECT * FROM machine_provided WHERE provider = '{provider}' AND machine_id >= $2
                    ORDER BY machine_id LIMIT {CLAIM_WINDOW}) p
                 WHERE {cond} ORDER BY p.machine_id LIMIT $3"
            )
        }
        Search::Everywhere(_) => match retrieval {
            // Few bare machines are on their way at any time, and any number may be done: the
            // search walks the open ones (a partial index), each looked up by id and probed.
            // The lateral lookup is fenced so that it stays a probe per open machine rather
            // than a join that reads the whole fleet.
            Retrieval::BareMetal { .. } => {
                let cond = eligibility(process, retrieval, 4, probe);
                let half = |op: &str| {
                    format!(
                        "SELECT p.machine_id FROM machine_bare_metal way,
                           LATERAL (SELECT machine_id, provider FROM machine_provided
                                    WHERE machine_id = way.machine_id OFFSET 0) p
                          WHERE {open} AND way.machine_id {op} $2 AND {cond}
                          ORDER BY way.machine_id LIMIT $3",
                        open = open_bare("way"),
                    )
                };
                format!("({}) UNION ALL ({}) LIMIT $3", half(">="), half("<"))
            }
            _ => {
                let cond = eligibility(process, retrieval, 4, Flavor::Postgres(Shape::Join));
                format!(
                    "(SELECT p.machine_id FROM machine_provided p
                      WHERE p.machine_id >= $2 AND {cond} ORDER BY p.machine_id LIMIT $3)
                     UNION ALL
                     (SELECT p.machine_id FROM machine_provided p
                      WHERE p.machine_id < $2 AND {cond} ORDER BY p.machine_id LIMIT $3)
                     LIMIT $3"
                )
            }
        },
    }
}

/// The text of one claim statement (see [`claim_statement`]). Parameters: `$1` the sessions
/// of the requests, in order, `$2` the start point or the given ids, `$3` the candidate
/// limit, then the eligibility thresholds from `$4`.
pub(crate) fn claim_sql(
    process: Process,
    retrieval: &Retrieval,
    search: &Search,
    requests: Requests,
) -> String {
    let candidates = candidates_sql(process, retrieval, search);
    let leftovers = match search {
        Search::Window(_) => "NULL::uuid[]",
        Search::Given(_) | Search::Everywhere(_) => {
            "(SELECT array_agg(machine_id) FROM cand
              WHERE machine_id NOT IN (SELECT machine_id FROM locked))"
        }
    };
    // The requests, numbered; the live ones numbered again among themselves (`n`); how many
    // machines to lock; and how the `n`-th locked machine goes to the `n`-th live request.
    let (req, live_n, lock_limit, pairing) = match requests {
        Requests::One => (
            "SELECT ($1::uuid[])[1] AS session_id, 1::int8 AS ord",
            "1::int8",
            "AND EXISTS (SELECT 1 FROM live) LIMIT 1",
            "CROSS JOIN locked l",
        ),
        Requests::Many => (
            "SELECT r.session_id, r.ord FROM unnest($1::uuid[]) WITH ORDINALITY AS r(session_id, ord)",
            "row_number() OVER (ORDER BY req.ord)",
            "LIMIT (SELECT count(*) FROM live)",
            "JOIN (SELECT machine_id, row_number() OVER (ORDER BY machine_id) AS n FROM locked) l
              ON l.n = live.n",
        ),
    };
    let proc = process.as_str();
    format!(
        "WITH req AS (
            {req}),
         live AS (
            SELECT req.session_id, req.ord, {live_n} AS n
            FROM req JOIN sessions s ON s.session_id = req.session_id AND s.deadline > now()),
         cand AS ({candidates}),
         locked AS (
            SELECT m.machine_id FROM cand
            JOIN machines seen ON seen.machine_id = cand.machine_id
            JOIN machines m ON m.machine_id = cand.machine_id
            WHERE m.claim_count = seen.claim_count
            {lock_limit} FOR NO KEY UPDATE OF m SKIP LOCKED),
         paired AS (
            SELECT live.ord, live.session_id, l.machine_id FROM live
            {pairing}),
         ins AS (
            INSERT INTO work (machine_id, session_id, process)
            SELECT machine_id, session_id, '{proc}' FROM paired
            ON CONFLICT DO NOTHING RETURNING machine_id),
         bump AS (
            UPDATE machines SET claim_count = claim_count + 1
            WHERE machine_id IN (SELECT machine_id FROM ins)),
         hist AS (
            INSERT INTO work_history (machine_id, process, event, at, session_id)
            SELECT paired.machine_id, '{proc}', 'Started', now(), paired.session_id
            FROM paired JOIN ins ON ins.machine_id = paired.machine_id)
         SELECT live.ord IS NOT NULL,
                ins.machine_id,
                b.last_interval_seconds,
                (SELECT count(*) FROM locked) > (SELECT count(*) FROM ins),
                CASE WHEN (SELECT count(*) FROM locked) < (SELECT count(*) FROM live)
                     THEN (SELECT count(*) FROM cand) ELSE 0 END,
                CASE WHEN req.ord = 1 THEN {leftovers} END
         FROM req
         LEFT JOIN live ON live.ord = req.ord
         LEFT JOIN paired ON paired.ord = req.ord
         LEFT JOIN ins ON ins.machine_id = paired.machine_id
         LEFT JOIN work_backoff b ON b.machine_id = ins.machine_id AND b.process = '{proc}'
         ORDER BY req.ord"
    )
}

/// Binds a claim statement's parameters (see [`claim_sql`]).
fn bind_claim<'q, O>(
    q: PgQueryAs<'q, O>,
    sessions: &[Uuid],
    search: &Search,
    retrieval: &Retrieval,
) -> PgQueryAs<'q, O> {
    let q = q.bind(sessions.to_vec());
    let q = match search {
        Search::Given(ids) => q.bind(ids.clone()),
        Search::Window(start) | Search::Everywhere(start) => q.bind(*start),
    };
    bind_pg(q.bind(search.limit(sessions.len())), retrieval)
}

/// One claim statement for a batch of requests: which requests' sessions are alive;
/// candidates evaluated lazily until as many lock as there are live requests; a `SKIP LOCKED`
/// row lock that also skips machines claimed since our snapshot (their `claim_count` moved on,
/// and READ COMMITTED re-checks the condition against the newest version of the locked row
/// while `seen` keeps the snapshot's); each locked machine paired with one live request; the
/// lock inserts (a lost race yields no row instead of an error); Started history; the previous
/// backoff intervals. Also returns, for a full or hinted search, the eligible candidates it
/// did not lock.
async fn claim_statement(
    conn: &mut PgConnection,
    sessions: &[Uuid],
    process: Process,
    retrieval: &Retrieval,
    search: Search,
) -> Result<Stage> {
    type ClaimRow = (
        bool,
        Option<Uuid>,
        Option<i64>,
        bool,
        i64,
        Option<Vec<Uuid>>,
    );
    let sql = claim_sql(process, retrieval, &search, Requests::of(sessions));
    // A session row deleted (garbage-collected) after the statement's snapshot saw it alive
    // fails the lock insert's foreign key check; the next statement's snapshot no longer sees
    // it alive, so the statement is run again, a bounded number of times.
    let mut attempts = 0;
    let rows = loop {
        let rows = bind_claim(
            sqlx::query_as::<_, ClaimRow>(&sql),
            sessions,
            &search,
            retrieval,
        )
        .fetch_all(&mut *conn)
        .await;
        match rows {
            Err(e) if is_sqlstate(&e, "23503") && attempts < 3 => attempts += 1,
            other => break other?,
        }
    };
    let mut stage = Stage {
        answered: Vec::with_capacity(rows.len()),
        insert_lost: false,
        candidates: 0,
        leftovers: Vec::new(),
    };
    for (alive, machine, last_interval, insert_lost, candidates, leftovers) in rows {
        stage.answered.push(match machine {
            Some(machine_id) => Some(ClaimOutcome::Claimed {
                machine_id,
                last_interval,
            }),
            None if !alive => Some(ClaimOutcome::SessionExpired),
            None => None,
        });
        stage.insert_lost = insert_lost;
        stage.candidates = candidates;
        if let Some(leftovers) = leftovers {
            stage.leftovers = leftovers;
        }
    }
    Ok(stage)
}

/// Upstream's claim shape, kept only as a benchmark baseline: first eligible row, plain insert,
/// and a unique violation as the conflict signal.
async fn claim_upstream(
    c: &mut PgConnection,
    session: Uuid,
    process: Process,
    retrieval: &Retrieval,
) -> Result<ClaimOutcome> {
    if !sessions::alive_pg(c, session).await? {
        return Ok(ClaimOutcome::SessionExpired);
    }
    let ids = eligible_pg(c, process, retrieval, 1).await?;
    let Some(machine_id) = ids.first().copied() else {
        return Ok(ClaimOutcome::Nothing);
    };
    let inserted =
        sqlx::query("INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3)")
            .bind(machine_id)
            .bind(session)
            .bind(process.as_str())
            .execute(&mut *c)
            .await;
    match inserted {
        Ok(_) => {}
        Err(e) if is_sqlstate(&e, "23505") => return Ok(ClaimOutcome::Conflict),
        Err(e) => return Err(e.into()),
    }
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id)
         VALUES ($1, $2, 'Started', now(), $3)",
    )
    .bind(machine_id)
    .bind(process.as_str())
    .bind(session)
    .execute(&mut *c)
    .await?;
    let last_interval = sqlx::query_scalar(LAST_INTERVAL)
        .bind(machine_id)
        .bind(process.as_str())
        .fetch_optional(&mut *c)
        .await?;
    Ok(ClaimOutcome::Claimed {
        machine_id,
        last_interval,
    })
}

/// Every claim statement variant of each named (process, rule) pair, for the snapshot test
/// and the query-plan test: Postgres' three searches, each for a batch and for a lone request,
/// and SQLite's two candidate queries.
#[cfg(feature = "testing")]
pub(crate) fn claim_statement_variants(
    rules: &[(&str, Process, Retrieval)],
) -> Vec<(String, Process, Retrieval, Search, String)> {
    let mut out = Vec::new();
    for &(rule, process, retrieval) in rules {
        let start = Uuid::nil();
        for (name, search) in [
            ("hinted", Search::Given(vec![start])),
            ("window", Search::Window(start)),
            ("everywhere", Search::Everywhere(start)),
        ] {
            for (requests, served) in [(Requests::Many, "batch"), (Requests::One, "lone")] {
                let sql = claim_sql(process, &retrieval, &search, requests);
                out.push((
                    format!("postgres {rule} {name}, {served}"),
                    process,
                    retrieval,
                    search.clone(),
                    sql,
                ));
            }
        }
        for (name, op) in [("from start", ">="), ("before start", "<")] {
            let sql = sqlite_candidate_sql(process, &retrieval, op);
            let search = Search::Window(start);
            out.push((
                format!("sqlite {rule} {name}"),
                process,
                retrieval,
                search,
                sql,
            ));
        }
    }
    out
}
