//! Local API tokens: how automation, and sites without an identity provider, authenticate to
//! the operator API. A token is a random secret shown once when it is made; the BMDB keeps
//! only its SHA-256, with the token's name, role, expiry, revocation and last use.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::RngCore;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::audit::{Actor, AuditEvent, AuditKind};
use crate::paging::{check_page_limit, last_page_key};
use crate::{Bmdb, Error, Role};

/// What every token's text starts with, so that a leaked one is recognisable (secret
/// scanners, logs) and a token is not mistaken for a JWT.
pub const TOKEN_PREFIX: &str = "shp_";

/// What the names of web UI sign-ins start with; no other token may be named so.
pub const SESSION_PREFIX: &str = "session.";

/// Longest token name kept.
const MAX_NAME: usize = 100;

/// Whether `text` has the shape of a token's secret: [`TOKEN_PREFIX`] and 64 lowercase hex
/// digits. Anything else is no token, known without a database round trip (a junk cookie
/// or header costs nothing).
pub fn is_token_shaped(text: &str) -> bool {
    text.strip_prefix(TOKEN_PREFIX).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Most tokens in one page of [`Bmdb::api_tokens`].
pub const MAX_PAGE: usize = 1000;

/// A token as the BMDB records it (never its secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiToken {
    /// Its id.
    pub id: Uuid,
    /// Its name, unique and never reused (`ci`, `cmdb-sync`): who it is in the operators'
    /// history (`token:NAME`).
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// Who made it.
    pub created_by: String,
    /// Its life, by the database clock.
    pub times: TokenTimes,
}

/// When a token was made, stops working, was revoked and was last used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenTimes {
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it stops working.
    pub expires_at: DateTime<Utc>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
    /// When it was last used (recorded at most once a minute per token).
    pub last_used_at: Option<DateTime<Utc>>,
}

impl ApiToken {
    /// Who the token acts as in the operators' history: `token:NAME`, or, for a web UI
    /// sign-in, the identity that signed in.
    pub fn principal_name(&self) -> String {
        if self.name.starts_with(SESSION_PREFIX) {
            self.created_by.clone()
        } else {
            format!("token:{}", self.name)
        }
    }

    /// Whether it may be used at `now`: not revoked and not expired.
    pub fn is_valid_at(&self, now: DateTime<Utc>) -> bool {
        self.times.revoked_at.is_none() && now < self.times.expires_at
    }
}

/// A token's secret text. Its `Debug` shows nothing of it, so it cannot reach a log by
/// accident.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSecret(String);

impl TokenSecret {
    /// A new random secret: the prefix and 32 random bytes in hex.
    /// A new secret: [`TOKEN_PREFIX`] and 64 lowercase hex digits ([`is_token_shaped`]).
    fn generate() -> TokenSecret {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        TokenSecret(format!("{TOKEN_PREFIX}{hex}"))
    }

    /// The text, to show once to whoever made it.
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

/// The SHA-256 the BMDB keeps of a token's text: what a server may cache lookups by.
pub fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

impl std::fmt::Debug for TokenSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSecret(…)")
    }
}

/// The checks on a new token's name: not empty, short, and of letters, digits, `-`, `_`, `.`.
fn check_name(name: &str) -> Result<(), Error> {
    let fine = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(fine) {
        return Err(Error::InvalidArgument {
            what: "token name",
            problem: format!(
                "{name:?}: 1 to {MAX_NAME} letters, digits, '-', '_' or '.' are allowed"
            ),
        });
    }
    Ok(())
}

/// A token to make: its name, role, life and maker, and the audit event its making records.
struct Draft<'a> {
    name: &'a str,
    role: Role,
    valid_for: Duration,
    created_by: &'a str,
    audit: AuditEvent,
}

impl Bmdb {
    /// Makes a token named `name` with `role`, valid for `valid_for`; returns it with its
    /// secret, or `None` if a token of that name exists (revoked ones included: names are
    /// never reused, so the history stays unambiguous). `by` made it: the audit trail records
    /// that in the same transaction.
    pub async fn create_api_token(
        &self,
        name: &str,
        role: Role,
        valid_for: Duration,
        by: &Actor,
    ) -> Result<Option<(ApiToken, TokenSecret)>, Error> {
        check_name(name)?;
        if name.starts_with(SESSION_PREFIX) {
            return Err(Error::InvalidArgument {
                what: "token name",
                problem: format!(
                    "{name:?}: names starting {SESSION_PREFIX:?} are the web UI's sign-ins"
                ),
            });
        }
        let days = valid_for.as_secs() / 86_400;
        let what = format!("token {name} ({role}, valid {days} days)");
        let draft = Draft {
            name,
            role,
            valid_for,
            created_by: &by.principal,
            audit: AuditEvent::acted(AuditKind::TokenCreated, what, by),
        };
        self.insert_api_token(draft).await
    }

    /// Makes the token of a web UI sign-in: `who` (as the identity provider proved it) with
    /// `role`, for `valid_for`. Its name is [`SESSION_PREFIX`] and a random id; it acts as
    /// `who` (see [`ApiToken::principal_name`]). Signing out revokes it, and an admin can
    /// list and revoke it like any token. The audit trail records the sign-in in the same
    /// transaction.
    pub async fn create_web_session(
        &self,
        who: &Actor,
        role: Role,
        valid_for: Duration,
    ) -> Result<(ApiToken, TokenSecret), Error> {
        let name = format!("{SESSION_PREFIX}{}", Uuid::new_v4().simple());
        let draft = Draft {
            name: &name,
            role,
            valid_for,
            created_by: &who.principal,
            audit: AuditEvent::acted(AuditKind::SignIn, format!("{role} ({name})"), who),
        };
        let made = self.insert_api_token(draft).await?;
        made.ok_or_else(|| Error::InvalidArgument {
            what: "web session",
            problem: format!("{name}: made twice"),
        })
    }

    /// Inserts the token `draft` describes (its name checked by the caller); `None` if the
    /// name is taken.
    async fn insert_api_token(
        &self,
        draft: Draft<'_>,
    ) -> Result<Option<(ApiToken, TokenSecret)>, Error> {
        let secret = TokenSecret::generate();
        let sha256 = digest(secret.reveal());
        let (role, valid_for) = (draft.role, draft.valid_for);
        let (name, created_by) = (draft.name.to_string(), draft.created_by.to_string());
        let audit = draft.audit;
        let id = Uuid::new_v4();
        let made = self
            .transact(move |tx| {
                let (name, created_by, audit) = (name.clone(), created_by.clone(), audit.clone());
                Box::pin(async move {
                    let draft = ApiToken {
                        id,
                        name: name.clone(),
                        role,
                        created_by,
                        times: TokenTimes {
                            created_at: DateTime::UNIX_EPOCH,
                            expires_at: DateTime::UNIX_EPOCH,
                            revoked_at: None,
                            last_used_at: None,
                        },
                    };
                    if !tx.create_api_token(&draft, &sha256, valid_for).await? {
                        return Ok(None);
                    }
                    tx.record_audit_event(&audit).await?;
                    tx.api_token(&name).await
                })
            })
            .await?;
        Ok(made.map(|token| (token, secret)))
    }

    /// The token whose secret is `text`, whatever its state (the caller checks
    /// [`ApiToken::is_valid_at`]); `None` for a text that is no token.
    pub async fn api_token_for(&self, text: &str) -> Result<Option<ApiToken>, Error> {
        if !is_token_shaped(text) {
            return Ok(None);
        }
        let sha256 = digest(text);
        self.read(move |tx| Box::pin(async move { tx.api_token_by_sha256(&sha256).await }))
            .await
    }

    /// The tokens named after `after` (from the first if `None`), by name: a page of at most
    /// `limit` (1 to [`MAX_PAGE`]), and the last one's name if more follow (the next page's
    /// `after`).
    pub async fn api_tokens(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<ApiToken>, Option<String>), Error> {
        check_page_limit(limit, MAX_PAGE)?;
        let after = after.map(str::to_string);
        let tokens = self
            .read(move |tx| {
                let after = after.clone();
                // One more than asked tells whether more follow.
                Box::pin(async move { tx.api_tokens(after.as_deref(), limit as i64 + 1).await })
            })
            .await?;
        Ok(last_page_key(tokens, limit, |t| t.name.clone()))
    }

    /// Revokes the token named `name`: it stops working at once for every server that has not
    /// cached it, and within the cache's lifetime for those that have. Returns the token as it
    /// now is, or `None` if there is no such token. The audit trail records that `by` revoked
    /// it (a sign-out, when `by` revoked their own sign-in), in the same transaction.
    pub async fn revoke_api_token(
        &self,
        name: &str,
        by: &Actor,
    ) -> Result<Option<ApiToken>, Error> {
        let (name, by) = (name.to_string(), by.clone());
        self.transact(move |tx| {
            let (name, by) = (name.clone(), by.clone());
            Box::pin(async move {
                let revoked = tx.revoke_api_token(&name).await?;
                let token = tx.api_token(&name).await?;
                if let (true, Some(token)) = (revoked, &token) {
                    let own_sign_in =
                        name.starts_with(SESSION_PREFIX) && token.created_by == by.principal;
                    let kind = match own_sign_in {
                        true => AuditKind::SignOut,
                        false => AuditKind::TokenRevoked,
                    };
                    let what = format!("token {name} of {}", token.created_by);
                    tx.record_audit_event(&AuditEvent::acted(kind, what, &by))
                        .await?;
                }
                Ok(token)
            })
        })
        .await
    }

    /// Revokes every web sign-in of `who` (`oidc:SUBJECT@ISSUER`), as signing out of each
    /// would; returns how many were revoked. The audit trail records that `by` did, in the
    /// same transaction.
    pub async fn revoke_sessions_of(&self, who: &str, by: &Actor) -> Result<u64, Error> {
        let (who, by) = (who.to_string(), by.clone());
        self.transact(move |tx| {
            let (who, by) = (who.clone(), by.clone());
            Box::pin(async move {
                let revoked = tx.revoke_sessions_of(&who).await?;
                let what = format!("{revoked} sign-ins of {who}");
                let event = AuditEvent::acted(AuditKind::SessionsRevoked, what, &by);
                tx.record_audit_event(&event).await?;
                Ok(revoked)
            })
        })
        .await
    }

    /// Records that the tokens `ids` were used now, in one transaction.
    pub async fn api_tokens_used(&self, ids: &[Uuid]) -> Result<(), Error> {
        let ids = ids.to_vec();
        self.transact(move |tx| {
            let ids = ids.clone();
            Box::pin(async move {
                for id in ids {
                    tx.api_token_used(id).await?;
                }
                Ok(())
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_prefixed_random_and_never_printed() {
        let (a, b) = (TokenSecret::generate(), TokenSecret::generate());
        assert!(a.reveal().starts_with(TOKEN_PREFIX));
        assert_eq!(a.reveal().len(), TOKEN_PREFIX.len() + 64);
        assert_ne!(a, b);
        assert!(!format!("{a:?}").contains(&a.reveal()[TOKEN_PREFIX.len()..]));
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("ci-pipeline.v2").is_ok());
        for bad in ["", "a b", "x;DROP", &"n".repeat(MAX_NAME + 1)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
