-- Schema v6 (Postgres): an operator's OS installation request (`shepherd machines install`)
-- is an operator action, recorded with who and why like the others. Expand only: the CHECK
-- constraint admits one more value. A binary of schema 3 to 5 never writes it; it refuses to
-- show the operators' history of a machine that holds one, naming the unknown action.
ALTER TABLE operator_actions DROP CONSTRAINT operator_actions_action_check;
ALTER TABLE operator_actions ADD CONSTRAINT operator_actions_action_check
    CHECK (action IN ('MaintenanceOn', 'MaintenanceOff', 'Retry', 'ForgetHostKey', 'Decommission', 'Recommission', 'Install'));
