#!/usr/bin/env bash
# bench/results/package.md: what scripts/package.sh makes from a release build, side by side
# with what it is measured against:
#   - the .deb sizes, and the binaries' installed sizes;
#   - the OCI image's size, compressed (what a registry stores and a host pulls; goal 60 MB)
#     and unpacked, beside its base layer alone;
#   - the time from a clean Debian bookworm root to `shepherd server` answering, installed with
#     apt as an operator does (scripts/package-check.sh, which also runs every other check);
#   - the units' `systemd-analyze security` exposure (0 best, 10 worst), beside the units of
#     the commit before they were hardened (77b3182).
# Needs what scripts/package-check.sh needs, and a release build (made if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
SHEPHERD_PACKAGE_DIR="$work/previous" SHEPHERD_DEB_VERSION=0.1.0~previous \
  scripts/package.sh --no-image > /dev/null
SHEPHERD_PACKAGE_DIR="$work/current" scripts/package.sh > "$work/made.txt"
checked=$(scripts/package-check.sh "$work/previous" "$work/current")
echo "$checked"
mb() { awk "BEGIN { printf \"%.1f\", $1 / 1048576 }"; }
deb_size() { stat -c %s "$work"/current/"$1"_*.deb; }
installed() { dpkg-deb -f "$work"/current/"$1"_*.deb Installed-Size; }
layers=$(python3 - "$work/current/shepherd-image" <<'PY'
import json, sys
layout = sys.argv[1]
index = json.load(open(f"{layout}/index.json"))
digest = index["manifests"][0]["digest"].split(":", 1)[1]
manifest = json.load(open(f"{layout}/blobs/sha256/{digest}"))
print(" ".join(str(layer["size"]) for layer in manifest["layers"]))
PY
)
read -r base_gz app_gz <<< "$layers"
base_tar=$(stat -c %s "${SHEPHERD_OCI_BASE_DIR:-$HOME/.cache/shepherd/oci-base}/base.tar")
unpacked_kib=$(sed -n 's/.*the image unpacked: [0-9]* layers, \([0-9]*\) KiB.*/\1/p' <<< "$checked")
answering=$(sed -n 's/.*clean_root_to_server_answering_s = //p' <<< "$checked")
exposure() { systemd-analyze security --offline=yes "$1" 2>/dev/null | sed -n 's/.*Overall exposure level for .*: \([0-9.]*\) .*/\1/p'; }
git show 77b3182:deploy/systemd/shepherd-server.service > "$work/before-server.service"
git show 77b3182:deploy/systemd/shepherd-run.service > "$work/before-run.service"
version=$(dpkg-deb -f "$work"/current/shepherd_*.deb Version)
cat > bench/results/package.md <<EOF2
# Packages and image

Run on $(date -u '+%Y-%m-%d %H:%M') UTC with \`scripts/package-figures.sh\` (2 cores; release build;
version $version). Every check of \`scripts/package-check.sh\` passed in the same run
(the install, purge and upgrade on a clean Debian bookworm chroot, the image run from its
layers).

| What | Shepherd | Beside it |
|---|---|---|
| \`shepherd\` .deb | $(mb "$(deb_size shepherd)") MB ($(installed shepherd) KiB installed) | |
| \`shepherd-agent\` .deb | $(mb "$(deb_size shepherd-agent)") MB ($(installed shepherd-agent) KiB installed) | |
| OCI image, compressed layers | $(mb $((base_gz + app_gz))) MB | base layer alone (Debian's libc): $(mb "$base_gz") MB |
| OCI image, unpacked | $(awk "BEGIN { printf \"%.1f\", $unpacked_kib / 1024 }") MB | base layer alone: $(mb "$base_tar") MB |
| clean root to a server answering | $answering s (apt install, migrate, TLS files, start, \`/metrics\` and \`shepherd tasks\`) | |
| \`shepherd-server.service\` exposure | $(exposure deploy/systemd/shepherd-server.service) | $(exposure "$work/before-server.service") before hardening |
| \`shepherd-run.service\` exposure | $(exposure deploy/systemd/shepherd-run.service) | $(exposure "$work/before-run.service") before hardening |

deb_shepherd_mb = $(mb "$(deb_size shepherd)")
deb_agent_mb = $(mb "$(deb_size shepherd-agent)")
image_compressed_mb = $(mb $((base_gz + app_gz)))
image_unpacked_mb = $(awk "BEGIN { printf \"%.1f\", $unpacked_kib / 1024 }")
clean_root_to_server_answering_s = $answering
unit_exposure = $(exposure deploy/systemd/shepherd-server.service)
EOF2
echo "package-figures: bench/results/package.md"
