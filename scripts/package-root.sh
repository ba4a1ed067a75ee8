#!/usr/bin/env bash
# The clean system scripts/package-check.sh installs the packages on: Debian bookworm's minbase
# and what an operator's host would have besides (adduser, which the package depends on;
# systemd, whose units it ships; man-db and the three shells whose completions it ships), as a
# tar. Cached in
# $SHEPHERD_PACKAGE_ROOT_DIR (default ~/.cache/shepherd/package-root) and made again only when
# this script or bookworm's release file changes; the check then needs no network.
#   root.tar      the system
# Needs root (mmdebstrap) and mmdebstrap.
set -euo pipefail

out="${SHEPHERD_PACKAGE_ROOT_DIR:-$HOME/.cache/shepherd/package-root}"
. "$(dirname "$0")/debian-build.sh"
debian_build "$out" "package test root" root.tar

say "bootstrapping Debian bookworm (minbase) into $out/root.tar"
mmdebstrap --quiet --variant=minbase --mode=root \
    --include=adduser,systemd,man-db,bash-completion,zsh,fish \
    bookworm "$work/root.tar" "$mirror"
mv "$work/root.tar" "$out/root.tar"
echo "$stamp" > "$out/stamp"
say "$out/root.tar ($(du -k "$out/root.tar" | cut -f1) KiB)"
