#!/usr/bin/env bash
# make bench: installs the plotting library if missing, then runs the benchmark runner.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
    apt-get install -y -q python3-matplotlib || { apt-get update -q && apt-get install -y -q python3-matplotlib; }
fi
exec /usr/bin/python3 bench/run.py "$@"
