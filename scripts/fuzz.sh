#!/usr/bin/env bash
# `make fuzz`: runs each cargo-fuzz target (fuzz/fuzz_targets) for FUZZ_SECONDS (default 600)
# from the committed seed corpus plus what earlier runs found (target/fuzz-work). Installs the
# nightly toolchain and cargo-fuzz when missing. Exits non-zero on the first finding; the input
# that caused it is in fuzz/artifacts/<target>/ (replay: cargo +nightly fuzz run -O <target> FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-600}
targets=${FUZZ_TARGETS:-stream snapshot api}

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked

cargo +nightly fuzz build -O
for t in $targets; do
    mkdir -p "target/fuzz-work/$t"
    echo "fuzz: $t for ${seconds}s"
    log="target/fuzz-work/$t.log"
    if ! cargo +nightly fuzz run -O "$t" "target/fuzz-work/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1; then
        tail -60 "$log"
        echo "fuzz: $t FOUND A FAILURE (input in fuzz/artifacts/$t/; log $log)" >&2
        exit 1
    fi
    runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    echo "fuzz: $t: no finding in ${seconds}s, $runs runs, $cov, $(ls "target/fuzz-work/$t" | wc -l) new inputs"
done
