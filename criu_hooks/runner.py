"""criu dump and criu restore of one worker's process tree, each timed on its own. A dump leaves the
tasks stopped (not killed), so the caller decides: kill them once the restore elsewhere succeeded
(`discard_original`), or let them go on (`resume_original`) when the dump or restore failed."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from criu_hooks import actions, locate
from criu_hooks.errors import CriuFailed
from torchpass_common import log

# Printed by every criu run that is not allowed to raise its own RLIMIT_NOFILE; harmless.
_HARMLESS = re.compile(r"rlimit: Can't setup RLIMIT_NOFILE")


@dataclass(frozen=True)
class DumpResult:
    images: Path
    seconds: float  # criu dump wall time
    frozen_seconds: float | None  # pre-dump .. post-dump action, the tasks' frozen time
    image_bytes: int


@dataclass(frozen=True)
class RestoreResult:
    pid: int  # the restored root task, as seen from the caller's PID namespace
    seconds: float  # criu restore wall time, until the tasks run again


def dump(pid: int, images: Path, *, tcp_close: bool = True, timeout: float = 120.0,
         enter: Sequence[str] = (), page_server: tuple[str, int] | None = None,
         where: dict[str, object] | None = None) -> DumpResult:
    """Dump the process tree rooted at ``pid`` (a session leader; a PID-namespace init for a
    cross-node restore) into ``images`` and leave it stopped. ``tcp_close``: connected TCP sockets
    are not dumped and come back closed (criu 4.2+). ``enter``: a command prefix that puts criu into
    the worker's node namespaces (criu would otherwise try to dump them). ``page_server``: (host,
    port) of a `PageServer` on the target, which then receives the memory pages (``images`` keeps
    the rest, a few hundred KB, to be shipped). Raises CriuFailed; the tree then runs on."""
    where = where or {}
    images.mkdir(parents=True, exist_ok=True)
    # --link-remap: a file mapped by a name since unlinked but linked by another (glibc's sem_open
    # does that) is dumped by a link criu makes (node_files.py carries it to the spare)
    argv = ["dump", "-t", str(pid), "-D", str(images), "--leave-stopped", "--link-remap"]
    if tcp_close:
        argv.append("--tcp-close")
    if page_server:
        argv += ["--page-server", "--address", page_server[0], "--port", str(page_server[1])]
    seconds, timeline = _run("dump", argv, images, timeout=timeout, where=where, enter=enter)
    size = sum(f.stat().st_size for f in images.iterdir() if f.is_file() and f.suffix == ".img")
    result = DumpResult(images, seconds, actions.span(timeline, "pre-dump", "post-dump"), size)
    log.get(**where).info("criu.dumped", pid=pid, seconds=round(seconds, 4), image_bytes=size,
                          frozen_seconds=result.frozen_seconds)
    return result


def restore(images: Path, *, tcp_close: bool = True, timeout: float = 120.0,
            enter: Sequence[str] = (), inherit: Mapping[str, int] | None = None,
            where: dict[str, object] | None = None) -> RestoreResult:
    """Restore the tree dumped in ``images``, detached: its root is re-parented to the caller's
    nearest child subreaper (launchpad makes itself one, see `become_subreaper`). ``enter`` is a
    command prefix that puts criu into the target node's namespaces (e.g. nsenter --net=...).
    ``inherit`` maps the dumped worker's external resources (`spawn.stdio_pipes`: "pipe:[123]") to
    this process's fds that replace them, e.g. new pipes to the target launchpad's output reader.
    Raises CriuFailed; nothing of the tree is left running then."""
    where = where or {}
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    argv = ["restore", "-D", str(images), "--restore-detached", "--pidfile", str(pidfile)]
    if tcp_close:
        argv.append("--tcp-close")
    for resource, fd in (inherit or {}).items():
        argv += ["--inherit-fd", f"fd[{fd}]:{resource}"]
    seconds, _ = _run("restore", argv, images, timeout=timeout, where=where, enter=enter,
                      pass_fds=tuple((inherit or {}).values()))
    pid = int(pidfile.read_text().strip())
    log.get(**where).info("criu.restored", pid=pid, seconds=round(seconds, 4))
    return RestoreResult(pid, seconds)


class PageServer:
    """`criu page-server` on the target node: receives one dump's memory pages straight into
    ``images`` (no copy on the source's disk). Start it before the dump; `wait` after it."""

    def __init__(self, images: Path, host: str, port: int, *, enter: Sequence[str] = (),
                 timeout: float = 30.0, where: dict[str, object] | None = None) -> None:
        self.images, self.where = images, where or {}
        images.mkdir(parents=True, exist_ok=True)
        self.log = images / "page-server.log"
        ready_r, ready_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*enter, locate.find().path, "page-server", "-D", str(images), "--address", host,
                 "--port", str(port), "--status-fd", str(ready_w), "-o", str(self.log), "-v4"],
                pass_fds=(ready_w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:  # criu writes one NUL byte once it listens
            listening = select.select([ready], [], [], timeout)[0] and ready.read(1) == b"\0"
        if not listening:
            self.proc.kill()
            self.proc.wait()
            raise CriuFailed(f"criu page-server on {host}:{port} did not start: "
                             + " | ".join(_errors(self.log)[-3:] or ["no answer"]),
                             hint=f"criu's log: {self.log}", **self.where)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for the page server to finish (it ends with the dump); returns the received bytes."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            self.proc.wait()
            raise CriuFailed("criu page-server did not finish after the dump", hint=f"see {self.log}",
                             **self.where) from e
        if rc != 0:
            raise CriuFailed("criu page-server failed: " + " | ".join(_errors(self.log)[-3:]),
                             hint=f"criu's log: {self.log}", **self.where)
        return sum(f.stat().st_size for f in self.images.glob("page*.img"))

    def stop(self) -> None:
        """Give up on the page server (the dump failed or was abandoned)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def resume_original(pid: int) -> None:
    """Let a tree left stopped by `dump` go on (the migration was abandoned): every task of it, not
    only its root. A DataLoader's worker processes left stopped would hold the worker in its next
    batch for ever, and its peers in their next collective until the backend's timeout."""
    for task in tree(pid):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(task, signal.SIGCONT)


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the kernel's children lists, of every thread), parents first."""
    found, todo = [], [pid]
    while todo:
        task = todo.pop(0)
        found.append(task)
        try:
            threads = os.listdir(f"/proc/{task}/task")
        except OSError:
            continue
        for thread in threads:
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in Path(f"/proc/{task}/task/{thread}/children").read_text().split()]
    return found


def discard_original(pid: int) -> None:
    """Kill a tree left stopped by `dump` once its restored copy runs elsewhere."""
    os.kill(pid, signal.SIGKILL)


def become_subreaper() -> None:
    """Make this process adopt orphaned descendants (PR_SET_CHILD_SUBREAPER), so that it can wait
    for the restored worker trees criu leaves behind."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # 36 = PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _run(verb: str, argv: list[str], images: Path, *, timeout: float, where: dict[str, object],
         enter: Sequence[str] = (), pass_fds: tuple[int, ...] = ()) -> tuple[float, dict[str, float]]:
    criu = locate.find()
    logfile = images / f"{verb}.log"
    timeline = images / f"{verb}.timeline"
    timeline.unlink(missing_ok=True)
    script = actions.install(images)
    cmd = [*enter, criu.path, *argv, "-o", str(logfile), "-v4", "--action-script", str(script)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=actions.env_for(timeline), pass_fds=pass_fds)
    except subprocess.TimeoutExpired as e:
        raise CriuFailed(f"criu {verb} did not finish within {timeout:.0f} s", hint=f"see {logfile}",
                         **where) from e
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        errors = _errors(logfile) or [done.stderr.strip() or f"exit status {done.returncode}"]
        log.get(**where).warning(f"criu.{verb}_failed", errors=errors, log=str(logfile))
        raise CriuFailed(f"criu {verb} failed: " + " | ".join(errors[-3:]),
                         hint=f"the worker was left as it was; criu's log: {logfile}", **where)
    return seconds, actions.read_timeline(timeline)


def _errors(logfile: Path) -> list[str]:
    """criu's "Error (file:line): ..." lines, less the harmless ones."""
    try:
        text = logfile.read_text(errors="replace")
    except OSError:
        return []
    lines = [line.split("Error ", 1)[1].strip() for line in text.splitlines() if "Error (" in line]
    return [line for line in lines if not _HARMLESS.search(line)]
