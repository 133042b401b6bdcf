"""The workers of this node for one rendezvous round: starting them, adding a joining worker,
watching them until all succeeded or the first one failed (torchrun's rule: one failure stops
the others), and stopping them with SIGTERM then SIGKILL after the grace period. Under a
model-aware TorchPass job a worker killed by a signal (SIGKILL of an OOM kill, SIGSEGV, SIGABRT)
is held instead: the others keep running while torchpassd rebuilds its rank in place (a joiner
added here, from the node's warm standby when it has one: launchpad/standby.py); held past ``hold_s``
it fails the round as before. A worker that exits with a code (the script raised) always fails the
round: restarting a bug would repeat it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from launchpad import movable, workers
from launchpad.output import OutputRouter
from launchpad.rendezvous import Membership
from launchpad.spec import LaunchSpec
from launchpad.standby import Standby
from torchpass_common import agent_channel, log
from torchpass_common.errors import ProtocolError, WorkerError
from torchpass_common.task_handover import HandedTask
from torchpass_common.transfer_address import TransferAddress

STANDBY_WAIT_S = 0.5  # how often a standby not started yet looks whether the workers settled


@dataclass(frozen=True)
class Outcome:
    """How a round ended. ``failed`` names the first failed worker (rank, exit code);
    ``remote`` is another node's failure report; ``signal`` a signal launchpad received."""

    ok: bool
    failed: tuple[int, int] | None = None
    remote: str | None = None
    signal: int | None = None

    def describe(self) -> str:
        if self.failed:
            rank, code = self.failed
            how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            return f"worker rank {rank} {how}"
        if self.remote:
            return f"another node failed: {self.remote}"
        if self.signal:
            return f"launchpad received {signal.Signals(self.signal).name}"
        return "all workers succeeded"


def join_plan(nproc: int) -> dict[str, Any] | None:
    """The join plan torchpassd gave this launchpad (agent_channel.ENV_JOIN_PLAN), checked against
    its --nproc-per-node, its sources read as TransferAddress; None on a launchpad that starts a
    job's own workers."""
    raw = os.environ.get(agent_channel.ENV_JOIN_PLAN)
    if not raw:
        return None
    try:
        plan = json.loads(raw)
        ok = (len(plan["ranks"]) == len(plan["sources"]) == nproc
              and all(isinstance(plan[k], int) for k in ("world_size", "group_rank", "group_world_size")))
        # wormhole listeners only: never a filesystem path
        plan["sources"] = [TransferAddress.parse(src, "a join plan's source") for src in plan["sources"]]
    except (ValueError, KeyError, TypeError, ProtocolError):
        ok = False
    if not ok:
        raise WorkerError(f"{agent_channel.ENV_JOIN_PLAN} is not a join plan for {nproc} workers",
                          hint="it is set by torchpassd for a joining node; do not set it by hand")
    return plan


class WorkerGroup:
    """This node's workers in round ``m.round``; ``workers`` maps pid to Worker."""

    def __init__(self, spec: LaunchSpec, m: Membership, restarts: int, socket_path: str, *,
                 hold_s: float = 0.0, on_held: Callable[[], None] = lambda: None,
                 settled: Callable[[], bool] = lambda: True, tasks: Mapping[int, HandedTask] | None = None) -> None:
        self.spec, self.m, self.restarts, self.socket_path = spec, m, restarts, socket_path
        self.tasks = dict(tasks or {})  # srun python: the local ranks' tasks that handed themselves over
        self.router = OutputRouter(spec, attempt=restarts,
                                   local={lr: (t.stdout, t.stderr) for lr, t in self.tasks.items()})
        self.workers: dict[int, workers.Worker] = {}
        self._exited: asyncio.Queue[workers.Worker] = asyncio.Queue()
        self.told_to_exit: set[int] = set()  # pids the abort/exit commands asked to exit
        self.dismissed: set[int] = set()  # joiners of a migration given up (abort): their end is no failure
        self.hold_s = hold_s  # > 0: hold a worker killed by a signal that long for an in-place recovery
        self.held: dict[int, float] = {}  # pid of a held crashed worker -> when it crashed (loop time)
        self.on_held = on_held  # e.g. an immediate heartbeat, so torchpassd hears of the crash at once
        self.frozen: dict[int, float] = {}  # pid -> seconds it was frozen when the watchdog killed it
        self.rebuilding: set[int] = set()  # pids of joiners that took a held crashed worker's place
        self.hold = movable.restore_target()
        self.standbys: list[Standby] = []  # kept while crashes are held for an in-place rebuild
        self.standbys_wanted = 1  # a hot spare keeps one for each rank of a node it may take
        self.settled = settled  # the workers' own start-up is over (e.g. each timed a step): a standby may start
        self.seated = asyncio.Event()  # a joiner was added (a hot spare took a lost node's ranks)
        self._standby_task: asyncio.Task[None] | None = None
        self._log = log.get(job=spec.job, node=spec.node, round=m.round)

    def _env(self, m: Membership, local_rank: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        task = self.tasks.get(local_rank)
        return workers.worker_env(self.spec, m, local_rank, self.restarts, self.socket_path, extra,
                                  task=task.env if task else None)

    async def start(self) -> None:
        if self.hold:  # a spare's launchpad waiting for a worker criu restores here
            return
        plan = join_plan(self.m.local_world_size)
        for local_rank in range(self.m.local_world_size):
            if plan is None:
                env = self._env(self.m, local_rank)
                await self._add(self.m.rank_offset + local_rank, local_rank, env)
                continue
            rank = plan["ranks"][local_rank]  # this node takes the place of a leaving (or lost) node
            m = dataclasses.replace(self.m, world_size=plan["world_size"], rank_offset=rank - local_rank,
                                    node_rank=plan["group_rank"], nnodes=plan["group_world_size"])
            env = self._env(m, local_rank, {agent_channel.ENV_JOIN: "1",
                                            agent_channel.ENV_JOIN_SOURCE: json.dumps(plan["sources"][local_rank].wire())})
            env.pop(agent_channel.ENV_JOIN_PLAN, None)  # every worker sees only its own source and token
            await self._add(rank, local_rank, env)
        self.keep_standby()

    def keep_standby(self) -> None:
        """Start standbys in the background (up to ``standbys_wanted``) where a crashed rank may be
        rebuilt here: crashes are held (not a transparent job) and workers run the bootstrap (not
        --no-python). A worker made of a standby is not movable: the job it rebuilds a rank of registered."""
        if self.hold_s > 0 and not movable.transparent() and not self.spec.no_python and not self._standby_starting:
            self._standby_task = asyncio.create_task(self._start_standbys())

    @property
    def _standby_starting(self) -> bool:
        return self._standby_task is not None and not self._standby_task.done()

    def seat(self, node_rank: int, nnodes: int) -> None:
        """A hot spare takes a lost node's place (its GROUP_RANK among GROUP_WORLD_SIZE nodes): from
        now on it keeps one standby, as a node of the job's."""
        self.m = dataclasses.replace(self.m, node_rank=node_rank, nnodes=nnodes)
        self.standbys_wanted = 1

    @property
    def standby_state(self) -> str:
        """``ready`` (a rebuild here starts warm), ``starting`` (waiting for the workers to settle,
        or importing torch) or ``none`` (this node keeps no standby)."""
        if len(self.standbys) >= self.standbys_wanted:
            return "ready"
        return "starting" if self._standby_starting else "ready" if self.standbys else "none"

    async def _start_standbys(self) -> None:
        while not self.settled():  # its torch import would slow theirs (and a joiner's) on a node of few cores
            await asyncio.sleep(STANDBY_WAIT_S)
        while len(self.standbys) < self.standbys_wanted:  # one by one: each imports torch
            env = self._env(self.m, 0)
            try:
                self.standbys.append(await Standby.start(self.spec, env))
            except OSError as exc:  # a rebuild then starts its worker cold, as without a standby
                self._log.warning("standby.not_started", error=str(exc))
                return

    async def _from_standby(self, rank: int, local_rank: int, env: dict[str, str]) -> workers.Worker | None:
        """Worker ``rank`` made of a standby (and a new standby started), or None without one."""
        if not self.standbys:
            return None
        standby = self.standbys.pop(0)
        w = await standby.become(self.router, rank, local_rank, env)
        if w is None:
            await standby.stop()
        self.keep_standby()
        return None if w is None else self.adopt(w)

    async def add_joiner(self, rank: int, world_size: int, source: TransferAddress) -> workers.Worker:
        """Start a worker that joins the running job as ``rank``, loading its state from ``source``;
        it takes the place (and the local rank) of a held crashed worker of that rank, if any."""
        crashed = next((w for pid, w in self.workers.items() if pid in self.held and w.rank == rank), None)
        if crashed is not None:  # replaced: no longer one of this node's workers
            del self.held[crashed.pid], self.workers[crashed.pid]
            local_rank = crashed.local_rank
        else:
            local_rank = max((w.local_rank for w in self.workers.values()), default=-1) + 1
        m = dataclasses.replace(self.m, world_size=world_size, rank_offset=rank - local_rank)
        env = self._env(m, local_rank, {agent_channel.ENV_JOIN: "1", agent_channel.ENV_JOIN_SOURCE: json.dumps(source.wire())})
        w = await self._from_standby(rank, local_rank, env) or await self._add(rank, local_rank, env)
        self.seated.set()
        if crashed is not None:
            self.rebuilding.add(w.pid)
        return w

    async def _add(self, rank: int, local_rank: int, env: dict[str, str]) -> workers.Worker:
        try:
            if movable.movable():
                w = await movable.spawn(self.spec, self.router, rank, local_rank, env)
            else:
                w = await workers.spawn(self.spec, self.router, rank, local_rank, env)
        except OSError as exc:
            raise WorkerError(f"cannot start worker: {exc}", rank=rank, node=self.spec.node,
                              hint="check the entrypoint path and that it is executable") from exc
        return self.adopt(w)

    def resumed(self, pid: int) -> None:
        """Worker ``pid`` trains on the new generation: a joiner's migration succeeded, its output is let out."""
        w = self.workers.get(pid)
        if w is not None and w.withheld is not None:
            w.withheld.release()

    def dismiss(self, w: workers.Worker) -> None:
        """``w`` joined for a migration that was given up: none of its output reaches the job's (what
        it had printed goes to launchpad's log), and its end is no failure of this node's."""
        self.told_to_exit.add(w.pid)
        self.dismissed.add(w.pid)
        self._drop_output(w)

    def _drop_output(self, w: workers.Worker) -> None:
        if w.withheld is None or w.withheld.state != "held":
            return
        kept = w.withheld.discard()
        if kept:
            self._log.info("worker.output_withheld", rank=w.rank, pid=w.pid, bytes=len(kept),
                           tail=kept[-2000:].decode(errors="replace"))

    def adopt(self, w: workers.Worker) -> workers.Worker:
        """Supervise ``w`` as one of this node's workers (also a worker criu restored here)."""
        self.workers[w.pid] = w
        asyncio.create_task(self._watch(w))
        return w

    async def _watch(self, w: workers.Worker) -> None:
        await w.wait()
        self._exited.put_nowait(w)

    async def supervise(self, stop: asyncio.Event, stop_signal: Callable[[], int | None],
                        remote_failure: Callable[[], Awaitable[str | None]], poll: float) -> Outcome:
        """Run until every worker exited 0, one failed, another node failed, or ``stop`` is set."""
        running = set(self.workers)
        stop_task = asyncio.create_task(stop.wait())
        try:
            while running or self.held or (self.hold and not self.workers):  # a held crash awaits its rebuild
                get = asyncio.create_task(self._exited.get())
                done, _ = await asyncio.wait({get, stop_task}, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    if (failed := self._exited_worker(get.result(), running)) is not None:
                        return failed
                else:
                    get.cancel()
                running |= {pid for pid, w in self.workers.items() if w.returncode is None}  # joiners
                if stop_task in done:
                    return Outcome(ok=False, signal=stop_signal())
                if (expired := self._hold_expired()) is not None:
                    return expired
                if (remote := await remote_failure()) is not None:
                    return await self._told_exit_outcome(running) or Outcome(ok=False, remote=remote)
            return Outcome(ok=True)
        finally:
            stop_task.cancel()

    async def kill_frozen(self, pid: int, quiet_s: float) -> None:
        """The watchdog found worker ``pid`` frozen for ``quiet_s`` s: SIGKILL it (a stopped process
        too), so that it is held as a crash and rebuilt in place like any other."""
        w = self.workers.get(pid)
        if w is None or w.returncode is not None:
            return
        self.frozen[pid] = quiet_s
        w.signal(signal.SIGKILL)

    def _hold_expired(self) -> Outcome | None:
        """The round's failure when a held crashed worker was not rebuilt within hold_s: then it
        fails as torchrun would have at the crash."""
        now = asyncio.get_running_loop().time()
        for pid, since in self.held.items():
            if now - since > self.hold_s:
                w = self.workers[pid]
                self._log.error("worker.hold_expired", rank=w.rank, pid=pid, code=w.returncode,
                                held_s=round(now - since, 1))
                return Outcome(ok=False, failed=(w.rank, w.returncode or 0))
        return None

    async def _told_exit_outcome(self, running: set[int]) -> Outcome | None:
        """Workers here that were told to exit (an orchestrator's abort or exit) get the grace
        period to do so: when one fails, its exit code, not another node's report of the same
        abort, is this node's outcome. None when they all exited 0 or did not exit in time."""
        told = running & self.told_to_exit
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.grace_period
        while told:
            try:
                w = await asyncio.wait_for(self._exited.get(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None
            told.discard(w.pid)
            if (failed := self._exited_worker(w, running)) is not None:
                return failed
        return None

    def _exited_worker(self, w: workers.Worker, running: set[int]) -> Outcome | None:
        """Note that ``w`` exited; the round's failure when it failed."""
        running.discard(w.pid)
        self._log.info("worker.exited", rank=w.rank, pid=w.pid, code=w.returncode)
        self._drop_output(w)  # a joiner that ended before its migration succeeded
        if w.pid in self.dismissed:  # its rank runs where it ran before, or on another spare
            return None
        if w.returncode != 0 and not w.moved:  # a moved worker's original is killed here
            if self.hold_s > 0 and (w.returncode or 0) < 0 and w.pid not in self.told_to_exit:
                self.held[w.pid] = asyncio.get_running_loop().time()
                self._log.warning("worker.crash_held", rank=w.rank, pid=w.pid, code=w.returncode,
                                  hold_s=self.hold_s, why="killed by a signal: torchpassd may rebuild it here")
                self.on_held()
                return None
            return Outcome(ok=False, failed=(w.rank, w.returncode or 0))
        return None

    def dismissed_all(self) -> bool:
        """Every worker here was a joiner of a migration given up (a hot spare whose seating was
        undone): the node runs no rank of the job and may be seated again."""
        return bool(self.workers) and set(self.workers) <= self.dismissed

    def emptied(self) -> bool:
        """Every worker here left for another node and ended: a migration moved it (criu) or told
        it to exit once its rank ran elsewhere. The node stays in the job only if Slurm cannot release it."""
        return bool(self.workers) and all(w.returncode is not None and (w.moved or w.pid in self.told_to_exit)
                                          for w in self.workers.values())

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker still running: ``sig`` first, SIGKILL after the grace period; and the standby."""
        if self._standby_task is not None:
            self._standby_task.cancel()
            await asyncio.gather(self._standby_task, return_exceptions=True)
        standbys, self.standbys = self.standbys, []
        await asyncio.gather(*(s.stop() for s in standbys))
        await asyncio.gather(*(w.stop(sig, self.spec.grace_period) for w in self.workers.values()))
