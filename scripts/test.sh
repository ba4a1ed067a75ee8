#!/usr/bin/env bash
# The project's test command: sets up what the tests need, then runs every test of the
# workspace. Tests that need a service fail (rather than skip) when it is missing.
#
# With no arguments, the tests under `solo::` (clusters, VMs, Ironic, a browser: see
# crates/shepherd/tests/it/solo/mod.rs) are kept out of the first run and each of their
# modules then runs in a `cargo test` of its own, beside nothing else. Arguments are passed
# to one `cargo test --workspace --all-targets` as they are (for instance `-- run_cli::`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/test-deps.sh
export SHEPHERD_REQUIRE_POSTGRES="${SHEPHERD_REQUIRE_POSTGRES:-1}"
# Tests start the workspace's binaries (the agents, `shepherd`) from the target directory;
# they are built here, never from inside a test.
cargo build --workspace --bins
if [ $# -gt 0 ]; then
  exec cargo test --workspace --all-targets "$@"
fi
cargo test --workspace --all-targets -- --skip solo::
modules=$(cargo test -q -p shepherd --test it -- --list solo:: 2>/dev/null |
  sed -n 's/^solo::\([a-z0-9_]*\)::.*: test$/\1/p' | sort -u)
if [ -z "$modules" ]; then
  echo "test.sh: found no solo:: modules in the shepherd crate's tests" >&2
  exit 1
fi
for module in $modules; do
  echo "test.sh: solo::$module"
  cargo test -p shepherd --test it -- "solo::$module::"
done
