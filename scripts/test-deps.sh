#!/usr/bin/env bash
# Installs and starts everything the test suite needs on a fresh Debian machine, and checks
# it is reachable. Safe to run repeatedly: PostgreSQL on 127.0.0.1:5432 with trust auth for
# local connections and a database named `test`; OpenSSH's sshd binary (the tests start their
# own daemons on loopback ports; no system sshd is started or configured); Chromium and
# chromedriver for the web UI tests; the sushy-tools Redfish emulator in a virtualenv under
# ~/.cache/shepherd (SHEPHERD_SUSHY_VENV); OpenStack Ironic in a virtualenv under ~/.cache/shepherd
# (SHEPHERD_IRONIC_VENV); QEMU and the tools that build the VM tests' guest
# image, and the image itself (scripts/vm-image.sh, cached under ~/.cache/shepherd/vm);
# libvirt (virtlogd and libvirtd, started here and stopped by `test-deps.sh stop-libvirt` when
# this script started them), Shepherd's live image (scripts/live-image.sh) and a stock cloud
# image (scripts/cloud-image.sh).
set -euo pipefail

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

pg_ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }

ensure_postgres() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "test-deps: installing PostgreSQL"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  if ! pg_ready; then
    local version
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    echo "test-deps: starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 30); do pg_ready && break; sleep 1; done
  fi
  pg_ready || { echo "test-deps: PostgreSQL is not accepting connections on 127.0.0.1:5432" >&2; exit 1; }
  # The tests connect as postgres without a password over TCP (trust auth, as on the CI kind).
  if ! psql "postgres://postgres@127.0.0.1/postgres" -Atqc 'select 1' >/dev/null 2>&1; then
    echo "test-deps: cannot log in as postgres over TCP without a password; configure trust auth for 127.0.0.1" >&2
    exit 1
  fi
  if [ "$(psql "postgres://postgres@127.0.0.1/postgres" -Atqc "select count(*) from pg_database where datname = 'test'")" = "0" ]; then
    psql "postgres://postgres@127.0.0.1/postgres" -qc 'CREATE DATABASE test' >/dev/null
  fi
  # Test databases left behind by interrupted runs.
  psql "postgres://postgres@127.0.0.1/postgres" -Atqc \
    "select datname from pg_database where datname like 'shepherd\_t\_%'" | while read -r db; do
      [ -n "$db" ] && psql "postgres://postgres@127.0.0.1/postgres" -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null || true
    done
}

ensure_sshd() {
  if [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null 2>&1 || ! command -v scp >/dev/null 2>&1; then
    echo "test-deps: installing openssh-server and openssh-client"
    as_root apt-get update -qq
    # RUNLEVEL=1 keeps the package scripts from starting a system sshd on port 22.
    as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq openssh-server openssh-client >/dev/null
  fi
  # sshd refuses to start without its privilege separation directory.
  as_root mkdir -p /run/sshd
  /usr/sbin/sshd -V 2>&1 | head -n 1 | sed 's/^/test-deps: /' || true
}

ensure_chromium() {
  # The web UI tests drive Debian's Chromium headless through chromedriver (WebDriver).
  if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    echo "test-deps: installing chromium and chromium-driver"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  fi
  /usr/bin/chromium --version 2>/dev/null | head -n 1 | sed 's/^/test-deps: /' || true
}

ensure_promtool() {
  # The alert rules in deploy/ are checked with promtool, from Debian's prometheus package.
  # RUNLEVEL=1 keeps the package scripts from starting a Prometheus server.
  if ! command -v promtool >/dev/null 2>&1; then
    echo "test-deps: installing prometheus (for promtool)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  fi
  promtool --version 2>&1 | head -n 1 | sed 's/^/test-deps: /' || true
}

ensure_cloud_init() {
  # The config drive the agent adds to an installed OS is read back by cloud-init's own code
  # (Debian's package), as a stock cloud image's cloud-init reads it. It never runs on this
  # machine: /etc/cloud/cloud-init.disabled, written first, keeps it from running at boot.
  if [ ! -d /usr/lib/python3/dist-packages/cloudinit ]; then
    echo "test-deps: installing cloud-init (its code, for the tests; disabled on this machine)"
    as_root mkdir -p /etc/cloud
    as_root touch /etc/cloud/cloud-init.disabled
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq \
      --no-install-recommends cloud-init >/dev/null
  fi
  echo "test-deps: cloud-init $(dpkg-query -W -f '${Version}' cloud-init)"
}

ensure_patroni() {
  # The failover tests run a Patroni cluster of their own (three Postgres nodes, one etcd,
  # HAProxy in front), all on loopback ports they pick. Debian's packages; RUNLEVEL=1 keeps the
  # package scripts from starting an etcd or an HAProxy of their own, and the ones that start
  # anyway are stopped: the tests start every daemon themselves.
  if ! command -v patroni >/dev/null 2>&1 || ! command -v etcd >/dev/null 2>&1 \
    || ! command -v haproxy >/dev/null 2>&1; then
    echo "test-deps: installing patroni, etcd-server and haproxy"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq \
      patroni etcd-server haproxy >/dev/null
    as_root pkill -x etcd 2>/dev/null || true
    as_root pkill -x haproxy 2>/dev/null || true
  fi
  echo "test-deps: patroni $(patroni --version 2>&1 | awk '{print $2}'), $(etcd --version 2>&1 | head -n 1), $(haproxy -v 2>&1 | head -n 1 | awk '{print $1, $2, $3}')"
}

new_venv() {
  # A fresh virtualenv at $1 with the pip packages that follow (python3-venv installed first
  # where Debian's python3 lacks it).
  local venv="$1"
  shift
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q "$@"
}

ensure_sushy() {
  # The Redfish tests run the sushy-tools emulator from a virtualenv of our own: its fake
  # driver, and its libvirt driver for the bare-metal tests' VMs. The virtualenv is made from
  # Debian's Python with the system's packages visible, for Debian's python3-libvirt (the
  # Python first on PATH may be another, without it).
  local venv="${SHEPHERD_SUSHY_VENV:-$HOME/.cache/shepherd/sushy-venv}"
  if ! "$venv/bin/sushy-emulator" --help >/dev/null 2>&1 || ! "$venv/bin/python" -c 'import libvirt' >/dev/null 2>&1; then
    echo "test-deps: installing sushy-tools into $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q 'sushy-tools==2.2.0' bcrypt
  fi
  echo "test-deps: sushy-tools $("$venv/bin/pip" show sushy-tools 2>/dev/null | sed -n 's/^Version: //p')"
}

# Where ensure_libvirt notes that it started the daemons, so that `stop-libvirt` stops only
# what it started.
libvirt_mark=/run/shepherd-test-deps-libvirt

ensure_libvirt() {
  # The bare-metal tests boot VMs with blank disks through sushy-tools' libvirt driver, as
  # Ironic's and Metal3's CI do: Debian's libvirt run without systemd (virtlogd, libvirtd),
  # with the user its QEMU driver expects, a `default` storage pool (virtual media lands
  # there), and QEMU run as root so that it opens the disks in the tests' own scratch
  # directories. Guests run under TCG. Also xorriso, GRUB's EFI image and OVMF (the live
  # image's build, its UEFI boot).
  local missing=0 tool
  for tool in libvirtd virtlogd virsh xorriso grub-mkstandalone; do
    command -v "$tool" >/dev/null 2>&1 || missing=1
  done
  /usr/bin/python3 -c 'import libvirt' >/dev/null 2>&1 || missing=1
  [ -f /usr/lib/ISOLINUX/isohdpfx.bin ] && [ -f /usr/share/OVMF/OVMF_CODE_4M.fd ] || missing=1
  if [ "$missing" = 1 ]; then
    echo "test-deps: installing libvirt, python3-libvirt, xorriso, isolinux, GRUB's EFI image and OVMF"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq --no-install-recommends \
      libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients \
      python3-libvirt xorriso isolinux syslinux-common grub-efi-amd64-bin grub-common mtools \
      dosfstools ovmf >/dev/null
  fi
  # The QEMU driver's defaults name the user libvirt-qemu and the group libvirt-qemu (for
  # swtpm) even when qemu.conf runs QEMU as root; without them it does not start.
  getent group kvm >/dev/null || as_root groupadd -r kvm
  getent group libvirt-qemu >/dev/null || as_root groupadd -r libvirt-qemu
  id libvirt-qemu >/dev/null 2>&1 || as_root useradd -r -g kvm -d /var/lib/libvirt -s /usr/sbin/nologin libvirt-qemu
  as_root mkdir -p /var/log/libvirt /var/run/libvirt /var/lib/libvirt/images
  # Without its seccomp sandbox, which forbids QEMU to spawn processes: the guests reach
  # `shepherd server` and the tests' image servers through user-mode networking's guestfwd,
  # which spawns a socat per connection.
  local configured=0
  if ! grep -q '^user = "root"' /etc/libvirt/qemu.conf 2>/dev/null; then
    printf 'user = "root"\ngroup = "root"\n' | as_root tee -a /etc/libvirt/qemu.conf >/dev/null
    configured=1
  fi
  if ! grep -q '^seccomp_sandbox = 0' /etc/libvirt/qemu.conf 2>/dev/null; then
    printf 'seccomp_sandbox = 0\n' | as_root tee -a /etc/libvirt/qemu.conf >/dev/null
    configured=1
  fi
  if [ "$configured" = 1 ] && [ -f "$libvirt_mark" ]; then
    as_root pkill -x libvirtd 2>/dev/null || true
    for _ in $(seq 1 20); do pgrep -x libvirtd >/dev/null || break; sleep 0.5; done
  fi
  if ! virsh -c qemu:///system version >/dev/null 2>&1; then
    echo "test-deps: starting virtlogd and libvirtd"
    pgrep -x virtlogd >/dev/null || as_root virtlogd -d
    pgrep -x libvirtd >/dev/null || as_root libvirtd -d
    as_root touch "$libvirt_mark"
    for _ in $(seq 1 30); do virsh -c qemu:///system version >/dev/null 2>&1 && break; sleep 1; done
  fi
  virsh -c qemu:///system version >/dev/null 2>&1 || { echo "test-deps: libvirtd does not answer on qemu:///system" >&2; exit 1; }
  if ! virsh -c qemu:///system pool-info default >/dev/null 2>&1; then
    virsh -c qemu:///system pool-define-as default dir --target /var/lib/libvirt/images >/dev/null
  fi
  # A libvirtd that just started may still be bringing its pools up. A pool that still does
  # not start after 10 tries is defined anew (a definition left by an earlier libvirtd whose
  # state was lost), then given 20 more.
  local pool_runs=0 said="" try info
  for try in $(seq 1 30); do
    # Read whole before matching: under pipefail, `virsh … | grep -q` fails whenever grep
    # exits on its match while virsh still writes (SIGPIPE); on a busy machine it did so
    # every time, and a running pool was taken for one that does not start.
    info=$(virsh -c qemu:///system pool-info default 2>/dev/null || true)
    if grep -q '^State: *running' <<<"$info"; then
      pool_runs=1
      break
    fi
    if [ "$try" = 10 ]; then
      echo "test-deps: libvirt's storage pool default does not start ($said); defining it anew"
      virsh -c qemu:///system pool-destroy default >/dev/null 2>&1 || true
      virsh -c qemu:///system pool-undefine default >/dev/null 2>&1 || true
      as_root mkdir -p /var/lib/libvirt/images
      virsh -c qemu:///system pool-define-as default dir --target /var/lib/libvirt/images >/dev/null 2>&1 || true
    fi
    said=$(virsh -c qemu:///system pool-start default 2>&1) || sleep 1
    said=$(printf '%s' "$said" | tr '\n' ' ')
  done
  if [ "$pool_runs" != 1 ]; then
    echo "test-deps: libvirt's storage pool default does not run: $said" >&2
    virsh -c qemu:///system pool-list --all >&2 || true
    exit 1
  fi
  echo "test-deps: $(virsh -c qemu:///system version 2>/dev/null | sed -n 's/^Running hypervisor: //p'), libvirt $(virsh -c qemu:///system version 2>/dev/null | sed -n 's/^Using library: libvirt //p')"
}

stop_libvirt() {
  # Stops the daemons ensure_libvirt started, and nothing it found running.
  [ -f "$libvirt_mark" ] || return 0
  as_root pkill -x libvirtd 2>/dev/null || true
  as_root pkill -x virtlogd 2>/dev/null || true
  for _ in $(seq 1 20); do pgrep -x libvirtd >/dev/null || pgrep -x virtlogd >/dev/null || break; sleep 0.5; done
  as_root rm -f "$libvirt_mark"
  echo "test-deps: stopped libvirtd and virtlogd"
}

ensure_live_image() {
  # Shepherd's live image for bare machines, and the OS image its tests install
  # (scripts/live-image.sh, cached under ~/.cache/shepherd/live).
  as_root env HOME="$HOME" SHEPHERD_LIVE_DIR="${SHEPHERD_LIVE_DIR:-$HOME/.cache/shepherd/live}" \
    "$(dirname "$0")/live-image.sh" | sed 's/^/test-deps: /'
  # A stock cloud image with cloud-init and no key, for them to install too
  # (scripts/cloud-image.sh, cached under ~/.cache/shepherd/cloud).
  as_root env HOME="$HOME" SHEPHERD_CLOUD_DIR="${SHEPHERD_CLOUD_DIR:-$HOME/.cache/shepherd/cloud}" \
    "$(dirname "$0")/cloud-image.sh" | sed 's/^/test-deps: /'
}

ensure_packaging() {
  # What scripts/package.sh and scripts/package-check.sh use (dpkg-shlibdeps, strip, lintian,
  # mmdebstrap), then the clean Debian root the packages are tried on, the image's base layer
  # and the older build the upgrade check starts from (all cached under ~/.cache/shepherd).
  local tool missing=0
  for tool in dpkg-shlibdeps strip lintian mmdebstrap openssl curl python3 systemd-analyze unshare; do
    command -v "$tool" >/dev/null 2>&1 || missing=1
  done
  if [ "$missing" = 1 ]; then
    echo "test-deps: installing the packaging tools"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev binutils lintian \
      mmdebstrap openssl curl python3 systemd util-linux >/dev/null
  fi
  echo "test-deps: lintian $(lintian --print-version)"
  as_root env HOME="$HOME" "$(dirname "$0")/package-root.sh" | sed 's/^/test-deps: /'
  as_root env HOME="$HOME" "$(dirname "$0")/oci-base.sh" | sed 's/^/test-deps: /'
  # The build the upgrade check upgrades from (packaging/previous-release), built once.
  echo "test-deps: previous build $("$(dirname "$0")/previous-build.sh")"
}

ensure_ironic() {
  # The Ironic provider's tests run a real, standalone OpenStack Ironic (API and conductor in
  # one process, SQLite, no message queue) from a virtualenv of our own: PyPI's release is
  # pinned and current, and installs no system services, while Debian's ironic-api and
  # ironic-conductor (21.4, 2022) come with service units and database configuration prompts.
  # bcrypt hashes the http_basic users' passwords; psycopg2 lets an Ironic keep its database in
  # Postgres, as production Ironics do (the benchmark's, one test's).
  local venv="${SHEPHERD_IRONIC_VENV:-$HOME/.cache/shepherd/ironic-venv}"
  if ! "$venv/bin/ironic-dbsync" --version >/dev/null 2>&1 || [ ! -x "$venv/bin/ironic" ]; then
    echo "test-deps: installing OpenStack Ironic into $venv"
    new_venv "$venv" 'ironic==39.0.0' bcrypt 'psycopg2-binary==2.9.10'
  fi
  if ! "$venv/bin/python" -c 'import psycopg2' >/dev/null 2>&1; then
    "$venv/bin/pip" install -q 'psycopg2-binary==2.9.10'
  fi
  echo "test-deps: ironic $("$venv/bin/pip" show ironic 2>/dev/null | sed -n 's/^Version: //p')"
}

ensure_oidc_provider() {
  # The operator API's tests sign in against a real OpenID provider: panva's oidc-provider
  # (OpenID Certified) under Node, installed from npm into a directory of our own
  # (crates/shepherd/tests/it/common/oidc-idp.mjs runs it). Node from Debian if there is none.
  local dir="${SHEPHERD_OIDC_PROVIDER_DIR:-$HOME/.cache/shepherd/oidc-provider}"
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "test-deps: installing Node.js"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  fi
  if [ ! -f "$dir/node_modules/oidc-provider/package.json" ]; then
    echo "test-deps: installing oidc-provider into $dir"
    mkdir -p "$dir"
    (cd "$dir" && npm install --no-audit --no-fund --silent oidc-provider@9.13.3 >/dev/null)
  fi
  echo "test-deps: node $(node --version), oidc-provider $(sed -n 's/^  "version": "\(.*\)",$/\1/p' "$dir/node_modules/oidc-provider/package.json")"
}

ensure_vm() {
  # QEMU (TCG: this machine's nested KVM cannot run these guests) and the image tools, in one
  # apt command: qemu-system-x86 alone conflicts with a backported qemu-utils, so the
  # distribution's qemu-utils comes with it.
  local tool missing=0
  for tool in qemu-system-x86_64 mmdebstrap syslinux mcopy mkfs.vfat sfdisk socat mke2fs faketime; do
    command -v "$tool" >/dev/null 2>&1 || missing=1
  done
  [ -f /usr/lib/syslinux/mbr/mbr.bin ] || missing=1
  if [ "$missing" = 1 ]; then
    echo "test-deps: installing QEMU and the guest image tools"
    local release
    release=$(. /etc/os-release && echo "$VERSION_CODENAME")
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --allow-downgrades \
      qemu-system-x86 "qemu-utils/$release" mmdebstrap syslinux syslinux-common mtools \
      dosfstools fdisk socat e2fsprogs faketime >/dev/null
  fi
  qemu-system-x86_64 --version | head -n 1 | sed 's/^/test-deps: /'
  as_root env HOME="$HOME" SHEPHERD_VM_DIR="${SHEPHERD_VM_DIR:-$HOME/.cache/shepherd/vm}" \
    "$(dirname "$0")/vm-image.sh" | sed 's/^/test-deps: /'
}

# `test-deps.sh vm` sets up only what the VMs need (scripts/vm-fleet.sh); `vm bare` also what
# bare VMs need; `stop-libvirt` stops the daemons an earlier run started.
if [ "${1:-}" = vm ]; then
  ensure_vm
  if [ "${2:-}" = bare ]; then
    ensure_sushy
    ensure_libvirt
    ensure_live_image
  fi
  exit 0
fi
if [ "${1:-}" = stop-libvirt ]; then
  stop_libvirt
  exit 0
fi
ensure_postgres
ensure_sshd
ensure_chromium
ensure_promtool
ensure_cloud_init
ensure_patroni
ensure_sushy
ensure_ironic
ensure_oidc_provider
ensure_vm
ensure_libvirt
ensure_live_image
ensure_packaging
echo "test-deps: ready"
