"""What a drill found: the report ``torchpassctl drill --json`` prints, and how a drilled job's
per-step log compares with the undisturbed reference run (every drill mode uses both)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DrillReport:
    """What ``torchpassctl drill --json`` prints."""

    ok: bool = False
    mode: str = "planned-aware"
    job_id: str = ""
    migrated_from: str = ""
    migrated_to: str = ""
    detect_s: float | None = None
    pause_s: float | None = None
    resumed_at_step: int | None = None
    expected_step: int | None = None
    lost_steps: int | None = None
    bit_identical: bool = False
    error: str | None = None
    drain_reason: str = ""  # gpu-degrade: why torchpassd drained the node
    fault: str = ""  # unplanned: kill or cut (drill_unplanned.py)
    step_at_kill: int | None = None  # unplanned: the highest step any rank had started at the kill
    workdir: str = ""
    moved_ranks: list[int] = field(default_factory=list)  # every rank of the failed node
    rollbacks: list[str] = field(default_factory=list)  # migrations rolled back before the one that moved them
    job_state: str = ""  # the job's final Slurm state: COMPLETED, as if nothing had happened
    timeline: list[dict[str, Any]] = field(default_factory=list)
    move: dict[str, Any] = field(default_factory=dict)  # planned-transparent: dump, transfer, restore



def read_log(path: Path) -> tuple[list[tuple[int, int, str]], dict[int, str]]:
    """The example script's ``--log``: (rank, step, loss hex) in file order, and final hashes. A last
    line without its newline is still being written by a rank: it is left for the next read."""
    steps, finals = [], {}
    text = path.read_text()
    for line in text[:text.rfind("\n") + 1].splitlines():
        rec = json.loads(line)
        if "final" in rec:
            finals[rec["rank"]] = rec["final"]
        else:
            steps.append((rec["rank"], rec["step"], rec["loss"]))
    return steps, finals


def compare(run: Path, ref: Path, rank: int, expected_step: int, report: DrillReport) -> None:
    """Fill in resumed_at_step (the first step the moved rank logged after its first
    ``expected_step`` lines), lost_steps and bit_identical."""
    got, got_final = read_log(run)
    want, want_final = read_log(ref)
    seq = [s for r, s, _ in got if r == rank]
    report.expected_step = expected_step
    report.resumed_at_step = seq[expected_step] if len(seq) > expected_step else None
    have = {(r, s): loss for r, s, loss in got}
    report.lost_steps = sum(1 for r, s, _ in want if (r, s) not in have)
    report.bit_identical = (len(got) == len(want) and {(r, s): x for r, s, x in want} == have
                            and got_final == want_final and bool(want_final))
