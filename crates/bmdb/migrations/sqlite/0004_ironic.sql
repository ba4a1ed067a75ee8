-- Schema v4 (SQLite): machines provided by OpenStack Ironic, a provider status for a
-- machine its provider has put in maintenance, and whether a decommissioning asked the
-- provider to tear the machine down. Expand only: the CHECK constraints admit more values and
-- the new column has a default. SQLite cannot alter a CHECK constraint, so both tables are rebuilt; no table refers
-- to either of them.
CREATE TABLE machine_provided_v4 (
    machine_id BLOB PRIMARY KEY NOT NULL REFERENCES machines (machine_id) ON DELETE CASCADE,
    provider TEXT NOT NULL CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim', 'Ironic')),
    provider_id TEXT NOT NULL CHECK (length(provider_id) BETWEEN 1 AND 128),
    reservation_id TEXT,
    ip_address TEXT,
    location TEXT,
    status TEXT CHECK (status IN ('Missing', 'Provisioning', 'ProvisioningFailedPermanent', 'Running', 'Stopped', 'Unknown', 'Maintenance')),
    UNIQUE (provider, provider_id)
) WITHOUT ROWID;
INSERT INTO machine_provided_v4 SELECT machine_id, provider, provider_id, reservation_id, ip_address, location, status FROM machine_provided;
DROP TABLE machine_provided;
ALTER TABLE machine_provided_v4 RENAME TO machine_provided;
CREATE INDEX machine_provided_provider ON machine_provided (provider, machine_id);

CREATE TABLE decommissioned_v4 (
    provider TEXT NOT NULL CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim', 'Ironic')),
    provider_id TEXT NOT NULL,
    machine_id BLOB NOT NULL,
    at INTEGER NOT NULL,
    actor TEXT NOT NULL,
    reason TEXT NOT NULL,
    undeploy INTEGER NOT NULL DEFAULT 0 CHECK (undeploy IN (0, 1)),
    PRIMARY KEY (provider, provider_id)
) WITHOUT ROWID;
INSERT INTO decommissioned_v4 (provider, provider_id, machine_id, at, actor, reason)
    SELECT provider, provider_id, machine_id, at, actor, reason FROM decommissioned;
DROP TABLE decommissioned;
ALTER TABLE decommissioned_v4 RENAME TO decommissioned;
CREATE INDEX decommissioned_machine ON decommissioned (machine_id);
