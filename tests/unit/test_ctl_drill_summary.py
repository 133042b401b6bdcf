"""``torchpassctl drill`` without --json: the summary a person reads after a drill shows the
outcome fields of every mode, and a mode-specific field (why the node was drained, which fault)
or the error only when the drill produced one."""

from __future__ import annotations

from dataclasses import asdict

from torchpassd.ctl_ops import drill_summary
from torchpassd.drill_report import DrillReport


def _lines(rep: DrillReport) -> dict[str, str]:
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in drill_summary(asdict(rep)).splitlines())}


def test_a_planned_drill_shows_its_outcome_without_empty_fields() -> None:
    rep = DrillReport(ok=True, job_id="7", migrated_from="n4", migrated_to="n5", pause_s=0.19, lost_steps=0,
                      bit_identical=True)
    lines = _lines(rep)
    assert lines["ok"] == "True" and lines["mode"] == "planned-aware" and lines["migrated_to"] == "n5"
    assert lines["lost_steps"] == "0" and lines["bit_identical"] == "True"
    assert "drain_reason" not in lines and "error" not in lines and "fault" not in lines


def test_mode_specific_fields_and_errors_are_shown_when_set() -> None:
    rep = DrillReport(mode="gpu-degrade", drain_reason="gpu 0: XID 79 (fell off the bus)",
                      error="no spare node became available within 600 s")
    lines = _lines(rep)
    assert lines["ok"] == "False"
    assert lines["drain_reason"] == "gpu 0: XID 79 (fell off the bus)"
    assert lines["error"] == "no spare node became available within 600 s"
