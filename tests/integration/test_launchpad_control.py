"""launchpad driven over a real mosquitto by a test playing the orchestrator: pause after a step,
re-form as generation 2 and resume, with training bit-identical to torchrun's uninterrupted run
(slow and few-millisecond steps); repeated commands acked once-executed; garbage dropped; a broker
restart not disturbing training and heartbeats coming back; the Last Will when launchpad dies."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import test_launchpad_training as lt
from test_launchpad_training import (
    Procs,
    TorchrunReference,
    assert_same_training,
    launchpad_argv,
    results,
    write_script,
)

from tests.support.broker import Mosquitto
from torchpass_common import mqtt, protocol
from torchpass_common.config import render

procs = lt.procs
torchrun_reference = lt.torchrun_reference
pytestmark = [pytest.mark.mqtt, pytest.mark.slow]
JOB, NODE = "job7", "n1"
HB_INTERVAL = 0.2


class Orchestrator:
    """The test's side of the control plane: sees heartbeats, states and acks, sends commands."""

    def __init__(self, client: mqtt.ControlClient) -> None:
        self.client = client
        self.heartbeats: list[protocol.Message] = []
        self.states: list[protocol.Message] = []
        self.acks: dict[str, list[protocol.Message]] = {}
        self._changed = asyncio.Condition()

    async def pump(self) -> None:
        async for _topic, msg in self.client.messages():
            async with self._changed:
                if msg.kind == protocol.HEARTBEAT:
                    self.heartbeats.append(msg)
                elif msg.kind == protocol.STATE:
                    self.states.append(msg)
                elif msg.kind == protocol.ACK:
                    self.acks.setdefault(msg.body["command_id"], []).append(msg)
                self._changed.notify_all()

    async def until(self, predicate: Any, timeout: float = 60.0) -> Any:
        async with self._changed:
            return await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    def steps(self, *, running: bool = False) -> list[int]:
        """Each worker's step in the last heartbeat (only running workers' if ``running``)."""
        workers = self.heartbeats[-1].body["workers"] if self.heartbeats else []
        return [w["step"] for w in workers if not running or w["state"] != "exited"]

    async def send(self, cmd: str, args: dict[str, Any], *, gen: int, migration: str = "m1",
                   payload: bytes | None = None) -> str:
        payload = payload or protocol.encode(protocol.COMMAND, job=JOB, gen=gen,
                                             body={"cmd": cmd, "migration": migration, "args": args})
        await self.client.publish(protocol.cmd_topic(JOB, NODE), payload)
        return protocol.decode(payload).id

    async def command(self, cmd: str, args: dict[str, Any], *, gen: int, migration: str = "m1",
                      timeout: float = 60.0) -> protocol.Message:
        cid = await self.send(cmd, args, gen=gen, migration=migration)
        await self.until(lambda: cid in self.acks, timeout)
        return self.acks[cid][0]


@contextlib.asynccontextmanager
async def orchestrator(broker: Mosquitto, cls: type[Orchestrator] = Orchestrator) -> AsyncIterator[Orchestrator]:
    async with mqtt.ControlClient(broker.config(keepalive=2), "test-orchestrator") as client:
        for kind in (protocol.HEARTBEAT, protocol.STATE, protocol.ACK):
            await client.subscribe(protocol.nodes_filter(kind, JOB))
        await client.wait_connected(10)
        orch = cls(client)
        task = asyncio.create_task(orch.pump())
        try:
            yield orch
        finally:
            task.cancel()


def start_launchpad(procs: Procs, tmp_path: Path, broker: Mosquitto, steps: int, pace: float,
                    script_text: str = lt.TRAIN_SCRIPT) -> Any:
    config = tmp_path / "torchpass.toml"
    config.write_text(render({"broker": broker.section(keepalive=2), "timeouts": {"heartbeat_interval": HB_INTERVAL}}))
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path, script_text)
    proc = procs.start(launchpad_argv("--standalone", "--nproc-per-node=2", "--job", JOB, "--node", NODE,
                                      "--config", str(config), str(script), str(out), str(steps), str(pace)),
                       env={"TORCHPASS_LOG_LEVEL": "info"},  # all of its log in
                       log=tmp_path / "launchpad.log")  # the file shown on failure
    return proc, out


async def wait_listening(port: int, timeout: float = 120.0) -> None:
    """Until something listens on 127.0.0.1:``port`` (a joiner's wormhole receiver)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        assert asyncio.get_running_loop().time() < deadline, f"nothing listens on port {port}"
        await asyncio.sleep(0.1)


async def wait_exit(proc: Any, timeout: float = 120.0) -> None:
    await asyncio.to_thread(proc.wait, timeout)
    assert proc.returncode == 0, f"launchpad exited {proc.returncode}"


@pytest.fixture(autouse=True)
def _show_launchpad_log_on_failure(tmp_path: Path) -> Iterator[None]:
    """The agent's and workers' output is the first thing to read when a test here fails."""
    yield
    log = tmp_path / "launchpad.log"
    if log.exists():
        print(f"---- {log} (tail) ----\n{log.read_text()[-6000:]}")


async def pause_somewhere_ahead(orch: Orchestrator, ahead: int) -> tuple[int, int]:
    """Pause a few steps ahead of the last heartbeat; if a rank was already past it (fast steps),
    ask again further ahead, as the orchestrator does. Returns (pause step, attempts)."""
    for attempt in range(1, 6):
        at = max(orch.steps()) + ahead * attempt
        ack = await orch.command("pause", {"at_step": at}, gen=2, migration=f"pause{attempt}")
        if ack.body["ok"]:
            assert set(ack.body["result"]["steps"].values()) == {at}
            return at, attempt
    raise AssertionError(f"no pause landed: {ack.body['error']}")


@pytest.mark.parametrize(("steps", "pace", "ahead"), [(100, 0.05, 10), (1500, 0.0, 40)], ids=["slow", "fast"])
def test_pause_reform_resume_is_bit_identical(procs: Procs, tmp_path: Path, mosquitto: Mosquitto,
                                              torchrun_reference: TorchrunReference,
                                              steps: int, pace: float, ahead: int) -> None:
    async def drive() -> None:
        async with orchestrator(mosquitto) as orch:
            proc, out = start_launchpad(procs, tmp_path, mosquitto, steps, pace)
            await orch.until(lambda: orch.steps() and min(orch.steps()) >= 3)
            at, _ = await pause_somewhere_ahead(orch, ahead)
            # parked: heartbeats keep coming and show every worker still at the pause step
            seen = len(orch.heartbeats)
            await orch.until(lambda: len(orch.heartbeats) >= seen + 3)
            assert orch.steps() == [at, at]
            assert {w["state"] for w in orch.heartbeats[-1].body["workers"]} == {"paused"}
            assert "path" not in orch.heartbeats[-1].body  # no links.fabric, none set by the job: the backends choose
            ack = await orch.command("reform", {"ifname": "eth0; rm -rf"}, gen=2, migration="m1")
            assert not ack.body["ok"] and "network interface name" in ack.body["error"]
            # a reroute's re-form: the new generation's collectives take the interface named
            ack = await orch.command("reform", {"ifname": "lo"}, gen=2, migration="m2")
            assert ack.body["ok"], ack.body["error"]
            ack = await orch.command("resume", {}, gen=2, migration="m2")
            assert ack.body["ok"], ack.body["error"]
            await orch.until(lambda: orch.heartbeats[-1].gen == 2 and min(orch.steps()) > at)
            assert orch.heartbeats[-1].body["path"] == "lo"
            await wait_exit(proc)
            assert_same_training(results(out, 2), torchrun_reference(2, steps))

    asyncio.run(drive())


def test_a_new_process_takes_over_a_rank_bit_identically(procs: Procs, tmp_path: Path, mosquitto: Mosquitto,
                                                         torchrun_reference: TorchrunReference) -> None:
    """The local migration flow: pause, start a joiner for rank 1, the old rank 1 sends its state
    through the wormhole to the joiner's receiver, exits; rank 0 and the joiner re-form as generation
    2 and resume. A start_joiner or save naming a file path is refused first (commands never carry
    paths). (torchpassd starts the joiner before the pause to keep the pause short; here the pause
    comes first so that a joiner slow to import torch on a loaded machine cannot find the short run
    already over.)"""
    steps, port, token = 300, lt.free_port(), secrets.token_hex(32)

    async def drive() -> None:
        async with orchestrator(mosquitto) as orch:
            proc, out = start_launchpad(procs, tmp_path, mosquitto, steps, 0.02, lt.HANDOVER_SCRIPT)
            await orch.until(lambda: orch.steps() and min(orch.steps()) >= 3)
            at, _ = await pause_somewhere_ahead(orch, 20)
            planted = tmp_path / "rank1.state"
            for cmd, args in (("start_joiner", {"rank": 1, "source": {"path": str(planted)}}),
                              ("save", {"rank": 1, "dest": {"path": str(planted)}})):
                ack = await orch.command(cmd, args, gen=2, migration="paths")  # its own: acks are kept per command
                assert not ack.body["ok"] and "commands never carry filesystem paths" in ack.body["error"], ack.body
            assert not planted.exists()
            source = {"host": "127.0.0.1", "port": port, "token": token}
            ack = await orch.command("start_joiner", {"rank": 1, "source": source}, gen=2)
            assert ack.body["ok"], ack.body["error"]
            joiner = ack.body["result"]["pid"]
            await wait_listening(port)  # as torchpassd does: the joiner sits in register()
            dest = {"host": "127.0.0.1", "port": port, "token": token}
            for cmd, args in (("save", {"rank": 1, "dest": dest}), ("exit", {"rank": 1}),
                              ("reform", {}), ("resume", {})):
                ack = await orch.command(cmd, args, gen=2)
                assert ack.body["ok"], f"{cmd}: {ack.body['error']}"
            await orch.until(lambda: orch.steps(running=True) and min(orch.steps(running=True)) > at)
            workers = orch.heartbeats[-1].body["workers"]
            assert sorted((w["rank"], w["pid"] == joiner) for w in workers if w["state"] != "exited") == [
                (0, False), (1, True)]
            assert [(w["rank"], w["step"], w["exit_code"]) for w in workers if w["state"] == "exited"] == [(1, at, 0)]
            await wait_exit(proc)
            got = results(out, 2)
            assert got[1]["env"]["TORCHPASS_JOIN"] == "1"  # rank 1's results come from the new process
            assert_same_training(got, torchrun_reference(2, steps))

    asyncio.run(drive())


def test_repeated_commands_are_executed_once_and_garbage_is_dropped(procs: Procs, tmp_path: Path,
                                                                    mosquitto: Mosquitto) -> None:
    async def drive() -> None:
        async with orchestrator(mosquitto) as orch:
            proc, _ = start_launchpad(procs, tmp_path, mosquitto, 80, 0.05)
            await orch.until(lambda: orch.steps() and min(orch.steps()) >= 2)
            topic = protocol.cmd_topic(JOB, NODE)
            for junk in (b"\x00garbage", b"\x81\xa1v\x63",
                         protocol.encode(protocol.EVENT, job=JOB, gen=1, body={"event": "wrong topic"})):
                await orch.client.publish(topic, junk)
            at = max(orch.steps()) + 20  # well ahead: heartbeats lag the workers on a busy machine
            payload = protocol.encode(protocol.COMMAND, job=JOB, gen=2,
                                      body={"cmd": "pause", "migration": "dup", "args": {"at_step": at}})
            cid = await orch.send("pause", {}, gen=2, payload=payload)
            await orch.send("pause", {}, gen=2, payload=payload)  # redelivery of the same message
            await orch.until(lambda: len(orch.acks.get(cid, [])) == 2)
            first, second = orch.acks[cid]
            assert first.body == second.body and first.body["ok"]
            bad = await orch.command("save", {"rank": 9, "dest": {"host": "127.0.0.1", "port": lt.free_port(),
                                                                  "token": "ab" * 32}}, gen=2)
            assert not bad.body["ok"] and "rank=9" in bad.body["error"]
            ack = await orch.command("resume", {}, gen=1, migration="dup")
            assert ack.body["ok"], ack.body["error"]
            await wait_exit(proc)

    asyncio.run(drive())


@pytest.mark.faults
def test_broker_restart_does_not_disturb_training(procs: Procs, tmp_path: Path, mosquitto: Mosquitto,
                                                 torchrun_reference: TorchrunReference) -> None:
    async def drive() -> None:
        async with orchestrator(mosquitto) as orch:
            proc, out = start_launchpad(procs, tmp_path, mosquitto, 120, 0.05)
            await orch.until(lambda: orch.steps() and min(orch.steps()) >= 2)
            mosquitto.stop(signal.SIGKILL)
            await asyncio.sleep(1.5)  # training goes on while the broker is away
            mosquitto.start()
            before = len(orch.heartbeats)
            await orch.until(lambda: len(orch.heartbeats) >= before + 3, timeout=30)
            online = [s for s in orch.states if s.body["online"]]
            assert online, "launchpad did not re-announce its online state after the restart"
            await wait_exit(proc)
            assert_same_training(results(out, 2), torchrun_reference(2, 120))

    asyncio.run(drive())


@pytest.mark.faults
def test_last_will_says_offline_when_launchpad_is_killed(procs: Procs, tmp_path: Path,
                                                         mosquitto: Mosquitto) -> None:
    async def drive() -> None:
        async with orchestrator(mosquitto) as orch:
            proc, _ = start_launchpad(procs, tmp_path, mosquitto, 400, 0.05)
            await orch.until(lambda: any(s.body["online"] for s in orch.states))
            await orch.until(lambda: orch.steps() and min(orch.steps()) >= 1)
            pids = [w["pid"] for w in orch.heartbeats[-1].body["workers"]]
            proc.kill()
            await orch.until(lambda: orch.states and not orch.states[-1].body["online"], timeout=10)
            await asyncio.to_thread(proc.wait, 10)
            for _ in range(100):  # workers die with their agent (parent-death signal)
                if not any(Path(f"/proc/{pid}").exists() for pid in pids):
                    break
                await asyncio.sleep(0.1)
            assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "workers outlived launchpad"

    asyncio.run(drive())
