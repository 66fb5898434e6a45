"""Device models by name, for whoever serves them (device server, remote proxy, CLI)."""

from __future__ import annotations

from typing import Callable

from .accel import AccelDevice
from .device import PciFunction
from .display import DisplayAdapter
from .nvme import NvmeController
from .testdev import TestDevice

MODELS: dict[str, Callable[..., PciFunction]] = {
    "testdev": TestDevice,
    "nvme": NvmeController,
    "display": DisplayAdapter,
    "accel": AccelDevice,
}


def create_model(name: str, **settings: object) -> PciFunction:
    """A new device of model ``name``; settings are the model's constructor options."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown device model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    try:
        return factory(**settings)
    except TypeError as exc:
        raise ValueError(f"bad settings for {name}: {exc}") from exc
