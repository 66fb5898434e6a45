"""The host side of the guest's accel runtime (``vm_images/tools/dxpu_accel.py``): copy it
into a guest and run its self-test there, reading back its ``key=value`` lines; or load
it here to drive a device from the host side (:mod:`dxpu_vfio.lab.accel_workloads`)."""

from __future__ import annotations

import functools
import importlib.util

from dxpu_vfio.paths import VM_IMAGES_DIR

GUEST_TOOL = VM_IMAGES_DIR / "tools" / "dxpu_accel.py"


@functools.cache
def load_runtime():
    """The guest runtime as a module of this process, to drive a device from the host side
    (through a vfio-user client in QEMU's place): the same code the guest runs."""
    spec = importlib.util.spec_from_file_location("dxpu_accel", GUEST_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install(vm, path: str = "/tmp/dxpu_accel.py") -> str:
    """Copy the runtime into ``vm`` (a guest with python3: the full image); returns its path there."""
    source = GUEST_TOOL.read_text(encoding="utf-8")
    vm.run(f"cat > {path} <<'DXPU_ACCEL_EOF'\n{source}\nDXPU_ACCEL_EOF")
    return path


def parse_lines(text: str) -> dict[str, str]:
    """``key=value [more]`` lines as {key: "value [more]"}; other lines are left out."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key and " " not in key:
            out[key] = value
    return out


def selftest(vm, bdf: str, sizes: list[int], timeout: float = 300) -> tuple[int, dict[str, str]]:
    """Run the runtime's self-test on the device at ``bdf`` in ``vm``: (exit status, its lines)."""
    path = install(vm)
    result = vm.run(f"python3 {path} --bdf {bdf} selftest --sizes {','.join(map(str, sizes))}",
                    check=False, timeout=timeout)
    return result.rc, parse_lines(result.stdout)


def mlp(vm, bdf: str, batch: int = 64, width: int = 256, layers: int = 3, repeat: int = 5,
        timeout: float = 300) -> dict:
    """Time MLP inference in ``vm`` on the device at ``bdf`` (the runtime's ``mlp``):
    {"batch", "median_ms", "min_ms", "max_abs_error", "match", ...}; raises if it failed."""
    path = install(vm)
    result = vm.run(f"python3 {path} --bdf {bdf} mlp --batch {batch} --width {width} --layers {layers} "
                    f"--repeat {repeat}", check=False, timeout=timeout)
    lines = parse_lines(result.stdout)
    out: dict = {k.removeprefix("mlp_"): v for k, v in lines.items() if k.startswith("mlp_")}
    if result.rc != 0 or not out:
        raise RuntimeError(f"the guest's MLP on {bdf} failed (exit {result.rc}): {result.stdout[-2000:]}")
    for key in ("batch", "width", "layers", "nonzero"):
        out[key] = int(out[key])
    for key in ("median_ms", "min_ms", "max_abs_error"):
        out[key] = float(out[key])
    out["match"] = out["match"] == "True"
    return out
