"""A worker's state as launchpad derives it from the worker's messages, and as torchpassd reads it
back from a heartbeat (a plain string after msgpack): the same names on both sides; the transition
table both ends check each move against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchpass_common import agent_channel as ac
from torchpass_common import protocol
from torchpass_common.worker_state import ENDED, TRANSITIONS, WorkerState, advance, after


@dataclass
class Life:
    state: WorkerState = WorkerState.STARTING
    joining: bool = False
    recovering: bool = False


def walk(*msgs: dict[str, Any]) -> tuple[Life, list[tuple[str, bool]]]:
    life = Life()
    return life, [(msg["t"], advance(life, msg)) for msg in msgs]


def test_a_drain_and_a_recovery_as_the_worker_reports_them() -> None:
    state = WorkerState.STARTING
    seen = []
    for kind in (ac.HELLO, ac.STEP, ac.PAUSED, ac.SAVED, ac.REFORMED, ac.RESUMED, ac.STEP, ac.INTERRUPTED, ac.RESUMED):
        state = after(state, kind)
        seen.append(state)
    assert seen == ["running", "running", "paused", "paused", "reformed", "running", "running", "interrupted", "running"]


def test_a_joiner_and_a_transparent_move() -> None:
    assert after(WorkerState.STARTING, ac.READY) == WorkerState.STARTING  # inside register(), not joined yet
    assert after(WorkerState.STARTING, ac.JOINED) == WorkerState.JOINED
    assert after(WorkerState.PAUSED, ac.DETACHED) == WorkerState.DETACHED
    assert after(WorkerState.PAUSED, ac.PAUSE_MISSED) == WorkerState.RUNNING
    assert after(WorkerState.RUNNING, ac.ERROR) == WorkerState.ERROR


def test_torchpassd_reads_the_states_launchpad_sent() -> None:
    body = {"node": "n1", "seq": 1, "workers": [{"rank": 0, "step": 3, "state": WorkerState.INTERRUPTED},
                                                {"rank": 1, "step": 3, "state": WorkerState.EXITED}]}
    workers = protocol.decode(protocol.encode(protocol.HEARTBEAT, job="5", gen=1, body=body)).body["workers"]
    assert [type(w["state"]) for w in workers] == [str, str]
    assert workers[0]["state"] == WorkerState.INTERRUPTED and workers[1]["state"] in ENDED


def test_every_path_a_worker_takes_is_in_the_table() -> None:
    hello = {"t": ac.HELLO, "joining": False}
    paths = {
        "planned, leaving": [hello, {"t": ac.STEP}, {"t": ac.PAUSED}, {"t": ac.SAVED}],
        "planned, staying": [hello, {"t": ac.PAUSED}, {"t": ac.REFORMED}, {"t": ac.RESUMED}],
        "pause missed, then a later step": [hello, {"t": ac.PAUSE_MISSED}, {"t": ac.PAUSED}, {"t": ac.RESUMED}],
        "joiner": [{"t": ac.HELLO, "joining": True}, {"t": ac.READY}, {"t": ac.JOINED}, {"t": ac.REFORMED},
                   {"t": ac.RESUMED}],
        "survivor of a lost peer": [hello, {"t": ac.INTERRUPTED}, {"t": ac.READY}, {"t": ac.JOINED},
                                    {"t": ac.REFORMED}, {"t": ac.RESUMED}],
        "a donation failed, recovered next time": [hello, {"t": ac.INTERRUPTED}, {"t": ac.ERROR},
                                                   {"t": ac.INTERRUPTED}, {"t": ac.JOINED}],
        "transparent move": [hello, {"t": ac.PAUSED}, {"t": ac.DETACHED}, hello, {"t": ac.REFORMED},
                             {"t": ac.RESUMED}],
        "rolled back": [hello, {"t": ac.PAUSED}, {"t": ac.RESUMED}, {"t": ac.INTERRUPTED}],
    }
    for name, msgs in paths.items():
        _, moves = walk(*msgs)
        assert all(ok for _, ok in moves), (name, moves)


def test_a_move_no_worker_makes_is_flagged_and_still_followed() -> None:
    life, moves = walk({"t": ac.HELLO}, {"t": ac.PAUSED}, {"t": ac.JOINED})  # a member never joins
    assert moves == [(ac.HELLO, True), (ac.PAUSED, True), (ac.JOINED, False)]
    assert life.state == WorkerState.JOINED  # what the worker said it did
    _, moves = walk({"t": ac.HELLO}, {"t": ac.INTERRUPTED}, {"t": ac.SAVED})  # nothing to save: it lost its group
    assert moves[-1] == (ac.SAVED, False)
    assert all(not TRANSITIONS[end] for end in (WorkerState.EXITED, WorkerState.CRASHED))  # only the process ends them


def test_joining_and_recovering_last_until_the_resume() -> None:
    life, _ = walk({"t": ac.HELLO, "joining": True}, {"t": ac.JOINED}, {"t": ac.REFORMED})
    assert life.joining and not life.recovering
    advance(life, {"t": ac.RESUMED})
    assert not life.joining and life.state == WorkerState.RUNNING
    life, _ = walk({"t": ac.HELLO}, {"t": ac.STEP}, {"t": ac.INTERRUPTED})
    assert life.recovering and not life.joining
    advance(life, {"t": ac.JOINED})
    assert life.recovering  # reloaded, but an exit before the resume still means the job was given up
    advance(life, {"t": ac.REFORMED})
    advance(life, {"t": ac.RESUMED})
    assert not life.recovering
