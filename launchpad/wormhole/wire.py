"""The wormhole's wire format after authentication: length-prefixed checksummed frames (the
manifest), the header and checksum trailer around each data chunk, and the final status frame a
receiver sends back. One home for every struct layout; knows nothing of sockets or tensors."""

from __future__ import annotations

import struct

import xxhash

from launchpad.wormhole.transport import Stream
from torchpass_common.errors import WormholeError

MAGIC = b"TPWH"
VERSION = 1

_FRAME = struct.Struct("!QQ")  # length, XXH3-64 digest of the body
CHUNK = struct.Struct("!IQI")  # item index, offset in item, length; the payload follows
TRAILER = struct.Struct("!Q")  # XXH3-64 digest of the payload, after it
# Bytes checksummed right before they are sent and right after they arrive, while still in the
# last-level cache, and moved by one sendmsg / recv_into: 8 MiB (one default chunk) rather than 1 MiB
# cut the sender's CPU per GB by 22% and the transfer's time by 9% on the dev VM (loopback, 1 GiB,
# 30 transfers each, interleaved): fewer system calls and wake-ups, the same cache behaviour.
PIECE = 8 << 20
_STATUS = struct.Struct("!BI")  # ok flag, message length

MAX_FRAME = 1 << 30
MAX_STATUS_MESSAGE = 4096


def checksum(data: bytes | memoryview) -> int:
    """XXH3-64 digest of ``data``: on the dev VM 45-55 GB/s on cache-hot data, 17-36 GB/s (busy or
    quiet VM) reading from memory (its cost on the sender, who reads the state first); 2.3x
    hardware CRC-32C."""
    return xxhash.xxh3_64_intdigest(data)


def digest() -> xxhash.xxh3_64:
    """An incremental XXH3-64 (``update(piece)``, ``intdigest()``) equal to checksum() of the whole."""
    return xxhash.xxh3_64()


def send_frame(stream: Stream, body: bytes) -> None:
    """Send one frame: 12-byte header (length, checksum) then ``body``."""
    stream.send(_FRAME.pack(len(body), checksum(body)) + body)


def recv_frame(stream: Stream, what: str) -> bytes:
    """Receive one frame and verify its size limit and checksum; ``what`` names it in errors."""
    length, crc = _FRAME.unpack(stream.recv_exact(_FRAME.size))
    if length > MAX_FRAME:
        raise WormholeError(f"{what} frame of {length} bytes exceeds the {MAX_FRAME}-byte limit",
                            peer=stream.peer, hint="the peer is not a compatible wormhole sender")
    body = stream.recv_exact(length)
    if checksum(body) != crc:
        raise WormholeError(f"{what} frame failed its checksum (corrupted in transit)", peer=stream.peer,
                            hint="retry the transfer; if it repeats, check the network path")
    return body


def send_status(stream: Stream, ok: bool, message: str = "") -> None:
    """Tell the sender how the transfer ended on this stream (receiver side)."""
    raw = message.encode()[:MAX_STATUS_MESSAGE]
    stream.send(_STATUS.pack(1 if ok else 0, len(raw)) + raw)


def recv_status(stream: Stream) -> tuple[bool, str]:
    """Read the receiver's verdict (sender side): (ok, message)."""
    ok, length = _STATUS.unpack(stream.recv_exact(_STATUS.size))
    if length > MAX_STATUS_MESSAGE:
        raise WormholeError("receiver status message too long", peer=stream.peer)
    return bool(ok), stream.recv_exact(length).decode(errors="replace")
