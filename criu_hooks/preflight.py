"""Can this worker be moved transparently? Asked before anything is paused, so that the orchestrator
can fall back (model-aware when the job registered save/load, else wait) instead of rolling back a
half-done move. Checks: a usable criu, the worker started by `spawn` (PID-namespace init, session
leader), the device files its process tree holds (a DataLoader's workers too: criu cannot carry a
device to another node), TCP sockets its children listen on at an address of this node only (criu
cannot bind them on another node; the worker's own process-group sockets are released before the
dump) and its GPU state (criu_hooks.cuda). Returns reasons; an empty list means go."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from criu_hooks import cuda, locate, proc_sockets, runner, spawn
from criu_hooks.errors import CriuUnavailable, CudaCheckpointUnsupported


def reasons(pid: int, *, cross_gpu: bool = False) -> list[str]:
    """Why process ``pid`` cannot be moved with criu (empty: it can)."""
    found = []
    try:
        locate.find()
    except CriuUnavailable as e:
        found.append(str(e))
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        session = spawn.session_of(pid)
    except OSError:
        return [*found, f"process {pid} does not exist"]
    nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
    if len(nspid) < 2 or nspid[-1] != "1":
        found.append(f"process {pid} is not the first process of its own PID namespace, so its PID "
                     "may be taken on the target: start workers with criu_hooks.spawn")
    if session != pid:
        found.append(f"process {pid} is not a session leader (session {session}): start workers with "
                     "criu_hooks.spawn (setsid)")
    if os.path.realpath(f"/proc/{pid}/fd/0").startswith("/dev/pts"):
        found.append(f"process {pid} reads a terminal; give workers stdin=/dev/null")
    found += [f"process {task} holds {path}, {why}" for task, path, why in held_devices(pid)]
    found += [f"process {task}, a child of the worker, listens on {address}, an address of this node only: "
              "criu cannot bind that socket on another node; listen on all addresses (0.0.0.0), or close it "
              "before a move" for task, address in held_listeners(pid)]
    try:
        cuda.check(pid, cross_gpu=cross_gpu)
    except CudaCheckpointUnsupported as e:
        found.append(str(e))
    return found


# Device files a moved process may hold: they mean the same on every node (GPUs: criu_hooks.cuda).
PORTABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
PORTABLE_PREFIXES = ("/dev/shm/", "/dev/nvidia")


def unportable(path: str) -> str:
    """Why criu cannot move a process holding ``path`` to another node ("" when it can)."""
    if not path.startswith("/dev/") or path in PORTABLE_DEVICES or path.startswith(PORTABLE_PREFIXES):
        return ""
    if path.startswith(("/dev/pts/", "/dev/tty")):
        return "a terminal: give workers no terminal (stdin /dev/null, no tty)"
    return ("a device that criu cannot carry to another node: close it before a move, or use a "
            "model-aware move (torchpass.register)")


def held_devices(pid: int) -> list[tuple[int, str, str]]:
    """(task, path, why) for each unportable device file that a task of ``pid``'s tree has open or mapped."""
    found = []
    for task in runner.tree(pid):
        paths = set()
        fd_dir = Path(f"/proc/{task}/fd")
        try:
            for fd in fd_dir.iterdir():
                try:
                    paths.add(os.readlink(fd))
                except OSError:
                    continue
            maps = Path(f"/proc/{task}/maps").read_text().splitlines()
        except OSError:  # ended meanwhile
            continue
        paths |= {line.split(None, 5)[5] for line in maps if len(line.split(None, 5)) == 6}
        found += [(task, path, why) for path in sorted(paths) if (why := unportable(path))]
    return found


def held_listeners(pid: int) -> list[tuple[int, str]]:
    """(task, "address:port") for each TCP socket a descendant of ``pid`` listens on at one address
    of this node (not all addresses, not loopback). The worker itself is not asked: its process
    group's listening socket is bound that way and released before the dump."""
    listening: dict[str, str] = {}  # socket inode -> where it listens
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and (where := _specific(cols[1])):
                listening[cols[9]] = where
    return sorted({(task, listening[i]) for task in runner.tree(pid)[1:] for i in proc_sockets.held(task)
                   if i in listening})


def _specific(local: str) -> str:
    """``/proc/net/tcp``'s "HEXADDR:HEXPORT" as "address:port" when it is one address of this node
    (not the wildcard, not loopback), else ""."""
    hexaddr, _, hexport = local.partition(":")
    raw = bytes.fromhex(hexaddr)
    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]  # the kernel prints host-order 32-bit words
    address = ipaddress.ip_address(b"".join(words))
    if address.is_unspecified or address.is_loopback:
        return ""
    return f"[{address}]:{int(hexport, 16)}" if address.version == 6 else f"{address}:{int(hexport, 16)}"
