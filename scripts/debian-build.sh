# Sourced by the image builds (vm-image.sh, live-image.sh, cloud-image.sh): what they share to build from
# Debian bookworm's packages, repeatably and only when needed.
#
# debian_build OUT NAME FILE...: makes a scratch directory `$work` under OUT (removed on exit)
# and fetches bookworm's release file into it. When FILE... are in OUT and were built by this
# very script from this release (`OUT/stamp`), or when the archive is out of reach and they
# are there, says so and exits the build; without them and without the archive, fails. Else
# sets `$stamp` (to write to OUT/stamp once built) and exports SOURCE_DATE_EPOCH, the release's
# date, for every tool that stamps times. `say` prefixes NAME to what it prints.
mirror=http://deb.debian.org/debian

debian_build() {
    local out="$1" file
    build_name="$2"
    shift 2
    say() { echo "$build_name: $*"; }
    mkdir -p "$out"
    work="$(mktemp -d "$out/build.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    local all_there=1
    for file in "$@"; do [[ -f "$out/$file" ]] || all_there=0; done
    if ! curl -fsS --max-time 30 -o "$work/InRelease" "$mirror/dists/bookworm/InRelease"; then
        if [[ "$all_there" = 1 ]]; then
            say "$out/$1 (cached; the Debian archive is out of reach, so it was not checked)"
            exit 0
        fi
        say "cannot reach $mirror and nothing is cached" >&2
        exit 1
    fi
    stamp="$(cat "$0" "$work/InRelease" | sha256sum | cut -c1-16)"
    if [[ "$all_there" = 1 && "$(cat "$out/stamp" 2>/dev/null)" == "$stamp" ]]; then
        say "$out/$1 (cached)"
        exit 0
    fi
    SOURCE_DATE_EPOCH="$(date -d "$(sed -n 's/^Date: //p' "$work/InRelease")" +%s)"
    export SOURCE_DATE_EPOCH
}

# debian_bootstrap ROOT PACKAGES HOOK: bookworm's minbase and PACKAGES (comma-separated) in
# ROOT, without documentation, manual pages, locales (but their aliases) or info pages, HOOK
# run as mmdebstrap's essential hook; every package and its version in $work/packages.txt.
debian_bootstrap() {
    say "bootstrapping Debian bookworm (minbase) into $1"
    mmdebstrap --quiet --variant=minbase --mode=root --include="$2" \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-include=/usr/share/locale/locale.alias' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --essential-hook="$3" \
        bookworm "$1" "$mirror"
    chroot "$1" dpkg-query -W -f '${Package} ${Version}\n' > "$work/packages.txt"
}

# syslinux_fat FAT MIB SERIAL KERNEL INITRD APPEND: at FAT, a FAT file system of MIB MiB
# labelled BOOT (volume serial SERIAL) holding KERNEL as vmlinuz and INITRD as initrd.img, with
# syslinux installed to boot them with kernel command line APPEND.
syslinux_fat() {
    local fat="$1" mib="$2" serial="$3" kernel="$4" initrd="$5" append="$6"
    mkfs.vfat -n BOOT -i "$serial" --invariant -C "$fat" $((mib * 1024)) >/dev/null
    printf 'DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL vmlinuz\n  APPEND initrd=initrd.img %s\n' \
        "$append" > "$fat.cfg"
    touch -d "@$SOURCE_DATE_EPOCH" "$fat.cfg"
    mcopy -m -i "$fat" "$kernel" ::vmlinuz
    mcopy -m -i "$fat" "$initrd" ::initrd.img
    mcopy -m -i "$fat" "$fat.cfg" ::syslinux.cfg
    faketime "@$SOURCE_DATE_EPOCH" syslinux --install "$fat"
    rm -f "$fat.cfg"
}

# ext4_root ROOT MIB UUID HASH_SEED IMAGE: the tree at ROOT as an ext4 file system of MIB MiB
# labelled root at IMAGE, repeatably: a fixed UUID and hash seed, and every time the release's
# (E2FSPROGS_FAKE_TIME stamps the superblock and inodes with it instead of the clock).
ext4_root() {
    local root="$1" mib="$2" uuid="$3" seed="$4" image="$5"
    # Files made since the release (configuration, initramfs, logs) get its time, as packages do.
    find "$root" -newermt "@$SOURCE_DATE_EPOCH" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
    E2FSPROGS_FAKE_TIME="$SOURCE_DATE_EPOCH" mke2fs -q -t ext4 -L root -U "$uuid" \
        -E hash_seed="$seed" -d "$root" "$image" "${mib}M"
    # mke2fs copies each file's ctime, which only the clock sets, and its atime, which reading
    # it for the copy may have just set; give them the release's time too.
    (cd "$root" && find . -printf "sif \"/%P\" ctime @$SOURCE_DATE_EPOCH\nsif \"/%P\" atime @$SOURCE_DATE_EPOCH\n") \
        > "$image.times"
    E2FSPROGS_FAKE_TIME="$SOURCE_DATE_EPOCH" debugfs -w -f "$image.times" "$image" >/dev/null 2>&1
    rm -f "$image.times"
}

# boot_and_root_disk DISK LABEL_ID BOOT BOOT_MIB ROOT ROOT_MIB: at DISK, an MBR disk (id
# LABEL_ID, syslinux's boot code) whose partition 1, bootable, holds the FAT image BOOT and
# partition 2 the Linux file system image ROOT, sized BOOT_MIB and ROOT_MIB, from sector 2048.
boot_and_root_disk() {
    local disk="$1" label_id="$2" boot="$3" boot_mib="$4" root="$5" root_mib="$6"
    local start1=2048 start2=$((2048 + $4 * 2048))
    truncate -s $(((start2 + root_mib * 2048) * 512)) "$disk"
    sfdisk --quiet "$disk" <<SFDISK
label: dos
label-id: $label_id
start=$start1, size=$((boot_mib * 2048)), type=c, bootable
start=$start2, size=$((root_mib * 2048)), type=83
SFDISK
    dd if=/usr/lib/syslinux/mbr/mbr.bin of="$disk" bs=440 count=1 conv=notrunc status=none
    dd if="$boot" of="$disk" bs=512 seek=$start1 conv=notrunc,sparse status=none
    dd if="$root" of="$disk" bs=512 seek=$start2 conv=notrunc,sparse status=none
}

# boot_files ROOT: brings ROOT's initramfs up to date and drops apt's caches, then sets
# $kernel and $initrd to its kernel and initramfs.
boot_files() {
    chroot "$1" update-initramfs -u -k all >/dev/null 2>&1
    rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*
    kernel="$(ls "$1"/boot/vmlinuz-* | head -1)"
    initrd="$(ls "$1"/boot/initrd.img-* | head -1)"
}
