"""Starting and stopping one worker process: its command line (through the torchpass bootstrap,
like torchrun's ``python -u script args``), the environment torchrun gives workers, its own
session so its whole process tree can be signalled, and its output piped to the OutputRouter."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from launchpad.output import OutputRouter, Withheld
from launchpad.rendezvous import Membership
from launchpad.spec import LaunchSpec
from torchpass_common import agent_channel, log, task_handover

BOOTSTRAP = "torchpass._bootstrap"
LINE_LIMIT = 1 << 20
_PR_SET_PDEATHSIG = 1


def die_with_agent() -> None:
    """In the child before exec: SIGKILL this worker if launchpad dies, so no worker outlives
    its agent (a SIGKILLed launchpad cannot forward anything)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def command(spec: LaunchSpec) -> list[str]:
    """The worker's argv: the bootstrap runs the script (or -m module) with argv intact;
    --no-python executes the entrypoint itself, so no TorchPass code runs in that worker."""
    if spec.no_python:
        return [spec.entrypoint, *spec.args]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if spec.as_tasks:  # the Python the user's srun ran
        python = os.environ.get(task_handover.ENV_TASK_PYTHON, python)
    return [python, "-u", "-m", BOOTSTRAP, *(["-m"] if spec.module else []), spec.entrypoint, *spec.args]


def worker_env(spec: LaunchSpec, m: Membership, local_rank: int, restarts: int,
               socket_path: str, extra: Mapping[str, str] | None = None, *,
               task: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one worker: launchpad's own plus what torchrun sets (same names and
    meanings; the store is the agent's, so TORCHELASTIC_USE_AGENT_STORE is True) plus TorchPass's.
    A task's rank (--as-tasks) also gets what that task of the step has (``task``: the environment
    it handed over; a joiner's from the step, task_handover.ENV_TASK_STEP) and its place's SLURM_*."""
    rank = m.rank_offset + local_rank
    env = _task_env(spec, m, local_rank, task) if spec.as_tasks else dict(os.environ)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(m.node_rank),
        "ROLE_RANK": str(rank), "ROLE_NAME": spec.role, "LOCAL_WORLD_SIZE": str(m.local_world_size),
        "WORLD_SIZE": str(m.world_size), "GROUP_WORLD_SIZE": str(m.nnodes),
        "ROLE_WORLD_SIZE": str(m.world_size), "MASTER_ADDR": m.store_host, "MASTER_PORT": str(m.store_port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.run_id, "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        agent_channel.ENV_SOCKET: socket_path,
    })
    if spec.output_args:  # read back by torchpassd from a leaving worker's environment
        env[agent_channel.ENV_OUTPUT_ARGS] = json.dumps(list(spec.output_args))
    if "OMP_NUM_THREADS" not in os.environ and m.local_world_size > 1 and not spec.as_tasks:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, so N workers do not oversubscribe the cores
    env.update(extra or {})
    return env


def _task_env(spec: LaunchSpec, m: Membership, local_rank: int, task: Mapping[str, str] | None) -> dict[str, str]:
    """A srun python task's rank: the environment the task handed over (local rank 0's: launchpad's
    as its task had it), TorchPass's own from launchpad (TORCHPASS_*), a joiner's step variables
    (task_handover.ENV_TASK_STEP) and the SLURM_* of its place."""
    env = dict(task if task is not None else spec.first_task_env or os.environ)
    env.update({k: v for k, v in os.environ.items() if k.startswith("TORCHPASS")})
    try:
        step = json.loads(os.environ.get(task_handover.ENV_TASK_STEP) or "{}")
    except ValueError:
        step = {}
    env.update({k: v for k, v in step.items() if k in task_handover.STEP_VARS and isinstance(v, str)})
    env.update(task_handover.rank_vars(m.rank_offset + local_rank, local_rank, m.node_rank))
    env[task_handover.ENV_AS_TASKS] = "1"
    return env


@dataclass
class Worker:
    """One running worker process and the tasks copying its output. A movable worker
    (--torchpass=transparent, launchpad/transparent.py) runs under ``unshare``: ``proc`` is that
    launcher, ``host_pid`` the worker itself; ``moved`` is set once criu moved it elsewhere."""

    rank: int
    local_rank: int
    proc: Any
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    host_pid: int | None = None
    control: int | None = None  # movable: launchpad's write end of the worker's control pipe
    moved: bool = False
    withheld: Withheld | None = None  # a joiner's console output, kept back until its migration succeeded

    def start_output(self, router: OutputRouter, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader,
                     env: Mapping[str, str]) -> None:
        """Copy its output streams to their per-rank destinations; a joiner's (TORCHPASS_JOIN) console
        output is withheld until its migration succeeded (``withheld``)."""
        self.withheld = Withheld() if env.get(agent_channel.ENV_JOIN) == "1" else None
        self.pumps = pump_output(router, self.rank, self.local_rank, stdout, stderr, self.withheld)

    @property
    def pid(self) -> int:
        return self.host_pid or self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def signal(self, sig: int) -> None:
        """Signal the worker's whole process group (it leads its own session)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    async def wait(self) -> int:
        """Wait for the worker to exit; then kill what it left in its session (strays would hold
        its output pipes open) and let the output pumps drain."""
        code = await self.proc.wait()
        self.signal(signal.SIGKILL)
        await asyncio.gather(*self.pumps, return_exceptions=True)
        return code

    async def stop(self, sig: int, grace: float) -> int:
        """Send ``sig``; SIGKILL the process group if it has not exited after ``grace`` seconds."""
        if self.proc.returncode is None:
            self.signal(sig)
            try:
                return await asyncio.wait_for(self.wait(), grace)
            except TimeoutError:
                log.get(rank=self.rank).warning("worker.kill", pid=self.pid, after=grace)
        self.signal(signal.SIGKILL)
        return await self.wait()


async def spawn(spec: LaunchSpec, router: OutputRouter, rank: int, local_rank: int,
                env: Mapping[str, str], *, prefix: Sequence[str] = (), pass_fds: Sequence[int] = (),
                os_pipes: bool = False) -> Worker:
    """Start one worker; its stdout/stderr are routed per rank. ``prefix`` (e.g. criu_hooks.spawn's)
    goes before its command line; ``pass_fds`` stay open in it; ``os_pipes``: its output goes to
    real pipes (criu moves pipes; the event loop's own PIPE may be a socketpair, under uvloop)."""
    if not os_pipes:
        proc = await asyncio.create_subprocess_exec(
            *prefix, *command(spec), env=dict(env), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, preexec_fn=die_with_agent, limit=LINE_LIMIT,
            pass_fds=tuple(pass_fds))
        assert proc.stdout is not None and proc.stderr is not None
        streams = (proc.stdout, proc.stderr)
    else:
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *prefix, *command(spec), env=dict(env), stdin=asyncio.subprocess.DEVNULL, stdout=out_w,
                stderr=err_w, start_new_session=True, preexec_fn=die_with_agent, pass_fds=tuple(pass_fds))
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        streams = (await pipe_reader(out_r), await pipe_reader(err_r))
    worker = Worker(rank, local_rank, proc)
    worker.start_output(router, *streams, env)
    log.get(rank=rank).info("worker.started", local_rank=local_rank, pid=proc.pid)
    return worker


async def pipe_reader(fd: int) -> asyncio.StreamReader:
    """An asyncio reader on the read end ``fd`` of a pipe (it takes the fd over)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


def pump_output(router: OutputRouter, rank: int, local_rank: int, stdout: asyncio.StreamReader,
                stderr: asyncio.StreamReader, withheld: Withheld | None = None) -> list[asyncio.Task[None]]:
    """The tasks copying a worker's two output streams to their per-rank destinations."""
    return [asyncio.create_task(router.pump(stdout, rank, local_rank, "stdout", withheld)),
            asyncio.create_task(router.pump(stderr, rank, local_rank, "stderr", withheld))]
