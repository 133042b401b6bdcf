"""What the adapter knows about Slurm, as plain frozen records: nodes, jobs, reservations, and a
snapshot of all three taken in one poll. Backends build these; the watcher, the spare pool and
the CLI read them. Node health and "is this a TorchPass job" are decided here, in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Node flags that make a node unfit to run (or receive) training ranks.
UNHEALTHY_FLAGS = frozenset({"DRAIN", "NOT_RESPONDING", "FAIL", "MAINTENANCE", "POWERED_DOWN",
                             "POWERING_DOWN", "POWER_DOWN", "REBOOT_REQUESTED", "REBOOT_ISSUED"})
BUSY_STATES = frozenset({"allocated", "mixed", "completing"})
ACTIVE_JOB_STATES = frozenset({"RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING"})

# The mode whose workers are moved whole by criu: they register no save/load, so a lost rank cannot
# be rebuilt (only planned drains move them).
AWARE, TRANSPARENT, AUTO = "aware", "transparent", "auto"  # auto: torchpassd picks from what the workers did
TORCHPASS_MODES = (AWARE, TRANSPARENT, AUTO)
# A job is a TorchPass job when its comment (or admin comment) carries the marker that
# spank/cli_filter.lua writes for --torchpass / --torchpass-spares. Slurm 22.05 shows slurmctld's
# clients neither the SPANK job environment nor the submit line, so the comment is the carrier.
_COMMENT_MARK = re.compile(rf"\btorchpass:mode=({'|'.join(TORCHPASS_MODES)})\b(?:,spares=(\d+))?")


@dataclass(frozen=True)
class Node:
    """One node as slurmctld sees it. ``state`` is the base state in lower case (idle, mixed,
    allocated, down, ...); ``flags`` the state flags (DRAIN, NOT_RESPONDING, RESERVED, ...)."""

    name: str
    state: str
    flags: frozenset[str] = frozenset()
    reason: str = ""
    reason_by: str = ""
    reason_time: int = 0
    addr: str = ""

    @property
    def down(self) -> bool:
        return self.state == "down"

    @property
    def draining(self) -> bool:
        """Drain requested while jobs still run on the node."""
        return "DRAIN" in self.flags and self.state in BUSY_STATES

    @property
    def drained(self) -> bool:
        """Drain requested and the node is empty."""
        return "DRAIN" in self.flags and self.state not in BUSY_STATES

    @property
    def not_responding(self) -> bool:
        return "NOT_RESPONDING" in self.flags

    @property
    def failed(self) -> bool:
        return "FAIL" in self.flags

    @property
    def healthy(self) -> bool:
        """Fit to run training ranks: up, responding, not drained, failed or in maintenance."""
        return not self.down and self.state != "unknown" and not (self.flags & UNHEALTHY_FLAGS)

    @property
    def idle(self) -> bool:
        return self.state == "idle"

    def describe(self) -> str:
        """``mixed+DRAIN`` style, for tables and messages."""
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True)
class TorchPassFlags:
    """How a job asked to run under TorchPass."""

    mode: str = "auto"
    spares: int = 0


@dataclass(frozen=True)
class Job:
    """One job as slurmctld sees it. ``nodes`` are expanded node names, in Slurm's order."""

    job_id: int
    name: str
    user: str
    state: str
    nodes: tuple[str, ...] = ()
    batch_host: str = ""
    partition: str = ""
    comment: str = ""
    admin_comment: str = ""
    resize_time: int = 0
    start_time: int = 0  # epoch seconds; the same across resizes, new when a job id is used again

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_JOB_STATES

    @property
    def torchpass(self) -> TorchPassFlags | None:
        """The job's TorchPass flags, or None when it is not a TorchPass job."""
        for text in (self.comment, self.admin_comment):
            m = _COMMENT_MARK.search(text or "")
            if m:
                return TorchPassFlags(mode=m.group(1), spares=int(m.group(2) or 0))
        return None


@dataclass(frozen=True)
class Reservation:
    name: str
    nodes: tuple[str, ...] = ()
    state: str = ""
    users: tuple[str, ...] = ()  # users allowed to run in it (empty: given by accounts instead)

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"


@dataclass(frozen=True)
class Snapshot:
    """Everything one poll saw. ``taken_at`` is time.monotonic() at the poll."""

    nodes: dict[str, Node] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    taken_at: float = 0.0

    def torchpass_jobs(self) -> dict[int, Job]:
        """Active jobs that run under TorchPass."""
        return {j.job_id: j for j in self.jobs.values() if j.active and j.torchpass is not None}
