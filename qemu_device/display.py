"""A display adapter compatible with QEMU's bochs-display (PCI 1234:1111), which Linux's
own ``bochs`` DRM driver binds to.

BAR0 is the framebuffer (prefetchable; memory of whoever serves the device: on a GPU
box, the box). With ``mapped=True`` (the default) it is
declared host-mappable (written only by the CPU) and kept in a sealed memfd, which QEMU maps straight into the guest when the
device is served locally, and a host proxy shadows and writes back when it is served from
a box (docs/devices/display.md); ``mapped=False`` is the trapped path (every store a
message); BAR2 is 4 KiB of MMIO: an EDID blob at 0x000, the VBE DISPI registers at
0x500 (16 bit each, index * 2) and QEMU's extended registers at 0x600 (size, byte order).
Nothing else: no VGA, no legacy I/O ports. ``render_png()`` draws the current scanout.

The guest may program any mode. One larger than the advertised limits (QEMU's VBE
maxima, which ENABLE's GETCAPS bit makes XRES/YRES/BPP report) or whose frame does not
fit in VRAM is invalid: it shows nothing, and a screenshot of it raises
:class:`DisplayModeError` (a box answers the request with an error), never allocates
the frame it describes.
"""

from __future__ import annotations

import io
import struct

from PIL import Image

from .bars import BarSpec
from .device import IrqConfig, PciFunction
from .header import PciIdentity
from .mapped_memory import MappedMemory

DISPI, QEXT = 0x500, 0x600
ID, XRES, YRES, BPP, ENABLE, BANK, VIRT_WIDTH, VIRT_HEIGHT, X_OFFSET, Y_OFFSET, VIDEO_MEMORY_64K = range(11)
DISPI_ID5 = 0xB0C5
ENABLED, GETCAPS, LFB_ENABLED = 0x01, 0x02, 0x40
MAX_XRES, MAX_YRES, MAX_BPP = 16000, 12000, 32  # as QEMU's VBE (VBE_DISPI_MAX_*), reported by GETCAPS
BYTEORDER_LE = 0x1E1E1E1E


def _edid(name: bytes = b"DXPU") -> bytes:
    """A minimal EDID 1.4 block preferring 1024x768@60 (from the DMT timing table) and also
    offering 800x600@60 and 640x480@60, so a KMS client can change the mode."""
    e = bytearray(128)
    e[0:8] = b"\x00\xff\xff\xff\xff\xff\xff\x00"
    e[8:10] = struct.pack(">H", (ord("D") - 64) << 10 | (ord("X") - 64) << 5 | (ord("P") - 64))
    e[18], e[19] = 1, 4  # EDID 1.4
    e[20] = 0xA5  # digital, 8 bits per colour, DisplayPort
    e[21], e[22] = 34, 27  # cm
    e[35] = 0x21  # established timings I: 640x480@60, 800x600@60
    e[36] = 0x08  # established timings II: 1024x768@60
    # detailed timing descriptor: 1024x768@60, 65 MHz
    e[54:72] = bytes([0x64, 0x19, 0x00, 0x40, 0x41, 0x00, 0x26, 0x30, 0x18, 0x88,
                      0x36, 0x00, 0x54, 0x0E, 0x11, 0x00, 0x00, 0x1E])
    e[72:90] = b"\x00\x00\x00\xfc\x00" + name.ljust(13, b"\n")[:13]  # monitor name
    e[127] = (-sum(e[:127])) & 0xFF
    return bytes(e)


class DisplayModeError(ValueError):
    """The guest programmed a mode beyond the limits or VRAM: there is no frame to show."""


class DisplayAdapter(PciFunction):
    """``vram_mib``: framebuffer size (16 MiB or more); ``coalesce``: ask whoever serves
    the device to combine posted writes (vfio-user write_multiple, link batches), since
    framebuffer fills are floods of them; ``mapped``: the framebuffer BAR is host-mappable
    (a memfd the VMM maps: fills at memory speed; False: every store is a trapped access,
    an order of magnitude slower, kept as an option and for its tests)."""

    renders_screen = True

    def __init__(self, *, vram_mib: int = 16, coalesce: bool = True, mapped: bool = True) -> None:
        self.coalesce_posted = coalesce
        if vram_mib < 16 or vram_mib & (vram_mib - 1):
            raise ValueError("vram_mib must be a power of two, 16 or more")
        super().__init__(PciIdentity(0x1234, 0x1111, 0x038000, revision=2),
                         [BarSpec(0, vram_mib << 20, "mem32", prefetchable=True, host_mappable=bool(mapped)),
                          BarSpec(2, 4096, "mem32")],
                         IrqConfig(intx=False), config_size=256, pcie=False)
        self.memory = MappedMemory(vram_mib << 20, "dxpu-display-vram") if mapped else None
        self.vram = self.memory.buf if self.memory is not None else bytearray(vram_mib << 20)
        self.edid = _edid()
        self.writes = 0
        self.bytes_written = 0
        self.reset_registers()

    def reset_registers(self) -> None:
        self.dispi = [0] * 11
        self.dispi[ID] = DISPI_ID5
        self.dispi[VIDEO_MEMORY_64K] = len(self.vram) >> 16
        self.byteorder = BYTEORDER_LE

    def bar_memory(self, index: int) -> MappedMemory | None:
        return self.memory if index == 0 else None

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()

    # --- BAR access ------------------------------------------------------------------------
    def bar_read(self, index: int, offset: int, size: int) -> bytes:
        if index == 0:
            return bytes(self.vram[offset:offset + size])
        return bytes(self._mmio_byte(offset + i) for i in range(size))

    def _mmio_byte(self, offset: int) -> int:
        if offset < len(self.edid):
            return self.edid[offset]
        if DISPI <= offset < DISPI + 2 * len(self.dispi):
            reg = (offset - DISPI) // 2
            value = self.dispi[reg]
            if self.dispi[ENABLE] & GETCAPS and reg in (XRES, YRES, BPP):
                value = {XRES: MAX_XRES, YRES: MAX_YRES, BPP: MAX_BPP}[reg]
            return (value >> (8 * ((offset - DISPI) % 2))) & 0xFF
        if QEXT <= offset < QEXT + 8:
            value = 8 if offset < QEXT + 4 else self.byteorder
            return (value >> (8 * ((offset - QEXT) % 4))) & 0xFF
        return 0

    def bar_write(self, index: int, offset: int, data: bytes) -> None:
        if index == 0:
            self.vram[offset:offset + len(data)] = data
            self.writes += 1
            self.bytes_written += len(data)
            return
        for i, byte in enumerate(data):
            off = offset + i
            if DISPI <= off < DISPI + 2 * len(self.dispi):
                reg, shift = (off - DISPI) // 2, 8 * ((off - DISPI) % 2)
                if reg in (ID, VIDEO_MEMORY_64K):
                    continue  # read-only here
                self.dispi[reg] = (self.dispi[reg] & ~(0xFF << shift)) | (byte << shift)
            elif QEXT + 4 <= off < QEXT + 8:
                shift = 8 * ((off - QEXT) % 4)
                self.byteorder = (self.byteorder & ~(0xFF << shift)) | (byte << shift)

    # --- what is on the screen -------------------------------------------------------------
    def mode(self) -> dict:
        d = self.dispi
        return {"enabled": bool(d[ENABLE] & ENABLED), "xres": d[XRES], "yres": d[YRES], "bpp": d[BPP],
                "virt_width": d[VIRT_WIDTH] or d[XRES], "x_offset": d[X_OFFSET], "y_offset": d[Y_OFFSET]}

    def mode_error(self, m: dict | None = None) -> str | None:
        """Why the mode (``m``, or the current one) cannot be shown; None if it can."""
        m = m or self.mode()
        w, h, bpp = m["xres"], m["yres"], m["bpp"]
        if w > MAX_XRES or h > MAX_YRES or bpp > MAX_BPP or m["virt_width"] > MAX_XRES:
            return f"mode {w}x{h}x{bpp} (line {m['virt_width']}) exceeds {MAX_XRES}x{MAX_YRES}x{MAX_BPP}"
        stride = max(m["virt_width"], w) * ((bpp + 7) // 8)
        end = (m["y_offset"] + h) * stride + m["x_offset"] * ((bpp + 7) // 8) if h else 0
        if end > len(self.vram):
            return (f"mode {w}x{h}x{bpp} at offset {m['x_offset']},{m['y_offset']} needs {end} bytes, "
                    f"VRAM has {len(self.vram)}")
        return None

    def scanout(self) -> Image.Image | None:
        """What the display shows now as an RGB image; None while it shows nothing
        (disabled, or not 32 bpp XRGB8888). An invalid mode raises DisplayModeError."""
        with self.lock:
            m = self.mode()
            if not m["enabled"] or m["bpp"] != 32 or not m["xres"] or not m["yres"]:
                return None
            error = self.mode_error(m)
            if error is not None:
                raise DisplayModeError(error)
            w, h = m["xres"], m["yres"]
            stride = max(m["virt_width"], w) * 4  # as QEMU's VBE: a line is never narrower than the mode
            base = m["y_offset"] * stride + m["x_offset"] * 4
            frame = bytes(self.vram[base:base + h * stride])  # copied under the lock, converted outside it
        # XRGB8888 little-endian is B, G, R, X in memory; the frame lies inside VRAM (mode_error)
        return Image.frombytes("RGB", (w, h), frame.ljust(h * stride, b"\0"), "raw", "BGRX", stride)

    def render_png(self) -> bytes:
        """The scanout as an 8-bit RGB PNG (one black pixel while nothing is shown);
        DisplayModeError for an invalid mode."""
        image = self.scanout()
        if image is None:
            image = Image.new("RGB", (1, 1))
        out = io.BytesIO()
        image.save(out, "PNG", compress_level=6)
        return out.getvalue()

    def stats(self) -> dict:
        return {"framebuffer_writes": self.writes, "framebuffer_bytes": self.bytes_written,
                "framebuffer_mapped": self.memory is not None, "mode": self.mode(),
                "mode_error": self.mode_error(),
                "suppressed_interrupts": 0}
