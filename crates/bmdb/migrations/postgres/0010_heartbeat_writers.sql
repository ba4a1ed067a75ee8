-- Schema v10 (Postgres): what the BMaaS servers could not record. A server that answers an
-- agent's heartbeat "unavailable" (its BMDB writes fail, it sheds load) or records it late has
-- made a machine look silent that was not: the recoverer must not believe that silence. Each
-- server reports here, every second, until when everything it received was recorded
-- (`clean_at`); a trouble that ended is kept as a window. The recoverer's claims read both
-- (sql/claims.rs; the rule and its arithmetic are in ARCHITECTURE.md).
--
-- Expand: binaries of schema 3 to 9 keep running; they neither report nor read these tables,
-- so their recoverers believe a silence a server caused, as they always did.
CREATE TABLE heartbeat_writers (
    -- One running server; gone when it stops.
    writer_id uuid PRIMARY KEY,
    component text NOT NULL,
    -- Every heartbeat it received before this was recorded or refused in time.
    clean_at timestamptz NOT NULL,
    -- Its last report: one older than a few seconds means it stopped reporting.
    reported_at timestamptz NOT NULL,
    -- Heartbeats waiting to be written at the last report, and refused since it started.
    backlog bigint NOT NULL,
    refused bigint NOT NULL
);

CREATE TABLE heartbeat_troubles (
    id bigserial PRIMARY KEY,
    writer_id uuid NOT NULL,
    -- From the first heartbeat refused or recorded late to the last.
    started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL,
    refused bigint NOT NULL,
    cause text NOT NULL
);
CREATE INDEX heartbeat_troubles_ended ON heartbeat_troubles (ended_at);
