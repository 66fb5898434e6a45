"""What the NVMe 1.4 specification names that the controller (:mod:`.nvme`) uses: register
offsets and bits, opcodes, Identify's CNS, log pages, features and completion statuses.
Numbers and names only; what the controller does with them is in nvme.py."""

from __future__ import annotations

import enum

# registers (BAR0), and the first doorbell (stride 4 bytes: CAP.DSTRD = 0)
CAP, VS, INTMS, INTMC, CC, CSTS, AQA, ASQ, ACQ = 0x00, 0x08, 0x0C, 0x10, 0x14, 0x1C, 0x24, 0x28, 0x30
CC_EN, CSTS_RDY, CSTS_CFS = 1, 1, 2
CSTS_SHST_OCCURRING, CSTS_SHST_DONE, CSTS_SHST = 1 << 2, 2 << 2, 3 << 2
DOORBELLS = 0x1000
OACS_DBBUF = 1 << 8  # Identify's OACS: Doorbell Buffer Config


class AdminOpcode(enum.IntEnum):
    """Admin commands (submission queue 0) that the Linux driver and nvme-cli send."""

    DELETE_SQ = 0x00
    CREATE_SQ = 0x01
    GET_LOG_PAGE = 0x02
    DELETE_CQ = 0x04
    CREATE_CQ = 0x05
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    KEEP_ALIVE = 0x18
    DOORBELL_BUFFER_CONFIG = 0x7C  # offered only where DMA reads are local (OACS bit 8)


class IoOpcode(enum.IntEnum):
    """NVM command set I/O commands."""

    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09


class IdentifyCns(enum.IntEnum):
    """Identify's CDW10.CNS: which data structure is asked for."""

    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NAMESPACES = 0x02  # ids above CDW1.NSID
    NAMESPACE_DESCRIPTORS = 0x03
    CS_CONTROLLER = 0x06  # I/O command set specific controller (CDW11.CSI); Linux asks for NVM's


class LogPage(enum.IntEnum):
    """Get Log Page's CDW10.LID."""

    ERROR = 0x01
    SMART = 0x02
    FIRMWARE_SLOT = 0x03
    COMMAND_EFFECTS = 0x05  # which commands are supported and what they change (Identify's LPA bit 1)


class Feature(enum.IntEnum):
    """Get/Set Features' CDW10.FID."""

    ARBITRATION = 0x01
    POWER_MANAGEMENT = 0x02
    TEMPERATURE_THRESHOLD = 0x04
    ERROR_RECOVERY = 0x05
    VOLATILE_WRITE_CACHE = 0x06
    NUMBER_OF_QUEUES = 0x07
    INTERRUPT_COALESCING = 0x08
    WRITE_ATOMICITY = 0x0A
    ASYNC_EVENT_CONFIG = 0x0B
    TIMESTAMP = 0x0E
    KEEP_ALIVE_TIMER = 0x0F
    HOST_THERMAL_MANAGEMENT = 0x10


class StatusType(enum.IntEnum):
    """Status Code Type (SCT), bits 10:8 of a completion's status field."""

    GENERIC = 0
    COMMAND_SPECIFIC = 1
    MEDIA = 2  # media and data integrity errors


_GENERIC, _SPECIFIC, _MEDIA = StatusType.GENERIC << 8, StatusType.COMMAND_SPECIFIC << 8, StatusType.MEDIA << 8
DNR = 1 << 14  # a completion's Do Not Retry bit (status field without the phase bit)


class Status(enum.IntEnum):
    """A completion's status field without the phase bit: ``SCT << 8 | SC``."""

    SUCCESS = _GENERIC | 0x00
    INVALID_OPCODE = _GENERIC | 0x01
    INVALID_FIELD = _GENERIC | 0x02
    DATA_TRANSFER_ERROR = _GENERIC | 0x04
    INTERNAL_ERROR = _GENERIC | 0x06
    ABORT_REQUESTED = _GENERIC | 0x07  # an Abort command took it before it started
    ABORTED_SQ_DELETION = _GENERIC | 0x08  # its SQ was deleted before it started
    INVALID_NAMESPACE = _GENERIC | 0x0B
    INVALID_PRP_OFFSET = _GENERIC | 0x13
    LBA_OUT_OF_RANGE = _GENERIC | 0x80  # NVM command set
    INVALID_CQ = _SPECIFIC | 0x00
    INVALID_QID = _SPECIFIC | 0x01
    INVALID_QUEUE_SIZE = _SPECIFIC | 0x02
    INVALID_VECTOR = _SPECIFIC | 0x08
    INVALID_LOG_PAGE = _SPECIFIC | 0x09
    INVALID_QUEUE_DELETION = _SPECIFIC | 0x0C  # a CQ that SQs still post to
    WRITE_FAULT = _MEDIA | 0x80  # the backing file did not take the data (full, I/O error)
    UNRECOVERED_READ_ERROR = _MEDIA | 0x81


class CommandError(Exception):
    """A command that fails with ``status``: its completion carries it."""

    def __init__(self, status: Status) -> None:
        super().__init__(f"status {status.name} ({status:#x})")
        self.status = status
