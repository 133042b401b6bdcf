"""The raw-byte leaves of a state, receiver side: a Sink is the memory a leaf is received into
(a template's tensor or its pre-faulted staging buffer, a fresh tensor, a file via mmap, a byte
buffer), committed only after every chunk verified, or aborted leaving the template, files and
caller state as they were. Also the validation of leaf headers from an untrusted manifest."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launchpad.wormhole.payload import (
    DTYPES,
    EMPTY,
    byte_view,
    contiguous_stride,
    host_staging,
    is_dense,
    unmap,
)
from torchpass_common.errors import WormholeError


@dataclass
class Slot:
    """A template tensor (returned as is, so callers keep their objects) and the pre-allocated,
    pre-faulted buffer its bytes are received into (a detached alias of it when in place)."""

    target: torch.Tensor
    buffer: torch.Tensor


def make_slot(target: torch.Tensor, in_place: bool) -> Slot:
    """Prepare a template tensor for receiving: in place when allowed and possible (dense CPU),
    else into a touched staging buffer of the same layout that is copied over on commit."""
    dense = is_dense(target)
    if in_place and dense and target.device.type == "cpu":
        return Slot(target, target.detach())
    staging = host_staging(target, target.stride() if dense else contiguous_stride(tuple(target.shape)))
    staging.zero_()  # fault the pages in now, before the pause, not while bytes arrive
    return Slot(target, staging)


class Sink:
    """Receiver side of one leaf: ``view`` is where its bytes land; ``commit`` returns the value
    for the rebuilt state; ``abort`` undoes everything visible outside the receiver."""

    def __init__(self, spec: dict[str, Any], view: memoryview) -> None:
        self.spec = spec
        self.path: str = spec["p"]
        self.view = view

    def commit(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        """Nothing to undo for memory that only the receiver holds."""


class TensorSink(Sink):
    """Receives into the template's buffer when the layouts agree, else into a fresh tensor."""

    def __init__(self, spec: dict[str, Any], slot: Slot | None) -> None:
        dtype, shape, stride = DTYPES[spec["dtype"]], tuple(spec["shape"]), tuple(spec["stride"])
        self._target = slot.target if slot else None
        if slot is not None and (slot.target.dtype != dtype or tuple(slot.target.shape) != shape):
            raise WormholeError(
                f"tensor at {spec['p']} is {spec['dtype']}{list(shape)} but the receive template has "
                f"{str(slot.target.dtype).removeprefix('torch.')}{list(slot.target.shape)}",
                hint="the joiner must build the same model and optimizer as the sender")
        if slot is not None and slot.buffer.stride() == stride:
            self._buffer = slot.buffer
        else:
            self._buffer = torch.empty_strided(shape, stride, dtype=dtype)
        super().__init__(spec, byte_view(self._buffer))

    def commit(self) -> torch.Tensor:
        if self._target is None:
            return self._buffer
        if self._buffer.data_ptr() != self._target.data_ptr():
            with torch.no_grad():
                _bit_copy(self._target, self._buffer)
        return self._target


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the exact bits (a value copy would turn a bool byte 0x05 into 0x01)."""
    as_int = _SAME_SIZE_INT.get(src.element_size())
    if as_int is None:  # complex128: 16-byte elements, copied by value (exact for same dtype)
        dst.copy_(src)
    else:
        dst.view(as_int).copy_(src.view(as_int))


class BufferSink(Sink):
    def __init__(self, spec: dict[str, Any]) -> None:
        self._buf = bytearray(spec["n"])
        super().__init__(spec, memoryview(self._buf))

    def commit(self) -> bytearray:
        return self._buf


class FileSink(Sink):
    """Receives into ``<files_dir>/<name>.part`` through a writable mmap; renamed on commit,
    deleted on abort."""

    def __init__(self, spec: dict[str, Any], files_dir: Path) -> None:
        name = spec["name"]
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
            raise WormholeError(f"file name {name!r} for {spec['p']} is not a plain file name")
        self.final = files_dir / name
        self._part = files_dir / (name + ".part")
        self._mm: mmap.mmap | None = None
        with open(self._part, "w+b") as fh:
            fh.truncate(spec["n"])
            if spec["n"]:
                self._mm = mmap.mmap(fh.fileno(), spec["n"])
        super().__init__(spec, memoryview(self._mm) if self._mm else EMPTY)

    def unmap(self) -> None:
        if self._mm is not None:
            unmap(self.view, self._mm)
            self._mm = None

    def commit(self) -> Path:
        if self._mm is not None:
            self._mm.flush()
        self.unmap()
        os.replace(self._part, self.final)
        return self.final

    def abort(self) -> None:
        self.unmap()
        self._part.unlink(missing_ok=True)


def check_spec(spec: Any) -> dict[str, Any]:
    """Validate one leaf header from the manifest; raise WormholeError naming what is wrong."""
    ok = isinstance(spec, dict) and isinstance(spec.get("p"), str) and isinstance(spec.get("n"), int) \
        and spec["n"] >= 0 and spec.get("k") in ("tensor", "buffer", "file")
    if ok and spec["k"] == "tensor":
        shape, stride = spec.get("shape"), spec.get("stride")
        ok = spec.get("dtype") in DTYPES and isinstance(shape, list) and isinstance(stride, list) \
            and len(shape) == len(stride) and all(isinstance(x, int) and x >= 0 for x in shape + stride)
        if ok:
            meta = torch.empty_strided(shape, stride, dtype=DTYPES[spec["dtype"]], device="meta")
            ok = is_dense(meta) and spec["n"] == meta.numel() * meta.element_size()
    if not ok:
        raise WormholeError(f"malformed leaf header in the manifest: {spec!r:.200}",
                            hint="sender and receiver run different TorchPass versions")
    return spec
