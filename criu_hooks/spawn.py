"""How a worker must be started so that criu can move it to another node: in its own PID namespace
(its PIDs are free on any node), as a session leader (no controlling terminal: no --shell-job), stdin
from /dev/null, output to files or to pipes (re-attached on the target, see `stdio_pipes`), and no
parent-death signal on the worker itself (criu restores it, and it fires when criu exits)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from criu_hooks.errors import CriuFailed

# unshare stays in the caller's PID namespace as the parent; the worker is PID 1 of the new one. No
# --kill-child: criu restores a parent-death signal, which would then kill the restored worker.
PREFIX = ("unshare", "--pid", "--fork", "setsid")


def start(argv: Sequence[str], *, output: Path, env: Mapping[str, str] | None = None,
          cwd: str | None = None, enter: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a movable worker; stdout and stderr go (appended) to ``output``. ``enter``
    is a command prefix that puts it into a node's namespaces (criu must then run there too)."""
    with open(output, "ab") as out:
        return subprocess.Popen([*enter, *PREFIX, *argv], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(env) if env is not None else None, cwd=cwd)


def worker_pid(launcher: subprocess.Popen[bytes], *, timeout: float = 10.0) -> int:
    """The worker's PID (as this process sees it) under a launcher from `start`, once it leads its
    own session (setsid done): what criu dumps."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = children.read_text().split()
            if pids and session_of(int(pids[0])) == int(pids[0]):
                return int(pids[0])
        except OSError:
            pass
        if launcher.poll() is not None:
            break
        time.sleep(0.005)
    raise CriuFailed(f"worker under launcher {launcher.pid} did not start within {timeout:.0f} s",
                     hint="look at the worker's output file")


def stdio_pipes(pid: int) -> dict[int, str]:
    """The worker's stdin/stdout/stderr that are pipes, as criu names them ({1: "pipe:[123]"}): ship
    them with the images so that the target can give the restored worker its own pipes
    (runner.restore's ``inherit``). Read it before the dump."""
    out = {}
    for fd in (0, 1, 2):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:["):
            out[fd] = target
    return out


def session_of(pid: int) -> int:
    """The session id of process ``pid`` (OSError when it is gone)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[3])  # after "(comm)": state ppid pgrp session
