"""Running one task per stream in threads (socket I/O and the checksum release the GIL, so
threads use every core) with a deadline, and turning the first failure into the transfer's error
after unblocking the other streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torchpass_common.errors import WormholeError


def run_parallel(tasks: list[Callable[[], None]], *, deadline: float, abort: Callable[[], None],
                 what: str) -> None:
    """Run ``tasks`` concurrently until all finish or ``deadline`` (time.monotonic) passes. On the
    first failure or at the deadline, ``abort()`` (close the streams) unblocks the rest; the first
    error is raised (as a WormholeError)."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def guarded(task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as exc:  # handed to the caller's thread below
            with lock:
                first = not errors
                errors.append(exc)
            if first:
                abort()

    threads = [threading.Thread(target=guarded, args=(t,), name=f"wormhole-{what}-{i}", daemon=True)
               for i, t in enumerate(tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        abort()
        for t in threads:
            t.join(5.0)
        raise WormholeError(f"{what} did not finish before the deadline",
                            hint="the link is too slow for the timeout, or the peer stalled")
    if errors:
        if isinstance(errors[0], WormholeError):
            raise errors[0]
        raise WormholeError(f"{what} failed: {errors[0]!r}") from errors[0]
