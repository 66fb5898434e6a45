"""The run directory in /tmp is shared ground: another local user may create it first."""

from __future__ import annotations

import json
import os

import pytest

from dxpu_vfio import registry
from dxpu_vfio.paths import UnsafeRunDir, run_dir
from dxpu_vfio.testing import needs_root


@pytest.fixture
def run_path(tmp_path, monkeypatch):
    path = tmp_path / "run"
    monkeypatch.setenv("DXPU_RUN", str(path))
    return path


def test_a_new_run_directory_is_private(run_path):
    assert run_dir() == run_path
    assert (run_path.stat().st_mode & 0o777) == 0o700


def test_a_run_directory_open_to_others_is_refused(run_path):
    run_path.mkdir()
    run_path.chmod(0o777)
    with pytest.raises(UnsafeRunDir, match="0777") as exc:
        run_dir()
    assert "chmod 700" in exc.value.hint


def test_a_run_directory_of_another_user_is_refused(run_path):
    needs_root("giving the directory to another user")
    run_path.mkdir(mode=0o700)
    os.chown(run_path, 65534, 65534)
    with pytest.raises(UnsafeRunDir, match="belongs to uid 65534") as exc:
        run_dir()
    assert "DXPU_RUN" in exc.value.hint


def test_a_link_in_place_of_the_run_directory_is_refused(run_path, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    run_path.symlink_to(elsewhere)
    with pytest.raises(UnsafeRunDir, match="not a directory"):
        run_dir()


def test_registry_entries_are_never_written_through_planted_links(run_path, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    entry = registry.entry_path("host", "dev", os.getpid())  # makes run/proxies
    entry.with_suffix(".tmp").symlink_to(victim)
    entry.symlink_to(victim)
    written = registry.register("host", "dev", tmp_path / "stats.json")
    assert victim.read_text() == "precious"
    assert not written.is_symlink() and json.loads(written.read_text())["pid"] == os.getpid()
    assert (written.stat().st_mode & 0o777) == 0o600
    registry.unregister(written)
