"""The agent side of the local channel over a real Unix socket, with the test playing a worker
through agent_channel's own asyncio endpoint: hello registers the worker, step reports update it
without being taken for replies, a request gets its matching reply, and an error reply, a worker
that goes away or one that never answers raise WorkerError naming the rank."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from launchpad.channel import ChannelServer, WorkerLink
from torchpass_common import agent_channel as ac
from torchpass_common.errors import WorkerError


def with_server(tmp_path: Path, body: Callable[[ChannelServer, ac.AsyncChannel], Awaitable[None]],
                *, hello: bool = True) -> None:
    async def main() -> None:
        server = ChannelServer(str(tmp_path / "agent.sock"))
        await server.start()
        worker = ac.AsyncChannel(*await asyncio.open_unix_connection(server.path))
        try:
            if hello:
                await worker.send(ac.message(ac.HELLO, rank=3, local_rank=1, pid=4242, joining=False))
                await server.wait_for([4242], timeout=5)
            await asyncio.wait_for(body(server, worker), 10)
        finally:
            await worker.close()
            await server.close()

    asyncio.run(main())


def test_steps_update_the_link_and_requests_get_their_reply(tmp_path: Path) -> None:
    async def body(server: ChannelServer, worker: ac.AsyncChannel) -> None:
        link = server.links[4242]
        assert (link.rank, link.local_rank, link.state) == (3, 1, "running")

        async def play_worker() -> None:
            assert (await worker.recv())["t"] == ac.PAUSE
            await worker.send(ac.message(ac.STEP, step=9))
            await worker.send(ac.message(ac.RESUMED, gen=1))  # not what was asked: skipped
            await worker.send(ac.message(ac.PAUSED, gen=2, step=10))

        task = asyncio.create_task(play_worker())
        reply = await server.request(link, ac.message(ac.PAUSE, gen=2, at_step=10),
                                     lambda r: r["t"] == ac.PAUSED and r["gen"] == 2, timeout=5)
        await task
        assert reply["step"] == 10
        assert (link.step, link.state) == (10, "paused")

    with_server(tmp_path, body)


async def reported(link: WorkerLink, step: int) -> None:
    while link.step != step:
        await asyncio.sleep(0.005)


def test_step_time_is_the_steps_own_not_the_start_up_or_a_pause(tmp_path: Path) -> None:
    """The stall watch and the watchdog wait a few step times: a step time inflated by the start-up
    (hello to the first step) or by a pause would let a survivor sit out the collective timeout."""
    async def body(server: ChannelServer, worker: ac.AsyncChannel) -> None:
        link = server.links[4242]
        await asyncio.sleep(1.0)  # start-up: building the model, the first rendezvous
        for step in range(1, 8):
            await worker.send(ac.message(ac.STEP, step=step))
            await reported(link, step)
            await asyncio.sleep(0.05)
        assert link.step_s is not None and link.step_s < 0.25, link.step_s
        await worker.send(ac.message(ac.PAUSED, gen=1, step=8))
        await asyncio.sleep(1.0)  # parked during a migration
        await worker.send(ac.message(ac.RESUMED, gen=2, step=8))
        await reported(link, 8)
        resumed_at = link.step_at
        for step in range(9, 11):
            await asyncio.sleep(0.05)
            await worker.send(ac.message(ac.STEP, step=step))
            await reported(link, step)
        assert link.step_s < 0.25, link.step_s
        assert link.step_at > resumed_at > 0  # progress counted from the resume, not the pause

    with_server(tmp_path, body)


def test_error_reply_raises_worker_error(tmp_path: Path) -> None:
    async def body(server: ChannelServer, worker: ac.AsyncChannel) -> None:
        async def play_worker() -> None:
            await worker.recv()
            await worker.send(ac.message(ac.ERROR, msg="save() raised KeyError"))

        task = asyncio.create_task(play_worker())
        with pytest.raises(WorkerError, match=r"worker failed save: save\(\) raised KeyError.*rank=3"):
            dest = {"host": "127.0.0.1", "port": 9, "token": "ab" * 32}
            await server.request(server.links[4242], ac.message(ac.SAVE, dest=dest),
                                 lambda r: r["t"] == ac.SAVED, timeout=5)
        await task

    with_server(tmp_path, body)


def test_worker_going_away_or_silent_raises(tmp_path: Path) -> None:
    async def body(server: ChannelServer, worker: ac.AsyncChannel) -> None:
        link = server.links[4242]
        with pytest.raises(WorkerError, match="did not answer resume within"):
            await server.request(link, ac.message(ac.RESUME, gen=2), lambda r: True, timeout=0.3)
        await worker.close()
        with pytest.raises(WorkerError, match="closed the local channel"):
            await server.request(link, ac.message(ac.RESUME, gen=2), lambda r: True, timeout=5)
        assert not link.connected and server.links[4242] is link  # kept for heartbeats

    with_server(tmp_path, body)


def test_a_peer_that_does_not_start_with_hello_is_dropped(tmp_path: Path) -> None:
    async def body(server: ChannelServer, worker: ac.AsyncChannel) -> None:
        await worker.send(ac.message(ac.STEP, step=1))
        assert await worker.recv() is None  # the agent hung up
        assert server.links == {}

    with_server(tmp_path, body, hello=False)
