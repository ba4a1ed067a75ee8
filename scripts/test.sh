#!/usr/bin/env bash
# The project's test command: sets up what the tests need, then runs every test of the
# workspace. Tests that need a service fail (rather than skip) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/test-deps.sh
export SHEPHERD_REQUIRE_POSTGRES="${SHEPHERD_REQUIRE_POSTGRES:-1}"
# Tests start the workspace's binaries (the agents, `shepherd`) from the target directory;
# they are built here, never from inside a test.
cargo build --workspace --bins
cargo test --workspace --all-targets "$@"
