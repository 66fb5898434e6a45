"""The network link without a VM: a real remote proxy process on loopback (TCP + mutual
TLS), the host proxy's vfio-user server in forward mode, and our vfio-user client in
QEMU's place with a real memfd for guest memory."""

import hashlib
import mmap
import os
import select
import signal
import socket
import ssl
import time

import pytest
from fakes import map_guest_memory

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
from dxpu_vfio.link.endpoint import LinkState
from dxpu_vfio.link import transport
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient
from dxpu_vfio.vfio_user.server import VfioUserServer

BAR0 = 0
GUEST = 0x100000
MEM = 1 << 20


# Box names must be unique on this host while tests run: `dxpu stats` names remote
# proxies BOX/DEVICE, and the lab fixtures of other modules run boxes called box1.
BOX = f"lbox{os.getpid()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", BOX])
    other = tmp_path_factory.mktemp("other-ca")
    make_certs(other, ["host"])  # a host certificate from a CA the box does not trust
    return d, other


@pytest.fixture
def box(tmp_path, certs, stream):
    port = free_port()
    config = tmp_path / f"{BOX}.toml"
    config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{certs[0]}"\n'
                      '[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "lease-td0"\n'
                      'settings = { memory_size = 1048576 }\n')
    proc = RemoteProxyProcess(config).start()
    proc.address = f"127.0.0.1:{port}"
    yield proc
    proc.stop()


@pytest.fixture
def forwarded(tmp_path, box, certs, stream):
    """Host proxy in forward mode with a client in QEMU's place and a memfd as guest RAM."""
    down = []
    device = connect_remote(box.address, "td0", "lease-td0", TlsFiles.in_dir(certs[0], "host"),
                            completion_timeout=0.5, on_down=down.append)
    assert device.endpoint.native == (stream == "native")
    device.endpoint.dead_after = 1.0
    server = VfioUserServer(device, tmp_path / "host.sock", name="fwd").start()
    client = VfioUserClient(server.socket_path)
    ram = map_guest_memory(client, GUEST, MEM)
    cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
    client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
    yield client, ram, device, down
    client.close()
    server.stop()
    ram.close()


def start_dma(client, src, dst, length, op=1):
    for reg, value in ((0x20, src), (0x24, src >> 32), (0x28, dst), (0x2C, dst >> 32), (0x30, length), (0x34, op)):
        client.write32(BAR0, reg, value, posted=True)


def wait_dma(client, timeout=5.0):
    deadline = time.monotonic() + timeout
    while (status := client.read32(BAR0, 0x38)) == 1:
        assert time.monotonic() < deadline
    return status


def test_registers_and_posted_write_ordering_over_tls(forwarded):
    client, _, device, _ = forwarded
    assert client.read32(BAR0, 0) == 0xD0C50001
    for v in range(50):
        client.write32(BAR0, 0x08, v, posted=True)
    assert client.read32(BAR0, 0x08) == 49  # the read came after all posted writes
    assert device.stats()["writes_posted"] >= 50
    if device.endpoint.native:  # on the native stream the host proxy forwards in C
        assert device.stats()["link"]["native"]["reads"] >= 2


def test_remote_dma_lands_in_guest_memory(forwarded):
    client, ram, device, _ = forwarded
    data = os.urandom(300_000)
    ram[0:len(data)] = data
    start_dma(client, GUEST, GUEST + 0x60000, len(data))
    assert wait_dma(client) == 2
    assert ram[0x60000:0x60000 + len(data)] == data
    assert device.stats()["dma_bytes_read"] == len(data) and device.stats()["dma_bytes_written"] == len(data)


def test_rogue_dma_outside_the_windows_is_refused_and_memory_untouched(forwarded):
    """The host proxy checks every remote DMA against QEMU's windows (guard pages around)."""
    client, ram, device, _ = forwarded
    ram[:] = b"\xaa" * MEM
    start_dma(client, GUEST - 4096, GUEST, 8192)  # read starts in the guard page below
    assert wait_dma(client) == 3
    start_dma(client, GUEST, GUEST + MEM - 4096, 8192)  # write runs into the guard page above
    assert wait_dma(client) == 2  # posted: the device is not told ...
    assert device.stats()["dma_refused"] == 2  # ... but the host refused and counted it
    assert ram[:] == b"\xaa" * MEM  # nothing in the window was written either


def test_wrong_lease_unknown_device_and_busy_device_are_refused(box, certs, forwarded):
    tls = TlsFiles.in_dir(certs[0], "host")
    with pytest.raises(RemoteAttachError, match="lease token refused"):
        connect_remote(box.address, "td0", "stolen", tls)
    with pytest.raises(RemoteAttachError, match="no such device"):
        connect_remote(box.address, "gpu9", "x", tls)
    with pytest.raises(RemoteAttachError, match="in use by another host"):
        connect_remote(box.address, "td0", "lease-td0", tls)
    refused = box.stats()["refused"]
    assert refused["lease"] == 1 and refused["busy"] == 1


def test_peer_without_a_valid_certificate_is_refused(box, certs):
    with pytest.raises(RemoteAttachError):
        connect_remote(box.address, "td0", "lease-td0", TlsFiles.in_dir(certs[1], "host"))  # untrusted CA
    with pytest.raises(RemoteAttachError):
        connect_remote(box.address, "td0", "lease-td0", None)  # plaintext to a TLS box
    # the box counts a refusal when its own handshake fails, which may be after the client gave up
    eventually(lambda: box.stats()["refused"]["tls"] == 2, what="both refusals counted by the box")


def test_killed_remote_reads_all_ones_and_link_goes_down(forwarded, box):
    client, _, device, down = forwarded
    assert client.read32(BAR0, 0) == 0xD0C50001
    box.signal(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while client.read32(BAR0, 0) != 0xFFFFFFFF:
        assert time.monotonic() < deadline, "reads never became all-ones"
    assert not device.link_up
    eventually(lambda: down, what="the control plane's link-down notice")
    link = device.endpoint.stats()
    assert device.endpoint.state is LinkState.DOWN and link["up"] is False and link["down_reason"] == down[0]
    assert client.read32(BAR0, 0x08) == 0xFFFFFFFF  # every later read too, at once
    client.write32(BAR0, 0x08, 1)  # and writes are dropped without an error


def test_stopped_remote_completion_timeout_then_heartbeat(forwarded, box):
    client, _, device, down = forwarded
    box.signal(signal.SIGSTOP)
    started = time.monotonic()
    assert client.read32(BAR0, 0) == 0xFFFFFFFF  # completion timeout answers all-ones
    assert time.monotonic() - started < 3  # ... well before QEMU's 5 s
    eventually(lambda: down, what="the control plane's link-down notice")
    assert device.stats()["master_aborts"] == 1 and "completion timeout" in down[0]
    box.signal(signal.SIGCONT)


def test_heartbeats_catch_a_stopped_peer_without_traffic(forwarded, box):
    _, _, device, down = forwarded
    box.signal(signal.SIGSTOP)
    eventually(lambda: down, what="the heartbeat watchdog")
    assert "heartbeats stopped" in down[0]
    box.signal(signal.SIGCONT)


def test_reattach_after_the_box_comes_back(tmp_path, box, certs):
    tls = TlsFiles.in_dir(certs[0], "host")
    first = connect_remote(box.address, "td0", "lease-td0", tls)
    box.stop()
    box.start()
    eventually(lambda: not first.link_up, what="the old link going down")
    second = connect_remote(box.address, "td0", "lease-td0", tls)
    assert int.from_bytes(second.region_read(0, 0, 4), "little") == 0xD0C50001
    second.close()
    first.close()


def test_dxpu_stats_shows_both_proxies(tmp_path, box, certs):
    """Counters of the host proxy process and the remote proxy process, through the CLI."""
    import json
    import subprocess
    import sys

    from dxpu_vfio.hostproxy.process import HostProxyProcess
    settings = {"address": box.address, "device": "td0", "lease": "lease-td0", "tls_dir": str(certs[0])}
    host = HostProxyProcess("remote", tmp_path / "h.sock", settings=settings, name=f"stats{os.getpid()}").start()
    try:
        client = VfioUserClient(host.socket_path)
        map_guest_memory(client, GUEST, MEM).close()
        cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
        client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
        for v in range(10):
            client.write32(BAR0, 0x08, v, posted=True)
        start_dma(client, GUEST, GUEST + 0x10000, 8192)
        assert wait_dma(client) == 2
        out = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "stats", "--json"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        rows = {r["name"]: r for r in json.loads(out)}
        mine, theirs = rows[host.name], rows[f"{BOX}/td0"]
        assert mine["proxy"] == "host" and mine["link"] == "up" and theirs["link"] == "up"
        assert mine["posted_writes"] >= 10 and mine["nonposted"] >= 2
        assert mine["dma_read_bytes"] == theirs["dma_read_bytes"] == 8192
        assert mine["dma_write_bytes"] == theirs["dma_write_bytes"] == 8192
        assert mine["link_wait_us"] > 0 and theirs["link_wait_us"] > 0
        client.close()
    finally:
        host.stop()


def test_external_vfio_user_server_behind_the_remote_proxy(tmp_path, certs):
    """The box drives an external vfio-user server (our device server, a separate process)
    as a client: its DMA becomes messages over the link, its interrupts IRQ messages."""
    from dxpu_vfio.hostproxy.process import HostProxyProcess
    external = HostProxyProcess("testdev", tmp_path / "ext.sock", settings={"memory_size": 1 << 20}).start()
    port = free_port()
    config = tmp_path / f"{BOX}.toml"
    config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{certs[0]}"\n'
                      f'[[device]]\nid = "ext0"\nmodel = "vfio-user"\nlease = "l"\n'
                      f'settings = {{ socket = "{external.socket_path}" }}\n')
    box = RemoteProxyProcess(config).start()
    try:
        device = connect_remote(f"127.0.0.1:{port}", "ext0", "l", TlsFiles.in_dir(certs[0], "host"))
        server = VfioUserServer(device, tmp_path / "host.sock", name="ext").start()
        client = VfioUserClient(server.socket_path)
        client.negotiate()
        assert client.region_info(2)[0] == 1 << 20 and client.irq_info(p.IRQ_MSI)[0] == 4
        fd = os.memfd_create("guest")
        os.ftruncate(fd, MEM)
        ram = mmap.mmap(fd, MEM)
        client.dma_map(GUEST, MEM, fd=fd)
        os.close(fd)
        cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
        client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
        data = os.urandom(20000)
        ram[0:len(data)] = data
        start_dma(client, GUEST, GUEST + 0x40000, len(data))
        assert wait_dma(client) == 2
        assert ram[0x40000:0x40000 + len(data)] == data
        efd = os.eventfd(0, os.EFD_NONBLOCK)
        client.set_irqs(p.IRQ_INTX, [efd])
        client.write32(BAR0, 0x14, 0)  # doorbell: INTx from the external server
        eventually(lambda: select.select([efd], [], [], 0)[0], what="INTx through the chain")
        assert external.stats()["server"]["dma"]["bytes_read"] == len(data)  # it did DMA by messages
        client.close()
        server.stop()
        ram.close()
        os.close(efd)
    finally:
        box.stop()
        external.stop()


def test_inventory_and_screenshot_requests_of_the_pool_manager(box, certs):
    """INVENTORY lists the box's devices, without any token (only to the pool's CA);
    SCREENSHOT is for the box's managers and wants a display."""
    from dxpu_vfio.pool.boxes import BoxUnreachable, fetch_inventory, fetch_screenshot
    inventory = fetch_inventory(box.address, str(certs[0]))
    assert inventory["box"] == BOX
    der = ssl.PEM_cert_to_DER_cert((certs[0] / f"{BOX}.pem").read_text())
    assert inventory["certificate_sha256"] == hashlib.sha256(der).hexdigest()
    [td] = inventory["devices"]
    assert td == {"id": "td0", "class": "testdev", "vendor": "1b36", "model": "10f0", "capacity": 1048576,
                  "in_use": False}
    with pytest.raises(BoxUnreachable, match="TLS|closed the link"):
        fetch_inventory(box.address, str(certs[1]))  # a host certificate of another CA
    with pytest.raises(BoxUnreachable, match="not a display device"):
        fetch_screenshot(box.address, str(certs[0]), "td0")
    with pytest.raises(BoxUnreachable, match="no such device"):
        fetch_screenshot(box.address, str(certs[0]), "gpu9")


def test_a_screenshot_of_an_invalid_mode_is_an_error_and_the_box_serves_on():
    """A guest's 65535x65535 mode once made the box allocate 5.5 GB and die: now the
    request is refused (EINVAL) and the next one, of a valid mode, is served."""
    from dxpu_vfio.pool.boxes import BoxUnreachable, fetch_inventory, fetch_screenshot
    from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
    from dxpu_vfio.remoteproxy.proxy import RemoteProxy
    proxy = RemoteProxy(BoxConfig("box1", "127.0.0.1", 0, [BoxDevice("fb0", "display", "t")],
                                  plaintext=True)).start()
    try:
        dev = proxy.slots["fb0"].device

        def mode(x: int, y: int) -> None:
            for reg, value in ((3, 32), (1, x), (2, y), (6, x), (4, 0x41)):  # BPP, XRES, YRES, VIRT_WIDTH, ENABLE
                dev.region_write(2, 0x500 + 2 * reg, value.to_bytes(2, "little"))
        mode(65535, 65535)
        with pytest.raises(BoxUnreachable, match="mode cannot be shown"):
            fetch_screenshot(f"127.0.0.1:{proxy.port}", None, "fb0")
        [(device, render)] = proxy.screenshots()  # SIGUSR2's: the daemon writes why, no PNG
        with pytest.raises(ValueError, match="exceeds"):
            render()
        mode(640, 480)
        assert fetch_screenshot(f"127.0.0.1:{proxy.port}", None, "fb0") == dev.render_png()
        assert fetch_inventory(f"127.0.0.1:{proxy.port}", None)["devices"][0]["id"] == "fb0"
    finally:
        proxy.stop()


def test_a_screenshot_larger_than_one_message_comes_in_pieces():
    """Noise does not compress: a 1024x768 scanout of random pixels is a ~2.3 MiB PNG,
    more than one link message, and arrives whole."""
    from dxpu_vfio.pool.boxes import fetch_screenshot
    from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
    from dxpu_vfio.remoteproxy.proxy import RemoteProxy
    proxy = RemoteProxy(BoxConfig("box1", "127.0.0.1", 0, [BoxDevice("fb0", "display", "t")],
                                  plaintext=True)).start()
    try:
        dev = proxy.slots["fb0"].device
        for reg, value in ((3, 32), (1, 1024), (2, 768), (6, 1024), (4, 0x41)):  # BPP, XRES, YRES, VIRT_WIDTH, ENABLE
            dev.region_write(2, 0x500 + 2 * reg, value.to_bytes(2, "little"))
        dev.region_write(0, 0, os.urandom(1024 * 768 * 4))
        png = fetch_screenshot(f"127.0.0.1:{proxy.port}", None, "fb0")
        assert len(png) > 2 << 20 and png == dev.render_png()
    finally:
        proxy.stop()


def test_large_dma_copies_cross_the_link_intact(forwarded):
    """Half a MiB each way per copy: pipelined DMA reads of the box and posted DMA writes
    interleaved with the guest's status reads (the native forwarder serves both in C)."""
    client, ram, device, down = forwarded
    data = os.urandom(1 << 19)
    ram[0:len(data)] = data
    for _ in range(3):
        start_dma(client, GUEST, GUEST + (1 << 19), len(data))
        assert wait_dma(client) == 2, down
    assert ram[1 << 19:(1 << 19) + len(data)] == data
    assert device.stats()["dma_bytes_read"] == device.stats()["dma_bytes_written"] == 3 * len(data)


def test_the_box_reads_by_scatter_list_from_a_host_that_offers_it(forwarded, box):
    """The host's HELLO offers DMA_READV, so the box's device reads guest memory with it
    (a 512 KiB copy: two requests of 256 KiB) and never falls back to DMA_READ."""
    client, ram, device, down = forwarded
    data = os.urandom(1 << 19)
    ram[0:len(data)] = data
    start_dma(client, GUEST, GUEST + (1 << 19), len(data))
    assert wait_dma(client) == 2, down
    assert ram[1 << 19:1 << 20] == data
    requests = box.stats()["devices"]["td0"]["link"]["requests"]
    assert set(requests) == {"DMA_READV"} and requests["DMA_READV"]["count"] == 2, requests


def test_a_read_after_a_flood_of_posted_writes_waits_for_them_not_for_a_timeout(forwarded):
    """20,000 posted writes sent at once take the box longer than the completion timeout
    (0.5 s here) to apply; the host must not let them pile up in the box's socket ahead
    of the read (PCIe's posted-write credits: the host SYNCs every 2048)."""
    client, _, device, down = forwarded
    client.conn.send(b"".join(p.message(i, p.Command.REGION_WRITE, p.RegionAccess(BAR0, 0x08, 4, i.to_bytes(4, "little")).pack(),
                                        no_reply=True) for i in range(20000)))
    assert client.read32(BAR0, 0x08) == 19999
    assert device.link_up and not down


def test_a_stopped_box_during_a_posted_write_flood_still_gets_reads_answered_in_time(forwarded, box):
    """Issue 18 item 2: with the box stopped, a flood of posted writes fills the link; the
    host must not wait on its send for ever: the read behind the flood is answered all-ones
    within a few completion timeouts (0.5 s here), far below QEMU's 5 s, and the link is down."""
    client, _, device, down = forwarded
    box.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        client.conn.send(b"".join(p.message(i, p.Command.REGION_WRITE,
                                            p.RegionAccess(BAR0, 0x08, 4, i.to_bytes(4, "little")).pack(),
                                            no_reply=True) for i in range(20000)))
        assert client.read32(BAR0, 0x08) == 0xFFFFFFFF
        assert time.monotonic() - started < 3
        assert not device.link_up and down
    finally:
        box.signal(signal.SIGCONT)


def test_dxpu_screenshot_asks_only_a_box_that_serves_the_device(tmp_path):
    """Two labs may each run a box of the same name. `dxpu screenshot BOX/DEV` asked every
    one of them and waited 30 s on each that never writes DEV's file (CI's two-display
    test timed out so): now a box's registry entry lists its devices and displays, and a
    device that is no display is answered at once."""
    import subprocess
    import sys
    boxes = []
    try:
        for model, device in (("testdev", "td0"), ("display", "fbx")):
            config = tmp_path / f"{device}.toml"
            config.write_text(f'name = "twin{os.getpid()}"\nlisten = "127.0.0.1"\nport = {free_port()}\n'
                              f'plaintext = true\n[[device]]\nid = "{device}"\nmodel = "{model}"\nlease = "l"\n')
            boxes.append(RemoteProxyProcess(config).start())
        proc = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "screenshot", f"twin{os.getpid()}/td0",
                               str(tmp_path / "shot.png")], capture_output=True, text=True, timeout=20)
        assert proc.returncode == 1 and "is it a display device?" in proc.stderr, proc.stderr
    finally:
        for box in boxes:
            box.stop()


def test_link_sockets_retransmit_on_a_datacenter_timescale():
    """Both ends of a link socket (tune: connect and accept) ask TCP for a minimum
    retransmission timeout of milliseconds, not the default 200 ms: a burst of lost segments
    then costs the link a few ms per retransmission and fits its completion timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = transport.tune(socket.create_connection(listener.getsockname()))
    accepted = transport.tune(listener.accept()[0])
    try:
        for sock in (client, accepted):
            try:
                rto_min = sock.getsockopt(socket.IPPROTO_TCP, transport.TCP_RTO_MIN_US)
            except OSError as exc:
                pytest.fail(f"this kernel has no TCP_RTO_MIN_US (Linux 6.15 or newer): {exc}")
            assert transport.LINK_RTO_MIN_US <= rto_min <= 10_000, rto_min  # rounded up to whole ticks
    finally:
        for sock in (client, accepted, listener):
            sock.close()

