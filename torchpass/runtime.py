"""This worker's TorchPass state: activation by the bootstrap (the TorchPass default group, DDP
tracking, the connection to launchpad) and what register() does with the user's save/load.
Without launchpad (no TORCHPASS_AGENT_SOCKET) only the step counter runs, so a script behaves
exactly as under plain torchrun."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torchpass import ddp_layout, default_group, steps
from torchpass.agent import Agent
from torchpass_common import agent_channel as ac

_agent: Agent | None = None


def activate() -> None:
    """Called by the bootstrap before the user's script runs."""
    global _agent
    steps.install()
    path = os.environ.get(ac.ENV_SOCKET)
    if not path or _agent is not None:
        return
    joining = os.environ.get(ac.ENV_JOIN) == "1"
    default_group.install(joining=joining)
    ddp_layout.track()
    _agent = Agent(ac.SyncChannel.connect(path), rank=int(os.environ.get("RANK", "0")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), joining=joining)
    _agent.start()


def register(save: Callable[[], Any], load: Callable[[Any], None]) -> None:
    """See torchpass.register."""
    if _agent is None:
        return
    _agent.save_fn, _agent.load_fn = save, load
    if _agent.joining:
        _agent.joining = False
        _agent.join()
