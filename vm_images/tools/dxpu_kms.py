"""A tiny modetest for guests: set a mode through a DRM driver's KMS interface, draw a
known pattern into the scanout buffer, time it, hold the mode.

Standard library only: the host copies this file into a guest (``dxpu_vfio.lab.kms.install``) and runs it
with the guest's python3, so it exercises the guest's own DRM driver (bochs-drm) the
way a compositor would: GETRESOURCES, GETCONNECTOR (the modes the driver derived from
the EDID), CREATE_DUMB + ADDFB, SETCRTC, MAP_DUMB + mmap (a write-combined mapping of
the buffer in VRAM), fill.

    python3 dxpu_kms.py --card /dev/dri/card0 --mode 800x600 [--hold SECONDS [--until FILE]] [--repeat N]
                        [--animate SECONDS [--fps N] [--band LINES] [--start FILE]]

prints one JSON line: the mode set, the fill time of each repeat (each fill ends with a
read of the buffer, which on PCIe cannot pass the posted writes before it), and then
holds the mode (the DRM master) until ``--hold`` runs out or the file ``--until``
exists. When it exits, the kernel's fbdev client restores its own mode.

``--animate``: after the fills, draw frames for that long, ``--fps`` a second: frame k
(1, 2, ...) fills the first ``--band`` lines with the pixel value k (24 bits: R, G, B =
k >> 16, k >> 8, k), so a screenshot's first pixel says which frame it shows; then a
second JSON line, ``{"frames": n}`` (the last frame's counter), before the hold. With
``--start``, the frames begin once that file exists (the host watches first).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import struct
import sys
import time

MODEINFO = struct.Struct("<IHHHHHHHHHHIII32s")  # struct drm_mode_modeinfo (68 bytes)
CARD_RES = struct.Struct("<QQQQIIIIIIII")
CONNECTOR = struct.Struct("<QQQQIIIIIIIIIIII")
CRTC = struct.Struct("<QIIIIIII") # + modeinfo
FB_CMD = struct.Struct("<IIIIIII")
CREATE_DUMB = struct.Struct("<IIIIIIQ")
MAP_DUMB = struct.Struct("<IIQ")
CHUNK = 1024  # bytes per memcpy: below glibc's rep-movsb threshold, so vector stores


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("d") << 8) | nr


def _ioctl(fd: int, nr: int, st: struct.Struct, *fields, extra: bytes = b"") -> tuple:
    buf = bytearray(st.pack(*fields) + extra)
    fcntl.ioctl(fd, _iowr(nr, len(buf)), buf, True)
    return st.unpack_from(buf) + ((bytes(buf[st.size:]),) if extra else ())


def _u32_array(n: int):
    return (ctypes.c_uint32 * max(n, 1))()


def resources(fd: int) -> tuple[list[int], list[int]]:
    """(crtc ids, connector ids)."""
    r = _ioctl(fd, 0xA0, CARD_RES, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    crtcs, conns = _u32_array(r[5]), _u32_array(r[6])
    fbs, encs = _u32_array(r[4]), _u32_array(r[7])
    r = _ioctl(fd, 0xA0, CARD_RES, ctypes.addressof(fbs), ctypes.addressof(crtcs), ctypes.addressof(conns),
               ctypes.addressof(encs), r[4], r[5], r[6], r[7], 0, 0, 0, 0)
    return list(crtcs)[:r[5]], list(conns)[:r[6]]


def connector_modes(fd: int, connector: int) -> list[bytes]:
    """The connector's modes as packed drm_mode_modeinfo structs."""
    c = _ioctl(fd, 0xA7, CONNECTOR, 0, 0, 0, 0, 0, 0, 0, 0, connector, 0, 0, 0, 0, 0, 0, 0)
    n_modes, n_props, n_enc = c[4], c[5], c[6]
    modes = (ctypes.c_uint8 * (MODEINFO.size * max(n_modes, 1)))()
    props, values, encs = (ctypes.c_uint32 * max(n_props, 1))(), (ctypes.c_uint64 * max(n_props, 1))(), _u32_array(n_enc)
    c = _ioctl(fd, 0xA7, CONNECTOR, ctypes.addressof(encs), ctypes.addressof(modes), ctypes.addressof(props),
               ctypes.addressof(values), n_modes, n_props, n_enc, 0, connector, 0, 0, 0, 0, 0, 0, 0)
    raw = bytes(modes)
    return [raw[i * MODEINFO.size:(i + 1) * MODEINFO.size] for i in range(min(c[4], n_modes))]


def pattern_row(y: int, width: int) -> bytes:
    """XRGB8888 row y of the test pattern: R = x, G = y, B = x ^ y (low 8 bits)."""
    return b"".join(struct.pack("<I", ((x & 255) << 16) | ((y & 255) << 8) | ((x ^ y) & 255))
                    for x in range(width))


def animate(fb: mmap.mmap, pitch: int, band: int, seconds: float, fps: float) -> int:
    """Frames 1, 2, ... each filling the first ``band`` lines with its counter, on a fixed
    beat; returns the last frame's counter."""
    k, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        k += 1
        fb[0:pitch * band] = struct.pack("<I", k & 0xFFFFFF) * (pitch * band // 4)
        time.sleep(max(0.0, start + k / fps - time.monotonic()))
    return k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--card", default="/dev/dri/card0")
    ap.add_argument("--mode", default=None, help="WxH from the connector's list (default: its first)")
    ap.add_argument("--hold", type=float, default=0.0, help="keep the mode this long at most")
    ap.add_argument("--until", default=None, help="stop holding once this file exists")
    ap.add_argument("--repeat", type=int, default=1, help="fills to time")
    ap.add_argument("--pattern-file", default=None, help="only write the pattern for --mode (XRGB8888) to this file")
    ap.add_argument("--animate", type=float, default=0.0, help="then draw counter frames for this many seconds")
    ap.add_argument("--fps", type=float, default=100.0, help="frames a second while animating")
    ap.add_argument("--band", type=int, default=16, help="lines each animation frame fills")
    ap.add_argument("--start", default=None, help="animate once this file exists")
    args = ap.parse_args(argv)
    if args.pattern_file:
        w, h = (int(v) for v in args.mode.split("x"))
        with open(args.pattern_file, "wb") as f:
            f.writelines(pattern_row(y, w) for y in range(h))
        return 0

    fd = os.open(args.card, os.O_RDWR)
    crtcs, conns = resources(fd)
    conn = conns[0]
    modes = connector_modes(fd, conn)
    names = [f"{MODEINFO.unpack(m)[1]}x{MODEINFO.unpack(m)[6]}" for m in modes]
    if args.mode is None:
        pick = 0
    elif args.mode in names:
        pick = names.index(args.mode)
    else:
        print(json.dumps({"error": f"mode {args.mode} not offered", "modes": names}), flush=True)
        return 2
    mode = modes[pick]
    w, h = MODEINFO.unpack(mode)[1], MODEINFO.unpack(mode)[6]
    dumb = _ioctl(fd, 0xB2, CREATE_DUMB, h, w, 32, 0, 0, 0, 0)
    handle, pitch, size = dumb[4], dumb[5], dumb[6]
    fb_id = _ioctl(fd, 0xAE, FB_CMD, 0, w, h, pitch, 32, 24, handle)[0]
    conn_ids = _u32_array(1)
    conn_ids[0] = conn
    # SETCRTC first: the driver pins the buffer in VRAM, so the mapping below is VRAM
    _ioctl(fd, 0xA2, CRTC, ctypes.addressof(conn_ids), 1, crtcs[0], fb_id, 0, 0, 0, 1, extra=mode)
    offset = _ioctl(fd, 0xB3, MAP_DUMB, handle, 0, 0)[2]
    fb = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    # --repeat 0 (an animation only): no pattern, whose rows take seconds to build under TCG
    frame = b"".join(pattern_row(y, w).ljust(pitch, b"\0") for y in range(h)) if args.repeat > 0 else b""
    view = memoryview(frame)
    fills = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        for pos in range(0, len(frame), CHUNK):
            fb[pos:pos + CHUNK] = view[pos:pos + CHUNK]
        fb[len(frame) - 4:len(frame)]  # a read: completes only after the writes before it
        fills.append(time.perf_counter() - t0)
    print(json.dumps({"mode": names[pick], "modes": names, "pitch": pitch, "bytes": len(frame),
                      "fill_s": fills}), flush=True)
    if args.animate > 0:
        while args.start and not os.path.exists(args.start):
            time.sleep(0.01)
        print(json.dumps({"frames": animate(fb, pitch, min(args.band, h), args.animate, args.fps)}), flush=True)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline and not (args.until and os.path.exists(args.until)):
        time.sleep(0.1)
    fb.close()
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
