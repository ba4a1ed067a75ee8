//! `shepherd tokens …`: the operator API's local tokens, on the database directly (the
//! administrators' break-glass path, as for `machines` without `--api`). A token's secret is
//! printed once, when it is made; the BMDB keeps only its SHA-256.

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Subcommand;
use shepherd_bmdb::{ApiToken, Bmdb};

use crate::api::policy::parse_role;

/// Subcommands of `shepherd tokens`.
#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Makes a token and prints it once (store it now: it cannot be shown again).
    Create {
        /// Its name, unique and never reused: who it is in the operators' history.
        #[arg(long)]
        name: String,
        /// What it may do: viewer (reads), operator (actions on machines), admin (tokens,
        /// decommission).
        #[arg(long)]
        role: String,
        /// How long it is valid (`90d`, `12h`).
        #[arg(long, value_parser = crate::flags::duration)]
        expires: Duration,
        /// Who makes it, for the record (default: the login name).
        #[arg(long)]
        by: Option<String>,
    },
    /// Every token: name, role, expiry, revocation and last use (never a secret).
    List,
    /// Revokes a token: it stops working at once on servers that have not cached it, within
    /// ten seconds on those that have.
    Revoke {
        /// The token's name.
        name: String,
    },
}

/// Runs `command` on the BMDB at `url`.
pub async fn run(url: &str, command: TokensCommand) -> Result<()> {
    let db = Bmdb::open(url).await?;
    let result = run_on(&db, command).await;
    db.close().await;
    result
}

async fn run_on(db: &Bmdb, command: TokensCommand) -> Result<()> {
    match command {
        TokensCommand::Create {
            name,
            role,
            expires,
            by,
        } => {
            let role = parse_role(&role).map_err(|e| anyhow::anyhow!(e))?;
            if expires < Duration::from_secs(60) {
                bail!("--expires: {expires:?} is too short; a token lives at least a minute");
            }
            let by = by
                .or_else(|| std::env::var("USER").ok())
                .unwrap_or_else(|| "unknown".into());
            let Some((token, secret)) = db.create_api_token(&name, role, expires, &by).await?
            else {
                bail!("a token named {name:?} exists (names are never reused)");
            };
            eprintln!(
                "token {:?} ({}) valid until {}; it is shown once:",
                token.name,
                token.role,
                token.times.expires_at.to_rfc3339()
            );
            println!("{}", secret.reveal());
        }
        TokensCommand::List => {
            for t in db.api_tokens().await? {
                println!("{}", line(&t));
            }
        }
        TokensCommand::Revoke { name } => match db.revoke_api_token(&name).await? {
            Some(t) => println!("{}", line(&t)),
            None => bail!("no token named {name:?}"),
        },
    }
    Ok(())
}

/// One token as a line.
fn line(t: &ApiToken) -> String {
    let when = |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".into(), |t| t.to_rfc3339());
    let state = match (t.times.revoked_at, t.is_valid_at(chrono::Utc::now())) {
        (Some(_), _) => "revoked",
        (None, false) => "expired",
        (None, true) => "valid",
    };
    format!(
        "{:<24} {:<9} {:<8} expires {}  last used {}  by {}",
        t.name,
        t.role,
        state,
        t.times.expires_at.to_rfc3339(),
        when(t.times.last_used_at),
        t.created_by
    )
}
