//! Tests that need the machine to themselves: a Patroni cluster, QEMU VMs, OpenStack Ironic,
//! Chromium, a private Postgres, or faults whose limits are derived from the replicas' timing.
//! `scripts/test.sh` lists the modules here and runs each in a `cargo test` of its own
//! (`cargo test -p shepherd --test it solo::vm_fleet::`); the first invocation skips them all.

mod fault_disk_full;
mod fault_failover;
mod fault_fencing;
mod fault_hostile_peers;
mod fault_postgres_outage;
mod fault_replicas;
mod ironic_e2e;
mod recovery_e2e;
mod redfish_sushy;
mod rolling_upgrade;
mod vm_fleet;
mod vm_ironic;
mod web_ui;
