"""torchpassd's straggler policy (opt-in: ``[straggler] enabled``): a node whose ranks want
``ratio`` times the CPU a step that the job's other nodes want (their median), for ``steps`` of its
steps in a row, has its ranks migrated like a drain, with the reason "straggler: ..." in the
history, the journal and the ``torchpass_stragglers_total`` metric; at most once per job per
``cooldown`` seconds. The signal is each rank's wanted CPU per step (torchpass/busy_time.py) as
launchpad's heartbeats carry it (``busy_s`` per worker): a node counts with its slowest rank.

The rule is a pure function (``is_slow``); ``StragglerWatch`` keeps the per-node history and
asks the orchestrator to migrate. It does not pick a spare or move anything (the planned flow does)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchpass_common import log
from torchpass_common.config import StragglerConfig
from torchpassd.journal import Journal
from torchpassd.metrics import Counter

STALE_S = 10.0  # a node's last report older than this is left out of the job's median
MigrateFn = Callable[[str, str, str], None]  # (job, node, reason)


def others_median(busy: Mapping[str, float], node: str) -> float:
    """The median of the other nodes' ``busy`` (0 when there is no other node)."""
    others = [v for n, v in busy.items() if n != node]
    return statistics.median(others) if others else 0.0


def is_slow(busy: Mapping[str, float], node: str, ratio: float) -> bool:
    """``node`` wants at least ``ratio`` times the CPU a step of the median of the other nodes (a
    job needs two nodes with a positive median to compare)."""
    median = others_median(busy, node)
    return median > 0 and busy[node] >= ratio * median


@dataclass(frozen=True)
class Straggler:
    """A decision: ``node``'s ranks of ``job`` are to move."""

    job: str
    node: str
    busy_s: float
    median_s: float
    steps: int

    @property
    def reason(self) -> str:
        return (f"straggler: the ranks on {self.node} wanted {self.busy_s * 1e3:.1f} ms of CPU a step, "
                f"{self.busy_s / self.median_s:.1f}x the job's other nodes ({self.median_s * 1e3:.1f} ms), "
                f"for {self.steps} steps")


@dataclass
class _Seen:
    busy_s: float
    step: int
    at: float


class StragglerWatch:
    """One per torchpassd; fed every heartbeat (``on_heartbeat``)."""

    def __init__(self, cfg: StragglerConfig, journal: Journal, *, migrate: MigrateFn, counter: Counter) -> None:
        self.cfg, self.journal, self.migrate, self.counter = cfg, journal, migrate, counter
        self._seen: dict[str, dict[str, _Seen]] = {}  # job -> node -> its last report
        self._slow_from: dict[str, dict[str, int]] = {}  # job -> node -> its step when it became slow
        self._acted_at: dict[str, float] = {}  # job -> when its last straggler was migrated
        self._log = log.get()

    async def on_heartbeat(self, job: str, node: str, body: dict[str, Any],
                           now: float | None = None) -> Straggler | None:
        """Take ``node``'s report; the decision it led to, if any (the migration is asked for)."""
        if not self.cfg.enabled:
            return None
        workers = [w for w in body.get("workers") or () if isinstance(w, dict)]
        busy = [w["busy_s"] for w in workers if isinstance(w.get("busy_s"), int | float)]
        steps = [w["step"] for w in workers if isinstance(w.get("step"), int)]
        if not busy or not steps:
            return None
        now = time.monotonic() if now is None else now
        seen = self._seen.setdefault(job, {})
        seen[node] = _Seen(float(max(busy)), min(steps), now)
        fresh = {n: s.busy_s for n, s in seen.items() if now - s.at <= STALE_S}
        slow_from = self._slow_from.setdefault(job, {})
        if not is_slow(fresh, node, self.cfg.ratio):  # only the sender is judged: O(nodes) a heartbeat
            slow_from.pop(node, None)
            return None
        since = slow_from.setdefault(node, seen[node].step)
        cooling = now - self._acted_at[job] < self.cfg.cooldown if job in self._acted_at else False
        if seen[node].step - since < self.cfg.steps or cooling:
            return None
        decision = Straggler(job, node, fresh[node], others_median(fresh, node), seen[node].step - since)
        self._acted_at[job] = now
        slow_from.clear()
        await self._act(decision)
        return decision

    async def _act(self, d: Straggler) -> None:
        self._log.warning("straggler.decision", job=d.job, node=d.node, busy_s=d.busy_s, median_s=d.median_s,
                          steps=d.steps, action="migrate")
        self.counter.inc()
        self.migrate(d.job, d.node, d.reason)
        detail = {"node": d.node, "busy_s": d.busy_s, "median_s": d.median_s, "steps": d.steps, "reason": d.reason}
        await asyncio.to_thread(self.journal.add_event, "straggler.decision", job_id=d.job, detail=detail)

    def job_ended(self, job: str) -> None:
        for table in (self._seen, self._slow_from, self._acted_at):
            table.pop(job, None)
