"""When a GPU is about to fail: turns a node's GPU samples (launchpad/telemetry) into at most one
Decision per node (drain, migrate or none, per health.action) with the signal, a Slurm reason
that names it and the evidence. Signals: GPU not answering, fatal XIDs, uncorrectable ECC,
pending/failed page retirement or row remapping, bursts of corrected ECC or NVLink errors over
a window, temperature over the limit for a while. It acts on nothing (health_watch.py does)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torchpass_common.config import HealthConfig

# What operators read in the drain reason; XIDs not listed are shown by number only.
XID_MEANING = {13: "graphics engine exception", 31: "memory page fault", 43: "GPU stopped processing",
               48: "double-bit ECC error", 63: "row remapping event", 64: "row remapping failure",
               74: "NVLink error", 79: "fell off the bus", 92: "high single-bit ECC rate",
               94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP timeout"}
NVLINK_FIELDS = ("nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data")
# Signals in order of severity: the first that fires names the decision.
SIGNALS = ("not_answering", "xid", "ecc_uncorrected", "retirement", "ecc_burst", "nvlink_burst", "temperature")


@dataclass(frozen=True)
class Decision:
    """What to do about one node, why (``reason`` is the Slurm drain reason) and the evidence."""

    action: str  # drain | migrate | none
    signal: str
    job: str
    node: str
    gpu: str
    reason: str
    at: float  # sample time
    evidence: dict[str, Any] = field(default_factory=dict)


class _Window:
    """Growth of a cumulative counter since its oldest sample within the last ``seconds``
    (restarts when the counter drops)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.points: deque[tuple[float, int]] = deque()

    def growth(self, t: float, value: int) -> int:
        if self.points and value < self.points[-1][1]:
            self.points.clear()  # driver reload or counter reset
        self.points.append((t, value))
        while self.points[0][0] < t - self.seconds:  # keep samples inside the window only
            self.points.popleft()
        return value - self.points[0][1]


@dataclass
class _GpuState:
    ecc: _Window
    nvlink: _Window
    hot_since: float | None = None
    baseline: dict[str, int] = field(default_factory=dict)  # counters when the node was last cleared


class HealthPolicy:
    """Per cluster config; one instance watches every node (state keyed by node)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self._gpus: dict[tuple[str, str], _GpuState] = {}
        self.decided: dict[str, Decision] = {}
        self.latest: dict[str, dict[str, Any]] = {}

    def observe(self, job: str, node: str, sample: dict[str, Any]) -> Decision | None:
        """Feed one full sample of ``node``; a Decision the first time a signal fires, then None
        until :meth:`clear` (a node is drained or migrated once, not at every heartbeat)."""
        self.latest[node] = sample
        t = float(sample["t"])
        found: list[tuple[int, str, str, str]] = []  # (severity, signal, gpu, text)
        for gpu, fields in sorted(sample.get("gpus", {}).items()):
            for signal, text in self._signals(node, gpu, fields, t):
                found.append((SIGNALS.index(signal), signal, gpu, text))
        if not found or node in self.decided:
            return None
        found.sort()
        _, signal, gpu, text = found[0]
        fields = sample["gpus"][gpu]
        decision = Decision(
            action=self.cfg.action, signal=signal, job=job, node=node, gpu=gpu,
            reason=f"torchpass: GPU{gpu} {text}", at=t,
            evidence={"uuid": fields.get("uuid", ""), "name": fields.get("name", ""),
                      "signals": [{"signal": s, "gpu": g, "detail": d} for _, s, g, d in found],
                      "fields": {k: v for k, v in fields.items() if k not in ("uuid", "name")}})
        self.decided[node] = decision
        return decision

    def clear(self, node: str) -> None:
        """The node is back in service: forget its decision and count errors from now on."""
        self.decided.pop(node, None)
        sample = self.latest.get(node, {})
        for gpu, fields in sample.get("gpus", {}).items():
            state = self._gpus.get((node, gpu))
            if state is not None:
                state.baseline = {k: v for k, v in fields.items() if _is_count(k, v)}
                state.hot_since = None

    def _state(self, node: str, gpu: str) -> _GpuState:
        key = (node, gpu)
        if key not in self._gpus:
            self._gpus[key] = _GpuState(_Window(self.cfg.rate_window), _Window(self.cfg.rate_window))
        return self._gpus[key]

    def _signals(self, node: str, gpu: str, f: dict[str, Any], t: float) -> list[tuple[str, str]]:
        cfg, st = self.cfg, self._state(node, gpu)

        def new(key: str) -> int:  # a cumulative count since the node was last cleared
            return int(f.get(key, 0)) - st.baseline.get(key, 0)
        out: list[tuple[str, str]] = []
        if not f.get("answering", True):
            out.append(("not_answering", f"not answering ({f.get('error') or 'no reply'})"))
        for xid in cfg.fatal_xids:
            if new(f"xid_{xid}") > 0:
                meaning = XID_MEANING.get(xid)
                out.append(("xid", f"XID {xid}" + (f" ({meaning})" if meaning else "")))
        if new("ecc_vol_unc") >= cfg.uncorrected_ecc:
            out.append(("ecc_uncorrected", f"{new('ecc_vol_unc')} uncorrectable ECC errors"))
        if cfg.pending_retirement:
            pending = [what for key, what in (("retired_pending", "page retirement pending"),
                                              ("remap_pending", "row remapping pending"),
                                              ("remap_failed", "row remapping failed")) if f.get(key)]
            if pending:
                out.append(("retirement", ", ".join(pending) + " (needs a GPU reset)"))
        if "ecc_vol_corr" in f:
            grew = st.ecc.growth(t, int(f["ecc_vol_corr"]))
            if grew >= cfg.corrected_ecc_burst:
                out.append(("ecc_burst", f"{grew} corrected ECC errors in {cfg.rate_window:.0f} s"))
        if any(k in f for k in NVLINK_FIELDS):
            grew = st.nvlink.growth(t, sum(int(f.get(k, 0)) for k in NVLINK_FIELDS))
            if grew >= cfg.nvlink_error_burst:
                out.append(("nvlink_burst", f"{grew} NVLink errors in {cfg.rate_window:.0f} s"))
        temp = f.get("temp_c")
        if temp is None or temp < cfg.temperature_limit:
            st.hot_since = None
        else:
            st.hot_since = t if st.hot_since is None else st.hot_since
            if t - st.hot_since >= cfg.temperature_for:
                out.append(("temperature", f"{temp} C for {t - st.hot_since:.0f} s (limit {cfg.temperature_limit:g} C)"))
        return out


def _is_count(key: str, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and key != "xid_last" and key.startswith(("xid_", "ecc_"))
