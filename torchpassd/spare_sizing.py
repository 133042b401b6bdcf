"""How many spare nodes to hold. The model: nodes fail (or are drained) as a Poisson process at
``rate`` per node-hour; each failed node leaves for repair for ``repair_hours`` on average and comes
back as a spare. The nodes away for repair at any moment are then Poisson-distributed with mean
m = rate x nodes x repair_hours (an M/G/inf queue: true for any repair-time distribution), and a
failure finds a free spare when fewer than S of them are away (Poisson arrivals see the time
average): P(S) = sum_{k<S} e^-m m^k / k!. The advice is the smallest S with P(S) >= target.
Goodput per S weighs what holding S spares costs (their GPU-hours, less the share preemptible
backfill jobs use: ``spare_backfill``) against what a failure without a spare costs
(checkpoint-restart instead of TorchPass's pause). Rates come from the journal when it has seen
enough node-hours, otherwise from the cluster description. Pure arithmetic and the chart; no I/O
besides writing the chart. ``torchpassctl goodput --advise-spares`` drives it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torchpassd import journal as jn
from torchpassd.goodput import HOURS_PER_YEAR, Cluster

MIN_NODE_HOURS = 1000.0  # less exposure than this and the journal's failure rate is noise
MAX_SPARES = 64  # the curve stops here (or at the advice plus a few, when that is more)


@dataclass(frozen=True)
class Exposure:
    """What the journal saw: node-hours of TorchPass jobs and the failures among them, by cause."""

    node_hours: float
    failures: dict[str, int]


def exposure_from(journal: jn.Journal, now: float) -> Exposure:
    """Node-hours of every job in the journal (running ones up to ``now``) and its distinct node
    losses (one per job and node, however many tries it took), by cause: a node death, a GPU health
    drain, or another drain."""
    hours = sum(len(j.nodes) * max(0.0, (j.ended or now) - j.created) / 3600 for j in journal.jobs(active_only=False))
    seen: dict[tuple[str, str], str] = {}
    for rec in journal.history(limit=100000):
        if rec.source:
            seen.setdefault((rec.job_id, rec.source), cause_of(rec.mode, rec.reason))
    failures: dict[str, int] = {}
    for cause in seen.values():
        failures[cause] = failures.get(cause, 0) + 1
    return Exposure(hours, failures)


def cause_of(mode: str, reason: str) -> str:
    """A migration's cause as the advice counts it."""
    if mode.startswith("unplanned"):
        return "node death"
    return "GPU health" if "GPU" in reason or "XID" in reason else "drain"


def p_spare_free(mean_away: float, spares: int) -> float:
    """P(fewer than ``spares`` nodes away for repair) when that count is Poisson(``mean_away``)."""
    if spares <= 0:
        return 0.0
    term = total = math.exp(-mean_away)
    for k in range(1, spares):
        term *= mean_away / k
        total += term
    return min(1.0, total)


@dataclass(frozen=True)
class Point:
    """The curve at ``spares`` held: chance a failure finds one, yearly cost, goodput."""

    spares: int
    p_spare_free: float
    gpu_hours_lost_per_year: float  # failures: TorchPass's pause, or checkpoint-restart without a spare
    gpu_hours_held_per_year: float  # the spares standing idle (what backfill does not use)
    goodput: float  # useful GPU-hours / all GPU-hours paid for (the spares' included)


def advise(cluster: Cluster, exposure: Exposure | None, target: float, pause_s: float | None = None) -> dict[str, Any]:
    """The advice: the failure rate and where it came from, the model's mean, the spares needed
    for ``target`` (a probability that a failure finds a spare), and the goodput curve."""
    if not 0 < target < 1:
        raise ValueError(f"target must be a probability between 0 and 1, got {target}")
    if exposure is not None and exposure.node_hours >= MIN_NODE_HOURS:
        rate = sum(exposure.failures.values()) / exposure.node_hours
        source = f"journal: {sum(exposure.failures.values())} node losses in {exposure.node_hours:,.0f} node-hours"
    else:
        rate = cluster.failures_per_1000_node_days / 1000 / 24
        seen = f"the journal saw {exposure.node_hours:,.1f} node-hours (< {MIN_NODE_HOURS:,.0f}); " if exposure else ""
        source = f"{seen}cluster description: {cluster.failures_per_1000_node_days:g} per 1000 node-days"
    mean_away = rate * cluster.nodes * cluster.repair_hours
    needed = 0
    while p_spare_free(mean_away, needed) < target:
        needed += 1
    pause = pause_s if pause_s is not None else (cluster.pause_s or 0.0)
    curve = [_point(cluster, rate, mean_away, s, pause) for s in range(max(MAX_SPARES, needed + 4) + 1)]
    best = max(curve, key=lambda p: p.goodput)
    return {"model": "failures Poisson at rate r per node-hour; a failed node is away for repair_hours on average "
                     "and comes back a spare; nodes away ~ Poisson(m = r x nodes x repair_hours); "
                     "P(a failure finds a spare | S held) = sum_{k<S} e^-m m^k / k!",
            "rate_per_node_hour": rate, "rate_source": source,
            "causes": dict(exposure.failures) if exposure else {}, "nodes": cluster.nodes,
            "repair_hours": cluster.repair_hours, "mean_away": mean_away, "target": target,
            "recommended_spares": needed, "p_spare_free": p_spare_free(mean_away, needed),
            "best_goodput_spares": best.spares, "pause_s": pause, "restart_loss_s": cluster.restart_loss_s,
            "spare_backfill": cluster.spare_backfill,
            "curve": [asdict(p) for p in curve]}


def _point(cluster: Cluster, rate: float, mean_away: float, spares: int, pause_s: float) -> Point:
    gpn, year = cluster.gpus_per_node, HOURS_PER_YEAR
    failures = rate * cluster.nodes * year
    p = p_spare_free(mean_away, spares)
    job_gpus = (cluster.job_nodes or cluster.nodes) * gpn
    lost = failures * job_gpus * (p * pause_s + (1 - p) * cluster.restart_loss_s) / 3600
    held = spares * gpn * year * (1 - cluster.spare_backfill)
    useful = cluster.nodes * gpn * year - lost
    return Point(spares, p, lost, held, useful / (useful + lost + held))


def table(adv: dict[str, Any]) -> str:
    """The advice in a few lines."""
    lines = [f"failure rate {adv['rate_per_node_hour'] * 24000:.2f} per 1000 node-days ({adv['rate_source']})",
             f"{adv['nodes']} nodes, repair {adv['repair_hours']:g} h: on average {adv['mean_away']:.2f} nodes away",
             f"hold {adv['recommended_spares']} spares for a {adv['target']:.2%} chance that a failure finds one "
             f"(P = {adv['p_spare_free']:.5f}); goodput is highest at {adv['best_goodput_spares']} spares "
             f"(idle spares cost their GPU-hours less {adv['spare_backfill']:.0%} backfill)"]
    if adv["causes"]:
        lines.append("node losses in the journal: " + ", ".join(f"{v} {k}" for k, v in sorted(adv["causes"].items())))
    return "\n".join(lines)


def chart(adv: dict[str, Any], path: str | Path) -> Path:
    """A PNG: goodput and the chance a failure finds a spare, against spares held."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = min(len(adv["curve"]), max(adv["recommended_spares"], adv["best_goodput_spares"]) * 2 + 4)
    curve = adv["curve"][:last]
    xs = [p["spares"] for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [p["goodput"] * 100 for p in curve], marker="o", color="#4c72b0", label="goodput (%)")
    ax.set_xlabel("spare nodes held")
    ax.set_ylabel("goodput (%)")
    other = ax.twinx()
    other.plot(xs, [p["p_spare_free"] * 100 for p in curve], color="#55a868", linestyle="--",
               label="failure finds a spare (%)")
    other.set_ylabel("failure finds a spare (%)")
    ax.axvline(adv["recommended_spares"], color="#c44e52", linestyle=":",
               label=f"advice: {adv['recommended_spares']} spares ({adv['target']:.1%})")
    handles = ax.get_legend_handles_labels()[0] + other.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_title(f"{adv['nodes']} nodes, {adv['rate_per_node_hour'] * 24000:.2f} failures per 1000 node-days, "
                 f"repair {adv['repair_hours']:g} h", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
