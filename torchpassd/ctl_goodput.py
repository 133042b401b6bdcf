"""``torchpassctl goodput``: GPU-hours and dollars TorchPass saved against checkpoint-restart, from
the journal's migrations (read directly, so it works with torchpassd stopped) and a cluster
description (contrib/goodput/cluster.toml); a table or ``--json``, and a PNG chart. With
``--advise-spares``: how many spares to hold (spare_sizing.py), and its chart."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from torchpass_common.errors import TorchPassError
from torchpassd import goodput, spare_sizing
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
@click.option("--advise-spares", is_flag=True,
              help="Also say how many spare nodes to hold (and chart goodput against spares held).")
@click.option("--target", default=0.999, show_default=True, type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="With --advise-spares: the chance that a failure finds a free spare.")
@click.pass_context
def goodput_cmd(ctx: click.Context, cluster_path: str, journal_path: str | None, png_path: str,
                as_json: bool, advise_spares: bool, target: float) -> None:
    """GPU-hours and dollars saved by the journal's migrations, and projected per year, against
    checkpoint-restart (restart overhead + half a checkpoint interval lost per failure). With
    --advise-spares, the spares to hold: failures from the journal (or the description), each
    failed node away for the description's repair_hours (the model: README, Operating it)."""
    path = Path(journal_path) if journal_path else Path(_config(ctx).orchestrator.state_dir) / "journal.sqlite"
    try:
        cluster = goodput.Cluster.load(cluster_path)
        if not path.exists():
            raise jn.JournalError(f"no journal at {path}",
                                  hint="pass --journal, or the --config of the torchpassd that wrote it")
        with jn.Journal(path) as journal:
            migrations, statuses = goodput.migrations_from(journal)
            exposure = spare_sizing.exposure_from(journal, time.time()) if advise_spares else None
        rep = goodput.report(cluster, migrations)
        rep["statuses"] = statuses
        rep["chart"] = str(goodput.chart(rep, png_path))
        if advise_spares:
            rep["spares"] = spare_sizing.advise(cluster, exposure, target, rep["mean_pause_s"])
            png = Path(png_path)
            rep["spares"]["chart"] = str(spare_sizing.chart(rep["spares"], png.with_name(f"{png.stem}-spares{png.suffix}")))
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
    if advise_spares:
        click.echo(spare_sizing.table(rep["spares"]))
        click.echo(f"chart: {rep['spares']['chart']}")


COMMANDS = (goodput_cmd,)
