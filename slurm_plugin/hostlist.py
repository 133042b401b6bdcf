"""Slurm hostlist expressions (``n[1-3,7],gpu05``): expand them into node names and compress
node names back, so the watcher never has to call ``scontrol show hostnames``.

The parsing is python-hostlist's (the library Slurm sites use for this); this module owns only
what TorchPass adds around it: Slurm's empty spellings (``(null)``) and one error type."""

from __future__ import annotations

from collections.abc import Iterable

import hostlist

from torchpass_common.errors import SlurmError


def expand(expr: str | None) -> list[str]:
    """``"n[1-3],x"`` -> ``["n1", "n2", "n3", "x"]``; empty or None -> ``[]``; order kept."""
    if not expr or expr in ("(null)", "None"):
        return []
    try:
        return hostlist.expand_hostlist(expr.strip())
    except hostlist.BadHostlist as exc:
        raise SlurmError(f"cannot read the hostlist {expr!r}: {exc}") from None


def compress(names: Iterable[str]) -> str:
    """``["n1", "n2", "n3", "x"]`` -> ``"n[1-3],x"`` (numeric suffixes of equal width grouped, sorted)."""
    return hostlist.collect_hostlist(sorted(set(names)))
