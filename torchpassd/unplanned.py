"""The unplanned, model-aware recovery of a job after a node died (failure_detect.py decided it):
spare chosen -> added to the job -> launchpad and joining worker started there -> every survivor
reports its worker interrupted (just-in-time state saved) -> the most advanced survivor donates
the lost rank's state to the joiner (laggards load it too) -> new generation formed -> resume at
the step that failed -> dead node released. Phases are journaled, published and timed as in
planned.py (whose Flow it shares); there is no going back, so a failure fails the job clearly,
except when the survivors turn out to train on (only the node's control plane was lost)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from slurm_plugin import events as ev
from slurm_plugin import node_admin
from slurm_plugin.model import TRANSPARENT
from torchpass_common import log
from torchpass_common.errors import MigrationError, SpareFailed, TorchPassError
from torchpass_common.transfer_address import TransferAddress
from torchpass_common.worker_state import WorkerState
from torchpassd import journal as jn
from torchpassd import planned
from torchpassd.failure_detect import INTERRUPTED, Death, FailureDetector
from torchpassd.planned import (
    JOINER_READY,
    SPARE_ADDED,
    SPARE_CHOSEN,
    WORMHOLE_PORT_BASE,
    Deps,
    Flow,
    Plan,
    WorkerTemplate,
    joiner_port,
)

MODE = "unplanned-aware"
CRASHED = WorkerState.CRASHED
CRASHES_TO_DRAIN, CRASH_WINDOW_S = 3, 600.0  # a node whose workers crash this often is migrated
LAG_PORT_OFFSET = 50  # a lagging survivor listens for the donor's state on port + this
DETECTED, INTERRUPTED_ALL, RECOVERED = "detected", "interrupted", "recovered"
REFORMED, RESUMED, RELEASED, FAILED = planned.REFORMED, planned.RESUMED, planned.RELEASED, planned.FAILED
BEFORE_RECOVER = (planned.REQUESTED, DETECTED, SPARE_CHOSEN, SPARE_ADDED, JOINER_READY, INTERRUPTED_ALL)


@dataclass
class UnplannedPlan(Plan):
    """What one recovery decided so far (journaled with every phase; never the token). ``seats``:
    one per lost node, {node, ranks (rank: the first), target, target_addr}; ``steps``: completed steps per surviving
    rank at the interruption; ``resume_step``: the step that failed (the most advanced survivor's)."""

    seats: list[dict[str, Any]] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    failed_at: float = 0.0
    steps: dict[str, int] = field(default_factory=dict)
    donor: str = ""
    laggards: list[str] = field(default_factory=list)
    resume_step: int = -1
    recover_sent: bool = False
    severed: dict[str, list[int]] = field(default_factory=dict)  # per survivor: ranks whose collectives were cut
    hot_tried: list[str] = field(default_factory=list)  # hot spares whose joiners failed to start (run no rank)

    @property
    def dead(self) -> list[str]:
        """The nodes lost (not those whose lost ranks are rebuilt in place: they live)."""
        return [s["node"] for s in self.seats if not s.get("in_place")]

    @property
    def targets(self) -> list[str]:
        """The spares taking lost nodes' ranks."""
        return [s["target"] for s in self.seats if s.get("target") and not s.get("in_place")]

    @property
    def in_place(self) -> list[str]:
        """The live nodes whose crashed ranks are rebuilt on them."""
        return [s["node"] for s in self.seats if s.get("in_place")]

    @property
    def members(self) -> list[str]:
        """The nodes of the next generation: survivors, spares taking lost ranks, nodes rebuilding in place."""
        return list(dict.fromkeys([*self.survivors, *self.targets, *self.in_place]))

    @property
    def lost_ranks(self) -> set[int]:
        return {r for s in self.seats for r in s.get("ranks") or [s["rank"]]}


def choose_donor(steps: dict[str, int], rank_node: dict[int, str], *, where: dict[str, Any]) -> tuple[str, list[str], int]:
    """(donor node, laggard nodes, step to resume at) from the survivors' completed steps.
    The most advanced replica donates (DDP: every rank holds the whole model; torchpassd does
    not know an HSDP shard layout and treats every rank as a full replica); survivors one
    step behind it (the failure hit while others had finished that step) load its state; a gap
    of more than one step means the ranks were not in lock-step: not recoverable this way."""
    if not steps:
        raise MigrationError("no surviving rank reported its state; nothing to recover from",
                             hint="fall back to the job's last checkpoint", **where)
    c_max = max(steps.values())
    behind = {int(r): c for r, c in steps.items() if c != c_max}
    if any(c < c_max - 1 for c in behind.values()):
        raise MigrationError(f"survivors' completed steps {steps} are more than one step apart",
                             hint="data-parallel replicas should never drift; fall back to the last checkpoint",
                             **where)
    leaders = sorted(int(r) for r, c in steps.items() if c == c_max)
    donor = rank_node[leaders[0]]
    laggards = sorted({rank_node[r] for r in behind})
    return donor, laggards, c_max


def interrupted_after(workers: list[dict[str, Any]], decided_at: float) -> float | None:
    """Seconds from the decision to the last of the surviving ``workers``' interruptions (launchpads'
    reports; 0 when every one was interrupted before it), or None when a report lacks the time."""
    times = [w.get("interrupted_at") for w in workers]
    if not times or any(not isinstance(t, int | float) for t in times):
        return None
    return round(max(0.0, max(times) - decided_at), 3)


def seat_of(death: Death) -> dict[str, Any]:
    """The seat (journaled with the plan) of ``death``'s ranks; ``target`` is added once chosen."""
    return {"node": death.node, "rank": death.ranks[0], "ranks": list(death.ranks),
            **({"in_place": True} if death.in_place else {})}


class NoReplica(MigrationError):
    """A lost rank's state exists nowhere else (pure FSDP or tensor parallel: every rank holds its
    own shard): nothing to rebuild it from; the job falls back to a requeue."""


def replica_donor(rank: int, holders: list[int] | None, leaders: list[int], load: dict[int, int]) -> int | None:
    """The surviving rank at the resume step to rebuild ``rank`` from: one of its replica
    ``holders`` (any leader when the layout is unknown: DDP replicas), the least loaded first."""
    pool = [r for r in leaders if holders is None or r in holders]
    if not pool:
        return None
    donor = min(pool, key=lambda r: (load.get(r, 0), r))
    load[donor] = load.get(donor, 0) + 1
    return donor


class RanksAlive(MigrationError):
    """The survivors completed steps after the decision: every rank, the "dead" node's too, took
    part in their all-reduce, so only its control plane (launchpad, network to the broker) was lost."""


class UnplannedRecovery(Flow):
    """Recovery of ``plan.job`` from the death of ``plan.source`` (and of any node that dies
    while the survivors' state is not yet handed over); ``run()`` drives it to an end."""

    mode = MODE

    def __init__(self, deps: Deps, plan: UnplannedPlan, migration: str, *, detected_at: float,
                 no_spare: str = "wait", control_up: Callable[[], bool] = lambda: True) -> None:
        super().__init__(deps, plan, migration, detected_at=detected_at)
        self.plan: UnplannedPlan = plan
        self.no_spare = no_spare
        self.control_up = control_up  # torchpassd hears the launchpads (its broker connection is up)
        self._more: list[Death] = []
        self._changed = asyncio.Event()
        self._slurm = asyncio.Lock()  # one job resize at a time
        self.failure: str | None = None

    def swapped(self) -> tuple[list[str], list[str]]:
        return self.plan.dead, self.plan.targets

    # ---- inputs ------------------------------------------------------------------------------
    def another_death(self, death: Death) -> None:
        """A second node of the job died while this recovery runs: taken in if the survivors'
        state has not been handed over yet (and a spare is free), else the job fails clearly."""
        self._more.append(death)
        self._changed.set()

    # ---- the flow ----------------------------------------------------------------------------
    async def run(self, deaths: list[Death]) -> str:
        """Carry the recovery out; returns succeeded or failed."""
        p = self.plan
        try:
            await self.phase(DETECTED, detect_s=round(max(0.0, self.detected_at - p.failed_at), 3),
                             evidence=p.evidence, failed_at=p.failed_at)
            seating = self._seat_nowhere(deaths) if self._rebuilds_nothing() else self._seat_all(deaths)
            await asyncio.gather(self._sever_survivors(deaths), seating)
            await self._wait_interrupted()
            await self._recover()
        except RanksAlive as exc:
            return await self.stand_down(str(exc))
        except NoReplica as exc:
            return await self.requeue(str(exc))
        except TorchPassError as exc:  # a spare whose joiner could not start is drained (_drop_target)
            return await self.fail(self.failed_before_hand_over(exc))
        return await self.finish()

    def _rebuilds_nothing(self) -> bool:
        """A model-transparent job (``--torchpass=transparent``) registers no save/load: no lost rank
        can be rebuilt, so no spare is taken for it (its joiner would only fail with the job, and the
        spare be drained for it). The survivors are still cut and waited for: their reports end the
        recovery (unregistered: the job ends clearly) or show the ranks alive (stand down)."""
        return self.view().mode == TRANSPARENT

    async def _seat_nowhere(self, deaths: list[Death]) -> None:
        """Note ``deaths``' ranks as lost without preparing a place for them (_rebuilds_nothing)."""
        self.plan.seats += [seat_of(d) for d in deaths if d.ranks]
        self.plan.survivors = self._survivors()

    async def stand_down(self, reason: str) -> str:
        """Nothing was lost after all: let the spares go, leave the job alone."""
        problems: list[str] = []
        for t in self.plan.targets:
            problems += await self._drop_target(t)
        self.log.warning("unplanned.standing_down", reason=reason)
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="rolled_back")
        await self.phase(planned.ROLLED_BACK, jn.ROLLED_BACK, error=reason, problems=problems)
        return jn.ROLLED_BACK

    async def _sever_survivors(self, deaths: list[Death]) -> None:
        """Active abort, while the spare is prepared: each survivor's launchpad cuts the collectives
        of its workers that stopped progressing (launchpad/stall_watch.py), so every survivor
        reaches its just-in-time checkpoint now, wherever it sits in the ring, instead of at the
        collective timeout; workers still training are only watched (their peers all answer: the
        lost node's ranks may be alive, _check_still_training). Never fails the recovery: a
        launchpad that does not answer leaves its workers to the collective timeout, as before. A
        worker that crashed is surely gone: with only such deaths every survivor is cut at once."""
        p = self.plan
        lost = [d.node for d in deaths if not d.in_place]
        survivors = [n for n in self._survivors() if n not in lost]
        args = {"lost": [d.node for d in deaths], "watch_s": self.t.collective,
                "all": all(d.in_place for d in deaths)}
        results = await asyncio.gather(*(self.send(n, "sever", p.gen, args, timeout=self.t.collective)
                                         for n in survivors), return_exceptions=True)
        for node, res in zip(survivors, results, strict=True):
            if isinstance(res, BaseException):
                self.log.warning("unplanned.sever_failed", node=node, error=str(res))
            else:
                p.severed[node] = res.get("severed", [])

    def _survivors(self) -> list[str]:
        view = self.view()
        return sorted(n for n, lp in view.launchpads.items()
                      if lp.online and self._members(lp.workers) and n not in self.plan.dead
                      and n not in self.plan.targets
                      and (not view.nodes or n in view.nodes))

    async def _seat(self, death: Death) -> None:
        """Prepare the place of ``death``'s ranks: a spare in the job with joiners waiting, or
        (in place) joiners waiting on the live node itself."""
        p, view = self.plan, self.view()
        if death.in_place:
            return await self._seat_in_place(death)
        if death.node == view.batch_host:
            raise MigrationError(f"the batch host {death.node} died; Slurm ends the job with it",
                                 hint="keep training ranks off the batch host, or restart from a checkpoint",
                                 **self.where)
        if not death.ranks:
            raise MigrationError(f"{death.node} ran no rank of the job: nothing to rebuild", **self.where)
        survivors = self._survivors()
        if not survivors:
            raise MigrationError("no surviving node holds a replica of the lost rank's state",
                                 hint="fall back to the job's last checkpoint", **self.where)
        alive = {r for n in survivors if n != death.node for r in view.ranks_on(n)}
        orphans = [r for r in death.ranks if (h := view.replicas.get(r)) is not None and not alive & set(h)]
        if orphans:
            raise NoReplica(f"no surviving rank holds a replica of ranks {orphans} lost with {death.node} "
                            f"(their state is sharded: {view.unplanned()})",
                            hint="HSDP (replicate across nodes) lets TorchPass rebuild a node; the job restarts "
                                 "from its last checkpoint", **self.where)
        seat = seat_of(death)
        p.seats.append(seat)
        p.survivors = survivors
        donor = survivors[0]  # the lost worker's own node is gone; a rank rebuilt in place has no worker to read
        tpl = await self._template(donor, next(r for r in self.view().ranks_on(donor) if r not in p.lost_ranks))
        self._adopt_template(tpl)
        if tpl.env["MASTER_ADDR"] in p.dead:
            raise MigrationError(f"the job's rendezvous store ran on {tpl.env['MASTER_ADDR']}, which died",
                                 hint="restart the job from its last checkpoint", **self.where)
        if await self._seat_on_a_hot_spare(seat, death, tpl):
            return
        limit = self.d.cfg.orchestrator.spares_per_incident
        for attempt in range(1, limit + 1):
            await self._seat_on_a_spare(seat, death)
            try:  # torchrun numbers a node's ranks node_rank * nproc + local_rank: the dead node's place
                await self._start_joiner(tpl, seat["ranks"], seat["target"], seat["target_addr"],
                                         group_rank=seat["ranks"][0] // len(seat["ranks"]))
            except SpareFailed as exc:
                if attempt == limit:
                    tried = [*(s for s in self.failed_spares if s != exc.spare), exc.spare]
                    raise SpareFailed(f"no spare could take the ranks of {death.node} (tried {', '.join(tried)}); "
                                      f"the last: {exc.message}", spare=exc.spare,
                                      hint="fix the spares (drained with the reason) or restart the job from "
                                           "its last checkpoint", **self.where) from exc
                await self._replace_failed_spare(seat, exc)
                continue
            await self.phase(JOINER_READY, spare=seat["target"])
            return

    async def _seat_in_place(self, death: Death) -> None:
        """Only ``death.ranks``' workers died, on a node that lives: their joiners start there
        (launchpad's start_joiner takes the crashed workers' places), no spare and no resize; the
        node's other ranks are survivors like any other."""
        p, view = self.plan, self.view()
        if not death.ranks:
            raise MigrationError(f"no crashed rank on {death.node} to rebuild", **self.where)
        seat = seat_of(death)
        p.seats.append(seat)
        p.survivors = self._survivors()
        lost = p.lost_ranks
        alive = [(n, r) for n in p.survivors for r in view.ranks_on(n) if r not in lost]
        orphans = [r for r in death.ranks
                   if (h := view.replicas.get(r)) is not None and not {a for _, a in alive} & set(h)]
        if not alive or orphans:
            raise NoReplica(f"no surviving rank holds a replica of ranks {orphans or list(death.ranks)} that crashed "
                            f"on {death.node}", hint="the job restarts from its last checkpoint", **self.where)
        self._adopt_template(await self._template(*alive[0]))
        nodes = await asyncio.to_thread(self.d.resizer.client.nodes)
        seat["target_addr"] = (nodes[death.node].addr if death.node in nodes else "") or death.node
        await self._start_joiners_on(death.node, seat["target_addr"], list(death.ranks))
        await self.phase(JOINER_READY, node=death.node, ranks=list(death.ranks), in_place=True)

    async def _seat_on_a_hot_spare(self, seat: dict[str, Any], death: Death, tpl: WorkerTemplate) -> bool:
        """Seat ``death``'s ranks on a hot spare of the job's own allocation (``--torchpass-spares``):
        its launchpad already runs, with a warm standby a rank, so the joiners start at once (no
        spare taken from the pool, no resize, no job step). False when the job has none free and
        healthy, or its joiners could not start there (stopped; the pool's spares are tried next)."""
        p = self.plan
        hot = await self._hot_spare({*p.dead, *p.targets, *p.hot_tried})
        if hot is None:
            return False
        node = hot[0]
        seat.update(target=node, target_addr=hot[1])
        p.hot.append(node)
        if not p.target:
            p.target, p.rank, p.target_addr = node, seat["rank"], seat["target_addr"]
        await self.phase(SPARE_CHOSEN, dead=death.node, ranks=seat["ranks"], spare=node, hot=True)
        try:  # torchrun numbers a node's ranks node_rank * nproc + local_rank: the dead node's place
            await self._start_joiners_on(node, seat["target_addr"], seat["ranks"],
                                         group_rank=seat["ranks"][0] // len(seat["ranks"]),
                                         group_world_size=int(tpl.env.get("GROUP_WORLD_SIZE", 1)))
        except TorchPassError as exc:
            self.log.warning("unplanned.hot_spare_failed", spare=node, error=str(exc))
            p.hot_tried.append(node)  # journaled with the next phase: not tried again after a restart
            await self._abort_on([node], {})
            p.hot.remove(node)
            for key in ("target", "target_addr"):
                seat.pop(key)
            if p.target == node:
                p.target = p.target_addr = ""
            return False
        await self.phase(JOINER_READY, spare=node, hot=True)
        return True

    async def _seat_on_a_spare(self, seat: dict[str, Any], death: Death) -> None:
        """Take a spare for ``seat`` and grow the job by it."""
        p = self.plan
        async with self._slurm:
            seat["target"], seat["target_addr"] = await self._take_spare()
            if not p.target:
                p.target, p.rank, p.target_addr = seat["target"], seat["rank"], seat["target_addr"]
            p.port = WORMHOLE_PORT_BASE + p.new_gen
            await self.phase(SPARE_CHOSEN, dead=death.node, ranks=seat["ranks"], spare=seat["target"])
            await self._add_spare_to_job(seat["target"])
            await self.phase(SPARE_ADDED, spare=seat["target"])

    async def _replace_failed_spare(self, seat: dict[str, Any], exc: SpareFailed) -> None:
        """``seat``'s spare could not start its joiners: drain it with the reason, out of the job,
        and clear the seat for the next spare (within orchestrator.spares_per_incident)."""
        p = self.plan
        self.failed_before_hand_over(exc)
        self.log.warning("unplanned.spare_failed", spare=exc.spare, error=exc.message)
        failed = seat.pop("target")
        seat.pop("target_addr", None)
        problems = await self._drop_target(failed)
        if p.target == failed:
            p.target = p.target_addr = ""
        await asyncio.to_thread(self.d.journal.add_event, "migration.spare_failed", job_id=p.job,
                                migration_id=self.id, detail={"spare": failed, "error": exc.message,
                                                              "problems": problems})

    async def _seat_all(self, deaths: list[Death]) -> None:
        """Seat every dead node's rank with the joiners starting side by side; a node that dies
        meanwhile has its seat started at once too (the pause is the slowest joiner's start)."""
        tasks = {asyncio.ensure_future(self._seat(d)) for d in deaths}
        try:
            while tasks:
                changed = asyncio.ensure_future(self._changed.wait())
                done, _ = await asyncio.wait({*tasks, changed}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                for t in done & tasks:
                    tasks.discard(t)
                    t.result()  # a seat that failed fails the recovery
                self._changed.clear()
                tasks |= {asyncio.ensure_future(self._seat(d)) for d in await self._new_deaths()}
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _absorb(self) -> None:
        """Take in nodes that died since the last look (before the hand-over only)."""
        deaths = await self._new_deaths()
        if self._rebuilds_nothing():
            await self._seat_nowhere(deaths)
            return
        for death in deaths:
            await self._seat(death)

    async def _new_deaths(self) -> list[Death]:
        """Deaths reported since the last look that need a seat; raises when one cannot have it."""
        found: list[Death] = []
        while self._more:
            death = self._more.pop(0)
            if death.node in self.plan.dead or death.node in (d.node for d in found):
                continue
            if self.plan.recover_sent:
                raise MigrationError(f"{death.node} died too while the job recovered from {self.plan.source}'s "
                                     f"failure, after the survivors' state was handed over",
                                     hint="restart the job from its last checkpoint", **self.where)
            self.log.warning("unplanned.second_failure", node=death.node, evidence=list(death.evidence))
            if not self._rebuilds_nothing() and not any(s.available for s in await asyncio.to_thread(self.d.pool.list)):
                raise MigrationError(f"{death.node} died too while the job recovered, and no second spare is free",
                                     hint="add spares to the reservation, or restart from the last checkpoint",
                                     **self.where)
            found.append(death)
        return found

    def _unheard(self) -> list[str]:
        """Nodes of the job, neither lost nor a spare of this recovery, whose launchpad has not
        reported its workers: their ranks would be missing from the new generation."""
        view, p = self.view(), self.plan
        idle = {*view.hot_spares(), *p.hot_tried}  # run no rank: nothing of theirs to wait for
        return sorted(n for n in view.nodes if n not in p.dead and n not in p.targets and n not in p.survivors
                      and n not in p.in_place and n not in idle)

    def _check_still_training(self, baseline: dict[str, int]) -> None:
        """A survivor that completes two more steps while we wait for the interruption has had
        its all-reduces answered by every rank: nothing died (heartbeats lag a second at most,
        so one step of slack)."""
        view = self.view()
        ahead = {n: (baseline[n], view.launchpads[n].max_step) for n in baseline if n in view.launchpads
                 and view.launchpads[n].max_step >= baseline[n] + 2
                 and not any(w.get("state") == INTERRUPTED for w in view.launchpads[n].workers)}
        if ahead:
            raise RanksAlive(f"survivors went on training (steps from, to: {ahead}): the ranks on "
                             f"{', '.join(self.plan.dead)} are alive, only their launchpad or its broker link "
                             "was lost; nothing to recover", hint="check that node's launchpad", **self.where)

    def _interrupted_steps(self) -> dict[str, int] | None:
        """{rank: completed steps} once every survivor's workers are interrupted, else None."""
        view = self.view()
        steps: dict[str, int] = {}
        for node in self.plan.survivors:
            lp = view.launchpads.get(node)
            if lp is None or not lp.online or not lp.workers:
                return None
            for w in self._members(lp.workers):
                if w.get("state") != INTERRUPTED:
                    return None
                steps[str(w["rank"])] = int(w["step"])
        return steps

    def _members(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A survivor node's surviving workers: not a rank being rebuilt (a crashed worker, or its joiner)."""
        lost = self.plan.lost_ranks
        return [w for w in workers if w["rank"] not in lost and w.get("state") != CRASHED and not w.get("joining")]

    async def _wait_interrupted(self) -> None:
        """Until every survivor parked with its just-in-time state (bounded: a collective with
        a lost peer raises within timeouts.collective, one step within timeouts.step). While
        torchpassd cannot hear the launchpads (its broker connection is down) the bound holds
        still: their reports wait in the outage, not in the job."""
        p = self.plan
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.t.step + self.t.collective
        view = self.view()
        baseline = {n: view.launchpads[n].max_step for n in p.survivors if n in view.launchpads}
        last = loop.time()
        while True:
            now = loop.time()
            if not self.control_up():
                deadline += now - last
            last = now
            await self._absorb()
            # a launchpad that reports late (torchpassd just restarted: it has not heard every node yet) joins in
            p.survivors = sorted(n for n in {*p.survivors, *self._survivors()} if n not in p.dead)
            unheard = self._unheard()
            steps = self._interrupted_steps()
            if steps is not None and not unheard:
                break
            self._check_still_training(baseline)
            if loop.time() > deadline:
                view = self.view()
                late = sorted({*unheard, *(n for n in p.survivors if n not in view.launchpads
                                           or any(w.get("state") != INTERRUPTED
                                                  for w in self._members(view.launchpads[n].workers)))})
                raise MigrationError(f"survivors {late} did not report their workers interrupted within "
                                     f"{self.t.step + self.t.collective:.0f} s",
                                     hint="a rank hangs outside a collective; see its launchpad log", **self.where)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):  # heartbeats arrive every second: poll
                await asyncio.wait_for(self._changed.wait(), 0.1)
        view = self.view()
        unregistered = sorted({n for n in p.survivors for w in self._members(view.launchpads[n].workers)
                               if w.get("registered") is False})
        if unregistered:
            raise MigrationError(f"workers on {unregistered} never called torchpass.register(save, load): "
                                 "their state cannot be captured, so the lost ranks cannot be rebuilt",
                                 hint=("a model-transparent job (--torchpass=transparent) is moved on planned "
                                       "drains only; " if view.mode == TRANSPARENT else "")
                                 + "fall back to the job's last checkpoint", **self.where)
        rank_node = {w["rank"]: n for n in p.survivors for w in self._members(view.launchpads[n].workers)}
        p.donor, p.laggards, p.resume_step = choose_donor(steps, rank_node, where=self.where)
        p.steps = steps
        await self.phase(INTERRUPTED_ALL, steps=steps, resume_step=p.resume_step, donor=p.donor,
                         laggards=p.laggards, severed=p.severed,
                         interrupted_after_s=interrupted_after(
                             [w for n in p.survivors for w in self._members(view.launchpads[n].workers)],
                             self.detected_at))

    def recover_args(self, addrs: dict[str, str]) -> dict[str, dict[str, Any]]:
        """The `recover` command for each survivor: donors stream each lost rank's state to its
        joiner (and the first donor to the lagging ranks, who listen for it); all re-enter the script."""
        p = self.plan
        base = {"gen": p.new_gen, "world_size": p.world_size, "step": p.resume_step, "lost_nodes": len(p.dead)}
        args = {n: dict(base) for n in p.survivors}
        view = self.view()
        rank_node = {r: n for n in p.survivors for r in view.ranks_on(n) if r not in p.lost_ranks}
        leaders = sorted(r for r in rank_node if p.steps.get(str(r), p.resume_step) == p.resume_step)
        load: dict[int, int] = {}

        def donate(rank: int, dest: TransferAddress) -> None:
            """From a replica of ``rank`` at the resume step (DDP: any; HSDP: the same shard elsewhere)."""
            donor = replica_donor(rank, view.replicas.get(rank), leaders, load)
            if donor is None:
                raise NoReplica(f"no survivor at step {p.resume_step} holds a replica of rank {rank}", **self.where)
            args[rank_node[donor]].setdefault("donate", []).append({"rank": rank, "from": donor, "dest": dest.wire()})

        for seat in p.seats:  # spread the lost ranks over their replicas
            for i, rank in enumerate(seat.get("ranks") or [seat["rank"]]):
                donate(rank, TransferAddress(seat["target_addr"], joiner_port(p.port, i), self.token))
        for lag in p.laggards:
            behind = [r for r in view.ranks_on(lag)
                      if r not in p.lost_ranks and p.steps.get(str(r), p.resume_step) < p.resume_step]
            ports = {r: joiner_port(p.port + LAG_PORT_OFFSET, j) for j, r in enumerate(behind)}
            args[lag]["load_from"] = {str(r): TransferAddress("0.0.0.0", port, self.token).wire()
                                      for r, port in ports.items()}
            addr = addrs.get(lag) or lag
            for r, port in ports.items():
                donate(r, TransferAddress(addr, port, self.token))
        for a in args.values():
            if len(a.get("donate", ())) == 1:
                a["donate"] = a["donate"][0]  # the contract's single form
        return args

    async def _recover(self) -> None:
        p = self.plan
        await self._absorb()
        nodes = await asyncio.to_thread(self.d.resizer.client.nodes)
        args = self.recover_args({n: nodes[n].addr for n in p.laggards if n in nodes and nodes[n].addr})
        p.recover_sent = True
        started = time.time()
        results = await asyncio.gather(*(self.send(n, "recover", p.new_gen, a, timeout=self.t.decision)
                                         for n, a in args.items()))
        res = dict(zip(args, results, strict=True))
        donor = res.get(p.donor) or {}
        await self.phase(RECOVERED, recover_s=round(time.time() - started, 3), bytes=donor.get("bytes"),
                         transfer_s=donor.get("seconds"))

    def _rejoin_states(self) -> list[str]:
        """The states of every worker of the recovery's nodes but crashed ones, as heartbeats show them."""
        view, p = self.view(), self.plan
        return [w.get("state") for n in p.members
                for w in (view.launchpads[n].workers if n in view.launchpads else ()) if w.get("state") != CRASHED]

    async def rejoined_after_restart(self) -> bool:
        """Whether the survivors got ``recover`` before torchpassd was restarted in the interrupted
        phase (a worker re-entered and loaded its state: joined); if so, wait (up to the decision
        timeout) until every worker has, for the hand-over is then done without torchpassd. Judged
        from heartbeats sent after this call began (what was retained may predate the recover)."""
        p, since = self.plan, time.monotonic()
        nodes = list(dict.fromkeys([*p.survivors, *p.in_place]))
        with contextlib.suppress(MigrationError):  # a node that stays silent: judged on what there is
            await self.d.registry.wait_for(lambda: True if all(
                (lp := self.view().launchpads.get(n)) is not None and (lp.last_heartbeat or 0.0) > since
                for n in nodes) else None, 3 * self.t.heartbeat_interval, "a heartbeat from every survivor")
        if not any(s in (WorkerState.JOINED, WorkerState.REFORMED) for s in self._rejoin_states()):
            return False
        self.plan.recover_sent = True
        await self.d.registry.wait_for(
            lambda: True if all(s in (WorkerState.JOINED, WorkerState.REFORMED) for s in self._rejoin_states())
            else None, self.t.decision, "every worker to load its state after the restart", **self.where)
        await self.phase(RECOVERED, after_restart=True)
        return True

    async def finish(self) -> str:
        """From the hand-over on: form generation G+1 with the joiner(s), resume at the failed
        step, release the dead node(s). Also used by a restarted torchpassd."""
        p = self.plan
        members = p.members
        try:
            await self._absorb()
            await asyncio.gather(*(self.send(n, "reform", p.new_gen, self._reform_args(p.new_gen)) for n in members))
            await self.phase(REFORMED)
            await asyncio.gather(*(self.send(n, "resume", p.new_gen, {"gen": p.new_gen}) for n in members))
            p.resumed_at, p.gen_after, p.paused_step = time.time(), p.new_gen, p.resume_step
            pause_s = p.resumed_at - p.failed_at
            await self.phase(RESUMED, pause_s=round(pause_s, 3), resumed_at_step=p.resume_step)
            problems = []
            for node in p.dead:  # DOWN, as Slurm takes a failed node: the user's srun is told its tasks are gone
                try:
                    await asyncio.to_thread(self.d.resizer.evict_node, int(p.job), node,
                                            f"torchpass: died in job {p.job}; its ranks were rebuilt on a spare")
                except TorchPassError as exc:  # the job runs on; the node stays allocated (and dead)
                    problems.append(f"evicting {node}: {exc}")
        except TorchPassError as exc:
            return await self.fail(str(exc))
        self.d.metrics.migration_pause_seconds.observe(pause_s)
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="succeeded")
        await self.phase(RELEASED, jn.SUCCEEDED, pause_s=round(pause_s, 3), problems=problems,
                         detect_s=round(max(0.0, self.detected_at - p.failed_at), 3))
        for t in p.targets:
            self.d.steps.pop(self._step_key(t), None)
        return jn.SUCCEEDED

    async def requeue(self, reason: str) -> str:
        """No replica of a lost rank survives: hand the job back to Slurm's queue (it restarts from
        its last checkpoint, as without TorchPass), recorded with the reason. Never a hang."""
        p = self.plan
        problems: list[str] = []
        for t in p.targets:
            problems += await self._drop_target(t)
        try:
            await asyncio.to_thread(self.d.resizer.requeue, int(p.job), p.source, f"torchpass: died ({p.source})")
            outcome = f"{reason}; job {p.job} requeued through Slurm"
        except TorchPassError as exc:
            outcome = f"{reason}; requeueing job {p.job} failed too: {exc}"
        self.failure = outcome
        self.log.error("unplanned.requeued", error=outcome)
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="failed")
        await self.phase(FAILED, jn.FAILED, error=outcome, problems=problems, fallback="requeue")
        return jn.FAILED

    async def fail(self, reason: str, *, survivors_exit: bool = True) -> str:
        """The job cannot be recovered: say why everywhere, let the spares go, and tell the
        parked survivors to exit (the job ends; restart it from its last checkpoint). Without
        ``survivors_exit`` they stay parked for another attempt, and a rank being rebuilt in place
        is held as crashed again (its joiner stopped), so the next attempt is decided from it."""
        p = self.plan
        self.failure = reason
        self.log.error("unplanned.failed", error=reason)
        problems: list[str] = []
        if not p.recover_sent:
            for t in p.targets:
                problems += await self._drop_target(t)
            if not survivors_exit:
                problems += await self._abort_on(p.in_place, {"hold": True})
        if survivors_exit:
            await self._tell_job(f"job {p.job} cannot be recovered, so it ends (restart it from its last "
                                 f"checkpoint): {reason}")
            problems += await self._abort_on(p.survivors, {"exit": True})
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="failed")
        await self.phase(FAILED, jn.FAILED, error=reason, problems=problems)
        return jn.FAILED

    async def _tell_job(self, text: str) -> None:
        """One line in the job's output, through a survivor's launchpad (the batch host's if it is
        one), while they still run: said before they are told to exit. Best effort."""
        survivors = self.plan.survivors
        if not survivors:
            return
        node = self.view().batch_host if self.view().batch_host in survivors else survivors[0]
        try:
            await self.send(node, "notice", self.plan.gen, {"text": text}, timeout=self.t.reform)
        except TorchPassError as exc:
            self.log.warning("unplanned.notice_failed", node=node, error=str(exc))


async def resume_after_restart(rec: UnplannedRecovery, phase: str) -> str:
    """A recovery a previous torchpassd left in ``phase``: before the hand-over the joiners it
    started are gone with its steps and the survivors are still parked, so it fails (the failure
    detector decides again and a new recovery starts from the evidence); after it, drive forward."""
    if phase == INTERRUPTED_ALL:
        try:
            if await rec.rejoined_after_restart():  # recover was sent before the restart
                return await rec.finish()
        except TorchPassError as exc:
            return await rec.fail(f"torchpassd restarted while the survivors recovered, and they did not: {exc}")
    if phase in BEFORE_RECOVER:
        return await rec.fail(f"torchpassd restarted during phase {phase}, before the hand-over; "
                              "the failure is decided again from the evidence", survivors_exit=False)
    if phase in (RECOVERED, REFORMED, RESUMED):
        return await rec.finish()
    raise MigrationError(f"in-flight recovery is in unknown phase {phase}", **rec.where)


class Driver:
    """The orchestrator's unplanned side: owns the failure detector, turns its decisions into
    recoveries (sharing the orchestrator's one-migration-per-job rule), and without a free spare
    lets the job wait (survivors parked; `torchpassctl status` says why) or fails it, as
    ``orchestrator.unplanned_no_spare`` says."""

    def __init__(self, orch: Any, control_up: Callable[[], bool]) -> None:
        self.o, self.d = orch, orch.d
        self.policy = self.d.cfg.orchestrator.unplanned_no_spare
        self.control_up = control_up
        self.dead: dict[str, dict[str, Death]] = {}
        self.running: dict[str, UnplannedRecovery] = {}
        self.given_up: set[str] = set()  # jobs whose recovery failed: ending, nothing more to judge
        self.crashes: dict[tuple[str, str], list[float]] = {}  # (job, node) -> when its workers crashed
        self._said: dict[str, str] = {}
        self.detector = FailureDetector(self.d.cfg.timeouts, on_death=self.on_death, busy=self.busy,
                                        nodes_of=self._nodes_of, control_up=control_up)
        self.log = log.get()

    def _nodes_of(self, job: str) -> tuple[str, ...]:
        view = self.d.registry.jobs.get(job)
        return view.nodes if view else ()

    def busy(self, job: str, node: str) -> str:
        """A planned migration off ``node`` runs: it owns the node until it ends. A job whose
        recovery failed is ending: its survivors leaving are no new failures."""
        if job in self.given_up:
            return "its recovery failed; the job ends"
        cur = self.o.current.get(job)
        if job in self.o.active and isinstance(cur, planned.PlannedMigration) and cur.plan.source == node:
            return f"a planned migration off {node} runs"
        if job in self.o.active and cur is not None and node in cur.swapped()[1]:
            return f"a migration is bringing {node} into the job"
        return ""

    def on_death(self, death: Death) -> None:
        self.d.metrics.failure_detect_seconds.observe(death.detect_s)
        flow = self.running.get(death.job)
        if flow is not None and flow.failure is None:
            flow.another_death(death)
            return
        # none runs, or the one running is failing (e.g. given up by a restart, whose abort makes an
        # in-place rank crash again right now): this death waits for the next recovery
        self.dead.setdefault(death.job, {})[death.node] = death
        if death.in_place:
            self._count_crash(death)
        else:
            self.o.pending.pop((death.job, death.node), None)  # a drain of it, if any, is moot now
        self.o.yield_to_recovery(death)
        self.o.kick()

    def _count_crash(self, death: Death) -> None:
        """Escalation: a node whose workers crashed CRASHES_TO_DRAIN times within CRASH_WINDOW_S is
        drained (reason in sinfo -R), so once this in-place recovery is done the planned migration
        moves its ranks to a spare: a node that keeps killing workers is not healthy after all."""
        key, now = (death.job, death.node), death.decided_at
        recent = [t for t in self.crashes.get(key, []) if now - t < CRASH_WINDOW_S] + [now]
        self.crashes[key] = recent
        if len(recent) < CRASHES_TO_DRAIN:
            return
        self.crashes.pop(key)
        reason = (f"torchpass: {len(recent)} worker crashes of job {death.job} within "
                  f"{CRASH_WINDOW_S / 60:.0f} min; its ranks move to a spare")
        self.log.warning("unplanned.crash_escalated", job=death.job, node=death.node, crashes=len(recent))

        async def drain() -> None:
            try:
                await asyncio.to_thread(node_admin.drain, self.d.resizer.runner, death.node, reason)
            except TorchPassError as exc:
                self.log.error("unplanned.escalation_failed", node=death.node, error=str(exc))
        asyncio.create_task(drain())

    def describe(self) -> list[dict[str, Any]]:
        return [{**d.describe(), "waiting": self.d.registry.jobs[job].blocked if job in self.d.registry.jobs else ""}
                for job, deaths in self.dead.items() for d in deaths.values()]

    def on_slurm(self, e: ev.SlurmEvent) -> None:
        """slurmctld's events: evidence for the detector; an ended job is forgotten."""
        self.detector.on_slurm(e)
        if isinstance(e, ev.JobEnded):
            self.dead.pop(str(e.job), None)
            self.given_up.discard(str(e.job))

    def waits(self, job: str) -> bool:
        """The job has dead nodes to recover (planned migrations of it wait)."""
        return bool(self.dead.get(job)) or job in self.running

    def kick(self) -> None:
        for job, deaths in list(self.dead.items()):
            if job in self.given_up:  # its recovery failed: the job is ending
                self.dead.pop(job)
                continue
            view = self.d.registry.job(job)
            for node in [n for n in deaths if view.nodes and n not in view.nodes]:
                deaths.pop(node)  # it left the job meanwhile (a migration's spare let go): nothing to recover
            if job in self.o.active or not deaths:
                if not deaths:
                    self.dead.pop(job)
                continue
            why = self._blocked(job, deaths)
            if why:
                if self._said.get(job) != why:
                    self.log.warning("unplanned.waiting", job=job, why=why)
                    asyncio.create_task(asyncio.to_thread(self.d.journal.add_event, "unplanned.waiting",
                                                          job_id=job, detail={"nodes": sorted(deaths), "why": why}))
                self._said[job] = view.blocked = why
                continue
            self._said.pop(job, None)
            view.blocked = ""
            self.dead.pop(job)
            self.o._spawn(job, self._recover(job, sorted(deaths.values(), key=lambda d: d.decided_at)))

    def _blocked(self, job: str, deaths: dict[str, Death]) -> str:
        if self.o.watcher.last is None:
            return "waiting for the first Slurm poll"
        if self.policy != "wait":
            return ""  # fail: the recovery starts and fails clearly without a spare
        lost_nodes = [d for d in deaths.values() if not d.in_place]  # a crash rebuilt in place takes no spare
        if not lost_nodes:
            return ""
        spares = self.d.pool.list(self.o.watcher.last)
        free = [s for s in spares if s.available]
        if len(free) + len(self.d.registry.job(job).hot_spares()) < len(lost_nodes):
            detail = "; ".join(f"{s.node}: {s.why}" for s in spares) or "the spare reservation has no nodes"
            return (f"{', '.join(sorted(deaths))} died; no spare free ({detail}); the survivors stay parked and "
                    "the job recovers when one appears (orchestrator.unplanned_no_spare = wait)")
        return ""

    async def open_record(self, job: str, mode: str, source: str, reason: str) -> tuple[str, int]:
        """Journal a recovery (or reroute) of ``job`` starting in its current generation and announce
        it; returns (migration id, generation)."""
        rec = {j.job_id: j for j in await asyncio.to_thread(self.d.journal.jobs)}.get(job)
        gen = rec.gen if rec else 1
        mid = await asyncio.to_thread(self.d.journal.start_migration, job, mode=mode, source=source,
                                      reason=reason, gen=gen)
        await self.d.publish_event(job, "migration.started", {"migration": mid, "source": source,
                                                              "reason": reason, "mode": mode})
        return mid, gen

    async def _recover(self, job: str, deaths: list[Death]) -> None:
        first = deaths[0]
        reason = (f"ranks {list(first.ranks)} crashed on {first.node}: " if first.in_place
                  else f"node {first.node} died: ") + "; ".join(first.evidence)
        mid, gen = await self.open_record(job, MODE, first.node, reason)
        plan = UnplannedPlan(job=job, source=first.node, gen=gen, evidence=list(first.evidence),
                             failed_at=min(d.failed_at for d in deaths))
        flow = UnplannedRecovery(self.d, plan, mid, detected_at=first.decided_at, no_spare=self.policy,
                                 control_up=self.control_up)
        await self.run(flow, flow.run(deaths))

    async def run(self, flow: UnplannedRecovery, work: Awaitable[str]) -> None:
        """Carry out ``work`` of ``flow`` as the job's one running recovery (deaths meanwhile join it)."""
        job = flow.plan.job
        self.running[job] = self.o.current[job] = flow
        try:
            status = await work
        finally:
            self.running.pop(job, None)
        p = flow.plan
        if status == jn.ROLLED_BACK:  # its ranks were alive: judge it again only on harder evidence
            for node in p.dead:
                self.detector.undecide(job, node, proven_alive=True)
        elif status == jn.FAILED and not p.recover_sent and "restarted" in (flow.failure or ""):
            for seat in p.seats:  # judged again from the evidence
                self.detector.recall(job, seat["node"], seat["ranks"])
        elif status == jn.FAILED:
            self.given_up.add(job)

    async def resume(self, rec: jn.MigrationRecord, kind: type[UnplannedRecovery] = UnplannedRecovery) -> None:
        """A recovery (of ``kind``: a reroute is one) a previous torchpassd left in flight."""
        plan = UnplannedPlan.from_record(rec)
        flow = kind(self.d, plan, rec.id, detected_at=rec.started, no_spare=self.policy, control_up=self.control_up)
        await self.run(flow, resume_after_restart(flow, rec.phase))
