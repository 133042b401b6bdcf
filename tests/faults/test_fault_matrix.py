"""The fault matrix of issue 11 on the dev cluster: kill -9 of torchpassd, of the broker, of one
launchpad, and a network cut of one node, each during idle training and during a planned
migration. Every case ends with the job running and nothing lost (bit-identical to an
uninterrupted run) or with a clear, reported failure; the matrix is printed at the end of the run
(tests/support/fault_matrix.py). torchpassd and broker kills during a migration are the cases in
test_planned_migration.py, which record their cells too and run in CI (with the unplanned kills
and cuts of test_unplanned_migration.py); the rest of the matrix runs under ``-m matrix``
(make test-matrix)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.test_planned_migration import STEPS, restart_broker
from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, assert_bit_identical, reference_log, sacct_state, wait_until
from tests.support.fault_matrix import OK, FaultMatrix
from torchpassd.drill_report import DrillReport, read_log
from torchpassd.drill_unplanned import judge

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow, pytest.mark.matrix]
IDLE_STEP_SLEEP = 0.4  # room for three faults, their repair and checks before the run ends
BROKER_OUTAGE_S = 60.0  # issue 22: a broker restart of a minute costs a job nothing
SHORT_CUT_S = 2.5  # a partition shorter than heartbeat loss detection (1 s x 5 in the e2e config)


@pytest.fixture(autouse=True)
def _matrix_file(fault_matrix: FaultMatrix, e2e_dir: Path) -> None:
    fault_matrix.out = e2e_dir / "fault-matrix.txt"


def max_step(daemon: Daemon, job: str) -> int:
    view = daemon.job(job) or {}
    return min((w["step"] for lp in view.get("launchpads", {}).values() for w in lp["workers"]), default=-1)


def wait_training_goes_on(daemon: Daemon, job: str, steps: int = 5, timeout: float = 60) -> None:
    """Every rank (as torchpassd sees it through heartbeats) gets ``steps`` further."""
    start = max_step(daemon, job)
    wait_until(f"job {job} to train {steps} more steps", lambda: max_step(daemon, job) >= start + steps, timeout)


def launchpad_pid(daemon: Daemon, job: str, node: str) -> int:
    """The PID of ``node``'s launchpad: the launchpad ancestor of a worker it reports."""
    lp = daemon.job(job)["launchpads"][node]
    pid = lp["workers"][0]["pid"]
    for _ in range(4):
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if b"launchpad" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no launchpad process above the workers on {node}")


def test_idle_kills_of_torchpassd_and_broker_and_a_short_cut(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,  # noqa: E501
                                                             workdir: Path, reference,  # noqa: ANN001
                                                             fault_matrix: FaultMatrix) -> None:
    """Three faults, one after the other, on one training job; none may start a migration, and
    the run must end bit-identical (so each cell is OK only once the whole run is)."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=IDLE_STEP_SLEEP)
    job.wait_running(torchpassd)
    cells = []
    with fault_matrix.case("kill -9 torchpassd", "idle training") as cell:
        cells.append(cell)
        torchpassd.stop(signal.SIGKILL)
        torchpassd.start()  # empty memory: the journal, retained launchpad states and heartbeats rebuild it
        wait_training_goes_on(torchpassd, job.job)
        cell["detail"] = "restarted torchpassd sees all 4 launchpads training; no migration; bit-identical"
    with fault_matrix.case("kill -9 broker", "idle training") as cell:
        cells.append(cell)
        restart_broker(devcluster)
        wait_training_goes_on(torchpassd, job.job)  # launchpads and torchpassd reconnected, heartbeats flow
        cell["detail"] = "all clients reconnected, heartbeats resumed; no migration; bit-identical"
    with fault_matrix.case("network cut of one node", "idle training") as cell:
        cells.append(cell)
        devcluster.cut("n3")
        time.sleep(SHORT_CUT_S)
        devcluster.heal("n3")
        wait_training_goes_on(torchpassd, job.job)
        assert torchpassd.migrations(job.job) == [], "a short partition started a (false) migration"
        assert_bit_identical(job.wait_done(), reference(STEPS))
        cell["detail"] = (f"n3 cut {SHORT_CUT_S} s (below loss detection): no false migration; bit-identical. "
                          "Longer cuts: test_unplanned_migration.py (recovered on the spare)")
    for c in cells:
        c["outcome"] = OK


def assert_recovered_bit_identical(job: Training, reference_steps: tuple, rank: int, resumed_at: int,
                                   offset: int) -> None:
    """The unplanned flow's verdict (drill_unplanned.judge): only the failed step may repeat,
    with the same loss; everything else equals the uninterrupted run."""
    steps, finals = reference_steps
    ref = job.log.with_name("reference.log")
    ref.write_text("".join(json.dumps({"rank": r, "step": st, "loss": x}) + "\n" for r, st, x in steps)
                   + "".join(json.dumps({"rank": r, "final": h}) + "\n" for r, h in finals.items()))
    report = DrillReport()
    judge(job.log, ref, rank, resumed_at, offset, report)
    assert report.bit_identical and report.lost_steps == 0 and report.error is None, report


def test_idle_kill_one_launchpad(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                 workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=IDLE_STEP_SLEEP)
    job.wait_running(torchpassd)
    with fault_matrix.case("kill -9 one launchpad", "idle training") as cell:
        offset = job.log.stat().st_size
        os.kill(launchpad_pid(torchpassd, job.job, "n3"), signal.SIGKILL)  # its workers go with it
        mig = torchpassd.wait_migration(job.job, "n3", timeout=180)
        assert mig["status"] == "succeeded" and mig["mode"] == "unplanned-aware" and mig["target"] == "n5", mig
        resumed = next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]
        job.wait_done(timeout=180)
        assert_recovered_bit_identical(job, reference(STEPS), 2, resumed, offset)
        detected = next(p for p in mig["phases"] if p["phase"] == "detected")
        cell["outcome"] = OK
        cell["detail"] = (f"rank 2 recovered on n5 (unplanned, {detected.get('detail', {}).get('evidence', 'detected')}),"
                          f" resumed at step {resumed}; bit-identical")[:150]


def _migration_under_way(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, wd: Path) -> Training:
    job = Training(devcluster, tp_config, wd, steps=STEPS, step_sleep=IDLE_STEP_SLEEP)
    job.wait_running(torchpassd)
    devcluster.drain("n3", "planned maintenance")
    torchpassd.wait_phase(job.job, ("joiner_ready", "paused"))
    return job


def test_migration_kill_joiner_launchpad(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                         workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    job = _migration_under_way(torchpassd, devcluster, tp_config, workdir)
    with fault_matrix.case("kill -9 one launchpad", "planned migration") as cell:
        os.kill(launchpad_pid(torchpassd, job.job, "n5"), signal.SIGKILL)  # the joiner's, mid hand-over
        first = torchpassd.wait_migration(job.job, "n3")
        assert first["status"] == "rolled_back" and first["error"], first
        assert_bit_identical(job.wait_done(), reference(STEPS))  # the source kept its rank: nothing lost
        others = [f"{m['mode']} off {m['source']}: {m['status']}" for m in torchpassd.migrations(job.job)[1:]]
        cell["outcome"] = OK
        cell["detail"] = f"rolled back ({first['error'][:60]}...); bit-identical; then {others or 'nothing'}"[:150]


def test_migration_cut_of_the_target(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                     workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    job = _migration_under_way(torchpassd, devcluster, tp_config, workdir)
    with fault_matrix.case("network cut of one node", "planned migration") as cell:
        devcluster.cut("n5")
        try:
            first = torchpassd.wait_migration(job.job, "n3")
        finally:
            devcluster.heal("n5")
        assert first["status"] == "rolled_back" and first["error"], first
        assert_bit_identical(job.wait_done(), reference(STEPS))
        final = [m for m in torchpassd.migrations(job.job) if m["source"] == "n3"][-1]
        cell["outcome"] = OK
        cell["detail"] = (f"n5 cut: rolled back ({first['error'][-50:]}); healed, retry {final['status']}; "
                          "bit-identical")[:150]



def test_migration_kill_a_survivor_node(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                        workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    """n3 drained, and n2 dies while its ranks are moved: the planned migration gives way at once
    (rolled back, the spare freed), the unplanned recovery rebuilds n2's rank on that spare, and
    the drain waits for another spare while the job trains on to the end, bit-identical."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=IDLE_STEP_SLEEP)
    job.wait_running(torchpassd)
    devcluster.drain("n3", "planned maintenance")
    torchpassd.wait_phase(job.job, ("spare_chosen", "spare_added", "joiner_ready"))
    with fault_matrix.case("a survivor killed", "planned migration") as cell:
        offset = job.log.stat().st_size
        devcluster.kill_node("n2")
        planned_first = torchpassd.wait_migration(job.job, "n3", timeout=120)
        assert planned_first["status"] == "rolled_back", planned_first
        assert planned_first["error"].startswith("n2 died during the migration off n3, before the hand-over"), \
            planned_first
        rec = torchpassd.wait_migration(job.job, "n2", timeout=180)
        assert rec["status"] == "succeeded" and rec["mode"] == "unplanned-aware" and rec["target"] == "n5", rec
        resumed = next(p for p in rec["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]
        job.wait_done(timeout=240)
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        assert_recovered_bit_identical(job, reference(STEPS), 1, resumed, offset)
        cell["outcome"] = OK
        cell["detail"] = (f"planned off n3 rolled back at once; n2's rank rebuilt on n5 at step {resumed}; "
                          "drain waits for a spare; COMPLETED, bit-identical")[:150]


def test_migration_a_second_node_drained(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                         workdir: Path, fault_matrix: FaultMatrix) -> None:
    """n2 and n3 drained in the same moment, two spares: one migration at a time per job, so n2's
    ranks move, then n3's; the job ends COMPLETED, bit-identical to an undisturbed 3-rank run."""
    devcluster.run("scontrol", "update", "reservationname=torchpass_spares", "nodes=n4,n5")  # two spares
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=IDLE_STEP_SLEEP, nodes=3)
    job.wait_running(torchpassd)
    with fault_matrix.case("a second node drained", "planned migration") as cell:
        devcluster.drain("n2", "planned maintenance")
        devcluster.drain("n3", "planned maintenance")
        moved = [torchpassd.wait_migration(job.job, n, timeout=180) for n in ("n2", "n3")]
        assert [m["status"] for m in moved] == ["succeeded", "succeeded"], moved
        assert sorted(m["target"] for m in moved) == ["n4", "n5"], moved
        assert_bit_identical(job.wait_done(), read_log(reference_log(workdir, 3, STEPS)))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        cell["outcome"] = OK
        cell["detail"] = (f"n2 -> {moved[0]['target']}, then n3 -> {moved[1]['target']} (one migration at a time); "
                          "COMPLETED, bit-identical")


def test_idle_broker_stopped_for_a_minute(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                          workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    """The broker down for 60 s: the workers train on (the control plane is not on their path),
    torchpassd and the launchpads reconnect when it is back, nothing is judged dead meanwhile."""
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=IDLE_STEP_SLEEP)
    job.wait_running(torchpassd)
    with fault_matrix.case("broker stopped 60 s", "idle training") as cell:
        before = len(read_log(job.log)[0])
        restart_broker(devcluster, down_s=BROKER_OUTAGE_S)
        assert len(read_log(job.log)[0]) > before + BROKER_OUTAGE_S / IDLE_STEP_SLEEP / 2, "training stalled"
        wait_training_goes_on(torchpassd, job.job)  # every launchpad reports again
        assert torchpassd.migrations(job.job) == []
        assert_bit_identical(job.wait_done(), reference(STEPS))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        cell["outcome"] = OK
        cell["detail"] = f"broker down {BROKER_OUTAGE_S:.0f} s: training went on, all reconnected, no migration; bit-identical"


def test_migration_broker_stopped_for_a_minute(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                               workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    """The broker goes down for 60 s while n3's ranks are being moved: the migration ends (moved,
    or rolled back with the reason), no rank is left parked, and the job completes bit-identical."""
    job = _migration_under_way(torchpassd, devcluster, tp_config, workdir)
    with fault_matrix.case("broker stopped 60 s", "planned migration") as cell:
        restart_broker(devcluster, down_s=BROKER_OUTAGE_S)
        first = torchpassd.wait_migration(job.job, "n3", timeout=240)
        assert first["status"] in ("succeeded", "rolled_back"), first
        assert_bit_identical(job.wait_done(timeout=300), reference(STEPS))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        final = [m for m in torchpassd.migrations(job.job) if m["source"] == "n3"][-1]
        cell["outcome"] = OK
        cell["detail"] = (f"first attempt {first['status']} ({(first.get('error') or '')[:50]}); last "
                          f"{final['status']}; COMPLETED, bit-identical")[:150]
