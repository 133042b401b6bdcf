"""One Slurm task a rank, as Lightning's SLURMEnvironment, submitit and NeMo-Run launch:
``#SBATCH --ntasks-per-node=2`` and ``srun python slurm_tasks.py ddp_train.py``, ranks from SLURM_PROCID,
SLURM_LOCALID and SLURM_NTASKS, no torchrun and nothing but ``--torchpass`` added. Each node's tasks
are supervised by one launchpad; a drained node's ranks move and a killed node's are rebuilt on the
spare with the SLURM_* a task there would have (a script without TorchPass code is moved by criu);
the job ends COMPLETED 0:0, bit-identical to an undisturbed run of the same training, and each
task's output is what it is without TorchPass. FSDP2 too; and ``torchpassctl drill --launcher
srun-python`` in every drill mode."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import (
    SRUN_PYTHON,
    Daemon,
    Training,
    assert_bit_identical,
    assert_every_line_once,
    drain_a_worker_node,
    install_site_config,
    reference_log,
    sacct_state,
)
from torchpassd.drill import EXAMPLE, MODES
from torchpassd.drill_report import DrillReport, read_log
from torchpassd.drill_transparent import SCRIPT as TUTORIAL
from torchpassd.drill_transparent import SCRIPT_ARGS as TUTORIAL_ARGS
from torchpassd.drill_unplanned import judge

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

SCRIPT = EXAMPLE.parent / "slurm_tasks.py"  # runs the script it is given as SLURMEnvironment would
FSDP = EXAMPLE.parents[2] / "contrib" / "examples" / "fsdp_train.py"
STEPS, STEP_SLEEP = 150, 0.2
NODES, NPROC = 3, 2


def _training(devcluster: DevCluster, tp_config: Path, workdir: Path, mode: str = "aware") -> Training:
    """The DDP example, or under transparent mode the DDP tutorial, which has no TorchPass code (with
    2 DataLoader worker processes a rank)."""
    return Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES, nproc=NPROC,
                    script=SCRIPT, args=" ".join(_script(mode)), mode=mode, launcher=SRUN_PYTHON)


def _script(mode: str) -> tuple[str, ...]:
    return (str(TUTORIAL), *TUTORIAL_ARGS) if mode == "transparent" else (str(EXAMPLE),)


def _reference(workdir: Path, mode: str = "aware") -> Path:
    script, *args = _script(mode)
    return reference_log(workdir, NODES * NPROC, STEPS, Path(script), args=" ".join(args))


def _victim(view: dict) -> tuple[str, list[int]]:
    victim = next(n for n in view["nodes"] if n != view["batch_host"])
    ranks = sorted(w["rank"] for w in view["launchpads"][victim]["workers"])
    assert len(view["launchpads"]) == NODES and len(ranks) == NPROC, view  # one launchpad a node runs its tasks
    return victim, ranks


def _finished(devcluster: DevCluster, job: Training) -> None:
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert_every_line_once(job)


@pytest.mark.parametrize("mode", ["aware", pytest.param("transparent", marks=pytest.mark.matrix)])
def test_a_drained_node_of_a_srun_python_job_moves_its_tasks_ranks(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, mode: str) -> None:
    job = _training(devcluster, tp_config, workdir, mode)
    victim, ranks = _victim(job.wait_running(torchpassd))
    devcluster.drain(victim, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, victim)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    moved = torchpassd.job(job.job)["launchpads"]["n5"]["workers"]
    assert sorted(w["rank"] for w in moved) == ranks, moved
    devcluster.resume(victim)
    assert_bit_identical(job.wait_done(), read_log(_reference(workdir, mode)))
    _finished(devcluster, job)


@pytest.mark.faults
@pytest.mark.matrix  # CI: a srun python rank's joiner (drained above); a killed node's recovery (test_unplanned_migration.py)
def test_a_killed_node_of_a_srun_python_job_is_rebuilt_from_a_replica(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    job = _training(devcluster, tp_config, workdir)
    victim, ranks = _victim(job.wait_running(torchpassd, min_step=5))
    devcluster.kill_node(victim)
    offset = job.log.stat().st_size
    mig = torchpassd.wait_migration(job.job, victim, timeout=180)
    assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and mig["target"] == "n5", mig
    resumed = next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]
    job.wait_done()
    rep = DrillReport()  # the failed step is replayed by every rank: its lines repeat, with the same losses
    judge(job.log, _reference(workdir), ranks[0], resumed, offset, rep)
    assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


TORCH_WARNING_TIME = re.compile(r"^\[([WEI])\d{4} [\d:.]+ ")  # torch's C++ warnings: their time differs


def _task_lines(out: str, ours: list[str]) -> dict[int, list[str]]:
    """Each task's lines of a ``srun -l`` output, in order (``3: text`` is task 3's); TorchPass's own
    lines (``torchpass: ...``) go to ``ours``."""
    lines: dict[int, list[str]] = defaultdict(list)
    for line in out.splitlines():
        m = re.match(r"^\s*(\d+): (.*)$", line)
        assert m, f"a line srun did not label: {line!r}"
        if m.group(2).startswith("torchpass: "):
            ours.append(m.group(2))
        else:
            lines[int(m.group(1))].append(TORCH_WARNING_TIME.sub(r"[\1 ", m.group(2)))
    return dict(lines)


def test_each_tasks_output_is_what_it_is_without_torchpass(torchpassd: Daemon, devcluster: DevCluster,
                                                           tp_config: Path, workdir: Path) -> None:
    """The same ``srun -l python`` job with and without ``--torchpass``: every task prints the same
    lines in the same order, on the same stream, labelled by srun as the same task, and ends 0:0."""
    install_site_config(devcluster, tp_config)
    client_conf = [ln.split('"')[1] for ln in tp_config.read_text().splitlines() if ln.startswith("slurm_conf")][0]
    outs, ours = {}, {}
    for flag in ("--torchpass", ""):
        (workdir / "tasks.sh").write_text(
            f"#!/bin/bash\n#SBATCH --ntasks-per-node={NPROC}\n"
            f"srun -l {sys.executable} {SCRIPT} {EXAMPLE} --steps 20 "
            f"--log {workdir}/tasks{flag}.log\n"
            f"srun -l -n{NODES} --ntasks-per-node=1 sh -c 'echo $SLURM_NODEID done' 1>&2\n")
        res = subprocess.run(["sbatch", "--parsable", "--wait", *([flag] if flag else []), f"-N{NODES}",
                              "-o", f"{workdir}/out{flag}.txt", "-e", f"{workdir}/err{flag}.txt",
                              str(workdir / "tasks.sh")], capture_output=True, text=True, cwd=workdir, timeout=300,
                             env=dict(devcluster.env, SLURM_CONF=client_conf))
        assert res.returncode == 0, res.stderr
        job = res.stdout.strip().split(";")[0]
        assert sacct_state(devcluster, job) == "COMPLETED 0:0"
        ours[flag] = []
        outs[flag] = (_task_lines((workdir / f"out{flag}.txt").read_text(), ours[flag]),
                      _task_lines((workdir / f"err{flag}.txt").read_text(), ours[flag]))
    protected, plain = outs["--torchpass"], outs[""]
    assert not ours[""] and len(ours["--torchpass"]) == 1, ours  # the one line saying how the job is protected
    assert "is protected by aware migration" in ours["--torchpass"][0]
    assert sorted(plain[0]) == list(range(NODES * NPROC)), plain[0]
    assert all(len(lines) == 20 for lines in plain[0].values()), plain[0]
    assert protected == plain


@pytest.mark.matrix  # CI: FSDP2 under torchrun (test_sharded_jobs.py) and DDP under srun python, above
def test_a_drained_node_of_a_srun_python_fsdp2_job_moves_its_shards(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path) -> None:
    """FSDP2 over 2 nodes x 2 tasks under ``srun python``: the drained node's two shards move in one
    pause; COMPLETED 0:0, bit-identical to the same training under torchrun."""
    from tests.e2e.test_sharded_jobs import undisturbed  # the torchrun reference of the same layout

    job = Training(devcluster, tp_config, workdir, steps=100, step_sleep=STEP_SLEEP, nodes=2, nproc=2,
                   script=SCRIPT, args=f"{FSDP} --mesh fsdp", launcher=SRUN_PYTHON)
    drain_a_worker_node(torchpassd, devcluster, job, job.wait_running(torchpassd), 2)
    assert_bit_identical(job.wait_done(), undisturbed(workdir, "fsdp"))
    _finished(devcluster, job)


@pytest.mark.matrix  # CI: the same moves of srun python jobs, above
@pytest.mark.parametrize("mode", MODES)
def test_drill_with_the_srun_python_launcher_passes(torchpassd: Daemon, tp_config: Path, mode: str) -> None:
    res = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config), "drill",
                          "--mode", mode, "--launcher", "srun-python", "--json", "--steps", "150", "--nodes", "3",
                          "--nproc-per-node", "2", "--step-sleep", str(STEP_SLEEP)],
                         capture_output=True, text=True, timeout=900)
    report = json.loads(res.stdout)
    assert res.returncode == 0, report
    assert report["ok"] and report["bit_identical"] and report["lost_steps"] == 0, report
    assert report["job_state"] == "COMPLETED" and report["moved_ranks"], report
    assert report["mode"] == mode, report
