"""Can this worker be moved transparently? Asked before anything is paused, so that the orchestrator
can fall back (model-aware when the job registered save/load, else wait) instead of rolling back a
half-done move. Checks: a usable criu, the worker started by `spawn` (PID-namespace init, session
leader), and its GPU state (criu_hooks.cuda). Returns reasons; an empty list means go."""

from __future__ import annotations

import os
from pathlib import Path

from criu_hooks import cuda, locate, spawn
from criu_hooks.errors import CriuUnavailable, CudaCheckpointUnsupported


def reasons(pid: int, *, cross_gpu: bool = False) -> list[str]:
    """Why process ``pid`` cannot be moved with criu (empty: it can)."""
    found = []
    try:
        locate.find()
    except CriuUnavailable as e:
        found.append(str(e))
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        session = spawn.session_of(pid)
    except OSError:
        return [*found, f"process {pid} does not exist"]
    nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
    if len(nspid) < 2 or nspid[-1] != "1":
        found.append(f"process {pid} is not the first process of its own PID namespace, so its PID "
                     "may be taken on the target: start workers with criu_hooks.spawn")
    if session != pid:
        found.append(f"process {pid} is not a session leader (session {session}): start workers with "
                     "criu_hooks.spawn (setsid)")
    if os.path.realpath(f"/proc/{pid}/fd/0").startswith("/dev/pts"):
        found.append(f"process {pid} reads a terminal; give workers stdin=/dev/null")
    try:
        cuda.check(pid, cross_gpu=cross_gpu)
    except CudaCheckpointUnsupported as e:
        found.append(str(e))
    return found
