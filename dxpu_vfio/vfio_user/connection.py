"""Whole vfio-user messages (and their file descriptors) over one stream socket.

On a UNIX socket descriptors travel with messages; the network link (TCP or TLS)
uses the same framing without them.

QEMU sends requests and expects replies on the same socket, and both sides may send
requests (we send DMA_READ/DMA_WRITE). Reading is greedy (as much as the buffer's free
room a call) to save system calls on the hot path, and goes into one preallocated
buffer (``recv_into``/``recvmsg_into``): a ``recv(256 KiB)`` would make CPython allocate,
shrink and free a 256 KiB object per call (mmap + mremap + munmap, 12-14 µs here).
Descriptors that arrive with a read belong to the message that holds the read's last
byte: Linux glues bytes sent without descriptors (a posted write QEMU sent just before)
in front of a message that carries some into one read, and ends the read with that
message's bytes (a read never goes on past a send with descriptors).
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from dxpu_vfio.vfio_user.protocol import HEADER, HEADER_SIZE, MAX_MESSAGE, MAX_MSG_FDS, Header, ProtocolError

INITIAL_BUFFER = 256 * 1024  # grows (up to one largest message plus this) only when a message needs it
_ANC_SPACE = socket.CMSG_SPACE(MAX_MSG_FDS * 4)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # an IntFlag: "&" on the enum costs microseconds per read


PEER_CLOSED = "peer closed the connection"  # the reason of an orderly close (the C stream says the same)


class ConnectionClosed(Exception):
    """The peer closed the socket (or it failed)."""


class ReceiveTimeout(Exception):
    """``receive(timeout=...)`` ran out; what arrived so far stays buffered."""


@dataclass
class Message:
    header: Header
    payload: memoryview
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        """Close descriptors nobody took ownership of."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class Connection:
    """Message framing on a connected socket; ``send`` may be called from any thread."""

    native = False  # the Python stream (dxpu_vfio.native.stream.NativeConnection is the C one)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # fds travel only on UNIX sockets; TCP and TLS streams carry bytes alone
        self._with_fds = sock.family == socket.AF_UNIX and not hasattr(sock, "cipher")
        self._buffer = bytearray(INITIAL_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = 0  # first unconsumed byte
        self._end = 0  # end of the bytes read so far
        self._fds: list[tuple[int, list[int]]] = []  # (buffer position, fds) from reads
        self._send_lock = threading.Lock()
        self.closed = False

    def _make_room(self, need: int) -> None:
        """At least ``need`` bytes from ``_start`` fit in the buffer: move the unconsumed
        bytes to the front (usually a few, or none), and grow only for a larger message."""
        if self._start:
            unread = self._end - self._start
            self._buffer[:unread] = self._buffer[self._start:self._end]  # same size: allowed while viewed
            self._fds = [(pos - self._start, f) for pos, f in self._fds]
            self._start, self._end = 0, unread
        if need > len(self._buffer):
            self._view.release()
            self._buffer.extend(bytes(need + INITIAL_BUFFER - len(self._buffer)))
            self._view = memoryview(self._buffer)

    def _fill(self, need: int, deadline: float | None = None) -> None:
        """Read once, into the free room, wanting ``need`` bytes from ``_start`` in all.
        A ``deadline`` needs a stream whose ``recv_into`` takes a timeout (a LinkStream)."""
        if self._start + need > len(self._buffer) or self._end == len(self._buffer):
            self._make_room(need)
        room = self._view[self._end:]
        try:
            if self._with_fds:
                n, ancdata, msg_flags, _ = self.sock.recvmsg_into([room], _ANC_SPACE)
            elif deadline is not None:
                n, ancdata, msg_flags = self.sock.recv_into(room, max(0.0, deadline - time.monotonic())), [], 0
            else:
                n, ancdata, msg_flags = self.sock.recv_into(room), [], 0
        except TimeoutError as exc:
            if deadline is not None:
                raise ReceiveTimeout(str(exc)) from exc
            raise ConnectionClosed(str(exc)) from exc
        except OSError as exc:
            raise ConnectionClosed(str(exc)) from exc
        finally:
            room.release()
        fds: list[int] = []
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[: len(cdata) - len(cdata) % arr.itemsize])
                fds.extend(arr)
        if msg_flags & _MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"more than {MAX_MSG_FDS} descriptors in one message")
        if not n:
            for fd in fds:
                os.close(fd)
            raise ConnectionClosed(PEER_CLOSED)
        if fds:
            self._fds.append((self._end + n - 1, fds))  # the position of the read's last byte
        self._end += n

    def fileno(self) -> int:
        return self.sock.fileno()

    def has_message(self) -> bool:
        """A whole message is already buffered: the next ``receive`` will not wait."""
        buf, pos, avail = self._buffer, self._start, self._end - self._start
        return avail >= HEADER_SIZE and avail >= int.from_bytes(buf[pos + 4:pos + 8], "little")

    def receive(self, timeout: float | None = None) -> Message:
        """The next whole message. ProtocolError means the stream cannot be trusted any more;
        :class:`ReceiveTimeout` after ``timeout`` seconds (for a LinkStream only)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._end - self._start < HEADER_SIZE:
            self._fill(HEADER_SIZE, deadline)
        header = Header(*HEADER.unpack_from(self._buffer, self._start))
        if header.size < HEADER_SIZE:
            raise ProtocolError(f"message size {header.size} is smaller than its header")
        if header.size > MAX_MESSAGE:
            raise ProtocolError(f"message size {header.size} exceeds {MAX_MESSAGE}", err=7)  # E2BIG
        while self._end - self._start < header.size:
            self._fill(header.size, deadline)
        start, end = self._start, self._start + header.size
        payload = memoryview(self._view[start + HEADER_SIZE:end].tobytes())
        fds: list[int] = []
        while self._fds and self._fds[0][0] < end:
            pos, got = self._fds.pop(0)
            if pos >= start and not fds:
                fds = got
            else:  # a sender that split one message's fds over several sends
                for fd in got:
                    os.close(fd)
        self._start = end
        if self._start == self._end:  # all consumed (no fds can be left): reads start at the front again
            self._start = self._end = 0
        return Message(header, payload, fds)

    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        with self._send_lock:
            try:
                if fds:
                    self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                array.array("i", fds))])
                else:
                    self.sock.sendall(data)
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from exc

    def send_message(self, msg_id: int, command: int, flags: int, payload: bytes | tuple = b"") -> None:
        """Frame and send one message; ``payload`` may be a tuple of buffers (one copy)."""
        parts = payload if isinstance(payload, tuple) else (payload,)
        size = HEADER_SIZE + sum(len(part) for part in parts)
        self.send(b"".join((HEADER.pack(msg_id, command, size, flags, 0), *parts)))

    def send_messages(self, messages: list[tuple[int, int, int, bytes | tuple]]) -> None:
        """Frame and send several messages, in order, as one send."""
        chunks: list = []
        for msg_id, command, flags, payload in messages:
            parts = payload if isinstance(payload, tuple) else (payload,)
            chunks += (HEADER.pack(msg_id, command, HEADER_SIZE + sum(len(part) for part in parts), flags, 0), *parts)
        self.send(b"".join(chunks))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            for _, fds in self._fds:
                for fd in fds:
                    os.close(fd)
            self._fds = []


def close_listener(sock: socket.socket | None) -> None:
    """Wake a thread blocked in accept() (shutdown) and close the listening socket."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
