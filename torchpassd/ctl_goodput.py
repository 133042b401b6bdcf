"""``torchpassctl goodput``: GPU-hours and dollars TorchPass saved against checkpoint-restart, from
the journal's migrations (read directly, so it works with torchpassd stopped) and a cluster
description (contrib/goodput/cluster.toml); a table or ``--json``, and a PNG chart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from torchpass_common.errors import TorchPassError
from torchpassd import goodput
from torchpassd import journal as jn
from torchpassd.ctl_ops import _config


@click.command("goodput")
@click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="Cluster description (TOML or JSON), e.g. contrib/goodput/cluster.toml.")
@click.option("--journal", "journal_path", type=click.Path(dir_okay=False),
              help="torchpassd's journal (default: orchestrator.state_dir/journal.sqlite of the config).")
@click.option("--png", "png_path", default="goodput.png", show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the chart.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.pass_context
def goodput_cmd(ctx: click.Context, cluster_path: str, journal_path: str | None, png_path: str,
                as_json: bool) -> None:
    """GPU-hours and dollars saved by the journal's migrations, and projected per year, against
    checkpoint-restart (restart overhead + half a checkpoint interval lost per failure)."""
    path = Path(journal_path) if journal_path else Path(_config(ctx).orchestrator.state_dir) / "journal.sqlite"
    try:
        cluster = goodput.Cluster.load(cluster_path)
        if not path.exists():
            raise jn.JournalError(f"no journal at {path}",
                                  hint="pass --journal, or the --config of the torchpassd that wrote it")
        with jn.Journal(path) as journal:
            migrations, statuses = goodput.migrations_from(journal)
        rep = goodput.report(cluster, migrations)
        rep["statuses"] = statuses
        rep["chart"] = str(goodput.chart(rep, png_path))
    except TorchPassError as exc:
        click.echo(f"torchpassctl: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(rep))
        return
    click.echo(goodput.table(rep))
    others = {k: v for k, v in statuses.items() if k != jn.SUCCEEDED}
    if others:
        click.echo("not counted: " + ", ".join(f"{v} {k}" for k, v in sorted(others.items())))
    click.echo(f"chart: {rep['chart']}")


COMMANDS = (goodput_cmd,)
