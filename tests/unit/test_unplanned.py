"""The unplanned recovery's decisions and flow against fakes (commander, Slurm, spares; real
registry, journal and metrics): the donor is the most advanced survivor and laggards load its
state, the commands in order (recover -> reform -> resume), the dead node released, phases and
timings journaled; a second death before the hand-over is recovered too, one after it fails the
job clearly; no spare with `fail` fails clearly; the token is never journaled."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_plugin.model import Node
from slurm_plugin.spares import Spare
from torchpass_common import agent_channel as ac
from torchpass_common import protocol, rank_ranges
from torchpass_common.config import Config
from torchpass_common.errors import MigrationError, SlurmError
from torchpass_common.timeouts import Timeouts
from torchpassd import journal as jn
from torchpassd.failure_detect import Death
from torchpassd.metrics import Metrics
from torchpassd.planned import WORMHOLE_PORT_BASE, Deps, joiner_port
from torchpassd.registry import Registry
from torchpassd.unplanned import MODE, UnplannedPlan, UnplannedRecovery, choose_donor

PROC_TEXT = ("/venv/bin/python\n-u\n-m\ntorchpass._bootstrap\ntrain.py\n\n===\n"
             "RANK=1\nWORLD_SIZE=4\nGROUP_RANK=1\nGROUP_WORLD_SIZE=4\nMASTER_ADDR=n1\nMASTER_PORT=29500\n\n===\n"
             "/home/u/run\n")


def test_donor_is_the_most_advanced_survivor_and_laggards_load_its_state() -> None:
    nodes = {0: "n1", 1: "n2", 3: "n4"}
    assert choose_donor({"0": 42, "1": 42, "3": 42}, nodes, where={}) == ("n1", [], 42)
    assert choose_donor({"0": 41, "1": 42, "3": 41}, nodes, where={}) == ("n2", ["n1", "n4"], 42)
    with pytest.raises(MigrationError, match="more than one step apart"):
        choose_donor({"0": 40, "1": 42}, nodes, where={})
    with pytest.raises(MigrationError, match="no surviving rank"):
        choose_donor({}, nodes, where={})


class FakeProc:
    returncode: int | None = 0

    def __init__(self, out: str = "", ended: int | None = None) -> None:
        self.out = out
        if ended is not None:  # a step that ended before its joiner got ready
            self.returncode = ended
            self.poll = lambda: ended  # type: ignore[method-assign]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        return self.out, ""

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def terminate(self) -> None:
        pass


class FakeSlurm:
    """Spares, job membership and steps; a joiner step opens a listener where the flow looks."""

    def __init__(self, spares: list[str], port: int) -> None:
        self.free = list(spares)
        self.port = port
        self.added: list[str] = []
        self.released: list[str] = []
        self.evicted: list[str] = []  # dead nodes set DOWN (Slurm's failed-node path: srun is told)
        self.settled_nodes: list[str] = []
        self.client = self
        self.listeners: list[socket.socket] = []
        self.joiner_rc: dict[str, int] = {}  # node -> a joiner step there ends at once with that code
        self.runner = self
        self.commands: list[list[str]] = []

    # SlurmRunner
    def run(self, argv: list[str], **where: Any) -> str:
        self.commands.append(list(argv))
        return ""

    # SlurmClient
    def nodes(self) -> dict[str, Node]:
        return {n: Node(n, "idle", addr="127.0.0.1") for n in ("n1", "n2", "n3", "n4", "n5", "n6")}

    # SparePool
    def take(self, *, job: int | None = None) -> str:
        if not self.free:
            raise SlurmError("no usable spare in reservation 'torchpass_spares' (n5: down)", job=job)
        return self.free.pop(0)

    def give_back(self, node: str) -> None:
        self.free.append(node)

    def settled(self, node: str) -> None:
        self.settled_nodes.append(node)

    def list(self, snap: Any = None) -> list[Spare]:
        return [Spare(n, True, "", "idle") for n in self.free]

    # JobResizer
    def add_node(self, job: int, node: str) -> None:
        self.added.append(node)

    def release_node(self, job: int, node: str) -> None:
        self.released.append(node)

    def evict_node(self, job: int, node: str, reason: str) -> None:
        assert "died" in reason  # what an operator reads on the DOWN node
        self.evicted.append(node)

    def start_step(self, job: int, node: str, argv: list[str], **kw: Any) -> FakeProc:
        if argv[0] == "sh":
            return FakeProc(PROC_TEXT)
        assert "token" not in " ".join(argv)  # the wormhole token travels in the environment only
        if node in self.joiner_rc:
            return FakeProc(ended=self.joiner_rc[node])
        if not self.listeners:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))
            s.listen()
            self.listeners.append(s)
        return FakeProc()


class FakeCommander:
    def __init__(self, on_send: Any = None) -> None:
        self.sent: list[tuple[str, str, int, dict[str, Any]]] = []
        self.on_send = on_send

    async def send(self, job: str, node: str, cmd: str, *, migration: str, gen: int,
                   args: dict[str, Any] | None = None, timeout: float) -> dict[str, Any]:
        self.sent.append((node, cmd, gen, args or {}))
        if self.on_send:
            await self.on_send(node, cmd)
        return {"rank": 0, "step": 42, "bytes": 1000, "seconds": 0.01} if cmd == "recover" else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hb(node: str, rank: int, step: int, state: str, **extra: Any) -> protocol.Message:
    body = {"node": node, "seq": 1, "workers": [{"rank": rank, "step": step, "state": state, "pid": 100 + rank,
                                                 **extra}]}
    return protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1, body=body))


class World:
    def __init__(self, tmp: Path, spares: list[str], steps: dict[str, int] | None = None) -> None:
        self.port = _free_port()
        self.gen = self.port - WORMHOLE_PORT_BASE - 1  # the joiner listens on BASE + gen + 1
        self.registry = Registry()
        self.journal = jn.Journal(tmp / "j.sqlite")
        self.journal.upsert_job("7", user="u", mode="aware", state="RUNNING", gen=self.gen,
                                nodes=["n1", "n2", "n3", "n4"])
        self.slurm = FakeSlurm(spares, self.port)
        self.commander = FakeCommander()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.steps = steps or {"n1": 42, "n2": 42, "n4": 42}
        self.metrics = Metrics()

        async def publish(job: str, event: str, detail: dict[str, Any]) -> None:
            self.events.append((event, detail))
        self.deps = Deps(Config(), self.journal, self.registry, self.commander, self.slurm, self.slurm,  # type: ignore[arg-type]
                         self.metrics, publish, tmp / "steps")

    async def setup(self) -> None:
        await self.registry.update_job("7", nodes=("n1", "n2", "n3", "n4"), user="u", batch_host="n1")
        for i, n in enumerate(("n1", "n2", "n3", "n4")):
            await self.registry.on_message(n, _hb(n, i, 40, "running"))
        offline = protocol.encode(protocol.STATE, job="7", gen=1, body={"node": "n3", "online": False})
        await self.registry.on_message("n3", protocol.decode(offline))

    async def interrupt(self, delay: float = 0.05) -> None:
        await asyncio.sleep(delay)
        for i, n in enumerate(("n1", "n2", "n3", "n4")):
            if n in self.steps:
                await self.registry.on_message(n, _hb(n, i, self.steps[n], "interrupted", registered=True,
                                                      interrupted_at=time.time()))

    def recovery(self, no_spare: str = "wait") -> UnplannedRecovery:
        mid = self.journal.start_migration("7", mode=MODE, source="n3", reason="n3 died", gen=self.gen)
        plan = UnplannedPlan(job="7", source="n3", gen=self.gen, evidence=["Last Will"], failed_at=time.time() - 1.0)
        return UnplannedRecovery(self.deps, plan, mid, detected_at=time.time() - 0.5, no_spare=no_spare)

    def close(self) -> None:
        for s in self.slurm.listeners:
            s.close()
        self.journal.close()


def _death(node: str, rank: int) -> Death:
    now = time.time()
    return Death("7", node, (rank,), ("Last Will",), now - 1.0, now - 0.5)


def test_recovery_flow_donates_reforms_resumes_and_releases(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5"], steps={"n1": 41, "n2": 42, "n4": 42})  # n1 lags one step

    async def go() -> str:
        await w.setup()
        rec = w.recovery()
        interrupt = asyncio.create_task(w.interrupt())
        status = await rec.run([_death("n3", 2)])
        await interrupt
        return status
    status = asyncio.run(go())
    cmds = [(n, c) for n, c, _, _ in w.commander.sent]
    assert status == jn.SUCCEEDED, w.journal.history()[0].error
    recover = {n: a for n, c, _, a in w.commander.sent if c == "recover"}
    assert set(recover) == {"n1", "n2", "n4"}
    assert all(a["gen"] == w.gen + 1 and a["step"] == 42 and a["world_size"] == 4 for a in recover.values())
    # the ranks at step 42 (1 on n2, 3 on n4) each donate once: to the joiner, and to n1's lagging rank 0
    donations = {d["rank"]: (n, d) for n, a in recover.items() for d in _listed(a.get("donate"))}
    assert {r: (n, d["from"]) for r, (n, d) in donations.items()} == {2: ("n2", 1), 0: ("n4", 3)}
    assert donations[2][1]["dest"]["port"] == w.port and donations[2][1]["dest"]["host"] == "127.0.0.1"
    assert recover["n1"]["load_from"]["0"]["port"] == donations[0][1]["dest"]["port"]  # rank 0 lags
    assert "donate" not in recover["n1"] and "load_from" not in recover["n4"]
    first_reform = cmds.index(next(c for c in cmds if c[1] == "reform"))
    # active abort first: every survivor (not the dead node) is told to cut its stalled workers' collectives
    severs = {n: a for n, c, _, a in w.commander.sent if c == "sever"}
    assert set(severs) == {"n1", "n2", "n4"} and all(a["lost"] == ["n3"] and not a["all"] for a in severs.values())
    assert [c for _, c in cmds[:first_reform]] == ["sever"] * 3 + ["recover"] * 3
    assert {n for n, c in cmds if c == "reform"} == {n for n, c in cmds if c == "resume"} == {"n1", "n2", "n4", "n5"}
    assert w.slurm.added == ["n5"] and w.slurm.evicted == ["n3"] and not w.slurm.released
    assert w.slurm.settled_nodes == ["n5"]  # in the job now: Slurm guards it, the pool forgets its mark
    mig = w.journal.history()[0]
    assert mig.mode == MODE and mig.status == jn.SUCCEEDED and mig.target == "n5"
    phases = [p.phase for p in mig.phases]
    assert phases == ["requested", "detected", "spare_chosen", "spare_added", "joiner_ready", "interrupted",
                      "recovered", "reformed", "resumed", "released"]
    resumed = next(p for p in mig.phases if p.phase == "resumed").detail
    assert resumed["resumed_at_step"] == 42 and resumed["pause_s"] >= 1.0
    assert next(p for p in mig.phases if p.phase == "detected").detail["detect_s"] == pytest.approx(0.5, abs=0.05)
    token = w.commander.sent[-1]  # any command: the token is in recover args, never in the journal
    assert token
    text = json.dumps([p.detail for p in mig.phases]) + json.dumps(w.events)
    assert donations[2][1]["dest"]["token"] not in text
    assert 'torchpass_migrations_total{mode="unplanned-aware",outcome="succeeded"} 1' in w.metrics.render()
    w.close()


def test_every_rank_of_a_dead_node_gets_its_own_joiner_and_each_lagging_rank_its_source(tmp_path: Path) -> None:
    """Two ranks a node: the dead node's ranks 4 and 5 are donated to the two joiners on the spare
    (one port each); on the lagging node only the rank that lags loads the donor's state."""
    w = World(tmp_path, ["n5"])

    async def setup() -> UnplannedRecovery:
        await w.registry.update_job("7", nodes=("n1", "n2", "n3"), user="u", batch_host="n1")
        for n, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
            body = {"node": n, "seq": 1, "workers": [{"rank": r, "step": 42, "state": "interrupted", "pid": 100 + r}
                                                     for r in ranks]}
            await w.registry.on_message(n, protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1,
                                                                           body=body)))
        return w.recovery()
    rec = asyncio.run(setup())
    p = rec.plan
    p.seats = [{"node": "n3", "rank": 4, "ranks": [4, 5], "target": "n5", "target_addr": "10.0.0.5"}]
    p.survivors, p.donor, p.laggards, p.resume_step, p.port = ["n1", "n2"], "n2", ["n1"], 42, 29402
    p.steps = {"0": 41, "1": 42, "2": 42, "3": 42}
    args = rec.recover_args({"n1": "10.0.0.1"})
    gifts = {d["rank"]: d["dest"] for a in args.values() for d in _listed(a.get("donate"))}
    assert (gifts[4]["host"], gifts[4]["port"]) == ("10.0.0.5", joiner_port(29402, 0))
    assert (gifts[5]["host"], gifts[5]["port"]) == ("10.0.0.5", joiner_port(29402, 1))
    assert set(args["n1"]["load_from"]) == {"0"} and gifts[0]["host"] == "10.0.0.1"  # rank 1 is at the step
    assert args["n1"]["load_from"]["0"]["port"] == gifts[0]["port"]
    assert args["n2"]["lost_nodes"] == 1
    w.close()


def _listed(donate: Any) -> list[dict[str, Any]]:
    return [] if donate is None else donate if isinstance(donate, list) else [donate]


def _sharded_world(tmp_path: Path, replicas: Any) -> tuple[World, UnplannedRecovery]:
    """3 nodes x 2 ranks, n3 (ranks 4, 5) dead; each worker reported ``replicas(rank)``."""
    w = World(tmp_path, ["n5"])

    async def setup() -> UnplannedRecovery:
        await w.registry.update_job("7", nodes=("n1", "n2", "n3"), user="u", batch_host="n1")
        for n, ranks in (("n1", (0, 1)), ("n2", (2, 3)), ("n3", (4, 5))):
            body = {"node": n, "seq": 1, "workers": [{"rank": r, "step": 42, "state": "interrupted", "pid": 100 + r,
                                                      "replicas": rank_ranges.compact(replicas(r))} for r in ranks]}
            await w.registry.on_message(n, protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1,
                                                                           body=body)))
        return w.recovery()
    return w, asyncio.run(setup())


def test_hsdp_lost_ranks_are_rebuilt_from_the_same_shard_of_another_replica_group(tmp_path: Path) -> None:
    """HSDP, shard within a node, replicate across: rank r's state lives on every rank r % 2."""
    w, rec = _sharded_world(tmp_path, lambda r: list(range(r % 2, 6, 2)))
    assert rec.view().unplanned().startswith("unplanned: every rank has a replica (at least 3 copies)")
    p = rec.plan
    p.seats = [{"node": "n3", "rank": 4, "ranks": [4, 5], "target": "n5", "target_addr": "10.0.0.5"}]
    p.survivors, p.donor, p.laggards, p.resume_step, p.port = ["n1", "n2"], "n1", [], 42, 29402
    p.steps = {str(r): 42 for r in range(4)}
    args = rec.recover_args({})
    given = {d["rank"]: d["from"] for a in args.values() for d in _listed(a.get("donate"))}
    assert set(given) == {4, 5} and given[4] % 2 == 0 and given[5] % 2 == 1, given
    w.close()


def test_pipeline_stages_whose_replicas_share_a_node_are_said_to_fall_back_to_requeue(tmp_path: Path) -> None:
    """Stage k on node k, its data-parallel copies within the node: every rank has a replica,
    none on another node. `torchpassctl jobs` says so while the job trains; a node death there takes
    the requeue fallback, never a recovery that cannot be."""
    w, rec = _sharded_world(tmp_path, lambda r: [r - r % 2, r - r % 2 + 1])
    requeued: list[tuple[int, str]] = []
    w.slurm.requeue = lambda job, node, reason: requeued.append((job, node))  # type: ignore[attr-defined]
    assert rec.view().unplanned() == ("unplanned: every rank has a replica (at least 2 copies), but every copy of "
                                      "ranks 0-5 is on their own node: a lost worker is rebuilt, a node death "
                                      "there falls back to requeue")
    now = time.time()
    status = asyncio.run(rec.run([Death("7", "n3", (4, 5), ("Last Will",), now - 1.0, now - 0.5)]))
    assert status == jn.FAILED and requeued == [(7, "n3")] and w.slurm.added == []
    assert "no surviving rank holds a replica of ranks [4, 5] lost with n3" in w.journal.history()[0].error
    w.close()


def test_a_pure_fsdp_node_death_requeues_the_job_with_the_reason(tmp_path: Path) -> None:
    """No rank holds another's shard: the recovery takes no spare and hands the job back to Slurm."""
    w, rec = _sharded_world(tmp_path, lambda r: [r])
    requeued: list[tuple[int, str]] = []
    w.slurm.requeue = lambda job, node, reason: requeued.append((job, node))  # type: ignore[attr-defined]
    assert "no replica of ranks 0-5, falls back to requeue" in rec.view().unplanned()
    now = time.time()
    status = asyncio.run(rec.run([Death("7", "n3", (4, 5), ("Last Will",), now - 1.0, now - 0.5)]))
    assert status == jn.FAILED and requeued == [(7, "n3")] and w.slurm.added == []
    mig = w.journal.history()[0]
    assert "no surviving rank holds a replica of ranks [4, 5] lost with n3" in mig.error
    assert "requeued through Slurm" in mig.error and mig.phases[-1].detail["fallback"] == "requeue"
    w.close()


def test_second_death_before_the_hand_over_is_recovered_too(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5", "n6"], steps={"n1": 42, "n2": 42})

    async def go() -> str:
        await w.setup()
        rec = w.recovery()

        async def kill_n4() -> None:
            await asyncio.sleep(0.02)
            offline = protocol.encode(protocol.STATE, job="7", gen=1, body={"node": "n4", "online": False})
            await w.registry.on_message("n4", protocol.decode(offline))
            rec.another_death(_death("n4", 3))
            await w.interrupt(0.2)
        task = asyncio.create_task(kill_n4())
        status = await rec.run([_death("n3", 2)])
        await task
        return status
    assert asyncio.run(go()) == jn.SUCCEEDED, w.journal.history()[0].error
    recover = {n: a for n, c, _, a in w.commander.sent if c == "recover"}
    assert set(recover) == {"n1", "n2"}
    assert recover["n1"]["donate"]["rank"] == 2 and recover["n2"]["donate"]["rank"] == 3
    assert sorted(w.slurm.added) == ["n5", "n6"] and sorted(w.slurm.evicted) == ["n3", "n4"]
    w.close()


def test_second_death_after_the_hand_over_fails_the_job_clearly(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5", "n6"])

    async def go() -> tuple[str, UnplannedRecovery]:
        await w.setup()
        rec = w.recovery()

        async def on_send(node: str, cmd: str) -> None:
            if cmd == "recover" and node == "n1":
                rec.another_death(_death("n4", 3))
        w.commander.on_send = on_send
        interrupt = asyncio.create_task(w.interrupt())
        status = await rec.run([_death("n3", 2)])
        await interrupt
        return status, rec
    status, rec = asyncio.run(go())
    assert status == jn.FAILED
    mig = w.journal.history()[0]
    assert "n4 died too" in (mig.error or "") and "after the survivors' state was handed over" in mig.error
    aborts = {n: a for n, c, _, a in w.commander.sent if c == "abort"}
    assert aborts and all(a == {"exit": True} for a in aborts.values())
    assert not any(c == "reform" for _, c, _, _ in w.commander.sent)
    w.close()


def test_no_spare_with_fail_policy_fails_clearly_and_survivors_exit(tmp_path: Path) -> None:
    w = World(tmp_path, [])

    async def go() -> str:
        await w.setup()
        return await w.recovery(no_spare="fail").run([_death("n3", 2)])
    assert asyncio.run(go()) == jn.FAILED
    mig = w.journal.history()[0]
    assert mig.phases[-1].phase == "failed" and "no usable spare" in (mig.error or "")
    assert {n for n, c, _, _ in w.commander.sent if c == "abort"} == {"n1", "n2", "n4"}
    w.close()


def test_a_spare_whose_joiner_cannot_start_is_drained_and_the_next_spare_takes_the_ranks(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5", "n6"])
    w.slurm.joiner_rc = {"n5": ac.EXIT_NO_WORKDIR}

    async def go() -> str:
        await w.setup()
        interrupt = asyncio.create_task(w.interrupt(0.3))
        status = await w.recovery().run([_death("n3", 2)])
        await interrupt
        return status
    status = asyncio.run(go())
    mig = w.journal.history()[0]
    assert status == jn.SUCCEEDED, mig.error
    assert mig.target == "n6"
    assert [c[2:4] for c in w.slurm.commands] == [["nodename=n5", "state=drain"]]
    assert "joiner failed: the job's working directory /home/u/run does not exist on n5" in w.slurm.commands[0][4]
    assert w.slurm.added == ["n5", "n6"] and w.slurm.released == ["n5"]  # n5 out of the job again
    assert "n5" in w.slurm.free  # back to the pool's bookkeeping, but drained in Slurm: not taken again
    assert {n for n, c, _, _ in w.commander.sent if c == "resume"} == {"n1", "n2", "n4", "n6"}
    (failed,) = [e for e in w.journal.events(job_id="7") if e.event == "migration.spare_failed"]
    assert failed.detail["spare"] == "n5" and "does not exist on n5" in failed.detail["error"]
    w.close()


def test_when_every_spare_of_the_incident_fails_the_recovery_names_them_and_drains_each(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5", "n6", "n2b"])
    w.slurm.joiner_rc = {"n5": ac.EXIT_NO_WORKDIR, "n6": ac.EXIT_NO_WORKDIR}

    async def go() -> str:
        await w.setup()
        return await w.recovery().run([_death("n3", 2)])
    assert asyncio.run(go()) == jn.FAILED
    mig = w.journal.history()[0]
    assert "no spare could take the ranks of n3 (tried n5, n6)" in (mig.error or ""), mig.error
    assert "does not exist on n6: no joiner can start there" in mig.error
    assert [c[2:4] for c in w.slurm.commands] == [["nodename=n5", "state=drain"], ["nodename=n6", "state=drain"]]
    assert w.slurm.released == ["n5", "n6"]  # a third spare is not tried: spares_per_incident = 2
    w.close()


def test_unregistered_survivor_fails_with_the_checkpoint_hint(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5"])

    async def go() -> str:
        await w.setup()
        rec = w.recovery()

        async def interrupt() -> None:
            await asyncio.sleep(0.05)
            for i, n in ((0, "n1"), (1, "n2"), (3, "n4")):
                await w.registry.on_message(n, _hb(n, i, 42, "interrupted", registered=n != "n2"))
        task = asyncio.create_task(interrupt())
        status = await rec.run([_death("n3", 2)])
        await task
        return status
    assert asyncio.run(go()) == jn.FAILED
    err = w.journal.history()[0].error or ""
    assert "never called torchpass.register" in err and "n2" in err
    assert w.slurm.free == ["n5"]  # the spare went back to the pool
    w.close()


def test_a_transparent_job_is_not_rebuilt_and_no_spare_is_taken_for_it(tmp_path: Path) -> None:
    """--torchpass=transparent registers no save/load: a lost node's ranks cannot be rebuilt. No
    spare is taken (a joiner would only fail with the job and get its spare drained); once the
    survivors report in, unregistered, the recovery fails saying why and tells them to exit. A
    second node lost meanwhile takes no spare either."""
    w = World(tmp_path, ["n5", "n6"])

    async def go() -> str:
        await w.setup()
        await w.registry.update_job("7", mode="transparent")
        rec = w.recovery()

        async def interrupt() -> None:
            await asyncio.sleep(0.05)
            offline = protocol.encode(protocol.STATE, job="7", gen=1, body={"node": "n4", "online": False})
            await w.registry.on_message("n4", protocol.decode(offline))
            rec.another_death(_death("n4", 3))
            await asyncio.sleep(0.3)
            for i, n in ((0, "n1"), (1, "n2")):
                await w.registry.on_message(n, _hb(n, i, 42, "interrupted", registered=False))
        task = asyncio.create_task(interrupt())
        status = await rec.run([_death("n3", 2)])
        await task
        return status
    assert asyncio.run(go()) == jn.FAILED
    mig = w.journal.history()[0]
    assert "never called torchpass.register" in (mig.error or "") and "--torchpass=transparent" in (mig.error or ""), \
        mig.error
    assert w.slurm.added == [] and w.slurm.free == ["n5", "n6"] and w.slurm.commands == []  # none taken or drained
    assert {n for n, c, _, _ in w.commander.sent if c == "sever"} == {"n1", "n2", "n4"}  # cut: reach the report now
    assert {n for n, c, _, _ in w.commander.sent if c == "abort"} == {"n1", "n2"}  # then told to exit
    w.close()


def test_restart_before_the_hand_over_fails_the_attempt_but_keeps_survivors_parked(tmp_path: Path) -> None:
    from torchpassd.unplanned import resume_after_restart

    w = World(tmp_path, ["n5"])

    async def go() -> str:
        await w.setup()
        rec = w.recovery()
        rec.plan.survivors = ["n1", "n2", "n4"]
        return await resume_after_restart(rec, "joiner_ready")
    assert asyncio.run(go()) == jn.FAILED
    assert "restarted during phase joiner_ready" in (w.journal.history()[0].error or "")
    assert not any(c == "abort" for _, c, _, _ in w.commander.sent)  # parked: the detector decides again
    w.close()


def test_restart_mid_rebuild_in_place_holds_the_rank_as_crashed_again(tmp_path: Path) -> None:
    """Rank 2 was being rebuilt on its own node n3 when torchpassd restarted: the attempt fails, the
    survivors stay parked, and n3's launchpad is told to abort it with ``hold`` (its joiner killed,
    rank 2 held as crashed again), so the restarted failure detector decides the crash afresh."""
    from torchpassd.unplanned import resume_after_restart

    w = World(tmp_path, ["n5"])

    async def go() -> str:
        await w.setup()
        rec = w.recovery()
        p = rec.plan
        p.survivors, p.seats = ["n1", "n2", "n3", "n4"], [{"node": "n3", "ranks": [2], "in_place": True}]
        return await resume_after_restart(rec, "joiner_ready")
    assert asyncio.run(go()) == jn.FAILED
    aborts = [(n, a) for n, c, _, a in w.commander.sent if c == "abort"]
    assert aborts == [("n3", {"hold": True})], aborts  # no one told to exit: everyone waits for the next attempt
    w.close()


def test_restart_right_after_recover_was_sent_drives_forward(tmp_path: Path) -> None:
    """torchpassd killed between sending ``recover`` and journaling ``recovered``: the journal says
    "interrupted", but the workers have re-entered and loaded their state (joined) without it. The
    restarted torchpassd sees that, waits for every worker, and finishes (re-form, resume) instead
    of failing an attempt whose hand-over is done."""
    from torchpassd.unplanned import resume_after_restart

    w = World(tmp_path, ["n5"])

    async def heartbeats(state: str) -> None:
        for i, n in ((0, "n1"), (1, "n2"), (3, "n4"), (2, "n5")):
            await w.registry.on_message(n, _hb(n, i, 42, state, joining=n == "n5"))

    async def go() -> str:
        await w.setup()
        await heartbeats("interrupted")  # what the restarted torchpassd heard first: from before the recover
        rec = w.recovery()
        p = rec.plan
        p.survivors, p.seats, p.resume_step = ["n1", "n2", "n4"], [
            {"node": "n3", "rank": 2, "ranks": [2], "target": "n5", "target_addr": "127.0.0.1"}], 42

        async def later() -> None:
            await asyncio.sleep(0.2)
            await heartbeats("joined")  # the next heartbeats: every worker re-entered and loaded
        beat = asyncio.create_task(later())
        status = await resume_after_restart(rec, "interrupted")
        await beat
        return status
    assert asyncio.run(go()) == jn.SUCCEEDED, w.journal.history()[0].error
    cmds = [c for _, c, _, _ in w.commander.sent]
    assert cmds.count("reform") == cmds.count("resume") == 4 and "abort" not in cmds and "recover" not in cmds
    phases = [ph.phase for ph in w.journal.history()[0].phases]
    assert phases[-4:] == ["recovered", "reformed", "resumed", "released"], phases
    w.close()


def test_restart_after_the_hand_over_drives_forward(tmp_path: Path) -> None:
    from torchpassd.unplanned import resume_after_restart

    w = World(tmp_path, ["n5"])

    async def go() -> str:
        await w.setup()
        rec = w.recovery()
        p = rec.plan
        p.survivors, p.seats, p.resume_step, p.recover_sent = ["n1", "n2", "n4"], [
            {"node": "n3", "rank": 2, "target": "n5", "target_addr": "127.0.0.1"}], 42, True
        return await resume_after_restart(rec, "recovered")
    assert asyncio.run(go()) == jn.SUCCEEDED
    assert [c for _, c, _, _ in w.commander.sent].count("reform") == 4 and w.slurm.evicted == ["n3"]
    w.close()


class FakeOrch:
    def __init__(self, deps: Deps) -> None:
        self.d, self.active, self.current, self.pending = deps, {}, {}, {("7", "n3"): (0.0, "drain")}
        self.watcher = type("W", (), {"last": object()})()
        self.spawned: list[str] = []
        self.preempted: list[str] = []

    def kick(self) -> None:
        self.unplanned.kick()

    def yield_to_recovery(self, death: Death) -> None:
        self.preempted.append(death.node)

    def _spawn(self, job: str, coro: Any) -> None:
        coro.close()
        self.spawned.append(job)


def test_driver_waits_for_a_spare_and_says_why(tmp_path: Path) -> None:
    from torchpassd.unplanned import Driver

    w = World(tmp_path, [])

    async def go() -> None:
        await w.setup()
        orch = FakeOrch(w.deps)
        orch.unplanned = Driver(orch, lambda: True)
        orch.unplanned.on_death(_death("n3", 2))
        assert orch.spawned == [] and ("7", "n3") not in orch.pending  # the drain is moot now
        assert orch.preempted == ["n3"]  # a planned migration of the job, if any, gives way
        assert orch.unplanned.waits("7")
        [dead] = orch.unplanned.describe()
        assert dead["node"] == "n3" and "no spare free" in dead["waiting"] and "survivors stay parked" in dead["waiting"]
        w.slurm.free.append("n5")  # a spare appears
        orch.kick()
        assert orch.spawned == ["7"] and orch.unplanned.describe() == []
    asyncio.run(go())
    w.close()


def test_driver_gives_up_on_a_failed_job_and_forgets_an_ended_one(tmp_path: Path) -> None:
    from slurm_plugin import events as ev
    from torchpassd.unplanned import Driver

    w = World(tmp_path, [])

    async def go() -> None:
        await w.setup()
        orch = FakeOrch(w.deps)
        driver = orch.unplanned = Driver(orch, lambda: True)
        flow = w.recovery(no_spare="fail")

        async def failed() -> str:
            return await flow.run([_death("n3", 2)])
        await driver.run(flow, failed())
        assert "recovery failed" in driver.busy("7", "n4")  # survivors told to exit are no new deaths
        driver.on_death(_death("n2", 1))
        driver.on_slurm(ev.JobEnded(0.0, 7, ("n1",), "FAILED"))
        assert driver.busy("7", "n4") == "" and not driver.waits("7")
    asyncio.run(go())
    w.close()


def test_ranks_that_train_on_were_not_lost_and_the_recovery_stands_down(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5"])

    async def go() -> str:
        await w.setup()
        rec = w.recovery()

        async def train_on() -> None:  # only n3's launchpad died: the all-reduces still complete
            for step in range(41, 46):
                await asyncio.sleep(0.05)
                for i, n in ((0, "n1"), (1, "n2"), (3, "n4")):
                    await w.registry.on_message(n, _hb(n, i, step, "running"))
        task = asyncio.create_task(train_on())
        status = await rec.run([_death("n3", 2)])
        await task
        return status
    assert asyncio.run(go()) == jn.ROLLED_BACK
    mig = w.journal.history()[0]
    assert mig.status == jn.ROLLED_BACK and "are alive" in (mig.error or "")
    assert not any(c in ("abort", "recover") for _, c, _, _ in w.commander.sent)  # the job is left alone
    assert w.slurm.free == ["n5"]
    w.close()


def test_the_spare_a_running_migration_brings_in_is_not_judged(tmp_path: Path) -> None:
    from torchpassd.unplanned import Driver

    w = World(tmp_path, ["n5"])
    orch = FakeOrch(w.deps)
    orch.unplanned = Driver(orch, lambda: True)
    rec = w.recovery()
    rec.plan.seats += [{"node": "n3", "rank": 2, "ranks": [2], "target": "n5"},
                       {"node": "n4", "rank": 3, "ranks": [3], "target": "n6"}]
    rec.plan.target = "n5"  # the first seat's, as _seat_on_a_spare sets it
    orch.active["7"], orch.current["7"] = object(), rec
    assert orch.unplanned.busy("7", "n5") == "a migration is bringing n5 into the job"
    assert orch.unplanned.busy("7", "n6") == "a migration is bringing n6 into the job"
    assert orch.unplanned.busy("7", "n2") == ""
    w.close()


def _crash(node: str, rank: int) -> Death:
    now = time.time()
    return Death("7", node, (rank,), (f"worker rank {rank} was killed by signal SIGKILL on {node}",),
                 now - 1.0, now - 0.5, in_place=True)


def test_a_crashed_rank_is_rebuilt_in_place_on_its_live_node_without_a_spare(tmp_path: Path) -> None:
    w = World(tmp_path, ["n5"], steps={"n1": 42, "n2": 42, "n4": 41})  # n4 lags one step

    async def on_send(node: str, cmd: str) -> None:
        if cmd == "start_joiner":  # launchpad's joiner on n3 listens for rank 2's state
            w.slurm.start_step(7, node, ["launchpad"])
    w.commander.on_send = on_send

    async def go() -> str:
        await w.setup()
        await w.registry.on_message("n3", _hb("n3", 2, 40, "crashed", exit_code=-9))
        rec = w.recovery()
        interrupt = asyncio.create_task(w.interrupt())
        status = await rec.run([_crash("n3", 2)])
        await interrupt
        return status
    status = asyncio.run(go())
    assert status == jn.SUCCEEDED, w.journal.history()[0].error
    assert not w.slurm.added and not w.slurm.evicted and not w.slurm.released and w.slurm.free == ["n5"]
    [(node, joiner)] = [(n, a) for n, c, _, a in w.commander.sent if c == "start_joiner"]
    [one] = joiner["joiners"]
    assert node == "n3" and one["rank"] == 2 and joiner["world_size"] == 4
    assert one["source"]["port"] == w.port and len(one["source"]["token"]) == 64
    severs = {n: a for n, c, _, a in w.commander.sent if c == "sever"}
    assert set(severs) == {"n1", "n2", "n4"} and all(a["all"] for a in severs.values())  # a crash is certain
    recover = {n: a for n, c, _, a in w.commander.sent if c == "recover"}
    assert set(recover) == {"n1", "n2", "n4"}  # n3's only rank is the one being rebuilt
    donations = {d["rank"]: (n, d) for n, a in recover.items() for d in _listed(a.get("donate"))}
    assert donations[2][1]["dest"]["port"] == w.port and donations[2][0] in ("n1", "n2")  # from a rank at step 42
    assert recover["n4"]["load_from"]  # the lagging survivor loads the donor's state
    cmds = [(n, c) for n, c, _, _ in w.commander.sent]
    assert {n for n, c in cmds if c == "reform"} == {n for n, c in cmds if c == "resume"} == {"n1", "n2", "n3", "n4"}
    mig = w.journal.history()[0]
    assert mig.status == jn.SUCCEEDED and not mig.target  # no spare
    phases = [p.phase for p in mig.phases]
    assert phases == ["requested", "detected", "joiner_ready", "interrupted", "recovered", "reformed", "resumed",
                      "released"]
    ready = next(p for p in mig.phases if p.phase == "joiner_ready").detail
    assert ready["in_place"] is True and ready["node"] == "n3" and ready["ranks"] == [2]
    # timed over the survivors only: the crashed worker (and its joiner) never report an interruption
    assert 0 <= next(p for p in mig.phases if p.phase == "interrupted").detail["interrupted_after_s"] < 5
    assert w.journal.jobs()[0].nodes == ["n1", "n2", "n3", "n4"]  # the job keeps its nodes
    w.close()


def test_a_node_whose_workers_keep_crashing_is_drained_so_its_ranks_move(tmp_path: Path) -> None:
    from torchpassd.unplanned import CRASHES_TO_DRAIN, Driver

    w = World(tmp_path, [])

    async def go() -> None:
        await w.setup()
        orch = FakeOrch(w.deps)
        driver = orch.unplanned = Driver(orch, lambda: True)
        orch.pending[("7", "n3")] = "drain"
        for _ in range(CRASHES_TO_DRAIN - 1):
            driver.on_death(_crash("n3", 2))
        await asyncio.sleep(0.1)
        assert not w.slurm.commands and ("7", "n3") in orch.pending  # in place, no spare needed, drain kept
        assert orch.spawned == ["7"] * (CRASHES_TO_DRAIN - 1)
        driver.on_death(_crash("n3", 2))
        await asyncio.sleep(0.1)
    asyncio.run(go())
    [argv] = w.slurm.commands
    assert argv[:3] == ["scontrol", "update", "nodename=n3"] and "state=drain" in argv
    assert any("3 worker crashes" in a for a in argv), argv
    w.close()


def test_a_death_decided_while_the_running_recovery_fails_waits_for_the_next_one(tmp_path: Path) -> None:
    """A restarted torchpassd fails the attempt it found and aborts it with ``hold``: the rank crashes
    again on its node at once, before that failure is over. That death is not given to the failing
    recovery (it would be lost with it) but waits, and the next kick starts a recovery for it; a
    death during a recovery that still runs is that recovery's (a second failure)."""
    from torchpassd.unplanned import Driver

    w = World(tmp_path, [])

    async def go() -> tuple[list, dict, list]:
        await w.setup()
        orch = FakeOrch(w.deps)
        driver = orch.unplanned = Driver(orch, lambda: True)
        running = w.recovery()
        driver.running["7"], orch.active["7"] = running, "its task"
        driver.on_death(_crash("n2", 3))  # the recovery runs: its second failure
        taken = list(running._more)
        running.failure = "torchpassd restarted during phase joiner_ready, before the hand-over"
        driver.on_death(_crash("n3", 2))  # it is failing: the death waits
        waiting = {job: dict(deaths) for job, deaths in driver.dead.items()}
        del driver.running["7"], orch.active["7"]
        driver.kick()
        await asyncio.sleep(0.1)
        return taken, waiting, orch.spawned
    taken, waiting, spawned = asyncio.run(go())
    assert [d.node for d in taken] == ["n2"]
    assert list(waiting["7"]) == ["n3"] and spawned == ["7"]
    w.close()


@pytest.mark.parametrize("broker_down", [True, False], ids=["broker-down", "broker-up"])
def test_the_wait_for_interrupted_survivors_holds_while_torchpassd_cannot_hear_them(tmp_path: Path,
                                                                                   broker_down: bool) -> None:
    """The survivors' interrupted reports arrive after the wait's bound: during a broker outage
    (torchpassd hears nobody) the bound holds still and the recovery goes on; with the broker up
    they are late and the recovery fails saying who did not report."""
    w = World(tmp_path, ["n5"])

    async def go() -> str:
        await w.setup()
        rec = w.recovery()
        rec.t = Timeouts(collective=0.2, step=0.3, reform=1.0, decision=5.0)  # a bound of 0.5 s
        rec.control_up = lambda: not broker_down
        interrupt = asyncio.create_task(w.interrupt(delay=1.5))
        status = await rec.run([_death("n3", 2)])
        await interrupt
        return status
    status = asyncio.run(go())
    rec = w.journal.history()[0]
    if broker_down:
        assert status == jn.SUCCEEDED, rec.error
    else:
        assert status == jn.FAILED and "did not report their workers interrupted" in (rec.error or ""), rec.error
    w.close()


def _hot_spare_world(tmp_path: Path, fail_on: str = "") -> World:
    """n1-n4 train (n3 dies), n6 is the job's hot spare (--torchpass-spares=1), n5 the pool's spare.
    A start_joiner on ``fail_on`` fails; elsewhere its joiner listens for the state."""
    w = World(tmp_path, ["n5"])

    async def on_send(node: str, cmd: str) -> None:
        if cmd == "start_joiner" and node == fail_on:
            raise MigrationError(f"launchpad on {node} could not start the joiner")
        if cmd == "start_joiner":
            w.slurm.start_step(7, node, ["launchpad"])
    w.commander.on_send = on_send
    return w


async def _add_hot_spare(w: World) -> None:
    await w.setup()
    await w.registry.update_job("7", nodes=("n1", "n2", "n3", "n4", "n6"), user="u", batch_host="n1")
    body = {"node": "n6", "seq": 1, "workers": [], "standby": "ready", "hot_spare": True}
    await w.registry.on_message("n6", protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1, body=body)))


async def _with_hot_spare(w: World) -> str:
    await _add_hot_spare(w)
    rec = w.recovery()
    interrupt = asyncio.create_task(w.interrupt())
    status = await rec.run([_death("n3", 2)])
    await interrupt
    return status


def test_a_dead_nodes_ranks_go_to_the_jobs_hot_spare_without_a_resize(tmp_path: Path) -> None:
    """--torchpass-spares: the lost node's place is taken by the launchpad already running on the
    job's hot spare (its joiner started there as the dead node's group rank): the pool's spare is
    left alone, the job is not resized and no step is started; the dead node is evicted."""
    w = _hot_spare_world(tmp_path)
    status = asyncio.run(_with_hot_spare(w))
    assert status == jn.SUCCEEDED, w.journal.history()[0].error
    [(node, joiner)] = [(n, a) for n, c, _, a in w.commander.sent if c == "start_joiner"]
    assert node == "n6" and joiner["group_rank"] == 2 and joiner["world_size"] == 4
    assert [j["rank"] for j in joiner["joiners"]] == [2]
    assert not w.slurm.added and w.slurm.free == ["n5"] and w.slurm.evicted == ["n3"] and not w.slurm.released
    cmds = [(n, c) for n, c, _, _ in w.commander.sent]
    assert {n for n, c in cmds if c == "reform"} == {"n1", "n2", "n4", "n6"}
    mig = w.journal.history()[0]
    assert mig.target == "n6"
    assert [p.phase for p in mig.phases] == ["requested", "detected", "spare_chosen", "joiner_ready", "interrupted",
                                            "recovered", "reformed", "resumed", "released"]
    assert next(p for p in mig.phases if p.phase == "spare_chosen").detail["hot"] is True
    w.close()


def test_a_hot_spare_that_cannot_start_the_joiner_gives_way_to_the_pools_spare(tmp_path: Path) -> None:
    w = _hot_spare_world(tmp_path, fail_on="n6")
    status = asyncio.run(_with_hot_spare(w))
    assert status == jn.SUCCEEDED, w.journal.history()[0].error
    assert [n for n, c, _, _ in w.commander.sent if c == "abort"] == ["n6"]  # its joiners stopped; it stays
    assert w.slurm.added == ["n5"] and w.journal.history()[0].target == "n5" and not w.slurm.released
    assert UnplannedPlan.from_record(w.journal.history()[0]).hot_tried == ["n6"]  # a restarted torchpassd skips it
    w.close()


def test_a_planned_move_seats_the_leaving_ranks_on_the_jobs_hot_spare_and_letting_go_keeps_it_in_the_job(
        tmp_path: Path) -> None:
    """A drain of a job with a hot spare: the leaving node's ranks get joiners on the hot spare's
    running launchpad in the leaving node's place (no spare from the pool, no resize, no step);
    a migration that lets the target go stops only those joiners, the node stays in the job."""
    from torchpassd.planned import Plan, PlannedMigration

    w = _hot_spare_world(tmp_path)

    async def go() -> PlannedMigration:
        await _add_hot_spare(w)
        mid = w.journal.start_migration("7", mode="planned-aware", source="n2", reason="drain", gen=w.gen)
        mig = PlannedMigration(w.deps, Plan(job="7", source="n2", gen=w.gen), mid, detected_at=time.time())
        await mig._prepare()
        assert await mig._drop_target(mig.plan.target) == []
        return mig
    mig = asyncio.run(go())
    assert (mig.plan.target, mig.plan.hot, mig.plan.ranks) == ("n6", ["n6"], [1])
    [(node, joiner)] = [(n, a) for n, c, _, a in w.commander.sent if c == "start_joiner"]
    assert node == "n6" and joiner["group_rank"] == 1 and joiner["group_world_size"] == 4
    assert [j["rank"] for j in joiner["joiners"]] == [1] and joiner["world_size"] == 4
    assert [p.phase for p in w.journal.history()[0].phases] == ["requested", "spare_chosen", "joiner_ready"]
    assert [n for n, c, _, _ in w.commander.sent if c == "abort"] == ["n6"]
    assert not w.slurm.added and not w.slurm.released and w.slurm.free == ["n5"]  # the pool's spare untouched
    w.close()
