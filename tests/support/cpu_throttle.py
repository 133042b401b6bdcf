"""A CPU quota on some processes, as a noisy neighbour or a throttled CPU puts one on a node: a
cgroup with ``share`` of one CPU, on cgroup v2 (cpu.max) or v1 (the cpu controller's CFS quota),
that the processes are moved into and out of again. Needs root; tests skip without it."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def available() -> str | None:
    """Why no quota can be set here, or None when it can."""
    if os.geteuid() != 0:
        return "setting a CPU quota needs root"
    if (V2 / "cgroup.controllers").exists():
        return None if "cpu" in (V2 / "cgroup.controllers").read_text().split() else "cgroup v2 without the cpu controller"
    return None if (V1_CPU / "cpu.cfs_quota_us").exists() else "no cgroup cpu controller mounted"


@contextlib.contextmanager
def throttled(pids: Iterable[int], share: float) -> Iterator[Path]:
    """Run ``pids`` (whole processes, all their threads) under ``share`` of one CPU until exit."""
    pids = list(pids)
    quota = max(1000, int(share * PERIOD_US))
    if (V2 / "cgroup.controllers").exists():
        with contextlib.suppress(OSError):  # let children of the root use the cpu controller
            (V2 / "cgroup.subtree_control").write_text("+cpu")
        group = V2 / f"torchpass-throttle-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        home = V2
    else:
        group = V1_CPU / f"torchpass-throttle-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        home = V1_CPU
    try:
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (home / "cgroup.procs").write_text(pid)
        group.rmdir()
