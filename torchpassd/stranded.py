"""Ranks left interrupted with nobody lost: a collective failed (timed out, or was cut) while every
node of the job lives, e.g. during a migration that rolled back, so no death is decided and no
recovery comes for them; left alone they wait for ever (a hung job). ``StrandedWatch`` says, per
job, when its interrupted ranks have waited out a grace with nothing of the job running; the
orchestrator then re-forms the job in place (reroute.py's recovery with nobody lost, on the path it
has): registered ranks resume from their just-in-time state, unregistered ones cannot, and the job
ends with the reason instead of hanging."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torchpass_common.worker_state import WorkerState


class StrandedWatch:
    """Since when each job has had interrupted workers while no migration or recovery of it ran."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s  # the failure detector's time to find a node dead first
        self._since: dict[str, float] = {}

    def due(self, job: str, workers: Iterable[dict[str, Any]], now: float, busy: bool) -> list[int]:
        """The interrupted ranks of ``job`` once they have waited ``grace_s`` with nothing of the job
        running (``busy``: a migration, recovery or reroute of it runs or waits), else []. Answered
        once: the clock starts again."""
        ranks = sorted(int(w["rank"]) for w in workers if w.get("state") == WorkerState.INTERRUPTED)
        if busy or not ranks:
            self._since.pop(job, None)
            return []
        since = self._since.setdefault(job, now)
        if now - since < self.grace_s:
            return []
        del self._since[job]
        return ranks

    def forget(self, job: str) -> None:
        self._since.pop(job, None)
