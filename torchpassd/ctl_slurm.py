"""``torchpassctl spares | jobs | nodes``: what the scheduler adapter sees in Slurm right now,
read straight from slurmctld through slurm_plugin (no torchpassd needed). Tables for people,
``--json`` for tools: one document that also names the backend in use."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click

from slurm_plugin import hostlist
from slurm_plugin.client import SlurmClient
from slurm_plugin.connect import open_client
from slurm_plugin.model import Snapshot
from slurm_plugin.spares import spares_of
from torchpass_common import config
from torchpass_common.errors import TorchPassError
from torchpassd.ctl_client import DaemonClient


def _snapshot(ctx: click.Context) -> tuple[config.Config, SlurmClient, Snapshot]:
    try:
        cfg = config.load(ctx.obj.get("config_path") if ctx.obj else None)
        client = open_client(cfg.slurm)
        return cfg, client, client.snapshot()
    except TorchPassError as exc:
        click.echo(f"torchpassctl: {exc}", err=True)
        sys.exit(1)


def _emit(as_json: bool, client: SlurmClient, key: str, rows: list[dict[str, Any]],
          columns: Sequence[str]) -> None:
    if as_json:
        click.echo(json.dumps({"backend": client.name, "backend_reason": client.reason, key: rows}))
        return
    table = [list(columns)] + [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        click.echo(f"(no {key})")


def _listing(key: str, columns: Sequence[str]) -> Callable:
    def wrap(fn: Callable[[config.Config, Snapshot], list[dict[str, Any]]]) -> click.Command:
        @click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
        @click.pass_context
        def command(ctx: click.Context, as_json: bool) -> None:
            cfg, client, snap = _snapshot(ctx)
            _emit(as_json, client, key, fn(cfg, snap), columns)

        command.__doc__ = fn.__doc__
        return click.command(key)(command)
    return wrap


@_listing("spares", ("node", "available", "state", "why"))
def spares(cfg: config.Config, snap: Snapshot) -> list[dict[str, Any]]:
    """Nodes of the spare reservation and whether each can take a migration now."""
    return [dataclasses.asdict(s) for s in spares_of(snap, cfg.slurm.spare_reservation)]


@_listing("jobs", ("job", "user", "state", "mode", "protection", "spares", "nodes", "batch_host", "unplanned"))
def jobs(cfg: config.Config, snap: Snapshot) -> list[dict[str, Any]]:
    """Running TorchPass jobs (submitted with --torchpass), their nodes, which migration protects
    each (from what its workers did: registered save/load or not) and what unplanned recovery can
    do for it as torchpassd knows its layout ("-" when torchpassd does not answer)."""
    rows = []
    seen = _from_daemon(cfg, "jobs", lambda j: (j["job"], j))
    for job in sorted(snap.torchpass_jobs().values(), key=lambda j: j.job_id):
        flags = job.torchpass
        rows.append({"job": job.job_id, "user": job.user, "state": job.state,
                     "mode": flags.mode if flags else "", "protection": seen.get(str(job.job_id), {}).get("protection", "-"),
                     "spares": flags.spares if flags else 0,
                     "nodes": hostlist.compress(job.nodes), "batch_host": job.batch_host,
                     "unplanned": seen.get(str(job.job_id), {}).get("unplanned", "-")})
    return rows


def _from_daemon(cfg: config.Config, op: str, pick: Callable[[Any], tuple[str, Any]]) -> dict[str, Any]:
    """``pick`` over what torchpassd answers to ``op``; {} when it does not answer."""
    try:
        answer = DaemonClient(cfg.orchestrator.control_socket, timeout=2.0).call(op)
    except TorchPassError:
        return {}
    return dict(pick(item) for item in (answer.items() if isinstance(answer, dict) else answer))


@_listing("nodes", ("node", "state", "healthy", "jobs", "gpu", "reason", "reason_by"))
def nodes(cfg: config.Config, snap: Snapshot) -> list[dict[str, Any]]:
    """Every node with its state, health, TorchPass jobs, latest GPU health (from torchpassd, "-"
    when it does not answer) and drain/down reason (a GPU drain names its signal)."""
    gpu = _from_daemon(cfg, "health", lambda item: (item[0], item[1]["summary"]))  # latest GPU health
    on: dict[str, list[int]] = {}
    for job in snap.torchpass_jobs().values():
        for n in job.nodes:
            on.setdefault(n, []).append(job.job_id)
    return [{"node": n.name, "state": n.describe(), "healthy": n.healthy, "jobs": ",".join(map(str, sorted(on.get(n.name, [])))),
             "gpu": gpu.get(n.name, "-"), "reason": n.reason, "reason_by": n.reason_by} for n in sorted(snap.nodes.values(), key=lambda n: n.name)]


COMMANDS = (spares, jobs, nodes)
