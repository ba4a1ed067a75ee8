-- Schema v6 (SQLite): an operator's OS installation request (`shepherd machines install`)
-- is an operator action, recorded with who and why like the others. Expand only: the CHECK
-- constraint admits one more value. A binary of schema 3 to 5 never writes it; it refuses to
-- show the operators' history of a machine that holds one, naming the unknown action.
-- SQLite cannot alter a CHECK constraint, so the table is rebuilt; no table refers to it.
CREATE TABLE operator_actions_v6 (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine_id BLOB NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('MaintenanceOn', 'MaintenanceOff', 'Retry', 'ForgetHostKey', 'Decommission', 'Recommission', 'Install')),
    process TEXT,
    at INTEGER NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    session_id BLOB
);
INSERT INTO operator_actions_v6 (id, machine_id, action, process, at, actor, reason, session_id)
    SELECT id, machine_id, action, process, at, actor, reason, session_id FROM operator_actions;
DROP TABLE operator_actions;
ALTER TABLE operator_actions_v6 RENAME TO operator_actions;
CREATE INDEX operator_actions_machine ON operator_actions (machine_id, id);
CREATE INDEX operator_actions_at ON operator_actions (at);
