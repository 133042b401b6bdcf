#!/usr/bin/env python3
"""Run TorchPass's REAL GPU telemetry collector on a machine with NVIDIA GPUs and record what it
read: every probe's raw outcome per sample, in the replay format of launchpad/telemetry/replay.py
(so a real GPU's sequence can be replayed by tests and drills), plus the collector's samples.
It then replays the recording through the same collector and checks it reads the same values.

    .venv/bin/python contrib/gpu-check/gpu_check.py --samples 5 --interval 1 --out gpu-check.json

Exit 0: GPUs read and the replay matches; 3: no NVML on this machine; 1: a mismatch or an error."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launchpad.telemetry.backend import GpuIdentity, GpuLost, NvmlBackend, Scalar, Unsupported  # noqa: E402
from launchpad.telemetry.collector import Collector  # noqa: E402
from launchpad.telemetry.replay import ReplayBackend  # noqa: E402
from launchpad.telemetry.sampler import open_backend  # noqa: E402
from torchpass_common.errors import TorchPassError  # noqa: E402


class RecordingBackend:
    """Wraps a backend and writes down each probe's outcome per sample, in replay format."""

    def __init__(self, inner: NvmlBackend) -> None:
        self.inner, self.name = inner, inner.name
        self.gpus: list[GpuIdentity] = []
        self.steps: list[dict[str, Any]] = []

    def open(self) -> list[GpuIdentity]:
        self.gpus = self.inner.open()
        return self.gpus

    def tick(self) -> float:
        no_xid = self.inner.unsupported_xid() if self.gpus else set()
        self.steps.append({"gpus": {str(i): {"xid": "unsupported"} for i in no_xid}, "xids": []})
        return self.inner.tick()

    def read(self, index: int, probe: str) -> dict[str, Scalar]:
        gpus = self.steps[-1]["gpus"]
        try:
            value = self.inner.read(index, probe)
        except Unsupported:
            gpus.setdefault(str(index), {})[probe] = "unsupported"
            raise
        except GpuLost:
            gpus[str(index)] = "lost"
            raise
        except TorchPassError as exc:
            gpus.setdefault(str(index), {})[probe] = f"error: {exc.message}"
            raise
        gpus.setdefault(str(index), {})[probe] = value
        return value

    def xid_events(self) -> list[tuple[int, int]]:
        events = self.inner.xid_events()
        self.steps[-1]["xids"] = [list(e) for e in events]
        return events

    def unsupported_xid(self) -> set[int]:
        return self.inner.unsupported_xid()

    def close(self) -> None:
        self.inner.close()


def _without_time(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "t"} for s in samples]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--out", default="gpu-check.json", help="where to write the recording")
    args = ap.parse_args(argv)

    rec = RecordingBackend(open_backend("gpu-check"))
    collector = Collector(rec, node="gpu-check")
    if not collector.open():
        print(f"gpu-check: no NVML on this machine ({collector.absent_reason}); nothing to record")
        return 3
    t0 = time.monotonic()
    samples = []
    for i in range(args.samples):
        if i:
            time.sleep(args.interval)
        samples.append(collector.sample())
    seconds = time.monotonic() - t0
    collector.close()
    recording = {"description": f"recorded by contrib/gpu-check on {time.strftime('%Y-%m-%d %H:%M:%S')} "
                                f"through the {rec.name} backend",
                 "interval_s": args.interval, "gpus": [vars(g) for g in rec.gpus], "steps": rec.steps}

    replayed = Collector(ReplayBackend(json.loads(json.dumps(recording)), start=0.0), node="gpu-check")
    replayed.open()
    again = [replayed.sample() for _ in samples]
    matches = _without_time(again) == _without_time(samples)
    Path(args.out).write_text(json.dumps({"recording": recording, "samples": samples, "replay_matches": matches,
                                          "sample_seconds": round(seconds / len(samples), 4)}, indent=1))
    for gpu, fields in samples[-1]["gpus"].items():
        print(f"GPU{gpu} {fields.get('name')}: " + ", ".join(f"{k}={v}" for k, v in sorted(fields.items())
                                                           if k not in ("name", "uuid")))
    print(f"gpu-check: {len(rec.gpus)} GPU(s), {len(samples)} samples, "
          f"{1000 * seconds / len(samples):.1f} ms per sample incl. sleeps; replay matches: {matches}; wrote {args.out}")
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())
