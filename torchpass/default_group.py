"""Makes the user's own ``init_process_group("gloo" | "nccl", ...)`` build a TorchPassGroup around
that backend: registers the "torchpass" c10d backend and wraps init_process_group. On a joining
rank the rendezvous is skipped (a local HashStore) and the group starts local. Groups made later
by new_group (DeviceMesh, new_subgroups) are TorchPass subgroups of it (TorchPassGroup.new_group),
re-formed with it, on the backend new_group was asked for; split_group makes its splits through
new_group too. c10d sees the real backend's name, as under torchrun."""

from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from torchpass.group import BACKEND_NAME, TorchPassGroup, requested_backend
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
        # new_group, new_subgroups and DeviceMesh all reach c10d's _new_group_with_tag
        c10d._new_group_with_tag = _passing_backend(c10d._new_group_with_tag)
        c10d.split_group = dist.split_group = _splitting(c10d.split_group)


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


def _passing_backend(original: Any) -> Any:
    """c10d's _new_group_with_tag, telling TorchPassGroup.new_group the backend it was asked for."""
    @functools.wraps(original)
    def _new_group_with_tag(ranks: Any = None, timeout: Any = None, backend: Any = None, *args: Any,
                            **kwargs: Any) -> Any:
        token = requested_backend.set(str(backend) if backend else None)
        try:
            return original(ranks, timeout, backend, *args, **kwargs)
        finally:
            requested_backend.reset(token)
    return _new_group_with_tag


def _splitting(original: Any) -> Any:
    """c10d's split_group, which needs a backend that splits its communicator (NCCL with a bound
    device): on the TorchPass group each split is a new_group of its members instead, re-formed
    like any subgroup. Without the TorchPass group, torch's own."""
    @functools.wraps(original)
    def split_group(parent_pg: dist.ProcessGroup | None = None, split_ranks: list[list[int]] | None = None,
                    timeout: Any = None, pg_options: Any = None, group_desc: str | None = None,
                    backend: Any = None) -> dist.ProcessGroup | None:
        if _group is None or c10d._world.default_pg is not _group:
            return original(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
        parent = parent_pg or _group
        members = _split_of(parent, split_ranks)
        if members is None:
            return None
        sub = c10d.new_group(members, timeout=timeout, backend=backend or c10d._world.pg_map[parent][0],
                             pg_options=pg_options, use_local_synchronization=True, group_desc=group_desc)
        return None if sub is c10d.GroupMember.NON_GROUP_MEMBER else sub
    return split_group


def _split_of(parent: dist.ProcessGroup, split_ranks: list[list[int]] | None) -> list[int] | None:
    """The global ranks of this rank's split (``split_ranks``: group ranks in ``parent``, as
    split_group takes them), None when it is in none; bad splits are torch's ValueErrors."""
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    to_group = c10d._world.pg_group_ranks.get(parent)
    if to_group is None:
        raise ValueError(f"Group {parent} is not registered")
    assert _group is not None
    me = to_group.get(_group.rank())
    if me is None:
        raise ValueError(f"Global rank {_group.rank()} is not part of the parent group {parent}")
    to_global = {group_rank: global_rank for global_rank, group_rank in to_group.items()}
    taken: set[int] = set()
    mine = None
    for split in split_ranks:
        if not split or len(set(split)) != len(split) or not set(split) <= to_global.keys() or taken & set(split):
            raise ValueError(f"split_group: split {split} is empty, repeats a rank, names a rank outside the "
                             f"parent group (size {len(to_global)}) or overlaps another split")
        taken |= set(split)
        if me in split:
            mine = sorted(to_global[r] for r in split)
    return mine


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
