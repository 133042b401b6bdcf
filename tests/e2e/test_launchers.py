"""Launchers users use besides ``srun torchrun``, protected with nothing but the flag: torchrun by
another name (``python -m torch.distributed.run``, as Megatron-LM's Slurm recipe runs it; a
torchrun given by its full path). A drained node's ranks move, the job ends COMPLETED 0:0,
bit-identical to an undisturbed run, each rank's progress printed once."""

from __future__ import annotations

import sys
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
)
from torchpassd.drill_report import read_log

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

STEPS, STEP_SLEEP = 150, 0.2
NODES, NPROC = 3, 2
VENV = Path(sys.executable).parent


@pytest.mark.parametrize("launcher", [
    f"{VENV}/python -m torch.distributed.run",
    pytest.param(f"{VENV}/torchrun", marks=pytest.mark.matrix),
], ids=["python-m-torch.distributed.run", "torchrun-full-path"])
def test_torchrun_by_another_name_is_protected_like_torchrun(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, launcher: str) -> None:
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   launcher=launcher)
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    assert len(view["launchpads"][victim]["workers"]) == NPROC, view  # launchpad, not torchrun, runs them
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), read_log(reference_log(workdir, NODES * NPROC, STEPS)))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)
