-- Schema v13 (SQLite): the disk a bare machine's agent chose; see the Postgres script.
ALTER TABLE machine_bare_metal ADD COLUMN chosen_disk TEXT;
