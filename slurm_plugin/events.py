"""The typed events the watcher emits: what happened to a node, a TorchPass job or a spare.
Plain frozen dataclasses; ``jobs`` on node events lists the TorchPass jobs on that node, so the
orchestrator can act without another lookup. ``detected_at`` is time.monotonic() of the poll."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlurmEvent:
    detected_at: float


@dataclass(frozen=True)
class NodeEvent(SlurmEvent):
    node: str
    jobs: tuple[int, ...] = ()
    reason: str = ""
    reason_by: str = ""


@dataclass(frozen=True)
class NodeDraining(NodeEvent):
    """A drain was requested while jobs still run on the node (the planned-migration signal)."""


@dataclass(frozen=True)
class NodeDrained(NodeEvent):
    """The node is drained and empty."""


@dataclass(frozen=True)
class NodeNotResponding(NodeEvent):
    """slurmctld lost contact with the node's slurmd (about SlurmdTimeout/2 after it stopped)."""


@dataclass(frozen=True)
class NodeDown(NodeEvent):
    """The node is DOWN (admin state=down, or SlurmdTimeout passed)."""


@dataclass(frozen=True)
class NodeFailed(NodeEvent):
    """The node carries the FAIL flag (``scontrol update state=fail``)."""


@dataclass(frozen=True)
class NodeReturned(NodeEvent):
    """A node that was draining, drained, down, failed or not responding is healthy again."""


@dataclass(frozen=True)
class JobEvent(SlurmEvent):
    job: int
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobStarted(JobEvent):
    user: str = ""
    mode: str = "auto"
    spares: int = 0
    batch_host: str = ""
    started: int = 0  # Slurm's start time: with the id, names this run of the job


@dataclass(frozen=True)
class JobEnded(JobEvent):
    state: str = ""


@dataclass(frozen=True)
class JobResized(JobEvent):
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpareAdded(SlurmEvent):
    node: str


@dataclass(frozen=True)
class SpareRemoved(SlurmEvent):
    node: str
    why: str = ""
