"""``torchpassctl drill --mode planned-aware|gpu-degrade``: prove an installation end to end. Submits
the example DDP job with ``sbatch --torchpass``, drains one of its nodes (never the batch host; in
gpu-degrade mode torchpassd's health policy drains it, see drill_gpu.py; the unplanned modes
kill or cut it instead, see drill_unplanned.py),
waits for torchpassd's migration and for the job to finish, runs the same training locally under
launchpad without a failure, and compares every per-step loss and the final parameter hashes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from slurm_plugin.connect import open_client, runner_for
from torchpass_common.config import Config
from torchpass_common.errors import MigrationError, TorchPassError
from torchpassd import drill_gpu, drill_transparent, drill_unplanned
from torchpassd.ctl_client import DaemonClient
from torchpassd.drill_report import DrillReport, compare

JOBS = Path(__file__).resolve().parent / "drill_jobs"  # shipped in the wheel: scripts the drills run, not modules
EXAMPLE = JOBS / "ddp_train.py"
SLURM_TASKS = JOBS / "slurm_tasks.py"  # --launcher srun-python: runs the example as SLURMEnvironment would
LAUNCHERS = ("torchrun", "srun-python")
MODES = ("planned-aware", drill_gpu.MODE, drill_transparent.MODE, *drill_unplanned.MODES)
POLL = 0.5

_JOB_SCRIPT = """#!/bin/bash
# TorchPass drill: the example DDP job as a user writes it, rendezvous on the batch host
# (with --torchpass-spares, --nnodes $SLURM_NNODES counts the hot spares too: they are taken off it).
srun torchrun --nnodes {nodes} --nproc-per-node {nproc} --rdzv-endpoint $SLURMD_NODENAME:{port} \\
    {example} {args} --log {log}
"""
_TASKS_SCRIPT = """#!/bin/bash
#SBATCH --ntasks-per-node={nproc}
# TorchPass drill (--launcher srun-python): the example DDP job started one Slurm task a rank, as Lightning,
# submitit and NeMo-Run start it: no torchrun, ranks from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS.
srun {python} {tasks} {example} {args} --log {log}
"""


@dataclass(frozen=True)
class DrillSettings:
    nodes: int = 4
    nproc: int = 1  # workers a node (torchrun's --nproc-per-node)
    steps: int = 300
    step_sleep: float = 0.2
    warmup_steps: int = 5
    rdzv_port: int = 29500
    timeout: float = 600.0
    state_mib: int = 0  # extra state per rank carried by save/load (bench recovery: pause vs state size)
    victim: int = 0  # which node fails: the job's Nth node that is not the batch host (1-based); 0: the last
    hot_spares: int = 0  # --torchpass-spares=N: the allocation holds N more nodes, which run no rank
    launcher: str = LAUNCHERS[0]  # how the job script starts the ranks: srun torchrun, or srun python a task a rank


class Drill:
    """One drill run against the torchpassd configured in ``cfg``."""

    def __init__(self, cfg: Config, settings: DrillSettings, say: Callable[[str], None], mode: str = MODES[0]) -> None:
        self.cfg, self.s, self.say, self.mode = cfg, settings, say, mode
        if mode == drill_gpu.MODE:  # the replayed GPU must reach its XID while the job still trains
            self.s = replace(settings, steps=max(settings.steps, settings.warmup_steps
                                                 + drill_gpu.min_steps(cfg, settings.step_sleep)))
        self.daemon = DaemonClient(cfg.orchestrator.control_socket)
        self.runner = runner_for(cfg.slurm)
        self.slurm = open_client(cfg.slurm)
        self.t0 = time.monotonic()
        self.report = DrillReport(mode=mode)  # report.json names the mode too
        transparent = mode == drill_transparent.MODE  # a script without TorchPass code, moved by criu
        self.script = drill_transparent.SCRIPT if transparent else EXAMPLE
        self.sbatch_mode = drill_transparent.SBATCH_MODE if transparent else "aware"
        self.script_args = drill_transparent.SCRIPT_ARGS if transparent else ()

    def _wait(self, what: str, check: Callable[[], Any], timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.s.timeout)
        while not (value := check()):
            if time.monotonic() > deadline:
                raise MigrationError(f"drill: timed out waiting for {what}", job=self.report.job_id or None)
            time.sleep(POLL)
        return value

    def _note(self, text: str) -> None:
        self.say(f"[drill +{time.monotonic() - self.t0:6.1f}s] {text}")

    def run(self) -> DrillReport:
        rep = self.report
        try:
            self.daemon.call("status")
            workdir = Path(self.cfg.orchestrator.state_dir) / "drills" / time.strftime("%Y%m%d-%H%M%S")
            workdir.mkdir(parents=True, mode=0o755)
            rep.workdir = str(workdir)
            self._submit(workdir)
            victim, rank = self._wait_training()
            if self.mode == drill_gpu.MODE:
                drill_gpu.inject(self.daemon, rep.job_id, victim)
                self._note(f"{victim}'s launchpad replays a degrading GPU ({drill_gpu.RECORDING.name})")
                victim, rank = self._wait_gpu_drain()
            if self.mode in drill_unplanned.MODES:
                drill_unplanned.run(self, victim, rank, workdir)  # kill (or cut) instead of a drain
            else:
                self._drain_and_migrate(victim, rank, workdir)
            rep.job_state = rep.job_state or self._final_state()  # unplanned: taken before the fault's undo
            if rep.job_state != "COMPLETED":
                rep.error = rep.error or (f"the job ended {rep.job_state}, not COMPLETED: a migrated job must end "
                                          f"as if nothing had happened (see {workdir})")
        except TorchPassError as exc:
            rep.error = str(exc)
        finally:
            self._cancel()
        rep.ok = (rep.error is None and rep.bit_identical and rep.lost_steps == 0
                  and rep.resumed_at_step == rep.expected_step and rep.job_state == "COMPLETED")
        if rep.workdir:
            (Path(rep.workdir) / "report.json").write_text(json.dumps(asdict(rep), indent=1))
        return rep

    def _final_state(self) -> str:
        """The job's Slurm state once it has ended on its own (training is over by now)."""
        def ended() -> str | None:
            job = self.slurm.job(int(self.report.job_id))
            return None if job is not None and job.active else (job.state if job else "UNKNOWN")
        state = self._wait(f"job {self.report.job_id} to end", ended, timeout=120.0)
        self._note(f"job {self.report.job_id} ended {state}")
        return state

    def _cancel(self) -> None:
        """The drill's job never outlives the drill (it is finished already when all went well)."""
        if self.report.job_id:
            try:
                self.runner.run(["scancel", self.report.job_id])
            except TorchPassError as exc:
                self.say(f"[drill] could not cancel job {self.report.job_id}: {exc}")

    def _submit(self, workdir: Path) -> None:
        s = self.s
        script = workdir / "drill.sh"
        if s.launcher not in LAUNCHERS:
            raise MigrationError(f"unknown drill launcher {s.launcher!r}", hint=f"one of {', '.join(LAUNCHERS)}")
        if s.launcher != "torchrun" and s.hot_spares:
            raise MigrationError("--hot-spares needs --launcher torchrun: with one task a rank the script counts "
                                 "every task of the step, the spares' too", hint="drop --hot-spares")
        template = _JOB_SCRIPT if s.launcher == "torchrun" else _TASKS_SCRIPT
        script.write_text(template.format(
            nproc=s.nproc, nodes="$SLURM_NNODES" if s.hot_spares else s.nodes, port=s.rdzv_port, example=self.script,
            args=" ".join([*self.script_args, "--steps", str(s.steps), "--step-sleep", str(s.step_sleep),
                           *(["--state-mib", str(s.state_mib)] if s.state_mib else [])]),
            log=workdir / "train.log", python=sys.executable, tasks=SLURM_TASKS))
        hot = [f"--torchpass-spares={s.hot_spares}"] if s.hot_spares else []
        out = self.runner.run(["sbatch", "--parsable", f"--torchpass={self.sbatch_mode}", *hot, f"-N{s.nodes + s.hot_spares}",
                               "-o", str(workdir / "slurm-%j.out"), str(script)], cwd=str(workdir))
        self.report.job_id = out.strip().split(";")[0]
        self._note(f"submitted job {self.report.job_id} ({s.nodes} nodes, {s.hot_spares} hot spares, {s.steps} steps)")

    def _job(self) -> dict[str, Any] | None:
        jobs = {j["job"]: j for j in self.daemon.call("jobs")}
        return jobs.get(self.report.job_id)

    def _wait_training(self) -> tuple[str, int]:
        """Until every rank runs and has done a few steps; returns a non-batch node and its rank."""
        def ready() -> dict[str, Any] | None:
            slurm_job = self.slurm.job(int(self.report.job_id))
            if slurm_job is not None and not slurm_job.active and slurm_job.state != "PENDING":
                raise MigrationError(f"the drill job ended {slurm_job.state} before training ran",
                                     job=self.report.job_id, hint=f"see {self.report.workdir}")
            job = self._job()
            if not job or len(job["launchpads"]) < self.s.nodes + self.s.hot_spares:
                return None
            workers = [w for lp in job["launchpads"].values() for w in lp["workers"]]
            warming = any(lp.get("standby") == "starting" for lp in job["launchpads"].values())
            return job if len(workers) == self.s.nodes * self.s.nproc and not warming \
                and min(w["step"] for w in workers) >= self.s.warmup_steps else None
        # steady state: every rank trains and every node's standby is warm (the fault of a job
        # that runs for hours strikes then, not in its first seconds)
        job = self._wait("every rank to train and every node's standby to be warm", ready)
        others = [n for n in job["nodes"] if n != job["batch_host"] and not job["launchpads"].get(n, {}).get("hot_spare")]
        if self.s.victim > len(others):
            raise MigrationError(f"--victim {self.s.victim}: the job has {len(others)} nodes besides its batch host",
                                 job=self.report.job_id, hint=f"pick 1..{len(others)}")
        victim = others[self.s.victim - 1] if self.s.victim else others[-1]
        self.report.moved_ranks = sorted(w["rank"] for w in job["launchpads"][victim]["workers"])
        self._note(f"training on {', '.join(job['nodes'])}; ranks {self.report.moved_ranks} run on {victim}")
        return victim, self.report.moved_ranks[0]

    def _wait_gpu_drain(self) -> tuple[str, int]:
        """gpu-degrade: until torchpassd's health policy drains one of the job's nodes; that node
        and its first rank."""
        rep = self.report
        victim, rep.drain_reason = self._wait("torchpassd to drain a node for its GPU",
                                              lambda: drill_gpu.decision(self.daemon, rep.job_id))
        workers = self._wait(f"the ranks on {victim}",
                             lambda: (((self._job() or {}).get("launchpads") or {}).get(victim) or {}).get("workers"))
        rep.moved_ranks = sorted(w["rank"] for w in workers)
        self._note(f"torchpassd drained {victim} (ranks {rep.moved_ranks}): {rep.drain_reason}")
        return victim, rep.moved_ranks[0]

    def _drain_and_migrate(self, victim: str, rank: int, workdir: Path) -> None:
        rep = self.report
        drained_at = time.time()
        if self.mode != drill_gpu.MODE:  # in gpu-degrade mode torchpassd drained it (seen by polling)
            self.runner.run(["scontrol", "update", f"nodename={victim}", "state=drain", "reason=torchpass drill"])
            self._note(f"drained {victim}")
        try:
            mig = self._wait(f"the migration off {victim}", lambda: self._settled(victim))
        finally:
            self.runner.run(["scontrol", "update", f"nodename={victim}", "state=resume"])
        rep.migrated_from, rep.migrated_to = victim, mig["target"] or ""
        phases = mig["phases"]
        rep.timeline = [{"phase": p["phase"], "status": p["status"], "seconds": round(p["seconds"], 3)} for p in phases]
        if self.mode == drill_transparent.MODE:
            rep.move = drill_transparent.move_timings(phases)
        for p in phases:
            self._note(f"  {p['phase']:<13} {p['status']:<11} +{p['seconds']:.3f}s")
        if mig["status"] != "succeeded":
            raise MigrationError(f"the migration ended {mig['status']}: {mig['error']}", job=rep.job_id)
        chosen = next(p for p in phases if p["phase"] == "spare_chosen")
        resumed = next(p for p in phases if p["phase"] == "resumed")
        rep.detect_s = round(max(0.0, chosen["at"] - drained_at), 3)
        rep.pause_s = resumed["detail"]["pause_s"]
        paused_step = resumed["detail"]["plan"]["paused_step"]
        self._note(f"moved ranks {rep.moved_ranks} {victim} -> {rep.migrated_to}: detect {rep.detect_s}s, "
                   f"pause {rep.pause_s}s")
        self._wait(f"job {rep.job_id} to finish", lambda: not (j := self.slurm.job(int(rep.job_id))) or not j.active)
        self._note("job finished; running the reference without a failure")
        ref = workdir / "reference.log"
        self._reference(ref)
        compare(workdir / "train.log", ref, rank, paused_step, rep)

    def _settled(self, victim: str) -> dict[str, Any] | None:
        """The migration off ``victim`` that succeeded or failed. One rolled back (the job went on
        where it was) is noted in the report and torchpassd's retry awaited, while the job runs."""
        rep = self.report
        ours = [m for m in reversed(self.daemon.call("history", job=rep.job_id)) if m["source"] == victim]
        for m in ours[len(rep.rollbacks):]:
            if m["status"] in ("succeeded", "failed"):
                return m
            if m["status"] != "rolled_back":
                return None
            rep.rollbacks.append(m["error"] or "")
            self._note(f"migration off {victim} rolled back ({m['error']}); torchpassd retries")
        job = self.slurm.job(int(rep.job_id))
        if job is not None and not job.active:
            raise MigrationError(f"job {rep.job_id} ended before a migration off {victim} succeeded "
                                 f"({len(rep.rollbacks)} rolled back: {'; '.join(rep.rollbacks)[-500:]})",
                                 job=rep.job_id)
        return None

    def _reference(self, log: Path) -> None:
        s = self.s
        argv = [sys.executable, "-m", "launchpad", "--standalone", "--nproc-per-node", str(s.nodes * s.nproc),
                str(self.script), *self.script_args, "--steps", str(s.steps), "--log", str(log)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.s.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise MigrationError(f"the reference run did not finish within {self.s.timeout:.0f} s") from None
        if proc.returncode != 0:
            raise MigrationError(f"the reference run failed (rc={proc.returncode}): {proc.stderr[-500:]}")


def run(cfg: Config, mode: str, settings: DrillSettings, say: Callable[[str], None]) -> dict[str, Any]:
    """Run one drill and return its report as a plain dict."""
    if mode not in MODES:
        raise MigrationError(f"drill mode {mode!r} is not available", hint=f"use one of {', '.join(MODES)}")
    report = Drill(cfg, settings, say, mode).run()
    report.mode = mode
    return asdict(report)
