"""A migration that fails costs the job one pause, never a hang: a transparent move whose criu
restore fails on the spare (the site config's [faults] criu = "restore") is rolled back, every rank
trains again within seconds (the dumped worker's process tree resumes whole: for its DataLoader
workers see tests/integration/test_criu_tree_resume.py), the move is not retried (criu would refuse
the same process again: one rolled-back try, no retry storm), the job's output says it was given
up, and the job ends COMPLETED, bit-identical. The same for a script that registered save/load: it
is never left interrupted. (Not with DataLoader workers here: the dev cluster's nodes share one
/tmp, and criu's restore on the spare unlinks, before it binds them again, the unix socket paths
that multiprocessing's resource sharer listens on, the original's too; real nodes have their own.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from criu_hooks import runner
from tests.support.devcluster import FINAL_JOB_STATES, DevCluster
from tests.support.e2e import Daemon, Training, assert_bit_identical, sacct_state, wait_until
from torchpassd.drill import EXAMPLE
from torchpassd.drill_transparent import SCRIPT as TUTORIAL

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.criu, pytest.mark.faults, pytest.mark.slow,
              pytest.mark.timeout(600)]

STEPS, STEP_SLEEP = 120, 0.2
BACK_WITHIN_S = 10.0


@pytest.mark.parametrize("script", [TUTORIAL, pytest.param(EXAMPLE, marks=pytest.mark.matrix)],
                         ids=["unregistered", "registered"])
def test_a_failed_restore_costs_one_pause_and_is_not_retried(
        criu: None, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, reference,  # noqa: ANN001
        script: Path) -> None:
    site = workdir / "faulty.toml"  # the operator's fault injection: every criu restore fails
    site.write_text(tp_config.read_text() + '[faults]\ncriu = "restore"\n')
    job = Training(devcluster, site, workdir, steps=STEPS, step_sleep=STEP_SLEEP, script=script, mode="transparent")
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim, timeout=240)
    assert mig["status"] == "rolled_back" and "criu restore failed" in mig["error"], mig
    at = {w["rank"]: w["step"] for lp in torchpassd.job(job.job)["launchpads"].values() for w in lp["workers"]}

    def every_rank_stepped() -> bool:
        now = {w["rank"]: w["step"] for lp in torchpassd.job(job.job)["launchpads"].values() for w in lp["workers"]}
        return len(now) == len(at) and all(now[r] > at[r] for r in at)
    wait_until(f"every rank of job {job.job} to train again after the roll-back", every_rank_stepped, BACK_WITHIN_S)
    assert_bit_identical(job.wait_done(), reference(STEPS, script))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    tries = [m for m in torchpassd.migrations(job.job) if m["source"] == victim]
    assert len(tries) == 1, [(m["status"], m["error"]) for m in tries]  # no retry storm
    out = job.out.read_text()
    assert f"torchpass: gave up moving job {job.job}'s ranks off {victim}: criu could not restore" in out, out[-2000:]
    devcluster.resume(victim)


def test_ranks_interrupted_with_nobody_lost_are_not_left_waiting(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """One rank's DataLoader workers stop (as a dumped tree left stopped did) longer than gloo's
    timeout: its peers' collective fails, then its own, while every node lives, so no death is
    decided and no recovery comes. torchpassd re-forms the job in place once they waited out the
    failure detector's grace; this script registered no save/load, so the job ends, saying why,
    instead of hanging (under plain torchrun the timeout would end it too)."""
    job = Training(devcluster, tp_config, workdir, steps=400, step_sleep=STEP_SLEEP, nodes=3, script=TUTORIAL,
                   args="--num-workers 2", mode="transparent")
    view = job.wait_running(torchpassd)
    node = next(n for n in view["nodes"] if n != view["batch_host"])
    pid = view["launchpads"][node]["workers"][0]["pid"]
    loaders = wait_until(f"rank on {node} to run its DataLoader workers", lambda: runner.tree(pid)[1:], 30)
    for child in loaders:
        os.kill(child, signal.SIGSTOP)

    def interrupted() -> bool:
        return any(w["state"] == "interrupted" for lp in torchpassd.job(job.job)["launchpads"].values()
                   for w in lp["workers"])
    wait_until("the peers' collective to time out", interrupted, 60)
    for child in loaders:
        os.kill(child, signal.SIGCONT)
    released = time.monotonic()
    state = devcluster.wait_job_state(job.job, tuple(FINAL_JOB_STATES), timeout=120)
    assert time.monotonic() - released < 90, "the job hung"
    assert state != "COMPLETED"  # it could not be recovered: it ended, as a gloo timeout ends it under torchrun
    (tried,) = [m for m in torchpassd.migrations(job.job) if m["mode"] == "reroute"]
    assert tried["status"] == "failed" and "never called torchpass.register" in tried["error"], tried
    out = job.out.read_text()
    said = [ln for ln in out.splitlines() if ln.startswith(f"torchpass: job {job.job} cannot be recovered")]
    assert len(said) == 1 and "never called torchpass.register(save, load)" in said[0], out[-3000:]


@pytest.mark.matrix
def test_registered_ranks_interrupted_with_nobody_lost_resume_bit_identical(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, reference) -> None:  # noqa: ANN001
    """The same with a script that registered save/load (under --torchpass=transparent, whose workers
    no watchdog kills): one worker is stopped past gloo's timeout, then goes on; every rank is
    interrupted, nobody is lost, and the in-place re-form resumes them at the step that failed."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, script=EXAMPLE,
                   mode="transparent")
    view = job.wait_running(torchpassd)
    node = next(n for n in view["nodes"] if n != view["batch_host"])
    pid = view["launchpads"][node]["workers"][0]["pid"]
    os.kill(pid, signal.SIGSTOP)

    def interrupted() -> bool:
        return any(w["state"] == "interrupted" for lp in torchpassd.job(job.job)["launchpads"].values()
                   for w in lp["workers"])
    try:
        wait_until("the peers' collective to time out", interrupted, 60)
    finally:
        os.kill(pid, signal.SIGCONT)
    steps, finals = job.wait_done()
    seen: dict[tuple[int, int], str] = {}
    replayed = set()
    for rank, step, loss in steps:  # training resumed at the step that failed: it is logged again
        if (rank, step) in seen:
            assert seen[(rank, step)] == loss, f"rank {rank} step {step} replayed with another loss"
            replayed.add(step)
        seen[(rank, step)] = loss
    assert len(replayed) <= 1, f"steps replayed: {sorted(replayed)}"  # only the one that failed
    assert_bit_identical(([(r, s, loss) for (r, s), loss in seen.items()], finals), reference(STEPS, EXAMPLE))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    (rec,) = [m for m in torchpassd.migrations(job.job) if m["mode"] == "reroute"]
    assert rec["status"] == "succeeded" and "left interrupted" in rec["reason"], rec
