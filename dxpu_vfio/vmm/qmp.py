"""A blocking face on qemu.qmp's asyncio client, for code and tests that are not async.

qemu.qmp runs in an event loop on a thread of its own; every call here is submitted to
that loop with a timeout. Every event QEMU sends is kept in :attr:`QmpSession.history`
(saved with a failed test's logs). To wait for an event caused by a command, open an
:meth:`QmpSession.listen` block *before* sending the command, so the event cannot be
missed: ``with qmp.listen("DEVICE_DELETED") as ev: qmp.execute("device_del", ...); ev.wait(...)``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from qemu.qmp import EventListener, ExecuteError, QMPClient

from dxpu_vfio.errors import DxpuError, VmError


class QmpError(DxpuError):
    """A QMP command failed: carries the command sent and what QEMU answered."""

    def __init__(self, message: str, *, command: str, arguments: dict | None,
                 response: Any = None, **kw: Any) -> None:
        self.command = command
        self.arguments = arguments
        self.response = response
        super().__init__(f"{message} (sent {command} {arguments or {}}; got {response!r})", **kw)


class QmpTimeout(QmpError):
    """QEMU did not answer a command, or an awaited event did not come, in time."""


class EventWaiter:
    """Events of some names that arrived since the ``listen`` block opened."""

    def __init__(self, session: "QmpSession", listener: EventListener) -> None:
        self._session = session
        self._listener = listener

    def wait(self, timeout: float, match: Callable[[dict], bool] = lambda ev: True) -> dict:
        """The first matching event; :class:`QmpTimeout` if none comes in ``timeout`` s."""
        async def next_match() -> dict:
            while True:
                event = await self._listener.get()
                if match(event):
                    return dict(event)

        names = sorted(self._listener.names or [])
        try:
            return self._session._call(asyncio.wait_for(next_match(), timeout), timeout + 5)
        except (asyncio.TimeoutError, FutureTimeout) as exc:
            raise QmpTimeout(f"no {'/'.join(names)} event within {timeout:.1f} s",
                             command="(event wait)", arguments=None) from exc


class QmpSession:
    """One QMP connection to one QEMU, usable from any thread."""

    def __init__(self, name: str = "dxpu") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"qmp-{name}",
                                        daemon=True)
        self._thread.start()
        self._client = QMPClient(name)
        self.history: list[dict] = []
        self._history_task: asyncio.Task | None = None
        self.connected = False

    def _call(self, coro: Any, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise

    def connect(self, path: Path, timeout: float, alive: Callable[[], bool]) -> None:
        """Connect to QEMU's QMP socket, retrying while QEMU is alive and starting."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline and alive():
            if Path(path).exists():
                try:
                    self._call(self._client.connect(str(path)), 10)
                    self.connected = True
                    self._history_task = self._call(self._spawn_history(), 5)
                    return
                except Exception as exc:  # noqa: BLE001 - retried, then reported
                    last = exc
            time.sleep(0.02)
        raise VmError(f"could not connect to QMP at {path} within {timeout:.0f} s"
                      + (f": {last}" if last else "") + ("" if alive() else " (QEMU exited)"))

    async def _spawn_history(self) -> asyncio.Task:
        return asyncio.create_task(self._record_events())

    async def _cancel_history(self) -> None:
        if self._history_task:
            self._history_task.cancel()
            await asyncio.gather(self._history_task, return_exceptions=True)

    async def _record_events(self) -> None:
        listener = EventListener()
        with self._client.listen(listener):
            async for event in listener:
                self.history.append(dict(event))

    def execute(self, command: str, arguments: dict | None = None, timeout: float = 30) -> Any:
        """Run one QMP command and return its ``return`` value."""
        if not self.connected:
            raise QmpError("QMP is not connected", command=command, arguments=arguments)
        try:
            return self._call(self._client.execute(command, arguments), timeout)
        except ExecuteError as exc:
            raise QmpError(f"QMP {command} failed: {exc.error_class}: {exc}",
                           command=command, arguments=arguments,
                           response=dict(exc.received)) from exc
        except FutureTimeout as exc:
            raise QmpTimeout(f"QMP {command} got no answer within {timeout:.0f} s",
                             command=command, arguments=arguments) from exc
        except Exception as exc:  # connection lost, QEMU gone ...
            raise QmpError(f"QMP {command} failed: {type(exc).__name__}: {exc}",
                           command=command, arguments=arguments) from exc

    def hmp(self, command_line: str, timeout: float = 30) -> str:
        """A human-monitor command (for what QMP lacks, e.g. ``info pci``)."""
        return self.execute("human-monitor-command", {"command-line": command_line}, timeout)

    @contextmanager
    def listen(self, *names: str) -> Iterator[EventWaiter]:
        """Register interest in events *before* the command that causes them."""
        listener = EventListener(names=names or None)
        self._call(self._register(listener), 5)
        try:
            yield EventWaiter(self, listener)
        finally:
            self._loop.call_soon_threadsafe(self._client.remove_listener, listener)

    async def _register(self, listener: EventListener) -> None:
        self._client.register_listener(listener)

    def close(self) -> None:
        """Disconnect and stop the loop thread; safe to call more than once."""
        if self._thread.is_alive():
            if self.connected:
                try:
                    self._call(self._client.disconnect(), 5)
                except Exception:  # noqa: BLE001 - QEMU may already be gone
                    pass
            self._call(self._cancel_history(), 5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.connected = False
