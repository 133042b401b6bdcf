"""The job registry: which TorchPass jobs run, on which nodes, and what each node's launchpad
last said (online or not, its workers' ranks, steps, states and pids, heartbeat age). Fed by
Slurm events and by MQTT state/heartbeat messages; waiters are woken on every change. It keeps
no history (the journal does) and makes no decisions (planned.py and daemon.py do)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torchpass_common import log, protocol, rank_ranges
from torchpass_common.errors import MigrationError, ProtocolError
from torchpassd import protection

T = TypeVar("T")
STANDBY_STATES = ("ready", "starting", "none")  # a launchpad's warm standby, as its heartbeats say


@dataclass
class Launchpad:
    """One node's launchpad as the control plane shows it."""

    node: str
    online: bool = False
    gen: int = 0
    workers: list[dict[str, Any]] = field(default_factory=list)
    last_heartbeat: float | None = None  # time.monotonic()
    pid: int = 0  # the launchpad process on its node (from its state messages)
    links: dict[str, Any] = field(default_factory=dict)  # its network links, as last reported
    path: str = ""  # the network interface its workers' collectives take ("" not reported)
    standby: str = ""  # its warm standby: ready, starting or none ("" not reported)
    hot_spare: bool = False  # a node of the job's allocation that runs no rank: it waits to take a lost node's
    # Step rate estimate: (monotonic time, max step) of the previous heartbeat.
    _prev: tuple[float, int] | None = None
    steps_per_s: float = 0.0

    @property
    def max_step(self) -> int:
        return max((w["step"] for w in self.workers), default=0)

    def heartbeat_age(self, now: float | None = None) -> float | None:
        if self.last_heartbeat is None:
            return None
        return (now or time.monotonic()) - self.last_heartbeat


@dataclass
class JobView:
    """One tracked job: Slurm's view (user, nodes, batch host) plus its launchpads."""

    job_id: str
    user: str = ""
    mode: str = "auto"
    nodes: tuple[str, ...] = ()
    batch_host: str = ""
    launchpads: dict[str, Launchpad] = field(default_factory=dict)
    blocked: str = ""  # why a wanted migration cannot start (e.g. no spare), for operators
    replicas: dict[int, list[int]] = field(default_factory=dict)  # rank -> ranks holding the same state
    emptied: set[str] = field(default_factory=set)  # nodes still in the job whose ranks moved away (the batch host)

    def launchpad(self, node: str) -> Launchpad:
        return self.launchpads.setdefault(node, Launchpad(node))

    @property
    def path(self) -> str:
        """The interface the job's collectives take, as most of its online launchpads report it
        ("" when none reports one: the job's backends choose)."""
        paths = [lp.path for lp in self.launchpads.values() if lp.online and lp.path]
        return max(sorted(set(paths)), key=paths.count) if paths else ""

    def ranks_on(self, node: str) -> list[int]:
        lp = self.launchpads.get(node)
        return sorted(w["rank"] for w in lp.workers) if lp else []

    def hot_spares(self) -> list[str]:
        """Nodes of the job's allocation whose launchpad, online, runs no rank and waits to take a
        lost node's (``--torchpass-spares``); warm ones (standby ready) first."""
        spares = [lp for n, lp in self.launchpads.items()
                  if lp.online and lp.hot_spare and not lp.workers and (not self.nodes or n in self.nodes)]
        return [lp.node for lp in sorted(spares, key=lambda lp: (lp.standby != "ready", lp.node))]

    def without_replica(self) -> list[int]:
        """Ranks whose state no other rank holds (pure FSDP, tensor parallel): a node death loses them."""
        return sorted(r for r, holders in self.replicas.items() if holders == [r])

    def replicas_on_one_node(self) -> list[int]:
        """Ranks whose every copy is on their own node (a pipeline stage whose data-parallel ranks
        share a node): a lost worker can be rebuilt, a node death loses them."""
        node = {w["rank"]: lp.node for lp in self.launchpads.values() for w in lp.workers}
        return sorted(r for r, holders in self.replicas.items()
                      if r in node and len(holders) > 1 and {node.get(h) for h in holders} == {node[r]})

    def unplanned(self) -> str:
        """What unplanned recovery can do for this job, as its workers reported their layout."""
        if not self.replicas:
            return "layout not reported yet"
        alone = self.without_replica()
        if alone:
            return (f"unplanned: no replica of ranks {rank_ranges.span(alone)}, falls back to requeue "
                    "(the job restarts from its last checkpoint)")
        copies = f"every rank has a replica (at least {min(len(h) for h in self.replicas.values())} copies)"
        if shared := self.replicas_on_one_node():
            return (f"unplanned: {copies}, but every copy of ranks {rank_ranges.span(shared)} is on their own "
                    "node: a lost worker is rebuilt, a node death there falls back to requeue")
        return f"unplanned: {copies}"

    def protection(self) -> protection.Protection:
        """Which migration protects the job now, from what the workers of its online launchpads did."""
        if not self.launchpads:
            return protection.Protection("", protection.NO_LAUNCHPAD, known=False)
        return protection.decide(self.mode, [w for lp in self.launchpads.values() if lp.online for w in lp.workers])

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"job": self.job_id, "user": self.user, "mode": self.mode, "nodes": list(self.nodes),
                "protection": self.protection().describe(),
                "batch_host": self.batch_host, "blocked": self.blocked, "unplanned": self.unplanned(),
                "path": self.path,
                "launchpads": {n: {"online": lp.online, "gen": lp.gen, "workers": lp.workers,
                                   "heartbeat_age": None if lp.last_heartbeat is None
                                   else round(lp.heartbeat_age(now) or 0.0, 3),
                                   "steps_per_s": round(lp.steps_per_s, 2), "links": lp.links, "path": lp.path,
                                   "standby": lp.standby, "hot_spare": lp.hot_spare}
                               for n, lp in sorted(self.launchpads.items())}}


class Registry:
    """All tracked jobs, by Slurm job id (as a string, the control plane's job name)."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobView] = {}
        self._changed = asyncio.Condition()

    def job(self, job_id: str) -> JobView:
        return self.jobs.setdefault(job_id, JobView(job_id))

    def forget(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def update_job(self, job_id: str, **fields: Any) -> JobView:
        view = self.job(job_id)
        for name, value in fields.items():
            setattr(view, name, value)
        await self._notify()
        return view

    async def on_message(self, node: str, msg: protocol.Message) -> None:
        """Apply a state or heartbeat message from ``node``'s launchpad."""
        lp = self.job(msg.job).launchpad(node)
        now = time.monotonic()
        if msg.kind == protocol.STATE:
            lp.online = bool(msg.body["online"])
            lp.gen = msg.gen
            lp.pid = int(msg.body.get("pid") or lp.pid)
            if not lp.online:
                lp.workers = []
        elif msg.kind == protocol.HEARTBEAT:
            lp.online, lp.gen, lp.workers, lp.last_heartbeat = True, msg.gen, list(msg.body["workers"]), now
            if isinstance(msg.body.get("links"), dict):
                lp.links = msg.body["links"]
            if isinstance(msg.body.get("path"), str):
                lp.path = msg.body["path"]
            if msg.body.get("standby") in STANDBY_STATES:
                lp.standby = msg.body["standby"]
            lp.hot_spare = msg.body.get("hot_spare") is True
            view = self.job(msg.job)
            for w in lp.workers:
                if "replicas" in w:
                    try:
                        view.replicas[w["rank"]] = rank_ranges.expand(w["replicas"])
                    except ProtocolError as exc:
                        log.get(job=msg.job, node=node).warning("registry.bad_replicas", rank=w["rank"], error=str(exc))
            if lp._prev is not None and now > lp._prev[0] and lp.max_step >= lp._prev[1]:
                lp.steps_per_s = (lp.max_step - lp._prev[1]) / (now - lp._prev[0])
            lp._prev = (now, lp.max_step)
        await self._notify()

    async def wait_for(self, check: Callable[[], T | None], timeout: float, what: str, **where: Any) -> T:
        """Wait until ``check()`` returns something other than None (re-checked on every change);
        MigrationError naming ``what`` after ``timeout`` seconds."""
        async def waiting() -> T:
            async with self._changed:
                while (value := check()) is None:
                    await self._changed.wait()
                return value
        try:
            return await asyncio.wait_for(waiting(), timeout)
        except TimeoutError:
            raise MigrationError(f"timed out after {timeout:.0f} s waiting for {what}", **where) from None
