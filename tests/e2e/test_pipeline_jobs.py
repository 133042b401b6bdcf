"""Pipeline-parallel jobs as users submit them: ``sbatch --torchpass`` of an unchanged ``srun
torchrun`` of contrib/examples/pipeline_train.py (``torch.distributed.pipelining`` stages, FSDP2
replicating each stage over its data-parallel ranks), 2 nodes x 2 ranks. A drained node's stage
moves to the spare and the pipeline goes on with the same stage placement; a killed node's stages
are rebuilt from their replicas on the other node; the job ends COMPLETED 0:0 and every stage's
losses and final parameters are bit-identical to an undisturbed run of the same layout. The GPipe
drain runs in CI; the node death, the 1F1B transparent drain, the interleaved schedule's drain, the
requeue fallback of a stage whose copies share a node, and the in-place rebuild of one killed stage
worker from its copy on that node under ``-m matrix``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import (
    Daemon,
    Reference,
    Training,
    assert_bit_identical,
    assert_every_line_once,
    drain_a_worker_node,
    sacct_state,
    torchrun_reference,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "contrib" / "examples" / "pipeline_train.py"
STEPS, STEP_SLEEP, NODES, NPROC = 110, 0.2, 2, 2


def undisturbed(workdir: Path, args: str) -> Reference:
    return torchrun_reference(workdir, EXAMPLE, args, nodes=NODES, nproc=NPROC, steps=STEPS)


def pipeline_job(devcluster: DevCluster, tp_config: Path, workdir: Path, args: str, mode: str = "aware") -> Training:
    return Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                    script=EXAMPLE, args=args, mode=mode)


def assert_completed_like(job: Training, devcluster: DevCluster, workdir: Path, args: str,
                          killed: list[int] | None = None) -> None:
    assert_bit_identical(job.wait_done(), undisturbed(workdir, args), killed=killed or ())
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("interleaved", marks=pytest.mark.matrix)])
def test_aware_drain_moves_a_whole_stage_and_the_pipeline_goes_on(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, schedule: str) -> None:
    """Stage k on node k, its two data-parallel ranks within the node: every rank parks at the same
    step (the stages' send/recv of the step complete), the node's stage (both replicas) moves to the
    spare in one pause, and the pipeline re-forms with the same placement."""
    args = f"--schedule {schedule} --layout across"
    job = pipeline_job(devcluster, tp_config, workdir, args)
    drain_a_worker_node(torchpassd, devcluster, job, job.wait_running(torchpassd), NPROC)
    assert_completed_like(job, devcluster, workdir, args)
    assert_every_line_once(job)


@pytest.mark.faults
@pytest.mark.matrix  # CI: the pipeline drain, the HSDP node death (test_sharded_jobs.py)
def test_node_death_rebuilds_each_stage_from_its_replica_on_the_other_node(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """The stages within each node, data parallel across nodes: each node holds a whole pipeline.
    The killed node's two stages come from the ranks of the same stage on the other node (the
    layout the workers reported), and the step that failed is run again."""
    args = "--schedule gpipe --layout within"
    job = pipeline_job(devcluster, tp_config, workdir, args)
    view = job.wait_running(torchpassd, min_step=5)
    assert wait_until("the job's layout", lambda: (torchpassd.job(job.job) or {}).get("unplanned", "").startswith(
        "unplanned: every rank has a replica"), 30)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    lost = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.kill_node(victim)
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and mig["target"] == "n5", mig
    assert next(p for p in mig["phases"] if p["phase"] == "spare_chosen")["detail"]["ranks"] == lost
    assert_completed_like(job, devcluster, workdir, args, killed=lost)


@pytest.mark.criu
@pytest.mark.matrix
def test_transparent_drain_of_a_1f1b_job_moves_its_worker_processes(
        criu: None, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """No help from the script: criu captures the node's two stage processes, parked at the start
    of their schedule's step, and restores them on the spare."""
    args = "--schedule 1f1b --layout across"
    job = pipeline_job(devcluster, tp_config, workdir, args, mode="transparent")
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    moved = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_moved(job.job, victim)
    assert mig["target"] == "n5" and mig["mode"] == "planned-transparent", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["plan"]["ranks"]) == moved and len(moved) == NPROC, handed
    devcluster.resume(victim)
    assert_completed_like(job, devcluster, workdir, args)
    assert_every_line_once(job)


@pytest.mark.faults
@pytest.mark.matrix  # CI: the requeue fallback of a pure FSDP job (test_sharded_jobs.py)
def test_node_death_of_a_stage_whose_copies_share_the_node_falls_back_to_a_requeue_said_in_advance(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """Stage k on node k: each stage's two copies are on one node. The job's view says while it
    trains that a node death cannot be recovered from replicas; when one dies the job is requeued
    through Slurm with the reason, without waiting for a recovery that cannot be."""
    job = pipeline_job(devcluster, tp_config, workdir, "--schedule gpipe --layout across")
    view = job.wait_running(torchpassd, min_step=5)
    said = "every copy of ranks 0-3 is on their own node: a lost worker is rebuilt, a node death there falls back"
    assert wait_until("the job's layout", lambda: said in (torchpassd.job(job.job) or {}).get("unplanned", ""), 30)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    lost = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.kill_node(victim)
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "failed" and mig["mode"] == "unplanned-aware" and not mig["target"], mig
    assert f"no surviving rank holds a replica of ranks {lost} lost with {victim}" in mig["error"], mig
    assert f"job {job.job} requeued through Slurm" in mig["error"]
    assert wait_until("Slurm to run the job again", lambda: "Restarts=1" in devcluster.run(
        "scontrol", "show", "job", job.job).stdout, 60)
    devcluster.run("scancel", job.job)


@pytest.mark.faults
@pytest.mark.matrix  # CI: the in-place recovery of a DDP job (test_rank_recovery.py)
def test_a_stage_worker_killed_on_a_healthy_node_is_rebuilt_in_place_from_its_copy_on_that_node(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """kill -9 of one rank of stage 1 (stage k on node k): its copy on the same node donates, the
    rank restarts on its own node, the pipeline's stages initialise again together, and the job
    ends COMPLETED 0:0, bit-identical."""
    args = "--schedule gpipe --layout across"
    job = pipeline_job(devcluster, tp_config, workdir, args)
    view = job.wait_running(torchpassd, min_step=5)
    assert wait_until("the job's layout", lambda: "every rank has a replica" in (
        torchpassd.job(job.job) or {}).get("unplanned", ""), 30)
    node = next(n for n in view["nodes"] if n != view["batch_host"])
    victim = max(view["launchpads"][node]["workers"], key=lambda w: w["rank"])
    os.kill(victim["pid"], signal.SIGKILL)
    mig = torchpassd.wait_migration(job.job, node, timeout=180)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and not mig["target"], mig
    phases = {p["phase"]: p.get("detail", {}) for p in mig["phases"]}
    assert phases["joiner_ready"]["in_place"] is True and phases["joiner_ready"]["ranks"] == [victim["rank"]], phases
    assert_completed_like(job, devcluster, workdir, args, killed=[victim["rank"]])
