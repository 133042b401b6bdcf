"""How long the training thread wanted the CPU per step: the time it ran plus the time it was
runnable but waiting to run (another process on the core, or its cgroup's CPU quota spent), from
the kernel's per-thread scheduler statistics (/proc/thread-self/schedstat). The time it slept is
left out: waiting for its peers inside a collective, on I/O, in the script's own sleeps. In
synchronous training every rank's step takes as long as the slowest one's, so the step time cannot
tell a straggler; this can: the slow rank's peers sleep in the collectives while it computes.

Host side only: a GPU kernel's time is not seen (the thread launching it does not wait for it); a
slow GPU would need a CUDA-event source, which this module does not provide. Linux only: elsewhere
the meter reports nothing. The straggler policy that reads it is torchpassd/straggler.py."""

from __future__ import annotations

from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def read_wanted_ns(path: Path = SCHEDSTAT) -> int | None:
    """Run time + run-queue wait of the calling thread so far, in ns; None where not available."""
    try:
        ran, waited, *_ = path.read_text().split()
        return int(ran) + int(waited)
    except (OSError, ValueError):
        return None


class BusyMeter:
    """Seconds of CPU the calling thread wanted per step, over the steps since the last reading.
    Call ``per_step`` from the training thread only (it reads that thread's statistics)."""

    def __init__(self, path: Path = SCHEDSTAT) -> None:
        self._path = path
        self._last: tuple[int, int] | None = None  # (step, wanted ns) at the last reading

    def per_step(self, step: int) -> float | None:
        """The mean wanted CPU seconds of the steps since the last call (None on the first call,
        when no step completed since, or where the statistics cannot be read)."""
        wanted = read_wanted_ns(self._path)
        if wanted is None:
            return None
        last, self._last = self._last, (step, wanted)
        if last is None or step <= last[0]:
            return None
        return round((wanted - last[1]) / 1e9 / (step - last[0]), 6)
