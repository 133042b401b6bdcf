"""The scale benchmark's stand-in for slurmctld (bench/scale.py): a SIMULATED Slurm cluster of racks
of trays with spares in the spare reservation and TorchPass jobs over the other trays, served
through the real ``SlurmClient`` interface, and a SlurmRunner that refuses every command. Drains are
injected by writing a JSON file ``{node: reason}``. Only the benchmark uses it; it is not a backend."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Job, Node, Reservation
from slurm_plugin.runner import SlurmRunner
from torchpass_common.errors import SlurmError

SPARE_RESERVATION = "torchpass_spares"
FIRST_JOB = 1000


@dataclass(frozen=True)
class Topology:
    """``racks`` x ``trays`` nodes; the last ``spares_per_rack`` trays of each rack are spares; each
    job spans ``job_racks`` consecutive racks (its compute trays), one rank per node."""

    racks: int = 64
    trays: int = 18
    spares_per_rack: int = 2
    job_racks: int = 8

    def __post_init__(self) -> None:
        if not (0 <= self.spares_per_rack < self.trays) or self.racks < 1 or not (1 <= self.job_racks <= self.racks):
            raise SlurmError(f"impossible simulated topology {self}",
                             hint="need 0 <= spares_per_rack < trays and 1 <= job_racks <= racks")

    @staticmethod
    def node(rack: int, tray: int) -> str:
        return f"r{rack:02d}t{tray:02d}"

    @property
    def size(self) -> int:
        return self.racks * self.trays

    def spares(self) -> list[str]:
        return [self.node(r, t) for r in range(self.racks) for t in range(self.trays - self.spares_per_rack, self.trays)]

    def jobs(self) -> dict[int, list[str]]:
        """Job id -> its nodes (racks left over after the last whole job run no job)."""
        compute = self.trays - self.spares_per_rack
        return {FIRST_JOB + j: [self.node(r, t) for r in range(j * self.job_racks, (j + 1) * self.job_racks)
                                for t in range(compute)]
                for j in range(self.racks // self.job_racks)}

    def as_dict(self) -> dict[str, int]:
        return {"racks": self.racks, "trays": self.trays, "spares_per_rack": self.spares_per_rack,
                "job_racks": self.job_racks}


class SimulatedSlurm(SlurmClient):
    """Answers like slurmctld would for ``topology``; nodes named in ``drains_file`` are draining."""

    name = "simulated"
    reason = "bench/scale.py: simulated cluster (stand-in for slurmctld)"

    def __init__(self, topology: Topology, drains_file: Path) -> None:
        self.topology = topology
        self.drains_file = Path(drains_file)
        self._drains_seen: tuple[float, dict[str, str]] = (-1.0, {})
        job_nodes = topology.jobs()
        busy = {n for nodes in job_nodes.values() for n in nodes}
        self._nodes = {}
        for r in range(topology.racks):
            for t in range(topology.trays):
                name = topology.node(r, t)
                self._nodes[name] = Node(name, "allocated" if name in busy else "idle",
                                         addr=f"10.{100 + r // 250}.{r % 250}.{10 + t}")
        self._jobs = {jid: Job(jid, f"train-{jid}", "bench", "RUNNING", tuple(nodes), batch_host=nodes[0],
                               partition="main", comment="torchpass:mode=aware")
                      for jid, nodes in job_nodes.items()}
        self._resv = {SPARE_RESERVATION: Reservation(SPARE_RESERVATION, tuple(topology.spares()), "ACTIVE")}

    def _drains(self) -> dict[str, str]:
        try:
            mtime = os.stat(self.drains_file).st_mtime
        except FileNotFoundError:
            return {}
        if mtime != self._drains_seen[0]:
            self._drains_seen = (mtime, json.loads(self.drains_file.read_text() or "{}"))
        return self._drains_seen[1]

    def nodes(self) -> dict[str, Node]:
        drains = self._drains()
        if not drains:
            return self._nodes
        out = dict(self._nodes)
        for name, reason in drains.items():
            if name in out:
                out[name] = replace(out[name], flags=frozenset({"DRAIN"}), reason=reason, reason_by="root",
                                    reason_time=int(time.time()))
        return out

    def jobs(self) -> dict[int, Job]:
        return self._jobs

    def reservations(self) -> dict[str, Reservation]:
        return self._resv


class RefusingRunner(SlurmRunner):
    """No Slurm commands in a simulation: the job expansion after the decision fails, and the
    migration rolls back; the benchmark measures the decision only."""

    def run(self, argv: Any, **kwargs: Any) -> str:
        raise SlurmError(f"simulated cluster: `{' '.join(argv)}` is not run",
                         hint="bench/scale.py measures decisions, not job resizes")

    def popen(self, argv: Any, **kwargs: Any) -> Any:
        raise SlurmError(f"simulated cluster: `{' '.join(argv)}` is not started")


def write_drains(path: Path, drains: dict[str, str]) -> None:
    """Replace the drain list atomically (the simulated slurmctld may read it at any time)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(drains))
    os.replace(tmp, path)
