"""Reading the pickled values of a wormhole skeleton (what msgpack cannot express: numpy arrays,
dtypes and scalars, huge ints, deques, ...) without trusting the sender. Only the globals in
ALLOWED may be named, each in a form whose cost is bounded by the bytes received: numpy's
``_reconstruct`` only as numpy's own pickles call it (an empty array the data then fills), the
plain types only as zero-argument factories (a defaultdict's), a deque only from a list. The memo
is a dict (the pure-Python unpickler: the C one allocates up to the largest memo index a pickle
names) and no declared length may exceed the pickle's own. Anything else is refused (RefusedGlobal, a WormholeError): nothing executable, no memory
bomb. Writing pickles is layout.py's."""

from __future__ import annotations

import collections
import importlib
import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from torchpass_common.errors import WormholeError

HINT = "the state's save() returned a {name}; return tensors, numpy arrays and plain values"


class RefusedGlobal(WormholeError):
    """A pickled value names a global outside ALLOWED, or calls one in a way that is not bounded
    (``name``: module.qualname)."""

    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(f"refused to unpickle {name}{why}: only tensors, numpy arrays and plain values may "
                         "cross the wormhole", hint=HINT.format(name=name))
        self.name = name


class _Factory:
    """A plain type as a defaultdict's factory: called with no argument only (``list(range(10**10))``
    in a pickle would be a memory bomb)."""

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            raise RefusedGlobal(f"builtins.{self.kind.__name__}", " with arguments")
        return self.kind()

    def __repr__(self) -> str:
        return self.kind.__name__


def _numpy(module: str, name: str) -> Any:
    for core in ("numpy._core.", "numpy.core."):  # the installed numpy's home of the object
        try:
            return getattr(importlib.import_module(core + module), name)
        except (ImportError, AttributeError):
            continue
    raise RefusedGlobal(f"numpy.core.{module}.{name}", " (not in this numpy)")


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
    """numpy's own pickles call ``_reconstruct(ndarray, (0,), b'b')`` and fill the array from the
    data that follows; any other shape would allocate what the sender names."""
    if subtype is not np.ndarray or tuple(shape) != (0,):
        raise RefusedGlobal("numpy.core.multiarray._reconstruct", f" for {shape!r}")
    return _numpy("multiarray", "_reconstruct")(subtype, shape, dtype)


def _deque(iterable: Any = (), maxlen: Any = None) -> collections.deque[Any]:
    if not isinstance(iterable, list | tuple) or not (maxlen is None or isinstance(maxlen, int)):
        raise RefusedGlobal("collections.deque", f" from a {type(iterable).__name__}")
    return collections.deque(iterable, maxlen)


_PLAIN = (set, frozenset, list, dict, tuple, int, float, bool, str)
ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    **{(f"numpy.{core}.multiarray", "_reconstruct"): lambda: _reconstruct for core in ("core", "_core")},
    **{(f"numpy.{core}.multiarray", "scalar"): lambda: _numpy("multiarray", "scalar") for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): lambda: _numpy("numeric", "_frombuffer")
       for core in ("core", "_core")},
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    **{("builtins", kind.__name__): (lambda kind=kind: _Factory(kind)) for kind in _PLAIN},
    ("builtins", "complex"): lambda: complex,
    ("builtins", "slice"): lambda: slice,
    ("builtins", "range"): lambda: range,
    ("collections", "OrderedDict"): lambda: collections.OrderedDict,
    ("collections", "defaultdict"): lambda: collections.defaultdict,
    ("collections", "deque"): lambda: _deque,
}


def _load_bytearray8(self: SafeUnpickler) -> None:
    """BYTEARRAY8, allocating no more than the pickle holds (the stock one makes the bytearray of
    the declared size first)."""
    (size,) = struct.unpack("<Q", self.read(8))
    if size > self.size:
        raise pickle.UnpicklingError(f"a bytearray of {size} bytes declared in a pickle of {self.size}")
    buf = bytearray(size)
    self.readinto(buf)
    self.append(buf)


class SafeUnpickler(pickle._Unpickler):  # noqa: SLF001 - the pure-Python one: its memo is a dict
    """Globals from ALLOWED only (no persistent ids, no out-of-band buffers); ``size``: the
    pickle's length, which no value it declares may exceed."""

    dispatch = {**pickle._Unpickler.dispatch, pickle.BYTEARRAY8[0]: _load_bytearray8}  # noqa: SLF001

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.size = len(data)

    def find_class(self, module: str, name: str) -> Any:
        make = ALLOWED.get((module, name))
        if make is None:
            raise RefusedGlobal(f"{module}.{name}")
        return make()


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` admitting only ALLOWED; RefusedGlobal or WormholeError otherwise."""
    try:
        return SafeUnpickler(data).load()
    except WormholeError:
        raise
    except Exception as exc:  # any malformed pickle: EOFError, UnpicklingError, TypeError, MemoryError...
        raise WormholeError(f"a pickled value in the state skeleton is malformed: {type(exc).__name__}: {exc}",
                            hint="sender and receiver versions differ, or the stream was tampered with") from exc
