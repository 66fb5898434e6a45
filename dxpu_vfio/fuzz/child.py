"""What every fuzz target shares: its server is one child process, ended by pid, and the
sessions it dropped are collected for the runner (:mod:`dxpu_vfio.fuzz.runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


def log_since(path: Path, pos: int) -> tuple[str, int]:
    """What the log at ``path`` gained past byte ``pos``, as text, and where it ends now
    (nothing new if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            new = f.read()
    except OSError:
        return "", pos
    return new.decode(errors="replace"), pos + len(new)


class Server(Protocol):
    """A server process handle (HostProxyProcess, RemoteProxyProcess, ManagerProcess)."""

    @property
    def pid(self) -> int | None: ...

    def alive(self) -> bool: ...

    def stop(self) -> object: ...


class ChildTarget:
    def __init__(self) -> None:
        self.process: Server | None = None
        self.log_path = Path("/nonexistent")
        self.drops: list[str] = []

    def _close(self) -> None:
        """End the target's own connections to the server (none by default)."""

    def stop(self) -> None:
        self._close()
        if self.process is not None:
            self.process.stop()
            self.process = None

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def take_drops(self) -> list[str]:
        drops, self.drops = self.drops, []
        return drops
