# Sourced by the image builds (vm-image.sh, live-image.sh): what they share to build from
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
