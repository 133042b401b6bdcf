"""TorchPass against its peers on the same faults, side by side in one run: a worker process
killed on a healthy node (an OOM kill, a segfault) and a whole node killed, each suffered by
- TorchPass: ``torchpassctl drill --mode unplanned-crash`` / ``--mode unplanned`` on the dev cluster
  (the rank rebuilt in place / on a spare from a data-parallel replica, resumed at the failed step);
- torchrun + checkpoint restart (bench/_restart.py): torchrun's --max-restarts for the worker,
  Slurm's requeue for the node, both reloading the last checkpoint and recomputing;
- torchft 0.2 (bench/_torchft.py): its Lighthouse, one replica group a node; the killed replica is
  started again (at once for the worker; for the node, as late as TorchPass's own replacement was
  ready in the same run: a spare, hot or not, takes the same time to start for both) and heals from a live peer
  while the others train on at reduced strength.
The same model (torchpassd/drill_jobs/ddp_train.py's) and the same number of nodes for all three.
Reported per fault and peer: time lost, steps trained at reduced strength, bit-identity to an
undisturbed run, and the peer's time lost over TorchPass's. Writes peers.json and peers.md to --outdir."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from bench.recovery import ROOT, _drill, _part, _round, _say, prepare_cluster, time_lost
from torchpassd.drill import DrillSettings
from torchpassd.goodput import ratio

# fault -> (the TorchPass drill mode, bench/_restart.py's fault, bench/_torchft.py's fault)
FAULTS = {"worker_kill": ("unplanned-crash", "worker", "worker_kill"),
          "node_kill": ("unplanned", "node", "node_kill")}
PEERS = ("checkpoint_restart", "torchft")
STEP_SLEEP = DrillSettings().step_sleep  # the simulated compute a step of the drill's job, for every system
NOT_MEASURED_RESTART = "not measured: the baseline job is cancelled once it is back at the failed step"


def torchpass_row(rep: dict[str, Any], step_s: float) -> dict[str, Any]:
    """A drill report as a row: every rank pauses together, so no step runs at reduced strength;
    a failed drill is reported with its error, never as a number."""
    if rep.get("pause_s") is None:
        return {"error": rep.get("not_available") or rep.get("error") or "no pause measured"}
    return {"time_lost_s": _round(time_lost(rep, step_s)), "reduced_strength_steps": 0 if rep.get("ok") else None,
            "bit_identical": bool(rep.get("bit_identical")), "job_state": rep.get("job_state"),
            "error": rep.get("error")}


def restart_row(res: dict[str, Any]) -> dict[str, Any]:
    """bench/_restart.py's result as a row: the job stops whole, so nothing trains at reduced strength.
    A job that ended instead of coming back lost its run until a person resubmits it."""
    if res.get("job_ended"):
        return {"time_lost_s": None, "job_ended": res["job_ended"], "reduced_strength_steps": 0, "bit_identical": None,
                "note": f"the job ended {res['job_ended']} and did not come back: lost until it is resubmitted"}
    if res.get("not_back_within_s") is not None:  # a lower bound: more than this was lost
        return {"time_lost_s": None, "lost_more_than_s": res["not_back_within_s"], "reduced_strength_steps": 0,
                "bit_identical": None, "note": f"not back at the failed step {res['not_back_within_s']:.0f} s after "
                                               "the fault (the benchmark stopped waiting): lost more than that"}
    if res.get("time_lost_s") is None:
        return {"error": res.get("error") or "no time lost measured"}
    return {"time_lost_s": res["time_lost_s"], "reduced_strength_steps": 0, "bit_identical": None,
            "note": NOT_MEASURED_RESTART, "lost_steps": res.get("lost_steps")}


def torchft_row(res: dict[str, Any]) -> dict[str, Any]:
    """bench/_torchft.py's result as a row."""
    if res.get("time_lost_s") is None:
        return {"error": res.get("error") or "no time lost measured"}
    return {"time_lost_s": _round(res["time_lost_s"]), "reduced_strength_steps": res.get("steps_at_reduced_strength"),
            "bit_identical": res.get("bit_identical"), "recovery_s": res.get("recovery_s")}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Per fault: each system's row and each peer's time lost over TorchPass's; the two goals
    (TorchPass loses least on every fault; only TorchPass stays bit-identical), None when a
    figure they need was not measured."""
    out: dict[str, Any] = {"faults": {}}
    least, only_identical = [], []
    for fault, rows in raw["faults"].items():
        tp = rows.get("torchpass", {})
        over = {p: _round(ratio(rows.get(p, {}).get("time_lost_s"), tp.get("time_lost_s")), 3) for p in PEERS}
        out["faults"][fault] = {**rows, "peer_over_torchpass": over}
        # a peer whose job ended unrecovered lost more than any finite time; one not back when the
        # benchmark stopped waiting lost more than that wait
        bound = {p: _lower_bound(rows.get(p, {})) for p in PEERS}
        lost_more = [(over[p] is not None and over[p] > 1) or
                     (bound[p] is not None and tp.get("time_lost_s") is not None and bound[p] > tp["time_lost_s"])
                     for p in PEERS]
        unknown = any(over[p] is None and bound[p] is None for p in PEERS)
        least.append(None if unknown or tp.get("time_lost_s") is None else all(lost_more))
        peers_identical = [rows.get(p, {}).get("bit_identical") for p in PEERS]
        only_identical.append(None if tp.get("bit_identical") is None
                              else tp["bit_identical"] and not any(peers_identical))
    out["torchpass_loses_least"] = None if None in least else all(least)
    out["only_torchpass_bit_identical"] = None if None in only_identical else all(only_identical)
    return out


def _lower_bound(row: dict[str, Any]) -> float | None:
    """What a peer's row proves it lost at least, when it has no time lost: forever (its job
    ended unrecovered) or the wait the benchmark gave up after; None when nothing was measured."""
    if row.get("job_ended") is not None:
        return float("inf")
    return row.get("lost_more_than_s")


def markdown(res: dict[str, Any]) -> str:
    rows = ["| fault | system | time lost (s) | steps at reduced strength | bit-identical | time lost / TorchPass's |",
            "|---|---|---|---|---|---|"]
    for fault, f in res["faults"].items():
        for system in ("torchpass", *PEERS):
            r = f.get(system, {})
            if r.get("job_ended") or r.get("lost_more_than_s") is not None:
                rows.append(f"| {fault} | {system} | {r['note']} | {r['reduced_strength_steps']} | - | - |")
                continue
            if r.get("time_lost_s") is None:
                rows.append(f"| {fault} | {system} | {r.get('error', 'not run')} | | | |")
                continue
            over = "1 (baseline)" if system == "torchpass" else f["peer_over_torchpass"][system]
            identical = r["bit_identical"] if r["bit_identical"] is not None else r.get("note", "not measured")
            rows.append(f"| {fault} | {system} | {r['time_lost_s']} | {r['reduced_strength_steps']} | {identical} "
                        f"| {over} |")
    hot = res.get("raw", {}).get("hot_spares") or 0
    where = (f"the job's hot spare (--torchpass-spares={hot})" if hot else "a spare from the pool")
    return ("TorchPass against its peers, one run, the same model and nodes; TorchPass rebuilds a killed "
            f"node's ranks on {where}, a killed worker's in place\n\n" + "\n".join(rows) + "\n\n"
            f"TorchPass loses least on every fault: {res['torchpass_loses_least']}; only TorchPass stays "
            f"bit-identical: {res['only_torchpass_bit_identical']}\n")


def replacement_ready_s(rep: dict[str, Any]) -> float | None:
    """From the fault to TorchPass's replacement being ready (its joiner up): detection plus the
    recovery's phases up to joiner_ready."""
    phases = rep.get("timeline") or []
    upto = next((i for i, p in enumerate(phases) if p["phase"] == "joiner_ready"), None)
    if upto is None or rep.get("detect_s") is None:
        return None
    return round(rep["detect_s"] + sum(p["seconds"] for p in phases[1:upto + 1]), 3)


def _measure(cluster: Any, work: Path, a: argparse.Namespace, fault: str,
             ft_baseline: dict[str, Any]) -> dict[str, Any]:
    """One fault suffered by TorchPass, checkpoint restart and torchft, one after the other."""
    from bench import _restart, _torchft

    drill_mode, restart_fault, ft_fault = FAULTS[fault]
    measured: dict[str, Any] = {}
    (work / fault).mkdir(mode=0o755)
    hot = a.hot_spares if drill_mode == "unplanned" else 0  # a crashed worker is rebuilt in place
    measured["torchpass"] = _drill(cluster, work / fault, drill_mode, a.nodes, hot_spares=hot)
    _part(measured, "checkpoint_restart", f"checkpoint restart, {fault}", lambda: _restart.run(
        cluster, work / fault / "restart", nodes=a.nodes, every=a.checkpoint_every, say=_say, fault=restart_fault))
    cluster.reset()
    delay = replacement_ready_s(measured["torchpass"]) or a.replace_delay_s
    if "error" in ft_baseline:
        measured["torchft"] = {"error": f"not measured: {ft_baseline['error']}"}
        return measured
    _part(measured, "torchft", f"torchft, {fault}", lambda: _torchft.run(
        replicas=a.nodes, steps=a.torchft_steps, step_sleep=STEP_SLEEP, fault=ft_fault, at_step=a.torchft_steps // 3,
        replace_delay_s=delay, baseline=ft_baseline, workdir=str(work / fault / "torchft")))
    return measured


def run(a: argparse.Namespace) -> dict[str, Any]:
    from bench import _torchft

    cluster, work = prepare_cluster("peers", a.nodes + a.hot_spares)
    raw: dict[str, Any] = {"devcluster": cluster.id, "nodes": a.nodes, "hot_spares": a.hot_spares, "faults": {},
                           "measured": {}}
    _say("[peers] torchft undisturbed (the baseline of its time lost)")
    raw["torchft_baseline"] = (_torchft.run(replicas=a.nodes, steps=a.torchft_steps, step_sleep=STEP_SLEEP,
                                            workdir=str(work / "torchft-baseline"))
                               if importlib.util.find_spec("torchft") else
                               {"error": "torchft is not installed (.venv/bin/pip install -e '.[bench]')"})
    for fault in a.faults.split(","):
        measured = raw["measured"][fault] = _measure(cluster, work, a, fault, raw["torchft_baseline"])
        raw["faults"][fault] = {"torchpass": torchpass_row(measured["torchpass"], STEP_SLEEP),
                                "checkpoint_restart": restart_row(measured["checkpoint_restart"]),
                                "torchft": torchft_row(measured["torchft"])}
    return raw


def main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench peers")
    p.add_argument("--nodes", type=int, default=3, help="nodes (torchft: replica groups) of the job (default 3)")
    p.add_argument("--faults", default=",".join(FAULTS), help="faults to inflict, comma-separated")
    p.add_argument("--hot-spares", type=int, default=1,
                   help="node kill: TorchPass's job keeps this many hot spares (--torchpass-spares; 0: the pool's "
                        "spare); torchft's replacement replica starts as late as TorchPass's was ready either way")
    p.add_argument("--checkpoint-every", type=int, default=25, help="checkpoint-restart's interval in steps")
    p.add_argument("--torchft-steps", type=int, default=150, help="steps of each torchft run")
    p.add_argument("--replace-delay-s", type=float, default=10.0,
                   help="torchft's replacement node start when TorchPass's measured none to copy (s)")
    p.add_argument("--outdir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    unknown = set(a.faults.split(",")) - set(FAULTS)
    if unknown:
        p.error(f"unknown fault(s) {sorted(unknown)}; use {', '.join(FAULTS)}")
    raw = run(a)
    res = {**summarise(raw), "raw": raw}
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "peers.md").write_text(markdown(res))
    _say(markdown(res))
    return res
