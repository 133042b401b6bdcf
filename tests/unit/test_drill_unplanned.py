"""The unplanned drill's verdict on a training log split at the kill: the failed step may be
logged twice (started before the kill, redone after) with the same loss; a completed step
logged again, a replay with another loss or a skipped step fails the drill. And its kills by pid:
a node on a real cluster, one worker process (the crash drill)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.processes import dead
from torchpassd.drill_report import DrillReport
from torchpassd.drill_unplanned import crash_script, judge, kill_script


def _write(path: Path, rows: list[tuple[int, int, str]], finals: bool = True) -> int:
    text = "".join(json.dumps({"rank": r, "step": s, "loss": x}) + "\n" for r, s, x in rows)
    if finals:
        text += "".join(json.dumps({"rank": r, "final": "h"}) + "\n" for r in (0, 1))
    path.write_text(text)
    return len(text.encode())


def _loss(r: int, s: int) -> str:
    return f"{r}.{s}"


@pytest.mark.parametrize("case", ["clean", "recomputed", "replayed_differently", "skipped"])
def test_verdict(tmp_path: Path, case: str) -> None:
    steps = 10
    _write(tmp_path / "ref", [(r, s, _loss(r, s)) for s in range(steps) for r in (0, 1)])
    # Rank 1 is killed during step 5 (both ranks had logged 5); rank 0 and the joiner redo 5.
    before = [(r, s, _loss(r, s)) for s in range(6) for r in (0, 1)]
    after = [(r, s, _loss(r, s)) for s in range(5, steps) for r in (0, 1)]
    if case == "recomputed":
        after.insert(0, (0, 4, _loss(0, 4)))
    elif case == "replayed_differently":
        after[0] = (0, 5, "other")
    elif case == "skipped":
        after = [row for row in after if row[:2] != (1, 5)]
    offset = _write(tmp_path / "run", before, finals=False)
    text = (tmp_path / "run").read_text()
    _write(tmp_path / "tail", after)
    (tmp_path / "run").write_text(text + (tmp_path / "tail").read_text())
    rep = DrillReport()
    judge(tmp_path / "run", tmp_path / "ref", rank=1, failed_step=5, offset=offset, report=rep)
    assert rep.step_at_kill == 5 and rep.expected_step == 5
    if case == "clean":
        assert (rep.resumed_at_step, rep.lost_steps, rep.bit_identical, rep.error) == (5, 0, True, None)
    elif case == "skipped":
        assert rep.resumed_at_step == 6 != rep.expected_step  # the drill is not ok: step 5 never ran on rank 1
    else:
        assert rep.bit_identical is False and "recomputed or replayed differently" in (rep.error or "")


def test_the_real_cluster_kill_takes_the_workers_their_launchpad_and_step_and_that_slurmd_only(tmp_path: Path) -> None:
    """On a real cluster the drill kills by pid (a dev cluster's nodes share one pid namespace, so
    `pidof slurmd` there would take every node's): a stand-in step (stepd -> launchpad -> worker),
    a stand-in slurmd with its pid file, and a bystander that must live on."""
    step = subprocess.Popen(["sh", "-c", "sh -c 'sleep 300 & echo $! > worker; wait' & wait"], cwd=tmp_path,
                            start_new_session=True)
    slurmd = subprocess.Popen(["sleep", "300"])
    bystander = subprocess.Popen(["sleep", "300"])
    (tmp_path / "slurmd.pid").write_text(f"{slurmd.pid}\n")
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "worker").exists() or not (tmp_path / "worker").read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        worker = int((tmp_path / "worker").read_text())
        launchpad = int(Path(f"/proc/{worker}/stat").read_text().split(")")[1].split()[1])
        subprocess.run(["sh", "-c", kill_script([worker], str(tmp_path / "slurmd.pid"))], check=False, timeout=30)
        assert step.wait(timeout=10) == -9  # the step's stepd stand-in
        assert slurmd.wait(timeout=10) == -9
        for pid in (worker, launchpad):
            deadline = time.monotonic() + 10
            while not dead(pid):
                assert time.monotonic() < deadline, f"{pid} still runs"
                time.sleep(0.02)
        assert bystander.poll() is None
    finally:
        for proc in (step, slurmd, bystander):
            proc.kill()
            proc.wait()


def test_the_crash_drill_kills_its_worker_and_leaves_the_launchpad_and_other_workers(tmp_path: Path) -> None:
    """``--mode unplanned-crash``: one worker process killed by pid, as an OOM kill would; its
    launchpad (the parent) and the node's other worker live on: the node stays healthy."""
    launchpad = subprocess.Popen(["sh", "-c", "sleep 300 & echo $! > a; sleep 300 & echo $! > b; wait"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 10
        while not all((tmp_path / n).exists() and (tmp_path / n).read_text().strip() for n in "ab"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        victim, other = (int((tmp_path / n).read_text()) for n in "ab")
        subprocess.run(["sh", "-c", crash_script(victim)], check=True, timeout=30)
        deadline = time.monotonic() + 10
        while not dead(victim):
            assert time.monotonic() < deadline, f"{victim} still runs"
            time.sleep(0.02)
        assert launchpad.poll() is None and not dead(other)
    finally:
        launchpad.kill()
        launchpad.wait()
