//! `shepherd`: one binary for every Shepherd role: `run` (the control loops), `server` (the
//! agent-facing BMaaS server), `demo` (the whole lifecycle over a simulated fleet), and the
//! operators' commands: `machines` (list, show, history, install, retry, forget-host-key),
//! `sessions list`, `bmdb` (migrate, status, check) and `config print` (the merged settings).

mod api_client;
mod audit_cmd;
mod bare_flags;
mod bmdb_cmd;
mod config_cmd;
mod config_file;
mod demo;
mod dist_cmd;
mod fds;
mod flags;
mod login_cmd;
mod machines_cmd;
mod plumbing;
mod run_cmd;
mod schema_watch;
mod server_cmd;
mod tasks_cmd;
mod tokens_cmd;
mod version;

use std::io::IsTerminal;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use shepherd_bmdb::DEFAULT_DATABASE_URL;

/// Bare-metal fleet lifecycle manager.
#[derive(Debug, Parser)]
#[command(name = "shepherd", version, about)]
struct Cli {
    /// BMDB location: sqlite:PATH or postgres://USER@HOST/DB.
    #[arg(long, global = true, env = "SHEPHERD_DATABASE", default_value = DEFAULT_DATABASE_URL, hide_env_values = true)]
    database: String,

    /// Log lines as text for people or as JSON objects for log collectors.
    #[arg(long, global = true, env = "SHEPHERD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with the span fields (machine, provider id, process).
    Json,
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
        /// The operator API to use instead of the database.
        #[command(flatten)]
        api: api_client::ApiArgs,
        #[command(subcommand)]
        command: machines_cmd::MachinesCommand,
    },
    /// Inspect BMDB sessions.
    Sessions {
        #[command(subcommand)]
        command: SessionsCommand,
    },
    /// The operator API's local tokens (on the database: administrators only).
    Tokens {
        /// The operator API to use instead of the database (an admin's token).
        #[command(flatten)]
        api: api_client::ApiArgs,
        #[command(subcommand)]
        command: tokens_cmd::TokensCommand,
    },
    /// The security audit trail: sign-ins, tokens made and revoked, refused requests (on the
    /// database: administrators only).
    Audit {
        /// The operator API to use instead of the database (an admin's token).
        #[command(flatten)]
        api: api_client::ApiArgs,
        #[command(subcommand)]
        command: audit_cmd::AuditCommand,
    },
    /// A process's background tasks: state, last outcome, counts, last panic. Exits 1 if a
    /// task is failed or stale.
    Tasks(tasks_cmd::TasksArgs),
    /// Sign in at the operator API's identity provider (in a browser) and cache the token
    /// for `--api` commands.
    Login(login_cmd::LoginArgs),
    /// Manage the Bare Metal Database itself.
    Bmdb {
        #[command(subcommand)]
        command: bmdb_cmd::BmdbCommand,
    },
    /// Show configuration.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Write the man pages and shell completions into DIR (for packaging).
    #[command(hide = true)]
    Dist {
        /// Where `man/` and `completions/` are written.
        dir: std::path::PathBuf,
    },
}

/// Subcommands of `shepherd config`.
#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Print the effective settings of `run` or `server` (takes the same flags, environment and
    /// --config file) with the source of each value and secrets redacted.
    Print {
        #[command(subcommand)]
        command: PrintCommand,
    },
}

/// Which command's configuration to print.
#[derive(Debug, Subcommand)]
enum PrintCommand {
    /// `shepherd run`.
    Run(Box<run_cmd::RunArgs>),
    /// `shepherd server`.
    Server(Box<server_cmd::ServerArgs>),
}

/// Subcommands of `shepherd sessions`.
#[derive(Debug, Subcommand)]
enum SessionsCommand {
    /// Every session with its component, deadline and runtime info.
    List,
}

#[tokio::main]
async fn main() {
    let merged = match config_file::merge(
        &Cli::command(),
        &["run", "server"],
        std::env::args_os().collect(),
    ) {
        Ok(merged) => merged,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::exit(2);
        }
    };
    let matches = cli_command().get_matches_from(merged.argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The demo injects failures on purpose; their warnings would bury the progress bars. A
    // BMDB that cannot be written (its disk full) is still told, once a minute at most.
    let default_level = match cli.command {
        Command::Demo(_) => "error,shepherd_bmdb::disk_full=warn",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SHEPHERD_LOG")
        .unwrap_or_else(|_| default_level.into());
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
    }
    let result = match cli.command {
        Command::Run(args) => run_cmd::run(&cli.database, *args).await,
        Command::Server(args) => server_cmd::run(&cli.database, *args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Machines { api, command } => machines_cmd::run(&cli.database, &api, command).await,
        Command::Sessions {
            command: SessionsCommand::List,
        } => machines_cmd::sessions(&cli.database).await,
        Command::Bmdb { command } => bmdb_cmd::run(&cli.database, command).await,
        Command::Tokens { api, command } => tokens_cmd::run(&cli.database, &api, command).await,
        Command::Audit { api, command } => audit_cmd::run(&cli.database, &api, command).await,
        Command::Login(args) => login_cmd::run(args).await,
        Command::Tasks(args) => tasks_cmd::run(args).await,
        Command::Dist { dir } => dist_cmd::run(cli_command(), &dir),
        Command::Config {
            command: ConfigCommand::Print { command },
        } => {
            let which = match command {
                PrintCommand::Run(_) => "run",
                PrintCommand::Server(_) => "server",
            };
            let root = Cli::command();
            let sub = root
                .find_subcommand("config")
                .and_then(|c| c.find_subcommand("print"))
                .and_then(|c| c.find_subcommand(which))
                .expect("declared above");
            let leaf = matches
                .subcommand_matches("config")
                .and_then(|m| m.subcommand_matches("print"))
                .and_then(|m| m.subcommand_matches(which))
                .expect("parsed above");
            print!(
                "{}",
                config_cmd::render(&root, sub, leaf, &merged.from_file)
            );
            Ok(())
        }
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
    }
}

/// The CLI's definition, with the long `--version` text (commit and BMDB schemas).
fn cli_command() -> clap::Command {
    Cli::command().long_version(version::long_version())
}

/// The error and its causes on one line. Shepherd's own errors carry their cause in their
/// message without also naming it as `source()`, so each cause appears once.
fn error_chain(e: &anyhow::Error) -> String {
    format!("{e:#}")
}
