"""Shared fixtures live in dxpu_vfio.testing: the VM ladder and factory, the lab factory
(labs, lab_factory) and devices served locally or from a GPU box (served_device)."""

pytest_plugins = ["dxpu_vfio.testing"]


# --- peer software built from a source checkout (libvfio-user) -------------------------
# No registry this project may reach ships libvfio-user, so a machine without its source
# (CI's) cannot build the peer: the suite then leaves the `peer` tests out and says so at
# the end; where the peer is built they run as any other test (and fail, naming what is
# missing, when asked for by name with `-m peer`).
def _peer_built() -> bool:
    from dxpu_vfio.paths import cache_dir
    return (cache_dir() / "libvfio-user" / "lvu-dma").exists()


def pytest_collection_modifyitems(config, items):
    if _peer_built() or "peer" in (config.getoption("-m") or ""):
        return
    left = [item for item in items if item.get_closest_marker("peer")]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not item.get_closest_marker("peer")]
        config._dxpu_peer_left = len(left)


def pytest_terminal_summary(terminalreporter, config):
    left = getattr(config, "_dxpu_peer_left", 0)
    if left:
        terminalreporter.write_line(
            f"peer software: {left} test(s) against libvfio-user not run: its source is not on this machine "
            "(git clone https://github.com/nutanix/libvfio-user ~/.cache/dxpu-vfio/src/libvfio-user, then "
            "scripts/build_libvfio_user.sh; docs/testing.md)", yellow=True)
