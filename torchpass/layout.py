"""Which ranks hold a copy of this rank's training state (its replicas), as torchpassd needs to know
for unplanned recovery: a lost rank can be rebuilt only from a surviving replica. Read from what
the script trains, never assumed: the parameters of every optimizer that stepped (an optimizer step
post-hook records them) and every live DDP. A sharded parameter (DTensor: FSDP2, HSDP, tensor
parallel) is held alike by the ranks at the same mesh coordinate on each dimension it is not
replicated along; a DDP module's parameters by every rank of its process group. The replicas are
what all of them agree on. Nothing sharded and no DDP: unknown (None)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchpass import ddp_layout

_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def saw_optimizer(optimizer: Any) -> None:
    """Remember an optimizer that stepped (called from the step hook; cheap after the first time)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _optimizers.add(optimizer)


def replicas(rank: int) -> list[int] | None:
    """The global ranks (``rank`` included) holding the same state as ``rank``; None if unknown."""
    holders: set[int] | None = None
    for ddp in ddp_layout.live():
        holders = _meet(holders, set(dist.get_process_group_ranks(ddp.process_group)))
    for opt in list(_optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if isinstance(p, DTensor):
                    holders = _meet(holders, _same_shard(p))
    return sorted(holders) if holders is not None else None


def _meet(holders: set[int] | None, these: set[int]) -> set[int]:
    return these if holders is None else holders & these


def _same_shard(t: DTensor) -> set[int]:
    """Ranks of ``t``'s mesh holding the same local data as this rank: same coordinate on every
    mesh dimension ``t`` is not replicated along."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing of t
        return set()
    ranks = mesh.mesh
    for dim, placement in enumerate(t.placements):
        if not isinstance(placement, Replicate):
            ranks = ranks.narrow(dim, coord[dim], 1)
    return {int(r) for r in ranks.flatten().tolist()}
