"""A single worker process lost on a healthy node (kill -9: what an OOM kill, a segfault or a fatal
CUDA error looks like) no longer fails the job: launchpad holds the crashed rank's place, torchpassd
cuts every survivor's collectives at once (active abort: no waiting out the collective timeout),
rebuilds the rank on the same node from a data-parallel replica (no spare), and training resumes
at the step that failed. The job ends COMPLETED 0:0, bit-identical to an undisturbed run. Jobs are
submitted as users submit them: ``sbatch --torchpass`` and an unchanged ``srun torchrun``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.test_real_jobs import NODES, NPROC, STEP_SLEEP, STEPS
from tests.support.devcluster import DevCluster
from tests.support.e2e import TIMEOUTS, Daemon, Training, reference_log, sacct_state
from torchpassd.drill_report import DrillReport
from torchpassd.drill_unplanned import judge

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow, pytest.mark.faults]


def _running(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path
             ) -> tuple[Training, str, dict]:
    """A 3 nodes x 2 ranks DDP job, running; the node (not the batch host) and its second worker."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC)
    view = job.wait_running(torchpassd, min_step=5)
    node = next(n for n in view["nodes"] if n != view["batch_host"])
    return job, node, max(view["launchpads"][node]["workers"], key=lambda w: w["rank"])


def _assert_rebuilt_in_place(torchpassd: Daemon, devcluster: DevCluster, workdir: Path, job: Training, node: str,
                             victim: dict, offset: int, skip: int = 0) -> dict:
    """The rank came back on its own node (no spare), every survivor was freed by the active abort,
    and the job ended COMPLETED 0:0 with the rank's losses and parameters as undisturbed. ``skip``:
    earlier recoveries off the node to pass over (failed attempts)."""
    nodes_before = torchpassd.job(job.job)["nodes"]
    mig = torchpassd.wait_migration(job.job, node, timeout=180, skip=skip)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware", mig
    assert not mig["target"], mig  # no spare: the rank was rebuilt where it ran
    assert sorted(torchpassd.job(job.job)["nodes"]) == sorted(nodes_before)  # the same nodes, nothing resized
    phases = {p["phase"]: p.get("detail", {}) for p in mig["phases"]}
    assert "spare_chosen" not in phases and phases["joiner_ready"]["in_place"] is True, phases
    assert phases["joiner_ready"]["ranks"] == [victim["rank"]], phases
    # active abort: every survivor was at its just-in-time checkpoint well before the collective timeout
    assert phases["interrupted"]["interrupted_after_s"] < TIMEOUTS["collective"] / 2, phases["interrupted"]
    failed_step = phases["resumed"]["resumed_at_step"]
    job.wait_done(timeout=240)
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    ref = reference_log(workdir, NODES * NPROC, STEPS)
    rep = DrillReport()
    judge(job.log, ref, victim["rank"], failed_step, offset, rep)
    assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep
    print(json.dumps({p: {k: v for k, v in d.items() if k != "plan"} for p, d in phases.items()}))  # timings in -s
    return phases


def test_a_worker_killed_on_a_healthy_node_is_rebuilt_in_place_and_the_job_ends_completed(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    job, node, victim = _running(torchpassd, devcluster, tp_config, workdir)
    offset = job.log.stat().st_size
    os.kill(victim["pid"], signal.SIGKILL)
    phases = _assert_rebuilt_in_place(torchpassd, devcluster, workdir, job, node, victim, offset)
    assert "killed by signal SIGKILL" in " ".join(phases["detected"]["evidence"]), phases["detected"]


@pytest.mark.matrix  # CI runs the watchdog on real launchpads in tests/integration/test_launchpad_unplanned.py
def test_a_frozen_rank_is_found_by_the_watchdog_and_rebuilt_in_place(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """SIGSTOP: the rank neither steps nor answers; its peers wait in their all-reduce. launchpad's
    watchdog kills it within max(3 s, 5 steps), and the crash is recovered like any other."""
    job, node, victim = _running(torchpassd, devcluster, tp_config, workdir)
    offset = job.log.stat().st_size
    os.kill(victim["pid"], signal.SIGSTOP)
    phases = _assert_rebuilt_in_place(torchpassd, devcluster, workdir, job, node, victim, offset)
    assert "frozen" in " ".join(phases["detected"]["evidence"]), phases["detected"]


@pytest.mark.matrix
def test_torchpassd_killed_while_a_rank_is_rebuilt_in_place_then_restarted(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """torchpassd SIGKILLed while it rebuilds a crashed rank on its node, and started again. If the
    survivors had not been sent ``recover`` yet, the attempt fails and its joiner is aborted so that
    launchpad holds the rank as crashed again: the crash is decided afresh and rebuilt in place. If
    they had, the restarted torchpassd sees them re-entered (joined) and finishes the attempt. Either
    way: COMPLETED, bit-identical."""
    job, node, victim = _running(torchpassd, devcluster, tp_config, workdir)
    offset = job.log.stat().st_size
    os.kill(victim["pid"], signal.SIGKILL)
    torchpassd.wait_phase(job.job, ("joiner_ready", "interrupted"), timeout=60)
    torchpassd.stop(signal.SIGKILL)
    torchpassd.start()
    first = torchpassd.wait_migration(job.job, node, timeout=120)
    assert first["status"] == "succeeded" or "torchpassd restarted" in (first["error"] or ""), first
    skip = 0 if first["status"] == "succeeded" else 1
    phases = _assert_rebuilt_in_place(torchpassd, devcluster, workdir, job, node, victim, offset, skip=skip)
    assert "killed by signal SIGKILL" in " ".join(phases["detected"]["evidence"]), phases["detected"]
    print(f"restart outcome: {'finished by the restarted torchpassd' if skip == 0 else 'failed, then rebuilt again'}")
