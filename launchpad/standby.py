"""A warm worker kept beside this node's workers for in-place rebuilds: a Python interpreter with
torch and torchpass already imported (``torchpass._bootstrap --standby``), parked on its stdin until
it is told the environment of the rank it becomes, then running the user's script like any worker.
A rank rebuilt in place otherwise starts cold inside the job's pause: the interpreter and the torch
import are most of that start (about 2 of 3 s on the dev cluster); a standby pays them before the
crash. This module owns starting, handing over and stopping that process; when one is kept and
for which rank it is used is launchpad/group.py's, what the worker does once it runs the
bootstrap's. It costs one idle interpreter's memory per node (a few hundred MB with torch)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Mapping

from launchpad import workers
from launchpad.output import OutputRouter
from launchpad.spec import LaunchSpec
from torchpass_common import agent_channel as ac
from torchpass_common import log


def command(spec: LaunchSpec) -> list[str]:
    """A worker's command line with the bootstrap told to wait for its environment first."""
    argv = workers.command(spec)
    at = argv.index(workers.BOOTSTRAP) + 1
    return [*argv[:at], ac.STANDBY_FLAG, *argv[at:]]


class Standby:
    """One parked interpreter; ``become`` turns it into a worker (once)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, spec: LaunchSpec, env: Mapping[str, str]) -> Standby:
        """Start the standby with ``env`` (a worker's environment: what torch reads at import) and
        wait until it is warm (it says so on its stdout); OSError when it ends first."""
        proc = await asyncio.create_subprocess_exec(
            *command(spec), env=dict(env), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, preexec_fn=workers.die_with_agent,
            limit=workers.LINE_LIMIT)
        standby = cls(proc)
        assert proc.stdout is not None
        try:
            ready = await proc.stdout.readline()
        except BaseException:
            await standby.stop()
            raise
        if ready != ac.STANDBY_READY:
            await standby.stop()
            raise OSError(f"the standby (pid {proc.pid}) ended before it was warm (exit {proc.returncode})")
        log.get(job=spec.job, node=spec.node).info("standby.started", pid=proc.pid)
        return standby

    async def become(self, router: OutputRouter, rank: int, local_rank: int,
                     env: Mapping[str, str]) -> workers.Worker | None:
        """Hand the standby the environment of worker ``rank``; the Worker it now is, or None when
        it is gone (the caller starts one cold)."""
        proc = self.proc
        if proc.returncode is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(json.dumps(dict(env)).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            return None
        assert proc.stdout is not None and proc.stderr is not None
        worker = workers.Worker(rank, local_rank, proc)
        worker.start_output(router, proc.stdout, proc.stderr, env)
        log.get(rank=rank).info("worker.started", local_rank=local_rank, pid=proc.pid, standby=True)
        return worker

    async def stop(self) -> None:
        """Let an unused standby go (its session with it)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
