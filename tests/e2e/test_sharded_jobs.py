"""Sharded jobs as users submit them: ``sbatch --torchpass`` of an unchanged ``srun torchrun`` of
contrib/examples/fsdp_train.py, 2 nodes x 2 ranks, FSDP2 over the whole job, HSDP (shard within a
node, replicate across nodes) or tensor parallel within a node with FSDP across. A drained node's
ranks move to the spare with their DCP state-dict shards in one pause; the job ends COMPLETED 0:0,
every loss and the final parameters are bit-identical to an undisturbed run on the same layout,
and the job's output holds each rank's progress line once. FSDP2 runs in CI; the other layouts
under ``-m matrix`` (make test-matrix)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Daemon, Training, assert_bit_identical, assert_every_line_once, sacct_state
from tests.support.devcluster import DevCluster
from torchpassd.drill import read_log

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "contrib" / "examples" / "fsdp_train.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS, STEP_SLEEP, NODES, NPROC = 100, 0.2, 2, 2


def undisturbed(workdir: Path, mesh: str) -> tuple[list[tuple[int, int, str]], dict[int, str]]:
    """The same training, same layout (NODES torchrun agents of NPROC ranks), no failure."""
    log = workdir / "reference.log"
    log.unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen([TORCHRUN, "--nnodes", str(NODES), "--nproc-per-node", str(NPROC),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                "--rdzv-id", "reference", str(EXAMPLE), "--mesh", mesh, "--steps", str(STEPS),
                                "--log-file", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for _ in range(NODES)]
    for agent in agents:
        _, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, err[-3000:]
    return read_log(log)


@pytest.mark.parametrize("mesh", ["fsdp", pytest.param("hsdp", marks=pytest.mark.matrix),
                                  pytest.param("tp", marks=pytest.mark.matrix)])
def test_aware_drain_of_a_sharded_job_moves_the_nodes_shards_and_ends_completed(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, mesh: str) -> None:
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                   script=EXAMPLE, args=f"--mesh {mesh}")
    view = job.wait_running(torchpassd)
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    moved = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    assert len(moved) == NPROC, view
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["ranks"]) == moved, handed  # the node's every shard, in one pause
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), undisturbed(workdir, mesh))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)


@pytest.mark.criu
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
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5" and mig["mode"] == "planned-transparent", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["plan"]["ranks"]) == moved and len(moved) == NPROC, handed
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), undisturbed(workdir, "fsdp"))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)
