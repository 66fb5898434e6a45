"""Finding, inside a guest, what its drivers made of a plugged device, and driving it."""

from __future__ import annotations

from dxpu_vfio.lab import guest_output
from dxpu_vfio.vms.runner import Vm


def nvme_disk(vm: Vm, bdf: str, nsid: int = 1, timeout: int = 20) -> str:
    """The block device (e.g. ``nvme0n1``) of namespace ``nsid`` of the NVMe controller at
    ``bdf``, once the driver has made it. Linux numbers ``nvmeXnY`` in scan order, not by
    NSID (namespaces are scanned in parallel), so the NSID is looked up in sysfs."""
    return guest_output.word(vm.run(f"i=0; while [ $i -lt {timeout * 10} ]; do "
                  f"for d in /sys/bus/pci/devices/{bdf}/nvme/nvme*/nvme*n*; do "
                  f"[ \"$(cat $d/nsid 2>/dev/null)\" = {nsid} ] && [ -e /dev/$(basename $d) ] && "
                  "{ basename $d; exit 0; }; done; sleep 0.1; i=$((i+1)); done; exit 1",
                  timeout=timeout + 10).stdout, guest_output.NVME_DISK, "the guest's sysfs poll",
                             "NVMe disk")


def fio(vm: Vm, dev: str, rw: str, bs: str, depth: int, runtime: int, size_mib: int) -> dict:
    """One time-based fio job with direct I/O on ``/dev/{dev}`` (libaio, ``depth`` deep) in
    the guest: fio's JSON for the side it ran (``read`` for read/randread, else ``write``),
    its figures checked (:func:`dxpu_vfio.lab.guest_output.fio_side`)."""
    out = vm.run(f"fio --name=b --filename=/dev/{dev} --direct=1 --ioengine=libaio --iodepth={depth} --rw={rw} "
                 f"--bs={bs} --size={size_mib}M --runtime={runtime} --time_based --output-format=json",
                 timeout=runtime * 10 + 120).stdout
    return guest_output.fio_side(out, "read" if "read" in rw else "write")
