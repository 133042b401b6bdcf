"""Choosing the SlurmClient backend from the [slurm] config: ``backend = "auto"`` tries pyslurm
(if it matches the running Slurm), then slurmrestd (if ``rest_url`` is set and answers), then
the commands. The choice and the reasons the others were passed over are logged and kept on the
client (``client.name``, ``client.reason``) so ``torchpassctl`` can show them."""

from __future__ import annotations

from slurm_plugin.backends import pyslurm_backend
from slurm_plugin.backends.commands import CommandClient
from slurm_plugin.backends.rest import RestClient
from slurm_plugin.client import SlurmClient
from slurm_plugin.runner import SlurmRunner
from torchpass_common import log
from torchpass_common.config import SlurmConfig
from torchpass_common.errors import SlurmError


def runner_for(cfg: SlurmConfig) -> SlurmRunner:
    return SlurmRunner(cfg.slurm_conf, cfg.command_timeout)


def _pyslurm(cfg: SlurmConfig, runner: SlurmRunner) -> SlurmClient:
    version = runner.run(["scontrol", "--version"])
    why = pyslurm_backend.unusable_reason(version)
    if why:
        raise SlurmError(why)
    return pyslurm_backend.PyslurmClient()


def _rest(cfg: SlurmConfig, runner: SlurmRunner) -> SlurmClient:
    if not cfg.rest_url:
        raise SlurmError("slurm.rest_url is not set")
    return RestClient(cfg.rest_url, runner, user=cfg.rest_user, timeout=cfg.command_timeout)


def _commands(cfg: SlurmConfig, runner: SlurmRunner) -> SlurmClient:
    return CommandClient(runner)


BACKENDS = {"pyslurm": _pyslurm, "rest": _rest, "commands": _commands}


def open_client(cfg: SlurmConfig) -> SlurmClient:
    """The configured backend, or for ``auto`` the first of pyslurm, rest, commands that works.
    An explicitly configured backend that does not work is a SlurmError, not a fallback."""
    runner = runner_for(cfg)
    names = list(BACKENDS) if cfg.backend == "auto" else [cfg.backend]
    passed_over: list[str] = []
    for name in names:
        try:
            client = BACKENDS[name](cfg, runner)
        except SlurmError as exc:
            if cfg.backend != "auto":
                raise SlurmError(f"slurm backend {name!r} (set in the config) cannot be used: {exc.message}",
                                 hint=exc.hint) from exc
            passed_over.append(f"{name}: {exc.message}")
            continue
        client.reason = ("configured" if cfg.backend != "auto"
                         else "auto: first that works" + (f" ({'; '.join(passed_over)})" if passed_over else ""))
        log.get().info("slurm.backend_selected", backend=client.name, reason=client.reason)
        return client
    raise SlurmError("no Slurm backend works: " + "; ".join(passed_over))  # commands never raises here
