//! The operator API's local tokens (`api_tokens`), each statement once for both engines, as
//! methods of [`Tx`]. Only a token's SHA-256 is stored.

use uuid::Uuid;

use super::engine::{from_columns, Arg, Columns, Dialects, FromColumns, Result, Tx};
use crate::api_tokens::{ApiToken, TokenTimes};

const CREATE: Dialects = Dialects {
    postgres: "INSERT INTO api_tokens
                      (token_id, name, role, sha256, created_at, created_by, expires_at)
               VALUES ($1, $2, $3, $4, now(), $5, now() + make_interval(secs => $6))
               ON CONFLICT (name) DO NOTHING",
    sqlite: "INSERT INTO api_tokens
                    (token_id, name, role, sha256, created_at, created_by, expires_at)
             VALUES ($1, $2, $3, $4, $7, $5, $7 + $6)
             ON CONFLICT (name) DO NOTHING",
};

const REVOKE: Dialects = Dialects {
    postgres: "UPDATE api_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL",
    sqlite: "UPDATE api_tokens SET revoked_at = $2 WHERE name = $1 AND revoked_at IS NULL",
};

const REVOKE_SESSIONS_OF: Dialects = Dialects {
    postgres: "UPDATE api_tokens SET revoked_at = now()
                WHERE name LIKE 'session.%' AND created_by = $1 AND revoked_at IS NULL",
    sqlite: "UPDATE api_tokens SET revoked_at = $2
              WHERE name LIKE 'session.%' AND created_by = $1 AND revoked_at IS NULL",
};

const USED: Dialects = Dialects {
    postgres: "UPDATE api_tokens SET last_used_at = now() WHERE token_id = $1",
    sqlite: "UPDATE api_tokens SET last_used_at = $2 WHERE token_id = $1",
};

/// The columns of [`ApiToken`].
const COLUMNS: &str =
    "token_id, name, role, created_at, created_by, expires_at, revoked_at, last_used_at";

impl Tx {
    /// Records a token with the SHA-256 of its secret, valid for `valid_for` from the
    /// transaction's time; false (nothing written) if a token of that name exists.
    pub(crate) async fn create_api_token(
        &mut self,
        token: &ApiToken,
        sha256: &[u8],
        valid_for: std::time::Duration,
    ) -> Result<bool> {
        let args = [
            Arg::Uuid(token.id),
            Arg::Text(&token.name),
            Arg::Text(token.role.as_str()),
            Arg::Bytes(sha256),
            Arg::Text(&token.created_by),
            Arg::Span(valid_for),
            Arg::Now,
        ];
        Ok(self.conn().execute(&CREATE, &args).await? == 1)
    }

    /// The token whose secret has this SHA-256, revoked and expired ones included.
    pub(crate) async fn api_token_by_sha256(&mut self, sha256: &[u8]) -> Result<Option<ApiToken>> {
        let sql = format!("SELECT {COLUMNS} FROM api_tokens WHERE sha256 = $1");
        self.conn().row(sql.as_str(), &[Arg::Bytes(sha256)]).await
    }

    /// The token named `name`.
    pub async fn api_token(&mut self, name: &str) -> Result<Option<ApiToken>> {
        let sql = format!("SELECT {COLUMNS} FROM api_tokens WHERE name = $1");
        self.conn().row(sql.as_str(), &[Arg::Text(name)]).await
    }

    /// At most `limit` tokens named after `after` (from the first if `None`), by name.
    pub async fn api_tokens(&mut self, after: Option<&str>, limit: i64) -> Result<Vec<ApiToken>> {
        let sql =
            format!("SELECT {COLUMNS} FROM api_tokens WHERE name > $1 ORDER BY name LIMIT $2");
        // Every name is longer than the empty one.
        let args = [Arg::Text(after.unwrap_or("")), Arg::Int(limit)];
        self.conn().rows(sql.as_str(), &args).await
    }

    /// Revokes the token named `name`; false if there is none or it was revoked already.
    pub(crate) async fn revoke_api_token(&mut self, name: &str) -> Result<bool> {
        let args = [Arg::Text(name), Arg::Now];
        Ok(self.conn().execute(&REVOKE, &args).await? == 1)
    }

    /// Revokes every web sign-in of `who` (as its token records who signed in) not revoked
    /// yet; returns how many.
    pub(crate) async fn revoke_sessions_of(&mut self, who: &str) -> Result<u64> {
        let args = [Arg::Text(who), Arg::Now];
        self.conn().execute(&REVOKE_SESSIONS_OF, &args).await
    }

    /// Records that the token `id` was used now.
    pub(crate) async fn api_token_used(&mut self, id: Uuid) -> Result<()> {
        self.conn()
            .execute(&USED, &[Arg::Uuid(id), Arg::Now])
            .await?;
        Ok(())
    }
}

from_columns! {
    TokenTimes {
        created_at: time, expires_at: time, revoked_at: opt_time, last_used_at: opt_time,
    }
}

impl FromColumns for ApiToken {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        Ok(ApiToken {
            id: r.get("token_id")?,
            name: r.get("name")?,
            role: r.parsed("role")?,
            created_by: r.get("created_by")?,
            times: TokenTimes::from_columns(r)?,
        })
    }
}
