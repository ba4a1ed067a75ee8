#!/usr/bin/env bash
# Brings up N local QEMU VMs (default 3) from the Debian guest image and a Shepherd managing
# them: `shepherd server` (agents heartbeat to it over TLS) and `shepherd run` with a static
# inventory of the VMs (takeover over SSH). Prints the web UI address; Ctrl-C tears it all down.
# The VMs reach nothing but their forwarded sshd and the server (user-mode networking with
# restrict=on). Each VM takes about a minute to boot under QEMU's emulation (TCG).
#
# With --bare, the N VMs are libvirt domains with nothing but blank disks and a Redfish BMC
# (sushy-tools' libvirt driver): watch Shepherd boot each from its BMC's virtual media into
# its live environment (scripts/live-image.sh), install an OS onto its disk, eject the media
# and boot the installed OS, which then heartbeats. Each takes a few minutes under TCG.
#
#   ./scripts/vm-fleet.sh [--bare] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
bare=0
if [ "${1:-}" = --bare ]; then
  bare=1
  shift
fi
n="${1:-3}"
[[ "$n" =~ ^[1-9][0-9]?$ ]] || { echo "usage: $0 [--bare] [N], N from 1 to 99" >&2; exit 2; }

if [ "$bare" = 1 ]; then
  ./scripts/test-deps.sh vm bare
else
  ./scripts/test-deps.sh vm
fi
cargo build --release --quiet -p shepherd -p shepherd-agent
bin=target/release
vm_dir="${SHEPHERD_VM_DIR:-$HOME/.cache/shepherd/vm}"
work="$(mktemp -d /tmp/shepherd-vm-fleet.XXXXXX)"
pids=()
domains=()
cleanup() {
    trap - EXIT
    echo "vm-fleet: tearing down"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    local d uuid vol
    for d in "${domains[@]}"; do
        uuid="$(virsh -c qemu:///system domuuid "$d" 2>/dev/null || true)"
        virsh -c qemu:///system destroy "$d" >/dev/null 2>&1 || true
        virsh -c qemu:///system undefine "$d" >/dev/null 2>&1 || true
        for vol in $(virsh -c qemu:///system vol-list default 2>/dev/null | awk -v u="$uuid" 'NR > 2 && u != "" && index($1, u) {print $1}'); do
            virsh -c qemu:///system vol-delete --pool default "$vol" >/dev/null 2>&1 || true
        done
    done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A loopback port nothing listens on.
free_port() {
    local port
    while :; do
        port=$((20000 + RANDOM % 20000))
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || { echo "$port"; return; }
    done
}

# The bare fleet: libvirt domains with blank disks behind sushy-tools, the live image served
# by `shepherd run`, and the OS image the tests install served to the guests.
bare_fleet() {
    local live_dir="${SHEPHERD_LIVE_DIR:-$HOME/.cache/shepherd/live}" uuids=() entries=() i
    install -m 400 "$live_dir/test_id_ed25519" "$work/live_id_ed25519"
    local images_port sushy_port media_port
    images_port="$(free_port)"; sushy_port="$(free_port)"; media_port="$(free_port)"
    mkdir -p "$work/images"
    ln -s "$live_dir/target.img" "$work/images/target.img"
    (cd "$work/images" && exec python3 -m http.server "$images_port" --bind 127.0.0.1) \
        >"$work/images.log" 2>&1 &
    pids+=($!)
    for i in $(seq 1 "$n"); do
        local name="shepherd-fleet-$$-$i" uuid ssh_port
        uuid="$(cat /proc/sys/kernel/random/uuid)"
        ssh_port="$(free_port)"
        truncate -s 256M "$work/$name.img"
        sed -e "s|@NAME@|$name|; s|@UUID@|$uuid|; s|@MEMORY_MIB@|512|; s|@DISK@|$work/$name.img|; s|@DISK_SERIAL@|$name|; s|@MORE_DISKS@||; s|@LOADER@||; s|@FEATURES@||" \
            -e "s|@SERIAL@|$work/$name.serial|g; s|@MAC@|52:54:00:5e:02:$(printf %02x "$i")|" \
            -e "s|@NETDEV@|user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:$ssh_port-:22,guestfwd=tcp:10.0.2.100:4443-cmd:socat STDIO TCP:127.0.0.1:$server_port,guestfwd=tcp:10.0.2.101:80-cmd:socat STDIO TCP:127.0.0.1:$images_port|" \
            scripts/bare-domain.xml >"$work/$name.xml"
        virsh -c qemu:///system define "$work/$name.xml" >/dev/null
        domains+=("$name")
        uuids+=("'$uuid'")
        entries+=("{\"ID\": \"$name\", \"Addr\": \"127.0.0.1:$ssh_port\", \"Location\": \"libvirt\", \"BMC\": {\"URL\": \"http://127.0.0.1:$sushy_port\", \"System\": \"/redfish/v1/Systems/$uuid\", \"Username\": \"admin\", \"PasswordFile\": \"$work/bmc-password\"}, \"Bare\": {\"ImageURL\": \"http://10.0.2.101/target.img\", \"ImageSHA256\": \"$(cat "$live_dir/target.img.sha256")\", \"Disk\": \"/dev/vda\"}}")
        echo "vm-fleet: $name defined, powered off, its disk blank (console log $work/$name.serial)"
    done
    echo x >"$work/bmc-password"
    (IFS=,; printf "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\nSUSHY_EMULATOR_LISTEN_PORT = %s\nSUSHY_EMULATOR_LIBVIRT_URI = 'qemu:///system'\nSUSHY_EMULATOR_ALLOWED_INSTANCES = [%s]\nSUSHY_EMULATOR_STATE_DIR = '%s'\n" \
        "$sushy_port" "${uuids[*]}" "$work/sushy-state") >"$work/sushy.conf"
    "${SHEPHERD_SUSHY_VENV:-$HOME/.cache/shepherd/sushy-venv}/bin/sushy-emulator" --config "$work/sushy.conf" \
        >/dev/null 2>"$work/sushy.log" &
    pids+=($!)
    (IFS=,; echo "[${entries[*]}]") >"$work/inventory.json"
    "$bin/shepherd" run --provider static --database "$db" \
        --static-inventory "file://$work/inventory.json" \
        --agent-executable "$bin/shepherd-agent" --agent-endpoint 10.0.2.100:4443 \
        --agent-ca "$work/certs/ca.pem" --ssh-key "$work/live_id_ed25519" --ssh-user root \
        --ssh-connect-timeout 10s --initializer-parallelism "$n" --metrics-listen 127.0.0.1:0 \
        --bare-live-image "$live_dir/live.iso" --bare-media-listen "127.0.0.1:$media_port" \
        --bare-media-url "https://127.0.0.1:$media_port" \
        --bare-media-cert "$work/certs/server.pem" --bare-media-key "$work/certs/server.key" \
        --bare-boot-wait 15s --bare-agent-env SHEPHERD_AGENT_HEARTBEAT_INTERVAL=5s \
        >"$work/run.out" 2>"$work/run.log" &
    pids+=($!)
    echo "vm-fleet: web UI at http://127.0.0.1:$http_port/machines (logs in $work); each machine's page shows its bare-metal steps; Ctrl-C stops everything"
    wait -n "${pids[@]}" || true
    echo "vm-fleet: a process exited; see $work/*.log" >&2
}

install -m 400 "$vm_dir/id_ed25519" "$work/id_ed25519"
server_port="$(free_port)"
http_port="${SHEPHERD_HTTP_PORT:-9465}"
db="sqlite:$work/bmdb.sqlite"

"$bin/shepherd" server --database "$db" --migrate --listen "127.0.0.1:$server_port" \
    --dev-certs "$work/certs" --dev-cert-names 10.0.2.100,127.0.0.1 \
    --http-listen "127.0.0.1:$http_port" >"$work/server.out" 2>"$work/server.log" &
pids+=($!)

if [ "$bare" = 1 ]; then
  bare_fleet
  exit
fi

entries=()
for i in $(seq 1 "$n"); do
    ssh_port="$(free_port)"
    qemu-system-x86_64 -machine q35 -accel tcg,tb-size=128 -cpu qemu64 -smp 1 -m 256 \
        -display none -monitor none -serial "file:$work/vm$i.serial" \
        -drive "file=$vm_dir/guest.img,format=raw,if=virtio,snapshot=on" \
        -netdev "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:$ssh_port-:22,guestfwd=tcp:10.0.2.100:4443-cmd:socat STDIO TCP:127.0.0.1:$server_port" \
        -device "virtio-net-pci,netdev=n0,mac=52:54:00:5e:01:$(printf %02x "$i")" \
        </dev/null >/dev/null 2>"$work/vm$i.log" &
    pids+=($!)
    entries+=("{\"ID\": \"vm$i\", \"Addr\": \"127.0.0.1:$ssh_port\", \"Location\": \"local-qemu\"}")
    echo "vm-fleet: vm$i booting (ssh on 127.0.0.1:$ssh_port, console log $work/vm$i.serial)"
done
(IFS=,; echo "[${entries[*]}]") >"$work/inventory.json"

# Start the loops once every VM's sshd greets (a failed first SSH attempt waits out a backoff).
deadline=$((SECONDS + 300))
for i in $(seq 1 "$n"); do
    port="$(sed -n "s/.*\"vm$i\", \"Addr\": \"127.0.0.1:\([0-9]*\)\".*/\1/p" "$work/inventory.json")"
    until timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port; head -c4 <&3" 2>/dev/null | grep -q SSH-; do
        ((SECONDS < deadline)) || { echo "vm-fleet: vm$i did not answer SSH; see $work/vm$i.serial" >&2; exit 1; }
        sleep 2
    done
    echo "vm-fleet: vm$i is up"
done

"$bin/shepherd" run --provider static --database "$db" \
    --static-inventory "file://$work/inventory.json" \
    --agent-executable "$bin/shepherd-agent" --agent-endpoint 10.0.2.100:4443 \
    --agent-ca "$work/certs/ca.pem" --ssh-key "$work/id_ed25519" --ssh-user root \
    --initializer-parallelism "$n" --metrics-listen 127.0.0.1:0 \
    >"$work/run.out" 2>"$work/run.log" &
pids+=($!)

echo "vm-fleet: web UI at http://127.0.0.1:$http_port/machines (logs in $work); Ctrl-C stops everything"
wait -n "${pids[@]}" || true
echo "vm-fleet: a process exited; see $work/*.log" >&2
