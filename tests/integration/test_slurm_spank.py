"""The SPANK plugin and cli_filter on the real dev cluster: `--torchpass` is offered and accepted,
the job gets its mode and --no-kill, `srun torchrun` (or torchrun by another name: `python -m
torch.distributed.run`, its full path) runs launchpad only in TorchPass jobs, and a
TorchPass job survives one of its nodes going down."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from slurm_plugin.backends.commands import CommandClient
from slurm_plugin.model import TorchPassFlags
from slurm_plugin.runner import SlurmRunner
from tests.support.devcluster import DevCluster

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SHIM = str(ROOT / "spank" / "shim")


@pytest.fixture(scope="session")
def torchpass_conf(devcluster: DevCluster) -> str:
    """The cluster's slurm.conf, which enables spank/cli_filter.lua as a site installs it
    (cli_filter runs in sbatch/salloc/srun, so only the clients need it). Builds the plugin."""
    subprocess.run(["make", "-s", "-C", str(ROOT / "spank")], check=True, timeout=120)
    conf = Path(devcluster.slurm_conf)
    assert "CliFilterPlugins=cli_filter/lua" in conf.read_text(), f"{conf} does not enable the cli_filter"
    return str(conf)


def submit(cluster: DevCluster, conf: str, script: str, *args: str, user: str = "") -> tuple[str, Path]:
    """sbatch ``script`` with client config ``conf`` (as ``user``, default us); returns the job id
    and its output file."""
    name = uuid.uuid4().hex[:8]
    path = cluster.jobs_dir / f"tp-{name}.sh"
    path.write_text("#!/bin/bash\n" + script)
    out = cluster.jobs_dir / f"tp-{name}.out"
    env = dict(cluster.slurm_env, SLURM_CONF=conf, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}")
    as_user = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={conf}"] if user else []
    res = subprocess.run([*as_user, "sbatch", "--parsable", "-o", str(out), *args, str(path)], capture_output=True,
                         text=True, env=env, cwd=cluster.jobs_dir, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip(), out


def test_help_lists_the_options(devcluster: DevCluster) -> None:
    for command in ("sbatch", "salloc", "srun"):
        text = devcluster.run(command, "--help").stdout
        assert "--torchpass=[aware|transparent|auto]" in text, command
        assert "--torchpass-spares=N" in text, command


def test_bad_mode_is_refused_at_submission(devcluster: DevCluster) -> None:
    res = devcluster.run("sbatch", "--torchpass=fast", "--wrap", "true", check=False)
    assert res.returncode != 0
    assert "mode must be aware, transparent or auto" in res.stderr


def test_torchpass_job_gets_mode_no_kill_marker_and_shim(devcluster: DevCluster, torchpass_conf: str) -> None:
    devcluster.reset()
    job, out = submit(devcluster, torchpass_conf, """
echo "batch TORCHPASS=$TORCHPASS SPARES=$TORCHPASS_SPARES NO_KILL=$SLURM_NO_KILL"
srun -N2 bash -c 'echo "step $(hostname) TORCHPASS=$TORCHPASS shims=$(echo "$PATH" | tr : "\\n" | grep -c "^{shim}$") torchrun=$(command -v torchrun) config=$TORCHPASS_CONFIG"'
""".replace("{shim}", SHIM), "--torchpass=aware", "--torchpass-spares=1", "-N2", "--comment", "nightly")
    devcluster.wait_job_state(job, "COMPLETED", timeout=60)
    text = out.read_text()
    assert "batch TORCHPASS=aware SPARES=1 NO_KILL=set" in text
    steps = sorted(line for line in text.splitlines() if line.startswith("step "))
    site = devcluster.info["torchpass_config"]  # plugstack.conf's config=: the job script sets nothing
    assert steps == [f"step {n} TORCHPASS=aware shims=1 torchrun={SHIM}/torchrun config={site}" for n in ("n1", "n2")]
    seen = CommandClient(SlurmRunner(devcluster.slurm_conf)).job(int(job))
    assert seen is not None and seen.comment == "torchpass:mode=aware,spares=1 nightly"
    assert seen.torchpass == TorchPassFlags(mode="aware", spares=1)


def test_srun_torchrun_runs_launchpad_only_under_torchpass(devcluster: DevCluster, torchpass_conf: str) -> None:
    devcluster.reset()
    script = "srun -N1 torchrun --help 2>&1 | head -3\n"
    with_flag, out_with = submit(devcluster, torchpass_conf, script, "--torchpass", "-N1")
    without, out_without = submit(devcluster, torchpass_conf, script, "-N1")
    devcluster.wait_job_state(with_flag, "COMPLETED", timeout=90)
    devcluster.wait_job_state(without, "COMPLETED", timeout=90)
    assert "Usage: launchpad" in out_with.read_text()
    plain = out_without.read_text()
    assert "usage: torchrun" in plain and "launchpad" not in plain


def test_torchrun_by_another_name_runs_launchpad_only_under_torchpass(devcluster: DevCluster,
                                                                      torchpass_conf: str) -> None:
    """``python -m torch.distributed.run`` and a torchrun given by its full path are torchrun too; the
    start-up hook that makes them so leaves other Python alone and runs the user's own sitecustomize."""
    devcluster.reset()
    mine = devcluster.jobs_dir / f"site-{uuid.uuid4().hex[:8]}"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("print('the user sitecustomize ran')\n")
    venv = ROOT / ".venv" / "bin"
    script = (f"srun -N1 {venv}/python -m torch.distributed.run --help 2>&1 | head -3\n"
              f"srun -N1 {venv}/torchrun --help 2>&1 | head -3\n"
              f"PYTHONPATH={mine} srun -N1 {venv}/python -c 'print(\"plain python\")'\n"
              f"srun -N1 {venv}/python -c 'print(\"no sitecustomize of its own\")'\n")
    with_flag, out_with = submit(devcluster, torchpass_conf, script, "--torchpass", "-N1")
    without, out_without = submit(devcluster, torchpass_conf, script, "-N1")
    devcluster.wait_job_state(with_flag, "COMPLETED", timeout=90)
    devcluster.wait_job_state(without, "COMPLETED", timeout=90)
    text = out_with.read_text()
    assert text.count("Usage: launchpad") == 2, text
    assert "the user sitecustomize ran\nplain python" in text, text
    assert "no sitecustomize of its own" in text and "Error in sitecustomize" not in text, text
    plain = out_without.read_text()
    assert plain.count("usage: ") == 2 and "launchpad" not in plain, plain  # torch's own (run.py, torchrun)
    assert "the user sitecustomize ran\nplain python" in plain, plain


def test_a_srun_python_step_that_cannot_be_supervised_runs_as_it_is_and_says_why_once(
        devcluster: DevCluster, torchpass_conf: str, tmp_path: Path) -> None:
    """``srun python`` one task a rank whose tasks are numbered cyclically over the nodes (a node's
    ranks are not consecutive) cannot get one launchpad a node: every task runs the script itself,
    untouched, and the step's first task says why, once; ``python -c`` and a job without --torchpass
    say nothing."""
    devcluster.reset()
    venv = ROOT / ".venv" / "bin"
    task = tmp_path / "task.py"
    task.write_text("print('task')\n")
    script = (f"srun -O -N2 --ntasks-per-node=2 -m cyclic {venv}/python {task}\n"  # -O: 1 CPU a node
              f"srun -O -N2 --ntasks-per-node=2 {venv}/python -c 'print(\"code\")'\n")
    with_flag, out_with = submit(devcluster, torchpass_conf, script, "--torchpass", "-N2")
    without, out_without = submit(devcluster, torchpass_conf, script, "-N2")
    devcluster.wait_job_state(with_flag, "COMPLETED", timeout=90)
    devcluster.wait_job_state(without, "COMPLETED", timeout=90)
    said = [ln for ln in out_with.read_text().splitlines() if ln.startswith("torchpass:")]
    assert said == [f"torchpass: job {with_flag} is not protected: its step 0 runs each of its 4 tasks' Python "
                    "directly (srun python, one task a rank) and its tasks are numbered cyclic over its nodes; a "
                    "node's ranks must be consecutive (srun -m block, the default); or run the script under `srun "
                    "torchrun --nproc-per-node=<ranks a node>` (one task a node)"], said
    lines = out_with.read_text().splitlines()
    assert lines.count("task") == 4 and lines.count("code") == 4, lines  # the tasks' own output, untouched
    assert "torchpass" not in out_without.read_text()


def test_torchpass_job_survives_a_node_going_down(devcluster: DevCluster, torchpass_conf: str) -> None:
    devcluster.reset()
    script = "srun -N2 sleep 120\n"
    tp_job, _ = submit(devcluster, torchpass_conf, script, "--torchpass", "-N2", "-w", "n1,n2")
    plain_job, _ = submit(devcluster, torchpass_conf, script, "-N2", "-w", "n3,n4", "--no-requeue")
    for job in (tp_job, plain_job):
        devcluster.wait_job_state(job, "RUNNING")
    devcluster.run("scontrol", "update", "nodename=n2,n4", "state=down", "reason=test")
    devcluster.wait_job_state(plain_job, "NODE_FAIL")  # the control: a job without --torchpass dies
    record = devcluster.job_record(tp_job)
    assert (record["JobState"], record["NodeList"]) == ("RUNNING", "n1")
