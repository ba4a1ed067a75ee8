//! How a statement runs on either engine, written once: [`Tx`], the one door to the database
//! for the rest of the crate, and the statement runner every typed query goes through.
//!
//! A statement is a text — the same on both engines, or the two texts side by side in a
//! [`Dialects`] — and its parameters as [`Arg`]s, which say what a value *is* (a time, a span,
//! the transaction's own time) so that each engine binds it as it stores it: `timestamptz`
//! and `make_interval` seconds on Postgres, integer microseconds on SQLite. [`Conn`]'s methods
//! match on the engine once, bind, run and decode; rows decode by column name through
//! [`FromColumns`], so each row shape is decoded once for both engines. Nothing here is a
//! macro: a reader and a debugger step from a query into the one `match` that runs it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArguments, PgRow, PgTypeInfo, PgValueRef};
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteRow, SqliteTypeInfo, SqliteValueRef};
use sqlx::{Database, Decode, Encode, Postgres, Row, Sqlite, Type};
use uuid::Uuid;

use crate::Error;

/// The future a transaction body returns; see [`crate::Bmdb::transact`].
pub type TxFuture<'t, T> = BoxFuture<'t, std::result::Result<T, Error>>;

pub(crate) type Result<T> = std::result::Result<T, Error>;

/// A Postgres transaction as the typed queries use it.
pub(crate) type PgTx = sqlx::Transaction<'static, Postgres>;

/// A SQLite transaction plus its fixed notion of "now" (read once at `BEGIN`, like Postgres'
/// `now()`), in microseconds.
pub(crate) struct SqliteTx {
    pub(crate) tx: SqliteTxConn,
    pub(crate) now: i64,
    /// A write transaction's turn at the one writer (`writer_turns.rs`), given up when the
    /// transaction ends; `None` for a read.
    pub(crate) _turn: Option<crate::writer_turns::WriterTurn>,
}

/// A pooled SQLite connection inside a transaction begun with a plain `BEGIN`, and ended
/// with a plain `COMMIT` or `ROLLBACK`. A connection whose transaction did not end cleanly
/// (its COMMIT or ROLLBACK failed, as on a full disk, or it was dropped unfinished) is closed
/// rather than returned to the pool: closing rolls back whatever SQLite still holds, and the
/// pool opens a fresh connection. (sqlx's own `Transaction` returns such a connection with
/// its transaction still counted, and every later BEGIN on it fails until the process
/// restarts.)
pub(crate) struct SqliteTxConn {
    conn: sqlx::pool::PoolConnection<Sqlite>,
    open: bool,
}

impl SqliteTxConn {
    /// Begins a transaction on `conn` with `begin` (`BEGIN` or `BEGIN IMMEDIATE`).
    pub(crate) fn begin(
        conn: sqlx::pool::PoolConnection<Sqlite>,
        begin: &'static str,
    ) -> BoxFuture<'static, std::result::Result<SqliteTxConn, sqlx::Error>> {
        Box::pin(async move {
            let mut tx = SqliteTxConn { conn, open: true };
            run_plain(&mut tx.conn, begin).await?;
            Ok(tx)
        })
    }

    /// Ends the transaction with `statement` (`COMMIT` or `ROLLBACK`); after a failed COMMIT
    /// a ROLLBACK is tried, and the connection is closed either way.
    fn end(
        mut self,
        statement: &'static str,
    ) -> BoxFuture<'static, std::result::Result<(), sqlx::Error>> {
        Box::pin(async move {
            let ended = run_plain(&mut self.conn, statement).await;
            if ended.is_ok() {
                self.return_to_pool();
            } else if statement != "ROLLBACK" {
                let _ = run_plain(&mut self.conn, "ROLLBACK").await;
            }
            ended
        })
    }
}

/// Runs one statement without parameters on `conn`.
fn run_plain<'c>(
    conn: &'c mut sqlx::SqliteConnection,
    statement: &'static str,
) -> BoxFuture<'c, std::result::Result<(), sqlx::Error>> {
    Box::pin(async move {
        sqlx::query(statement).execute(conn).await?;
        Ok(())
    })
}

impl SqliteTxConn {
    /// The transaction ended cleanly: the connection goes back to the pool when dropped.
    fn return_to_pool(&mut self) {
        self.open = false;
    }
}

impl std::ops::Deref for SqliteTxConn {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::ops::DerefMut for SqliteTxConn {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}

impl Drop for SqliteTxConn {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}

/// One open transaction on either engine.
pub(crate) enum Conn {
    Sqlite(SqliteTx),
    Postgres(PgTx),
}

/// An open transaction. Obtained inside [`crate::Bmdb::transact`],
/// [`crate::Session::transact`] or [`crate::Work::finish`]; every typed query of the BMDB is a
/// method of it, defined in the `sql/` module of its concern next to its SQL, so callers never
/// write SQL, the same code runs on SQLite and Postgres, and nothing outside `sql/` can reach
/// the connection (the field is private to this module).
pub struct Tx {
    inner: Conn,
}

impl Tx {
    /// A transaction `db.rs` just began.
    pub(crate) fn new(inner: Conn) -> Tx {
        Tx { inner }
    }

    /// The connection the statements of `sql/` run on.
    pub(super) fn conn(&mut self) -> &mut Conn {
        &mut self.inner
    }

    /// The engine this transaction runs on.
    pub(crate) fn engine(&self) -> Engine {
        self.inner.engine()
    }

    /// The transaction's notion of the current time: the database clock on Postgres, the
    /// host's clock read once at `BEGIN` on SQLite.
    pub async fn now(&mut self) -> Result<DateTime<Utc>> {
        match &mut self.inner {
            Conn::Postgres(c) => Ok(sqlx::query_scalar("SELECT now()")
                .fetch_one(&mut **c)
                .await?),
            Conn::Sqlite(c) => from_us(c.now),
        }
    }

    pub(crate) async fn commit(self) -> Result<()> {
        match self.inner {
            Conn::Sqlite(c) => c.tx.end("COMMIT").await?,
            Conn::Postgres(c) => c.commit().await?,
        }
        Ok(())
    }

    /// Test support: makes this transaction's connection read-only for the rest of its life
    /// in the pool, as one that reached a node which became a standby. Postgres only.
    #[cfg(feature = "testing")]
    pub(crate) async fn make_connection_read_only(&mut self) -> Result<()> {
        let Conn::Postgres(c) = &mut self.inner else {
            panic!("only a Postgres connection can become a standby's");
        };
        sqlx::query("SET SESSION default_transaction_read_only = on")
            .execute(&mut **c)
            .await?;
        Ok(())
    }

    pub(crate) async fn rollback(self) -> Result<()> {
        match self.inner {
            Conn::Sqlite(c) => c.tx.end("ROLLBACK").await?,
            Conn::Postgres(c) => c.rollback().await?,
        }
        Ok(())
    }
}

/// A pooled Postgres connection outside any transaction: the hot paths that are one
/// autocommitted statement each (claims, batches of bare heartbeats) run on it, as its
/// methods in `sql/`.
pub(crate) struct Autocommit(sqlx::pool::PoolConnection<Postgres>);

impl Autocommit {
    /// A connection `db.rs` took from its pool.
    pub(crate) fn new(conn: sqlx::pool::PoolConnection<Postgres>) -> Self {
        Autocommit(conn)
    }

    /// The connection the statements of `sql/` run on.
    pub(super) fn conn(&mut self) -> &mut sqlx::PgConnection {
        &mut self.0
    }
}

/// Which engine a connection belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    Sqlite,
    Postgres,
}

/// A statement's text for an engine: the same text for both (`str`, `String`) or a
/// [`Dialects`].
pub(crate) trait Sql {
    fn text(&self, engine: Engine) -> &str;
}

impl Sql for str {
    fn text(&self, _: Engine) -> &str {
        self
    }
}

impl Sql for String {
    fn text(&self, _: Engine) -> &str {
        self
    }
}

/// A statement whose text differs between the engines, both texts side by side. Where the
/// Postgres text reads `now()`, the SQLite text takes the transaction's time as a parameter
/// ([`Arg::Now`], last).
pub(crate) struct Dialects {
    pub(crate) postgres: &'static str,
    pub(crate) sqlite: &'static str,
}

impl Sql for Dialects {
    fn text(&self, engine: Engine) -> &str {
        match engine {
            Engine::Postgres => self.postgres,
            Engine::Sqlite => self.sqlite,
        }
    }
}

/// A statement parameter, bound as each engine stores what it is.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Uuid(Uuid),
    OptUuid(Option<Uuid>),
    Text(&'a str),
    OptText(Option<&'a str>),
    Int(i64),
    /// [`Arg::Int`] or NULL.
    OptInt(Option<i64>),
    Int32(i32),
    Bool(bool),
    Bytes(&'a [u8]),
    /// A point in time: `timestamptz` on Postgres, microseconds since the epoch on SQLite.
    Time(DateTime<Utc>),
    /// [`Arg::Time`] or NULL.
    OptTime(Option<DateTime<Utc>>),
    /// A span of time: seconds for `make_interval(secs => …)` on Postgres, microseconds to
    /// subtract from a time on SQLite.
    Span(Duration),
    /// The transaction's time, which a SQLite text takes as its last parameter; a Postgres
    /// text reads `now()` instead, so nothing is bound there.
    Now,
}

/// How `engine` reads the transaction's time in a statement: Postgres' `now()`, or SQLite's
/// parameter `$now` ([`Arg::Now`]).
pub(crate) fn now_in(engine: Engine, now: usize) -> String {
    match engine {
        Engine::Postgres => "now()".into(),
        Engine::Sqlite => format!("${now}"),
    }
}

/// The time a span (parameter `$span`, an [`Arg::Span`]) before the transaction's time, as
/// `engine` writes it; SQLite reads the time from parameter `$now`.
pub(crate) fn span_ago(engine: Engine, span: usize, now: usize) -> String {
    match engine {
        Engine::Postgres => format!("now() - make_interval(secs => ${span})"),
        Engine::Sqlite => format!("${now} - ${span}"),
    }
}

/// Seconds as whole microseconds, for SQLite's integer times.
pub(crate) fn secs_us(secs: f64) -> i64 {
    (secs * 1e6).round() as i64
}

/// Binds `args` to `q` in order: the values both engines store alike here, and the rest
/// (times, spans, the transaction's time) through `per_engine`.
fn bind_args<'q, DB>(
    mut q: Query<'q, DB, <DB as Database>::Arguments<'q>>,
    args: &[Arg<'q>],
    per_engine: impl Fn(
        Query<'q, DB, <DB as Database>::Arguments<'q>>,
        &Arg<'q>,
    ) -> Query<'q, DB, <DB as Database>::Arguments<'q>>,
) -> Query<'q, DB, <DB as Database>::Arguments<'q>>
where
    DB: Database,
    Uuid: Encode<'q, DB> + Type<DB>,
    Option<Uuid>: Encode<'q, DB>,
    &'q str: Encode<'q, DB> + Type<DB>,
    Option<&'q str>: Encode<'q, DB>,
    i64: Encode<'q, DB> + Type<DB>,
    Option<i64>: Encode<'q, DB>,
    i32: Encode<'q, DB> + Type<DB>,
    bool: Encode<'q, DB> + Type<DB>,
    &'q [u8]: Encode<'q, DB> + Type<DB>,
{
    for arg in args {
        q = match *arg {
            Arg::Uuid(v) => q.bind(v),
            Arg::OptUuid(v) => q.bind(v),
            Arg::Text(v) => q.bind(v),
            Arg::OptText(v) => q.bind(v),
            Arg::Int(v) => q.bind(v),
            Arg::OptInt(v) => q.bind(v),
            Arg::Int32(v) => q.bind(v),
            Arg::Bool(v) => q.bind(v),
            Arg::Bytes(v) => q.bind(v),
            Arg::Time(_) | Arg::OptTime(_) | Arg::Span(_) | Arg::Now => per_engine(q, arg),
        };
    }
    q
}

/// Postgres: `timestamptz`, seconds for `make_interval`, and `now()` in the text.
fn bind_postgres<'q>(
    q: Query<'q, Postgres, PgArguments>,
    args: &[Arg<'q>],
) -> Query<'q, Postgres, PgArguments> {
    bind_args(q, args, |q, arg| match *arg {
        Arg::Time(v) => q.bind(v),
        Arg::OptTime(v) => q.bind(v),
        Arg::Span(v) => q.bind(v.as_secs_f64()),
        _ => q,
    })
}

/// SQLite: integer microseconds, and the transaction's time `now` as a parameter.
fn bind_sqlite<'q>(
    q: Query<'q, Sqlite, SqliteArguments<'q>>,
    args: &[Arg<'q>],
    now: i64,
) -> Query<'q, Sqlite, SqliteArguments<'q>> {
    bind_args(q, args, |q, arg| match *arg {
        Arg::Time(v) => q.bind(to_us(v)),
        Arg::OptTime(v) => q.bind(v.map(to_us)),
        Arg::Span(v) => q.bind(secs_us(v.as_secs_f64())),
        _ => q.bind(now),
    })
}

impl Conn {
    /// The engine of this connection.
    pub(crate) fn engine(&self) -> Engine {
        match self {
            Conn::Sqlite(_) => Engine::Sqlite,
            Conn::Postgres(_) => Engine::Postgres,
        }
    }

    /// Runs a statement; returns the rows it changed.
    pub(crate) async fn execute(
        &mut self,
        sql: &(impl Sql + ?Sized),
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let text = sql.text(self.engine());
        let done = match self {
            Conn::Postgres(c) => bind_postgres(sqlx::query(text), args)
                .execute(&mut **c)
                .await?
                .rows_affected(),
            Conn::Sqlite(c) => bind_sqlite(sqlx::query(text), args, c.now)
                .execute(&mut *c.tx)
                .await?
                .rows_affected(),
        };
        Ok(done)
    }

    /// Runs a script of several statements (a migration), with no parameters.
    pub(crate) async fn execute_script(&mut self, script: &str) -> Result<()> {
        match self {
            Conn::Postgres(c) => {
                sqlx::raw_sql(script).execute(&mut **c).await?;
            }
            Conn::Sqlite(c) => {
                sqlx::raw_sql(script).execute(&mut *c.tx).await?;
            }
        }
        Ok(())
    }

    /// The rows a query returns, each decoded by column name.
    pub(crate) async fn rows<T: FromColumns>(
        &mut self,
        sql: &(impl Sql + ?Sized),
        args: &[Arg<'_>],
    ) -> Result<Vec<T>> {
        let text = sql.text(self.engine());
        match self {
            Conn::Postgres(c) => bind_postgres(sqlx::query(text), args)
                .fetch_all(&mut **c)
                .await?
                .iter()
                .map(T::from_columns)
                .collect(),
            Conn::Sqlite(c) => bind_sqlite(sqlx::query(text), args, c.now)
                .fetch_all(&mut *c.tx)
                .await?
                .iter()
                .map(T::from_columns)
                .collect(),
        }
    }

    /// The first row a query returns, if any.
    pub(crate) async fn row<T: FromColumns>(
        &mut self,
        sql: &(impl Sql + ?Sized),
        args: &[Arg<'_>],
    ) -> Result<Option<T>> {
        Ok(self.rows(sql, args).await?.into_iter().next())
    }

    /// The first column of every row a query returns.
    pub(crate) async fn values<T: Decodes>(
        &mut self,
        sql: &(impl Sql + ?Sized),
        args: &[Arg<'_>],
    ) -> Result<Vec<T>> {
        let rows: Vec<First<T>> = self.rows(sql, args).await?;
        Ok(rows.into_iter().map(|First(v)| v).collect())
    }

    /// The first column of the first row a query returns, if any.
    pub(crate) async fn value<T: Decodes>(
        &mut self,
        sql: &(impl Sql + ?Sized),
        args: &[Arg<'_>],
    ) -> Result<Option<T>> {
        Ok(self.row(sql, args).await?.map(|First(v)| v))
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

/// A result row of either engine, read by column name (or, for tuples, by position).
pub(crate) trait Columns {
    fn get<T: Decodes>(&self, column: &str) -> Result<T>;

    fn at<T: Decodes>(&self, index: usize) -> Result<T>;

    fn time(&self, column: &str) -> Result<DateTime<Utc>> {
        Ok(self.get::<DbTime>(column)?.0)
    }

    /// Two time columns as a range: `columns` names them as `"start..end"`.
    fn time_range(&self, columns: &str) -> Result<std::ops::Range<DateTime<Utc>>> {
        let (start, end) = columns.split_once("..").unwrap_or((columns, columns));
        Ok(self.time(start)?..self.time(end)?)
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
    fn at<T: Decodes>(&self, index: usize) -> Result<T> {
        Ok(self.try_get(index)?)
    }
}

impl Columns for SqliteRow {
    fn get<T: Decodes>(&self, column: &str) -> Result<T> {
        Ok(self.try_get(column)?)
    }
    fn at<T: Decodes>(&self, index: usize) -> Result<T> {
        Ok(self.try_get(index)?)
    }
}

/// A row type decoded alike on both engines: each row shape is decoded once.
pub(crate) trait FromColumns: Sized {
    fn from_columns(r: &impl Columns) -> Result<Self>;
}

/// The first column of a row.
struct First<T>(T);

impl<T: Decodes> FromColumns for First<T> {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        Ok(First(r.at(0)?))
    }
}

/// Two columns, by position.
impl<A: Decodes, B: Decodes> FromColumns for (A, B) {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        Ok((r.at(0)?, r.at(1)?))
    }
}

/// Three columns, by position.
impl<A: Decodes, B: Decodes, C: Decodes> FromColumns for (A, B, C) {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        Ok((r.at(0)?, r.at(1)?, r.at(2)?))
    }
}

/// Implements [`FromColumns`] for structs whose fields are read by name: `field: how`, with
/// `how` a method of [`Columns`] (`get`, `time`, `parsed` …), reads the column named like the
/// field; `field: how("column")` one named otherwise.
///
/// Kept as a macro on purpose: each use is a declarative list of which column fills which
/// field, with no control flow but `?`; written out by hand, every row type would repeat the
/// same struct literal shape, which is exactly what a reader should not have to check.
macro_rules! from_columns {
    ($($ty:ident { $($field:ident: $how:ident $(($column:literal))?),+ $(,)? })+) => {
        $(
            impl $crate::sql::engine::FromColumns for $ty {
                fn from_columns(
                    r: &impl $crate::sql::engine::Columns,
                ) -> $crate::sql::engine::Result<Self> {
                    Ok($ty { $($field: r.$how([$($column,)? stringify!($field)][0])?,)+ })
                }
            }
        )+
    };
}
pub(crate) use from_columns;

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
