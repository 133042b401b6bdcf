"""A migration that rolled back costs the job one pause, and is not tried for ever: a failure that a
retry would meet again (criu cannot restore the process: the launchpad's ack says ``lasting``) is
given up at once; any other is retried at most RETRIES times, each retry waiting twice as long as
the last, then given up. Giving up is said in the job's output and the journal, and the drain is
no longer pending (the job runs on where it is)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.orchestrator_stubs import JOB, Launchpads, orchestrator
from torchpass_common import protocol
from torchpassd import daemon
from torchpassd import journal as jn
from torchpassd.commander import Commander, CommandFailed


def _rolled_back(error: str, lasting: str = "") -> SimpleNamespace:
    """What _conclude reads of a migration off n3 that rolled back."""
    return SimpleNamespace(plan=SimpleNamespace(job=JOB, source="n3"), spare_failure=None, error=error,
                           lasting=lasting)


def test_a_failure_a_retry_would_meet_again_is_given_up_at_once(tmp_path: Path) -> None:
    async def main() -> None:
        launchpads = Launchpads()
        orch, journal, _ = await orchestrator(tmp_path, launchpads)
        orch.request(JOB, "n3", "node n3 draining: maintenance")
        await orch._conclude(_rolled_back("restore failed on the launchpad: criu restore failed: ...",
                                          lasting="criu could not restore ranks [2, 3] on n5"), jn.ROLLED_BACK)
        await asyncio.sleep(0.1)  # the journal event and the job notice are written by tasks
        assert (JOB, "n3") not in orch.pending and (JOB, "n3") not in orch.retry_at
        (why,) = launchpads.notices
        assert why.startswith("gave up moving job 7's ranks off n3: criu could not restore ranks [2, 3] on n5, "
                              "and a retry would fail the same way; the job runs on on n3.")
        assert orch.d.registry.job(JOB).blocked == why
        assert any(e.event == "migration.given_up" and e.detail["tries"] == 1 for e in journal.events(job_id=JOB))
        journal.close()
    asyncio.run(main())


def test_other_roll_backs_are_retried_with_growing_waits_then_given_up(tmp_path: Path) -> None:
    async def main() -> list[float]:
        launchpads = Launchpads()
        orch, journal, _ = await orchestrator(tmp_path, launchpads)
        orch.request(JOB, "n3", "node n3 draining: maintenance")
        waits = []
        for _ in range(daemon.RETRIES):
            before = time.time()
            await orch._conclude(_rolled_back("the pause was missed"), jn.ROLLED_BACK)
            waits.append(round(orch.retry_at[(JOB, "n3")] - before))
            assert (JOB, "n3") in orch.pending and not launchpads.notices
        await orch._conclude(_rolled_back("the pause was missed"), jn.ROLLED_BACK)
        await asyncio.sleep(0.1)
        assert (JOB, "n3") not in orch.pending
        assert launchpads.notices == [orch.d.registry.job(JOB).blocked]
        assert "4 tries rolled back, the last because the pause was missed" in launchpads.notices[0]
        orch.request(JOB, "n3", "node n3 drained: maintenance")  # a new incident gets its own tries
        assert orch.rollbacks.get((JOB, "n3"), 0) == 0
        journal.close()
        return waits
    assert asyncio.run(main()) == [daemon.RETRY_AFTER_S * 2 ** i for i in range(daemon.RETRIES)]


def test_the_ack_of_a_command_that_would_fail_again_says_so() -> None:
    class Client:
        connected = True

        async def publish(self, topic: str, payload: bytes, **kw: object) -> None:
            msg = protocol.decode(payload)
            body = {"command_id": msg.id, "cmd": msg.body["cmd"], "migration": msg.body["migration"], "ok": False,
                    "error": "criu restore failed: ...", "result": {"lasting": True}}
            commander.on_ack(protocol.decode(protocol.encode(protocol.ACK, job=JOB, gen=1, body=body)), "n5")

    commander = Commander(Client())  # type: ignore[arg-type]
    with pytest.raises(CommandFailed) as failed:
        asyncio.run(commander.send(JOB, "n5", "restore", migration="m1", gen=1, args={}, timeout=5))
    assert failed.value.lasting
