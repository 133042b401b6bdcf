"""The planned migration's pure decisions: reading the leaving worker's command line, the plan a
restarted torchpassd rebuilds from the journal, the joiner's command line, the pause step, and the
drill's verdict on a training log (resumed step, lost steps, bit-identity); and where the pause ends."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.orchestrator_stubs import JOB, orchestrator
from torchpass_common import protocol
from torchpass_common.config import Config
from torchpass_common.errors import MigrationError
from torchpassd import journal as jn
from torchpassd.drill_report import DrillReport, compare
from torchpassd.planned import WORMHOLE_PORT_BASE, Deps, Plan, PlannedMigration, WorkerTemplate, joiner_port
from torchpassd.registry import Registry

PROC_TEXT = ("/venv/bin/python\n-u\n-m\ntorchpass._bootstrap\ntrain.py\n--steps\n50\n\n===\n"
             "RANK=2\nWORLD_SIZE=4\nMASTER_ADDR=n1\nMASTER_PORT=29500\nTORCHPASS_CONFIG=/etc/tp.toml\n\n===\n/home/u/run\n")


def test_worker_template_is_read_from_proc_text() -> None:
    tpl = WorkerTemplate.parse(PROC_TEXT, job="7", node="n3")
    assert tpl.python == "/venv/bin/python"
    assert tpl.script_args == ["train.py", "--steps", "50"]
    assert tpl.env["MASTER_ADDR"] == "n1" and tpl.env["WORLD_SIZE"] == "4"
    assert tpl.cwd == "/home/u/run"


def test_the_leaving_nodes_output_options_go_to_the_spares_launchpad() -> None:
    with_args = PROC_TEXT.replace("TORCHPASS_CONFIG=", 'TORCHPASS_OUTPUT_ARGS=["--tee", "3"]\nTORCHPASS_CONFIG=')
    assert WorkerTemplate.parse(with_args, job="7", node="n3").output_args() == ["--tee", "3"]
    assert WorkerTemplate.parse(PROC_TEXT, job="7", node="n3").output_args() == []
    for bad in ("not json", '{"tee": 3}', "[3]"):  # a worker's environment is not trusted blindly
        text = PROC_TEXT.replace("TORCHPASS_CONFIG=", f"TORCHPASS_OUTPUT_ARGS={bad}\nTORCHPASS_CONFIG=")
        assert WorkerTemplate.parse(text, job="7", node="n3").output_args() == []


def test_worker_not_under_the_bootstrap_is_refused_with_a_hint() -> None:
    with pytest.raises(MigrationError, match="does not run under the torchpass bootstrap.*job=7, node=n3"):
        WorkerTemplate.parse(PROC_TEXT.replace("torchpass._bootstrap", "train"), job="7", node="n3")
    with pytest.raises(MigrationError, match="lacks MASTER_ADDR"):
        WorkerTemplate.parse(PROC_TEXT.replace("MASTER_ADDR=n1\n", ""), job="7", node="n3")


def test_plan_is_rebuilt_from_the_journal(tmp_path: Path) -> None:
    with jn.Journal(tmp_path / "j.sqlite") as j:
        j.upsert_job("7", user="u", mode="aware", state="RUNNING", gen=3, nodes=["n1", "n3"])
        mid = j.start_migration("7", mode="planned-aware", source="n3", reason="drain", gen=3)
        j.record_transition(mid, "spare_chosen", jn.RUNNING, {"plan": {"target": "n5", "rank": 2}})
        j.record_transition(mid, "paused", jn.RUNNING, {"plan": {"paused_step": 40, "future_field": 1}})
        plan = Plan.from_record(j.migration(mid))
    assert (plan.job, plan.source, plan.gen, plan.new_gen) == ("7", "n3", 3, 4)
    assert (plan.target, plan.rank, plan.paused_step) == ("n5", 2, 40)


def _migration(registry: Registry, plan: Plan) -> PlannedMigration:
    deps = Deps(Config(), None, registry, None, None, None, None, None, Path("/tmp"))  # type: ignore[arg-type]
    return PlannedMigration(deps, plan, "ab" * 16, detected_at=time.time())


def test_joiner_node_runs_the_leaving_nodes_script_in_as_many_workers() -> None:
    plan = Plan(job="7", source="n3", gen=1, rank=2, world_size=4, target="n5", store_host="n1", store_port=29500)
    argv = _migration(Registry(), plan)._joiner_argv(WorkerTemplate.parse(PROC_TEXT, job="7", node="n3"), 2, "n5")
    assert argv[:3] == ["/venv/bin/python", "-m", "launchpad"]
    assert argv[argv.index("--node") + 1] == "n5" and argv[argv.index("--config") + 1] == "/etc/tp.toml"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "n1:29500"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[-3:] == ["train.py", "--steps", "50"]  # ranks and sources travel in the join plan (env)
    module = PROC_TEXT.replace("torchpass._bootstrap\ntrain.py", "torchpass._bootstrap\n-m\npkg.train")
    argv = _migration(Registry(), plan)._joiner_argv(WorkerTemplate.parse(module, job="7", node="n3"), 1, "n5")
    assert argv[-4:] == ["--module", "pkg.train", "--steps", "50"]


def test_joiner_ports_do_not_collide_for_eight_workers_over_many_generations() -> None:
    ports = {joiner_port(WORMHOLE_PORT_BASE + gen, i) for gen in range(2, 150) for i in range(8)}
    assert len(ports) == 148 * 8 and max(ports) < 32768  # below Linux's ephemeral port range


def _heartbeat(node: str, step: int) -> protocol.Message:
    body = {"node": node, "seq": 1, "workers": [{"rank": 0, "step": step, "state": "running"}]}
    return protocol.decode(protocol.encode(protocol.HEARTBEAT, job="7", gen=1, body=body))


def test_pause_step_leaves_room_for_heartbeat_lag_and_delivery() -> None:
    registry = Registry()

    async def feed() -> None:
        await registry.on_message("n1", _heartbeat("n1", 10))
        await registry.on_message("n3", _heartbeat("n3", 12))
    asyncio.run(feed())
    for lp in registry.job("7").launchpads.values():
        lp.steps_per_s = 4.0
    step = _migration(registry, Plan(job="7", source="n3", gen=1, survivors=["n1"]))._pause_step()
    assert step >= 12 + 1 + 6  # 4 steps/s over the 1.5 s margin at least
    assert step <= 12 + 1 + 8  # and not much more: the heartbeats are fresh


def _log(path: Path, rows: list[tuple[int, int, str]], final: str) -> Path:
    lines = [json.dumps({"rank": r, "step": s, "loss": x}) for r, s, x in rows]
    lines += [json.dumps({"rank": r, "final": final}) for r in (0, 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(steps: int, bad: dict[tuple[int, int], str] | None = None) -> list[tuple[int, int, str]]:
    return [(r, s, (bad or {}).get((r, s), f"{r}.{s}")) for s in range(steps) for r in (0, 1)]


@pytest.mark.parametrize("case", ["identical", "skipped", "replayed", "diverged"])
def test_drill_verdict(tmp_path: Path, case: str) -> None:
    ref = _log(tmp_path / "ref", _rows(10), "h")
    rows: list[tuple[int, int, str]] = _rows(10)
    expected: dict[str, Any] = {"resumed_at_step": 4, "lost_steps": 0, "bit_identical": True}
    if case == "skipped":  # rank 1 came back at step 5: step 4 never ran there
        rows = [row for row in rows if row[:2] != (1, 4)]
        expected = {"resumed_at_step": 5, "lost_steps": 1, "bit_identical": False}
    elif case == "replayed":  # rank 1 ran step 3 again after the move
        rows.insert(rows.index((1, 4, "1.4")), (1, 3, "1.3"))
        expected = {"resumed_at_step": 3, "lost_steps": 0, "bit_identical": False}
    elif case == "diverged":
        rows = _rows(10, {(1, 7): "other"})
        expected = {"resumed_at_step": 4, "lost_steps": 0, "bit_identical": False}
    rep = DrillReport()
    compare(_log(tmp_path / "run", rows, "h"), ref, rank=1, expected_step=4, report=rep)
    assert {k: getattr(rep, k) for k in expected} == expected
    assert rep.expected_step == 4


class _SlowExit:
    """The commander: every command succeeds at once but ``exit``, which takes ``exit_s``, as a
    leaving worker does while it frees gigabytes of state."""

    def __init__(self, exit_s: float) -> None:
        self.exit_s = exit_s
        self.sent: list[tuple[str, str]] = []

    async def send(self, job: str, node: str, cmd: str, **kw: Any) -> dict[str, Any]:
        self.sent.append((node, cmd))
        if cmd == "exit":
            await asyncio.sleep(self.exit_s)
        return {}


def test_the_pause_ends_when_the_job_trains_again_not_when_the_leaving_worker_has_exited(tmp_path: Path) -> None:
    async def main() -> None:
        commander = _SlowExit(0.6)
        orch, journal, _ = await orchestrator(tmp_path, commander)
        mid = journal.start_migration(JOB, mode="planned-aware", source="n1", reason="drain", gen=1)
        plan = Plan(job=JOB, source="n1", gen=1, ranks=[0, 1], world_size=4, target="n5", survivors=["n3"],
                    paused_at=time.time())
        assert await PlannedMigration(orch.d, plan, mid, detected_at=time.time()).finish() == jn.SUCCEEDED
        assert ("n1", "exit") in commander.sent and ("n5", "resume") in commander.sent
        resumed = next(p for p in journal.migration(mid).phases if p.phase == "resumed")
        assert resumed.detail["pause_s"] < 0.4  # not the leaving worker's 0.6 s exit

    asyncio.run(main())
