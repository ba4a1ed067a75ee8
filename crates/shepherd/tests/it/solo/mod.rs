//! Tests that need the machine to themselves: a Patroni cluster, QEMU VMs, OpenStack Ironic,
//! Chromium, a private Postgres, or faults whose limits are derived from the replicas' timing.
//! `scripts/test.sh` skips them all in its first run, then lists the modules here and runs the
//! test binary once for each (`cargo test -p shepherd --test it solo::vm_fleet::` by hand):
//! those it names as mostly waiting two at a time, beside each other only, the rest alone.

mod bare_metal_e2e;
mod fault_disk_full;
mod fault_failover;
mod fault_fencing;
mod fault_hostile_peers;
mod fault_postgres_outage;
mod fault_replicas;
mod ironic_e2e;
mod overload;
mod packages;
mod recovery_e2e;
mod redfish_sushy;
mod rolling_upgrade;
mod vm_fleet;
mod vm_ironic;
mod web_ui;
