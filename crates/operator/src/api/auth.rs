//! Who is asking: the identity a request proves with its `Authorization: Bearer` header. A
//! local API token (`shp_…`) is looked up by its SHA-256 in the BMDB; answers are cached
//! briefly so that a busy client costs no query per request, and its use is recorded at
//! most once a minute, every server's uses in one transaction by the task `token-uses`
//! ([`Authenticator::record_uses`]). Anything else is verified as the identity provider's JWT
//! (`oidc.rs`), when one is configured. A credential is never logged, counted or stored.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap};
use chrono::Utc;
use shepherd_bmdb::{ApiToken, Bmdb};
use shepherd_tasks::{Outcome, TaskHandle};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::policy::Principal;
use super::problem::{Kind, Problem};
use crate::rate_limit::{RateLimiter, RateSpec};

/// How long a token's lookup is reused. A token revoked through another server (or on the
/// database) stops working here within this; one revoked through this server stops at once.
/// One second: a busy client still costs one primary-key read a second per server, and a
/// revocation holds everywhere well within the two seconds an operator may expect.
pub const TOKEN_CACHE_TTL: Duration = Duration::from_secs(1);
/// Most token lookups cached; the cache starts afresh when full (garbage tokens cannot grow it
/// without bound).
const TOKEN_CACHE_MAX: usize = 10_000;
/// A token's use is recorded at most this often.
const USE_RECORDED_EVERY: Duration = Duration::from_secs(60);
/// How often the uses waiting to be recorded are written, together.
const USES_WRITTEN_EVERY: Duration = Duration::from_secs(5);
/// The task that writes them, as `/tasks` shows it.
pub const USES_TASK: &str = "token-uses";
/// Longest `Authorization` header read.
const MAX_CREDENTIAL: usize = 8 << 10;

/// A cached lookup: when it was made and what it found.
type Cached = (Instant, Option<ApiToken>);

/// Verifies credentials.
pub struct Authenticator {
    db: Bmdb,
    /// The identity provider whose tokens are accepted, if one is configured.
    oidc: Option<Arc<super::oidc::OidcVerifier>>,
    /// Token lookups by the SHA-256 of the token.
    tokens: Mutex<HashMap<[u8; 32], Cached>>,
    /// When each token's use was last recorded.
    recorded: Mutex<HashMap<Uuid, Instant>>,
    /// Tokens whose use waits to be written by [`Authenticator::record_uses`] (at most one
    /// entry per token).
    unwritten: Mutex<BTreeSet<Uuid>>,
    /// Requests per identity, one budget for every surface: the API, the web UI's pages and
    /// `/metrics`.
    per_identity: RateLimiter,
}

impl Authenticator {
    /// An authenticator of the tokens in `db` and, if given, of an identity provider's.
    pub fn new(db: Bmdb, oidc: Option<Arc<super::oidc::OidcVerifier>>) -> Authenticator {
        Authenticator {
            db,
            oidc,
            tokens: Mutex::new(HashMap::new()),
            recorded: Mutex::new(HashMap::new()),
            unwritten: Mutex::new(BTreeSet::new()),
            per_identity: RateLimiter::new(crate::rate_limit::DEFAULT_RATE),
        }
    }

    /// The same authenticator, each identity allowed `rate`.
    pub fn with_identity_rate(self, rate: RateSpec) -> Authenticator {
        Authenticator {
            per_identity: RateLimiter::new(rate),
            ..self
        }
    }

    /// Takes one request from `who`'s budget, which every surface shares; a 429 problem once
    /// it is spent (until it refills).
    pub fn admit(&self, who: &Principal) -> Result<(), Problem> {
        self.per_identity
            .admit(&who.name)
            .map_err(|_| Problem::new(Kind::RateLimited, "too many requests; slow down"))
    }

    /// The principal `headers` prove; a 401 problem for none, or one that does not verify.
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, Problem> {
        let unauthenticated = |why: &str| Problem::new(Kind::Unauthenticated, why);
        let value = headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| unauthenticated("no credentials: send Authorization: Bearer TOKEN"))?;
        if value.len() > MAX_CREDENTIAL {
            return Err(unauthenticated("the Authorization header is too long"));
        }
        let value = value
            .to_str()
            .map_err(|_| unauthenticated("the Authorization header is not text"))?;
        let (scheme, credential) = value.split_once(' ').unwrap_or((value, ""));
        if !scheme.eq_ignore_ascii_case("bearer") || credential.trim().is_empty() {
            return Err(unauthenticated("only Bearer credentials are accepted"));
        }
        let credential = credential.trim();
        if credential.starts_with(shepherd_bmdb::TOKEN_PREFIX) {
            return self.token(credential).await;
        }
        match &self.oidc {
            Some(oidc) => oidc.verify(credential).await,
            None => Err(unauthenticated(
                "the credential is not a Shepherd API token (no identity provider is configured)",
            )),
        }
    }

    /// The principal of the local API token `text`.
    async fn token(&self, text: &str) -> Result<Principal, Problem> {
        let token = self.valid_token(text).await?;
        Ok(Principal {
            name: token.principal_name(),
            role: token.role,
        })
    }

    /// The web UI sign-in whose cookie holds `text`: its principal and its token (whose name
    /// signing out revokes). Only a sign-in's token is accepted from a cookie.
    pub async fn web_session(&self, text: &str) -> Result<(Principal, ApiToken), Problem> {
        let token = self.valid_token(text).await?;
        if !token.name.starts_with(shepherd_bmdb::SESSION_PREFIX) {
            let why = "the cookie does not hold a web sign-in";
            return Err(Problem::new(Kind::Unauthenticated, why));
        }
        let principal = Principal {
            name: token.principal_name(),
            role: token.role,
        };
        Ok((principal, token))
    }

    /// The token whose text is `text`, if it is valid now (its use is recorded).
    async fn valid_token(&self, text: &str) -> Result<ApiToken, Problem> {
        let invalid = |why: &str| Problem::new(Kind::Unauthenticated, why);
        // Junk is refused before it costs a lookup or a place in the cache.
        if !shepherd_bmdb::is_token_shaped(text) {
            return Err(invalid("not a token"));
        }
        let digest = shepherd_bmdb::api_token_digest(text);
        let cached = self.tokens.lock().unwrap().get(&digest).cloned();
        let token = match cached {
            Some((at, token)) if at.elapsed() < TOKEN_CACHE_TTL => token,
            _ => {
                let token = self.db.api_token_for(text).await?;
                let mut tokens = self.tokens.lock().unwrap();
                if tokens.len() >= TOKEN_CACHE_MAX {
                    tokens.clear();
                }
                tokens.insert(digest, (Instant::now(), token.clone()));
                token
            }
        };
        let token = token.ok_or_else(|| invalid("unknown token"))?;
        if token.times.revoked_at.is_some() {
            return Err(invalid("the token was revoked"));
        }
        if !token.is_valid_at(Utc::now()) {
            return Err(invalid("the token expired"));
        }
        self.record_use(token.id);
        Ok(token)
    }

    /// Notes the use of token `id` for [`Authenticator::record_uses`], at most once a minute.
    fn record_use(&self, id: Uuid) {
        let mut recorded = self.recorded.lock().unwrap();
        let due = recorded
            .get(&id)
            .is_none_or(|at| at.elapsed() >= USE_RECORDED_EVERY);
        if due {
            recorded.insert(id, Instant::now());
            self.unwritten.lock().unwrap().insert(id);
        }
    }

    /// Writes the tokens' uses noted since the last write, in one transaction every few
    /// seconds, until `cancel` (then once more); each write is a unit of `task`. Uses that
    /// could not be written wait for the next (at most one entry per token).
    pub async fn record_uses(&self, task: TaskHandle, cancel: CancellationToken) {
        let pause = || tokio::time::sleep(USES_WRITTEN_EVERY);
        shepherd_tasks::driver::repeat(&task, &cancel, || self.write_uses(), pause).await;
        let (outcome, summary) = self.write_uses().await;
        task.ended(outcome, summary);
    }

    /// Writes the uses noted so far; how that ended, in one line.
    async fn write_uses(&self) -> (Outcome, String) {
        let ids: Vec<Uuid> = std::mem::take(&mut *self.unwritten.lock().unwrap())
            .into_iter()
            .collect();
        if ids.is_empty() {
            return (Outcome::Succeeded, "no token use to record".into());
        }
        match self.db.api_tokens_used(&ids).await {
            Ok(()) => (
                Outcome::Succeeded,
                format!("{} token uses recorded", ids.len()),
            ),
            Err(e) => {
                tracing::debug!(error = %e, uses = ids.len(), "could not record tokens' uses; trying again");
                self.unwritten.lock().unwrap().extend(&ids);
                let summary = format!("{} token uses not recorded: {e}", ids.len());
                (Outcome::of_bmdb_error(&e), summary)
            }
        }
    }

    /// Forgets every cached lookup (after a revocation through this server).
    pub fn forget_cached(&self) {
        self.tokens.lock().unwrap().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A junk cookie or bearer credential costs no database round trip: with the database
    /// closed under it, junk is still refused as invalid (a lookup would have failed as
    /// unavailable), and it takes no place in the lookup cache.
    #[tokio::test]
    async fn junk_credentials_cost_no_database_round_trip() {
        let t = shepherd_bmdb::testing::sqlite().await;
        let auth = Authenticator::new(t.db.clone(), None);
        t.db.close().await;
        let junk = [
            "x".to_string(),
            format!("{}{}", shepherd_bmdb::TOKEN_PREFIX, "0".repeat(63)),
            format!("{}{}", shepherd_bmdb::TOKEN_PREFIX, "G".repeat(64)),
            format!("{}{}x", shepherd_bmdb::TOKEN_PREFIX, "0".repeat(64)),
        ];
        for (n, text) in junk
            .iter()
            .chain(&[format!("junk-{}", "z".repeat(2000))])
            .enumerate()
        {
            let refused = auth.web_session(text).await.unwrap_err();
            assert_eq!(
                refused.kind,
                Kind::Unauthenticated,
                "{n}: {}",
                refused.detail
            );
        }
        assert!(auth.tokens.lock().unwrap().is_empty());
        // A well-formed unknown token is looked up, and with the database closed that fails.
        let shaped = format!("{}{}", shepherd_bmdb::TOKEN_PREFIX, "0".repeat(64));
        let looked_up = auth.web_session(&shaped).await.unwrap_err();
        assert_eq!(looked_up.kind, Kind::Unavailable, "{}", looked_up.detail);
    }

    /// Uses are noted once a minute per token and written together by the recording task;
    /// uses it could not write (the database down) wait for its next write.
    #[tokio::test]
    async fn token_uses_are_written_together_and_kept_while_the_database_is_down() {
        let t = shepherd_bmdb::testing::sqlite().await;
        let who = shepherd_bmdb::Actor::named("alice");
        let day = Duration::from_secs(86_400);
        let mut tokens = Vec::new();
        for name in ["ci", "deploys"] {
            let made =
                t.db.create_api_token(name, shepherd_bmdb::Role::Viewer, day, &who);
            tokens.push(made.await.unwrap().unwrap());
        }
        let auth = Authenticator::new(t.db.clone(), None);
        for (_, secret) in tokens.iter().chain(&tokens) {
            auth.valid_token(secret.reveal()).await.unwrap();
        }
        assert_eq!(auth.unwritten.lock().unwrap().len(), 2, "one use per token");
        let (outcome, summary) = auth.write_uses().await;
        assert_eq!(
            (outcome, summary.as_str()),
            (Outcome::Succeeded, "2 token uses recorded")
        );
        for (token, secret) in &tokens {
            let found = t.db.api_token_for(secret.reveal()).await.unwrap().unwrap();
            assert!(found.times.last_used_at.is_some(), "{}", token.name);
        }
        assert_eq!(auth.write_uses().await.1, "no token use to record");

        // A use noted while the database is down is kept for the next write.
        auth.record_use(uuid::Uuid::new_v4());
        t.db.close().await;
        let (outcome, _) = auth.write_uses().await;
        assert_eq!(outcome, Outcome::Waited);
        assert_eq!(auth.unwritten.lock().unwrap().len(), 1);
    }
}
