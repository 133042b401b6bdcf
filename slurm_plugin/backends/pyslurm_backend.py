"""The pyslurm backend: libslurm in-process (about 1 ms per poll instead of ~12 ms for the
commands). pyslurm is built per Slurm release, so it is used only when it imports and its
major.minor equals the running Slurm's. Written against pyslurm's 23.2+ object API
(``Nodes.load()``, ``Jobs.load()``, ``Reservations.load()``); no pyslurm exists for Debian's
22.05 or 24.11, so this module is not exercised by the test suite here."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Any

from slurm_plugin import hostlist
from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Job, Node, Reservation
from torchpass_common.errors import SlurmError

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def release(text: str) -> tuple[int, int] | None:
    """``"slurm 22.05.8"`` / ``"25.11.2"`` -> ``(22, 5)`` / ``(25, 11)``."""
    m = _RELEASE.search(text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def unusable_reason(slurm_version: str) -> str:
    """Why pyslurm cannot be used with Slurm ``slurm_version`` ("" when it can)."""
    try:
        mod = importlib.import_module("pyslurm")
    except ImportError as exc:
        return f"pyslurm is not importable ({exc})"
    have = release(getattr(mod, "__version__", ""))
    want = release(slurm_version)
    if have is None or want is None or have != want:
        return (f"pyslurm {getattr(mod, '__version__', '?')} does not match Slurm "
                f"{slurm_version.strip() or '?'} (pyslurm is built per Slurm release)")
    if not all(hasattr(mod, name) for name in ("Nodes", "Jobs", "Reservations")):
        return f"pyslurm {mod.__version__} lacks the Nodes/Jobs/Reservations API"
    return ""


def _records(collection: Any) -> Iterable[Any]:
    return collection.values() if hasattr(collection, "values") else collection


def _node(n: Any) -> Node:
    base, *flags = (str(n.state or "UNKNOWN").upper().split("+"))
    return Node(name=n.name, state=base.lower(), flags=frozenset(flags), reason=n.reason or "",
                reason_by=n.reason_user or "", reason_time=int(n.reason_time or 0), addr=n.address or "")


def _job(j: Any) -> Job:
    return Job(job_id=int(j.id), name=j.name or "", user=j.user_name or "", state=str(j.state).upper(),
               nodes=tuple(hostlist.expand(j.allocated_nodes)), batch_host=j.batch_host or "",
               partition=j.partition or "", comment=j.comment or "", admin_comment=j.admin_comment or "",
               resize_time=int(j.resize_time or 0), start_time=int(j.start_time or 0))


class PyslurmClient(SlurmClient):
    name = "pyslurm"

    def __init__(self) -> None:
        self.mod = importlib.import_module("pyslurm")

    def _load(self, what: str) -> Iterable[Any]:
        try:
            return _records(getattr(self.mod, what).load())
        except Exception as exc:  # pyslurm raises its own RPCError; keep Slurm's message
            raise SlurmError(f"pyslurm {what}.load() failed: {exc}") from exc

    def nodes(self) -> dict[str, Node]:
        return {n.name: n for n in map(_node, self._load("Nodes"))}

    def jobs(self) -> dict[int, Job]:
        return {j.job_id: j for j in map(_job, self._load("Jobs"))}

    def reservations(self) -> dict[str, Reservation]:
        out = {}
        for r in self._load("Reservations"):
            out[r.name] = Reservation(name=r.name, nodes=tuple(hostlist.expand(r.nodes)), state="ACTIVE"
                                      if getattr(r, "active", True) else "INACTIVE")
        return out
