"""pytest support for dxpu-vfio, registered as a plugin by ``tests/conftest.py``
(``pytest_plugins = ["dxpu_vfio.testing"]``), which brings in each room below:

- :mod:`.reports`: what every test gets: its VMs' and labs' logs saved under
  ``results/<test>/`` when it fails, a failure when a process it ran logged a Python
  traceback, and a SIGTERM that tears every fixture down as Ctrl-C would;
- :mod:`.vms`: the VM ladder (image -> configured VM -> booted VM) and the factory that
  owns every VM a test starts and kills it by pid at teardown; guests shared by a module
  or a session;
- :mod:`.labs`: the lab factory that owns every lab of a session and brings them all down
  at its end; faults on demand on a lab's boxes (``lab_faults``);
- :mod:`.served`: devices served locally or from a GPU box of a lab (``served_device``),
  and the link stream a test runs over (``stream``);
- :mod:`.libvirt_vms`: libvirtd for the session and a libvirt domain per test;
- :mod:`.etcd`: etcd clusters on free ports (one member for the session, three for a test
  that kills members), ended by pid, and both pool stores (``stores``).

Every wait is bounded; a test that needs something absent fails naming it.
"""

from __future__ import annotations

import os

import pytest

from dxpu_vfio.procs import wait_until

pytest_plugins = ["dxpu_vfio.testing.reports", "dxpu_vfio.testing.vms", "dxpu_vfio.testing.labs",
                  "dxpu_vfio.testing.served", "dxpu_vfio.testing.libvirt_vms", "dxpu_vfio.testing.etcd"]


def eventually(predicate, timeout: float = 5.0, what: str = "condition", interval: float = 0.02) -> None:
    """Like :func:`~dxpu_vfio.procs.wait_until`, failing the test with ``what`` on timeout."""
    assert wait_until(predicate, timeout, interval), f"{what} did not happen within {timeout} s"


def needs_root(what: str) -> None:
    """Fail (not skip) a test that needs root where it runs as another user: a test that
    needs something absent fails naming it (the suite runs as root: scripts/test.sh)."""
    if os.geteuid() != 0:
        pytest.fail(f"{what} needs root: run the tests as root (scripts/test.sh)", pytrace=False)
