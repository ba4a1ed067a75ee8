#!/usr/bin/env bash
# The bare-metal figures of bench/results/baremetal.md, from one run of the end-to-end test
# CI runs (crates/shepherd/tests/it/solo/bare_metal_e2e.rs) with SHEPHERD_BARE_FIGURES set, so
# that no replica is killed: seven libvirt domains with blank disks, under TCG on this machine,
# three go from powered off to heartbeating from their installed OS, and four are refused. The test
# times the whole way and its parts on the same VMs: the live environment's boot (power-on to
# sshd greeting, polled by the test itself), the installation (request to report) and the
# installed OS's boot (power-on to its first heartbeat). Then `shepherd-bench image-write`
# measures the agent's writing of a 2 GiB image (raw, zstd, qcow2) against `curl | dd` over
# loopback onto the same file. About ten minutes.
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
if ! writes=$(cargo run --release --quiet -p shepherd-bench -- image-write); then
  echo "bare-figures: the image-write benchmark failed; nothing written" >&2
  exit 1
fi
figures="$figures
$writes"
echo "$figures"
value() { sed -n "s/^$1 = //p" <<< "$figures"; }
mkdir -p bench/results
cat > bench/results/baremetal.md <<MD
# Bare metal: from a BMC and empty disks to heartbeating

Run on $(date -u '+%Y-%m-%d %H:%M UTC') with \`scripts/bare-figures.sh\` (2 cores, guests under TCG): seven
libvirt domains (512 MiB, one vCPU, blank 256 MiB disks) behind sushy-tools' libvirt driver,
two \`shepherd run\` replicas on Postgres, \`shepherd server\`, the live image of
\`scripts/live-image.sh\` and its test OS images (48 MiB, written by the agent from qcow2 and
zstd forms), beside a third machine whose image server stopped mid-download and four refused
ones. Means over the two machines not interrupted.

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
- The agent's writing (\`shepherd-bench image-write\`, in the same run): a 2 GiB raw image
  (of every 4 MiB, 3 of bytes with 6 bits of entropy and 1 of zeros), its zstd form
  ($(value image_zstd_mib) MiB), its qcow2 form with compressed clusters as distributions ship
  them ($(value image_qcow2_mib) MiB) and without ($(value image_qcow2_plain_mib) MiB), both by
  qemu-img, served over loopback HTTP by a static file server and written onto the same
  preallocated file, median of three runs each. \`install_vs_dd\`: the agent's write rate for
  the raw image (\`shepherd-agent write-image\`: format by magic bytes, sha256 as served, every
  write checked, one fsync) over that of \`curl | dd bs=1M conv=fsync\` of the same image onto
  the same file ($(value agent_raw_mib_s) against $(value dd_mib_s) MiB/s). \`*_install_vs_raw\`:
  the agent's time for each form over its time for the raw image; on loopback the disk and the
  network cost little, so a compressed form costs what its decompression takes on these two
  cores (deflate for qcow2's clusters, inflated on both). \`*_agent_peak_rss_mb\`: the agent's
  peak RSS in each form's runs, as the kernel kept it (\`VmHWM\`).

$(for key in bare_to_heartbeating_s live_boot_to_ssh_s install_s disk_boot_to_heartbeat_s \
    bare_overhead_ratio live_image_mb install_vs_dd zstd_install_vs_raw qcow2_install_vs_raw \
    qcow2_plain_install_vs_raw raw_agent_peak_rss_mb zstd_agent_peak_rss_mb qcow2_agent_peak_rss_mb; do
  echo "$key = $(value "$key")"
done)
MD
echo "bare-figures: wrote bench/results/baremetal.md"
