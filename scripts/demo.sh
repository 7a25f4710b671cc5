#!/usr/bin/env bash
# The demo: boot a guest that writes and verifies 256 MiB, live-migrate it between two ferry
# processes over TCP on loopback, print the report, and show the guest verifying on.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=target/release/ferry
GUEST=guest/build/guest.elf
work=$(mktemp -d /tmp/ferry-demo.XXXXXX)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

wait_socket() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no API at $1" >&2; exit 1; }
status() { "$FERRY" status --api-socket "$1" | python3 -c '
import json, sys
i = json.load(sys.stdin)
print("  %-12s state=%-9s heartbeat=%-7d pages=%-9d passes=%-4d verify_errors=%d"
      % (sys.argv[1], i["state"], i["heartbeat_seq"], i["pages_touched"], i["passes"], i["verify_errors"]))' "$2"; }

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

echo "== TLS: a private CA and a certificate for each host (ferry certs)"
"$FERRY" certs --out "$work/tls" --name source.local --name 127.0.0.1 >/dev/null
src_tls=(--tls-cert "$work/tls/source.local.pem" --tls-key "$work/tls/source.local.key" --tls-ca "$work/tls/ca.pem")
dst_tls=(--tls-cert "$work/tls/127.0.0.1.pem" --tls-key "$work/tls/127.0.0.1.key" --tls-ca "$work/tls/ca.pem")

echo "== source: a 1 GiB guest, 2 vCPUs, writing and verifying a 256 MiB working set"
"$FERRY" run --guest "$GUEST" --memory 1G --vcpus 2 --cmdline "write ws=256M seq verify" \
    --api-socket "$work/src.sock" --serial "$work/src.serial" "${src_tls[@]}" &
pids+=($!); src_pid=$!
wait_socket "$work/src.sock"
echo "== destination: waiting on tcp:127.0.0.1:$port (TLS 1.3, both certificates checked)"
"$FERRY" run --incoming "tcp:127.0.0.1:$port" --api-socket "$work/dst.sock" --serial "$work/dst.serial" \
    "${dst_tls[@]}" &
pids+=($!)
wait_socket "$work/dst.sock"
for _ in 1 2; do sleep 1; status "$work/src.sock" source; done

echo "== ferry migrate --to tcp:127.0.0.1:$port --max-downtime-ms 20"
"$FERRY" migrate --api-socket "$work/src.sock" --to "tcp:127.0.0.1:$port" --max-downtime-ms 20
returned_ns=$(date +%s%N)
"$FERRY" migration --api-socket "$work/dst.sock" --watch --json | python3 -c '
import json, sys
s = json.load(sys.stdin)
print("== ferry migrate returned %.1f ms after the VM ran on the destination (both on this host'"'"'s clock)"
      % ((int(sys.argv[1]) - s["resumed_at_unix_ns"]) / 1e6))
print("== the destination (ferry migration --watch): downtime as the guest saw it %.2f ms, "
      "its work rate after %.0f pages/s" % (s["guest_observed_downtime_ms"], s["guest_pages_per_s_after"]))' "$returned_ns"
wait "$src_pid" && echo "== the source process exited with status 0"

echo "== the guest runs on at the destination, verifying every page it wrote before the move"
for _ in 1 2 3; do sleep 1; status "$work/dst.sock" destination; done
echo "== destination serial console (last lines)"; tail -n 2 "$work/dst.serial"
"$FERRY" shutdown --api-socket "$work/dst.sock"
