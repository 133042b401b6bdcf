"""This worker's TorchPass state: activation by the bootstrap (the TorchPass default group, DDP
tracking, the connection to launchpad) and what register() does with the user's save/load.
Without launchpad (no TORCHPASS_AGENT_SOCKET) only the step counter runs, so a script behaves
exactly as under plain torchrun."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

from torchpass import ddp_layout, default_group, recovery, severing, steps
from torchpass.agent import Agent
from torchpass_common import agent_channel as ac
from torchpass_common import log
from torchpass_common.timeouts import Timeouts

_agent: Agent | None = None
WORKER_CONSOLE_LOG_LEVEL = "warning"  # TORCHPASS_LOG_LEVEL overrides it


def activate() -> None:
    """Called by the bootstrap before the user's script runs."""
    global _agent
    steps.install()
    path = os.environ.get(ac.ENV_SOCKET)
    if not path or _agent is not None:
        return
    # the job's console shows what torchrun's would (warnings only); the rest goes to launchpad's log file
    log.setup(WORKER_CONSOLE_LOG_LEVEL, file=os.environ.get(log.ENV_FILE) or None)
    joining = os.environ.get(ac.ENV_JOIN) == "1"
    timeouts = Timeouts(**json.loads(os.environ.get(ac.ENV_TIMEOUTS) or "{}"))
    default_group.install(joining=joining, collective=timeouts.collective)
    ddp_layout.track()
    _agent = Agent(ac.SyncChannel.connect(path), rank=int(os.environ.get("RANK", "0")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), joining=joining, timeouts=timeouts)
    _agent.start()
    os.register_at_fork(after_in_child=_drop_parent_connections)


def _drop_parent_connections() -> None:
    """In a process forked from this worker (a DataLoader's worker, a fork-started helper): the
    worker's connections (its process groups', its launchpad channel) are not the child's to use;
    its copies are disowned, so the worker's process tree can be moved by criu (severing.disown)."""
    group = default_group.group()
    held = group.sockets() if group is not None else set()
    if _agent is not None:
        with contextlib.suppress(OSError):  # closed meanwhile (a worker detached for a move)
            held.add(_agent.chan.socket_name())
    severing.disown(held)


def interrupted(exc: BaseException) -> bool:
    """Did ``exc`` leave the script because a peer was lost (a collective failed) under launchpad?"""
    return _agent is not None and recovery.is_interruption(exc)


def recover(exc: BaseException) -> None:
    """After an interruption: capture and report, wait for launchpad's recover, and return when
    the bootstrap should run the script again; its register() then loads the state (joining mode)."""
    assert _agent is not None
    _agent.recover(exc)
    default_group.install(joining=True)


def register(save: Callable[[], Any], load: Callable[[Any], None]) -> None:
    """See torchpass.register."""
    if _agent is None:
        return
    _agent.save_fn, _agent.load_fn = save, load
    if _agent.must_load():
        _agent.join()
