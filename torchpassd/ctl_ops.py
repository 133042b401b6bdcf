"""``torchpassctl status | migrate | history | drill``: the commands that go through torchpassd
(its control socket), as opposed to ctl_slurm's read-only Slurm views. Tables for people,
``--json`` for tools (one document on stdout); exit 1 when the daemon refuses or is unreachable."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from torchpass_common import config
from torchpass_common.errors import TorchPassError
from torchpassd import drill as drillmod
from torchpassd.ctl_client import DaemonClient


def _config(ctx: click.Context) -> config.Config:
    try:
        return config.load(ctx.obj.get("config_path") if ctx.obj else None)
    except TorchPassError as exc:
        click.echo(f"torchpassctl: {exc}", err=True)
        sys.exit(1)


def _call(ctx: click.Context, op: str, **args: Any) -> Any:
    cfg = _config(ctx)
    try:
        return DaemonClient(cfg.orchestrator.control_socket).call(op, **args)
    except TorchPassError as exc:
        click.echo(f"torchpassctl: {exc}", err=True)
        sys.exit(1)


def _when(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def _json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")(fn)


@click.command("status")
@_json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """torchpassd's state: backend, broker, tracked jobs with their launchpads, waiting migrations."""
    st = _call(ctx, "status")
    if as_json:
        click.echo(json.dumps(st))
        return
    d = st["daemon"]
    click.echo(f"torchpassd pid {d['pid']}, up {d['uptime_s']}s, Slurm backend {d['slurm_backend']}, "
               f"broker {'connected' if d['broker_connected'] else 'DISCONNECTED'}")
    for job in st["jobs"]:
        click.echo(f"job {job['job']} ({job['user']}, {job['mode']}) on {','.join(job['nodes'])}; "
                   f"{job['protection']}; {job['unplanned']}"
                   + (f"  BLOCKED: {job['blocked']}" if job["blocked"] else ""))
        for node, lp in job["launchpads"].items():
            ranks = ", ".join(f"rank {w['rank']} step {w['step']} {w['state']}" for w in lp["workers"])
            ranks = ranks or ("hot spare (no rank; takes a lost node's)" if lp.get("hot_spare") else "")
            click.echo(f"  {node:<10} {'online' if lp['online'] else 'offline':<8} gen {lp['gen']:<3} "
                       f"hb {lp['heartbeat_age']}s  {ranks}" + (f"  standby {lp['standby']}" if lp.get("standby") else ""))
    for p in st["pending"]:
        click.echo(f"wanted: move job {p['job']} off {p['node']} ({p['reason']}) since {_when(p['since'])}")
    for dead in st.get("dead", []):  # unplanned: nodes found dead whose recovery has not started
        click.echo(f"dead: {dead['node']} of job {dead['job']} (ranks {dead['ranks']}): {'; '.join(dead['evidence'])}"
                   + (f"  WAITING: {dead['waiting']}" if dead["waiting"] else ""))
    if st["in_flight"]:
        click.echo(f"in flight: {', '.join(st['in_flight'])}")


@click.command("migrate")
@click.option("--job", required=True, help="Slurm job id.")
@click.option("--node", required=True, help="Node whose ranks should move to a spare.")
@_json_option
@click.pass_context
def migrate(ctx: click.Context, job: str, node: str, as_json: bool) -> None:
    """Move a node's ranks to a spare now (planned migration, e.g. off a straggler)."""
    res = _call(ctx, "migrate", job=job, node=node)
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"migration of job {job} off {node} queued" + (f"; blocked: {res['blocked']}" if res["blocked"] else ""))


@click.command("history")
@click.option("--job", default=None, help="Only this job's migrations.")
@click.option("--limit", default=20, show_default=True, help="Most recent N migrations.")
@_json_option
@click.pass_context
def history(ctx: click.Context, job: str | None, limit: int, as_json: bool) -> None:
    """Past and running migrations with their phase timings."""
    recs = _call(ctx, "history", **({"job": job} if job else {}), limit=limit)
    if as_json:
        click.echo(json.dumps({"migrations": recs}))
        return
    if not recs:
        click.echo("(no migrations)")
    for m in recs:
        took = f"{m['ended'] - m['started']:.2f}s" if m["ended"] else "running"
        click.echo(f"{_when(m['started'])} job {m['job_id']} {m['source']} -> {m['target'] or '?'} {m['mode']} "
                   f"{m['status']} ({took}) {m['id'][:8]}" + (f": {m['error']}" if m["error"] else ""))
        for p in m["phases"]:
            click.echo(f"    {p['phase']:<13} {p['status']:<11} +{p['seconds']:.3f}s")


@click.command("drill")
@click.option("--mode", type=click.Choice(drillmod.MODES), default="planned-aware", show_default=True)
@click.option("--steps", default=drillmod.DrillSettings.steps, show_default=True, help="Training steps.")
@click.option("--nodes", default=drillmod.DrillSettings.nodes, show_default=True, help="Nodes of the job.")
@click.option("--nproc-per-node", "nproc", default=drillmod.DrillSettings.nproc, show_default=True,
              help="Workers a node (torchrun's --nproc-per-node); all of the failed node's ranks move.")
@click.option("--step-sleep", default=drillmod.DrillSettings.step_sleep, show_default=True,
              help="Extra seconds per step (simulated compute), so the job outlasts the migration.")
@click.option("--timeout", default=drillmod.DrillSettings.timeout, show_default=True, help="Seconds per wait.")
@click.option("--victim", default=0, show_default=True,
              help="Which node fails: the job's Nth node besides its batch host (1-based); 0: the last.")
@click.option("--hot-spares", default=0, show_default=True,
              help="Submit with --torchpass-spares=N: N more nodes, warm, in the job's own allocation.")
@click.option("--launcher", type=click.Choice(drillmod.LAUNCHERS), default=drillmod.LAUNCHERS[0], show_default=True,
              help="How the job script starts the ranks: srun torchrun, or srun python one task a rank.")
@_json_option
@click.pass_context
def drill(ctx: click.Context, mode: str, steps: int, nodes: int, nproc: int, step_sleep: float, timeout: float,
          victim: int, hot_spares: int, launcher: str, as_json: bool) -> None:
    """Validate the installation: run the example job, make one of its nodes fail, and check the
    job went on with nothing lost, bit-identical to a run without a failure, and ended COMPLETED.

    \b
    planned-aware        drain a node; its rank's registered state moves to a spare
    planned-transparent  drain a node under a script with no TorchPass code; criu moves the process
    gpu-degrade          replayed GPU telemetry (ECC, then XID 79) makes torchpassd drain a node
    unplanned            kill -9 a node; its rank is rebuilt from a replica, the step replayed
    unplanned-cut        cut a node's network instead of killing it"""
    cfg = _config(ctx)
    settings = drillmod.DrillSettings(nodes=nodes, nproc=nproc, steps=steps, step_sleep=step_sleep, timeout=timeout,
                                      victim=victim, hot_spares=hot_spares, launcher=launcher)
    try:
        rep = drillmod.run(cfg, mode, settings, say=(lambda _: None) if as_json else click.echo)
    except TorchPassError as exc:
        click.echo(f"torchpassctl: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(rep) if as_json else drill_summary(rep))
    sys.exit(0 if rep["ok"] else 1)


_DRILL_KEYS = ("ok", "mode", "job_id", "migrated_from", "migrated_to", "moved_ranks", "detect_s", "pause_s",
               "resumed_at_step", "expected_step", "lost_steps", "bit_identical", "job_state")
_DRILL_IF_SET = ("fault", "drain_reason", "error")  # only some modes, or only a failed drill, have these


def drill_summary(rep: dict[str, Any]) -> str:
    """The drill report as aligned ``key: value`` lines; mode-specific fields and the error only when set."""
    keys = [*_DRILL_KEYS, *(k for k in _DRILL_IF_SET if rep.get(k))]
    return "\n".join(f"{k:>16}: {rep[k]}" for k in keys)


COMMANDS = (status, migrate, history, drill)
