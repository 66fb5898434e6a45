#!/usr/bin/env bash
# The native link stream under AddressSanitizer + UndefinedBehaviorSanitizer: builds the
# sanitized module (build/native-asan) and runs the tests that drive it (its own tests and
# the link tests, both proxies in processes) with that build loaded (DXPU_FASTLINK_SO).
#   scripts/sanitize.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
so=$(.venv/bin/python scripts/build_native.py --sanitize)
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
# Python is not built with ASan: preload the runtime; CPython's own allocations at exit are
# not leaks of ours (detect_leaks=0); any report aborts the process and fails the test.
export LD_PRELOAD="$asan $ubsan"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export DXPU_FASTLINK_SO="$so" DXPU_FASTLINK=1
# (and the host's DMA_READV and DMA_WRITEV parsers in forward.c, driven by a hostile box, and
# its ring pushes and merged doorbells, driven by the accelerator's runtime and directly; and
# the local DMA table's file I/O, mapped_io.c, with the random lists of its fuzz test; and the
# box reader's ring pushes taken in C, serve.c, against Python's with random pushes, and its waiting serve)
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_native_stream.py tests/test_link.py tests/test_hostile_box.py \
    tests/test_forwarder_pushes.py tests/test_dma_file_io.py tests/test_box_push_mirror.py tests/test_box_serve_waiting.py \
    tests/test_accel_runtime.py::test_a_burst_of_doorbells_is_one_push_and_one_doorbell_on_the_link \
    tests/test_accel_runtime.py::test_a_boxs_ring_fetches_come_with_their_doorbells \
    -k "not python and (not hostile_box or readv or writev)" "$@"
