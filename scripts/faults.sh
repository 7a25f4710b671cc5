#!/usr/bin/env bash
# The full fault matrix (crates/ferry/tests/faults.rs): every mode × point × fault, 258
# injected faults, about 14 minutes here. Writes the table to target/faults.md; exits non-zero
# if any outcome differs from what the design promises (docs/faults.md).
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY_FAULTS=full cargo test --release -p ferry --test faults -- --nocapture 2>&1 \
    | tee target/faults.log | grep -E '^\| |faults injected|test result'
echo "fault matrix: table in target/faults.md"
