"""launchpad's progress watchdog: a worker that neither steps nor answers pings for
max(3 s, 5 x its step time) is frozen and killed (then held and rebuilt in place); one that waits
on a peer (no step, but it answers) or steps slowly is left alone. Real worker processes: one is
stopped with SIGSTOP, as a test on the dev cluster freezes a rank."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launchpad import watchdog as wd
from launchpad import workers
from launchpad.channel import WorkerLink
from launchpad.group import WorkerGroup
from launchpad.rendezvous import Membership
from launchpad.spec import LaunchSpec
from torchpass_common import agent_channel as ac


def test_frozen_needs_both_no_step_and_no_answer_past_the_limit() -> None:
    assert wd.hung_after(None) == 3.0 and wd.hung_after(0.1) == 3.0 and wd.hung_after(2.0) == 10.0
    link = WorkerLink(0, 0, 1, False, None, step_at=100.0, pong_at=100.0)  # type: ignore[arg-type]
    assert wd.frozen(102.9, link, 0.0) is None and wd.frozen(103.5, link, 0.0) == 3.5
    link.pong_at = 103.0  # it answers: it waits on a peer, not frozen
    assert wd.frozen(105.0, link, 0.0) is None
    link.step_s = 2.0  # slow steps: 10 s of patience
    assert wd.frozen(112.0, link, 0.0) is None and wd.frozen(113.5, link, 0.0) is not None
    # just resumed after an interruption (no pings while interrupted): judged from its resume on
    assert wd.frozen(113.5, link, 110.0) is None


@dataclass
class AnsweringChannel:
    """A worker's channel whose reader thread answers pings, unless its process is stopped."""

    link: WorkerLink | None = None
    stopped: bool = False
    pings: list[float] = field(default_factory=list)

    async def send(self, msg: dict[str, Any]) -> None:
        assert msg["t"] == ac.PING
        self.pings.append(time.monotonic())
        if not self.stopped and self.link is not None:
            self.link.pong_at = time.monotonic()


def test_a_stopped_worker_is_killed_and_held_while_one_waiting_on_it_is_not(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(wd, "PING_EVERY_S", 0.2)
    monkeypatch.setattr(wd, "HUNG_FLOOR_S", 1.0)
    script = tmp_path / "worker.py"
    script.write_text("import time; time.sleep(30)")
    spec = LaunchSpec(entrypoint=sys.executable, args=(str(script),), no_python=True, grace_period=2.0)
    m = Membership(round=0, node_rank=0, nnodes=1, rank_offset=0, local_world_size=2, world_size=2,
                   store_host="127.0.0.1", store_port=1)

    async def main() -> tuple[WorkerGroup, dict[int, int | None]]:
        group = WorkerGroup(spec, m, restarts=0, socket_path=str(tmp_path / "agent.sock"), hold_s=30)
        procs = [group.adopt(await workers.spawn(spec, group.router, r, r, {})) for r in range(2)]
        links: dict[int, WorkerLink] = {}
        for w in procs:
            chan = AnsweringChannel()
            chan.link = links[w.pid] = WorkerLink(w.rank, w.rank, w.pid, False, chan)  # type: ignore[arg-type]
        frozen = procs[0]
        links[frozen.pid].chan.stopped = True  # type: ignore[attr-defined]
        frozen.signal(signal.SIGSTOP)
        channel = type("Channel", (), {"links": links})()
        task = asyncio.create_task(wd.Watchdog(channel, group).run())  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(frozen.wait(), 10)
        finally:
            task.cancel()
        codes = {w.rank: w.returncode for w in procs}
        await group.stop()
        return group, codes

    group, codes = asyncio.run(main())
    assert codes == {0: -signal.SIGKILL, 1: None}, codes  # the one that answered kept running
    assert list(group.frozen.values())[0] >= 1.0
