"""The hand-over of a ``srun python`` step's tasks (one task a rank) to their node's launchpad.

Slurm starts every task of the step; on each node the first one (SLURM_LOCALID 0) becomes launchpad
(spank/shim/python/sitecustomize.py execs it with ``--as-tasks``), and every other one connects to
launchpad's socket, hands it its environment and its stdout and stderr, and waits for its exit code.
launchpad starts each task's rank as a worker with that task's environment and its output on that
task's streams, so Slurm sees each task's output and exit code as it would without TorchPass.

The socket is abstract (one per network namespace: a node; gone with its process) and named by user,
job and step; each side checks that the other runs as the same user. A frame is a 4-byte big-endian
length and a JSON map; the task's two descriptors ride on its first bytes (SCM_RIGHTS). Standard
library only: the proxies are the user's own interpreters."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

from torchpass_common.errors import WorkerError

CONNECT_S = 120.0  # how long the tasks and launchpad wait for each other at the step's start
ENV_AS_TASKS = "TORCHPASS_AS_TASKS"  # "1" in a worker that is a srun python task's rank (torchpassd reads it)
ENV_TASK_PYTHON = "TORCHPASS_TASK_PYTHON"  # the interpreter the tasks run (their ranks run it too)
ENV_TASK_STEP = "TORCHPASS_TASK_STEP"  # JSON: STEP_VARS of the step, for a joiner that takes a task's rank
# what every task of a step has alike: a joiner's worker gets these from the step, its own rank's from its place
STEP_VARS = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODELIST",
             "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
             "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID",
             "SLURM_STEPID", "SLURM_DISTRIBUTION")
_LEN = struct.Struct(">I")
_FRAME_MAX = 4 << 20


def address(env: Mapping[str, str]) -> str:
    """The abstract socket of this node's launchpad for the step in ``env``."""
    return f"\0torchpass-tasks-{os.getuid()}-{env.get('SLURM_JOB_ID', '?')}.{env.get('SLURM_STEP_ID', '?')}"


def rank_vars(rank: int, local_rank: int, node_rank: int) -> dict[str, str]:
    """The SLURM_* by which a task knows its place (what SLURMEnvironment-style code reads)."""
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank), "SLURM_NODEID": str(node_rank)}


def step_vars(env: Mapping[str, str]) -> dict[str, str]:
    """STEP_VARS as ``env`` has them."""
    return {k: env[k] for k in STEP_VARS if k in env}


def _same_user(sock: socket.socket) -> bool:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid == os.getuid()


def _send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    frame = _LEN.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):  # nothing more to send after a whole frame: the other side may have closed already
        sock.sendall(frame[sent:])


def _recv(sock: socket.socket, *, max_fds: int = 0) -> tuple[dict, list[int]]:
    """One frame and the descriptors that came with it. WorkerError on a torn or malformed one
    (the descriptors are closed then)."""
    buf, fds = b"", []
    try:
        while len(buf) < _LEN.size or len(buf) < _LEN.size + _LEN.unpack_from(buf)[0]:
            if len(buf) >= _LEN.size and _LEN.unpack_from(buf)[0] > _FRAME_MAX:
                raise WorkerError("a task hand-over frame is too long")
            chunk, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, max_fds) if max_fds and not buf \
                else (sock.recv(1 << 16), [], 0, None)
            fds += got
            if not chunk:
                raise WorkerError("the other side of a task hand-over closed it mid-frame" if buf
                                  else "the other side of a task hand-over closed it")
            buf += chunk
        message = json.loads(buf[_LEN.size:])
        if not isinstance(message, dict):
            raise ValueError("not a map")
        return message, fds
    except (ValueError, OSError, WorkerError) as exc:
        for fd in fds:
            os.close(fd)
        raise exc if isinstance(exc, WorkerError) else WorkerError(f"a bad task hand-over frame: {exc}") from exc


def hand_over(env: Mapping[str, str], *, connect_s: float = CONNECT_S, streams: tuple[int, int] = (1, 2)) -> int:
    """This task's side (not the node's first): hand the environment and ``streams`` (stdout,
    stderr) to the node's launchpad and return the exit code it sends when the task's rank ended
    (here or on the node it moved to). 1 with a line on the stderr when launchpad cannot be reached
    or ends without one."""
    node, local = env.get("SLURMD_NODENAME", "?"), env.get("SLURM_LOCALID", "?")
    deadline = time.monotonic() + connect_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address(env))
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                return _gone(streams, f"no launchpad listens for task {local} on {node} after {connect_s:.0f} s "
                             "(the node's first task, which starts it, may have failed: see its output)")
            time.sleep(0.1)
    with sock:
        if not _same_user(sock):
            return _gone(streams, f"the socket launchpad should listen on for task {local} on {node} is another user's")
        try:
            _send(sock, {"local_id": int(env.get("SLURM_LOCALID", "-1")), "env": dict(env)},
                  streams)
            reply, _ = _recv(sock)
            return int(reply["exit"])
        except (WorkerError, OSError, KeyError, ValueError, TypeError) as exc:
            return _gone(streams, f"the launchpad of {node} ended without task {local}'s exit code ({exc}); "
                         "its own output says why")


def _gone(streams: tuple[int, int], why: str) -> int:
    os.write(streams[1], f"torchpass: {why}\n".encode())
    return 1


@dataclass
class HandedTask:
    """One task of this node's that handed itself over: its environment and its output streams."""

    local_id: int
    env: dict[str, str]
    stdout: BinaryIO
    stderr: BinaryIO
    conn: socket.socket = field(repr=False)


class TaskDesk:
    """launchpad's side: listens before the step's other tasks come, takes their hand-overs
    (``gather``) and at the end tells each its exit code (``release``)."""

    def __init__(self, env: Mapping[str, str], expected: int) -> None:
        self.expected = expected
        self.tasks: dict[int, HandedTask] = {}
        self._where = f"step {env.get('SLURM_JOB_ID', '?')}.{env.get('SLURM_STEP_ID', '?')} on " \
                      f"{env.get('SLURMD_NODENAME', '?')}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(address(env))
        except OSError as exc:
            self._sock.close()
            raise WorkerError(f"cannot take the tasks of {self._where}: {exc}",
                              hint="another launchpad already serves this step on this node") from exc
        self._sock.listen(socket.SOMAXCONN)

    def gather(self, timeout: float = CONNECT_S) -> dict[int, HandedTask]:
        """Until every expected task handed itself over (local ids 1..expected). A stranger's or a
        malformed hand-over is refused and does not count. WorkerError when some did not come in time."""
        deadline = time.monotonic() + timeout
        while len(self.tasks) < self.expected:
            self._sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                missing = sorted(set(range(1, self.expected + 1)) - set(self.tasks))
                raise WorkerError(f"tasks {missing} of {self._where} did not hand themselves over within "
                                  f"{timeout:.0f} s", hint="every task of a srun python step must run the same "
                                  "Python (with TorchPass importable); see those tasks' output") from None
            self._take(conn)
        return self.tasks

    def _take(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        try:
            if not _same_user(conn):
                raise WorkerError("another user's process tried to hand a task over")
            message, fds = _recv(conn, max_fds=2)
            local, env = message.get("local_id"), message.get("env")
            if len(fds) != 2 or not isinstance(local, int) or not 1 <= local <= self.expected \
                    or local in self.tasks or not isinstance(env, dict):
                for fd in fds:
                    os.close(fd)
                raise WorkerError(f"a malformed task hand-over (local id {local!r}, {len(fds)} descriptors)")
        except (WorkerError, OSError) as exc:
            print(f"launchpad: refused a task hand-over on {self._where}: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return
        conn.settimeout(None)
        self.tasks[local] = HandedTask(local, {str(k): str(v) for k, v in env.items()},
                                       open(fds[0], "wb"), open(fds[1], "wb"), conn)  # noqa: SIM115 - kept for the run

    def release(self, code: int) -> None:
        """Tell every task its exit code (the run's), close what it gave, stop listening."""
        self._sock.close()
        for task in self.tasks.values():
            for stream in (task.stdout, task.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
            try:
                _send(task.conn, {"exit": code})
            except OSError:
                pass  # it was killed meanwhile (scancel): nothing waits for the code
            task.conn.close()
