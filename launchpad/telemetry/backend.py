"""The narrow interface between the telemetry collector and NVML: open the library and list
GPUs, read one probe of one GPU, drain XID events without blocking. Two implementations: the
real one on nvidia-ml-py (pynvml_backend.py) and a replay of recorded sequences (replay.py,
for tests and drills only). Errors are classified here so the collector never sees pynvml's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torchpass_common.errors import TorchPassError

Scalar = int | float | bool | str
# One NVML reading per probe; each returns a flat dict of named fields.
PROBES = ("ecc_volatile", "ecc_aggregate", "retired_pages", "row_remap", "nvlink", "temperature",
          "power", "throttle")
XID_PROBE = "xid"  # named in a GPU's "unsupported" list when it cannot deliver XID events


class TelemetryError(TorchPassError):
    """NVML could not deliver a reading; the subclass says why."""


class NoNvml(TelemetryError):
    """No NVML on this machine (no driver, no library, no GPU): telemetry stays off."""


class Unsupported(TelemetryError):
    """This GPU or driver does not support the function (reported, never fatal)."""


class GpuLost(TelemetryError):
    """The GPU no longer answers (NVML_ERROR_GPU_IS_LOST, reset required, not found)."""


class NvmlFailure(TelemetryError):
    """Any other NVML error for one reading (permissions, timeout, unknown)."""


@dataclass(frozen=True)
class GpuIdentity:
    """One GPU as NVML enumerates it."""

    index: int
    uuid: str
    name: str


class NvmlBackend(Protocol):
    """What the collector needs from NVML (or from a recording of it)."""

    name: str

    def open(self) -> list[GpuIdentity]:
        """Initialise; the GPUs to watch. Raises NoNvml when there is no NVML at all."""
        ...

    def read(self, index: int, probe: str) -> dict[str, Scalar]:
        """One probe of GPU ``index``; raises Unsupported, GpuLost or NvmlFailure."""
        ...

    def xid_events(self) -> list[tuple[int, int]]:
        """(gpu index, XID) events since the last call, without blocking."""
        ...

    def unsupported_xid(self) -> set[int]:
        """GPUs whose XID events could not be registered."""
        ...

    def tick(self) -> float:
        """Called once at the start of every sample; returns its wall-clock time (a replay
        moves to its next recorded step and returns the recorded time)."""
        ...

    def close(self) -> None:
        ...
