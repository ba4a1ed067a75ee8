-- Schema v12 (SQLite): two facts of a bare machine's live boot; see the Postgres script.
ALTER TABLE machine_agent_started ADD COLUMN live_proof TEXT;
ALTER TABLE machine_bare_metal ADD COLUMN rewrite_grant TEXT;
