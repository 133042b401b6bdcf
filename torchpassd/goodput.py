"""Goodput arithmetic: what a failure costs under checkpoint-restart (restart overhead plus, on
average, half a checkpoint interval of recomputation) against what it cost under TorchPass (the
measured pause), turned into GPU-hours and dollars for the migrations in the journal and projected
over a year for a cluster description (TOML or JSON). Also the PNG chart. No I/O besides reading
the description and writing the chart; torchpassctl goodput (ctl_goodput.py) drives it."""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchpass_common.errors import ConfigError
from torchpassd import journal as jn

HOURS_PER_YEAR = 24 * 365


def checkpoint_restart_loss_s(restart_overhead_s: float, interval_s: float) -> float:
    """Expected wall time a job loses per failure under checkpoint-restart: the restart overhead
    (detect, requeue, start, reload) plus the recomputation since the last checkpoint, which for a
    failure uniformly distributed in the interval is half of it on average."""
    if restart_overhead_s < 0 or interval_s < 0:
        raise ValueError("restart overhead and checkpoint interval must be >= 0")
    return restart_overhead_s + interval_s / 2


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is unknown or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


@dataclass(frozen=True)
class Cluster:
    """A cluster description: how big, what a GPU-hour costs, how often nodes fail, and how much a
    checkpoint-restart loses (``restart_overhead_s`` given, or read from a bench result)."""

    nodes: int
    gpus_per_node: int
    usd_per_gpu_hour: float
    failures_per_1000_node_days: float
    checkpoint_interval_s: float = 600.0
    restart_overhead_s: float = 0.0
    job_nodes: int = 0  # nodes stopped by one failure under checkpoint-restart (0: the whole cluster)
    pause_s: float | None = None  # TorchPass pause to project with when the journal has no migration
    repair_hours: float = 48.0  # a failed node's mean time away before it is a spare again (spare_sizing.py)
    spare_backfill: float = 0.0  # share of a held spare's GPU-hours preemptible backfill jobs use (0..1)
    restart_source: str = "given"

    @property
    def restart_loss_s(self) -> float:
        return checkpoint_restart_loss_s(self.restart_overhead_s, self.checkpoint_interval_s)

    @property
    def failures_per_year(self) -> float:
        return self.nodes * 365 * self.failures_per_1000_node_days / 1000

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Read a TOML or JSON description. ``restart_from = "bench.json"`` (a ``python -m bench
        recovery --json`` result, relative to the description) supplies the measured restart overhead."""
        p = Path(path)
        try:
            text = p.read_text()
            raw: dict[str, Any] = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the cluster description {p}: {exc}",
                              hint="see contrib/goodput/cluster.toml for the format") from exc
        source = "given"
        if "restart_from" in raw:
            bench = p.parent / str(raw.pop("restart_from"))
            try:
                measured = json.loads(bench.read_text())["baseline"]["restart_overhead_s"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"cannot take the restart overhead from {bench}: {exc!r}",
                                  hint="point restart_from at `python -m bench recovery --json` output, "
                                       "or set restart_overhead_s") from exc
            raw.setdefault("restart_overhead_s", measured)
            source = f"measured ({bench.name})"
        known = set(cls.__dataclass_fields__) - {"restart_source"}
        unknown = sorted(set(raw) - known - {"description"})
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in {p}", hint=f"known: {sorted(known)}")
        try:
            cluster = cls(**{k: v for k, v in raw.items() if k in known}, restart_source=source)
        except TypeError as exc:
            raise ConfigError(f"cluster description {p}: {exc}", hint="nodes, gpus_per_node, usd_per_gpu_hour "
                              "and failures_per_1000_node_days are required") from exc
        cluster.validate(p)
        return cluster

    def validate(self, where: Path | str = "cluster description") -> None:
        numbers = {k: v for k, v in asdict(self).items() if k not in ("restart_source", "pause_s")}
        bad = [k for k, v in numbers.items() if not isinstance(v, int | float) or v < 0]
        if bad or self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"{where}: {', '.join(bad) or 'nodes/gpus_per_node'} must be positive numbers")
        if self.spare_backfill > 1:
            raise ConfigError(f"{where}: spare_backfill is a share of a spare's time, between 0 and 1")


@dataclass(frozen=True)
class Migration:
    """One succeeded migration as the report counts it."""

    id: str
    job: str
    mode: str
    started: float
    pause_s: float
    job_nodes: int


@dataclass
class Line:
    """One row of the report: ``failures`` handled, GPU-hours each way, what was saved."""

    label: str
    failures: float
    gpu_hours_checkpoint_restart: float
    gpu_hours_torchpass: float
    gpu_hours_saved: float = field(init=False)
    usd_saved: float = 0.0

    def __post_init__(self) -> None:
        self.gpu_hours_saved = self.gpu_hours_checkpoint_restart - self.gpu_hours_torchpass


def migrations_from(journal: jn.Journal, limit: int = 100000) -> tuple[list[Migration], dict[str, int]]:
    """Succeeded migrations with their pause and the job's size, and a count of every status."""
    sizes = {j.job_id: len(j.nodes) for j in journal.jobs(active_only=False)}
    out, statuses = [], {}
    for rec in journal.history(limit=limit):
        statuses[rec.status] = statuses.get(rec.status, 0) + 1
        pause = next((p.detail["pause_s"] for p in rec.phases if "pause_s" in p.detail), None)
        if rec.status == jn.SUCCEEDED and pause is not None:
            out.append(Migration(rec.id, rec.job_id, rec.mode, rec.started, float(pause), sizes.get(rec.job_id, 1)))
    return sorted(out, key=lambda m: m.started), statuses


def report(cluster: Cluster, migrations: list[Migration]) -> dict[str, Any]:
    """The observed line (the journal's migrations) and the projected yearly line."""
    usd = cluster.usd_per_gpu_hour
    gpn = cluster.gpus_per_node
    restart = cluster.restart_loss_s
    observed = Line("observed (journal)", len(migrations),
                    sum(m.job_nodes * gpn * restart for m in migrations) / 3600,
                    sum(m.job_nodes * gpn * m.pause_s for m in migrations) / 3600)
    observed.usd_saved = observed.gpu_hours_saved * usd
    mean_pause = (sum(m.pause_s for m in migrations) / len(migrations)) if migrations else cluster.pause_s
    lines = [observed]
    if mean_pause is not None:
        job_gpus = (cluster.job_nodes or cluster.nodes) * gpn
        per_year = cluster.failures_per_year
        projected = Line("projected per year", per_year, per_year * job_gpus * restart / 3600,
                         per_year * job_gpus * mean_pause / 3600)
        projected.usd_saved = projected.gpu_hours_saved * usd
        lines.append(projected)
    return {"cluster": asdict(cluster), "restart_loss_s": restart,
            "restart_model": "restart_overhead_s + checkpoint_interval_s / 2 per failure, whole job stopped",
            "mean_pause_s": mean_pause, "loss_ratio": ratio(restart, mean_pause),
            "migrations": [asdict(m) for m in migrations], "lines": [asdict(line) for line in lines]}


def table(rep: dict[str, Any]) -> str:
    """The report as a fixed-width table."""
    c = rep["cluster"]
    head = (f"checkpoint-restart loses {rep['restart_loss_s']:.0f} s per failure (restart "
            f"{c['restart_overhead_s']:.0f} s, {c['restart_source']}; + half of a {c['checkpoint_interval_s']:.0f} s "
            f"interval); TorchPass pause {'-' if rep['mean_pause_s'] is None else format(rep['mean_pause_s'], '.2f')} s")
    rows = [f"{'':<20} {'failures':>10} {'ckpt-restart GPU-h':>19} {'TorchPass GPU-h':>16} {'saved GPU-h':>12} "
            f"{'saved $':>12}"]
    for ln in rep["lines"]:
        rows.append(f"{ln['label']:<20} {ln['failures']:>10.1f} {ln['gpu_hours_checkpoint_restart']:>19.2f} "
                    f"{ln['gpu_hours_torchpass']:>16.3f} {ln['gpu_hours_saved']:>12.2f} {ln['usd_saved']:>12,.2f}")
    return "\n".join([head, *rows])


def chart(rep: dict[str, Any], path: str | Path) -> Path:
    """A PNG: GPU-hours lost per line, checkpoint-restart against TorchPass, with dollars saved."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = rep["lines"]
    fig, axes = plt.subplots(1, len(lines), figsize=(4.5 * len(lines), 4), squeeze=False)
    for ax, ln in zip(axes[0], lines, strict=True):
        values = [ln["gpu_hours_checkpoint_restart"], ln["gpu_hours_torchpass"]]
        bars = ax.bar(["checkpoint-restart", "TorchPass"], values, color=["#c44e52", "#4c72b0"])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_title(f"{ln['label']}: {ln['failures']:.0f} failures\nsaved {ln['gpu_hours_saved']:.1f} GPU-h, "
                     f"${ln['usd_saved']:,.0f}", fontsize=10)
        ax.set_ylabel("GPU-hours lost")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
