#!/usr/bin/env bash
# Builds Shepherd's live image: the ISO a bare server boots from its BMC's virtual media, so
# that Shepherd can reach a machine that has nothing but a BMC, empty disks and power. From
# Debian packages only, without loop devices or mounts: mmdebstrap into a directory, then a
# small initramfs of busybox, OpenSSH's sshd and sftp-server, jq, kmod and the kernel modules
# real servers need, a BIOS (isolinux) and a UEFI (GRUB) boot loader, and xorriso.
#
# No secret is in the image. Each machine's facts (Shepherd's SSH public key, the network,
# the agent's settings) reach it on a config drive in OpenStack's config-2 layout
# (openstack/latest/meta_data.json and network_data.json), folded into the ISO itself: the
# ISO's volume id is `config-2`, and both files are fixed-size slots that Shepherd's media
# server fills in for each machine as it streams the ISO (crates/media). An ISO served as it
# is boots to an sshd nobody can log in to.
#
# The result is cached in $SHEPHERD_LIVE_DIR (default ~/.cache/shepherd/live) and rebuilt only
# when its inputs change: this script, and the release file of Debian bookworm, which pins the
# version of every package. Without network the cached image is used. The build is
# repeatable: SOURCE_DATE_EPOCH comes from the release file (xorriso, mkfs.vfat and cpio take
# their times from it), and packages.txt lists every package and version it was made of.
#   live.iso          the live image (BIOS and UEFI; El Torito and hybrid MBR/GPT)
#   target.img        a small OS image for the tests to install: the live kernel and
#                     initramfs on a disk that boots from BIOS (syslinux) and UEFI, Secure
#                     Boot on or off (Debian's signed shim, GRUB and kernel at
#                     EFI/BOOT/BOOTX64.EFI), whose FAT partition, labelled CONFIG-2,
#                     carries its own config drive (DHCP, the key in test_id_ed25519.pub), so
#                     that the installed OS answers SSH as "shepherd installed OS"
#   target-stock.img  the same OS as a stock cloud image is: no config drive nor key of its
#                     own (its FAT partition is labelled SHEPHERD), so that it lets in only
#                     whoever wrote a config-2 partition beside it (Shepherd's agent does)
#   target.img.sha256, target-stock.img.sha256 their sha256
#   test_id_ed25519{,.pub} the key the target image lets in (test use only)
#   packages.txt      every package the image was made of, with its version
# Needs root (mmdebstrap) and scripts/test-deps.sh's live image packages.
set -euo pipefail

out="${SHEPHERD_LIVE_DIR:-$HOME/.cache/shepherd/live}"
. "$(dirname "$0")/debian-build.sh"
debian_build "$out" "live image" live.iso target.img target-stock.img

root="$work/root"
debian_bootstrap "$root" \
    linux-image-amd64,openssh-server,openssh-sftp-server,busybox-static,jq,kmod,cpio,xz-utils,shim-signed,grub-efi-amd64-signed \
    'mkdir -p "$1/etc/initramfs-tools/conf.d"; echo MODULES=list > "$1/etc/initramfs-tools/conf.d/modules"'
kernel="$(ls "$root"/boot/vmlinuz-* | head -1)"
kver="${kernel##*/vmlinuz-}"

say "making the initramfs (kernel $kver)"
# Built inside the bootstrapped system, whose kmod resolves and indexes the modules.
initrd="$root/initrd"
mkdir -p "$initrd"/{bin,sbin,etc/ssh,etc/shepherd,lib64,root,run,tmp,proc,sys,dev,media,var/empty,usr/sbin,usr/bin,usr/lib/openssh}
chmod 700 "$initrd/root"
chmod 1777 "$initrd/tmp"
# The files a program needs: itself and every library the dynamic linker loads for it.
copy_exec() {
    local f lib
    for f in "$@"; do
        install -D "$root$f" "$initrd$f"
        for lib in $(chroot "$root" ldd "$f" | grep -o '/[^ ]*' | sort -u); do
            [[ -e "$initrd$lib" ]] || install -D "$root$lib" "$initrd$lib"
        done
    done
}
copy_exec /usr/sbin/sshd /usr/lib/openssh/sftp-server /usr/bin/ssh-keygen /usr/bin/jq /usr/bin/kmod
# The agent, uploaded at takeover, is built against this glibc and needs libgcc_s.
install -D "$root/lib/x86_64-linux-gnu/libgcc_s.so.1" "$initrd/lib/x86_64-linux-gnu/libgcc_s.so.1"
install -m 755 "$root/bin/busybox" "$initrd/bin/busybox"
for applet in $(chroot "$root" /bin/busybox --list); do
    [[ -e "$initrd/bin/$applet" ]] || ln -s busybox "$initrd/bin/$applet"
done
for tool in modprobe insmod rmmod lsmod depmod modinfo; do
    ln -sf ../usr/bin/kmod "$initrd/sbin/$tool"
done
ln -s ../bin/busybox "$initrd/sbin/init"

# The drivers of the machines it boots on: disks (virtio, NVMe, AHCI/SATA, SAS and RAID
# controllers, USB storage: BMCs attach virtual media over USB), the CD file system, and the
# common NICs, each with the modules it depends on. NICs whose firmware Debian keeps in
# non-free-firmware (bnx2x, ice's DDP package) load without it and may not come up.
modules=(
    virtio_pci virtio_blk virtio_scsi virtio_net
    nvme ahci ata_piix ata_generic sd_mod sr_mod isofs vfat nls_cp437 nls_iso8859_1 nls_utf8 nls_ascii
    megaraid_sas mpt3sas hpsa smartpqi aacraid
    xhci_pci ehci_pci ohci_pci uhci_hcd usb_storage uas
    e1000 e1000e igb igc ixgbe i40e ice bnxt_en tg3 bnx2x mlx4_en mlx5_core r8169 vmxnet3 af_packet
)
mkdir -p "$initrd/lib/modules/$kver"
for m in "${modules[@]}"; do
    # Built-in modules have nothing to copy (and are listed as "builtin").
    chroot "$root" modprobe -S "$kver" --show-depends "$m" 2>/dev/null | sed -n 's/^insmod \([^ ]*\).*/\1/p' || true
done | sort -u | while read -r path; do
    install -D -m 644 "$root$path" "$initrd$path"
done
cp "$root/lib/modules/$kver"/modules.{order,builtin,builtin.modinfo} "$initrd/lib/modules/$kver/"
chroot "$root" depmod -b /initrd "$kver"

cat > "$initrd/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
sshd:x:100:65534:sshd privilege separation:/run/sshd:/bin/false
EOF
printf 'root:x:0:\nnogroup:x:65534:\n' > "$initrd/etc/group"
printf 'root:*:19000:0:99999:7:::\nsshd:*:19000:0:99999:7:::\n' > "$initrd/etc/shadow"
chmod 600 "$initrd/etc/shadow"
cat > "$initrd/etc/ssh/sshd_config" <<'EOF'
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile .ssh/authorized_keys
Subsystem sftp /usr/lib/openssh/sftp-server
PidFile /run/sshd.pid
Include /etc/ssh/sshd_config.d/*.conf
EOF
mkdir -p "$initrd/etc/ssh/sshd_config.d"
cat > "$initrd/etc/inittab" <<'EOF'
::sysinit:/etc/shepherd/setup
::respawn:/usr/sbin/sshd -D -e
::ctrlaltdel:/bin/busybox reboot -f
::shutdown:/bin/busybox umount -a -r
EOF
cat > "$initrd/init" <<'EOF'
#!/bin/busybox sh
# PID 1 of Shepherd's live environment: the kernel's file systems, then busybox init, which
# runs /etc/shepherd/setup once and keeps sshd running.
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox mkdir -p /dev/pts
/bin/busybox mount -t devpts devpts /dev/pts
/bin/busybox mount -t tmpfs -o mode=755 run /run
exec /bin/busybox init
EOF
chmod 755 "$initrd/init"
cat > "$initrd/etc/shepherd/setup" <<'EOF'
#!/bin/sh
# Loads the drivers, finds this machine's config drive (an ISO 9660 volume or a FAT partition
# labelled config-2; in the live environment only a whole device, its boot medium, and in the
# installed OS only a partition), and
# configures from it the network (OpenStack network_data.json: DHCP, or static addresses with
# routes and DNS), the keys root accepts (meta_data.json public_keys) and the agent's settings
# (meta_data.json meta, as SHEPHERD_* variables of SSH sessions).
mode="live environment"
grep -q shepherd.installed /proc/cmdline && mode="installed OS"
say() { echo "shepherd $mode: $*" > /dev/console; }
firmware=BIOS
[ -d /sys/firmware/efi ] && firmware=UEFI
say "starting (kernel $(uname -r), booted by $firmware)"
hostname shepherd-live
# Cold plug: every device's driver, again as buses behind drivers loaded meanwhile appear.
for round in 1 2 3; do
    find /sys/devices -name modalias -exec cat {} + 2>/dev/null | sort -u | xargs -r modprobe -abq
    sleep 1
done
modprobe -aq isofs vfat nls_cp437 nls_iso8859_1 nls_utf8 nls_ascii
# A block device's label: an ISO 9660 volume id, or a FAT label (FAT32's, FAT12/16's place).
label_of() {
    if [ "$(dd if="$1" bs=1 skip=32769 count=5 2>/dev/null)" = CD001 ]; then
        dd if="$1" bs=1 skip=32808 count=32 2>/dev/null
    else
        dd if="$1" bs=1 skip=71 count=11 2>/dev/null
        dd if="$1" bs=1 skip=43 count=11 2>/dev/null
    fi
}
mkdir -p /media/config
found=
for try in $(seq 1 30); do
    for dev in $(ls /sys/class/block); do
        # The live environment reads its own boot medium's config drive, a whole device (the
        # virtual CD, or a USB disk holding the ISO). A local disk's config-2 partition (an
        # installed OS's, or one Ironic wrote) is never it, though its name may sort first.
        [ "$mode" = "live environment" ] && [ -e "/sys/class/block/$dev/partition" ] && continue
        # The installed OS reads its own disk's, a partition, and never a CD's: a live image
        # may still be inserted when a CD boot falls through to it.
        [ "$mode" = "installed OS" ] && [ ! -e "/sys/class/block/$dev/partition" ] && continue
        case "$(label_of "/dev/$dev" | tr -d ' \000')" in
        *config-2*|*CONFIG-2*)
            for fs in iso9660 vfat; do
                if mount -t $fs -o ro "/dev/$dev" /media/config 2>/tmp/mount.err; then found=/dev/$dev; break 3; fi
            done
            [ "$try" = 1 ] && say "cannot mount /dev/$dev: $(cat /tmp/mount.err)"
            ;;
        esac
    done
    sleep 1
done
md=/media/config/openstack/latest/meta_data.json
nd=/media/config/openstack/latest/network_data.json
if [ -z "$found" ] || ! jq -e .public_keys "$md" >/dev/null 2>&1; then
    say "no config drive with keys found; nobody can log in"
    md=/dev/null
    nd=/dev/null
else
    say "config drive on $found"
fi
mkdir -p /root/.ssh
chmod 700 /root/.ssh
jq -r '.public_keys // {} | .[]' "$md" > /root/.ssh/authorized_keys 2>/dev/null
chmod 600 /root/.ssh/authorized_keys
name=$(jq -r '.hostname // empty' "$md" 2>/dev/null)
[ -n "$name" ] && hostname "$name"
# One SetEnv line for them all: sshd takes the first SetEnv line and ignores the others.
jq -r '[.meta // {} | to_entries[] | select(.key | test("^SHEPHERD_[A-Z_]+$")) | "\(.key)=\"\(.value)\""]
    | select(length > 0) | "SetEnv " + join(" ")' "$md" \
    > /etc/ssh/sshd_config.d/shepherd.conf 2>/dev/null
ip link set lo up
# The interface of a link: the one with its MAC address, else the first with a carrier.
iface_of() {
    mac=$(jq -r --arg l "$1" '.links[] | select(.id == $l) | .ethernet_mac_address // empty' "$nd" | tr A-F a-f)
    for i in /sys/class/net/*; do
        [ "$(cat "$i/type")" = 1 ] || continue
        ip link set "${i##*/}" up
        if [ -n "$mac" ] && [ "$(cat "$i/address")" = "$mac" ]; then echo "${i##*/}"; return; fi
    done
    [ -n "$mac" ] && return
    sleep 3
    for i in /sys/class/net/*; do
        [ "$(cat "$i/type")" = 1 ] && [ "$(cat "$i/carrier" 2>/dev/null)" = 1 ] && { echo "${i##*/}"; return; }
    done
}
networks=$(jq -c '.networks // [] | .[]' "$nd" 2>/dev/null)
if [ -z "$networks" ]; then
    for i in /sys/class/net/*; do
        [ "$(cat "$i/type")" = 1 ] || continue
        ip link set "${i##*/}" up
        udhcpc -i "${i##*/}" -b -t 60 -T 2 -s /etc/shepherd/udhcpc -q >/dev/null 2>&1
    done
fi
echo "$networks" | while read -r net; do
    [ -n "$net" ] || continue
    iface=$(iface_of "$(echo "$net" | jq -r .link)")
    if [ -z "$iface" ]; then say "no interface for $(echo "$net" | jq -c .)"; continue; fi
    case "$(echo "$net" | jq -r .type)" in
    ipv4_dhcp)
        udhcpc -i "$iface" -b -t 60 -T 2 -s /etc/shepherd/udhcpc >/dev/null 2>&1
        ;;
    ipv4)
        addr=$(echo "$net" | jq -r .ip_address)
        eval "$(ipcalc -p "$addr" "$(echo "$net" | jq -r .netmask)")"
        ip addr add "$addr/$PREFIX" dev "$iface"
        echo "$net" | jq -r '.routes // [] | .[] | "\(.network) \(.netmask) \(.gateway)"' |
        while read -r dest mask gw; do
            if [ "$dest" = 0.0.0.0 ]; then ip route add default via "$gw" dev "$iface"
            else eval "$(ipcalc -p "$dest" "$mask")"; ip route add "$dest/$PREFIX" via "$gw" dev "$iface"; fi
        done
        say "$iface: $addr/$PREFIX"
        ;;
    esac
done
jq -r '.services // [] | .[] | select(.type == "dns") | "nameserver \(.address)"' "$nd" > /etc/resolv.conf 2>/dev/null
# Nothing reads the media from here on: it may be ejected at any time.
[ -n "$found" ] && umount /media/config
ssh-keygen -q -t ed25519 -N '' -f /etc/ssh/ssh_host_ed25519_key
mkdir -p /run/sshd
chmod 755 /run/sshd
say "sshd starting, host key $(ssh-keygen -l -f /etc/ssh/ssh_host_ed25519_key.pub | cut -d' ' -f2)"
EOF
chmod 755 "$initrd/etc/shepherd/setup"
cat > "$initrd/etc/shepherd/udhcpc" <<'EOF'
#!/bin/sh
# udhcpc's hook: applies a lease (address, router, DNS) to the interface.
case "$1" in
bound|renew)
    ip addr flush dev "$interface"
    eval "$(ipcalc -p "$ip" "${subnet:-255.255.255.0}")"
    ip addr add "$ip/$PREFIX" dev "$interface"
    for r in $router; do ip route add default via "$r" dev "$interface"; break; done
    [ -n "$dns" ] && for d in $dns; do echo "nameserver $d"; done > /etc/resolv.conf
    echo "shepherd: $interface: $ip/$PREFIX by DHCP" > /dev/console
    ;;
deconfig)
    ip addr flush dev "$interface"
    ;;
esac
EOF
chmod 755 "$initrd/etc/shepherd/udhcpc"
find "$initrd" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
chroot "$root" sh -c 'cd /initrd && find . | LC_ALL=C sort | cpio --quiet -o -H newc --reproducible -R 0:0 |
    xz -9 --check=crc32 --lzma2=dict=1MiB -T1' > "$work/initrd.img"

say "making the ISO"
iso="$work/iso"
mkdir -p "$iso"/{boot,isolinux,EFI/BOOT,openstack/latest}
cp "$kernel" "$iso/boot/vmlinuz"
cp "$work/initrd.img" "$iso/boot/initrd.img"
append="console=tty0 console=ttyS0,115200 quiet"
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 "$iso/isolinux/"
printf 'DEFAULT live\nPROMPT 0\nTIMEOUT 0\nLABEL live\n  KERNEL /boot/vmlinuz\n  APPEND initrd=/boot/initrd.img %s\n' "$append" \
    > "$iso/isolinux/isolinux.cfg"
# GRUB for UEFI, its configuration inside it: find the volume holding the kernel, boot it.
printf 'set timeout=0\nsearch --no-floppy --set=root --file /boot/vmlinuz\nlinux /boot/vmlinuz %s\ninitrd /boot/initrd.img\nboot\n' "$append" \
    > "$work/grub.cfg"
touch -d "@$SOURCE_DATE_EPOCH" "$work/grub.cfg"
faketime "@$SOURCE_DATE_EPOCH" grub-mkstandalone -O x86_64-efi -o "$iso/EFI/BOOT/BOOTX64.EFI" \
    --modules="part_gpt part_msdos iso9660 fat search linux normal" \
    --locales= --fonts= --themes= "boot/grub/grub.cfg=$work/grub.cfg"
mkfs.vfat -n EFIBOOT -i 5e9e1001 --invariant -C "$iso/boot/efiboot.img" 4096 >/dev/null
mmd -i "$iso/boot/efiboot.img" ::EFI ::EFI/BOOT
mcopy -m -i "$iso/boot/efiboot.img" "$iso/EFI/BOOT/BOOTX64.EFI" ::EFI/BOOT/BOOTX64.EFI
# The config drive's slots: fixed-size JSON that names itself, padded with spaces; Shepherd's
# media server finds each by its first bytes at the start of an ISO sector and streams each
# machine's own files in their place (crates/media/src/slots.rs).
slot() {
    local text="{\"shepherd_slot\":\"$1\",\"bytes\":16384}"
    { printf '%s' "$text"; printf '%*s\n' $((16384 - ${#text} - 1)) ''; } > "$2"
}
slot meta_data.json "$iso/openstack/latest/meta_data.json"
slot network_data.json "$iso/openstack/latest/network_data.json"
find "$iso" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
xorriso -as mkisofs -quiet -iso-level 3 -full-iso9660-filenames -J -joliet-long -R \
    -volid config-2 -sort /dev/null \
    -isohybrid-mbr /usr/lib/ISOLINUX/isohdpfx.bin \
    -b isolinux/isolinux.bin -c isolinux/boot.cat -no-emul-boot -boot-load-size 4 -boot-info-table \
    -eltorito-alt-boot -e boot/efiboot.img -no-emul-boot -isohybrid-gpt-basdat \
    -o "$work/live.iso" "$iso" 2>&1 | grep -v 'UPDATE' || true
[[ -s "$work/live.iso" ]] || { say "xorriso made no ISO" >&2; exit 1; }

say "making the target images the tests install"
[[ -f "$out/test_id_ed25519" ]] || ssh-keygen -q -t ed25519 -N '' -C shepherd-live-tests -f "$out/test_id_ed25519"
target_mib=48
printf 'DEFAULT installed\nPROMPT 0\nTIMEOUT 0\nLABEL installed\n  KERNEL vmlinuz\n  APPEND initrd=initrd.img %s shepherd.installed=1\n' "$append" \
    > "$work/syslinux.cfg"
jq -n --arg key "$(cat "$out/test_id_ed25519.pub")" \
    '{uuid: "5e9e0000-0000-4000-8000-00000000face", hostname: "shepherd-installed", public_keys: {test: $key}}' \
    > "$work/meta_data.json"
echo '{"links": [], "networks": [], "services": []}' > "$work/network_data.json"
# The same for UEFI, with Secure Boot on or off: Debian's signed boot chain at the
# removable-media path the firmware looks for on any FAT partition. Its shim (signed by
# Microsoft's UEFI CA) loads grubx64.efi beside it, Debian's signed GRUB, which reads
# EFI/debian/grub.cfg from the partition it was loaded from and boots Debian's signed kernel
# from there too ($cmdpath is "(hd0,msdos1)/EFI/BOOT"), never another disk's copy.
cat > "$work/target-grub.cfg" <<GRUB
set timeout=0
regexp --set=1:root '^\(([^)]*)\)' "\$cmdpath"
linux /vmlinuz $append shepherd.installed=1
initrd /initrd.img
boot
GRUB
touch -d "@$SOURCE_DATE_EPOCH" "$work/syslinux.cfg" "$work/meta_data.json" "$work/network_data.json" \
    "$work/target-grub.cfg"
# target_image NAME LABEL [own]: $work/NAME, a disk image of one bootable FAT partition
# labelled LABEL with the kernel, the initramfs and both boot loaders; with "own", the
# partition is its own config drive too (openstack/latest/, the test key, DHCP).
target_image() {
    local fat="$work/$1.fat"
    mkfs.vfat -n "$2" -i 5e9e1002 --invariant -C "$fat" $(((target_mib - 1) * 1024)) >/dev/null
    mcopy -m -i "$fat" "$kernel" ::vmlinuz
    mcopy -m -i "$fat" "$work/initrd.img" ::initrd.img
    mcopy -m -i "$fat" "$work/syslinux.cfg" ::syslinux.cfg
    mmd -i "$fat" ::EFI ::EFI/BOOT ::EFI/debian
    mcopy -m -i "$fat" "$root/usr/lib/shim/shimx64.efi.signed" ::EFI/BOOT/BOOTX64.EFI
    mcopy -m -i "$fat" "$root/usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed" ::EFI/BOOT/grubx64.efi
    mcopy -m -i "$fat" "$work/target-grub.cfg" ::EFI/debian/grub.cfg
    if [[ "${3:-}" = own ]]; then
        mmd -i "$fat" ::openstack ::openstack/latest
        mcopy -m -i "$fat" "$work/meta_data.json" ::openstack/latest/meta_data.json
        mcopy -m -i "$fat" "$work/network_data.json" ::openstack/latest/network_data.json
    fi
    faketime "@$SOURCE_DATE_EPOCH" syslinux --install "$fat"
    truncate -s "${target_mib}M" "$work/$1"
    printf 'label: dos\nlabel-id: 0x5e9e1002\nstart=2048, type=c, bootable\n' | sfdisk --quiet "$work/$1"
    dd if=/usr/lib/syslinux/mbr/mbr.bin of="$work/$1" bs=440 count=1 conv=notrunc status=none
    dd if="$fat" of="$work/$1" bs=512 seek=2048 conv=notrunc status=none
}
target_image target.img CONFIG-2 own
# As a stock cloud image is: no key of its own, so that only a config drive someone else wrote
# (the one Shepherd's agent adds after the image) lets anyone in.
target_image target-stock.img SHEPHERD

mv "$work/live.iso" "$out/live.iso"
for image in target.img target-stock.img; do
    mv "$work/$image" "$out/$image"
    (cd "$out" && sha256sum "$image" | cut -d' ' -f1 > "$image.sha256")
done
mv "$work/packages.txt" "$out/packages.txt"
echo "$stamp" > "$out/stamp"
say "$out/live.iso ($(du -h --apparent-size "$out/live.iso" | cut -f1)), target.img and target-stock.img ($(du -h --apparent-size "$out/target.img" | cut -f1) each)"
