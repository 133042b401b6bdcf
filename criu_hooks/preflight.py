"""Can this worker be moved transparently? Asked before anything is paused, so that the orchestrator
can fall back (model-aware when the job registered save/load, else wait) instead of rolling back a
half-done move. Checks: a usable criu, the worker started by `spawn` (PID-namespace init, session
leader), the device files its process tree holds (a DataLoader's workers too: criu cannot carry a
device to another node) and its GPU state (criu_hooks.cuda). Returns reasons; an empty list means go."""

from __future__ import annotations

import os
from pathlib import Path

from criu_hooks import cuda, locate, runner, spawn
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
    found += [f"process {task} holds {path}, {why}" for task, path, why in held_devices(pid)]
    try:
        cuda.check(pid, cross_gpu=cross_gpu)
    except CudaCheckpointUnsupported as e:
        found.append(str(e))
    return found


# Device files a moved process may hold: they mean the same on every node (GPUs: criu_hooks.cuda).
PORTABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
PORTABLE_PREFIXES = ("/dev/shm/", "/dev/nvidia")


def unportable(path: str) -> str:
    """Why criu cannot move a process holding ``path`` to another node ("" when it can)."""
    if not path.startswith("/dev/") or path in PORTABLE_DEVICES or path.startswith(PORTABLE_PREFIXES):
        return ""
    if path.startswith(("/dev/pts/", "/dev/tty")):
        return "a terminal: give workers no terminal (stdin /dev/null, no tty)"
    return ("a device that criu cannot carry to another node: close it before a move, or use a "
            "model-aware move (torchpass.register)")


def held_devices(pid: int) -> list[tuple[int, str, str]]:
    """(task, path, why) for each unportable device file that a task of ``pid``'s tree has open or mapped."""
    found = []
    for task in runner.tree(pid):
        paths = set()
        fd_dir = Path(f"/proc/{task}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    paths.add(os.readlink(fd))
                except OSError:
                    continue
            maps = Path(f"/proc/{task}/maps").read_text().splitlines()
        except OSError:  # ended meanwhile
            continue
        paths |= {line.split(None, 5)[5] for line in maps if len(line.split(None, 5)) == 6}
        found += [(task, path, why) for path in sorted(paths) if (why := unportable(path))]
    return found
