"""CRIU action scripts: criu runs one at each phase (pre-dump, post-dump, pre-restore, pre-resume,
post-resume, ...) with CRTOOLS_SCRIPT_ACTION set. Ours appends "<action> <unix time>" to the
timeline file named in TORCHPASS_CRIU_TIMELINE, which gives how long the tasks were frozen."""

from __future__ import annotations

import os
from pathlib import Path

TIMELINE_ENV = "TORCHPASS_CRIU_TIMELINE"
SCRIPT = f"""#!/bin/sh
# TorchPass criu action script (criu_hooks/actions.py): records when criu reaches each phase.
[ -n "${TIMELINE_ENV}" ] && echo "$CRTOOLS_SCRIPT_ACTION $(date +%s.%N)" >> "${TIMELINE_ENV}"
exit 0
"""


def install(directory: Path) -> Path:
    """Write the action script into ``directory`` (e.g. a run dir) and return its path."""
    path = directory / "torchpass-criu-action.sh"
    path.write_text(SCRIPT)
    path.chmod(0o755)
    return path


def read_timeline(path: Path) -> dict[str, float]:
    """{action: unix time} from a timeline file (the last time wins for repeated actions)."""
    if not path.exists():
        return {}
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        action, _, stamp = line.partition(" ")
        try:
            out[action] = float(stamp)
        except ValueError:
            continue
    return out


def span(timeline: dict[str, float], start: str, end: str) -> float | None:
    """Seconds from action ``start`` to ``end``, or None when either was not recorded."""
    if start in timeline and end in timeline:
        return timeline[end] - timeline[start]
    return None


def env_for(timeline: Path) -> dict[str, str]:
    """The environment criu needs so that the action script writes to ``timeline``."""
    return {**os.environ, TIMELINE_ENV: str(timeline)}
