"""The host side of the guest's KMS client (``vm_images/tools/dxpu_kms.py``): copy it
into a guest, free the framebuffer from the text console, and the pattern it draws as
a screenshot shows it (to check the box's scanout pixel for pixel)."""

from __future__ import annotations

from dxpu_vfio.paths import VM_IMAGES_DIR

GUEST_TOOL = VM_IMAGES_DIR / "tools" / "dxpu_kms.py"


def pattern_rgb(width: int, height: int) -> bytes:
    """The guest tool's pattern (``pattern_row``: R = x, G = y, B = x ^ y, low 8 bits) as
    8-bit RGB rows."""
    return b"".join(bytes(c for x in range(width) for c in (x & 255, y & 255, (x ^ y) & 255))
                    for y in range(height))


def bind_console(vm, bound: bool) -> None:
    """Bind (or unbind) the guest's text console to the framebuffer: unbound, its
    blinking cursor no longer draws into a pattern written to /dev/fb0."""
    vm.run("for v in /sys/class/vtconsole/vtcon*; do grep -q 'frame buffer' $v/name && "
           f"echo {int(bound)} > $v/bind; done; true")


def install(vm, path: str = "/tmp/dxpu_kms.py") -> str:
    """Copy the KMS client into ``vm`` (a guest with python3); returns its path there."""
    source = GUEST_TOOL.read_text(encoding="utf-8")
    vm.run(f"cat > {path} <<'DXPU_KMS_EOF'\n{source}\nDXPU_KMS_EOF")
    return path
