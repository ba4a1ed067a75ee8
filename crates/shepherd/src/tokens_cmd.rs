//! `shepherd tokens …`: the operator API's local tokens, on the database directly (the
//! administrators' break-glass path, and how the first token is made) or, with `--api`,
//! through the API with an admin's token. A token's secret is printed once, when it is made;
//! the BMDB keeps only its SHA-256.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};
use shepherd_bmdb::{Actor, ApiToken, Bmdb, TokenTimes, MAX_TOKEN_PAGE};

use crate::api_client::{ApiArgs, ApiClient};
use shepherd_bmdb::one_line;

use shepherd_operator::api::policy::parse_role;

/// Subcommands of `shepherd tokens`.
#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Makes a token and prints it once (store it now: it cannot be shown again).
    Create(NewToken),
    /// Every token, page after page: name, role, expiry, revocation and last use (never a
    /// secret).
    List {
        /// Only the tokens made by or for this principal (a person's web sign-ins are made
        /// for them: `oidc:SUBJECT@ISSUER`).
        #[arg(long)]
        by: Option<String>,
    },
    /// Revokes every web sign-in of one person, as signing out of each would.
    RevokeSessions {
        /// The person, as the history names them (`oidc:SUBJECT@ISSUER`).
        of: String,
    },
    /// Revokes a token: it stops working at once on servers that have not cached it, within
    /// a second on those that have.
    Revoke {
        /// The token's name.
        name: String,
    },
}

/// What `tokens create` makes.
#[derive(Debug, clap::Args)]
pub struct NewToken {
    /// Its name, unique and never reused: who it is in the operators' history.
    #[arg(long)]
    name: String,
    /// What it may do: viewer (reads), operator (actions on machines), admin (tokens,
    /// decommission).
    #[arg(long)]
    role: String,
    /// How long it is valid (`90d`, `12h`; through the API, rounded up to whole days).
    #[arg(long, value_parser = crate::flags::duration)]
    expires: Duration,
    /// Who makes it, for the record (default: the login name; through the API, the token's).
    #[arg(long)]
    by: Option<String>,
}

/// Tells what was made, on stderr, and prints the secret alone on stdout.
fn made(token: &ApiToken, secret: &str) {
    let until = token.times.expires_at.to_rfc3339();
    eprintln!(
        "token {:?} ({}) valid until {until}; it is shown once:",
        token.name, token.role
    );
    println!("{secret}");
}

/// Runs `command` on the BMDB at `url`, or through the operator API (an admin's token).
pub async fn run(url: &str, api: &ApiArgs, command: TokensCommand) -> Result<()> {
    if let Some(client) = api.client()? {
        return run_via_api(&client, command).await;
    }
    let db = Bmdb::open(url).await?;
    let result = run_on(&db, command).await;
    db.close().await;
    result
}

/// `command` through the operator API: the same lines as on the database.
async fn run_via_api(api: &ApiClient, command: TokensCommand) -> Result<()> {
    match command {
        TokensCommand::Create(new) => {
            if new.by.is_some() {
                bail!("--by: through the API, the token says who acts");
            }
            let days = new.expires.as_secs().div_ceil(86_400);
            let body = json!({"name": new.name, "role": new.role, "expires_in_days": days});
            let answer = api.call(Method::POST, "/tokens", Some(body)).await?;
            made(
                &token_of(&answer)?,
                answer["secret"].as_str().unwrap_or_default(),
            );
        }
        TokensCommand::List { by } => {
            let mut path = format!("/tokens?limit={MAX_TOKEN_PAGE}");
            loop {
                let listed = api.get(&path).await?;
                for t in listed["tokens"].as_array().into_iter().flatten() {
                    print_if_by(&token_of(t)?, by.as_deref());
                }
                let Some(next) = listed["next"].as_str() else {
                    break;
                };
                let after: String = url::form_urlencoded::byte_serialize(next.as_bytes()).collect();
                path = format!("/tokens?limit={MAX_TOKEN_PAGE}&after={after}");
            }
        }
        TokensCommand::Revoke { name } => {
            let revoked = api
                .call(Method::DELETE, &format!("/tokens/{name}"), None)
                .await?;
            println!("{}", line(&token_of(&revoked)?));
        }
        TokensCommand::RevokeSessions { of } => {
            let body = json!({ "of": of });
            let answer = api
                .call(Method::POST, "/tokens/revoke-sessions", Some(body))
                .await?;
            sessions_revoked(&of, answer["revoked"].as_u64().unwrap_or(0));
        }
    }
    Ok(())
}

/// A token as the API describes it.
fn token_of(v: &Value) -> Result<ApiToken> {
    let time = |key: &str| -> Result<Option<chrono::DateTime<chrono::Utc>>> {
        match v[key].as_str() {
            Some(t) => Ok(Some(
                t.parse().with_context(|| format!("token {key}: {t:?}"))?,
            )),
            None => Ok(None),
        }
    };
    let text = |key: &str| v[key].as_str().unwrap_or_default().to_string();
    Ok(ApiToken {
        id: uuid::Uuid::nil(),
        name: text("name"),
        role: text("role").parse()?,
        created_by: text("created_by"),
        times: TokenTimes {
            created_at: time("created_at")?.context("token without created_at")?,
            expires_at: time("expires_at")?.context("token without expires_at")?,
            revoked_at: time("revoked_at")?,
            last_used_at: time("last_used_at")?,
        },
    })
}

async fn run_on(db: &Bmdb, command: TokensCommand) -> Result<()> {
    match command {
        TokensCommand::Create(NewToken {
            name,
            role,
            expires,
            by,
        }) => {
            let role = parse_role(&role)?;
            if expires < Duration::from_secs(60) {
                bail!("--expires: {expires:?} is too short; a token lives at least a minute");
            }
            let by = Actor::named(by.unwrap_or_else(cli_user));
            let Some((token, secret)) = db.create_api_token(&name, role, expires, &by).await?
            else {
                bail!("a token named {name:?} exists (names are never reused)");
            };
            made(&token, secret.reveal());
        }
        TokensCommand::List { by } => {
            let mut after = None;
            loop {
                let (tokens, next) = db.api_tokens(after.as_deref(), MAX_TOKEN_PAGE).await?;
                for t in &tokens {
                    print_if_by(t, by.as_deref());
                }
                match next {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        TokensCommand::Revoke { name } => match db.revoke_api_token(&name, &cli_actor()).await? {
            Some(t) => println!("{}", line(&t)),
            None => bail!("no token named {name:?}"),
        },
        TokensCommand::RevokeSessions { of } => {
            sessions_revoked(&of, db.revoke_sessions_of(&of, &cli_actor()).await?);
        }
    }
    Ok(())
}

/// Who runs the CLI on the database: `$USER`, as the tokens it makes record their maker.
fn cli_user() -> String {
    std::env::var("USER").unwrap_or_else(|_| "unknown".into())
}

/// The audit trail's actor for the CLI on the database: `cli:$USER`.
fn cli_actor() -> Actor {
    Actor::named(format!("cli:{}", cli_user()))
}

/// One token as a line.
/// Prints `t`'s line, if `by` names no one or names who `t` was made by or for.
fn print_if_by(t: &ApiToken, by: Option<&str>) {
    if by.is_none_or(|by| t.created_by == by) {
        println!("{}", line(t));
    }
}

/// Tells how many web sign-ins of `of` were revoked.
fn sessions_revoked(of: &str, revoked: u64) {
    println!("revoked {revoked} web sign-in(s) of {}", one_line(of));
}

/// A token on one line (who made it, as anyone's text, escaped).
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
        one_line(&t.created_by)
    )
}
