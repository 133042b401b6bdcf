"""The byte-moving layer under the wormhole: a Transport opens Streams (connect/listen) that send
whole buffers and receive exactly into caller memory, every operation bounded by a timeout.
TCP is the one implementation here; RDMA belongs behind the same three classes, so the sender and
receiver never change. Knows nothing of states, chunks or tokens."""

from __future__ import annotations

import socket
import struct
from abc import ABC, abstractmethod

from torchpass_common.errors import WormholeError

_TIMEVAL = struct.Struct("@ll")  # struct timeval for SO_SNDTIMEO / SO_RCVTIMEO


class Stream(ABC):
    """One ordered, reliable byte stream to a peer. Errors are WormholeErrors naming the peer."""

    peer: str

    @abstractmethod
    def send(self, *parts: bytes | memoryview) -> None:
        """Send all of ``parts``, in order, as one gathered write where the link allows, or raise."""

    @abstractmethod
    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` completely or raise (peer closed, timeout, reset)."""

    @abstractmethod
    def set_timeout(self, seconds: float) -> None:
        """Bound every later send/receive operation by ``seconds``."""

    @abstractmethod
    def close(self) -> None:
        """Close; unblocks a send/recv_into running in another thread. Idempotent."""

    def recv_exact(self, n: int) -> bytes:
        """Receive exactly ``n`` bytes into a new buffer (for headers, not bulk data)."""
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)


class Listener(ABC):
    """A bound, listening endpoint."""

    port: int

    @abstractmethod
    def accept(self, timeout: float) -> Stream | None:
        """The next incoming stream, or None when ``timeout`` passes first."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening. Idempotent."""


class Transport(ABC):
    """Factory of streams and listeners for one kind of link; ``io_timeout`` bounds each
    send/receive operation of the streams it makes."""

    name: str
    io_timeout: float

    @abstractmethod
    def listen(self, host: str, port: int) -> Listener:
        """Bind and listen on ``host:port`` (port 0 picks a free one)."""

    @abstractmethod
    def connect(self, host: str, port: int, timeout: float) -> Stream:
        """Open a stream to ``host:port`` within ``timeout`` seconds."""


class TcpStream(Stream):
    """A TCP connection with TCP_NODELAY and a per-operation timeout.

    The socket stays blocking and the kernel enforces the timeout (SO_SNDTIMEO / SO_RCVTIMEO):
    one sendmsg queues a whole piece and one recv_into(MSG_WAITALL) fills one, where Python's own
    timeouts (a non-blocking socket, poll before every call) took a system call and a wake-up per
    socket buffer's worth. On the dev VM (loopback, 1 GiB, 2 streams, 20 transfers each,
    interleaved): -10% transfer time, -21% receiver CPU."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self._sock = sock
        self.peer = peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.set_timeout(timeout)

    def set_timeout(self, seconds: float) -> None:
        seconds = max(seconds, 0.001)  # a zero timeval would mean "wait forever"
        tv = _TIMEVAL.pack(int(seconds), int((seconds - int(seconds)) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    def send(self, *parts: bytes | memoryview) -> None:
        views = [memoryview(p) for p in parts]
        try:
            while views:  # sendmsg gathers header + payload into one segment stream, no tiny packets
                sent = self._sock.sendmsg(views)
                while views and sent >= views[0].nbytes:
                    sent -= views.pop(0).nbytes
                if sent:
                    views[0] = views[0][sent:]
        except BlockingIOError as exc:  # SO_SNDTIMEO passed with nothing sent
            raise WormholeError("sending timed out", peer=self.peer,
                                hint="the peer stopped reading; check it is alive") from exc
        except OSError as exc:
            raise WormholeError(f"sending failed: {exc.strerror or exc}", peer=self.peer) from exc

    def recv_into(self, view: memoryview) -> None:
        done, total = 0, len(view)
        try:
            while done < total:
                n = self._sock.recv_into(view[done:], total - done, socket.MSG_WAITALL)
                if n == 0:
                    raise WormholeError(f"stream cut: peer closed after {done} of {total} bytes",
                                        peer=self.peer, hint="the peer died or gave up; retry the transfer")
                done += n
        except BlockingIOError as exc:  # SO_RCVTIMEO passed with nothing more received
            raise WormholeError(f"receiving timed out after {done} of {total} bytes", peer=self.peer,
                                hint="the peer stopped sending; check it is alive") from exc
        except OSError as exc:
            raise WormholeError(f"receiving failed after {done} of {total} bytes: {exc.strerror or exc}",
                                peer=self.peer) from exc

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed or never connected
        self._sock.close()


class TcpListener(Listener):
    """A listening TCP socket."""

    def __init__(self, host: str, port: int, io_timeout: float) -> None:
        self._io_timeout = io_timeout
        try:
            self._sock = socket.create_server((host, port), backlog=64)
        except OSError as exc:
            raise WormholeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                                hint="choose another port or bind address ([wormhole] bind_host)") from exc
        self.port = self._sock.getsockname()[1]

    def accept(self, timeout: float) -> Stream | None:
        self._sock.settimeout(max(timeout, 0.001))
        try:
            conn, addr = self._sock.accept()
        except TimeoutError:
            return None
        return TcpStream(conn, f"{addr[0]}:{addr[1]}", self._io_timeout)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() (Linux)
        except OSError:
            pass  # already closed
        self._sock.close()


class TcpTransport(Transport):
    """Plain TCP; ``io_timeout`` bounds every socket operation of the streams it makes."""

    name = "tcp"

    def __init__(self, io_timeout: float = 30.0) -> None:
        self.io_timeout = io_timeout

    def listen(self, host: str, port: int) -> Listener:
        return TcpListener(host, port, self.io_timeout)

    def connect(self, host: str, port: int, timeout: float) -> Stream:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise WormholeError(f"cannot connect to wormhole receiver {host}:{port}: {exc.strerror or exc}",
                                hint="check the receiver is listening and the address is reachable") from exc
        return TcpStream(sock, f"{host}:{port}", self.io_timeout)
