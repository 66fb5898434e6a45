"""The dxpu error hierarchy.

Every error says what went wrong, names the log or file to read, and, where the
user can fix it, what to run. Errors wrap their root cause (``__cause__``).
"""

from __future__ import annotations

from pathlib import Path


class DxpuError(Exception):
    """Base of every error dxpu raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None,
                 logs: list[Path] | None = None) -> None:
        self.message = message
        self.hint = hint
        self.logs = [Path(p) for p in (logs or [])]
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = self.message
        if self.logs:
            text += "\n  logs: " + ", ".join(str(p) for p in self.logs)
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text


class SetupError(DxpuError):
    """Something setup should have provided is missing or broken."""


class QemuNotFound(SetupError):
    """No QEMU with vfio-user-pci could be found."""


class ImageError(SetupError):
    """A guest image is missing, stale or corrupt."""


class VmError(DxpuError):
    """A VM could not be started, reached or stopped."""


class QemuStartError(VmError):
    """QEMU exited or never opened its monitor while starting."""


class GuestBootTimeout(VmError):
    """The guest did not reach its shell or agent in time."""


class GuestPanic(VmError):
    """The guest kernel panicked: always a failure, never a hang."""


class GuestCommandTimeout(VmError):
    """A command in the guest did not finish in time."""


class GuestCommandFailed(VmError):
    """A command in the guest exited non-zero where success was required."""

    def __init__(self, command: str, result: "object", **kw) -> None:
        self.command = command
        self.result = result
        super().__init__(f"guest command failed: {command!r}: {result}", **kw)
