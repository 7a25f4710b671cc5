#!/usr/bin/env bash
# The full fault matrix (crates/ferry/tests/faults.rs): every mode × point × fault, 426
# injected faults (306 of hosts, links and cancel, 88 stop requests, 23 link blips, 9 with
# strangers). Writes
# the table to target/faults.md (target/faults-only.md with FERRY_FAULTS_ONLY, which picks
# from every case and fails if it picks none); exits non-zero if any outcome or answer differs
# from what the design promises (docs/faults.md).
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY_FAULTS=full cargo test --release -p ferry --test faults -- --nocapture 2>&1 \
    | tee target/faults.log | grep -E '^\| |faults injected|test result|picks no case'
echo "fault matrix: table in target/$([[ -n ${FERRY_FAULTS_ONLY:-} ]] && echo faults-only.md || echo faults.md)"
