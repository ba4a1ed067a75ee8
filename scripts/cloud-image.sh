#!/usr/bin/env bash
# Builds the stock cloud image the bare-metal tests install: Debian bookworm as a distribution
# builds its cloud image, from Debian packages only (systemd and its networkd, the cloud
# kernel, OpenSSH and cloud-init with Debian's own configuration), with nothing of Shepherd in
# it: no key, no network configuration, no agent settings. Whoever installs it brings those on
# a config drive (OpenStack's config-2), as Shepherd's agent does; without one, nobody can log
# in.
# Without loop devices or mounts: mmdebstrap into a directory, an ext4 root made with
# `mke2fs -d`, a FAT boot partition filled with mtools and made bootable with syslinux (BIOS),
# and an MBR from syslinux.
# The result is cached in $SHEPHERD_CLOUD_DIR (default ~/.cache/shepherd/cloud) and rebuilt
# only when its inputs change: this script, and the release file of Debian bookworm. The build
# is repeatable: SOURCE_DATE_EPOCH comes from the release file, file systems get fixed UUIDs
# and serials, and packages.txt lists every package and version in it.
#   cloud.img         raw disk: partition 1 FAT (syslinux, kernel, initrd), partition 2 the
#                     ext4 root (found by its UUID); a disk it is written onto is larger, and
#                     the space after them is free, as a cloud image leaves it
#   cloud.img.sha256  its sha256
#   packages.txt      every package in it, with its version
# Needs root (mmdebstrap, ownership in the image) and scripts/test-deps.sh's VM packages.
set -euo pipefail

out="${SHEPHERD_CLOUD_DIR:-$HOME/.cache/shepherd/cloud}"
. "$(dirname "$0")/debian-build.sh"
debian_build "$out" "cloud image" cloud.img
root_uuid=5e9e0000-0000-4000-8000-00000000c10d

root="$work/root"
debian_bootstrap "$root" \
    systemd-sysv,udev,openssh-server,linux-image-cloud-amd64,initramfs-tools,cloud-init,iproute2 \
    'mkdir -p "$1/etc/initramfs-tools/conf.d"; echo MODULES=list > "$1/etc/initramfs-tools/conf.d/modules"; printf "%s\n" virtio_pci virtio_blk virtio_scsi sd_mod ext4 > "$1/etc/initramfs-tools/modules"'

say "configuring"
echo debian > "$root/etc/hostname"
printf 'UUID=%s / ext4 rw,relatime 0 1\n' "$root_uuid" > "$root/etc/fstab"
# cloud-init writes the network's configuration for systemd-networkd, which brings it up.
chroot "$root" systemctl enable systemd-networkd >/dev/null 2>&1
# Every instance makes its own host keys (cloud-init does, and sshd's unit if it came first).
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
    > "$root/etc/systemd/system/ssh.service.d/host-keys.conf"
# No machine id: each instance makes its own on first boot.
: > "$root/etc/machine-id"
boot_files "$root"

say "making the disk"
boot_mib=48
root_mib=$(( $(du -sm "$root" | cut -f1) * 11 / 10 + 48 ))
syslinux_fat "$work/boot.img" "$boot_mib" 5e9e0c01 "$kernel" "$initrd" \
    "root=UUID=$root_uuid rw console=ttyS0 net.ifnames=1"
ext4_root "$root" "$root_mib" "$root_uuid" 5e9e0000-0000-4000-8000-00000000c10e "$work/root.img"
disk="$work/cloud.img"
boot_and_root_disk "$disk" 0x5e9e0c01 "$work/boot.img" "$boot_mib" "$work/root.img" "$root_mib"
mv "$disk" "$out/cloud.img"
(cd "$out" && sha256sum cloud.img | cut -d' ' -f1 > cloud.img.sha256)
mv "$work/packages.txt" "$out/packages.txt"
echo "$stamp" > "$out/stamp"
say "$out/cloud.img ($(du -h --apparent-size "$out/cloud.img" | cut -f1), $(du -h "$out/cloud.img" | cut -f1) used)"
