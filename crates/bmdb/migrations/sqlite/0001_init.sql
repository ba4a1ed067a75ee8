-- Shepherd BMDB schema v1 for SQLite. Ids are 16-byte UUID blobs; times are integer
-- microseconds since the Unix epoch (UTC); enumerations are text with CHECK constraints.
CREATE TABLE machines (
    machine_id BLOB PRIMARY KEY NOT NULL CHECK (length(machine_id) = 16),
    created_at INTEGER NOT NULL,
    -- Bumped by every claim (kept in step with the Postgres schema; SQLite claims are serial).
    claim_count INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

CREATE TABLE sessions (
    session_id BLOB PRIMARY KEY NOT NULL,
    component_name TEXT NOT NULL,
    runtime_info TEXT NOT NULL,
    processor TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    interval_seconds INTEGER NOT NULL CHECK (interval_seconds >= 1),
    deadline INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX sessions_deadline ON sessions (deadline);

CREATE TABLE work (
    machine_id BLOB NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    session_id BLOB NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    process TEXT NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery')),
    PRIMARY KEY (machine_id, process)
) WITHOUT ROWID;
CREATE INDEX work_session ON work (session_id);

CREATE TABLE work_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine_id BLOB NOT NULL,
    process TEXT NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery')),
    event TEXT NOT NULL CHECK (event IN ('Started', 'Finished', 'Failed', 'Canceled')),
    at INTEGER NOT NULL,
    session_id BLOB,
    failed_cause TEXT
);
CREATE INDEX work_history_machine ON work_history (machine_id, id);

CREATE TABLE work_backoff (
    machine_id BLOB NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process TEXT NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery')),
    until INTEGER NOT NULL,
    cause TEXT NOT NULL,
    last_interval_seconds INTEGER NOT NULL,
    PRIMARY KEY (machine_id, process)
) WITHOUT ROWID;
CREATE INDEX work_backoff_process ON work_backoff (process, machine_id, until);

CREATE TABLE machine_provided (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    provider TEXT NOT NULL CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim')),
    provider_id TEXT NOT NULL CHECK (length(provider_id) BETWEEN 1 AND 128),
    reservation_id TEXT,
    ip_address TEXT,
    location TEXT,
    status TEXT CHECK (status IN ('Missing', 'Provisioning', 'ProvisioningFailedPermanent', 'Running', 'Stopped', 'Unknown')),
    UNIQUE (provider, provider_id)
) WITHOUT ROWID;
CREATE INDEX machine_provided_provider ON machine_provided (provider, machine_id);

CREATE TABLE machine_agent_started (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    started_at INTEGER NOT NULL,
    public_key BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX machine_agent_started_key ON machine_agent_started (public_key);

CREATE TABLE machine_agent_heartbeat (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    heartbeat_at INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE machine_hardware_report (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    report_raw BLOB NOT NULL
) WITHOUT ROWID;

CREATE TABLE machine_os_installation_request (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation INTEGER NOT NULL,
    request_raw BLOB NOT NULL
) WITHOUT ROWID;

CREATE TABLE machine_os_installation_report (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation INTEGER NOT NULL,
    result TEXT NOT NULL CHECK (result IN ('Success', 'Error')),
    report_raw BLOB NOT NULL
) WITHOUT ROWID;

CREATE TABLE machine_ssh_host_key (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    key TEXT NOT NULL,
    first_seen_at INTEGER NOT NULL
) WITHOUT ROWID;
