"""Moving one rank's state to a joining rank: the hand-over record (the user's save() state plus
TorchPass's own: the step and the DDP bucket layouts), sent by the donor through the wormhole and
received on the joiner; the wormhole peer is launchpad's choice (``dest``), never a file path.
Sharded tensors (DTensor: FSDP2, HSDP, tensor parallel, a DCP state dict) travel as their local
shard; the joiner puts each back on its own mesh with the placements of its own state (it built
the same model and mesh), with no collective."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch.distributed.tensor import DTensor, Replicate

from torchpass_common.errors import ProtocolError, WorkerError
from torchpass_common.transfer_address import TransferAddress

FORMAT = 1
_SHARD = "__torchpass_local_shard__"  # marks a DTensor sent as {_SHARD: local tensor, "shape": [...]}


def record(user_state: Any, step: int, ddp: list[dict[str, Any]], *, rank: int = -1,
           groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The hand-over record for ``user_state`` taken after ``step`` completed steps by ``rank``,
    whose process groups are ``groups`` (group_identity.identities)."""
    return {"torchpass": {"format": FORMAT, "step": step, "ddp": ddp, "rank": rank, "groups": groups or []},
            "user": _local_shards(user_state)}


def _map(fn: Any, obj: Any, *others: Any) -> Any:
    """``obj`` with ``fn(leaf, *other_leaves)`` at each leaf, walking dicts, lists and tuples (and
    ``others`` of the same structure alongside, None where they lack a part)."""
    if isinstance(obj, dict) and _SHARD not in obj:
        out = {k: _map(fn, v, *(o.get(k) if isinstance(o, dict) else None for o in others)) for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if isinstance(obj, list | tuple):
        items = [_map(fn, v, *(o[i] if isinstance(o, list | tuple) and i < len(o) else None for o in others))
                 for i, v in enumerate(obj)]
        return type(obj)(items) if isinstance(obj, list) else tuple(items)
    return fn(obj, *others)


def _shard_position(t: DTensor) -> list[int | None]:
    """Which shard of ``t`` this rank holds: its mesh coordinate on each sharded dimension (None
    on replicated ones, where any replica holds the same data)."""
    coord = t.device_mesh.get_coordinate() or []
    return [None if isinstance(p, Replicate) else c for c, p in zip(coord, t.placements, strict=True)]


def _local_shards(state: Any) -> Any:
    return _map(lambda v: {_SHARD: v.to_local(), "shape": list(v.shape), "position": _shard_position(v)}
                if isinstance(v, DTensor) else v, state)


def sharded_like(state: Any, own: Any, *, rank: int) -> Any:
    """``state`` (a received record's user state) with each local shard a DTensor again, placed
    like the same entry of ``own`` (this rank's save() of the model it built)."""
    def place(value: Any, mine: Any) -> Any:
        if not (isinstance(value, dict) and _SHARD in value):
            return value
        if not isinstance(mine, DTensor) or list(mine.shape) != value["shape"]:
            raise WorkerError(f"the donor's state holds a sharded tensor of shape {value['shape']} where this "
                              f"rank's own state has {type(mine).__name__} {list(getattr(mine, 'shape', []))}",
                              hint="donor and joiner must build the same model on the same mesh", rank=rank)
        local = value[_SHARD]
        if value["position"] != _shard_position(mine):
            raise WorkerError(f"the donor holds shard {value['position']} of a sharded tensor, this rank needs shard "
                              f"{_shard_position(mine)}: the donor is no replica of this rank's state",
                              hint="only a rank at the same shard position (HSDP: another replica group) can "
                                   "donate; with pure FSDP or tensor parallel no replica exists", rank=rank)
        if local.shape != mine.to_local().shape:
            raise WorkerError(f"the donor's shard has shape {list(local.shape)}, this rank's "
                              f"{list(mine.to_local().shape)}: the ranks disagree about the mesh",
                              hint="every rank must build the same DeviceMesh", rank=rank)
        return DTensor.from_local(local.to(mine.device), mine.device_mesh, mine.placements, run_check=False,
                                  shape=mine.shape, stride=mine.stride())
    return _map(place, state, own)


def has_local_shards(state: Any) -> bool:
    found: list[bool] = []
    _map(lambda v: found.append(True) if isinstance(v, dict) and _SHARD in v else None, state)
    return bool(found)


def address(raw: Any, what: str, *, rank: int, hint: str) -> TransferAddress:
    """``raw`` (a TransferAddress on the wire) as an address, else WorkerError saying why."""
    try:
        return TransferAddress.parse(raw, what)
    except ProtocolError as exc:
        raise WorkerError(exc.message, hint=hint, rank=rank) from None


def send(rec: dict[str, Any], dest: TransferAddress, *, rank: int) -> int:
    """Deliver ``rec`` to the wormhole receiver at ``dest``; returns bytes moved."""
    from launchpad.wormhole import send_state  # launchpad ships with torchpass; imported on use

    stats = send_state(rec, dest.host, dest.port, dest.token, context={"rank": rank})
    return stats.bytes


class Incoming:
    """The joiner's end of a hand-over, described by ``source`` (TORCHPASS_JOIN_SOURCE): from
    construction on it can take the state (a wormhole receiver is listening). ``template``: a
    record whose tensors the wormhole fills, e.g. the joiner's own parameters. ``in_place``: the
    bytes land in the template's tensors directly, no staging copy of the state (for a rank whose
    own state is worthless if the receive fails: a fresh joiner, which then exits)."""

    def __init__(self, source: TransferAddress, *, rank: int, template: Any = None, in_place: bool = False) -> None:
        from launchpad.wormhole import StateReceiver

        self.rank = rank
        self._receiver = StateReceiver(source.host, source.port, source.token, template=template,
                                       in_place=in_place, context={"rank": rank})

    def receive(self, timeout: float) -> dict[str, Any]:
        """Wait up to ``timeout`` s for the donor's record."""
        with self._receiver:
            rec = self._receiver.receive(timeout)
        meta = rec.get("torchpass") if isinstance(rec, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise WorkerError("the received state is not a TorchPass hand-over record of format "
                              f"{FORMAT}", hint="donor and joiner must run the same TorchPass", rank=self.rank)
        return rec
