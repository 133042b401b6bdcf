"""launchpad's WorkerGroup.supervise with real worker processes: which outcome a round ends with
when a local worker fails, when another node reports a failure, and when both happen because an
orchestrator told the workers to exit (the local exit code wins: the node failed clearly)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from launchpad import workers
from launchpad.agent import Agent
from launchpad.commands import Commands
from launchpad.group import Outcome, WorkerGroup, join_plan
from launchpad.rendezvous import Membership
from launchpad.spec import LaunchSpec
from tests.support.ports import free_port
from torchpass_common import agent_channel
from torchpass_common.config import Config
from torchpass_common.errors import WorkerError
from torchpass_common.transfer_address import TransferAddress

MEMBERSHIP = Membership(round=0, node_rank=0, nnodes=2, rank_offset=0, local_world_size=1, world_size=2,
                        store_host="127.0.0.1", store_port=1)


def supervise(tmp_path: Path, code: str, told_to_exit: bool, remote: str | None) -> Outcome:
    """Run one worker (``python -c code``) under a WorkerGroup; another node reports ``remote``
    as soon as the supervisor first asks."""
    script = tmp_path / "worker.py"
    script.write_text(code)
    spec = LaunchSpec(entrypoint=sys.executable, args=(str(script),), no_python=True, grace_period=10.0)

    async def main() -> Outcome:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path=str(tmp_path / "agent.sock"))
        w = group.adopt(await workers.spawn(spec, group.router, 0, 0, {}))
        if told_to_exit:
            group.told_to_exit.add(w.pid)

        async def remote_failure() -> str | None:
            return remote

        try:
            return await asyncio.wait_for(group.supervise(asyncio.Event(), lambda: None, remote_failure, 0.05), 30)
        finally:
            await group.stop()

    return asyncio.run(main())


def test_a_failed_local_worker_ends_the_round_with_its_exit_code(tmp_path: Path) -> None:
    out = supervise(tmp_path, "import sys; sys.exit(3)", told_to_exit=False, remote=None)
    assert (out.ok, out.failed) == (False, (0, 3))


def test_another_nodes_failure_ends_the_round_at_once(tmp_path: Path) -> None:
    out = supervise(tmp_path, "import time; time.sleep(60)", told_to_exit=False, remote="n1: worker rank 1 exited")
    assert (out.ok, out.failed, out.remote) == (False, None, "n1: worker rank 1 exited")


def test_a_worker_told_to_exit_is_the_nodes_outcome_not_the_other_nodes_report(tmp_path: Path) -> None:
    # both nodes' workers were told to exit by an abort; the other node's report of its own exit
    # arrives first, but this node still exits with its own worker's code (75: interrupted)
    out = supervise(tmp_path, "import sys, time; time.sleep(1); sys.exit(75)", told_to_exit=True,
                    remote="n1: worker rank 1 exited with code 75")
    assert (out.ok, out.failed, out.remote) == (False, (0, 75), None)


def test_a_worker_told_to_exit_that_succeeds_leaves_the_remote_failure(tmp_path: Path) -> None:
    out = supervise(tmp_path, "import time; time.sleep(0.5)", told_to_exit=True, remote="n1: lost")
    assert (out.ok, out.failed, out.remote) == (False, None, "n1: lost")


def test_a_joining_node_starts_each_worker_as_the_rank_it_takes_over(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """torchpassd's join plan: local worker i becomes ranks[i] with torchrun's environment for that
    place (node rank, sizes) and only its own state source; the plan itself (tokens) stays out."""
    plan = {"ranks": [6, 7], "world_size": 8, "group_rank": 3, "group_world_size": 4,
            "sources": [{"host": "0.0.0.0", "port": 29402 + 200 * i, "token": "ab"} for i in range(2)]}
    monkeypatch.setenv(agent_channel.ENV_JOIN_PLAN, json.dumps(plan))
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys\n"
                      "keys = ['RANK', 'LOCAL_RANK', 'GROUP_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_WORLD_SIZE',"
                      " 'TORCHPASS_JOIN', 'TORCHPASS_JOIN_SOURCE', 'TORCHPASS_JOIN_PLAN']\n"
                      f"open({str(tmp_path)!r} + '/w' + os.environ['LOCAL_RANK'], 'w')"
                      ".write(json.dumps({k: os.environ.get(k) for k in keys}))\n")
    spec = LaunchSpec(entrypoint=sys.executable, args=(str(script),), no_python=True, nproc_per_node=2)
    m = Membership(round=0, node_rank=0, nnodes=1, rank_offset=0, local_world_size=2, world_size=2,
                   store_host="127.0.0.1", store_port=1)

    async def main() -> Outcome:
        group = WorkerGroup(spec, m, restarts=0, socket_path=str(tmp_path / "agent.sock"))
        await group.start()

        async def no_failure() -> None:
            return None
        try:
            return await asyncio.wait_for(group.supervise(asyncio.Event(), lambda: None, no_failure, 0.05), 30)
        finally:
            await group.stop()

    assert asyncio.run(main()).ok
    seen = [json.loads((tmp_path / f"w{i}").read_text()) for i in range(2)]
    for i, env in enumerate(seen):
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(6 + i), str(i), "3")
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("8", "2", "4")
        assert env["TORCHPASS_JOIN"] == "1" and json.loads(env["TORCHPASS_JOIN_SOURCE"]) == plan["sources"][i]
        assert env["TORCHPASS_JOIN_PLAN"] is None


def test_a_joining_launchpad_starts_its_workers_without_a_rendezvous_or_torch(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A spare's launchpad takes its place from the join plan: no rendezvous round (nothing listens
    at its endpoint here, yet the worker runs as the plan's rank), and launchpad itself never imports
    torch (seconds on a small node, before the joiner could even start its own import)."""
    plan = {"ranks": [5], "world_size": 6, "group_rank": 2, "group_world_size": 3,
            "sources": [{"host": "0.0.0.0", "port": 29402, "token": "ab"}]}
    monkeypatch.setenv(agent_channel.ENV_JOIN_PLAN, json.dumps(plan))
    script = tmp_path / "worker.py"
    script.write_text(f"import os; open({str(tmp_path / 'rank')!r}, 'w').write(os.environ['RANK'] + ' ' + "
                      "os.environ['MASTER_ADDR'] + ':' + os.environ['MASTER_PORT'])\n")
    spec = LaunchSpec(entrypoint=sys.executable, args=(str(script),), no_python=True, rdzv_backend="c10d",
                      rdzv_host="127.0.0.1", rdzv_port=free_port(), run_id="7-join-ab-n4")
    code = subprocess.run([sys.executable, "-c", "import sys, launchpad.cli, launchpad.agent, launchpad.control; "
                           "sys.exit('torch' in sys.modules)"], timeout=60).returncode
    assert code == 0, "launchpad imported torch at start-up"
    assert asyncio.run(asyncio.wait_for(Agent(spec, Config()).main(), 60)) == 0
    assert (tmp_path / "rank").read_text() == f"5 127.0.0.1:{spec.rdzv_port}"


def test_a_join_plan_that_does_not_fit_is_refused_clearly(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(agent_channel.ENV_JOIN_PLAN, json.dumps({"ranks": [6], "world_size": 8, "group_rank": 3,
                                                                "group_world_size": 4, "sources": [{}]}))
    with pytest.raises(WorkerError, match="not a join plan for 2 workers"):
        join_plan(2)
    monkeypatch.setenv(agent_channel.ENV_JOIN_PLAN, "{not json")
    with pytest.raises(WorkerError, match="not a join plan"):
        join_plan(1)


def test_a_node_whose_workers_all_left_by_migration_is_emptied(tmp_path: Path) -> None:
    """The batch host after its ranks moved: every worker exited because a migration told it to
    (or criu moved it), so the node runs none of the job's ranks; one that ended on its own, or
    one still running, means the node still has its ranks."""
    spec = LaunchSpec(entrypoint=sys.executable, args=("-c", "import sys; sys.exit(0)"), no_python=True)

    async def main() -> list[bool]:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path=str(tmp_path / "agent.sock"))
        seen = [group.emptied()]  # no workers at all: nothing left by migration
        a = group.adopt(await workers.spawn(spec, group.router, 0, 0, {}))
        b = group.adopt(await workers.spawn(spec, group.router, 1, 1, {}))
        await asyncio.gather(a.wait(), b.wait())
        group.told_to_exit.add(a.pid)
        seen.append(group.emptied())  # b ended on its own
        b.moved = True
        seen.append(group.emptied())
        return seen

    assert asyncio.run(main()) == [False, False, True]


def held_round(tmp_path: Path, codes: list[str], hold_s: float, *, replace: bool) -> tuple[Outcome, dict]:
    """Two workers under a WorkerGroup that holds crashes for ``hold_s``; with ``replace`` the
    crashed rank 0 is rebuilt by a joiner (as torchpassd's start_joiner does) 0.5 s after it died."""
    spec = LaunchSpec(entrypoint=sys.executable, args=(), no_python=True, grace_period=5.0)
    seen: dict = {"beats": 0}

    async def main() -> Outcome:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path=str(tmp_path / "agent.sock"), hold_s=hold_s,
                            on_held=lambda: seen.__setitem__("beats", seen["beats"] + 1))
        for rank, code in enumerate(codes):
            script = tmp_path / f"worker{rank}.py"
            script.write_text(code)
            group.adopt(await workers.spawn(dataclasses.replace(spec, args=(str(script),)), group.router,
                                            rank, rank, {}))

        async def rebuild() -> None:
            while not group.held:
                await asyncio.sleep(0.05)
            seen["held"] = sorted(group.workers[p].rank for p in group.held)
            await asyncio.sleep(0.5)
            good = tmp_path / "joiner.py"
            good.write_text("import time; time.sleep(1)")
            group.spec = dataclasses.replace(spec, args=(str(good),))
            w = await group.add_joiner(0, 2, TransferAddress("127.0.0.1", 1, b"\0"))
            seen["joiner_local_rank"] = w.local_rank

        async def no_remote() -> str | None:
            return None

        task = asyncio.create_task(rebuild()) if replace else None
        try:
            return await asyncio.wait_for(group.supervise(asyncio.Event(), lambda: None, no_remote, 0.05), 30)
        finally:
            if task is not None:
                await task
            seen["ranks_after"] = sorted(w.rank for w in group.workers.values())
            await group.stop()

    return asyncio.run(main()), seen


KILLED = "import os, signal, time; time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)"


def test_a_worker_killed_by_a_signal_is_held_and_rebuilt_in_place_while_the_others_run(tmp_path: Path) -> None:
    out, seen = held_round(tmp_path, [KILLED, "import time; time.sleep(2)"], hold_s=10, replace=True)
    assert out.ok, out.describe()  # the joiner took rank 0's place and both finished
    assert seen["held"] == [0] and seen["beats"] == 1  # torchpassd was told at once
    assert seen["joiner_local_rank"] == 0 and seen["ranks_after"] == [0, 1]  # the crashed one is gone


def test_a_held_crash_not_rebuilt_in_time_fails_the_round_as_torchrun_would(tmp_path: Path) -> None:
    out, seen = held_round(tmp_path, [KILLED, "import time; time.sleep(20)"], hold_s=1, replace=False)
    assert (out.ok, out.failed) == (False, (0, -9)), out.describe()


def test_a_script_that_raises_is_never_held(tmp_path: Path) -> None:
    out, seen = held_round(tmp_path, ["raise SystemExit(1)", "import time; time.sleep(20)"], hold_s=10, replace=False)
    assert (out.ok, out.failed) == (False, (0, 1)) and seen["beats"] == 0


def test_the_only_worker_of_a_node_crashing_is_held_too(tmp_path: Path) -> None:
    out, seen = held_round(tmp_path, [KILLED], hold_s=10, replace=True)
    assert out.ok, out.describe()  # the round waited for the rebuild instead of ending with no worker left
    assert seen["held"] == [0] and seen["ranks_after"] == [0]


def test_an_in_place_rebuild_given_up_by_a_restarted_torchpassd_is_held_as_a_crash_again(tmp_path: Path) -> None:
    """torchpassd restarted mid-way through rebuilding rank 0 in place: its abort with ``hold`` kills
    the joiner so that rank 0 is held as crashed again (a heartbeat at once), the next decision's
    joiner takes its place, and the round ends ok."""
    spec = LaunchSpec(entrypoint=sys.executable, args=(), no_python=True, grace_period=5.0)
    beats: list[int] = []

    async def main() -> tuple[Outcome, dict, list[int]]:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path=str(tmp_path / "agent.sock"), hold_s=10,
                            on_held=lambda: beats.append(len(group.held)))
        for rank, code in enumerate([KILLED, "import time; time.sleep(3)"]):
            script = tmp_path / f"worker{rank}.py"
            script.write_text(code)
            group.adopt(await workers.spawn(dataclasses.replace(spec, args=(str(script),)), group.router, rank, rank, {}))
        cmds = Commands.__new__(Commands)
        cmds.agent = SimpleNamespace(node="n1", group=group, gen=1, spec=spec, channel=SimpleNamespace(links={}))
        cmds.joiners = {}

        async def torchpassd() -> tuple[dict, list[int]]:
            while not group.held:
                await asyncio.sleep(0.05)
            waiting = tmp_path / "waiting.py"
            waiting.write_text("import time; time.sleep(30)")  # a joiner waiting for its state
            group.spec = dataclasses.replace(spec, args=(str(waiting),))
            first = await group.add_joiner(0, 2, TransferAddress("127.0.0.1", 1, b"\0"))
            cmds.joiners["m1"] = [first.pid]
            acked = await cmds.abort({"hold": True}, 1, "m1")  # the restarted torchpassd's fail()
            while first.pid not in group.held:
                await asyncio.sleep(0.05)
            done = tmp_path / "done.py"
            done.write_text("import time; time.sleep(1)")
            group.spec = dataclasses.replace(spec, args=(str(done),))
            second = await group.add_joiner(0, 2, TransferAddress("127.0.0.1", 1, b"\0"))  # the new decision's
            return acked, [first.pid, second.pid]

        task = asyncio.create_task(torchpassd())
        out = await asyncio.wait_for(group.supervise(asyncio.Event(), lambda: None, no_remote, 0.05), 30)
        acked, pids = await task
        await group.stop()
        return out, acked, pids

    async def no_remote() -> str | None:
        return None

    out, acked, (first, second) = asyncio.run(main())
    assert out.ok, out.describe()
    assert acked["held"] == [0] and acked["stopped_joiners"] == [], acked
    assert beats == [1, 1], beats  # torchpassd heard of each crash at once: the kill, then the aborted rebuild
    assert first != second


def test_a_crashed_rank_is_rebuilt_from_the_warm_standby_and_a_new_one_is_kept(tmp_path: Path) -> None:
    """Under a model-aware job the node keeps a standby (interpreter up, torch imported): the joiner
    that rebuilds a crashed rank is that process, told the rank's environment, so the pause pays no
    interpreter start; another standby is started for the next crash; stop() lets it go."""
    joiner = tmp_path / "joiner.py"
    joiner.write_text("import json, os, sys, time\n"
                      f"open({str(tmp_path / 'joined.json')!r}, 'w').write(json.dumps({{'pid': os.getpid(), "
                      "'rank': os.environ['RANK'], 'join': os.environ.get('TORCHPASS_JOIN'), "
                      "'torch_before_script': 'torch' in sys.modules, 'stdin': sys.stdin.read()}))\n"
                      "time.sleep(1)\n")
    spec = LaunchSpec(entrypoint=str(joiner), args=(), grace_period=5.0)  # through the bootstrap
    crash = LaunchSpec(entrypoint=sys.executable, args=("-c", KILLED), no_python=True, grace_period=5.0)

    async def main() -> tuple[Outcome, dict]:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path="", hold_s=10)  # no agent socket: inert
        group.keep_standby()
        while not group.standbys:
            await asyncio.sleep(0.05)
        standby = group.standbys[0].proc.pid
        group.adopt(await workers.spawn(crash, group.router, 0, 0, {}))
        seen: dict = {"standby": standby}

        async def rebuild() -> None:
            while not group.held:
                await asyncio.sleep(0.05)
            seen["joiner"] = (await group.add_joiner(0, 2, TransferAddress("127.0.0.1", 1, b"\0"))).pid
            while not group.standbys:
                await asyncio.sleep(0.05)
            seen["next_standby"] = group.standbys[0].proc.pid

        async def no_remote() -> str | None:
            return None

        task = asyncio.create_task(rebuild())
        try:
            return await asyncio.wait_for(group.supervise(asyncio.Event(), lambda: None, no_remote, 0.05), 60), seen
        finally:
            await task
            await group.stop()
            seen["left"] = [p for p in (standby, seen.get("next_standby")) if p and Path(f"/proc/{p}").exists()]

    out, seen = asyncio.run(main())
    assert out.ok, out.describe()
    joined = json.loads((tmp_path / "joined.json").read_text())
    assert seen["joiner"] == seen["standby"] == joined["pid"]  # the standby became rank 0's joiner
    assert (joined["rank"], joined["join"], joined["torch_before_script"], joined["stdin"]) == ("0", "1", True, "")
    assert seen["next_standby"] not in (None, seen["standby"]) and seen["left"] == []


def test_the_standby_waits_until_the_workers_have_settled(tmp_path: Path) -> None:
    """The standby's own torch import is not added to the workers' (or a joiner's) start-up on a
    node of few cores: it starts only once the agent says they settled (each timed a step)."""
    spec = LaunchSpec(entrypoint=str(tmp_path / "unused.py"), args=(), grace_period=5.0)
    settled = [False]

    async def main() -> tuple[bool, bool]:
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path="", hold_s=10, settled=lambda: settled[0])
        group.keep_standby()
        await asyncio.sleep(1.5)
        before = bool(group.standbys)
        settled[0] = True
        for _ in range(600):
            if group.standbys:
                break
            await asyncio.sleep(0.05)
        after = bool(group.standbys)
        await group.stop()
        return before, after

    assert asyncio.run(main()) == (False, True)


def test_a_groups_standby_state_follows_its_start(tmp_path: Path) -> None:
    spec = LaunchSpec(entrypoint=str(tmp_path / "unused.py"), args=(), grace_period=5.0)

    async def main() -> list[str]:
        states = []
        off = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path="")  # hold_s 0: crashes are not held
        off.keep_standby()
        states.append(off.standby_state)
        group = WorkerGroup(spec, MEMBERSHIP, restarts=0, socket_path="", hold_s=10, settled=lambda: False)
        group.keep_standby()
        states.append(group.standby_state)
        await group.stop()
        return states

    assert asyncio.run(main()) == ["none", "starting"]


def test_a_hot_spare_seated_for_a_lost_node_runs_its_ranks_in_that_nodes_place(tmp_path: Path) -> None:
    """start_joiner on a hot spare (--torchpass-spares) names the lost node's place: its joiners get
    what torchrun gives that node's workers (GROUP_RANK 2 of 3 nodes, local ranks 0 and 1)."""
    script = tmp_path / "worker.py"
    script.write_text("import json, os\n"
                      "keys = ['RANK', 'LOCAL_RANK', 'GROUP_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'GROUP_WORLD_SIZE',"
                      " 'TORCHPASS_JOIN']\n"
                      f"open({str(tmp_path)!r} + '/w' + os.environ['RANK'], 'w')"
                      ".write(json.dumps({k: os.environ.get(k) for k in keys}))\n")
    spec = LaunchSpec(entrypoint=sys.executable, args=(str(script),), no_python=True, nproc_per_node=2, hot_spare=True)
    m = Membership(round=0, node_rank=0, nnodes=1, rank_offset=0, local_world_size=2, world_size=2,
                   store_host="127.0.0.1", store_port=1)
    agent = SimpleNamespace(group=WorkerGroup(spec, m, restarts=0, socket_path=str(tmp_path / "agent.sock")),
                            world_size=0, node="n4", timeouts=Config().timeouts,
                            channel=SimpleNamespace(wait_for=lambda pids, timeout: asyncio.sleep(0)))
    source = {"host": "0.0.0.0", "port": 29402, "token": "ab"}

    async def main() -> Outcome:
        await Commands(agent).start_joiner({"world_size": 6, "group_rank": 2, "group_world_size": 3, "joiners": [
            {"rank": 4, "source": source}, {"rank": 5, "source": source}]}, 1, "m1")

        async def no_failure() -> None:
            return None
        try:
            return await asyncio.wait_for(agent.group.supervise(asyncio.Event(), lambda: None, no_failure, 0.05), 30)
        finally:
            await agent.group.stop()

    assert asyncio.run(main()).ok and agent.world_size == 6
    for rank, local in ((4, "0"), (5, "1")):
        env = json.loads((tmp_path / f"w{rank}").read_text())
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (str(rank), local, "2", "3")
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["TORCHPASS_JOIN"]) == ("6", "2", "1")


def test_a_hot_spare_never_seated_ends_with_success_once_the_jobs_store_closes(tmp_path: Path) -> None:
    """The hot spare's task is one of the user's srun: it must end 0 (the job COMPLETED) when the
    training ends without a lost node, which it learns from the rendezvous store closing; it never
    runs the script."""
    server = socket.create_server(("127.0.0.1", 0))
    def accept() -> None:  # the store: takes the spare's looks until it closes
        with contextlib.suppress(OSError):
            while True:
                server.accept()[0].close()
    threading.Thread(target=accept, daemon=True).start()
    marker = tmp_path / "ran"
    spec = LaunchSpec(entrypoint=sys.executable, args=("-c", f"open({str(marker)!r}, 'w')"), no_python=True,
                      rdzv_backend="c10d", rdzv_host="127.0.0.1", rdzv_port=server.getsockname()[1], hot_spare=True)

    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        agent = asyncio.create_task(Agent(spec, Config()).main())
        await asyncio.sleep(2.5)
        assert not agent.done()  # the job still trains: the spare waits
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        closed = loop.time()
        code = await asyncio.wait_for(agent, 30)
        return code, loop.time() - closed

    code, after = asyncio.run(main())
    assert code == 0 and after < 10 and not marker.exists()


def test_a_hot_spare_whose_seating_is_undone_stands_by_again_and_ends_with_success(tmp_path: Path) -> None:
    """A hot spare's joiners stopped because their migration was given up (they failed and the
    pool's spare took the ranks, or a drain rolled back) are no failure of the job's: the spare
    stands by for the next lost node, can be seated again, and ends 0 (the job COMPLETED) once
    the job's store closes."""
    server = socket.create_server(("127.0.0.1", 0))
    def accept() -> None:  # the job's rendezvous store, open while the job trains
        with contextlib.suppress(OSError):
            while True:
                server.accept()[0].close()
    threading.Thread(target=accept, daemon=True).start()
    spec = LaunchSpec(entrypoint=sys.executable, args=("-c", "import time; time.sleep(60)"), no_python=True,
                      rdzv_backend="c10d", rdzv_host="127.0.0.1", rdzv_port=server.getsockname()[1], hot_spare=True,
                      grace_period=2.0)
    source = {"host": "127.0.0.1", "port": 29402, "token": "ab"}

    async def main() -> tuple[list[list[int]], int]:
        agent = Agent(spec, Config())
        agent.channel.wait_for = lambda pids, timeout: asyncio.sleep(0)  # the joiners here never say hello
        task = asyncio.create_task(agent.main())
        stopped, groups = [], []
        for migration in ("m1", "m2"):  # seated, given up; seated again, given up again
            for _ in range(200):
                if agent.group is not None and agent.group not in groups and not agent.group.workers:
                    break
                await asyncio.sleep(0.05)
            groups.append(agent.group)
            commands = Commands(agent)
            await commands.start_joiner({"world_size": 4, "group_rank": 1, "group_world_size": 2,
                                         "joiners": [{"rank": 2, "source": source}, {"rank": 3, "source": source}]},
                                        1, migration)
            stopped.append((await commands.abort({}, 1, migration))["stopped_joiners"])
            await asyncio.sleep(1.0)
            assert not task.done(), f"the hot spare ended after {migration} was given up: {task.result()}"
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        return stopped, await asyncio.wait_for(task, 30)

    stopped, code = asyncio.run(main())
    assert stopped == [[2, 3], [2, 3]] and code == 0
