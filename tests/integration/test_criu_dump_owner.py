"""The credentials check before a restore reads what a real criu wrote: a dumped worker's images
name this user (they pass for this job) and are refused for any other."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from criu_hooks import image_owner, locate, runner, spawn
from criu_hooks.errors import CriuUnavailable
from criu_hooks.image_owner import ImageRefused

pytestmark = [pytest.mark.criu, pytest.mark.security, pytest.mark.timeout(120)]


def test_a_real_dump_restores_only_as_its_own_user(tmp_path: Path) -> None:
    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))
    launcher = subprocess.Popen([*spawn.PREFIX, sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid = spawn.worker_pid(launcher)
    try:
        dumped = runner.dump(pid, tmp_path / "images")
        tasks = image_owner.read(dumped.images)
        assert tasks and all(t.uids == {os.getuid()} and os.getgid() in t.gids for t in tasks), tasks
        image_owner.check(dumped.images, uid=os.getuid(), gids={os.getgid(), *os.getgroups()})
        with pytest.raises(ImageRefused, match=rf"as uid \[{os.getuid()}\], not as the job's user \(uid 65534\)"):
            image_owner.check(dumped.images, uid=65534, gids={65534})
    finally:  # the dumped worker was left stopped: kill it and its launcher
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait(timeout=10)
