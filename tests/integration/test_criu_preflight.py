"""Before anything is paused: a worker started the CRIU way is declared movable, and a worker started
any other way is refused with reasons that say what to change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from criu_hooks import preflight, spawn

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.criu
def test_worker_started_by_spawn_is_movable(tmp_path: Path) -> None:
    from criu_hooks import locate
    from criu_hooks.errors import CriuUnavailable

    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))
    launcher = spawn.start(SLEEPER, output=tmp_path / "out")
    worker = spawn.worker_pid(launcher)
    try:
        assert preflight.reasons(worker) == []
    finally:
        os.kill(worker, signal.SIGKILL)  # the namespace's init; unshare then exits by itself
        launcher.wait(timeout=10)


def test_plain_child_is_refused_with_what_to_change() -> None:
    child = subprocess.Popen(SLEEPER, stdin=subprocess.DEVNULL)
    try:
        found = " | ".join(preflight.reasons(child.pid))
        assert "not the first process of its own PID namespace" in found
        assert "not a session leader" in found and "criu_hooks.spawn" in found
    finally:
        child.kill()
        child.wait(timeout=10)


def test_vanished_process_is_refused() -> None:
    child = subprocess.Popen(SLEEPER)
    child.kill()
    child.wait(timeout=10)
    assert any("does not exist" in r for r in preflight.reasons(child.pid))
