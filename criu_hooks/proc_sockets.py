"""The sockets a task holds, as /proc shows them: the inodes of its open socket fds, and this network
namespace's unix sockets with the path each is bound to. Shared by preflight (what a worker's
children listen on), node_files (the directories of its bound unix sockets) and launchpad (waiting
until a worker closed its agent channel before the dump)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def held(pid: int) -> set[str]:
    """The inodes (as /proc writes them) of the sockets task ``pid`` has open; empty once it ended."""
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    found.add(target[8:-1])
    return found


def unix() -> dict[str, str]:
    """This network namespace's unix sockets: inode -> the path it is bound to ("" for none or an
    abstract name)."""
    try:
        rows = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return {}
    found = {}
    for row in rows:
        cols = row.split()  # Num RefCount Protocol Flags Type St Inode [Path]
        if len(cols) > 6:
            found[cols[6]] = cols[7] if len(cols) > 7 and cols[7].startswith("/") else ""
    return found
