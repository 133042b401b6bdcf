"""The agent side of the worker <-> launchpad local channel: an asyncio Unix socket server that
knows each connected worker (rank, pid, last step, state) and lets commands send a message to a
worker and await its matching reply. Framing and message types come from agent_channel; what a
command means is decided in commands.py."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torchpass_common import agent_channel as ac
from torchpass_common import log, worker_state
from torchpass_common.errors import ProtocolError, WorkerError
from torchpass_common.worker_state import WorkerState

STEP_AVERAGING = 0.2  # weight of the newest CPU time in WorkerLink.busy_s
STEP_WINDOW = 15  # step times WorkerLink.step_s is the median of


def patience(step_s: float | None, floor: float, steps: int) -> float:
    """Seconds a worker with typical step time ``step_s`` (None: not known yet) may go without
    completing a step before it counts as stuck: ``steps`` of its step times, at least ``floor``.
    The stall watch (cut now) and the watchdog (frozen) judge with it, each with its own numbers."""
    return max(floor, steps * step_s if step_s else 0.0)


@dataclass
class WorkerLink:
    """One connected worker as the agent sees it. Its lifecycle (``state``, ``joining``,
    ``recovering``: worker_state.Lifecycle) starts at its hello and moves with each message it sends."""

    rank: int
    local_rank: int
    pid: int
    joining: bool
    chan: ac.AsyncChannel
    step: int = 0
    state: WorkerState = WorkerState.RUNNING  # where its hello put it
    connected: bool = True
    replies: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    step_at: float = field(default_factory=time.monotonic)
    step_s: float | None = None  # its typical step time: the median of the last STEP_WINDOW (None: none yet)
    step_times: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=STEP_WINDOW))
    timing: bool = False  # its last report was a step report while running: the next one times a step
    busy_s: float | None = None  # CPU its training thread wanted per step (a moving average; straggler signal)
    pong_at: float = field(default_factory=time.monotonic)  # its last answer to the watchdog's ping
    interruption: dict[str, Any] | None = None  # the INTERRUPTED report while it waits for recover
    interrupted_at: float | None = None  # wall time of that report (torchpassd times its active abort by it)
    recovering: bool = False  # from INTERRUPTED until RESUMED (unplanned recovery)
    registered: bool = False  # the script called torchpass.register(save, load)
    replicas: list[int] | None = None  # ranks holding the same state (torchpass/layout.py); None: unknown
    error: str = ""  # the last error it reported (a joiner's reason for failing, after it exited)


class ChannelServer:
    """Listens at ``path``; ``links`` maps each worker's pid to its WorkerLink once it said hello
    (kept after the worker disconnects, with ``connected`` False)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.links: dict[int, WorkerLink] = {}
        self._server: asyncio.base_events.Server | None = None
        self._hello = asyncio.Condition()
        self._log = log.get(socket=path)
        self.on_interrupted: Callable[[WorkerLink], None] | None = None  # e.g. an immediate heartbeat
        self.on_resumed: Callable[[WorkerLink], None] | None = None  # e.g. a joiner's output released

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for link in list(self.links.values()):
                await link.chan.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chan = ac.AsyncChannel(reader, writer)
        link: WorkerLink | None = None
        try:
            first = await chan.recv()
            if first is None or first["t"] != ac.HELLO:
                raise ProtocolError(f"worker's first channel message must be hello, got {first!r}")
            link = WorkerLink(first["rank"], first["local_rank"], first["pid"], first["joining"], chan)
            async with self._hello:
                self.links[link.pid] = link
                self._hello.notify_all()
            self._log.info("channel.hello", rank=link.rank, pid=link.pid, joining=link.joining)
            while (msg := await chan.recv()) is not None:
                self._on_message(link, msg)
        except (ProtocolError, ConnectionError) as exc:
            self._log.warning("channel.dropped", rank=link.rank if link else None, error=str(exc))
        finally:
            if link is not None:  # kept, so heartbeats still show its last step
                link.connected = False
            await chan.close()

    def _on_message(self, link: WorkerLink, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == ac.STEP:
            now = time.monotonic()
            if link.timing and msg["step"] > link.step:
                link.step_times.append((now - link.step_at) / (msg["step"] - link.step))
                link.step_s = statistics.median(link.step_times)
            link.step, link.step_at, link.timing = msg["step"], now, True
            busy = msg.get("busy")
            if isinstance(busy, int | float) and not isinstance(busy, bool) and busy >= 0:
                link.busy_s = busy if link.busy_s is None else STEP_AVERAGING * busy + (1 - STEP_AVERAGING) * link.busy_s
            link.registered = bool(msg.get("registered", link.registered))
            if "replicas" in msg:
                link.replicas = msg["replicas"]
            return
        if kind == ac.PONG:
            link.pong_at = time.monotonic()
            return
        # the time to the next step report holds a start-up, a pause or a recovery, not a step
        link.timing = False
        if "step" in msg:
            link.step = msg["step"]
        if kind == ac.RESUMED:
            link.step_at = time.monotonic()  # progress is judged from the resume on
        before = link.state
        if not worker_state.advance(link, msg):
            self._log.warning("channel.unexpected_move", rank=link.rank, pid=link.pid, kind=kind, before=before,
                              after=link.state)
        if kind == ac.INTERRUPTED:
            link.interruption = {k: msg[k] for k in ("gen", "registered", "error")}
            link.interrupted_at = time.time()
            self._log.warning("channel.worker_interrupted", rank=link.rank, pid=link.pid, **link.interruption)
            if self.on_interrupted is not None:
                self.on_interrupted(link)
        elif kind == ac.JOINED:
            link.interruption = None
        elif kind == ac.RESUMED and self.on_resumed is not None:
            self.on_resumed(link)
        if kind == ac.ERROR:
            link.error = msg["msg"]
            self._log.error("channel.worker_error", rank=link.rank, pid=link.pid, error=msg["msg"])
        link.replies.put_nowait(msg)

    async def wait_for(self, pids: Iterable[int], timeout: float) -> None:
        """Wait until every worker in ``pids`` has said hello."""
        wanted = set(pids)
        async with self._hello:
            await asyncio.wait_for(self._hello.wait_for(lambda: wanted <= self.links.keys()), timeout)

    async def request(self, link: WorkerLink, msg: dict[str, Any], accept: Callable[[dict[str, Any]], bool],
                      timeout: float) -> dict[str, Any]:
        """Send ``msg`` to one worker and return its first reply that ``accept`` takes; an error
        reply, a vanished worker or the timeout raise WorkerError naming the rank."""
        while not link.replies.empty():  # replies to an earlier, finished request
            self._log.debug("channel.stale_reply", rank=link.rank, msg=link.replies.get_nowait())
        gone = _gone(link)
        if not link.connected:
            raise gone
        try:
            await link.chan.send(msg)
        except ConnectionError as exc:
            link.connected = False
            raise gone from exc
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                reply = await asyncio.wait_for(self._next_reply(link), max(0.0, remaining))
            except TimeoutError:
                raise WorkerError(f"worker did not answer {msg['t']} within {timeout:.0f} s", rank=link.rank,
                                  pid=link.pid, hint="the worker may be hung; see its log") from None
            if reply["t"] == ac.ERROR:
                raise WorkerError(f"worker failed {msg['t']}: {reply['msg']}", rank=link.rank, pid=link.pid)
            if accept(reply):
                return reply
            self._log.debug("channel.unexpected_reply", rank=link.rank, want=msg["t"], got=reply)

    async def _next_reply(self, link: WorkerLink) -> dict[str, Any]:
        while link.connected:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(link.replies.get(), 0.2)
        if not link.replies.empty():
            return link.replies.get_nowait()
        raise _gone(link)


def _gone(link: WorkerLink) -> WorkerError:
    said = f"; its last error: {link.error}" if link.error else ""
    return WorkerError(f"worker closed the local channel (exited?) before answering{said}", rank=link.rank,
                       pid=link.pid)
