"""The network interface a job's collectives take (issue 24): the environment variables that name
it for gloo and NCCL, the check that a name is an interface name, and the path a job starts on.
torchpassd decides when a job changes path (torchpassd/link_policy.py); launchpad relays it with
``reform``; the worker re-forms its groups over it (torchpass/agent.py)."""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from typing import Any

from torchpass_common.errors import ProtocolError

ENV_NAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_IFNAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")  # Linux: at most 15 bytes, no '/' or spaces


def check(value: Any, what: str) -> str:
    """``value`` if it is an interface name, else ProtocolError naming ``what``."""
    if not isinstance(value, str) or not _IFNAME.fullmatch(value):
        raise ProtocolError(f"{what} must be a network interface name, got {value!r}")
    return value


def start_path(environ: MutableMapping[str, str], fabric: str) -> str:
    """The interface a job's workers start on, put into ``environ`` (the workers inherit it): the
    job's own choice when it named one (GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME), else the site's
    ``fabric`` (links.fabric), else "" (the backends choose; TorchPass reroutes nothing)."""
    own = next((environ[name] for name in ENV_NAMES if environ.get(name)), "")
    if own or not fabric:
        return own
    use(environ, fabric)
    return fabric


def use(environ: MutableMapping[str, str], ifname: str) -> None:
    """Make ``ifname`` the interface of the process groups created from now on (gloo reads
    GLOO_SOCKET_IFNAME each time it creates a group, NCCL its own variable at communicator init)."""
    for name in ENV_NAMES:
        environ[name] = ifname
