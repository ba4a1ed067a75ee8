//! Every SQL statement of the BMDB, organised by concern, both engines side by side:
//!
//! - `schema.rs` — migrations' bookkeeping;
//! - `sessions.rs` — sessions and the one-statement agent heartbeat;
//! - `tags.rs` — machines and the facts about them;
//! - `claims.rs` — eligibility (SPEC §5) and claiming work (SPEC §4);
//! - `endings.rs` — finishing, failing and canceling work, backoffs and the audit history;
//! - `views.rs` — operators' read-only views and counts;
//! - `operator.rs` — operators' actions (maintenance, decommission) and their history;
//! - `overview.rs` — fleet counts over time, work endings per minute, top failure causes;
//! - `retention.rs` — pruning old history in bounded batches.
//!
//! A statement both engines accept is written once: [`on_engine!`] runs the same body on
//! either connection, [`Columns`] decodes a row the same way on both and [`DbTime`] stores a
//! time as each engine does (`timestamptz` on Postgres, integer microseconds on SQLite). Where
//! the texts differ — mostly Postgres' `now()` against SQLite's time bound at `BEGIN` — the two
//! texts stand next to each other in a [`Dialects`]. Statements one engine cannot express
//! (Postgres' data-modifying CTEs, SQLite's `PRAGMA`s) are functions per engine, side by side.
//!
//! The rest of the crate reaches this module through [`crate::Tx`] (every typed query, inside
//! a transaction), `db.rs` (migrations) and the two hot paths that run outside a BEGIN on
//! Postgres as one autocommitted statement: claims (`work.rs`) and agent heartbeats
//! (`session.rs`).

pub(crate) mod claims;
pub(crate) mod endings;
pub(crate) mod operator;
pub(crate) mod overview;
pub(crate) mod retention;
pub(crate) mod schema;
pub(crate) mod sessions;
pub(crate) mod tags;
pub(crate) mod views;

pub(crate) use views::StatusCounts;

use chrono::{DateTime, Utc};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgRow, PgTypeInfo, PgValueRef};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::sqlite::{SqliteArguments, SqliteRow, SqliteTypeInfo, SqliteValueRef};
use sqlx::{Database, Decode, Encode, Postgres, Row, Sqlite, Type};

use uuid::Uuid;

use crate::Error;

pub(crate) type Result<T> = std::result::Result<T, Error>;

/// A Postgres transaction as the typed queries use it.
pub(crate) type PgTx = sqlx::Transaction<'static, Postgres>;

/// A SQLite transaction plus its fixed notion of "now" (read once at `BEGIN`, like Postgres'
/// `now()`), in microseconds.
pub(crate) struct SqliteTx {
    pub(crate) tx: sqlx::Transaction<'static, Sqlite>,
    pub(crate) now: i64,
}

/// One open transaction on either engine.
pub(crate) enum Conn {
    Sqlite(SqliteTx),
    Postgres(PgTx),
}

/// A statement whose text differs between the engines, both texts side by side. Where the
/// Postgres text reads `now()`, the SQLite text takes one parameter more, last: the
/// transaction's time (see [`OnSqlite::with_now`]).
pub(crate) struct Dialects {
    pub(crate) postgres: &'static str,
    pub(crate) sqlite: &'static str,
}

impl Dialects {
    /// The text for `conn`'s engine.
    pub(crate) fn for_engine(&self, conn: &Conn) -> &'static str {
        match conn {
            Conn::Postgres(_) => self.postgres,
            Conn::Sqlite(_) => self.sqlite,
        }
    }
}

/// Runs `$body` on whichever engine `$conn` is, with `$c` its connection and `$e` an engine
/// handle ([`OnSqlite`] or [`OnPostgres`]) that picks a [`Dialects`] text and binds the
/// time. The body is compiled once per engine, so it is written once and checked twice.
macro_rules! on_engine {
    ($conn:expr, |$c:ident, $e:pat_param| $body:expr) => {
        match $conn {
            $crate::sql::Conn::Sqlite(t) => {
                let $e = $crate::sql::OnSqlite { now: t.now };
                let $c = &mut *t.tx;
                $body
            }
            $crate::sql::Conn::Postgres(t) => {
                let $e = $crate::sql::OnPostgres;
                let $c = &mut **t;
                $body
            }
        }
    };
}
pub(crate) use on_engine;

/// The SQLite side of [`on_engine!`].
pub(crate) struct OnSqlite {
    /// The transaction's time, microseconds.
    pub(crate) now: i64,
}

/// The Postgres side of [`on_engine!`].
pub(crate) struct OnPostgres;

impl OnSqlite {
    pub(crate) fn sql(&self, d: &Dialects) -> &'static str {
        d.sqlite
    }

    /// Binds the transaction's time as the last parameter.
    pub(crate) fn with_now<Q: BindNow>(&self, q: Q) -> Q {
        q.bind_now(self.now)
    }

    /// A span of time as SQLite's texts take it: microseconds, subtracted from a time.
    pub(crate) fn span(&self, d: std::time::Duration) -> i64 {
        secs_us(d.as_secs_f64())
    }
}

impl OnPostgres {
    pub(crate) fn sql(&self, d: &Dialects) -> &'static str {
        d.postgres
    }

    /// Nothing to bind: Postgres reads `now()` itself.
    pub(crate) fn with_now<Q>(&self, q: Q) -> Q {
        q
    }

    /// A span of time as Postgres' texts take it: seconds, for `make_interval(secs => …)`.
    pub(crate) fn span(&self, d: std::time::Duration) -> f64 {
        d.as_secs_f64()
    }
}

/// A SQLite query that can take the transaction's time as its next parameter.
pub(crate) trait BindNow {
    fn bind_now(self, now: i64) -> Self;
}

impl<'q> BindNow for Query<'q, Sqlite, SqliteArguments<'q>> {
    fn bind_now(self, now: i64) -> Self {
        self.bind(now)
    }
}

impl<'q, O> BindNow for QueryAs<'q, Sqlite, O, SqliteArguments<'q>> {
    fn bind_now(self, now: i64) -> Self {
        self.bind(now)
    }
}

impl<'q, O> BindNow for QueryScalar<'q, Sqlite, O, SqliteArguments<'q>> {
    fn bind_now(self, now: i64) -> Self {
        self.bind(now)
    }
}

/// A point in time as a column holds it: `timestamptz` on Postgres, integer microseconds since
/// the epoch (UTC) on SQLite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DbTime(pub(crate) DateTime<Utc>);

pub(crate) fn to_us(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(crate) fn from_us(us: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| Error::UnreadableValue {
        what: "time",
        problem: format!("{us} µs since the epoch is out of range"),
    })
}

/// Seconds as whole microseconds, for SQLite's integer times.
pub(crate) fn secs_us(secs: f64) -> i64 {
    (secs * 1e6).round() as i64
}

impl Type<Sqlite> for DbTime {
    fn type_info() -> SqliteTypeInfo {
        <i64 as Type<Sqlite>>::type_info()
    }
    fn compatible(ty: &SqliteTypeInfo) -> bool {
        <i64 as Type<Sqlite>>::compatible(ty)
    }
}

impl<'q> Encode<'q, Sqlite> for DbTime {
    fn encode_by_ref(
        &self,
        buf: &mut <Sqlite as Database>::ArgumentBuffer<'q>,
    ) -> std::result::Result<IsNull, BoxDynError> {
        <i64 as Encode<'q, Sqlite>>::encode(to_us(self.0), buf)
    }
}

impl<'r> Decode<'r, Sqlite> for DbTime {
    fn decode(value: SqliteValueRef<'r>) -> std::result::Result<Self, BoxDynError> {
        Ok(DbTime(from_us(<i64 as Decode<'r, Sqlite>>::decode(
            value,
        )?)?))
    }
}

impl Type<Postgres> for DbTime {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }
    fn compatible(ty: &PgTypeInfo) -> bool {
        <DateTime<Utc> as Type<Postgres>>::compatible(ty)
    }
}

impl<'q> Encode<'q, Postgres> for DbTime {
    fn encode_by_ref(
        &self,
        buf: &mut <Postgres as Database>::ArgumentBuffer<'q>,
    ) -> std::result::Result<IsNull, BoxDynError> {
        <DateTime<Utc> as Encode<'q, Postgres>>::encode_by_ref(&self.0, buf)
    }
}

impl<'r> Decode<'r, Postgres> for DbTime {
    fn decode(value: PgValueRef<'r>) -> std::result::Result<Self, BoxDynError> {
        Ok(DbTime(<DateTime<Utc> as Decode<'r, Postgres>>::decode(
            value,
        )?))
    }
}

/// A value both engines decode.
pub(crate) trait Decodes:
    for<'r> Decode<'r, Sqlite> + Type<Sqlite> + for<'r> Decode<'r, Postgres> + Type<Postgres>
{
}

impl<T> Decodes for T where
    T: for<'r> Decode<'r, Sqlite> + Type<Sqlite> + for<'r> Decode<'r, Postgres> + Type<Postgres>
{
}

/// A result row of either engine, read by column name, so each row shape is decoded once.
pub(crate) trait Columns {
    fn get<T: Decodes>(&self, column: &str) -> Result<T>;

    fn time(&self, column: &str) -> Result<DateTime<Utc>> {
        Ok(self.get::<DbTime>(column)?.0)
    }

    fn opt_time(&self, column: &str) -> Result<Option<DateTime<Utc>>> {
        Ok(self.get::<Option<DbTime>>(column)?.map(|t| t.0))
    }

    /// A text column naming a closed enumeration (process, provider, result …).
    fn parsed<T>(&self, column: &str) -> Result<T>
    where
        T: std::str::FromStr,
        Error: From<T::Err>,
    {
        Ok(self.get::<String>(column)?.parse()?)
    }

    /// Like [`Columns::parsed`] for a column that may be NULL.
    fn opt_parsed<T>(&self, column: &str) -> Result<Option<T>>
    where
        T: std::str::FromStr,
        Error: From<T::Err>,
    {
        Ok(match self.get::<Option<String>>(column)? {
            Some(s) => Some(s.parse()?),
            None => None,
        })
    }
}

impl Columns for PgRow {
    fn get<T: Decodes>(&self, column: &str) -> Result<T> {
        Ok(self.try_get(column)?)
    }
}

impl Columns for SqliteRow {
    fn get<T: Decodes>(&self, column: &str) -> Result<T> {
        Ok(self.try_get(column)?)
    }
}

/// A row type decoded alike on both engines, by column name: each row shape is decoded once.
pub(crate) trait FromColumns: Sized {
    fn from_columns(r: &impl Columns) -> Result<Self>;
}

/// Implements [`FromColumns`] for structs whose fields are read by name: `field: how`, with
/// `how` a method of [`Columns`] (`get`, `time`, `parsed`), reads the column named like the
/// field; `field: how("column")` one named otherwise.
macro_rules! from_columns {
    ($($ty:ident { $($field:ident: $how:ident $(($column:literal))?),+ $(,)? })+) => {
        $(
            impl $crate::sql::FromColumns for $ty {
                fn from_columns(r: &impl $crate::sql::Columns) -> $crate::sql::Result<Self> {
                    Ok($ty { $($field: r.$how([$($column,)? stringify!($field)][0])?,)+ })
                }
            }
        )+
    };
}
pub(crate) use from_columns;

/// The row `sql` selects for `key`, its one parameter (a primary key), if there is one.
pub(crate) async fn row_by_key<T: FromColumns>(
    conn: &mut Conn,
    sql: &'static str,
    key: Uuid,
) -> Result<Option<T>> {
    Ok(rows_by_key(conn, sql, key).await?.into_iter().next())
}

/// The rows `sql` selects for `key`, its one parameter, in the statement's order.
pub(crate) async fn rows_by_key<T: FromColumns>(
    conn: &mut Conn,
    sql: &'static str,
    key: Uuid,
) -> Result<Vec<T>> {
    on_engine!(conn, |c, _| {
        let rows = sqlx::query(sql).bind(key).fetch_all(c).await?;
        rows.iter().map(T::from_columns).collect()
    })
}

/// Parses the names of `(name, count)` rows (processes, providers).
pub(crate) fn parse_counts<T>(rows: Vec<(String, i64)>) -> Result<Vec<(T, i64)>>
where
    T: std::str::FromStr,
    Error: From<T::Err>,
{
    rows.into_iter().map(|(p, n)| Ok((p.parse()?, n))).collect()
}

/// Whether a database error is this SQLSTATE (e.g. `23503`, a foreign key violation).
pub(crate) fn is_sqlstate(e: &sqlx::Error, code: &str) -> bool {
    e.as_database_error().and_then(|d| d.code()).as_deref() == Some(code)
}
