"""The spare pool: the nodes of the spare reservation (default ``torchpass_spares``), whether each
is usable right now (a drained, down, failed or busy spare is not a spare), and taking one for a
migration so that two migrations never get the same node."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Node, Snapshot
from torchpass_common import log
from torchpass_common.errors import SlurmError


@dataclass(frozen=True)
class Spare:
    node: str
    available: bool
    why: str = ""  # why it is not available; empty when it is
    state: str = ""


def spare_problem(node: Node | None, name: str, users: list[int]) -> str:
    """Why node ``name`` of the reservation cannot be used as a spare now ("" = it can); ``users``:
    the active jobs on it."""
    if node is None:
        return "unknown to slurmctld"
    if node.down:
        return "down" + (f": {node.reason}" if node.reason else "")
    if node.not_responding:
        return "not responding"
    if "DRAIN" in node.flags:
        return "drained" + (f": {node.reason}" if node.reason else "")
    if not node.healthy:
        return node.describe()
    if users or not node.idle:
        return "in use" + (f" by job {', '.join(map(str, users))}" if users else f" ({node.state})")
    return ""


def spares_of(snap: Snapshot, reservation: str) -> list[Spare]:
    """Every node of ``reservation`` with its availability (empty when there is no such reservation)."""
    resv = snap.reservations.get(reservation)
    if resv is None:
        return []
    spares = set(resv.nodes)
    users: dict[str, list[int]] = {}  # spare -> active jobs on it, one pass over the jobs' nodes
    for j in sorted(snap.jobs.values(), key=lambda j: j.job_id):
        for name in spares.intersection(j.nodes) if j.active else ():
            users.setdefault(name, []).append(j.job_id)
    out = []
    for name in resv.nodes:
        node = snap.nodes.get(name)
        why = "reservation not active" if not resv.active else spare_problem(node, name, users.get(name, []))
        out.append(Spare(name, not why, why, node.describe() if node else "?"))
    return out


class SparePool:
    """Spares of one reservation, read through ``client``; ``take`` hands each out once."""

    def __init__(self, client: SlurmClient, reservation: str = "torchpass_spares") -> None:
        self.client = client
        self.reservation = reservation
        self._taken: set[str] = set()
        self._lock = threading.Lock()

    def list(self, snap: Snapshot | None = None) -> list[Spare]:
        spares = spares_of(snap or self.client.snapshot(), self.reservation)
        with self._lock:
            self._taken &= {s.node for s in spares if s.available}  # used or gone: forget
        return [Spare(s.node, False, "taken for a migration", s.state) if s.node in self._taken else s
                for s in spares]

    def take(self, *, job: int | None = None) -> str:
        """Reserve an available spare for a migration of ``job`` and return its name."""
        spares = self.list()
        with self._lock:
            for spare in spares:
                if spare.available and spare.node not in self._taken:
                    self._taken.add(spare.node)
                    log.get(job=job).info("spare.taken", node=spare.node, reservation=self.reservation)
                    return spare.node
        detail = "; ".join(f"{s.node}: {s.why}" for s in spares) or "the reservation has no nodes"
        raise SlurmError(f"no usable spare in reservation {self.reservation!r} ({detail})", job=job,
                         hint="resume or add nodes: scontrol update reservationname="
                              f"{self.reservation} nodes=...")

    def give_back(self, node: str) -> None:
        """Return a spare that was taken but not used (the migration was rolled back)."""
        with self._lock:
            self._taken.discard(node)

    def settled(self, node: str) -> None:
        """``node`` now belongs to a job: from here slurmctld's state ("in use by job J") keeps it
        from other migrations, and once that job ends the node is a spare again. Without this the
        pool would hold it as taken for as long as it never saw the node in use."""
        with self._lock:
            self._taken.discard(node)
