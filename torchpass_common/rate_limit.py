"""Token buckets per key: at most ``rate`` events a second sustained, bursts of up to ``burst``.
Used wherever outsiders can make TorchPass do work (reports about nodes, credential requests).
Keys are cheap for a sender to invent, so once more than ``keep`` are held the idle ones (full
again) are forgotten. Counting and logging refusals is the caller's."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

KEEP = 4096


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimit:
    def __init__(self, rate: float, burst: float, *, keep: int = KEEP,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst, self.keep, self.clock = rate, burst, keep, clock
        self._buckets: dict[Hashable, _Bucket] = {}

    def allow(self, key: Hashable) -> bool:
        """Take one token from ``key``'s bucket; False when it is empty (the event is over the rate)."""
        now = self.clock()
        if len(self._buckets) > self.keep:
            full_after = self.burst / self.rate
            self._buckets = {k: b for k, b in self._buckets.items() if now - b.at < full_after}
        b = self._buckets.setdefault(key, _Bucket(self.burst, now))
        b.tokens, b.at = min(self.burst, b.tokens + (now - b.at) * self.rate), now
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True
