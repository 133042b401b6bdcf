"""The report gate: torchpassd acts on a launchpad report only when Slurm shows the sender's job
running on the node the report names (or the job's own migration brings the node in), and only
within the per-node rate; forged, premature and flooding reports are held or refused, logged and
counted, and the real launchpads of the same node keep being heard. Also: with the health policy
off, GPU telemetry (a forged XID) is not acted on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from launchpad.telemetry.collector import Collector
from launchpad.telemetry.encoding import DeltaEncoder
from launchpad.telemetry.replay import ReplayBackend
from slurm_plugin.model import Job, Snapshot
from torchpass_common import protocol
from torchpass_common.config import HealthConfig
from torchpassd.health_watch import HealthWatch
from torchpassd.journal import Journal
from torchpassd.metrics import Metrics
from torchpassd.report_gate import ReportGate

pytestmark = pytest.mark.security

MARK = "torchpass:mode=aware,spares=0"
HEALTH = Path(__file__).resolve().parents[2] / "torchpassd" / "drill_jobs" / "health"


def snap(*jobs: Job) -> Snapshot:
    return Snapshot(jobs={j.job_id: j for j in jobs})


def job(job_id: int, *nodes: str, comment: str = MARK) -> Job:
    return Job(job_id, "train", "alice", "RUNNING", nodes, nodes[0], "main", comment)


def heartbeat(job_id: str, node: str, seq: int = 1) -> protocol.Message:
    return protocol.decode(protocol.encode(protocol.HEARTBEAT, job=job_id, gen=1,
                                           body={"node": node, "seq": seq, "workers": []}))


def state(job_id: str, node: str, online: bool = True) -> protocol.Message:
    return protocol.decode(protocol.encode(protocol.STATE, job=job_id, gen=1,
                                           body={"node": node, "online": online, "pid": 4242}))


class World:
    """Slurm's view, a migration's moving nodes and a clock the test sets."""

    def __init__(self, view: Snapshot | None) -> None:
        self.view, self.moving, self.now = view, {}, 0.0
        self.metrics = Metrics()
        self.stale: list[tuple[str, str]] = []  # the retained states the daemon would clear
        self.gate = ReportGate(lambda: self.view, lambda j: self.moving.get(j, set()),
                               self.metrics.reports_refused_total, lambda j, n: self.stale.append((j, n)),
                               clock=lambda: self.now, hold_max=8)

    def refused(self, reason: str) -> float:
        return self.metrics.reports_refused_total.value(reason=reason)


def test_a_report_about_a_node_of_its_job_is_admitted() -> None:
    w = World(snap(job(7, "n1", "n2")))
    hb = heartbeat("7", "n2")
    assert w.gate.admit("n2", hb) == [hb]
    assert w.gate.release() == []


def test_a_forged_report_about_a_node_outside_the_job_is_refused_once_slurm_has_spoken() -> None:
    """Job 7's account names n3 (another job's node): never acted on; refused, logged and counted
    as soon as a Slurm snapshot newer than the report still does not show job 7 there."""
    w = World(snap(job(7, "n1", "n2"), job(8, "n3")))
    assert w.gate.admit("n3", heartbeat("7", "n3")) == []
    assert w.gate.release() == [] and w.refused("not_in_job") == 0  # the same snapshot: held
    w.view = snap(job(7, "n1", "n2"), job(8, "n3"))
    assert w.gate.release() == []
    assert w.refused("not_in_job") == 1
    assert 'torchpass_reports_refused_total{reason="not_in_job"} 1' in w.metrics.render()
    w.view = snap(job(7, "n1", "n2", "n3"), job(8, "n3"))  # held no longer: nothing comes back
    assert w.gate.release() == []


def test_a_job_without_torchpass_or_one_that_ended_vouches_for_nothing() -> None:
    """Job 9 runs without --torchpass; job 3 ended and left its retained state behind: that state
    is handed back to be cleared from the broker (a heartbeat is never retained: nothing to clear)."""
    w = World(snap(job(9, "n4", comment="")))
    assert w.gate.admit("n4", heartbeat("9", "n4")) == []
    assert w.gate.admit("n1", state("3", "n1")) == []
    w.view = snap(job(9, "n4", comment=""))
    assert w.gate.release() == []
    assert w.refused("job_not_running") == 2 and w.refused("not_in_job") == 0
    assert w.stale == [("3", "n1")]


def test_a_forged_state_about_a_running_job_is_refused_but_not_cleared() -> None:
    """A state naming a node outside its running job is refused; nothing is cleared for it."""
    w = World(snap(job(7, "n1")))
    assert w.gate.admit("n3", state("7", "n3")) == []
    w.view = snap(job(7, "n1"))
    assert w.gate.release() == [] and w.refused("not_in_job") == 1 and w.stale == []


def test_reports_of_a_job_slurm_has_not_shown_yet_wait_and_keep_their_order() -> None:
    """A job that started after the last poll: its launchpad's (retained) state and first
    heartbeat are held, not lost; once Slurm shows the job they are acted on, oldest first."""
    w = World(snap())
    st, hb1, hb2 = state("7", "n1"), heartbeat("7", "n1", 1), heartbeat("7", "n1", 2)
    assert w.gate.admit("n1", st) == [] and w.gate.admit("n1", hb1) == []
    w.view = snap(job(7, "n1"))
    assert w.gate.admit("n1", hb2) == [st, hb1, hb2]  # the held ones first
    assert w.gate.release() == []
    w2 = World(None)  # before the first Slurm answer at all
    assert w2.gate.admit("n1", st) == []
    w2.view = snap(job(7, "n1"))
    assert w2.gate.release() == [("n1", st)]
    assert w.refused("not_in_job") == w2.refused("not_in_job") == 0


def test_the_spare_a_running_migration_brings_in_is_heard_before_slurm_shows_it() -> None:
    w = World(snap(job(7, "n1", "n2")))
    w.moving["7"] = {"n2", "n5"}
    ack = protocol.decode(protocol.encode(protocol.ACK, job="7", gen=2,
                                          body={"node": "n5", "command_id": "c1", "cmd": "ready", "migration": "m1",
                                                "ok": True, "error": None, "result": {}}))
    assert w.gate.admit("n5", ack) == [ack]
    w.moving.clear()
    assert w.gate.admit("n5", heartbeat("7", "n5")) == []  # the migration is over: Slurm decides again


def test_the_goodbye_of_a_node_that_left_the_job_is_heard_nothing_else() -> None:
    """n2 moved out of job 7 and Slurm shows it gone: its launchpad's offline state still counts
    (the job's view must not keep a ghost), a heartbeat or an online state does not."""
    w = World(snap(job(7, "n1", "n2")))
    assert w.gate.admit("n2", heartbeat("7", "n2")) != []
    w.view = snap(job(7, "n1", "n5"))
    assert w.gate.admit("n2", heartbeat("7", "n2")) == []
    bye = state("7", "n2", online=False)
    assert w.gate.admit("n2", bye) == [bye]
    assert w.gate.admit("n2", heartbeat("7", "n2")) == [] and w.gate.admit("n2", state("7", "n2")) == []
    assert w.gate.admit("n9", state("7", "n9", online=False)) == []  # never in the job: not a goodbye


def test_a_flood_is_cut_to_the_rate_and_does_not_silence_the_nodes_own_job() -> None:
    """Job 7's account floods reports about n3; job 8, which really runs on n3, is still heard."""
    w = World(snap(job(7, "n1", "n3"), job(8, "n3")))
    admitted = sum(len(w.gate.admit("n3", heartbeat("7", "n3", i))) for i in range(1000))
    assert admitted == 200  # the burst
    assert w.refused("rate") == 800
    assert w.gate.admit("n3", heartbeat("8", "n3")) != []
    w.now = 1.0  # a second later: the sustained rate again
    assert sum(len(w.gate.admit("n3", heartbeat("7", "n3", i))) for i in range(100)) == 50


def test_held_reports_are_bounded() -> None:
    w = World(snap())
    for i in range(20):
        assert w.gate.admit(f"x{i}", heartbeat("7", f"x{i}")) == []
    assert w.refused("held_overflow") == 12
    w.view = snap(job(7, *(f"x{i}" for i in range(20))))
    assert [n for n, _ in w.gate.release()] == [f"x{i}" for i in range(12, 20)]  # the newest were kept


def test_a_job_that_ended_has_its_held_reports_dropped() -> None:
    w = World(snap())
    w.gate.admit("n1", heartbeat("7", "n1"))
    w.gate.forget("7")
    w.view = snap(job(7, "n1"))
    assert w.gate.release() == []


def test_gpu_telemetry_is_not_acted_on_while_the_health_policy_is_off(tmp_path: Path) -> None:
    """A job's account sends an XID 79 report for its own node with health.enabled = false: the
    node is not drained and nothing is decided."""
    drained: list[str] = []

    async def drain(node: str, reason: str) -> None:
        drained.append(node)

    async def main() -> None:
        with Journal(tmp_path / "journal.sqlite") as journal:
            watch = HealthWatch(HealthConfig(enabled=False), journal, drain=drain, migrate=lambda *a: None,
                                counter=Metrics().health_decisions_total)
            collector = Collector(ReplayBackend.from_file(HEALTH / "degrading.json", start=0.0), node="n3")
            collector.open()
            enc = DeltaEncoder()
            decisions = [await watch.on_heartbeat("42", "n3", {"gpu": enc.encode(collector.sample())})
                         for _ in range(16)]  # XID 79 at sample 12
            await watch.settle()
            assert decisions == [None] * 16 and drained == []
            assert journal.events(job_id="42") == []

    asyncio.run(main())
