"""The ``torchpassctl`` operator CLI: a click group whose commands talk to torchpassd's
control socket (or, for read-only views, to Slurm through slurm_plugin). Every listing
command has ``--json``; exit code 0 only on success, 2 for usage errors."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="TORCHPASS_CONFIG",
              help="Config file (default $TORCHPASS_CONFIG or /etc/torchpass/torchpass.toml).")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """Operate TorchPass: see jobs, nodes and spares, start and review migrations, run drills."""
    ctx.obj = {"config_path": config_path}


from torchpassd import ctl_goodput, ctl_ops, ctl_slurm  # noqa: E402 - commands register on the group defined above

for _command in (*ctl_slurm.COMMANDS, *ctl_ops.COMMANDS, *ctl_goodput.COMMANDS):
    main.add_command(_command)
