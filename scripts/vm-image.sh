#!/usr/bin/env bash
# Builds the Debian guest image the VM tests boot under QEMU, from Debian packages only, without
# loop devices or mounts: mmdebstrap into a directory, an ext4 root made with `mke2fs -d`, a FAT
# boot partition filled with mtools and made bootable with syslinux, and an MBR from syslinux.
# The result is cached in $SHEPHERD_VM_DIR (default ~/.cache/shepherd/vm) and rebuilt only when
# its inputs change: this script, and the release file of Debian bookworm, which pins the version
# of every package (it changes with a point release). Without network the cached image is used.
# The build is repeatable: SOURCE_DATE_EPOCH comes from the release file, file systems get fixed
# UUIDs and serials, and packages.txt lists every package and version in the guest.
#   guest.img         raw disk: vda1 FAT (syslinux, kernel, initrd), vda2 ext4 root
#   tftp/             the same kernel and initrd with an iPXE script, for VMs that boot a target
#                     disk first and fall back to the network into the base system (as a real
#                     machine does while its OS is being installed)
#   installable.img   the OS image the agent installs onto a target disk (a few MB: syslinux,
#                     the kernel and a busybox initramfs that announces itself on the console),
#                     with its sha256 in installable.img.sha256
#   packages.txt      every package in the guest, with its version
#   id_ed25519{,.pub} the SSH key root accepts in the guest (test use only)
# Needs root (mmdebstrap, ownership in the image) and scripts/test-deps.sh's VM packages.
set -euo pipefail

out="${SHEPHERD_VM_DIR:-$HOME/.cache/shepherd/vm}"
. "$(dirname "$0")/debian-build.sh"
debian_build "$out" "guest image" guest.img

[[ -f "$out/id_ed25519" ]] || ssh-keygen -q -t ed25519 -N '' -C shepherd-vm-tests -f "$out/id_ed25519"

root="$work/root"
debian_bootstrap "$root" \
    systemd-sysv,udev,openssh-server,linux-image-cloud-amd64,initramfs-tools,curl,ca-certificates,iproute2,busybox-static \
    'mkdir -p "$1/etc/initramfs-tools/conf.d"; echo MODULES=list > "$1/etc/initramfs-tools/conf.d/modules"; printf "%s\n" virtio_pci virtio_blk virtio_net ext4 > "$1/etc/initramfs-tools/modules"'

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
boot_files "$root"

say "making the disk"
boot_mib=64
root_mib=1024
syslinux_fat "$work/boot.img" "$boot_mib" 5e9e0001 "$kernel" "$initrd" \
    "root=/dev/vda2 rw console=ttyS0 net.ifnames=1 quiet"
ext4_root "$root" "$root_mib" 5e9e0000-0000-4000-8000-000000000002 \
    5e9e0000-0000-4000-8000-000000000003 "$work/root.img"

# A FAT-partitioned disk image of $2 MiB at $1 whose partition holds syslinux and the files
# given as NAME=PATH, booting with kernel command line $3.
bootable_disk() {
    local disk="$1" mib="$2" append="$3"
    shift 3
    local fat="$disk.fat"
    mkfs.vfat -n BOOT -i 5e9e0002 --invariant -C "$fat" $(((mib - 1) * 1024)) >/dev/null
    printf 'DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL vmlinuz\n  APPEND initrd=initrd.img %s\n' "$append" > "$disk.cfg"
    touch -d "@$SOURCE_DATE_EPOCH" "$disk.cfg" "${@#*=}"
    mcopy -m -i "$fat" "$disk.cfg" ::syslinux.cfg
    local f
    for f in "$@"; do mcopy -m -i "$fat" "${f#*=}" "::${f%%=*}"; done
    faketime "@$SOURCE_DATE_EPOCH" syslinux --install "$fat"
    truncate -s "${mib}M" "$disk"
    printf 'label: dos\nlabel-id: 0x5e9e0002\nstart=2048, type=c, bootable\n' | sfdisk --quiet "$disk"
    dd if=/usr/lib/syslinux/mbr/mbr.bin of="$disk" bs=440 count=1 conv=notrunc status=none
    dd if="$fat" of="$disk" bs=512 seek=2048 conv=notrunc status=none
    rm -f "$fat" "$disk.cfg"
}

say "making the installable image"
inst="$work/installed-root"
mkdir -p "$inst/bin" "$inst/proc" "$inst/dev"
cp "$root/bin/busybox" "$inst/bin/busybox"
cat > "$inst/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
while :; do
    echo "shepherd installed OS: running ($(/bin/busybox cat /proc/cmdline))" > /dev/console
    /bin/busybox sleep 5
done
INIT
chmod 755 "$inst/init"
mv "$inst" "$root/tmp/installed-root"
chroot "$root" sh -c 'cd /tmp/installed-root && find . -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} + && find . | sort | cpio --quiet -o -H newc --reproducible' | gzip -9n > "$work/installed-initrd.img"
rm -rf "$root/tmp/installed-root"
bootable_disk "$work/installable.img" 24 "console=ttyS0 shepherd.installed=1" \
    vmlinuz="$kernel" initrd.img="$work/installed-initrd.img"

say "making the network boot files"
mkdir -p "$work/tftp"
cp "$kernel" "$work/tftp/vmlinuz"
cp "$initrd" "$work/tftp/initrd.img"
printf '#!ipxe\nkernel tftp://10.0.2.2/vmlinuz initrd=initrd.img root=/dev/vda2 rw console=ttyS0 net.ifnames=1 quiet\ninitrd tftp://10.0.2.2/initrd.img\nboot\n' \
    > "$work/tftp/boot.ipxe"

disk="$work/guest.img"
boot_and_root_disk "$disk" 0x5e9e0001 "$work/boot.img" "$boot_mib" "$work/root.img" "$root_mib"
rm -rf "$out/tftp"
mv "$work/tftp" "$out/tftp"
mv "$work/installable.img" "$out/installable.img"
(cd "$out" && sha256sum installable.img | cut -d' ' -f1 > installable.img.sha256)
mv "$disk" "$out/guest.img"
mv "$work/packages.txt" "$out/packages.txt"
echo "$stamp" > "$out/stamp"
say "$out/guest.img ($(du -h --apparent-size "$out/guest.img" | cut -f1), $(du -h "$out/guest.img" | cut -f1) used), installable.img ($(du -h --apparent-size "$out/installable.img" | cut -f1))"
