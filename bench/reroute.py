"""The pause of a reroute against a planned migration at the same state size (issue 24), in one run
on the dev cluster ($TORCHPASS_DEVCLUSTER_ID): the example DDP job with ``--state-mib`` extra state
per rank trains on 4 nodes; n2's fabric link (eth1) goes down (a reroute over eth0: no state
moves), comes back (the reroute back after the hold-down), then n3 is drained (a planned migration
streams its rank's state to the spare). Reports each pause from torchpassd's history and the
reroute's ratio to the planned migration's pause of the same run. Writes reroute.json and
reroute.md to --outdir."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.recovery import ROOT, DrillDaemon, _say, prepare_cluster
from torchpassd.goodput import ratio

STEPS, STEP_SLEEP, NODES = 600, 0.1, 4


def _ended(daemon: DrillDaemon, job: str, count: int, mode: str) -> list[dict[str, Any]] | None:
    """The job's migrations of ``mode`` once ``count`` of them ended, oldest first."""
    done = [m for m in reversed(daemon.client.call("history", job=job)) if m["mode"] == mode and m["status"] != "running"]
    return done if len(done) >= count else None


def _pause(mig: dict[str, Any]) -> float | None:
    return next((p["detail"].get("pause_s") for p in mig["phases"] if p["phase"] == "resumed"), None)


def measure(cluster: Any, work: Path, state_mib: int) -> dict[str, Any]:
    # the job as a user submits it (sbatch --torchpass, srun torchrun), and the tests' wait
    from tests.support.e2e import Training, wait_until

    daemon = DrillDaemon(cluster, work)
    try:
        job = Training(cluster, work / "torchpass.toml", work, steps=STEPS, step_sleep=STEP_SLEEP, nodes=NODES,
                       args=f"--state-mib {state_mib}")
        def training() -> bool:  # every rank past its first steps: the groups formed, state registered
            j = next((j for j in daemon.client.call("jobs") if j["job"] == job.job), None)
            workers = [w for lp in (j or {}).get("launchpads", {}).values() for w in lp["workers"]]
            return bool(j) and j["path"] == "eth1" and len(workers) == NODES and min(w["step"] for w in workers) >= 5
        wait_until("the job to train", training, 300)
        cluster.link_down("n2", "eth1")
        (away,) = wait_until("the reroute over eth0", lambda: _ended(daemon, job.job, 1, "reroute"), 120)
        cluster.link_up("n2", "eth1")
        back = wait_until("the reroute back to eth1", lambda: _ended(daemon, job.job, 2, "reroute"), 120)[1]
        cluster.drain("n3", "bench reroute: a planned migration to compare with")
        (planned,) = wait_until("the planned migration off n3", lambda: _ended(daemon, job.job, 1, "planned-aware"), 240)
    finally:
        daemon.stop()
        cluster.reset()
    out = {"state_mib": state_mib, "nodes": NODES, "reroute_pause_s": _pause(away), "return_pause_s": _pause(back),
           "planned_pause_s": _pause(planned), "statuses": [away["status"], back["status"], planned["status"]]}
    for key in ("reroute", "return"):
        r = ratio(out[f"{key}_pause_s"], out["planned_pause_s"])
        out[f"{key}_over_planned"] = None if r is None else round(r, 3)
    return out


def markdown(res: dict[str, Any]) -> str:
    return (f"Reroute against planned migration ({res['state_mib']} MiB extra state per rank, {res['nodes']} nodes, "
            "same run)\n\n| change | pause (s) | / planned migration |\n|---|---|---|\n"
            f"| reroute over eth0 (n2's eth1 down) | {res['reroute_pause_s']} | {res['reroute_over_planned']} |\n"
            f"| back to eth1 after the hold-down | {res['return_pause_s']} | {res['return_over_planned']} |\n"
            f"| planned migration n3 -> spare (baseline) | {res['planned_pause_s']} | 1 |\n"
            "\nA reroute's pause runs from torchpassd's decision to the resume (every rank cut, its just-in-time "
            "state kept, the groups re-formed over the other interface); a planned migration's from the moment "
            "every rank paused at the agreed step to the resume (its spare was prepared while training went on, "
            "and its state streamed during the pause). A reroute takes no spare and moves no state.\n")


def main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench reroute")
    p.add_argument("--state-mib", type=int, default=256, help="extra state per rank (default 256)")
    p.add_argument("--outdir", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args(argv)
    cluster, work = prepare_cluster("reroute")
    res = measure(cluster, work, a.state_mib)
    a.outdir.mkdir(parents=True, exist_ok=True)
    (a.outdir / "reroute.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    (a.outdir / "reroute.md").write_text(markdown(res))
    _say(f"[reroute] written to {a.outdir}/reroute.md")
    return res
