"""Per-stream mutual authentication with the per-migration token: an HMAC-SHA256
challenge-response in which both sides prove they hold the token and the token itself never
crosses the wire. Runs before any state byte is read or sent; also binds each stream to one
transfer session (session id, stream index, stream count)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

from launchpad.wormhole.transport import Stream
from launchpad.wormhole.wire import MAGIC, VERSION
from torchpass_common.errors import WormholeError

_NONCE = 32
_MAC = 32
_HELLO = struct.Struct(f"!4sH{_NONCE}s")  # magic, version, sender nonce
_CHALLENGE = struct.Struct(f"!4sH{_NONCE}s{_MAC}s")  # magic, version, receiver nonce, receiver proof
_BINDING = struct.Struct("!16sHH")  # session id, stream index, stream count
_VERDICT = struct.Struct("!BH")  # admitted flag, length of the reason that follows


@dataclass(frozen=True)
class StreamInfo:
    """Which transfer session a stream belongs to, and its place among that session's streams."""

    session: bytes
    index: int
    count: int


class Refused(WormholeError):
    """A connecting peer failed authentication (stranger, wrong token, garbage, port scan)."""


class Unanswered(WormholeError):
    """Sender side: the receiver hung up (or stayed silent) before its challenge, as it does with
    connections over its handshake cap during a flood; nothing but the hello was sent: retry."""


def _proof(token: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"torchpass-wormhole-" + role + b"".join(parts), hashlib.sha256).digest()


def check_token(token: bytes) -> bytes:
    """Validate a token's type and length (the orchestrator makes 32 random bytes)."""
    if not isinstance(token, bytes | bytearray) or len(token) < 16:
        raise WormholeError("wormhole token must be at least 16 bytes",
                            hint="pass the migration's token (secrets.token_bytes(32)), decoded from hex")
    return bytes(token)


def client_handshake(stream: Stream, token: bytes, info: StreamInfo) -> None:
    """Sender side: verify the receiver holds ``token`` before sending anything else, then prove it."""
    nonce_c = secrets.token_bytes(_NONCE)
    try:
        stream.send(_HELLO.pack(MAGIC, VERSION, nonce_c))
        challenge = stream.recv_exact(_CHALLENGE.size)
    except WormholeError as exc:
        raise Unanswered(f"receiver did not answer the hello ({exc.message})", peer=stream.peer,
                         hint="it may be busy refusing a flood of connections; the sender retries") from exc
    magic, version, nonce_r, proof_r = _CHALLENGE.unpack(challenge)
    if magic != MAGIC or version != VERSION:
        raise WormholeError(f"peer is not a wormhole receiver of version {VERSION}", peer=stream.peer,
                            hint="check the receiver address and that both nodes run the same TorchPass")
    if not hmac.compare_digest(proof_r, _proof(token, b"receiver", nonce_c, nonce_r)):
        raise WormholeError("receiver failed authentication: it does not hold this migration's token",
                            peer=stream.peer, hint="the address belongs to another migration or a stranger; "
                            "nothing was sent")
    binding = _BINDING.pack(info.session, info.index, info.count)
    stream.send(binding + _proof(token, b"sender", nonce_c, nonce_r, binding))
    verdict = stream.recv_exact(_VERDICT.size)
    ok, length = _VERDICT.unpack(verdict)
    if not ok:
        reason = stream.recv_exact(min(length, 1024)).decode(errors="replace")
        raise WormholeError(f"receiver refused this stream: {reason}", peer=stream.peer)


def admit(stream: Stream) -> None:
    """Receiver side, after server_handshake: take this authenticated stream into the transfer."""
    stream.send(_VERDICT.pack(1, 0))


def turn_away(stream: Stream, reason: str) -> None:
    """Receiver side: tell an authenticated (so trusted) sender why its stream is not taken."""
    raw = reason.encode()[:1024]
    stream.send(_VERDICT.pack(0, len(raw)) + raw)


def server_handshake(stream: Stream, token: bytes) -> StreamInfo:
    """Receiver side: challenge the peer; return its stream binding or raise Refused. The caller
    then answers with admit() or turn_away(); a peer that failed is told nothing."""
    try:
        hello = stream.recv_exact(_HELLO.size)
    except WormholeError as exc:
        raise Refused(f"peer sent no complete hello ({exc.message})", peer=stream.peer) from exc
    magic, version, nonce_c = _HELLO.unpack(hello)
    if magic != MAGIC:
        raise Refused("peer is not a wormhole sender (bad magic)", peer=stream.peer)
    if version != VERSION:
        raise Refused(f"wormhole protocol version {version} is not {VERSION}", peer=stream.peer,
                      hint="run the same TorchPass release on both nodes")
    nonce_r = secrets.token_bytes(_NONCE)
    stream.send(_CHALLENGE.pack(MAGIC, VERSION, nonce_r, _proof(token, b"receiver", nonce_c, nonce_r)))
    try:
        answer = stream.recv_exact(_BINDING.size + _MAC)
    except WormholeError as exc:
        raise Refused(f"peer did not answer the challenge ({exc.message})", peer=stream.peer) from exc
    binding, proof = answer[:_BINDING.size], answer[_BINDING.size:]
    if not hmac.compare_digest(proof, _proof(token, b"sender", nonce_c, nonce_r, binding)):
        raise Refused("peer failed authentication (wrong token)", peer=stream.peer)
    session, index, count = _BINDING.unpack(binding)
    return StreamInfo(session, index, count)
