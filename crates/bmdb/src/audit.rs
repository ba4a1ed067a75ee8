//! The security audit trail (`audit_events`): sign-ins and sign-outs, tokens made and revoked,
//! and every request the operator surfaces refused. A server hands its events over in
//! batches ([`Bmdb::record_audit_events`]); operators read them newest first, filtered by
//! principal, kind and time ([`Bmdb::audit_events`]); retention deletes the oldest.

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::model::text_enum;
use crate::paging::{check_page_limit, last_page_key};
use crate::{Bmdb, Error};

text_enum! {
    /// What an audit event records.
    AuditKind { SignIn, SignOut, TokenCreated, TokenRevoked, SessionsRevoked, Refused }
}

/// Longest text kept in one field of an event; longer text is cut (a refused peer chooses
/// what it sends).
pub const MAX_AUDIT_TEXT: usize = 512;

/// Most events in one page of [`Bmdb::audit_events`].
pub const MAX_AUDIT_PAGE: usize = 1000;

/// One security event, as a server saw it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AuditEvent {
    /// What happened.
    pub kind: AuditKind,
    /// When the server saw it (the server's clock).
    pub at: DateTime<Utc>,
    /// Who: the identity that acted or was refused, if it was proven or named.
    pub principal: Option<String>,
    /// Why, or what: the refusal's reason, the token's name, the role signed in with.
    pub reason: String,
    /// The peer's address, if known.
    pub peer: Option<String>,
    /// Its place in the trail: later events have higher ids. 0 for an event not recorded
    /// yet.
    pub id: i64,
    /// The route (`/api/v1/tokens`, `web sign-in`), if any.
    pub route: Option<String>,
    /// The request's id, as its answer carried it.
    pub request_id: Option<String>,
}

impl AuditEvent {
    /// An event of `kind` seen now, with `reason`; the other fields empty.
    pub fn now(kind: AuditKind, reason: impl Into<String>) -> AuditEvent {
        AuditEvent {
            id: 0,
            at: Utc::now(),
            kind,
            principal: None,
            peer: None,
            route: None,
            reason: cut(reason.into()),
            request_id: None,
        }
    }

    /// The same event, by or about `principal`.
    pub fn by(self, principal: impl Into<String>) -> AuditEvent {
        AuditEvent {
            principal: Some(cut(principal.into())),
            ..self
        }
    }

    /// The same event, from `peer` on `route` in request `request_id`.
    pub fn from_request(
        self,
        peer: Option<&str>,
        route: Option<&str>,
        request_id: Option<&str>,
    ) -> AuditEvent {
        let owned = |text: Option<&str>| text.map(|t| cut(t.to_string()));
        AuditEvent {
            peer: owned(peer),
            route: owned(route),
            request_id: owned(request_id),
            ..self
        }
    }

    /// An event of `kind` that `actor` caused now, with `reason`.
    pub fn acted(kind: AuditKind, reason: impl Into<String>, actor: &Actor) -> AuditEvent {
        AuditEvent::now(kind, reason)
            .by(&actor.principal)
            .from_request(
                actor.peer.as_deref(),
                actor.route.as_deref(),
                actor.request_id.as_deref(),
            )
    }
}

/// Who made or revoked a token or a sign-in, and from where: what the audit trail records
/// with the change, in the change's own transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Actor {
    /// The identity (`token:ci`, `oidc:SUBJECT@ISSUER`, `cli:USER`).
    pub principal: String,
    /// The peer's address, for a request.
    pub peer: Option<String>,
    /// The route, for a request.
    pub route: Option<String>,
    /// The request's id, for a request.
    pub request_id: Option<String>,
}

impl Actor {
    /// `principal`, not in a request (the CLI on the database).
    pub fn named(principal: impl Into<String>) -> Actor {
        Actor {
            principal: principal.into(),
            ..Actor::default()
        }
    }

    /// The same actor, in the request `request_id` from `peer` on `route`.
    pub fn in_request(self, peer: Option<String>, route: &str, request_id: &str) -> Actor {
        Actor {
            peer,
            route: Some(route.to_string()),
            request_id: Some(request_id.to_string()),
            ..self
        }
    }
}

/// `text` cut to [`MAX_AUDIT_TEXT`] bytes, at a character boundary.
fn cut(mut text: String) -> String {
    if text.len() > MAX_AUDIT_TEXT {
        let mut end = MAX_AUDIT_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// Which events an operator asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only this principal's.
    pub principal: Option<String>,
    /// Only of this kind.
    pub kind: Option<AuditKind>,
    /// Only those seen at or after this.
    pub since: Option<DateTime<Utc>>,
}

impl Bmdb {
    /// Records `events` in one transaction.
    pub async fn record_audit_events(&self, events: &[AuditEvent]) -> Result<(), Error> {
        let events: Arc<[AuditEvent]> = events.into();
        self.transact(move |tx| {
            let events = Arc::clone(&events);
            Box::pin(async move { tx.record_audit_events(&events).await })
        })
        .await
    }

    /// The events `filter` selects with ids below `before` (from the newest if `None`),
    /// newest first: a page of at most `limit` (1 to [`MAX_AUDIT_PAGE`]), and the last one's id
    /// if more follow (the next page's `before`).
    pub async fn audit_events(
        &self,
        filter: &AuditFilter,
        before: Option<i64>,
        limit: usize,
    ) -> Result<(Vec<AuditEvent>, Option<i64>), Error> {
        check_page_limit(limit, MAX_AUDIT_PAGE)?;
        let filter = filter.clone();
        let before = before.unwrap_or(i64::MAX);
        let events = self
            .read(move |tx| {
                let filter = filter.clone();
                // One more than asked tells whether more follow.
                Box::pin(async move { tx.audit_events(&filter, before, limit as i64 + 1).await })
            })
            .await?;
        Ok(last_page_key(events, limit, |e| e.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_AUDIT_TEXT);
        let event = AuditEvent::now(AuditKind::Refused, long).by("x".repeat(2000));
        assert!(event.reason.len() <= MAX_AUDIT_TEXT && event.reason.len() >= MAX_AUDIT_TEXT - 1);
        assert!(event.reason.chars().all(|c| c == 'é'));
        assert_eq!(event.principal.unwrap().len(), MAX_AUDIT_TEXT);
    }
}
