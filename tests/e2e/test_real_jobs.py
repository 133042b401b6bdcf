"""Jobs as users submit them: ``sbatch --torchpass`` of a script whose only TorchPass-related part
is the flag, an unchanged ``srun torchrun`` with several ranks a node. After a migration the job
ends COMPLETED 0:0 (so ``--dependency=afterok`` chains go on), every rank of the node moved, the
parameters are bit-identical to an undisturbed run, and the job's output holds each rank's
progress lines exactly once (after a node died, the step that failed is replayed and may print twice)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import (
    PROGRESS,
    TIMEOUTS,
    Daemon,
    Reference,
    Training,
    assert_bit_identical,
    assert_every_line_once,
    reference_log,
    sacct_state,
)
from torchpassd.drill import EXAMPLE
from torchpassd.drill_report import DrillReport, read_log
from torchpassd.drill_transparent import SCRIPT as TUTORIAL
from torchpassd.drill_unplanned import judge

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

STEPS, STEP_SLEEP = 150, 0.2
NODES, NPROC = 3, 2


def undisturbed(workdir: Path, world: int, script: Path = EXAMPLE) -> Reference:
    """The same training on ``world`` ranks without any failure (launchpad on this machine)."""
    return read_log(reference_log(workdir, world, STEPS, script))


@pytest.mark.criu
@pytest.mark.parametrize("batch_host", [False, pytest.param(True, marks=pytest.mark.matrix)],
                         ids=["other-node", "batch-host"])
def test_transparent_drain_of_a_two_rank_node_ends_completed_and_the_moved_ranks_keep_printing(
        criu: None, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, batch_host: bool) -> None:
    """criu moves the node's two worker processes to the spare, each with its 2 DataLoader worker
    processes. The batch host's too: Slurm keeps it in the job (it cannot release it), running no
    ranks, its launchpad keeping the rendezvous store."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   script=TUTORIAL, args="--num-workers 2", mode="transparent")
    view = job.wait_running(torchpassd)
    victim = view["batch_host"] if batch_host else next(n for n in view["nodes"] if n != view["batch_host"])
    moved = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_moved(job.job, victim)
    assert mig["target"] == "n5", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["plan"]["ranks"]) == moved and len(moved) == NPROC, handed
    assert next(p for p in mig["phases"] if p["phase"] == "released")["detail"]["kept_in_job"] is batch_host
    if not batch_host:
        devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), undisturbed(workdir, NODES * NPROC, TUTORIAL))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)


def test_aware_drain_of_a_two_rank_node_ends_completed_with_every_line_once(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC)
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    moved = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    assert len(moved) == NPROC, view
    # a second job that runs only if the first one succeeds, as users chain them
    after = devcluster.run("sbatch", "--parsable", f"--dependency=afterok:{job.job}", "-N1", "-o",
                           str(workdir / "after-%j.out"), "--wrap", "echo chained").stdout.strip().split(";")[0]
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["ranks"]) == moved, handed  # every rank of the node moved, in one pause
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), undisturbed(workdir, NODES * NPROC))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)
    devcluster.wait_job_state(after, ("COMPLETED",), timeout=120)  # afterok: the chained job ran
    assert (workdir / f"after-{after}.out").read_text().strip() == "chained"


def test_the_moved_ranks_output_keeps_the_jobs_torchrun_output_options(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """``srun torchrun --local-ranks-filter 0``: only each node's local rank 0 reaches the job's
    output; the spare's launchpad, started for the moved ranks, applies the same filter."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   torchrun_args="--local-ranks-filter 0")
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    devcluster.resume(victim)
    job.wait_done()
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    lines = Counter((int(r), int(s)) for r, s in PROGRESS.findall(job.out.read_text()))
    assert set(lines) == {(r, s) for r in range(0, job.world, NPROC) for s in range(STEPS)}, sorted(
        set(lines) ^ {(r, s) for r in range(0, job.world, NPROC) for s in range(STEPS)})[:10]
    assert max(lines.values()) == 1


@pytest.mark.faults
def test_unplanned_kill_of_a_two_rank_node_rebuilds_both_ranks_and_ends_completed(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC)
    view = job.wait_running(torchpassd, min_step=5)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    lost = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.kill_node(victim)
    offset = job.log.stat().st_size
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "succeeded" and mig["target"] == "n5" and mig["mode"] == "unplanned-aware", mig
    chosen = next(p for p in mig["phases"] if p["phase"] == "spare_chosen")
    assert chosen["detail"]["ranks"] == lost and len(lost) == NPROC, chosen  # every rank of the node, one spare
    failed_step = next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]
    interrupted = next(p for p in mig["phases"] if p["phase"] == "interrupted")["detail"]
    # active abort: survivors wherever they sat in the ring reached their checkpoint long before the timeout
    assert interrupted["interrupted_after_s"] < TIMEOUTS["collective"] / 2, interrupted
    job.wait_done(timeout=240)  # the dead node stays dead (DOWN): the job must end without it
    ref = reference_log(workdir, NODES * NPROC, STEPS)
    for rank in lost:  # each rebuilt rank resumed at the failed step, every loss and hash as undisturbed
        rep = DrillReport()
        judge(job.log, ref, rank, failed_step, offset, rep)
        assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep
        assert rep.resumed_at_step == failed_step, rep
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    lines = Counter((int(r), int(s)) for r, s in PROGRESS.findall(job.out.read_text()))
    missing = {(r, s) for r in range(job.world) for s in range(STEPS)} - set(lines)
    # Only what the dead ranks printed in the last instant before their node died, still in its pipes,
    # may be gone with it (as under torchrun); every line from the rebuilt ranks on is there.
    assert all(r in lost and failed_step - 2 <= s < failed_step for r, s in missing), sorted(missing)
