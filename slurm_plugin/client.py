"""The one interface through which TorchPass reads slurmctld: ``SlurmClient``. Backends
(commands, slurmrestd, pyslurm) implement its three reads; everything else (the watcher, the
spare pool, the CLI) is written against it. Calls block: asyncio code runs them in a thread
(``Watcher.events()`` does; ``await asyncio.to_thread(...)`` for the rest)."""

from __future__ import annotations

import abc
import time

from slurm_plugin.model import Job, Node, Reservation, Snapshot
from torchpass_common import log
from torchpass_common.errors import SlurmError

# Slurm's words for a failure that passes (slurmctld busy, restarting, or a connection lost).
TRANSIENT = ("Socket timed out", "Unable to contact slurm controller", "Resource temporarily unavailable",
             "Zero Bytes were transmitted", "Connection refused", "Connection reset", "try again",
             "did not finish within")
SNAPSHOT_TRIES = 4  # a transient failure is tried again after 0.25, 0.5, 0.75 s ...
SNAPSHOT_BUDGET = 10.0  # ... while the poll has taken less than this many seconds


def transient(exc: SlurmError) -> bool:
    """Is ``exc`` a failure that passes, worth trying again at once?"""
    return any(words.lower() in str(exc).lower() for words in TRANSIENT)


class SlurmClient(abc.ABC):
    """Read-only view of one Slurm cluster. ``name`` says which backend it is and ``reason``
    why it was chosen (shown by ``torchpassctl`` and logged at start-up)."""

    name: str = "?"
    reason: str = ""

    @abc.abstractmethod
    def nodes(self) -> dict[str, Node]:
        """All nodes, by name."""

    @abc.abstractmethod
    def jobs(self) -> dict[int, Job]:
        """All jobs slurmctld still knows (finished ones until MinJobAge), by id."""

    @abc.abstractmethod
    def reservations(self) -> dict[str, Reservation]:
        """All reservations, by name."""

    def snapshot(self) -> Snapshot:
        """Nodes, jobs and reservations from one poll. A transient failure is tried again within
        the poll; only one that lasts (or any other) raises SlurmError."""
        t0, tries = time.monotonic(), 0
        while True:
            tries += 1
            try:
                return Snapshot(nodes=self.nodes(), jobs=self.jobs(), reservations=self.reservations(),
                                taken_at=time.monotonic())
            except SlurmError as exc:
                if not transient(exc) or tries >= SNAPSHOT_TRIES or time.monotonic() - t0 > SNAPSHOT_BUDGET:
                    raise
                log.get(backend=self.name).info("slurm.retry", error=str(exc), tries=tries)
                time.sleep(0.25 * tries)

    def job(self, job_id: int) -> Job | None:
        return self.jobs().get(int(job_id))
