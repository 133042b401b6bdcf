"""Sharded jobs as users submit them: ``sbatch --torchpass`` of an unchanged ``srun torchrun`` of
contrib/examples/fsdp_train.py, 2 nodes x 2 ranks, FSDP2 over the whole job, HSDP (shard within a
node, replicate across nodes) or tensor parallel within a node with FSDP across. A drained node's
ranks move to the spare with their DCP state-dict shards in one pause; the job ends COMPLETED 0:0,
every loss and the final parameters are bit-identical to an undisturbed run on the same layout
(with a process group the script makes after the move, used every step from then on), and the
job's output holds each rank's progress line once. FSDP2 runs in CI; the other layouts
under ``-m matrix`` (make test-matrix). A node death: HSDP is rebuilt from the other replica
group; pure FSDP (no replica) falls back to a requeue, said in ``torchpassctl jobs`` beforehand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
EXAMPLE = ROOT / "contrib" / "examples" / "fsdp_train.py"
STEPS, STEP_SLEEP, NODES, NPROC = 100, 0.2, 2, 2
LATE_GROUP_AT = 60  # the drain tests' jobs make a new process group at this step


def undisturbed(workdir: Path, mesh: str, extra: str = "") -> Reference:
    """The same training, same layout (NODES torchrun agents of NPROC ranks), no failure."""
    return torchrun_reference(workdir, EXAMPLE, f"--mesh {mesh} {extra}", nodes=NODES, nproc=NPROC, steps=STEPS)


@pytest.mark.parametrize("mesh", ["fsdp", pytest.param("hsdp", marks=pytest.mark.matrix),
                                  pytest.param("tp", marks=pytest.mark.matrix)])
def test_aware_drain_of_a_sharded_job_moves_the_nodes_shards_and_ends_completed(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, mesh: str) -> None:
    # from step 60 on, the loss is also averaged over a group the script makes then: after the move
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   script=EXAMPLE, args=f"--mesh {mesh} --new-group-at {LATE_GROUP_AT}")
    mig = drain_a_worker_node(torchpassd, devcluster, job, job.wait_running(torchpassd), NPROC)
    assert next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"] < LATE_GROUP_AT
    assert_bit_identical(job.wait_done(), undisturbed(workdir, mesh, f"--new-group-at {LATE_GROUP_AT}"))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)


@pytest.mark.criu
@pytest.mark.matrix  # CI: the transparent drain of a two-rank node (test_real_jobs.py)
def test_transparent_drain_of_an_fsdp2_job_moves_its_worker_processes_and_ends_completed(
        criu: None, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """No help from the script: CRIU captures the node's two FSDP2 worker processes (their gloo
    communicators re-formed around the dump) and restores them on the spare."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   script=EXAMPLE, args="--mesh fsdp", mode="transparent")
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    moved = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_moved(job.job, victim)
    assert mig["target"] == "n5" and mig["mode"] == "planned-transparent", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["plan"]["ranks"]) == moved and len(moved) == NPROC, handed
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), undisturbed(workdir, "fsdp"))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)


def hsdp_training(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, spares: int = 0
                  ) -> tuple[Training, dict]:
    """An HSDP job training (with ``spares`` hot spares), once torchpassd knows every rank has a
    replica; and its view."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   script=EXAMPLE, args="--mesh hsdp", spares=spares)
    view = job.wait_running(torchpassd, min_step=5)
    assert wait_until("the job's layout", lambda: (torchpassd.job(job.job) or {}).get("unplanned", "").startswith(
        "unplanned: every rank has a replica"), 30)
    return job, view


@pytest.mark.faults
def test_hsdp_node_death_rebuilds_its_ranks_from_the_other_replica_group(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """HSDP keeps a whole replica on each node: the dead node's shards come from the ranks at the
    same shard position on the other node (the layout the workers reported), bit-identically."""
    job, view = hsdp_training(torchpassd, devcluster, tp_config, workdir)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    lost = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.kill_node(victim)
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and mig["target"] == "n5", mig
    chosen = next(p for p in mig["phases"] if p["phase"] == "spare_chosen")
    assert chosen["detail"]["ranks"] == lost, chosen
    assert_bit_identical(job.wait_done(), undisturbed(workdir, "hsdp"), killed=lost)
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


@pytest.mark.faults
@pytest.mark.matrix  # CI: a DDP job's node rebuilt on its hot spare (test_unplanned_migration.py)
def test_hsdp_node_death_rebuilds_its_ranks_on_the_jobs_hot_spare(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """``sbatch -N3 --torchpass-spares=1`` of the same HSDP job: the dead node's two shards are
    rebuilt on the job's own hot spare (no spare from the pool, no resize) from the other replica
    group; the job ends COMPLETED 0:0, bit-identical, on the nodes it was given."""
    job, view = hsdp_training(torchpassd, devcluster, tp_config, workdir, spares=1)
    (hot,) = [n for n, lp in view["launchpads"].items() if not lp["workers"]]
    victim = next(n for n in view["nodes"] if n not in (view["batch_host"], hot))
    lost = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    devcluster.kill_node(victim)
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and mig["target"] == hot, mig
    chosen = next(p for p in mig["phases"] if p["phase"] == "spare_chosen")
    assert chosen["detail"]["ranks"] == lost and chosen["detail"]["hot"] is True, chosen
    assert set(torchpassd.job(job.job)["nodes"]) <= set(view["nodes"])  # no spare from the pool
    assert_bit_identical(job.wait_done(), undisturbed(workdir, "hsdp"), killed=lost)
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


@pytest.mark.faults
@pytest.mark.matrix  # CI: the in-place recovery of a DDP job (test_rank_recovery.py)
def test_an_hsdp_worker_killed_on_a_healthy_node_is_rebuilt_in_place_from_its_replica(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """kill -9 of one HSDP rank (an OOM kill, a segfault): no spare, no resize; its shard comes from
    the rank at the same shard position in the other replica group, it restarts on its own node,
    and the job ends COMPLETED 0:0, bit-identical."""
    job, view = hsdp_training(torchpassd, devcluster, tp_config, workdir)
    node = next(n for n in view["nodes"] if n != view["batch_host"])
    victim = max(view["launchpads"][node]["workers"], key=lambda w: w["rank"])
    os.kill(victim["pid"], signal.SIGKILL)
    mig = torchpassd.wait_migration(job.job, node, timeout=180)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and not mig["target"], mig
    phases = {p["phase"]: p.get("detail", {}) for p in mig["phases"]}
    assert phases["joiner_ready"]["in_place"] is True and phases["joiner_ready"]["ranks"] == [victim["rank"]], phases
    assert sorted(torchpassd.job(job.job)["nodes"]) == sorted(view["nodes"])  # the same nodes
    assert_bit_identical(job.wait_done(), undisturbed(workdir, "hsdp"), killed=[victim["rank"]])
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


@pytest.mark.faults
def test_pure_fsdp_node_death_falls_back_to_a_requeue_said_in_advance_and_recorded(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """No rank holds another's shard: `torchpassctl jobs` says so while the job trains, and when a
    node dies torchpassd requeues the job through Slurm (it restarts from its last checkpoint) with
    a history record saying why; it never waits for a recovery that cannot be."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   script=EXAMPLE, args="--mesh fsdp")
    view = job.wait_running(torchpassd, min_step=5)
    said = "unplanned: no replica of ranks 0-3, falls back to requeue"
    wait_until("the job's layout", lambda: (torchpassd.job(job.job) or {}).get("unplanned", "").startswith(said), 30)
    res = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config), "jobs",
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    row = next(j for j in json.loads(res.stdout)["jobs"] if str(j["job"]) == job.job)
    assert row["unplanned"].startswith(said), row
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    devcluster.kill_node(victim)
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "failed" and mig["mode"] == "unplanned-aware" and not mig["target"], mig
    assert f"no surviving rank holds a replica of ranks [2, 3] lost with {victim}" in mig["error"], mig
    assert f"job {job.job} requeued through Slurm" in mig["error"] and mig["phases"][-1]["detail"]["fallback"] == "requeue"
    wait_until("Slurm to run the job again", lambda: "Restarts=1" in devcluster.run(
        "scontrol", "show", "job", job.job).stdout, 60)
    devcluster.run("scancel", job.job)
