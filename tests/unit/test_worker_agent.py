"""The worker's agent client against a launchpad end over a real socket pair, with real torch
training iterations (a module forward, an optimizer step) driving the step boundary: step reports,
parking at the chosen step (before the next forward), pause_missed, a failed command reported while
staying parked, and resume."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from torchpass import steps
from torchpass.agent import REPORT_EVERY_S, Agent
from torchpass_common import agent_channel as ac


def next_reply(chan: ac.SyncChannel) -> dict:
    """The next message other than a step report."""
    while True:
        msg = chan.recv()
        if msg is None or msg["t"] != ac.STEP:
            return msg


@pytest.fixture
def setup():
    steps.install()
    agent_end, worker_end = socket.socketpair()
    agent_end.settimeout(30)
    launchpad = ac.SyncChannel(agent_end)
    agent = Agent(ac.SyncChannel(worker_end), rank=3, local_rank=1, joining=False)
    agent.start()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(iterations: int = 1) -> None:
        """Training iterations as a script runs them: forward (a pause parks before it), step."""
        for _ in range(iterations):
            model(torch.ones(1))
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
    yield agent, launchpad, train
    steps.on_boundary(None)
    launchpad.close()


def test_hello_and_step_reports_thinned_for_fast_steps(setup):
    agent, launchpad, train = setup
    assert launchpad.recv()["t"] == ac.HELLO
    before = steps.current()
    train()
    agent.save_fn = lambda: {}  # what torchpass.register(save=...) sets: a model-aware move becomes possible
    train()  # reported at once although it follows closely: launchpad must learn of register()
    # the first report also says which ranks hold this rank's state: unknown here (no DDP, no DTensor);
    # from the second on, the CPU the training thread wanted per step since the last report (straggler signal)
    first, second = launchpad.recv(), launchpad.recv()
    busy = second.pop("busy")
    assert [first, second] == [
        {"t": "step", "step": before + 1, "registered": False, "replicas": None},
        {"t": "step", "step": before + 2, "registered": True}]
    assert isinstance(busy, float) and 0.0 <= busy < 1.0
    t0 = time.monotonic()
    train(200)  # sub-millisecond steps
    fast = time.monotonic() - t0
    time.sleep(REPORT_EVERY_S)
    train()  # after a pause longer than the interval: reported
    reports = []
    while not reports or reports[-1]["step"] != before + 203:
        reports.append(launchpad.recv())
    assert len(reports) <= 2 + fast / REPORT_EVERY_S, "fast steps must not each wake launchpad"
    assert [r["step"] for r in reports] == sorted(r["step"] for r in reports)


def test_parks_after_the_chosen_step_until_resume(setup, tmp_path):
    agent, launchpad, train = setup
    launchpad.recv()  # hello
    at_step = steps.current() + 2
    launchpad.send(ac.message(ac.PAUSE, gen=2, at_step=at_step))
    wait_for_command(agent)  # else a busy machine may run past the step before the pause arrives
    trainer = threading.Thread(target=train, args=(3,))
    trainer.start()
    assert next_reply(launchpad) == {"t": "paused", "gen": 2, "step": at_step}
    assert trainer.is_alive()  # parked before the next iteration's forward

    launchpad.send(ac.message(ac.SAVE, dest={"host": "127.0.0.1", "port": 9, "token": "ab" * 32}))
    reply = next_reply(launchpad)
    assert reply["t"] == ac.ERROR and "register" in reply["msg"]  # no save(): reported, still parked
    assert trainer.is_alive()

    # a save to a file path is refused before save() runs: nothing written, still parked
    saved: list[int] = []
    agent.save_fn = lambda: saved.append(1) or {"w": torch.ones(2)}
    launchpad.send(ac.message(ac.SAVE, dest={"path": str(tmp_path / "state.pt")}))
    reply = next_reply(launchpad)
    assert reply["t"] == ac.ERROR and "commands never carry filesystem paths" in reply["msg"], reply
    assert not saved and not (tmp_path / "state.pt").exists() and trainer.is_alive()

    launchpad.send(ac.message(ac.RESUME, gen=2))
    assert next_reply(launchpad) == {"t": "resumed", "gen": 2}
    trainer.join(30)
    assert not trainer.is_alive() and steps.current() == at_step + 1


def wait_for_command(agent: Agent) -> None:
    """Until the agent's reader thread has taken in the command just sent."""
    deadline = time.monotonic() + 30
    while not agent._wake:
        assert time.monotonic() < deadline, "the agent never received the command"
        time.sleep(0.001)


def test_a_pause_for_a_step_boundary_already_passed_is_answered_missed_at_once(setup):
    """Without waiting for the next boundary: the rank's current step may be waiting in a collective
    on ranks that did park at that boundary, and would wait there until the collective timeout."""
    agent, launchpad, train = setup
    launchpad.recv()  # hello
    train()
    done = steps.current()
    assert launchpad.recv() == {"t": "step", "step": done, "registered": False, "replicas": None}
    # done: the boundary it went on from, into a step that has not ended (no train() here)
    for at_step in (done - 1, done):
        launchpad.send(ac.message(ac.PAUSE, gen=2, at_step=at_step))
        assert next_reply(launchpad) == {"t": "pause_missed", "gen": 2, "step": done}
    assert not agent._wake  # nothing left for the next boundary: it trains on
    launchpad.send(ac.message(ac.PAUSE, gen=2, at_step=done + 1))  # the boundary ahead: parks there
    trainer = threading.Thread(target=train, args=(2,))
    trainer.start()
    assert next_reply(launchpad) == {"t": "paused", "gen": 2, "step": done + 1}
    launchpad.send(ac.message(ac.RESUME, gen=2))
    assert next_reply(launchpad) == {"t": "resumed", "gen": 2}
    trainer.join(30)
    assert not trainer.is_alive() and steps.current() == done + 2


def test_commands_other_than_pause_and_exit_are_refused_while_running(setup):
    agent, launchpad, train = setup
    launchpad.recv()  # hello
    launchpad.send(ac.message(ac.RESUME, gen=5))
    wait_for_command(agent)
    train()
    reply = next_reply(launchpad)
    assert reply["t"] == ac.ERROR and "while running" in reply["msg"]


def test_a_parked_rank_asked_to_pause_later_trains_on_and_parks_there(setup):
    agent, launchpad, train = setup
    launchpad.recv()  # hello
    first = steps.current() + 1
    launchpad.send(ac.message(ac.PAUSE, gen=2, at_step=first))
    wait_for_command(agent)  # else a busy machine may run the first step before the pause arrives
    trainer = threading.Thread(target=train, args=(4,))
    trainer.start()
    assert next_reply(launchpad) == {"t": "paused", "gen": 2, "step": first}
    # Another rank had missed `first`: launchpad moves everyone's pause two steps later.
    launchpad.send(ac.message(ac.PAUSE, gen=2, at_step=first + 2))
    assert next_reply(launchpad) == {"t": "paused", "gen": 2, "step": first + 2}
    launchpad.send(ac.message(ac.RESUME, gen=2))
    assert next_reply(launchpad) == {"t": "resumed", "gen": 2}
    trainer.join(30)
    assert not trainer.is_alive() and steps.current() == first + 3


def test_training_goes_on_when_launchpad_goes_away(setup):
    agent, launchpad, train = setup
    launchpad.recv()  # hello
    launchpad.close()
    before = steps.current()
    train(50)  # step reports into the closed socket fail quietly
    assert steps.current() == before + 50
    assert agent._gone
