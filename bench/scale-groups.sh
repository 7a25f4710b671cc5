#!/bin/bash
# The scale profile on a host lent for minutes (docs/benchmarks.md, "Scale profile"): its rows in
# groups, most telling first, each group a run of bench/run.py under what is left of a deadline,
# and everything packed into one archive at the end (a lent host may hand back few files).
#   OUT=dir LIMIT=seconds [GROUPS_ONLY="conn-1-8 live"] bench/scale-groups.sh
# With scale-kit/before/ferry (`make scale-kit BEFORE=<commit>`) the group conn-1-8-before
# runs the same rows with that build.
# MEM, WS, CWS and VCPUS shrink the rows as --scale-memory/-ws/-codec-ws/-vcpus do.
set -u
cd "$(dirname "$0")/.."
MEM=${MEM:-64G} WS=${WS:-16G} CWS=${CWS:-512M} VCPUS=${VCPUS:-8} LIMIT=${LIMIT:-530}
OUT=${OUT:-bench/results/scale-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export FERRY_BIN=${FERRY_BIN:-scale-kit/ferry} FERRY_GUEST=${FERRY_GUEST:-scale-kit/guest.elf}
{ date -u; uname -a; nproc; free -g; cat /sys/kernel/mm/transparent_hugepage/enabled \
    /sys/kernel/mm/transparent_hugepage/defrag; grep -m1 "model name" /proc/cpuinfo
  ls /sys/module | grep -i kvm; ulimit -a; python3 --version
  # A VM whose balloon reports free pages (feature bit 5) hands freed memory back to its host.
  for d in /sys/bus/virtio/devices/*; do echo "$d $(basename "$(readlink -f "$d/driver")") $(cat "$d/features")"; done
} > "$OUT/host.txt" 2>&1
end=$((SECONDS + LIMIT))
ceilings=
group() {
    local name=$1; shift
    case " ${GROUPS_ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
    local left=$((end - SECONDS - 5))
    if [ $left -lt 30 ]; then echo "$name: skipped, ${left}s left" >> "$OUT/progress"; return; fi
    echo "$name: started at ${SECONDS}s, ${left}s left" >> "$OUT/progress"
    # On the deadline run.py gets SIGTERM: it stops its VMs, and results.json keeps every
    # scenario finished before.
    timeout -k 10 -s TERM $left python3 bench/run.py --profile scale --scale-memory "$MEM" \
        --scale-ws "$WS" --scale-codec-ws "$CWS" --scale-vcpus "$VCPUS" --out "$OUT/$name" \
        $ceilings "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    # The host's ceilings are measured once: by the first group that got them.
    grep -qs '"fault_in": {' "$OUT/$name/results.json" && ceilings=--skip-ceilings
    echo "$name: exit $rc at ${SECONDS}s" >> "$OUT/progress"
    grep -h " run [0-9]*/" "$OUT/$name.log" >> "$OUT/progress"
}
group conn-1-8 --only "^scale warm $WS / $MEM (1|8) conn\$"
# The same rows with an earlier build, where the kit holds one (`make scale-kit BEFORE=<commit>`).
if [ -x scale-kit/before/ferry ]; then
    FERRY_BIN=scale-kit/before/ferry group conn-1-8-before --only "^scale warm $WS / $MEM (1|8) conn\$"
fi
group codec-8 --only "^scale warm mixed $CWS / $MEM 8 conn (none|zstd|auto)\$"
group live --only "^scale pre-copy $WS / $MEM (1|8) conn\$"
group switch --only "^scale (postcopy|hybrid) $WS / $MEM 8 conn\$"
group conn-2-4-16 --only "^scale warm $WS / $MEM (2|4|16) conn\$"
group codec-1 --only "^scale warm mixed $CWS / $MEM 1 conn (none|zstd|auto)\$"
group threads --only "^scale warm mixed $CWS / $MEM .* threads\$"
group lz4 --only "^scale warm mixed $CWS / $MEM (1|8) conn lz4\$"
echo "done at ${SECONDS}s" >> "$OUT/progress"
tar czf "$OUT.tgz" -C "$OUT" . && mv "$OUT.tgz" "$OUT/all.tgz"
cat "$OUT/progress"
