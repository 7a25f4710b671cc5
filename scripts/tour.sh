#!/usr/bin/env bash
# Runs the README's CLI tour exactly as written (the ```sh block after its "tour" marker), so it
# cannot go stale: every command must succeed, a line that ends in `# → TEXT` must print TEXT,
# and every ferry it starts in the background must have exited 0 by its end. `ferry` is the one in FERRY_BIN_DIR (default target/release), first on PATH.
# make test runs it (crates/ferry/tests/tour.rs); by hand: scripts/tour.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin_dir=$(cd "${FERRY_BIN_DIR:-target/release}" && pwd)
[ -x "$bin_dir/ferry" ] || { echo "tour: no ferry in $bin_dir (make build)" >&2; exit 1; }
export PATH="$bin_dir:$PATH"

work=$(mktemp -d /tmp/ferry-tour.XXXXXX)
script="$work/tour.sh"
# The block, each `CMD  # → TEXT` line turned into a check that CMD's output holds TEXT.
python3 - "$script" <<'EOF'
import re, shlex, sys
text = open("README.md").read()
marker = text.index("<!-- tour:")
block = text[text.index("```sh\n", marker) + 6:]
block = block[:block.index("```\n")]
out = ["tour_pids=()"]
for line in block.splitlines():
    m = re.match(r"^(.*\S)\s+# → (.*)$", line)
    if m:
        cmd, want = m.group(1), m.group(2)
        out.append(f"said=$({cmd}); printf '%s\\n' \"$said\"; "
                   f"grep -qF -- {shlex.quote(want)} <<<\"$said\" || "
                   f"{{ echo {shlex.quote('tour: expected ' + want)} >&2; exit 1; }}")
    else:
        out.append(line)
        if line.rstrip().endswith(" &"):  # a ferry started in the background
            out.append('tour_pids+=("$!")')
# Every ferry the tour started in the background must have exited 0 by its end.
out.append('for pid in "${tour_pids[@]}"; do wait "$pid" || '
           '{ echo "tour: a ferry it started exited $?" >&2; exit 1; }; done')
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF

# The tour runs in a session of its own: whatever it leaves running is stopped with it, and
# what it made (its mktemp -d lands in $work) is removed.
tour=
cleanup() {
    [ -z "$tour" ] || kill -KILL -- "-$tour" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
export TMPDIR="$work"
# -x: each command is shown as it runs, then what it printed.
setsid bash -euxo pipefail "$script" &
tour=$!
# A tour that hangs is stopped (its own commands are bounded; this bounds the whole).
( sleep 600 && kill -KILL -- "-$tour" ) >/dev/null 2>&1 &
guard=$!
status=0
wait "$tour" || status=$?
pkill -P "$guard" 2>/dev/null || true
[ "$status" = 0 ] || { echo "tour: failed (exit $status)" >&2; exit "$status"; }
echo "tour: every step ran as the README says"
