-- Schema v8 (SQLite): provider ids a provider refused to make a machine of (Ironic refusing a
-- node's deploy, say), skipped until a time, so that every replica and a restarted one skip
-- them alike instead of each asking again. Expand only: a new table, which binaries of schema
-- 3 to 7 neither read nor write.
CREATE TABLE provider_skips (
    provider TEXT NOT NULL,
    provider_id TEXT NOT NULL CHECK (length(provider_id) BETWEEN 1 AND 128),
    until INTEGER NOT NULL,
    at INTEGER NOT NULL,
    cause TEXT NOT NULL,
    PRIMARY KEY (provider, provider_id)
) WITHOUT ROWID;
