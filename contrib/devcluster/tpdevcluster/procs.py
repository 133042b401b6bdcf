"""Processes of one instance: start a daemon in the foreground with the instance's marker in its
environment and a pidfile, wait for it to be ready (failing fast with its log if it dies), find
every marked process, and stop processes by PID. Never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import DevClusterError
from .instance import MARK_ENV, Instance

_started: dict[str, subprocess.Popen[bytes]] = {}


def marked_env(inst: Instance, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env[MARK_ENV] = str(inst.id)
    env["SLURM_CONF"] = str(inst.slurm_conf)
    env.update(extra or {})
    return env


def spawn(inst: Instance, name: str, argv: list[str]) -> None:
    """Start ``argv`` (which must stay in the foreground) as daemon ``name``, its output going to
    log/<name>.out, and record its PID in run/<name>.started."""
    with open(inst.log_dir / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=marked_env(inst), start_new_session=True)
    _started[name] = proc
    inst.spawn_record(name).write_text(f"{proc.pid}\n")


def read_pid(inst: Instance, name: str) -> int | None:
    try:
        return int(inst.spawn_record(name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int | None) -> bool:
    """True if ``pid`` is a running (not zombie) process."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def daemon_pid(inst: Instance, name: str) -> int | None:
    """The PID of daemon ``name`` if it is running, else None."""
    pid = read_pid(inst, name)
    return pid if alive(pid) else None


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def wait_ready(inst: Instance, name: str, ready: Callable[[], bool], timeout: float,
               log: Path | None = None) -> None:
    """Poll ``ready()`` until true; raise with the daemon's log if it exits or time runs out."""
    log = log or inst.log_dir / f"{name}.out"
    proc = _started.get(name)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if ready():
            return
        if proc is not None and proc.poll() is not None:
            raise DevClusterError(f"{name} exited with status {proc.returncode} while starting",
                                  instance=inst.id, hint=f"its log {log} ends with:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise DevClusterError(f"{name} was not ready after {timeout:.0f} s", instance=inst.id,
                                  hint=f"its log {log} ends with:\n{log_tail(log)}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


def _lineage() -> set[int]:
    """This process and its ancestors: never ours to kill even if they carry the marker."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def marked_pids(inst: Instance) -> list[int]:
    """Every live process whose environment carries this instance's marker."""
    needle = inst.marker.encode()
    skip = _lineage()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(pids: Iterable[int], grace: float) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace`` seconds, SIGKILL the rest; returns those killed."""
    pids = [p for p in pids if alive(p)]
    signal_pids(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    rest = [p for p in pids if alive(p)]
    signal_pids(rest, signal.SIGKILL)
    return rest

