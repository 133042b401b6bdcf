"""The fault matrix's remaining second faults on the dev cluster (issue 22): a survivor killed while an
unplanned recovery seats a lost rank, the joining spare killed and a survivor killed while a
transparent (criu) migration runs. A job whose state can be rebuilt ends COMPLETED and bit-identical
(a step a recovery resumed at may repeat, with the same loss); a transparent job, whose script
registered no state, cannot be rebuilt from a replica: it ends with a clear, recorded failure and
never hangs. Run under ``-m matrix`` (make test-matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_link_reroute import assert_identical_replays_aside
from tests.faults.test_fault_matrix_recoveries import (
    RECOVERY,
    SEATING,
    STEPS,
    TRANSPARENT,
    _transparent_job,
    n3_killed,
    succeeded_off,
    two_spares,
)
from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, assert_bit_identical, reference_log, sacct_state, wait_until
from tests.support.fault_matrix import OK, FaultMatrix
from torchpassd import drill_transparent
from torchpassd.drill_report import read_log

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow, pytest.mark.matrix,
              pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def _matrix_file(fault_matrix: FaultMatrix, e2e_dir: Path) -> None:
    fault_matrix.out = e2e_dir / "fault-matrix.txt"


def test_a_survivor_killed_while_a_lost_rank_is_seated(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                                       workdir: Path, fault_matrix: FaultMatrix) -> None:
    """n3 dies; while its rank is seated on a spare, n2 dies too. Both ranks are rebuilt on the two
    spares from the one survivor's replica; the job ends COMPLETED, bit-identical."""
    two_spares(devcluster)
    job, _ = n3_killed(devcluster, tp_config, workdir, torchpassd, nodes=3)
    with fault_matrix.case("a survivor killed", RECOVERY) as cell:
        torchpassd.wait_phase(job.job, SEATING, timeout=60)
        devcluster.kill_node("n2")
        wait_until("n2's and n3's ranks rebuilt on the spares", lambda: (v := torchpassd.job(job.job)) and
                   sorted(v["nodes"]) == ["n1", "n4", "n5"] and
                   sum(len(lp["workers"]) for lp in v["launchpads"].values()) == 3, 300)
        job.wait_done(timeout=300)
        assert_identical_replays_aside(job, read_log(reference_log(workdir, 3, STEPS)))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        tries = [f"{m['source']}:{m['status']}" for m in torchpassd.migrations(job.job)]
        cell["outcome"] = OK
        cell["detail"] = f"n3 then n2 died: attempts {tries}; on n1, n4, n5; COMPLETED, bit-identical"[:150]


@pytest.mark.criu
def test_the_joining_spare_killed_during_a_transparent_migration(torchpassd: Daemon, devcluster: DevCluster,
                                                                 tp_config: Path, workdir: Path, criu: None,
                                                                 fault_matrix: FaultMatrix) -> None:
    """n3 drained in a transparent job; the spare chosen to restore its worker dies while the move is
    prepared. The move is rolled back (the original worker goes on), the dead spare is not used
    again, and the worker is moved to the other spare; COMPLETED, bit-identical."""
    two_spares(devcluster)
    job = _transparent_job(devcluster, tp_config, workdir, torchpassd, nodes=3)
    with fault_matrix.case("joining spare killed", TRANSPARENT) as cell:
        devcluster.drain("n3", "planned maintenance")
        first = torchpassd.wait_phase(job.job, ("spare_added", "joiner_ready"), timeout=120)
        chosen = next(p["detail"]["spare"] for p in reversed(first["phases"]) if p["phase"] == "spare_chosen")
        devcluster.kill_node(chosen)
        mig = succeeded_off(torchpassd, job.job, "n3", timeout=400)
        other = ({"n4", "n5"} - {chosen}).pop()
        assert mig["mode"] == "planned-transparent" and mig["target"] == other, (chosen, mig)
        ref = reference_log(workdir, 3, job.steps, drill_transparent.SCRIPT)
        assert_bit_identical(job.wait_done(timeout=400), read_log(ref))
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        tries = [m["status"] for m in torchpassd.migrations(job.job)]
        cell["outcome"] = OK
        cell["detail"] = f"spare {chosen} killed while joining: attempts {tries}, moved to {other}; bit-identical"


@pytest.mark.criu
def test_a_survivor_killed_during_a_transparent_migration_fails_the_job_clearly(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, criu: None,
        fault_matrix: FaultMatrix) -> None:
    """n3 drained in a transparent job; n2 dies while n3's worker is being moved. A transparent job's
    script registered no state, so n2's rank cannot be rebuilt from a replica: the job must end, with
    the reason in torchpassd's history, instead of hanging or training on without a rank."""
    job = _transparent_job(devcluster, tp_config, workdir, torchpassd, nodes=4)
    with fault_matrix.case("a survivor killed", TRANSPARENT) as cell:
        devcluster.drain("n3", "planned maintenance")
        torchpassd.wait_phase(job.job, ("spare_added", "joiner_ready"), timeout=120)
        devcluster.kill_node("n2")
        def ended() -> str | None:
            state = sacct_state(devcluster, job.job, timeout=0)
            return None if state.startswith(("RUNNING", "PENDING", "RESIZING")) else state
        try:
            state = wait_until("the job to end", ended, 300, every=2)
        finally:
            devcluster.start_node("n2")
        assert not state.startswith("COMPLETED"), state
        lost = [m for m in torchpassd.migrations(job.job) if m["source"] == "n2"]
        assert lost and lost[-1]["status"] == "failed" and "register" in (lost[-1]["error"] or ""), lost
        cell["outcome"] = "clear failure"
        cell["detail"] = f"job {state}; n2's rank: {lost[-1]['error'][:90]}"
