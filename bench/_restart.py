"""The checkpoint-restart baseline of bench/recovery.py and bench/peers.py, on the dev cluster: the
example job under plain torchrun (no TorchPass), submitted with --requeue, rank 0 saving a torch.save
checkpoint every N steps. ``fault="node"``: a node is killed; Slurm notices (SlurmdTimeout), requeues
the job, restarts it on other nodes, and it reloads the checkpoint and recomputes the lost steps.
``fault="worker"``: one worker process is killed on a healthy node; torchrun (--max-restarts)
restarts every worker of the job, which reload the checkpoint. Time lost = kill -> the restarted job
is back at the last step completed before the kill; split into restart overhead and recompute."""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.devcluster import FINAL_JOB_STATES, DevCluster
from torchpass_common.errors import TorchPassError
from torchpassd.drill import EXAMPLE

RDZV_PORT = 29600
FAULTS = ("node", "worker")
RESTARTS = {"node": 0, "worker": 3}  # torchrun's --max-restarts: a whole-node loss is Slurm's to handle
_SCRIPT = """#!/bin/bash
# checkpoint-restart baseline: plain torchrun, rendezvous on the batch host
srun {torchrun} --nnodes {nodes} --nproc-per-node 1 --max-restarts {restarts} --rdzv-backend c10d --rdzv-id $SLURM_JOB_ID \\
    --rdzv-endpoint $SLURMD_NODENAME:{port} {example} --steps {steps} --step-sleep {sleep} \\
    --checkpoint {ckpt} --checkpoint-every {every} --log-file {log}
"""


class JobEnded(TorchPassError):
    """The baseline job reached a final Slurm state (``state``) while the benchmark waited on it."""

    def __init__(self, state: str, message: str) -> None:
        super().__init__(message)
        self.state = state


def steps_logged(log: Path, rank: int = 0) -> list[tuple[int, float]]:
    """(step, wall time) of ``rank``'s step lines, in file order (a restart repeats steps)."""
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("rank") == rank and "step" in rec and "t" in rec:
            out.append((rec["step"], rec["t"]))
    return out


def analyse(lines: list[tuple[int, float]], killed_at: float) -> dict[str, float]:
    """From rank 0's (step, time) lines and the kill time: the step it was at when the job failed,
    the checkpoint step the restarted run began at (where the step count goes back), the time lost
    and its split into restart overhead and recomputation (at the restarted run's own step time).
    Raises TorchPassError while the restarted run has not got back to the failed step."""
    restart = next((i for i in range(1, len(lines)) if lines[i][1] > killed_at and lines[i][0] <= lines[i - 1][0]),
                   None)
    if restart is None:
        raise TorchPassError("the baseline log shows no restart after the failure yet")
    before, after = lines[:restart], lines[restart:]
    failed_step, resumed_step = max(s for s, _ in before), after[0][0]
    back = next((t for s, t in after if s == failed_step), None)
    if back is None:
        raise TorchPassError(f"the restarted job has not got back to step {failed_step} yet")
    times = [t for _, t in after]
    step_s = statistics.median(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else 0.0
    first_step_start = after[0][1] - step_s
    return {"failed_step": failed_step, "resumed_from_step": resumed_step, "lost_steps": failed_step - resumed_step,
            "step_s": round(step_s, 4), "time_lost_s": round(back - killed_at, 3),
            "restart_overhead_s": round(first_step_start - killed_at, 3),
            "recompute_s": round(back - first_step_start, 3)}


def _analysed(log: Path, killed_at: float) -> dict[str, float] | None:
    try:
        return analyse(steps_logged(log), killed_at)
    except TorchPassError:
        return None


def run(cluster: DevCluster, workdir: Path, *, nodes: int = 3, steps: int = 2000, step_sleep: float = 0.2,
        every: int = 25, timeout: float = 480.0, say: Any = print, fault: str = "node") -> dict[str, Any]:
    """One failure (``fault``: a node killed, or one worker process on a healthy node) of the baseline
    job; the measured figures (see ``analyse``), the job's state changes after the kill (Slurm's own
    detection and requeue), and the setting."""
    if fault not in FAULTS:
        raise TorchPassError(f"baseline: unknown fault {fault!r}", hint=f"use one of {', '.join(FAULTS)}")
    workdir.mkdir(parents=True, exist_ok=True, mode=0o755)
    log, ckpt = workdir / "train.log", workdir / "checkpoint.pt"
    for f in (log, ckpt):
        f.unlink(missing_ok=True)
    script = _SCRIPT.format(torchrun=Path(sys.executable).parent / "torchrun", nodes=nodes, port=RDZV_PORT,
                            example=EXAMPLE, steps=steps, restarts=RESTARTS[fault], sleep=step_sleep, ckpt=ckpt, every=every, log=log)
    fail_at = every + every // 2  # mid-interval
    job = cluster.sbatch(script, f"-N{nodes}", "--requeue", "--job-name=bench-ckpt-restart")
    say(f"[baseline] job {job}: plain torchrun on {nodes} nodes, checkpoint every {every} steps, --requeue")
    deadline = time.monotonic() + timeout
    transitions: list[dict[str, Any]] = []

    def wait(what: str, check: Any) -> None:
        while not check():
            state = cluster.job_record(job).get("JobState", "?")
            if not transitions or transitions[-1]["state"] != state:
                transitions.append({"state": state, "at": time.time()})
            if state in FINAL_JOB_STATES:
                raise JobEnded(state, f"baseline: job {job} ended {state} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TorchPassError(f"baseline: timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.25)

    try:
        wait(f"step {fail_at}", lambda: any(s >= fail_at for s, _ in steps_logged(log)))
        hosts = cluster.run("scontrol", "show", "hostnames", cluster.job_record(job)["NodeList"]).stdout.split()
        victim = hosts[-1]  # not the batch host
        if fault == "node":
            killed_at = time.time()
            cluster.kill_node(victim)
            say(f"[baseline] killed {victim} at step {max(s for s, _ in steps_logged(log))}; Slurm detects it "
                "and requeues the job")
        else:
            worker = _worker_pid(cluster, victim)
            killed_at = time.time()
            os.kill(worker, signal.SIGKILL)
            say(f"[baseline] killed worker {worker} on {victim} at step {max(s for s, _ in steps_logged(log))}; "
                "torchrun restarts every worker")
        result: dict[str, Any] = {}
        try:
            wait(f"job {job} to be back at the step it failed at",
                 lambda: result.update(_analysed(log, killed_at) or {}) or result)
        except JobEnded as exc:  # a measured outcome: the job did not come back by itself
            say(f"[baseline] job {job} ended {exc.state} instead of coming back: {exc}")
            result = {"job_ended": exc.state, "time_lost_s": None}
        except TorchPassError as exc:  # also measured: it lost at least this long (restarts failing, say)
            result = {"not_back_within_s": round(time.time() - killed_at, 1), "time_lost_s": None}
            say(f"[baseline] job {job} not back at the failed step {result['not_back_within_s']} s after the "
                f"fault; stopped waiting: {exc}")
    finally:
        cluster.run("scancel", job, check=False)
    if result.get("time_lost_s") is not None:
        say(f"[baseline] lost {result['time_lost_s']} s: restart {result['restart_overhead_s']} s + "
            f"recompute {result['recompute_s']} s ({result['lost_steps']} steps)")
    return {**result, "nodes": nodes, "checkpoint_every_steps": every,
            "checkpoint_interval_s": round(every * result["step_s"], 2) if "step_s" in result else None,
            "job_states_after_kill": [{"state": t["state"], "after_s": round(t["at"] - killed_at, 1)}
                                      for t in transitions if t["at"] >= killed_at],
            "failure": (f"devcluster kill-node {victim} (SIGKILL of every process on it)" if fault == "node"
                        else f"kill -9 of the worker process on {victim} (the node stays healthy)"),
            "restart": ("Slurm's own: node DOWN after SlurmdTimeout, job requeued (--requeue), restarted on "
                        "other nodes, reloads the checkpoint" if fault == "node" else
                        "torchrun's own (--max-restarts): every worker of the job stopped and started again "
                        "through a new rendezvous, reloads the checkpoint")}


def _worker_pid(cluster: DevCluster, node: str) -> int:
    """The pid of the training worker (not its torchrun agent) running on ``node``."""
    for pid in cluster.node_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(EXAMPLE).encode() in argv and not any(a.endswith(b"torchrun") for a in argv):
            return pid
    raise TorchPassError(f"baseline: no training worker found on {node}")
