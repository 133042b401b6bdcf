"""Active abort on this node (the ``sever`` command): once torchpassd decided a peer node of the job
lost, each local worker that has stopped making progress (it waits in a collective with the lost
ranks, or is about to) has its collectives cut at once (torchpass/severing.py), so it reaches its
just-in-time checkpoint now instead of at the backend's timeout (gloo's 30 s, NCCL's watchdog).
A worker still completing steps is left alone and watched for the rest of the window: it is cut
the moment it stalls; if it completes ALIVE_STEPS more steps, every rank answered its
collectives, the lost node's ranks are alive (torchpassd stands down) and it is not cut.
Owns the stall rule and the watch, not the decision (torchpassd/unplanned.py) nor the cut."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from launchpad.channel import ChannelServer, WorkerLink, patience
from torchpass_common import agent_channel as ac
from torchpass_common import log
from torchpass_common.errors import ProtocolError
from torchpass_common.worker_state import WorkerState

STALL_FLOOR_S = 0.5  # never stalled sooner than this after its last step report
STALL_STEPS = 3  # ... nor sooner than this many of its own step times
ALIVE_STEPS = 2  # steps completed after the decision that show its collectives are answered
WATCH_POLL_S = 0.1
_NOT_CUT = frozenset({WorkerState.INTERRUPTED, WorkerState.EXITED, WorkerState.JOINED, WorkerState.REFORMED})


def stalled(now: float, step_at: float, step_s: float | None, floor: float) -> bool:
    """A worker whose last step report (at ``step_at``) is older than ``floor`` and than
    STALL_STEPS of its typical step time ``step_s`` (None: not known yet) makes no progress."""
    return now - step_at > patience(step_s, floor, STALL_STEPS)


def _seconds(args: dict[str, Any], name: str, default: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ProtocolError(f"sever's {name!r} must be a number of seconds >= 0, got {value!r}")
    return float(value)


class StallWatch:
    """The ``sever`` command of one launchpad; a new command replaces the previous watch."""

    def __init__(self, channel: ChannelServer, node: str) -> None:
        self.channel = channel
        self.node = node
        self._watch: asyncio.Task[None] | None = None
        self._log = log.get(node=node)

    def _candidates(self) -> list[WorkerLink]:
        """Workers of the running generation that could sit in one of its collectives."""
        return [lk for lk in self.channel.links.values()
                if lk.connected and not lk.joining and not lk.recovering and lk.state not in _NOT_CUT]

    async def sever(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """``lost``: the nodes torchpassd decided lost (for the workers' logs); ``stalled_s``: the
        stall floor; ``watch_s``: how long to keep watching the workers still progressing; ``all``:
        cut every worker now (a worker of the job surely died: no collective can complete)."""
        lost = args.get("lost") or []
        if not isinstance(lost, list) or not all(isinstance(n, str) for n in lost):
            raise ProtocolError(f"sever's 'lost' must be a list of node names, got {lost!r}")
        floor, window = _seconds(args, "stalled_s", STALL_FLOOR_S), _seconds(args, "watch_s", 30.0)
        reason = f"torchpassd decided {', '.join(lost) or 'a peer node'} lost ({migration})"
        now = time.monotonic()
        links = self._candidates()
        everyone = args.get("all", False)
        if not isinstance(everyone, bool):
            raise ProtocolError(f"sever's 'all' must be true or false, got {everyone!r}")
        cut = [lk for lk in links if everyone or stalled(now, lk.step_at, lk.step_s, floor)]
        await self._cut(cut, reason)
        progressing = [lk for lk in links if lk not in cut]
        if self._watch is not None:
            self._watch.cancel()
        if progressing:
            self._watch = asyncio.create_task(self._keep_watching(progressing, floor, now + window, reason))
        self._log.warning("stall_watch.severed", lost=lost, severed=sorted(lk.rank for lk in cut),
                          watching=sorted(lk.rank for lk in progressing))
        return {"severed": sorted(lk.rank for lk in cut), "watching": sorted(lk.rank for lk in progressing)}

    async def _cut(self, links: list[WorkerLink], reason: str) -> None:
        async def one(lk: WorkerLink) -> None:
            with contextlib.suppress(ConnectionError):  # it exited meanwhile: nothing to free
                await lk.chan.send(ac.message(ac.SEVER, reason=reason))
        await asyncio.gather(*(one(lk) for lk in links))

    async def _keep_watching(self, links: list[WorkerLink], floor: float, until: float, reason: str) -> None:
        """Cut each of ``links`` that stalls before ``until``; stop watching one that completed
        ALIVE_STEPS steps meanwhile or left the running generation."""
        start = {lk.pid: lk.step for lk in links}
        while links and time.monotonic() < until:
            await asyncio.sleep(WATCH_POLL_S)
            now = time.monotonic()
            candidates = self._candidates()
            links = [lk for lk in links if lk in candidates and lk.step < start[lk.pid] + ALIVE_STEPS]
            cut = [lk for lk in links if stalled(now, lk.step_at, lk.step_s, floor)]
            if cut:
                self._log.warning("stall_watch.stalled_later", severed=sorted(lk.rank for lk in cut))
                await self._cut(cut, reason)
                links = [lk for lk in links if lk not in cut]
