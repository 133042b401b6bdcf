"""A job that ends (its training finished, or it was cancelled) while a planned migration of it is
still before the hand-over: torchpassd stops the migration at once, lets the spare go and records
why, instead of waiting for launchpads that are gone until a command times out. After the
hand-over a migration is never abandoned that way (the moved rank's state lives on the spare)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_plugin import events as ev
from torchpass_common import protocol
from torchpass_common.config import Config
from torchpassd import journal as jn
from torchpassd import planned
from torchpassd.daemon import Orchestrator
from torchpassd.metrics import Metrics
from torchpassd.registry import Registry

JOB = "7"


class Spares:
    """The spare pool and the resizer: records what was given back and released."""

    reservation = "torchpass_spares"

    def __init__(self) -> None:
        self.given_back: list[str] = []
        self.released: list[str] = []

    def give_back(self, node: str) -> None:
        self.given_back.append(node)

    def release_node(self, job: int, node: str) -> None:
        self.released.append(node)


class Watcher:
    jobs: dict[str, Any] = {}
    last = None


async def _events(job: str, event: str, detail: dict[str, Any]) -> None:
    return None


async def _scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_after: str) -> tuple[
        jn.Journal, Spares, Orchestrator, float]:
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
    registry = Registry()
    await registry.update_job(JOB, nodes=("n1", "n3"), user="u", mode="aware", batch_host="n1")
    for node, ranks in (("n1", (0, 1)), ("n3", (2, 3))):
        body = {"node": node, "seq": 1, "workers": [{"rank": r, "step": 10, "state": "running", "pid": 99}
                                                    for r in ranks]}
        await registry.on_message(node, protocol.decode(protocol.encode(protocol.HEARTBEAT, job=JOB, gen=1,
                                                                        body=body)))
    journal = jn.Journal(tmp_path / "j.sqlite")
    journal.upsert_job(JOB, user="u", mode="aware", state="RUNNING", gen=1, nodes=["n1", "n3"])
    spares = Spares()
    deps = planned.Deps(Config(), journal, registry, None, spares, spares, Metrics(), _events,  # type: ignore[arg-type]
                        tmp_path / "steps")
    orch = Orchestrator(deps, Watcher())  # type: ignore[arg-type]
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
