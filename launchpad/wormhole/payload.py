"""The raw-byte leaves of a state, sender side: a Source is a small header (dtype, shape, strides,
size) plus a memoryview straight onto tensor, file or buffer memory; also the byte-level helpers
both sides share. CUDA tensors are staged whole through (pinned) host buffers: written for GPUs,
not testable on this CPU-only VM. The receiving side is sinks.py."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from torchpass_common.errors import WormholeError

DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
EMPTY = memoryview(b"")


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
        return EMPTY
    flat = t.detach().as_strided((t.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())


def host_staging(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """An empty host tensor like ``t`` with ``stride``; pinned when CUDA is present so device<->host
    copies run at full speed (that path is untested here: no GPU)."""
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, pin_memory=torch.cuda.is_available())


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides for ``shape``."""
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
            unmap(self.view, self._keep)


def unmap(view: memoryview, mm: mmap.mmap) -> None:
    """Release ``view`` and close the file mapping behind it."""
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
    stride = t.stride() if is_dense(t) else contiguous_stride(tuple(t.shape))
    if t.device.type != "cpu":
        t = host_staging(t, stride).copy_(t)
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
    return Source({"k": "file", "p": path, "name": name, "n": size}, memoryview(mm) if mm else EMPTY, mm)


def make_source(value: Any, path: str) -> Source:
    """The Source for one leaf found by layout.flatten."""
    if isinstance(value, torch.Tensor):
        return tensor_source(value, path)
    if isinstance(value, File):
        return file_source(value, path)
    return buffer_source(value, path)
