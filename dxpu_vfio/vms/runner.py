"""The VM runner: one QEMU (q35) guest, from start to a guaranteed end.

Lifecycle, each step with a timeout: ``start()`` (QEMU running, QMP connected),
``wait_booted()`` (guest shell or agent answers), ``run()`` commands, then
``shutdown()`` which falls back to SIGKILL. QEMU is always ended by its pid.

Guest RAM is a shared memfd so that vfio-user DMA_MAP messages carry fds, and the
VM gets N ``pcie-root-port``s (rp1..rpN) to hot-plug into, each reserving windows
big enough for multi-GiB 64-bit prefetchable BARs, and a port I/O window
(:mod:`dxpu_vfio.vms.port_windows`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from dxpu_vfio.errors import GuestBootTimeout, GuestPanic, QemuStartError, VmError
from dxpu_vfio.paths import run_dir
from dxpu_vfio.procs import terminate
from dxpu_vfio.vmm.qmp import QmpSession
from dxpu_vfio.vmm.targets import SessionTarget
from dxpu_vfio.vms.guest_exec import (AgentChannel, CommandResult, GuestChannel, GuestDied, SerialChannel, run_checked,
                                      wait_ready)
from dxpu_vfio.vms.images import Image, load_image
from dxpu_vfio.vms.port_windows import io_reserve_bytes
from dxpu_vfio.vms.qemu import Qemu, find_qemu

PANIC_MARKERS = ("Kernel panic - not syncing", "---[ end Kernel panic")


@dataclass
class VmConfig:
    """Everything that decides how QEMU is started."""

    image: str = "tiny"
    name: str = "dxpu-vm"
    memory_mib: int = 1024
    cpus: int = 2
    accel: str = "tcg"  # "kvm" where KVM can run stock kernels
    root_ports: int = 4
    pref64_reserve: str = "16G"  # per root port: room for multi-GiB prefetchable BARs
    mem32_reserve: str = "64M"
    io_reserve: str = "4K"  # per root port: port I/O for hot-plugged devices with I/O BARs; "0": none
    edu: bool = False  # QEMU's own 'edu' test device, a local baseline for benchmarks
    cmdline: str | None = None  # kernel command line; None: the image's own
    extra_args: list[str] = field(default_factory=list)
    boot_timeout: float = 120.0


class VmState(Enum):
    CREATED = "created"
    RUNNING = "running"  # QEMU up, QMP connected
    BOOTED = "booted"  # guest answers commands
    STOPPED = "stopped"


class Vm:
    """A QEMU guest owned by this process; logs live in ``workdir``."""

    def __init__(self, config: VmConfig, workdir: Path | None = None,
                 qemu: Qemu | None = None, image: Image | None = None) -> None:
        self.config = config
        self.workdir = Path(workdir) if workdir else run_dir() / f"vm-{config.name}-{os.getpid()}"
        self._own_workdir = workdir is None  # made here: removed after a clean exit (kept for the logs otherwise)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.qemu = qemu or find_qemu()
        self.image = image or load_image(config.image)
        self.state = VmState.CREATED
        self.process: subprocess.Popen | None = None
        self.qmp = QmpSession(config.name)
        self.target = SessionTarget(self.qmp, config.name)  # hot-plug goes through VM control
        self.channel: GuestChannel | None = None
        self.boot_seconds: float | None = None
        self._started_at = 0.0
        self._serial_pos = 0
        self._panic_line: str | None = None
        # Processes serving this VM's devices (hot-plug adds them); ended with the VM.
        self.device_servers: list = []

    # --- paths -------------------------------------------------------------------
    @property
    def serial_log(self) -> Path:
        return self.workdir / "serial.log"

    @property
    def stderr_log(self) -> Path:
        return self.workdir / "qemu.stderr"

    @property
    def qmp_path(self) -> Path:
        return self.workdir / "qmp.sock"

    @property
    def admin_qmp_path(self) -> Path:
        """A second QMP monitor, free for admins and the pool manager (``dxpu attach PATH``)."""
        return self.workdir / "admin.sock"

    @property
    def channel_path(self) -> Path:
        return self.workdir / "guest.sock"

    @property
    def logs(self) -> list[Path]:
        return [self.serial_log, self.stderr_log]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def root_port_ids(self) -> list[str]:
        return [f"rp{i}" for i in range(1, self.config.root_ports + 1)]

    # --- command line ------------------------------------------------------------
    def command_line(self) -> list[str]:
        c, img = self.config, self.image
        io_reserve = io_reserve_bytes(c.io_reserve, c.root_ports)
        args = [
            str(self.qemu.binary), "-name", c.name,
            "-machine", f"q35,accel={c.accel},memory-backend=mem",
            "-cpu", "max" if c.accel == "tcg" else "host",
            "-smp", str(c.cpus), "-m", f"{c.memory_mib}M",
            "-object", f"memory-backend-memfd,id=mem,size={c.memory_mib}M,share=on",
            "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none",
            "-kernel", str(img.kernel), "-initrd", str(img.initrd), "-append", c.cmdline or img.cmdline,
            "-serial", f"file:{self.serial_log}",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-qmp", f"unix:{self.admin_qmp_path},server=on,wait=off",
        ]
        for i, port in enumerate(self.root_port_ids(), start=1):
            args += ["-device", f"pcie-root-port,id={port},bus=pcie.0,chassis={i},slot={i},"
                                f"addr={0x10 + i:#x},io-reserve={io_reserve},mem-reserve={c.mem32_reserve},"
                                f"pref64-reserve={c.pref64_reserve}"]
        chardev = f"socket,id=guestch,path={self.channel_path},server=on,wait=off"
        if img.kind == "disk":
            args += ["-drive", f"file={img.disk},if=none,id=root,format=raw,snapshot=on",
                     "-device", "virtio-blk-pci,drive=root,addr=0x3",
                     "-chardev", chardev, "-device", "virtio-serial-pci,id=vser,addr=0x4",
                     "-device", "virtserialport,chardev=guestch,name=org.qemu.guest_agent.0"]
        else:
            args += ["-chardev", chardev, "-serial", "chardev:guestch"]
        if c.edu:
            args += ["-device", "edu,addr=0x5"]
        return args + list(c.extra_args)

    # --- lifecycle ---------------------------------------------------------------
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def panicked(self) -> bool:
        """True once the serial log shows a kernel panic (the guest then hangs, panic=0).

        Reads only what the log gained since the last call, so waits can ask often.
        """
        if self._panic_line is None:
            try:
                with open(self.serial_log, "rb") as f:
                    f.seek(max(0, self._serial_pos - 200))  # a marker may straddle reads
                    chunk = f.read()
                    self._serial_pos = f.tell()
            except OSError:
                return False
            text = chunk.decode(errors="replace")
            for line in text.splitlines():
                if any(marker in line for marker in PANIC_MARKERS):
                    self._panic_line = line.strip()
                    break
        return self._panic_line is not None

    def guest_alive(self) -> bool:
        """QEMU runs and its guest has not panicked: what every wait checks."""
        return self.alive() and not self.panicked()

    def start(self) -> "Vm":
        """Start QEMU and connect QMP; raises :class:`QemuStartError` naming the logs."""
        if self.state is not VmState.CREATED:
            raise VmError(f"VM {self.config.name} was already started")
        for stale in (self.qmp_path, self.admin_qmp_path, self.channel_path):
            stale.unlink(missing_ok=True)
        argv = self.command_line()
        (self.workdir / "qemu.cmdline").write_text(shlex.join(argv) + "\n")
        self._started_at = time.monotonic()
        with open(self.stderr_log, "wb") as err:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                            stdout=err, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            self.qmp.connect(self.qmp_path, timeout=30, alive=self.alive)
        except VmError as exc:
            self.kill()
            raise QemuStartError(f"QEMU failed to start: {self._stderr_tail() or exc.message}",
                                 logs=[self.stderr_log, self.workdir / "qemu.cmdline"]) from exc
        self.state = VmState.RUNNING
        return self

    def wait_booted(self, timeout: float | None = None) -> "Vm":
        """Wait until the guest runs commands; a panic or QEMU exit fails at once."""
        timeout = timeout or self.config.boot_timeout
        deadline = self._started_at + timeout
        kind = AgentChannel if self.image.kind == "disk" else SerialChannel
        channel = kind(self.channel_path, self.guest_alive)
        try:
            if wait_ready(channel, deadline):
                self.channel = channel
                self.state = VmState.BOOTED
                self.boot_seconds = time.monotonic() - self._started_at
                return self
        except GuestDied as exc:
            raise self._death_error("while booting") from exc
        channel.close()
        if not self.guest_alive():
            raise self._death_error("while booting")
        raise GuestBootTimeout(f"guest {self.config.name} ({self.image.name}) did not reach its "
                               f"{'agent' if kind is AgentChannel else 'shell'} within {timeout:.0f} s",
                               logs=self.logs)

    def reset(self, timeout: float | None = None) -> "Vm":
        """QMP system_reset, then wait until the guest answers again."""
        if self.channel is None:
            raise VmError(f"VM {self.config.name} is not booted")
        self.qmp.execute("system_reset")
        self._started_at = time.monotonic()
        timeout = timeout or self.config.boot_timeout
        try:
            while time.monotonic() - self._started_at < timeout:
                if self.channel.ping(3.0):
                    return self
        except GuestDied as exc:
            raise self._death_error("while rebooting") from exc
        raise GuestBootTimeout(f"guest {self.config.name} did not come back within {timeout:.0f} s "
                               "of system_reset", logs=self.logs)

    def boot(self, timeout: float | None = None) -> "Vm":
        return self.start().wait_booted(timeout)

    def run(self, script: str, timeout: float = 60, check: bool = True) -> CommandResult:
        """Run a shell script in the guest; ``check`` raises on a non-zero exit."""
        if self.state is not VmState.BOOTED or self.channel is None:
            raise VmError(f"VM {self.config.name} is not booted (state {self.state.value})")
        return run_checked(self.channel, script, timeout, check, self._death_error, self.logs)

    def spawn(self, script: str) -> int:
        """Start a script in the guest without waiting (full image: guest agent only)."""
        if not isinstance(self.channel, AgentChannel):
            raise VmError(f"VM {self.config.name}: background guest commands need the full image")
        try:
            return self.channel.spawn(script)
        except GuestDied as exc:
            raise self._death_error(f"while starting {script!r}") from exc

    def wait(self, pid: int, timeout: float) -> CommandResult:
        """Wait for a script started with :meth:`spawn`."""
        assert isinstance(self.channel, AgentChannel)
        try:
            return self.channel.wait(pid, timeout)
        except GuestDied as exc:
            raise self._death_error(f"while waiting for guest pid {pid}") from exc

    def serial_text(self) -> str:
        try:
            return self.serial_log.read_text(errors="replace")
        except OSError:
            return ""

    def _stderr_tail(self) -> str:
        try:
            return self.stderr_log.read_text(errors="replace").strip()[-600:]
        except OSError:
            return ""

    def _death_error(self, when: str) -> VmError:
        """Explain why the guest is gone: a kernel panic (QEMU is then killed), or QEMU itself."""
        if self.panicked():
            self.kill()
            return GuestPanic(f"guest {self.config.name} panicked {when}: {self._panic_line}", logs=self.logs)
        if self.process:
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.state = VmState.STOPPED
        code = self.process.returncode if self.process else None
        return VmError(f"QEMU of {self.config.name} exited (code {code}) {when}: "
                       f"{self._stderr_tail()}", logs=self.logs)

    def shutdown(self, timeout: float = 30) -> bool:
        """Power the guest off from inside; if it does not stop in time, kill QEMU.

        Returns True if the guest powered off by itself. Idempotent.
        """
        clean = False
        if self.alive() and self.channel is not None:
            try:
                self.channel.request_poweroff()
                self.process.wait(timeout)
                clean = True
            except Exception:  # noqa: BLE001 - any failure falls back to kill
                pass
        self.kill()
        return clean

    def release(self) -> int:
        """Let QEMU run on without this object (``dxpu lab up``); returns its pid."""
        pid = self.pid
        if self.channel:
            self.channel.close()
            self.channel = None
        self.qmp.close()
        self.process = None  # never killed by this object again
        self.state = VmState.STOPPED
        return pid

    def kill(self) -> None:
        """End QEMU by its pid (SIGTERM, then SIGKILL), then the device servers it used."""
        if self.channel:
            self.channel.close()
            self.channel = None
        terminate(self.process)
        for server in self.device_servers:
            server.stop()
        self.device_servers.clear()
        self.qmp.close()
        for sock in (self.qmp_path, self.admin_qmp_path, self.channel_path):
            sock.unlink(missing_ok=True)
        self.state = VmState.STOPPED

    def __enter__(self) -> "Vm":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.kill()
        stopped = isinstance(exc_type, type) and issubclass(exc_type, SystemExit)  # SIGTERM, sys.exit: not a failure
        if (exc_type is None or stopped) and self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
