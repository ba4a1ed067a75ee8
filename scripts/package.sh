#!/usr/bin/env bash
# Builds what operators install, into target/packages (or $SHEPHERD_PACKAGE_DIR):
#   shepherd_VERSION_amd64.deb        the CLI and its services: `shepherd server`, `shepherd run`
#   shepherd-agent_VERSION_amd64.deb  the agent, for the managed machines (and for `run` to upload)
#   shepherd-image/                   an OCI image layout of the server and loops (non-root)
#   shepherd-image.tar                the same layout as one file (`skopeo copy oci-archive:…`)
#
# The packages are made with dpkg's own tools (dpkg-shlibdeps for the dependencies, dpkg-deb
# with root:root ownership), no daemon and no debhelper: the tree is small and written out here
# once. The image is written as an OCI layout directly: a base layer of Debian bookworm's libc
# (scripts/oci-base.sh) and a layer of Shepherd's files, both tars with fixed times and owners.
#
# Usage: scripts/package.sh [--profile PROFILE] [--no-build] [--no-image]
#   --profile  the cargo profile packaged (default release; CI packages the `dev` build it has
#              already made: a release build would add about 10 minutes on 2 cores)
#   --no-build package the binaries there are (the tests: built alone, the binaries would get
#              other features of their dependencies than the workspace build gave them)
#   --no-image the packages only
# SHEPHERD_DEB_VERSION overrides the version; SHEPHERD_VERSION_COMMIT versions the packages
# by another commit than HEAD (the upgrade test's older build, scripts/previous-build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

profile=release
build=1
image=1
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --no-image) image=0; shift ;;
    *) echo "package.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
target="${CARGO_TARGET_DIR:-target}"
case "$profile" in
  dev) bin_dir="$target/debug" ;;
  *) bin_dir="$target/$profile" ;;
esac
out="${SHEPHERD_PACKAGE_DIR:-$root/target/packages}"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$build" = 1 ]; then
  cargo build --quiet --profile "$profile" -p shepherd -p shepherd-agent
fi
# The commit whose binaries these are: HEAD, or $SHEPHERD_VERSION_COMMIT (the upgrade test's
# earlier build, scripts/previous-build.sh).
commit="${SHEPHERD_VERSION_COMMIT:-HEAD}"
crate_version=$(git show "$commit:Cargo.toml" 2>/dev/null | sed -n 's/^version = "\(.*\)"$/\1/p' | head -1)
[ -n "$crate_version" ] || crate_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
# The Debian version orders builds of main by their commit's time, so that a newer build
# upgrades an older one: 0.1.0+git20261129.195601.77b318220de3.
if [ -n "${SHEPHERD_DEB_VERSION:-}" ]; then
  version="$SHEPHERD_DEB_VERSION"
elif stamp=$(TZ=UTC git log -1 --format=%cd.%h --abbrev=12 --date=format-local:%Y%m%d.%H%M%S "$commit" 2>/dev/null); then
  version="$crate_version+git$stamp"
else
  version="$crate_version"
fi
# Every file gets the commit's time, so that two builds of one commit are the same bytes.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct "$commit" 2>/dev/null || date +%s)}"
arch=$(dpkg --print-architecture)

# install_file MODE SOURCE DEST: SOURCE at DEST (created with its parents).
install_file() {
  install -D -m "$1" "$2" "$3"
}

# doc_files PACKAGE TREE: the copyright file and the changelog policy asks of every package.
doc_files() {
  local doc="$2/usr/share/doc/$1"
  mkdir -p "$doc"
  cat > "$doc/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: shepherd
Source: https://example.invalid/shepherd

Files: *
Copyright: 2026 The Shepherd authors
License: Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF
  # The changelog: what the release changes for operators (packaging/CHANGELOG.md), in
  # Debian's format under this build's version (a native package's `changelog.gz`).
  {
    echo "$1 ($version) unstable; urgency=medium"
    sed -n '/^## /,$p' packaging/CHANGELOG.md | sed '1d; /^## /,$d' | sed 's/^- /  * /; s/^  \([^ *]\)/    \1/'
    echo
    echo " -- Shepherd maintainers <shepherd@example.invalid>  $(date -u -R -d "@$SOURCE_DATE_EPOCH")"
  } | gzip -9n > "$doc/changelog.gz"
}

# build_deb PACKAGE TREE DESCRIPTION: DEBIAN/control (with dependencies from dpkg-shlibdeps
# over the ELF files in TREE), md5sums and conffiles, then the .deb.
build_deb() {
  local name="$1" tree="$2" description="$3" depends elves
  mkdir -p "$tree/DEBIAN" "$work/shlibs/debian"
  elves=$(find "$tree" -type f -perm -u+x -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print)
  printf 'Source: shepherd\n\nPackage: %s\nArchitecture: any\n' "$name" > "$work/shlibs/debian/control"
  # shellcheck disable=SC2086
  depends=$(cd "$work/shlibs" && dpkg-shlibdeps -O $elves 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
  {
    echo "Package: $name"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: Shepherd maintainers <shepherd@example.invalid>"
    echo "Installed-Size: $(du -sk --exclude=DEBIAN "$tree" | cut -f1)"
    echo "Depends: $depends${4:+, $4}"
    [ -z "${5:-}" ] || echo "Recommends: $5"
    echo "Section: admin"
    echo "Priority: optional"
    echo "Homepage: https://example.invalid/shepherd"
    echo "Description: $description"
    cat "$work/$name.description"
  } > "$tree/DEBIAN/control"
  (cd "$tree" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort |
    xargs md5sum > DEBIAN/md5sums)
  if [ -d "$tree/etc" ]; then
    (cd "$tree" && find etc -type f -printf '/%p\n' | LC_ALL=C sort > DEBIAN/conffiles)
  fi
  find "$tree" -exec touch --no-dereference -d "@$SOURCE_DATE_EPOCH" {} +
  dpkg-deb --root-owner-group -Zxz --build "$tree" "$out/${name}_${version}_${arch}.deb" >/dev/null
  echo "package.sh: $out/${name}_${version}_${arch}.deb ($(du -k "$out/${name}_${version}_${arch}.deb" | cut -f1) KiB)"
}

rm -f "$out"/*.deb

# The CLI and its services.
tree="$work/shepherd"
install_file 0755 "$bin_dir/shepherd" "$tree/usr/bin/shepherd"
strip --strip-unneeded "$tree/usr/bin/shepherd"
# The manual pages and completions come from the binary's own CLI definition; a build older
# than `shepherd dist` (the upgrade test's previous version) takes them from $SHEPHERD_DIST_BIN.
"${SHEPHERD_DIST_BIN:-$tree/usr/bin/shepherd}" dist "$work/dist"
for page in "$work"/dist/man/*.1; do
  install_file 0644 "$page" "$tree/usr/share/man/man1/${page##*/}"
  gzip -9n "$tree/usr/share/man/man1/${page##*/}"
done
install_file 0644 "$work/dist/completions/shepherd.bash" "$tree/usr/share/bash-completion/completions/shepherd"
install_file 0644 "$work/dist/completions/_shepherd" "$tree/usr/share/zsh/vendor-completions/_shepherd"
install_file 0644 "$work/dist/completions/shepherd.fish" "$tree/usr/share/fish/vendor_completions.d/shepherd.fish"
for unit in shepherd-server shepherd-run; do
  install_file 0644 "deploy/systemd/$unit.service" "$tree/lib/systemd/system/$unit.service"
done
for file in server.toml run.toml inventory.json; do
  install_file 0644 "deploy/single-site-sqlite/$file" "$tree/etc/shepherd/$file"
done
doc_files shepherd "$tree"
for script in postinst prerm postrm; do
  install_file 0755 "packaging/shepherd.$script" "$tree/DEBIAN/$script"
done
cat > "$work/shepherd.description" <<'EOF'
 Shepherd keeps a Bare Metal Database of machines and runs control loops over
 it: it brings new servers in (from a static inventory with Redfish BMCs,
 OpenStack Ironic, or a bare-metal cloud), starts its agent on them over SSH,
 installs their OS, and recovers machines whose agent went silent.
 .
 This package holds the shepherd command and its two services,
 shepherd-server (the agents' gRPC/TLS server, web UI and operator API) and
 shepherd-run (the control loops). Neither is enabled: configure
 /etc/shepherd first, then enable them.
EOF
build_deb shepherd "$tree" "bare-metal fleet lifecycle manager" "adduser" "shepherd-agent"

# The agent.
tree="$work/shepherd-agent"
install_file 0755 "$bin_dir/shepherd-agent" "$tree/usr/bin/shepherd-agent"
strip --strip-unneeded "$tree/usr/bin/shepherd-agent"
install_file 0644 packaging/shepherd-agent.1 "$tree/usr/share/man/man1/shepherd-agent.1"
gzip -9n "$tree/usr/share/man/man1/shepherd-agent.1"
doc_files shepherd-agent "$tree"
cat > "$work/shepherd-agent.description" <<'EOF'
 The agent Shepherd runs on each machine it manages: it heartbeats to the
 Shepherd server over TLS with its own ed25519 key, reports the machine's
 hardware, and installs an OS image when asked.
 .
 Shepherd uploads and starts it over SSH; on the Shepherd host, this package
 gives `shepherd run` the binary to upload (/usr/bin/shepherd-agent).
EOF
build_deb shepherd-agent "$tree" "agent of the Shepherd bare-metal fleet manager" "" ""

if [ "$image" = 0 ]; then
  exit 0
fi

# The OCI image: Debian's libc, then Shepherd's own layer, owned by root but for its state
# directory, which belongs to the user it runs as (65532, as distroless images do).
base_dir="${SHEPHERD_OCI_BASE_DIR:-$HOME/.cache/shepherd/oci-base}"
SHEPHERD_OCI_BASE_DIR="$base_dir" scripts/oci-base.sh
layer="$work/layer"
install_file 0755 "$work/shepherd/usr/bin/shepherd" "$layer/usr/bin/shepherd"
install_file 0644 packaging/image-server.toml "$layer/etc/shepherd/server.toml"
# The mount points a runtime (or the image test) mounts over.
mkdir -p "$layer/var/lib/shepherd" "$layer/tmp" "$layer/proc" "$layer/sys" "$layer/dev" "$layer/run"
chmod 1777 "$layer/tmp"
chmod 0750 "$layer/var/lib/shepherd"
printf 'root:x:0:0:root:/root:/sbin/nologin\nshepherd:x:65532:65532:shepherd:/var/lib/shepherd:/sbin/nologin\n' \
  > "$layer/etc/passwd"
printf 'root:x:0:\nshepherd:x:65532:\n' > "$layer/etc/group"
tar_of() {
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --numeric-owner --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime "$@"
}
tar_of --owner=0 --group=0 -C "$layer" --exclude=./var/lib/shepherd -cf "$work/app.tar" .
tar_of --owner=65532 --group=65532 -C "$layer" -rf "$work/app.tar" ./var/lib/shepherd
python3 packaging/oci_layout.py "$out/shepherd-image" "$version" "$SOURCE_DATE_EPOCH" \
  "$base_dir/base.tar" "$work/app.tar"
rm -f "$out/shepherd-image.tar"
tar_of --owner=0 --group=0 -C "$out/shepherd-image" -cf "$out/shepherd-image.tar" .
echo "package.sh: $out/shepherd-image ($(du -k "$out/shepherd-image.tar" | cut -f1) KiB as one file)"
