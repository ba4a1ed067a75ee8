#!/usr/bin/env bash
# Brings up N local QEMU VMs (default 3) from the Debian guest image and a Shepherd managing
# them: `shepherd server` (agents heartbeat to it over TLS) and `shepherd run` with a static
# inventory of the VMs (takeover over SSH). Prints the web UI address; Ctrl-C tears it all down.
# The VMs reach nothing but their forwarded sshd and the server (user-mode networking with
# restrict=on). Each VM takes about a minute to boot under QEMU's emulation (TCG).
#
#   ./scripts/vm-fleet.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-3}"
[[ "$n" =~ ^[1-9][0-9]?$ ]] || { echo "usage: $0 [N], N from 1 to 99" >&2; exit 2; }

./scripts/test-deps.sh vm
cargo build --release --quiet -p shepherd -p shepherd-agent
bin=target/release
vm_dir="${SHEPHERD_VM_DIR:-$HOME/.cache/shepherd/vm}"
work="$(mktemp -d /tmp/shepherd-vm-fleet.XXXXXX)"
pids=()
cleanup() {
    trap - EXIT
    echo "vm-fleet: tearing down"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
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

install -m 400 "$vm_dir/id_ed25519" "$work/id_ed25519"
server_port="$(free_port)"
http_port="${SHEPHERD_HTTP_PORT:-9465}"
db="sqlite:$work/bmdb.sqlite"

"$bin/shepherd" server --database "$db" --migrate --listen "127.0.0.1:$server_port" \
    --dev-certs "$work/certs" --dev-cert-names 10.0.2.100 \
    --http-listen "127.0.0.1:$http_port" >"$work/server.out" 2>"$work/server.log" &
pids+=($!)

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
