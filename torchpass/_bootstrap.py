"""How launchpad starts a worker: ``python -m torchpass._bootstrap [-m] TARGET [ARGS...]``.
Activates TorchPass (default group, launchpad connection), then runs the user's script or module
as ``__main__`` with argv intact, the way ``python script.py`` / ``python -m module`` would. When
a collective fails because a peer was lost, the exception stops here: the worker is interrupted,
and once recovered runs the script again in this process (its register() loads the state)."""

from __future__ import annotations

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
                runpy.run_path(target, run_name="__main__")
            return
        except BaseException as exc:
            if not runtime.interrupted(exc):
                raise
            runtime.recover(exc)  # returns once recovered: run the script again, in joining mode


if __name__ == "__main__":
    main(sys.argv[1:])
