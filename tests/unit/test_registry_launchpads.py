"""torchpassd's registry as launchpads' heartbeats fill it: each node's warm standby and the
job's hot spares (nodes of its allocation that run no rank, waiting to take a lost node's)."""

from __future__ import annotations

import asyncio
from typing import Any

from torchpass_common import protocol
from torchpassd.registry import Registry


async def _beat(registry: Registry, node: str, seq: int, **body: Any) -> None:
    msg = protocol.encode(protocol.HEARTBEAT, job="4", gen=1, body={"node": node, "seq": seq, "workers": [], **body})
    await registry.on_message(node, protocol.decode(msg))


def test_torchpassd_shows_each_nodes_standby_as_its_heartbeat_says() -> None:
    """``torchpassctl jobs`` (and the drill, which strikes only once every standby is warm) read
    the standby's state from the heartbeats; a value that is not one of the states is ignored."""
    registry = Registry()

    async def beat(standby: object, seq: int) -> str:
        await _beat(registry, "n2", seq, standby=standby)
        return registry.job("4").describe()["launchpads"]["n2"]["standby"]

    async def feed() -> list[str]:
        return [await beat("starting", 1), await beat("ready", 2), await beat("bogus", 3), await beat(7, 4)]

    assert asyncio.run(feed()) == ["starting", "ready", "ready", "ready"]


def test_the_jobs_hot_spares_are_its_idle_launchpads_that_say_so_warm_ones_first() -> None:
    registry = Registry()

    async def feed() -> list[list[str]]:
        await registry.update_job("4", nodes=("n1", "n2", "n3", "n4"), user="u", batch_host="n1")
        await _beat(registry, "n1", 1, standby="ready")  # trains (below: has a worker)
        await _beat(registry, "n3", 1, standby="starting", hot_spare=True)
        await _beat(registry, "n4", 1, standby="ready", hot_spare=True)
        await _beat(registry, "n2", 1, standby="ready", hot_spare="yes")  # not a boolean: not a spare
        seen = [registry.job("4").hot_spares()]
        await registry.update_job("4", nodes=("n1", "n2", "n3"), user="u", batch_host="n1")  # n4 left the job
        seen.append(registry.job("4").hot_spares())
        await _beat(registry, "n3", 2, standby="ready")  # seated: no longer says it is a spare
        seen.append(registry.job("4").hot_spares())
        return seen

    assert asyncio.run(feed()) == [["n4", "n3"], ["n3"], []]
