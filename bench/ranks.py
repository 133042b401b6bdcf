"""The pause of a planned, model-aware migration against the number of ranks the leaving node runs
(``--nproc-per-node``), at the same state per rank, measured in one run on the dev cluster
($TORCHPASS_DEVCLUSTER_ID) with torchpassctl drill's code: a node's ranks save and stream their
states side by side, so N ranks should cost little more than one (goal: <= 1.3x). Reports each
pause and its ratio to the 1-rank pause of the same run, and, for N > 1, its ratio to one rank
carrying all N ranks' bytes: where the machine has fewer cores than the 2N processes that save,
send and receive (sender and joiner per rank), the transfer is CPU-bound and the second ratio shows
whether running side by side costs anything beyond the bytes. Writes ranks.json and ranks.md to
--outdir."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench.recovery import ROOT, _drill, _round, _say, mem_available, prepare_cluster, size_fits
from torchpassd.goodput import ratio
from torchpassd.planned import WORMHOLE_PORT_BASE, joiner_port

GOAL = 1.3  # N ranks' pause over one rank's


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Each rank count's pause, hand-over bytes and its ratio to the 1-rank pause of the run."""
    one = (raw["runs"].get("1") or {}).get("pause_s")
    out: dict[str, Any] = {"state_mib": raw["state_mib"], "nodes": raw["nodes"], "goal": GOAL,
                           "cpus": raw.get("cpus"), "link_gbit_per_rank": raw.get("link_gbit_per_rank")}
    for n, rep in raw["runs"].items():
        out[f"pause_s_{n}"] = rep.get("pause_s")
        out[f"bytes_{n}"] = rep.get("bytes")
        if n != "1":
            out[f"ratio_{n}"] = _round(ratio(rep.get("pause_s"), one), 3)
            same = raw.get("same_bytes", {}).get(n) or {}
            out[f"pause_s_one_rank_x{n}"] = same.get("pause_s")
            out[f"ratio_same_bytes_{n}"] = _round(ratio(rep.get("pause_s"), same.get("pause_s")), 3)
        if rep.get("not_available") or rep.get("error"):
            out[f"note_{n}"] = rep.get("not_available") or rep.get("error")
    return out


def markdown(res: dict[str, Any]) -> str:
    rows = ["| ranks on the leaving node | pause (s) | bytes moved | pause / 1-rank pause "
            "| 1 rank carrying the same bytes: pause (s) | pause / that pause |", "|---|---|---|---|---|---|"]
    for n in sorted({k.split("_")[-1] for k in res if k.startswith("pause_s_") and k[8:].isdigit()}, key=int):
        r = res.get(f"ratio_{n}")
        same = ("| - | - |" if n == "1" or res.get(f"pause_s_one_rank_x{n}") is None
                else f"| {res[f'pause_s_one_rank_x{n}']} | {res.get(f'ratio_same_bytes_{n}')} |")
        rows.append(f"| {n} | {res[f'pause_s_{n}']} | {res.get(f'bytes_{n}')} | "
                    f"{'1 (baseline)' if n == '1' else r} {same}")
    link = (f"; each rank's state on a link of its own of {res['link_gbit_per_rank']:g} Gbit/s out of the node "
            "(one NIC per GPU)" if res.get("link_gbit_per_rank") else "")
    return (f"Planned-aware pause against ranks a node ({res['state_mib']} MiB extra state per rank, "
            f"{res['nodes']} nodes, {res.get('cpus')} CPUs{link}; goal <= {res['goal']}x)\n\n" + "\n".join(rows) + "\n"
            "\nThe last column compares with one rank moving the same bytes: 1 means the ranks cost no more "
            "than their bytes; above 1, running them side by side costs extra (each moved rank has a saving and "
            "a joining process: with fewer CPUs than that they share cores).\n")


def run(a: argparse.Namespace) -> dict[str, Any]:
    cluster, work = prepare_cluster("ranks", a.nodes)
    raw: dict[str, Any] = {"devcluster": cluster.id, "nodes": a.nodes, "state_mib": a.state_mib,
                           "cpus": os.cpu_count(), "runs": {}, "same_bytes": {}}

    counts = [int(x) for x in a.nproc.split(",")]
    if a.link_gbit_per_rank:
        raw["link_gbit_per_rank"] = a.link_gbit_per_rank

    def drill(name: str, nproc: int, mib: int) -> dict[str, Any]:
        why = size_fits(mib, a.nodes * nproc, mem_available())
        if why:
            return {"not_available": why}
        (work / name).mkdir(mode=0o755)  # a torchpassd of its own: a fresh spare pool
        if a.link_gbit_per_rank:  # every drill ends with a cluster reset, which lifts it
            for node in (n["name"] for n in cluster.info["nodes"]):
                cluster.shape(node, a.link_gbit_per_rank, rank_port_groups(max(counts)))
        return _drill(cluster, work / name, "planned-aware", a.nodes, mib, nproc=nproc)

    for n in counts:
        raw["runs"][str(n)] = drill(f"nproc{n}", n, a.state_mib)
        if n > 1 and not a.no_same_bytes:
            raw["same_bytes"][str(n)] = drill(f"nproc1-x{n}", 1, n * a.state_mib)
    return raw


def rank_port_groups(nproc: int, generations: int = 32) -> list[list[int]]:
    """The wormhole ports a joining node's local worker i listens on (over the job's first
    ``generations`` generations), one group per i: shaped as one link each, a rank's state takes
    its own NIC, as each GPU of an NVL72 tray has."""
    return [[joiner_port(WORMHOLE_PORT_BASE + gen, i) for gen in range(1, generations + 1)] for i in range(nproc)]


def main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench ranks")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the example job (default 2)")
    p.add_argument("--nproc", default="1,2,4", help="ranks a node to measure, comma-separated (1 first: the baseline)")
    p.add_argument("--state-mib", type=int, default=256, help="extra state per rank, carried by save/load (MiB)")
    p.add_argument("--no-same-bytes", action="store_true",
                   help="skip the 1-rank runs that carry N ranks' bytes (the CPU-bound reference)")
    p.add_argument("--link-gbit-per-rank", type=float, default=0.0,
                   help="give each rank's state a link of its own of this many Gbit/s out of every node (one NIC "
                        "per GPU; low enough that the CPUs are not the limit); default 0: the nodes' links as they are")
    p.add_argument("--outdir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    raw = run(a)
    res = {**summarise(raw), "raw": raw}
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"ranks-link-{a.link_gbit_per_rank:g}gbit-per-rank" if a.link_gbit_per_rank else "ranks"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(markdown(res))
    _say(markdown(res))
    return res
