"""Virtual PCIe devices that guests see: config space, BARs, interrupts, DMA port, device models."""

from .bars import BarKind, BarSpec
from .capabilities import CapabilityList, MsiState, walk_capabilities
from .config_space import ConfigSpace
from .device import IrqConfig, PcieLink, PciFunction, RegionInfo
from .header import PciIdentity
from .msix import MsixTable
from .ports import DmaError, DmaPort, IrqPort, NullDmaPort, NullIrqPort
from .sparse_memory import SparseMemory
from .testdev import TestDevice

__all__ = [
    "BarKind", "BarSpec", "CapabilityList", "ConfigSpace", "DmaError", "DmaPort",
    "IrqConfig", "IrqPort", "MsiState", "MsixTable", "NullDmaPort", "NullIrqPort",
    "PciFunction", "PciIdentity", "PcieLink", "RegionInfo", "SparseMemory", "TestDevice",
    "walk_capabilities",
]
