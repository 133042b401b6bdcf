"""Running Slurm's command-line tools: every call has a timeout, runs with the configured
SLURM_CONF, optionally as another user (runuser, when we are root), and turns a failure into a
SlurmError that carries Slurm's own message. Nothing outside slurm_plugin spawns Slurm commands."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence

from torchpass_common import log
from torchpass_common.errors import SlurmError


class SlurmRunner:
    """Runs ``scontrol``, ``salloc``, ``srun``... against one cluster (``slurm_conf``: its
    slurm.conf, empty for the system default) with ``timeout`` seconds per call."""

    def __init__(self, slurm_conf: str = "", timeout: float = 30.0) -> None:
        self.slurm_conf = slurm_conf
        self.timeout = timeout

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a Slurm client: ours, plus SLURM_CONF and ``extra``."""
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        env.update(extra or {})
        return env

    def argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        """``argv``, wrapped in ``runuser`` when it must run as ``user`` and we are root."""
        if user and os.geteuid() == 0 and user != "root":
            keep = f"SLURM_CONF={self.slurm_conf}" if self.slurm_conf else "SLURM_CONF="
            return ["runuser", "-u", user, "--", "env", keep, *argv]
        return list(argv)

    def run(self, argv: Sequence[str], *, user: str | None = None, timeout: float | None = None,
            extra_env: Mapping[str, str] | None = None, cwd: str | None = None, with_stderr: bool = False,
            **where: object) -> str:
        """Run a command and return its stdout (and stderr after it, ``with_stderr``). Raises SlurmError (with Slurm's stderr, and the
        ``where`` keys such as job= or node=) on a non-zero exit, a timeout or a missing binary."""
        full = self.argv(argv, user=user)
        limit = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        try:
            proc = subprocess.run(full, capture_output=True, text=True, timeout=limit,
                                  env=self.env(extra_env), cwd=cwd, check=False)
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"`{' '.join(argv)}` did not finish within {limit:.0f} s",
                             hint="is slurmctld up and reachable? (`scontrol ping`)", **where) from exc
        except FileNotFoundError as exc:
            raise SlurmError(f"cannot run `{argv[0]}`: {exc.strerror}",
                             hint="install the Slurm client commands on this host", **where) from exc
        log.get().debug("slurm.command", argv=list(argv), rc=proc.returncode,
                        seconds=round(time.monotonic() - t0, 4))
        if proc.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed (rc={proc.returncode}): {slurm_message(proc)}",
                             **where)
        return proc.stdout + (proc.stderr if with_stderr else "")

    def popen(self, argv: Sequence[str], *, user: str | None = None,
              extra_env: Mapping[str, str] | None = None, **kwargs: object) -> subprocess.Popen:
        """Start a long-running command (a job step) and return its process; the caller owns it."""
        return subprocess.Popen(self.argv(argv, user=user), env=self.env(extra_env), **kwargs)  # type: ignore[call-overload]


def slurm_message(proc: subprocess.CompletedProcess) -> str:
    """Slurm's own words from a failed command: its stderr (or stdout), on one line."""
    text = (proc.stderr or proc.stdout or "").strip()
    return " / ".join(line.strip() for line in text.splitlines() if line.strip()) or "no message"
