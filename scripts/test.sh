#!/usr/bin/env bash
# The README's test command: set up whatever is missing, then run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k tiny -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
printf '\n==> Tests\n'
exec .venv/bin/python -m pytest "$@"
