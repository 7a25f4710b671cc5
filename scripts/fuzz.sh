#!/usr/bin/env bash
# `make fuzz`: runs every cargo-fuzz target (fuzz/fuzz_targets), one after the other, each for
# FUZZ_SECONDS (default 600), from the committed seed corpus plus what earlier runs found
# (target/fuzz-work). FUZZ_TARGETS picks some. Installs the nightly toolchain and cargo-fuzz
# when missing. Each run is recorded as a row of target/fuzz-work/runs.md (target, commit,
# seconds, executions, corpus size, findings), the table docs/fuzzing.md keeps. A target that
# finds a failure stops there (libFuzzer writes the input to fuzz/artifacts/<target>/; replay:
# cargo +nightly fuzz run -O <target> FILE); the others still run, and the script fails.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-600}

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked

targets=${FUZZ_TARGETS:-$(cargo +nightly fuzz list)}
commit=$(git rev-parse --short HEAD)
[ -z "$(git status --porcelain -- crates fuzz Cargo.lock)" ] || commit="$commit+changes"
table=target/fuzz-work/runs.md
mkdir -p target/fuzz-work
[ -s "$table" ] || printf '| target | commit | seconds | executions | corpus | findings |\n|---|---|---|---|---|---|\n' >"$table"

cargo +nightly fuzz build -O
failed=0
for t in $targets; do
    mkdir -p "target/fuzz-work/$t" "fuzz/artifacts/$t"
    echo "fuzz: $t for ${seconds}s"
    log="target/fuzz-work/$t.log"
    before=$(ls "fuzz/artifacts/$t" | wc -l)
    started=$(date +%s)
    status=0
    # The live conversations leave the engine's detached threads (post-copy's fault handler,
    # the guest report, the source's migration thread) ending after the input returns:
    # LeakSanitizer's check after each input, and at exit, reports their data as leaks.
    leaks=1
    case $t in live_destination | source | resume | local_destination) leaks=0 ;; esac
    ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=$leaks cargo +nightly fuzz run -O "$t" "target/fuzz-work/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -timeout=120 -rss_limit_mb=4096 -detect_leaks=$leaks \
        -print_final_stats=1 >"$log" 2>&1 || status=$?
    took=$(($(date +%s) - started))
    runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log" | tail -1)
    corpus=$(cat "target/fuzz-work/$t"/* "fuzz/corpus/$t"/* 2>/dev/null | wc -c)
    files=$(find "target/fuzz-work/$t" "fuzz/corpus/$t" -type f | wc -l)
    found=$(($(ls "fuzz/artifacts/$t" | wc -l) - before))
    echo "| $t | $commit | $took | ${runs:-?} | $files inputs, $((corpus / 1024)) KiB | $found |" >>"$table"
    if [ "$status" -ne 0 ]; then
        tail -60 "$log"
        echo "fuzz: $t FOUND A FAILURE (input in fuzz/artifacts/$t/; log $log)" >&2
        failed=1
        continue
    fi
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    echo "fuzz: $t: no finding in ${took}s, ${runs:-?} runs, $cov, $files inputs"
done
echo "fuzz: runs recorded in $table"
tail -n +3 "$table"
exit "$failed"
