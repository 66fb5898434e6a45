"""Faults on demand without a VM: a real remote proxy process on loopback (mutual TLS, both
streams), the host proxy in forward mode and our vfio-user client in QEMU's place; the
faults are armed through the box's FAULT control request (dxpu_vfio.lab.faults)."""

import errno
import os
import threading
import time

import pytest
from fakes import map_guest_memory

from dxpu_vfio.hostproxy.forwarder import RemoteAttachError, connect_remote
from dxpu_vfio.lab.faults import FaultError, Faults
from dxpu_vfio.link.transport import TlsFiles, make_certs
from dxpu_vfio.pool.boxes import fetch_inventory
from dxpu_vfio.remoteproxy.faults import FaultTable
from dxpu_vfio.remoteproxy.faults import FaultError as BoxFaultError
from dxpu_vfio.remoteproxy.process import RemoteProxyProcess
from dxpu_vfio.testing import eventually
from dxpu_vfio.vfio_user import protocol as p
from dxpu_vfio.vfio_user.client import ClientError, VfioUserClient
from dxpu_vfio.vfio_user.server import VfioUserServer

BAR0 = 0
GUEST = 0x100000
MEM = 1 << 20
BOX = f"fbox{os.getpid()}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certs(d, ["host", BOX, "other"])
    return d


@pytest.fixture
def box(tmp_path, certs, stream):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / f"{BOX}.toml"
    config.write_text(f'name = "{BOX}"\nlisten = "127.0.0.1"\nport = {port}\ntls_dir = "{certs}"\n'
                      '[[device]]\nid = "td0"\nmodel = "testdev"\nlease = "lease-td0"\n'
                      'settings = { memory_size = 1048576 }\n')
    proc = RemoteProxyProcess(config).start()
    proc.address = f"127.0.0.1:{port}"
    yield proc
    proc.stop()


@pytest.fixture
def faults(box, certs):
    f = Faults(box.address, str(certs), BOX, "td0", proxy_pid=box.pid)
    yield f
    f.close()


@pytest.fixture
def forwarded(tmp_path, box, certs):
    down = []
    device = connect_remote(box.address, "td0", "lease-td0", TlsFiles.in_dir(certs, "host"),
                            completion_timeout=0.5, on_down=down.append)
    server = VfioUserServer(device, tmp_path / "host.sock", name="fwd").start()
    client = VfioUserClient(server.socket_path)
    ram = map_guest_memory(client, GUEST, MEM)
    cmd = int.from_bytes(client.read(p.REGION_CONFIG, 4, 2), "little")
    client.write(p.REGION_CONFIG, 4, (cmd | 6).to_bytes(2, "little"))
    yield client, ram, device, down
    client.close()
    server.stop()
    ram.close()


def box_faults(box) -> dict:
    return box.stats()["devices"]["td0"]["faults"]


def start_dma(client, src, dst, length, op=1):
    for reg, value in ((0x20, src), (0x24, src >> 32), (0x28, dst), (0x2C, dst >> 32), (0x30, length), (0x34, op)):
        client.write32(BAR0, reg, value, posted=True)


def wait_dma(client, timeout=5.0):
    deadline = time.monotonic() + timeout
    while (status := client.read32(BAR0, 0x38)) == 1:
        assert time.monotonic() < deadline
    return status


def test_abort_answers_the_next_mmio_read_with_an_error_completion_once(forwarded, faults, box):
    client, _, device, down = forwarded
    fault = faults.abort("mmio-read", count=1)
    with pytest.raises(ClientError) as err:  # QEMU turns the error reply into all-ones for the guest
        client.read32(BAR0, 0)
    assert err.value.errno == errno.EINVAL
    assert client.read32(BAR0, 0) == 0xD0C50001  # spent after one: the link is still up
    assert client.read(p.REGION_CONFIG, 0, 2) == b"\x36\x1b"  # config reads were never its target
    assert device.link_up and not down
    assert device.stats()["error_completions"] == 1  # the host counts it too (in C on the native stream)
    listing = faults.list()
    assert listing["faults"] == []
    assert [e["event"] for e in listing["log"] if e["fault"] == fault["id"]] == ["armed", "hit", "spent"]
    assert all(e["t"] >= fault["armed_at"] for e in listing["log"])
    assert box_faults(box) == {"armed": 0, "abort:mmio-read": 1}


def test_config_read_abort_leaves_mmio_alone(forwarded, faults):
    client, _, _, _ = forwarded
    faults.abort("config-read", count=2)
    for _ in range(2):
        with pytest.raises(ClientError):
            client.read(p.REGION_CONFIG, 0, 4)
    assert client.read32(BAR0, 0) == 0xD0C50001
    assert client.read(p.REGION_CONFIG, 0, 2) == b"\x36\x1b"


def test_a_stalled_read_completes_after_the_stall_with_its_data(forwarded, faults, box):
    client, _, device, _ = forwarded
    faults.stall("mmio-read", ms=300, count=2)
    for _ in range(2):
        started = time.monotonic()
        assert client.read32(BAR0, 0) == 0xD0C50001
        assert time.monotonic() - started >= 0.29
    started = time.monotonic()
    client.read32(BAR0, 0)
    assert time.monotonic() - started < 0.25  # spent after two
    assert device.link_up
    assert box_faults(box)["stall:mmio-read"] == 2


def test_a_read_stalled_until_cleared_completes_when_cleared(forwarded, faults):
    client, _, device, _ = forwarded
    faults.stall("mmio-read")  # forever (bounded by its duration)
    timer = threading.Timer(0.2, faults.clear)
    timer.start()
    started = time.monotonic()
    assert client.read32(BAR0, 0x10) == 0  # COUNTER's first read
    assert 0.19 <= time.monotonic() - started < 0.5  # under the 0.5 s completion timeout
    timer.join()
    assert device.link_up


def test_a_stall_past_the_completion_timeout_is_a_master_abort_and_the_link_goes_down(forwarded, faults):
    client, _, device, down = forwarded
    faults.stall("mmio-read", duration=2)
    assert client.read32(BAR0, 0) == 0xFFFFFFFF  # the host's completion timeout (0.5 s here)
    eventually(lambda: down, what="on_down")
    assert not device.link_up and device.stats()["master_aborts"] >= 1


def test_dropped_posted_writes_never_reach_the_device(forwarded, faults, box):
    client, _, _, _ = forwarded
    client.write32(BAR0, 0x08, 0x11111111, posted=True)
    # a posted write has no completion: read it back (reads never pass posted writes) so it
    # has landed before the control socket arms the fault (a CI run once dropped it too)
    assert client.read32(BAR0, 0x08) == 0x11111111
    faults.drop_posted(duration=5)
    for v in range(10):
        client.write32(BAR0, 0x08, 0x22220000 + v, posted=True)
    client.write32(BAR0, 0x0C, 0x33333333, posted=False)  # a non-posted write is not dropped
    assert client.read32(BAR0, 0x08) == 0x11111111
    assert client.read32(BAR0, 0x0C) == 0x33333333
    faults.clear()
    client.write32(BAR0, 0x08, 0x44444444, posted=True)
    assert client.read32(BAR0, 0x08) == 0x44444444
    assert box_faults(box)["drop-posted"] == 10


def test_refused_dma_sets_the_device_error_status_and_spares_memory(forwarded, faults, box):
    client, ram, _, _ = forwarded
    ram[0:8192] = os.urandom(8192)
    ram[0x10000:0x12000] = b"\0" * 8192
    faults.refuse_dma("dma-read", count=1)
    start_dma(client, GUEST, GUEST + 0x10000, 8192)
    assert wait_dma(client) == 3 and client.read32(BAR0, 0x3C) == 3  # error, DMA fault
    assert ram[0x10000:0x12000] == b"\0" * 8192
    start_dma(client, GUEST, GUEST + 0x10000, 8192)  # spent: the next copy works
    assert wait_dma(client) == 2 and ram[0x10000:0x12000] == ram[0:8192]
    assert box_faults(box)["refuse-dma:dma-read"] == 1


def test_a_stalled_dma_read_delays_the_device_not_the_link(forwarded, faults):
    client, ram, device, _ = forwarded
    ram[0:4096] = os.urandom(4096)
    faults.stall("dma-read", ms=400, count=1)
    started = time.monotonic()
    start_dma(client, GUEST, GUEST + 0x20000, 4096)
    assert client.read32(BAR0, 0x38) == 1  # registers still answer while the DMA is held
    assert wait_dma(client) == 2
    assert time.monotonic() - started >= 0.39
    assert ram[0x20000:0x21000] == ram[0:4096] and device.link_up


def test_cut_takes_the_link_down_and_reads_master_abort(forwarded, faults, box):
    client, _, device, down = forwarded
    faults.cut()
    eventually(lambda: down, what="the host to see the link go")
    assert client.read32(BAR0, 0) == 0xFFFFFFFF
    assert box_faults(box)["cut"] == 1 and faults.list()["faults"] == []


def test_removed_device_refuses_links_until_the_fault_ends(forwarded, faults, box, certs):
    client, _, _, down = forwarded
    fault = faults.remove(grace=None, duration=10)
    eventually(lambda: down, what="the host to see the link go")
    assert client.read32(BAR0, 0) == 0xFFFFFFFF
    tls = TlsFiles.in_dir(certs, "host")
    with pytest.raises(RemoteAttachError, match="surprise removal"):
        connect_remote(box.address, "td0", "lease-td0", tls)
    assert [d["id"] for d in fetch_inventory(box.address, str(certs))["devices"]] == []  # gone from the bus:
    assert not faults.listed()  # a pool refreshing the box no longer offers it
    faults.clear(fault["id"])
    assert faults.listed()
    connect_remote(box.address, "td0", "lease-td0", tls).close()  # back in the box


def test_freeze_and_thaw_are_bounded_and_counted_by_the_box(forwarded, faults, box):
    client, _, device, _ = forwarded
    faults.freeze(seconds=0.3)
    assert open(f"/proc/{box.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"
    with pytest.raises(FaultError, match="frozen"):
        faults.abort()
    eventually(lambda: faults.frozen_at is None, what="the thaw")
    assert client.read32(BAR0, 0) == 0xD0C50001 and device.link_up
    assert box_faults(box)["freeze"] == 1
    assert [e["event"] for e in faults.history] == ["frozen", "thawed"]


def test_close_clears_everything_and_bad_requests_say_why(box, certs):
    f = Faults(box.address, str(certs), BOX, "td0", proxy_pid=box.pid)
    f.stall("config-read", ms=10, duration=60)
    f.drop_posted(duration=60)
    with pytest.raises(FaultError, match="needs a target"):
        f.arm("abort")
    with pytest.raises(FaultError, match="no device 'gpu9'"):
        f.abort(device="gpu9")
    with pytest.raises(FaultError, match="duration"):
        f.drop_posted(duration=10_000)
    f.freeze(seconds=30)
    f.close()
    assert f.frozen_at is None and f.list()["faults"] == []


def test_only_the_box_managers_may_arm_faults(box, certs, tmp_path):
    """FAULT is an admin command: another certificate of the same CA is refused."""
    other = tmp_path / "other"
    other.mkdir()
    for name in ("ca.pem", "other.pem", "other.key"):
        (other / name.replace("other", "host")).write_bytes((certs / name).read_bytes())
    with pytest.raises(FaultError, match="refused"):
        Faults(box.address, str(other), BOX, "td0").drop_posted()


def test_fault_table_bounds_by_time_and_count():
    cut = []
    table = FaultTable(["d0"], {"cut": lambda d, why: cut.append((d, why))})
    table.arm("d0", "drop-posted", duration=0.1)
    assert table.drop_posted("d0")
    time.sleep(0.15)
    assert not table.drop_posted("d0")
    assert [e["event"] for e in table.history] == ["armed", "hit", "expired"]
    table.arm("d0", "abort", "mmio-read", count=2)
    assert [table.read_fault("d0", 0), table.read_fault("d0", 7), table.read_fault("d0", 0),
            table.read_fault("d0", 0)] == [errno.EIO, None, errno.EIO, None]
    table.arm("d0", "cut")
    assert cut and cut[0][0] == "d0" and table.listing()["faults"] == []
    with pytest.raises(BoxFaultError):
        table.arm("d0", "stall", "mmio-write")
    with pytest.raises(BoxFaultError):
        table.request({"op": "arm", "device": "d0", "kind": "stall", "target": "mmio-read", "ms": -1})
    table.arm("d0", "stall", "mmio-read", duration=60)
    table.clear_all()
    assert table.listing()["faults"] == []


@pytest.mark.parametrize("request_", [
    {"op": "clear", "device": ["d0"]}, {"op": "note", "device": {"d": 0}, "kind": "freeze"},
    {"op": "arm", "device": "d0", "kind": "drop-posted", "count": float("inf")},
    {"op": "arm", "device": "d0", "kind": "stall", "target": "mmio-read", "ms": float("nan")},
    {"op": "clear", "id": float("inf")}])
def test_a_fault_request_of_the_wrong_types_is_refused_with_its_reason(request_):
    """What the link fuzzer's FAULT requests found (nineteenth session): a device that was a
    list or an object raised TypeError (unhashable) out of the box's admit thread, a count
    of Infinity OverflowError; each is a FaultError (EINVAL, its reason to the manager)."""
    table = FaultTable(["d0"])
    with pytest.raises(BoxFaultError) as err:
        table.request(request_)
    assert err.value.errno == errno.EINVAL and ("device" in str(err.value) or "number" in str(err.value))
    assert table.listing()["faults"] == []


FAULT_LAB = """
name = "lab"
[[box]]
name = "fbox"
[[box.device]]
id = "fd0"
model = "testdev"
"""


def test_dxpu_lab_fault_arms_lists_and_clears_and_the_fixture_clears_at_teardown(labs, lab_faults):
    """A lab's box (no VM) from the CLI and from the fixture, both through the lab's host namespace."""
    import json
    import subprocess
    import sys

    from dxpu_vfio.lab import lab
    state = labs.shared(lab.Topology.parse(FAULT_LAB))
    run = lambda *a: subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "lab", "fault", "fbox", *a,  # noqa: E731
                                     "--name", state.name, "--json"], capture_output=True, text=True, timeout=60)
    armed = run("stall", "mmio-read", "--ms", "50", "--count", "3")
    assert armed.returncode == 0, armed.stderr
    fault = json.loads(armed.stdout)["fault"]
    assert (fault["device"], fault["kind"], fault["target"], fault["ms"], fault["count"]) == \
        ("fd0", "stall", "mmio-read", 50.0, 3)
    bad = run("abort")
    assert bad.returncode == 1 and "needs a target" in bad.stderr
    assert "dxpu lab fault fbox abort mmio-read" in bad.stderr  # what to run
    assert json.loads(bad.stdout)["error"] == "FaultError"
    faults = lab_faults(state, "fbox")
    assert [f["id"] for f in faults.list()["faults"]] == [fault["id"]]
    faults.drop_posted(duration=60)
    cleared = run("clear", "--id", str(fault["id"]))
    assert [f["id"] for f in json.loads(cleared.stdout)["cleared"]] == [fault["id"]]
    assert [f["kind"] for f in faults.list()["faults"]] == ["drop-posted"]
    faults.close()  # what the fixture does at teardown
    assert json.loads(run("list").stdout)["faults"] == []


def test_dxpu_stats_shows_the_box_fault_counters(forwarded, faults):
    import json
    import subprocess
    import sys
    client, _, _, _ = forwarded
    faults.abort("mmio-read", count=1)
    faults.drop_posted(duration=30)
    with pytest.raises(ClientError):
        client.read32(BAR0, 0)
    out = subprocess.run([sys.executable, "-m", "dxpu_vfio.cli", "stats", "--json"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    row = {r["name"]: r for r in json.loads(out)}[f"{BOX}/td0"]
    assert row["faults"] == {"armed": 1, "abort:mmio-read": 1}


# --- the lab's reader of a box's FAULT answers (a box is a peer) ---------------------------------
@pytest.mark.parametrize("op, payload, problem", [
    ("arm", b"{", "no JSON"),
    ("arm", b"[" * 100_000 + b"]" * 100_000, "no JSON"),  # nested past the parser's stack
    ("arm", b'{"fault": "\xff"}', "no JSON"),  # not UTF-8
    ("list", b"[]", "no JSON object"),
    ("arm", b'{"fault": {"id": "3"}}', "no fault with integer ids"),
    ("arm", b'{"fault": {"id": true}}', "no fault with integer ids"),
    ("clear", b'{"cleared": {"id": 3}}', "no cleared faults with integer ids"),
    ("clear", b'{"cleared": [null]}', "no cleared faults with integer ids"),
])
def test_a_fault_answer_the_lab_cannot_read_is_a_fault_error_that_quotes_it(op, payload, problem):
    from dxpu_vfio.lab.faults import fault_reply
    with pytest.raises(FaultError) as caught:
        fault_reply(op, payload, "b9")
    assert f"box b9 answered a FAULT {op} with {problem}" in str(caught.value) and "dxpu lab status" in str(caught.value)
    assert fault_reply("clear", b'{"cleared": []}', "b9") == {"cleared": []}


def test_the_fault_replies_fuzz_target_catches_a_reader_that_trusts_the_box(tmp_path):
    """The reader before it checked (json.loads, then the caller's ["fault"]["id"]), put
    back in the fuzz target: found. The target itself runs in test_fuzz.py."""
    import dataclasses
    import json

    from dxpu_vfio.fuzz import fault_replies
    from dxpu_vfio.fuzz.readers import ReaderTarget
    from dxpu_vfio.fuzz.runner import Run

    def trusting(text):
        answer = json.loads(text)
        answer["fault"]["id"]
        return answer

    readers = tuple(dataclasses.replace(r, read=trusting) if r.name == "fault-arm" else r
                    for r in fault_replies.READERS)
    result = Run(ReaderTarget("fault-replies", readers), seed=5, stop=400, check_every=50, out=tmp_path).execute()
    assert result.violations > 0 and all("the fault-arm reader" in f.detail for f in result.findings), \
        [f.detail[:200] for f in result.findings]
