"""Changing a running job's nodes and launching work on them: grow a job by a spare (a helper
``salloc --no-shell --dependency=expand:J`` as the job's user, let into the spare reservation for
that moment, merged by ``scontrol update jobid=HELPER NumNodes=0``), start a step on one node
(``srun --no-kill --overlap --torchpass``), release a node (never the batch host), hot spares.
Needs SchedulerParameters=permit_job_expansion, and slurmdbd for repeated shrinks."""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from slurm_plugin import hostlist
from slurm_plugin.backends.commands import parse_oneliner
from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Job
from slurm_plugin.runner import SlurmRunner
from slurm_plugin.spares import SparePool
from torchpass_common import log
from torchpass_common.errors import SlurmError

_GRANTED = re.compile(r"Granted job allocation (\d+)")
SETTLE_TIMEOUT = 10.0  # seconds for slurmctld to show a resize it has acknowledged
# A node released from a job revokes the job's credential on that node's slurmd; a step of the same
# job launched there within the same second carries a credential no newer than the revocation and is
# refused ("Job credential revoked"). A node that comes back to the job it left waits this long.
REJOIN_GUARD_S = 2.0


class GrantLog(Protocol):
    """Where a grant of the spare reservation to a job's user is recorded while it lasts
    (torchpassd's journal): a crash between letting the user in and out is undone at the next
    start (JobResizer.reconcile_grants) instead of leaving the user in the reservation."""

    def grant_opened(self, reservation: str, user: str, job_id: str) -> None: ...

    def grant_closed(self, reservation: str, user: str, job_id: str) -> None: ...

    def open_grants(self) -> list[tuple[str, str, str]]: ...


class JobResizer:
    """Resizes jobs of one cluster. ``runner`` runs the commands, ``client`` reads the result,
    ``grants`` (if given) records each reservation grant while it lasts."""

    def __init__(self, runner: SlurmRunner, client: SlurmClient, *,
                 spare_reservation: str = "torchpass_spares", grants: GrantLog | None = None) -> None:
        self.runner = runner
        self.client = client
        self.spare_reservation = spare_reservation
        self.grants = grants
        self._released: dict[tuple[int, str], float] = {}  # (job, node) -> when it left the job (monotonic)

    def _job(self, job_id: int) -> Job:
        job = self.client.job(job_id)
        if job is None or not job.active:
            raise SlurmError(f"job {job_id} is not running ({job.state if job else 'unknown to slurmctld'})",
                             job=job_id)
        return job

    def _settle(self, job_id: int, done: str, ok: Callable[[Job], bool]) -> Job:
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            job = self._job(job_id)
            if ok(job):
                return job
            if time.monotonic() > deadline:
                raise SlurmError(f"slurmctld accepted the resize but job {job_id} still runs on "
                                 f"{hostlist.compress(job.nodes)} after {SETTLE_TIMEOUT:.0f} s ({done})",
                                 job=job_id)
            time.sleep(0.1)

    def add_node(self, job_id: int, node: str) -> Job:
        """Grow running job ``job_id`` by ``node`` (a node of the spare reservation)."""
        job = self._job(job_id)
        if node in job.nodes:
            return job
        where = {"job": job_id, "node": node}
        name = f"torchpass-expand-{job_id}"
        argv = ["salloc", "--no-shell", f"--dependency=expand:{job_id}", "-N1", "-w", node,
                f"--reservation={self.spare_reservation}", f"--job-name={name}", "--immediate=20"]
        if job.partition:
            argv.append(f"--partition={job.partition}")
        t0 = time.monotonic()
        try:
            with self._reservation_access(job.user, where):
                out = self.runner.run(argv, user=job.user, with_stderr=True, **where)
        except SlurmError:
            self._cancel_helpers(name, job.user)
            raise
        m = _GRANTED.search(out)
        if not m:
            self._cancel_helpers(name, job.user)
            raise SlurmError(f"salloc gave no job id for the helper allocation: {out.strip()!r}", **where)
        helper = int(m.group(1))
        with tempfile.TemporaryDirectory() as cwd:  # scontrol may drop slurm_job_*_resize.sh files here
            try:
                self.runner.run(["scontrol", "update", f"jobid={helper}", "NumNodes=0"], cwd=cwd, **where)
            except SlurmError:
                self.runner.run(["scancel", str(helper)], **where)
                raise
        job = self._settle(job_id, f"adding {node}", lambda j: node in j.nodes)
        log.get(job=job_id).info("slurm.job_grown", node=node, helper=helper,
                                 seconds=round(time.monotonic() - t0, 3), nodes=hostlist.compress(job.nodes))
        return job

    @contextlib.contextmanager
    def _reservation_access(self, user: str, where: dict[str, object]) -> Iterator[None]:
        """Let ``user`` allocate in the spare reservation for the helper allocation (the helper
        must belong to the job's user, and spare reservations are normally root-only)."""
        resv = self.client.reservations().get(self.spare_reservation)
        if resv is None:
            raise SlurmError(f"spare reservation {self.spare_reservation!r} does not exist",
                             hint=f"scontrol create reservation reservationname={self.spare_reservation} "
                                  "nodes=... users=root starttime=now duration=infinite flags=ignore_jobs",
                             **where)
        if user == "root" or user in resv.users or not resv.users:
            yield
            return
        job = str(where["job"])
        if self.grants is not None:
            self.grants.grant_opened(self.spare_reservation, user, job)
        self.runner.run([*self._reservation_update(), f"Users+={user}"], **where)
        try:
            yield
        finally:
            self._revoke(user, job)

    def _reservation_update(self) -> list[str]:
        return ["scontrol", "update", f"reservationname={self.spare_reservation}"]

    def _revoke(self, user: str, job: str) -> None:
        """Take ``user`` out of the spare reservation (granted for job ``job``) and close the
        grant; a failure is logged and the grant left open for the next reconcile."""
        try:
            self.runner.run([*self._reservation_update(), f"Users-={user}"], job=job)
        except SlurmError as exc:
            log.get(job=job).warning("slurm.reservation_revoke_failed", user=user, error=str(exc))
            return
        if self.grants is not None:
            self.grants.grant_closed(self.spare_reservation, user, job)

    def reconcile_grants(self) -> list[tuple[str, str]]:
        """Undo grants a previous run left open (it stopped between letting a job's user into the
        spare reservation and out): cancel the job's helper allocation, if any, and take the user
        out if Slurm still lists them. Returns the (user, job) pairs undone."""
        if self.grants is None:
            return []
        undone = []
        for reservation, user, job in self.grants.open_grants():
            if reservation != self.spare_reservation:
                continue
            self._cancel_helpers(f"torchpass-expand-{job}", user)
            try:
                resv = self.client.reservations().get(reservation)
            except SlurmError as exc:  # kept open: the next start tries again
                log.get(job=job).warning("slurm.stale_grant_unknown", user=user, error=str(exc))
                continue
            if resv is not None and user in resv.users:
                self._revoke(user, job)
            else:
                self.grants.grant_closed(reservation, user, job)
            log.get(job=job).warning("slurm.stale_grant_undone", user=user, reservation=reservation)
            undone.append((user, job))
        return undone

    def _cancel_helpers(self, name: str, user: str) -> None:
        try:
            self.runner.run(["scancel", f"--name={name}", f"--user={user}"])
        except SlurmError as exc:
            log.get().warning("slurm.helper_cancel_failed", name=name, error=str(exc))

    def add_spare(self, job_id: int, pool: SparePool) -> str:
        """Take a spare from ``pool``, grow the job by it, and return its name (the spare goes
        back to the pool if Slurm refuses; once the job holds it, Slurm's state guards it)."""
        node = pool.take(job=job_id)
        try:
            self.add_node(job_id, node)
        except SlurmError:
            pool.give_back(node)
            raise
        pool.settled(node)
        return node

    def release_node(self, job_id: int, node: str) -> Job:
        """Shrink running job ``job_id`` so it no longer holds ``node``; its other nodes and the
        steps on them keep running. The batch host cannot be released (a Slurm rule)."""
        job = self._job(job_id)
        if node not in job.nodes:
            return job
        if node == job.batch_host:
            raise SlurmError(f"{node} is the batch host of job {job_id}; Slurm cannot remove it from the job",
                             job=job_id, node=node,
                             hint="keep training ranks off the batch host (run them in steps on the other "
                                  "nodes) or start the job with salloc, which has no batch script")
        keep = [n for n in job.nodes if n != node]
        if not keep:
            raise SlurmError(f"{node} is the last node of job {job_id}; releasing it would end the job",
                             job=job_id, node=node)
        with tempfile.TemporaryDirectory() as cwd:
            self.runner.run(["scontrol", "update", f"jobid={job_id}", f"NodeList={hostlist.compress(keep)}"],
                            cwd=cwd, job=job_id, node=node)
        return self._left(job_id, node, "releasing", "slurm.node_released")

    def evict_node(self, job_id: int, node: str, reason: str) -> Job:
        """Take a dead ``node`` out of job ``job_id`` the way Slurm takes a failed node: set it DOWN
        (with ``reason``), so slurmctld removes it from the --no-kill job and tells the job's sruns
        that its tasks are gone ("Node failure"; srun still exits 0 when every other task did). A
        shrink instead would leave srun waiting for the dead node's tasks for ever. The node stays
        DOWN until an operator resumes it. The batch host cannot leave (a Slurm rule)."""
        job = self._job(job_id)
        if node not in job.nodes:
            return job
        if node == job.batch_host:
            raise SlurmError(f"{node} is the batch host of job {job_id}; Slurm ends the job with it",
                             job=job_id, node=node, hint="keep training ranks off the batch host")
        self._set_down(job_id, node, reason)
        return self._left(job_id, node, "evicting", "slurm.node_evicted")

    def _set_down(self, job_id: int, node: str, reason: str) -> None:
        self.runner.run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"],
                        job=job_id, node=node)

    def requeue(self, job_id: int, node: str, reason: str) -> None:
        """Give the job back to Slurm's queue (``scontrol requeue``): its processes end and it runs
        again from the start of its batch script, i.e. from its last checkpoint. The dead ``node``
        is set DOWN first (with ``reason``) so the new run is not placed on it."""
        self._set_down(job_id, node, reason)
        self.runner.run(["scontrol", "requeue", str(job_id)], job=job_id)
        log.get(job=job_id).warning("slurm.job_requeued", node=node, reason=reason)

    def _left(self, job_id: int, node: str, doing: str, event: str) -> Job:
        """Until ``node`` is out of the job; remembered for the re-join guard."""
        job = self._settle(job_id, f"{doing} {node}", lambda j: node not in j.nodes)
        now = time.monotonic()
        self._released = {k: t for k, t in self._released.items() if now - t < REJOIN_GUARD_S}
        self._released[(job_id, node)] = now
        log.get(job=job_id).info(event, node=node, nodes=hostlist.compress(job.nodes))
        return job

    def start_step(self, job_id: int, node: str, argv: Sequence[str], *, mode: str = "auto",
                   extra_env: Mapping[str, str] | None = None, job_output: bool = False, chdir: str = "",
                   **popen: object) -> subprocess.Popen:
        """Start ``argv`` as a one-task step of job ``job_id`` on ``node``, as the job's user, under
        TorchPass (shim first on PATH), with --no-kill and --overlap (it may share CPUs with the
        job's long-running training step). ``job_output``: the task's stdout/stderr are appended to
        the job's own output files (written on ``node``: they must be on a file system it shares with
        the batch host, as job output usually is), so a rank that moved keeps reaching them.
        ``chdir``: the task's working directory on ``node`` (srun --chdir; where it is missing,
        Slurm starts the task in /tmp). Returns the srun process; the caller waits for it."""
        job = self._job(job_id)
        if node not in job.nodes:
            raise SlurmError(f"{node} is not part of job {job_id} ({hostlist.compress(job.nodes)})",
                             job=job_id, node=node, hint="add it first (JobResizer.add_node)")
        left = self._released.pop((job_id, node), None)
        if left is not None and (wait := left + REJOIN_GUARD_S - time.monotonic()) > 0:
            log.get(job=job_id).info("slurm.rejoin_wait", node=node, seconds=round(wait, 2))
            time.sleep(wait)
        cmd = ["srun", f"--jobid={job_id}", "-w", node, "-N1", "-n1", "--no-kill", "--overlap",
               f"--torchpass={mode}", *([f"--chdir={chdir}"] if chdir else []),
               *(self._output_options(job_id) if job_output else ()), "--", *argv]
        log.get(job=job_id).info("slurm.step_start", node=node, argv=list(argv))
        return self.runner.popen(cmd, user=job.user, extra_env=extra_env, **popen)

    def _output_options(self, job_id: int) -> list[str]:
        """srun options appending a step's output to the job's StdOut/StdErr files (none known: none)."""
        record = parse_oneliner(self.runner.run(["scontrol", "-o", "show", "job", str(job_id)]).strip())
        out, err = record.get("StdOut", ""), record.get("StdErr", "")
        if not out.startswith("/"):
            return []
        opts = ["--open-mode=append", f"--output={out}"]
        if err.startswith("/") and err != out:
            opts.append(f"--error={err}")
        return opts
