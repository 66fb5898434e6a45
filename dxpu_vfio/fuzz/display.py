"""Fuzzing the display adapter (:mod:`qemu_device.display`) as a malicious guest drives
it: the host proxy process serving it, on its vfio-user socket, with screenshots asked
for in between (``dxpu screenshot``, the proxy's SIGUSR2).

Besides the units of :class:`VfioUserTarget`, a device program here writes the VBE DISPI
registers (whole modes as Linux's bochs driver sets them, or one register at a time with
values at the edges of QEMU's VBE maxima, in 1, 2, 4 and 8 byte accesses that straddle
registers), the byte-order register and the framebuffer, and then looks at the screen.

What a look checks (a :class:`Violation` if not): the request is answered by its bound
with a PNG or a refusal; a PNG decodes and is exactly the mode the registers hold (1x1
black while the display shows nothing); a refusal comes only for a mode that would show
something, and names that mode. The renderer never allocates a frame larger than VRAM:
a mode that asks for one is refused (the runner's memory check catches a proxy that grows).
"""

from __future__ import annotations

import io
import random
import struct
import time
from pathlib import Path

from PIL import Image

from dxpu_vfio.hostproxy.process import HostProxyError
from dxpu_vfio.fuzz.mutate import edge
from dxpu_vfio.fuzz.peer import Hang, Violation
from dxpu_vfio.fuzz.vfio_user import VfioUserTarget, Wire
from dxpu_vfio.procs import RequestRefused
from dxpu_vfio.vfio_user import protocol as p
from qemu_device import display as d

VRAM_MIB = 16  # the smallest the model takes: the largest frame it may show is 16 MiB
LOOK_SECONDS = 5.0  # a screenshot of the largest frame takes well under a second
REGS = 11  # DISPI registers ID .. VIDEO_MEMORY_64K
LOOK_ID = 0xFFFD  # the message ids of a look's own reads (never a generated message's)
MODES = ((640, 480), (800, 600), (1024, 768), (1280, 1024), (1, 1), (2048, 2048), (4096, 1024))


class DisplayTarget(VfioUserTarget):
    """The host proxy serving a display, its registers and screen fuzzed."""

    def __init__(self) -> None:
        super().__init__("display")
        self.looks = 0  # screenshots checked (the probe's included)

    def _settings(self, workdir: Path) -> dict:
        return {"vram_mib": VRAM_MIB}

    # --- units ---------------------------------------------------------------------------
    def _program_device(self, rng: random.Random):
        if rng.random() < 0.9:
            yield self._config_write(rng, 4, bytes([rng.choice((0x02, 0x02, 0x00, 0xFF)), 0]))
        if rng.random() < 0.4:
            yield from self._set_mode(rng)
        for _ in range(rng.choice((0, 1, 2, 4, 8))):
            yield self._register_write(rng)
        if rng.random() < 0.3:
            yield self._framebuffer_write(rng)
        if rng.random() < 0.3:
            self._look(time.monotonic() + LOOK_SECONDS)

    def _dispi(self, reg: int, value: int, posted: bool = True) -> Wire:
        return self._bar0(d.DISPI + 2 * reg, value & 0xFFFF, size=2, posted=posted, region=2)

    def _set_mode(self, rng: random.Random):
        """A whole mode, in the order Linux's bochs driver writes one (bochs_hw_setmode)."""
        width, height = rng.choice(MODES)
        bpp = rng.choice((32, 32, 32, 24, 16, 8))
        virt = rng.choice((width, width, 0, width * 2, width + 1))
        yield self._dispi(d.ENABLE, 0)
        for reg, value in ((d.BPP, bpp), (d.XRES, width), (d.YRES, height), (d.BANK, 0), (d.VIRT_WIDTH, virt),
                           (d.VIRT_HEIGHT, height), (d.X_OFFSET, rng.choice((0, 0, 1, 100))),
                           (d.Y_OFFSET, rng.choice((0, 0, 1, height)))):
            yield self._dispi(reg, value)
        yield self._dispi(d.ENABLE, rng.choice((d.ENABLED | d.LFB_ENABLED,) * 4 + (d.ENABLED | d.GETCAPS, 0x80)),
                          posted=False)

    def _register_write(self, rng: random.Random) -> Wire:
        """One register (or a span of them, or the byte order) with a value at the edges."""
        reg = rng.choice(tuple(range(REGS)) + (d.XRES, d.YRES, d.BPP, d.VIRT_WIDTH, d.ENABLE, REGS, 0x7F))
        value = edge(rng, 16, near=(d.MAX_XRES, d.MAX_YRES, d.MAX_BPP, 4096, 0x100))
        if reg == d.ENABLE and rng.random() < 0.6:
            value = rng.choice((d.ENABLED | d.LFB_ENABLED, 0, d.GETCAPS, d.ENABLED | d.GETCAPS, d.ENABLED, 0xFFFF))
        roll = rng.random()
        if roll < 0.6:
            return self._dispi(reg, value, posted=rng.random() < 0.7)
        if roll < 0.75:  # one byte of a register
            return self._bar0(d.DISPI + 2 * reg + rng.randrange(2), value & 0xFF, size=1, region=2)
        if roll < 0.9:  # two or four registers in one access, at any alignment
            size = rng.choice((4, 8))
            return self._bar0(d.DISPI + 2 * reg + rng.choice((0, 1)), rng.getrandbits(8 * size), size=size, region=2)
        return self._bar0(d.QEXT + rng.choice((4, 4, 0, 5, 8)), edge(rng, 32, near=(d.BYTEORDER_LE,)), region=2)

    def _framebuffer_write(self, rng: random.Random) -> Wire:
        vram = VRAM_MIB << 20
        size = rng.choice((4, 64, 4096))
        offset = rng.choice((0, vram - size, vram - 1, vram, rng.randrange(vram)))
        payload = p.REGION_RW.pack(offset, 0, size) + rng.randbytes(size)
        return p.message(0x7FFF, p.Command.REGION_WRITE, payload, no_reply=rng.random() < 0.7), [], False

    # --- the screen ----------------------------------------------------------------------
    def probe(self, deadline: float) -> None:
        super().probe(deadline)
        self._look(deadline)

    def _register(self, reg: int, deadline: float) -> int | None:
        """A DISPI register as the guest reads it; None where this session cannot read
        (a session a unit left without VERSION, or with the device's memory disabled)."""
        assert self.peer is not None
        reply = self.peer.request(p.message(LOOK_ID, p.Command.REGION_READ,
                                            p.RegionAccess(2, d.DISPI + 2 * reg, 2).pack()), LOOK_ID, deadline)
        payload = self.peer.reply_payload
        if reply.is_error or len(payload) != p.REGION_RW.size + 2:
            return None
        return struct.unpack_from("<H", payload, p.REGION_RW.size)[0]

    def _look(self, deadline: float) -> None:
        """Ask for a screenshot and hold it against the mode the guest reads back."""
        if self.peer is None or self.peer.closed:
            return
        regs = {reg: self._register(reg, deadline) for reg in (d.ENABLE, d.XRES, d.YRES, d.BPP)}
        assert self.process is not None
        try:
            png, refusal = self.process.screenshot(timeout=max(0.1, deadline - time.monotonic())), None
        except HostProxyError as exc:
            if not isinstance(exc.__cause__, RequestRefused):
                raise Hang(f"a screenshot was neither given nor refused: {exc}") from None
            png, refusal = None, str(exc.__cause__)
        self.looks += 1
        # GETCAPS makes XRES/YRES/BPP read the maxima: then the mode cannot be read back
        readable = None not in regs.values() and not regs[d.ENABLE] & d.GETCAPS
        width, height, bpp = regs[d.XRES], regs[d.YRES], regs[d.BPP]
        shows = readable and bool(regs[d.ENABLE] & d.ENABLED) and bpp == 32 and bool(width) and bool(height)
        if refusal is not None:
            if "mode " not in refusal or (readable and not shows) or \
                    (shows and f"mode {width}x{height}x{bpp}" not in refusal):
                raise Violation(f"a screenshot was refused ({refusal!r}) with the registers at {regs}")
            return
        assert png is not None
        try:
            size = Image.open(io.BytesIO(png)).size
        except Exception as exc:  # noqa: BLE001 - whatever PIL makes of it, it is not a PNG
            raise Violation(f"the screenshot is not a PNG ({exc}); registers {regs}") from None
        want = (width, height) if shows else (1, 1)  # 1x1 black: nothing shown
        if readable and size != want:
            raise Violation(f"the screenshot is {size[0]}x{size[1]}, the registers say {want} ({regs})")
        if size[0] * size[1] * 4 > VRAM_MIB << 20:
            raise Violation(f"the screenshot is {size[0]}x{size[1]}: more than VRAM holds")
