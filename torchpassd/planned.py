"""The planned, model-aware migration of one node's rank off a draining node onto a spare:
spare chosen -> added to the job -> launchpad and joining worker started there -> all ranks
pause after one step S -> the leaving rank's save() state streamed by the wormhole -> new
generation formed -> resume -> drained node released. Every phase is journaled (with what a
restarted torchpassd needs), published on the job's events topic and timed; a failure before
the hand-over rolls back to the running job, after it the migration is driven forward."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import subprocess
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slurm_plugin import node_admin
from slurm_plugin.resize import JobResizer
from slurm_plugin.spares import SparePool
from torchpass_common import agent_channel as ac
from torchpass_common import log, task_handover
from torchpass_common.config import Config
from torchpass_common.errors import MigrationError, SpareFailed, TorchPassError
from torchpass_common.transfer_address import TransferAddress
from torchpassd import journal as jn
from torchpassd.commander import Commander
from torchpassd.metrics import Metrics
from torchpassd.registry import JobView, Registry

MODE = "planned-aware"
WORMHOLE_PORT_BASE = 29400  # the joiner listens on BASE + generation (a fresh port per migration)
JOINER_PORT_STRIDE = 200  # a joining node's local worker i listens on that port + i * STRIDE
PAUSE_MARGIN_S = 1.5  # steps the job may run between the last heartbeat and the pause command
# Phases in order; a restarted torchpassd rolls back a migration that stopped before HANDED_OVER.
REQUESTED, SPARE_CHOSEN, SPARE_ADDED, JOINER_READY, PAUSED = (
    "requested", "spare_chosen", "spare_added", "joiner_ready", "paused")
HANDED_OVER, REFORMED, RESUMED, RELEASED, ROLLED_BACK, FAILED = (
    "handed_over", "reformed", "resumed", "released", "rolled_back", "failed")
BEFORE_HANDOVER = (REQUESTED, SPARE_CHOSEN, SPARE_ADDED, JOINER_READY, PAUSED)


@dataclass
class Plan:
    """What one migration decided so far; journaled with every phase (never the token)."""

    job: str
    source: str
    gen: int
    rank: int = -1
    ranks: list[int] = field(default_factory=list)  # every rank the move takes (planned-aware: the node's)
    world_size: int = 0
    target: str = ""
    target_addr: str = ""
    port: int = 0
    store_host: str = ""
    store_port: int = 0
    at_step: int = -1
    paused_step: int = -1
    survivors: list[str] = field(default_factory=list)
    paused_at: float = 0.0
    resumed_at: float = 0.0
    gen_after: int = 0  # the job's generation once the migration ended (0: unchanged)
    path: str = ""  # a reroute (reroute.py): the interface the job's collectives move to
    path_before: str = ""  # a reroute: the one they took before
    hot: list[str] = field(default_factory=list)  # hot spares of the job's allocation taking ranks (--torchpass-spares)

    @property
    def new_gen(self) -> int:
        return self.gen + 1

    @classmethod
    def from_record(cls, rec: jn.MigrationRecord) -> Plan:
        merged: dict[str, Any] = {}
        for p in rec.phases:
            merged.update(p.detail.get("plan", {}))
        known = set(cls.__dataclass_fields__)
        plan = cls(job=rec.job_id, source=rec.source, gen=rec.gen)
        for k, v in merged.items():
            if k in known:
                setattr(plan, k, v)
        if not plan.ranks and plan.rank >= 0:  # journaled before a move took a node's every rank
            plan.ranks = [plan.rank]
        return plan


def joiner_port(port: int, index: int) -> int:
    """The wormhole port of a joining node's local worker ``index`` (``port``: the migration's)."""
    return port + index * JOINER_PORT_STRIDE


@dataclass(frozen=True)
class WorkerTemplate:
    """How the leaving rank's worker was started, read from its /proc entry through a job step:
    enough to start the same script as a joining rank on the spare."""

    python: str
    script_args: list[str]
    env: dict[str, str]
    cwd: str

    @classmethod
    def parse(cls, text: str, *, job: str, node: str) -> WorkerTemplate:
        try:
            argv_part, env_part, cwd = text.split("\n===\n")
            argv = [a for a in argv_part.split("\n") if a]
            boot = argv.index("torchpass._bootstrap")
        except ValueError:
            raise MigrationError("the leaving worker does not run under the torchpass bootstrap",
                                 hint="start training through launchpad (srun torchrun under --torchpass)",
                                 job=job, node=node) from None
        env = dict(line.split("=", 1) for line in env_part.split("\n") if "=" in line)
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise MigrationError(f"the leaving worker's environment lacks {name}", job=job, node=node,
                                     hint="it was not started by launchpad")
        cwd = cwd.strip()
        # Linux marks a working directory that was removed meanwhile; the joiner wants its name
        return cls(argv[0], argv[boot + 1:], env, cwd.removesuffix(" (deleted)"))

    @property
    def as_tasks(self) -> bool:
        """The leaving rank is a srun python task's (launchpad --as-tasks): a joiner is one too."""
        return self.env.get(task_handover.ENV_AS_TASKS) == "1"

    def task_step_env(self) -> dict[str, str]:
        """For a joiner of a srun python task's rank: the step's SLURM_* as the leaving task had them
        (its SLURMEnvironment-style code computes the same world from them); {} for a torchrun job."""
        return {task_handover.ENV_TASK_STEP: json.dumps(task_handover.step_vars(self.env))} if self.as_tasks else {}

    def output_args(self) -> list[str]:
        """The leaving node's launchpad output options (--tee, --log-dir, ...), to start the spare's
        launchpad with the same; [] when it had none or the value is not a list of strings."""
        try:
            args = json.loads(self.env.get(ac.ENV_OUTPUT_ARGS, "[]"))
        except ValueError:
            return []
        return args if isinstance(args, list) and all(isinstance(a, str) for a in args) else []


@dataclass
class Deps:
    """What a migration works with; built once by the daemon."""

    cfg: Config
    journal: jn.Journal
    registry: Registry
    commander: Commander
    resizer: JobResizer
    pool: SparePool
    metrics: Metrics
    publish_event: Callable[[str, str, dict[str, Any]], Awaitable[None]]
    steps_dir: Path
    steps: dict[str, subprocess.Popen] = field(default_factory=dict)  # migration -> spare's srun


class Flow:
    """What planned and unplanned migrations share: journaled phases, commands to launchpads,
    reading a worker's command line, starting a joining rank on a spare (launchpad + worker,
    wormhole receiver), the re-form arguments, and letting a spare go again."""

    mode = MODE

    def __init__(self, deps: Deps, plan: Plan, migration: str, *, detected_at: float) -> None:
        self.d = deps
        self.plan = plan
        self.id = migration
        self.detected_at = detected_at  # wall time the drain (or failure) was seen
        self.token = secrets.token_bytes(32)
        self.t = deps.cfg.timeouts
        self.log = log.get(job=plan.job, node=plan.source, migration=migration, gen=plan.gen)
        self.where = {"job": plan.job, "node": plan.source, "migration": migration, "gen": plan.gen}
        self.last_phase = REQUESTED
        self.spare_failure: SpareFailed | None = None  # the last spare that could not take the ranks
        self.error = ""  # why it rolled back or failed, once it has
        self.lasting = ""  # a failure that a retry would meet again (why), so the move is not retried
        self.failed_spares: dict[str, SpareFailed] = {}  # every such spare: drained when let go

    # ---- bookkeeping -----------------------------------------------------------------------
    async def phase(self, name: str, status: str = jn.RUNNING, error: str | None = None,
                    **detail: Any) -> None:
        self.last_phase = name
        self.error = error or self.error
        rec = await asyncio.to_thread(self.d.journal.record_transition, self.id, name, status,
                                      {"plan": asdict(self.plan), **detail},
                                      target=self.plan.target or None, error=error, job_after=self._job_after(status))
        self.log.info("migration.phase", phase=name, status=status, seconds=round(rec.seconds, 3),
                      **({"error": error} if error else {}))
        await self.d.publish_event(self.plan.job, "migration.phase", {
            "migration": self.id, "phase": name, "status": status, "seconds": rec.seconds,
            "source": self.plan.source, "target": self.plan.target, "error": error, **detail})

    def view(self) -> JobView:
        return self.d.registry.job(self.plan.job)

    def _others_training(self) -> list[str]:
        """The nodes, besides the leaving one and the spare, whose launchpad reports workers."""
        return sorted(n for n, lp in self.view().launchpads.items()
                      if lp.online and lp.workers and n not in (self.plan.source, self.plan.target))

    def _job_after(self, status: str) -> jn.JobAfter | None:
        """The job's generation and nodes once this migration ends with ``status``; None while it
        runs, or when it ends in the generation it started in."""
        if status not in jn.TERMINAL or not self.plan.gen_after:
            return None
        left, joined = self.swapped() if status == jn.SUCCEEDED else ((), ())
        nodes = [n for n in dict.fromkeys((*self.view().nodes, *joined)) if n not in left or self.keeps_source()]
        return jn.JobAfter(self.plan.gen_after, nodes)

    def keeps_source(self) -> bool:
        """The leaving node is the job's batch host: Slurm cannot take it out of the running job,
        so it stays in it, running no ranks; its launchpad keeps the rendezvous store the job's
        groups re-form through until the job ends."""
        return self.plan.source == self.view().batch_host

    def swapped(self) -> tuple[list[str], list[str]]:
        """The nodes a succeeded migration took out of the job, and those it put in."""
        return [self.plan.source], [self.plan.target]

    async def send(self, node: str, cmd: str, gen: int, args: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        return await self.d.commander.send(self.plan.job, node, cmd, migration=self.id, gen=gen,
                                           args=args, timeout=timeout or self.t.decision)

    def failed_before_hand_over(self, exc: TorchPassError) -> str:
        """Note whether ``exc`` was the spare's failure (roll_back then drains the spare) and
        return the rollback's reason."""
        self.spare_failure = exc if isinstance(exc, SpareFailed) else None
        if self.spare_failure is not None:
            self.failed_spares[self.spare_failure.spare] = self.spare_failure
        return str(exc)

    def before_hand_over(self) -> bool:
        """Nothing has moved yet: the leaving ranks still hold the only copy of their state."""
        return self.last_phase in BEFORE_HANDOVER

    async def job_ended(self, state: str) -> None:
        """The job ended (its training finished, or it was cancelled) before the hand-over, while
        this migration's task was stopped: nothing is left to move and no launchpad to talk to.
        Let the spare go and record why, at once rather than after a command's timeout."""
        problems = await self._drop_target(self.plan.target) if self.plan.target else []
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="rolled_back")
        await self.phase(ROLLED_BACK, jn.ROLLED_BACK, problems=problems,
                         error=f"job {self.plan.job} ended ({state}) during the migration, before the hand-over; "
                               "nothing to move")

    # ---- shared steps ------------------------------------------------------------------------
    async def _take_spare(self) -> tuple[str, str]:
        """A spare out of the pool and its address (nothing else is changed yet)."""
        target = await asyncio.to_thread(self.d.pool.take, job=int(self.plan.job))
        nodes = await asyncio.to_thread(self.d.resizer.client.nodes)
        return target, nodes[target].addr or target

    async def _hot_spare(self, exclude: Collection[str] = ()) -> tuple[str, str] | None:
        """A hot spare of the job's own allocation (``--torchpass-spares``): its launchpad runs no
        rank and holds a warm standby a rank; healthy in Slurm, not in ``exclude``, warm ones first.
        Its name and address, or None."""
        candidates = [n for n in self.view().hot_spares() if n not in exclude]
        if not candidates:
            return None
        nodes = await asyncio.to_thread(self.d.resizer.client.nodes)
        node = next((n for n in candidates if n in nodes and nodes[n].healthy), None)
        return None if node is None else (node, nodes[node].addr or node)

    async def _start_joiners_on(self, node: str, addr: str, ranks: list[int], **place: int) -> None:
        """Have the launchpad running on ``node`` (a crash's own node, or a hot spare taking the place
        ``place`` says: group_rank, group_world_size) start a joiner for each of ``ranks``; returns
        once each listens for its state."""
        p = self.plan
        p.port = p.port or WORMHOLE_PORT_BASE + p.new_gen
        ports = [joiner_port(p.port, i) for i in range(len(ranks))]
        await self.send(node, "start_joiner", p.gen, {"world_size": p.world_size, **place, "joiners": [
            {"rank": rank, "source": TransferAddress("0.0.0.0", port, self.token).wire()}
            for rank, port in zip(ranks, ports, strict=True)]}, timeout=self.t.reform)
        await self._wait_receiver(None, node, addr, ports, "")

    async def _add_spare_to_job(self, target: str) -> None:
        """Grow the job by the spare taken for it; from then on Slurm's state guards the node."""
        await asyncio.to_thread(self.d.resizer.add_node, int(self.plan.job), target)
        self.d.pool.settled(target)

    def _adopt_template(self, tpl: WorkerTemplate) -> None:
        p = self.plan
        p.world_size, p.store_host = int(tpl.env["WORLD_SIZE"]), tpl.env["MASTER_ADDR"]
        p.store_port = int(tpl.env["MASTER_PORT"])

    async def _template(self, node: str, rank: int) -> WorkerTemplate:
        """Read the command line, environment and cwd of ``rank``'s worker on ``node`` (a step
        on that node): how to start the same script as a joining rank elsewhere."""
        p = self.plan
        lp = self.view().launchpads[node]
        pid = next(w["pid"] for w in lp.workers if w["rank"] == rank)
        script = (f"tr '\\0' '\\n' </proc/{pid}/cmdline; echo; echo ===; tr '\\0' '\\n' </proc/{pid}/environ; "
                  f"echo; echo ===; readlink /proc/{pid}/cwd")
        rc, out, err = await self._node_shell(node, script, self.d.cfg.slurm.command_timeout,
                                              f"reading rank {rank}'s command line on {node}")
        if rc != 0:
            raise MigrationError(f"cannot read rank {rank}'s command line on {node}: {err.strip()}", **self.where)
        return WorkerTemplate.parse(out, job=p.job, node=node)

    async def _node_shell(self, node: str, script: str, timeout: float, what: str) -> tuple[int, str, str]:
        """Run ``script`` (sh) on ``node`` as a step of the job: (exit code, stdout, stderr).
        MigrationError when it does not end within ``timeout`` seconds (it is killed)."""
        proc = await asyncio.to_thread(self.d.resizer.start_step, int(self.plan.job), node, ["sh", "-c", script],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = await asyncio.to_thread(proc.communicate, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
            raise MigrationError(f"{what} timed out", **self.where) from None
        return proc.returncode, out, err

    def _joiner_argv(self, tpl: WorkerTemplate, nproc: int, target: str) -> list[str]:
        """launchpad on ``target`` running ``tpl``'s script in ``nproc`` joining workers (their ranks
        and sources come in the join plan, agent_channel.ENV_JOIN_PLAN)."""
        p = self.plan
        config = tpl.env.get("TORCHPASS_CONFIG") or self.d.cfg.source
        entry = ["--module", *tpl.script_args[1:]] if tpl.script_args[:1] == ["-m"] else tpl.script_args
        return [tpl.python, "-m", "launchpad", "--job", p.job, "--node", target,
                *(["--config", config] if config else []), *(["--as-tasks"] if tpl.as_tasks else []),
                "--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{p.store_host}:{p.store_port}",
                "--rdzv-id", f"{p.job}-join-{self.id[:8]}-{target}",  # one rendezvous per joining node
                *tpl.output_args(), *entry]

    def _step_key(self, target: str) -> str:
        return f"{self.id}/{target}"

    async def _start_joiner(self, tpl: WorkerTemplate, ranks: list[int], target: str, target_addr: str, *,
                            group_rank: int | None = None) -> None:
        """Start launchpad and one joining worker per rank of ``ranks`` on ``target`` (a job step; the
        wormhole tokens travel in its environment, never on a command line or in a log) and wait
        until every one of them listens for its state. ``group_rank``: the node rank the joiners take
        (default: that of ``tpl``, read from the leaving node's worker)."""
        p = self.plan
        ports = [joiner_port(p.port, i) for i in range(len(ranks))]
        if group_rank is None:
            group_rank = int(tpl.env.get("GROUP_RANK", 0))
        plan = {"ranks": ranks, "world_size": p.world_size, "group_rank": group_rank,
                "group_world_size": int(tpl.env.get("GROUP_WORLD_SIZE", 1)),
                "sources": [TransferAddress("0.0.0.0", port, self.token).wire() for port in ports],
                "cwd": tpl.cwd}
        self.d.steps_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.d.steps_dir / f"{p.job}-{self.id[:8]}-{target}.log", "ab")  # noqa: SIM115 - the step owns it
        try:
            proc = await asyncio.to_thread(
                self.d.resizer.start_step, int(p.job), target, self._joiner_argv(tpl, len(ranks), target),
                extra_env={ac.ENV_JOIN_PLAN: json.dumps(plan), **tpl.task_step_env()}, job_output=True, chdir=tpl.cwd,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()
        self.d.steps[self._step_key(target)] = proc
        asyncio.get_running_loop().run_in_executor(None, proc.wait)  # reap it whenever it ends
        await self._wait_receiver(proc, target, target_addr, ports, tpl.cwd)

    async def _wait_receiver(self, proc: subprocess.Popen | None, target: str, target_addr: str, ports: list[int],
                             cwd: str) -> None:
        """Until every joining worker's wormhole receiver listens (it has built its model and sits in
        register()); the launchpad step ``proc`` (None: joiners of a running launchpad) ending first
        is a failure."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.t.decision
        waiting = list(ports)
        while waiting:
            if proc is not None and proc.poll() is not None:
                raise SpareFailed(_step_ended(proc.returncode, target, cwd), spare=target,
                                  hint=f"see {self.d.steps_dir} and the job's output", **self.where)
            with contextlib.suppress(OSError):
                sock = await asyncio.wait_for(asyncio.open_connection(target_addr, waiting[0]), 1.0)
                sock[1].close()
                waiting.pop(0)
                continue
            if loop.time() > deadline:
                raise SpareFailed(f"the joiners on {target} did not get ready within {self.t.decision:.0f} s "
                                  f"(not listening: ports {waiting})", spare=target, **self.where)
            await asyncio.sleep(0.1)

    def _reform_args(self, gen: int) -> dict[str, Any]:
        """The re-form of generation ``gen``: its size, the store and a fresh prefix, and the
        interface the job's collectives take now (a job rerouted keeps its path across a move)."""
        p = self.plan
        path = self.view().path
        return {"gen": gen, "world_size": p.world_size, "store_host": p.store_host, "store_port": p.store_port,
                "prefix": f"/torchpass/{p.job}/gen{gen}", **({"ifname": path} if path else {})}

    async def _abort_on(self, nodes: list[str], args: dict[str, Any]) -> list[str]:
        """Send ``abort`` with ``args`` to ``nodes`` side by side; the problems, one per node that failed."""
        results = await asyncio.gather(*(self.send(n, "abort", self.plan.gen, args, timeout=self.t.reform)
                                         for n in nodes), return_exceptions=True)
        return [f"{n}: {r}" for n, r in zip(nodes, results, strict=True) if isinstance(r, BaseException)]

    async def _drop_target(self, target: str) -> list[str]:
        """Stop the joiner on ``target`` and its launchpad, take the spare out of the job, back
        to the pool; returns what went wrong on the way. A hot spare stays in the job (its
        launchpad is a task of the user's step): only the joiners this migration started stop."""
        p = self.plan
        if target in p.hot:
            return await self._abort_on([target], {})
        problems: list[str] = []
        proc = self.d.steps.pop(self._step_key(target), None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
        elif self.view().launchpads.get(target) is not None:  # started by a previous torchpassd
            with contextlib.suppress(TorchPassError):
                await self.send(target, "exit", p.gen, timeout=5.0)
        try:
            await asyncio.to_thread(self.d.resizer.release_node, int(p.job), target)
        except TorchPassError as exc:
            problems.append(f"releasing {target}: {exc}")
        if (failure := self.failed_spares.get(target)) is not None:
            reason = f"torchpass: joiner failed: {failure.message}"[:200]
            try:  # not back into the pool: the next migration would fail on it the same way
                await asyncio.to_thread(node_admin.drain, self.d.resizer.runner, target, reason)
            except TorchPassError as exc:
                problems.append(f"draining the failed spare {target}: {exc}")
        self.d.pool.give_back(target)
        return problems


class PlannedMigration(Flow):
    """One migration of ``plan.source``'s rank in ``plan.job``; ``run()`` drives it to an end."""

    def __init__(self, deps: Deps, plan: Plan, migration: str, *, detected_at: float) -> None:
        super().__init__(deps, plan, migration, detected_at=detected_at)
        self.save_sent = False

    async def run(self) -> str:
        """Carry the migration out; returns the final status (succeeded or rolled_back)."""
        try:
            await self._prepare()
            await self._pause()
            await self._hand_over()
        except TorchPassError as exc:
            await self.roll_back(self.failed_before_hand_over(exc))
            return jn.ROLLED_BACK
        return await self.finish()

    async def _prepare(self) -> None:
        p, view = self.plan, self.view()
        p.ranks = view.ranks_on(p.source)
        if not p.ranks:
            raise MigrationError(f"{p.source} runs no rank of the job", hint="nothing to move", **self.where)
        p.rank = p.ranks[0]
        p.survivors = self._others_training()
        hot = await self._hot_spare()
        p.target, p.target_addr = hot or await self._take_spare()
        p.hot = [p.target] if hot else []
        p.port = WORMHOLE_PORT_BASE + p.new_gen
        await self.phase(SPARE_CHOSEN, detect_s=round(time.time() - self.detected_at, 3), hot=bool(hot))
        if not hot:
            await self._add_spare_to_job(p.target)
            await self.phase(SPARE_ADDED)
        tpl = await self._template(p.source, p.rank)
        self._adopt_template(tpl)
        if hot:  # its launchpad runs: the joiners take the leaving node's place there, warm
            await self._start_joiners_on(p.target, p.target_addr, p.ranks, group_rank=int(tpl.env.get("GROUP_RANK", 0)),
                                         group_world_size=int(tpl.env.get("GROUP_WORLD_SIZE", 1)))
        else:
            await self._start_joiner(tpl, p.ranks, p.target, p.target_addr)
        await self.phase(JOINER_READY)

    def _pause_step(self) -> int:
        """A step every rank is still before: the highest reported step plus what the job may
        run during the heartbeat lag and the command's delivery."""
        view = self.view()
        lps = [view.launchpads[n] for n in [*self.plan.survivors, self.plan.source]]
        rate = max(lp.steps_per_s for lp in lps)
        lag = max(lp.heartbeat_age() or 0.0 for lp in lps) + PAUSE_MARGIN_S
        return max(lp.max_step for lp in lps) + 1 + math.ceil(rate * lag)

    async def _pause(self) -> None:
        p = self.plan
        p.survivors = self._others_training()  # a launchpad may have reported since _prepare (a young job)
        p.at_step = self._pause_step()
        nodes = [*p.survivors, p.source]
        acks = await asyncio.gather(*(self.send(n, "pause", p.gen, {"at_step": p.at_step, "gen": p.gen})
                                      for n in nodes))
        steps = {int(r): s for a in acks for r, s in a["steps"].items()}
        if set(steps) != set(range(p.world_size)):
            missing = sorted(set(range(p.world_size)) - set(steps))
            raise MigrationError(f"ranks {missing} did not pause (their launchpads paused no worker)",
                                 hint="launchpad skips workers it still counts as joining; see its pause",
                                 **self.where)
        if set(steps.values()) != {p.at_step}:
            raise MigrationError(f"ranks paused at different steps {steps}", **self.where)
        p.paused_step, p.paused_at = p.at_step, time.time()
        await self.phase(PAUSED, step=p.paused_step)

    async def _hand_over(self) -> None:
        p = self.plan
        saves = [{"rank": rank, "dest": TransferAddress(p.target_addr, joiner_port(p.port, i), self.token).wire()}
                 for i, rank in enumerate(p.ranks)]
        self.save_sent = True
        res = await self.send(p.source, "save", p.gen, {"saves": saves})  # the node's ranks stream side by side
        await self.phase(HANDED_OVER, bytes=res.get("bytes"), transfer_s=res.get("seconds"), ranks=p.ranks)

    async def finish(self) -> str:
        """From the hand-over on: form the new generation with the joiner, resume, release the
        drained node. The leaving rank stays parked until the new generation stands, so a failed
        re-form can still go back to it. Also used by a restarted torchpassd (every command here
        is idempotent in launchpad)."""
        p = self.plan
        members = [*p.survivors, p.target]
        try:
            await asyncio.gather(*(self.send(n, "reform", p.new_gen, self._reform_args(p.new_gen)) for n in members))
        except TorchPassError as exc:
            return await self._reform_back(f"forming generation {p.new_gen} with {p.target} failed: {exc}")
        try:
            await self.phase(REFORMED)
            await asyncio.gather(*(self.send(n, "resume", p.new_gen, {"gen": p.new_gen}) for n in members))
            p.resumed_at, p.gen_after = time.time(), p.new_gen  # every member trains again: the pause ends
            # then the leaving worker exits: freeing gigabytes of state takes a while, and on a node
            # shared with the members (a test machine) it would slow their resume
            await self.send(p.source, "exit", p.gen)
            pause_s = p.resumed_at - p.paused_at
            await self.phase(RESUMED, pause_s=round(pause_s, 3), resumed_at_step=p.paused_step)
            if self.keeps_source():
                self.view().emptied.add(p.source)
                self.log.info("migration.batch_host_kept", node=p.source,
                              why="Slurm cannot release a job's batch host; it runs no ranks from now on")
            else:
                await self._source_gone()
                await asyncio.to_thread(self.d.resizer.release_node, int(p.job), p.source)
        except TorchPassError as exc:
            await self.phase(FAILED, jn.FAILED, error=str(exc))
            self.d.metrics.migrations_total.inc(mode=self.mode, outcome="failed")
            return jn.FAILED
        self.d.metrics.migration_pause_seconds.observe(pause_s)
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="succeeded")
        await self.phase(RELEASED, jn.SUCCEEDED, pause_s=round(pause_s, 3), kept_in_job=self.keeps_source())
        self.d.steps.pop(self._step_key(p.target), None)
        return jn.SUCCEEDED

    async def _reform_back(self, reason: str) -> str:
        """The joiner could not be admitted: form one more generation with the leaving rank
        (still parked, its state intact) instead, resume, and let the spare go."""
        p = self.plan
        self.log.warning("migration.reforming_back", reason=reason)
        back = p.new_gen + 1
        members = [*p.survivors, p.source]
        try:
            await self._drop_target(p.target)
            await asyncio.gather(*(self.send(n, "reform", back, self._reform_args(back)) for n in members))
            await asyncio.gather(*(self.send(n, "resume", back, {"gen": back}) for n in members))
        except TorchPassError as exc:
            await self.phase(FAILED, jn.FAILED, error=f"{reason}; going back to {p.source} failed too: {exc}")
            self.d.metrics.migrations_total.inc(mode=self.mode, outcome="failed")
            return jn.FAILED
        p.gen_after = back
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="rolled_back")
        await self.phase(ROLLED_BACK, jn.ROLLED_BACK, error=reason)
        return jn.ROLLED_BACK

    async def _source_gone(self) -> None:
        """Let the leaving launchpad finish on its own before Slurm takes the node away: its task
        then ends with code 0 and the user's srun (and so the job) ends COMPLETED; a task still
        running at the release is killed, and srun and the job fail. Past the re-form timeout Slurm's
        release stops it anyway."""
        view = self.view()
        source = self.plan.source
        with contextlib.suppress(MigrationError):
            lp = await self.d.registry.wait_for(
                lambda: lp if (lp := view.launchpads.get(source)) is not None and not lp.online else None,
                self.t.reform, f"the launchpad on {source} to exit", **self.where)
            await self._process_ended(source, lp.pid)

    async def _process_ended(self, node: str, pid: int) -> None:
        """Until process ``pid`` on ``node`` is gone (reaped by its slurmstepd, which has then told
        srun its exit code), looked at through a step on that node; at most timeouts.reform."""
        if pid <= 0:
            return
        tries = max(1, int(self.t.reform / 0.05))
        script = f"i=0; while [ -e /proc/{pid} ] && [ $i -lt {tries} ]; do sleep 0.05; i=$((i+1)); done; " \
                 f"[ ! -e /proc/{pid} ]"
        try:
            rc, _, err = await self._node_shell(node, script, self.t.reform + self.d.cfg.slurm.command_timeout,
                                                f"waiting for launchpad {pid} on {node} to end")
        except TorchPassError as exc:
            self.log.warning("migration.source_exit_unknown", pid=pid, error=str(exc))
            return
        if rc != 0:
            self.log.warning("migration.source_still_running", pid=pid, error=err.strip())

    async def roll_back(self, reason: str) -> None:
        """Before the hand-over: back to the job as it was. Paused ranks resume in the current
        generation, the joiner and its launchpad go, the spare leaves the job for the pool."""
        p = self.plan
        self.log.warning("migration.rolling_back", reason=reason)
        problems = await self._abort_on([*p.survivors, p.source], {})
        if self.save_sent:
            # A failed save leaves the leaving rank parked but reported as errored, and launchpad's
            # abort resumes only workers it sees as paused: resume it by name.
            try:
                await self.send(p.source, "resume", p.gen, {"gen": p.gen}, timeout=self.t.reform)
            except TorchPassError as exc:
                problems.append(f"resuming ranks {p.ranks} on {p.source}: {exc}")
        if p.target:
            problems += await self._drop_target(p.target)
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="rolled_back")
        await self.phase(ROLLED_BACK, jn.ROLLED_BACK, error=reason, problems=problems)

async def resume_after_restart(mig: PlannedMigration, phase: str) -> str:
    """A migration a previous torchpassd left in ``phase``: roll it back if the hand-over had not
    happened (the leaving rank still holds the only copy of its state), else drive it forward."""
    if phase in BEFORE_HANDOVER:
        await mig.roll_back(f"torchpassd restarted during phase {phase}, before the hand-over")
        return jn.ROLLED_BACK
    if phase in (HANDED_OVER, REFORMED, RESUMED):
        return await mig.finish()
    raise MigrationError(f"in-flight migration is in unknown phase {phase}", **mig.where)


def _step_ended(rc: int | None, target: str, cwd: str) -> str:
    """Why a joiner's launchpad step ended before its workers got ready, in words."""
    if rc == ac.EXIT_NO_WORKDIR:
        return f"the job's working directory {cwd} does not exist on {target}: no joiner can start there"
    return f"the joiner's launchpad step on {target} ended (rc={rc})"
