"""A migration that fails in any phase costs the job one pause, never a hang: the planned
(model-aware) and the transparent flow are failed at each command they send once the ranks are
paused, and every paused member's last command must be one that makes it train again (``abort``
resumes what is paused, ``resume`` the re-formed generation), with the flow ended and recorded
well within the 10 s the job may lose. Commands go to a launchpad stand-in that answers at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from torchpass_common import protocol
from torchpass_common.config import Config
from torchpass_common.errors import MigrationError
from torchpassd import journal as jn
from torchpassd import planned, transparent
from torchpassd.commander import CommandFailed
from torchpassd.metrics import Metrics
from torchpassd.registry import Registry

RANKS = {"n1": [0], "n2": [1], "n3": [2]}  # n3 leaves; n5 is the spare
TRAINS_AGAIN = ("abort", "resume")
STEP = 10


class Launchpads:
    """Answers every command as a healthy launchpad would, except ``fail`` = (node, command): that
    one fails once, as a launchpad reports a failure. Records (node, command) in order."""

    def __init__(self, fail: tuple[str, str]) -> None:
        self.fail, self.sent = fail, []
        self.at_step = 0

    async def send(self, job: str, node: str, cmd: str, *, migration: str, gen: int,
                   args: dict[str, Any] | None = None, timeout: float) -> dict[str, Any]:
        self.sent.append((node, cmd))
        if (node, cmd) == self.fail:
            self.fail = ("", "")
            raise CommandFailed(f"{cmd} failed on the launchpad: injected", lasting=cmd == "restore", node=node)
        if cmd == "pause":
            return {"steps": {str(r): args["at_step"] for r in RANKS[node]}}  # type: ignore[index]
        if cmd == "preflight":
            return {"reasons": [], "registered": False, "pid": 99}
        return {"bytes": 1, "seconds": 0.1, "dump_s": 0.1, "restore_s": 0.1, "page_bytes": 1}


async def _events(job: str, event: str, detail: dict[str, Any]) -> None:
    return None


def _flow(tmp_path: Path, kind: type[planned.PlannedMigration], launchpads: Launchpads) -> tuple[
        planned.PlannedMigration, jn.Journal]:
    registry = Registry()
    for node, ranks in RANKS.items():
        body = {"node": node, "seq": 1, "workers": [{"rank": r, "step": STEP, "state": "running", "pid": 90 + r,
                                                     "registered": True, "movable": True} for r in ranks]}
        asyncio.run(registry.on_message(node, protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1,
                                                                              body=body))))
    journal = jn.Journal(tmp_path / "j.sqlite")
    journal.upsert_job("7", user="u", mode="auto", state="RUNNING", gen=1, nodes=list(RANKS))
    mid = journal.start_migration("7", mode=kind.mode, source="n3", reason="drain", gen=1)
    deps = planned.Deps(Config(), journal, registry, launchpads, None, None, Metrics(), _events,  # type: ignore[arg-type]
                        tmp_path / "steps")
    return kind(deps, planned.Plan(job="7", source="n3", gen=1), mid, detected_at=time.time()), journal


def _prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spare is in the job and its launchpad (or joiner) is up: what _prepare does with Slurm."""
    async def prepare(self: planned.PlannedMigration) -> None:
        p = self.plan
        p.ranks, p.rank, p.survivors = [2], 2, ["n1", "n2"]
        p.target, p.target_addr, p.world_size, p.port = "n5", "10.0.0.5", 3, planned.WORMHOLE_PORT_BASE + p.new_gen
        await self.phase(planned.JOINER_READY)

    async def nothing(self: planned.PlannedMigration, target: str) -> list[str]:
        return []
    monkeypatch.setattr(planned.PlannedMigration, "_prepare", prepare)
    monkeypatch.setattr(transparent.TransparentMigration, "_prepare", prepare)
    monkeypatch.setattr(planned.PlannedMigration, "_drop_target", nothing)  # the spare goes back: Slurm's part


PLANNED = [("n3", "pause"), ("n1", "pause"), ("n3", "save"), ("n5", "reform"), ("n1", "reform")]
TRANSPARENT = [("n3", "pause"), ("n2", "pause"), ("n5", "prepare_restore"), ("n3", "checkpoint"),
               ("n5", "restore"), ("n5", "reform"), ("n2", "reform")]


@pytest.mark.parametrize("kind,fail", [(planned.PlannedMigration, f) for f in PLANNED]
                         + [(transparent.TransparentMigration, f) for f in TRANSPARENT],
                         ids=[f"aware-{n}-{c}" for n, c in PLANNED] + [f"transparent-{n}-{c}" for n, c in TRANSPARENT])
def test_a_failure_after_the_pause_leaves_every_member_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type[planned.PlannedMigration],
        fail: tuple[str, str]) -> None:
    _prepared(monkeypatch)
    launchpads = Launchpads(fail)
    flow, journal = _flow(tmp_path, kind, launchpads)
    t0 = time.monotonic()
    status = asyncio.run(asyncio.wait_for(flow.run(), 10))
    assert time.monotonic() - t0 < 10
    assert status == jn.ROLLED_BACK, journal.migration(flow.id).error
    assert flow.error and "injected" in flow.error
    assert flow.lasting == ("criu could not restore ranks [2] on n5" if fail[1] == "restore" else "")
    failed_at = launchpads.sent.index(fail)
    after = launchpads.sent[failed_at + 1:]
    for node in ("n1", "n2", "n3"):  # each paused member: its last word after the failure makes it train
        last = [c for n, c in after if n == node][-1:]
        assert last and last[0] in TRAINS_AGAIN, (node, after)
    assert "exit" not in [c for n, c in after if n == "n3"], "the leaving ranks hold the only copy: kept"
    journal.close()


@pytest.mark.parametrize("kind", [planned.PlannedMigration, transparent.TransparentMigration], ids=["aware", "transparent"])
def test_a_failure_before_the_pause_pauses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   kind: type[planned.PlannedMigration]) -> None:
    _prepared(monkeypatch)

    async def no_spare(self: planned.PlannedMigration) -> None:
        raise MigrationError("no spare free", **self.where)
    monkeypatch.setattr(kind, "_prepare", no_spare)
    launchpads = Launchpads(("", ""))
    flow, journal = _flow(tmp_path, kind, launchpads)
    assert asyncio.run(flow.run()) == jn.ROLLED_BACK and "no spare free" in flow.error
    assert "pause" not in [c for _, c in launchpads.sent]
    journal.close()
