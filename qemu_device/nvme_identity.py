"""What the NVMe controller (:mod:`.nvme`) reports about itself: Identify's data
structures and the log pages, built from its settings and counters, and the fixed
limits they announce. Pure functions: the controller's command handling stays apart
from the bytes it answers with, and each answer can be checked on its own."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Protocol

from .nvme_spec import AdminOpcode, CommandError, IdentifyCns, IoOpcode, LogPage, Status

IDENTIFY_SIZE = PAGE = 4096  # an Identify data structure; the memory page (CC.MPS = 0)
LBA_SHIFT = 9  # 512-byte blocks
MDTS = 5  # max transfer 2^5 pages = 128 KiB
ABORT_LIMIT = 3  # Identify's ACL: Aborts outstanding at once, minus one (Linux sends up to ACL + 1)


class NamespaceFacts(Protocol):
    """What Identify tells of a namespace."""

    blocks: int  # its size in LBAs of 1 << LBA_SHIFT bytes
    uuid: bytes  # 16 bytes: its NGUID and its UUID descriptor


def identify(cns: int, nsid: int, csi: int, *, serial: str, oacs: int,
             namespaces: Mapping[int, NamespaceFacts]) -> bytes:
    """Identify's answer to CNS ``cns`` (CDW10) for namespace ``nsid`` (CDW1) and command
    set ``csi`` (CDW11): one 4 KiB data structure, or a CommandError."""
    out = bytearray(IDENTIFY_SIZE)
    if cns == IdentifyCns.CONTROLLER:
        struct.pack_into("<HH", out, 0, 0x1B36, 0x1B36)
        out[4:24] = serial.ljust(20).encode()[:20]
        out[24:64] = b"dxpu-vfio pooled NVMe".ljust(40)
        out[64:72] = b"1.0".ljust(8)
        out[72], out[77] = 6, MDTS
        struct.pack_into("<HI", out, 78, 1, 0x00010400)  # CNTLID, VER
        struct.pack_into("<H", out, 256, oacs)  # OACS
        out[258], out[259] = ABORT_LIMIT, 3  # ACL, AERL
        out[260] = 0x02  # FRMW: one slot
        out[261] = 0x02 | 0x04  # LPA: the Commands Supported and Effects log; extended data (NUMDU, LPO)
        out[512], out[513] = 0x66, 0x44  # SQES, CQES
        struct.pack_into("<I", out, 516, len(namespaces))  # NN
        struct.pack_into("<H", out, 520, (1 << 2) | (1 << 3))  # ONCS: DSM, Write Zeroes
        out[525] = 1  # VWC: a volatile write cache, so the host flushes
        nqn = f"nqn.2026-11.io.dxpu:nvme:{serial}".encode()
        out[768:768 + len(nqn)] = nqn
    elif cns == IdentifyCns.NAMESPACE:
        ns = namespaces.get(nsid)
        if ns is None:
            raise CommandError(Status.INVALID_NAMESPACE)
        struct.pack_into("<QQQ", out, 0, ns.blocks, ns.blocks, ns.blocks)
        out[26] = 0  # FLBAS: format 0
        out[33] = 0x01 | 0x08  # DLFEAT: deallocated blocks read zero; Write Zeroes' DEAC bit works
        struct.pack_into("<HBB", out, 128, 0, LBA_SHIFT, 0)  # LBAF0: 512 B, no metadata
        out[104:120] = ns.uuid  # NGUID
    elif cns == IdentifyCns.ACTIVE_NAMESPACES:
        ids = [n for n in sorted(namespaces) if n > nsid][:1024]
        struct.pack_into(f"<{len(ids)}I", out, 0, *ids)
    elif cns == IdentifyCns.CS_CONTROLLER:
        if csi != 0:  # only the NVM command set; its limits (VSL, WZSL, DMRL ...) all 0: none beyond MDTS
            raise CommandError(Status.INVALID_FIELD)
    elif cns == IdentifyCns.NAMESPACE_DESCRIPTORS:
        ns = namespaces.get(nsid)
        if ns is None:
            raise CommandError(Status.INVALID_NAMESPACE)
        out[0:4] = bytes([3, 16, 0, 0])  # NIDT uuid, NIDL 16
        out[4:20] = ns.uuid
    else:
        raise CommandError(Status.INVALID_FIELD)
    return bytes(out)


def log_page(cdw10: int, cdw11: int, offset: int, *, bytes_read: int, bytes_written: int) -> bytes:
    """Get Log Page's answer: the page CDW10.LID names, from byte ``offset``, as long as
    CDW10/CDW11 ask (in dwords, at most a page), or a CommandError."""
    lid = cdw10 & 0xFF
    length = ((((cdw11 & 0xFFFF) << 16) | (cdw10 >> 16)) + 1) * 4
    if offset & 3:
        raise CommandError(Status.INVALID_FIELD)
    if lid == LogPage.ERROR:  # no errors
        page = bytes(64)
    elif lid == LogPage.SMART:  # SMART / health
        smart = bytearray(512)
        struct.pack_into("<H", smart, 1, 300)  # composite temperature, K
        smart[3], smart[4] = 100, 10  # available spare %, threshold
        read_units = bytes_read // 512000
        write_units = bytes_written // 512000
        struct.pack_into("<QQ", smart, 32, read_units, write_units)
        page = bytes(smart)
    elif lid == LogPage.FIRMWARE_SLOT:
        fw = bytearray(512)
        fw[0] = 1
        fw[8:16] = b"1.0".ljust(8)
        page = bytes(fw)
    elif lid == LogPage.COMMAND_EFFECTS:  # CSUPP for what is served; LBCC for what changes blocks
        effects = bytearray(4096)
        for op in AdminOpcode:
            struct.pack_into("<I", effects, op * 4, 1)
        for op in IoOpcode:
            changes = op in (IoOpcode.WRITE, IoOpcode.WRITE_ZEROES, IoOpcode.DATASET_MANAGEMENT)
            struct.pack_into("<I", effects, 1024 + op * 4, 1 | (2 if changes else 0))
        page = bytes(effects)
    else:
        raise CommandError(Status.INVALID_LOG_PAGE)
    if offset >= len(page):
        raise CommandError(Status.INVALID_FIELD)
    return page[offset:offset + length].ljust(min(length, PAGE), b"\0")
