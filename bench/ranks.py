"""The pause of a planned, model-aware migration against the number of ranks the leaving node runs
(``--nproc-per-node``), at the same state per rank, measured in one run on the dev cluster
($TORCHPASS_DEVCLUSTER_ID) with torchpassctl drill's code: a node's ranks save and stream their
states side by side, so N ranks should cost little more than one (goal: <= 1.3x). Reports each
pause and its ratio to the 1-rank pause of the same run; writes ranks.json and ranks.md to --outdir."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.recovery import ROOT, _drill, _say, mem_available, prepare_cluster, size_fits
from torchpassd.goodput import ratio

GOAL = 1.3  # N ranks' pause over one rank's


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Each rank count's pause, hand-over bytes and its ratio to the 1-rank pause of the run."""
    one = (raw["runs"].get("1") or {}).get("pause_s")
    out: dict[str, Any] = {"state_mib": raw["state_mib"], "nodes": raw["nodes"], "goal": GOAL}
    for n, rep in raw["runs"].items():
        out[f"pause_s_{n}"] = rep.get("pause_s")
        out[f"bytes_{n}"] = rep.get("bytes")
        if n != "1":
            r = ratio(rep.get("pause_s"), one)
            out[f"ratio_{n}"] = None if r is None else round(r, 3)
        if rep.get("not_available") or rep.get("error"):
            out[f"note_{n}"] = rep.get("not_available") or rep.get("error")
    return out


def markdown(res: dict[str, Any]) -> str:
    rows = ["| ranks on the leaving node | pause (s) | bytes moved | pause / 1-rank pause |", "|---|---|---|---|"]
    for n in sorted({k.split("_")[-1] for k in res if k.startswith("pause_s_")}, key=int):
        r = res.get(f"ratio_{n}")
        rows.append(f"| {n} | {res[f'pause_s_{n}']} | {res.get(f'bytes_{n}')} | "
                    f"{'1 (baseline)' if n == '1' else r} |")
    return (f"Planned-aware pause against ranks a node ({res['state_mib']} MiB extra state per rank, "
            f"{res['nodes']} nodes; goal <= {res['goal']}x)\n\n" + "\n".join(rows) + "\n")


def run(a: argparse.Namespace) -> dict[str, Any]:
    cluster, work = prepare_cluster("ranks")
    raw: dict[str, Any] = {"devcluster": cluster.id, "nodes": a.nodes, "state_mib": a.state_mib, "runs": {}}
    for n in [int(x) for x in a.nproc.split(",")]:
        why = size_fits(a.state_mib, a.nodes * n, mem_available())
        (work / f"nproc{n}").mkdir(mode=0o755)  # a torchpassd of its own: a fresh spare pool
        raw["runs"][str(n)] = {"not_available": why} if why else _drill(
            cluster, work / f"nproc{n}", "planned-aware", a.nodes, a.state_mib, nproc=n)
    return raw


def main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench ranks")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the example job (default 2)")
    p.add_argument("--nproc", default="1,2,4", help="ranks a node to measure, comma-separated (1 first: the baseline)")
    p.add_argument("--state-mib", type=int, default=256, help="extra state per rank, carried by save/load (MiB)")
    p.add_argument("--outdir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    raw = run(a)
    res = {**summarise(raw), "raw": raw}
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks.json").write_text(json.dumps(res, indent=1))
    (out / "ranks.md").write_text(markdown(res))
    _say(markdown(res))
    return res
