"""The start-up hook the SPANK plugin puts on a --torchpass task's PYTHONPATH knows torchrun under
its other names (``python -m torch.distributed.run``, a full path, after interpreter options) and
nothing else: any other Python command line goes on untouched. In a step that runs its ranks' Python
directly (srun python, one task a rank) each node's first task becomes its launchpad and the others
hand themselves over to it; a step whose tasks cannot be supervised so runs as it is, and its first
task says why, once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / "spank" / "shim" / "python" / "sitecustomize.py"


def _hook():  # noqa: ANN202 - the hook's module (imported by another name, the hook does not run)
    spec = importlib.util.spec_from_file_location("tp_hook", HOOK)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize(("argv", "args"), [
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"], ["--nproc-per-node", "2", "t.py"]),
    (["python3", "-u", "-X", "utf8", "-m", "torch.distributed.run", "t.py"], ["t.py"]),
    (["python", "-mtorch.distributed.run", "t.py"], ["t.py"]),
    (["/x/.venv/bin/python", "/x/.venv/bin/torchrun", "--standalone", "t.py"], ["--standalone", "t.py"]),
    (["python", "-W", "ignore", "/opt/bin/torchrun"], []),
    (["python", "train.py", "torchrun"], None),
    (["python", "-m", "torch.distributed.launch", "t.py"], None),
    (["python", "-c", "import torch.distributed.run"], None),
    (["python"], None),
    (["python", "-m"], None),
])
def test_torchrun_is_known_by_its_other_names_only(argv: list[str], args: list[str] | None) -> None:
    assert _hook().torchrun_args(argv) == args


STEP = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_DISTRIBUTION": "block", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0", "SLURM_GTIDS": "0,1"}
TASK3 = {**STEP, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_GTIDS": "2,3"}


@pytest.mark.parametrize(("argv", "env", "role"), [
    (["python", "train.py"], STEP, "launchpad"),  # the node's first task becomes its launchpad
    (["python", "train.py"], {**TASK3, "SLURM_LOCALID": "0", "SLURM_PROCID": "2"}, "launchpad"),
    (["python", "train.py"], TASK3, "proxy"),  # the others hand themselves over to it
    (["python", "-u", "-m", "trainer.main", "--lr", "1"], TASK3, "proxy"),
    (["python", "train.py"], {k: v for k, v in STEP.items() if k != "SLURM_GTIDS"}, "launchpad"),  # Slurm 24.11
    (["python", "train.py"], {**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}, ""),
    (["python", "prepare.py"], {k: v for k, v in STEP.items() if k != "SLURM_STEP_NUM_TASKS"}, ""),  # batch script
    (["python", "/v/bin/launchpad", "--nproc-per-node", "2", "t.py"], STEP, ""),
    (["python", "-m", "torchpass._bootstrap", "t.py"], STEP, ""),
    (["python", "-c", "print(1)"], STEP, ""),
    (["python", "t.py"], {**STEP, "TORCHPASS_AGENT_SOCKET": "/run/x"}, ""),  # a worker launchpad started
])
def test_each_task_of_a_srun_python_step_knows_its_part(argv: list[str], env: dict[str, str], role: str) -> None:
    assert _hook().task_role(argv, env) == (role, "")


@pytest.mark.parametrize(("env", "why"), [
    ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "3,2,1"}, "not spread evenly over its nodes (3,2,1 a node)"),
    ({**STEP, "SLURM_DISTRIBUTION": "cyclic", "SLURM_GTIDS": "0,3"}, "numbered cyclic over its nodes"),
    ({**STEP, "SLURM_DISTRIBUTION": "arbitrary", "SLURM_GTIDS": "0,4"}, "numbered arbitrary over its nodes"),
])
def test_a_step_that_cannot_be_supervised_runs_as_it_is_and_its_first_task_says_why(env: dict[str, str],
                                                                                   why: str) -> None:
    hook = _hook()
    role, notice = hook.task_role(["python", "train.py"], env)
    assert role == "notice" and why in notice, notice
    assert notice.startswith("torchpass: job 12 is not protected: its step 0 runs each of its 6 tasks' Python")
    assert hook.task_role(["python", "train.py"], {**env, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}) == ("", "")


def test_without_torchpass_in_the_tasks_python_the_step_runs_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = _hook()
    monkeypatch.setattr(hook.importlib.util, "find_spec", lambda name: None)
    role, notice = hook.task_role(["python", "train.py"], STEP)
    assert role == "notice" and "cannot import torchpass; install TorchPass" in notice


@pytest.mark.parametrize(("argv", "env", "args"), [
    (["python", "-u", "train.py", "--lr", "1"], STEP,
     ["--as-tasks", "--nnodes", "3", "--node-rank", "0", "--nproc-per-node", "2", "train.py", "--lr", "1"]),
    (["python", "-m", "pkg.train"], {**STEP, "SLURM_NODEID": "2", "MASTER_ADDR": "n7", "MASTER_PORT": "4242"},
     ["--as-tasks", "--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "2", "--master-addr", "n7",
      "--master-port", "4242", "-m", "pkg.train"]),
])
def test_the_nodes_launchpad_runs_one_worker_a_task_of_the_node(argv: list[str], env: dict[str, str],
                                                                args: list[str]) -> None:
    assert _hook().launchpad_args(argv, env) == args
