"""The progress watchdog of a model-aware TorchPass job's workers on this node: a worker that
neither completes a step nor answers a ping for max(HUNG_FLOOR_S, HUNG_STEPS x its step time)
is frozen (SIGSTOP, a thread holding the interpreter lock forever, a process the kernel stopped):
it is killed, so it becomes a crashed worker that the group holds and torchpassd rebuilds in
place (group.py, torchpassd/unplanned.py), instead of every peer waiting out the collective
timeout and the job failing. A worker that answers pings while its steps stall waits on a peer
(every rank of a collective stalls together): that is the lost peer's business, not its own.
Owns the rule and the pings; the answer comes from the worker's reader thread (torchpass/agent.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from launchpad.channel import ChannelServer, WorkerLink, patience
from launchpad.group import WorkerGroup
from torchpass_common import agent_channel as ac
from torchpass_common import log
from torchpass_common.worker_state import WorkerState

HUNG_FLOOR_S = 3.0
HUNG_STEPS = 5
PING_EVERY_S = 1.0


def hung_after(step_s: float | None) -> float:
    """Seconds without a step and without an answer after which a worker is frozen."""
    return patience(step_s, HUNG_FLOOR_S, HUNG_STEPS)


def frozen(now: float, link: WorkerLink, since: float) -> float | None:
    """How long ``link``'s worker has been frozen, or None while it steps or answers; ``since``:
    when it was last seen entering the running state (pings go to running workers only, so a
    worker that was parked or interrupted meanwhile is judged from then on)."""
    limit = hung_after(link.step_s)
    quiet = now - max(link.step_at, link.pong_at, since)
    return quiet if quiet > limit else None


class Watchdog:
    """Pings this node's running workers every PING_EVERY_S and kills the frozen ones."""

    def __init__(self, channel: ChannelServer, group: WorkerGroup) -> None:
        self.channel, self.group = channel, group
        self.running_since: dict[int, float] = {}  # pid -> when this stretch of running began
        self._log = log.get(node=group.spec.node)

    def _watched(self) -> list[WorkerLink]:
        return [lk for lk in self.channel.links.values()
                if lk.connected and lk.state == WorkerState.RUNNING and (w := self.group.workers.get(lk.pid))
                is not None and w.returncode is None]

    async def run(self) -> None:
        while True:
            links = self._watched()
            now = time.monotonic()
            self.running_since = {lk.pid: self.running_since.get(lk.pid, now) for lk in links}
            for lk in links:
                with contextlib.suppress(ConnectionError):
                    await lk.chan.send(ac.message(ac.PING))
            for lk in links:
                if (quiet := frozen(now, lk, self.running_since[lk.pid])) is not None:
                    self._log.error("watchdog.frozen", rank=lk.rank, pid=lk.pid, quiet_s=round(quiet, 1),
                                    step=lk.step, step_s=lk.step_s, action="killed; its rank is rebuilt in place")
                    await self.group.kill_frozen(lk.pid, quiet)
            await asyncio.sleep(PING_EVERY_S)
