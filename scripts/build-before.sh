#!/bin/bash
# Builds ferry as of an earlier commit into a kit folder of its own (ferry, COMMIT), for an A/B
# on a host lent for minutes: `make scale-kit BEFORE=<commit>`.
#   scripts/build-before.sh <commit> <folder>
set -euo pipefail
rev=$(git rev-parse --verify "$1^{commit}")
out=$2
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"' EXIT
git worktree add --detach "$tree" "$rev" >/dev/null
# Its own target folder: the checkout's build stays as it is.
cargo build --release --manifest-path "$tree/Cargo.toml" --target-dir target/before -p ferry
mkdir -p "$out"
strip -o "$out/ferry" target/before/release/ferry
echo "$rev clean" > "$out/COMMIT"
echo "built $rev into $out"
