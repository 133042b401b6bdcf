"""Turning a nested state (dicts, lists, tuples, OrderedDicts of tensors, files, byte buffers and
plain values) into a msgpack skeleton plus a list of leaves that travel as raw bytes, and back.
Plain values go as msgpack; values msgpack cannot express (numpy arrays and scalars, huge ints,
sets, ...) go as pickle, read back by safe_pickle's unpickler (an allow-list of globals, each
bounded in cost), checked on both ends: nothing executable crosses the wire. Knows nothing of
sockets."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from launchpad.wormhole.payload import File
from launchpad.wormhole.safe_pickle import HINT, RefusedGlobal, safe_loads
from torchpass_common.errors import WormholeError

_EXT_TUPLE, _EXT_LEAF, _EXT_ODICT, _EXT_PICKLE = 1, 2, 3, 4
_LEAF_TYPES = (torch.Tensor, bytearray, memoryview, File)

@dataclass(frozen=True)
class Leaf:
    """A value that travels as raw bytes, and where it sits in the state (for error messages)."""

    path: str
    value: Any


class _Marker:
    __slots__ = ("kind", "data")

    def __init__(self, kind: int, data: Any) -> None:
        self.kind, self.data = kind, data


def _pickled(obj: Any, path: str) -> bytes:
    """``obj`` pickled, checked at the sender with the receiver's own allow-list, so that a state
    the receiver would refuse fails before any migration starts."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if type(obj) is not int:  # a huge int pickles without globals
        try:
            safe_loads(data)
        except RefusedGlobal as exc:
            raise WormholeError(f"state value at {path or '<root>'} ({type(obj).__module__}.{type(obj).__qualname__}) "
                                f"cannot be sent: it pickles as {exc.name}, which receivers refuse",
                                hint=HINT.format(name=exc.name)) from None
    return data


def _walk(obj: Any, path: str, leaves: list[Leaf]) -> Any:
    if isinstance(obj, _LEAF_TYPES):
        leaves.append(Leaf(path or "<root>", obj))
        return _Marker(_EXT_LEAF, len(leaves) - 1)
    kind = type(obj)
    if kind is dict:
        return {_walk(k, f"{path}<key>", leaves): _walk(v, f"{path}[{k!r}]", leaves) for k, v in obj.items()}
    if kind is OrderedDict:
        return _Marker(_EXT_ODICT, [[_walk(k, f"{path}<key>", leaves), _walk(v, f"{path}[{k!r}]", leaves)]
                                    for k, v in obj.items()])
    if kind is list:
        return [_walk(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)]
    if kind is tuple:
        return _Marker(_EXT_TUPLE, [_walk(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)])
    if kind in (str, bytes, float, bool, type(None)) or (kind is int and -(1 << 63) <= obj < 1 << 64):
        return obj
    return _Marker(_EXT_PICKLE, _pickled(obj, path))  # numpy arrays, huge ints, sets: not msgpack


def _pack(tree: Any) -> bytes:
    return msgpack.packb(tree, default=_default, strict_types=True, use_bin_type=True)


def _default(obj: Any) -> msgpack.ExtType:
    if not isinstance(obj, _Marker):
        raise TypeError(f"unexpected {type(obj).__name__} in a wormhole skeleton")
    if obj.kind == _EXT_LEAF:
        return msgpack.ExtType(_EXT_LEAF, obj.data.to_bytes(4, "big"))
    if obj.kind == _EXT_PICKLE:
        return msgpack.ExtType(_EXT_PICKLE, obj.data)
    return msgpack.ExtType(obj.kind, _pack(obj.data))


def flatten(state: Any) -> tuple[bytes, list[Leaf]]:
    """Split ``state`` into its msgpack skeleton and its raw-byte leaves (in traversal order)."""
    leaves: list[Leaf] = []
    try:
        skeleton = _pack(_walk(state, "", leaves))
    except (TypeError, ValueError, OverflowError, AttributeError, pickle.PicklingError) as exc:
        raise WormholeError(f"state cannot be serialised: {exc}",
                            hint="save() must return dicts/lists/tuples of tensors and plain values") from exc
    return skeleton, leaves


def leaves_of(state: Any) -> list[Leaf]:
    """The raw-byte leaves of ``state`` with their paths (used to index a receive template)."""
    return flatten(state)[1]


def unflatten(skeleton: bytes, values: list[Any]) -> Any:
    """Rebuild the state from its skeleton, putting ``values[i]`` where leaf ``i`` was. Pickled
    values are read with safe_pickle.SafeUnpickler: a global outside its ALLOWED raises RefusedGlobal."""

    def hook(code: int, data: bytes) -> Any:
        if code == _EXT_LEAF:
            return values[int.from_bytes(data, "big")]
        if code == _EXT_PICKLE:
            return safe_loads(data)
        inner = msgpack.unpackb(data, ext_hook=hook, strict_map_key=False, raw=False)
        if code == _EXT_TUPLE:
            return tuple(inner)
        if code == _EXT_ODICT:
            return OrderedDict((k, v) for k, v in inner)
        raise WormholeError(f"unknown skeleton extension type {code}", hint="sender and receiver versions differ")

    try:
        return msgpack.unpackb(skeleton, ext_hook=hook, strict_map_key=False, raw=False)
    except (ValueError, IndexError, TypeError, msgpack.UnpackException) as exc:
        raise WormholeError(f"state skeleton is malformed: {exc}") from exc
