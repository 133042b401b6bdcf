"""When a drain may become a migration: not before the leaving node's launchpad reports its
ranks, nor while any worker of the job has yet to reach its agent channel (a young job: a worker
still importing torch cannot be paused, and the pause would roll back); never off the batch host,
which Slurm cannot take out of a running job (the user is told, once, that the job runs on there)."""

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


def test_a_drained_batch_host_is_refused_lastingly_with_what_it_means_for_the_job(tmp_path: Path) -> None:
    async def main() -> None:
        orch, journal, _ = await orchestrator(tmp_path)
        why, lasting = orch._blocked(JOB, "n1")
        assert lasting and why.startswith("n1 is the batch host of job 7: Slurm cannot take it out of a running job")
        assert "unprotected against n1's failure" in why
        journal.close()
    asyncio.run(main())
