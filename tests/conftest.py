"""Shared fixtures live in dxpu_vfio.testing: the VM ladder and factory, the lab factory
(labs, lab_factory) and devices served locally or from a GPU box (served_device)."""

pytest_plugins = ["dxpu_vfio.testing"]
