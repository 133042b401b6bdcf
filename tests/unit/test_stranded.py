"""Ranks left interrupted with nobody lost (a collective timed out while every node lives, e.g.
during a migration that rolled back) are not left waiting for ever: once they have waited out the
failure detector's grace with nothing of the job running, the orchestrator re-forms the job in
place (a reroute onto the path it has), and says so in the job's output if that fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.orchestrator_stubs import JOB, orchestrator
from torchpass_common import protocol
from torchpassd.stranded import StrandedWatch


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


def test_the_orchestrator_re_forms_a_stranded_job_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, str, str, str]] = []

    async def main() -> None:
        orch, journal, _ = await orchestrator(tmp_path)

        async def reroute(job: str, seen: float, d: object) -> None:
            started.append((job, d.node, d.ifname, d.reason))  # type: ignore[attr-defined]
        monkeypatch.setattr(orch, "_reroute", reroute)
        body = {"node": "n3", "seq": 2, "workers": [{"rank": r, "step": 10, "state": "interrupted", "pid": 99}
                                                    for r in (2, 3)]}
        await orch.d.registry.on_message("n3", protocol.decode(protocol.encode(protocol.HEARTBEAT, job=JOB, gen=1,
                                                                               body=body)))
        orch.stranded.grace_s = 0.0
        orch.watch_stranded()  # starts the clock
        orch.watch_stranded()
        await asyncio.sleep(0.1)
        journal.close()
    asyncio.run(main())
    ((job, node, ifname, reason),) = started
    assert (job, node, ifname) == (JOB, "n3", "")
    assert reason.startswith("ranks 2-3 were left interrupted (a collective failed) while every node of the job lives")
