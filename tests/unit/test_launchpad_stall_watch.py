"""launchpad's active abort (the sever command): which workers have their collectives cut when
torchpassd decided a peer node lost. A worker that stopped reporting steps is cut at once; one
still training is watched and cut the moment it stalls, or left alone once it completed two more
steps (every rank answered it: the "lost" node's ranks are alive); an interrupted or joining
worker is never cut. Workers are channel links with a recording channel."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from launchpad.channel import WorkerLink
from launchpad.stall_watch import StallWatch, stalled
from torchpass_common import agent_channel as ac
from torchpass_common.errors import ProtocolError
from torchpass_common.worker_state import WorkerState


@dataclass
class RecordingChannel:
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)


@dataclass
class Links:
    links: dict[int, WorkerLink] = field(default_factory=dict)

    def add(self, rank: int, *, age: float, step_s: float | None = 0.02, **kw: Any) -> WorkerLink:
        link = WorkerLink(rank, rank, 1000 + rank, kw.pop("joining", False), RecordingChannel(),  # type: ignore[arg-type]
                          step=10, step_at=time.monotonic() - age, step_s=step_s, **kw)
        self.links[link.pid] = link
        return link


def severed(link: WorkerLink) -> bool:
    return any(m["t"] == ac.SEVER for m in link.chan.sent)  # type: ignore[attr-defined]


def test_the_stall_rule_waits_for_the_floor_and_for_three_of_the_workers_own_steps() -> None:
    assert not stalled(10.4, 10.0, 0.01, 0.5) and stalled(10.6, 10.0, 0.01, 0.5)  # fast steps: the floor
    assert not stalled(12.0, 10.0, 1.0, 0.5) and stalled(13.1, 10.0, 1.0, 0.5)  # 1 s steps: 3 of them
    assert stalled(10.6, 10.0, None, 0.5)  # no step time known yet: the floor


def test_stalled_workers_are_cut_at_once_and_the_others_are_watched() -> None:
    async def go() -> tuple[dict[str, Any], Links, WorkerLink, WorkerLink]:
        chan = Links()
        waiting = chan.add(0, age=3.0)  # in a collective with the lost node since the failure
        training = chan.add(1, age=0.0)
        chan.add(2, age=9.0, state=WorkerState.INTERRUPTED, recovering=True)  # already at its checkpoint
        chan.add(3, age=9.0, joining=True)
        watch = StallWatch(chan, "n2")  # type: ignore[arg-type]
        result = await watch.sever({"lost": ["n3"], "stalled_s": 0.3, "watch_s": 5}, 1, "m1")
        assert severed(waiting) and not severed(training)
        await asyncio.sleep(0.6)  # rank 1 reports no step any more: it reached the collective too
        return result, chan, waiting, training

    result, chan, waiting, training = asyncio.run(go())
    assert result == {"severed": [0], "watching": [1]}
    assert severed(training), "a worker that stalls during the watch is cut then"
    assert "n3" in waiting.chan.sent[0]["reason"]  # type: ignore[attr-defined]
    assert not any(severed(lk) for lk in chan.links.values() if lk.rank in (2, 3))


def test_a_worker_that_trains_on_is_never_cut() -> None:
    async def go() -> WorkerLink:
        chan = Links()
        training = chan.add(1, age=0.0)
        watch = StallWatch(chan, "n2")  # type: ignore[arg-type]
        await watch.sever({"lost": ["n3"], "stalled_s": 0.3, "watch_s": 2}, 1, "m1")
        for _ in range(3):  # its all-reduces are answered: two more steps
            await asyncio.sleep(0.05)
            training.step, training.step_at = training.step + 1, time.monotonic()
        await asyncio.sleep(0.8)  # then it is idle (between steps, say): no longer watched
        return training

    assert not severed(asyncio.run(go()))


def test_a_malformed_sever_is_refused() -> None:
    watch = StallWatch(Links(), "n2")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="lost"):
        asyncio.run(watch.sever({"lost": "n3"}, 1, "m1"))
    with pytest.raises(ProtocolError, match="stalled_s"):
        asyncio.run(watch.sever({"lost": ["n3"], "stalled_s": "soon"}, 1, "m1"))


def test_with_all_every_running_worker_is_cut_at_once() -> None:
    async def go() -> dict[str, Any]:
        chan = Links()
        chan.add(0, age=0.0)  # still in its step: a peer's worker crashed, its next collective cannot complete
        chan.add(1, age=3.0)
        return await StallWatch(chan, "n2").sever({"lost": ["n3"], "all": True}, 1, "m1")  # type: ignore[arg-type]
    assert asyncio.run(go()) == {"severed": [0, 1], "watching": []}
