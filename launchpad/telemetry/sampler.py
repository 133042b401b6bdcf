"""launchpad's GPU sampling loop: opens the collector (real NVML, or for tests and drills the
replay that $TORCHPASS_HEALTH_REPLAY names, see :func:`replay_path`), samples every
health.sample_interval seconds on its own thread so a hung NVML call never blocks the agent's
loop (a sample that does not come back in time reports every GPU as not answering), and hands
the changes to each heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from launchpad.telemetry.backend import NvmlBackend
from launchpad.telemetry.collector import Collector
from launchpad.telemetry.encoding import DeltaEncoder
from launchpad.telemetry.pynvml_backend import PynvmlBackend
from launchpad.telemetry.replay import ReplayBackend
from torchpass_common import log
from torchpass_common.config import HealthConfig

REPLAY_ENV = "TORCHPASS_HEALTH_REPLAY"
MIN_HANG_S = 10.0  # a sample slower than max(this, 2 x interval) counts as NVML not answering


def replay_path(node: str, value: str) -> str | None:
    """The recording ``node`` replays: $TORCHPASS_HEALTH_REPLAY is PATH (every node) or
    NODE=PATH[,NODE=PATH...] (only those nodes; the others read their real NVML)."""
    if "=" not in value:
        return value or None
    paths = dict(entry.split("=", 1) for entry in value.split(",") if "=" in entry)
    return paths.get(node)


def open_backend(node: str = "") -> NvmlBackend:
    """The real NVML backend, or the replay fake when $TORCHPASS_HEALTH_REPLAY names a recording
    for this node (tests and drills only)."""
    path = replay_path(node, os.environ.get(REPLAY_ENV, ""))
    if path:
        log.get(node=node or None).warning("health.replay_in_use", recording=path)
        return ReplayBackend.from_file(path)
    return PynvmlBackend()


class Sampler:
    """``async with Sampler(cfg, node):`` samples in the background; :meth:`heartbeat_part`
    is the ``gpu`` entry of the next heartbeat (None when nothing new was sampled)."""

    def __init__(self, cfg: HealthConfig, node: str, backend: NvmlBackend | None = None) -> None:
        self.cfg, self.node = cfg, node
        self.collector = Collector(backend or open_backend(node), node=node)
        self.encoder = DeltaEncoder()
        self.latest: dict[str, Any] | None = None
        self.samples = 0
        self._fresh = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="launchpad-nvml")
        self._task: asyncio.Task[None] | None = None
        self._log = log.get(node=node)

    async def __aenter__(self) -> Sampler:
        if self.cfg.enabled:
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.submit(self.collector.close)
        self._pool.shutdown(wait=False)

    async def replay(self, recording: dict[str, Any], source: str) -> None:
        """From now on sample ``recording`` (the FAKE NVML replay) instead of this node's GPUs:
        the gpu-degrade drill's fault, sent by torchpassd on the operator's request."""
        backend = ReplayBackend.validated(recording, source)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        old, self.collector = self.collector, Collector(backend, node=self.node)
        await asyncio.get_running_loop().run_in_executor(self._pool, old.close)
        self.encoder, self.latest, self._fresh = DeltaEncoder(), None, False  # a keyframe of the new GPUs next
        self._log.warning("health.replay_in_use", recording=source)
        self._task = asyncio.create_task(self._run())

    def heartbeat_part(self) -> dict[str, Any]:
        """``{"gpu": <keyframe or delta>}`` for a new sample, else ``{}``."""
        if not self._fresh or self.latest is None:
            return {}
        self._fresh = False
        return {"gpu": self.encoder.encode(self.latest)}

    def _publish(self, sample: dict[str, Any]) -> None:
        self.latest, self._fresh = sample, True
        self.samples += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(self._pool, self.collector.open):
            self._publish(self.collector.sample())  # one "no NVML" (or "failed") report, then nothing
            return
        limit = max(MIN_HANG_S, 2 * self.cfg.sample_interval)
        while True:
            fut = loop.run_in_executor(self._pool, self.collector.sample)
            try:
                self._publish(await asyncio.wait_for(asyncio.shield(fut), limit))
            except TimeoutError:
                self._log.error("health.nvml_hung", seconds=limit)
                self._publish(self._not_answering(limit))
                self._publish(await fut)
            await asyncio.sleep(self.cfg.sample_interval)

    def _not_answering(self, limit: float) -> dict[str, Any]:
        error = f"NVML did not answer within {limit:.0f} s"
        return {"t": time.time(), "nvml": self.collector.backend.name,
                "gpus": {str(g.index): {"uuid": g.uuid, "name": g.name, "answering": False, "error": error}
                         for g in self.collector.gpus}}
