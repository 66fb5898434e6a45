#!/usr/bin/env bash
# The README's demo command: set up whatever is missing (the first run on a fresh machine
# takes a few minutes: packages, QEMU, guest images), then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
log=/tmp/dxpu-setup.log
echo "demo: setting up what is missing (log: $log) ..."
scripts/setup.sh > "$log" 2>&1 || { cat "$log"; exit 1; }
rm -f "$log"  # kept only when setup failed
exec .venv/bin/dxpu demo "$@"
