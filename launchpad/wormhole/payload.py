"""The raw-byte leaves of a state on each side of the wormhole. Sender: a Source is a spec (small
header: dtype, shape, strides, size) plus a memoryview straight onto tensor, file or buffer
memory. Receiver: a Sink is the memory a leaf is received into, committed only after every chunk
verified, or aborted leaving the template, files and caller state as they were. CUDA tensors are
staged whole through (pinned) host buffers: written for GPUs, not testable on this CPU-only VM."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchpass_common.errors import WormholeError

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_EMPTY = memoryview(b"")


@dataclass(frozen=True)
class File:
    """A file moved by content (e.g. a CRIU image); it arrives as a ``pathlib.Path`` inside the
    receiver's ``files_dir`` under ``name`` (default: the file's base name)."""

    path: str | os.PathLike[str]
    name: str | None = None


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements (any dim order, no gaps,
    no overlap): its memory can then be sent and received as one byte range, strides kept."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def byte_view(t: torch.Tensor) -> memoryview:
    """A memoryview onto the bytes of a dense CPU tensor, in memory order (no copy)."""
    if t.numel() == 0:
        return _EMPTY
    flat = t.detach().as_strided((t.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())


def _host_staging(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    # Pinned when CUDA is present so device<->host copies run at full speed (untested here: no GPU).
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, pin_memory=torch.cuda.is_available())


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


@dataclass
class Source:
    """Sender side of one leaf: its header and the bytes to send."""

    spec: dict[str, Any]
    view: memoryview
    _keep: Any = field(default=None, repr=False)  # object owning the memory behind ``view``

    def close(self) -> None:
        if isinstance(self._keep, mmap.mmap):
            _unmap(self.view, self._keep)


def _unmap(view: memoryview, mm: mmap.mmap) -> None:
    view.release()
    try:
        mm.close()
    except BufferError:
        pass  # a stream thread abandoned at the deadline still holds a slice; GC unmaps it later


def tensor_source(t: torch.Tensor, path: str) -> Source:
    """Header + zero-copy view of a tensor. Dense tensors (contiguous or permuted) go as they lie in
    memory with their strides; tensors with gaps or overlap are compacted (a copy of that tensor only)."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise WormholeError(f"tensor at {path} has layout {t.layout} on {t.device}, which the wormhole "
                            "cannot send", hint="convert it in save() (to_dense(), dequantize())")
    t = t.detach().resolve_conj().resolve_neg()
    stride = t.stride() if is_dense(t) else _contiguous_stride(tuple(t.shape))
    if t.device.type != "cpu":
        t = _host_staging(t, stride).copy_(t)
    elif stride != t.stride():
        t = t.contiguous()
    spec = {"k": "tensor", "p": path, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "stride": list(stride), "n": t.numel() * t.element_size()}
    return Source(spec, byte_view(t), t)


def buffer_source(buf: bytearray | memoryview, path: str) -> Source:
    view = memoryview(buf).cast("B")
    return Source({"k": "buffer", "p": path, "n": len(view)}, view, buf)


def file_source(f: File, path: str) -> Source:
    name = f.name or os.path.basename(os.fspath(f.path))
    try:
        with open(f.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            mm = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) if size else None
    except OSError as exc:
        raise WormholeError(f"cannot read file {f.path} for {path}: {exc.strerror or exc}") from exc
    return Source({"k": "file", "p": path, "name": name, "n": size}, memoryview(mm) if mm else _EMPTY, mm)


def make_source(value: Any, path: str) -> Source:
    """The Source for one leaf found by layout.flatten."""
    if isinstance(value, torch.Tensor):
        return tensor_source(value, path)
    if isinstance(value, File):
        return file_source(value, path)
    return buffer_source(value, path)


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
    staging = _host_staging(target, target.stride() if dense else _contiguous_stride(tuple(target.shape)))
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
        dtype, shape, stride = _DTYPES[spec["dtype"]], tuple(spec["shape"]), tuple(spec["stride"])
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
        super().__init__(spec, memoryview(self._mm) if self._mm else _EMPTY)

    def _unmap(self) -> None:
        if self._mm is not None:
            _unmap(self.view, self._mm)
            self._mm = None

    def commit(self) -> Path:
        if self._mm is not None:
            self._mm.flush()
        self._unmap()
        os.replace(self._part, self.final)
        return self.final

    def abort(self) -> None:
        self._unmap()
        self._part.unlink(missing_ok=True)


def check_spec(spec: Any) -> dict[str, Any]:
    """Validate one leaf header from the manifest; raise WormholeError naming what is wrong."""
    ok = isinstance(spec, dict) and isinstance(spec.get("p"), str) and isinstance(spec.get("n"), int) \
        and spec["n"] >= 0 and spec.get("k") in ("tensor", "buffer", "file")
    if ok and spec["k"] == "tensor":
        shape, stride = spec.get("shape"), spec.get("stride")
        ok = spec.get("dtype") in _DTYPES and isinstance(shape, list) and isinstance(stride, list) \
            and len(shape) == len(stride) and all(isinstance(x, int) and x >= 0 for x in shape + stride)
        if ok:
            meta = torch.empty_strided(shape, stride, dtype=_DTYPES[spec["dtype"]], device="meta")
            ok = is_dense(meta) and spec["n"] == meta.numel() * meta.element_size()
    if not ok:
        raise WormholeError(f"malformed leaf header in the manifest: {spec!r:.200}",
                            hint="sender and receiver run different TorchPass versions")
    return spec
