//! `shepherd audit list`: the security audit trail, newest first, on the database directly
//! (administrators) or, with `--api`, through the operator API with an admin's token. Every
//! field is anyone's text (a refused peer chose the route and the reason), so each is printed
//! escaped on one line.

use anyhow::{Context, Result};
use clap::Subcommand;
use shepherd_bmdb::{AuditEvent, AuditFilter, Bmdb, MAX_AUDIT_PAGE};

use crate::api_client::{ApiArgs, ApiClient};
use shepherd_bmdb::one_line;

/// Subcommands of `shepherd audit`.
#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Events, newest first: sign-ins and sign-outs, tokens made and revoked, refusals.
    List {
        /// Only this principal's (`token:ci`, `oidc:SUBJECT@ISSUER`).
        #[arg(long)]
        principal: Option<String>,
        /// Only of this kind: SignIn, SignOut, TokenCreated, TokenRevoked, SessionsRevoked,
        /// Refused.
        #[arg(long)]
        kind: Option<String>,
        /// Only those seen within this long (`1h`, `7d`).
        #[arg(long, value_parser = crate::flags::duration)]
        since: Option<std::time::Duration>,
        /// Most events printed.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
}

/// Runs `command` on the BMDB at `url`, or through the operator API.
pub async fn run(url: &str, api: &ApiArgs, command: AuditCommand) -> Result<()> {
    let AuditCommand::List {
        principal,
        kind,
        since,
        limit,
    } = command;
    let since = since
        .map(|s| chrono::Duration::from_std(s).map(|s| chrono::Utc::now() - s))
        .transpose()
        .context("--since: too long")?;
    if let Some(client) = api.client()? {
        return list_via_api(&client, principal, kind, since, limit).await;
    }
    let kind = kind
        .map(|k| k.parse())
        .transpose()
        .map_err(|e| anyhow::anyhow!("--kind: {e}"))?;
    let filter = AuditFilter {
        principal,
        kind,
        since,
    };
    let db = Bmdb::open(url).await?;
    let mut before = None;
    let mut left = limit;
    while left > 0 {
        let page = left.min(MAX_AUDIT_PAGE);
        let (events, next) = db.audit_events(&filter, before, page).await?;
        left -= events.len();
        events.iter().for_each(|e| println!("{}", line(e)));
        match next {
            Some(next) => before = Some(next),
            None => break,
        }
    }
    db.close().await;
    Ok(())
}

/// The same list through the API.
async fn list_via_api(
    api: &ApiClient,
    principal: Option<String>,
    kind: Option<String>,
    since: Option<chrono::DateTime<chrono::Utc>>,
    limit: usize,
) -> Result<()> {
    let encode =
        |v: &str| -> String { url::form_urlencoded::byte_serialize(v.as_bytes()).collect() };
    let mut query = String::new();
    if let Some(p) = &principal {
        query.push_str(&format!("&principal={}", encode(p)));
    }
    if let Some(k) = &kind {
        query.push_str(&format!("&kind={}", encode(k)));
    }
    if let Some(s) = since {
        query.push_str(&format!("&since={}", encode(&s.to_rfc3339())));
    }
    let mut before = String::new();
    let mut left = limit;
    while left > 0 {
        let page = left.min(MAX_AUDIT_PAGE);
        let listed = api
            .get(&format!("/audit?limit={page}{query}{before}"))
            .await?;
        let events = listed["events"].as_array().cloned().unwrap_or_default();
        left = left.saturating_sub(events.len());
        for e in &events {
            let text = |key: &str| e[key].as_str().map(str::to_string);
            let event = AuditEvent {
                id: e["id"].as_i64().unwrap_or_default(),
                at: text("at").unwrap_or_default().parse()?,
                kind: text("kind").unwrap_or_default().parse()?,
                principal: text("principal"),
                peer: text("peer"),
                route: text("route"),
                reason: text("reason").unwrap_or_default(),
                request_id: text("request_id"),
            };
            println!("{}", line(&event));
        }
        let Some(next) = listed["next"].as_i64() else {
            break;
        };
        before = format!("&before={next}");
    }
    Ok(())
}

/// One event on one line, every field escaped.
fn line(e: &AuditEvent) -> String {
    fn or_dash(v: &Option<String>) -> String {
        v.as_deref()
            .map_or("-".into(), |t| one_line(t).into_owned())
    }
    format!(
        "{}  {:<15} {:<30} peer {:<15} {:<28} {}  (request {})",
        e.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        e.kind,
        or_dash(&e.principal),
        or_dash(&e.peer),
        or_dash(&e.route),
        one_line(&e.reason),
        or_dash(&e.request_id),
    )
}
