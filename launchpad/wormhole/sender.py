"""The sending end of the wormhole: ``send_state`` authenticates every stream against the
receiver, sends the manifest (skeleton + leaf headers), then streams each leaf's bytes straight
from tensor/file memory in checksummed chunks striped over parallel streams, and returns once the
receiver has verified and committed everything."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import msgpack

from launchpad.wormhole.auth import StreamInfo, Unanswered, check_token, client_handshake
from launchpad.wormhole.layout import flatten
from launchpad.wormhole.parallel import run_parallel
from launchpad.wormhole.payload import Source, make_source
from launchpad.wormhole.plan import Chunk, stripe
from launchpad.wormhole.progress import Meter, ProgressCallback, TransferStats
from launchpad.wormhole.transport import Stream, TcpTransport, Transport
from launchpad.wormhole.wire import CHUNK, PIECE, TRAILER, digest, recv_status, send_frame
from torchpass_common import log
from torchpass_common.errors import WormholeError

MAX_STREAMS = 64
_RETRY_FIRST, _RETRY_MAX = 0.02, 0.5  # seconds between tries of a stream the receiver hung up on
_RETRY_FOR = 30.0  # seconds a stream is tried again at most (several of the receiver's handshake deadlines)


def _open_stream(transport: Transport, host: str, port: int, token: bytes, info: StreamInfo,
                 deadline: float, logger: Any) -> Stream:
    """Connect and authenticate one stream; a receiver that hangs up before its challenge (it
    sheds connections over its handshake cap while strangers flood it) is tried again, with
    backoff, for up to _RETRY_FOR seconds (at most until ``deadline``)."""
    delay, tries = _RETRY_FIRST, 0
    deadline = min(deadline, time.monotonic() + _RETRY_FOR)
    while True:
        stream = transport.connect(host, port, timeout=max(0.001, min(10.0, deadline - time.monotonic())))
        try:
            client_handshake(stream, token, info)
            return stream
        except Unanswered as exc:
            stream.close()
            tries += 1
            if time.monotonic() + delay >= deadline:
                raise WormholeError(f"{exc.message}; {tries} tries in {_RETRY_FOR:g} s or until the timeout",
                                    peer=exc.where.get("peer"),
                                    hint="the receiver was busy the whole time (a flood?) or is not a "
                                         "wormhole receiver") from exc
            if tries == 1:
                logger.warning("wormhole.retrying", stream=info.index, error=exc.message)
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)
        except BaseException:
            stream.close()
            raise


def _send_chunks(stream: Stream, chunks: list[Chunk], sources: list[Source], meter: Meter) -> None:
    try:
        trailer = b""
        for c in chunks:
            prefix, hashed = trailer + CHUNK.pack(c.item, c.offset, c.length), digest()
            for lo in range(c.offset, c.offset + c.length, PIECE):
                with sources[c.item].view[lo:min(lo + PIECE, c.offset + c.length)] as piece:
                    hashed.update(piece)
                    stream.send(prefix, piece)  # one gathered write: previous trailer, header, bytes
                prefix = b""
            trailer = TRAILER.pack(hashed.intdigest())
            meter.add(c.length)
        stream.send(trailer)
        ok, message = recv_status(stream)
    except WormholeError as exc:
        stream.set_timeout(1.0)
        try:  # the receiver may have said why it hung up
            ok, message = recv_status(stream)
        except WormholeError:
            raise exc from None
        if ok:
            raise
    if not ok:
        raise WormholeError(f"receiver rejected the transfer: {message}", peer=stream.peer)


def send_state(state: Any, host: str, port: int, token: bytes, *, streams: int = 2,
               chunk_bytes: int = 8 << 20, progress: ProgressCallback | None = None,
               transport: Transport | None = None, timeout: float = 600.0,
               context: Mapping[str, Any] | None = None) -> TransferStats:
    """Send ``state`` to the StateReceiver at ``host:port`` holding the same ``token``.

    ``streams`` parallel connections, ``chunk_bytes`` per checksummed chunk; ``progress`` is called
    from the stream threads with a Progress snapshot; ``timeout`` bounds the whole transfer (each
    socket operation is bounded by the transport's io_timeout); ``context`` (job, node, rank,
    migration) goes into logs and errors. Raises WormholeError; nothing is committed on the
    receiver unless this returns."""
    token = check_token(token)
    if not 1 <= streams <= MAX_STREAMS or chunk_bytes < 4096:
        raise WormholeError(f"invalid wormhole settings: streams={streams}, chunk_bytes={chunk_bytes}",
                            hint=f"streams must be 1..{MAX_STREAMS}, chunk_bytes at least 4096")
    where = dict(context or {})
    logger = log.get(peer=f"{host}:{port}", **where)
    transport = transport or TcpTransport()
    deadline = time.monotonic() + timeout
    skeleton, leaves = flatten(state)
    sources: list[Source] = []
    conns: list[Stream] = []
    try:
        sources = [make_source(leaf.value, leaf.path) for leaf in leaves]
        session = secrets.token_bytes(16)
        for index in range(streams):
            conns.append(_open_stream(transport, host, port, token, StreamInfo(session, index, streams),
                                      deadline, logger))
        sizes = [s.spec["n"] for s in sources]
        send_frame(conns[0], msgpack.packb({"skeleton": skeleton, "leaves": [s.spec for s in sources],
                                            "chunk": chunk_bytes}, use_bin_type=True))
        meter = Meter(sum(sizes), progress)
        plan = stripe(sizes, streams, chunk_bytes)
        run_parallel([partial(_send_chunks, c, plan[i], sources, meter) for i, c in enumerate(conns)],
                     deadline=deadline, abort=lambda: [c.close() for c in conns], what="wormhole send")
        seconds = meter.finish()
    except WormholeError as exc:
        logger.error("wormhole.send_failed", error=str(exc))
        raise WormholeError(f"sending state failed: {exc.message}", hint=exc.hint,
                            **{**exc.where, **where}) from exc
    finally:
        for c in conns:
            c.close()
        for s in sources:
            s.close()
    stats = TransferStats(meter.total, seconds, streams, len(sources), transport.name)
    logger.info("wormhole.sent", bytes=stats.bytes, seconds=round(seconds, 4), gbps=round(stats.gbps, 3),
                streams=streams, leaves=stats.leaves)
    return stats
