//! What the web UI's overview page reads: the fleet counts over time (snapshots written by
//! the fleet statistics, a row per minute and series), work endings per minute and the most
//! frequent failure causes, both from the work history by its time index.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::engine::{from_columns, Arg, DbTime, Dialects, Result, Tx};
use crate::model::{Process, WorkEvent};
use crate::summary::FleetCounts;

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

impl Tx {
    /// Records the fleet counts as this minute's snapshot (unless another process already
    /// did) and forgets snapshots older than eight days.
    pub async fn record_fleet_snapshot(&mut self, counts: &FleetCounts) -> Result<()> {
        let keep_after = self.now().await? - chrono::Duration::days(8);
        for (name, machines) in counts.series() {
            let args = [Arg::Text(name), Arg::Int(machines), Arg::Now];
            self.conn().execute(&SNAPSHOT, &args).await?;
        }
        let forget = "DELETE FROM fleet_counts_history WHERE at < $1";
        self.conn()
            .execute(forget, &[Arg::Time(keep_after)])
            .await?;
        Ok(())
    }

    /// Fleet count snapshots of the last `span`, oldest first: (minute, series, machines).
    pub async fn fleet_snapshots(
        &mut self,
        span: chrono::Duration,
    ) -> Result<Vec<(DateTime<Utc>, String, i64)>> {
        let after = self.now().await? - span;
        let sql = "SELECT at, series, machines FROM fleet_counts_history WHERE at > $1
                    ORDER BY at, series";
        let rows: Vec<(DbTime, String, i64)> = self.conn().rows(sql, &[Arg::Time(after)]).await?;
        Ok(rows.into_iter().map(|(t, s, n)| (t.0, s, n)).collect())
    }

    /// Finished and Failed work per minute and process over the last `span`, oldest first.
    pub async fn work_endings_per_minute(
        &mut self,
        span: chrono::Duration,
    ) -> Result<Vec<(DateTime<Utc>, Process, WorkEvent, i64)>> {
        let after = self.now().await? - span;
        let rows: Vec<EndingsRow> = self
            .conn()
            .rows(&ENDINGS_PER_MINUTE, &[Arg::Time(after)])
            .await?;
        rows.into_iter()
            .map(|r| Ok((r.minute.0, r.process.parse()?, r.event.parse()?, r.n)))
            .collect()
    }

    /// The `limit` most frequent failure causes of the last `span`, with their counts.
    pub async fn top_failure_causes(
        &mut self,
        span: chrono::Duration,
        limit: i64,
    ) -> Result<Vec<(String, i64)>> {
        let after = self.now().await? - span;
        let sql = "SELECT failed_cause, count(*) AS n FROM work_history
                    WHERE at > $1 AND event = 'Failed'
                    GROUP BY failed_cause ORDER BY n DESC, failed_cause LIMIT $2";
        let rows: Vec<(Option<String>, i64)> = self
            .conn()
            .rows(sql, &[Arg::Time(after), Arg::Int(limit)])
            .await?;
        Ok(rows
            .into_iter()
            .map(|(cause, n)| (cause.unwrap_or_default(), n))
            .collect())
    }

    /// The machines that failed within `span`, with each cause they failed with: how often
    /// and when last; the most recent first, at most `limit` rows (the page that lists the
    /// machines of one cause shape filters these).
    pub async fn recent_failures(
        &mut self,
        span: chrono::Duration,
        limit: i64,
    ) -> Result<Vec<RecentFailure>> {
        let after = self.now().await? - span;
        let sql = "SELECT machine_id, COALESCE(failed_cause, '') AS cause,
                          count(*) AS failures, max(at) AS last
                     FROM work_history
                    WHERE at > $1 AND event = 'Failed'
                    GROUP BY machine_id, failed_cause ORDER BY last DESC, machine_id LIMIT $2";
        self.conn()
            .rows(sql, &[Arg::Time(after), Arg::Int(limit)])
            .await
    }

    /// Test support: writes a fleet-count snapshot point at any time (a chart's history).
    #[cfg(feature = "testing")]
    pub async fn insert_fleet_snapshot_raw(
        &mut self,
        at: DateTime<Utc>,
        series: &str,
        machines: i64,
    ) -> Result<()> {
        let sql = "INSERT INTO fleet_counts_history (at, series, machines) VALUES ($1, $2, $3)
                   ON CONFLICT DO NOTHING";
        let args = [Arg::Time(at), Arg::Text(series), Arg::Int(machines)];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }
}

/// A row of [`ENDINGS_PER_MINUTE`].
struct EndingsRow {
    minute: DbTime,
    process: String,
    event: String,
    n: i64,
}

super::engine::from_columns! {
    EndingsRow { minute: get, process: get, event: get, n: get }
}

from_columns! {
    RecentFailure { machine_id: get, cause: get, failures: get, last: time }
}

/// A machine's failures with one cause, within a span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecentFailure {
    /// The machine.
    pub machine_id: Uuid,
    /// The cause, as written.
    pub cause: String,
    /// How often it failed so.
    pub failures: i64,
    /// When last.
    pub last: DateTime<Utc>,
}
