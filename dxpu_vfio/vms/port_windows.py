"""What each hot-plug root port reserves from the firmware, for the VM runner and
libvirt domains alike.

Firmware (SeaBIOS) sizes a root port's bridge windows at boot; a device hot-plugged
later gets BARs only inside them. Memory windows are ``mem-reserve`` (32-bit) and
``pref64-reserve`` (64-bit prefetchable); ``io-reserve`` is the port I/O window, without
which a device with an I/O BAR (legacy devices, libvfio-user's gpio sample) gets no port
I/O at all. Bridge I/O windows come in 4 KiB units out of x86's 64 KiB port space, of
which the board's own devices and legacy ports take part; SeaBIOS stops the boot when
the windows do not fit ("out of I/O address space"), so their sum is checked here first.
"""

from __future__ import annotations

import re

from dxpu_vfio.errors import VmError

IO_WINDOW_UNIT = 4 << 10
IO_SPACE_FOR_PORTS = 40 << 10  # of the 64 KiB port space, what root ports may take in all


def size_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KMGT]?)", text.strip().upper())
    if not match:
        raise ValueError(f"bad size {text!r} (want e.g. 64M, 16G)")
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[match.group(2)]


def io_reserve_bytes(io_reserve: str, root_ports: int) -> int:
    """The I/O window of each root port in bytes, checked: a multiple of 4 KiB (0: none),
    and all ports' together within what the port space can give."""
    size = size_bytes(io_reserve)
    if size % IO_WINDOW_UNIT:
        raise VmError(f"io_reserve {io_reserve} is not a multiple of 4K (bridge I/O windows come in 4 KiB units)",
                      hint="use 0 (no port I/O below the root ports), 4K or 8K")
    if size * root_ports > IO_SPACE_FOR_PORTS:
        raise VmError(f"{root_ports} root ports with io_reserve {io_reserve} need {size * root_ports >> 10} KiB "
                      f"of port I/O space, more than the {IO_SPACE_FOR_PORTS >> 10} KiB the firmware can give",
                      hint="use fewer root ports, a smaller io_reserve, or io_reserve 0 (then devices with "
                           "I/O BARs get no port I/O)")
    return size
