"""The fault matrix's planned column phase by phase on the dev cluster (issue 22): while n3's ranks
are moved by a planned, model-aware migration, a second fault strikes once the migration reached a
given phase (or a later one: the phases after the pause last milliseconds): the joining spare is
killed, a survivor (n2) is killed, the broker is down for a minute, or n2 is drained too. Three
nodes train, two spares wait. Whatever happened in between, each cell ends with every faulted node
out of the job, no migration left running, the job COMPLETED 0:0 and every loss and final parameter
bit-identical to an undisturbed run (a step an unplanned recovery resumed at may repeat, with the
same loss). torchpassd SIGKILLed in each phase is test_planned_migration.py's
test_torchpassd_sigkill_in_each_phase_then_restart. Run under ``-m matrix`` (make test-matrix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_link_reroute import assert_identical_replays_aside
from tests.e2e.test_planned_migration import STEP_SLEEP, STEPS, repair_killed_spare, restart_broker
from tests.faults.test_fault_matrix import BROKER_OUTAGE_S
from tests.faults.test_fault_matrix_recoveries import two_spares
from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, reference_log, sacct_state, wait_until
from tests.support.fault_matrix import OK, FaultMatrix
from torchpassd.drill_report import read_log

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow, pytest.mark.matrix,
              pytest.mark.timeout(900)]

ORDER = ("spare_added", "joiner_ready", "paused", "handed_over", "reformed", "resumed")
FAULTS = ("joining spare killed", "a survivor killed", "broker stopped 60 s", "a second node drained")


@pytest.fixture(autouse=True)
def _matrix_file(fault_matrix: FaultMatrix, e2e_dir: Path) -> None:
    fault_matrix.out = e2e_dir / "fault-matrix.txt"


@pytest.mark.parametrize("phase", ORDER[:4])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.replace(" ", "-") for f in FAULTS])
def test_a_second_fault_in_each_phase_of_a_planned_migration(torchpassd: Daemon, devcluster: DevCluster,
                                                             tp_config: Path, workdir: Path,
                                                             fault_matrix: FaultMatrix, fault: str, phase: str,
                                                             request: pytest.FixtureRequest) -> None:
    two_spares(devcluster)
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=3 * STEP_SLEEP, nodes=3)
    job.wait_running(torchpassd, min_step=5)
    with fault_matrix.case(fault, f"planned migration ({phase})") as cell:
        devcluster.drain("n3", "planned maintenance")
        running = torchpassd.wait_phase(job.job, ORDER[ORDER.index(phase):])
        struck_at = running["phase"]
        faulted = {"n3"}
        if fault == "joining spare killed":
            spare = running["target"]  # the spare a planned migration chose
            devcluster.kill_node(spare)
            request.addfinalizer(lambda: repair_killed_spare(devcluster, spare))  # before the cluster's reset
            faulted.add(spare)
        elif fault == "a survivor killed":
            devcluster.kill_node("n2")
            faulted.add("n2")
        elif fault == "a second node drained":
            devcluster.drain("n2", "planned maintenance")
            faulted.add("n2")
        else:
            restart_broker(devcluster, down_s=BROKER_OUTAGE_S)

        def settled() -> list[str] | None:
            view, migs = torchpassd.job(job.job), torchpassd.migrations(job.job)
            if view is None or any(m["status"] == "running" for m in migs) or set(view["nodes"]) & faulted:
                return None
            workers = sum(len(lp["workers"]) for lp in view["launchpads"].values())
            return sorted(view["nodes"]) if workers == job.world else None
        nodes = wait_until(f"{sorted(faulted)} out of the job, every rank training", settled, 400, every=0.5)
        job.wait_done(timeout=400)
        assert_identical_replays_aside(job, read_log(reference_log(workdir, 3, STEPS)))
        devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
        tries = [f"{m['mode'].split('-')[0]} {m['source']}:{m['status']}" for m in torchpassd.migrations(job.job)]
        cell["outcome"] = OK
        cell["detail"] = f"struck at {struck_at}: {tries}; ends on {nodes}; COMPLETED, bit-identical"[:150]
