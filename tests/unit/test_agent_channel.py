"""The worker <-> launchpad local channel over a real Unix socket: a sync worker end talking to
an asyncio agent end, plus the checks that reject malformed or oversized frames."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import msgpack
import pytest

from torchpass_common import agent_channel as ac
from torchpass_common.errors import ProtocolError


def test_worker_and_agent_exchange_messages_over_a_unix_socket(tmp_path):
    path = str(tmp_path / "agent.sock")

    async def agent() -> list[dict]:
        got: list[dict] = []
        done = asyncio.Event()

        async def on_worker(reader, writer):
            ch = ac.AsyncChannel(reader, writer)
            got.append(await ch.recv())
            await ch.send(ac.message(ac.PAUSE, gen=2, at_step=7))
            got.append(await ch.recv())
            got.append(await ch.recv())  # None: worker closed
            await ch.close()
            done.set()

        server = await asyncio.start_unix_server(on_worker, path=path)
        ready.set()
        async with server:
            await asyncio.wait_for(done.wait(), 10)
        return got

    ready = threading.Event()
    result: list = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(agent())))
    t.start()
    assert ready.wait(10)
    worker = ac.SyncChannel.connect(path)
    worker.send(ac.message(ac.HELLO, rank=1, local_rank=0, pid=123, joining=False))
    assert worker.recv() == {"t": "pause", "gen": 2, "at_step": 7}
    worker.send(ac.message(ac.PAUSED, gen=2, step=7))
    worker.close()
    t.join(10)
    assert result == [[{"t": "hello", "rank": 1, "local_rank": 0, "pid": 123, "joining": False},
                       {"t": "paused", "gen": 2, "step": 7}, None]]


@pytest.mark.parametrize("bad", [
    {"rank": 1},                                   # no type
    {"t": "fly", "x": 1},                          # unknown type
    {"t": "pause", "gen": 2},                      # missing at_step
    {"t": "step", "step": "3"},                    # wrong type
    {"t": "step", "step": True},                   # bool is not an int here
])
def test_malformed_messages_are_protocol_errors(bad):
    with pytest.raises(ProtocolError):
        ac.validate(bad)


def test_extra_fields_from_a_newer_peer_are_kept():
    assert ac.validate({"t": "resume", "gen": 3, "hint": "x"})["hint"] == "x"


def test_oversized_and_torn_frames_are_rejected():
    a, b = socket.socketpair()
    worker = ac.SyncChannel(b)
    a.sendall(struct.pack(">I", ac.MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        worker.recv()
    body = msgpack.packb({"t": "exit"})
    a.sendall(struct.pack(">I", len(body) + 5) + body)
    a.close()
    with pytest.raises(ProtocolError, match="middle of a frame"):
        worker.recv()
    worker.close()
    with pytest.raises(ProtocolError, match="over"):
        ac.encode(ac.message(ac.ERROR, msg="x" * (ac.MAX_FRAME + 1)))


def test_connect_to_a_missing_agent_says_what_to_do(tmp_path):
    with pytest.raises(ProtocolError, match="TORCHPASS_AGENT_SOCKET"):
        ac.SyncChannel.connect(str(tmp_path / "nope.sock"), timeout=1)
