"""A storage device's DMA straight between a file and guest memory (DmaTable's preadv /
pwritev path), against a real sealed memfd as QEMU's guest RAM is: the bytes land where
the scatter list says, zeroes past the file's end, and a bad list touches nothing. Each
test runs on both paths: the native one (``mapped_io.c``, where a list lies in one
sealed mapping) and Python's (``DXPU_FASTLINK=0``)."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import pytest

from dxpu_vfio.native import stream as native
from dxpu_vfio.vfio_user.dma import DmaTable
from dxpu_vfio.vfio_user.protocol import DMA_FLAG_READ, DMA_FLAG_WRITE
from qemu_device.ports import DmaError

BASE, SIZE = 0x100000, 1 << 20


@pytest.fixture(autouse=True, params=["native", "python"])
def path(request, monkeypatch):
    """The DmaTables a test makes use the native file I/O, or Python's."""
    if request.param == "native":
        native.require()  # fails naming what to build where it is not built
        monkeypatch.setenv("DXPU_FASTLINK", "1")
    else:
        monkeypatch.setenv("DXPU_FASTLINK", "0")
    return request.param


def guest_ram(flags: int = DMA_FLAG_READ | DMA_FLAG_WRITE) -> tuple[DmaTable, int]:
    """A DmaTable over a sealed memfd window (mmapped, as the host proxy maps QEMU's RAM),
    and a second fd on the same memory to look at it."""
    fd = os.memfd_create("guest-ram", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    table = DmaTable()
    table.add(BASE, SIZE, flags, os.dup(fd), 0)
    return table, fd


@pytest.fixture
def backing(tmp_path):
    fd = os.open(tmp_path / "ns.img", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(fd, bytes(range(256)) * 64, 0)  # 16 KiB of a pattern
    yield fd
    os.close(fd)


def test_a_scattered_read_lands_page_by_page_and_past_the_end_is_zeroes(backing):
    table, ram = guest_ram()
    os.pwrite(ram, b"\xee" * SIZE, 0)
    pieces = [(BASE + 0x3000, 4096), (BASE + 0x1000, 4096), (BASE + 0x8000, 12288)]  # 20 KiB: 4 past the end
    table.write_from_file(pieces, backing, 0)
    pattern = bytes(range(256)) * 64
    assert os.pread(ram, 4096, 0x3000) == pattern[:4096]
    assert os.pread(ram, 4096, 0x1000) == pattern[4096:8192]
    assert os.pread(ram, 12288, 0x8000) == pattern[8192:] + bytes(4096)
    assert os.pread(ram, 4096, 0x2000) == b"\xee" * 4096  # between the pieces: untouched
    assert table.bytes_written == 20480
    table.write_from_file([(BASE + 0x3000, 512)], backing, 512, then=[(BASE + 0x20, b"entry")])  # a read's completion
    assert os.pread(ram, 512, 0x3000) == pattern[512:1024] and os.pread(ram, 5, 0x20) == b"entry"
    table.clear()  # no view left on the mapping: it closes


def test_a_scattered_write_reaches_the_file_in_list_order(backing):
    table, ram = guest_ram()
    os.pwrite(ram, b"A" * 4096, 0x5000)
    os.pwrite(ram, b"B" * 100, 0x2000)
    table.read_into_file([(BASE + 0x5000, 4096), (BASE + 0x2000, 100)], backing, 512)
    assert os.pread(backing, 4196, 512) == b"A" * 4096 + b"B" * 100
    assert table.bytes_read == 4196
    table.clear()


def test_a_list_with_one_bad_piece_is_refused_before_the_file_or_memory_is_touched(backing):
    table, ram = guest_ram()
    with pytest.raises(DmaError, match="outside every mapped window"):
        table.write_from_file([(BASE, 4096), (BASE + SIZE, 4096)], backing, 0)
    assert os.pread(ram, 4096, 0) == bytes(4096)
    before = os.pread(backing, 8192, 0)
    with pytest.raises(DmaError, match="outside every mapped window"):
        table.read_into_file([(BASE, 4096), (BASE - 4096, 4096)], backing, 0)
    assert os.pread(backing, 8192, 0) == before
    table.clear()


def test_rights_are_checked_for_the_direction_of_the_transfer(backing):
    table, _ = guest_ram(DMA_FLAG_READ)  # the guest lets the device read this memory, not write it
    with pytest.raises(DmaError, match="not allowed"):
        table.write_from_file([(BASE, 4096)], backing, 0)
    table.read_into_file([(BASE, 4096)], backing, 0)  # reading it is fine
    table.clear()


def test_a_list_across_two_windows_is_checked_in_each_and_split_at_their_border(backing):
    """Pieces are looked up in the window of the piece before first; one that leaves it
    (or runs across its end) is checked against the next window's own rights."""
    table, ram = guest_ram()
    fd = os.memfd_create("more-ram", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    table.add(BASE + SIZE, SIZE, DMA_FLAG_READ, os.dup(fd), 0)     # adjacent, read-only
    across = [(BASE + 0x1000, 4096), (BASE + SIZE - 2048, 4096)]   # the second runs across
    table.read_into_file(across, backing, 8192)                     # (the file keeps its first 8 KiB)
    assert [n for _, _, n in table._pieces_many(across, DMA_FLAG_READ)] == [4096, 2048, 2048]
    with pytest.raises(DmaError, match="not allowed"):
        table.write_from_file(across, backing, 0)                  # its second half may not be written
    assert os.pread(ram, 4096, 0x1000) == bytes(4096)              # and the first was not either
    table.write_from_file([(BASE + 0x1000, 4096), (BASE + 0x4000, 4096)], backing, 0)
    assert os.pread(ram, 4096, 0x4000) == (bytes(range(256)) * 64)[4096:8192]
    table.clear()
    os.close(fd)


def test_a_list_must_lie_wholly_in_the_window_up_to_its_last_byte(backing):
    """The last byte of the window may be moved; one more byte, or a length that wraps
    around 2^64, refuses the whole list with nothing touched."""
    table, ram = guest_ram()
    table.write_from_file([(BASE + SIZE - 4096, 4096)], backing, 0)
    assert os.pread(ram, 4096, SIZE - 4096) == (bytes(range(256)) * 64)[:4096]
    os.pwrite(ram, b"\xee" * SIZE, 0)
    for bad in ([(BASE + 0x1000, 4096), (BASE + SIZE - 4095, 4096)],
                [(BASE + 0x1000, 4096), (BASE + 0x2000, (1 << 64) - 0x1000)],
                [(BASE + 0x1000, 4096), ((1 << 64) - 2048, 4096)]):
        with pytest.raises(DmaError, match="outside every mapped window"):
            table.write_from_file(bad, backing, 0)
        assert os.pread(ram, SIZE, 0) == b"\xee" * SIZE
    table.clear()


def test_a_file_that_takes_no_more_is_an_oserror_not_a_partial_success():
    table, ram = guest_ram()
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as caught:
            table.read_into_file([(BASE, 4096), (BASE + 0x3000, 512)], full, 0)
        assert caught.value.errno == errno.ENOSPC
        assert table.bytes_read == 0
    finally:
        os.close(full)
        table.clear()


def test_random_lists_move_the_same_bytes_as_a_reference_copy(tmp_path, path):
    """Fuzz of what reaches the C code from a guest (its PRPs become these lists): random
    lists, in and out of the window, overlapping, of odd lengths, past the file's end. The
    table does what a plain Python copy does, or refuses the list with nothing touched."""
    rng = random.Random(f"mapped-io-{path}")
    size = 64 * 1024
    table, ram = guest_ram()
    fd = os.open(tmp_path / "ns.img", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for round_ in range(300):
            content = rng.randbytes(rng.choice([0, 100, 4096, size]))
            os.ftruncate(fd, 0)
            os.pwrite(fd, content, 0)
            memory = rng.randbytes(size)
            os.pwrite(ram, memory, 0)
            ranges = []
            for _ in range(rng.randint(1, 40)):
                where = rng.choice([rng.randrange(BASE, BASE + size), rng.randrange(0, 1 << 64),
                                    BASE + SIZE - rng.randrange(0, 64), BASE - rng.randrange(1, 64)])
                ranges.append((where, rng.choice([rng.randrange(0, 5000), rng.randrange(0, 1 << 64)])))
            if rng.random() < 0.6:  # mostly lists a guest could make
                ranges = [(BASE + rng.randrange(0, size - 4096), rng.randrange(1, 4097))
                          for _ in range(rng.randint(1, 40))]
            offset = rng.randrange(0, 8192)
            then = [(rng.choice([BASE + rng.randrange(0, size - 16), BASE + SIZE - rng.randrange(0, 32)]),
                     rng.choice([bytes, lambda n: memoryview(bytes(n))])(rng.randrange(0, 17)))
                    for _ in range(rng.choice([0, 0, 1, 2]))]  # a completion entry after the data
            expect = bytearray(memory)
            fits = all(BASE <= a and a + n <= BASE + SIZE for a, n in ranges)
            then_fits = fits and all(a + len(d) <= BASE + SIZE for a, d in then)
            if fits:  # the reference: pieces back to back from the offset, zeroes past the end
                at = offset
                for a, n in ranges:
                    piece = content[at:at + n]
                    piece += bytes(n - len(piece))
                    if a + n <= BASE + size:
                        expect[a - BASE:a - BASE + n] = piece
                    at += n
            for a, d in then if fits else ():  # in order, up to the first that does not fit
                if a + len(d) > BASE + SIZE:
                    break
                if a + len(d) <= BASE + size:
                    expect[a - BASE:a - BASE + len(d)] = d
            try:
                table.write_from_file(ranges, fd, offset, then)
                assert then_fits, (ranges, then)
            except DmaError:
                assert not then_fits, (ranges, then)
            got = os.pread(ram, size, 0)
            assert got == bytes(expect), (round_, ranges, then)
    finally:
        os.close(fd)
        table.clear()


def test_plain_reads_and_writes_in_one_window_keep_the_tables_rules():
    """A read or write inside one sealed window is a plain copy (DmaTable._sealed_window);
    the rules stay the general path's: rights per direction, the window's end, and Bus
    Master off refuses (and counts) everything."""
    table, ram = guest_ram()
    table.write(BASE + SIZE - 4, b"tail")
    assert os.pread(ram, 4, SIZE - 4) == b"tail" and table.read(BASE + SIZE - 4, 4) == b"tail"
    with pytest.raises(DmaError, match="outside every mapped window"):
        table.write(BASE + SIZE - 2, b"tail")  # runs past the window's end
    assert os.pread(ram, 4, SIZE - 4) == b"tail"
    table.bus_master = False
    for access in (lambda: table.read(BASE, 4), lambda: table.write(BASE, b"x")):
        with pytest.raises(DmaError, match="Bus Master"):
            access()
    assert table.refused_bus_master == 2
    table.clear()
    read_only, _ = guest_ram(DMA_FLAG_READ)
    with pytest.raises(DmaError, match="not allowed"):
        read_only.write(BASE, b"x")
    assert read_only.read(BASE, 2) == b"\0\0"
    read_only.clear()
