"""Makes the user's own ``init_process_group("gloo" | "nccl", ...)`` build a TorchPassGroup around
that backend: registers the "torchpass" c10d backend and wraps init_process_group. On a joining
rank the rendezvous is skipped (a local HashStore) and the group starts local. Groups made later
by new_group (DeviceMesh, new_subgroups) are TorchPass subgroups of it (TorchPassGroup.new_group),
re-formed with it; c10d sees the real backend's name, as under torchrun."""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from torchpass.group import BACKEND_NAME, TorchPassGroup
from torchpass_common import log
from torchpass_common.errors import WorkerError

_joining = False
_backend = "gloo"
_group: TorchPassGroup | None = None
_collective: timedelta | None = None  # cap on the group's collective timeout (timeouts.collective)


def install(*, joining: bool, collective: float | None = None) -> None:
    """Register the backend and wrap init_process_group (idempotent). ``collective``: seconds a
    collective may wait for a peer at most, whatever the script asked (a frozen or cut-off peer
    must interrupt the rank, not hang it for init_process_group's default of 30 minutes)."""
    global _joining, _collective
    _joining = joining
    if collective is not None:
        _collective = timedelta(seconds=collective)
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    if not getattr(c10d.init_process_group, "_torchpass", False):
        wrapped = _wrap(c10d.init_process_group)
        c10d.init_process_group = wrapped
        dist.init_process_group = wrapped


def group() -> TorchPassGroup | None:
    """The TorchPass default group, once the script has called init_process_group."""
    return _group


def forget() -> None:
    """Drop the default group of a failed generation (after destroy_process_group): the script,
    re-entered, calls init_process_group again and gets a new, local one."""
    global _group
    _group = None


def _create(store: dist.Store, rank: int, world_size: int, timeout: Any) -> dist.ProcessGroup:
    global _group
    if _collective is not None and (timeout is None or timeout > _collective):
        timeout = _collective
    if _group is None:
        _group = TorchPassGroup(_backend, store, rank, world_size, timeout, local=_joining,
                                max_timeout=_collective)
        return _group
    # torch's new_group hands subgroup creation to TorchPassGroup.new_group; a group reaching the
    # backend's creator instead would never be re-formed, and break at the first migration.
    raise WorkerError(f"a second {BACKEND_NAME!r} process group was requested outside new_group "
                      f"(rank {rank} of {world_size})",
                      hint="make subgroups with torch.distributed.new_group / new_subgroups / DeviceMesh; "
                           "a torch whose new_group does not delegate to the default group (before 2.13) "
                           "cannot be used", rank=rank)


def _default_backend() -> str:
    return "cpu:gloo,cuda:nccl" if dist.is_nccl_available() and torch.cuda.is_available() else "gloo"


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def init_process_group(backend: str | None = None, init_method: str | None = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: dist.Store | None = None,
                           group_name: str = "", pg_options: Any = None, device_id: Any = None,
                           **kwargs: Any) -> None:
        global _backend
        if backend == BACKEND_NAME:
            return original(backend, init_method, timeout, world_size, rank, store, group_name,
                            pg_options, device_id, **kwargs)
        _backend = str(backend or _default_backend())
        if pg_options is not None or device_id is not None:
            log.get(rank=rank).warning("group.options_ignored", pg_options=pg_options is not None,
                                       device_id=str(device_id))
        if _joining:
            # A joining rank builds its model alone; it meets the live group at the re-form.
            rank = rank if rank >= 0 else _env_int("RANK")
            world_size = world_size if world_size >= 0 else _env_int("WORLD_SIZE")
            init_method, store = None, dist.HashStore()
        result = original(BACKEND_NAME, init_method, timeout, world_size, rank, store, group_name, **kwargs)
        _show_real_backend()
        return result

    init_process_group._torchpass = True  # type: ignore[attr-defined]
    return init_process_group


def _show_real_backend() -> None:
    """c10d records the backend a group was made with ("torchpass"); record the real one instead,
    so that get_backend(), get_backend_config(), monitored_barrier's gloo check and new_group's
    default backend see what they see under torchrun."""
    pg = c10d._world.default_pg
    if pg is None or pg is not _group or pg not in c10d._world.pg_map:
        return
    _, store = c10d._world.pg_map[pg]
    c10d._world.pg_map[pg] = (_backend, store)
    c10d._world.pg_backend_config[pg] = str(dist.BackendConfig(dist.Backend(_backend)))


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError) as e:
        raise WorkerError(f"a joining rank needs {name} in its environment or init_process_group",
                          hint="launchpad sets it; pass rank= and world_size= explicitly otherwise") from e
