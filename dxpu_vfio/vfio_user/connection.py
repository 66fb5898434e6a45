"""Whole vfio-user messages (and their file descriptors) over one stream socket.

On a UNIX socket descriptors travel with messages; the network link (TCP or TLS)
uses the same framing without them.

QEMU sends requests and expects replies on the same socket, and both sides may send
requests (we send DMA_READ/DMA_WRITE). Reading is greedy (up to 256 KiB a call) to save
system calls on the hot path; descriptors that arrive with a read belong to the first
message that starts in it: the kernel never merges bytes that carry different
descriptors into one read, and every sender passes a message's fds with its first byte.
"""

from __future__ import annotations

import array
import os
import socket
import threading
from dataclasses import dataclass, field

from dxpu_vfio.vfio_user.protocol import HEADER, HEADER_SIZE, MAX_MESSAGE, MAX_MSG_FDS, Header, ProtocolError

READ_CHUNK = 256 * 1024
_ANC_SPACE = socket.CMSG_SPACE(MAX_MSG_FDS * 4)


class ConnectionClosed(Exception):
    """The peer closed the socket (or it failed)."""


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

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # fds travel only on UNIX sockets; TCP and TLS streams carry bytes alone
        self._with_fds = sock.family == socket.AF_UNIX and not hasattr(sock, "cipher")
        self._buffer = bytearray()
        self._pos = 0  # start of the first unconsumed byte in _buffer
        self._fds: list[tuple[int, list[int]]] = []  # (buffer position, fds) from reads
        self._send_lock = threading.Lock()
        self.closed = False

    def _fill(self) -> None:
        try:
            if self._with_fds:
                data, ancdata, msg_flags, _ = self.sock.recvmsg(READ_CHUNK, _ANC_SPACE)
            else:
                data, ancdata, msg_flags = self.sock.recv(READ_CHUNK), [], 0
        except OSError as exc:
            raise ConnectionClosed(str(exc)) from exc
        fds: list[int] = []
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[: len(cdata) - len(cdata) % arr.itemsize])
                fds.extend(arr)
        if msg_flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"more than {MAX_MSG_FDS} descriptors in one message")
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionClosed("peer closed the connection")
        if self._pos:  # drop what was consumed (once per read, not once per message)
            del self._buffer[:self._pos]
            self._fds = [(pos - self._pos, f) for pos, f in self._fds]
            self._pos = 0
        if fds:
            self._fds.append((len(self._buffer), fds))
        self._buffer += data

    def has_message(self) -> bool:
        """A whole message is already buffered: the next ``receive`` will not wait."""
        buf, pos = self._buffer, self._pos
        return len(buf) - pos >= HEADER_SIZE and len(buf) - pos >= int.from_bytes(buf[pos + 4:pos + 8], "little")

    def receive(self) -> Message:
        """The next whole message. ProtocolError means the stream cannot be trusted any more."""
        while len(self._buffer) - self._pos < HEADER_SIZE:
            self._fill()
        header = Header(*HEADER.unpack_from(self._buffer, self._pos))
        if header.size < HEADER_SIZE:
            raise ProtocolError(f"message size {header.size} is smaller than its header")
        if header.size > MAX_MESSAGE:
            raise ProtocolError(f"message size {header.size} exceeds {MAX_MESSAGE}", err=7)  # E2BIG
        while len(self._buffer) - self._pos < header.size:
            self._fill()
        start, end = self._pos, self._pos + header.size
        with memoryview(self._buffer) as view:
            payload = memoryview(bytes(view[start + HEADER_SIZE:end]))
        self._pos = end
        fds: list[int] = []
        if self._fds and self._fds[0][0] == start:
            fds = self._fds.pop(0)[1]
        while self._fds and self._fds[0][0] < end:  # a sender that split fds from their message
            for fd in self._fds.pop(0)[1]:
                os.close(fd)
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
