"""A spare that cannot take a drained node's ranks (its joiner cannot start: here the job's working
directory is missing on it) is drained with the reason instead of going back into the pool, and
after orchestrator.spares_per_incident such spares torchpassd gives the incident up: the job runs
on where it is, and the operator (history, `torchpassctl jobs`) and the user (job output) read why."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.support.orchestrator_stubs import JOB, Launchpads, orchestrator
from torchpass_common import agent_channel as ac
from torchpass_common.errors import SpareFailed
from torchpassd import journal as jn
from torchpassd import planned


def test_failed_spares_are_drained_and_the_incident_given_up_after_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spares = iter(["n5", "n6"])

    async def prepare(self: planned.PlannedMigration) -> None:
        self.plan.ranks, self.plan.rank, self.plan.survivors = [2, 3], 2, ["n1"]
        self.plan.target = next(spares)
        await self.phase(planned.SPARE_CHOSEN)
        raise SpareFailed(planned._step_ended(ac.EXIT_NO_WORKDIR, self.plan.target, "/home/u/run"),
                          spare=self.plan.target, **self.where)

    monkeypatch.setattr(planned.PlannedMigration, "_prepare", prepare)

    async def main() -> None:
        launchpads = Launchpads()
        orch, journal, slurm = await orchestrator(tmp_path, launchpads)
        registry = orch.d.registry
        orch.request(JOB, "n3", "node n3 draining: maintenance")

        await orch._migrate(JOB, "n3", time.time(), "node n3 draining: maintenance")
        (first,) = journal.history(job_id=JOB)
        assert first.status == jn.ROLLED_BACK
        assert "the job's working directory /home/u/run does not exist on n5" in first.error
        assert slurm.commands == [["scontrol", "update", "nodename=n5", "state=drain",
                                   "reason=torchpass: joiner failed: the job's working directory /home/u/run "
                                   "does not exist on n5: no joiner can start there"]]
        assert slurm.released == slurm.given_back == ["n5"]  # out of the job; not taken, but drained
        assert (JOB, "n3") in orch.pending  # one more spare may be tried
        assert not registry.job(JOB).blocked.startswith("gave up")

        await orch._migrate(JOB, "n3", time.time(), "node n3 draining: maintenance")
        await asyncio.sleep(0.1)  # the journal event and the job notice are written by tasks
        assert [c[2] for c in slurm.commands] == ["nodename=n5", "nodename=n6"]
        assert (JOB, "n3") not in orch.pending  # given up: no third spare
        why = registry.job(JOB).blocked
        assert why.startswith("gave up moving job 7's ranks off n3: 2 spares (n5, n6) could not take them")
        assert "does not exist on n6" in why and "the job runs on on n3" in why
        assert launchpads.notices == [why]
        assert any(e.event == "migration.given_up" and e.detail["spares"] == ["n5", "n6"]
                   for e in journal.events(job_id=JOB))
        journal.close()
    asyncio.run(main())
