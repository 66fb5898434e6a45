"""What every test gets: its VMs' and labs' logs saved when it fails (a factory joins
them with :func:`register`), a failure when a process it ran logged a Python traceback,
and a SIGTERM that ends the run as Ctrl-C would, tearing every fixture down."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import pytest

from dxpu_vfio.paths import PROJECT_ROOT, run_dir
from dxpu_vfio.procs import exit_on_sigterm

RESULTS_DIR = Path(os.environ.get("DXPU_RESULTS", PROJECT_ROOT / "results"))


def _test_dir(nodeid: str) -> Path:
    return RESULTS_DIR / re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    factories = getattr(item, "_dxpu_factories", [])
    if report.failed and factories:
        dest = _test_dir(item.nodeid)
        saved = [p for f in factories for p in f.save_logs(dest)]
        if saved:
            report.sections.append(("dxpu logs", f"saved in {dest}: " + ", ".join(p.name for p in saved)))


TRACEBACK = b"Traceback (most recent call last)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_tracebacks(why): the test provokes a logged Python traceback on purpose")
    _stop_on_sigterm()


def _stop_on_sigterm() -> None:
    """A test run stopped by SIGTERM (CI's time limit, a user's kill) ends as after Ctrl-C:
    pytest.exit unwinds the running test and pytest then tears every fixture down, so the
    session's labs, VMs, proxies and etcd go by pid as after a clean run. Python's default
    would end the process at once and leave them all running (found when a CI run was
    stopped: a lab and two host proxies outlived it)."""
    def stop(code: int) -> None:
        pytest.exit("stopped by SIGTERM: fixtures torn down", returncode=code)

    exit_on_sigterm(stop)


def _log_sizes(root: Path) -> dict[Path, int]:
    """Every *.log under ``root`` and its size. os.walk, not rglob: a lab or VM directory
    removed during the walk (a teardown in another process) is skipped, not an error."""
    sizes = {}
    for folder, _dirs, files in os.walk(root, onerror=lambda _exc: None):
        for name in files:
            if name.endswith(".log"):
                path = Path(folder, name)
                try:
                    sizes[path] = path.stat().st_size
                except OSError:  # removed while we looked
                    pass
    return sizes


def _tracebacks(before: dict[Path, int], after: dict[Path, int]) -> list[str]:
    """'file: the line after Traceback' for each log that got a Python traceback."""
    found = []
    for path, size in after.items():
        start = before.get(path, 0) if before.get(path, 0) <= size else 0
        try:
            with open(path, "rb") as f:
                f.seek(start)
                text = f.read()
        except OSError:
            continue
        at = text.find(TRACEBACK)
        if at >= 0:
            last = text[at:].strip().splitlines()[-1].decode("utf-8", "replace")
            found.append(f"{path}: {last[:300]}")
    return found


@pytest.fixture(autouse=True)
def no_tracebacks_in_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """No uncaught exception in any proxy or manager (issue 18): after each test, the logs
    its processes wrote (under the run directory, and its tmp_path) are read, and a Python
    traceback in them fails the test, naming the file. A test that provokes one on purpose
    says so with ``@pytest.mark.allow_tracebacks("why")``. (Threads of this process: an
    uncaught exception there is an error by pyproject's filterwarnings.)"""
    root = run_dir()
    before = _log_sizes(root)
    yield
    if request.node.get_closest_marker("allow_tracebacks"):
        return
    found = _tracebacks(before, _log_sizes(root))
    funcargs = getattr(request.node, "funcargs", None)  # None once a stopped run tears it down
    tmp = funcargs.get("tmp_path") if funcargs else None
    if isinstance(tmp, Path):
        found += _tracebacks({}, _log_sizes(tmp))
    if found:
        pytest.fail("a process this test ran logged a Python traceback:\n  " + "\n  ".join(found), pytrace=False)


def register(request: pytest.FixtureRequest, factory) -> None:
    """Make a (possibly shared) factory's VMs or labs part of this test's failure logs
    (anything with ``save_logs(dest) -> list[Path]``)."""
    node = request.node
    if not hasattr(node, "_dxpu_factories"):
        node._dxpu_factories = []
    node._dxpu_factories.append(factory)

