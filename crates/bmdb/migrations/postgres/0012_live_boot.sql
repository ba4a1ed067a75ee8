-- Schema v12 (Postgres): two facts of a bare machine's live boot (design.md §21).
--
-- machine_agent_started.live_proof: the proof an agent showed at its takeover that it runs in
-- the live environment of its machine's current live boot, a value derived from that boot's
-- media grant, which only that boot's config drive carries. NULL: it showed none (an
-- installed OS, or a takeover recorded by an older binary).
--
-- machine_bare_metal.rewrite_grant: the URL secret (media_token) of the grant during which an
-- installation began writing the machine's disk before the image's server failed. While it is
-- the current grant's, Shepherd may write that disk again without a wipe permission; any
-- other grant's live boot needs one as before.
--
-- Expand: binaries of schema 3 to 11 neither read nor write them. A takeover one of them
-- records anew keeps the proof the row had (their upsert sets the key and time only); a live
-- boot deletes the row first, so a proof never outlives its grant. They never set
-- rewrite_grant, and a grant of theirs has another secret, so it allows nothing there.
ALTER TABLE machine_agent_started ADD COLUMN live_proof TEXT;
ALTER TABLE machine_bare_metal ADD COLUMN rewrite_grant TEXT;
