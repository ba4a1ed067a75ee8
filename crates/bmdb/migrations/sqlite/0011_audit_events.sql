-- Schema v11 (SQLite): the security audit trail; see the Postgres script.
CREATE TABLE audit_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at INTEGER NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN
        ('SignIn', 'SignOut', 'TokenCreated', 'TokenRevoked', 'SessionsRevoked', 'Refused')),
    principal TEXT, peer TEXT, route TEXT, reason TEXT NOT NULL, request_id TEXT
);
CREATE INDEX audit_events_at ON audit_events (at);
CREATE INDEX audit_events_principal ON audit_events (principal, id);
