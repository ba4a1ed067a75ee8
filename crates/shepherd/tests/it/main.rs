//! The whole system's integration tests, one binary: each module is one concern, driving the
//! real `shepherd` (and the agents) from the target directory, over real services that
//! `scripts/test-deps.sh` installs.
//!
//! Modules at this level share the machine: libtest runs two of their tests at a time, from
//! any modules. The modules under [`solo`] start clusters, VMs, Ironic or a browser, or hold
//! faults to the clock; `scripts/test.sh` runs each of them in an invocation of its own, so
//! their tests run beside each other and beside nothing else.

mod api;
mod bmdb_cli;
mod common;
mod fault_bad_inventory;
mod fault_migration;
mod machines_cli;
mod metrics_scrape;
mod monitoring;
mod recovery_cli;
mod run_cli;
mod server_e2e;
mod solo;
