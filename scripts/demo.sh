#!/usr/bin/env bash
# The README's demo command: set up whatever is missing, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh > /tmp/dxpu-setup.log 2>&1 || { cat /tmp/dxpu-setup.log; exit 1; }
exec .venv/bin/dxpu demo "$@"
