"""The host side of the guest's accel runtime (``vm_images/tools/dxpu_accel.py``): copy it
into a guest and run its self-test or the AI workloads there (numpy in the full image
checks them), reading back its ``key=value`` lines; or load it here to drive a device
from the host side (:mod:`dxpu_vfio.lab.accel_workloads`)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from dxpu_vfio.lab import guest_output
from dxpu_vfio.paths import VM_IMAGES_DIR

GUEST_TOOL = VM_IMAGES_DIR / "tools" / "dxpu_accel.py"
WORKLOADS_MODULE = Path(__file__).with_name("accel_workloads.py")   # std-lib + numpy: runs in a guest too

# Runs in the guest: argv = passes, workload names (comma separated), then label=bdf per
# device; one line per workload and device, ``workload=<json of run_passes' result, with
# "device": label>``, or ``workload_failed=<json>`` and exit status 1 at the first whose
# numerics are off. With several devices their passes alternate, in an order that turns
# each pass (a, b, b, a, ...): a busy moment of this shared machine falls on both.
GUEST_RUNNER = """
import json, sys
sys.path.insert(0, "/tmp")
import dxpu_accel as rt
import accel_workloads as aw
passes, names = int(sys.argv[1]), sys.argv[2].split(",")
devices = dict(arg.split("=", 1) for arg in sys.argv[3:])
opened = {label: rt.Accel.open(bdf) for label, bdf in devices.items()}
for name in names:
    try:
        runners = {label: aw.Passes(aw.WORKLOADS[name](dev)) for label, dev in opened.items()}
        labels = list(runners)
        for i in range(passes):
            for label in (labels if i % 2 == 0 else labels[::-1]):
                runners[label].one()
        results = {label: runner.result() for label, runner in runners.items()}
    except AssertionError as exc:
        print("workload_failed=" + json.dumps({"workload": name, "error": str(exc)}))
        sys.exit(1)
    for label, result in results.items():
        print("workload=" + json.dumps({**result, "device": label}))
"""


@functools.cache
def load_runtime():
    """The guest runtime as a module of this process, to drive a device from the host side
    (through a vfio-user client in QEMU's place): the same code the guest runs."""
    spec = importlib.util.spec_from_file_location("dxpu_accel", GUEST_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def put(vm, path: str, text: str) -> None:
    """Write ``text`` to ``path`` in ``vm``."""
    vm.run(f"cat > {path} <<'DXPU_ACCEL_EOF'\n{text}\nDXPU_ACCEL_EOF")


def install(vm, path: str = "/tmp/dxpu_accel.py") -> str:
    """Copy the runtime into ``vm`` (a guest with python3: the full image); returns its path there."""
    put(vm, path, GUEST_TOOL.read_text(encoding="utf-8"))
    return path


def selftest(vm, bdf: str, sizes: list[int], timeout: float = 300) -> tuple[int, dict[str, str]]:
    """Run the runtime's self-test on the device at ``bdf`` in ``vm``: (exit status, its lines)."""
    path = install(vm)
    result = vm.run(f"python3 {path} --bdf {bdf} selftest --sizes {','.join(map(str, sizes))}",
                    check=False, timeout=timeout)
    return result.rc, guest_output.key_lines(result.stdout)


def workloads(vm, bdf: str, names: list[str], passes: int = 2, timeout: float = 900) -> dict[str, dict]:
    """Run the AI workloads ``names`` (of :data:`dxpu_vfio.lab.accel_workloads.WORKLOADS`)
    in ``vm`` through the runtime on the device at ``bdf``, each checking its results
    against numpy in the guest: {name: run_passes' result (median_s, max_abs_error, ...)}.
    RuntimeError naming the workload if a check failed or the run did not finish."""
    return compare(vm, {"device": bdf}, names, passes, timeout)["device"]


def compare(vm, bdfs: dict[str, str], names: list[str], passes: int = 2,
            timeout: float = 900) -> dict[str, dict[str, dict]]:
    """:func:`workloads` on several devices of ``vm`` at once ({label: bdf}), their passes
    alternating in one guest process: {label: {name: result}}. A ratio between two devices
    is then worth what two medians of the same minutes are; run one after the other, five
    passes each, the demo's remote / local swung from 0.89 to 1.75 between runs."""
    if not bdfs or any("=" in label or " " in label for label in bdfs):
        raise ValueError(f"device labels must be words without '=': {sorted(bdfs)}")
    install(vm)
    put(vm, "/tmp/accel_workloads.py", WORKLOADS_MODULE.read_text(encoding="utf-8"))
    put(vm, "/tmp/dxpu_accel_run.py", GUEST_RUNNER)
    devices = " ".join(f"{label}={bdf}" for label, bdf in bdfs.items())
    result = vm.run(f"python3 /tmp/dxpu_accel_run.py {passes} {','.join(names)} {devices}", check=False,
                    timeout=timeout)
    out, failed = guest_output.workload_lines(result.stdout, bdfs, "the accel runner")
    if failed is not None:
        raise RuntimeError(f"{failed['workload']} in the guest: its numerics are off: {failed['error']}")
    if result.rc != 0 or any(set(runs) != set(names) for runs in out.values()):
        done = {label: sorted(runs) for label, runs in out.items()}
        raise RuntimeError(f"the guest's workloads on {devices} did not finish (exit {result.rc}; done: "
                           f"{done}): {(result.stdout + result.stderr)[-2000:]}")
    return out
