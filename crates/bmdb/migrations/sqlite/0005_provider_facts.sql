-- Schema v5 (SQLite): what a provider says about a machine's hardware (Ironic's resource
-- class, hardware type and properties), a JSON object of strings written by the provisioner
-- and refreshed by the updater. Expand only: a nullable column older binaries ignore.
ALTER TABLE machine_provided ADD COLUMN facts TEXT;
