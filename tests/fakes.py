"""Fakes shared by the unit tests (real ports are tested with QEMU elsewhere)."""

from __future__ import annotations


class RecordingIrqPort:
    """Records every interrupt the device signals, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def msi(self, vector: int) -> None:
        self.events.append(("msi", vector))

    def msix(self, vector: int) -> None:
        self.events.append(("msix", vector))

    def intx(self, level: bool) -> None:
        self.events.append(("intx", level))

    def take(self) -> list[tuple[str, object]]:
        events, self.events = self.events, []
        return events
