"""What ``torchpassctl drill --mode unplanned`` adds to the planned drill: instead of draining a
node it kills one (never the batch host) for real - SIGKILL of its slurmd, launchpad and workers
(on the dev cluster: everything in the node's namespace, `devcluster kill-node`; elsewhere: a job
step on the node) - or cuts its network (``fault="cut"``, dev cluster only), or kills one worker
process of a healthy node (``fault="crash"``: an OOM kill, a segfault; the rank is rebuilt in place,
no spare), waits for torchpassd's unplanned recovery, and judges the run: detect_s from the kill,
the step in progress at the kill, resumed_at_step from the joiner's first logged step, lost steps,
bit-identity.

The example script logs each step's loss right after the forward pass (before the gradient
all-reduce), so a rank killed mid-step has logged every step it started; survivors and the joiner
log the failed step again when they redo it, with the same loss (the model seeds its randomness
per (step, rank): the replay is exact). A repeated line is accepted only for the failed step."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpass_common.errors import MigrationError, TorchPassError
from torchpassd.drill_report import compare, read_log

if TYPE_CHECKING:
    from torchpassd.drill import Drill

MODE, CUT_MODE, CRASH_MODE = "unplanned", "unplanned-cut", "unplanned-crash"
MODES = (MODE, CUT_MODE, CRASH_MODE)
FAULTS = ("kill", "cut", "crash")
FAULT_OF_MODE = {MODE: "kill", CUT_MODE: "cut", CRASH_MODE: "crash"}
DEVCLUSTER = Path(__file__).resolve().parents[1] / "contrib" / "devcluster" / "devcluster"


class DevClusterTool:
    """The dev cluster's own command (contrib/devcluster/devcluster), run as a program for its node
    faults (kill-node, cut, heal, start-node) when the drill's cluster is the dev cluster running
    here (TORCHPASS_DEVCLUSTER_ID picks the instance). Nothing of contrib is imported."""

    def __init__(self, tool: Path, say: Callable[[str], None]) -> None:
        self.tool, self.say = tool, say

    @classmethod
    def serving(cls, cluster_name: str, say: Callable[[str], None]) -> DevClusterTool | None:
        """The tool, if this checkout has one and its instance (with nodes) is the cluster ``cluster_name``."""
        if not os.access(DEVCLUSTER, os.X_OK):
            return None
        res = subprocess.run([str(DEVCLUSTER), "status", "--json"], capture_output=True, text=True, timeout=60,
                             check=False)
        try:
            info = json.loads(res.stdout) if res.returncode == 0 else {}
        except ValueError:
            return None
        return cls(DEVCLUSTER, say) if info.get("nodes") and info.get("cluster_name") == cluster_name else None

    def __call__(self, verb: str, node: str) -> None:
        res = subprocess.run([str(self.tool), verb, node], capture_output=True, text=True, timeout=180, check=False)
        for line in (res.stdout + res.stderr).splitlines():
            self.say(line)
        if res.returncode != 0:
            raise MigrationError(f"`devcluster {verb} {node}` failed (status {res.returncode})",
                                 hint=(res.stderr.strip().splitlines() or ["see its output above"])[-1])


def _config(drill: Drill) -> dict[str, str]:
    """slurmctld's running configuration (``scontrol show config``), as "Key = value" pairs."""
    out = drill.runner.run(["scontrol", "show", "config"])
    return {k.strip(): v.strip() for k, sep, v in (line.partition("=") for line in out.splitlines()) if sep}


def crash_script(worker: int) -> str:
    """The shell script that kills one worker process by pid, and nothing else: its node stays healthy."""
    return f"kill -9 {int(worker)}"


def kill_script(workers: list[int], slurmd_pidfile: str) -> str:
    """The shell script that kills a node for real by pid: each worker, its parent (launchpad) and
    grandparent (the step's slurmstepd), and the slurmd whose pid file is ``slurmd_pidfile``."""
    return ("for p in " + " ".join(str(int(p)) for p in workers) + "; do l=$(ps -o ppid= -p $p); "
            "s=$(ps -o ppid= -p ${l:-0}); kill -9 $s $l $p; done; "
            f"kill -9 $(cat {shlex.quote(slurmd_pidfile)})")


class Fault:
    """Kills (or cuts off) one node of the drill job, and undoes it after the drill."""

    def __init__(self, drill: Drill, kind: str) -> None:
        if kind not in FAULTS:
            raise MigrationError(f"unknown fault {kind!r}", hint=f"use one of {', '.join(FAULTS)}")
        self.drill, self.kind = drill, kind
        self.slurm_config = _config(drill)  # which cluster, and where its slurmds keep their pids
        # the dev cluster's own tool, when the drill's slurmctld is the dev cluster running here
        self.devcluster = DevClusterTool.serving(self.slurm_config.get("ClusterName", ""), drill.say)
        if kind == "cut" and self.devcluster is None:
            raise MigrationError("the network-cut drill needs the dev cluster",
                                 hint="use --fault kill on a real cluster")
        self.node = ""

    def inject(self, node: str, pids: list[int]) -> float:
        """Strike ``node`` (crash: its worker ``pids[0]`` only); returns the wall time of the fault."""
        self.node = node
        if self.kind == "crash" and self.devcluster is not None:  # the dev cluster's nodes share our pid namespace
            at = time.time()
            os.kill(pids[0], signal.SIGKILL)
            return at
        if self.devcluster is not None:
            at = time.time()
            self.devcluster("kill-node" if self.kind == "kill" else "cut", node)
            return at
        # A real cluster: a step on the node SIGKILLs, by pid, the job's workers, their launchpad,
        # its slurmstepd and the node's slurmd (from its pid file), and nothing else there.
        pidfile = self.slurm_config.get("SlurmdPidFile", "/run/slurmd.pid").replace("%n", node).replace("%h", node)
        script = crash_script(pids[0]) if self.kind == "crash" else kill_script(pids, pidfile)
        at = time.time()
        subprocess.run(["srun", f"--jobid={self.drill.report.job_id}", "-w", node, "-N1", "-n1", "--overlap",
                        "sh", "-c", script], capture_output=True, timeout=60, check=False, env=self.drill.runner.env())
        return at

    def undo(self) -> None:
        """Bring the node back (dev cluster; elsewhere the operator restarts its slurmd)."""
        if self.kind == "crash":  # the node was never down
            return
        if self.devcluster is None or not self.node:
            if self.node:
                self.drill.say(f"[drill] {self.node}: restart its slurmd and resume it (scontrol update "
                               f"nodename={self.node} state=resume)")
            return
        self.devcluster("heal" if self.kind == "cut" else "start-node", self.node)
        with contextlib.suppress(TorchPassError):  # not down (yet): nothing to resume
            self.drill.runner.run(["scontrol", "update", f"nodename={self.node}", "state=resume"])


def judge(run_log: Path, ref_log: Path, rank: int, failed_step: int, offset: int, report: Any) -> None:
    """Fill the report's verdict: ``offset`` is the training log's size at the kill. The step
    in progress at the kill is the highest step logged before it; the lost rank resumed at the
    first step logged for it after the kill (by its joiner). Lines repeated for the failed step
    must repeat the same loss and are then counted once; any other repetition is a recomputed
    step. Then the planned drill's comparison (lost steps, every loss, final hashes)."""

    text = run_log.read_text()
    cut = text.rfind("\n", 0, offset) + 1
    before = [json.loads(ln) for ln in text[:cut].splitlines() if ln]
    after = [json.loads(ln) for ln in text[cut:].splitlines() if ln]
    report.step_at_kill = max((r["step"] for r in before if "step" in r and "loss" in r), default=None)
    report.resumed_at_step = next((r["step"] for r in after if r.get("rank") == rank and "loss" in r), None)
    seen: dict[tuple[int, int], str] = {}
    kept, replays = [], []
    for rec in [*before, *after]:
        if "loss" in rec:
            key = (rec["rank"], rec["step"])
            if key in seen:
                replays.append({"rank": key[0], "step": key[1], "same": seen[key] == rec["loss"]})
                continue
            seen[key] = rec["loss"]
        kept.append(rec)
    dedup = run_log.with_name(run_log.stem + ".dedup.log")
    dedup.write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = report.resumed_at_step
    compare(dedup, ref_log, rank, failed_step, report)
    report.resumed_at_step = resumed
    report.expected_step = failed_step
    bad = [r for r in replays if r["step"] != failed_step or not r["same"]]
    if bad:
        report.bit_identical = False
        report.error = report.error or f"steps recomputed or replayed differently: {bad[:5]}"


def run(drill: Drill, victim: str, rank: int, workdir: Path) -> None:
    """Strike ``victim`` while the job trains, follow the recovery, finish and judge the run."""
    rep = drill.report
    fault_kind = FAULT_OF_MODE[drill.mode]
    fault = Fault(drill, fault_kind)
    rep.fault = fault_kind
    job = drill._job() or {}
    workers = job.get("launchpads", {}).get(victim, {}).get("workers") or []
    pids = [w["pid"] for w in workers if "pid" in w and (fault_kind != "crash" or w["rank"] == rank)]
    if fault_kind == "crash":
        rep.moved_ranks = [rank]
        if not pids:
            raise MigrationError(f"{victim}'s launchpad reported no pid for rank {rank}: nothing to crash",
                                 hint="check that its launchpad reports its workers", job=rep.job_id)
    log = workdir / "train.log"
    try:
        killed_at = fault.inject(victim, pids)
        offset = log.stat().st_size if log.exists() else 0
        drill._note(f"{fault_kind} {victim} (rank {rank})")
        mig = drill._wait(f"the recovery from {victim}'s failure", lambda: next(
            (m for m in drill.daemon.call("history", job=rep.job_id)
             if m["source"] == victim and m["mode"] == "unplanned-aware" and m["status"] in ("succeeded", "failed")),
            None))
        rep.migrated_from, rep.migrated_to = victim, mig["target"] or ""
        phases = mig["phases"]
        rep.timeline = [{"phase": p["phase"], "status": p["status"], "seconds": round(p["seconds"], 3)}
                        for p in phases]
        for p in phases:
            drill._note(f"  {p['phase']:<13} {p['status']:<11} +{p['seconds']:.3f}s")
        if mig["status"] != "succeeded":
            raise MigrationError(f"the recovery ended {mig['status']}: {mig['error']}", job=rep.job_id)
        rep.detect_s = round(max(0.0, phases[0]["at"] - killed_at), 3)
        resumed = next(p for p in phases if p["phase"] == "resumed")["detail"]
        rep.pause_s = resumed["pause_s"]
        failed_step = resumed["resumed_at_step"]
        drill._note(f"rank {rank} rebuilt on {rep.migrated_to or victim}: detect {rep.detect_s}s, pause {rep.pause_s}s, "
                    f"resumed at step {failed_step}")
        # Training is done once every rank logged its final hash; the job then ends on its own (the
        # dead node was set DOWN, so srun was told its tasks are gone). The fault lasts until then: a
        # cut node that comes back while the job still runs has its stale step killed by Slurm, and
        # srun counts that task as failed (a known gap, see the README).
        drill._wait(f"job {rep.job_id} to finish training",
                    lambda: not (j := drill.slurm.job(int(rep.job_id))) or not j.active
                    or (log.exists() and len(read_log(log)[1]) >= drill.s.nodes * drill.s.nproc))
        rep.job_state = drill._final_state()
    finally:
        fault.undo()
    drill._note("job finished; running the reference without a failure")
    ref = workdir / "reference.log"
    drill._reference(ref)
    judge(log, ref, rank, failed_step, offset, rep)
    if rep.step_at_kill is not None and not rep.step_at_kill <= failed_step <= rep.step_at_kill + 1:
        rep.error = rep.error or (f"resumed at step {failed_step}, but the step in progress at the kill was "
                                  f"{rep.step_at_kill}")
