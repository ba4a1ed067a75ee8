//! What the BMaaS servers could not record (design.md §12 as amended in ARCHITECTURE.md, "A
//! machine is silent only if it was silent"): each server's report of until when every
//! heartbeat it received was recorded in time, and the windows of its troubles that ended.
//! The recoverer's claims read both (`claims.rs`, [`excused_ago`]).

use std::time::Duration;

use uuid::Uuid;

use super::engine::{from_columns, span_ago, Arg, Dialects, Engine, Result, Tx};
use crate::model::{
    stored_cause, HeartbeatTrouble, HeartbeatWriter, WriterReport, WriterState, WRITER_STALE,
};

/// How long an ended trouble's window is kept for operators; stopped servers' rows older than
/// this go too. Written when a trouble ends, so the table stays bounded without a collector.
const KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// A report: the writer's row says it is clean now.
const REPORT_CLEAN: Dialects = Dialects {
    postgres: "INSERT INTO heartbeat_writers (writer_id, component, clean_at, reported_at, backlog, refused)
               VALUES ($1, $2, now(), now(), $3, $4)
               ON CONFLICT (writer_id) DO UPDATE SET clean_at = now(), reported_at = now(),
                   backlog = excluded.backlog, refused = excluded.refused",
    sqlite: "INSERT INTO heartbeat_writers (writer_id, component, clean_at, reported_at, backlog, refused)
             VALUES ($1, $2, $5, $5, $3, $4)
             ON CONFLICT (writer_id) DO UPDATE SET clean_at = $5, reported_at = $5,
                 backlog = excluded.backlog, refused = excluded.refused",
};

/// A report in trouble since `$5` ago: the clean point never moves forward while it lasts.
const REPORT_TROUBLE: Dialects = Dialects {
    postgres: "INSERT INTO heartbeat_writers (writer_id, component, clean_at, reported_at, backlog, refused)
               VALUES ($1, $2, now() - make_interval(secs => $5), now(), $3, $4)
               ON CONFLICT (writer_id) DO UPDATE SET
                   clean_at = LEAST(heartbeat_writers.clean_at, excluded.clean_at), reported_at = now(),
                   backlog = excluded.backlog, refused = excluded.refused",
    sqlite: "INSERT INTO heartbeat_writers (writer_id, component, clean_at, reported_at, backlog, refused)
             VALUES ($1, $2, $6 - $5, $6, $3, $4)
             ON CONFLICT (writer_id) DO UPDATE SET
                 clean_at = MIN(heartbeat_writers.clean_at, excluded.clean_at), reported_at = $6,
                 backlog = excluded.backlog, refused = excluded.refused",
};

/// An ended trouble's window: from the writer's clean point (or `$2` ago, if earlier) to `$3`
/// ago. Written before the row says clean again.
const KEEP_WINDOW: Dialects = Dialects {
    postgres: "INSERT INTO heartbeat_troubles (writer_id, started_at, ended_at, refused, cause)
               SELECT $1, LEAST(now() - make_interval(secs => $2),
                                COALESCE((SELECT clean_at FROM heartbeat_writers WHERE writer_id = $1), now())),
                      now() - make_interval(secs => $3), $4, $5",
    sqlite: "INSERT INTO heartbeat_troubles (writer_id, started_at, ended_at, refused, cause)
             SELECT $1, MIN($6 - $2,
                            COALESCE((SELECT clean_at FROM heartbeat_writers WHERE writer_id = $1), $6)),
                    $6 - $3, $4, $5",
};

/// What is older than [`KEEP`]: ended troubles' windows, and rows of servers that stopped
/// without saying so (table, time column).
const OLD: [(&str, &str); 2] = [
    ("heartbeat_troubles", "ended_at"),
    ("heartbeat_writers", "reported_at"),
];

const FORGET: &str = "DELETE FROM heartbeat_writers WHERE writer_id = $1";

const WRITERS: &str = "SELECT writer_id, clean_at, reported_at, backlog, refused
                         FROM heartbeat_writers ORDER BY writer_id";

#[cfg(feature = "testing")]
const AGE_WRITERS: Dialects = Dialects {
    postgres: "UPDATE heartbeat_writers SET clean_at = clean_at - make_interval(secs => $1),
                                           reported_at = reported_at - make_interval(secs => $1)",
    sqlite: "UPDATE heartbeat_writers SET clean_at = clean_at - $1, reported_at = reported_at - $1",
};

#[cfg(feature = "testing")]
const AGE_TROUBLES: Dialects = Dialects {
    postgres: "UPDATE heartbeat_troubles SET started_at = started_at - make_interval(secs => $1),
                                            ended_at = ended_at - make_interval(secs => $1)",
    sqlite: "UPDATE heartbeat_troubles SET started_at = started_at - $1, ended_at = ended_at - $1",
};

const RECENT_TROUBLES: &str = "SELECT writer_id, started_at, ended_at, refused, cause
                                 FROM heartbeat_troubles ORDER BY ended_at DESC LIMIT $1";

impl Tx {
    /// Records a server's report: its row, and the window of a trouble that ended.
    pub async fn report_heartbeat_writer(&mut self, report: &WriterReport) -> Result<()> {
        let conn = self.conn();
        let (id, component) = (Arg::Uuid(report.writer_id), Arg::Text(&report.component));
        let counts = [Arg::Int(report.backlog), Arg::Int(report.refused)];
        match &report.state {
            WriterState::Clean => {
                let args = [id, component, counts[0], counts[1], Arg::Now];
                conn.execute(&REPORT_CLEAN, &args).await?;
            }
            WriterState::Trouble { since } => {
                let args = [
                    id,
                    component,
                    counts[0],
                    counts[1],
                    Arg::Span(*since),
                    Arg::Now,
                ];
                conn.execute(&REPORT_TROUBLE, &args).await?;
            }
            WriterState::Ended {
                since,
                last,
                refused,
                cause,
            } => {
                let cause = stored_cause(cause);
                let window = [
                    id,
                    Arg::Span(*since),
                    Arg::Span(*last),
                    Arg::Int(*refused),
                    Arg::Text(&cause),
                    Arg::Now,
                ];
                conn.execute(&KEEP_WINDOW, &window).await?;
                let args = [id, component, counts[0], counts[1], Arg::Now];
                conn.execute(&REPORT_CLEAN, &args).await?;
                let before = span_ago(conn.engine(), 1, 2);
                for (table, column) in OLD {
                    let forget = format!("DELETE FROM {table} WHERE {column} < {before}");
                    conn.execute(&forget, &[Arg::Span(KEEP), Arg::Now]).await?;
                }
            }
        }
        Ok(())
    }

    /// Forgets a server that stops gracefully: it recorded or refused everything it received.
    pub async fn forget_heartbeat_writer(&mut self, writer_id: Uuid) -> Result<()> {
        self.conn().execute(FORGET, &[Arg::Uuid(writer_id)]).await?;
        Ok(())
    }

    /// Every server's last report.
    pub async fn heartbeat_writers(&mut self) -> Result<Vec<HeartbeatWriter>> {
        self.conn().rows(WRITERS, &[]).await
    }

    /// Moves every server report and trouble window `by` into the past, as if that time had
    /// passed without reports.
    #[cfg(feature = "testing")]
    pub async fn age_heartbeat_writers(&mut self, by: Duration) -> Result<()> {
        let conn = self.conn();
        conn.execute(&AGE_WRITERS, &[Arg::Span(by)]).await?;
        conn.execute(&AGE_TROUBLES, &[Arg::Span(by)]).await?;
        Ok(())
    }

    /// The `limit` troubles that ended last, newest first.
    pub async fn recent_heartbeat_troubles(&mut self, limit: i64) -> Result<Vec<HeartbeatTrouble>> {
        self.conn().rows(RECENT_TROUBLES, &[Arg::Int(limit)]).await
    }
}

/// The time `span` (parameter `$span`) before the moment since which servers' troubles excuse
/// agents' silence, as `engine` writes it: the transaction's time, or the start of the
/// earliest trouble that was going on at any time within `span` before it, if earlier. A
/// silence that began less than `span` before a server's trouble started is no evidence the
/// machine stopped: its heartbeats may have been the ones refused. SQLite reads the time from
/// parameter `$now`.
///
/// A trouble is going on within the span if its window ended within it, if a server reports
/// it as ongoing, or if a server stopped reporting (it may have lost what it received since
/// its clean point) less than `span` plus [`WRITER_STALE`] ago.
pub(crate) fn excused_ago(engine: Engine, span: usize, now: usize) -> String {
    let stale = WRITER_STALE.as_secs();
    match engine {
        Engine::Postgres => format!(
            "LEAST(now(), COALESCE((SELECT MIN(x.since) FROM (
                 SELECT started_at AS since FROM heartbeat_troubles
                  WHERE ended_at >= now() - make_interval(secs => ${span}::float8)
                 UNION ALL
                 SELECT clean_at FROM heartbeat_writers
                  WHERE (clean_at < reported_at OR reported_at < now() - interval '{stale} seconds')
                    AND reported_at >= now() - make_interval(secs => ${span}::float8) - interval '{stale} seconds'
             ) x), now())) - make_interval(secs => ${span}::float8)"
        ),
        Engine::Sqlite => {
            let stale = stale * 1_000_000;
            format!(
                "MIN(${now}, COALESCE((SELECT MIN(x.since) FROM (
                     SELECT started_at AS since FROM heartbeat_troubles
                      WHERE ended_at >= ${now} - ${span}
                     UNION ALL
                     SELECT clean_at FROM heartbeat_writers
                      WHERE (clean_at < reported_at OR reported_at < ${now} - {stale})
                        AND reported_at >= ${now} - ${span} - {stale}
                 ) x), ${now})) - ${span}"
            )
        }
    }
}

from_columns! {
    HeartbeatWriter {
        writer_id: get, backlog: get, refused: get, in_doubt: time_range("clean_at..reported_at")
    }
    HeartbeatTrouble {
        writer_id: get, window: time_range("started_at..ended_at"), refused: get, cause: get
    }
}
