"""The agent's life: rendezvous, the local channel, the control plane (when a job and broker
are given), rounds of workers with torchrun's restart rule, signal forwarding, and the exit code.
One asyncio loop (uvloop where available); blocking store calls run on one helper thread."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from launchpad import movable
from launchpad.channel import ChannelServer
from launchpad.group import Outcome, WorkerGroup
from launchpad.rendezvous import Rendezvous, joiner_membership, store_listening
from launchpad.spec import LaunchSpec
from launchpad.watchdog import Watchdog
from torchpass_common import agent_channel as ac
from torchpass_common import collective_path, log, task_handover
from torchpass_common.config import Config
from torchpass_common.errors import TorchPassError

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_FAILURE_POLL = 0.5  # seconds between looks at the store for another node's failure
_STORE_POLL = 1.0  # seconds between a hot spare's looks at the rendezvous store
_STORE_GONE_MISSES = 2  # looks in a row that find it closed: the job's training is over


class Agent:
    """State shared by the parts of one launchpad run (commands and heartbeats read it)."""

    def __init__(self, spec: LaunchSpec, config: Config) -> None:
        self.spec, self.config, self.timeouts = spec, config, config.timeouts
        self.node = str(spec.node)
        self.gen = 1
        self.world_size = 0
        self.group: WorkerGroup | None = None
        self.rdzv: Rendezvous | None = None
        self.lost_nodes = 0  # nodes of this rendezvous that died and were recovered from (unplanned)
        self.beat_now: Callable[[], None] = lambda: None  # the control plane's: a heartbeat now
        # workers take the collective timeout (and how long to park) from launchpad's config
        os.environ[ac.ENV_TIMEOUTS] = json.dumps(dataclasses.asdict(self.timeouts))
        # the interface the workers' collectives take (heartbeats report it; reform may change it)
        self.path = collective_path.start_path(os.environ, config.links.fabric)
        self.scratch = Path(tempfile.mkdtemp(prefix="launchpad-"))
        self.channel = ChannelServer(str(self.scratch / "agent.sock"))
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="launchpad-store")
        self._stop = asyncio.Event()
        self._signal: int | None = None
        self.desk: task_handover.TaskDesk | None = None  # srun python: this node's other tasks hand over here
        self._log = log.get(job=spec.job, node=self.node)

    async def _store(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._store_thread, fn, *args)

    def _on_signal(self, sig: int) -> None:
        self._log.warning("agent.signal", signal=signal.Signals(sig).name)
        self._signal = sig
        self._stop.set()
        if self.rdzv is not None:
            self.rdzv.cancel.set()  # a rendezvous still waiting for peers gives up

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in _FORWARDED:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self.channel.start()
            if self.spec.as_tasks and ac.ENV_JOIN_PLAN not in os.environ:  # a joiner is no task of the step
                self.desk = task_handover.TaskDesk(os.environ, self.spec.nproc_per_node - 1)
                await loop.run_in_executor(None, self.desk.gather)
            # a joiner's place is its join plan (joiner_membership); a hot spare's, the node it is seated for
            if ac.ENV_JOIN_PLAN not in os.environ and not self.spec.hot_spare:
                self.rdzv = await self._store(Rendezvous, self.spec)
            if self.spec.job:
                from launchpad.control import ControlPlane  # deferred: only with a control plane

                async with ControlPlane(self):
                    return await self._rounds()
            return await self._rounds()
        except TorchPassError as exc:
            print(f"launchpad: {exc}", file=sys.stderr, flush=True)
            return 128 + self._signal if self._signal is not None else 1
        finally:
            if self.group is not None:
                await self.group.stop()
            await self.channel.close()
            self._store_thread.shutdown(wait=True, cancel_futures=True)
            if self.rdzv is not None:
                self.rdzv.close()
            shutil.rmtree(self.scratch, ignore_errors=True)

    async def _rounds(self) -> int:
        """torchrun's rule: on a failure restart all workers (every node, a new round) until
        --max-restarts is spent; then stop and exit non-zero naming the failed worker."""
        spec, rnd, restarts = self.spec, 0, 0
        while True:
            m = joiner_membership(spec) if self.rdzv is None else await self._store(self.rdzv.join, rnd)
            self.world_size = m.world_size
            self.group = WorkerGroup(spec, m, restarts, self.channel.path, hold_s=self._crash_hold_s(),
                                     on_held=lambda: self.beat_now(), settled=self._workers_settled,
                                     tasks=self.desk.tasks if self.desk else None)
            self.channel.on_resumed = lambda link, group=self.group: group.resumed(link.pid)
            if not self.spec.hot_spare:
                await self.group.start()
            elif (code := await self._stand_by()) is not None:
                return code
            watchdog = asyncio.create_task(Watchdog(self.channel, self.group).run()) if self.group.hold_s else None
            try:
                outcome = await self.group.supervise(self._stop, lambda: self._signal,
                                                     self._remote_failure(rnd, m.nnodes), spec.monitor_interval)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            if outcome.ok and self.spec.hot_spare and self.group.dismissed_all():
                await self.group.stop()  # its seating was undone: warm again for the next lost node
                self._log.warning("agent.hot_spare_again", ranks=sorted(w.rank for w in self.group.workers.values()))
                continue
            if outcome.ok:
                # a store host whose ranks all moved away (the job's batch host, which Slurm keeps in
                # the job) keeps the store for as long as the other nodes train
                emptied = self.group.emptied()
                try:  # nodes lost on the way never report done
                    if self.rdzv is not None:
                        await self._store(self.rdzv.finish, rnd, m.nnodes - self.lost_nodes,
                                          None if emptied else self.timeouts.reform)
                except Exception as exc:
                    if not self.lost_nodes:
                        raise
                    self._log.warning("agent.finish_without_store", error=str(exc))  # its host was lost
                self._log.info("agent.done", round=rnd)
                return 0
            self._log.error("agent.round_failed", round=rnd, reason=outcome.describe())
            if outcome.failed is not None and m.nnodes > 1:
                with contextlib.suppress(Exception):  # the store may be gone with its host
                    await self._store(self.rdzv.report_failure, rnd, f"{self.node}: {outcome.describe()}")
            await self.group.stop(outcome.signal or signal.SIGTERM)
            if outcome.signal is not None or restarts >= spec.max_restarts or self.rdzv is None:  # a joiner's plan is used once
                return self._final(outcome)
            restarts, rnd = restarts + 1, rnd + 1
            self._log.warning("agent.restart", restarts=restarts, max_restarts=spec.max_restarts)

    async def _stand_by(self) -> int | None:
        """A hot spare (``--torchpass-spares``) runs no rank of its own: it keeps a warm standby
        until torchpassd seats a lost node's ranks here (start_joiner: None, supervise them), or the
        job's training ends, which closes the rendezvous store (0, as a node whose workers all
        succeeded), or launchpad is signalled."""
        group, spec, loop = self.group, self.spec, asyncio.get_running_loop()
        assert group is not None
        group.standbys_wanted = spec.nproc_per_node  # one warm process for each rank of the node it may take
        group.keep_standby()
        self._log.info("agent.hot_spare", store=f"{spec.rdzv_host}:{spec.rdzv_port}")
        seen, misses, deadline = False, 0, loop.time() + spec.join_timeout
        while not group.workers:
            if self._stop.is_set():
                return 128 + self._signal if self._signal is not None else 0
            up = await loop.run_in_executor(None, store_listening, spec.rdzv_host, spec.rdzv_port)
            seen, misses = seen or up, 0 if up else misses + 1
            if (seen and misses >= _STORE_GONE_MISSES) or (not seen and loop.time() > deadline):
                self._log.info("agent.hot_spare_done", store_seen=seen)
                return 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(group.seated.wait(), _STORE_POLL)
        return None

    def _workers_settled(self) -> bool:
        """Every worker of this round has timed a step: its start-up (interpreter, torch import,
        model, a joiner's state) is over."""
        links, group = self.channel.links, self.group
        return group is not None and all(
            (lk := links.get(pid)) is not None and lk.step_s is not None
            for pid in group.workers if pid not in group.held)

    def _crash_hold_s(self) -> float:
        """How long a worker killed by a signal is held for torchpassd to rebuild it in place: under a
        model-aware TorchPass job, the orchestrator's decision time; otherwise 0 (torchrun's rule:
        the round fails at once). Transparent jobs register no state to rebuild a rank from."""
        return self.timeouts.decision if self.spec.job and not movable.transparent() else 0.0

    def _remote_failure(self, rnd: int, nnodes: int) -> Callable[[], Awaitable[str | None]]:
        """A coroutine function the supervisor calls each tick: another node's failure report."""
        loop = asyncio.get_running_loop()
        last = [loop.time()]
        warned: list[bool] = []

        async def check() -> str | None:
            if nnodes == 1 or loop.time() - last[0] < _FAILURE_POLL:
                return None
            last[0] = loop.time()
            try:
                return await self._store(self.rdzv.failure, rnd)
            except Exception as exc:  # any store error means its host (node rank 0's agent) is gone
                if self.spec.job:  # under an orchestrator a lost node is its to recover from (unplanned)
                    if not warned:
                        warned.append(True)
                        self._log.warning("agent.store_unreachable", error=str(exc))
                    return None
                return f"rendezvous store unreachable ({exc})"
        return check

    def _final(self, outcome: Outcome) -> int:
        if outcome.signal is not None:
            return 128 + outcome.signal
        line = f"launchpad: {outcome.describe()} on node {self.node}"
        if outcome.failed is not None:
            code = outcome.failed[1]
            line += f" (run {self.spec.run_id}); other workers were stopped"
            print(line, file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
        print(line + "; local workers were stopped", file=sys.stderr, flush=True)
        return 1


def run(spec: LaunchSpec, config: Config) -> int:
    """Run one launchpad agent to completion and return its exit code (also each srun python task's
    that handed itself over to it)."""
    agent = Agent(spec, config)
    try:
        import uvloop
    except ImportError:
        code = asyncio.run(agent.main())
    else:
        code = uvloop.run(agent.main())
    if agent.desk is not None:
        agent.desk.release(code)
    return code
