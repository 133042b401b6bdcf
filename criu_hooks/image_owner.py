"""Who the tasks of a dump would run as, checked before a restore. criu restores each task with the
credentials its images name; a restore run with privilege (root, or criu with its capabilities)
would give a task whatever the images say, so images that arrived over the network must name the
job's own user. This module reads the credentials of every task (``core-*.img``: criu's image
header, then one length-prefixed protobuf CoreEntry whose thread_core.creds holds the ids, groups
and capability sets) with a minimal protobuf reader, and refuses images naming another user, a
group the job's user is not in, or capabilities for a user other than root. It does not restore,
and trusts nothing in the images: a malformed one is refused too."""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from criu_hooks.errors import CriuFailed

HEADER = 8  # criu's two magic words before the first entry
MAX_CORE_BYTES = 1 << 20  # a CoreEntry is a few KiB
THREAD_CORE, CREDS = 5, 10  # CoreEntry.thread_core, ThreadCoreEntry.creds
UIDS, GIDS = (1, 3, 5, 7), (2, 4, 6, 8)  # CredsEntry: uid gid euid egid suid sgid fsuid fsgid
CAP_PRM, CAP_EFF, GROUPS = 10, 11, 14  # CredsEntry: permitted, effective capabilities; supplementary groups


class ImageRefused(CriuFailed):
    """A dump's images would restore a task as someone other than the job's user, or cannot be read."""


@dataclass(frozen=True)
class TaskCreds:
    """One task's credentials as its images name them."""

    image: str
    uids: frozenset[int]
    gids: frozenset[int]
    capabilities: bool  # any permitted or effective capability


def check(images: Path, *, uid: int, gids: Collection[int], where: dict[str, object] | None = None) -> None:
    """Raise ImageRefused unless every task in ``images`` runs as ``uid``, in groups among
    ``gids``, and (unless ``uid`` is root) without capabilities."""
    where = where or {}
    tasks = read(images, where)
    for task in tasks:
        if task.uids != {uid}:
            raise ImageRefused(f"the worker images would restore {task.image} as uid {sorted(task.uids)}, "
                               f"not as the job's user (uid {uid})",
                               hint="images are only restored for the user whose job dumped them", **where)
        if uid != 0 and not task.gids <= set(gids):
            raise ImageRefused(f"the worker images would restore {task.image} in groups {sorted(task.gids - set(gids))} "
                               f"the job's user (uid {uid}) is not in", hint="the images were not made by this job", **where)
        if uid != 0 and task.capabilities:
            raise ImageRefused(f"the worker images would restore {task.image} with capabilities, for uid {uid}",
                               hint="a worker of an unprivileged job holds none", **where)


def read(images: Path, where: dict[str, object] | None = None) -> list[TaskCreds]:
    """The credentials of each task (one ``core-<pid>.img`` per thread) in ``images``."""
    where = where or {}
    cores = sorted(images.glob("core-*.img"))
    if not cores:
        raise ImageRefused(f"no task images (core-*.img) in {images}", hint="the dump did not arrive whole", **where)
    return [_creds(path, where) for path in cores]


def _creds(path: Path, where: dict[str, object]) -> TaskCreds:
    try:
        with path.open("rb") as f:
            head = f.read(HEADER + 4)
            if len(head) < HEADER + 4:
                raise ValueError("shorter than criu's image header")
            (size,) = struct.unpack("<I", head[HEADER:])
            if size > MAX_CORE_BYTES:
                raise ValueError(f"an entry of {size} bytes")
            entry = f.read(size)
        if len(entry) != size:
            raise ValueError("cut short")
        creds = [_one(v, CREDS) for f, v in _fields(entry) if f == THREAD_CORE]
        fields = list(_fields(creds[-1] if creds else b""))
    except (OSError, ValueError, IndexError, struct.error) as exc:
        raise ImageRefused(f"cannot read the credentials in {path.name}: {exc}",
                           hint="the images are damaged or were not made by criu", **where) from exc
    ids = {f: v for f, v in fields if isinstance(v, int)}
    if not creds or not all(f in ids for f in UIDS + GIDS):
        raise ImageRefused(f"{path.name} names no credentials", hint="the images were not made by criu", **where)
    groups = {v for f, v in fields if f == GROUPS and isinstance(v, int)}
    for packed in (v for f, v in fields if f == GROUPS and isinstance(v, bytes)):  # criu writes them unpacked
        groups |= set(_packed(packed))
    caps = any(v for f, v in fields if f in (CAP_PRM, CAP_EFF) and isinstance(v, int))
    return TaskCreds(path.name, frozenset(ids[f] for f in UIDS), frozenset({*(ids[f] for f in GIDS), *groups}), caps)


def _one(message: bytes, field: int) -> bytes:
    """The last length-delimited ``field`` of ``message`` (b"" if absent)."""
    found = [v for f, v in _fields(message) if f == field and isinstance(v, bytes)]
    return found[-1] if found else b""


def _fields(message: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field: an int for varints, bytes for the rest."""
    i = 0
    while i < len(message):
        key, i = _varint(message, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(message, i)
            yield field, value
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(message):
                raise ValueError("a fixed-size field runs past the end")
            yield field, message[i:i + width]
            i += width
        elif wire == 2:
            n, i = _varint(message, i)
            if i + n > len(message):
                raise ValueError("a field runs past the end")
            yield field, message[i:i + n]
            i += n
        else:
            raise ValueError(f"wire type {wire}")


def _packed(data: bytes) -> Iterator[int]:
    i = 0
    while i < len(data):
        value, i = _varint(data, i)
        yield value


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("a varint runs past the end")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i
