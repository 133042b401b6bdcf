"""The straggler signal measured on this machine's kernel: a thread that computes is charged its
time per step, one that sleeps (as a rank waiting for its peers in a collective) is not, and a
thread held back by a CPU quota is charged the time it waited to run too."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import cpu_throttle
from torchpass.busy_time import SCHEDSTAT, BusyMeter

pytestmark = pytest.mark.skipif(not SCHEDSTAT.exists(), reason="no /proc/thread-self/schedstat (not Linux)")


def in_thread(work: str, steps: int, seconds: float) -> list[float | None]:
    """``steps`` steps of ``seconds`` each, spinning or sleeping, metered on their own thread."""
    out: list[float | None] = []

    def run() -> None:
        meter = BusyMeter()
        out.append(meter.per_step(0))
        for _ in range(steps):
            end = time.monotonic() + seconds
            if work == "spin":
                while time.monotonic() < end:
                    pass
            else:
                time.sleep(seconds)
        out.append(meter.per_step(steps))
        out.append(meter.per_step(steps))  # no step since
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out


def test_computing_is_charged_per_step_and_sleeping_is_not() -> None:
    first, spin, again = in_thread("spin", 4, 0.05)
    assert first is None and again is None
    assert 0.04 <= spin <= 0.08, spin  # ran (or waited to run) the whole 50 ms a step
    _, sleep, _ = in_thread("sleep", 4, 0.05)
    assert sleep < 0.005, sleep  # asleep: the peers' wait in a collective costs nothing


def test_unreadable_statistics_report_nothing(tmp_path: Path) -> None:
    assert BusyMeter(tmp_path / "absent").per_step(5) is None
    (tmp_path / "garbled").write_text("not numbers\n")
    assert BusyMeter(tmp_path / "garbled").per_step(5) is None


METERED = """
import sys, time
sys.path.insert(0, {root!r})
from torchpass.busy_time import BusyMeter
meter = BusyMeter()
meter.per_step(0)
print("ready", flush=True)
sys.stdin.readline()  # moved under the quota meanwhile
for _ in range(4):
    end = time.thread_time() + 0.02  # 20 ms of computing a step
    while time.thread_time() < end:
        pass
print(meter.per_step(4), flush=True)
"""


def test_a_throttled_process_is_charged_the_time_it_waited_for_the_cpu() -> None:
    if why := cpu_throttle.available():
        pytest.skip(why)
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", METERED.format(root=root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with cpu_throttle.throttled([proc.pid], 0.2):  # a fifth of a CPU
            proc.stdin.write("go\n")
            proc.stdin.flush()
            busy = float(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert busy >= 0.06, busy  # 20 ms of work a step takes >= 80 ms at a fifth of a CPU, all of it wanted
