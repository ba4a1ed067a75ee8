#!/usr/bin/env bash
# The fault figures of bench/results/faults.md, from the fault tests that measure them (the
# same tests CI runs): leases that fence side effects (two replicas over real sshds or
# scripted BMCs, one partitioned from Postgres or paused mid-upload or mid-reboot, on Postgres
# and, paused, on SQLite), a
# replica cut off inside its keep-alive, agents with wrong clocks, and the SQLite BMDB's disk
# filled mid-run. Each test prints `key = value` lines; a figure seen in several runs is
# reported at its worst. About two minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/test-deps.sh
cargo build --workspace --bins
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# Runs one test binary's tests, keeping the `key = value` figures they print; a failed test
# stops the script before anything is written.
run() {
  local log
  log=$(mktemp)
  if ! cargo test "$@" -- --nocapture --test-threads 1 >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "fault-figures: cargo test $* failed; nothing written" >&2
    exit 1
  fi
  grep -oE '[a-z_0-9]+ = [0-9.]+' "$log" | tee -a "$out"
  rm -f "$log"
}
run -p shepherd --test it solo::fault_fencing::
run -p shepherd-loops --test it recoverer_fencing::
run -p shepherd-bmdb --test it leases::a_replica_cut_off_inside_a_transaction_stalls_no_one
run -p shepherd-server --test it agent_e2e::agents_with_wrong_clocks_heartbeat
run -p shepherd --test it solo::fault_disk_full::

# The worst value of every key printed, summing a figure's kinds (`_partition`, `_pause`).
worst() {
  awk -v key="$1" -v how="$2" '
    $2 == "=" && index($1, key) == 1 {
      v = $3 + 0
      if (how == "sum") { total += v } else if (how == "min") { if (!seen || v < best) best = v }
      else { if (!seen || v > best) best = v }
      seen = 1
    }
    END { if (!seen) exit 1; if (how == "sum") print total; else print best }' "$out"
}
overlap=$(worst fence_overlapping_side_effects sum)
late=$(worst fence_side_effects_after_lease sum)
stalled=$(worst stalled_replica_claims_after_lease_s max)
interval=$(worst session_interval_s max)
clocks=$(worst wrong_clock_agents_heartbeating min)
first=$(worst disk_full_first_commit_after_space_s max)
penalised=$(worst disk_full_penalised_machines sum)

mkdir -p bench/results
cat > bench/results/faults.md <<MD
# Fault figures

Run on $(date -u '+%Y-%m-%d %H:%M UTC') with \`scripts/fault-figures.sh\` (2 cores; the fault tests CI
runs, on loopback). Worst case over the runs of each figure; counts are summed over the fault
kinds.

- Fencing (\`crates/shepherd/tests/it/solo/fault_fencing.rs\`): two \`shepherd run\` replicas over three
  real sshds whose uploads take 3 s, session interval 2 s; replica a is cut off from Postgres by
  a silent partition, or paused with SIGSTOP (on Postgres and on SQLite), in the middle of an
  upload, until replica b has taken over every machine. Side effects are the commands the
  machines' \`ForceCommand\` logged with the key that ran them; a's lease end is the last
  deadline the BMDB gave its sessions. Reboots, in the same file: two replicas' recoverers
  power-cycle three silent machines through scripted Redfish BMCs (one set per replica, reads
  answered after 3 s, every request logged); replica a is partitioned (Postgres) or paused (both
  engines) while it reads a BMC, until b has reset every machine. Also
  (\`crates/loops/tests/it/recoverer_fencing.rs\`) two recoverers in one process, one
  partitioned while its provider looks a machine up.
- Stalled replica (\`crates/bmdb/tests/it/leases.rs\`): a replica cut off between its keep-alive's
  UPDATE and COMMIT, its session row locked; the time from its lease's end to the other
  replica's claim of its machine, with the session interval ${interval} s.
- Wrong clocks (\`crates/server/tests/agent_e2e.rs\`): real agents under libfaketime at
  2000-01-01, -2 days and +1 year, and one with the right clock, against a server certificate
  valid from today for 90 days; the share that heartbeats.
- Full disk (\`crates/shepherd/tests/it/solo/fault_disk_full.rs\`): \`shepherd demo\` (300 machines, no
  injected failures) with its SQLite BMDB on a 64 MiB tmpfs, filled while takeovers run and
  freed 3 s after the demo told the cause; the first commit after space returned, and the
  machines with a Failed entry, a reboot or a failure backoff.

fence_overlapping_side_effects = ${overlap}
fence_side_effects_after_lease = ${late}
stalled_replica_claims_after_lease_s = ${stalled}
wrong_clock_agents_heartbeating = ${clocks}
disk_full_first_commit_after_space_s = ${first}
disk_full_penalised_machines = ${penalised}
MD
cat bench/results/faults.md
