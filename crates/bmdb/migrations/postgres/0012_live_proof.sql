-- Schema v12 (Postgres): the proof an agent showed at its takeover that it runs in the live
-- environment of its machine's current live boot (design.md §21): a value derived from that
-- boot's media grant, which only that boot's config drive carries. NULL: the agent showed
-- none (an installed OS, or a takeover recorded by an older binary).
--
-- Expand: binaries of schema 3 to 11 neither read nor write it. A takeover one of them records
-- anew keeps the proof the row had (their upsert sets the key and time only); a live boot
-- deletes the row first, so a proof never outlives its grant.
ALTER TABLE machine_agent_started ADD COLUMN live_proof TEXT;
