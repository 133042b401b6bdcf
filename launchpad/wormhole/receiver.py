"""The receiving end of the wormhole: ``StateReceiver`` listens, refuses (and logs) every peer
that fails the token challenge, takes the manifest, receives each chunk with recv_into straight
into its destination (template tensors, fresh tensors, files), verifies every checksum, and only
then commits and rebuilds the state. A failed transfer leaves caller-visible state untouched
(except template tensors received with ``in_place=True``, which the error then says)."""

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
    commit). ``progress``: called from stream threads with Progress snapshots."""

    def __init__(self, bind_host: str, port: int = 0, token: bytes = b"", *, streams: int = 2,
                 template: Any = None, in_place: bool = False, files_dir: str | Path | None = None,
                 progress: ProgressCallback | None = None, transport: Transport | None = None,
                 handshake_timeout: float = 5.0, context: Mapping[str, Any] | None = None) -> None:
        self._token = check_token(token)
        if not 1 <= streams <= MAX_STREAMS:
            raise WormholeError(f"invalid wormhole streams={streams}", hint=f"use 1..{MAX_STREAMS}")
        self.streams = streams
        self._where = dict(context or {})
        self._log = log.get(**self._where)
        self._transport = transport or TcpTransport()
        self._in_place = in_place
        self._files_dir = Path(files_dir) if files_dir is not None else None
        self._progress = progress
        self._handshake_timeout = handshake_timeout
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
        stream.set_timeout(self._handshake_timeout)
        try:
            outcome: StreamInfo | Refused = server_handshake(stream, self._token)
        except Refused as exc:
            outcome = exc
        except WormholeError as exc:
            outcome = Refused(exc.message, peer=stream.peer)
        with self._lock:
            if self._accepting:
                results.put((stream, outcome))
                return
        stream.close()  # receive() has already returned

    def _acceptor(self, results: queue.Queue[tuple[Stream, StreamInfo | Refused]]) -> None:
        """Accept every incoming connection and authenticate it in its own thread, so a silent
        stranger delays nobody."""
        while self._accepting:
            try:
                stream = self._listener.accept(0.2)
            except OSError:
                return  # listener closed
            if stream is not None:
                with self._lock:
                    self._pending.add(stream)
                threading.Thread(target=self._handshake, args=(stream, results), daemon=True,
                                 name="wormhole-handshake").start()

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
                        f"streams; {len(self.refused)} peers refused)", port=self.port,
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
