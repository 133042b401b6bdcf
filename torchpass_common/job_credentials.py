"""How a launchpad proves which job it belongs to and gets that job's broker account. The launchpad
sends a munge credential whose payload names the job and its node (``fetch``); torchpassd's
``CredentialServer`` unmunges it (forged, expired and replayed credentials fail there), checks the
encoding uid is the job's owner and the node one of the job's nodes (``lookup``, from Slurm), and
replies with the account, the password sealed in a munge credential only that uid may decode."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self

from torchpass_common import log
from torchpass_common.errors import TorchPassError
from torchpass_common.rate_limit import RateLimit

PROOF = "torchpass-job-proof/v1"
_PAYLOAD_RE = re.compile(rf"{re.escape(PROOF)} job=([A-Za-z0-9_.-]{{1,64}}) node=([A-Za-z0-9_.-]{{1,128}})")
MAX_LINE = 4096
RATE, BURST = 5.0, 20.0  # credential requests a second per peer address (a node's launchpads at job start fit the burst)
TIMEOUT = 10.0


class CredentialError(TorchPassError):
    """A job-credential request was refused, or could not be made."""


@dataclass(frozen=True)
class JobFacts:
    """What torchpassd checks a proof against: the job owner's uid and the job's nodes (Slurm), and
    the job's start time (a job id Slurm uses again names another job, with other credentials)."""

    owner_uid: int
    nodes: tuple[str, ...]
    started: int


Lookup = Callable[[str], Awaitable[JobFacts | None]]
Issue = Callable[[str, int], Awaitable[tuple[str, str]]]  # (job, started) -> (username, password)


async def _munge(tool: str, args: list[str], data: bytes, socket: str) -> tuple[int, str, str]:
    argv = [tool, *(["--socket", socket] if socket else []), *args]
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        raise CredentialError(f"cannot run {tool}: {exc.strerror}", hint="install munge (apt install munge)") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(data), TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise CredentialError(f"{tool} did not answer within {TIMEOUT} s", hint="check that munged runs") from None
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace").strip()


async def seal(payload: str, *, uid: int | None = None, socket: str = "") -> str:
    """A munge credential carrying ``payload`` (encrypted), decodable only by ``uid`` when given."""
    rc, out, err = await _munge("munge", ["--restrict-uid", str(uid)] if uid is not None else [],
                                payload.encode(), socket)
    if rc:
        raise CredentialError(f"munge failed: {err or rc}", hint="check that munged runs (and munge_socket)")
    return out.strip()


async def unseal(credential: str, *, socket: str = "") -> tuple[int, str]:
    """(uid of the encoder, payload) of a munge credential; CredentialError with munge's reason
    for a forged, expired, replayed or foreign credential."""
    rc, out, err = await _munge("unmunge", [], credential.encode(), socket)
    meta, _, payload = out.partition("\n\n")
    if rc:
        status = re.search(r"STATUS:\s+(.*)", meta)
        reason = status.group(1) if status else (err.removeprefix("unmunge: Error: ") or f"exit {rc}")
        raise CredentialError(f"munge credential refused: {reason}")
    uid = re.search(r"^UID:\s+.*\((\d+)\)$", meta, re.M)
    if uid is None:
        raise CredentialError("unmunge reported no UID")
    return int(uid.group(1)), payload


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class CredentialServer:
    """torchpassd's endpoint (TCP, one JSON line each way) handing out job broker accounts."""

    def __init__(self, host: str, port: int, lookup: Lookup, issue: Issue, *, munge_socket: str = "",
                 refused: Callable[[str], None] = lambda reason: None) -> None:
        self.host, self.port = host, port
        self.lookup, self.issue, self.munge_socket = lookup, issue, munge_socket
        self.refused = refused  # told "rate", "request" (malformed, timed out) or "proof" on each refusal
        self._rate, self._rate_logged = RateLimit(RATE, BURST), RateLimit(1.0, 1.0)
        self._server: asyncio.Server | None = None
        self.log = log.get()

    async def __aenter__(self) -> Self:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_LINE)
        except OSError as exc:
            raise CredentialError(f"cannot listen on {self.host}:{self.port} for job credentials: {exc.strerror}",
                                  hint="check orchestrator.credentials_endpoint") from exc
        self.port = self._server.sockets[0].getsockname()[1]
        self.log.info("credentials.listening", port=self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(TIMEOUT):
                line = await reader.readuntil(b"\n")
                reply = await self.answer(line, peer=str(peer[0]) if peer else "?")
            writer.write(_line(reply))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            self.log.warning("credentials.refused", peer=str(peer), reason=f"bad request: {type(exc).__name__}")
            self.refused("request")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def answer(self, line: bytes, *, peer: str = "?") -> dict[str, Any]:
        """The reply to one request line: the account, or ``ok: false`` with why (also logged).
        Each peer address gets at most RATE answers a second (each costs two munge calls)."""
        if not self._rate.allow(peer):
            self.refused("rate")
            if self._rate_logged.allow(peer):  # a flood is logged once a second, counted in full
                self.log.warning("credentials.refused", peer=peer, reason=f"more than {RATE:g} requests a second")
            return {"ok": False, "error": f"more than {RATE:g} credential requests a second from {peer}",
                    "hint": "a launchpad asks once at start: retry in a second"}
        try:
            return {"ok": True, **await self._check_and_issue(line)}
        except TorchPassError as exc:
            self.log.warning("credentials.refused", peer=peer, reason=str(exc))
            self.refused("proof")
            return {"ok": False, "error": exc.message, "hint": exc.hint}

    async def _check_and_issue(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            credential = request["credential"]
            if not isinstance(credential, str) or not credential.startswith("MUNGE:"):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            raise CredentialError('expected {"credential": "MUNGE:..."}') from None
        uid, payload = await unseal(credential, socket=self.munge_socket)
        m = _PAYLOAD_RE.fullmatch(payload)
        if m is None:
            raise CredentialError("the munge credential is not a TorchPass job proof",
                                  hint="launchpad makes it: munge payload 'torchpass-job-proof/v1 job=J node=N'")
        job, node = m.groups()
        facts = await self.lookup(job)
        if facts is None:
            raise CredentialError(f"job {job} is not a running TorchPass job", job=job, node=node)
        if uid != facts.owner_uid:
            raise CredentialError(f"uid {uid} does not own job {job}", job=job, node=node,
                                  hint="only the job's owner gets its broker account")
        if node not in facts.nodes:
            raise CredentialError(f"node {node} is not one of job {job}'s nodes ({','.join(facts.nodes)})",
                                  job=job, node=node)
        username, password = await self.issue(job, facts.started)
        self.log.info("credentials.issued", job=job, node=node, uid=uid, username=username)
        return {"username": username, "sealed": await seal(password, uid=uid, socket=self.munge_socket)}


async def fetch(endpoint: str, job: str, node: str, *, munge_socket: str = "", wait: float = 0.0) -> tuple[str, str]:
    """Ask torchpassd at ``endpoint`` (HOST:PORT) for ``job``'s broker account; (username, password).
    An unreachable torchpassd is retried for up to ``wait`` seconds (a refusal is final)."""
    host, _, port = endpoint.rpartition(":")
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + wait, 0.2
    while True:
        proof = await seal(f"{PROOF} job={job} node={node}", socket=munge_socket)  # each one is used once
        try:
            async with asyncio.timeout(TIMEOUT):
                reader, writer = await asyncio.open_connection(host, int(port), limit=MAX_LINE)
                try:
                    writer.write(_line({"credential": proof}))
                    reply = json.loads(await reader.readuntil(b"\n"))
                finally:
                    writer.close()
            break
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            if loop.time() + delay > deadline:
                raise CredentialError(f"no job credentials from torchpassd at {endpoint}: {exc or type(exc).__name__}",
                                      job=job, node=node,
                                      hint="check that torchpassd runs and orchestrator.credentials_endpoint") from exc
            log.get(job=job, node=node).warning("credentials.retry", endpoint=endpoint, error=str(exc) or type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
    if not reply.get("ok"):
        raise CredentialError(f"torchpassd refused the job credentials: {reply.get('error')}", job=job, node=node,
                              hint=reply.get("hint"))
    _uid, password = await unseal(str(reply.get("sealed", "")), socket=munge_socket)
    return str(reply["username"]), password
