"""The soak (issue 22): one long job on the dev cluster takes 50 faults drawn at random, one after
the other, each with the consequence an operator expects (a drained node migrated to the spare, a
killed node's ranks rebuilt there, a killed or frozen worker rebuilt in place, a fabric link lost
and back rerouted, torchpassd or the broker killed and restarted, a short partition ridden out).
After a fault that used the spare, the vacated node is repaired (started, resumed) and made the
spare, as an operator returns a tray. The job must end COMPLETED 0:0 with every loss and the final
parameters bit-identical to an undisturbed run (a step a recovery resumed at may repeat, with the
same loss). The faults, their outcomes and the time each took go to bench/results/soak.{json,md}.

Run with ``make test-matrix`` (``-m soak``); SOAK_FAULTS, SOAK_STEPS and SOAK_SEED override the
number of faults, the job's length and the seed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_link_reroute import assert_identical_replays_aside
from tests.e2e.test_planned_migration import restart_broker
from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, reference_log, sacct_state, wait_until
from torchpass_common.config import LinksConfig
from torchpassd.drill_report import read_log
from torchpassd.unplanned import CRASH_WINDOW_S, CRASHES_TO_DRAIN

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow, pytest.mark.soak,
              pytest.mark.timeout(7200)]

ROOT = Path(__file__).resolve().parents[2]
FAULTS = int(os.environ.get("SOAK_FAULTS", "50"))
SEED = int(os.environ.get("SOAK_SEED", str(int(time.time()))))
STEP_SLEEP = 0.1
STEPS = int(os.environ.get("SOAK_STEPS", "6000"))  # ~16 min here: room for the faults (the loop checks)
NPROC = 2
SPARE_RESERVATION = "torchpass_spares"
FLAP_WINDOW_S = LinksConfig().flap_window
SHORT_CUT_S = 2.5  # below heartbeat loss detection (1 s x 5 in the e2e config): no migration may follow


@dataclass
class Soak:
    """The running job and what the faults need to find their targets."""

    daemon: Daemon
    cluster: DevCluster
    job: Training
    rng: random.Random
    rows: list[dict[str, Any]] = field(default_factory=list)
    crashes: dict[str, list[float]] = field(default_factory=dict)  # node -> when its workers crashed (torchpassd's count)
    link_changes: dict[str, float] = field(default_factory=dict)  # node -> when its fabric link last changed

    def view(self) -> dict[str, Any]:
        view = self.daemon.job(self.job.job)
        assert view is not None, f"torchpassd lost track of job {self.job.job}"
        return view

    def step(self) -> int:
        """The lowest step any rank reported (-1 while a node reports none)."""
        return min((w["step"] for lp in self.view()["launchpads"].values() for w in lp["workers"]), default=-1)

    def trains_on(self, steps: int = 5, timeout: float = 90) -> None:
        """Every rank gets ``steps`` further, all ranks present (the job is whole again)."""
        def whole() -> int | None:
            view = self.daemon.job(self.job.job) or {}
            workers = [w for lp in view.get("launchpads", {}).values() for w in lp["workers"]]
            return min(w["step"] for w in workers) if len(workers) == self.job.world else None
        start = wait_until("every rank of the job to report", whole, timeout)
        wait_until(f"job {self.job.job} to train {steps} more steps", lambda: (whole() or -1) >= start + steps, timeout)

    def node(self, *, batch_host: bool = True) -> str:
        view = self.view()
        nodes = sorted(n for n in view["nodes"] if batch_host or n != view["batch_host"])
        return self.rng.choice(nodes)

    def worker(self) -> tuple[str, dict[str, Any]]:
        """A worker off the batch host (a batch host whose ranks moved stays in the job, so it could
        not be made the spare again)."""
        node = self.node(batch_host=False)
        return node, self.rng.choice(self.view()["launchpads"][node]["workers"])

    def next_migration(self, known: int, timeout: float = 240) -> dict[str, Any]:
        """The first migration record after the ``known`` earlier ones, once it ended; it must have succeeded."""
        def ended() -> dict[str, Any] | None:
            later = self.daemon.migrations(self.job.job)[known:]
            return later[0] if later and later[0]["status"] != "running" else None
        mig = wait_until("the fault's migration to end", ended, timeout)
        assert mig["status"] == "succeeded", mig
        return mig

    def make_spare(self, node: str) -> None:
        """The operator's repair: the node undrained and made the spare reservation's node; waits
        until ``torchpassctl spares`` calls it available."""
        if any(word in self.cluster.node_state(node) for word in ("drain", "down", "fail")):
            self.cluster.resume(node)
        self.cluster.run("scontrol", "update", f"reservationname={SPARE_RESERVATION}", f"nodes={node}")
        try:
            wait_until(f"{node} to be the free spare", lambda: self.spares() == {node: True}, 30, every=1.0)
        except AssertionError:
            self.cluster.clear_stale_allocation(node, "soak repair")
            wait_until(f"{node} to be the free spare", lambda: self.spares() == {node: True}, 60, every=1.0)

    def spares(self) -> dict[str, bool]:
        out = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(self.daemon.config),
                              "spares", "--json"], capture_output=True, text=True, timeout=30, check=True).stdout
        return {s["node"]: s["available"] for s in json.loads(out)["spares"]}


def drain(s: Soak) -> str:
    node, known = s.node(batch_host=False), len(s.daemon.migrations(s.job.job))
    s.cluster.drain(node, "soak: planned maintenance")
    mig = s.next_migration(known)
    assert mig["mode"] == "planned-aware" and mig["source"] == node and mig["target"], mig
    s.trains_on()
    s.make_spare(node)
    return f"{node} -> {mig['target']} (planned aware)"


def kill_node(s: Soak) -> str:
    node, known = s.node(batch_host=False), len(s.daemon.migrations(s.job.job))
    s.cluster.kill_node(node)
    mig = s.next_migration(known)
    assert mig["mode"] == "unplanned-aware" and mig["source"] == node and mig["target"], mig
    s.trains_on()
    s.cluster.start_node(node)
    s.make_spare(node)
    return f"{node} -> {mig['target']} (unplanned)"


def _lose_worker(s: Soak, sig: int, how: str) -> str:
    """The worker is rebuilt in place; its node's third crash within CRASH_WINDOW_S also moves the
    node to the spare (torchpassd's escalation)."""
    node, victim = s.worker()
    known, now = len(s.daemon.migrations(s.job.job)), time.monotonic()
    os.kill(victim["pid"], sig)
    mig = s.next_migration(known)
    assert mig["mode"] == "unplanned-aware" and mig["source"] == node and not mig["target"], mig
    done = f"rank {victim['rank']} on {node} {how}, rebuilt in place"
    recent = s.crashes[node] = [t for t in s.crashes.get(node, []) if now - t < CRASH_WINDOW_S] + [now]
    if len(recent) >= CRASHES_TO_DRAIN:
        del s.crashes[node]
        moved = s.next_migration(known + 1)
        assert moved["mode"] == "planned-aware" and moved["source"] == node and moved["target"], moved
        s.trains_on()
        s.make_spare(node)
        return f"{done}; {len(recent)} crashes in {CRASH_WINDOW_S / 60:.0f} min: node moved to {moved['target']}"
    s.trains_on()
    return done


def kill_worker(s: Soak) -> str:
    return _lose_worker(s, signal.SIGKILL, "killed")


def freeze_worker(s: Soak) -> str:
    return _lose_worker(s, signal.SIGSTOP, "frozen")


def fabric_down(s: Soak) -> str:
    """A node whose fabric changed within [links] flap_window would count as flapping (damped: no
    way back), which is test_link_reroute.py's case; the soak waits that window out."""
    node, known = s.node(), len(s.daemon.migrations(s.job.job))
    time.sleep(max(0.0, s.link_changes.get(node, -FLAP_WINDOW_S) + FLAP_WINDOW_S - time.monotonic()))
    s.cluster.link_down(node, "eth1")
    away = s.next_migration(known)
    assert away["mode"] == "reroute" and not away["target"], away
    s.cluster.link_up(node, "eth1")
    s.link_changes[node] = time.monotonic()
    back = s.next_migration(known + 1)  # after the hold-down
    assert back["mode"] == "reroute" and s.view()["path"] == "eth1", back
    s.trains_on()
    return f"eth1 of {node} down: rerouted over eth0, back on eth1 after the hold-down"


def _no_migration(s: Soak, fault: Callable[[], None]) -> None:
    known = len(s.daemon.migrations(s.job.job))
    fault()
    s.trains_on()
    assert len(s.daemon.migrations(s.job.job)) == known, "the fault started a (false) migration"


def kill_torchpassd(s: Soak) -> str:
    def restart() -> None:
        s.daemon.stop(signal.SIGKILL)
        s.daemon.start()
        s.crashes.clear()  # torchpassd counts crashes in memory
    _no_migration(s, restart)
    return "torchpassd killed and restarted: nothing moved"


def kill_broker(s: Soak) -> str:
    _no_migration(s, lambda: restart_broker(s.cluster, down_s=2.0))
    return "broker killed, back after 2 s: nothing moved"


def short_cut(s: Soak) -> str:
    node = s.node()

    def cut() -> None:
        s.cluster.cut(node)
        time.sleep(SHORT_CUT_S)
        s.cluster.heal(node)
        s.link_changes[node] = time.monotonic()  # the fabric link went down and up too
    _no_migration(s, cut)
    return f"{node} cut for {SHORT_CUT_S} s: ridden out"


KINDS: dict[str, Callable[[Soak], str]] = {
    "drain": drain, "kill node": kill_node, "kill worker": kill_worker, "freeze worker": freeze_worker,
    "fabric link down": fabric_down, "kill torchpassd": kill_torchpassd, "kill broker": kill_broker,
    "short cut": short_cut,
}


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    out = ROOT / "bench" / "results"
    (out / "soak.json").write_text(json.dumps({**meta, "faults": rows}, indent=1) + "\n")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    lines = [f"# Soak: {len(rows)} random faults on one job (seed {meta['seed']})", "",
             f"Job {meta['job']}: {meta['nodes']} nodes x {meta['nproc']} ranks, {meta['steps']} steps; "
             f"ended {meta['end']}; {meta['verdict']}; replayed steps: {meta['replays']}; "
             f"soak {meta['seconds']:.0f} s.", "",
             "| kind | count |", "|---|---|", *(f"| {k} | {v} |" for k, v in sorted(counts.items())), "",
             "| # | fault | at step | seconds | outcome |", "|---|---|---|---|---|",
             *(f"| {i + 1} | {r['kind']} | {r['step']} | {r['seconds']:.1f} | {r['outcome']} |" for i, r in enumerate(rows))]
    (out / "soak.md").write_text("\n".join(lines) + "\n")


def test_fifty_random_faults_on_one_job_end_bit_identical(torchpassd: Daemon, devcluster: DevCluster,
                                                          tp_config: Path, workdir: Path) -> None:
    rng = random.Random(SEED)
    print(f"soak seed {SEED} (SOAK_SEED={SEED} repeats this run)")
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nproc=NPROC)
    soak = Soak(torchpassd, devcluster, job, rng)
    job.wait_running(torchpassd, min_step=5, timeout=180)
    t0 = time.monotonic()
    for i in range(FAULTS):
        at = soak.step()
        assert at < STEPS - 500, f"the job neared its end after {i} faults: raise STEPS"
        kind = rng.choice(sorted(KINDS))
        t = time.monotonic()
        outcome = KINDS[kind](soak)
        soak.rows.append({"kind": kind, "step": at, "seconds": round(time.monotonic() - t, 1), "outcome": outcome})
        print(f"fault {i + 1}/{FAULTS}: {kind}: {outcome} ({soak.rows[-1]['seconds']} s)", flush=True)
    seconds = time.monotonic() - t0
    job.wait_done(timeout=STEPS * STEP_SLEEP * 2)
    try:
        replays, verdict = assert_identical_replays_aside(job, read_log(reference_log(workdir, job.world, STEPS))), ""
    except AssertionError as exc:
        replays, verdict = None, f"NOT bit-identical: {exc}"
    end = sacct_state(devcluster, job.job, timeout=120)  # accounting: slurmctld forgets a job minutes after its end
    write_results(soak.rows, {"seed": SEED, "job": job.job, "nodes": job.nodes, "nproc": job.nproc, "steps": STEPS,
                              "end": end, "verdict": verdict or "bit-identical", "replays": replays,
                              "seconds": seconds})
    assert not verdict, verdict
    assert end == "COMPLETED 0:0"
