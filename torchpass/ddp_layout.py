"""DDP instances of this process (weak references, in construction order) and their gradient
bucket layout: read on the donor at hand-over, replayed on a joining rank so that its reducer gets
rank 0's buckets (bucket order decides summation order, hence bit-identity) without sending DDP's
one-time bucket-rebuild collectives to the live group."""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

if TYPE_CHECKING:  # at run time the group is only passed through
    from torchpass.group import TorchPassGroup
from torchpass_common.errors import WorkerError

_instances: list[weakref.ReferenceType[DDP]] = []


def track() -> None:
    """Remember every DDP constructed from now on (patches DDP.__init__ once)."""
    if getattr(DDP.__init__, "_torchpass_tracked", False):
        return
    original = DDP.__init__

    @functools.wraps(original)
    def init(self: DDP, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _instances.append(weakref.ref(self))

    init._torchpass_tracked = True  # type: ignore[attr-defined]
    DDP.__init__ = init  # type: ignore[method-assign]


def forget() -> None:
    """Stop counting the DDP instances built so far: those of a script run that a failed
    collective ended (the re-entered script builds its own)."""
    _instances.clear()


def live() -> list[DDP]:
    """The DDP instances still alive, oldest first."""
    return [d for d in (ref() for ref in _instances) if d is not None]


def capture() -> list[dict[str, Any]]:
    """Each live DDP's layout: ``rebuilt`` with its buckets (lists of parameter indices, identical on
    all ranks after DDP's rebuild), ``pending`` (trained, rebuild not yet done) or ``fresh``."""
    return [_layout_of(d) for d in live()]


def _layout_of(ddp: DDP) -> dict[str, Any]:
    if not ddp._has_rebuilt_buckets:
        return {"state": "pending" if ddp._lazy_init_ran else "fresh"}
    replayed = getattr(ddp, "_torchpass_buckets", None)
    if replayed is not None:  # this rank joined with that layout; DDP may not have logged it yet
        return {"state": "rebuilt", "buckets": replayed}
    key = "rebuilt_per_bucket_param_indices"
    data = ddp._get_ddp_logging_data()
    if key not in data:
        # DDP logs the rebuilt layout at the next sampled iteration (all of the first ten); when
        # paused right after the rebuild, take that sample now.
        ddp.logger.set_runtime_stats_and_log()
        data = ddp._get_ddp_logging_data()
    if key not in data:
        raise WorkerError("DDP rebuilt its buckets but does not report the layout",
                          hint="this torch version's DDP logging differs; TorchPass needs torch 2.13")
    buckets = [[int(i) for i in bucket.split()] for bucket in data[key].split(",")]
    return {"state": "rebuilt", "buckets": buckets}


def replay(group: TorchPassGroup, layouts: list[dict[str, Any]]) -> None:
    """On a joining rank (group still local): bring each DDP to the donor's layout state."""
    ddps = live()
    if len(ddps) != len(layouts):
        raise WorkerError(f"the donor had {len(layouts)} DDP models, this joining rank built {len(ddps)}",
                          hint="build the same DDP models before torchpass.register() on every rank",
                          rank=group.rank())
    for ddp, layout in zip(ddps, layouts, strict=True):
        if layout["state"] == "fresh":
            continue
        # As after a first backward: every parameter is queued for the bucket rebuild.
        ddp.reducer._push_all_rebuilt_params()
        if layout["state"] == "pending":
            continue  # the rebuild happens live, with everyone, on the next forward
        buckets = layout["buckets"]
        flat = [i for bucket in buckets for i in bucket]
        indices = torch.tensor([*flat, len(buckets)], dtype=torch.int32)
        sizes = torch.tensor([len(b) for b in buckets], dtype=torch.int32)
        with group.answering_broadcasts([indices, sizes]):
            if not ddp.reducer._rebuild_buckets():
                raise WorkerError("the joining rank's DDP did not rebuild its buckets",
                                  hint="DDP options must match the donor's", rank=group.rank())
        ddp._has_rebuilt_buckets = True
        ddp._torchpass_buckets = buckets
