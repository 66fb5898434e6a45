"""Shared fixtures: the VM ladder and factory live in dxpu_vfio.testing."""

pytest_plugins = ["dxpu_vfio.testing"]
