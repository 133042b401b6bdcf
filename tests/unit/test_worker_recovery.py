"""A re-entered survivor's register() (Agent.join with a Rejoin), against a launchpad end over a
real socket pair: one that lagged a step loads the donor's state, not its own; when the donor's
stream is torn mid-transfer it says so, reports interrupted again with its own state kept, and
takes a second recover. Plus the classification: only a failed collective interrupts a worker,
and one without register() cannot be recovered (a clear error, it stays interrupted)."""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from launchpad.wormhole import send_state, sinks
from launchpad.wormhole.transport import Stream, TcpTransport
from tests.support.ports import free_port
from torchpass import default_group, handover, recovery, steps
from torchpass.agent import Agent
from torchpass_common import agent_channel as ac
from torchpass_common.errors import WorkerError, WormholeError
from torchpass_common.timeouts import Timeouts
from torchpass_common.transfer_address import TransferAddress

SHORT = Timeouts(collective=1.0, step=2.0, reform=3.0, decision=10.0)


def next_reply(chan: ac.SyncChannel) -> dict[str, Any]:
    while True:
        msg = chan.recv()
        assert msg is not None
        if msg["t"] != ac.STEP:
            return msg


@pytest.fixture
def local_group() -> Iterator[None]:
    """A joining rank's local default group (rank 1 of 3), as a re-entered script builds it."""
    default_group.install(joining=True)
    dist.init_process_group("gloo", rank=1, world_size=3)
    count = steps.current()
    yield
    dist.destroy_process_group()
    default_group.forget()
    default_group.install(joining=False)
    steps.on_boundary(None)
    steps.restore(count)


def agent_pair(**kw: Any) -> tuple[Agent, ac.SyncChannel]:
    agent_end, worker_end = socket.socketpair()
    agent_end.settimeout(30)
    agent = Agent(ac.SyncChannel(worker_end), rank=1, local_rank=1, joining=True, timeouts=SHORT, **kw)
    agent.start()
    launchpad = ac.SyncChannel(agent_end)
    assert launchpad.recv()["t"] == ac.HELLO
    return agent, launchpad


def state(who: str, value: float) -> dict[str, Any]:
    return {"w": torch.full((256, 1024), value), "who": who}


def test_a_lagging_survivor_loads_the_donors_state_after_a_torn_stream(local_group: None) -> None:
    agent, launchpad = agent_pair()
    loaded: list[Any] = []
    live = state("template", 0.0)  # the survivor's own tensors, as its save() returns them
    agent.save_fn, agent.load_fn = (lambda: live), loaded.append
    own, donor = handover.record(state("own", 6.0), 6, []), handover.record(state("donor", 7.0), 7, [])
    token, port = secrets.token_bytes(32), free_port()
    agent.rejoin = recovery.Rejoin(TransferAddress("127.0.0.1", port, token), own, 6, gen=1)
    joined = threading.Thread(target=agent.join, daemon=True)
    joined.start()
    assert next_reply(launchpad)["t"] == ac.READY

    with pytest.raises(WormholeError):
        send_state(donor, "127.0.0.1", port, token, chunk_bytes=64 << 10, transport=Tearing())
    error = next_reply(launchpad)
    assert error["t"] == ac.ERROR and "keeps its own state (step 6)" in error["msg"]
    again = next_reply(launchpad)
    assert (again["t"], again["gen"], again["step"], again["registered"]) == (ac.INTERRUPTED, 1, 6, True)
    assert not loaded  # nothing half-received was loaded
    assert torch.equal(live["w"], torch.zeros(256, 1024))  # nor written into the survivor's own tensors
    token2, port2 = secrets.token_bytes(32), free_port()
    launchpad.send(ac.message(ac.RECOVER, gen=2, world_size=3, step=7, donate=[],
                              load_from={"host": "127.0.0.1", "port": port2, "token": token2.hex()}))
    assert next_reply(launchpad)["t"] == ac.READY  # listening again, on the new source
    handover.send(donor, TransferAddress("127.0.0.1", port2, token2), rank=0)
    joined_msg = next_reply(launchpad)
    assert (joined_msg["t"], joined_msg["step"], joined_msg["bytes"]) == (ac.JOINED, 7, 0)
    assert loaded[0]["who"] == "donor" and torch.equal(loaded[0]["w"], donor["user"]["w"])
    assert steps.current() == 7 and agent.rejoin is None
    launchpad.send(ac.message(ac.RESUME, gen=2))
    assert next_reply(launchpad) == {"t": ac.RESUMED, "gen": 2}
    joined.join(10)
    assert not joined.is_alive()


def test_a_fresh_joiner_receives_straight_into_its_own_tensors(local_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No staging copy of the state on a joiner (a 4 GiB rank would need 8 GiB): the donor's bytes
    land in the tensors its save() returned, before its load() runs."""
    staged: list[torch.Size] = []
    real_staging = sinks.host_staging
    monkeypatch.setattr(sinks, "host_staging", lambda t, stride: staged.append(t.shape) or real_staging(t, stride))
    token, port = secrets.token_bytes(32), free_port()
    monkeypatch.setenv(ac.ENV_JOIN_SOURCE, json.dumps(TransferAddress("127.0.0.1", port, token).wire()))
    agent, launchpad = agent_pair()
    live = state("template", 0.0)
    seen: list[bool] = []
    agent.save_fn = lambda: live
    agent.load_fn = lambda user: seen.append(user["w"] is live["w"] and bool((live["w"] == 7.0).all()))
    joined = threading.Thread(target=agent.join, daemon=True)
    joined.start()
    assert next_reply(launchpad)["t"] == ac.READY
    handover.send(handover.record(state("donor", 7.0), 7, []), TransferAddress("127.0.0.1", port, token), rank=0)
    assert next_reply(launchpad)["t"] == ac.JOINED
    assert seen == [True] and staged == []
    launchpad.send(ac.message(ac.RESUME, gen=1))
    assert next_reply(launchpad)["t"] == ac.RESUMED
    joined.join(10)
    assert not joined.is_alive()


def test_without_register_a_recover_is_refused_and_the_rank_stays_interrupted(local_group: None) -> None:
    agent, launchpad = agent_pair()
    result: list[Any] = []

    def wait() -> None:
        try:
            result.append(recovery.wait_for_recover(agent, None, 4, 1, "RuntimeError: peer lost"))
        except WorkerError as exc:
            result.append(exc)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    assert next_reply(launchpad) == {"t": ac.INTERRUPTED, "gen": 1, "step": 4, "registered": False,
                                     "error": "RuntimeError: peer lost"}
    launchpad.send(ac.message(ac.RECOVER, gen=2, world_size=3, step=4, donate=[]))
    error = next_reply(launchpad)
    assert error["t"] == ac.ERROR and "never called torchpass.register(" in error["msg"]
    assert next_reply(launchpad)["t"] == ac.INTERRUPTED
    assert waiting.is_alive() and not result
    launchpad.close()  # launchpad gone: the interrupted rank gives up with a clear error
    waiting.join(10)
    assert isinstance(result[0], WorkerError) and "went away" in str(result[0])


@pytest.mark.security
def test_a_recover_whose_source_or_donation_is_a_file_path_is_refused_and_the_rank_keeps_its_state(
        local_group: None, tmp_path: Path) -> None:
    """Commands never carry filesystem paths: a recover loading from a path, or donating to one, is
    refused before anything is read or written; the rank reports interrupted again and a proper
    recover then goes through with its own state."""
    agent, launchpad = agent_pair()
    own = handover.record(state("own", 4.0), 4, [])
    result: list[Any] = []
    waiting = threading.Thread(target=lambda: result.append(recovery.wait_for_recover(agent, own, 4, 1, "lost")),
                               daemon=True)
    waiting.start()
    assert next_reply(launchpad)["t"] == ac.INTERRUPTED
    planted = tmp_path / "planted.pt"
    planted.write_bytes(b"not to be read")
    written = tmp_path / "written.pt"
    for bad in ({"load_from": {"path": str(planted)}},
                {"donate": [{"to": 2, "dest": {"path": str(written)}}]},
                {"donate": [{"to": 2, "dest": {"host": "127.0.0.1", "port": free_port(), "token": "ab" * 32,
                                               "path": str(written)}}]}):
        launchpad.send(ac.message(ac.RECOVER, gen=2, world_size=3, step=4, **{"donate": [], **bad}))
        error = next_reply(launchpad)
        assert error["t"] == ac.ERROR and "commands never carry filesystem paths" in error["msg"], error
        again = next_reply(launchpad)
        assert (again["t"], again["step"], again["registered"]) == (ac.INTERRUPTED, 4, True)
    assert not written.exists() and not result
    launchpad.send(ac.message(ac.RECOVER, gen=2, world_size=3, step=4, donate=[]))
    waiting.join(10)
    assert result and result[0].source == {"record": own} and result[0].step == 4


def test_only_a_failed_collective_makes_an_interruption(local_group: None) -> None:
    group = default_group.group()
    assert group is not None and group.failed() is None
    assert not recovery.is_interruption(ValueError("a bug in the script"))
    group.failure = RuntimeError("Connection closed by peer")  # what failed() found in a failed work
    assert recovery.is_interruption(RuntimeError("anything the script raised then"))
    assert not recovery.is_interruption(SystemExit(0)) and not recovery.is_interruption(KeyboardInterrupt())


class WatchlessGroup:
    """A formed group none of whose works said it failed: gloo's reduce-scatter work has no future
    and, after failing, reports neither completion nor an error (torch 2.13)."""

    local = False

    def __init__(self) -> None:
        self.failure: BaseException | None = None

    def failed(self) -> BaseException | None:
        return self.failure


def test_a_peer_lost_under_a_reduce_scatter_is_an_interruption(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in CI: a node killed while FSDP's backward reduce-scattered failed the job instead of
    starting the unplanned flow. gloo's broken-connection error (also as the cause of what the script
    raised) is an interruption; anything else still is the script's own error."""
    group = WatchlessGroup()
    monkeypatch.setattr(default_group, "group", lambda: group)
    monkeypatch.setattr(recovery, "_GRACE", 0.05)
    assert not recovery.is_interruption(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert group.failure is None
    broken = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                          "[10.78.0.12]:61672: Connection reset by peer")
    try:
        try:
            raise broken
        except RuntimeError as exc:
            raise ValueError("the script wrapped it") from exc
    except ValueError as wrapped:
        assert recovery.is_interruption(wrapped)
    assert group.failure is broken  # the interruption report carries gloo's own error


class Tearing(TcpTransport):
    """Its streams die after 256 KiB: a donor lost in the middle of its transfer."""

    def connect(self, host: str, port: int, timeout: float) -> Stream:
        stream = super().connect(host, port, timeout)
        sent = [0]
        send = stream.send

        def tearing_send(*parts: bytes | memoryview) -> None:
            sent[0] += sum(memoryview(p).nbytes for p in parts)
            if sent[0] > 256 << 10:
                stream.close()
                raise WormholeError("the donor died mid-transfer")
            send(*parts)

        stream.send = tearing_send  # type: ignore[method-assign]
        return stream

