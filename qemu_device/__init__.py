"""Virtual PCIe devices that guests see: config space, BARs, interrupts, DMA port, device models."""
