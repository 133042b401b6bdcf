"""The compact "only changes" form of GPU samples carried in heartbeats (body key ``gpu``).
Each message has a sequence number ``s`` and the sample time ``t``; a keyframe (no ``b``)
carries every field, a delta names its base ``b`` and only the fields that changed (``g``) or
vanished (``x``). Heartbeats are QoS 0, so the decoder drops deltas after a gap and waits for
the next keyframe (every KEYFRAME_EVERY samples) rather than guess."""

from __future__ import annotations

import copy
from typing import Any

from torchpass_common.errors import ProtocolError

KEYFRAME_EVERY = 12
_SCALARS = (int, float, bool, str)
_MISSING = object()


class DeltaEncoder:
    """Launchpad side: turns successive samples into keyframes and deltas."""

    def __init__(self, keyframe_every: int = KEYFRAME_EVERY) -> None:
        self.keyframe_every = keyframe_every
        self.seq = 0
        self._sent: dict[str, Any] | None = None

    def encode(self, sample: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        msg: dict[str, Any] = {"s": self.seq, "t": sample["t"]}
        prev = self._sent
        if prev is None or (self.seq - 1) % self.keyframe_every == 0:
            msg.update(n=sample["nvml"], g=copy.deepcopy(sample["gpus"]))
            if sample.get("why"):
                msg["w"] = sample["why"]
        else:
            msg["b"] = self.seq - 1
            if sample["nvml"] != prev["nvml"]:
                msg["n"] = sample["nvml"]
            changed, removed = _diff(prev["gpus"], sample["gpus"])
            if changed:
                msg["g"] = changed
            if removed:
                msg["x"] = removed
        self._sent = copy.deepcopy(sample)
        return msg


def _diff(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    changed: dict[str, Any] = {}
    removed: dict[str, list[str]] = {}
    for gpu in old.keys() - new.keys():
        changed[gpu] = None
    for gpu, fields in new.items():
        before = old.get(gpu)
        if before is None:
            changed[gpu] = dict(fields)
            continue
        delta = {k: v for k, v in fields.items() if _changed(before.get(k, _MISSING), v)}
        if delta:
            changed[gpu] = delta
        gone = sorted(before.keys() - fields.keys())
        if gone:
            removed[gpu] = gone
    return changed, removed


def _changed(old: Any, new: Any) -> bool:
    return type(old) is not type(new) or old != new  # 1 == True == 1.0, but they differ on the wire


class DeltaDecoder:
    """torchpassd side, one per (job, node): rebuilds the full sample from keyframes and deltas."""

    def __init__(self) -> None:
        self.sample: dict[str, Any] | None = None
        self.seq = 0
        self.gaps = 0

    def apply(self, msg: Any) -> dict[str, Any] | None:
        """The node's current full sample, or None while out of step (a delta after a gap)."""
        _check(msg)
        if "b" not in msg:
            self.sample = {"t": msg["t"], "nvml": msg["n"], "gpus": copy.deepcopy(msg["g"])}
            if "w" in msg:
                self.sample["why"] = msg["w"]
        elif self.sample is None or msg["b"] != self.seq:
            if self.sample is not None:
                self.gaps += 1
            self.sample = None
            return None
        else:
            self.sample["t"] = msg["t"]
            self.sample["nvml"] = msg.get("n", self.sample["nvml"])
            gpus = self.sample["gpus"]
            for gpu, fields in msg.get("g", {}).items():
                if fields is None:
                    gpus.pop(gpu, None)
                else:
                    gpus.setdefault(gpu, {}).update(fields)
            for gpu, keys in msg.get("x", {}).items():
                for k in keys:
                    gpus.get(gpu, {}).pop(k, None)
        self.seq = msg["s"]
        return copy.deepcopy(self.sample)  # the caller may keep it; later deltas must not change it


def _check(msg: Any) -> None:
    """Reject a malformed ``gpu`` part (it comes from the network) with a ProtocolError."""
    def bad(why: str) -> ProtocolError:
        return ProtocolError(f"malformed GPU telemetry in a heartbeat: {why}",
                             hint="launchpad and torchpassd versions may differ; upgrade both")
    if not isinstance(msg, dict) or not isinstance(msg.get("s"), int) or not isinstance(msg.get("t"), int | float):
        raise bad("needs integer s and numeric t")
    if "b" not in msg and not (isinstance(msg.get("n"), str) and isinstance(msg.get("g"), dict)):
        raise bad("a keyframe needs n (str) and g (map)")
    if "b" in msg and not isinstance(msg["b"], int):
        raise bad("b must be an integer")
    if not all(isinstance(msg.get(key, {}), dict) for key in ("g", "x")):
        raise bad("g and x must be maps")
    for gpu, fields in msg.get("g", {}).items():
        if not isinstance(gpu, str) or not (fields is None or isinstance(fields, dict)):
            raise bad(f"GPU {gpu!r} must map to fields or null")
        if fields and not all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in fields.items()):
            raise bad(f"GPU {gpu} fields must be scalars")
    for gpu, keys in msg.get("x", {}).items():
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise bad(f"removed fields of GPU {gpu!r} must be a list of names")
