"""What a worker's process tree holds on its node that criu records by name but does not carry, so
that a restore on another node finds it: files still linked in /dev/shm (glibc's named semaphores,
which multiprocessing's spawn start method makes for every queue and lock a DataLoader uses;
``shm_open`` segments; the ``link_remap.N`` names criu's ``--link-remap`` gives a mapping whose own
name was unlinked, as glibc's ``sem_open`` does to its temporary name) and the directories of the
unix sockets it is bound to (multiprocessing's ``/tmp/pymp-*``).

``collect`` (the source, the tree stopped after its dump) copies each such file once next to the
images, with every name it has; ``place`` (the spare, before the restore) creates them again, the
names of one file hard-linked as they were, so that tasks that mapped it by different names share
it again; ``unplace`` takes back what ``place`` made (the restore failed) and ``release`` removes
the source's names once the tree is gone from there (criu removes the ``link_remap`` names itself
after a restore). A file unlinked everywhere is not here: criu carries it in its images (a ghost)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from criu_hooks import proc_sockets
from criu_hooks.errors import CriuFailed
from torchpass_common.errors import ProtocolError

SHM = "/dev/shm"
REMAP = "link_remap."  # criu's prefix for the names it links
_COPY = re.compile(r"shm-\d+")


@dataclass(frozen=True)
class ShmFile:
    """One file in /dev/shm: its names (hard links), its copy in the images directory, its mode."""

    names: tuple[str, ...]
    copy: str
    mode: int


@dataclass(frozen=True)
class NodeFiles:
    """What goes with one tree's images (``to_wire``/``from_wire``: the wormhole's resources)."""

    shm: tuple[ShmFile, ...] = ()
    socket_dirs: tuple[tuple[str, int], ...] = ()  # (directory, mode)

    def to_wire(self) -> dict[str, Any]:
        return {"shm": [{"names": list(f.names), "copy": f.copy, "mode": f.mode} for f in self.shm],
                "socket_dirs": [[d, m] for d, m in self.socket_dirs]}

    @classmethod
    def from_wire(cls, raw: object) -> NodeFiles:
        """Checked: /dev/shm names only, copies named as ``collect`` names them, absolute directories."""
        if raw is None:
            return cls()
        try:
            shm = tuple(ShmFile(tuple(_shm_name(n) for n in f["names"]), _copy_name(f["copy"]), int(f["mode"]) & 0o7777)
                        for f in raw["shm"])  # type: ignore[index]
            dirs = tuple((_directory(d), int(m) & 0o7777) for d, m in raw["socket_dirs"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed node files with the images: {exc}") from exc
        if any(not f.names for f in shm):
            raise ProtocolError("a /dev/shm file with the images has no name")
        return cls(shm, dirs)


@dataclass
class Collected:
    """``files`` as sent, and the source's own names with the inode each named then."""

    files: NodeFiles
    names: dict[str, tuple[int, int]] = field(default_factory=dict)


def collect(pids: Iterable[int], images: Path) -> Collected:
    """Copy the linked /dev/shm files the tasks ``pids`` map or hold open into ``images`` and
    find the directories of their bound unix sockets. criu's link_remap names are dropped here
    once copied: the source's tasks hold their files, the spare gets them by the copies."""
    pids = list(pids)
    groups = _shm_names(_held_inodes(pids))
    shm, names = [], {}
    for n, (inode, paths) in enumerate(sorted(groups.items(), key=lambda kv: kv[1])):
        copy = f"shm-{n}"
        shutil.copyfile(paths[0], images / copy)
        shm.append(ShmFile(tuple(paths), copy, stat.S_IMODE(os.lstat(paths[0]).st_mode)))
        names.update({p: inode for p in paths if not _remap(p)})
    _drop_remaps(groups)
    dirs = sorted({os.path.dirname(p) for p in _bound_sockets(pids)})
    modes = [(d, stat.S_IMODE(os.stat(d).st_mode)) for d in dirs if os.path.isdir(d)]
    return Collected(NodeFiles(tuple(shm), tuple(modes)), names)


def drop_remaps(pids: Iterable[int]) -> None:
    """Remove criu's link_remap names of the /dev/shm files the tasks ``pids`` hold (a failed dump
    may leave them behind)."""
    _drop_remaps(_shm_names(_held_inodes(list(pids))))


def _drop_remaps(groups: dict[tuple[int, int], list[str]]) -> None:
    for paths in groups.values():
        for p in paths:
            if _remap(p):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)


def place(files: NodeFiles, images: Path) -> list[str]:
    """On the spare, before the restore: create each file under its names and each socket
    directory that is missing; returns what was made, for ``unplace``. A name already taken here
    raises CriuFailed (nothing of this call left behind): the restore would map the wrong file."""
    made: list[str] = []
    try:
        for d, mode in files.socket_dirs:
            if not os.path.isdir(d):
                os.makedirs(d, exist_ok=True)
                os.chmod(d, mode)
                made.append(d)
        for f in files.shm:
            first, *others = sorted(f.names, key=_remap)  # its own name first, criu's after
            try:
                fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError as exc:
                raise CriuFailed(f"{first} exists on this node already: the worker's own file of that name "
                                 "cannot be restored next to it",
                                 hint=f"remove {first} if nothing here uses it, or move to another spare") from exc
            made.append(first)
            with os.fdopen(fd, "wb") as out, open(images / f.copy, "rb") as src:
                shutil.copyfileobj(src, out)
                os.fchmod(out.fileno(), f.mode)
            for other in others:
                os.link(first, other)
                made.append(other)
    except OSError as exc:
        unplace(made)
        raise CriuFailed(f"cannot place the worker's node files: {exc}", hint="is /dev/shm full on this node?") from exc
    except CriuFailed:
        unplace(made)
        raise
    return made


def unplace(made: Iterable[str]) -> None:
    """Take back what ``place`` made (files, then the directories it created, if left empty)."""
    for p in sorted(made, key=len, reverse=True):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)


def release(collected: Collected) -> None:
    """On the source once its tree was killed: remove its /dev/shm names that still name the file
    they named at the dump (its socket directories stay: where /tmp is shared they are the spare's too)."""
    for p, inode in collected.names.items():
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(p)
            if (st.st_dev, st.st_ino) == inode:
                os.unlink(p)


# ---- what the tasks hold -----------------------------------------------------------------------
def _held_inodes(pids: list[int]) -> set[tuple[int, int]]:
    """(device, inode) of every file the tasks map (/proc/PID/maps) or hold open (/proc/PID/fd)."""
    held: set[tuple[int, int]] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) >= 5 and parts[4] != "0":
                    major, minor = parts[3].split(":")
                    held.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(fd.path)
                    held.add((st.st_dev, st.st_ino))
    return held


def _shm_names(held: set[tuple[int, int]]) -> dict[tuple[int, int], list[str]]:
    """The names in /dev/shm of the regular files in ``held``, grouped by file."""
    groups: dict[tuple[int, int], list[str]] = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(SHM) as entries:
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                st = e.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) in held:
                    groups.setdefault((st.st_dev, st.st_ino), []).append(e.path)
    return {k: sorted(v) for k, v in groups.items()}


def _bound_sockets(pids: list[int]) -> list[str]:
    """The file system paths of the unix sockets the tasks hold (abstract ones have none)."""
    paths = proc_sockets.unix()
    return sorted({paths[i] for pid in pids for i in proc_sockets.held(pid) if paths.get(i)})


def _remap(path: str) -> bool:
    return os.path.basename(path).startswith(REMAP)


def _shm_name(name: object) -> str:
    if not isinstance(name, str) or os.path.dirname(name) != SHM or os.path.basename(name) in ("", ".", ".."):
        raise ValueError(f"not a file directly in {SHM}: {name!r}")
    return name


def _copy_name(name: object) -> str:
    if not isinstance(name, str) or not _COPY.fullmatch(name):
        raise ValueError(f"not a copy's name: {name!r}")
    return name


def _directory(path: object) -> str:
    if not isinstance(path, str) or not path.startswith("/") or os.path.normpath(path) != path or path == "/":
        raise ValueError(f"not an absolute, normal directory: {path!r}")
    return path
