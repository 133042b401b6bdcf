"""A worker whose output goes to a pipe (as launchpad reads its workers) keeps writing after it is
restored: its stdout pipe is re-attached to a new pipe of the restoring process (criu --inherit-fd),
and the lines go on from where they stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]

TICKER = "import itertools, time\nfor i in itertools.count():\n    print(i, flush=True)\n    time.sleep(0.02)\n"


def _lines(fd: int, count: int, timeout: float = 30.0) -> list[int]:
    got, buf = [], b""
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        *done, buf = buf.split(b"\n")
        got += [int(x) for x in done]
    return got


def test_restored_worker_writes_on_into_the_new_pipe(tmp_path: Path) -> None:
    from criu_hooks import locate, runner, spawn
    from criu_hooks.errors import CriuUnavailable

    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))
    launcher = subprocess.Popen([*spawn.PREFIX, sys.executable, "-c", TICKER], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid, restored = spawn.worker_pid(launcher), None
    new_r, new_w = os.pipe()
    try:
        before = _lines(launcher.stdout.fileno(), 5)
        pipes = spawn.stdio_pipes(pid)
        assert set(pipes) == {1, 2} and pipes[1] == pipes[2]  # stdout and stderr: one pipe
        dumped = runner.dump(pid, tmp_path / "images")
        restored = runner.restore(dumped.images, inherit={pipes[1]: new_w}).pid
        runner.discard_original(pid)
        os.close(new_w)
        after = _lines(new_r, 20)
        assert len(after) == 20 and after == list(range(after[0], after[0] + 20))
        assert before[-1] < after[0] <= before[-1] + 1 + 64 * 1024 // 2  # nothing lost, at most the unread pipe
    finally:
        for p in (pid, restored):
            if p:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        launcher.kill()
        launcher.wait(timeout=10)
        os.close(new_r)
