//! Provider ids skipped after their provider refused to make a machine of them (design.md §7 as
//! amended in ARCHITECTURE.md): one row per id, until a time, shared by every replica.

use chrono::{DateTime, Utc};

use super::engine::{from_columns, Arg, Dialects, Result, Tx};
use crate::model::{stored_cause, ProviderKind, ProviderSkip};

const SKIP: Dialects = Dialects {
    postgres: "INSERT INTO provider_skips (provider, provider_id, until, at, cause)
               VALUES ($1, $2, $3, now(), $4)
               ON CONFLICT (provider, provider_id)
               DO UPDATE SET until = excluded.until, at = excluded.at, cause = excluded.cause",
    sqlite: "INSERT INTO provider_skips (provider, provider_id, until, at, cause)
             VALUES ($1, $2, $3, $5, $4)
             ON CONFLICT (provider, provider_id)
             DO UPDATE SET until = excluded.until, at = excluded.at, cause = excluded.cause",
};

/// Skips that ended go when the next one is written: the table holds at most the ids
/// refused within one skip's length.
const FORGET_ENDED: Dialects = Dialects {
    postgres: "DELETE FROM provider_skips WHERE provider = $1 AND until <= now()",
    sqlite: "DELETE FROM provider_skips WHERE provider = $1 AND until <= $2",
};

const SKIPPED: Dialects = Dialects {
    postgres: "SELECT provider_id, until, at, cause FROM provider_skips
                WHERE provider = $1 AND until > now() ORDER BY provider_id",
    sqlite: "SELECT provider_id, until, at, cause FROM provider_skips
              WHERE provider = $1 AND until > $2 ORDER BY provider_id",
};

impl Tx {
    /// Skips `provider_id` of `provider` until `until` because of `cause` (stored bounded),
    /// replacing an earlier skip of it; forgets the provider's skips that ended.
    pub async fn skip_provider_id(
        &mut self,
        provider: ProviderKind,
        provider_id: &str,
        until: DateTime<Utc>,
        cause: &str,
    ) -> Result<()> {
        let conn = self.conn();
        let kind = Arg::Text(provider.as_str());
        conn.execute(&FORGET_ENDED, &[kind, Arg::Now]).await?;
        let cause = stored_cause(cause);
        let args = [
            kind,
            Arg::Text(provider_id),
            Arg::Time(until),
            Arg::Text(&cause),
            Arg::Now,
        ];
        conn.execute(&SKIP, &args).await?;
        Ok(())
    }

    /// The provider ids of `provider` skipped now, in id order.
    pub async fn skipped_provider_ids(
        &mut self,
        provider: ProviderKind,
    ) -> Result<Vec<ProviderSkip>> {
        let args = [Arg::Text(provider.as_str()), Arg::Now];
        self.conn().rows(&SKIPPED, &args).await
    }
}

from_columns! {
    ProviderSkip { provider_id: get, until: time, at: time, cause: get }
}
