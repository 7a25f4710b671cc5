#!/usr/bin/env bash
# The demo: boot a guest in ferry, watch its heartbeats, pause and resume it, shut it down.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=target/release/ferry
GUEST=guest/build/guest.elf
work=$(mktemp -d /tmp/ferry-demo.XXXXXX)
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
pids=()
trap cleanup EXIT

status() { "$FERRY" status --api-socket "$1" | python3 -c '
import json, sys
i = json.load(sys.stdin)
print("  state=%-9s heartbeat=%-7d pages=%-9d passes=%-5d verify_errors=%d"
      % (i["state"], i["heartbeat_seq"], i["pages_touched"], i["passes"], i["verify_errors"]))'; }

echo "== booting a 1 GiB guest: write ws=256M seq verify, 2 vCPUs"
"$FERRY" run --guest "$GUEST" --memory 1G --vcpus 2 --cmdline "write ws=256M seq verify" \
    --api-socket "$work/src.sock" --serial "$work/src.serial" &
pids+=($!)
for _ in $(seq 100); do [ -S "$work/src.sock" ] && break; sleep 0.1; done
for _ in 1 2 3; do sleep 1; status "$work/src.sock"; done
echo "== pause"; "$FERRY" pause --api-socket "$work/src.sock"; status "$work/src.sock"; sleep 1; status "$work/src.sock"
echo "== resume"; "$FERRY" resume --api-socket "$work/src.sock"; sleep 1; status "$work/src.sock"
echo "== guest serial console (last lines)"; tail -n 3 "$work/src.serial"
echo "== shutdown"; "$FERRY" shutdown --api-socket "$work/src.sock"; wait "${pids[0]}"; echo "  ferry exited with status $?"
