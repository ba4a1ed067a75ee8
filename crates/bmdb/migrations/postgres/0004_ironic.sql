-- Schema v4 (Postgres): machines provided by OpenStack Ironic, a provider status for a
-- machine its provider has put in maintenance, and whether a decommissioning asked the
-- provider to tear the machine down. Expand only: the CHECK constraints admit more values and
-- the new column has a default; nothing an older binary writes is refused.
ALTER TABLE machine_provided
    DROP CONSTRAINT machine_provided_provider_check,
    ADD CONSTRAINT machine_provided_provider_check
        CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim', 'Ironic')),
    DROP CONSTRAINT machine_provided_status_check,
    ADD CONSTRAINT machine_provided_status_check
        CHECK (status IN ('Missing', 'Provisioning', 'ProvisioningFailedPermanent', 'Running', 'Stopped', 'Unknown', 'Maintenance'));

ALTER TABLE decommissioned
    DROP CONSTRAINT decommissioned_provider_check,
    ADD CONSTRAINT decommissioned_provider_check
        CHECK (provider IN ('Equinix', 'Lumen', 'None', 'Static', 'Redfish', 'Sim', 'Ironic')),
    ADD COLUMN undeploy BOOLEAN NOT NULL DEFAULT false;
