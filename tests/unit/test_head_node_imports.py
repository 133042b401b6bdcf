"""torchpassd, torchpassctl and the Slurm adapter run on head nodes, where torch may be absent and
loading it costs seconds and hundreds of MB: each is imported in a fresh interpreter and must not
load torch (#20)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["torchpassd.daemon", "torchpassd.cli", "torchpassd.ctl", "slurm_plugin.watcher"])
def test_head_node_programs_do_not_load_torch(module: str) -> None:
    res = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(sorted(m for m in sys.modules "
                                                "if m == 'torch' or m.startswith('torch.')))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", f"importing {module} loaded torch: {res.stdout[:300]}"
