"""Stopping asyncio tasks for sure. On Python 3.11, asyncio.wait_for (used inside aiomqtt and by
our own timeouts) can swallow a cancellation that lands as the awaited operation completes; a
task looping on such waits then runs on, and a shutdown that cancelled it once and awaits it hangs
forever (seen: a launchpad that finished its job but never exited). Cancel until the tasks end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], *, every: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every ``every`` seconds
    those that go on (a swallowed cancellation). Their results and errors are discarded."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: an error of a task being stopped is of no interest
