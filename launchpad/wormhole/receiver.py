"""The receiving end of the wormhole: ``StateReceiver`` listens, refuses (and logs) every peer
that fails the token challenge, takes the manifest, receives each chunk with recv_into straight
into its destination (template tensors, fresh tensors, files), verifies every checksum, and only
then commits and rebuilds the state. At most MAX_HANDSHAKES strangers are challenged at once, each
within a deadline; more are hung up on at once. A failed transfer leaves caller-visible state
untouched (except template tensors received with ``in_place=True``, which the error then says)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import torch

from launchpad.wormhole.auth import Refused, StreamInfo, admit, check_token, server_handshake, turn_away
from launchpad.wormhole.layout import leaves_of, unflatten
from launchpad.wormhole.parallel import run_parallel
from launchpad.wormhole.plan import Chunk, stripe
from launchpad.wormhole.progress import Meter, ProgressCallback, TransferStats
from launchpad.wormhole.sinks import BufferSink, FileSink, Sink, Slot, TensorSink, check_spec, make_slot
from launchpad.wormhole.transport import Stream, TcpTransport, Transport
from launchpad.wormhole.wire import CHUNK, PIECE, TRAILER, digest, recv_frame, send_status
from torchpass_common import log
from torchpass_common.errors import WormholeError

MAX_STREAMS = 64
MAX_HANDSHAKES = 32  # connections being authenticated at once; more are closed at once (a flood)
_SHED_LOG_EVERY = 1.0  # seconds between two logs of connections closed over MAX_HANDSHAKES


def _recv_chunks(stream: Stream, index: int, chunks: list[Chunk], sinks: list[Sink], meter: Meter) -> None:
    header = bytearray(CHUNK.size)
    for c in chunks:
        stream.recv_into(memoryview(header))
        if CHUNK.unpack(header) != (c.item, c.offset, c.length):
            raise WormholeError(f"stream {index} out of step: expected chunk {c}, got (item, offset, length) "
                                f"{CHUNK.unpack(header)}", peer=stream.peer,
                                hint="the stream was corrupted; retry the transfer")
        sink, hashed = sinks[c.item], digest()
        for lo in range(c.offset, c.offset + c.length, PIECE):
            with sink.view[lo:min(lo + PIECE, c.offset + c.length)] as piece:
                stream.recv_into(piece)
                hashed.update(piece)
        if TRAILER.unpack(stream.recv_exact(TRAILER.size))[0] != hashed.intdigest():
            raise WormholeError(f"checksum mismatch in {sink.path} bytes {c.offset}..{c.offset + c.length} "
                                f"on stream {index} (corrupted in transit)", peer=stream.peer,
                                hint="retry the transfer; if it repeats, check the NIC and link")
        meter.add(c.length)


class StateReceiver:
    """One transfer's receiving end. Construct it (it binds and, given a ``template``, allocates
    and pre-faults its receive buffers) before the pause; hand ``.port`` to the sender; call
    ``receive(timeout)`` once.

    ``template``: a state of the same structure (e.g. the joiner's own model and optimizer state);
    its tensors are matched by path and filled. With ``in_place=False`` (default) bytes land in
    staging buffers that are copied into the template only after every chunk verified; with
    ``in_place=True`` they land in the template's tensors directly (fastest; after a failure those
    tensors hold partial data). ``files_dir``: where File leaves are written (``name.part`` until
    commit). ``progress``: called from stream threads with Progress snapshots.
    ``handshake_timeout``: the deadline of each connection's whole authentication;
    ``max_handshakes``: how many run at once (a connection over the cap is closed at once, counted
    in ``shed``; the sender retries such a stream until its timeout)."""

    def __init__(self, bind_host: str, port: int = 0, token: bytes = b"", *, streams: int = 2,
                 template: Any = None, in_place: bool = False, files_dir: str | Path | None = None,
                 progress: ProgressCallback | None = None, transport: Transport | None = None,
                 handshake_timeout: float = 5.0, max_handshakes: int = MAX_HANDSHAKES,
                 context: Mapping[str, Any] | None = None) -> None:
        self._token = check_token(token)
        if not 1 <= streams <= MAX_STREAMS:
            raise WormholeError(f"invalid wormhole streams={streams}", hint=f"use 1..{MAX_STREAMS}")
        if max_handshakes < streams:
            raise WormholeError(f"invalid wormhole max_handshakes={max_handshakes}",
                                hint=f"allow at least as many concurrent handshakes as streams ({streams})")
        self.streams = streams
        self._where = dict(context or {})
        self._log = log.get(**self._where)
        self._transport = transport or TcpTransport()
        self._in_place = in_place
        self._files_dir = Path(files_dir) if files_dir is not None else None
        self._progress = progress
        self._handshake_timeout = handshake_timeout
        self._max_handshakes = max_handshakes
        self._handshake_slots = threading.BoundedSemaphore(max_handshakes)
        self._handshaking: dict[Stream, float] = {}  # stream -> deadline of its authentication
        self._expired: set[Stream] = set()  # closed by the acceptor at their deadline
        self.shed = 0  # connections closed at once because max_handshakes were running
        self._shed_logged = (0, 0.0)  # shed count and time at the last wormhole.shed log
        self._slots: dict[str, Slot] = {}
        if template is not None:
            self._slots = {leaf.path: make_slot(leaf.value, in_place) for leaf in leaves_of(template)
                           if isinstance(leaf.value, torch.Tensor)}
        self._listener = self._transport.listen(bind_host, port)
        self.port = self._listener.port
        self.refused: list[str] = []
        self._lock = threading.Lock()
        self._accepting = False
        self._pending: set[Stream] = set()
        self.stats: TransferStats | None = None
        self._log.info("wormhole.listening", host=bind_host, port=self.port, streams=streams,
                       template_tensors=len(self._slots), in_place=in_place)

    def __enter__(self) -> StateReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening (receive() does this itself when it returns)."""
        self._listener.close()

    def _refuse(self, stream: Stream, reason: str) -> None:
        self.refused.append(reason)
        self._log.warning("wormhole.refused", peer=stream.peer, reason=reason)
        stream.close()

    def _handshake(self, stream: Stream, results: queue.Queue[tuple[Stream, StreamInfo | Refused]]) -> None:
        try:
            stream.set_timeout(self._handshake_timeout)
            outcome: StreamInfo | Refused = server_handshake(stream, self._token)
        except Refused as exc:
            outcome = exc
        except WormholeError as exc:
            outcome = Refused(exc.message, peer=stream.peer)
        finally:
            with self._lock:
                self._handshaking.pop(stream, None)
                expired = stream in self._expired
                self._expired.discard(stream)
            self._handshake_slots.release()
        if expired and isinstance(outcome, Refused):
            outcome = Refused(f"{outcome.message}; its handshake deadline of {self._handshake_timeout:g} s passed",
                              peer=stream.peer)
        with self._lock:
            if self._accepting:
                results.put((stream, outcome))
                return
        stream.close()  # receive() has already returned

    def _expire_handshakes(self) -> None:
        """Close every connection whose authentication ran past its deadline (a peer trickling
        bytes would otherwise hold its slot; each read alone is bounded by the same time)."""
        now = time.monotonic()
        with self._lock:
            late = [s for s, deadline in self._handshaking.items() if deadline < now and s not in self._expired]
            self._expired.update(late)
        for s in late:
            s.close()  # its handshake thread wakes up and reports the refusal

    def _shed(self, stream: Stream) -> None:
        """Close a connection over the handshake cap at once, unauthenticated."""
        stream.close()
        self.shed += 1
        self._log_shed()

    def _log_shed(self, *, final: bool = False) -> None:
        """Log how many connections were shed since the last log: at most once a second, and once
        more when accepting ends (``final``)."""
        logged, at = self._shed_logged
        now = time.monotonic()
        if self.shed > logged and (final or now - at >= _SHED_LOG_EVERY):
            self._log.warning("wormhole.shed", connections=self.shed - logged, total=self.shed,
                              max_handshakes=self._max_handshakes, port=self.port,
                              hint="a flood of connections: they were closed unauthenticated")
            self._shed_logged = (self.shed, now)

    def _acceptor(self, results: queue.Queue[tuple[Stream, StreamInfo | Refused]]) -> None:
        """Accept every incoming connection and authenticate it in its own thread, so a silent
        stranger delays nobody; at most max_handshakes at once, each within handshake_timeout."""
        while self._accepting:
            try:
                stream = self._listener.accept(0.2)
            except OSError:
                return  # listener closed
            self._expire_handshakes()
            if stream is None:
                continue
            if not self._handshake_slots.acquire(blocking=False):
                self._shed(stream)
                continue
            with self._lock:
                self._pending.add(stream)
                self._handshaking[stream] = time.monotonic() + self._handshake_timeout
            try:
                threading.Thread(target=self._handshake, args=(stream, results), daemon=True,
                                 name="wormhole-handshake").start()
            except RuntimeError:  # no thread could be started: treat it as over the cap
                with self._lock:
                    self._pending.discard(stream)
                    self._handshaking.pop(stream, None)
                self._handshake_slots.release()
                self._shed(stream)

    def _accept(self, deadline: float) -> list[Stream]:
        """Wait until one session's streams all authenticated; refuse (and log) everyone else."""
        results: queue.Queue[tuple[Stream, StreamInfo | Refused]] = queue.Queue()
        accepted: dict[int, Stream] = {}
        session: bytes | None = None
        self._accepting = True
        acceptor = threading.Thread(target=self._acceptor, args=(results,), daemon=True,
                                    name="wormhole-acceptor")
        acceptor.start()
        try:
            while len(accepted) < self.streams:
                try:
                    stream, outcome = results.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise WormholeError(
                        f"no authenticated sender within the timeout ({len(accepted)} of {self.streams} "
                        f"streams; {len(self.refused)} peers refused, {self.shed} connections closed over "
                        f"the limit of {self._max_handshakes} concurrent handshakes)", port=self.port,
                        hint="check the sender got this address and the migration's token") from None
                with self._lock:
                    self._pending.discard(stream)
                if isinstance(outcome, Refused):
                    self._refuse(stream, outcome.message)
                    continue
                if outcome.count != self.streams:
                    reason = f"sender uses {outcome.count} streams, receiver expects {self.streams}"
                elif session not in (None, outcome.session) or outcome.index in accepted \
                        or outcome.index >= self.streams:
                    reason = "stream belongs to another transfer session"
                else:
                    session = outcome.session
                    stream.set_timeout(self._transport.io_timeout)
                    admit(stream)
                    accepted[outcome.index] = stream
                    continue
                try:
                    turn_away(stream, reason)
                except WormholeError:
                    pass  # it hung up already; the refusal is logged below either way
                self._refuse(stream, reason)
        except BaseException:
            for s in accepted.values():
                s.close()
            raise
        finally:
            with self._lock:
                self._accepting = False
                pending, self._pending = self._pending, set()
            for s in pending:
                s.close()
            self._listener.close()
            acceptor.join(1.0)
            self._log_shed(final=True)
            while not results.empty():  # handshakes that finished after the last get()
                results.get()[0].close()
        return [accepted[i] for i in range(self.streams)]

    def _open_sinks(self, manifest: dict[str, Any]) -> list[Sink]:
        sinks: list[Sink] = []
        try:
            for spec in manifest["leaves"]:
                spec = check_spec(spec)
                if spec["k"] == "tensor":
                    sinks.append(TensorSink(spec, self._slots.get(spec["p"])))
                elif spec["k"] == "buffer":
                    sinks.append(BufferSink(spec))
                elif self._files_dir is None:
                    raise WormholeError(f"sender sends file {spec.get('name')!r} ({spec['p']}) but this "
                                        "receiver has no files_dir", hint="pass files_dir= to StateReceiver")
                else:
                    sinks.append(FileSink(spec, self._files_dir))
        except BaseException:
            for s in sinks:
                s.abort()
            raise
        return sinks

    def _read_manifest(self, stream: Stream) -> dict[str, Any]:
        try:
            manifest = msgpack.unpackb(recv_frame(stream, "manifest"), raw=False)
            ok = isinstance(manifest, dict) and isinstance(manifest.get("leaves"), list) \
                and isinstance(manifest.get("skeleton"), bytes) and isinstance(manifest.get("chunk"), int) \
                and manifest["chunk"] >= 4096
        except (ValueError, msgpack.UnpackException) as exc:
            raise WormholeError(f"manifest is not valid msgpack: {exc}", peer=stream.peer) from exc
        if not ok:
            raise WormholeError("manifest lacks leaves, skeleton or chunk size", peer=stream.peer,
                                hint="sender and receiver run different TorchPass versions")
        unflatten(manifest["skeleton"], [None] * len(manifest["leaves"]))  # malformed: fail before any data
        return manifest

    def start(self, timeout: float) -> Future[Any]:
        """Run ``receive(timeout)`` in a background thread; the Future holds the state or the
        WormholeError (asyncio callers: ``await asyncio.wrap_future(rx.start(t))``)."""
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(self.receive(timeout))
            except BaseException as exc:  # delivered through the future
                future.set_exception(exc)

        threading.Thread(target=run, name="wormhole-receive", daemon=True).start()
        return future

    def receive(self, timeout: float) -> Any:
        """Wait up to ``timeout`` seconds for the sender and the whole state; return the rebuilt
        state. Raises WormholeError (timeout, torn stream, checksum mismatch, mismatched template)."""
        deadline = time.monotonic() + timeout
        streams: list[Stream] = []
        try:
            streams = self._accept(deadline)
            manifest = self._read_manifest(streams[0])
            sinks = self._open_sinks(manifest)
            try:
                meter = Meter(sum(s.spec["n"] for s in sinks), self._progress)
                self._log.info("wormhole.receiving", bytes=meter.total, leaves=len(sinks), peer=streams[0].peer)
                plan = stripe([s.spec["n"] for s in sinks], self.streams, manifest["chunk"])
                run_parallel([partial(_recv_chunks, st, i, plan[i], sinks, meter) for i, st in enumerate(streams)],
                             deadline=deadline, abort=lambda: [s.close() for s in streams],
                             what="wormhole receive")
                seconds = meter.finish()
                state = unflatten(manifest["skeleton"], [s.commit() for s in sinks])
            except BaseException:
                for s in sinks:
                    s.abort()
                raise
            for st in streams:
                send_status(st, True)
        except WormholeError as exc:
            for st in streams:
                try:
                    send_status(st, False, exc.message)
                except WormholeError:
                    pass  # that stream is gone already; the sender sees it broken
            touched = self._in_place and bool(self._slots)
            hint = ("template tensors received in place hold partial data: rebuild them before retrying"
                    if touched else "nothing was loaded: the template and any files are as before; retry")
            if exc.hint:  # what the failure itself says to do (e.g. a refused pickled value) comes first
                hint = f"{exc.hint}; {hint}"
            self._log.error("wormhole.receive_failed", error=str(exc), template_touched=touched)
            raise WormholeError(f"receiving state failed: {exc.message}", hint=hint,
                                **{**exc.where, **self._where}) from exc
        finally:
            for st in streams:
                st.close()
            self.close()
        self.stats = TransferStats(meter.total, seconds, self.streams, len(sinks), self._transport.name)
        self._log.info("wormhole.received", bytes=meter.total, seconds=round(seconds, 4),
                       gbps=round(self.stats.gbps, 3), streams=self.streams, leaves=len(sinks),
                       refused=len(self.refused))
        return state
