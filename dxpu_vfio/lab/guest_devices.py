"""Finding, inside a guest, what its drivers made of a plugged device."""

from __future__ import annotations

from dxpu_vfio.vms.runner import Vm


def nvme_disk(vm: Vm, bdf: str, nsid: int = 1, timeout: int = 20) -> str:
    """The block device (e.g. ``nvme0n1``) of namespace ``nsid`` of the NVMe controller at
    ``bdf``, once the driver has made it. Linux numbers ``nvmeXnY`` in scan order, not by
    NSID (namespaces are scanned in parallel), so the NSID is looked up in sysfs."""
    return vm.run(f"i=0; while [ $i -lt {timeout * 10} ]; do "
                  f"for d in /sys/bus/pci/devices/{bdf}/nvme/nvme*/nvme*n*; do "
                  f"[ \"$(cat $d/nsid 2>/dev/null)\" = {nsid} ] && [ -e /dev/$(basename $d) ] && "
                  "{ basename $d; exit 0; }; done; sleep 0.1; i=$((i+1)); done; exit 1",
                  timeout=timeout + 10).stdout.strip()
