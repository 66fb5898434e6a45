"""What a box's device description must be before the host proxy serves it to QEMU.

The description (the HELLO reply) answers QEMU's GET_REGION_INFO and GET_IRQ_INFO
without the network, so it is trusted by the vfio-user server: a region list shorter
than vfio-user's nine regions failed every QEMU session at GET_REGION_INFO, an interrupt
name the server does not know killed its accept thread. A box may be broken or hostile,
so the description is checked once, at attach, and a bad one refuses the device.
"""

from __future__ import annotations

from dxpu_vfio.link.protocol import DeviceDescription
from dxpu_vfio.vfio_user import protocol as vp
from dxpu_vfio.vfio_user.device_api import IRQ_INDEX

# the most vectors (or lines) each interrupt index may have: PCI's and vfio-user's own bounds
MAX_VECTORS = {"intx": 1, "msi": 32, "msix": 2048, "err": 1, "req": 1}
CONFIG_SIZES = (256, 4096)  # PCI and PCI Express configuration space
MAX_REGION = 1 << 62  # bytes; a 64-bit BAR of more cannot be placed
MAX_MODEL = 64  # characters in the model name (shown in stats and logs)
MAX_SHADOW = 1 << 30  # bytes of a host-mappable BAR the host proxy shadows (host memory, twice: shadow + snapshot)


class BadDescription(ValueError):
    """The box described a device the host proxy cannot serve (the message says why)."""


def check_description(desc: DeviceDescription) -> None:
    """Raise :class:`BadDescription` unless ``desc`` is one the server can answer QEMU from."""
    if not isinstance(desc.model, str) or not 0 < len(desc.model) <= MAX_MODEL:
        raise BadDescription(f"model name {desc.model!r}")
    if len(desc.regions) != vp.NUM_REGIONS:
        raise BadDescription(f"{len(desc.regions)} regions; vfio-user has {vp.NUM_REGIONS} (absent ones have size 0)")
    for position, region in enumerate(desc.regions):
        if len(region) != 4:
            raise BadDescription(f"region {position}: {region!r} is not (index, size, readable, writable)")
        index, size, readable, writable = region
        if index != position or isinstance(index, bool):
            raise BadDescription(f"region {position} is numbered {index!r}")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_REGION:
            raise BadDescription(f"region {index}: size {size!r}")
        if not isinstance(readable, bool) or not isinstance(writable, bool):
            raise BadDescription(f"region {index}: readable/writable {readable!r}/{writable!r} are not booleans")
    config = desc.regions[vp.REGION_CONFIG]
    if config[1] not in CONFIG_SIZES or not config[2]:
        raise BadDescription(f"configuration space of {config[1]} bytes (readable: {config[2]}); "
                             f"it must be {' or '.join(map(str, CONFIG_SIZES))} and readable")
    if not isinstance(desc.mappable, list):
        raise BadDescription(f"mappable regions {desc.mappable!r} are not a list")
    for index in desc.mappable:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 6:
            raise BadDescription(f"mappable region {index!r}: only BARs 0-5 can be")
        size = desc.regions[index][1]
        if not 0 < size <= MAX_SHADOW or size % 4096:
            raise BadDescription(f"mappable region {index} of {size} bytes: the host shadows whole pages, "
                                 f"at most {MAX_SHADOW >> 20} MiB")
    for name, count in desc.irqs.items():
        if name not in IRQ_INDEX:
            raise BadDescription(f"interrupt {name!r}; known: {', '.join(IRQ_INDEX)}")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_VECTORS[name]:
            raise BadDescription(f"interrupt {name!r} with {count!r} vectors (at most {MAX_VECTORS[name]})")
