"""launchpad's `recover` command over a real agent channel, the test playing two interrupted
workers of one node: the most advanced one donates to the lost rank's joiner, the one that lagged
a step loads the donor's state (load_from) and is refused without it; a worker that is not
interrupted or never registered save/load makes a clear error; an interruption beats at once;
abort {exit} ends the workers still in the recovery."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from launchpad.channel import ChannelServer
from launchpad.commands import Commands
from torchpass_common import agent_channel as ac
from torchpass_common.errors import MigrationError, ProtocolError
from torchpass_common.timeouts import Timeouts

DEST = {"host": "10.0.0.9", "port": 7001, "token": "ab" * 32}
SOURCE = {"host": "0.0.0.0", "port": 7002, "token": "cd" * 32}


def with_node(tmp_path: Path, steps: dict[int, int], body: Callable[..., Awaitable[None]],
              registered: bool = True) -> None:
    """A node whose workers (rank -> completed steps) reported interrupted; ``body(commands,
    workers, beats)`` runs against it."""

    async def main() -> None:
        server = ChannelServer(str(tmp_path / "agent.sock"))
        beats: list[int] = []
        server.on_interrupted = lambda link: beats.append(link.rank)
        await server.start()
        workers: dict[int, ac.AsyncChannel] = {}
        try:
            for rank, step in steps.items():
                chan = ac.AsyncChannel(*await asyncio.open_unix_connection(server.path))
                await chan.send(ac.message(ac.HELLO, rank=rank, local_rank=rank, pid=1000 + rank, joining=False))
                await chan.send(ac.message(ac.INTERRUPTED, gen=1, step=step, registered=registered,
                                           error="RuntimeError: Connection closed by peer"))
                workers[rank] = chan
            await server.wait_for([1000 + r for r in steps], timeout=5)
            for _ in range(100):
                if all(lk.state == "interrupted" for lk in server.links.values()):
                    break
                await asyncio.sleep(0.01)
            procs = {1000 + r: SimpleNamespace(rank=r, pid=1000 + r, returncode=None) for r in steps}
            agent = SimpleNamespace(node="n1", world_size=3, gen=1, lost_nodes=0, channel=server,
                                    group=SimpleNamespace(workers=procs, told_to_exit=set()),
                                    timeouts=Timeouts(collective=1, step=2, reform=3, decision=5))
            commands = Commands.__new__(Commands)  # the handler only needs its agent
            commands.agent, commands.joiners = agent, {}
            await asyncio.wait_for(body(commands, workers, beats), 20)
        finally:
            for chan in workers.values():
                await chan.close()
            await server.close()

    asyncio.run(main())


async def answer_joined(chan: ac.AsyncChannel, step: int, nbytes: int) -> dict[str, Any]:
    """Play a worker: take the recover, answer as a re-entered script parked in register()."""
    msg = await chan.recv()
    assert msg is not None and msg["t"] == ac.RECOVER
    await chan.send(ac.message(ac.READY))
    await chan.send(ac.message(ac.JOINED, step=step, bytes=nbytes, seconds=0.25))
    return msg


def test_the_leader_donates_and_the_lagging_worker_loads_the_donors_state(tmp_path: Path) -> None:
    async def body(commands: Commands, workers: dict[int, ac.AsyncChannel], beats: list[int]) -> None:
        assert sorted(beats) == [0, 1]  # each interruption asked for a heartbeat at once
        args = {"gen": 2, "world_size": 3, "step": 7, "donate": {"rank": 2, "dest": DEST}}
        with pytest.raises(MigrationError, match=r"ranks \[1\] lag behind step 7"):
            await commands.recover(args, 2, "r1")
        got = asyncio.gather(answer_joined(workers[0], 7, 4096), answer_joined(workers[1], 7, 0))
        result = await commands.recover({**args, "load_from": SOURCE}, 2, "r2")
        leader, lagging = await got
        assert (leader["donate"], leader["load_from"], leader["step"]) == ([{"to": 2, "dest": DEST}], None, 7)
        assert (lagging["donate"], lagging["load_from"]) == ([], SOURCE)
        assert result["step"] == 7 and result["bytes"] == 4096 and set(result["ranks"]) == {"0", "1"}
        assert commands.agent.lost_nodes == 1
        assert {lk.state for lk in commands.agent.channel.links.values()} == {"joined"}
        # the recovery is given up before the resume: the parked survivors are told to exit
        aborted = await commands.abort({"exit": True}, 2, "r2")
        assert (aborted["interrupted"], aborted["exited"]) == ([0, 1], True)
        assert [(await workers[r].recv())["t"] for r in (0, 1)] == [ac.EXIT, ac.EXIT]
        assert commands.agent.group.told_to_exit == {1000, 1001}  # their exit codes will be the node's

    with_node(tmp_path, {0: 7, 1: 6}, body)


def test_workers_ahead_or_not_registered_are_refused(tmp_path: Path) -> None:
    async def body(commands: Commands, workers: dict[int, ac.AsyncChannel], beats: list[int]) -> None:
        with pytest.raises(MigrationError, match=r"never called torchpass.register\(\)"):
            await commands.recover({"gen": 2, "step": 5}, 2, "r1")

    with_node(tmp_path, {0: 5}, body, registered=False)

    async def ahead(commands: Commands, workers: dict[int, ac.AsyncChannel], beats: list[int]) -> None:
        with pytest.raises(MigrationError, match=r"completed more than step 4"):
            await commands.recover({"gen": 2, "step": 4}, 2, "r1")
        commands.agent.channel.links[1000].interruption = None  # as a worker still training
        with pytest.raises(MigrationError, match=r"not interrupted"):
            await commands.recover({"gen": 2, "step": 5}, 2, "r2")

    (tmp_path / "ahead").mkdir()
    with_node(tmp_path / "ahead", {0: 5}, ahead)


@pytest.mark.security
def test_a_recover_naming_a_file_path_is_refused_before_any_worker_hears_of_it(tmp_path: Path) -> None:
    """Commands never carry filesystem paths: load_from (alone or per rank) or a donation's dest
    with a path is a ProtocolError, and the workers get no recover."""
    async def body(commands: Commands, workers: dict[int, ac.AsyncChannel], beats: list[int]) -> None:
        base = {"gen": 2, "world_size": 3, "step": 7, "donate": {"rank": 2, "dest": DEST}}
        for bad in ({"load_from": {"path": "/tmp/state.pt"}}, {"load_from": {"1": {"path": "/tmp/state.pt"}}},
                    {"load_from": {**SOURCE, "path": "/tmp/state.pt"}},
                    {"load_from": SOURCE, "donate": {"rank": 2, "dest": {"path": "/tmp/out.pt"}}}):
            with pytest.raises(ProtocolError, match="commands never carry filesystem paths"):
                await commands.recover({**base, **bad}, 2, "r1")
        for chan in workers.values():  # nothing was sent to them
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(chan.recv(), 0.2)

    with_node(tmp_path, {0: 7, 1: 6}, body)
