"""The client end of torchpassd's control socket, used by torchpassctl: one blocking call per
request, with errors that tell an operator what to do (daemon not running, stale socket, no
permission and which group grants it, no answer in time, or the daemon's own refusal)."""

from __future__ import annotations

import errno
import grp
import os
import socket
import stat
from pathlib import Path
from typing import Any

from torchpassd.control_socket import MAX_LINE, ControlSocketError, decode_line, encode_line

DEFAULT_TIMEOUT = 30.0
_START_HINT = "start it (systemctl start torchpassd) or check orchestrator.control_socket in the config"


def _permission_hint(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "run torchpassctl as root"
    if st.st_mode & stat.S_IWGRP and st.st_gid != 0:
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return f"run torchpassctl as root or as a member of group {group!r} (orchestrator.control_group)"
    return "run torchpassctl as root, or set orchestrator.control_group to grant a group access"


class DaemonClient:
    """Talks to the torchpassd listening on ``path``."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.path = Path(path)
        self.timeout = timeout

    def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result; ControlSocketError on any failure."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            self._connect(sock)
            sock.sendall(encode_line({"op": op, "args": args}))
            reply = self._read_line(sock, op)
        finally:
            sock.close()
        if not reply.get("ok"):
            raise ControlSocketError(f"torchpassd refused {op}: {reply.get('error', 'no reason given')}",
                                     hint=reply.get("hint"), **reply.get("where", {}))
        return reply.get("result")

    def _connect(self, sock: socket.socket) -> None:
        try:
            sock.connect(str(self.path))
        except FileNotFoundError:
            raise ControlSocketError(f"torchpassd is not running: no control socket at {self.path}",
                                     hint=_START_HINT) from None
        except ConnectionRefusedError:
            raise ControlSocketError(f"torchpassd is not running: {self.path} is a stale socket",
                                     hint=_START_HINT) from None
        except PermissionError:
            raise ControlSocketError(f"permission denied on the control socket {self.path}",
                                     hint=_permission_hint(self.path)) from None
        except TimeoutError:
            raise ControlSocketError(f"torchpassd did not accept a connection on {self.path} "
                                     f"within {self.timeout} s", hint="it may be overloaded or hung; "
                                     "see journalctl -u torchpassd") from None
        except OSError as exc:
            if exc.errno == errno.ENOTSOCK:
                raise ControlSocketError(f"{self.path} is not a socket", hint=_START_HINT) from None
            raise ControlSocketError(f"cannot connect to torchpassd at {self.path}: {exc.strerror}") from exc

    def _read_line(self, sock: socket.socket, op: str) -> dict[str, Any]:
        buf = bytearray()
        while not buf.endswith(b"\n"):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise ControlSocketError(f"torchpassd did not answer {op} within {self.timeout} s",
                                         hint="see journalctl -u torchpassd") from None
            except ConnectionError as exc:
                raise ControlSocketError(f"torchpassd dropped the connection during {op}: {exc}") from exc
            if not chunk:
                raise ControlSocketError(f"torchpassd closed the connection without answering {op}",
                                         hint="it may have crashed; see journalctl -u torchpassd")
            buf += chunk
            if len(buf) > MAX_LINE:
                raise ControlSocketError(f"reply to {op} is longer than {MAX_LINE} bytes")
        return decode_line(bytes(buf))
