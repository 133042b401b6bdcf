"""The fault matrix's transparent column's remaining second faults on the dev cluster (issue 22): the
joining spare killed and a survivor killed while a transparent (criu) migration runs. The first ends
COMPLETED and bit-identical; a transparent job's script registered no state, so a survivor's ranks
cannot be rebuilt from a replica: that job ends with a clear, recorded failure and never hangs. (A
survivor killed during an unplanned recovery: test_unplanned_migration.py's
test_second_death_during_the_recovery_is_recovered_too, in CI.) Run under ``-m matrix``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.test_fault_matrix_recoveries import (
    TRANSPARENT,
    TRANSPARENT_STEPS,
    succeeded_off,
    transparent_job,
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


@pytest.mark.criu
def test_the_joining_spare_killed_during_a_transparent_migration(torchpassd: Daemon, devcluster: DevCluster,
                                                                 tp_config: Path, workdir: Path, criu: None,
                                                                 fault_matrix: FaultMatrix) -> None:
    """n3 drained in a transparent job; the spare chosen to restore its worker dies while the move is
    prepared. The move is rolled back (the original worker goes on), the dead spare is not used
    again, and the worker is moved to the other spare; COMPLETED, bit-identical."""
    two_spares(devcluster)
    # long enough for the roll-back (the dead spare is known once Slurm ends its step: ~30 s) and the retry
    job = transparent_job(devcluster, tp_config, workdir, torchpassd, nodes=3, steps=3 * TRANSPARENT_STEPS)
    with fault_matrix.case("joining spare killed", TRANSPARENT) as cell:
        devcluster.drain("n3", "planned maintenance")
        first = torchpassd.wait_phase(job.job, ("spare_added", "joiner_ready"), timeout=120)
        chosen = first["target"]
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
    job = transparent_job(devcluster, tp_config, workdir, torchpassd, nodes=4)
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
