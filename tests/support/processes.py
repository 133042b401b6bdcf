"""Looking at a test's processes from outside: whether one is still alive."""

from __future__ import annotations

from pathlib import Path


def dead(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet (killed all the same)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
