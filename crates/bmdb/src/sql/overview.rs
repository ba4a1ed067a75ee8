//! What the web UI's overview page reads: the fleet counts over time (snapshots written by
//! the fleet statistics, a row per minute and series), work endings per minute and the most
//! frequent failure causes, both from the work history by its time index.

use chrono::{DateTime, Utc};

use super::{on_engine, Conn, DbTime, Dialects, Result};
use crate::model::{Process, WorkEvent};

const SNAPSHOT: Dialects = Dialects {
    postgres: "INSERT INTO fleet_counts_history (at, series, machines)
               VALUES (date_trunc('minute', now()), $1, $2) ON CONFLICT DO NOTHING",
    sqlite: "INSERT INTO fleet_counts_history (at, series, machines)
             VALUES (($3 / 60000000) * 60000000, $1, $2) ON CONFLICT DO NOTHING",
};

const ENDINGS_PER_MINUTE: Dialects = Dialects {
    postgres: "SELECT date_trunc('minute', at) AS minute, process, event, count(*) AS n
                 FROM work_history WHERE at > $1 AND event IN ('Finished', 'Failed')
                GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
    sqlite: "SELECT (at / 60000000) * 60000000 AS minute, process, event, count(*) AS n
               FROM work_history WHERE at > $1 AND event IN ('Finished', 'Failed')
              GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
};

/// Records `series` (name, machines) as this minute's snapshot unless another process did,
/// and forgets snapshots from before `keep_after`.
pub(crate) async fn record_snapshot(
    conn: &mut Conn,
    series: &[(&str, i64)],
    keep_after: DateTime<Utc>,
) -> Result<()> {
    on_engine!(conn, |c, e| {
        for (name, machines) in series {
            let q = sqlx::query(e.sql(&SNAPSHOT)).bind(*name).bind(*machines);
            e.with_now(q).execute(&mut *c).await?;
        }
        sqlx::query("DELETE FROM fleet_counts_history WHERE at < $1")
            .bind(DbTime(keep_after))
            .execute(c)
            .await?;
        Ok(())
    })
}

/// Snapshots after `after`, oldest first: (minute, series, machines).
pub(crate) async fn snapshots(
    conn: &mut Conn,
    after: DateTime<Utc>,
) -> Result<Vec<(DateTime<Utc>, String, i64)>> {
    let rows: Vec<(DbTime, String, i64)> = on_engine!(conn, |c, _| {
        sqlx::query_as(
            "SELECT at, series, machines FROM fleet_counts_history WHERE at > $1
              ORDER BY at, series",
        )
        .bind(DbTime(after))
        .fetch_all(c)
        .await?
    });
    Ok(rows.into_iter().map(|(t, s, n)| (t.0, s, n)).collect())
}

/// Finished and Failed entries per minute and process after `after`, oldest first.
pub(crate) async fn endings_per_minute(
    conn: &mut Conn,
    after: DateTime<Utc>,
) -> Result<Vec<(DateTime<Utc>, Process, WorkEvent, i64)>> {
    let rows: Vec<(DbTime, String, String, i64)> = on_engine!(conn, |c, e| {
        sqlx::query_as(e.sql(&ENDINGS_PER_MINUTE))
            .bind(DbTime(after))
            .fetch_all(c)
            .await?
    });
    rows.into_iter()
        .map(|(t, p, ev, n)| Ok((t.0, p.parse()?, ev.parse()?, n)))
        .collect()
}

/// The `limit` most frequent causes of Failed entries after `after`, most frequent first.
pub(crate) async fn top_failure_causes(
    conn: &mut Conn,
    after: DateTime<Utc>,
    limit: i64,
) -> Result<Vec<(String, i64)>> {
    let rows: Vec<(Option<String>, i64)> = on_engine!(conn, |c, _| {
        sqlx::query_as(
            "SELECT failed_cause, count(*) AS n FROM work_history
              WHERE at > $1 AND event = 'Failed'
              GROUP BY failed_cause ORDER BY n DESC, failed_cause LIMIT $2",
        )
        .bind(DbTime(after))
        .bind(limit)
        .fetch_all(c)
        .await?
    });
    Ok(rows
        .into_iter()
        .map(|(cause, n)| (cause.unwrap_or_default(), n))
        .collect())
}

/// Writes one snapshot point at any minute, to build a chart's history.
#[cfg(feature = "testing")]
pub(crate) async fn insert_snapshot_raw(
    conn: &mut Conn,
    at: DateTime<Utc>,
    series: &str,
    machines: i64,
) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(
            "INSERT INTO fleet_counts_history (at, series, machines) VALUES ($1, $2, $3)
             ON CONFLICT DO NOTHING",
        )
        .bind(DbTime(at))
        .bind(series)
        .bind(machines)
        .execute(c)
        .await?;
        Ok(())
    })
}
