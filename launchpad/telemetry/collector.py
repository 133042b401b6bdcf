"""The per-node GPU collector: one :meth:`Collector.sample` reads every probe of every GPU
through an NvmlBackend, each reading guarded on its own (a probe the GPU does not support is
listed as unsupported, a GPU that stopped answering is reported as such, nothing raises), and
keeps cumulative XID counts. Without NVML it says so once and samples nothing."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from launchpad.telemetry.backend import (
    PROBES,
    XID_PROBE,
    GpuIdentity,
    GpuLost,
    NoNvml,
    NvmlBackend,
    NvmlFailure,
    TelemetryError,
    Unsupported,
)
from torchpass_common import log

ABSENT = "absent"  # the "nvml" value of a sample from a machine without NVML
FAILED = "failed"  # ... and from one whose NVML would not start (driver trouble, a GPU lost at start)


class Collector:
    """Samples the GPUs of one node. ``open()`` once, then ``sample()`` at the sampling rate."""

    def __init__(self, backend: NvmlBackend, *, node: str = "") -> None:
        self.backend = backend
        self.gpus: list[GpuIdentity] = []
        self.available = False
        self.status = ABSENT  # the "nvml" value of samples while not available
        self.absent_reason = ""
        self._xids: dict[int, Counter[int]] = {}
        self._last_xid: dict[int, int] = {}
        self._reported: set[tuple[int, str]] = set()
        self._log = log.get(node=node or None)

    def open(self) -> bool:
        """Start NVML; False when this machine has none (logged once as ``health.no_nvml``) or
        when it would not start (``health.nvml_failed``: samples then say so, for operators)."""
        try:
            self.gpus = self.backend.open()
        except NoNvml as exc:
            self.absent_reason = exc.message
            self._log.info("health.no_nvml", reason=exc.message, backend=self.backend.name)
            return False
        except TelemetryError as exc:
            self.status, self.absent_reason = FAILED, exc.message
            self._log.error("health.nvml_failed", error=exc.message, backend=self.backend.name)
            self.backend.close()
            return False
        self.available = True
        self._xids = {g.index: Counter() for g in self.gpus}
        self._log.info("health.collector_open", backend=self.backend.name, gpus=len(self.gpus),
                       names=sorted({g.name for g in self.gpus}))
        return True

    def close(self) -> None:
        if self.available:
            self.backend.close()
            self.available = False

    def sample(self) -> dict[str, Any]:
        """``{"t", "nvml", "gpus": {index: {field: value}}}``; ``nvml`` is the backend's name, or
        "absent" / "failed" (with ``why``) when NVML is not available."""
        if not self.available:
            return {"t": time.time(), "nvml": self.status, "why": self.absent_reason, "gpus": {}}
        t = self.backend.tick()
        self._collect_xids()
        no_xid = self.backend.unsupported_xid()
        return {"t": t, "nvml": self.backend.name,
                "gpus": {str(g.index): self._gpu(g, g.index in no_xid) for g in self.gpus}}

    def _collect_xids(self) -> None:
        try:
            events = self.backend.xid_events()
        except TelemetryError as exc:
            self._once(-1, "xid", "health.xid_wait_failed", error=exc.message)
            return
        for index, xid in events:
            self._xids.setdefault(index, Counter())[xid] += 1
            self._last_xid[index] = xid
            self._log.warning("health.xid", gpu=index, xid=xid)

    def _gpu(self, gpu: GpuIdentity, no_xid: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {"uuid": gpu.uuid, "name": gpu.name, "answering": True}
        unsupported, errors = [XID_PROBE] if no_xid else [], []
        for probe in PROBES:
            try:
                fields.update(self.backend.read(gpu.index, probe))
            except Unsupported:
                unsupported.append(probe)
                self._once(gpu.index, probe, "health.unsupported", probe=probe, level="info")
            except GpuLost as exc:
                fields = {"uuid": gpu.uuid, "name": gpu.name, "answering": False, "error": exc.message}
                self._once(gpu.index, "lost", "health.gpu_lost", error=exc.message)
                break
            except NvmlFailure as exc:
                errors.append(exc.message)
                self._once(gpu.index, exc.message, "health.read_failed", error=exc.message)
        for xid, count in sorted(self._xids.get(gpu.index, Counter()).items()):
            fields[f"xid_{xid}"] = count
        if gpu.index in self._last_xid:
            fields["xid_last"] = self._last_xid[gpu.index]
        if unsupported and fields["answering"]:
            fields["unsupported"] = ",".join(unsupported)
        if errors and fields["answering"]:
            fields["errors"] = "; ".join(errors)
        return fields

    def _once(self, gpu: int, key: str, event: str, *, level: str = "warning", **kw: Any) -> None:
        if (gpu, key) not in self._reported:
            self._reported.add((gpu, key))
            getattr(self._log, level)(event, gpu=gpu, **kw)
