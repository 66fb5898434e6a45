"""Posted writes combined and coalesced, without a VM: the write runs themselves, our
vfio-user server with REGION_WRITE_MULTI, and the host proxy's link coalescing over a
real TLS link to a remote proxy (in threads of this process, so the test can look at
the device in the box directly): PCIe ordering is kept, nothing lingers."""

import struct
import time

import pytest
from fakes import map_guest_memory

from dxpu_vfio.hostproxy.forwarder import connect_remote
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.remoteproxy.config import BoxConfig, BoxDevice
from dxpu_vfio.remoteproxy.proxy import RemoteProxy
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import VfioUserClient
from dxpu_vfio.vfio_user.posted import WriteRuns, pack_batch, unpack_batch
from dxpu_vfio.vfio_user.server import ServerOptions, VfioUserServer
from qemu_device.display import DisplayAdapter

VRAM, MMIO = 0, 2
GUEST, MEM = 0x100000, 1 << 20


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def test_write_runs_merge_only_what_is_adjacent_and_keep_order():
    runs = WriteRuns()
    for i in range(4):
        runs.add(VRAM, 0x100 + 4 * i, u32(i))  # one run
    runs.add(MMIO, 0x104, u32(7))  # another region: a new run
    runs.add(VRAM, 0x110, u32(9))  # adjacent to the first run, but not to the last: new run
    runs.add(VRAM, 0x100, u32(5))  # overwrites an earlier write: must stay after it
    taken = runs.take()
    assert [(r, o, bytes(d)) for r, o, d in taken] == [
        (VRAM, 0x100, u32(0) + u32(1) + u32(2) + u32(3)), (MMIO, 0x104, u32(7)),
        (VRAM, 0x110, u32(9)), (VRAM, 0x100, u32(5))]
    assert not runs and runs.size == 0
    assert [(r, o, bytes(d)) for r, o, d in unpack_batch(pack_batch(taken))] == [(r, o, bytes(d)) for r, o, d in taken]


def test_write_multi_entries_are_combined_like_single_writes():
    runs = WriteRuns()
    runs.add(VRAM, 0, u32(1))
    multi = [p.RegionAccess(VRAM, 4, 4, u32(2)), p.RegionAccess(VRAM, 8, 8, b"abcdefgh"),
             p.RegionAccess(MMIO, 0x500, 2, b"\x20\x03"), p.RegionAccess(VRAM, 16, 1, b"z")]
    runs.add_multi(p.pack_write_multi(multi))
    assert [(r, o, bytes(d)) for r, o, d in runs.take()] == [
        (VRAM, 0, u32(1) + u32(2) + b"abcdefgh"), (MMIO, 0x500, b"\x20\x03"), (VRAM, 16, b"z")]
    bad = bytearray(p.pack_write_multi(multi[:2]))
    bad[8 + 24 + 12:8 + 24 + 16] = (9).to_bytes(4, "little")  # the second entry claims 9 bytes
    with pytest.raises(p.ProtocolError):
        runs.add_multi(bytes(bad))
    assert [(r, o, bytes(d)) for r, o, d in runs.take()] == [(VRAM, 4, u32(2))]  # the one before it stays


def test_without_merge_adjacent_writes_stay_separate_writes():
    """Registers (NVMe's adjacent doorbells) must see each write: batched, not glued."""
    runs = WriteRuns(merge=False)
    runs.add(VRAM, 0x1000, u32(1))
    runs.add_multi(p.pack_write_multi([p.RegionAccess(VRAM, 0x1004, 4, u32(2)), p.RegionAccess(VRAM, 0x1008, 4, u32(3))]))
    assert [(o, bytes(d)) for _, o, d in runs.take()] == [(0x1000, u32(1)), (0x1004, u32(2)), (0x1008, u32(3))]


def test_write_runs_report_full_at_the_size_limit():
    runs = WriteRuns(max_bytes=64)
    assert not runs.add(VRAM, 0, bytes(16))
    assert runs.add(VRAM, 16, bytes(40))  # 16 header + 56 data >= 64


@pytest.mark.parametrize("payload", [b"\x01" * 5, struct.pack("<QII", 0, 0, 8) + b"1234",
                                     struct.pack("<QII", 0, 0, 0)])
def test_write_batch_decoding_never_trusts_a_count(payload):
    with pytest.raises(p.ProtocolError):
        unpack_batch(payload)


@pytest.fixture
def local(tmp_path):
    dev = DisplayAdapter(mapped=False)  # the trapped path: every store a posted write
    server = VfioUserServer(dev, tmp_path / "d.sock", options=ServerOptions(advertise_write_multiple=True)).start()
    client = VfioUserClient(server.socket_path)
    yield client, dev, server
    client.close()
    server.stop()


def test_server_combines_posted_writes_and_write_multi_in_order(local):
    client, dev, server = local
    assert client.negotiate().get("write_multiple") is True
    singles = [p.message(i, p.Command.REGION_WRITE, p.RegionAccess(VRAM, 4 * i, 4, u32(i)).pack(), no_reply=True)
               for i in range(256)]
    multi = [p.RegionAccess(VRAM, 0x400 + 4 * i, 4, u32(1000 + i)) for i in range(100)]
    multi += [p.RegionAccess(VRAM, 0, 4, u32(0xAAAA)), p.RegionAccess(VRAM, 0x2000, 8, b"12345678")]
    # all at once, as QEMU sends them when the server is busy
    client.conn.send(b"".join(singles) + p.message(999, p.Command.REGION_WRITE_MULTI, p.pack_write_multi(multi),
                                                   no_reply=True))
    assert client.read(VRAM, 0x2000, 8) == b"12345678"  # the read passes none of them
    assert dev.vram[0:4] == u32(0xAAAA)  # the later write to 0 won
    assert bytes(dev.vram[4:0x400]) == b"".join(u32(i) for i in range(1, 256))
    assert bytes(dev.vram[0x400:0x590]) == b"".join(u32(1000 + i) for i in range(100))
    assert dev.writes < 50  # 358 writes reached the device as far fewer runs
    assert server.stats[p.Command.REGION_WRITE].count >= 256


def test_posted_writes_reach_the_device_without_a_later_request(local):
    client, dev, _ = local
    client.negotiate()
    client.write(MMIO, 0x500 + 2 * 1, (800).to_bytes(2, "little"), posted=True)  # XRES
    eventually(lambda: dev.dispi[1] == 800, 2.0, "the posted write being applied", interval=0.005)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", "box1"])
    return d


@pytest.fixture
def linked(tmp_path, certs):
    """A box (remote proxy threads) with a display, the host proxy's server in forward
    mode, and our client in QEMU's place with a memfd as guest memory."""
    box = RemoteProxy(BoxConfig("box1", "127.0.0.1", 0, [BoxDevice("fb0", "display", "lease", {"mapped": False})], tls_dir=certs)).start()
    made = []

    def make(coalesce=True, delay=10.0):  # a long timer: only the ordering rules flush
        remote = connect_remote(f"127.0.0.1:{box.port}", "fb0", "lease", TlsFiles.in_dir(certs, "host"),
                                coalesce=coalesce)
        remote.coalesce_delay = delay
        server = VfioUserServer(remote, tmp_path / f"h{len(made)}.sock", name="fwd",
                                options=ServerOptions(advertise_write_multiple=True)).start()
        client = VfioUserClient(server.socket_path)
        ram = map_guest_memory(client, GUEST, MEM)
        made.append((client, server, ram))
        return client, remote, box.slots["fb0"], ram
    yield make
    for client, server, ram in made:
        client.close()
        server.stop()
        ram.close()
    box.stop()


def test_coalesced_writes_keep_order_and_take_few_link_messages(linked):
    client, remote, slot, _ = linked()
    writes = [(VRAM, 8 * i, u32(i)) for i in range(2000)]  # every other word: 2000 runs
    writes += [(MMIO, 0x500 + 2 * 1, (640).to_bytes(2, "little")), (VRAM, 0, u32(0xBEEF))]  # the last must win
    client.conn.send(b"".join(p.message(i, p.Command.REGION_WRITE, p.RegionAccess(r, o, len(d), d).pack(),
                                        no_reply=True) for i, (r, o, d) in enumerate(writes)))
    assert client.read(VRAM, 8 * 1999, 4) == u32(1999)
    assert client.read(MMIO, 0x502, 2) == (640).to_bytes(2, "little")
    assert bytes(slot.device.vram[:4]) == u32(0xBEEF)
    assert [struct.unpack_from("<I", slot.device.vram, 8 * i)[0] for i in range(1, 2000)] == list(range(1, 2000))
    assert remote.counters["writes_posted"] >= 2002
    assert remote.counters["posted_messages"] < 100  # 2002 writes, few link messages
    assert remote.endpoint.posted["WRITE_BATCH"] + remote.endpoint.posted.get("REGION_WRITE", 0) < 100


def test_the_display_asks_for_coalescing_unless_told_otherwise(linked):
    _, remote, _, _ = linked(coalesce=None)  # None: follow the device's hint
    assert remote.description.coalesce and remote.coalesce and remote.coalesce_posted


def test_without_coalescing_every_write_is_a_link_message(linked):
    client, remote, slot, _ = linked(coalesce=False)
    assert not remote.coalesce_posted  # a device server would not offer write_multiple for it either
    for i in range(300):
        client.write(VRAM, 4 * i, u32(i), posted=True)
    assert client.read(VRAM, 4 * 299, 4) == u32(299)
    # the vfio-user server still glues adjacent writes into runs; the link sends each run
    assert remote.counters["posted_messages"] == remote.counters["writes_posted"]


def test_pending_writes_go_before_a_non_posted_write_and_a_reset(linked):
    client, remote, slot, _ = linked()
    remote.region_write(VRAM, 0x40, u32(0x1234), posted=True)  # straight into the batch
    assert bytes(slot.device.vram[0x40:0x44]) != u32(0x1234)  # pending (10 s timer)
    client.write(p.REGION_CONFIG, 4, (6).to_bytes(2, "little"))  # a non-posted config write
    assert bytes(slot.device.vram[0x40:0x44]) == u32(0x1234)  # it flushed the batch first
    remote.region_write(MMIO, 0x500 + 2 * 2, (600).to_bytes(2, "little"), posted=True)
    remote.reset()  # the write goes first, then the reset clears the registers
    assert slot.device.dispi[2] == 0


def test_a_dma_read_completion_does_not_pass_pending_writes(linked):
    client, remote, slot, ram = linked()
    ram[0:8] = b"guestmem"
    client.write(p.REGION_CONFIG, 4, (6).to_bytes(2, "little"))  # memory + bus master
    remote.region_write(VRAM, 0x80, u32(0x5678), posted=True)
    assert bytes(slot.device.vram[0x80:0x84]) != u32(0x5678)
    assert slot.dma.read(GUEST, 8) == b"guestmem"  # the box's DMA read, answered by the host
    # the completion came after the pending write on the stream, and the box's reader
    # applies in stream order: the write is in place when the completion arrives
    assert bytes(slot.device.vram[0x80:0x84]) == u32(0x5678)


def test_a_lone_write_goes_out_when_the_server_waits(linked):
    client, remote, slot, _ = linked()  # 10 s timer: only the server's idle nudge can send it
    client.write(VRAM, 0x200, u32(0xF00D), posted=True)
    eventually(lambda: bytes(slot.device.vram[0x200:0x204]) == u32(0xF00D), 2.0, "the idle flush", interval=0.005)


def test_a_lone_write_is_flushed_by_the_timer(linked):
    client, remote, slot, _ = linked(delay=0.05)
    started = time.monotonic()
    remote.region_write(VRAM, 0x100, u32(0xCAFE), posted=True)
    eventually(lambda: bytes(slot.device.vram[0x100:0x104]) == u32(0xCAFE), 2.0, "the timer flush", interval=0.005)
    assert time.monotonic() - started < 1.0
