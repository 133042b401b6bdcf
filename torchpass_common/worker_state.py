"""A worker's lifecycle, one for every part: the states, the moves between them, and how a message
on the agent channel moves a worker. Both ends apply the same function to the same messages (the
worker to each message it sends, launchpad to each it receives), so both hold the same state;
launchpad reports it in heartbeats and torchpassd reads it back (a drain waits for STARTING ones, a
recovery for INTERRUPTED ones, the failure detector ignores ENDED ones). It owns the names, the
transition table and that mapping, not what a state leads to."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

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

_S = WorkerState
# the message a worker sends -> the state it is in from then on
_AFTER = {ac.HELLO: _S.RUNNING, ac.PAUSED: _S.PAUSED, ac.PAUSE_MISSED: _S.RUNNING, ac.SAVED: _S.PAUSED,
          ac.JOINED: _S.JOINED, ac.REFORMED: _S.REFORMED, ac.RESUMED: _S.RUNNING, ac.ERROR: _S.ERROR,
          ac.DETACHED: _S.DETACHED, ac.INTERRUPTED: _S.INTERRUPTED}

# The moves a message may make (staying in a state is always allowed). EXITED and CRASHED are not
# reached by a message: launchpad sets them from the process (see launchpad/control.py).
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    _S.STARTING: frozenset({_S.RUNNING}),  # hello
    # paused; a collective failed; a joiner (hello said running) loaded its state; a parked rank that
    # answered a pause as missed is re-formed; a command refused while running
    _S.RUNNING: frozenset({_S.PAUSED, _S.INTERRUPTED, _S.JOINED, _S.REFORMED, _S.ERROR}),
    # resumed (or told to run on to a later step, where it may be interrupted); re-formed; detached
    _S.PAUSED: frozenset({_S.RUNNING, _S.REFORMED, _S.DETACHED, _S.INTERRUPTED, _S.ERROR}),
    _S.JOINED: frozenset({_S.REFORMED, _S.ERROR}),
    _S.REFORMED: frozenset({_S.RUNNING, _S.PAUSED, _S.ERROR}),
    # re-entered its script and loaded; a recover refused or a donation failed
    _S.INTERRUPTED: frozenset({_S.JOINED, _S.ERROR}),
    _S.DETACHED: frozenset({_S.RUNNING, _S.ERROR}),  # hello again once restored (or the move failed)
    # a failed command leaves the rank where it was: any message may follow
    _S.ERROR: frozenset({_S.RUNNING, _S.PAUSED, _S.JOINED, _S.REFORMED, _S.INTERRUPTED, _S.DETACHED}),
    _S.EXITED: frozenset(),
    _S.CRASHED: frozenset(),
}


def after(state: WorkerState, kind: str) -> WorkerState:
    """The state of a worker in ``state`` once it sent a message of ``kind`` (other kinds, such as
    step reports, leave it as it was)."""
    return _AFTER.get(kind, state)


class Lifecycle(Protocol):
    """What both ends keep of a worker's lifecycle (launchpad's WorkerLink, the worker's Agent)."""

    state: WorkerState
    joining: bool  # started to receive a running rank's state (hello said so), until resumed
    recovering: bool  # interrupted (a peer was lost), until resumed: an exit meanwhile is a failure


def advance(life: Lifecycle, msg: dict[str, Any]) -> bool:
    """Apply the message ``msg`` the worker sent to ``life``; False if the table does not allow the
    move it made (the state follows the message anyway: it is what the worker says it did, and the
    caller logs the disagreement)."""
    kind = msg["t"]
    new = after(life.state, kind)
    legal = new == life.state or new in TRANSITIONS[life.state]
    life.state = new
    if kind == ac.HELLO:
        life.joining = bool(msg.get("joining"))
    elif kind == ac.INTERRUPTED:
        life.recovering = True
    elif kind == ac.RESUMED:
        life.joining = life.recovering = False
    return legal
