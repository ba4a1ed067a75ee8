#!/usr/bin/env bash
# The project's test command: sets up what the tests need, then runs every test of the
# workspace. Tests that need a service fail (rather than skip) when it is missing.
#
# With no arguments, the tests under `solo::` (clusters, VMs, Ironic, a browser: see
# crates/shepherd/tests/it/solo/mod.rs) are kept out of the first run. Their modules then run
# each in a run of its own: those that mostly wait two at a time, the others one at a time.
# Arguments are passed to one `cargo test --workspace --all-targets` as they are (for instance
# `-- run_cli::`).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
./scripts/test-deps.sh
# libvirtd and virtlogd run only while the tests do, when test-deps started them. The tests'
# status is the script's, whatever stopping them says (the script changes directory below).
stop_libvirt() {
  local status=$?
  "$root/scripts/test-deps.sh" stop-libvirt || echo "test.sh: stopping libvirt failed" >&2
  exit "$status"
}
trap stop_libvirt EXIT
export SHEPHERD_REQUIRE_POSTGRES="${SHEPHERD_REQUIRE_POSTGRES:-1}"
# Tests start the workspace's binaries (the agents, `shepherd`) from the target directory;
# they are built here, never from inside a test. Every target is built in one go: built alone,
# the binaries would get other features of their dependencies (a dev-dependency's count only
# when tests are built too), and `cargo test` would then build them all a second time.
cargo build --workspace --all-targets
if [ $# -gt 0 ]; then
  cargo test --workspace --all-targets "$@"
  exit
fi
cargo test --workspace --all-targets -- --skip solo::
# The `shepherd` crate's test binary as that run built it. It is run directly, from the crate's
# directory as cargo runs it: `cargo test -p shepherd` would resolve features for that crate
# alone and build it, with some of its dependencies, a second time.
it=$(cargo test --workspace --all-targets --no-run --message-format=json 2>/dev/null |
  grep '"name":"it"' | grep '/crates/shepherd#' |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
if [ ! -x "$it" ]; then
  echo "test.sh: cannot find the shepherd crate's test binary" >&2
  exit 1
fi
cd crates/shepherd
modules=$("$it" --list solo:: 2>/dev/null |
  sed -n 's/^solo::\([a-z0-9_]*\)::.*: test$/\1/p' | sort -u)
if [ -z "$modules" ]; then
  echo "test.sh: found no solo:: modules in the shepherd crate's tests" >&2
  exit 1
fi
# Modules whose tests mostly wait (for a failover's timeouts, an outage's end, idle peers to
# be closed): measured alone on CI, each kept the 2 cores less than 40 % busy. They run two at
# a time, longest first, beside each other but never beside the busy modules that follow.
waiting="fault_failover fault_replicas fault_postgres_outage fault_hostile_peers recovery_e2e
  fault_disk_full redfish_sushy rolling_upgrade"
# One module's tests, its output shown whole once it ends (two run at a time).
run_module() {
  local log status=0
  log=$(mktemp)
  "$it" "solo::$1::" > "$log" 2>&1 || status=$?
  echo "test.sh: solo::$1$([ "$status" = 0 ] || echo ' FAILED')"
  cat "$log"
  rm -f "$log"
  return "$status"
}
export -f run_module
export it
for module in $waiting; do
  if ! grep -qx "$module" <<< "$modules"; then
    echo "test.sh: solo::$module is listed as waiting but is not a module" >&2
    exit 1
  fi
done
printf '%s\n' $waiting | xargs -P 2 -I{} bash -c 'run_module {}'
for module in $modules; do
  if grep -qw "$module" <<< "$waiting"; then
    continue
  fi
  echo "test.sh: solo::$module"
  "$it" "solo::$module::"
done
