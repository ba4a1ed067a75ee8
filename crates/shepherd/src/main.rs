//! `shepherd`: one binary for every Shepherd role: `run` (the control loops), `server` (the
//! agent-facing BMaaS server), `demo` (the whole lifecycle over a simulated fleet), `bmdb
//! migrate` and `bmdb status`.

mod bmdb_cmd;
mod config_file;
mod demo;
mod fleet;
mod fleet_stats;
mod inventory;
mod machines_cmd;
mod metrics_http;
mod run_cmd;
mod server_cmd;
mod web;

use std::io::IsTerminal;

use clap::{CommandFactory, Parser, Subcommand};
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
    /// Run the provisioner, initializer and recoverer until SIGINT/SIGTERM.
    Run(Box<run_cmd::RunArgs>),
    /// Serve agents: heartbeats, hardware and installation reports over gRPC with TLS.
    Server(Box<server_cmd::ServerArgs>),
    /// Watch a simulated fleet of machines go through the whole lifecycle (SQLite, in-process).
    Demo(demo::DemoArgs),
    /// Inspect machines: list, show, history.
    Machines {
        #[command(subcommand)]
        command: machines_cmd::MachinesCommand,
    },
    /// Inspect BMDB sessions.
    Sessions {
        #[command(subcommand)]
        command: SessionsCommand,
    },
    /// Manage the Bare Metal Database itself.
    Bmdb {
        #[command(subcommand)]
        command: bmdb_cmd::BmdbCommand,
    },
}

/// Subcommands of `shepherd sessions`.
#[derive(Debug, Subcommand)]
enum SessionsCommand {
    /// Every session with its component, deadline and runtime info.
    List,
}

#[tokio::main]
async fn main() {
    let argv = match config_file::merge(
        &Cli::command(),
        &["run", "server"],
        std::env::args_os().collect(),
    ) {
        Ok(argv) => argv,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(argv);
    // The demo injects failures on purpose; their warnings would bury the progress bars.
    let default_level = match cli.command {
        Command::Demo(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SHEPHERD_LOG")
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Run(args) => run_cmd::run(&cli.database, *args).await,
        Command::Server(args) => server_cmd::run(&cli.database, *args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Machines { command } => machines_cmd::run(&cli.database, command).await,
        Command::Sessions {
            command: SessionsCommand::List,
        } => machines_cmd::sessions(&cli.database).await,
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
