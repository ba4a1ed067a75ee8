-- Schema v9 (Postgres): servers with nothing but a BMC (SPEC §21). A machine the inventory
-- marks as bare has a row in machine_bare_metal saying where it stands on its way from empty
-- disks to its installed OS, and every step it takes is a row of bare_metal_history. The
-- bare-metal loop holds its machines under a work process of its own, and an operator may
-- reimage a machine (boot it into the live environment again).
--
-- Expand: binaries of schema 3 to 8 keep running. They never record a bare machine, nor claim
-- one for the bare-metal process; their initializer may try (and fail, and back off) to take
-- over a bare machine before its live environment is up, their recoverer may reset one that
-- is in its live environment, and they cannot show a machine while the bare-metal loop holds
-- it (the process is unknown to them, and named as such). None of them writes a disk.
ALTER TABLE work DROP CONSTRAINT work_process_check;
ALTER TABLE work ADD CONSTRAINT work_process_check
    CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal'));
ALTER TABLE work_history DROP CONSTRAINT work_history_process_check;
ALTER TABLE work_history ADD CONSTRAINT work_history_process_check
    CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal'));
ALTER TABLE work_backoff DROP CONSTRAINT work_backoff_process_check;
ALTER TABLE work_backoff ADD CONSTRAINT work_backoff_process_check
    CHECK (process IN ('UnitTest1', 'UnitTest2', 'ShepherdAccess', 'ShepherdAgentStart', 'ShepherdRecovery', 'ShepherdBareMetal'));
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('MaintenanceOn', 'MaintenanceOff', 'Retry', 'ForgetHostKey', 'Decommission', 'Recommission', 'Install', 'Reimage'));

CREATE TABLE machine_bare_metal (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    phase text NOT NULL CHECK (phase IN ('Bare', 'Inserting', 'StartingLive', 'LiveBoot', 'Installing', 'Ejecting', 'StartingDisk', 'DiskBoot', 'Done', 'Failed')),
    phase_at timestamptz NOT NULL,
    -- Live boots begun since the machine was last recorded bare or reimaged.
    attempts integer NOT NULL DEFAULT 0,
    -- The secret of the live image URL the BMC was given, and until when it may be fetched.
    media_token text,
    media_expires_at timestamptz,
    -- This machine's config drive files, JSON: {"meta_data.json": …, "network_data.json": …}.
    config text,
    -- Who allowed the disk to be overwritten beyond the inventory entry (an operator's reimage).
    wipe_by text,
    -- The installation generation the bare-metal loop asked the agent for.
    install_generation bigint
);
-- The few machines on their way, in id order: where the bare-metal loop's claims search (the
-- predicate is written exactly so in the claims, so that SQLite too knows it may use it).
CREATE INDEX machine_bare_metal_open ON machine_bare_metal (machine_id)
    WHERE phase IN ('Bare', 'Inserting', 'StartingLive', 'LiveBoot', 'Installing', 'Ejecting', 'StartingDisk', 'DiskBoot');

CREATE TABLE bare_metal_history (
    id bigserial PRIMARY KEY,
    machine_id uuid NOT NULL,
    at timestamptz NOT NULL,
    -- The phase entered, and what was done or found (the BMC's answer, who allowed a wipe).
    phase text NOT NULL CHECK (phase IN ('Bare', 'Inserting', 'StartingLive', 'LiveBoot', 'Installing', 'Ejecting', 'StartingDisk', 'DiskBoot', 'Done', 'Failed')),
    detail text NOT NULL,
    -- The loop's session that moved it; none for the provisioner's recording or a reimage.
    session_id uuid
);
CREATE INDEX bare_metal_history_machine ON bare_metal_history (machine_id, id);
CREATE INDEX bare_metal_history_at ON bare_metal_history (at);
