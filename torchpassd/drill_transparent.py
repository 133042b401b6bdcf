"""What ``torchpassctl drill --mode planned-transparent`` changes in the planned-aware drill: the job is
submitted with ``--torchpass=transparent`` and trains contrib/examples/ddp_tutorial.py, a DDP
tutorial-style script with no TorchPass code, so the drained node's rank can only move as a whole
process (criu, torchpassd/transparent.py). The reference run and the comparison are the drill's own."""

from __future__ import annotations

from pathlib import Path

MODE = "planned-transparent"
SCRIPT = Path(__file__).resolve().parents[1] / "contrib" / "examples" / "ddp_tutorial.py"
SBATCH_MODE = "transparent"
