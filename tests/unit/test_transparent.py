"""The transparent migration's decisions before anything is paused (preflight refused: fall back
to model-aware when the script registered save/load, else leave the job running and wait), and how
its source's worker leaves (discarded, not asked to exit). Commands go to a recording commander."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from torchpass_common import protocol
from torchpass_common.config import Config
from torchpassd import journal as jn
from torchpassd import planned, transparent
from torchpassd.metrics import Metrics
from torchpassd.registry import Registry


class Commander:
    """Answers each command from ``answers`` (by name) and records what was sent where."""

    def __init__(self, answers: dict[str, dict[str, Any]]) -> None:
        self.answers, self.sent = answers, []

    async def send(self, job: str, node: str, cmd: str, *, migration: str, gen: int,
                   args: dict[str, Any] | None = None, timeout: float) -> dict[str, Any]:
        self.sent.append((node, cmd, args))
        return self.answers[cmd]


async def _events(job: str, event: str, detail: dict[str, Any]) -> None:
    return None


def _migration(tmp_path: Path, answers: dict[str, dict[str, Any]]) -> tuple[transparent.TransparentMigration,
                                                                           jn.Journal, Commander]:
    registry = Registry()
    body = {"node": "n3", "seq": 1, "workers": [{"rank": 2, "step": 10, "state": "running", "pid": 99}]}
    asyncio.run(registry.on_message("n3", protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1,
                                                                          body=body))))
    journal = jn.Journal(tmp_path / "j.sqlite")
    journal.upsert_job("7", user="u", mode="transparent", state="RUNNING", gen=1, nodes=["n1", "n3"])
    mid = journal.start_migration("7", mode=transparent.MODE, source="n3", reason="drain", gen=1)
    commander = Commander(answers)
    deps = planned.Deps(Config(), journal, registry, commander, None, None, Metrics(), _events,  # type: ignore[arg-type]
                        tmp_path / "steps")
    mig = transparent.TransparentMigration(deps, planned.Plan(job="7", source="n3", gen=1), mid,
                                           detected_at=time.time())
    return mig, journal, commander


def test_refused_without_save_load_leaves_the_job_running_and_says_why(tmp_path: Path) -> None:
    mig, journal, commander = _migration(tmp_path, {"preflight": {
        "reasons": ["process 99 reads a terminal; give workers stdin=/dev/null"], "registered": False}})
    assert asyncio.run(mig.run()) == jn.ROLLED_BACK
    assert [c for _, c, _ in commander.sent] == ["preflight"]  # nothing paused, no spare taken
    rec = journal.migration(mig.id)
    assert rec.status == jn.ROLLED_BACK and "reads a terminal" in rec.error and "keeps running" in rec.error
    journal.close()


def test_refused_with_save_load_falls_back_to_the_model_aware_flow(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    async def aware_run(self: planned.PlannedMigration) -> str:
        ran.append(type(self).__name__)
        return jn.SUCCEEDED
    monkeypatch.setattr(planned.PlannedMigration, "run", aware_run)
    mig, journal, commander = _migration(tmp_path, {"preflight": {"reasons": ["no usable criu"], "registered": True}})
    assert asyncio.run(mig.run()) == jn.SUCCEEDED
    assert ran == ["PlannedMigration"]
    phase = journal.migration(mig.id).phases[-1]
    assert phase.phase == "preflight" and phase.detail["fallback"] == planned.MODE
    assert phase.detail["refused"] == ["no usable criu"]
    journal.close()


def test_the_source_worker_is_discarded_not_asked_to_exit(tmp_path: Path) -> None:
    mig, journal, commander = _migration(tmp_path, {"discard": {"discarded": 99}, "exit": {}})
    mig.plan.ranks, mig.plan.target = [2, 3], "n5"  # a node's every worker moved
    asyncio.run(mig.send("n3", "exit", 1))
    asyncio.run(mig.send("n5", "exit", 1))  # the spare's launchpad (dropping the target) still exits
    assert commander.sent == [("n3", "discard", {"ranks": [2, 3]}), ("n5", "exit", None)]
    journal.close()
