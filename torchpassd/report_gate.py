"""Which launchpad reports torchpassd believes. The broker lets a job's account publish only under
that job's topics, so a report's job is its sender's; the node a report names is vouched for by
no one. The gate admits a state, heartbeat or ack about (job, node) only when Slurm shows that
TorchPass job running on that node, or the job's own running migration brings the node in or takes
it out, and at most ``rate`` reports a second per node. A report Slurm has not confirmed yet (a job
that started after the last poll) is held until a newer Slurm snapshot decides it; one that the
newer snapshot still contradicts is refused. Every refusal is logged (who, what, why) and counted.
It decides nothing else: the registry, the failure detector and the health watch only ever see
what it admitted. A launchpad's goodbye (an offline state) on a node its job had is believed even
after Slurm shows the node gone. A state report refused because its job no longer runs is handed
to ``stale``: the launchpad left it retained on the broker, where nothing else would ever remove it."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from slurm_plugin.model import Snapshot
from torchpass_common import log, protocol
from torchpass_common.rate_limit import RateLimit
from torchpassd.metrics import Counter

RATE = 50.0  # reports a second per node, sustained (a heartbeat a second and a migration's acks)
BURST = 200.0
HOLD_MAX = 1024  # reports held for Slurm's confirmation, over all nodes
KEEP_MAX = 4096  # rate buckets and log throttles kept before the idle ones are forgotten
LOG_EVERY_S = 10.0  # a refusal repeated for the same node and reason is logged once per this


class ReportGate:
    """``snapshot()``: Slurm's latest view (None before the first poll); ``moving(job)``: the nodes
    a running migration of the job brings in or takes out; ``refused``: the refusals metric
    (label ``reason``); ``stale(job, node)``: a state report about a job Slurm shows no longer
    running was refused (the caller clears what the broker retained)."""

    def __init__(self, snapshot: Callable[[], Snapshot | None], moving: Callable[[str], Collection[str]],
                 refused: Counter, stale: Callable[[str, str], None], *, rate: float = RATE, burst: float = BURST,
                 hold_max: int = HOLD_MAX, clock: Callable[[], float] = time.monotonic) -> None:
        self.snapshot, self.moving, self.refused, self.stale = snapshot, moving, refused, stale
        self.rate, self.hold_max, self.clock = rate, hold_max, clock
        self._rate = RateLimit(rate, burst, keep=KEEP_MAX, clock=clock)
        # (job, node, kind) -> (the latest such report, the snapshot it was judged against); in arrival order
        self._held: dict[tuple[str, str, str], tuple[protocol.Message, Snapshot | None]] = {}
        self._jobs: tuple[Snapshot | None, dict[str, frozenset[str]]] = (None, {})
        self._had: set[tuple[str, str]] = set()  # (job, node) pairs Slurm vouched for
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}
        self._log = log.get()

    def admit(self, node: str, msg: protocol.Message) -> list[protocol.Message]:
        """The reports to act on now because ``msg`` arrived from ``node``'s topic: none (held or
        refused), or the reports held for this job and node followed by ``msg``."""
        if not self._rate.allow((msg.job, node)):  # per job and node: a flood sent in another job's
            # name cannot starve the reports of the node's own job
            self._refuse(msg.job, node, msg.kind, "rate",
                         f"more than {self.rate:.0f} reports a second about this node")
            return []
        snap = self.snapshot()
        if self._vouched(snap, msg.job, node):
            self._had.add((msg.job, node))
        elif self._goodbye(node, msg):
            return [msg]  # and nothing held about the node: Slurm did not vouch for that
        else:
            self._hold(node, msg, snap)
            return []
        earlier = [self._held.pop(k)[0] for k in [k for k in self._held if k[:2] == (msg.job, node)]]
        return [*earlier, msg]

    def release(self) -> list[tuple[str, protocol.Message]]:
        """Decide the held reports a newer Slurm snapshot can decide: ``(node, report)`` for those
        it confirms (in arrival order); those it contradicts are refused."""
        snap = self.snapshot()
        out: list[tuple[str, protocol.Message]] = []
        for key, (msg, seen) in list(self._held.items()):
            job, node, _ = key
            if self._vouched(snap, job, node):
                self._had.add((job, node))
                out.append((node, self._held.pop(key)[0]))
            elif snap is not None and snap is not seen:
                del self._held[key]
                if job in self._jobs[1]:
                    self._refuse(job, node, msg.kind, "not_in_job",
                                 f"Slurm shows TorchPass job {job} running, but not on {node}")
                else:  # most often a retained report its launchpad left behind
                    self._refuse(job, node, msg.kind, "job_not_running",
                                 f"Slurm shows no running TorchPass job {job}", level="info")
                    if msg.kind == protocol.STATE:
                        self.stale(job, node)
        return out

    def forget(self, job: str) -> None:
        """The job ended: its held reports can no longer be confirmed."""
        for key in [k for k in self._held if k[0] == job]:
            del self._held[key]
        self._had = {k for k in self._had if k[0] != job}

    # ---- the checks ----------------------------------------------------------------------------
    def _vouched(self, snap: Snapshot | None, job: str, node: str) -> bool:
        if node in self.moving(job):
            return True
        if snap is None:
            return False
        if self._jobs[0] is not snap:
            self._jobs = (snap, {str(j): frozenset(v.nodes) for j, v in snap.torchpass_jobs().items()})
        return node in self._jobs[1].get(job, ())

    def _goodbye(self, node: str, msg: protocol.Message) -> bool:
        """A launchpad going offline on a node its job had (it left the job, Slurm already shows
        it gone): believed, as it can only make torchpassd count on that node less."""
        return (msg.job, node) in self._had and msg.kind == protocol.STATE and not msg.body.get("online")

    def _hold(self, node: str, msg: protocol.Message, snap: Snapshot | None) -> None:
        key = (msg.job, node, msg.kind)
        self._held.pop(key, None)  # the latest report of a kind replaces the one held
        self._held[key] = (msg, snap)
        while len(self._held) > self.hold_max:
            (job, old, kind), _ = next(iter(self._held.items()))
            del self._held[(job, old, kind)]
            self._refuse(job, old, kind, "held_overflow",
                         f"more than {self.hold_max} reports wait for Slurm to confirm their job and node")

    def _refuse(self, job: str, node: str, kind: str, reason: str, why: str, level: str = "warning") -> None:
        self.refused.inc(reason=reason)
        now = self.clock()
        if len(self._logged) > KEEP_MAX:
            self._logged = {k: v for k, v in self._logged.items() if now - v[0] < LOG_EVERY_S}
        last, quiet = self._logged.get((node, reason), (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self._logged[(node, reason)] = (last, quiet + 1)
            return
        self._logged[(node, reason)] = (now, 0)
        getattr(self._log, level)("report.refused", sender=f"the broker account of job {job}", job=job, node=node,
                          kind=kind, reason=reason, why=why, refused_since_last_log=quiet)
