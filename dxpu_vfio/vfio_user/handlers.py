"""The answers to QEMU's requests: one handler per vfio-user command, ``(session, message)
-> reply payload``, looked up in :data:`HANDLERS` by the session's one dispatch.

A handler validates what the client sent before it acts (the client is not trusted): it
raises :class:`~dxpu_vfio.vfio_user.protocol.ProtocolError` (or ``ValueError``,
``OSError``) and the session answers with an error reply and goes on. Which commands may
carry descriptors, and how many, is :data:`FDS_ALLOWED`, checked before any handler runs.
"""

from __future__ import annotations

import errno
import os
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Protocol

from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.connection import Message
from dxpu_vfio.vfio_user.device_api import VfioDevice
from dxpu_vfio.vfio_user.dma import DmaTable
from dxpu_vfio.vfio_user.irq import EventfdIrqs

MAX_DMA_WINDOW = 8 << 40  # bytes: libvfio-user's MAX_DMA_SIZE
FDS_ALLOWED = {p.Command.DMA_MAP: 1, p.Command.DEVICE_SET_IRQS: p.MAX_MSG_FDS}  # every other command: none


@dataclass
class ServerOptions:
    """How a server answers; most of it is read by the handlers below."""

    advertise_write_multiple: bool = False
    allow_msix: bool = False  # QEMU 11.1 aborts on device_del of MSI-X vfio-user devices
    # the largest DMA window accepted: libvfio-user's MAX_DMA_SIZE (8 TiB), so that a client
    # that maps more (the remote proxy once mapped 2^48 bytes) fails against us as against it
    max_dma_window: int = MAX_DMA_WINDOW
    # refuse windows without a descriptor, like a server that needs fd-mapped guest memory
    # (tests: such a server cannot work behind a box)
    dma_needs_fd: bool = False
    # offer host-mappable BARs as mappable (False: every access of them is a message, as before)
    map_regions: bool = True


class HandlerSession(Protocol):
    """What a handler reads and changes of the session it answers for."""

    device: VfioDevice
    options: ServerOptions
    dma: DmaTable
    irqs: EventfdIrqs
    version_seen: bool  # VERSION was negotiated: every other request may come now
    windows_told: bool  # the device was told of a DMA window (dma_mapped)
    mapped_regions: set[int]  # regions offered to QEMU as mappable (with their memfd)


@dataclass
class Reply:
    """A handler's reply payload with descriptors to send along (the caller keeps them)."""

    payload: bytes
    fds: list[int]


def command_name(command: int) -> str:
    try:
        return p.Command(command).name
    except ValueError:
        return f"command {command}"


def _version(s: HandlerSession, msg: Message) -> bytes:
    theirs = p.Version.unpack(msg.payload)
    if theirs.major != 0:
        raise p.ProtocolError(f"unsupported vfio-user major version {theirs.major}", errno.ENOTSUP)
    s.version_seen = True
    caps = {"max_msg_fds": p.MAX_MSG_FDS, "max_data_xfer_size": p.MAX_DATA_XFER,
            "pgsizes": p.PAGE_SIZE, "max_dma_maps": s.dma.max_maps}
    if s.options.advertise_write_multiple:
        caps["write_multiple"] = True
    return p.Version(0, 0, caps).pack()


def _dma_map(s: HandlerSession, msg: Message) -> bytes:
    req = p.DmaMap.unpack(msg.payload)
    if len(msg.fds) > 1:
        raise p.ProtocolError(f"DMA_MAP with {len(msg.fds)} descriptors")
    if msg.fds and (req.size > sys.maxsize - p.PAGE_SIZE or req.offset > sys.maxsize - req.size - p.PAGE_SIZE):
        raise p.ProtocolError(f"DMA_MAP of {req.size:#x} bytes at file offset {req.offset:#x}: "
                              "beyond what a mapping can hold")
    if s.options.max_dma_window and req.size > s.options.max_dma_window:
        raise ValueError(f"DMA_MAP of {req.size:#x} bytes: windows are at most "
                         f"{s.options.max_dma_window:#x} bytes here")
    if s.options.dma_needs_fd and not msg.fds:
        raise ValueError(f"DMA_MAP of {req.address:#x}+{req.size:#x} without a file descriptor: "
                         "this server needs fd-mapped guest memory")
    fd = msg.fds.pop() if msg.fds else None
    s.dma.add(req.address, req.size, req.flags, fd, req.offset)
    if s.device.wants_dma_windows:  # a device that passes windows on (a box's external server)
        try:
            s.device.dma_mapped(req.address, req.size, req.flags)
        except BaseException:
            s.dma.remove(req.address, req.size)
            raise
        s.windows_told = True
    return b""


def _dma_unmap(s: HandlerSession, msg: Message) -> bytes:
    req = p.DmaUnmap.unpack(msg.payload)
    if req.flags & p.DMA_UNMAP_ALL:
        s.dma.clear()
    else:
        s.dma.remove(req.address, req.size)
    if s.device.wants_dma_windows:
        s.device.dma_unmapped(req.address, req.size, req.flags)
    return req.pack()


def _device_info(s: HandlerSession, msg: Message) -> bytes:
    # QEMU only logs a refused DMA_MAP (it sends them before GET_INFO, without waiting):
    # a device that cannot work with QEMU's windows fails the attach here instead
    refused = s.device.attach_error
    if refused:
        raise OSError(errno.EOPNOTSUPP, refused)
    return p.device_info_reply()


def _region_info(s: HandlerSession, msg: Message) -> bytes | Reply:
    """A region's size and rights; a mappable one (a host-mappable BAR whose memory the
    device shows: ``bar_memory(index)``) also gets VFIO_REGION_INFO_FLAG_MMAP, its memfd
    with the reply, and the sparse-mmap capability when the memory says only some
    ``areas`` may be mapped. QEMU then maps it into the guest and sends no more
    accesses for it (and sends every MMIO write of the device non-posted from then on)."""
    index = p.unpack_index(msg.payload, "GET_REGION_INFO")
    argsz = struct.unpack_from("<I", msg.payload)[0]
    if index >= p.NUM_REGIONS:
        raise p.ProtocolError(f"region {index} does not exist")
    device = s.device
    region = device.regions()[index]
    flags = (p.REGION_FLAG_READ if region.readable else 0) | (p.REGION_FLAG_WRITE if region.writable else 0)
    memory = device.bar_memory(index) if region.mappable and s.options.map_regions else None
    if memory is None or memory.fd < 0:
        return p.region_info_reply(index, region.size, flags)
    areas = memory.areas  # None: the whole region may be mapped
    reply = p.region_info_reply(index, region.size, flags | p.REGION_FLAG_MMAP, areas=areas, argsz=argsz)
    s.mapped_regions.add(index)
    return Reply(reply, [memory.fd])


IRQ_FLAGS = {p.IRQ_INTX: p.IRQ_INFO_EVENTFD | p.IRQ_INFO_MASKABLE | p.IRQ_INFO_AUTOMASKED,
             p.IRQ_MSI: p.IRQ_INFO_EVENTFD | p.IRQ_INFO_NORESIZE,
             p.IRQ_MSIX: p.IRQ_INFO_EVENTFD | p.IRQ_INFO_NORESIZE,
             p.IRQ_ERR: p.IRQ_INFO_EVENTFD, p.IRQ_REQ: p.IRQ_INFO_EVENTFD}


def _irq_info(s: HandlerSession, msg: Message) -> bytes:
    index = p.unpack_index(msg.payload, "GET_IRQ_INFO")
    if index >= p.NUM_IRQS:
        raise p.ProtocolError(f"irq index {index} does not exist")
    return p.irq_info_reply(index, s.irqs.counts.get(index, 0), IRQ_FLAGS[index])


def _set_irqs(s: HandlerSession, msg: Message) -> bytes:
    req = p.SetIrqs.unpack(msg.payload)
    if msg.fds and req.data_type != p.IRQ_DATA_EVENTFD:
        raise p.ProtocolError(f"SET_IRQS without eventfd data carries {len(msg.fds)} descriptors")
    fds, msg.fds = msg.fds, []
    try:
        leftover = s.irqs.set_irqs(req, fds)
    except p.ProtocolError:
        msg.fds = fds  # closed by the caller
        raise
    for fd in leftover:
        os.close(fd)
    return b""


def _region_read(s: HandlerSession, msg: Message) -> bytes:
    req = p.RegionAccess.unpack(msg.payload, write=False)
    device = s.device
    with device.lock:
        data = device.region_read(req.region, req.offset, req.count)
    return p.RegionAccess(req.region, req.offset, req.count, data).pack()


def _region_write(s: HandlerSession, msg: Message) -> bytes:
    req = p.RegionAccess.unpack(msg.payload, write=True)
    device = s.device
    with device.lock:
        device.region_write(req.region, req.offset, req.data, posted=msg.header.no_reply)
    return p.RegionAccess(req.region, req.offset, req.count).pack()


def _reset(s: HandlerSession, msg: Message) -> bytes:
    with s.device.lock:
        s.device.reset()
    return b""


def _not_supported(s: HandlerSession, msg: Message) -> bytes:
    raise p.ProtocolError(f"{command_name(msg.header.command)} is not supported", errno.ENOTSUP)


Handler = Callable[[HandlerSession, Message], bytes | Reply]

HANDLERS: dict[int, Handler] = {
    p.Command.VERSION: _version,
    p.Command.DMA_MAP: _dma_map,
    p.Command.DMA_UNMAP: _dma_unmap,
    p.Command.DEVICE_GET_INFO: _device_info,
    p.Command.DEVICE_GET_REGION_INFO: _region_info,
    p.Command.DEVICE_GET_REGION_IO_FDS: _not_supported,
    p.Command.DEVICE_GET_IRQ_INFO: _irq_info,
    p.Command.DEVICE_SET_IRQS: _set_irqs,
    p.Command.REGION_READ: _region_read,
    p.Command.REGION_WRITE: _region_write,
    p.Command.REGION_WRITE_MULTI: _not_supported,  # posted only: combined in Session._add_posted
    p.Command.DEVICE_RESET: _reset,
    p.Command.DIRTY_PAGES: _not_supported,
}
