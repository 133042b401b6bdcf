"""TorchPass's interpreter start-up hook for the tasks of a ``--torchpass`` job step: the SPANK plugin
puts this directory first on each task's PYTHONPATH. ``python -m torch.distributed.run ARGS``
(Megatron-LM's Slurm recipe) and ``torchrun`` run by its full path (``.venv/bin/torchrun``,
``uv run torchrun``) become launchpad, exactly as the ``torchrun`` the shim puts first on PATH
does. A step that runs its ranks' Python directly (``srun python``, one task a rank) is not protected
yet: its first task says so, once, in the job's output. Any other Python goes on untouched, and the
sitecustomize this one shadows (the site's, the environment's) still runs after it. Standard library only: the user's Python need not have
TorchPass installed (the shim finds launchpad)."""

from __future__ import annotations

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


def unsupervised_notice(argv: list[str], env: dict[str, str]) -> str:
    """The line the first task of a step says when the step runs its ranks' Python directly (``srun
    python``, one task a rank): no launchpad supervises them, so nothing protects them ("" for
    anything else: launchpad and the processes it starts, one-task steps, the batch script)."""
    kind, name, _ = command(argv)
    ours = name.split(".")[0] in ("launchpad", "torchpass") if kind == "module" else os.path.basename(name) == "launchpad"
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if ours or "TORCHPASS_AGENT_SOCKET" in env or env.get("SLURM_PROCID") != "0" or not tasks.isdigit() \
            or int(tasks) < 2:
        return ""
    return (f"torchpass: job {env.get('SLURM_JOB_ID', '?')} is not protected: its step {env.get('SLURM_STEP_ID', '?')} "
            f"runs each of its {tasks} tasks' Python directly (srun python, one task a rank), which no launchpad "
            "supervises yet; run the script under `srun torchrun --nproc-per-node=<ranks a node>` (one task a "
            "node) to have it protected")


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
        if (args := torchrun_args(list(getattr(sys, "orig_argv", [])))) is not None:
            sys.stdout.flush()
            os.execv(SHIM, [SHIM, *args])  # launchpad, which accepts torchrun's options
        if notice := unsupervised_notice(list(getattr(sys, "orig_argv", [])), dict(os.environ)):
            print(notice, file=sys.stderr, flush=True)
    _chain()
