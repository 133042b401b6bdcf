"""The launchpads' retained states that outlive their job. A launchpad keeps its online state
retained (and leaves an offline one as its Last Will) so a restarted torchpassd learns who is
there; once the job ended nobody needs them, and the broker would keep them forever, one per
job and node. This module removes them (an empty retained publish); it decides nothing about
which are stale: the daemon calls it when Slurm ends a job, and the report gate when a state
arrives for a job that no longer runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from torchpass_common import log, mqtt, protocol
from torchpass_common.errors import TorchPassError

CLEAR_TIMEOUT = 5.0


class RetainedStates:
    """Clears job states retained on the broker through torchpassd's own client."""

    def __init__(self, client: mqtt.ControlClient) -> None:
        self.client = client
        self._tasks: set[asyncio.Task[None]] = set()
        self.log = log.get()

    def clear(self, job: str, nodes: Iterable[str]) -> None:
        """Remove the retained state of each of ``job``'s ``nodes``, in the background."""
        task = asyncio.create_task(self._clear(job, sorted(set(nodes))))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _clear(self, job: str, nodes: list[str]) -> None:
        for node in nodes:
            try:
                await self.client.publish(protocol.state_topic(job, node), b"", retain=True, timeout=CLEAR_TIMEOUT)
            except TorchPassError as exc:  # the next start clears it: the gate refuses it then
                self.log.warning("retained.clear_failed", job=job, node=node, error=str(exc))
                return
        self.log.info("retained.cleared", job=job, nodes=nodes)
