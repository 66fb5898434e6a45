"""Prometheus text exposition of the pool: box health, device counts, per-device counters.

The per-device counters come from each lease's host proxy (its SIGUSR1 stats): what
QEMU asked of the device (vfio-user messages), what crossed the link (waiting reads,
posted writes, DMA bytes, interrupts) and what was refused. ``prometheus_client``
writes the text; the families are built afresh from the store at every scrape.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dxpu_vfio.pool.states import BoxState
from dxpu_vfio.pool.storage import PoolStore

LEASE_LABELS = ["lease", "device", "vm"]


class PoolCollector:
    """One scrape: the store's boxes, devices and leases, and the proxies' counters
    (``proxy_stats``: lease id -> the proxy's stats, None where it did not answer)."""

    def __init__(self, store: PoolStore, proxy_stats: dict[str, dict | None]) -> None:
        self.store = store
        self.proxy_stats = proxy_stats

    def collect(self) -> Iterator[Metric]:
        box_up = GaugeMetricFamily("dxpu_box_up", "1 if the GPU box answers its heartbeat", labels=["box"])
        last_seen = GaugeMetricFamily("dxpu_box_last_seen_seconds", "unix time of the box's last heartbeat answer",
                                      labels=["box"])
        for box in self.store.boxes():
            box_up.add_metric([box["name"]], int(box["state"] == BoxState.UP))
            last_seen.add_metric([box["name"]], round(box["last_seen"], 3))
        devices = GaugeMetricFamily("dxpu_devices", "devices in the pool by box, class and state",
                                    labels=["box", "class", "state"])
        counts = Counter((d["box"], d["class"], "leased" if d["lease"] else "free" if d["available"] else "unavailable")
                         for d in self.store.devices())
        for labels, n in sorted(counts.items()):
            devices.add_metric(list(labels), n)
        info = GaugeMetricFamily("dxpu_lease_info", "one series per lease: which device which VM holds",
                                 labels=LEASE_LABELS + ["state"])
        messages = CounterMetricFamily("dxpu_device_messages_total",
                                       "vfio-user messages QEMU sent the host proxy, by command",
                                       labels=LEASE_LABELS + ["command"])
        link = CounterMetricFamily("dxpu_device_link_total",
                                   "host proxy counters of the device's link (reads, posted writes, ...)",
                                   labels=LEASE_LABELS + ["counter"])
        dma = CounterMetricFamily("dxpu_device_dma_bytes_total", "guest memory the device read or wrote through the link",
                                  labels=LEASE_LABELS + ["direction"])
        link_up = GaugeMetricFamily("dxpu_device_link_up", "1 while the host proxy's link to the box is up",
                                    labels=LEASE_LABELS)
        for lease in self.store.leases():
            base = [lease.id, lease.device, lease.vm]
            info.add_metric(base + [lease.state], 1)
            stats = self.proxy_stats.get(lease.id)
            if not stats:
                continue
            server = stats.get("server") or {}
            counts = Counter({command: c["count"] for command, c in (server.get("commands") or {}).items()})
            counts.update(server.get("forwarded") or {})  # the ones the native forwarder handled in C
            for command, n in sorted(counts.items()):
                messages.add_metric(base + [command], n)
            device = stats.get("device") or {}
            for key, value in sorted(device.items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if key.startswith("dma_bytes_"):
                        dma.add_metric(base + [key.removeprefix("dma_bytes_")], value)
                    else:
                        link.add_metric(base + [key], value)
            if isinstance(device.get("link"), dict):
                link_up.add_metric(base, int(bool(device["link"].get("up"))))
        yield from (box_up, last_seen, devices, info, messages, link, dma, link_up)


def render(store: PoolStore, proxy_stats: dict[str, dict | None]) -> str:
    """The text a Prometheus scrape of ``/metrics`` gets (format 0.0.4)."""
    return generate_latest(PoolCollector(store, proxy_stats)).decode()
