"""Stand-ins for what torchpassd's Orchestrator talks to, for unit tests of its decisions
(tests/unit/test_job_ended_mid_migration.py, test_spare_failure.py): Slurm (spare pool, resizer and
command runner, recording what they were asked), the launchpads' commander, the watcher; and a
job of two nodes whose launchpads have reported, in a real Registry and Journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchpass_common import protocol
from torchpass_common.config import Config
from torchpassd import journal as jn
from torchpassd import planned
from torchpassd.daemon import Orchestrator
from torchpassd.metrics import Metrics
from torchpassd.registry import Registry

JOB = "7"


class Slurm:
    """The spare pool, the resizer and its command runner: records what they were asked."""

    reservation = "torchpass_spares"

    def __init__(self) -> None:
        self.given_back: list[str] = []
        self.released: list[str] = []
        self.commands: list[list[str]] = []
        self.runner = self

    def give_back(self, node: str) -> None:
        self.given_back.append(node)

    def list(self, snap: Any = None) -> list[Any]:
        return []  # the reservation's spares: none free

    def release_node(self, job: int, node: str) -> None:
        self.released.append(node)

    def run(self, argv: list[str], **where: Any) -> str:
        self.commands.append(list(argv))
        return ""


class Launchpads:
    """The commander: every command succeeds; commands (node, name) and notices to the job's
    output are kept."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self.sent: list[tuple[str, str]] = []

    async def send(self, job: str, node: str, cmd: str, **kw: Any) -> dict[str, Any]:
        self.sent.append((node, cmd))
        if cmd == "notice":
            self.notices.append(kw["args"]["text"])
        return {}


class Watcher:
    jobs: dict[str, Any] = {}
    last = None


async def _events(job: str, event: str, detail: dict[str, Any]) -> None:
    return None


async def orchestrator(tmp_path: Path, commander: Any = None) -> tuple[Orchestrator, jn.Journal, Slurm]:
    """An Orchestrator over job JOB on n1 (ranks 0, 1; the batch host) and n3 (ranks 2, 3), whose
    workers registered save/load and started movable (either mode can move them)."""
    registry = Registry()
    await registry.update_job(JOB, nodes=("n1", "n3"), user="u", mode="aware", batch_host="n1")
    for node, ranks in (("n1", (0, 1)), ("n3", (2, 3))):
        body = {"node": node, "seq": 1, "workers": [{"rank": r, "step": 10, "state": "running", "pid": 99,
                                                     "registered": True, "movable": True} for r in ranks]}
        await registry.on_message(node, protocol.decode(protocol.encode(protocol.HEARTBEAT, job=JOB, gen=1,
                                                                        body=body)))
    journal = jn.Journal(tmp_path / "j.sqlite")
    journal.upsert_job(JOB, user="u", mode="aware", state="RUNNING", gen=1, nodes=["n1", "n3"])
    slurm = Slurm()
    deps = planned.Deps(Config(), journal, registry, commander, slurm, slurm, Metrics(), _events,  # type: ignore[arg-type]
                        tmp_path / "steps")
    return Orchestrator(deps, Watcher()), journal, slurm  # type: ignore[arg-type]
