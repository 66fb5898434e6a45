#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer + ASan + UBSan) of the native link stream's parser
# and receive buffer (dxpu_vfio/native/frame.h, harness fuzz_frame.c).
#   scripts/fuzz_native.sh [SECONDS]     default 60; CI runs it briefly
# Exit status is non-zero on any crash, leak or assertion; the crashing input is kept
# under build/native-fuzz/ (libFuzzer prints its name).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
bin=$(.venv/bin/python scripts/build_native.py --fuzz)
corpus=build/native-fuzz/corpus
mkdir -p "$corpus"
# seeds: a few well-formed streams (8 control bytes, then messages)
python3 - "$corpus" <<'PY'
import struct, sys, pathlib
d = pathlib.Path(sys.argv[1])
def msg(i, cmd, payload, flags=0):
    return struct.pack("<HHIII", i, cmd, 16 + len(payload), flags, 0) + payload
ctl = struct.pack("<II", 1 << 20, 7)
(d / "seed-one").write_bytes(ctl + msg(1, 9, b"\0" * 16))
(d / "seed-many").write_bytes(ctl + b"".join(msg(i, 12, bytes(i * 37)) for i in range(20)))
(d / "seed-bad").write_bytes(ctl + msg(1, 9, b"") + struct.pack("<HHIII", 2, 9, 3, 0, 0))
PY
cd build/native-fuzz
exec "$bin" -max_total_time="$seconds" -max_len=300000 -print_final_stats=1 corpus
