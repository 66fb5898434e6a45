"""dxpu-vfio: a software DxPU for QEMU VMs (vfio-user, network link, pool manager)."""

__version__ = "0.1.0"
