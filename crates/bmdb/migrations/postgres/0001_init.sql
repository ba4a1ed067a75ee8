-- Shepherd BMDB schema v1 for PostgreSQL. Times are timestamptz from the server clock;
-- enumerations are text with CHECK constraints (portable and easy to extend).
CREATE TABLE machines (
    machine_id uuid PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Bumped by every claim; a claimer only locks a machine whose count still equals what its
    -- snapshot saw, so a claim committed after that snapshot is never claimed twice.
    claim_count bigint NOT NULL DEFAULT 0
);

CREATE TABLE sessions (
    session_id uuid PRIMARY KEY,
    component_name text NOT NULL,
    runtime_info text NOT NULL,
    processor text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    interval_seconds bigint NOT NULL CHECK (interval_seconds >= 1),
    deadline timestamptz NOT NULL
);
CREATE INDEX sessions_deadline ON sessions (deadline);

CREATE TABLE work (
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    session_id uuid NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    process text NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery')),
    PRIMARY KEY (machine_id, process)
);
CREATE INDEX work_session ON work (session_id);

CREATE TABLE work_history (
    id bigserial PRIMARY KEY,
    machine_id uuid NOT NULL,
    process text NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery')),
    event text NOT NULL CHECK (event IN ('Started', 'Finished', 'Failed', 'Canceled')),
    at timestamptz NOT NULL,
    session_id uuid,
    failed_cause text
);
CREATE INDEX work_history_machine ON work_history (machine_id, id);

CREATE TABLE work_backoff (
    machine_id uuid NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    process text NOT NULL CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery')),
    until timestamptz NOT NULL,
    cause text NOT NULL,
    last_interval_seconds bigint NOT NULL,
    PRIMARY KEY (machine_id, process)
);
CREATE INDEX work_backoff_process ON work_backoff (process, machine_id) INCLUDE (until);

CREATE TABLE machine_provided (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    provider text NOT NULL CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim')),
    provider_id varchar(128) NOT NULL CHECK (length(provider_id) >= 1),
    reservation_id text,
    ip_address text,
    location text,
    status text CHECK (status IN ('Missing', 'Provisioning', 'ProvisioningFailedPermanent', 'Running', 'Stopped', 'Unknown')),
    UNIQUE (provider, provider_id)
);
CREATE INDEX machine_provided_provider ON machine_provided (provider, machine_id);

CREATE TABLE machine_agent_started (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    started_at timestamptz NOT NULL,
    public_key bytea NOT NULL
);
CREATE INDEX machine_agent_started_key ON machine_agent_started (public_key);

CREATE TABLE machine_agent_heartbeat (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    heartbeat_at timestamptz NOT NULL
);

CREATE TABLE machine_hardware_report (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    report_raw bytea NOT NULL
);

CREATE TABLE machine_os_installation_request (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation bigint NOT NULL,
    request_raw bytea NOT NULL
);

CREATE TABLE machine_os_installation_report (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    generation bigint NOT NULL,
    result text NOT NULL CHECK (result IN ('Success', 'Error')),
    report_raw bytea NOT NULL
);

CREATE TABLE machine_ssh_host_key (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    key text NOT NULL,
    first_seen_at timestamptz NOT NULL
);
