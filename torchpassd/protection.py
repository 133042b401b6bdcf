"""Which migration protects a job, decided from what its workers did rather than guessed: the mode
asked at sbatch (aware, transparent, auto: a bare ``--torchpass``) against whether each worker
called ``torchpass.register(save, load)`` and whether it started movable (as its launchpad's
heartbeats say). ``decide`` is a pure function, asked before any spare is taken; ``Announcer``
puts one ``torchpass:`` line into the job's output when the answer is first known and when it changes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from slurm_plugin.model import AUTO, AWARE, TRANSPARENT
from torchpass_common.rank_ranges import span

AWAITING = "waiting for the workers' first step (whether they registered save/load decides the mode)"
NO_LAUNCHPAD = ("no launchpad of the job has reported: a `srun torchrun` step starts one a node (a step of "
                "`srun python`, one task a rank, is not protected yet)")


@dataclass(frozen=True)
class Protection:
    """``flow``: AWARE or TRANSPARENT, or "" when no migration can protect the job now (``why``
    says why and what to do); ``known``: the workers have shown what they do (each took a step)."""

    flow: str
    why: str
    known: bool = True

    def describe(self) -> str:
        """One line for operators and the job's output."""
        if not self.known:
            return f"unknown yet: {self.why}"
        return f"{self.flow}: {self.why}" if self.flow else f"not protected: {self.why}"


def decide(mode: str, workers: Iterable[dict[str, Any]]) -> Protection:
    """The protection of a job run with ``--torchpass=mode`` whose workers reported ``workers``
    (heartbeat entries: rank, step, registered, movable; exited ones do not count)."""
    live = [w for w in workers if "exit_code" not in w and not w.get("joining")]  # joiners: a move under way
    if not live or any(int(w.get("step") or 0) < 1 for w in live):
        return Protection("", AWAITING, known=False)
    unregistered = sorted(int(w["rank"]) for w in live if not w.get("registered"))
    registered = sorted(int(w["rank"]) for w in live if w.get("registered"))
    unmovable = sorted(int(w["rank"]) for w in live if not w.get("movable"))
    if mode == AWARE or (mode == AUTO and registered):  # model-aware: every rank's state must be there
        if not unregistered:
            return Protection(AWARE, "every rank registered save/load: its state moves to the spare")
        did = f"ranks {span(registered)} did, " if registered else ""
        advice = ("register in every rank for a model-aware move, or in none for a transparent one" if mode == AUTO
                  else "register in every rank, or submit with a bare --torchpass or --torchpass=transparent to "
                       "move the processes whole")
        return Protection("", f"ranks {span(unregistered)} never called torchpass.register(save, load) ({did}a "
                              f"model-aware move needs every rank's state), so a drain leaves the job where it is; "
                              f"{advice}")
    if unmovable:
        return Protection("", f"ranks {span(unmovable)} were not started movable (their launchpad could "
                              "not give them a PID namespace of their own), so criu cannot move them; see "
                              "the launchpad log on their node")
    if mode in (TRANSPARENT, AUTO):  # auto here: no rank registered
        return Protection(TRANSPARENT, "the worker processes move whole with criu (no code change needed)")
    return Protection("", f"unknown --torchpass mode {mode!r}")


class Announcer:
    """Says each job's protection in its output once known, and again when it changes. Fed every
    heartbeat, which only notes whether a node's workers changed in what decides it; ``tick`` (once
    a heartbeat interval) decides again for the jobs so noted: a job of thousands of nodes whose
    workers all take their first step in the same second is decided once, not once a node."""

    def __init__(self, decide_for: Callable[[str], Protection], tell: Callable[[str, str], Awaitable[None]]) -> None:
        self.decide_for = decide_for  # job -> its protection now
        self.tell = tell  # (job, text): one line in the job's output
        self.said: dict[str, Protection] = {}
        self._facts: dict[tuple[str, str], tuple[tuple[Any, ...], ...]] = {}
        self._changed: set[str] = set()
        self._telling: dict[str, asyncio.Task[None]] = {}  # job -> its line being told

    def on_heartbeat(self, job: str, node: str, body: dict[str, Any]) -> None:
        workers = body.get("workers")
        facts = tuple(sorted((str(w.get("rank")), bool(w.get("registered")), bool(w.get("movable")),
                              int(w.get("step") or 0) >= 1, bool(w.get("joining")))
                             for w in (workers if isinstance(workers, list) else []) if isinstance(w, dict)))
        if self._facts.get((job, node)) != facts:
            self._facts[(job, node)] = facts
            self._changed.add(job)

    def tick(self) -> None:
        changed, self._changed = self._changed, set()
        for job in changed:
            self._decide(job)

    async def said_first(self, job: str) -> None:
        """Decide ``job`` now and wait until its protection line is in its output (or failed):
        what protects a job comes before any line saying why it is not protected right now."""
        self._changed.discard(job)
        self._decide(job)
        if (task := self._telling.get(job)) is not None:
            await asyncio.shield(task)

    def _decide(self, job: str) -> None:
        now = self.decide_for(job)
        if not now.known or self.said.get(job) == now:
            return
        self.said[job] = now
        how = f"protected by {now.flow} migration: {now.why}" if now.flow else f"not protected: {now.why}"
        before = self._telling.get(job)

        async def tell() -> None:
            if before is not None:  # in the order decided
                await asyncio.shield(before)
            await self.tell(job, f"job {job} is {how}")
        task = asyncio.create_task(tell())
        self._telling[job] = task
        task.add_done_callback(lambda t: self._telling.pop(job, None) if self._telling.get(job) is t else None)

    def job_ended(self, job: str) -> None:
        self.said.pop(job, None)
        self._changed.discard(job)
        for key in [k for k in self._facts if k[0] == job]:
            del self._facts[key]
