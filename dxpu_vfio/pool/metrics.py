"""Prometheus text exposition of the pool: box health, device counts, per-device counters.

The per-device counters come from each lease's host proxy (its SIGUSR1 stats): what
QEMU asked of the device (vfio-user messages), what crossed the link (waiting reads,
posted writes, DMA bytes, interrupts) and what was refused.
"""

from __future__ import annotations

from collections import Counter

from dxpu_vfio.pool.store import Store

HELP = {
    "dxpu_box_up": ("gauge", "1 if the GPU box answers its heartbeat"),
    "dxpu_box_last_seen_seconds": ("gauge", "unix time of the box's last heartbeat answer"),
    "dxpu_devices": ("gauge", "devices in the pool by box, class and state"),
    "dxpu_lease_info": ("gauge", "one series per lease: which device which VM holds"),
    "dxpu_device_messages_total": ("counter", "vfio-user messages QEMU sent the host proxy, by command"),
    "dxpu_device_link_total": ("counter", "host proxy counters of the device's link (reads, posted writes, ...)"),
    "dxpu_device_dma_bytes_total": ("counter", "guest memory the device read or wrote through the link"),
    "dxpu_device_link_up": ("gauge", "1 while the host proxy's link to the box is up"),
}


def _labels(**labels: object) -> str:
    def esc(value: object) -> str:
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def render(store: Store, proxy_stats: dict[str, dict | None]) -> str:
    samples: dict[str, list[str]] = {name: [] for name in HELP}

    def add(name: str, value: float, **labels: object) -> None:
        samples[name].append(f"{name}{_labels(**labels)} {value}")

    for box in store.boxes():
        add("dxpu_box_up", int(box["state"] == "up"), box=box["name"])
        add("dxpu_box_last_seen_seconds", round(box["last_seen"], 3), box=box["name"])
    counts = Counter((d["box"], d["class"], "leased" if d["lease"] else "free" if d["available"] else "unavailable")
                     for d in store.devices())
    for (box, cls, state), n in sorted(counts.items()):
        add("dxpu_devices", n, box=box, **{"class": cls}, state=state)
    for lease in store.leases():
        base = {"lease": lease.id, "device": lease.device, "vm": lease.vm}
        add("dxpu_lease_info", 1, **base, state=lease.state)
        stats = proxy_stats.get(lease.id)
        if not stats:
            continue
        for command, c in sorted(((stats.get("server") or {}).get("commands") or {}).items()):
            add("dxpu_device_messages_total", c["count"], **base, command=command)
        device = stats.get("device") or {}
        for key, value in sorted(device.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if key.startswith("dma_bytes_"):
                    add("dxpu_device_dma_bytes_total", value, **base, direction=key.removeprefix("dma_bytes_"))
                else:
                    add("dxpu_device_link_total", value, **base, counter=key)
        if isinstance(device.get("link"), dict):
            add("dxpu_device_link_up", int(bool(device["link"].get("up"))), **base)
    lines = []
    for name, (kind, text) in HELP.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples[name]]
    return "\n".join(lines) + "\n"
