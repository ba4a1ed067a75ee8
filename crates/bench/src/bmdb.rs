//! BMDB benchmark. Measures on Postgres and SQLite, in one run:
//! (a) claim+finish throughput with parallel workers (each claims its next machine while its
//! last ending is written, as the loops' runner does); (b) the same with upstream's claim shape;
//! (c) the raw single-row UPDATE transaction ceiling with as many connections; (d) claim
//! latency with 1k and 100k machines in the database.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use shepherd_bmdb::testing::{self, TestDb};
use shepherd_bmdb::*;

use crate::stats::{ms, quantile};

/// Settings of the BMDB benchmark.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Eligible machines for the throughput runs (a) and (b).
    #[arg(long, default_value_t = 10_000)]
    machines: usize,
    /// Parallel workers (and connections for the ceiling).
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Sessions the workers are spread over (design.md §10: one per worker).
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Upper bound on one throughput run; a run stops early when every machine is processed.
    #[arg(long, default_value_t = 30)]
    max_run_seconds: u64,
    /// Length of the raw write ceiling measurement.
    #[arg(long, default_value_t = 10)]
    ceiling_seconds: u64,
    /// Timed claims per latency measurement.
    #[arg(long, default_value_t = 1000)]
    latency_samples: usize,
    /// Machines in the small and the large database of the latency measurement.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000usize, 100_000])]
    latency_sizes: Vec<usize>,
    /// Rounds of the throughput measurements, each round one run of (a), (b) and (c) back to
    /// back; medians are reported, and each ratio is the median of the rounds' own ratios (a
    /// shared 2-core machine's speed drifts over minutes, and a ratio of figures taken in one
    /// round cancels it).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/bmdb.md")]
    out: PathBuf,
}

const START: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Postgres,
    Sqlite,
}

async fn fresh(backend: Backend) -> Result<TestDb> {
    Ok(match backend {
        Backend::Sqlite => testing::sqlite().await,
        Backend::Postgres => match testing::postgres().await {
            Some(t) => t,
            None => {
                bail!("Postgres is unreachable; the benchmark needs it (see scripts/test-deps.sh)")
            }
        },
    })
}

/// Adds `n` machines provided by the sim provider, in batches, then refreshes planner
/// statistics as autovacuum would on a live system: it analyzes the tables provisioning wrote
/// and leaves the tag tables, which nothing has written yet, unanalyzed. (Analyzing an empty
/// tag table would tell the planner it stays tiny, and the claim's cached generic plan would
/// then scan it sequentially while the run fills it, which a live system never sees.)
async fn provision(t: &TestDb, n: usize) -> Result<()> {
    let mut left = n;
    while left > 0 {
        let batch = left.min(2000);
        t.db.transact(move |tx| {
            Box::pin(async move {
                for _ in 0..batch {
                    let id = tx.create_machine().await?;
                    tx.set_provided(
                        id,
                        &Provided::new(ProviderKind::Sim, id.simple().to_string()),
                    )
                    .await?;
                }
                Ok(())
            })
        })
        .await?;
        left -= batch;
    }
    if t.url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&t.url).await?;
        sqlx::query("ANALYZE machines, machine_provided")
            .execute(&pool)
            .await?;
        pool.close().await;
    }
    Ok(())
}

struct Throughput {
    processed: u64,
    conflicts: u64,
    elapsed: Duration,
    /// When 90 % of the machines were processed: the rest is the drain's tail, where eligible
    /// machines are sparse and claims must search further.
    at_ninety_percent: Option<Duration>,
    /// Claim statements by search (Postgres): hinted, window, everywhere.
    searches: [u64; 3],
    /// Mean requests per claim batch and endings per ending transaction.
    batch_means: (f64, f64),
}

impl Throughput {
    fn per_second(&self) -> f64 {
        self.processed as f64 / self.elapsed.as_secs_f64()
    }
    /// Machines/s over the first 90 % and over the last 10 % of the machines.
    fn head_and_tail(&self, machines: usize) -> Option<(f64, f64)> {
        let head = self.at_ninety_percent?;
        let tail = self.elapsed.checked_sub(head)?;
        let ninety = (machines * 9 / 10) as f64;
        Some((
            ninety / head.as_secs_f64(),
            (self.processed as f64 - ninety) / tail.as_secs_f64(),
        ))
    }
    fn conflict_rate(&self) -> f64 {
        self.conflicts as f64 / (self.processed + self.conflicts).max(1) as f64
    }
}

/// Workers claim, do nothing, and finish (setting `agent_started`, which makes the machine
/// ineligible), until nothing is left or the time bound passes.
async fn claim_finish(db: &Bmdb, args: &Args, strategy: ClaimStrategy) -> Result<Throughput> {
    let processed = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let ninety_nanos = Arc::new(AtomicU64::new(0));
    let ninety = (args.machines * 9 / 10) as u64;
    let deadline = Instant::now() + Duration::from_secs(args.max_run_seconds);
    let mut sessions = vec![];
    for i in 0..args.sessions {
        sessions.push(
            db.start_session(SessionConfig::new(
                format!("bench-{i}"),
                Processor::ShepherdInitializer,
            ))
            .await?,
        );
    }
    let started = Instant::now();
    let mut workers = vec![];
    for w in 0..args.workers {
        let session = sessions[w % sessions.len()].clone();
        let (processed, conflicts) = (processed.clone(), conflicts.clone());
        let ninety_nanos = ninety_nanos.clone();
        workers.push(tokio::spawn(async move {
            // As the loops' runner does: a worker's ending is written while it claims its next
            // machine, one ending in flight per worker.
            let mut ending: Option<tokio::task::JoinHandle<Result<(), Error>>> = None;
            while Instant::now() < deadline {
                match session
                    .work_with_strategy(Process::ShepherdAgentStart, START, strategy)
                    .await?
                {
                    Claim::Work(mut work) => {
                        if let Some(previous) = ending.take() {
                            previous.await??;
                        }
                        let (processed, ninety_nanos) = (processed.clone(), ninety_nanos.clone());
                        ending = Some(tokio::spawn(async move {
                            work.finish(TagWrites::none().agent_started([7; AGENT_KEY_LEN]))
                                .await?;
                            if processed.fetch_add(1, Ordering::Relaxed) + 1 == ninety {
                                ninety_nanos
                                    .store(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                            }
                            Ok(())
                        }));
                    }
                    Claim::Conflict => {
                        conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                    Claim::NothingToDo => break,
                }
            }
            if let Some(last) = ending {
                last.await??;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let elapsed = started.elapsed();
    for s in sessions {
        s.close().await?;
    }
    let searches = [
        ClaimSearch::Hinted,
        ClaimSearch::Window,
        ClaimSearch::Everywhere,
    ]
    .map(|search| {
        [true, false]
            .into_iter()
            .map(|claimed| {
                db.metrics().claim_searches(
                    Processor::ShepherdInitializer,
                    Process::ShepherdAgentStart,
                    search,
                    claimed,
                )
            })
            .sum()
    });
    let mean = |(batches, members): (u64, u64)| members as f64 / batches.max(1) as f64;
    let batch_means = (
        mean(db.metrics().claim_batches(Processor::ShepherdInitializer)),
        mean(db.metrics().ending_batches(Processor::ShepherdInitializer)),
    );
    let ninety_nanos = ninety_nanos.load(Ordering::Relaxed);
    Ok(Throughput {
        batch_means,
        processed: processed.load(Ordering::Relaxed),
        conflicts: conflicts.load(Ordering::Relaxed),
        elapsed,
        at_ninety_percent: (ninety_nanos > 0).then(|| Duration::from_nanos(ninety_nanos)),
        searches,
    })
}

/// Raw ceiling: `workers` connections each updating its own row in single-row transactions, as
/// fast as they can; `explicit` wraps each UPDATE in BEGIN/COMMIT, otherwise it autocommits.
async fn write_ceiling(backend: Backend, args: &Args, explicit: bool) -> Result<f64> {
    let t = fresh(backend).await?;
    let n = args.workers;
    let duration = Duration::from_secs(args.ceiling_seconds);
    let count = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    match backend {
        Backend::Postgres => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(n as u32)
                .connect(&t.url)
                .await?;
            sqlx::query("CREATE TABLE ceiling (id int PRIMARY KEY, n bigint NOT NULL)")
                .execute(&pool)
                .await?;
            sqlx::query("INSERT INTO ceiling SELECT i, 0 FROM generate_series(0, $1) i")
                .bind(n as i32)
                .execute(&pool)
                .await?;
            let update = "UPDATE ceiling SET n = n + 1 WHERE id = $1";
            let workers_pool = pool.clone();
            until(duration, n, &count, move |i| {
                let pool = workers_pool.clone();
                async move {
                    if explicit {
                        let mut tx = pool.begin().await?;
                        sqlx::query(update).bind(i as i32).execute(&mut *tx).await?;
                        tx.commit().await
                    } else {
                        sqlx::query(update).bind(i as i32).execute(&pool).await?;
                        Ok(())
                    }
                }
            })
            .await?;
            pool.close().await;
        }
        Backend::Sqlite => {
            let path = t
                .url
                .strip_prefix("sqlite:")
                .context("sqlite url")?
                .to_string();
            let opts = sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(30));
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(n as u32)
                .connect_with(opts)
                .await?;
            sqlx::query("CREATE TABLE ceiling (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
                .execute(&pool)
                .await?;
            for i in 0..n {
                sqlx::query("INSERT INTO ceiling VALUES ($1, 0)")
                    .bind(i as i64)
                    .execute(&pool)
                    .await?;
            }
            let workers_pool = pool.clone();
            until(duration, n, &count, move |i| {
                let pool = workers_pool.clone();
                async move {
                    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                    sqlx::query("UPDATE ceiling SET n = n + 1 WHERE id = $1")
                        .bind(i as i64)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await
                }
            })
            .await?;
            pool.close().await;
        }
    }
    let rate = count.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    t.cleanup().await;
    Ok(rate)
}

/// Runs `workers` tasks, each calling `step(its index)` back to back for `duration`, and counts
/// the steps into `count`.
async fn until<F, Fut>(
    duration: Duration,
    workers: usize,
    count: &Arc<AtomicU64>,
    step: F,
) -> Result<(), sqlx::Error>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), sqlx::Error>> + Send,
{
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|i| {
            let (step, count) = (step.clone(), count.clone());
            tokio::spawn(async move {
                while started.elapsed() < duration {
                    step(i).await?;
                    count.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, sqlx::Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a ceiling worker panicked")?;
    }
    Ok(())
}

struct Latency {
    p50: Duration,
    p99: Duration,
}

/// Claim latency in databases of each size in `sizes`, all machines eligible. One worker per
/// database claims and finishes (without changing eligibility); only the claim is timed. The
/// databases are measured in interleaved rounds so background activity (checkpoints,
/// autovacuum) falls on all sizes alike.
async fn claim_latency(
    backend: Backend,
    sizes: &[usize],
    samples: usize,
) -> Result<Vec<(usize, Latency)>> {
    const ROUNDS: usize = 5;
    let mut dbs = vec![];
    for &size in sizes {
        let t = fresh(backend).await?;
        provision(&t, size).await?;
        let session =
            t.db.start_session(SessionConfig::new(
                "bench-latency",
                Processor::ShepherdInitializer,
            ))
            .await?;
        // Warm up statement caches and plans.
        for _ in 0..50 {
            claim_once(&session).await?;
        }
        dbs.push((size, t, session, Vec::with_capacity(samples)));
    }
    for _ in 0..ROUNDS {
        for (_, _, session, times) in dbs.iter_mut() {
            for _ in 0..samples.div_ceil(ROUNDS) {
                times.push(claim_once(session).await?);
            }
        }
    }
    let mut out = vec![];
    for (size, t, session, mut times) in dbs {
        session.close().await?;
        t.cleanup().await;
        out.push((
            size,
            Latency {
                p50: quantile(&mut times, 0.5),
                p99: quantile(&mut times, 0.99),
            },
        ));
    }
    Ok(out)
}

async fn claim_once(session: &Session) -> Result<Duration> {
    let begun = Instant::now();
    let claim = session.work(Process::ShepherdAgentStart, START).await?;
    let took = begun.elapsed();
    let Claim::Work(mut work) = claim else {
        bail!("no eligible machine in the latency run")
    };
    work.finish(TagWrites::none()).await?;
    Ok(took)
}

struct Report {
    ours: Throughput,
    upstream: Throughput,
    ceiling_autocommit: f64,
    ceiling_explicit: f64,
    /// The median of the rounds' own `claim_vs_ceiling` ([`Round`]).
    vs_ceiling: f64,
    /// The median of the rounds' own `claim_vs_upstream`.
    vs_upstream: f64,
    latency: Vec<(usize, Latency)>,
}

impl Report {
    fn claim_vs_ceiling(&self) -> f64 {
        self.vs_ceiling
    }
    fn claim_vs_upstream(&self) -> f64 {
        self.vs_upstream
    }
    fn latency_ratio(&self) -> f64 {
        let first = self
            .latency
            .first()
            .map(|(_, l)| l.p99.as_secs_f64())
            .unwrap_or(0.0);
        let last = self
            .latency
            .last()
            .map(|(_, l)| l.p99.as_secs_f64())
            .unwrap_or(0.0);
        last / first
    }
}

/// Claim+finish over a fresh, provisioned database of `backend` with `strategy`.
async fn claim_finish_on_fresh(
    backend: Backend,
    args: &Args,
    strategy: ClaimStrategy,
) -> Result<Throughput> {
    let t = fresh(backend).await?;
    provision(&t, args.machines).await?;
    let measured = claim_finish(&t.db, args, strategy).await?;
    t.cleanup().await;
    eprintln!(
        "[{backend:?}]     {:.0} machines/s, {} conflicts, {:.1} claims / {:.1} endings per batch",
        measured.per_second(),
        measured.conflicts,
        measured.batch_means.0,
        measured.batch_means.1,
    );
    Ok(measured)
}

async fn measure(backend: Backend, args: &Args) -> Result<Report> {
    eprintln!(
        "[{backend:?}] (a) claim+finish, {} workers, {} machines",
        args.workers, args.machines
    );
    let mut rounds = Vec::new();
    for round in 1..=args.repeat.max(1) {
        eprintln!("[{backend:?}] round {round}: (a), (b) upstream-style claimer, (c) raw write ceiling with {} connections", args.workers);
        let ours = claim_finish_on_fresh(backend, args, ClaimStrategy::SkipLocked).await?;
        let upstream =
            claim_finish_on_fresh(backend, args, ClaimStrategy::UpstreamFirstRow).await?;
        let autocommit = write_ceiling(backend, args, false).await?;
        let explicit = write_ceiling(backend, args, true).await?;
        eprintln!(
            "[{backend:?}]     {:.0} and {:.0} machines/s; {autocommit:.0} txn/s autocommit, {explicit:.0} txn/s BEGIN/COMMIT",
            ours.per_second(),
            upstream.per_second()
        );
        rounds.push(Round {
            ours,
            upstream,
            autocommit,
            explicit,
        });
    }
    let vs_ceiling = median(rounds.iter().map(Round::claim_vs_ceiling).collect());
    let vs_upstream = median(rounds.iter().map(Round::claim_vs_upstream).collect());
    let ceiling_autocommit = median(rounds.iter().map(|r| r.autocommit).collect());
    let ceiling_explicit = median(rounds.iter().map(|r| r.explicit).collect());
    let (ours, upstream): (Vec<_>, Vec<_>) =
        rounds.into_iter().map(|r| (r.ours, r.upstream)).unzip();
    let (ours, upstream) = (median_run(ours), median_run(upstream));

    eprintln!(
        "[{backend:?}] (d) claim latency with {:?} machines",
        args.latency_sizes
    );
    let latency = claim_latency(backend, &args.latency_sizes, args.latency_samples).await?;
    for (size, l) in &latency {
        eprintln!(
            "[{backend:?}]     {size}: p50 {} ms, p99 {} ms",
            ms(l.p50),
            ms(l.p99)
        );
    }
    Ok(Report {
        ours,
        upstream,
        ceiling_autocommit,
        ceiling_explicit,
        vs_ceiling,
        vs_upstream,
        latency,
    })
}

/// One round of the throughput measurements, taken back to back: (a), (b) and both shapes of
/// (c). Each claim+finish run is on a fresh database and stops by the same rule (every machine
/// processed, or `--max-run-seconds`), so ours and the baseline are measured alike.
struct Round {
    ours: Throughput,
    upstream: Throughput,
    autocommit: f64,
    explicit: f64,
}

impl Round {
    /// Ours against half the stricter ceiling (a claim and its ending are two transactions).
    fn claim_vs_ceiling(&self) -> f64 {
        self.ours.per_second() / (self.autocommit.max(self.explicit) / 2.0)
    }
    fn claim_vs_upstream(&self) -> f64 {
        self.ours.per_second() / self.upstream.per_second()
    }
}

/// The run of median throughput among `runs` (one per round).
fn median_run(mut runs: Vec<Throughput>) -> Throughput {
    runs.sort_by(|a, b| a.per_second().total_cmp(&b.per_second()));
    runs.swap_remove(runs.len() / 2)
}

/// The middle of `figures`.
fn median(mut figures: Vec<f64>) -> f64 {
    figures.sort_by(f64::total_cmp);
    figures[figures.len() / 2]
}

async fn environment() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let pg = match sqlx::PgPool::connect(&testing::postgres_admin_url()).await {
        Ok(pool) => sqlx::query_scalar::<_, String>("SHOW server_version")
            .fetch_one(&pool)
            .await
            .unwrap_or_default(),
        Err(_) => "unreachable".into(),
    };
    let sqlite = match sqlx::SqlitePool::connect("sqlite::memory:").await {
        Ok(pool) => sqlx::query_scalar::<_, String>("SELECT sqlite_version()")
            .fetch_one(&pool)
            .await
            .unwrap_or_default(),
        Err(_) => "unknown".into(),
    };
    format!("{cores} cores; PostgreSQL {pg} on loopback; SQLite {sqlite} (bundled, WAL, synchronous=NORMAL)")
}

/// The report's title and the paragraph saying how it was measured.
async fn report_header(args: &Args) -> String {
    format!(
        "# BMDB benchmark\n\n\
         Run on {} with `cargo run --release -p shepherd-bench -- bmdb` ({}). Workers: {} over {} sessions; \
         throughput runs use {} eligible machines, no-op work, and a finish that sets `agent_started`. \
         A claim+finish is two transactions, so the ratio to the ceiling uses half the faster (c); \
         (c) goes through a sqlx pool like the BMDB's own, so both pay the same cost per checkout. \
         (a), (b) and (c) are the medians of {} rounds, each round one run of each back to back, every \
         claim+finish run on a fresh database and stopped by the same rule: every machine processed, \
         or {} s; each ratio is the median of the rounds' own ratios, so that the machine's drift over \
         minutes cancels. Ours batches concurrent claims and endings. \
         As in the loops' runner, a worker claims its next machine while its last ending is written \
         (one ending in flight per worker), in (a) and (b) alike. \
         (b) is not upstream's code: it is our reimplementation of upstream's claim shape (take the \
         first eligible machine and let the work table's unique constraint refuse all but one \
         claimer), run through the same BMDB, pool and workers as (a). \
         (c) is a ceiling for unbatched transactions, one row each: (a) batches many claims into \
         one transaction and many endings into another, so it can pass (c), and a ratio to it \
         above 1 means batching, not a measurement error.\n\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        environment().await,
        args.workers,
        args.sessions,
        args.machines,
        args.repeat.max(1),
        args.max_run_seconds
    )
}

/// Runs the whole benchmark and writes the report.
pub async fn run(args: Args) -> Result<()> {
    if args.latency_sizes.len() < 2 {
        bail!("--latency-sizes needs a small and a large size");
    }
    let pg = measure(Backend::Postgres, &args).await?;
    let lite = measure(Backend::Sqlite, &args).await?;
    let mut md = report_header(&args).await;
    md.push_str("| measurement | Postgres | SQLite |\n|---|---:|---:|\n");
    let row = |md: &mut String, name: &str, a: String, b: String| {
        md.push_str(&format!("| {name} | {a} | {b} |\n"))
    };
    let split = |t: &Throughput| match t.head_and_tail(args.machines) {
        Some((head, tail)) => format!("{head:.0} / {tail:.0}"),
        None => "-".into(),
    };
    type Figure<'a> = (&'a str, Box<dyn Fn(&Report) -> String + 'a>);
    let both: Vec<Figure> = vec![
        (
            "(a) claim+finish, machines/s",
            Box::new(|m| format!("{:.0}", m.ours.per_second())),
        ),
        (
            "(a) machines processed / conflicts",
            Box::new(|m| format!("{} / {}", m.ours.processed, m.ours.conflicts)),
        ),
        (
            "(a) machines/s over the first 90 % / the last 10 % of machines",
            Box::new(|m| split(&m.ours)),
        ),
        (
            "(b) upstream-style claimer, machines/s",
            Box::new(|m| format!("{:.0}", m.upstream.per_second())),
        ),
        (
            "(b) machines processed / conflicts",
            Box::new(|m| format!("{} / {}", m.upstream.processed, m.upstream.conflicts)),
        ),
        (
            "(c) raw single-row UPDATE transactions/s, autocommit",
            Box::new(|m| format!("{:.0}", m.ceiling_autocommit)),
        ),
        (
            "(c) raw single-row UPDATE transactions/s, BEGIN; UPDATE; COMMIT",
            Box::new(|m| format!("{:.0}", m.ceiling_explicit)),
        ),
    ];
    for (name, figure) in &both {
        row(&mut md, name, figure(&pg), figure(&lite));
    }
    let searches = &pg.ours.searches;
    row(
        &mut md,
        "(a) claim statements: hinted / window / everywhere (Postgres only)",
        format!("{} / {} / {}", searches[0], searches[1], searches[2]),
        "-".into(),
    );
    let means = |t: &Throughput| format!("{:.1} / {:.1}", t.batch_means.0, t.batch_means.1);
    row(
        &mut md,
        "(a) mean claim requests per batch / endings per transaction",
        means(&pg.ours),
        means(&lite.ours),
    );
    for (i, (size, _)) in pg.latency.iter().enumerate() {
        let (p, l) = (&pg.latency[i].1, &lite.latency[i].1);
        row(
            &mut md,
            &format!("(d) claim latency p50 / p99 with {size} machines, ms"),
            format!("{} / {}", ms(p.p50), ms(p.p99)),
            format!("{} / {}", ms(l.p50), ms(l.p99)),
        );
    }
    md.push_str(&format!(
        "\nSQLite (for comparison; one writer, so claims never conflict): claim_vs_ceiling = {:.2}, \
         claim_vs_upstream = {:.2}, latency_100k_vs_1k = {:.2}.\n\n",
        lite.claim_vs_ceiling(),
        lite.claim_vs_upstream(),
        lite.latency_ratio()
    ));
    md.push_str(&format!(
        "ratio p1_claim_vs_ceiling = {:.2}\n",
        pg.claim_vs_ceiling()
    ));
    md.push_str(&format!(
        "ratio p1_claim_vs_upstream = {:.2}\n",
        pg.claim_vs_upstream()
    ));
    md.push_str(&format!("conflict_rate = {:.4}\n", pg.ours.conflict_rate()));
    md.push_str(&format!(
        "ratio p2_latency_100k_vs_1k = {:.2}\n",
        pg.latency_ratio()
    ));
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, &md).with_context(|| format!("writing {}", args.out.display()))?;
    print!("{md}");
    Ok(())
}
