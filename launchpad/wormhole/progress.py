"""Transfer accounting: a thread-safe meter that the stream threads feed and that calls the
user's progress callback at a bounded rate (launchpad forwards it to the orchestrator), and the
TransferStats a finished transfer returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """A snapshot: bytes moved so far of the total, seconds since the data phase began, rate."""

    bytes_done: int
    bytes_total: int
    seconds: float

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.bytes_done / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TransferStats:
    """What a finished transfer moved and how fast (``seconds``: data phase, after the handshakes)."""

    bytes: int
    seconds: float
    streams: int
    leaves: int
    transport: str

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


ProgressCallback = Callable[[Progress], None]


class Meter:
    """Counts bytes from several threads; calls ``callback`` at most every ``interval`` seconds
    (from whichever stream thread crosses it, so the callback must be quick) and once at the end."""

    def __init__(self, total: int, callback: ProgressCallback | None, interval: float = 0.2) -> None:
        self.total = total
        self._callback = callback
        self._interval = interval
        self._lock = threading.Lock()
        self._done = 0
        self.start = time.perf_counter()
        self._next = self.start + interval

    def add(self, n: int) -> None:
        with self._lock:
            self._done += n
            now = time.perf_counter()
            if self._callback is None or now < self._next:
                return
            self._next = now + self._interval
            self._callback(Progress(self._done, self.total, now - self.start))  # in order, one at a time

    def finish(self) -> float:
        """Seconds since start; reports the final snapshot."""
        seconds = time.perf_counter() - self.start
        if self._callback is not None:
            self._callback(Progress(self._done, self.total, seconds))
        return seconds
