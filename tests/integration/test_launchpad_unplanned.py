"""Unplanned recovery on localhost, the test playing torchpassd over a real mosquitto: three
launchpads ("nodes") x one worker train DDP (gloo); one node's launchpad and worker are SIGKILLed
between steps, while its worker waits in the gradient all-reduce, or during its optimizer step (or
frozen: SIGSTOP, found and killed by its launchpad's watchdog). The survivors report interrupted, a joiner is
started for the lost rank, the most advanced survivor donates its just-in-time state, everyone
re-enters the script, re-forms generation 2 and resumes at the step in progress: parameters and
per-step losses after the resume are bit-identical to an uninterrupted torchrun run."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_launchpad_control as lc
import test_launchpad_training as lt
from test_launchpad_training import Procs, TorchrunReference, launchpad_argv, results, write_script

from tests.support.broker import Mosquitto
from tests.support.processes import dead
from torchpass_common import protocol
from torchpass_common.config import render

procs = lt.procs
torchrun_reference = lt.torchrun_reference
pytestmark = [pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow]
JOB, NODES, DEAD = lc.JOB, ("n0", "n1", "n2"), "n2"
STEPS, AT, HOLD = 24, 6, 1.5
COLLECTIVE = 10.0  # timeouts.collective: how long the survivors would wait for a frozen peer

# The shared DDP script with torchpass.register() and a fault knob (env TP_FAULT, JSON): at
# completed step ``at`` the doomed rank marks the chosen phase in a file (the test kills it then) and
# holds ``hold`` s there; in the "backward" phase the other ranks hold in their backward instead, so
# the doomed one waits for them inside the all-reduce. Sleeping changes no number: the reference
# is the plain script under torchrun. Each rank also records its completed steps.
_KNOB = '''
fault = json.loads(os.environ.get("TP_FAULT") or "{}")


def _mark(what):
    with open(os.path.join(fault["dir"], f"rank{rank}.{what}"), "w") as f:
        f.write(str(progress["step"]))


def _hold(phase):
    if fault and fault["phase"] == phase and progress["step"] == fault["at"] and not os.path.exists(
            os.path.join(fault["dir"], "killed")):
        if rank == fault["rank"]:
            _mark(phase)
        if (rank == fault["rank"]) != (phase == "backward"):
            time.sleep(fault["hold"])


model.module[0].weight.register_hook(lambda grad: _hold("backward"))
opt.register_step_pre_hook(lambda *_: _hold("optimizer"))
'''


def with_knob(register: bool) -> str:
    text = lt._SCRIPT.replace("#REGISTER", ("import torchpass\ntorchpass.register(save=save, load=load)"
                                            if register else "") + _KNOB)
    text = text.replace('    progress["step"] += 1\n',
                        '    progress["step"] += 1\n    if fault:\n        _mark("step")\n        _hold("between")\n')
    assert text.count("_hold(") == 4  # the knob is in place
    return text


SCRIPT, PLAIN_SCRIPT = with_knob(register=True), with_knob(register=False)


class Orchestrator(lc.Orchestrator):
    """The control test's orchestrator, speaking to several nodes."""

    def hb(self, node: str) -> dict[str, Any] | None:
        """The last heartbeat body of ``node``."""
        return next((m.body for m in reversed(self.heartbeats) if m.body["node"] == node), None)

    def workers(self, node: str) -> list[dict[str, Any]]:
        return (self.hb(node) or {}).get("workers", [])

    async def to(self, node: str, cmd: str, args: dict[str, Any], *, gen: int, migration: str = "r1",
                 timeout: float = 120.0, ok: bool = True) -> dict[str, Any]:
        """Send ``cmd`` to ``node``; the ack's result (``ok``: it must succeed; else the ack body)."""
        payload = protocol.encode(protocol.COMMAND, job=JOB, gen=gen, body={"cmd": cmd, "migration": migration,
                                                                            "args": args})
        await self.client.publish(protocol.cmd_topic(JOB, node), payload)
        cid = protocol.decode(payload).id
        await self.until(lambda: cid in self.acks, timeout)
        body = self.acks[cid][0].body
        if not ok:
            return body
        assert body["ok"], f"{cmd} on {node}: {body['error']}"
        return body["result"]


def start_nodes(procs: Procs, tmp_path: Path, broker: Mosquitto, fault: dict[str, Any],
                script_text: str = SCRIPT) -> tuple[list, Path]:
    config = tmp_path / "torchpass.toml"
    config.write_text(render({"broker": broker.section(keepalive=2),
                               "timeouts": {"heartbeat_interval": lc.HB_INTERVAL, "collective": COLLECTIVE}}))
    out, marks = tmp_path / "out", tmp_path / "marks"
    out.mkdir()
    marks.mkdir()
    script = write_script(tmp_path, script_text)
    port = lt.free_port()
    env = {"TP_FAULT": json.dumps({**fault, "dir": str(marks)}),
           "TORCHPASS_LOG_LEVEL": "info"}  # launchpad's whole log in the files shown on failure
    nodes = [procs.start(launchpad_argv("--nnodes=3", f"--node-rank={i}", "--master-addr=127.0.0.1",
                                        f"--master-port={port}", "--nproc-per-node=1", "--job", JOB, "--node", node,
                                        "--config", str(config), str(script), str(out), str(STEPS)),
                         env=env, log=tmp_path / f"launchpad-{node}.log")
             for i, node in enumerate(NODES)]
    return nodes, marks


async def wait_file(path: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        await asyncio.sleep(0.02)
    return path.read_text()


@pytest.fixture(autouse=True)
def _show_logs_on_failure(tmp_path: Path) -> Iterator[None]:
    yield
    for log in sorted(tmp_path.glob("launchpad-*.log")):
        print(f"---- {log.name} (tail) ----\n{log.read_text()[-4000:]}")


# phase -> (how the doomed node goes, completed steps the survivors resume from)
CASES = {"between_steps": ("between", signal.SIGKILL, AT), "in_allreduce": ("backward", signal.SIGKILL, AT),
         "in_optimizer_step": ("optimizer", signal.SIGKILL, AT + 1), "frozen": ("between", signal.SIGSTOP, AT)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_node_is_recovered_at_the_step_in_progress(procs: Procs, tmp_path: Path, mosquitto: Mosquitto,
                                                           torchrun_reference: TorchrunReference, case: str) -> None:
    phase, how, resume_step = CASES[case]
    want = torchrun_reference(3, STEPS)

    async def drive() -> None:
        async with lc.orchestrator(mosquitto, Orchestrator) as orch:
            assert isinstance(orch, Orchestrator)
            nodes, marks = start_nodes(procs, tmp_path, mosquitto, {"rank": 2, "at": AT, "phase": phase, "hold": HOLD})
            await wait_file(marks / f"rank2.{phase}")
            await asyncio.sleep(0.3)  # well inside the hold: the doomed rank sits in that phase
            await orch.until(lambda: orch.workers(DEAD))
            worker = orch.workers(DEAD)[0]["pid"]
            dead_step = int((marks / "rank2.step").read_text())
            os.killpg(worker, how)
            if how == signal.SIGKILL:
                os.killpg(nodes[2].pid, signal.SIGKILL)
            (marks / "killed").write_text("1")
            t_kill = time.monotonic()
            survivors = NODES[:2]

            def interrupted() -> bool:
                return all([w["state"] for w in orch.workers(n)] == ["interrupted"] for n in survivors)
            await orch.until(interrupted, timeout=COLLECTIVE + 60)
            detect = time.monotonic() - t_kill
            if how == signal.SIGSTOP:  # its node's watchdog killed it (no step, no answer): no collective timeout
                assert detect < COLLECTIVE - 2, f"interrupted after {detect:.1f} s: at the collective timeout"
                assert dead(worker)  # the watchdog killed it (a stopped process keeps its sockets)
                os.killpg(nodes[2].pid, signal.SIGKILL)  # the node goes too: its rank is rebuilt next to rank 0
            steps = {n: orch.workers(n)[0]["step"] for n in survivors}
            assert set(steps.values()) == {resume_step}, steps
            assert dead_step == AT  # the lost rank had completed AT steps; the survivors resume_step
            assert all(orch.workers(n)[0]["registered"] and orch.workers(n)[0]["error"] for n in survivors)
            # the spare: a joiner for rank 2, started next to rank 0, listening for the donor's state
            token, port = secrets.token_bytes(32).hex(), lt.free_port()
            source = {"host": "127.0.0.1", "port": port, "token": token}
            await orch.to("n0", "start_joiner", {"rank": 2, "world_size": 3, "source": source}, gen=2)
            donate = {"rank": 2, "dest": {"host": "127.0.0.1", "port": port, "token": token}}
            base_args = {"gen": 2, "world_size": 3, "step": resume_step}
            acks = await asyncio.gather(orch.to("n0", "recover", {**base_args, "donate": donate}, gen=2),
                                        orch.to("n1", "recover", base_args, gen=2))
            assert [a["step"] for a in acks] == [resume_step, resume_step]
            assert acks[0]["bytes"] > 0 and acks[1]["bytes"] == 0
            for cmd in ("reform", "resume"):
                await asyncio.gather(*(orch.to(n, cmd, {}, gen=2) for n in survivors))
            for node in nodes[:2]:
                await lc.wait_exit(node)

    asyncio.run(drive())
    got = results(tmp_path / "out", 3)
    assert got[2]["env"]["TORCHPASS_JOIN"] == "1"  # rank 2's results come from the joiner
    for rank in range(3):
        assert got[rank]["params"] == want[rank]["params"], f"rank {rank}: parameters differ"
        assert len(got[rank]["losses"]) == STEPS
        # the joiner inherits the donor's loss history; every loss from the resumed step on is its own
        start = 0 if rank < 2 else resume_step
        assert got[rank]["losses"][start:] == want[rank]["losses"][start:], f"rank {rank}: losses differ"


def test_without_register_recover_is_refused_and_abort_ends_the_job(procs: Procs, tmp_path: Path,
                                                                     mosquitto: Mosquitto) -> None:
    async def drive() -> None:
        async with lc.orchestrator(mosquitto, Orchestrator) as orch:
            assert isinstance(orch, Orchestrator)
            nodes, marks = start_nodes(procs, tmp_path, mosquitto, {"rank": 2, "at": 3, "phase": "between",
                                                                    "hold": HOLD}, PLAIN_SCRIPT)
            await wait_file(marks / "rank2.between")
            await orch.until(lambda: orch.workers(DEAD))
            os.killpg(orch.workers(DEAD)[0]["pid"], signal.SIGKILL)
            os.killpg(nodes[2].pid, signal.SIGKILL)
            (marks / "killed").write_text("1")
            await orch.until(lambda: all([w["state"] for w in orch.workers(n)] == ["interrupted"] for n in NODES[:2]))
            assert [orch.workers(n)[0]["registered"] for n in NODES[:2]] == [False, False]
            ack = await orch.to("n0", "recover", {"gen": 2, "step": 3}, gen=2, ok=False)
            assert not ack["ok"] and "never called torchpass.register()" in ack["error"]
            assert "last checkpoint" in ack["error"]
            results_ = await asyncio.gather(*(orch.to(n, "abort", {"exit": True}, gen=2) for n in NODES[:2]))
            assert [(r["interrupted"], r["exited"]) for r in results_] == [([0], True), ([1], True)]
            for node in nodes[:2]:
                await asyncio.to_thread(node.wait, 60)
            assert [node.returncode for node in nodes[:2]] == [75, 75]  # failed clearly, not "succeeded"

    asyncio.run(drive())
