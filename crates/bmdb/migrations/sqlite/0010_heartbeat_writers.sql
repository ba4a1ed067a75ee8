-- Schema v10 (SQLite): what the BMaaS servers could not record; see the Postgres script.
CREATE TABLE heartbeat_writers (
    writer_id BLOB PRIMARY KEY,
    component TEXT NOT NULL,
    clean_at INTEGER NOT NULL,
    reported_at INTEGER NOT NULL,
    backlog INTEGER NOT NULL,
    refused INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE heartbeat_troubles (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    writer_id BLOB NOT NULL,
    started_at INTEGER NOT NULL,
    ended_at INTEGER NOT NULL,
    refused INTEGER NOT NULL,
    cause TEXT NOT NULL
);
CREATE INDEX heartbeat_troubles_ended ON heartbeat_troubles (ended_at);
