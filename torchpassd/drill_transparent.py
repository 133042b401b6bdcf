"""What ``torchpassctl drill --mode planned-transparent`` changes in the planned-aware drill: the job is
submitted with ``--torchpass=transparent`` and trains torchpassd/drill_jobs/ddp_tutorial.py, a DDP
tutorial-style script with no TorchPass code whose DataLoader has 2 worker processes (as nearly
every training script's has), so the drained node's rank can only move as a whole process tree
(criu, torchpassd/transparent.py). The reference run and the comparison are the drill's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurm_plugin.model import TRANSPARENT

MODE = "planned-transparent"
SCRIPT = Path(__file__).resolve().parent / "drill_jobs" / "ddp_tutorial.py"
SBATCH_MODE = TRANSPARENT
SCRIPT_ARGS = ("--num-workers", "2")  # forked DataLoader workers: they move with their worker
MOVE_KEYS = ("dump_s", "frozen_s", "transfer_s", "restore_s", "image_bytes", "page_bytes")


def move_timings(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Dump, transfer and restore of the move, each timed on its own (the handed_over phase)."""
    detail = next((p["detail"] for p in phases if p["phase"] == "handed_over"), {})
    return {k: detail.get(k) for k in MOVE_KEYS}
