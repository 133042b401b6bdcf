"""Jobs left without progress with nobody lost are not left waiting for ever: ranks left
interrupted (a collective timed out while every node lives, e.g. during a migration that rolled
back) once they waited out the failure detector's grace with nothing of the job running are
re-formed in place (a reroute onto the path it has), said in the job's output if that fails. A
job that completes no step for 5 of its step times after a migration or recovery ended is said to
be stalled, once, and left alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.orchestrator_stubs import JOB, orchestrator
from torchpass_common import protocol
from torchpassd.daemon import Orchestrator
from torchpassd.journal import Journal
from torchpassd.stranded import STALL_STEPS, StallWatch, StrandedWatch


def _workers(*states: str) -> list[dict[str, object]]:
    return [{"rank": r, "state": s} for r, s in enumerate(states)]


def test_interrupted_ranks_are_due_after_the_grace_and_only_while_nothing_runs() -> None:
    watch = StrandedWatch(grace_s=7.0)
    assert watch.due("j", _workers("running", "interrupted"), now=0.0, busy=False) == []
    assert watch.due("j", _workers("running", "interrupted"), now=6.9, busy=False) == []
    assert watch.due("j", _workers("interrupted", "interrupted"), now=7.0, busy=False) == [0, 1]
    assert watch.due("j", _workers("interrupted", "interrupted"), now=7.1, busy=False) == []  # answered once
    watch.due("k", _workers("interrupted"), now=0.0, busy=False)
    assert watch.due("k", _workers("interrupted"), now=5.0, busy=True) == []  # a recovery runs: its business
    assert watch.due("k", _workers("interrupted"), now=11.0, busy=False) == []  # the clock started again
    assert watch.due("k", _workers("running"), now=20.0, busy=False) == []
    assert watch.due("k", _workers("interrupted"), now=21.0, busy=False) == []


async def _rerouting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[tuple[str, str, str, str]],
                     state: str) -> tuple[Orchestrator, Journal]:
    """An orchestrator whose reroutes are only noted in ``started``, with ranks 2-3 of the job
    on n3 at step 10 in ``state``."""
    orch, journal, _ = await orchestrator(tmp_path)

    async def reroute(job: str, seen: float, d: object) -> None:
        started.append((job, d.node, d.ifname, d.reason))  # type: ignore[attr-defined]
    monkeypatch.setattr(orch, "_reroute", reroute)
    body = {"node": "n3", "seq": 2, "workers": [{"rank": r, "step": 10, "state": state, "pid": 99} for r in (2, 3)]}
    await orch.d.registry.on_message("n3", protocol.decode(protocol.encode(protocol.HEARTBEAT, job=JOB, gen=1,
                                                                           body=body)))
    return orch, journal


def test_the_orchestrator_re_forms_a_stranded_job_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, str, str, str]] = []

    async def main() -> None:
        orch, journal = await _rerouting(tmp_path, monkeypatch, started, "interrupted")
        orch.stranded.grace_s = 0.0
        orch.watch_stranded()  # starts the clock
        orch.watch_stranded()
        await asyncio.sleep(0.1)
        journal.close()
    asyncio.run(main())
    ((job, node, ifname, reason),) = started
    assert (job, node, ifname) == (JOB, "n3", "")
    assert reason.startswith("ranks 2-3 were left interrupted (a collective failed) while every node of the job lives")


def _stepping(step: int, state: str = "running", **more: object) -> list[dict[str, object]]:
    return [{"rank": r, "step": step, "state": state, **more} for r in range(2)]


def test_a_job_that_steps_no_more_after_a_change_ended_is_stalled_once() -> None:
    watch = StallWatch(floor_s=5.0)
    assert not watch.due("j", _stepping(10), steps_per_s=0.5, now=0.0, busy=False)  # steady: 2 s a step
    assert not watch.due("j", _stepping(10), steps_per_s=0.5, now=50.0, busy=False)  # no change ran: not watched
    assert not watch.due("j", _stepping(10), steps_per_s=0.0, now=51.0, busy=True)  # a migration runs
    assert not watch.due("j", _stepping(10), steps_per_s=0.0, now=52.0, busy=False)  # it ended: watched
    assert watch.limit("j") == STALL_STEPS * 2.0
    assert not watch.due("j", _stepping(11), steps_per_s=0.0, now=60.0, busy=False)  # progress restarts the clock
    assert not watch.due("j", _stepping(11), steps_per_s=0.0, now=69.9, busy=False)
    assert watch.due("j", _stepping(11), steps_per_s=0.0, now=70.0, busy=False)
    assert not watch.due("j", _stepping(11), steps_per_s=0.0, now=90.0, busy=False)  # answered once


def test_a_job_going_on_or_ending_after_a_change_is_not_stalled() -> None:
    watch = StallWatch(floor_s=5.0)
    for job in ("on", "ends", "interrupted"):
        watch.due(job, _stepping(10), steps_per_s=10.0, now=0.0, busy=True)
        watch.due(job, _stepping(10), steps_per_s=0.0, now=1.0, busy=False)
    assert watch.limit("on") == 5.0  # never below the floor (fast steps)
    for n, now in enumerate((2.0, 3.0, 4.0)):
        assert not watch.due("on", _stepping(11 + n), steps_per_s=0.0, now=now, busy=False)
    assert not watch.due("on", _stepping(13), steps_per_s=0.0, now=100.0, busy=False)  # settled: watched no longer
    assert not watch.due("ends", _stepping(10, exit_code=0), steps_per_s=0.0, now=100.0, busy=False)
    assert not watch.due("interrupted", _stepping(10, "interrupted"), steps_per_s=0.0, now=100.0, busy=False)


def test_the_orchestrator_says_a_job_stalled_after_a_migration_and_leaves_it_be(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Said in the job's output and history, once; no recovery starts (a long evaluation looks the same)."""
    started: list[tuple[str, str, str, str]] = []
    told: list[str] = []
    events: list[tuple[str, dict]] = []

    async def main() -> None:
        orch, journal = await _rerouting(tmp_path, monkeypatch, started, "running")

        async def tell(job: str, text: str) -> None:
            told.append(text)
        monkeypatch.setattr(orch, "tell_job", tell)
        orch.stalls.floor_s = 0.0
        orch.reroutes[JOB] = (0.0, None)  # type: ignore[assignment] # a change of the job runs ...
        orch.watch_stranded()
        del orch.reroutes[JOB]  # ... and ended
        for _ in range(3):
            orch.watch_stranded()
        await asyncio.sleep(0.2)
        events.extend((e.event, e.detail) for e in journal.events(job_id=JOB))
        journal.close()
    asyncio.run(main())
    assert not started  # no recovery
    assert told == [f"job {JOB} completed no step for 0 s after its last migration or recovery ended (at step 10); "
                    "ranks waiting in a collective are recovered in place once it times out (30 s); a rank stopped "
                    "elsewhere is not: look at the job"], told
    assert [e for e, _ in events if e == "job.stalled"] == ["job.stalled"], events
