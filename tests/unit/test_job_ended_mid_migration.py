"""A job that ends (its training finished, or it was cancelled) while a planned migration of it is
still before the hand-over: torchpassd stops the migration at once, lets the spare go and records
why, instead of waiting for launchpads that are gone until a command times out. After the
hand-over a migration is never abandoned that way (the moved rank's state lives on the spare)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from slurm_plugin import events as ev
from tests.support.orchestrator_stubs import JOB, Slurm, orchestrator
from torchpassd import journal as jn
from torchpassd import planned
from torchpassd.daemon import Orchestrator


async def _scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_after: str) -> tuple[
        jn.Journal, Slurm, Orchestrator, float]:
    """A migration of n3 that gets to ``stop_after`` and then waits for ever (launchpads gone)."""
    async def prepare(self: planned.PlannedMigration) -> None:
        self.plan.ranks, self.plan.rank, self.plan.survivors = [2, 3], 2, ["n1"]
        self.plan.target = "n5"
        for name in (planned.SPARE_CHOSEN, planned.SPARE_ADDED, planned.JOINER_READY):
            await self.phase(name)

    async def pause(self: planned.PlannedMigration) -> None:
        if stop_after == planned.HANDED_OVER:
            await self.phase(planned.PAUSED)
            await self.phase(planned.HANDED_OVER)
        await asyncio.Event().wait()  # a command no launchpad will ever answer

    monkeypatch.setattr(planned.PlannedMigration, "_prepare", prepare)
    monkeypatch.setattr(planned.PlannedMigration, "_pause", pause)
    orch, journal, spares = await orchestrator(tmp_path)
    orch._spawn(JOB, orch._migrate(JOB, "n3", time.time(), "node n3 draining: maintenance"))
    for _ in range(500):
        if JOB in orch.current and orch.current[JOB].last_phase == stop_after:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await orch.on_slurm(ev.JobEnded(time.time(), int(JOB), ("n1", "n3"), "COMPLETED"))
    return journal, spares, orch, time.monotonic() - t0


def test_a_job_ending_before_the_hand_over_stops_its_migration_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        journal, spares, orch, took = await _scenario(tmp_path, monkeypatch, planned.JOINER_READY)
        await asyncio.sleep(0.2)
        assert JOB not in orch.active and took < 5.0
        (rec,) = journal.history(job_id=JOB)
        assert rec.status == jn.ROLLED_BACK, rec
        assert "job 7 ended (COMPLETED) during the migration, before the hand-over" in rec.error
        assert spares.released == ["n5"] and spares.given_back == ["n5"]  # the spare is back in the pool
        journal.close()
    asyncio.run(main())


def test_a_job_ending_after_the_hand_over_leaves_the_migration_to_finish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        journal, spares, orch, _ = await _scenario(tmp_path, monkeypatch, planned.HANDED_OVER)
        assert JOB in orch.active and not orch.active[JOB].done()  # it owns the rank's only copy now
        assert journal.history(job_id=JOB)[0].status == jn.RUNNING and spares.given_back == []
        orch.active[JOB].cancel()
        journal.close()
    asyncio.run(main())
