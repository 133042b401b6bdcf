"""A big worker survives dump and restore whole: a process with a few GiB of tensor memory (2 by
default, TORCHPASS_CRIU_TEST_GIB to change) and many threads is dumped, restored beside its stopped
original and killed original, then checks its own memory and thread count. Run as a script, this
file is that worker. Prints the measured dump and restore times and throughput."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIB = float(os.environ.get("TORCHPASS_CRIU_TEST_GIB", "2"))
THREADS = 64

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]


def _wait_line(path: Path, prefix: str, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith(prefix):
                return line.split()[1:]
        time.sleep(0.05)
    tail = path.read_text()[-2000:] if path.exists() else "(no output)"
    raise AssertionError(f"no {prefix!r} line within {timeout} s; worker output: {tail}")


def test_worker_with_gibs_of_memory_and_many_threads_is_restored_whole(tmp_path: Path) -> None:
    from criu_hooks import locate, runner, spawn
    from criu_hooks.errors import CriuUnavailable

    try:
        locate.find()
    except CriuUnavailable as e:
        pytest.skip(str(e))
    out = tmp_path / "worker.log"
    launcher = spawn.start([sys.executable, __file__, "worker"], output=out,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    supervisor = None
    pid = spawn.worker_pid(launcher)
    try:
        checksum, threads = _wait_line(out, "ready", timeout=300)
        assert int(threads) >= THREADS
        dumped = runner.dump(pid, tmp_path / "images")
        assert dumped.image_bytes >= GIB * (1 << 30)
        supervisor = subprocess.Popen([sys.executable, "-m", "criu_hooks", "restore", str(dumped.images)],
                                      cwd=ROOT, stdout=subprocess.PIPE, text=True)
        restored = json.loads(supervisor.stdout.readline())
        runner.discard_original(pid)
        pid = restored["pid"]
        os.kill(pid, signal.SIGUSR1)
        assert _wait_line(out, "verified", timeout=120) == [checksum, threads]
        assert supervisor.wait(timeout=60) == 0
        gb = dumped.image_bytes / 1e9
        print(json.dumps({"image_gb": round(gb, 2), "threads": int(threads),
                          "dump_s": round(dumped.seconds, 2), "dump_gb_s": round(gb / dumped.seconds, 2),
                          "frozen_s": dumped.frozen_seconds, "restore_s": round(restored["seconds"], 2),
                          "restore_gb_s": round(gb / restored["seconds"], 2)}))
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc in (launcher, supervisor):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)


def _worker() -> None:
    import torch

    torch.set_num_threads(4)
    gen = torch.Generator().manual_seed(7)
    memory = torch.randint(-(2**62), 2**62, (int(GIB * (1 << 30)) // 8,), dtype=torch.int64, generator=gen)
    parked = threading.Event()
    for _ in range(THREADS):
        threading.Thread(target=parked.wait, daemon=True).start()
    woken = []
    # The worker is init of its PID namespace: only signals it handles reach it.
    signal.signal(signal.SIGUSR1, lambda *_: woken.append(True))

    def report(word: str) -> None:
        checksum = int(memory.sum()) ^ int(memory[::4099].sum())  # starts torch's pool on first use
        print(word, checksum, len(os.listdir("/proc/self/task")), flush=True)

    report("ready")
    while not woken:
        signal.pause()
    report("verified")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker()
