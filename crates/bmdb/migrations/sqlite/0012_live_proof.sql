-- Schema v12 (SQLite): the proof an agent showed at its takeover that it runs in its machine's
-- live environment; see the Postgres script.
ALTER TABLE machine_agent_started ADD COLUMN live_proof TEXT;
