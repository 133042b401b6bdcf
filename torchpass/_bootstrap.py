"""How launchpad starts a worker: ``python -m torchpass._bootstrap [-m] TARGET [ARGS...]``.
Activates TorchPass (default group, launchpad connection), then runs the user's script or module
as ``__main__`` with argv intact, the way ``python script.py`` / ``python -m module`` would. When
a collective fails because a peer was lost, the exception stops here: the worker is interrupted,
and once recovered runs the script again in this process (its register() loads the state).
``--standby`` first (launchpad/standby.py): import torch, then wait on stdin for the environment of
the rank this process becomes, and go on as that worker."""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys

from torchpass import runtime
from torchpass_common import agent_channel as ac


def await_role() -> None:
    """A standby: import what every worker imports, say so on stdout (ac.STANDBY_READY), then block
    until launchpad writes the environment of the worker this process becomes (one JSON line; end
    of file: not needed, leave). That environment replaces ours whole, and stdin becomes /dev/null
    as a worker's is."""
    import torch.distributed  # noqa: F401, PLC0415 - the import a standby is kept for

    sys.stdout.buffer.write(ac.STANDBY_READY)
    sys.stdout.buffer.flush()
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def main(argv: list[str]) -> None:
    if argv[:1] == [ac.STANDBY_FLAG]:
        await_role()
        argv = argv[1:]
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m torchpass._bootstrap [-m module | script.py] [args...]")
    runtime.activate()
    target = argv[0]
    if not module:  # for python -m, sys.path[0] is already the working directory
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    while True:
        sys.argv = list(argv)
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")  # its globals are dropped on return
            return
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            return  # sys.exit(0) at the end of a script: finished like a return
        except BaseException as exc:
            if not runtime.interrupted(exc):
                raise
            runtime.recover(exc)  # returns once recovered: run the script again, in joining mode


def finish() -> None:
    """The script returned: close what it left open, run its atexit handlers, flush, and leave
    without the interpreter's teardown. In that teardown torch 2.13's gloo objects sometimes abort
    the process (SIGABRT, a few % of runs, after training finished, also under plain torchrun); a
    worker that finished must not fail the job."""
    gc.collect()  # the script's globals are gone: files it left open are flushed and closed here
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
    finish()
