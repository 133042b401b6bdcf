"""The ``torchpassd`` command line: load and check the config, then run the orchestrator."""

from __future__ import annotations

import sys

import click

from torchpass_common import config, log
from torchpass_common.errors import TorchPassError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help=f"Config file (default ${config.ENV_VAR} or {config.DEFAULT_PATH}).")
@click.option("--check-config", is_flag=True, help="Load and validate the config, print it, and exit.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(config_path: str | None, check_config: bool, log_level: str) -> None:
    """TorchPass orchestrator daemon.

    Watches Slurm for drained and failed nodes of jobs run with ``sbatch --torchpass``, picks a
    spare, and drives the migration of the affected ranks through the launchpads over MQTT.
    Runs under systemd (contrib/systemd/torchpassd.service); talk to it with torchpassctl.
    """
    log.setup(log_level)
    try:
        cfg = config.load(config_path)
    except TorchPassError as exc:
        click.echo(f"torchpassd: {exc}", err=True)
        sys.exit(2)
    if check_config:
        click.echo(f"config OK ({cfg.source or 'built-in defaults'})")
        click.echo(repr(cfg))
        return
    from torchpassd.daemon import run  # imported late: the daemon pulls in asyncio machinery

    sys.exit(run(cfg))
