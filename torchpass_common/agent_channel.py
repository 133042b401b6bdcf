"""The local channel between a worker (the ``torchpass`` library) and its launchpad agent.

A Unix stream socket; each frame is a 4-byte big-endian length and a msgpack dict whose key
``"t"`` names the message type. This module owns the framing, the message types and their
fields, the env var names, and a sync (worker side) and an asyncio (launchpad side) endpoint.
It does not decide what a message means: torchpass and launchpad do.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from typing import Any

import msgpack

from torchpass_common.errors import ProtocolError

# Environment a worker is started with.
ENV_SOCKET = "TORCHPASS_AGENT_SOCKET"  # path of launchpad's listening socket
ENV_JOIN = "TORCHPASS_JOIN"  # "1" on a rank that joins a running job
ENV_JOIN_SOURCE = "TORCHPASS_JOIN_SOURCE"  # JSON: the TransferAddress.wire() map to listen on
# On a joining node's launchpad (never in a worker): JSON {"ranks": [...], "world_size", "group_rank",
# "group_world_size", "sources": [...], "cwd"}: local worker i joins as ranks[i], loading from
# sources[i], in the job's working directory cwd.
ENV_JOIN_PLAN = "TORCHPASS_JOIN_PLAN"
# On a spare's launchpad (transparent mode): "1": start no worker, wait for the one criu restores here.
ENV_RESTORE_TARGET = "TORCHPASS_RESTORE_TARGET"
# A joining launchpad's exit code when the job's working directory is missing on its node (srun
# then starts the task in /tmp): torchpassd names the cause from it.
EXIT_NO_WORKDIR = 66
ENV_OUTPUT_ARGS = "TORCHPASS_OUTPUT_ARGS"  # JSON list: the launchpad's output options (--tee ...), for a spare's
ENV_TIMEOUTS = "TORCHPASS_TIMEOUTS"  # JSON: launchpad's [timeouts] (the collective timeout, parking)
ENV_CONTROL_FD = "TORCHPASS_CONTROL_FD"  # transparent mode: a pipe launchpad writes "reconnect PATH" into
STANDBY_FLAG = "--standby"  # the bootstrap's first argument in a standby: its environment comes on stdin
STANDBY_READY = b"torchpass-standby-ready\n"  # what a standby writes on its stdout once torch is imported

MAX_FRAME = 1 << 20  # control messages only; state travels through the wormhole

_HEADER = struct.Struct(">I")

# worker -> agent
HELLO = "hello"
STEP = "step"  # also says "registered": whether the script called torchpass.register(save, load),
# and once "replicas": the ranks holding the same state as this one (None: unknown), torchpass/layout.py;
# "busy": the CPU seconds its training thread wanted per step since the last report (torchpass/busy_time.py)
PAUSED = "paused"
PAUSE_MISSED = "pause_missed"
SAVED = "saved"
READY = "ready"  # a joining worker is inside register() and can receive its state now
JOINED = "joined"
REFORMED = "reformed"
RESUMED = "resumed"
ERROR = "error"
INTERRUPTED = "interrupted"  # a collective failed (peer lost): state captured, waiting for recover
DETACHED = "detached"  # transparent mode: sockets dropped, the channel closes next (criu may dump now)
PONG = "pong"  # the reader thread's answer to a ping: the process is not frozen
# agent -> worker
PAUSE = "pause"
SAVE = "save"
REFORM = "reform"
RESUME = "resume"
EXIT = "exit"
RECOVER = "recover"  # to an interrupted worker: donate its state, re-enter the script, load, park
DETACH = "detach"  # transparent mode, while parked: drop what criu cannot carry, wait on the control fd
# A peer is lost (torchpassd decided it): fail this worker's collectives now. Carried out by the
# worker's reader thread at once, whatever the training thread is doing (it may sit in a collective).
SEVER = "sever"
PING = "ping"  # launchpad's progress watchdog: answered by the reader thread, whatever training does

_NUMBER = (int, float)
# Required fields of each message type and the types they must have. Extra fields are allowed
# (a newer peer may add some); missing or mistyped required fields are a ProtocolError.
FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    HELLO: {"rank": int, "local_rank": int, "pid": int, "joining": bool},
    STEP: {"step": int},
    PAUSED: {"gen": int, "step": int},
    PAUSE_MISSED: {"gen": int, "step": int},
    SAVED: {"bytes": int, "seconds": _NUMBER},
    READY: {},
    JOINED: {"step": int},
    REFORMED: {"gen": int},
    RESUMED: {"gen": int},
    ERROR: {"msg": str},
    INTERRUPTED: {"gen": int, "step": int, "registered": bool, "error": str},
    DETACHED: {"step": int},
    PAUSE: {"gen": int, "at_step": int},
    SAVE: {"dest": dict},
    REFORM: {"gen": int, "rank": int, "world_size": int, "store_host": str, "store_port": int,
             "prefix": str},
    RESUME: {"gen": int},
    EXIT: {},
    RECOVER: {"gen": int, "world_size": int, "step": int, "donate": list},
    DETACH: {},
    SEVER: {"reason": str},
    PING: {},
    PONG: {},
}


def validate(msg: Any) -> dict[str, Any]:
    """Return ``msg`` if it is a well-formed channel message, else raise ProtocolError."""
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("agent channel message is not a dict with a string 't'",
                            hint="both ends must use torchpass_common.agent_channel")
    spec = FIELDS.get(msg["t"])
    if spec is None:
        raise ProtocolError(f"unknown agent channel message type {msg['t']!r}",
                            hint="worker and launchpad run different TorchPass versions?")
    for name, kind in spec.items():
        value = msg.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ProtocolError(f"agent channel message {msg['t']!r} lacks field {name!r} of type "
                                f"{getattr(kind, '__name__', kind)} (got {value!r})")
    return msg


def message(kind: str, **fields: Any) -> dict[str, Any]:
    """Build and validate a message: ``message(PAUSE, gen=2, at_step=40)``."""
    return validate({"t": kind, **fields})


def encode(msg: dict[str, Any]) -> bytes:
    """One frame: length header plus msgpack body."""
    body = msgpack.packb(validate(msg), use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"agent channel message {msg['t']!r} is {len(body)} bytes, over {MAX_FRAME}",
                            hint="send state through a file or the wormhole, not the channel")
    return _HEADER.pack(len(body)) + body


def _decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"agent channel frame is not valid msgpack: {e}") from e
    return validate(msg)


def _check_length(length: int) -> int:
    if length > MAX_FRAME:
        raise ProtocolError(f"agent channel frame of {length} bytes exceeds {MAX_FRAME}",
                            hint="the peer is not speaking the agent channel protocol")
    return length


class SyncChannel:
    """Blocking endpoint over a connected socket (worker side). ``send`` is thread-safe, so the
    training thread and the library's reader thread may both send; only one thread may ``recv``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def connect(cls, path: str, timeout: float = 10.0) -> SyncChannel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise ProtocolError(f"cannot connect to the launchpad agent socket {path}: {e}",
                                hint=f"is launchpad running? unset {ENV_SOCKET} to run without it") from e
        sock.settimeout(None)
        return cls(sock)

    def send(self, msg: dict[str, Any]) -> None:
        frame = encode(msg)
        with self._send_lock:
            self._sock.sendall(frame)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed the connection cleanly."""
        header = self._recv_exact(_HEADER.size)
        if header is None:
            return None
        body = self._recv_exact(_check_length(_HEADER.unpack(header)[0]))
        if body is None:
            raise ProtocolError("agent channel closed in the middle of a frame")
        return _decode_body(body)

    def _recv_exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                if buf:
                    raise ProtocolError("agent channel closed in the middle of a frame")
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()

    def socket_name(self) -> str:
        """The connection as /proc names it (``socket:[inode]``)."""
        return f"socket:[{os.fstat(self._sock.fileno()).st_ino}]"


class AsyncChannel:
    """asyncio endpoint (launchpad side) over a stream pair, e.g. from ``asyncio.start_unix_server``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, msg: dict[str, Any]) -> None:
        self.writer.write(encode(msg))
        await self.writer.drain()

    async def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the worker closed the connection cleanly."""
        try:
            header = await self.reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise ProtocolError("agent channel closed in the middle of a frame") from e
            return None
        length = _check_length(_HEADER.unpack(header)[0])
        try:
            body = await self.reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise ProtocolError("agent channel closed in the middle of a frame") from e
        return _decode_body(body)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, BrokenPipeError):
            pass
