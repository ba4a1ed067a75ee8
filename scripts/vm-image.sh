#!/usr/bin/env bash
# Builds the Debian guest image the VM tests boot under QEMU, from Debian packages only, without
# loop devices or mounts: mmdebstrap into a directory, an ext4 root made with `mke2fs -d`, a FAT
# boot partition filled with mtools and made bootable with syslinux, and an MBR from syslinux.
# The result is cached in $SHEPHERD_VM_DIR (default ~/.cache/shepherd/vm) and rebuilt only when
# this script changes:
#   guest.img        raw disk: vda1 FAT (syslinux, kernel, initrd), vda2 ext4 root
#   id_ed25519{,.pub} the SSH key root accepts in the guest (test use only)
# Needs root (mmdebstrap, ownership in the image) and scripts/test-deps.sh's VM packages.
set -euo pipefail

out="${SHEPHERD_VM_DIR:-$HOME/.cache/shepherd/vm}"
stamp="$(sha256sum "$0" | cut -c1-16)"
if [[ -f "$out/guest.img" && "$(cat "$out/stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "guest image: $out/guest.img (cached)"
    exit 0
fi
mkdir -p "$out"
work="$(mktemp -d "$out/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
say() { echo "guest image: $*"; }

[[ -f "$out/id_ed25519" ]] || ssh-keygen -q -t ed25519 -N '' -C shepherd-vm-tests -f "$out/id_ed25519"

say "bootstrapping Debian bookworm (minbase) into $work/root"
root="$work/root"
mmdebstrap --quiet --variant=minbase --mode=root \
    --include=systemd-sysv,udev,openssh-server,linux-image-cloud-amd64,initramfs-tools,curl,ca-certificates,iproute2 \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d"; echo MODULES=list > "$1/etc/initramfs-tools/conf.d/modules"; printf "%s\n" virtio_pci virtio_blk virtio_net ext4 > "$1/etc/initramfs-tools/modules"' \
    bookworm "$root" http://deb.debian.org/debian

say "configuring"
echo shepherd-guest > "$root/etc/hostname"
printf '/dev/vda2 / ext4 rw,relatime 0 1\n' > "$root/etc/fstab"
mkdir -p "$root/etc/systemd/network"
printf '[Match]\nName=en*\n\n[Network]\nDHCP=yes\n' > "$root/etc/systemd/network/10-wired.network"
chroot "$root" systemctl enable systemd-networkd ssh >/dev/null 2>&1
# Every VM makes its own host keys on first boot.
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
    > "$root/etc/systemd/system/ssh.service.d/host-keys.conf"
# The takeover's SSH session tells the agent to heartbeat every 2 s (tests want it quick).
printf 'SetEnv SHEPHERD_AGENT_HEARTBEAT_INTERVAL=2s\n' > "$root/etc/ssh/sshd_config.d/shepherd-agent.conf"
install -d -m 700 "$root/root/.ssh"
install -m 600 "$out/id_ed25519.pub" "$root/root/.ssh/authorized_keys"
# A serial console, and no waiting for a network that user-mode networking answers at once.
chroot "$root" systemctl mask systemd-networkd-wait-online.service >/dev/null 2>&1
chroot "$root" update-initramfs -u -k all >/dev/null 2>&1
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

say "making the disk"
kernel="$(ls "$root"/boot/vmlinuz-* | head -1)"
initrd="$(ls "$root"/boot/initrd.img-* | head -1)"
boot_mib=64
root_mib=1024
mkfs.vfat -n BOOT -C "$work/boot.img" $((boot_mib * 1024)) >/dev/null
printf 'DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL vmlinuz\n  APPEND initrd=initrd.img root=/dev/vda2 rw console=ttyS0 net.ifnames=1 quiet\n' \
    > "$work/syslinux.cfg"
mcopy -i "$work/boot.img" "$kernel" ::vmlinuz
mcopy -i "$work/boot.img" "$initrd" ::initrd.img
mcopy -i "$work/boot.img" "$work/syslinux.cfg" ::syslinux.cfg
syslinux --install "$work/boot.img"
mke2fs -q -t ext4 -L root -d "$root" "$work/root.img" "${root_mib}M"

disk="$work/guest.img"
start1=2048
start2=$((start1 + boot_mib * 2048))
truncate -s $(((start2 + root_mib * 2048) * 512)) "$disk"
sfdisk --quiet "$disk" <<EOF
label: dos
start=$start1, size=$((boot_mib * 2048)), type=c, bootable
start=$start2, size=$((root_mib * 2048)), type=83
EOF
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$disk" bs=440 count=1 conv=notrunc status=none
dd if="$work/boot.img" of="$disk" bs=512 seek=$start1 conv=notrunc,sparse status=none
dd if="$work/root.img" of="$disk" bs=512 seek=$start2 conv=notrunc,sparse status=none
mv "$disk" "$out/guest.img"
echo "$stamp" > "$out/stamp"
say "$out/guest.img ($(du -h --apparent-size "$out/guest.img" | cut -f1), $(du -h "$out/guest.img" | cut -f1) used)"
