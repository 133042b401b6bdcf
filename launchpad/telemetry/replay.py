"""A FAKE NVML backend that replays a recorded counter sequence (torchpassd/drill_jobs/health/*.json, or what
contrib/gpu-check recorded on a real GPU). Used only by tests and by drills: these machines have
no GPU. Each sample moves one recorded step forward and the sample time advances by the
recording's interval, so a replay is deterministic however fast it is played.

Format: {"interval_s": 5, "gpus": [{"index", "uuid", "name"}], "steps": [{"gpus": {"0": {probe:
{field: value} | "unsupported" | "error: text"} | "lost"}, "xids": [[gpu, xid], ...]}]}. A step
lists only what changed (fields carry forward); a probe never recorded is unsupported;
top-level "nvml": "absent" replays a machine without NVML."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from launchpad.telemetry.backend import (
    PROBES,
    XID_PROBE,
    GpuIdentity,
    GpuLost,
    NoNvml,
    NvmlFailure,
    Scalar,
    TelemetryError,
    Unsupported,
)


class ReplayBackend:
    """Plays ``recording`` (a parsed recording dict) one step per sample; the last step repeats."""

    name = "replay"

    def __init__(self, recording: dict[str, Any], *, source: str = "<recording>", start: float | None = None) -> None:
        self.source = source
        self.rec = recording
        self.interval = float(recording.get("interval_s", 5.0))
        self.start = time.time() if start is None else start
        self.step = -1
        self._probes: dict[int, dict[str, Any]] = {}
        self._lost: set[int] = set()
        self._xids: list[tuple[int, int]] = []

    @classmethod
    def from_file(cls, path: str | Path, *, start: float | None = None) -> ReplayBackend:
        try:
            rec = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise TelemetryError(f"cannot read the GPU recording {path}: {exc}",
                                 hint="point TORCHPASS_HEALTH_REPLAY at a file like torchpassd/drill_jobs/health/degrading.json") from exc
        return cls.validated(rec, str(path), start=start)

    @classmethod
    def validated(cls, rec: Any, source: str, *, start: float | None = None) -> ReplayBackend:
        """A replay of ``rec`` once it has the recording's shape (TelemetryError if not)."""
        if not isinstance(rec, dict) or not isinstance(rec.get("steps"), list) or not rec["steps"]:
            raise TelemetryError(f"GPU recording {source} has no steps", hint="see launchpad/telemetry/replay.py for the format")
        return cls(rec, source=source, start=start)

    def open(self) -> list[GpuIdentity]:
        if self.rec.get("nvml") == "absent":
            raise NoNvml(f"no NVML (replayed from {self.source})")
        gpus = [GpuIdentity(int(g["index"]), str(g["uuid"]), str(g["name"])) for g in self.rec.get("gpus", [])]
        self._probes = {g.index: {} for g in gpus}
        return gpus

    def tick(self) -> float:
        """Move to the next recorded step (stay on the last) and return its time."""
        steps = self.rec["steps"]
        if self.step + 1 < len(steps):
            self.step += 1
            self._apply(steps[self.step])
        return self.start + self.step * self.interval

    def _apply(self, step: dict[str, Any]) -> None:
        for key, entry in step.get("gpus", {}).items():
            index = int(key)
            if entry == "lost":
                self._lost.add(index)
                continue
            self._lost.discard(index)
            probes = self._probes.setdefault(index, {})
            for probe, value in entry.items():
                if isinstance(value, dict) and isinstance(probes.get(probe), dict):
                    probes[probe] = {**probes[probe], **value}
                else:
                    probes[probe] = value
        self._xids.extend((int(g), int(x)) for g, x in step.get("xids", []))

    def read(self, index: int, probe: str) -> dict[str, Scalar]:
        if probe not in PROBES:
            raise ValueError(f"unknown probe {probe!r}")
        if index in self._lost:
            raise GpuLost(f"{probe}: GPU is lost (replayed)", gpu=index)
        value = self._probes.get(index, {}).get(probe, "unsupported")
        if value == "unsupported":
            raise Unsupported(f"{probe}: Not Supported (replayed)", gpu=index)
        if isinstance(value, str):
            raise NvmlFailure(f"{probe}: {value} (replayed)", gpu=index)
        return dict(value)

    def xid_events(self) -> list[tuple[int, int]]:
        found, self._xids = self._xids, []
        return found

    def unsupported_xid(self) -> set[int]:
        return {i for i, probes in self._probes.items() if probes.get(XID_PROBE) == "unsupported"}

    def close(self) -> None:
        self._xids = []
