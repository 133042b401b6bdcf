"""Facts about the host the dev cluster runs on, detected rather than assumed: Debian release,
Slurm version (22.05 on Debian 12, 24.11 on Debian 13), Slurm's plugin directory (Debian
multiarch path), the short hostname slurmctld must match, and the tools we need."""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import DevClusterError

REQUIRED_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "slurmdbd", "mariadbd",
                  "mariadb-install-db", "mariadb", "mosquitto", "openssl", "ip", "nsenter", "unshare",
                  "sinfo", "scontrol", "sbatch", "scancel")
INSTALL_HINT = "run `make setup` (contrib/install/install-deps.sh) as root"


@dataclass(frozen=True)
class HostInfo:
    debian: str
    slurm_version: tuple[int, int]
    plugin_dir: str
    hostname: str
    slurm_user: str

    @property
    def slurm_release(self) -> str:
        major, minor = self.slurm_version
        return f"{major}.{minor:02d}"

    @property
    def needs_cgroup_conf(self) -> bool:
        """Slurm >= 24.05 loads a cgroup plugin in slurmd unless cgroup.conf says disabled."""
        return self.slurm_version >= (24, 5)

    @property
    def has_jwt(self) -> bool:
        return Path(self.plugin_dir, "auth_jwt.so").exists()

    @property
    def has_cli_filter_lua(self) -> bool:
        return Path(self.plugin_dir, "cli_filter_lua.so").exists()

    @property
    def has_switch_none(self) -> bool:
        return Path(self.plugin_dir, "switch_none.so").exists()


def tool(name: str) -> str:
    """Absolute path of a required program (sbin included, which root's PATH may lack)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not found:
        raise DevClusterError(f"required program {name!r} is not installed", hint=INSTALL_HINT)
    return found


def slurm_version() -> tuple[int, int]:
    out = subprocess.run([tool("slurmctld"), "-V"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m:
        raise DevClusterError(f"cannot parse the Slurm version from `slurmctld -V`: {out!r}")
    return int(m.group(1)), int(m.group(2))


def plugin_dir() -> str:
    """Where this Slurm build keeps its plugins (found by its select_cons_tres plugin)."""
    patterns = ["/usr/lib/*/slurm-wlm", "/usr/lib/slurm-wlm", "/usr/lib64/slurm", "/usr/lib/slurm"]
    for pattern in patterns:
        for cand in sorted(glob.glob(pattern)):
            if os.path.exists(os.path.join(cand, "select_cons_tres.so")):
                return cand
    raise DevClusterError("cannot find Slurm's plugin directory (no select_cons_tres.so in "
                          + ", ".join(patterns) + ")", hint=INSTALL_HINT)


def require_root() -> None:
    if os.geteuid() != 0:
        raise DevClusterError("the dev cluster needs root (network namespaces, bridges, daemons)",
                              hint="run it as root, e.g. sudo contrib/devcluster/devcluster up")


def detect() -> HostInfo:
    """Check the prerequisites and describe the host; raises DevClusterError on what is missing."""
    require_root()
    for name in REQUIRED_TOOLS:
        tool(name)
    try:
        debian = Path("/etc/debian_version").read_text().strip()
    except OSError:
        debian = "unknown (not Debian)"
    try:
        pwd.getpwnam("slurm")
    except KeyError as exc:
        raise DevClusterError("the 'slurm' system user does not exist", hint=INSTALL_HINT) from exc
    return HostInfo(debian=debian, slurm_version=slurm_version(), plugin_dir=plugin_dir(),
                    hostname=socket.gethostname().split(".")[0], slurm_user="slurm")
