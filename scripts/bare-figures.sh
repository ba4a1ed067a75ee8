#!/usr/bin/env bash
# The bare-metal figures of bench/results/baremetal.md, from one run of the end-to-end test
# CI runs (crates/shepherd/tests/it/solo/bare_metal_e2e.rs) with SHEPHERD_BARE_FIGURES set, so
# that no replica is killed: two libvirt domains with blank disks, under TCG on this machine,
# go from powered off to heartbeating from their installed OS, and a third is refused. The test
# times the whole way and its parts on the same VMs: the live environment's boot (power-on to
# sshd greeting, polled by the test itself), the installation (request to report) and the
# installed OS's boot (power-on to its first heartbeat). About four minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/test-deps.sh
trap './scripts/test-deps.sh stop-libvirt' EXIT
cargo build --workspace --bins
log=$(mktemp)
if ! SHEPHERD_BARE_FIGURES=1 cargo test -p shepherd --test it solo::bare_metal_e2e:: -- --nocapture >"$log" 2>&1; then
  tail -n 60 "$log" >&2
  echo "bare-figures: the test failed; nothing written" >&2
  exit 1
fi
figures=$(grep -oE '^[a-z_0-9]+ = [0-9.]+$' "$log")
rm -f "$log"
echo "$figures"
value() { sed -n "s/^$1 = //p" <<< "$figures"; }
mkdir -p bench/results
cat > bench/results/baremetal.md <<MD
# Bare metal: from a BMC and empty disks to heartbeating

Run on $(date -u '+%Y-%m-%d %H:%M UTC') with \`scripts/bare-figures.sh\` (2 cores, guests under TCG): two
libvirt domains (512 MiB, one vCPU, a blank 256 MiB disk) behind sushy-tools' libvirt driver,
two \`shepherd run\` replicas on Postgres, \`shepherd server\`, the live image of
\`scripts/live-image.sh\` and its test OS image (48 MiB, written by the agent), a third domain
with a partitioned disk refused meanwhile. Means over the two machines.

- \`bare_to_heartbeating_s\`: from the machine's recording (powered off, disks empty) to the first
  heartbeat from its installed OS.
- Its parts, on the same VMs in the same run: \`live_boot_to_ssh_s\`, from the power-on into the
  live environment to its sshd's greeting (polled by the test every second);
  \`install_s\`, from the installation request to the agent's report (download and write of
  the image, its sha256 checked); \`disk_boot_to_heartbeat_s\`, from the power-on of the disk to
  the installed OS's first heartbeat (its boot and its takeover).
- \`bare_overhead_ratio\`: the whole over the sum of the parts; what it exceeds 1 by is
  Shepherd's own steps (BMC calls, claims, the live environment's takeover, the waits between).
- \`live_image_mb\`: the size of the live image.

bare_to_heartbeating_s = $(value bare_to_heartbeating_s)
live_boot_to_ssh_s = $(value live_boot_to_ssh_s)
install_s = $(value install_s)
disk_boot_to_heartbeat_s = $(value disk_boot_to_heartbeat_s)
bare_overhead_ratio = $(value bare_overhead_ratio)
live_image_mb = $(value live_image_mb)
MD
echo "bare-figures: wrote bench/results/baremetal.md"
