"""Jobs left without progress while every node of theirs lives, so that no death is decided and no
recovery comes for them. ``StrandedWatch``: ranks left interrupted (a collective failed: timed
out, or was cut, e.g. during a migration that rolled back) that have waited out a grace with
nothing of the job running; the orchestrator re-forms the job in place (reroute.py's recovery with
nobody lost, on the path it has, every rank's collectives cut): registered ranks resume from their
just-in-time state, unregistered ones cannot, and the job ends with the reason instead of hanging.
``StallWatch``: a job that, after a migration, recovery or reroute of it ended, completes no step
for STALL_STEPS of its step times; the orchestrator says so in the job's output and its history
and does nothing more (a long evaluation looks the same from here): its ranks waiting in a
collective are interrupted at the collective's timeout and become stranded ones. Both are pure:
the caller brings the clock."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torchpass_common.worker_state import WorkerState

STALL_STEPS = 5  # no step for this many of its step times after a change: stalled
SETTLED_STEPS = 3  # steps completed after a change that show the job goes on: watched no longer


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


@dataclass
class _Watched:
    since: float  # the job's last progress (or the end of its change)
    first: int  # its step when the change ended
    last: int  # the last step seen


class StallWatch:
    """Each job, from the end of every change of it (it was busy, it is no longer) until it
    completed SETTLED_STEPS steps: stalled when it completes none for STALL_STEPS of its typical
    step time (its rate while nothing ran), never sooner than ``floor_s``."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._busy: set[str] = set()
        self._watched: dict[str, _Watched] = {}
        self._step_s: dict[str, float] = {}  # job -> its step time when last steady

    def limit(self, job: str) -> float:
        """How long ``job`` may complete no step after a change before it is stalled."""
        return max(self.floor_s, STALL_STEPS * self._step_s.get(job, 0.0))

    def due(self, job: str, workers: Iterable[dict[str, Any]], steps_per_s: float, now: float, busy: bool) -> bool:
        """Whether ``job`` (its workers' heartbeat entries, its launchpads' best step rate) is
        stalled now. Answered once: watched no longer then."""
        workers = list(workers)
        if busy:
            self._busy.add(job)
            self._watched.pop(job, None)
            return False
        live = [w for w in workers if "exit_code" not in w]
        ending = not live or len(live) < len(workers)  # a worker exited: the job ends, steps stop
        step = max((int(w.get("step") or 0) for w in live), default=0)
        if job in self._busy:
            self._busy.discard(job)
            if not ending:
                self._watched[job] = _Watched(now, step, step)
            return False
        watched = self._watched.get(job)
        if watched is None:
            if steps_per_s > 0:
                self._step_s[job] = 1.0 / steps_per_s
            return False
        if ending or step >= watched.first + SETTLED_STEPS:
            del self._watched[job]
            return False
        if step > watched.last or any(w.get("state") == WorkerState.INTERRUPTED for w in live):
            watched.last, watched.since = max(step, watched.last), now  # interrupted: StrandedWatch's
            return False
        if now - watched.since < self.limit(job):
            return False
        del self._watched[job]
        return True

    def forget(self, job: str) -> None:
        self._busy.discard(job)
        self._watched.pop(job, None)
        self._step_s.pop(job, None)
