"""torchpassd's side of GPU health: decodes the ``gpu`` part of each launchpad heartbeat
(launchpad/telemetry/encoding.py), feeds the HealthPolicy, and carries out its decisions:
journal event ``health.decision`` with the evidence, the decisions metric, then drain the node
in Slurm (the normal planned migration follows) or ask for a migration directly. Also answers
"what is each node's latest GPU health" for torchpassctl."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from launchpad.telemetry.collector import ABSENT, FAILED
from launchpad.telemetry.encoding import DeltaDecoder
from torchpass_common import log
from torchpass_common.config import HealthConfig
from torchpass_common.errors import ProtocolError, TorchPassError
from torchpassd.health_policy import Decision, HealthPolicy
from torchpassd.journal import Journal
from torchpassd.metrics import Counter

DrainFn = Callable[[str, str], Awaitable[None]]  # (node, reason)
MigrateFn = Callable[[str, str, str], None]  # (job, node, reason)


class HealthWatch:
    """One per torchpassd. ``counter`` is the decisions metric (labels signal, action)."""

    def __init__(self, cfg: HealthConfig, journal: Journal, *, drain: DrainFn, migrate: MigrateFn,
                 counter: Counter) -> None:
        self.policy = HealthPolicy(cfg)
        self.enabled = cfg.enabled
        self._ignored: set[str] = set()  # nodes whose GPU telemetry arrived while the policy is off (logged once)
        self.journal, self.drain, self.migrate, self.counter = journal, drain, migrate, counter
        self._decoders: dict[tuple[str, str], DeltaDecoder] = {}
        self._acting: set[asyncio.Task[None]] = set()
        self._log = log.get()

    async def on_heartbeat(self, job: str, node: str, body: dict[str, Any]) -> Decision | None:
        """Apply one heartbeat body; the decision taken because of it, if any."""
        part = body.get("gpu")
        if part is None:
            return None
        if not self.enabled:  # no launchpad sends it then: whoever did is not acted on
            if node not in self._ignored and len(self._ignored) < 4096:
                self._ignored.add(node)
                self._log.warning("health.telemetry_ignored", job=job, node=node,
                                  reason="GPU telemetry arrived while the health policy is off (health.enabled = false)")
            return None
        decoder = self._decoders.setdefault((job, node), DeltaDecoder())
        try:
            sample = decoder.apply(part)
        except ProtocolError as exc:
            self._log.warning("health.bad_telemetry", job=job, node=node, error=str(exc))
            return None
        if sample is None:
            return None  # a delta after a lost heartbeat: wait for the next keyframe
        try:
            decision = self.policy.observe(job, node, sample)
        except (TypeError, ValueError) as exc:  # a field of the wrong type from a foreign sender
            self._log.warning("health.bad_telemetry", job=job, node=node, error=repr(exc))
            return None
        if decision is not None:  # acted on beside the caller (a drain may take seconds)
            task = asyncio.create_task(self._act(decision), name=f"health-{node}")
            self._acting.add(task)
            task.add_done_callback(self._acting.discard)
        return decision

    async def settle(self) -> None:
        """Wait until the actions of the decisions taken so far are done."""
        while self._acting:
            await asyncio.gather(*self._acting)

    def node_returned(self, node: str) -> None:
        """The node is healthy in Slurm again (resumed): its GPUs are watched afresh."""
        if node in self.policy.decided:
            self._log.info("health.cleared", node=node)
        self.policy.clear(node)

    def job_ended(self, job: str) -> None:
        """Forget the job's telemetry streams (each node keeps its last known GPU health)."""
        for key in [k for k in self._decoders if k[0] == job]:
            del self._decoders[key]

    async def _act(self, d: Decision) -> None:
        self._log.warning("health.decision", job=d.job, node=d.node, gpu=d.gpu, signal=d.signal,
                          action=d.action, reason=d.reason)
        self.counter.inc(signal=d.signal, action=d.action)
        detail = {k: v for k, v in asdict(d).items() if k != "job"}
        try:
            if d.action == "drain":
                await self.drain(d.node, d.reason)
            elif d.action == "migrate":
                self.migrate(d.job, d.node, d.reason)
        except TorchPassError as exc:
            detail["failed"] = str(exc)
            self._log.error("health.action_failed", job=d.job, node=d.node, action=d.action, error=str(exc))
        await asyncio.to_thread(self.journal.add_event, "health.decision", job_id=d.job, detail=detail)

    async def op_health(self, args: dict[str, Any]) -> dict[str, Any]:
        """The control socket's ``health`` operation (torchpassctl)."""
        return self.describe()

    def describe(self) -> dict[str, Any]:
        """Each node's latest GPU health (for ``torchpassctl``): per GPU a one-word state and the
        headline counters, plus the decision taken about the node, if any."""
        now = time.time()
        nodes = {}
        for node, sample in sorted(self.policy.latest.items()):
            d = self.policy.decided.get(node)
            gpus = {gpu: {"state": _state(f), **{k: f[k] for k in _HEADLINE if k in f}}
                    for gpu, f in sorted(sample.get("gpus", {}).items())}
            nodes[node] = {"nvml": sample.get("nvml"), "age_s": round(now - float(sample["t"]), 1), "gpus": gpus,
                           "summary": _summary(sample, gpus),
                           "decision": None if d is None else {"job": d.job, "action": d.action, "signal": d.signal,
                                                               "reason": d.reason, "at": d.at}}
        return nodes


_HEADLINE = ("temp_c", "power_w", "ecc_vol_corr", "ecc_vol_unc", "xid_last", "throttle", "error")


def _summary(sample: dict[str, Any], gpus: dict[str, dict[str, Any]]) -> str:
    """One line for a node: "no NVML", NVML failing, the GPUs in trouble, or "ok" with the hottest GPU."""
    if sample.get("nvml") == ABSENT:
        return "no NVML"
    if sample.get("nvml") == FAILED:
        return f"NVML failed: {sample.get('why', '')}"
    bad = [f"GPU{g} {v['state']}" for g, v in gpus.items() if v["state"] != "ok"]
    if bad:
        return ", ".join(bad)
    temps = [v["temp_c"] for v in gpus.values() if "temp_c" in v]
    return f"ok ({len(gpus)} GPUs" + (f", max {max(temps)} C)" if temps else ")")


def _state(fields: dict[str, Any]) -> str:
    if not fields.get("answering", True):
        return "not answering"
    return "errors" if fields.get("errors") else "ok"
