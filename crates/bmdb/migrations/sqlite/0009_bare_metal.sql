-- Schema v9 (SQLite): servers with nothing but a BMC (SPEC §21). A machine the inventory
-- marks as bare has a row in machine_bare_metal saying where it stands on its way from empty
-- disks to its installed OS, and every step it takes is a row of bare_metal_history. The
-- bare-metal loop holds its machines under a work process of its own, and an operator may
-- reimage a machine (boot it into the live environment again).
--
-- Expand: binaries of schema 3 to 8 keep running (see the Postgres script for what they do
-- with bare machines). SQLite cannot alter a CHECK constraint, so the tables whose process or
-- action it bounds are rebuilt; no table refers to them.
CREATE TABLE work_v9 (
    machine_id BLOB NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    session_id BLOB NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    process TEXT NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal')),
    PRIMARY KEY (machine_id, process)
) WITHOUT ROWID;
INSERT INTO work_v9 (machine_id, session_id, process) SELECT machine_id, session_id, process FROM work;
DROP TABLE work;
ALTER TABLE work_v9 RENAME TO work;
CREATE INDEX work_session ON work (session_id);

CREATE TABLE work_history_v9 (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine_id BLOB NOT NULL,
    process TEXT NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal')),
    event TEXT NOT NULL CHECK (event IN ('Started', 'Finished', 'Failed', 'Canceled')),
    at INTEGER NOT NULL,
    session_id BLOB,
    failed_cause TEXT
);
INSERT INTO work_history_v9 (id, machine_id, process, event, at, session_id, failed_cause)
    SELECT id, machine_id, process, event, at, session_id, failed_cause FROM work_history;
DROP TABLE work_history;
ALTER TABLE work_history_v9 RENAME TO work_history;
CREATE INDEX work_history_machine ON work_history (machine_id, id);
CREATE INDEX work_history_at ON work_history (at);

CREATE TABLE work_backoff_v9 (
    machine_id BLOB NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process TEXT NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal')),
    until INTEGER NOT NULL,
    cause TEXT NOT NULL,
    last_interval_seconds INTEGER NOT NULL,
    PRIMARY KEY (machine_id, process)
) WITHOUT ROWID;
INSERT INTO work_backoff_v9 (machine_id, process, until, cause, last_interval_seconds)
    SELECT machine_id, process, until, cause, last_interval_seconds FROM work_backoff;
DROP TABLE work_backoff;
ALTER TABLE work_backoff_v9 RENAME TO work_backoff;
CREATE INDEX work_backoff_process ON work_backoff (process, machine_id, until);

CREATE TABLE operator_actions_v9 (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine_id BLOB NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('MaintenanceOn', 'MaintenanceOff', 'Retry', 'ForgetHostKey', 'Decommission', 'Recommission', 'Install', 'Reimage')),
    process TEXT,
    at INTEGER NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    session_id BLOB,
    request_id TEXT
);
INSERT INTO operator_actions_v9 (id, machine_id, action, process, at, actor, reason, session_id, request_id)
    SELECT id, machine_id, action, process, at, actor, reason, session_id, request_id FROM operator_actions;
DROP TABLE operator_actions;
ALTER TABLE operator_actions_v9 RENAME TO operator_actions;
CREATE INDEX operator_actions_machine ON operator_actions (machine_id, id);
CREATE INDEX operator_actions_at ON operator_actions (at);

CREATE TABLE machine_bare_metal (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    phase TEXT NOT NULL CHECK (phase IN ('Bare', 'Inserting', 'StartingLive', 'LiveBoot', 'Installing', 'Ejecting', 'StartingDisk', 'DiskBoot', 'Done', 'Failed')),
    phase_at INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    media_token TEXT,
    media_expires_at INTEGER,
    config TEXT,
    wipe_by TEXT,
    install_generation INTEGER
) WITHOUT ROWID;
-- The few machines on their way, in id order: where the bare-metal loop's claims search (the
-- predicate is written exactly so in the claims, so that SQLite too knows it may use it).
CREATE INDEX machine_bare_metal_open ON machine_bare_metal (machine_id)
    WHERE phase IN ('Bare', 'Inserting', 'StartingLive', 'LiveBoot', 'Installing', 'Ejecting', 'StartingDisk', 'DiskBoot');

CREATE TABLE bare_metal_history (
    -- AUTOINCREMENT: an id is never given again, so the order of a machine's steps holds.
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine_id BLOB NOT NULL,
    at INTEGER NOT NULL,
    phase TEXT NOT NULL CHECK (phase IN ('Bare', 'Inserting', 'StartingLive', 'LiveBoot', 'Installing', 'Ejecting', 'StartingDisk', 'DiskBoot', 'Done', 'Failed')),
    detail TEXT NOT NULL,
    session_id BLOB
);
CREATE INDEX bare_metal_history_machine ON bare_metal_history (machine_id, id);
CREATE INDEX bare_metal_history_at ON bare_metal_history (at);
