-- Schema v2 (Postgres): the recoverer remembers how often it rebooted each machine in a row,
-- so that repeated recoveries back off and stop at an operator-set cap.
CREATE TABLE machine_recovery (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id) ON DELETE CASCADE,
    -- When the recoverer last rebooted the machine.
    rebooted_at timestamptz NOT NULL,
    -- Reboots since the machine's agent last heartbeated (1 for the first).
    in_a_row integer NOT NULL CHECK (in_a_row >= 1)
);
