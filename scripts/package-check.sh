#!/usr/bin/env bash
# Checks what scripts/package.sh made the way an operator meets it, on a clean Debian bookworm
# that has never seen the source (scripts/package-root.sh), in chroots on this machine:
#   1. the packages install with apt (every dependency there), `shepherd --version`, the man
#      pages, the bash/zsh/fish completions, `config print` of the packaged config, `bmdb
#      migrate` on the packaged SQLite path, and `shepherd server` as the shepherd user with
#      the packaged config answering; the units pass `systemd-analyze verify`;
#   2. `dpkg --purge` leaves nothing but the BMDB under /var/lib/shepherd and the files the
#      operator put in /etc/shepherd;
#   3. an upgrade from PREVIOUS (the packages of an older build, on an older schema) keeps a
#      fleet's database, its tokens and an edited conffile; `bmdb migrate` migrates the schema
#      once, then finds nothing to do;
#   4. the OCI image's root filesystem, unpacked from its layout, runs as its user (65532) what
#      its config says: the version, `config print`, a server on SQLite that answers, and its
#      health check.
# Each check prints `package-check: ok: …`; the first that fails ends the script with a
# message. Processes run in PID namespaces of their own (unshare), killed at the end.
#
# Usage: scripts/package-check.sh PREVIOUS_DIR CURRENT_DIR   (each holding package.sh's output)
# Needs root, unshare, openssl, curl, python3, systemd-analyze.
set -euo pipefail
previous=$(cd "$1" && pwd)
current=$(cd "$2" && pwd)
scripts=$(cd "$(dirname "$0")" && pwd)
"$scripts/package-root.sh"
root_tar="${SHEPHERD_PACKAGE_ROOT_DIR:-$HOME/.cache/shepherd/package-root}/root.tar"

work=$(mktemp -d /tmp/package-check.XXXXXX)
servers=()
# stop_server PID: stops a server that `serve` started, and waits for it. PID is the shell
# running `as_user`; its child is unshare, whose child is the server. The server itself is
# sent TERM: killing the shell alone left unshare and the server running after the check, and
# unshare's --kill-child does not reach a server that chroot --userspec started (a change of
# user clears the parent-death signal).
stop_server() {
  local shell="$1" unshare
  for unshare in $(pgrep -P "$shell" || true); do
    pkill -TERM -P "$unshare" 2>/dev/null || true
  done
  kill "$shell" 2>/dev/null || true
  wait "$shell" 2>/dev/null || true
}
cleanup() {
  local pid
  for pid in "${servers[@]}"; do stop_server "$pid"; done
  rm -rf "$work"
}
trap cleanup EXIT

ok() { echo "package-check: ok: $*"; }
fail() {
  echo "package-check: FAILED: $*" >&2
  exit 1
}
# must DESCRIPTION COMMAND...: runs COMMAND, failing the check with its output if it fails.
must() {
  local what="$1" out
  shift
  out=$("$@" 2>&1) || fail "$what: $* exited $?: $out"
  printf '%s' "$out"
}
# A fresh clean system at $1.
fresh_root() {
  mkdir -p "$1"
  tar -xf "$root_tar" -C "$1"
}
# in_root ROOT COMMAND...: as root in ROOT.
in_root() {
  local root="$1"
  shift
  chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"
}
# as_user ROOT UID:GID COMMAND...: as that user in ROOT, in a PID namespace of its own with
# its own /proc, with an environment of nothing but a PATH and what $user_env holds.
user_env=()
as_user() {
  local root="$1" ids="$2"
  shift 2
  env -i PATH=/usr/bin:/bin "${user_env[@]}" \
    /usr/bin/unshare --mount --pid --fork --kill-child --mount-proc="$root/proc" \
    /usr/sbin/chroot --userspec="$ids" --groups="${ids#*:}" "$root" "$@"
}
ids_of() { # ids_of ROOT NAME: uid:gid of NAME in ROOT
  awk -F: -v name="$2" '$1 == name { print $3 ":" $4 }' "$1/etc/passwd"
}
# tls ROOT DIR GROUP: a self-signed server certificate and key in ROOT/DIR, readable by GROUP.
tls() {
  mkdir -p "$1/$2"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
    -keyout "$1/$2/server.key" -out "$1/$2/server.pem" 2>/dev/null
  chown "0:$3" "$1/$2/server.key" "$1/$2/server.pem"
  chmod 0640 "$1/$2/server.key" "$1/$2/server.pem"
}
# serve LOG COMMAND...: starts COMMAND (a server) in the background with its output in LOG and
# waits until it prints its metrics address; sets $metrics to that URL.
serve() {
  local log="$1" i
  shift
  "$@" > "$log" 2>&1 &
  servers+=($!)
  for i in $(seq 1 300); do
    metrics=$(sed -n 's/.*metrics at \(http:[^ ]*\/metrics\).*/\1/p' "$log" | head -1)
    [ -n "$metrics" ] && return 0
    kill -0 "${servers[-1]}" 2>/dev/null || fail "the server exited: $(cat "$log")"
    sleep 0.1
  done
  fail "the server did not start within 30 s: $(cat "$log")"
}
# has_metrics URL: whether URL serves Prometheus metrics. The body is read whole first: `curl |
# grep -q` fails under pipefail when grep stops at its first match while curl still writes.
has_metrics() {
  local body
  body=$(curl -fsS --max-time 10 "$1") && grep -q '^# TYPE' <<< "$body"
}
debs() { ls "$1"/shepherd_*.deb "$1"/shepherd-agent_*.deb; }
install_debs() { # install_debs ROOT DIR [APT OPTIONS...]
  local root="$1" dir="$2"
  shift 2
  rm -rf "$root/tmp/debs"
  mkdir -p "$root/tmp/debs"
  cp $(debs "$dir") "$root/tmp/debs/"
  in_root "$root" sh -c "apt-get install -y -q --no-install-recommends $* /tmp/debs/*.deb 2>&1"
}
# Every path in ROOT, sorted, but the package system's bookkeeping, the run-time directories
# and /root (where the completion checks' shells keep their caches).
listing() {
  (cd "$1" && find . -path ./proc -prune -o -path ./tmp -prune -o -print) |
    grep -Ev '^\./(var/(cache|log|lib/dpkg|lib/apt)|run|root)(/|$)' | LC_ALL=C sort
}

# 1. A fresh install.
started=$(date +%s.%N)
root="$work/fresh"
fresh_root "$root"
before=$(listing "$root")
out=$(install_debs "$root" "$current") || fail "apt could not install the packages: $out"
version=$(in_root "$root" dpkg-query -W -f '${Version}' shepherd)
ok "apt installed shepherd and shepherd-agent $version with their dependencies"
user=$(ids_of "$root" shepherd)
[ -n "$user" ] || fail "the package made no shepherd user"
said=$(must "version" in_root "$root" shepherd --version)
grep -q "bmdb schema:" <<< "$said" || fail "shepherd --version names no BMDB schema: $said"
ok "shepherd --version: $(head -1 <<< "$said")"
for page in shepherd shepherd-server shepherd-run shepherd-bmdb-migrate shepherd-agent; do
  must "man page" in_root "$root" man -w "$page" > /dev/null
done
ok "man pages for shepherd, its commands and shepherd-agent"
must "bash completion" in_root "$root" bash -c \
  '. /usr/share/bash-completion/completions/shepherd && complete -p shepherd' > /dev/null
must "zsh completion" in_root "$root" zsh -c \
  'autoload -Uz compinit && compinit -u && whence -w _shepherd && [ "$_comps[shepherd]" = _shepherd ]' > /dev/null
said=$(must "fish completion" in_root "$root" fish -c 'complete -C "shepherd mach"')
grep -q '^machines' <<< "$said" || fail "fish completes no machines: $said"
ok "completions load in bash, zsh and fish"
said=$(must "config print" in_root "$root" shepherd config print server --config /etc/shepherd/server.toml)
grep -q 'sqlite:/var/lib/shepherd/bmdb.sqlite' <<< "$said" || fail "config print: $said"
ok "config print reads the packaged /etc/shepherd/server.toml"
for unit in shepherd-server shepherd-run; do
  must "systemd-analyze verify" systemd-analyze verify --man=no --root="$root" \
    "$unit.service" > /dev/null
done
ok "systemd-analyze verify passes both units"
said=$(must "bmdb migrate" as_user "$root" "$user" \
  shepherd bmdb migrate --database sqlite:/var/lib/shepherd/bmdb.sqlite)
grep -q "migrated schema from version 0" <<< "$said" || fail "bmdb migrate: $said"
ok "bmdb migrate as the shepherd user: $(head -1 <<< "$said")"
tls "$root" etc/shepherd/tls "${user#*:}"
serve "$work/server.log" as_user "$root" "$user" shepherd server --config /etc/shepherd/server.toml \
  --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 --api-listen 127.0.0.1:0
has_metrics "$metrics" || fail "no metrics at $metrics"
must "the server's tasks" as_user "$root" "$user" shepherd tasks --at "${metrics%/metrics}" > /dev/null
answered=$(date +%s.%N)
ok "shepherd server as user shepherd with the packaged config answers at $metrics"
echo "package-check: figure: clean_root_to_server_answering_s = $(awk "BEGIN { printf \"%.1f\", $answered - $started }")"
stop_server "${servers[-1]}"

# 2. Purge.
must "purge" in_root "$root" dpkg --purge shepherd shepherd-agent > /dev/null
left=$(LC_ALL=C comm -13 <(echo "$before") <(listing "$root") |
  grep -Ev '^\./var/lib/shepherd(/|$)|^\./etc/shepherd(/tls(/server\.(pem|key))?)?$|^\./etc/(passwd|group|shadow|gshadow)-$' || true)
[ -z "$left" ] || fail "dpkg --purge left files behind: $left"
[ -f "$root/var/lib/shepherd/bmdb.sqlite" ] || fail "dpkg --purge removed the BMDB"
ok "dpkg --purge leaves only the BMDB and the operator's TLS files"

# 3. An upgrade keeps a fleet's data.
root="$work/upgrade"
fresh_root "$root"
out=$(install_debs "$root" "$previous") || fail "apt could not install the previous packages: $out"
old=$(in_root "$root" dpkg-query -W -f '${Version}' shepherd)
user=$(ids_of "$root" shepherd)
db=sqlite:/var/lib/shepherd/bmdb.sqlite
must "migrate" as_user "$root" "$user" shepherd bmdb migrate --database "$db" > /dev/null
serve "$work/run.log" as_user "$root" "$user" shepherd run --provider sim --sim-machines 10 \
  --sim-takeover-time 50ms --agent-endpoint 127.0.0.1:4443 --database "$db" \
  --provisioner-reconcile-rate 200ms,1 --provisioner-creation-rate 1ms,100 \
  --metrics-listen 127.0.0.1:0
for i in $(seq 1 300); do
  count=$(as_user "$root" "$user" shepherd machines list --json --database "$db" 2>/dev/null |
    grep -o '"machine_id"' | wc -l)
  [ "$count" -ge 10 ] && break
  [ "$i" = 300 ] && fail "the simulated fleet did not reach 10 machines in 60 s: $count"
  sleep 0.2
done
stop_server "${servers[-1]}"
must "token" as_user "$root" "$user" shepherd tokens create --name upgrade-check --role viewer \
  --expires 1d --database "$db" > /dev/null
# What a machine is (not its state, which moves with the clock), sorted.
identities() {
  must "machines list" as_user "$root" "$user" shepherd machines list --json --database "$db" |
    grep -E '"(machine_id|provider|provider_id|address)"' | LC_ALL=C sort
}
machines=$(identities)
tokens=$(must "tokens list" as_user "$root" "$user" shepherd tokens list --database "$db")
[ "$(grep -c '"machine_id"' <<< "$machines")" -ge 10 ] || fail "no fleet to upgrade: $machines"
echo "# kept across upgrades" >> "$root/etc/shepherd/server.toml"
said=$(install_debs "$root" "$current" -o Dpkg::Options::=--force-confold) ||
  fail "apt could not upgrade: $said"
new=$(in_root "$root" dpkg-query -W -f '${Version}' shepherd)
[ "$new" = "$version" ] || fail "the upgrade installed $new, not $version"
grep -q "upgraded from $old" <<< "$said" || fail "the upgrade did not say what to run: $said"
grep -q "kept across upgrades" "$root/etc/shepherd/server.toml" || fail "the upgrade lost an edited conffile"
# The previous build is on an older schema: the new binary migrates the fleet's database once.
said=$(must "migrate" as_user "$root" "$user" shepherd bmdb migrate --database "$db")
migrated=$(sed -n 's/.*: migrated schema \(from version [0-9]* to [0-9]*\)$/\1/p' <<< "$said")
[ -n "$migrated" ] || fail "bmdb migrate after the upgrade migrated nothing: $said"
said=$(must "migrate" as_user "$root" "$user" shepherd bmdb migrate --database "$db")
grep -q "schema is up to date" <<< "$said" || fail "bmdb migrate a second time: $said"
[ "$(identities)" = "$machines" ] ||
  fail "the machines differ after the upgrade"
[ "$(must "tokens list" as_user "$root" "$user" shepherd tokens list --database "$db")" = "$tokens" ] ||
  fail "the tokens differ after the upgrade"
ok "an upgrade from $old migrates the schema $migrated and keeps the fleet (10 machines), its tokens and an edited conffile"

# 4. The image, unpacked as a runtime would from its layout, run as its config says.
image="$current/shepherd-image"
img="$work/image"
mkdir -p "$img"
python3 - "$image" > "$work/image.env" <<'PY'
import json, shlex, sys
layout = sys.argv[1]
def blob(digest):
    return f"{layout}/blobs/sha256/{digest.split(':', 1)[1]}"
index = json.load(open(f"{layout}/index.json"))
manifest = json.load(open(blob(index["manifests"][0]["digest"])))
config = json.load(open(blob(manifest["config"]["digest"])))["config"]
print("layers=(" + " ".join(shlex.quote(blob(l["digest"])) for l in manifest["layers"]) + ")")
print("entry=(" + " ".join(shlex.quote(a) for a in config["Entrypoint"] + config["Cmd"]) + ")")
print("envs=(" + " ".join(shlex.quote(e) for e in config["Env"]) + ")")
print("image_user=" + shlex.quote(config["User"]))
print("health=(" + " ".join(shlex.quote(a) for a in config["Healthcheck"]["Test"][1:]) + ")")
PY
. "$work/image.env"
for layer in "${layers[@]}"; do
  tar -xzf "$layer" -C "$img" --same-owner --numeric-owner
done
ok "the image unpacked: ${#layers[@]} layers, $(du -sk "$img" | cut -f1) KiB, user $image_user"
user_env=("${envs[@]}")
said=$(must "image version" as_user "$img" "$image_user" "${entry[0]}" --version)
grep -q "bmdb schema:" <<< "$said" || fail "the image's shepherd --version: $said"
said=$(must "image config" as_user "$img" "$image_user" "${entry[0]}" config print server \
  --config /etc/shepherd/server.toml)
grep -q 'http-listen.*127.0.0.1:9465' <<< "$said" || fail "the image's config print: $said"
ok "the image's shepherd runs as $image_user: version, config print"
tls "$img" etc/shepherd/tls "${image_user#*:}"
# Its own command, with the listeners moved to free ports by the environment.
user_env=("${envs[@]}" SHEPHERD_SERVER_LISTEN=127.0.0.1:0 SHEPHERD_HTTP_LISTEN=127.0.0.1:0)
serve "$work/image.log" as_user "$img" "$image_user" "${entry[@]}"
user_env=("${envs[@]}")
has_metrics "$metrics" || fail "the image's server: no metrics at $metrics"
[ "$(stat -c %u "$img/var/lib/shepherd/bmdb.sqlite")" = "${image_user%:*}" ] ||
  fail "the image's BMDB is not owned by its user"
# The health check as the config gives it, at the address this run listens on.
check=("${health[@]}")
for i in "${!check[@]}"; do
  [ "${check[$i]}" = --at ] && check[$((i + 1))]="${metrics%/metrics}"
done
must "health check" as_user "$img" "$image_user" "${check[@]}" > /dev/null
ok "the image's server answers on SQLite at $metrics and passes its health check"
