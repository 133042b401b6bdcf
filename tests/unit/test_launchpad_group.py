"""launchpad's WorkerGroup.supervise with real worker processes: which outcome a round ends with
when a local worker fails, when another node reports a failure, and when both happen because an
orchestrator told the workers to exit (the local exit code wins: the node failed clearly)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from launchpad import workers
from launchpad.group import Outcome, WorkerGroup
from launchpad.rendezvous import Membership
from launchpad.spec import LaunchSpec

MEMBERSHIP = Membership(round=0, node_rank=0, nnodes=2, rank_offset=0, local_world_size=1, world_size=2,
                        store_host="127.0.0.1", store_port=1)


def supervise(tmp_path: Path, code: str, told_to_exit: bool, remote: str | None) -> Outcome:
    """Run one worker (``python -c code``) under a WorkerGroup; another node reports ``remote``
    as soon as the supervisor first asks."""
    script = tmp_path / "worker.py"
    script.write_text(code)
    spec = LaunchSpec(entrypoint=sys.executable, args=(str(script),), no_python=True, grace_period=10.0)

    async def main() -> Outcome:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path=str(tmp_path / "agent.sock"))
        w = group.adopt(await workers.spawn(spec, group.router, 0, 0, {}))
        if told_to_exit:
            group.told_to_exit.add(w.pid)

        async def remote_failure() -> str | None:
            return remote

        try:
            return await asyncio.wait_for(group.supervise(asyncio.Event(), lambda: None, remote_failure, 0.05), 30)
        finally:
            await group.stop()

    return asyncio.run(main())


def test_a_failed_local_worker_ends_the_round_with_its_exit_code(tmp_path: Path) -> None:
    out = supervise(tmp_path, "import sys; sys.exit(3)", told_to_exit=False, remote=None)
    assert (out.ok, out.failed) == (False, (0, 3))


def test_another_nodes_failure_ends_the_round_at_once(tmp_path: Path) -> None:
    out = supervise(tmp_path, "import time; time.sleep(60)", told_to_exit=False, remote="n1: worker rank 1 exited")
    assert (out.ok, out.failed, out.remote) == (False, None, "n1: worker rank 1 exited")


def test_a_worker_told_to_exit_is_the_nodes_outcome_not_the_other_nodes_report(tmp_path: Path) -> None:
    # both nodes' workers were told to exit by an abort; the other node's report of its own exit
    # arrives first, but this node still exits with its own worker's code (75: interrupted)
    out = supervise(tmp_path, "import sys, time; time.sleep(1); sys.exit(75)", told_to_exit=True,
                    remote="n1: worker rank 1 exited with code 75")
    assert (out.ok, out.failed, out.remote) == (False, (0, 75), None)


def test_a_worker_told_to_exit_that_succeeds_leaves_the_remote_failure(tmp_path: Path) -> None:
    out = supervise(tmp_path, "import time; time.sleep(0.5)", told_to_exit=True, remote="n1: lost")
    assert (out.ok, out.failed, out.remote) == (False, None, "n1: lost")
