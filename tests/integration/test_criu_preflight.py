"""Before anything is paused: a worker started the CRIU way is declared movable, and a worker started
any other way is refused with reasons that say what to change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def test_device_paths_are_judged_by_whether_they_mean_the_same_on_the_spare() -> None:
    assert preflight.unportable("/dev/null") == preflight.unportable("/dev/shm/torch_1_2") == ""
    assert preflight.unportable("/dev/nvidia0") == ""  # GPUs: criu_hooks.cuda decides
    assert preflight.unportable("/tmp/train.log") == "" and preflight.unportable("socket:[12]") == ""
    assert "terminal" in preflight.unportable("/dev/pts/3")
    assert "cannot carry" in preflight.unportable("/dev/infiniband/uverbs0")


@pytest.mark.criu
def test_a_device_held_by_a_forked_child_is_named_before_any_pause(tmp_path: Path) -> None:
    """A DataLoader-style child of the worker holding a device file: preflight names the process and
    the device (criu would fail the dump, after the pause)."""
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg (the device this test holds open) is not readable here")
    holder = ("import os, time\nif os.fork() == 0:\n    f = open('/dev/kmsg', 'rb')\n    time.sleep(60)\n"
              "time.sleep(60)\n")
    launcher = spawn.start([sys.executable, "-c", holder], output=tmp_path / "out")
    worker = spawn.worker_pid(launcher)
    try:
        def named() -> list[str]:
            return [r for r in preflight.reasons(worker) if "/dev/kmsg" in r]
        for _ in range(100):  # until the child has opened it
            if found := named():
                break
            time.sleep(0.05)
        assert found and "a device that criu cannot carry to another node" in found[0], preflight.reasons(worker)
        assert not found[0].startswith(f"process {worker} "), "the child holds it, not the worker"
    finally:
        os.kill(worker, signal.SIGKILL)  # the namespace's init: its child goes with it
        launcher.wait(timeout=10)
