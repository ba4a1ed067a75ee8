//! `shepherd`: one binary for every Shepherd role. Subcommands grow with the system; today:
//! `bmdb migrate` and `bmdb status`.

mod bmdb_cmd;

use clap::{Parser, Subcommand};
use shepherd_bmdb::DEFAULT_DATABASE_URL;

/// Bare-metal fleet lifecycle manager.
#[derive(Debug, Parser)]
#[command(name = "shepherd", version, about)]
struct Cli {
    /// BMDB location: sqlite:PATH or postgres://USER@HOST/DB.
    #[arg(long, global = true, env = "SHEPHERD_DATABASE", default_value = DEFAULT_DATABASE_URL, hide_env_values = true)]
    database: String,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Manage the Bare Metal Database itself.
    Bmdb {
        #[command(subcommand)]
        command: bmdb_cmd::BmdbCommand,
    },
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHEPHERD_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bmdb { command } => bmdb_cmd::run(&cli.database, command).await,
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, skipping causes whose text an outer message already
/// includes (many driver errors embed their source in their own message).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let msg = cause.to_string();
        if text.contains(&msg) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&msg);
    }
    text
}
