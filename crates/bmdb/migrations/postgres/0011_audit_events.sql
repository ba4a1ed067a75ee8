-- Schema v11 (Postgres): the security audit trail. Every sign-in and sign-out, every token
-- made or revoked (and by whom), and every request the operator API or the web UI refused
-- (the peer, the principal if known, the route, the reason), written in batches by the
-- server that saw it, at the time that server saw it. Retention deletes the oldest.
--
-- Expand: binaries of schema 3 to 10 neither read nor write it.
CREATE TABLE audit_events (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL,
    kind text NOT NULL CHECK (kind IN
        ('SignIn', 'SignOut', 'TokenCreated', 'TokenRevoked', 'SessionsRevoked', 'Refused')),
    principal text,
    peer text,
    route text,
    reason text NOT NULL,
    request_id text
);
CREATE INDEX audit_events_at ON audit_events (at);
CREATE INDEX audit_events_principal ON audit_events (principal, id);
