"""The torchft peer of the TorchPass comparison: what torchft 0.2.0 loses on a fault, on localhost,
training the drill job's model (bench/_torchft_train.py: one process per replica group, one group
per "node"). ``run()`` starts a Lighthouse (the ``torchft_lighthouse`` binary, with the settings of
torchft's README: min_replicas 1, quorum tick 100 ms, join timeout 10 s; heartbeat timeout left at
its 5 s default) and the replicas, and injects one fault:

- ``none``: the undisturbed run (wall time, steps/s, final parameter hashes);
- ``worker_kill``: kill -9 one replica's process when it logs step ``at_step`` and start it again at
  once, as torchelastic restarts a crashed worker on a healthy node; it heals from a live peer;
- ``node_kill``: the same kill, but the replica is started again only ``replace_delay_s`` later,
  the time a replacement node takes to be allocated and start the worker (set it to the spare-start
  time measured for TorchPass to compare like with like); meanwhile the others train on without it.

The figures come from the replicas' JSON-line logs, by the pure functions below: time lost (wall
time to the final step against the undisturbed run measured right before), steps taken at reduced
strength (fewer participants than replicas), whether the final parameters are bit-identical to the
undisturbed run's, the recovery time (kill -> the restarted replica's first step) and the
survivors' stall (their longest pause after the kill: the Lighthouse waits out the dead replica's
heartbeat). On a machine with fewer cores than replicas, steps with fewer participants run faster
(fewer processes share the cores), which hides part of the time lost; stall_s does not depend on
that. No torch import here: the trainers and the Lighthouse are separate processes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

FAULTS = ("none", "worker_kill", "node_kill")
TRAINER = Path(__file__).resolve().parent / "_torchft_train.py"
LIGHTHOUSE_ARGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
POLL_S = 0.005

Logs = dict[int, list[dict[str, Any]]]


def parse(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON records of a replica's log, in file order; a line still being written is skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def strength(logs: Logs) -> dict[int, int]:
    """Participants of each step: for each replica the last attempt of a step counts (an earlier one
    failed its commit and was retried under the same step); the fewest over the replicas (a killed
    replica's last line still shows the quorum it died in)."""
    last: dict[tuple[int, int], int] = {}
    for rid, recs in logs.items():
        for rec in recs:
            if "step" in rec:
                last[rid, rec["step"]] = rec["participants"]
    out: dict[int, int] = {}
    for (_, step), n in last.items():
        out[step] = min(n, out.get(step, n))
    return out


def summarise(logs: Logs, replicas: int) -> dict[str, Any]:
    """One run's figures: wall time from the first step line to the last replica's final line,
    steps/s, each replica's final parameter hash, the steps at reduced strength and the replica-steps
    missing from them (sum over steps of replicas - participants)."""
    starts = [r["t"] for recs in logs.values() for r in recs if "step" in r]
    finals = {rid: next(r for r in reversed(recs) if "final" in r) for rid, recs in logs.items()
              if any("final" in r for r in recs)}
    if not starts or len(finals) < replicas:
        raise ValueError(f"incomplete logs: replicas {sorted(finals)} of {replicas} wrote a final line")
    wall = max(f["t"] for f in finals.values()) - min(starts)
    steps = max(f["steps"] for f in finals.values())
    short = {step: n for step, n in strength(logs).items() if n < replicas}
    reduced = sorted(short)
    return {"wall_s": round(wall, 3), "steps": steps, "steps_per_s": round(steps / wall, 2),
            "final_hashes": {str(rid): f["final"] for rid, f in sorted(finals.items())},
            "steps_at_reduced_strength": len(reduced),
            "reduced_steps": [reduced[0], reduced[-1]] if reduced else None,
            "lost_replica_steps": sum(replicas - n for n in short.values())}


def recovery(victim: list[dict[str, Any]], killed_at: float) -> dict[str, Any]:
    """From the killed replica's log (both processes' lines) and the kill time: the seconds to the
    restarted process's first step and the step it healed to; None for both if it logged none."""
    first = next((r for r in victim if "step" in r and r["t"] > killed_at), None)
    return {"recovery_s": round(first["t"] - killed_at, 3) if first else None,
            "healed_at_step": first["step"] if first else None}


def stall(logs: Logs, victim: int, killed_at: float) -> float | None:
    """The survivors' longest pause after the kill: the longest time between two consecutive step
    lines of a replica other than ``victim``, the later one after the kill (where the quorum waits out
    the dead replica's heartbeat); None if no survivor logged a step after the kill."""
    gaps = []
    for rid, recs in logs.items():
        times = [r["t"] for r in recs if "step" in r]
        if rid != victim:
            gaps += [later - earlier for earlier, later in zip(times, times[1:], strict=False) if later > killed_at]
    return round(max(gaps), 3) if gaps else None


def compare(baseline: dict[str, Any], faulted: dict[str, Any]) -> dict[str, Any]:
    """What the fault cost against the undisturbed run: time lost and bit-identity of the final
    parameters (every replica's hash equal to the undisturbed run's single hash)."""
    base = set(baseline["final_hashes"].values())
    return {"time_lost_s": round(faulted["wall_s"] - baseline["wall_s"], 3),
            "bit_identical": len(base) == 1 and set(faulted["final_hashes"].values()) == base}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Job:
    """The Lighthouse and the trainer processes of one run, their files under ``work``; every
    process it started is stopped by ``close``."""

    def __init__(self, work: Path, replicas: int, steps: int, step_sleep: float) -> None:
        self.work = work
        self.go = work / "go"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        port = _free_port()
        self.lighthouse = self._spawn([str(Path(sys.executable).parent / "torchft_lighthouse"), *LIGHTHOUSE_ARGS,
                                       "--bind", f"[::]:{port}"], "lighthouse.out")
        self.args = ["--replicas", str(replicas), "--lighthouse", f"http://localhost:{port}", "--steps", str(steps),
                     "--step-sleep", str(step_sleep), "--go", str(self.go)]
        deadline = time.monotonic() + 30
        while not self._listening(port):
            if self.lighthouse.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the Lighthouse did not start; see {work / 'lighthouse.out'}")
            time.sleep(0.05)

    @staticmethod
    def _listening(port: int) -> bool:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
        except OSError:
            return False
        return True

    def _spawn(self, argv: list[str], out: str) -> subprocess.Popen[bytes]:
        with open(self.work / out, "ab") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self, rid: int) -> Path:
        return self.work / f"replica{rid}.jsonl"

    def records(self, rid: int) -> list[dict[str, Any]]:
        path = self.log(rid)
        return parse(path.read_text().splitlines()) if path.exists() else []

    def start(self, rid: int) -> None:
        self.procs[rid] = self._spawn([sys.executable, str(TRAINER), "--replica-id", str(rid), "--log",
                                       str(self.log(rid)), *self.args], f"replica{rid}.out")

    def kill(self, rid: int) -> float:
        """kill -9 replica ``rid``; the kill time. It no longer counts among the job's processes."""
        proc = self.procs.pop(rid)
        proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        proc.wait()
        return killed_at

    def until(self, what: str, done: Callable[[], bool], deadline: float) -> None:
        """Poll ``done`` until it holds; raise if a trainer fails or the deadline passes first."""
        while not done():
            failed = {rid: p.returncode for rid, p in self.procs.items() if p.poll() not in (None, 0)}
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting for {what}: " + (f"exit codes {failed}" if failed else "timed out")
                                   + f"; see {self.work}")
            time.sleep(POLL_S)

    def close(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self.procs.values(), self.lighthouse]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _measure(work: Path, replicas: int, steps: int, step_sleep: float, fault: str, at_step: int,
             replace_delay_s: float, victim: int, timeout_s: float) -> dict[str, Any]:
    """One run of ``fault``; its summary, and for a kill the victim, the survivors' stall and the
    recovery figures."""
    work.mkdir(parents=True)
    deadline = time.monotonic() + timeout_s
    job = _Job(work, replicas, steps, step_sleep)
    try:
        for rid in range(replicas):
            job.start(rid)
        job.until("every replica's Manager", lambda: all(any(r.get("ready") for r in job.records(rid))
                                                         for rid in range(replicas)), deadline)
        job.go.touch()  # every Manager heartbeats now: the first quorum holds all replicas
        killed_at = None
        if fault != "none":
            job.until(f"replica {victim} at step {at_step}",
                      lambda: any(r.get("step", -1) >= at_step for r in job.records(victim)), deadline)
            killed_at = job.kill(victim)
            if fault == "node_kill":
                job.until(f"the replacement delay ({replace_delay_s} s)",
                          lambda: time.time() >= killed_at + replace_delay_s, deadline)
                if all(p.poll() is not None for p in job.procs.values()):
                    raise RuntimeError(f"the job ended before the replacement came {replace_delay_s} s after the "
                                       "kill; train more steps")
            job.start(victim)

        def finished() -> bool:
            others_done = all(p.poll() is not None for rid, p in job.procs.items() if rid != victim)
            if killed_at is not None and others_done and recovery(job.records(victim), killed_at)["recovery_s"] is None:
                raise RuntimeError("the others finished before the restarted replica took a step (no peer left to "
                                   "heal from); train more steps")
            return all(p.poll() == 0 for p in job.procs.values())

        job.until("the last step", finished, deadline)
        logs = {rid: job.records(rid) for rid in range(replicas)}
    finally:
        job.close()
    res = {**summarise(logs, replicas), "workdir": str(work)}
    if killed_at is not None:
        res.update({"victim": victim, "killed_at_step": at_step, "stall_s": stall(logs, victim, killed_at),
                    **recovery(logs[victim], killed_at)})
    return res


def run(replicas: int = 3, steps: int = 300, step_sleep: float = 0.05, fault: str = "none", at_step: int = 50,
        replace_delay_s: float = 10.0, victim: int | None = None, baseline: dict[str, Any] | None = None,
        timeout_s: float = 170.0, workdir: str | None = None) -> dict[str, Any]:
    """Measure torchft on ``fault`` (one of FAULTS) with ``replicas`` replica groups of one process
    training ``steps`` steps. For a kill, the undisturbed run is measured right before (or taken from
    ``baseline``, the result of an earlier ``run(fault="none")`` with the same settings) and the
    figures time_lost_s, recovery_s, stall_s, steps_at_reduced_strength and bit_identical are added;
    ``victim``: the replica killed (default the last). Each run must finish within ``timeout_s``.
    Never raises: a failure is returned as {"error": "..."}; files stay under ``workdir`` (default
    a new temporary directory)."""
    try:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
        victim = replicas - 1 if victim is None else victim
        if not 0 <= victim < replicas or (fault != "none" and not 0 <= at_step < steps):
            raise ValueError(f"need 0 <= victim < replicas and 0 <= at_step < steps (victim {victim}, at_step {at_step})")
        work = Path(workdir or tempfile.mkdtemp(prefix="bench-torchft-"))
        settings = {"replicas": replicas, "steps": steps, "step_sleep": step_sleep}
        if fault == "none":
            return {**settings, **_measure(work / "none", replicas, steps, step_sleep, "none", at_step,
                                           replace_delay_s, victim, timeout_s)}
        if baseline is None:
            baseline = _measure(work / "baseline", replicas, steps, step_sleep, "none", at_step, replace_delay_s,
                                victim, timeout_s)
        faulted = _measure(work / fault, replicas, steps, step_sleep, fault, at_step, replace_delay_s, victim,
                           timeout_s)
        return {**settings, "fault": fault, **({"replace_delay_s": replace_delay_s} if fault == "node_kill" else {}),
                **compare(baseline, faulted), "recovery_s": faulted["recovery_s"], "stall_s": faulted["stall_s"],
                "steps_at_reduced_strength": faulted["steps_at_reduced_strength"],
                "baseline": baseline, "run": faulted}
    except Exception as exc:  # the bench records a failed fault and goes on with the others
        return {"error": f"{type(exc).__name__}: {exc}"}
