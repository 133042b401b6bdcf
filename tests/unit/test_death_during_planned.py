"""A node of the job dies while a planned migration moves another node's ranks: before the
hand-over the migration gives way at once (rolled back without waiting on the dead node, the spare
let go) so that the unplanned recovery can start, and the drain stays wanted for afterwards. After
the hand-over, the migration is left to end on its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.support.orchestrator_stubs import JOB, Launchpads, orchestrator
from torchpassd import journal as jn
from torchpassd import planned
from torchpassd.failure_detect import Death


def _death(node: str) -> Death:
    now = time.time()
    return Death(JOB, node, (0, 1), ("Last Will",), now - 1.0, now)


def _stuck_in(phase: str, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """PlannedMigration._prepare takes spare n5, records ``phase`` and then waits (for a joiner,
    say) until cancelled; returns the event set once it waits."""
    waiting = asyncio.Event()

    async def prepare(self: planned.PlannedMigration) -> None:
        self.plan.ranks, self.plan.rank, self.plan.survivors, self.plan.target = [2, 3], 2, ["n1"], "n5"
        await self.phase(planned.SPARE_CHOSEN)
        if phase == planned.HANDED_OVER:
            await self.phase(planned.HANDED_OVER)
        waiting.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(planned.PlannedMigration, "_prepare", prepare)
    return waiting


def test_a_death_before_the_hand_over_rolls_the_migration_back_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = _stuck_in(planned.SPARE_CHOSEN, monkeypatch)

    async def main() -> None:
        launchpads = Launchpads()
        orch, journal, slurm = await orchestrator(tmp_path, launchpads)
        orch.pending[(JOB, "n3")] = (time.time(), "node n3 draining: maintenance")
        orch._spawn(JOB, orch._migrate(JOB, "n3", time.time(), "node n3 draining: maintenance"))
        await asyncio.wait_for(waiting.wait(), 5)
        orch.yield_to_recovery(_death("n1"))
        await asyncio.wait_for(orch.active[JOB], 5)
        (mig,) = journal.history(job_id=JOB)
        assert mig.status == jn.ROLLED_BACK
        assert mig.error == ("n1 died during the migration off n3, before the hand-over: the job recovers from "
                             "that first, then the move off n3 is tried again")
        assert launchpads.sent == [("n3", "abort")]  # the dead n1 is not waited on
        assert slurm.released == slurm.given_back == ["n5"]  # the spare is free for the recovery
        assert (JOB, "n3") in orch.pending  # the drain is still wanted
        assert JOB not in orch.active
        journal.close()
    asyncio.run(main())


def test_a_death_of_the_leaving_node_or_after_the_hand_over_leaves_the_migration_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = _stuck_in(planned.HANDED_OVER, monkeypatch)

    async def main() -> None:
        orch, journal, _ = await orchestrator(tmp_path, Launchpads())
        orch._spawn(JOB, orch._migrate(JOB, "n3", time.time(), "node n3 draining: maintenance"))
        await asyncio.wait_for(waiting.wait(), 5)
        task = orch.active[JOB]
        orch.yield_to_recovery(_death("n1"))  # after the hand-over: only the new generation can go on
        orch.yield_to_recovery(_death("n3"))
        await asyncio.sleep(0.1)
        assert orch.active[JOB] is task and not task.done()
        assert journal.history(job_id=JOB)[0].status == jn.RUNNING
        task.cancel()
        journal.close()
    asyncio.run(main())
