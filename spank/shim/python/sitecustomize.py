"""TorchPass's interpreter start-up hook for the tasks of a ``--torchpass`` job step: the SPANK plugin
puts this directory first on each task's PYTHONPATH. ``python -m torch.distributed.run ARGS``
(Megatron-LM's Slurm recipe) and ``torchrun`` run by its full path (``.venv/bin/torchrun``,
``uv run torchrun``) become launchpad, exactly as the ``torchrun`` the shim puts first on PATH
does. A step that runs its ranks' Python directly (``srun python``, one task a rank, as Lightning,
submitit and NeMo-Run launch) is supervised by one launchpad a node: each node's first task becomes
it, the node's other tasks hand themselves over to it (torchpass_common.task_handover) and it starts
every task's rank with that task's environment and output streams. A step that cannot be supervised
so (tasks spread unevenly, not numbered in node order, no TorchPass in its Python) runs as it is, and
its first task says why, once, in the job's output. Any other Python goes on untouched, and the
sitecustomize this one shadows (the site's, the environment's) still runs after it. Standard library
only until a step is supervised: a user's Python need not have TorchPass for anything else."""

from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(os.path.dirname(HERE), "torchrun")
_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")  # interpreter options that take the next word


def command(argv: list[str]) -> tuple[str, str, list[str]]:
    """What the interpreter command line ``argv`` (sys.orig_argv) runs: ("module", name, args),
    ("script", path, args), ("code", "", []) for -c, or ("", "", []) for an interactive one."""
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            if word != "-m":
                return "module", word[2:], argv[i + 1:]
            return ("module", argv[i + 1], argv[i + 2:]) if i + 1 < len(argv) else ("", "", [])
        if word in _WITH_VALUE:
            i += 2
        elif word == "-c" or (word.startswith("-c") and not word.startswith("--")):
            return "code", "", []
        elif word.startswith("-") and word != "-":
            i += 1
        else:
            return "script", word, argv[i + 1:]
    return "", "", []


def torchrun_args(argv: list[str]) -> list[str] | None:
    """torchrun's arguments when the interpreter command line ``argv`` runs torchrun by another
    name, else None."""
    kind, name, rest = command(argv)
    if (kind, name) == ("module", "torch.distributed.run") or (kind == "script" and os.path.basename(name) == "torchrun"):
        return rest
    return None


def _tasks_per_node(text: str) -> list[int]:
    """Slurm's ``2(x3),1`` into [2, 2, 2, 1] ([] when it cannot be read)."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        n, _, times = part.partition("(x")
        if not n.isdigit() or (times and not times.rstrip(")").isdigit()):
            return []
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts


def task_role(argv: list[str], env: dict[str, str]) -> tuple[str, str]:
    """What this task of a ``--torchpass`` step that runs its ranks' Python directly (``srun python``,
    one task a rank) does: ("launchpad", "") on each node's first task (it becomes the node's
    launchpad, which starts every task's rank), ("proxy", "") on the others (each hands itself over
    to it, torchpass_common.task_handover), ("notice", line) on the step's first task when the step
    cannot be supervised (the line says why and what to do; every task then runs as it is), and
    ("", "") elsewhere: launchpad and the processes it starts, one-task steps, the batch script, -c."""
    kind, name, _ = command(argv)
    ours = name.split(".")[0] in ("launchpad", "torchpass") if kind == "module" else os.path.basename(name) == "launchpad"
    tasks, nodes = env.get("SLURM_STEP_NUM_TASKS", ""), env.get("SLURM_STEP_NUM_NODES", "")
    if ours or kind not in ("script", "module") or "TORCHPASS_AGENT_SOCKET" in env or not tasks.isdigit() \
            or int(tasks) < 2:
        return "", ""
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    gtids = env.get("SLURM_GTIDS")
    node_id, n = env.get("SLURM_NODEID", ""), per_node[0] if per_node else 0
    why = ""
    if len(set(per_node)) != 1 or not nodes.isdigit() or len(per_node) != int(nodes) or not node_id.isdigit():
        why = (f"its tasks are not spread evenly over its nodes ({env.get('SLURM_STEP_TASKS_PER_NODE', '?')} "
               "a node); give it --ntasks-per-node")
    elif not env.get("SLURM_DISTRIBUTION", "block").startswith("block") or (
            gtids is not None and gtids != ",".join(str(int(node_id) * n + i) for i in range(n))):
        why = (f"its tasks are numbered {env.get('SLURM_DISTRIBUTION', '?')} over its nodes; a node's "
               "ranks must be consecutive (srun -m block, the default)")
    elif importlib.util.find_spec("torchpass") is None:
        why = f"this Python ({sys.executable}) cannot import torchpass; install TorchPass in the job's environment"
    if why:
        if env.get("SLURM_PROCID") != "0":
            return "", ""
        return "notice", (f"torchpass: job {env.get('SLURM_JOB_ID', '?')} is not protected: its step "
                          f"{env.get('SLURM_STEP_ID', '?')} runs each of its {tasks} tasks' Python directly "
                          f"(srun python, one task a rank) and {why}; or run the script under `srun torchrun "
                          "--nproc-per-node=<ranks a node>` (one task a node)")
    return ("launchpad", "") if env.get("SLURM_LOCALID") == "0" else ("proxy", "")


def launchpad_args(argv: list[str], env: dict[str, str]) -> list[str]:
    """The node's launchpad, for the node's first task: one worker a task of the node, node ranks as
    Slurm numbers the nodes, the store where the user's MASTER_ADDR/MASTER_PORT say (else launchpad's
    default: the step's first node), then the script (or -m module) and its arguments."""
    kind, name, rest = command(argv)
    per_node = _tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
    store = [a for var, opt in (("MASTER_ADDR", "--master-addr"), ("MASTER_PORT", "--master-port"))
             if env.get(var) for a in (opt, env[var])]
    return ["--as-tasks", "--nnodes", str(len(per_node)), "--node-rank", env["SLURM_NODEID"],
            "--nproc-per-node", str(per_node[0]), *store, *(["-m"] if kind == "module" else []), name, *rest]


def _chain() -> None:
    """Run the sitecustomize this one shadows, if any."""
    saved, ours = sys.path[:], sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    try:
        import sitecustomize  # noqa: F401 - the next one on the path
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if "sitecustomize" not in sys.modules and ours is not None:  # none other: the import of this one ends well
            sys.modules["sitecustomize"] = ours


if __name__ == "sitecustomize":  # at the interpreter's start (a test imports it by another name)
    if os.environ.get("TORCHPASS"):
        _argv, _env = list(getattr(sys, "orig_argv", [])), dict(os.environ)
        if (_args := torchrun_args(_argv)) is not None:
            sys.stdout.flush()
            os.execv(SHIM, [SHIM, *_args])  # launchpad, which accepts torchrun's options
        _role, _notice = task_role(_argv, _env)
        if _role == "launchpad":
            os.environ["TORCHPASS_TASK_PYTHON"] = sys.executable  # the ranks run the Python the user ran
            os.execv(SHIM, [SHIM, *launchpad_args(_argv, _env)])
        if _role == "proxy":
            # the step's Python has TorchPass (task_role)
            from torchpass_common.task_handover import hand_over

            os._exit(hand_over(_env))
        if _notice:
            print(_notice, file=sys.stderr, flush=True)
    _chain()
