#!/usr/bin/env bash
# The base layer of Shepherd's OCI image (scripts/package.sh): what the `shepherd` binary needs
# from Debian bookworm and nothing else, the way distroless images are made. The packages are
# extracted, not installed (no shell, no package manager, no maintainer script runs), then
# written as one tar with fixed times and owners, without documentation but the copyright
# files. Cached in $SHEPHERD_OCI_BASE_DIR (default ~/.cache/shepherd/oci-base) and made again
# only when this script or bookworm's release file changes.
#   base.tar      the layer, uncompressed
#   packages.txt  the packages it holds, with their versions
# Needs root (mmdebstrap) and mmdebstrap.
set -euo pipefail

out="${SHEPHERD_OCI_BASE_DIR:-$HOME/.cache/shepherd/oci-base}"
. "$(dirname "$0")/debian-build.sh"
debian_build "$out" "oci base" base.tar packages.txt

# libc6 brings libgcc-s1 (the binary's libgcc_s) and gcc-12-base; netbase /etc/services and
# /etc/protocols.
say "extracting libc6 and netbase from Debian bookworm"
mmdebstrap --quiet --variant=extract --mode=root --include=libc6,netbase \
    bookworm "$work/root" "$mirror"
rm -rf "$work/root/var/lib/apt" "$work/root/var/cache/apt" "$work/root/var/lib/dpkg" \
    "$work/root/usr/share/man" "$work/root/usr/share/info" "$work/root/usr/share/locale" \
    "$work/root/usr/share/lintian" "$work/root/dev" "$work/root/proc" "$work/root/sys" \
    "$work/root/run" "$work/root/tmp" "$work/root/etc/apt" "$work/root/etc/dpkg" \
    "$work/root/etc/hostname" "$work/root/etc/resolv.conf" "$work/root/etc/fstab" \
    "$work/root/usr/lib/x86_64-linux-gnu/gconv"
find "$work/root/usr/share/doc" -type f ! -name copyright -delete
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
    --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$work/root" -cf "$work/base.tar" .
ls "$work/root/usr/share/doc" > "$work/packages.txt"
mv "$work/base.tar" "$work/packages.txt" "$out/"
echo "$stamp" > "$out/stamp"
say "$out/base.tar ($(du -k "$out/base.tar" | cut -f1) KiB)"
