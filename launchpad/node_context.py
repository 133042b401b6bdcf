"""What the parts of one launchpad run that act on commands (commands.py, transparent.py,
control.py) may read and change of it: a declared interface, which launchpad/agent.py's Agent
satisfies, so no handler reaches into the agent's own machinery (its loop, its store thread, its
rounds). It owns the list, not the values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from launchpad.channel import ChannelServer
from launchpad.group import WorkerGroup
from launchpad.rendezvous import Rendezvous
from launchpad.spec import LaunchSpec
from torchpass_common.config import Config
from torchpass_common.timeouts import Timeouts


class NodeContext(Protocol):
    spec: LaunchSpec
    config: Config
    timeouts: Timeouts
    node: str
    channel: ChannelServer  # the workers' agent channel
    group: WorkerGroup | None  # this round's workers (None between rounds)
    rdzv: Rendezvous | None
    scratch: Path  # this run's private directory (CRIU images)
    # changed by commands: the job's generation and size, the workers' collective interface, the
    # nodes lost (unplanned) since the rendezvous
    gen: int
    world_size: int
    path: str
    lost_nodes: int
    beat_now: Callable[[], None]  # a heartbeat now (set by the control plane)
