-- Schema v3 (SQLite): operators' actions on machines, and fleet counts over time. Additive only: tables and an index,
-- nothing an older binary reads is changed.

-- A machine an operator took out of the loops' hands (Ironic's maintenance mode): no loop
-- claims it; the updater still refreshes its facts and its agent still heartbeats.
CREATE TABLE machine_maintenance (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    since INTEGER NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL
) WITHOUT ROWID;

-- Provider ids an operator decommissioned: the provisioner does not bring them back until
-- an operator recommissions them. The machine's own row is gone; its history stays.
CREATE TABLE decommissioned (
    provider TEXT NOT NULL CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim')),
    provider_id TEXT NOT NULL,
    machine_id BLOB NOT NULL,
    at INTEGER NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (provider, provider_id)
) WITHOUT ROWID;
CREATE INDEX decommissioned_machine ON decommissioned (machine_id);

-- What operators did to machines, with who and why: the operators' half of a machine's
-- history (the loops' half is work_history).
CREATE TABLE operator_actions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine_id BLOB NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('MaintenanceOn', 'MaintenanceOff', 'Retry', 'ForgetHostKey', 'Decommission', 'Recommission')),
    process TEXT,
    at INTEGER NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    session_id BLOB
);
CREATE INDEX operator_actions_machine ON operator_actions (machine_id, id);
CREATE INDEX operator_actions_at ON operator_actions (at);

-- History retention deletes by age.
CREATE INDEX work_history_at ON work_history (at);

-- The fleet counts over time, for the web UI's overview chart: one row per minute and series,
-- written by whichever process refreshes the fleet statistics first in that minute, kept for
-- eight days.
CREATE TABLE fleet_counts_history (
    at INTEGER NOT NULL,
    series TEXT NOT NULL,
    machines INTEGER NOT NULL,
    PRIMARY KEY (at, series)
) WITHOUT ROWID;
