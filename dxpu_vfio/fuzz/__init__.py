"""Structure-aware fuzzers against the project's own servers (``scripts/fuzz.py``).

Each target (:mod:`.vfio_user`, :mod:`.link`, :mod:`.manager`) runs the real server as a
child process and sends it messages that are well framed enough to reach the decoders
and handlers behind the framing, with mutated commands, flags, sizes, payloads and
descriptors; :mod:`.runner` checks after every few messages that the process lives, still
answers a known-good request within a bound, logged no traceback and did not grow.
Messages are generated from (seed, index) alone, so any finding replays from its seed and
index range.
"""
