"""A dumped process tree that is not moved after all goes on whole: criu dump leaves every task of
the tree stopped, and resume_original must continue each of them, a worker's forked children (its
DataLoader's worker processes) too. Left stopped, they would hold the worker in its next batch for
ever, and every other rank in its next collective until the backend's timeout (a hung job)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from criu_hooks import runner, spawn

pytestmark = [pytest.mark.criu]

# The worker forks a child that ticks into a file every 20 ms, as a DataLoader's worker produces batches.
TREE = """
import os, sys, time
path = sys.argv[1]
if os.fork() == 0:
    n = 0
    while True:
        n += 1
        with open(path, "w") as f:
            f.write(str(n))
        time.sleep(0.02)
while True:
    time.sleep(0.05)
"""


def _ticks(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _wait_ticking(path: Path, timeout: float = 10.0) -> int:
    start, deadline = _ticks(path), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ticks(path) > start:
            return _ticks(path)
        time.sleep(0.02)
    raise AssertionError(f"the child did not tick within {timeout} s (still {start})")


def test_a_dumped_tree_left_in_place_runs_again_children_included(criu: None, tmp_path: Path) -> None:
    ticks = tmp_path / "ticks"
    launcher = spawn.start([sys.executable, "-c", TREE, str(ticks)], output=tmp_path / "out.log")
    try:
        root = spawn.worker_pid(launcher)
        _wait_ticking(ticks)
        assert len(runner.tree(root)) == 2, runner.tree(root)
        runner.dump(root, tmp_path / "images", where={"test": "tree"})
        frozen = _ticks(ticks)
        time.sleep(0.3)
        assert _ticks(ticks) == frozen, "criu dump leaves the tree stopped"
        runner.resume_original(root)
        assert _wait_ticking(ticks, timeout=5.0) > frozen, "the child must run again"
    finally:
        launcher.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(ticks)], check=False)
        launcher.wait(10)
