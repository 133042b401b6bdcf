"""The one interface through which TorchPass reads slurmctld: ``SlurmClient``. Backends
(commands, slurmrestd, pyslurm) implement its three reads; everything else (the watcher, the
spare pool, the CLI) is written against it. Calls block: asyncio code runs them in a thread
(``Watcher.events()`` does; ``await asyncio.to_thread(...)`` for the rest)."""

from __future__ import annotations

import abc
import time

from slurm_plugin.model import Job, Node, Reservation, Snapshot


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
        """Nodes, jobs and reservations from one poll."""
        return Snapshot(nodes=self.nodes(), jobs=self.jobs(), reservations=self.reservations(),
                        taken_at=time.monotonic())

    def job(self, job_id: int) -> Job | None:
        return self.jobs().get(int(job_id))
