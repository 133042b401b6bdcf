"""When a drain may become a migration: not before the leaving node's launchpad reports its
ranks, nor while any worker of the job has yet to reach its agent channel (a young job: a worker
still importing torch cannot be paused, and the pause would roll back). The batch host's ranks move
like any node's; once they have (Slurm keeps the host in the job), nothing more is moved off it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support.orchestrator_stubs import JOB, orchestrator
from torchpass_common import protocol


async def _heartbeat(orch, node: str, states: dict[int, str]) -> None:  # noqa: ANN001
    body = {"node": node, "seq": 2, "workers": [{"rank": r, "step": 0, "state": s, "pid": 99} for r, s in states.items()]}
    await orch.d.registry.on_message(node, protocol.decode(protocol.encode(protocol.HEARTBEAT, job=JOB, gen=1,
                                                                           body=body)))


def test_a_drain_waits_until_every_worker_of_the_job_is_on_its_channel(tmp_path: Path) -> None:
    async def main() -> None:
        orch, journal, _ = await orchestrator(tmp_path)
        orch.watcher.last = None
        await _heartbeat(orch, "n1", {0: "starting", 1: "running"})
        assert orch._blocked(JOB, "n3") == ("waiting for the workers on n1 to start", False)
        await _heartbeat(orch, "n1", {0: "running", 1: "running"})
        assert orch._blocked(JOB, "n3") == ("waiting for the first Slurm poll", False)  # the next condition
        await _heartbeat(orch, "n3", {})
        assert orch._blocked(JOB, "n3") == ("waiting for the launchpad on n3 to report its ranks", False)
        journal.close()
    asyncio.run(main())


def test_a_drained_batch_host_may_move_like_any_node_and_once_emptied_is_left_alone(tmp_path: Path) -> None:
    """The batch host's ranks move like any node's (Slurm keeps the host in the job); once they
    have, a new drain or health request for it moves nothing and waits for nothing."""
    async def main() -> None:
        orch, journal, _ = await orchestrator(tmp_path)
        assert orch._blocked(JOB, "n1") == orch._blocked(JOB, "n3")
        assert "batch host" not in orch._blocked(JOB, "n1")[0]
        orch.d.registry.job(JOB).emptied.add("n1")  # what the migration off it records
        orch.request(JOB, "n1", "node n1 drained: maintenance")
        assert (JOB, "n1") not in orch.pending
        journal.close()
    asyncio.run(main())


def test_a_drain_of_a_job_with_a_hot_spare_does_not_wait_for_the_pools(tmp_path: Path) -> None:
    """No spare free in the reservation: a model-aware job with a hot spare of its own
    (--torchpass-spares) moves onto it; a transparent job's criu restore needs the pool's."""
    async def main() -> list[str]:
        orch, journal, _ = await orchestrator(tmp_path)
        orch.watcher.last = object()  # a Slurm poll was seen
        seen = [orch._blocked(JOB, "n3")[0]]
        await orch.d.registry.update_job(JOB, nodes=("n1", "n3", "n4"), user="u", mode="aware", batch_host="n1")
        body = {"node": "n4", "seq": 1, "workers": [], "standby": "ready", "hot_spare": True}
        await orch.d.registry.on_message("n4", protocol.decode(protocol.encode(protocol.HEARTBEAT, job=JOB, gen=1,
                                                                               body=body)))
        seen.append(orch._blocked(JOB, "n3")[0])
        orch.d.registry.job(JOB).mode = "transparent"
        seen.append(orch._blocked(JOB, "n3")[0])
        journal.close()
        return seen

    no_spare, hot, transparent = asyncio.run(main())
    assert no_spare.startswith("no spare free for n3") and hot == "" and transparent == no_spare
