"""The fault matrix's unplanned and transparent columns on the dev cluster (issue 22): a second fault
while an unplanned recovery or a transparent (criu) migration is under way: torchpassd SIGKILLed,
the broker stopped for a minute, the joining spare killed, a second node drained. Each cell ends
with the job COMPLETED and its parameters bit-identical to an undisturbed run (an unplanned
recovery may repeat only the failed step, with the same loss). The planned column and the idle row
are in tests/faults/test_fault_matrix.py; these run under ``-m matrix`` (make test-matrix), CI keeps one test
per row (test_planned_migration.py, test_unplanned_migration.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.e2e.test_planned_migration import restart_broker
from tests.faults.test_fault_matrix import BROKER_OUTAGE_S, assert_recovered_bit_identical
from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, assert_bit_identical, reference_log, sacct_state, wait_until
from tests.support.fault_matrix import OK, FaultMatrix
from torchpassd import drill_transparent
from torchpassd.drill_report import DrillReport, read_log
from torchpassd.drill_unplanned import judge

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow, pytest.mark.matrix,
              pytest.mark.timeout(900)]

STEPS = 200
STEP_SLEEP = 0.15
RECOVERY = "unplanned recovery"
TRANSPARENT = "transparent migration"
TRANSPARENT_STEPS, TRANSPARENT_SLEEP = 150, 0.2
# while the lost rank is being seated: the survivors are parked, the joiner starts on the spare
SEATING = ("spare_chosen", "spare_added", "joiner_ready", "interrupted")


@pytest.fixture(autouse=True)
def _matrix_file(fault_matrix: FaultMatrix, e2e_dir: Path) -> None:
    fault_matrix.out = e2e_dir / "fault-matrix.txt"


def two_spares(devcluster: DevCluster) -> None:
    devcluster.run("scontrol", "update", "reservationname=torchpass_spares", "nodes=n4,n5")


def succeeded_off(daemon: Daemon, job: str, node: str, timeout: float = 300) -> dict:
    """The migration off ``node`` that succeeded (earlier attempts may have failed or rolled back)."""
    return wait_until(f"a migration off {node} to succeed", lambda: next(
        (m for m in daemon.migrations(job) if m["source"] == node and m["status"] == "succeeded"), None), timeout)


def resumed_at(mig: dict) -> int:
    return next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]


def n3_killed(devcluster: DevCluster, tp_config: Path, workdir: Path, daemon: Daemon,
              nodes: int = 4) -> tuple[Training, int]:
    """A job training on ``nodes`` nodes whose n3 (rank 2) was just killed; and where in its log
    the lines after the kill begin."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=nodes)
    job.wait_running(daemon, min_step=5)
    offset = job.log.stat().st_size
    devcluster.kill_node("n3")
    return job, offset


def assert_rank_recovered(job: Training, ref: Path, rank: int, mig: dict, offset: int) -> None:
    rep = DrillReport()
    judge(job.log, ref, rank, resumed_at(mig), offset, rep)
    assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep


def test_unplanned_recovery_through_a_broker_outage(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                                    workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    """n3 dies; while its rank is being seated on the spare the broker is down for a minute. The
    survivors stay parked, nothing else is judged dead, and the recovery completes (or fails and is
    decided again) once the broker is back: the rank is rebuilt, COMPLETED, bit-identical."""
    job, offset = n3_killed(devcluster, tp_config, workdir, torchpassd)
    with fault_matrix.case("broker stopped 60 s", RECOVERY) as cell:
        torchpassd.wait_phase(job.job, SEATING, timeout=60)
        restart_broker(devcluster, down_s=BROKER_OUTAGE_S)
        mig = succeeded_off(torchpassd, job.job, "n3")
        assert mig["target"] == "n5" and mig["mode"] == "unplanned-aware", mig
        assert {m["source"] for m in torchpassd.migrations(job.job)} == {"n3"}, "a survivor was judged dead"
        job.wait_done(timeout=300)
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        assert_recovered_bit_identical(job, reference(STEPS), 2, resumed_at(mig), offset)
        tries = [m["status"] for m in torchpassd.migrations(job.job)]
        cell["outcome"] = OK
        cell["detail"] = f"broker down {BROKER_OUTAGE_S:.0f} s mid-recovery: attempts {tries}; COMPLETED, bit-identical"


def test_unplanned_recovery_whose_spare_dies_takes_the_next(torchpassd: Daemon, devcluster: DevCluster,
                                                            tp_config: Path, workdir: Path,
                                                            fault_matrix: FaultMatrix) -> None:
    """n3 dies and the spare chosen for its rank dies while the joiner starts: the rank is rebuilt on
    the other spare, the dead spare is not used again; COMPLETED, bit-identical."""
    two_spares(devcluster)
    job, offset = n3_killed(devcluster, tp_config, workdir, torchpassd, nodes=3)
    with fault_matrix.case("joining spare killed", RECOVERY) as cell:
        first = torchpassd.wait_phase(job.job, ("spare_added", "joiner_ready"), timeout=60)
        chosen = next(p["detail"]["spare"] for p in reversed(first["phases"]) if p["phase"] == "spare_chosen")
        devcluster.kill_node(chosen)
        mig = succeeded_off(torchpassd, job.job, "n3")
        other = ({"n4", "n5"} - {chosen}).pop()
        assert mig["target"] == other, (chosen, mig)
        job.wait_done(timeout=300)
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        assert_rank_recovered(job, reference_log(workdir, 3, STEPS), 2, mig, offset)
        cell["outcome"] = OK
        cell["detail"] = f"spare {chosen} killed while joining: rank 2 rebuilt on {other}; COMPLETED, bit-identical"


def test_a_node_drained_during_an_unplanned_recovery_moves_after_it(torchpassd: Daemon, devcluster: DevCluster,
                                                                    tp_config: Path, workdir: Path,
                                                                    fault_matrix: FaultMatrix) -> None:
    """n3 dies and n2 is drained while n3's rank is seated: the recovery finishes first (one change to
    a job at a time), then n2's rank moves to the second spare; COMPLETED, bit-identical."""
    two_spares(devcluster)
    job, offset = n3_killed(devcluster, tp_config, workdir, torchpassd, nodes=3)
    with fault_matrix.case("a second node drained", RECOVERY) as cell:
        torchpassd.wait_phase(job.job, SEATING, timeout=60)
        devcluster.drain("n2", "planned maintenance")
        rec = succeeded_off(torchpassd, job.job, "n3")
        moved = succeeded_off(torchpassd, job.job, "n2")
        assert rec["mode"] == "unplanned-aware" and moved["mode"] == "planned-aware", (rec, moved)
        assert {rec["target"], moved["target"]} == {"n4", "n5"}, (rec, moved)
        job.wait_done(timeout=300)
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        assert_rank_recovered(job, reference_log(workdir, 3, STEPS), 2, rec, offset)
        cell["outcome"] = OK
        cell["detail"] = (f"n3's rank rebuilt on {rec['target']}, then n2's moved to {moved['target']}; "
                          "COMPLETED, bit-identical")


def transparent_job(devcluster: DevCluster, tp_config: Path, workdir: Path, daemon: Daemon,
                     nodes: int = 4, steps: int = TRANSPARENT_STEPS) -> Training:
    job = Training(devcluster, tp_config, workdir, steps=steps, step_sleep=TRANSPARENT_SLEEP,
                   script=drill_transparent.SCRIPT, mode="transparent", nodes=nodes)
    job.wait_running(daemon)
    return job


@pytest.mark.criu
@pytest.mark.parametrize(("fault", "phase"), [("kill -9 torchpassd", "joiner_ready"),
                                              ("kill -9 torchpassd", "handed_over"),
                                              ("broker stopped 60 s", "joiner_ready")],
                         ids=["torchpassd-killed-at-joiner_ready", "torchpassd-killed-at-handed_over",
                              "broker-down-at-joiner_ready"])  # no spaces: the ids name the job's directory
def test_a_fault_during_a_transparent_migration(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                                workdir: Path, reference, criu: None,  # noqa: ANN001
                                                fault_matrix: FaultMatrix, fault: str, phase: str) -> None:
    """While n3's worker process is being moved by criu (before the dump, or after the hand-over)
    torchpassd is SIGKILLed and started again, or the broker is down for a minute: the migration is
    rolled back or finished (from the journal after a restart), the drain is carried out, no worker
    is left stopped or parked; COMPLETED, bit-identical."""
    job = transparent_job(devcluster, tp_config, workdir, torchpassd)
    with fault_matrix.case(fault, f"{TRANSPARENT} ({phase})") as cell:
        devcluster.drain("n3", "planned maintenance")
        torchpassd.wait_phase(job.job, (phase,), timeout=120)
        if fault == "kill -9 torchpassd":
            torchpassd.stop(signal.SIGKILL)
            torchpassd.start()
        else:
            restart_broker(devcluster, down_s=BROKER_OUTAGE_S)
        mig = succeeded_off(torchpassd, job.job, "n3", timeout=400)
        assert mig["mode"] == "planned-transparent" and mig["target"] == "n5", mig
        assert_bit_identical(job.wait_done(timeout=400), reference(TRANSPARENT_STEPS, drill_transparent.SCRIPT))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        tries = [m["status"] for m in torchpassd.migrations(job.job)]
        cell["outcome"] = OK
        cell["detail"] = f"{fault} at {phase}: attempts {tries}; COMPLETED, bit-identical"


@pytest.mark.criu
def test_two_nodes_drained_during_a_transparent_job_both_move(torchpassd: Daemon, devcluster: DevCluster,
                                                              tp_config: Path, workdir: Path, criu: None,
                                                              fault_matrix: FaultMatrix) -> None:
    """n2 and n3 drained in the same moment with two spares: both worker processes are moved by criu,
    one migration at a time; COMPLETED, bit-identical to an undisturbed 3-rank run."""
    two_spares(devcluster)
    job = transparent_job(devcluster, tp_config, workdir, torchpassd, nodes=3)
    with fault_matrix.case("a second node drained", TRANSPARENT) as cell:
        devcluster.drain("n2", "planned maintenance")
        devcluster.drain("n3", "planned maintenance")
        moved = [succeeded_off(torchpassd, job.job, n) for n in ("n2", "n3")]
        assert {m["target"] for m in moved} == {"n4", "n5"} and {m["mode"] for m in moved} == {"planned-transparent"}
        ref = reference_log(workdir, 3, TRANSPARENT_STEPS, drill_transparent.SCRIPT)
        assert_bit_identical(job.wait_done(timeout=300), read_log(ref))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        cell["outcome"] = OK
        cell["detail"] = f"n2 -> {moved[0]['target']}, n3 -> {moved[1]['target']} by criu; COMPLETED, bit-identical"
