"""A drill whose first migration is rolled back (the job went on where it was) waits for
torchpassd's retry and reports the rollback next to the migration that moved the ranks; a job
that ends before any migration off the node succeeded is a clear failure naming the rollbacks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from torchpass_common.config import Config
from torchpass_common.errors import MigrationError
from torchpassd import drill
from torchpassd.drill import Drill, DrillSettings


class History:
    """torchpassd's history op (newest first), growing as the test says."""

    def __init__(self) -> None:
        self.migrations: list[dict[str, Any]] = []

    def call(self, op: str, **args: Any) -> list[dict[str, Any]]:
        assert op == "history" and args == {"job": "7"}
        return list(reversed(self.migrations))


def _drill(monkeypatch: pytest.MonkeyPatch, active: list[bool]) -> tuple[Drill, History]:
    monkeypatch.setattr(drill, "open_client", lambda cfg: SimpleNamespace(
        job=lambda job_id: SimpleNamespace(active=active[0])))
    monkeypatch.setattr(drill, "runner_for", lambda cfg: None)
    d = Drill(Config(), DrillSettings(), say=lambda text: None)
    d.daemon = History()  # type: ignore[assignment]
    d.report.job_id = "7"
    return d, d.daemon  # type: ignore[return-value]


def test_a_rolled_back_migration_is_noted_and_the_retry_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    d, history = _drill(monkeypatch, [True])
    history.migrations.append({"source": "n3", "status": "running", "error": None})
    assert d._settled("n3") is None
    history.migrations[0].update(status="rolled_back", error="criu dump failed, rank 5 goes on here")
    history.migrations.append({"source": "n2", "status": "succeeded", "error": None})  # another node's
    assert d._settled("n3") is None and d.report.rollbacks == ["criu dump failed, rank 5 goes on here"]
    history.migrations.append({"source": "n3", "status": "succeeded", "error": None, "target": "n5"})
    assert d._settled("n3")["target"] == "n5"
    assert d.report.rollbacks == ["criu dump failed, rank 5 goes on here"]  # noted once


def test_a_job_ending_before_any_success_is_a_clear_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    active = [True]
    d, history = _drill(monkeypatch, active)
    history.migrations.append({"source": "n3", "status": "rolled_back", "error": "no spare"})
    assert d._settled("n3") is None
    active[0] = False
    with pytest.raises(MigrationError, match="job 7 ended before a migration off n3 succeeded .1 rolled back: no spare"):
        d._settled("n3")
