"""The start-up hook the SPANK plugin puts on a --torchpass task's PYTHONPATH knows torchrun under
its other names (``python -m torch.distributed.run``, a full path, after interpreter options) and
nothing else: any other Python command line goes on untouched. A step that runs its ranks' Python
directly (srun python, one task a rank) is told, once, by its first task, that nothing protects it."""

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


STEP = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "6", "SLURM_PROCID": "0"}


@pytest.mark.parametrize(("argv", "env", "said"), [
    (["python", "train.py"], STEP, True),
    (["python", "train.py"], {**STEP, "SLURM_PROCID": "3"}, False),  # once a step: its first task
    (["python", "train.py"], {**STEP, "SLURM_STEP_NUM_TASKS": "1"}, False),  # one task: not a job of ranks
    (["python", "prepare.py"], {k: v for k, v in STEP.items() if k != "SLURM_STEP_NUM_TASKS"}, False),  # batch script
    (["python", "/v/bin/launchpad", "--nproc-per-node", "2", "t.py"], STEP, False),
    (["python", "-m", "torchpass._bootstrap", "t.py"], STEP, False),
    (["python", "t.py"], {**STEP, "TORCHPASS_AGENT_SOCKET": "/run/x"}, False),  # a worker launchpad started
])
def test_a_step_of_bare_python_tasks_is_told_once_it_is_not_protected(argv: list[str], env: dict[str, str],
                                                                      said: bool) -> None:
    notice = _hook().unsupervised_notice(argv, env)
    assert bool(notice) == said
    if said:
        assert notice.startswith("torchpass: job 12 is not protected: its step 0 runs each of its 6 tasks' Python")
        assert "srun torchrun --nproc-per-node" in notice
