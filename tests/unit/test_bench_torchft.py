"""bench/_torchft.py's figures from hand-written replica logs (no torch process): wall time, the
steps at reduced strength (the last attempt of a retried step counts), recovery time and the
comparison with the undisturbed run."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench._torchft import compare, parse, recovery, stall, strength, summarise


def _step(rid: int, step: int, participants: int, t: float) -> dict[str, Any]:
    return {"replica": rid, "step": step, "loss": (1.0 / (step + 1)).hex(), "participants": participants, "t": t}


def _final(rid: int, digest: str, t: float, steps: int = 6) -> dict[str, Any]:
    return {"replica": rid, "final": digest, "steps": steps, "t": t}


def _undisturbed() -> dict[int, list[dict[str, Any]]]:
    return {rid: [{"replica": rid, "ready": True, "t": 99.0}, *(_step(rid, s, 3, 100.0 + s) for s in range(6)),
                  _final(rid, "aaaa", 106.0 + rid * 0.01)] for rid in range(3)}


def _killed() -> dict[int, list[dict[str, Any]]]:
    """Replica 2 killed at 102.5 during step 2; the survivors' step 2 fails its commit and is retried
    with 2 participants (after the 5 s heartbeat timeout); replica 2 restarts, heals to step 3, which
    runs with 2 participants (the healing replica's gradients are zeroed), then 3 again."""
    logs: dict[int, list[dict[str, Any]]] = {}
    for rid in (0, 1):
        logs[rid] = [*(_step(rid, s, 3, 100.0 + s) for s in range(3)), _step(rid, 2, 2, 107.6),
                     _step(rid, 3, 2, 108.0), _step(rid, 4, 3, 109.0), _step(rid, 5, 3, 110.0),
                     _final(rid, "bbbb", 111.0)]
    logs[2] = [*(_step(2, s, 3, 100.0 + s) for s in range(3)), {"replica": 2, "ready": True, "t": 105.0},
               _step(2, 3, 2, 108.0), _step(2, 4, 3, 109.0), _step(2, 5, 3, 110.0), _final(2, "bbbb", 111.2)]
    return logs


def test_parse_skips_a_line_being_written() -> None:
    lines = [json.dumps(_step(0, 0, 3, 1.0)), '{"replica": 0, "st', "", json.dumps(_final(0, "aa", 2.0))]
    assert parse(lines) == [_step(0, 0, 3, 1.0), _final(0, "aa", 2.0)]


def test_undisturbed_run() -> None:
    res = summarise(_undisturbed(), 3)
    assert res["wall_s"] == 6.02  # first step line -> the last replica's final line
    assert (res["steps"], res["steps_per_s"]) == (6, 1.0)
    assert res["final_hashes"] == {"0": "aaaa", "1": "aaaa", "2": "aaaa"}
    assert (res["steps_at_reduced_strength"], res["reduced_steps"], res["lost_replica_steps"]) == (0, None, 0)


def test_the_retried_attempt_of_a_step_decides_its_strength() -> None:
    # the killed replica's own last line for step 2 says 3 participants; the survivors' retry says 2
    assert strength(_killed()) == {0: 3, 1: 3, 2: 2, 3: 2, 4: 3, 5: 3}


def test_killed_run() -> None:
    logs = _killed()
    res = summarise(logs, 3)
    assert res["wall_s"] == 11.2
    assert (res["steps_at_reduced_strength"], res["reduced_steps"], res["lost_replica_steps"]) == (2, [2, 3], 2)
    assert recovery(logs[2], killed_at=102.5) == {"recovery_s": 5.5, "healed_at_step": 3}
    assert stall(logs, victim=2, killed_at=102.5) == 5.6  # the survivors' step 2 -> its retry
    assert compare(summarise(_undisturbed(), 3), res) == {"time_lost_s": 5.18, "bit_identical": False}


def test_same_hashes_are_bit_identical() -> None:
    base = summarise(_undisturbed(), 3)
    assert compare(base, {**base, "wall_s": 7.0})["bit_identical"] is True
    assert compare(base, {**base, "final_hashes": {"0": "aaaa", "1": "aaaa", "2": "cccc"}})["bit_identical"] is False


def test_a_restart_that_never_stepped_has_no_recovery() -> None:
    victim = [_step(2, 0, 3, 100.0), {"replica": 2, "ready": True, "t": 101.0}]
    assert recovery(victim, killed_at=100.5) == {"recovery_s": None, "healed_at_step": None}
    assert stall({2: victim}, victim=2, killed_at=100.5) is None


def test_a_replica_without_a_final_line_is_an_error() -> None:
    logs = _undisturbed()
    logs[1] = logs[1][:-1]
    with pytest.raises(ValueError, match="replicas \\[0, 2\\] of 3"):
        summarise(logs, 3)
