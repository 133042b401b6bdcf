"""A test-only stand-in for launchpad's side of the agent channel (tests/unit/test_worker_migration.py,
test_mesh_migration.py, test_agent_park.py): hosts the agent socket and the job's TCPStore, starts
worker processes of a training script through the torchpass bootstrap, and sends them the
commands launchpad would (pause, save, re-form, resume, exit). Plus reading the scripts' JSON logs,
and the whole replacement of one rank by a new process compared with an undisturbed run
(replace_rank)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchpass_common import agent_channel as ac
from torchpass_common.transfer_address import TransferAddress

ROOT = Path(__file__).resolve().parents[2]
# How the tests' own training scripts begin: the Driver's arguments, a gloo group, rank and world.
SCRIPT_PRELUDE = r'''
import argparse, hashlib, json, time
import torch, torch.distributed as dist
import torchpass

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int)
ap.add_argument("--step-sleep", type=float, default=0.0)
ap.add_argument("--log")
args = ap.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
'''
EXAMPLE = ROOT / "torchpassd" / "drill_jobs" / "ddp_train.py"
WAIT = 90.0  # upper bound for any single wait; a healthy run needs a few seconds


@dataclass
class Link:
    """One connected worker as the driver sees it."""

    chan: ac.SyncChannel
    hello: dict[str, Any]
    inbox: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    step: int = 0
    replicas: list[Any] = field(default_factory=list)  # each "replicas" a step report carried


class Driver:
    """Test-only stand-in for launchpad: hosts the agent socket and the job's TCPStore, starts
    workers through the bootstrap, and sends them the agent channel commands."""

    def __init__(self, tmp: Path, world_size: int, script_args: list[str], script: Path = EXAMPLE) -> None:
        self.tmp, self.world_size, self.script_args, self.script = tmp, world_size, script_args, script
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.sock_path = str(tmp / "agent.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.sock_path)
        self.server.listen()
        self.links: dict[int, Link] = {}  # rank -> the newest worker holding that rank
        self.hellos: queue.Queue[Link] = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            chan = ac.SyncChannel(conn)
            hello = chan.recv()
            assert hello is not None and hello["t"] == ac.HELLO
            link = Link(chan, hello)
            threading.Thread(target=self._read, args=(link,), daemon=True).start()
            self.hellos.put(link)

    def _read(self, link: Link) -> None:
        while True:
            try:
                msg = link.chan.recv()
            except OSError:
                msg = None
            if msg is not None and msg["t"] == ac.STEP:
                link.step = msg["step"]
                if "replicas" in msg:
                    link.replicas.append(msg["replicas"])
                continue
            link.inbox.put(msg)
            if msg is None:
                return

    def env(self, rank: int, agent: bool = True, **extra: str) -> dict[str, str]:
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size),
                   LOCAL_WORLD_SIZE=str(self.world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(self.store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                   TORCHPASS_LOG_JSON="1", **extra)
        if agent:
            env[ac.ENV_SOCKET] = self.sock_path
        return env

    def start(self, rank: int, log: Path, *, agent: bool = True, **extra: str) -> subprocess.Popen:
        boot = ["-m", "torchpass._bootstrap"] if agent else []
        out = open(self.tmp / f"{log.stem}.out", "w")  # noqa: SIM115 (closed by the OS at exit)
        proc = subprocess.Popen([sys.executable, "-u", *boot, str(self.script), *self.script_args, "--log", str(log)],
                                env=self.env(rank, agent, **extra), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def connect(self, count: int) -> None:
        """Wait for ``count`` hellos; the newest worker of a rank takes that rank's link."""
        for _ in range(count):
            link = self.hellos.get(timeout=WAIT)
            self.links[link.hello["rank"]] = link

    def send(self, to: int, kind: str, **fields: Any) -> None:
        self.links[to].chan.send(ac.message(kind, **fields))

    def expect(self, rank: int, kind: str) -> dict[str, Any]:
        msg = self.links[rank].inbox.get(timeout=WAIT)
        assert msg is not None and msg["t"] == kind, f"rank {rank}: expected {kind}, got {msg}"
        return msg

    def wait_steps(self, at_least: int) -> None:
        deadline = time.monotonic() + WAIT
        while min(link.step for link in self.links.values()) < at_least:
            assert time.monotonic() < deadline, "workers did not reach the step"
            time.sleep(0.005)

    def pause_all(self, gen: int, margin: int) -> int:
        """Pause every rank after one common step S (max reported step + margin); if a rank had
        already passed S, ask everyone again for a later step. Returns S."""
        at_step = max(link.step for link in self.links.values()) + margin
        while True:
            for rank in self.links:
                self.send(rank, ac.PAUSE, gen=gen, at_step=at_step)
            replies = {rank: self.links[rank].inbox.get(timeout=WAIT) for rank in self.links}
            missed = [m["step"] for m in replies.values() if m and m["t"] == ac.PAUSE_MISSED]
            if not missed:
                assert all(m and m["t"] == ac.PAUSED and m["step"] == at_step for m in replies.values()), replies
                return at_step
            at_step = max(missed) + margin

    def reform_and_resume(self, gen: int) -> None:
        for rank in self.links:
            self.send(rank, ac.REFORM, gen=gen, rank=rank, world_size=self.world_size,
                      store_host="127.0.0.1", store_port=self.store.port, prefix=f"torchpass/gen{gen}/")
        for rank in self.links:
            self.expect(rank, ac.REFORMED)
        for rank in self.links:
            self.send(rank, ac.RESUME, gen=gen)
        for rank in self.links:
            self.expect(rank, ac.RESUMED)

    def wait_all(self) -> None:
        for proc in self.procs:
            assert proc.wait(timeout=WAIT) == 0, (self.tmp / "*.out", proc.args)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.server.close()


def read_logs(*paths: Path) -> tuple[dict[tuple[int, int], str], dict[int, str]]:
    """(rank, step) -> loss hex, and rank -> final parameter hash, over several processes' logs."""
    losses: dict[tuple[int, int], str] = {}
    finals: dict[int, str] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "final" in rec:
                finals[rec["rank"]] = rec["final"]
            else:
                key = (rec["rank"], rec["step"])
                assert key not in losses, f"step {key} logged twice"
                losses[key] = rec["loss"]
    return losses, finals


def handover_ends() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the leaving rank's save ``dest``, the joiner's ``source``) on the wire, for a hand-over
    through the wormhole on this machine (a fresh port and token: the sender's and the listener's
    address are the same); commands never carry file paths."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    end = TransferAddress("127.0.0.1", port, os.urandom(32)).wire()
    return end, dict(end)


class Tap:
    """A wormhole hop inside the test, between the leaving rank and the joiner: the leaving rank
    saves to ``dest`` (a receiver of the test's), the tap keeps what arrived (``record()``) and sends
    it on to the joiner listening at ``source``; so a test can look inside a hand-over."""

    def __init__(self) -> None:
        from launchpad.wormhole import StateReceiver

        self._onward, self.source = handover_ends()
        token = os.urandom(32)
        self._rx = StateReceiver("127.0.0.1", 0, token)
        self.dest = TransferAddress("127.0.0.1", self._rx.port, token).wire()
        self._got: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._relay, daemon=True, name="test-tap").start()

    def _relay(self) -> None:
        from launchpad.wormhole import send_state

        try:
            rec = self._rx.receive(3 * WAIT)
            self._got.put(rec)
            onward = TransferAddress.parse(self._onward, "the tap's onward address")
            send_state(rec, onward.host, onward.port, onward.token, timeout=WAIT)
        except Exception as exc:  # the test sees it through record()
            self._got.put(exc)

    def record(self) -> dict[str, Any]:
        """The hand-over record the leaving rank sent."""
        got = self._got.get(timeout=WAIT)
        if isinstance(got, Exception):
            raise got
        return got


def finished(procs: list[subprocess.Popen]) -> None:
    """Each of ``procs`` ended well."""
    for proc in procs:
        rc = proc.wait(timeout=WAIT)
        assert rc in (0, -6), (proc.args, rc)  # -6: torch 2.13 gloo teardown abort after the final line


def undisturbed_run(drivers: Callable[..., Driver], script: Path, args: list[str], *, world: int, steps: int,
                    finals_alike: bool = True) -> tuple[dict, dict]:
    """Losses and final parameter hashes of ``script`` run undisturbed on ``world`` ranks, without
    the agent; ``finals_alike``: every rank hashes the same whole model (not a pipeline's stages)."""
    ref = drivers("reference", world, ["--steps", str(steps), *args], script)
    ref_logs = [ref.tmp / f"rank{r}.jsonl" for r in range(world)]
    finished([ref.start(r, ref_logs[r], agent=False) for r in range(world)])
    ref_losses, ref_finals = read_logs(*ref_logs)
    assert len(ref_losses) == world * steps and len(ref_finals) == world
    assert len(set(ref_finals.values())) == 1 or not finals_alike
    return ref_losses, ref_finals


def replace_rank(drivers: Callable[..., Driver], script: Path, args: list[str], *, world: int, steps: int,
                 leaving: int, replicas: dict[int, list[int]], finals_alike: bool = True) -> None:
    """Run ``script`` undisturbed, then again replacing rank ``leaving`` by a new process mid-run
    (state through the wormhole); losses and final parameters must be bit-identical.
    Each rank reports once which ranks hold its state: ``replicas``."""
    ref_losses, ref_finals = undisturbed_run(drivers, script, args, world=world, steps=steps, finals_alike=finals_alike)

    d = drivers("replace", world, ["--steps", str(steps), "--step-sleep", "0.05", *args], script)
    dest, source = handover_ends()
    joiner_log = d.tmp / "joiner.jsonl"
    joiner = d.start(leaving, joiner_log, **{ac.ENV_JOIN: "1", ac.ENV_JOIN_SOURCE: json.dumps(source)})
    new = d.hellos.get(timeout=WAIT)
    assert new.hello["joining"] and new.hello["rank"] == leaving
    assert new.inbox.get(timeout=WAIT) == {"t": ac.READY}  # mesh, subgroups and model built alone
    logs = [d.tmp / f"rank{r}.jsonl" for r in range(world)]
    workers = [d.start(r, logs[r]) for r in range(world)]
    d.connect(world)
    d.wait_steps(3)
    assert {r: link.replicas for r, link in d.links.items()} == {r: [replicas[r]] for r in range(world)}
    at_step = d.pause_all(gen=2, margin=3)
    d.send(leaving, ac.SAVE, dest=dest)
    assert d.expect(leaving, ac.SAVED)["bytes"] > 0
    assert new.inbox.get(timeout=WAIT) == {"t": ac.JOINED, "step": at_step}
    d.send(leaving, ac.EXIT)
    assert workers[leaving].wait(timeout=WAIT) == 0
    d.links[leaving] = new
    d.reform_and_resume(gen=2)
    finished([w for r, w in enumerate(workers) if r != leaving] + [joiner])

    losses, finals = read_logs(*logs, joiner_log)
    assert at_step < steps - 2
    assert losses == ref_losses
    assert finals == ref_finals
    assert min(s for (_, s) in read_logs(joiner_log)[0]) == at_step
