"""Transparent mode (--torchpass=transparent), worker side: how a parked worker lets criu move it.
On launchpad's ``detach`` it releases the inner communicator, closes the agent channel (criu cannot
carry either to another node) and blocks on its control pipe until a launchpad writes
``reconnect PATH``: the spare's launchpad after a restore, or its own after a failed move. It then
reconnects to PATH, says hello again and stays parked for the re-form. No user code is involved."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from torchpass import default_group, steps
from torchpass_common import agent_channel as ac
from torchpass_common import log
from torchpass_common.errors import WorkerError

_CHANNEL_CLOSE_S = 10.0  # launchpad closes its end right after DETACHED


def host_pid() -> int:
    """This process's PID as launchpad sees it: a movable worker is PID 1 of its own namespace, but
    /proc is the node's, so /proc/self names its PID there."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def control_fd() -> int | None:
    """The read end of the control pipe launchpad gave this worker (None: not started movable)."""
    value = os.environ.get(ac.ENV_CONTROL_FD, "")
    return int(value) if value.isdigit() else None


def detach(agent: Any) -> None:
    """Called by the parked agent on DETACH; returns once reconnected to a launchpad (still parked)."""
    fd = control_fd()
    if fd is None:
        raise WorkerError("asked to detach for a transparent move, but this worker has no control pipe",
                          hint="the job must run with --torchpass=transparent (launchpad then starts workers "
                               "movable)", rank=agent.rank)
    group = default_group.group()
    if group is not None:
        group.release()
    step = steps.current()
    agent.send(ac.message(ac.DETACHED, step=step))
    _wait_channel_closed(agent)
    agent.chan.close()
    agent.log.info("agent.detached", step=step)
    path = _wait_reconnect(fd, agent.rank)
    agent.reconnect(ac.SyncChannel.connect(path))  # hello again (with this node's PID), a new reader thread
    agent.log.info("agent.reattached", step=step, socket=path, pid=host_pid())


def _wait_channel_closed(agent: Any) -> None:
    """Until launchpad has closed its end and the reader thread has ended (it queues the 'gone'
    marker last), so no thread of ours is inside a socket call when criu freezes the process."""
    deadline = time.monotonic() + _CHANNEL_CLOSE_S
    while True:
        try:
            msg = agent.next_command(deadline)
        except queue.Empty:
            raise WorkerError(f"launchpad did not close the channel within {_CHANNEL_CLOSE_S:.0f} s of detached",
                              rank=agent.rank) from None
        if msg.get("t") == "_agent_gone":
            for t in threading.enumerate():  # the reader returns right after queueing it
                if t.name == "torchpass-agent" and t is not threading.current_thread():
                    t.join(_CHANNEL_CLOSE_S)
            return
        log.get(rank=agent.rank).warning("agent.ignored_while_detaching", kind=msg.get("t"))


def _wait_reconnect(fd: int, rank: int) -> str:
    """Block on the control pipe (criu dumps the worker here) for ``reconnect PATH``."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            raise WorkerError("launchpad closed the control pipe before telling this worker where to reconnect",
                              rank=rank, hint="the move was abandoned and the worker cannot rejoin")
        buf += chunk
    verb, _, path = buf.decode().strip().partition(" ")
    if verb != "reconnect" or not path:
        raise WorkerError(f"unexpected control pipe message {buf!r}", rank=rank)
    return path
