"""How the workers of a transparent job, and of an auto one (bare ``--torchpass``: torchpassd picks
the mode once the workers show whether they registered save/load), start so that criu can move them
later (criu_hooks.spawn: their own PID namespace and session, a control pipe the worker parks on),
and whether this launchpad is a spare waiting for a restored worker. Moving them (dump, transfer,
restore) is launchpad/transparent.py's."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from criu_hooks import spawn as criu_spawn
from launchpad import workers
from launchpad.output import OutputRouter
from launchpad.spec import MODE_ENV, LaunchSpec
from slurm_plugin.model import AUTO, TRANSPARENT
from torchpass_common import agent_channel as ac
from torchpass_common import log
from torchpass_common.errors import WorkerError


def transparent() -> bool:
    """The job asked for transparent mode: its workers move only as processes (they register no state)."""
    return os.environ.get(MODE_ENV) == TRANSPARENT


def movable() -> bool:
    """Start this node's workers so that criu can move them: the job asked for transparent mode, or
    for auto where this node can start them so (else they start as under torchrun: see ``unmovable``)."""
    mode = os.environ.get(MODE_ENV)
    return mode == TRANSPARENT or (mode == AUTO and not unmovable())


@functools.cache
def unmovable() -> str:
    """Why this node cannot start a movable worker ("" when it can): util-linux unshare must make a
    PID namespace here. Asked once; an auto job whose workers cannot be movable runs them plainly
    (a transparent move is then refused with this reason, before any pause)."""
    try:
        res = subprocess.run([*criu_spawn.PREFIX, "true"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL)
        why = "" if res.returncode == 0 else f"{' '.join(criu_spawn.PREFIX)} failed here: {res.stderr.strip()[:200]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"cannot run {criu_spawn.PREFIX[0]}: {exc}"
    if why:
        log.get().warning("worker.not_movable", why=why,
                          hint="workers start as under torchrun: drains of an unregistered script are refused")
    return why


def restore_target() -> bool:
    """This launchpad runs on a spare and starts no worker: it waits for the one criu restores here."""
    return os.environ.get(ac.ENV_RESTORE_TARGET) == "1"


async def spawn(spec: LaunchSpec, router: OutputRouter, rank: int, local_rank: int,
                env: Mapping[str, str]) -> workers.Worker:
    """Start a movable worker: criu_hooks.spawn's prefix, its control pipe's read end passed in
    (TORCHPASS_CONTROL_FD); the Worker's pid is the worker's own, not its launcher's."""
    ctl_r, ctl_w = os.pipe()
    try:
        w = await workers.spawn(spec, router, rank, local_rank, {**env, ac.ENV_CONTROL_FD: str(ctl_r)},
                                prefix=criu_spawn.PREFIX, pass_fds=(ctl_r,), os_pipes=True)
    except BaseException:
        os.close(ctl_w)
        raise
    finally:
        os.close(ctl_r)
    w.control = ctl_w
    w.host_pid = await _inner_pid(w.proc.pid, rank)
    log.get(rank=rank).info("worker.movable", launcher=w.proc.pid, pid=w.host_pid)
    return w


async def _inner_pid(launcher: int, rank: int, timeout: float = 30.0) -> int:
    """The worker under ``launcher`` (unshare) once it leads its own session."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = children.read_text().split()
            if pids and criu_spawn.session_of(int(pids[0])) == int(pids[0]):
                return int(pids[0])
        except OSError:
            if not Path(f"/proc/{launcher}").exists():
                break
        await asyncio.sleep(0.005)
    raise WorkerError(f"the movable worker under launcher {launcher} did not start within {timeout:.0f} s",
                      rank=rank, hint="is util-linux unshare available, and may this user make PID namespaces?")
