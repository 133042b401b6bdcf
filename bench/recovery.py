"""TorchPass against checkpoint-restart, measured in one run on the dev cluster
($TORCHPASS_DEVCLUSTER_ID): the raw link throughput between two nodes (bench/wormhole.py's raw
baseline), the checkpoint-restart baseline (bench/_restart.py), the time TorchPass loses per failure
in each drill mode (torchpassctl drill's code, against a torchpassd started here), the pause against
state size (the example's --state-mib) versus the transfer floor (the raw link throughput measured
again right before each size's drills: on this VM it wanders by a third within a run), the steady-state overhead
(bench/overhead.py) and the orchestrator at 1,152 simulated nodes (bench/scale.py). Prints JSON
(--json), writes recovery.json, recovery.md and recovery.png (pause vs state size) to --outdir."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torchpassd.goodput import checkpoint_restart_loss_s, ratio

ROOT = Path(__file__).resolve().parent.parent
MODES = ("planned-aware", "planned-transparent", "unplanned")
GOAL_RATIO, GOAL_FLOOR_FACTOR, GOAL_FLOOR_PLUS_S, GOAL_OVERHEAD, GOAL_DECISION_MS = 20.0, 1.2, 0.3, 1.01, 100.0
GOAL_UNPLANNED_S = 3.0  # unplanned time lost beyond the transfer floor, wherever the victim sits
MEMORY_MARGIN = 0.7  # use at most this share of MemAvailable for one state-size run


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def size_fits(mib: int, ranks: int, available: int) -> str:
    """"" when a state of ``mib`` per rank fits in memory for a drill of ``ranks`` ranks (each rank
    and the joiner hold it; the joiner receives into its own tensors), else why not."""
    need = mib * 2**20 * (ranks + 1)
    if need > MEMORY_MARGIN * available:
        return (f"skipped: {ranks} ranks + joiner need {need / 2**30:.1f} GiB, more than "
                f"{MEMORY_MARGIN:.0%} of the {available / 2**30:.1f} GiB available on this shared machine")
    return ""


def time_lost(report: dict[str, Any], step_s: float) -> float | None:
    """Wall time a drill's job lost to the failure, plus any step that had to be redone. Planned:
    the pause (the job trains until then). Unplanned: from the kill (the survivors stall in their
    collective at once) to the resume: detect_s + the phases up to ``resumed``."""
    if report.get("pause_s") is None:
        return None
    lost = report["pause_s"]
    if str(report.get("mode", "")).startswith("unplanned") and report.get("detect_s") is not None:
        phases = report.get("timeline") or []
        upto = next((i for i, p in enumerate(phases) if p["phase"] == "resumed"), None)
        if upto is not None:
            lost = report["detect_s"] + sum(p["seconds"] for p in phases[1:upto + 1])
    return lost + max(0, report.get("lost_steps") or 0) * step_s


def median_sample(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The drill report of median pause among ``reports`` (the lower middle one of an even count),
    with every sample's pause in ``samples_pause_s``; a failed drill (no pause) is never the median
    when one succeeded, and the failures are counted in ``failed_samples``."""
    done = sorted((r for r in reports if r.get("pause_s") is not None), key=lambda r: r["pause_s"])
    if not done:
        return reports[0]
    pick = dict(done[(len(done) - 1) // 2])
    pick["samples_pause_s"] = [r.get("pause_s") for r in reports]
    pick["failed_samples"] = len(reports) - len(done)
    return pick


def summarise(raw: dict[str, Any], interval_s: float = 600.0) -> dict[str, Any]:
    """The headline figures from the measured parts in ``raw`` (keys baseline, modes, sizes,
    link_gbps, overhead, scale); anything not measured stays None with the reason alongside."""
    base = raw.get("baseline") or {}
    restart = (checkpoint_restart_loss_s(base["restart_overhead_s"], interval_s)
               if "restart_overhead_s" in base else None)
    out: dict[str, Any] = {
        "checkpoint_restart_model": {
            "expected_loss_s": restart, "checkpoint_interval_s": interval_s,
            "restart_overhead_s": base.get("restart_overhead_s"),
            "formula": "restart_overhead_s + checkpoint_interval_s / 2 (failure uniform in the interval; "
                       "checkpoint save cost not counted)"},
        "restart_over_pause": {}, "restart_over_pause_measured": {}, "pause_over_floor": {},
    }
    for mode, rep in raw.get("modes", {}).items():
        lost = rep["time_lost_s"] = time_lost(rep, base.get("step_s", 0.0))
        out["restart_over_pause"][mode] = _round(ratio(restart, lost)) if lost else rep.get("not_available")
        out["restart_over_pause_measured"][mode] = _round(ratio(base.get("time_lost_s"), lost)) if lost else None
    for label, rep in raw.get("sizes", {}).items():
        gbps = rep.get("link_gbps") or raw.get("link_gbps")  # the floor measured right before its drills
        if rep.get("pause_s") is None or not gbps:
            out["pause_over_floor"][label] = rep.get("not_available") or rep.get("error")
            continue
        floor = rep["bytes"] / (gbps * 1e9)
        rep["floor_s"] = round(floor, 3)
        rep["within_goal"] = rep["pause_s"] <= GOAL_FLOOR_FACTOR * floor + GOAL_FLOOR_PLUS_S
        out["pause_over_floor"][label] = _round(rep["pause_s"] / floor)
    over = raw.get("overhead") or {}
    out["overhead_ratio"] = over.get("ratio")
    out["overhead_component_ratio"] = over.get("component_ratio")  # 1 + TorchPass's added time / step
    out["decision_latency_ms"] = (raw.get("scale") or {}).get("decision_latency_ms")
    out["unplanned_by_position"] = {v: {"time_lost_s": _round(time_lost(rep, base.get("step_s", 0.0))),
                                        "detect_s": rep.get("detect_s"), "note": rep.get("not_available")}
                                    for v, rep in (raw.get("positions") or {}).items()}
    return out


def _round(v: float | None, digits: int = 2) -> float | None:
    return None if v is None else round(v, digits)


def markdown(res: dict[str, Any]) -> str:
    """The short table of the results."""
    m = res["checkpoint_restart_model"]
    rows = ["| measure | value | goal |", "|---|---|---|",
            f"| checkpoint-restart loss per failure, {m['checkpoint_interval_s']:.0f} s interval | "
            f"{_fmt(m['expected_loss_s'])} s (restart {_fmt(m['restart_overhead_s'])} s + interval/2) | |"]
    for mode, value in res["restart_over_pause"].items():
        lost = res["raw"]["modes"][mode].get("time_lost_s")
        rows.append(f"| restart_over_pause {mode} | {_fmt(value)}" + (f" (TorchPass loses {lost:.2f} s)" if lost else "")
                    + f" | >= {GOAL_RATIO:.0f} |")
    for label, value in res["pause_over_floor"].items():
        rep = res["raw"]["sizes"][label]
        samples = rep.get("samples_pause_s") or []
        median = f"median of {len(samples)}: " if len(samples) > 1 else ""
        link = f" at {rep['link_gbps']:.2f} GB/s" if rep.get("link_gbps") else ""
        detail = (f" ({median}pause {rep['pause_s']:.2f} s, floor {rep['floor_s']:.2f} s{link})" if "floor_s" in rep else "")
        rows.append(f"| pause_over_floor {label} | {_fmt(value)}{detail} | pause <= {GOAL_FLOOR_FACTOR:g} x floor + "
                    f"{GOAL_FLOOR_PLUS_S:g} s |")
    over = res["raw"].get("overhead") or {}
    spread = (f" (rounds {over['ratio_range'][0]:.3g}..{over['ratio_range'][1]:.3g}; agent CPU "
              f"{over['launchpad_agent_cpu_pct']}% of a core, torchrun's {over['torchrun_agent_cpu_pct']}%)"
              if "ratio_range" in over else "")
    rows.append(f"| overhead_ratio | {_fmt(res['overhead_ratio'])}{spread} | < 1.01 |")
    if "added_us_per_step" in over:
        rows.append(f"| overhead_component_ratio | {over['component_ratio']} (TorchPass adds "
                    f"{over['added_us_per_step']} us to a {over['torchrun_step_ms']:.3g} ms step) | < 1.01 |")
    rows.append(f"| decision_latency_ms at {res['raw'].get('scale', {}).get('nodes', '?')} nodes | "
                f"{_fmt(res['decision_latency_ms'])} | < 100 |")
    timeout = res["raw"].get("collective_timeout_s")
    hot = res["raw"].get("positions_hot_spares", 0)
    taker = f"the job's hot spare (--torchpass-spares={hot})" if hot else "a spare from the pool"
    for v, pos in res.get("unplanned_by_position", {}).items():
        value = (f"{_fmt(pos['time_lost_s'])} s (detected in {_fmt(pos['detect_s'])} s; collective timeout "
                 f"{_fmt(timeout)} s)" if pos["time_lost_s"] is not None else str(pos["note"]))
        rows.append(f"| unplanned time lost, node {v} of the job killed, {taker} takes its ranks | {value} | "
                    f"<= {GOAL_UNPLANNED_S:g} s + transfer floor |")
    return "\n".join(rows) + "\n"


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def plot(res: dict[str, Any], path: Path) -> Path:
    """PNG: measured pause against state size per rank, with the transfer floor and the goal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((r["bytes"] / 2**30, r["pause_s"], r.get("floor_s")) for r in res["raw"].get("sizes", {}).values()
                 if r.get("pause_s") is not None)
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="TorchPass pause (planned-aware)")
    floors = [(p[0], p[2]) for p in pts if p[2] is not None]
    if floors:
        xs, floor = [f[0] for f in floors], [f[1] for f in floors]
        ax.plot(xs, floor, "--", label="transfer floor (raw TCP n1 -> n2, measured before each size)")
        ax.plot(xs, [GOAL_FLOOR_FACTOR * f + GOAL_FLOOR_PLUS_S for f in floor], ":", label=f"goal: {GOAL_FLOOR_FACTOR:g} x floor + {GOAL_FLOOR_PLUS_S:g} s")
    ax.set_xlabel("state per rank (GiB)")
    ax.set_ylabel("seconds")
    ax.set_title("Pause vs state size (dev cluster)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class DrillDaemon:
    """torchpassd for the dev cluster, started and stopped by PID, its files in ``workdir``; the
    torchpassd of ``bindir`` (default: this interpreter's) with ``env`` over the cluster's."""

    def __init__(self, cluster: Any, workdir: Path, bindir: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        from torchpass_common import config
        from torchpassd.ctl_client import DaemonClient

        path = workdir / "torchpass.toml"
        path.write_text(config.derive(Path(cluster.info["torchpass_config"]).read_text(), {
            "slurm": {"slurm_conf": str(cluster.slurm_conf), "backend": "commands", "poll_interval": 0.5},
            "orchestrator": {"state_dir": str(workdir / "state"), "control_socket": str(workdir / "tpd.sock")}}))
        self.cfg = config.load(str(path))
        self.client = DaemonClient(workdir / "tpd.sock", timeout=30)
        with open(workdir / "torchpassd.log", "ab") as out:
            self.proc = subprocess.Popen([str((bindir or Path(sys.executable).parent) / "torchpassd"), "--config",
                                          str(path)], stdout=out, stderr=subprocess.STDOUT,
                                         env={**cluster.slurm_env, **(env or {})}, cwd=workdir)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"torchpassd did not start; see {workdir / 'torchpassd.log'}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        from torchpass_common.errors import TorchPassError
        try:
            self.client.call("status")
        except TorchPassError:
            return False
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _drill(cluster: Any, work: Path, mode: str, nodes: int, state_mib: int = 0, nproc: int = 1,
           victim: int = 0, hot_spares: int = 0) -> dict[str, Any]:
    """One drill through torchpassctl drill's code, against a torchpassd of its own (one journal for
    all: torchpassd's spare pool still counts a spare used by an ended job's migration as taken, so
    a second drill in one daemon would wait for a spare); its report plus the hand-over's bytes."""
    from torchpass_common.errors import TorchPassError
    from torchpassd import drill as drillmod

    if mode not in drillmod.MODES:
        return {"not_available": f"not available: this build's torchpassctl drill has no mode {mode!r} "
                                 f"(it has {', '.join(drillmod.MODES)})"}
    settings = drillmod.DrillSettings(nodes=nodes, nproc=nproc, state_mib=state_mib, timeout=300.0, victim=victim,
                                      hot_spares=hot_spares)
    _say(f"[recovery] drill {mode}, {nproc} rank(s) a node" +
         (f", {state_mib} MiB extra state per rank" if state_mib else ""))
    daemon = DrillDaemon(cluster, work)
    try:
        rep = drillmod.run(daemon.cfg, mode, settings, say=_say)
        for m in daemon.client.call("history", job=rep["job_id"]) if rep.get("job_id") else []:
            for p in m["phases"]:
                if p["phase"] == "handed_over" and p["detail"].get("bytes"):
                    rep["bytes"], rep["transfer_s"] = p["detail"]["bytes"], p["detail"].get("transfer_s")
    except TorchPassError as exc:
        rep = {"ok": False, "error": str(exc)}
    finally:
        daemon.stop()
        cluster.reset()
    if rep.get("pause_s") is None:
        rep["not_available"] = f"not available: the {mode} drill measured no pause ({rep.get('error')})"
    return rep


def _part(raw: dict[str, Any], key: str, what: str, fn: Any) -> None:
    """Measure one part into ``raw[key]``; a failure is recorded (with why), never replaced by a number."""
    _say(f"[recovery] {what}")
    try:
        raw[key] = fn()
    except Exception as exc:  # a failed part must not cost the others
        raw[key] = {"error": f"{type(exc).__name__}: {exc}"}
        _say(f"[recovery] {what} FAILED: {exc}")


def prepare_cluster(bench: str, nodes: int = 3) -> tuple[Any, Path]:
    """The dev cluster ($TORCHPASS_DEVCLUSTER_ID) up with room for a job of ``nodes`` nodes, one
    more unreserved node (where the checkpoint-restart baseline's requeued job restarts after a node
    was killed) and its reserved spare (brought up again, larger, when it has fewer), reset, the
    SPANK plugin built, and a fresh work directory for benchmark ``bench`` under its jobs directory."""
    from tests.support.devcluster import DevCluster, instance_id_from_env

    cluster = DevCluster(instance_id_from_env())
    cluster.nodes = max(cluster.nodes, nodes + 1 + cluster.spares)
    info = cluster.info
    workers = sum(not n["spare"] for n in info.get("nodes", []))
    if not info.get("up") or workers < nodes + 1:
        _say(f"[{bench}] bringing dev cluster {cluster.id} up with {cluster.nodes} nodes "
             f"({cluster.spares} spare) for a {nodes}-node job")
        cluster.up()
    cluster.reset()
    subprocess.run(["make", "-s", "-C", str(ROOT / "spank")], check=True, timeout=120)  # sbatch --torchpass
    work = cluster.jobs_dir / f"bench-{bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(mode=0o755)
    return cluster, work


PARTS = ("wormhole", "baseline", "modes", "positions", "sizes", "overhead", "scale")


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Measure ``a.parts``; with ``a.keep`` (a recovery.json) the other parts are that run's."""
    from bench import _restart, overhead, scale, wormhole
    from torchpass_common.config import WormholeConfig

    parts = set(a.parts.split(","))
    cluster, work = prepare_cluster("recovery", a.nodes + a.hot_spares)
    raw: dict[str, Any] = json.loads(Path(a.keep).read_text())["raw"] if a.keep else {}
    raw.update({"devcluster": cluster.id, "nodes": a.nodes, "size_nodes": a.size_nodes})
    if "positions" in parts:
        raw["positions_hot_spares"] = a.hot_spares
    streams = WormholeConfig().streams

    def link() -> dict[str, Any]:
        return wormhole.main(["--devcluster", "--gib", str(a.link_gib), "--reps", "5", "--streams", str(streams)])

    if "wormhole" in parts:
        _part(raw, "wormhole", "raw TCP throughput n1 -> n2 (bench/wormhole.py raw baseline)", link)
        raw["link_gbps"] = raw["wormhole"].get(f"raw_s{streams}_gbps")
    if "baseline" in parts:
        _part(raw, "baseline", f"checkpoint-restart baseline ({a.nodes} nodes)", lambda: _restart.run(
            cluster, work / "baseline", nodes=a.nodes, every=a.checkpoint_every, say=_say))
        cluster.reset()
    if "modes" in parts:
        raw["modes"] = {mode: _drill(cluster, work, mode, a.nodes) for mode in a.modes.split(",")}
    if "positions" in parts:  # unplanned, each node but the batch host killed in turn: far from the ring's break too
        from torchpass_common import config
        raw["collective_timeout_s"] = config.load(cluster.info["torchpass_config"]).timeouts.collective
        raw["positions"] = {str(v): _drill(cluster, work, "unplanned", a.nodes, victim=v, hot_spares=a.hot_spares)
                            for v in range(1, a.nodes)}
    if "sizes" in parts:
        raw["sizes"] = {}
        aware = raw.get("modes", {}).get("planned-aware", {})
        if aware.get("pause_s") is not None:
            raw["sizes"]["model only"] = aware
        for mib in [int(x) for x in a.sizes_mib.split(",") if x]:
            label = f"{mib / 1024:g} GiB"
            why = size_fits(mib, a.size_nodes, mem_available())
            if why:
                raw["sizes"][label] = {"not_available": why}
                continue
            # this VM's link speed wanders by a third within a run: the floor is measured next to the drills
            floor = {}
            _part(floor, "link", f"raw TCP throughput n1 -> n2 before the {label} drills", link)
            raw["sizes"][label] = median_sample(
                [_drill(cluster, work, "planned-aware", a.size_nodes, mib) for _ in range(a.size_reps)])
            raw["sizes"][label]["link_gbps"] = floor["link"].get(f"raw_s{streams}_gbps")
    raw["journal"] = str(work / "state" / "journal.sqlite")  # torchpassctl goodput --journal
    if "overhead" in parts:
        _part(raw, "overhead", "steady-state overhead (bench/overhead.py)",
              lambda: overhead.main(["--rounds", str(a.overhead_rounds)]))
    if "scale" in parts:
        _part(raw, "scale", "orchestrator at scale (bench/scale.py)", lambda: scale.main(["--racks", str(a.racks)]))
    return raw


def main(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench recovery")
    p.add_argument("--nodes", type=int, default=3, help="nodes of the example job (default 3)")
    p.add_argument("--modes", default=",".join(MODES), help="drill modes to measure")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="what to measure (default all: " + ", ".join(PARTS) + "; positions: unplanned time lost "
                        "for every victim position, each node but the batch host)")
    p.add_argument("--hot-spares", type=int, default=1,
                   help="positions: the job's hot spares (--torchpass-spares; 0: the pool's spare takes the ranks)")
    p.add_argument("--keep", help="a recovery.json whose parts not measured now are kept (e.g. --parts positions)")
    p.add_argument("--sizes-mib", default="256,1024,2048,4096",
                   help="extra state per rank for pause vs size (MiB; a size that does not fit in memory is skipped)")
    p.add_argument("--size-reps", type=int, default=1,
                   help="drills per state size; the one of median pause is reported, with every sample's pause")
    p.add_argument("--size-nodes", type=int, default=2,
                   help="nodes of the job for pause vs size (default 2: the state of every rank must fit in memory)")
    p.add_argument("--checkpoint-every", type=int, default=25, help="baseline checkpoint interval in steps")
    p.add_argument("--interval-s", type=float, default=600.0, help="checkpoint interval to extrapolate to (s)")
    p.add_argument("--link-gib", type=float, default=1.0, help="bytes for the raw link measurement (GiB)")
    p.add_argument("--overhead-rounds", type=int, default=10)
    p.add_argument("--racks", type=int, default=64, help="racks of 18 trays in the scale simulation")
    p.add_argument("--outdir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--from-json", help="re-summarise a recovery.json instead of measuring")
    p.add_argument("--markdown", action="store_true", help="print the Markdown table to stderr too")
    a = p.parse_args(argv)
    raw = json.loads(Path(a.from_json).read_text())["raw"] if a.from_json else run(a)
    res = {**summarise(raw, a.interval_s), "raw": raw}
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps(res, indent=1))
    table = markdown(res)
    (out / "recovery.md").write_text(table)
    res["plot"] = str(plot(res, out / "recovery.png"))
    res["markdown"] = str(out / "recovery.md")
    if a.markdown or "--json" not in sys.argv:
        _say(table)
    return res
