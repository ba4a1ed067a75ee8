//! `shepherd bmdb …`: schema migration, a status summary and a consistency check.

use anyhow::Result;
use clap::Subcommand;
use shepherd_bmdb::{Bmdb, OpenOptions, SchemaWindow, StatusCounts, SCHEMA_VERSION};

/// Subcommands of `shepherd bmdb`.
#[derive(Debug, Subcommand)]
pub enum BmdbCommand {
    /// Create the database if needed and apply pending schema migrations.
    Migrate,
    /// Show the schema version and what the database holds.
    Status,
    /// Check the database's consistency with the engine Shepherd links (SQLite: integrity and
    /// foreign keys; Postgres: unvalidated constraints and invalid indexes). Exits 1 on problems.
    Check,
}

/// Runs a `bmdb` subcommand against `url`.
pub async fn run(url: &str, command: BmdbCommand) -> Result<()> {
    match command {
        BmdbCommand::Migrate => {
            let db = Bmdb::connect(
                url,
                &OpenOptions {
                    create: true,
                    ..Default::default()
                },
            )
            .await?;
            let (from, to) = db.migrate().await?;
            let w = db.schema_window().await?;
            if from == to {
                println!("{}: schema is up to date (version {to})", db.target());
            } else {
                println!(
                    "{}: migrated schema from version {from} to {to}",
                    db.target()
                );
            }
            println!(
                "{}: binaries of schema {} to {} may run on it",
                db.target(),
                w.oldest_compatible,
                w.version
            );
            db.close().await;
        }
        BmdbCommand::Status => {
            let db = Bmdb::open(url).await?;
            let counts = db.status_counts().await?;
            let window = db.schema_window().await?;
            print!("{}", render_status(db.target(), window, &counts));
            db.close().await;
        }
        BmdbCommand::Check => {
            let db = Bmdb::open(url).await?;
            let problems = db
                .read(|tx| Box::pin(async move { tx.integrity_problems().await }))
                .await?;
            db.close().await;
            if !problems.is_empty() {
                const SHOWN: usize = 50;
                for p in problems.iter().take(SHOWN) {
                    println!("{p}");
                }
                if problems.len() > SHOWN {
                    println!("… and {} more", problems.len() - SHOWN);
                }
                anyhow::bail!("{}: {} problem(s) found", db.target(), problems.len());
            }
            println!("{}: ok (schema version {SCHEMA_VERSION})", db.target());
        }
    }
    Ok(())
}

fn render_status(target: &str, w: SchemaWindow, c: &StatusCounts) -> String {
    let per_process = |v: &[(shepherd_bmdb::Process, i64)]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.iter()
                .map(|(p, n)| format!("{p}={n}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    format!(
        "database:        {target}\n\
         schema version:  {}\n\
         binaries:        schema {} to {} may run on it (this one: {SCHEMA_VERSION})\n\
         machines:        {}\n\
         provided:        {}\n\
         agent started:   {}\n\
         heartbeating:    {}\n\
         sessions:        {} live, {} expired\n\
         active work:     {}\n\
         active backoffs: {}\n\
         history entries: {}\n",
        w.version,
        w.oldest_compatible,
        w.version,
        c.machines,
        c.provided,
        c.agent_started,
        c.heartbeating,
        c.sessions_live,
        c.sessions_expired,
        per_process(&c.work),
        per_process(&c.backoffs),
        c.history_entries,
    )
}
