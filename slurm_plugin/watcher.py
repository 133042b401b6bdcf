"""The watcher: polls slurmctld through a SlurmClient (default every second) and turns what
changed between two snapshots into typed events about TorchPass jobs, their nodes and the spares.
A poll that fails is logged and retried; the first poll reports what is already true."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Mapping

from slurm_plugin import events as ev
from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Job, Node, Snapshot, TorchPassFlags
from slurm_plugin.spares import spares_of
from torchpass_common import log
from torchpass_common.errors import SlurmError

# (predicate on a node, event type): an event fires when the predicate turns true.
_NODE_CONDITIONS: tuple[tuple[str, type[ev.NodeEvent]], ...] = (
    ("draining", ev.NodeDraining),
    ("drained", ev.NodeDrained),
    ("not_responding", ev.NodeNotResponding),
    ("down", ev.NodeDown),
    ("failed", ev.NodeFailed),
)


def _node_events(name: str, old: Node | None, new: Node, jobs: tuple[int, ...], at: float) -> list[ev.SlurmEvent]:
    out: list[ev.SlurmEvent] = []
    for attr, kind in _NODE_CONDITIONS:
        if getattr(new, attr) and not (old is not None and getattr(old, attr)):
            out.append(kind(at, name, jobs, new.reason, new.reason_by))
    if old is not None and not old.healthy and new.healthy:
        out.append(ev.NodeReturned(at, name, jobs))
    return out


def _job_events(old: dict[int, Job], new: dict[int, Job], all_new: dict[int, Job], at: float) -> list[ev.SlurmEvent]:
    out: list[ev.SlurmEvent] = []
    for jid, job in new.items():
        prev = old.get(jid)
        if prev is None:
            flags = job.torchpass or TorchPassFlags()
            out.append(ev.JobStarted(at, jid, job.nodes, job.user, flags.mode, flags.spares, job.batch_host,
                                      job.start_time))
        elif prev.nodes != job.nodes:
            added = tuple(n for n in job.nodes if n not in prev.nodes)
            removed = tuple(n for n in prev.nodes if n not in job.nodes)
            out.append(ev.JobResized(at, jid, job.nodes, added, removed))
    for jid, prev in old.items():
        if jid not in new:
            gone = all_new.get(jid)
            out.append(ev.JobEnded(at, jid, prev.nodes, gone.state if gone else "GONE"))
    return out


def diff(old: Snapshot | None, new: Snapshot, spare_reservation: str,
         left: Mapping[str, Iterable[int]] | None = None) -> list[ev.SlurmEvent]:
    """Events for what changed from ``old`` to ``new`` (``old`` None: the first poll). ``left``:
    nodes that left TorchPass jobs unhealthy, still watched, with the jobs they left."""
    at = new.taken_at
    old_jobs = old.torchpass_jobs() if old else {}
    new_jobs = new.torchpass_jobs()
    out = _job_events(old_jobs, new_jobs, new.jobs, at)

    jobs_on: dict[str, set[int]] = {n: set(jobs) for n, jobs in (left or {}).items()}
    for jobs in (old_jobs, new_jobs):
        for job in jobs.values():
            for n in job.nodes:
                jobs_on.setdefault(n, set()).add(job.job_id)
    old_spares = {s.node: s for s in spares_of(old, spare_reservation)} if old else {}
    new_spares = {s.node: s for s in spares_of(new, spare_reservation)}
    for name in sorted(set(jobs_on) | set(old_spares) | set(new_spares)):
        node = new.nodes.get(name)
        if node is not None:
            prev = old.nodes.get(name) if old else None
            out.extend(_node_events(name, prev, node, tuple(sorted(jobs_on.get(name, ()))), at))

    for name, spare in new_spares.items():
        was = old_spares.get(name)
        if spare.available and not (was and was.available):
            out.append(ev.SpareAdded(at, name))
        elif not spare.available and was and was.available:
            out.append(ev.SpareRemoved(at, name, spare.why))
    for name, was in old_spares.items():
        if name not in new_spares and was.available:
            out.append(ev.SpareRemoved(at, name, f"no longer in reservation {spare_reservation}"))
    return out


class Watcher:
    """Polls ``client`` every ``interval`` seconds; ``poll()`` for one round, ``events()`` forever."""

    def __init__(self, client: SlurmClient, *, interval: float = 1.0,
                 spare_reservation: str = "torchpass_spares") -> None:
        self.client = client
        self.interval = interval
        self.spare_reservation = spare_reservation
        self.last: Snapshot | None = None
        # Nodes taken out of a running TorchPass job while unhealthy, and those jobs: watched until
        # healthy again. (Slurm drops a failing node from a --no-kill job as it turns it DOWN; the
        # commands backend reads jobs and nodes one after the other, so a snapshot can show the node
        # gone from the job before it shows it down: without this, that NodeDown was never seen.)
        self.left: dict[str, set[int]] = {}
        self.log = log.get(backend=client.name)

    @property
    def jobs(self) -> dict[int, Job]:
        """The TorchPass jobs seen at the last poll, with their nodes."""
        return self.last.torchpass_jobs() if self.last else {}

    def poll(self) -> list[ev.SlurmEvent]:
        """Take one snapshot and return the events since the previous one (raises SlurmError)."""
        snap = self.client.snapshot()
        found = diff(self.last, snap, self.spare_reservation, self.left)
        self._track_left(found, snap)
        self.last = snap
        for e in found:
            self.log.info("slurm.event", kind=type(e).__name__, **_fields(e))
        return found

    def _track_left(self, found: list[ev.SlurmEvent], snap: Snapshot) -> None:
        for e in found:
            if isinstance(e, ev.JobResized):
                for n in e.removed:
                    self.left.setdefault(n, set()).add(e.job)
        in_jobs = {n for job in snap.torchpass_jobs().values() for n in job.nodes}
        for n in list(self.left):
            node = snap.nodes.get(n)
            if n in in_jobs or node is None or node.healthy:
                del self.left[n]

    async def events(self) -> AsyncIterator[ev.SlurmEvent]:
        """Poll forever (in a worker thread) and yield each event; failed polls are retried."""
        failures = 0
        while True:
            started = time.monotonic()
            try:
                found = await asyncio.to_thread(self.poll)
                failures = 0
            except SlurmError as exc:
                failures += 1
                self.log.warning("slurm.poll_failed", error=str(exc), failures=failures)
                found = []
            for e in found:
                yield e
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def _fields(e: ev.SlurmEvent) -> dict[str, object]:
    return {k: v for k, v in vars(e).items() if k != "detected_at" and v not in ("", (), None)}
