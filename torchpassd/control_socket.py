"""torchpassd's local control socket (server side) and its wire format, shared with ctl_client.
A Unix stream socket speaking newline-delimited JSON: request ``{"op": ..., "args": {...}}``,
reply ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ..., "hint": ...}``. Access is
by file permission: 0600 root only, or 0660 with a configured group. Ops are handlers given by
the daemon; this module knows none of them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import grp
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Self

from torchpass_common import log
from torchpass_common.errors import ConfigError, TorchPassError

MAX_LINE = 16 << 20
Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class ControlSocketError(TorchPassError):
    """The control socket could not be set up, or a request on it failed."""


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def encode_line(obj: dict[str, Any]) -> bytes:
    """One request or reply as a JSON line (dataclasses, e.g. journal records, become objects)."""
    return json.dumps(obj, default=_jsonable, separators=(",", ":")).encode() + b"\n"


def decode_line(line: bytes) -> dict[str, Any]:
    """Parse one JSON line into an object; ControlSocketError if it is not one."""
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlSocketError(f"not a JSON line: {exc}") from exc
    if not isinstance(obj, dict):
        raise ControlSocketError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _group_id(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"orchestrator.control_group {group!r} does not exist on this host",
                          hint="create the group (groupadd) or leave control_group empty for root only") from None


def _peer(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """(pid, uid) of the connected client, for the audit log."""
    sock = writer.get_extra_info("socket")
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


class ControlServer:
    """Serves ``handlers[op](args)`` on the Unix socket at ``path`` while entered."""

    def __init__(self, path: str | os.PathLike[str], handlers: Mapping[str, Handler], *, group: str = "") -> None:
        self.path = Path(path)
        self.handlers = dict(handlers)
        self.group = group
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        sock = self._bind()
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE)
        log.get().info("control.listening", path=str(self.path), group=self.group or None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _bind(self) -> socket.socket:
        """Bind under a temporary name, set owner and mode, then rename into place, so the
        socket is never reachable with looser permissions than configured."""
        gid = _group_id(self.group) if self.group else None
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._clear_stale()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            sock.bind(str(tmp))
            if gid is not None:
                os.chown(tmp, 0 if os.geteuid() == 0 else -1, gid)
            os.chmod(tmp, 0o660 if gid is not None else 0o600)
            os.rename(tmp, self.path)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise ControlSocketError(f"cannot create the control socket {self.path}: {exc.strerror}",
                                     hint="check orchestrator.control_socket and that its directory is writable") from exc
        return sock

    def _clear_stale(self) -> None:
        if not self.path.exists():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOTSOCK, errno.ENOENT):
                raise ControlSocketError(f"cannot probe existing control socket {self.path}: {exc.strerror}") from exc
            self.path.unlink(missing_ok=True)  # left over by a daemon that died
            return
        finally:
            probe.close()
        raise ControlSocketError(f"another torchpassd is already listening on {self.path}",
                                 hint="stop it first (systemctl stop torchpassd) or use another control_socket")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = _peer(writer)
        logger = log.get(peer_pid=pid, peer_uid=uid)
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    return  # client closed
                except asyncio.LimitOverrunError:
                    writer.write(encode_line({"ok": False, "error": f"request longer than {MAX_LINE} bytes"}))
                    return
                writer.write(await self._dispatch(line, logger))
                await writer.drain()
        except ConnectionError:
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _dispatch(self, line: bytes, logger: Any) -> bytes:
        try:
            request = decode_line(line)
            op, args = request.get("op"), request.get("args", {})
            if not isinstance(args, dict):
                raise ControlSocketError("args must be a JSON object")
            handler = self.handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ControlSocketError(f"unknown op {op!r}", hint=f"known ops: {', '.join(sorted(self.handlers))}")
            logger.info("control.request", op=op)
            return encode_line({"ok": True, "result": await handler(args)})
        except TorchPassError as exc:
            logger.warning("control.refused", error=str(exc))
            where = {k: str(v) for k, v in exc.where.items()}
            return encode_line({"ok": False, "error": exc.message, "hint": exc.hint, "where": where})
        except Exception as exc:  # a handler bug must not take the daemon's control socket down
            logger.exception("control.handler_failed")
            return encode_line({"ok": False, "error": f"internal error in torchpassd: {type(exc).__name__}: {exc}",
                                "hint": "see torchpassd's log (journalctl -u torchpassd)"})
