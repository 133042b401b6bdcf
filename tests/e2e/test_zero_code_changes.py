"""Zero code changes, zero harm: scripts with no TorchPass code, written as users write them, under a
bare ``sbatch --torchpass`` or ``--torchpass=transparent`` and an unchanged ``srun torchrun``. A
transparent move takes the worker's whole process tree (its DataLoader worker processes too), the
job ends COMPLETED and bit-identical to an undisturbed run, and each rank prints each step once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import (
    Daemon,
    Training,
    assert_bit_identical,
    assert_every_line_once,
    reference_log,
    sacct_state,
    wait_until,
)
from torchpassd.drill_report import read_log
from torchpassd.drill_transparent import SCRIPT as TUTORIAL

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, STEP_SLEEP, NODES = 150, 0.2, 3
TRAINER = Path(__file__).resolve().parent / "jobs" / "snapshot_trainer.py"  # pytorch/examples' multinode.py style
EPOCH_LINE = re.compile(r"^\[rank (\d+)\] Epoch (\d+) \|", re.M)


def _protection(tp_config: Path, job: str) -> str:
    """What ``torchpassctl jobs`` says protects ``job``, once torchpassd knows (its workers took a step)."""
    def known() -> str | None:
        res = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config), "jobs",
                              "--json"], capture_output=True, text=True, timeout=60, check=True)
        row = next((j for j in json.loads(res.stdout)["jobs"] if str(j["job"]) == job), None)
        return row["protection"] if row and row["protection"] not in ("-",) and \
            not row["protection"].startswith("unknown") else None
    return wait_until(f"torchpassctl jobs to say what protects job {job}", known, 60, every=0.5)


def test_a_bare_torchpass_moves_an_unmodified_tutorial_script_transparently(
        criu: None, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """``sbatch --torchpass`` (mode auto) of a script that never heard of TorchPass: its workers
    never register, so torchpassd says (torchpassctl jobs, one torchpass: line) and does a
    transparent move. No joiner reruns the script: every rank prints every epoch once, the
    Trainer never reloads its snapshot, and the job ends COMPLETED, bit-identical."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=2, nproc=2,
                   script=TRAINER, mode="auto")
    view = job.wait_running(torchpassd)
    assert _protection(tp_config, job.job).startswith("transparent:")
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_moved(job.job, victim)
    assert mig["mode"] == "planned-transparent" and mig["target"] == "n5", mig
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), read_log(reference_log(workdir, 4, STEPS, TRAINER)))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    out = job.out.read_text()
    epochs = Counter((int(r), int(e)) for r, e in EPOCH_LINE.findall(out))
    assert set(epochs) == {(r, e) for r in range(4) for e in range(STEPS)} and max(epochs.values()) == 1, out[-2000:]
    assert "Loading snapshot" not in out, out[-2000:]
    said = [ln for ln in out.splitlines() if ln.startswith("torchpass:")]
    assert said == [f"torchpass: job {job.job} is protected by transparent migration: the worker processes "
                    "move whole with criu (no code change needed)"], said


@pytest.mark.parametrize("loader", [  # fork in CI: tests/e2e/test_real_jobs.py's transparent drain (2 ranks a node)
    pytest.param("--num-workers 2 --worker-start fork", marks=pytest.mark.matrix),
    pytest.param("--num-workers 2 --worker-start spawn --persistent-workers", marks=pytest.mark.matrix),
], ids=["fork", "spawn-persistent"])
def test_transparent_drain_moves_a_worker_with_its_dataloader_processes(
        criu: None, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, loader: str) -> None:
    """criu dumps the worker with its DataLoader worker processes as one tree and restores it on
    the spare; training goes on from the same step, bit-identical, each step printed once."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES,
                   script=TUTORIAL, args=loader, mode="transparent")
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_moved(job.job, victim)
    assert mig["target"] == "n5", mig
    devcluster.resume(victim)
    ref = read_log(reference_log(workdir, NODES, STEPS, TUTORIAL, loader))  # undisturbed, the same loader
    assert_bit_identical(job.wait_done(), ref)
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)
    assert len([m for m in torchpassd.migrations(job.job) if m["status"] == "succeeded"]) == 1
