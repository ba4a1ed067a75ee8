#!/usr/bin/env bash
# The failover figures of bench/results/failover.md: the Patroni fault test's first scenario
# (the primary's postmaster killed under two replicas and a server) with 3,000 machines, a
# side probe writing through HAProxy every 100 ms. About three minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/test-deps.sh
cargo test -p shepherd --test it -- --ignored --exact solo::fault_failover::failover_figures --nocapture
