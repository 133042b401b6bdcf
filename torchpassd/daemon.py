"""torchpassd's process: one asyncio (uvloop) loop running the Slurm watcher, the MQTT pump
(launchpad states, heartbeats, acks), the control socket, the metrics endpoint, sd_notify and
the Orchestrator, which turns drains and operator requests into planned migrations (one at a
time per job), waits for a spare when none is free, and on start finishes or rolls back what a
previous torchpassd left in flight. The migration steps themselves live in planned.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slurm_plugin import events as ev
from slurm_plugin import node_admin
from slurm_plugin.client import SlurmClient
from slurm_plugin.connect import open_client, runner_for
from slurm_plugin.model import TRANSPARENT, Snapshot
from slurm_plugin.resize import JobResizer
from slurm_plugin.runner import SlurmRunner
from slurm_plugin.spares import SparePool, spares_of
from slurm_plugin.watcher import Watcher
from torchpass_common import broker_check, log, mqtt, protocol
from torchpass_common.config import Config
from torchpass_common.errors import MigrationError, SlurmError, SpareFailed, TorchPassError
from torchpass_common.rank_ranges import span
from torchpass_common.worker_state import WorkerState
from torchpassd import (
    broker_auth,
    link_policy,
    planned,
    protection,
    reroute,
    sdnotify,
    transparent,
    unplanned,
)
from torchpassd import journal as jn
from torchpassd.commander import Commander
from torchpassd.control_socket import ControlServer
from torchpassd.failure_detect import Death, FailureDetector
from torchpassd.health_watch import HealthWatch
from torchpassd.metrics import Metrics, MetricsServer
from torchpassd.registry import JobView, Registry
from torchpassd.report_gate import ReportGate
from torchpassd.retained import RetainedStates
from torchpassd.straggler import StragglerWatch
from torchpassd.stranded import StallWatch, StrandedWatch

RETRY_AFTER_S = 5.0  # a rolled-back migration's first retry; each later one waits twice as long
RETRIES = 3  # retries of a rolled-back migration per incident (job, node); then it is given up


class Orchestrator:
    """Decides which migrations run: drains seen by the watcher and ``migrate`` requests become
    pending (job, node) pairs; each job runs at most one migration at a time."""

    def __init__(self, deps: planned.Deps, watcher: Watcher, control_up: Callable[[], bool] = lambda: True) -> None:
        self.d = deps
        self.watcher = watcher
        self.pending: dict[tuple[str, str], tuple[float, str]] = {}  # -> (wall time seen, reason)
        self.retry_at: dict[tuple[str, str], float] = {}
        self.failed_spares: dict[tuple[str, str], list[str]] = {}  # spares that could not take a node's ranks
        self.rollbacks: dict[tuple[str, str], int] = {}  # migrations of this incident that rolled back
        t = deps.cfg.timeouts  # a stranded rank (a stall) waits for the failure detector first
        grace = t.heartbeat_dead_after + 2 * t.heartbeat_interval
        self.stranded, self.stalls = StrandedWatch(grace), StallWatch(grace)
        self.active: dict[str, asyncio.Task[None]] = {}
        self.current: dict[str, planned.Flow] = {}  # job -> its running (or last) migration
        self.reroutes: dict[str, tuple[float, link_policy.Decision]] = {}  # job -> (wall time seen, the path wanted)
        self.unplanned = unplanned.Driver(self, control_up)  # dead nodes -> recoveries (#7)
        self.announcer = protection.Announcer(lambda job: self.d.registry.job(job).protection(), self.tell_job)
        self.log = log.get()

    # ---- inputs ------------------------------------------------------------------------------
    async def on_slurm(self, e: ev.SlurmEvent) -> None:
        self.unplanned.on_slurm(e)
        if isinstance(e, ev.JobStarted | ev.JobResized):
            view = await self.d.registry.update_job(str(e.job), nodes=tuple(e.nodes),
                                                    **({"user": e.user, "mode": e.mode, "batch_host": e.batch_host}
                                                       if isinstance(e, ev.JobStarted) else {}))
            await self._save_job(view)
        elif isinstance(e, ev.JobEnded):
            job = str(e.job)
            await self._abandon(job, e.state or "ENDED")
            self.d.registry.forget(job)
            for key in [k for k in self.pending if k[0] == job]:
                self.pending.pop(key)
            self.reroutes.pop(job, None)
            self.stranded.forget(job)
            self.stalls.forget(job)
            with contextlib.suppress(jn.JournalError):
                await asyncio.to_thread(self.d.journal.end_job, job, e.state or "ENDED")
        elif isinstance(e, ev.NodeDraining | ev.NodeDrained | ev.NodeFailed) and e.jobs:
            for job in e.jobs:
                if e.node in self.d.registry.job(str(job)).nodes:  # not one it already left
                    self.request(str(job), e.node, f"node {e.node} {type(e).__name__[4:].lower()}: {e.reason}")
        elif isinstance(e, ev.NodeReturned):
            for key in [k for k in self.pending if k[1] == e.node and k[0] not in self.active]:
                self.pending.pop(key)
                self.d.registry.job(key[0]).blocked = ""
            for key in [k for k in self.failed_spares if k[1] == e.node]:  # an incident given up is over
                self.failed_spares.pop(key)
                self.d.registry.job(key[0]).blocked = ""
        self.d.metrics.jobs_tracked.set(len(self.watcher.jobs))
        if self.watcher.last is not None:
            free = [s for s in spares_of(self.watcher.last, self.d.pool.reservation) if s.available]
            self.d.metrics.spares_free.set(len(free))
        self.kick()

    async def _abandon(self, job: str, state: str) -> None:
        """A job that ended while its migration had not handed anything over: stop the migration
        and record it (waiting for launchpads that are gone would only run into timeouts)."""
        task, mig = self.active.get(job), self.current.get(job)
        if task is None or mig is None or task.done() or not mig.before_hand_over():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.log.warning("migration.job_ended", job=job, migration=mig.id, phase=mig.last_phase, state=state)
        await mig.job_ended(state)

    def moving(self, job: str) -> set[str]:
        """The nodes the job's running migration or recovery brings in or takes out (their
        launchpads report before Slurm's next poll shows the change)."""
        task, flow = self.active.get(job), self.unplanned.running.get(job) or self.current.get(job)
        if flow is None or (job not in self.unplanned.running and (task is None or task.done())):
            return set()
        left, joined = flow.swapped()
        return {*left, *joined}

    def yield_to_recovery(self, death: Death) -> None:
        """``death.node`` died while a planned migration of its job runs off another node: before
        the hand-over the migration rolls back at once (without waiting for the dead node's
        answers), so the unplanned recovery can start; the drain stays pending and is tried again
        after it. After the hand-over the migration finishes or fails on its own."""
        task, mig = self.active.get(death.job), self.current.get(death.job)
        if (task is None or task.done() or not isinstance(mig, planned.PlannedMigration)
                or mig.plan.source == death.node or not mig.before_hand_over()
                or (isinstance(mig, transparent.TransparentMigration) and mig.plan.paused_step >= 0)):
            return
        self._spawn(death.job, self._preempt(task, mig, death))

    async def _preempt(self, task: asyncio.Task[None], mig: planned.PlannedMigration, death: Death) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        p = mig.plan
        if not death.in_place:  # a node whose workers crashed lives: its other ranks are resumed like any
            p.survivors = [n for n in p.survivors if n != death.node]
        what = f"ranks {list(death.ranks)} crashed on {death.node}" if death.in_place else f"{death.node} died"
        self.log.warning("migration.preempted", job=p.job, migration=mig.id, dead=death.node, phase=mig.last_phase)
        await mig.roll_back(f"{what} during the migration off {p.source}, before the hand-over: the job "
                            f"recovers from that first, then the move off {p.source} is tried again")

    def on_links(self, d: link_policy.Decision) -> None:
        """A decision of the link policy: move ``d.node``'s ranks (neither path left there), or
        reroute the job's collectives (kept until done, or until the job is on that path)."""
        if d.action == link_policy.MIGRATE:
            self.request(d.job, d.node, d.reason)
            return
        if self.d.registry.job(d.job).path == d.ifname:
            self.reroutes.pop(d.job, None)
            return
        if d.job not in self.reroutes:
            self.log.info("reroute.wanted", job=d.job, node=d.node, ifname=d.ifname, reason=d.reason)
        self.reroutes[d.job] = (self.reroutes.get(d.job, (time.time(), d))[0], d)
        self.kick()

    def request(self, job: str, node: str, reason: str) -> None:
        """Ask for ``node``'s ranks of ``job`` to move (kept until done or the node returns)."""
        if node in self.d.registry.job(job).emptied:
            self.log.info("migration.not_needed", job=job, node=node, reason=reason,
                          why="the node runs no ranks of the job any more (they moved away)")
            return
        if (job, node) not in self.pending:
            self.pending[(job, node)] = (time.time(), reason)
            self.failed_spares.pop((job, node), None)  # a new incident gets its own spares and tries
            self.rollbacks.pop((job, node), None)
            self.log.info("migration.wanted", job=job, node=node, reason=reason)
        self.kick()

    async def _save_job(self, view: JobView) -> None:
        await asyncio.to_thread(self.d.journal.upsert_job, view.job_id, user=view.user, mode=view.mode,
                                state="RUNNING", nodes=list(view.nodes), detail={"batch_host": view.batch_host})

    # ---- decisions ---------------------------------------------------------------------------
    def kick(self) -> None:
        """Start a migration for every pending pair whose job is idle and whose retry time came."""
        now = time.time()
        self.unplanned.kick()  # dead nodes first: their jobs are stopped
        for job, (seen, d) in list(self.reroutes.items()):  # then paths: a reroute pauses for less than a move
            if job in self.active or self.unplanned.waits(job):
                continue
            if self.d.registry.job(job).path == d.ifname:
                self.reroutes.pop(job)
            elif not self._starting(job):
                self.reroutes.pop(job)
                self._spawn(job, self._reroute(job, seen, d))
        for (job, node), (seen, reason) in list(self.pending.items()):
            if job in self.active or self.unplanned.waits(job) or self.retry_at.get((job, node), 0) > now:
                continue
            why, lasting = self._blocked(job, node)
            view = self.d.registry.job(job)
            if why:
                if view.blocked != why:
                    self.log.warning("migration.blocked", job=job, node=node, why=why)
                    asyncio.create_task(asyncio.to_thread(self.d.journal.add_event, "migration.blocked",
                                                          job_id=job, detail={"node": node, "why": why}))
                    if lasting:
                        asyncio.create_task(self._tell_blocked(job, why))
                view.blocked = why
                continue
            view.blocked = ""
            self._spawn(job, self._migrate(job, node, seen, reason))

    def _blocked(self, job: str, node: str) -> tuple[str, bool]:
        """Why the migration of ``job`` off ``node`` cannot start now ("" when it can), and whether
        that lasts beyond the next poll (then the job's user is told, in the job's output)."""
        view = self.d.registry.jobs.get(job)
        if view is None or not view.user:
            return "job not (yet) seen in Slurm", False
        lp = view.launchpads.get(node)
        if lp is None or not lp.online or not lp.workers:
            return f"waiting for the launchpad on {node} to report its ranks", False
        if starting := self._starting(job):  # a worker not yet on its agent channel cannot be paused
            return starting, False
        if self.watcher.last is None:
            return "waiting for the first Slurm poll", False
        protected = view.protection()  # from what the workers did: no spare is taken for a move that cannot work
        if not protected.flow:  # the job's output said so already (protection.Announcer)
            return protected.why, False
        spares = self.d.pool.list(self.watcher.last)
        hot = view.hot_spares() if protected.flow != TRANSPARENT else []  # criu restores onto a spare from the pool
        if not hot and not any(s.available for s in spares):
            detail = "; ".join(f"{s.node}: {s.why}" for s in spares) or "the spare reservation has no nodes"
            return f"no spare free for {node} ({detail}); the job keeps running and migrates when one appears", True
        return "", False

    def _starting(self, job: str) -> str:
        """Why the job's ranks cannot all pause now ("" when they can): workers still starting."""
        view = self.d.registry.job(job)
        starting = sorted(n for n, other in view.launchpads.items()
                          if other.online and any(w.get("state") == WorkerState.STARTING for w in other.workers))
        return f"waiting for the workers on {', '.join(starting)} to start" if starting else ""

    async def tell_job(self, job: str, text: str) -> None:
        """Put ``text`` once into the job's output: through one launchpad of the job (the batch
        host's when it runs one), whose stderr is the job's. Best effort: a failure is only logged."""
        view = self.d.registry.jobs.get(job)
        online = sorted(n for n, lp in (view.launchpads.items() if view else ()) if lp.online)
        if not online:
            return
        node = view.batch_host if view.batch_host in online else online[0]
        try:
            await self.d.commander.send(job, node, "notice", migration=f"notice-{uuid.uuid4().hex[:12]}",
                                        gen=view.launchpads[node].gen, args={"text": text},
                                        timeout=self.d.cfg.timeouts.reform)
        except TorchPassError as exc:
            self.log.warning("job.notice_failed", job=job, node=node, error=str(exc))

    async def _tell_blocked(self, job: str, why: str) -> None:
        await self.announcer.said_first(job)  # what protects the job, then why not right now
        await self.tell_job(job, f"job {job} is not protected right now: {why}")

    def _spawn(self, job: str, coro: Any) -> None:
        task = asyncio.create_task(coro, name=f"migration-{job}")
        self.active[job] = task

        def done(t: asyncio.Task[None]) -> None:
            if self.active.get(job) is t:  # not a task that took over from it (_preempt)
                self.active.pop(job)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("migration.crashed", job=job, error=repr(t.exception()))
            asyncio.get_running_loop().call_later(0.1, self.kick)
        task.add_done_callback(done)

    async def _migrate(self, job: str, node: str, seen: float, reason: str) -> None:
        rec = {j.job_id: j for j in await asyncio.to_thread(self.d.journal.jobs)}.get(job)
        gen = rec.gen if rec else 1
        flow = transparent.TransparentMigration if self.d.registry.job(job).protection().flow == TRANSPARENT \
            else planned.PlannedMigration
        mid = await asyncio.to_thread(self.d.journal.start_migration, job, mode=flow.mode, source=node,
                                      reason=reason, gen=gen)
        await self.d.publish_event(job, "migration.started", {"migration": mid, "source": node, "reason": reason})
        mig = flow(self.d, planned.Plan(job=job, source=node, gen=gen), mid, detected_at=seen)
        self.current[job] = mig
        await self._conclude(mig, await mig.run())

    async def _reroute(self, job: str, seen: float, d: link_policy.Decision) -> None:
        mid, gen = await self.unplanned.open_record(job, reroute.MODE, d.node, d.reason)
        plan = unplanned.UnplannedPlan(job=job, source=d.node, gen=gen, evidence=[d.reason], failed_at=seen,
                                       path=d.ifname, path_before=self.d.registry.job(job).path)
        flow = reroute.Reroute(self.d, plan, mid, detected_at=time.time(), no_spare=self.unplanned.policy,
                               control_up=self.unplanned.control_up)
        await self.unplanned.run(flow, flow.run([]))

    def watch_stranded(self) -> None:
        """Re-form in place every job whose ranks were left interrupted with nobody lost, and say so
        of a job that completed no step for a while after a change of it ended (stranded.py)."""
        now = time.monotonic()
        for job, view in list(self.d.registry.jobs.items()):
            busy = (job in self.active or self.unplanned.waits(job) or job in self.reroutes
                    or job in self.unplanned.given_up)  # given up: its ranks were told to exit
            online = [lp for lp in view.launchpads.values() if lp.online]
            workers = [w for lp in online for w in lp.workers]
            rate = max((lp.steps_per_s for lp in online), default=0.0)
            if ranks := self.stranded.due(job, workers, now, busy):
                self._reform_in_place(job, ranks, f"ranks {span(ranks)} were left interrupted (a collective "
                                                  "failed) while every node of the job lives, and no recovery came "
                                                  "for them")
            elif self.stalls.due(job, workers, rate, now, busy):
                self._say_stalled(job, max((int(w.get("step") or 0) for w in workers), default=0))

    def _say_stalled(self, job: str, step: int) -> None:
        """A job that stepped no more after a change of it ended: said and journaled, not acted on
        (a long evaluation or checkpoint save looks the same from here); ranks left waiting in a
        collective are interrupted at its timeout and recovered by the stranded rule."""
        why = (f"job {job} completed no step for {self.stalls.limit(job):.0f} s after its last migration or "
               f"recovery ended (at step {step}); ranks waiting in a collective are recovered in place once it times "
               f"out ({self.d.cfg.timeouts.collective:.0f} s); a rank stopped elsewhere is not: look at the job")
        self.log.warning("job.stalled", job=job, step=step, after_s=round(self.stalls.limit(job), 1))
        asyncio.create_task(asyncio.to_thread(self.d.journal.add_event, "job.stalled", job_id=job,
                                              detail={"step": step, "why": why}))
        asyncio.create_task(self.tell_job(job, why))

    def _reform_in_place(self, job: str, ranks: list[int], why: str) -> None:
        view = self.d.registry.job(job)
        node = min(n for n, lp in view.launchpads.items() if any(w["rank"] in ranks for w in lp.workers))
        self.log.warning("recovery.stranded", job=job, ranks=ranks, node=node, why=why)
        # unregistered ranks cannot resume: the recovery then ends the job, saying why in its output
        reason = f"{why}: every rank re-forms in place and resumes at the step that failed"
        self._spawn(job, self._reroute(job, time.time(),
                                       link_policy.Decision(link_policy.REROUTE, job, node, view.path, reason)))

    async def _conclude(self, mig: planned.PlannedMigration, status: str) -> None:
        """After a migration ended: done, or retried (a spare that failed: another spare; any other
        roll-back: at most RETRIES times, each retry waiting twice as long), or given up (a failure
        a retry would meet again, or the tries spent: the job runs on where it is)."""
        p, key = mig.plan, (mig.plan.job, mig.plan.source)
        if status == jn.SUCCEEDED:
            self.pending.pop(key, None)
            self.failed_spares.pop(key, None)
            self.rollbacks.pop(key, None)
            return
        if mig.spare_failure is not None:
            if not self._spares_exhausted(p.job, p.source, mig.spare_failure):
                self._retry(key, RETRY_AFTER_S)
            return
        tries = self.rollbacks[key] = self.rollbacks.get(key, 0) + 1
        if mig.lasting:
            self._give_up(p.job, p.source, f"{mig.lasting}, and a retry would fail the same way",
                          "torchpassctl history shows why; register save/load (torchpass.register) for a "
                          f"model-aware move, or resume and drain {p.source} again once the cause is fixed",
                          tries=tries, error=mig.error)
        elif tries > RETRIES:
            self._give_up(p.job, p.source, f"{tries} tries rolled back, the last because {mig.error}",
                          f"torchpassctl history shows each try; resume and drain {p.source} again to retry",
                          tries=tries, error=mig.error)
        else:
            self._retry(key, RETRY_AFTER_S * 2 ** (tries - 1))

    def _retry(self, key: tuple[str, str], after_s: float) -> None:
        self.retry_at[key] = time.time() + after_s
        asyncio.get_running_loop().call_later(after_s + 0.1, self.kick)

    def _give_up(self, job: str, node: str, cause: str, todo: str, **detail: Any) -> None:
        """Stop trying to move ``job``'s ranks off ``node`` (until the node returns and is drained
        again): said to the operator (log, journal event) and in the job's output, with what to do."""
        self.pending.pop((job, node), None)
        self.rollbacks.pop((job, node), None)
        why = f"gave up moving job {job}'s ranks off {node}: {cause}; the job runs on on {node}. {todo}"
        self.log.error("migration.given_up", job=job, node=node, why=why, **detail)
        self.d.registry.job(job).blocked = why
        asyncio.create_task(asyncio.to_thread(self.d.journal.add_event, "migration.given_up", job_id=job,
                                              detail={"node": node, "why": why, **detail}))
        asyncio.create_task(self.tell_job(job, why))

    def _spares_exhausted(self, job: str, node: str, failure: SpareFailed) -> bool:
        """Count ``failure``'s spare against this incident; True (and the incident given up, said
        to the operator and in the job's output) once orchestrator.spares_per_incident have failed."""
        failed = self.failed_spares.setdefault((job, node), [])
        failed.append(failure.spare)
        limit = self.d.cfg.orchestrator.spares_per_incident
        if len(failed) < limit:
            return False
        self._give_up(job, node, f"{len(failed)} spares ({', '.join(failed)}) could not take them, the last "
                                 f"because {failure.message}", "Fix the cause, resume the spares (scontrol update "
                                 f"nodename=... state=resume) and drain {node} again", spares=failed)
        return True

    async def recover(self) -> None:
        """Finish or roll back the migrations a previous torchpassd left in flight."""
        for rec in await asyncio.to_thread(self.d.journal.in_flight):
            self.log.warning("migration.recovering", job=rec.job_id, migration=rec.id, phase=rec.phase)
            await self._wait_launchpads(rec)
            self._spawn(rec.job_id, self._recover_one(rec))

    async def _wait_launchpads(self, rec: jn.MigrationRecord) -> None:
        plan = planned.Plan.from_record(rec)
        nodes = [n for n in (*plan.survivors, plan.source) if n]
        view = self.d.registry.job(rec.job_id)
        with contextlib.suppress(MigrationError):  # a launchpad that never reports is handled by the commands
            await self.d.registry.wait_for(lambda: True if all(view.launchpads.get(n) for n in nodes) else None,
                                           self.d.cfg.timeouts.heartbeat_dead_after, "launchpads to report")

    async def _recover_one(self, rec: jn.MigrationRecord) -> None:
        if rec.mode in (unplanned.MODE, reroute.MODE):
            await self.unplanned.resume(rec, reroute.Reroute if rec.mode == reroute.MODE else unplanned.UnplannedRecovery)
            return
        flow = transparent.TransparentMigration if rec.mode == transparent.MODE else planned.PlannedMigration
        mig = flow(self.d, planned.Plan.from_record(rec), rec.id, detected_at=rec.started)
        await self._conclude(mig, await planned.resume_after_restart(mig, rec.phase))

    # ---- control socket ----------------------------------------------------------------------
    def handlers(self, started: float, backend: str, client: mqtt.ControlClient) -> dict[str, Any]:
        async def status(args: dict[str, Any]) -> dict[str, Any]:
            return {"daemon": {"pid": os.getpid(), "uptime_s": round(time.time() - started, 1),
                               "slurm_backend": backend, "broker_connected": client.connected},
                    "jobs": await jobs(args), "pending": [
                        {"job": j, "node": n, "reason": r, "since": s} for (j, n), (s, r) in self.pending.items()],
                    "in_flight": [m.id for m in await asyncio.to_thread(self.d.journal.in_flight)],
                    "dead": self.unplanned.describe()}  # dead nodes waiting for their recovery, and why

        async def jobs(args: dict[str, Any]) -> list[dict[str, Any]]:
            return [v.describe() for k, v in sorted(self.d.registry.jobs.items()) if v.user]

        async def migrate(args: dict[str, Any]) -> dict[str, Any]:
            job, node = str(args.get("job", "")), str(args.get("node", ""))
            view = self.d.registry.jobs.get(job)
            if view is None or not view.user:
                raise MigrationError(f"job {job} is not a running TorchPass job", job=job,
                                     hint="torchpassctl jobs lists them")
            if node not in view.nodes:
                raise MigrationError(f"node {node} is not part of job {job} ({', '.join(view.nodes)})", job=job)
            self.request(job, node, f"operator request (torchpassctl migrate) for {node}")
            return {"job": job, "node": node, "queued": True, "blocked": self.d.registry.job(job).blocked}

        async def history(args: dict[str, Any]) -> list[dict[str, Any]]:
            job = args.get("job")
            recs = await asyncio.to_thread(self.d.journal.history, job_id=str(job) if job else None,
                                           limit=int(args.get("limit", 50)))
            return [asdict(r) for r in recs]

        async def health_replay(args: dict[str, Any]) -> dict[str, Any]:
            """Fault injection for the gpu-degrade drill: ``node``'s launchpad in ``job`` samples
            ``recording`` (a FAKE NVML replay, launchpad/telemetry/replay.py) from now on."""
            job, node = str(args.get("job", "")), str(args.get("node", ""))
            view = self.d.registry.jobs.get(job)
            lp = view.launchpads.get(node) if view else None
            if lp is None or not lp.online:
                raise MigrationError(f"no launchpad of job {job} is online on {node}", job=job,
                                     hint="torchpassctl jobs lists each job's nodes and launchpads")
            await self.d.commander.send(job, node, "health_replay", migration=f"drill-{uuid.uuid4().hex[:12]}",
                                        gen=lp.gen, args={"recording": args.get("recording"),
                                                          "source": str(args.get("source", ""))},
                                        timeout=self.d.cfg.timeouts.reform)
            self.log.warning("health.replay_injected", job=job, node=node, source=args.get("source"))
            return {"job": job, "node": node}

        return {"status": status, "jobs": jobs, "migrate": migrate, "history": history,
                "health_replay": health_replay}


@dataclass
class Reports:
    """Where the launchpads' reports go once the gate admitted them."""

    gate: ReportGate
    registry: Registry
    commander: Commander
    metrics: Metrics
    health: HealthWatch
    straggler: StragglerWatch
    links: link_policy.PathWatch
    detector: FailureDetector
    announcer: protection.Announcer

    async def pump(self, client: mqtt.ControlClient) -> None:
        async for topic, msg in client.messages():
            node = protocol.parse_topic(topic).node
            if node is not None:
                for admitted in self.gate.admit(node, msg):
                    await self.take(node, admitted)

    async def release(self) -> None:
        """Act on the held reports Slurm has confirmed since they arrived."""
        for node, msg in self.gate.release():
            await self.take(node, msg)

    async def take(self, node: str, msg: protocol.Message) -> None:
        if msg.kind == protocol.ACK:
            self.commander.on_ack(msg, node)
        elif msg.kind in (protocol.STATE, protocol.HEARTBEAT):
            await self.registry.on_message(node, msg)
            self.detector.on_message(node, msg)
            if msg.kind == protocol.HEARTBEAT:
                self.metrics.heartbeat_seen(msg.job, node)
                await self.health.on_heartbeat(msg.job, node, msg.body)
                await self.straggler.on_heartbeat(msg.job, node, msg.body)
                self.links.on_heartbeat(msg.job, node, msg.body)
                self.announcer.on_heartbeat(msg.job, node, msg.body)


async def _watch(watcher: Watcher, orch: Orchestrator, reports: Reports, retained: RetainedStates,
                 accounts: broker_auth.JobAccounts | None = None) -> None:
    health, gate = reports.health, reports.gate
    async for e in watcher.events():
        if accounts is not None:
            accounts.on_slurm(e)  # a job's broker account lives as long as the job
        if isinstance(e, ev.NodeReturned):
            health.node_returned(e.node)
        elif isinstance(e, ev.JobEnded):
            health.job_ended(str(e.job))
            reports.straggler.job_ended(str(e.job))
            reports.links.job_ended(str(e.job))
            reports.announcer.job_ended(str(e.job))
            gate.forget(str(e.job))
            view = orch.d.registry.jobs.get(str(e.job))  # every node a launchpad of it was on
            retained.clear(str(e.job), {*e.nodes, *(view.nodes if view else ()), *(view.launchpads if view else ())})
        try:
            await orch.on_slurm(e)
        except TorchPassError as exc:
            log.get().error("orchestrator.event_failed", event=type(e).__name__, error=str(exc))


async def _tick(orch: Orchestrator, reports: Reports, every: float) -> None:
    """Re-examine blocked migrations (a launchpad reported, a retry time came) and the reports
    held for Slurm's confirmation now and then."""
    while True:
        await asyncio.sleep(every)
        await reports.release()
        orch.unplanned.detector.check()  # silence needs a clock
        orch.watch_stranded()
        reports.announcer.tick()
        orch.kick()


async def _first_look(slurm: SlurmClient) -> Snapshot | None:
    """Slurm's view at start-up, so the reports of running jobs count before the watcher's first
    poll (a recovery left in flight waits for them); None if Slurm does not answer now."""
    try:
        return await asyncio.to_thread(slurm.snapshot)
    except SlurmError as exc:
        log.get().warning("torchpassd.slurm_not_answering", error=str(exc),
                          effect="launchpad reports wait for the first Slurm poll")
        return None


async def serve(cfg: Config, *, slurm: SlurmClient | None = None, runner: SlurmRunner | None = None) -> int:
    """Run torchpassd until SIGTERM/SIGINT; returns the exit code. ``slurm`` and ``runner`` replace
    the configured Slurm backend and command runner (bench/scale.py's simulated cluster)."""
    logger = log.get()
    cfg.timeouts.validate()
    state_dir = Path(cfg.orchestrator.state_dir)
    journal = jn.Journal(state_dir / "journal.sqlite")
    slurm = slurm or await asyncio.to_thread(open_client, cfg.slurm)
    runner = runner or runner_for(cfg.slurm)
    resizer = JobResizer(runner, slurm, spare_reservation=cfg.slurm.spare_reservation, grants=journal)
    watcher = Watcher(slurm, interval=cfg.slurm.poll_interval, spare_reservation=cfg.slurm.spare_reservation)
    metrics, registry = Metrics(), Registry()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = time.time()
    await broker_check.require_secure(cfg.broker, "torchpassd")
    async with mqtt.ControlClient(cfg.broker, f"torchpassd-{socket.gethostname()}-{os.getpid()}") as client:
        for kind in (protocol.STATE, protocol.HEARTBEAT, protocol.ACK):
            await client.subscribe(protocol.nodes_filter(kind))

        async def publish_event(job: str, event: str, detail: dict[str, Any]) -> None:
            payload = protocol.encode(protocol.EVENT, job=job, gen=0, body={"event": event, **detail})
            try:
                await client.publish(protocol.events_topic(job), payload, timeout=2.0)
            except TorchPassError as exc:
                logger.warning("events.publish_failed", job=job, event_name=event, error=str(exc))
            await asyncio.to_thread(journal.add_event, event, job_id=job, migration_id=detail.get("migration"),
                                    detail={k: v for k, v in detail.items() if k != "migration"})

        commander = Commander(client)
        deps = planned.Deps(cfg, journal, registry, commander, resizer, SparePool(slurm, cfg.slurm.spare_reservation),
                            metrics, publish_event, state_dir / "steps")
        orch = Orchestrator(deps, watcher, control_up=lambda: client.connected)
        # per-job broker accounts (or None), their endpoint's refusals counted
        accounts = broker_auth.JobAccounts.from_config(cfg, slurm, metrics.credentials_refused_total)
        health = HealthWatch(cfg.health, journal, migrate=orch.request, counter=metrics.health_decisions_total,
                             drain=lambda node, reason: asyncio.to_thread(node_admin.drain, runner, node, reason))
        boot = await _first_look(slurm)
        retained = RetainedStates(client)
        gate = ReportGate(lambda: watcher.last or boot, orch.moving, metrics.reports_refused_total,
                          lambda job, node: retained.clear(job, (node,)))
        straggler = StragglerWatch(cfg.straggler, journal, migrate=orch.request, counter=metrics.stragglers_total)
        paths = link_policy.PathWatch(cfg.links, registry.job, orch.on_links)
        reports = Reports(gate, registry, commander, metrics, health, straggler, paths, orch.unplanned.detector,
                          orch.announcer)
        tasks = [asyncio.create_task(reports.pump(client)),
                 asyncio.create_task(sdnotify.watchdog_loop())]
        async with ControlServer(cfg.orchestrator.control_socket,
                                 {**orch.handlers(started, slurm.name, client), "health": health.op_health},
                                 group=cfg.orchestrator.control_group), \
                MetricsServer(metrics, port=cfg.orchestrator.metrics_port) as metrics_server, \
                (accounts or contextlib.nullcontext()):
            await client.wait_connected(mqtt.PUBLISH_TIMEOUT)
            await asyncio.to_thread(resizer.reconcile_grants)  # before anything may grant again
            await orch.recover()
            tasks += [asyncio.create_task(_watch(watcher, orch, reports, retained, accounts)),
                      asyncio.create_task(_tick(orch, reports, cfg.timeouts.heartbeat_interval))]
            sdnotify.ready(f"watching Slurm through {slurm.name}")
            tasks.append(asyncio.create_task(sdnotify.broker_status_loop(lambda: client.connected, slurm.name)))
            logger.info("torchpassd.ready", backend=slurm.name, metrics_port=metrics_server.port,
                        control_socket=cfg.orchestrator.control_socket)
            await stop.wait()
            sdnotify.stopping()
            logger.info("torchpassd.stopping", in_flight=sorted(orch.active))
            for t in [*tasks, *orch.active.values()]:
                t.cancel()
            await asyncio.gather(*tasks, *orch.active.values(), return_exceptions=True)
    journal.close()
    return 0


def run(cfg: Config) -> int:
    """torchpassd's entry point (called by torchpassd.cli): 0 after a clean stop, 1 on a
    start-up failure (logged with what to do)."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(serve(cfg))
    except TorchPassError as exc:
        log.get().error("torchpassd.failed", error=str(exc))
        return 1
