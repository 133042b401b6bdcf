"""A worker's state as launchpad derives it from the worker's messages, and as torchpassd reads it
back from a heartbeat (a plain string after msgpack): the same names on both sides."""

from __future__ import annotations

from torchpass_common import agent_channel as ac
from torchpass_common import protocol
from torchpass_common.worker_state import ENDED, WorkerState, after


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
