#!/usr/bin/env bash
# make bench: installs the plotting library if missing, then runs the benchmark runner.
set -euo pipefail
cd "$(dirname "$0")/.."
# Plots only: a host without apt or a network (the scale profile's) runs without them.
if ! /usr/bin/python3 -c 'import matplotlib' 2>/dev/null && command -v apt-get >/dev/null; then
    apt-get install -y -q python3-matplotlib || { apt-get update -q && apt-get install -y -q python3-matplotlib; } \
        || echo "python3-matplotlib could not be installed: no plots" >&2
fi
exec /usr/bin/python3 bench/run.py "$@"
