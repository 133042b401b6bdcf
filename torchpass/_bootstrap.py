"""How launchpad starts a worker: ``python -m torchpass._bootstrap [-m] TARGET [ARGS...]``.
Activates TorchPass (default group, launchpad connection), then runs the user's script or module
as ``__main__`` with argv intact, the way ``python script.py`` / ``python -m module`` would. When
a collective fails because a peer was lost, the exception stops here: the worker is interrupted,
and once recovered runs the script again in this process (its register() loads the state)."""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import sys

from torchpass import runtime


def main(argv: list[str]) -> None:
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
