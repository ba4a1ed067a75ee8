-- Schema v2 (SQLite): the recoverer remembers how often it rebooted each machine in a row,
-- so that repeated recoveries back off and stop at an operator-set cap.
CREATE TABLE machine_recovery (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    -- When the recoverer last rebooted the machine.
    rebooted_at INTEGER NOT NULL,
    -- Reboots since the machine's agent last heartbeated (1 for the first).
    in_a_row INTEGER NOT NULL CHECK (in_a_row >= 1)
) WITHOUT ROWID;
