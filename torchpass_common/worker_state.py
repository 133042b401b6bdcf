"""A worker's states, one enum for every part: launchpad derives a worker's state from the last
message the worker sent on its agent channel (``after``) and reports it in heartbeats; torchpassd
reads the reports (a drain waits for STARTING ones, a recovery for INTERRUPTED ones, the failure
detector ignores ENDED ones). It owns the names and that mapping, not what a state leads to."""

from __future__ import annotations

from enum import StrEnum

from torchpass_common import agent_channel as ac


class WorkerState(StrEnum):
    STARTING = "starting"  # spawned, not on its agent channel yet
    RUNNING = "running"  # training
    PAUSED = "paused"  # stopped at the agreed step boundary, state intact
    JOINED = "joined"  # a joining worker loaded its state and waits for the re-form
    REFORMED = "reformed"  # in the new generation's groups, waiting for resume
    INTERRUPTED = "interrupted"  # a collective failed (a peer was lost): state saved, waiting for recover
    DETACHED = "detached"  # transparent mode: sockets dropped, ready for criu
    ERROR = "error"  # a command failed in the worker
    EXITED = "exited"  # the process ended
    CRASHED = "crashed"  # killed by a signal on a live node; launchpad holds its place for an in-place rebuild


ENDED = frozenset({WorkerState.EXITED})

# the message a worker sends -> the state it is in from then on
_AFTER = {ac.HELLO: WorkerState.RUNNING, ac.PAUSED: WorkerState.PAUSED, ac.PAUSE_MISSED: WorkerState.RUNNING,
          ac.SAVED: WorkerState.PAUSED, ac.JOINED: WorkerState.JOINED, ac.REFORMED: WorkerState.REFORMED,
          ac.RESUMED: WorkerState.RUNNING, ac.ERROR: WorkerState.ERROR, ac.DETACHED: WorkerState.DETACHED,
          ac.INTERRUPTED: WorkerState.INTERRUPTED}


def after(state: WorkerState, kind: str) -> WorkerState:
    """The state of a worker in ``state`` once it sent a message of ``kind`` (other kinds, such as
    step reports, leave it as it was)."""
    return _AFTER.get(kind, state)
