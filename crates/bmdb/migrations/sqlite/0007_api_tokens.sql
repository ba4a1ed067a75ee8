-- Schema v7 (SQLite): local API tokens for the operator API, and the request that made
-- each operator action. Expand only: a new table and a nullable column, which binaries of
-- schema 3 to 6 neither read nor write.

-- Tokens for automation and for sites without an identity provider. Only a SHA-256 of the
-- token is kept; the token itself is shown once, when it is made.
CREATE TABLE api_tokens (
    token_id BLOB PRIMARY KEY NOT NULL,
    name TEXT NOT NULL UNIQUE,
    role TEXT NOT NULL CHECK (role IN ('Viewer', 'Operator', 'Admin')),
    sha256 BLOB NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    created_by TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    revoked_at INTEGER,
    last_used_at INTEGER
) WITHOUT ROWID;

-- The API request an operator action came from (empty for the CLI on the database).
ALTER TABLE operator_actions ADD COLUMN request_id TEXT;
