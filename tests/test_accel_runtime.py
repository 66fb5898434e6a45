"""The guest runtime (vm_images/tools/dxpu_accel.py) driving the accel device without a
VM: through our vfio-user client in QEMU's place, with a memfd as guest RAM, served
locally (the device in the vfio-user server) and from a GPU box (a remote proxy process
over TCP + mutual TLS, the host proxy forwarding); and the box's inventory and the
pool's allocation by class ``accel``."""

from __future__ import annotations

import gc
import importlib.util
import os
import signal
import socket
import time

import numpy as np
import pytest
from fakes import map_guest_memory

from dxpu_vfio import registry
from dxpu_vfio.lab.accel_workloads import MlpTrainStep, TransformerBlock
from dxpu_vfio.hostproxy.forwarder import connect_remote
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.paths import VM_IMAGES_DIR
from dxpu_vfio.procs import wait_until
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.testing import needs_root
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient
from dxpu_vfio.vfio_user.server import VfioUserServer
from qemu_device import accel as ac

GUEST = 0x1_0000_0000
MEM = 32 << 20
BOX = f"abox{os.getpid()}"


def load_runtime():
    spec = importlib.util.spec_from_file_location("dxpu_accel", VM_IMAGES_DIR / "tools" / "dxpu_accel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rt = load_runtime()


class ClientMmio:
    """BAR0 through the vfio-user client; writes posted, as QEMU sends MMIO writes."""

    def __init__(self, client: VfioUserClient) -> None:
        self.client, self.bdf = client, "client"

    def read32(self, offset: int) -> int:
        return self.client.read32(0, offset)

    def write32(self, offset: int, value: int) -> None:
        self.client.write32(0, offset, value, posted=True)


class NonPostedMmio(ClientMmio):
    """BAR0 writes that wait for their completion, as a VMM that does not post them sends."""

    def write32(self, offset: int, value: int) -> None:
        self.client.write32(0, offset, value, posted=False)


class BurstMmio(ClientMmio):
    """Posted writes, but while ``held`` is a list the doorbell writes gather there and leave
    in one socket write (:meth:`release`): a guest that rang them in a burst, which the host
    proxy finds buffered one behind the other."""

    held: list[bytes] | None = None

    def write32(self, offset: int, value: int) -> None:
        if offset == rt.REG_DOORBELL and self.held is not None:
            access = p.RegionAccess(0, offset, 4, value.to_bytes(4, "little")).pack()
            self.held.append(p.message(0x7F00 + len(self.held), p.Command.REGION_WRITE, access, no_reply=True))
            return
        super().write32(offset, value)

    def release(self) -> None:
        burst, self.held = self.held or [], None
        self.client.conn.send(b"".join(burst))


def open_runtime(client: VfioUserClient, mmio: type = ClientMmio):
    ram = map_guest_memory(client, GUEST, MEM)
    cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
    client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
    return rt.Accel(mmio(client), rt.MappedMemory(ram, GUEST), timeout=20), ram


def close_ram(handle: list, ram) -> None:
    """The runtime's buffers are views of the memfd mapping: drop them (pytest keeps the
    fixture's value, ``handle``, until teardown ends), then unmap."""
    handle.clear()
    gc.collect()
    try:
        ram.close()
    except BufferError:   # a failed test's traceback still holds a buffer: unmapped when it goes
        pass


@pytest.fixture
def local(tmp_path):
    device = ac.AccelDevice(vram_size=64 << 20)
    server = VfioUserServer(device, tmp_path / "accel.sock", name="accel").start()
    client = VfioUserClient(server.socket_path)
    dev, ram = open_runtime(client)
    handle = [dev, device]
    del dev
    yield handle
    client.close()
    server.stop()
    close_ram(handle, ram)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", BOX])
    return d


@pytest.fixture
def box(tmp_path, certs):
    port = free_port()
    config = tmp_path / f"{BOX}.toml"
    config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{certs}"\n'
                      '[[device]]\nid = "acc0"\nmodel = "accel"\nlease = "lease-acc0"\n'
                      'settings = { vram_size = 67108864 }\n')
    proc = RemoteProxyProcess(config).start()
    proc.address = f"127.0.0.1:{port}"
    yield proc
    proc.stop()


@pytest.fixture
def remote(tmp_path, box, certs):
    device = connect_remote(box.address, "acc0", "lease-acc0", TlsFiles.in_dir(certs, "host"))
    server = VfioUserServer(device, tmp_path / "host.sock", name="fwd").start()
    client = VfioUserClient(server.socket_path)
    dev, ram = open_runtime(client)
    handle = [dev, device]
    del dev
    yield handle
    client.close()
    server.stop()
    close_ram(handle, ram)


def test_runtime_speaks_the_models_register_map():
    for name in dir(rt):
        if name.startswith(("REG_", "OP_", "FLAG_", "CONTROL_", "STATUS_", "DTYPE_")):
            assert getattr(rt, name) == getattr(ac, name), name
    assert (rt.ID_VALUE, rt.VENDOR_ID, rt.DEVICE_ID, rt.ENTRY_SIZE) == (ac.ID_VALUE, ac.VENDOR_ID, ac.DEVICE_ID, ac.ENTRY_SIZE)
    assert rt.ENTRY.size == ac.ENTRY.size


def test_selftest_locally(local):
    dev, device = local
    lines = []
    assert rt.selftest(dev, [4096, 1 << 20, 16 << 20], out=lines.append), lines
    assert device.stats()["errors"] == 1          # the self-test's deliberate one


def test_a_batch_is_one_doorbell_and_one_fetch(local):
    dev, device = local
    s = dev.stream()
    x = dev.malloc(4096)
    before = device.stats()
    for i in range(100):
        s.fill(x, 4, i)
    s.synchronize()
    after = device.stats()
    assert after["doorbells"] - before["doorbells"] == 1 and after["fetches"] - before["fetches"] == 1
    assert int.from_bytes(dev.memcpy_dtoh(x, 4), "little") == 99


def test_small_copies_travel_in_the_ring_and_large_ones_by_dma(local):
    """A copy to VRAM of at most ``inline_max`` bytes is a COPY_INLINE: the doorbell's ring
    fetch brings it, no DMA read of its own (on a box: no round trip of its own). Many of
    them wrap the ring; a larger copy is still a DMA read."""
    dev, device = local
    assert dev.caps & rt.CAP_INLINE and dev.inline_max == 256 << 10 and dev.ring_size == 16384
    x = dev.malloc(2 << 20)
    rng = np.random.default_rng(5)
    s = dev.stream()
    before = device.stats()
    chunks = [rng.bytes(n) for n in (1, 63, 64, 65, 4096, 64 << 10, 256 << 10)] * 4   # 1.3 MB: the ring (1 MiB) wraps
    at = 0
    for chunk in chunks:
        s.memcpy_htod(x + at, chunk)
        at += len(chunk)
    s.synchronize()
    after = device.stats()
    assert after["copy_reads"] == before["copy_reads"] and after["doorbells"] - before["doorbells"] >= 2
    assert after["inline_bytes"] - before["inline_bytes"] == at
    assert dev.memcpy_dtoh(x, at) == b"".join(chunks)
    big = rng.bytes((256 << 10) + 1)
    dev.memcpy_htod(x, big)
    assert device.stats()["copy_reads"] == after["copy_reads"] + 1 and dev.memcpy_dtoh(x, len(big)) == big
    before = device.stats()
    reads, read32 = [], dev.mmio.read32
    dev.mmio.read32 = lambda offset: reads.append(offset) or read32(offset)
    try:
        for i in range(12):     # 12 passes of 4098 entries round a 16384-entry ring: one doorbell each, and
            s.memcpy_htod(x, chunks[6])     # no RING_HEAD read (a round trip): the fences say where HEAD is
            s.synchronize()
    finally:
        dev.mmio.read32 = read32
    assert device.stats()["doorbells"] - before["doorbells"] == 12 and rt.REG_RING_HEAD not in reads


def test_copies_from_a_scattered_host_buffer(local):
    """A host buffer of 4 KiB pages in reverse order: copies go through scatter lists."""
    dev, _ = local
    pages = 300                                    # more than one scatter-list page holds
    base = dev.host_alloc(pages * 4096)
    scattered = rt.HostBuffer(base.view, [(base.segments[0][0] + (pages - 1 - i) * 4096, 4096) for i in range(pages)])
    data = os.urandom(pages * 4096)
    for i in range(pages):                         # the bytes of "page i" live in memory page pages-1-i
        base.view[(pages - 1 - i) * 4096:(pages - i) * 4096] = data[i * 4096:(i + 1) * 4096]
    ptr = dev.malloc(len(data))
    s = dev.stream()
    s.memcpy_htod(ptr, scattered)
    s.synchronize()
    assert dev.memcpy_dtoh(ptr, len(data)) == data


def mlp_forward(dev, x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Linear + bias + ReLU per layer (no ReLU after the last), one stream, one sync."""
    assert x.dtype == np.float32 and all(w.dtype == b.dtype == np.float32 for w, b in layers)
    s = dev.stream()
    batch, width = x.shape
    cur = dev.malloc(x.nbytes)
    s.memcpy_htod(cur, x)
    for i, (w, b) in enumerate(layers):
        pw, pb, out = dev.malloc(w.nbytes), dev.malloc(b.nbytes), dev.malloc(4 * batch * w.shape[1])
        s.memcpy_htod(pw, w)
        s.memcpy_htod(pb, b)
        s.gemm(out, cur, pw, batch, w.shape[1], width)
        s.bias_add(out, out, pb, batch, w.shape[1])
        if i < len(layers) - 1:
            s.relu(out, out, batch * w.shape[1])
        cur, width = out, w.shape[1]
    s.synchronize()
    return np.frombuffer(dev.memcpy_dtoh(cur, 4 * batch * width), dtype=np.float32).reshape(batch, width)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_mlp_inference_matches_numpy(local, batch):
    dev, _ = local
    rng = np.random.default_rng(batch)
    layers = [((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), rng.standard_normal(b).astype(np.float32))
              for a, b in ((256, 512), (512, 512), (512, 10))]
    x = rng.standard_normal((batch, 256)).astype(np.float32)
    want = x
    for i, (w, b) in enumerate(layers):
        want = want @ w + b
        if i < len(layers) - 1:
            want = np.maximum(want, 0)
    np.testing.assert_allclose(mlp_forward(dev, x, layers), want, rtol=1e-4, atol=1e-4)


def test_selftest_and_mlp_from_a_box_over_tls(remote):
    dev, forwarder = remote
    lines = []
    assert rt.selftest(dev, [4096, 1 << 20], out=lines.append), lines
    rng = np.random.default_rng(1)
    layers = [(rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32))]
    x = rng.standard_normal((8, 64)).astype(np.float32)
    np.testing.assert_allclose(mlp_forward(dev, x, layers), x @ layers[0][0] + layers[0][1], rtol=1e-4, atol=1e-4)
    assert forwarder.stats()["dma_bytes_read"] > 1 << 20   # the box fetched the data from "guest" memory


def through_the_forwarder(tmp_path, box, certs, mmio: type, body) -> None:
    """``body(function, dev)`` with the runtime driving the box's acc0 through a host proxy's
    C forwarder (QEMU's place taken by our client), then everything closed."""
    function = connect_remote(box.address, "acc0", "lease-acc0", TlsFiles.in_dir(certs, "host"))
    if not function.endpoint.native:
        pytest.fail("the native link stream is not built: run scripts/setup.sh")
    server = VfioUserServer(function, tmp_path / "host.sock", name="fwd").start()
    client = VfioUserClient(server.socket_path)
    try:
        dev, ram = open_runtime(client, mmio)
        body(function, dev)
        handle = [dev]
        del dev
    finally:
        client.close()
        server.stop()
    close_ram(handle, ram)


@pytest.mark.parametrize("mmio", [ClientMmio, NonPostedMmio], ids=["posted", "non-posted"])
def test_a_boxs_ring_fetches_come_with_their_doorbells(tmp_path, box, certs, mmio):
    """The host's C forwarder sends each doorbell's new entries just before it (DMA_PUSH),
    whether the doorbell write is posted or not, so the box's ring fetches wait for no round
    trip; the results are still exact."""
    def body(function, dev) -> None:
        box_before = box.stats()["devices"]["acc0"]
        link_before = function.stats()["link"]
        ptr = dev.malloc(4096)
        for i in range(20):
            dev.memcpy_htod(ptr, np.full(1024, i, np.float32))
            assert (np.frombuffer(dev.memcpy_dtoh(ptr, 4096), np.float32) == i).all()
        link = function.stats()["link"]
        native = link["native"]
        box_after = box.stats()["devices"]["acc0"]
        assert native["pushes"] >= 40 and native["pushes_empty"] == 0, native
        # a push and its doorbell leave in one write(2): one wake-up of the box's reader (a
        # heartbeat or two may add their own)
        pushes = native["pushes"] - link_before["native"].get("pushes", 0)
        writes = link["stream"]["writes"] - link_before["stream"]["writes"]
        assert writes <= pushes + 4, f"{writes} writes for {pushes} pushes and their doorbells"
        assert box_after["pushed_reads"] - box_before["pushed_reads"] >= 40, box_after
        assert box_after["dma_read_requests"] == box_before["dma_read_requests"], "a ring fetch went to the network"
        # the box's reader took each push in C with the doorbell behind it (native/serve.c),
        # none went round its Python loop as a message of its own
        taken = [b["link"]["handled"].get("DMA_PUSH", {}).get("count", 0) for b in (box_before, box_after)]
        assert taken[1] - taken[0] >= 40, box_after["link"]["handled"]
        assert box_after["link"]["received"].get("DMA_PUSH", 0) == 0, box_after["link"]["received"]
    through_the_forwarder(tmp_path, box, certs, mmio, body)


def test_a_256_kib_input_goes_to_a_box_with_its_doorbell(tmp_path, box, certs):
    """An input of up to 256 KiB (a transformer block's at sequence 256, an MLP batch of 64)
    is an inline copy, and the host pushes it with the doorbell: the box's device asks the
    network for nothing before it computes. One byte more is a DMA read of the buffer."""
    def body(function, dev) -> None:
        assert dev.inline_max == 256 << 10
        ptr = dev.malloc(1 << 20)
        rng = np.random.default_rng(11)
        before = box.stats()["devices"]["acc0"]
        data = rng.bytes(256 << 10)
        dev.memcpy_htod(ptr, data)
        after = box.stats()["devices"]["acc0"]
        assert after["dma_read_requests"] == before["dma_read_requests"], "the inline copy went to the network"
        assert after["pushed_reads"] > before["pushed_reads"]
        assert after["device"]["inline_bytes"] - before["device"]["inline_bytes"] == len(data)
        assert dev.memcpy_dtoh(ptr, len(data)) == data
        before = box.stats()["devices"]["acc0"]
        data = rng.bytes((256 << 10) + 1)
        dev.memcpy_htod(ptr, data)
        after = box.stats()["devices"]["acc0"]
        assert after["device"]["copy_reads"] == before["device"]["copy_reads"] + 1
        assert after["dma_read_requests"] > before["dma_read_requests"]
        assert dev.memcpy_dtoh(ptr, len(data)) == data
    through_the_forwarder(tmp_path, box, certs, ClientMmio, body)


def test_a_burst_of_doorbells_is_one_push_and_one_doorbell_on_the_link(tmp_path, box, certs):
    """A ring's doorbell carries its tail: when the host finds doorbells buffered one behind
    the other, only the last goes to the box, after one push of every entry they announce
    (the box's reader takes one of each, not five); every command of the burst runs."""
    def body(function, dev) -> None:
        ptr = dev.malloc(4 * 4096)
        dev.synchronize()
        stats_before = function.stats()
        native_before = stats_before["link"]["native"]
        box_before = box.stats()["devices"]["acc0"]["device"]
        dev.mmio.held = []
        stream = dev.stream()
        for i in range(4):
            stream.fill(ptr + i * 4096, 4096, 0x01010101 * (i + 1))
            stream.flush()                   # a doorbell each
        event = stream.record()              # and the fence's
        assert len(dev.mmio.held) == 5
        dev.mmio.release()
        event.synchronize(timeout=10)
        stats = function.stats()
        native = stats["link"]["native"]
        box_after = box.stats()["devices"]["acc0"]["device"]
        assert native["pushes"] - native_before["pushes"] == 1, native
        # what the host proxy reports as sent: one link message for the five doorbells
        assert stats["posted_messages"] - stats_before["posted_messages"] == 1, stats
        assert stats["writes_posted"] - stats_before["writes_posted"] == 5, stats
        assert box_after["doorbells"] - box_before["doorbells"] == 1, box_after
        assert box_after["entries"] - box_before["entries"] == 5, box_after
        assert native["doorbells_merged"] - native_before.get("doorbells_merged", 0) == 4, native
        for i in range(4):
            assert dev.memcpy_dtoh(ptr + i * 4096, 4096) == bytes([i + 1]) * 4096
    through_the_forwarder(tmp_path, box, certs, BurstMmio, body)


def test_a_second_qemu_session_gets_its_own_entries_not_the_first_ones(tmp_path, box, certs):
    """QEMU's session ending resets the device, which withdraws its ring from the host; the
    next session's guest memory is another memfd whose ring holds other entries at the same
    addresses, and its copies come back exact: nothing pushed for the first is served."""
    function = connect_remote(box.address, "acc0", "lease-acc0", TlsFiles.in_dir(certs, "host"))
    server = VfioUserServer(function, tmp_path / "host.sock", name="fwd").start()
    try:
        for session in range(2):
            client = VfioUserClient(server.socket_path)
            dev, ram = open_runtime(client)
            ptr = dev.malloc(4096)
            for i in range(5 + 3 * session):        # the sessions' tails differ
                dev.memcpy_htod(ptr, np.full(1024, 10 * session + i, np.float32))
                assert (np.frombuffer(dev.memcpy_dtoh(ptr, 4096), np.float32) == 10 * session + i).all()
            assert set(function.rings) == {0}, "the enabled ring is not watched"
            handle = [dev]
            del dev
            client.close()
            close_ram(handle, ram)
            assert server.wait_idle(5), "the first session did not end"
            assert wait_until(lambda: not function.rings, 5), "the reset ring is still watched"
    finally:
        server.stop()


def test_the_runtimes_own_mlp_checks_itself(local):
    dev, device = local
    result = rt.mlp_inference(dev, batch=8, width=64, layers=3, repeat=3)
    assert result["match"] and result["max_abs_error"] < 1e-4 and result["median_ms"] > 0
    assert result["nonzero"] > 64 // 4               # ReLU left a real result to compare
    assert device.stats()["opcodes"]["0x10"] == 9


def test_an_error_is_raised_and_cleared(local):
    dev, _ = local
    s = dev.stream()
    s.raw(0x77)
    with pytest.raises(rt.AccelError, match="bad opcode") as info:
        s.synchronize(timeout=5)
    assert info.value.code == ac.ERR_BAD_OPCODE and info.value.opcode == 0x77
    dev.clear_error()
    s.synchronize(timeout=5)
    dev.check()


def test_box_inventory_says_accel_and_the_pool_allocates_it_by_class(box, certs, tmp_path):
    from dxpu_vfio.pool.boxes import fetch_inventory
    from dxpu_vfio.pool.store import Store
    inventory = fetch_inventory(box.address, str(certs))
    [acc] = inventory["devices"]
    assert acc == {"id": "acc0", "class": "accel", "vendor": "1b36", "model": "10f2", "capacity": 64 << 20,
                   "in_use": False}
    store = Store(str(tmp_path / "pool.db"))
    try:
        store.register_box(BOX, box.address, None, [
            {**acc, "lease": "t0"}, {"id": "td0", "class": "testdev", "vendor": "1b36", "model": "10f0",
                                     "capacity": 1 << 20, "lease": "t1"}])
        [lease] = store.allocate("vm1", device_class="accel")
        assert lease.device == f"{BOX}/acc0"
    finally:
        store.close()


def test_pagemap_memory_gives_physical_segments():
    needs_root("reading physical frame numbers from /proc/self/pagemap")
    memory = rt.PagemapMemory(huge=False)
    buf = memory.alloc(5 * 4096 + 1)
    assert sum(n for _, n in buf.segments) == 6 * 4096 and all(a % 4096 == 0 and a for a, _ in buf.segments)
    assert len(memory.alloc(4096, contiguous=True).segments) == 1
    with pytest.raises(ValueError, match="contiguous"):
        memory.alloc(8192, contiguous=True)


def test_vram_allocator_reuses_and_merges():
    alloc = rt.VramAllocator(4096, align=256)
    a, b, c = alloc.malloc(100), alloc.malloc(256), alloc.malloc(1000)
    assert (a, b, c) == (0, 256, 512)
    alloc.free(b)
    alloc.free(a)
    assert alloc.malloc(512) == 0                  # the two holes merged
    with pytest.raises(MemoryError):
        alloc.malloc(4096)


def test_fence_naps_are_fine_grained_and_the_threads_timer_slack_comes_back():
    """A nap while a fence is awaited runs at a 1 µs timer slack (a 50 µs sleep took up to 180
    µs at Linux's default 50 µs slack); the thread's own slack is back when the wait ends."""
    before = rt._prctl(rt.FineSleep.PR_GET_TIMERSLACK, 0)
    assert before > rt.FineSleep.SLACK_NS, "this test needs a thread whose timer slack is above 1 µs"
    with rt.FineSleep() as nap:
        assert rt._prctl(rt.FineSleep.PR_GET_TIMERSLACK, 0) == before   # no nap yet: untouched
        nap(0.00005)
        assert rt._prctl(rt.FineSleep.PR_GET_TIMERSLACK, 0) == rt.FineSleep.SLACK_NS
    assert rt._prctl(rt.FineSleep.PR_GET_TIMERSLACK, 0) == before


def test_the_box_killed_mid_kernel_ends_the_wait_with_an_error(remote, box):
    """The guest program neither hangs nor gets a result: the host proxy completes its
    reads with all-ones once the box is gone, and the runtime says the device is gone."""
    dev, _ = remote
    n = 1536                                       # a GEMM of ~0.2 s on the box's numpy
    a = dev.malloc(4 * n * n)
    s = dev.stream()
    s.gemm(a, a, a, n, n, n)
    s.gemm(a, a, a, n, n, n)
    event = s.record()
    box.signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(rt.DeviceGone):
        event.synchronize(timeout=15)
    assert time.monotonic() - started < 10


def test_a_box_killed_by_a_signal_leaves_no_registry_entry_once_stopped(box):
    """A SIGKILLed box cannot remove its entry in the run directory's registry: the parent
    that stops it sweeps it, so no test (or lab) leaves one behind for the next."""
    entry = registry.find(box.pid, "remote")
    assert entry is not None, "the box did not register"
    path = registry.entry_path("remote", entry["name"], box.pid)
    assert path.exists()
    box.signal(signal.SIGKILL)
    box.stop()
    assert not path.exists()


def test_reset_while_work_is_queued_cancels_it_and_the_device_works_on(local):
    dev, device = local
    n = 1024
    a = dev.malloc(4 * n * n)
    s = dev.stream()
    for _ in range(20):
        s.gemm(a, a, a, n, n, n)                   # seconds of work queued
    s.flush()
    dev.reset()                                    # engine reset: the queue is dropped
    assert device.wait_idle(5)
    x = dev.malloc(4)
    s2 = dev.stream()
    s2.fill(x, 4, 42)
    s2.synchronize(timeout=10)
    assert int.from_bytes(dev.memcpy_dtoh(x, 4), "little") == 42
    assert device.stats()["opcodes"].get("0x10", 0) <= 2


def test_the_vmm_going_away_with_work_in_flight_leaves_a_clean_device(tmp_path):
    """What hot-unplug does to the server: QEMU's connection ends while the ring still
    holds seconds of GEMMs. The device is reset (the queue dropped), and the next
    connection finds it clean and working."""
    device = ac.AccelDevice(vram_size=64 << 20)
    server = VfioUserServer(device, tmp_path / "accel.sock", name="accel").start()
    try:
        for round_ in range(2):
            client = VfioUserClient(server.socket_path)
            dev, ram = open_runtime(client)
            x = dev.malloc(4)
            assert int.from_bytes(dev.memcpy_dtoh(x, 4), "little") == 0     # VRAM clean
            dev.memcpy_htod(x, (7).to_bytes(4, "little"))
            n = 1024
            a = dev.malloc(4 * n * n)
            s = dev.stream()
            for _ in range(20):
                s.gemm(a, a, a, n, n, n)
            s.flush()
            client.close()
            assert server.wait_idle(10), "the session did not end after its client left"  # as after device_del:
            assert device.wait_idle(10)  # the next connection is refused until it has
            del dev, s
            gc.collect()
            ram.close()
        assert device.stats()["opcodes"].get("0x10", 0) <= 4          # the queues were dropped
    finally:
        server.stop()


class OnDevice:
    """float32 arrays in VRAM by name, for the workload tests."""

    def __init__(self, dev) -> None:
        self.dev, self.ptr, self.shape = dev, {}, {}

    def put(self, s, name: str, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array, dtype=np.float32)
        self.ptr[name], self.shape[name] = self.dev.malloc(array.nbytes), array.shape
        s.memcpy_htod(self.ptr[name], array)
        return self.ptr[name]

    def new(self, name: str, *shape: int) -> int:
        self.ptr[name], self.shape[name] = self.dev.malloc(4 * int(np.prod(shape))), shape
        return self.ptr[name]

    def get(self, name: str) -> np.ndarray:
        shape = self.shape[name]
        return np.frombuffer(self.dev.memcpy_dtoh(self.ptr[name], 4 * int(np.prod(shape))), dtype=np.float32).reshape(shape)


@pytest.mark.parametrize("seq", [16, 64])
def test_a_transformer_block_forward_matches_numpy(local, seq):
    """Pre-LN, one head: LN, Q/K/V, softmax(Q K^T / sqrt(d)) V, output projection,
    residual; LN, GELU MLP, residual. All on the device, one doorbell: the workload that
    scripts/bench_accel.py and the sweep run (dxpu_vfio/lab/accel_workloads.py), small."""
    dev, _ = local
    block = TransformerBlock(dev, seq, d=64, f=256, seed=seq)
    s = dev.stream()
    block.push(s)
    s.synchronize()
    assert block.check() < 1e-2  # check() itself fails beyond rtol/atol 1e-3 against numpy


def test_an_mlp_training_step_matches_numpy(local):
    """Forward, MSE loss gradient, backward (ReLU), SGD update of all four parameters: the
    benchmark's MlpTrainStep (dxpu_vfio/lab/accel_workloads.py), small; its check replays
    the step in numpy and compares the parameters."""
    dev, _ = local
    step = MlpTrainStep(dev, batch=32, inputs=48, hidden=64, outputs=8)
    s = dev.stream()
    step.push(s)
    s.synchronize()
    step.check()
    for name, before in step.start.items():
        after = np.frombuffer(dev.memcpy_dtoh(step.p[name], before.nbytes), dtype=np.float32).reshape(before.shape)
        assert not np.allclose(after, before), f"the step left {name} as it was"
