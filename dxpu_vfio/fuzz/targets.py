"""The fuzz targets by name (``scripts/fuzz.py --target``)."""

from __future__ import annotations

from typing import Callable

from dxpu_vfio.fuzz.box_answers import BoxAnswersTarget
from dxpu_vfio.fuzz.display import DisplayTarget
from dxpu_vfio.fuzz.etcd import EtcdAnswersTarget
from dxpu_vfio.fuzz import fault_replies, guest_output, manager_answers
from dxpu_vfio.fuzz.external import ExternalServerTarget
from dxpu_vfio.fuzz.guest_channel import GuestChannelTarget
from dxpu_vfio.fuzz.host_link import HostLinkTarget
from dxpu_vfio.fuzz.link import LinkTarget
from dxpu_vfio.fuzz.manager import ManagerTarget
from dxpu_vfio.fuzz.runner import Target
from dxpu_vfio.fuzz.vfio_user import VfioUserTarget

TARGETS: dict[str, Callable[[], Target]] = {
    "vfio-user": lambda: VfioUserTarget("testdev"),
    "vfio-user-nvme": lambda: VfioUserTarget("nvme"),
    "vfio-user-accel": lambda: VfioUserTarget("accel"),
    "vfio-user-display": DisplayTarget,
    "link": LinkTarget,
    "host-link": HostLinkTarget,
    "vfio-user-client": ExternalServerTarget,
    "manager": ManagerTarget,
    "etcd": EtcdAnswersTarget,
    "box-answers": BoxAnswersTarget,
    "guest-channel": GuestChannelTarget,
    "guest-output": guest_output.target,
    "fault-replies": fault_replies.target,
    "manager-answers": manager_answers.target,
}


def make_target(name: str) -> Target:
    return TARGETS[name]()
