"""Planned, model-aware migration end to end on the dev cluster: an operator drains a node, the
training job's rank moves to a spare and the job goes on from the next step, bit-identical to a
run without the drain. Also: two migrations in a row, no spare free, the spare dying during the
hand-over, torchpassd SIGKILLed mid-migration, and the broker restarted mid-migration."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_plugin import hostlist
from tests.support.devcluster import DevCluster
from tests.support.e2e import ROOT, Daemon, Training, assert_bit_identical, sacct_state, wait_until
from tests.support.fault_matrix import OK, FaultMatrix
from torchpass_common.errors import SlurmError
from torchpassd.drill_report import read_log
from torchpassd.journal import Journal

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

STEPS = 200
STEP_SLEEP = 0.15  # slow enough that a migration (joiner start-up included) fits in the run


def repair_killed_spare(devcluster: DevCluster, node: str) -> None:
    """Bring a killed node back (and out of a job Slurm may still hold it in)."""
    devcluster.start_node(node)
    devcluster.run("scancel", "--user=root", check=False)
    try:
        devcluster.wait_node_state(node, ("idle", "reserved"), timeout=20)
    except SlurmError:
        devcluster.clear_stale_allocation(node, "e2e repair")
        devcluster.wait_node_state(node, ("idle", "reserved"), timeout=20)


def restart_broker(devcluster: DevCluster, down_s: float = 0.0) -> None:
    """SIGKILL the dev cluster's mosquitto and, ``down_s`` seconds later, start it again on the
    same port, through the devcluster tool's own daemon starter (pidfile kept, so `devcluster
    down` still stops it)."""
    sys.path.insert(0, str(ROOT / "contrib" / "devcluster"))
    from tpdevcluster import daemons, instance  # noqa: PLC0415 - the tool's package, off sys.path by default

    pid = devcluster.info["daemons"]["mosquitto"]
    os.kill(pid, signal.SIGKILL)
    wait_until("the broker to die", lambda: _reaped(pid), 10)
    time.sleep(down_s)
    daemons.start_mosquitto(instance.Instance.from_env())


def _reaped(pid: int) -> bool:
    """``pid`` is gone; a broker an earlier restart_broker started is this process's child, reaped here."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return not Path(f"/proc/{pid}").exists()


def training(devcluster: DevCluster, tp_config: Path, workdir: Path, daemon: Daemon,
             step_sleep: float = STEP_SLEEP) -> Training:
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=step_sleep)
    job.wait_running(daemon)
    return job


@pytest.mark.matrix  # CI: the aware drain of a two-rank node (test_real_jobs.py), the unplanned drills
def test_drill_two_ranks_a_node_reports_ok_bit_identical_and_completed(torchpassd: Daemon, tp_config: Path) -> None:
    res = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config), "drill",
                          "--mode", "planned-aware", "--json", "--steps", str(STEPS), "--nodes", "2",
                          "--nproc-per-node", "2", "--step-sleep", str(STEP_SLEEP)],
                         capture_output=True, text=True, timeout=900)
    report = json.loads(res.stdout)
    assert res.returncode == 0, report
    assert report["ok"] and report["bit_identical"] and report["lost_steps"] == 0, report
    assert report["job_state"] == "COMPLETED" and len(report["moved_ranks"]) == 2, report
    assert report["mode"] == "planned-aware" and report["migrated_to"] == "n5"
    assert report["migrated_from"] not in ("n1", "n5")  # never the batch host
    assert report["resumed_at_step"] == report["expected_step"] > 0
    assert 0 <= report["detect_s"] < 10 and 0 < report["pause_s"] < 30, report


def test_two_migrations_in_a_row(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path,
                                 reference) -> None:  # noqa: ANN001 - fixture factory
    job = training(devcluster, tp_config, workdir, torchpassd)
    devcluster.drain("n3", "fan failure")
    first = torchpassd.wait_migration(job.job, "n3")
    assert first["status"] == "succeeded" and first["target"] == "n5", first
    # The drained node is repaired and given to the spare pool; the next drain lands there.
    devcluster.resume("n3")
    devcluster.run("scontrol", "update", "reservationname=torchpass_spares", "nodes=n3,n5")
    devcluster.drain("n2", "memory errors")
    second = torchpassd.wait_migration(job.job, "n2")
    assert second["status"] == "succeeded" and second["target"] == "n3", second
    assert second["gen"] == first["gen"] + 1
    assert_bit_identical(job.wait_done(), reference(STEPS))


def test_drain_without_a_free_spare_waits_then_migrates(torchpassd: Daemon, devcluster: DevCluster,
                                                        tp_config: Path, workdir: Path, reference) -> None:  # noqa: ANN001
    devcluster.drain("n5", "spare under repair")
    job = training(devcluster, tp_config, workdir, torchpassd)
    devcluster.drain("n3", "planned maintenance")
    view = wait_until("the job to show why it waits",
                      lambda: (j := torchpassd.job(job.job)) and "no spare free" in j["blocked"] and j, 60)
    assert "n5: drained: spare under repair" in view["blocked"]
    assert not torchpassd.migrations(job.job)  # nothing started, the job keeps running on n3
    told = wait_until("the job's own output to say why", lambda: [ln for ln in job.out.read_text().splitlines()
                                                                  if ln.startswith("torchpass: ")
                                                                  and "right now" in ln], 30)
    assert told == [f"torchpass: job {job.job} is not protected right now: {view['blocked']}"], told  # once
    said = [ln for ln in job.out.read_text().splitlines() if ln.startswith("torchpass: ")]
    assert said == [f"torchpass: job {job.job} is protected by aware migration: every rank registered save/load: "
                    "its state moves to the spare", *told], said  # what protects it: said once, before why not now
    steps_before = max(w["step"] for lp in view["launchpads"].values() for w in lp["workers"])
    wait_until("training to go on", lambda: max(w["step"] for lp in torchpassd.job(job.job)["launchpads"].values()
                                               for w in lp["workers"]) > steps_before + 3, 60)
    devcluster.resume("n5")
    mig = torchpassd.wait_migration(job.job, "n3")
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    assert_bit_identical(job.wait_done(), reference(STEPS))


@pytest.mark.faults
def test_a_spare_missing_the_jobs_working_directory_is_drained_and_the_job_runs_on(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, reference) -> None:  # noqa: ANN001
    """The job's working directory vanishes (a file system not mounted on the spare looks the same):
    the joiner cannot start on n5, which is drained with that reason, not reused; with no other spare
    the job says why it waits and trains on, undisturbed, to COMPLETED."""
    cwd = workdir / "run"
    cwd.mkdir(exist_ok=True)
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, cwd=cwd)
    job.wait_running(torchpassd)
    cwd.rmdir()
    devcluster.drain("n3", "planned maintenance")
    try:
        mig = torchpassd.wait_migration(job.job, "n3")
        assert mig["status"] == "rolled_back" and mig["target"] == "n5", mig
        assert f"the job's working directory {cwd} does not exist on n5" in mig["error"], mig
        reason = devcluster.run("sinfo", "-h", "-n", "n5", "-o", "%200E").stdout.strip()
        assert reason.startswith("torchpass: joiner failed: the job's working directory"), reason
        wait_until("the job to say why it waits", lambda: "no spare free" in torchpassd.job(job.job)["blocked"], 60)
        assert len(torchpassd.migrations(job.job)) == 1  # the drained spare is not tried again
        assert_bit_identical(job.wait_done(), reference(STEPS))
        devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
        assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    finally:
        devcluster.resume("n5")


def test_a_drained_node_of_a_job_without_torchpass_is_left_alone(torchpassd: Daemon, devcluster: DevCluster) -> None:
    """A plain job (no --torchpass) on a node that is drained: torchpassd takes no spare, starts no
    migration and does not touch the job, which ends as Slurm ends it."""
    job = devcluster.sbatch("#!/bin/bash\nsrun sleep 15\n", "-N2", "-w", "n2,n3")
    devcluster.wait_job_state(job, "RUNNING")
    devcluster.drain("n3", "planned maintenance")
    try:
        time.sleep(5)  # ten of torchpassd's Slurm polls
        assert torchpassd.job(job) is None and not torchpassd.migrations(job)
        assert devcluster.job_record(job)["NodeList"] == "n[2-3]"  # no spare added to it
        devcluster.wait_job_state(job, ("COMPLETED",), timeout=60)
        assert sacct_state(devcluster, job) == "COMPLETED 0:0"
    finally:
        devcluster.resume("n3")


@pytest.mark.faults
def test_spare_dying_during_hand_over_rolls_back(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                                 workdir: Path, reference) -> None:  # noqa: ANN001
    job = training(devcluster, tp_config, workdir, torchpassd)
    devcluster.drain("n3", "planned maintenance")
    torchpassd.wait_phase(job.job, ("joiner_ready", "paused"))
    devcluster.kill_node("n5")
    try:
        mig = torchpassd.wait_migration(job.job, "n3")
        assert mig["status"] == "rolled_back", mig
        assert mig["error"], "the operator must see why"
        # The old rank resumed: training finishes on the original nodes, nothing lost.
        assert_bit_identical(job.wait_done(), reference(STEPS))
    finally:
        repair_killed_spare(devcluster, "n5")


@pytest.mark.faults
def test_torchpassd_sigkill_mid_migration_then_restart(torchpassd: Daemon, devcluster: DevCluster,
                                                       tp_config: Path, workdir: Path, reference,  # noqa: ANN001
                                                       fault_matrix: FaultMatrix) -> None:
    job = training(devcluster, tp_config, workdir, torchpassd, step_sleep=2 * STEP_SLEEP)  # room for two joiners
    devcluster.drain("n3", "planned maintenance")
    torchpassd.wait_phase(job.job, ("joiner_ready", "paused"))
    with fault_matrix.case("kill -9 torchpassd", "planned migration") as cell:
        torchpassd.stop(signal.SIGKILL)
        torchpassd.start()
        first = torchpassd.wait_migration(job.job, "n3")
        assert first["status"] == "rolled_back" and "restarted" in first["error"], first
        second = torchpassd.wait_migration(job.job, "n3", skip=1)
        assert second["status"] == "succeeded" and second["target"] == "n5", second
        assert_bit_identical(job.wait_done(), reference(STEPS))
        cell["outcome"], cell["detail"] = OK, "restart rolled the migration back (journal), retry succeeded; bit-identical"


@pytest.mark.faults
def test_broker_restart_mid_migration(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                      workdir: Path, reference, fault_matrix: FaultMatrix) -> None:  # noqa: ANN001
    job = training(devcluster, tp_config, workdir, torchpassd)
    devcluster.drain("n3", "planned maintenance")
    torchpassd.wait_phase(job.job, ("joiner_ready", "paused"))
    with fault_matrix.case("kill -9 broker", "planned migration") as cell:
        restart_broker(devcluster)  # SIGKILL, then start on the same port
        mig = torchpassd.wait_migration(job.job, "n3")
        assert mig["status"] == "succeeded", mig
        assert_bit_identical(job.wait_done(), reference(STEPS))
        cell["outcome"], cell["detail"] = OK, "clients reconnected, idempotent commands redelivered; migration succeeded; bit-identical"


@pytest.mark.matrix
def test_a_drain_before_the_first_step_waits_for_the_ranks_then_moves_them(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, reference) -> None:  # noqa: ANN001
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP)
    devcluster.wait_job_state(job.job, "RUNNING", timeout=60)
    devcluster.drain("n3", "planned maintenance")
    assert not (job.log.exists() and read_log(job.log)[0]), "the job had finished a step before the drain"
    mig = torchpassd.wait_migration(job.job, "n3", timeout=180)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    assert_bit_identical(job.wait_done(), reference(STEPS))
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


@pytest.mark.faults
@pytest.mark.matrix
@pytest.mark.parametrize("phase", ["spare_added", "joiner_ready", "paused", "handed_over"])
def test_torchpassd_sigkill_in_each_phase_then_restart(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                                       workdir: Path, reference, phase: str) -> None:  # noqa: ANN001
    """torchpassd SIGKILLed once the migration reached ``phase`` (or the next one: phases after the
    pause last milliseconds) and started again: it rolls back what had not been handed over and
    finishes what had, from its journal; in the end n3's ranks are on n5, the job COMPLETED
    bit-identical, and the journal's job record agrees with Slurm's node list."""
    order = ["spare_added", "joiner_ready", "paused", "handed_over", "reformed", "resumed"]
    job = training(devcluster, tp_config, workdir, torchpassd, step_sleep=3 * STEP_SLEEP)
    devcluster.drain("n3", "planned maintenance")
    killed_at = torchpassd.wait_phase(job.job, tuple(order[order.index(phase):]))["phase"]
    torchpassd.stop(signal.SIGKILL)
    torchpassd.start()
    first = torchpassd.wait_migration(job.job, "n3")
    if killed_at in ("spare_added", "joiner_ready", "paused"):
        assert first["status"] == "rolled_back" and "restarted" in first["error"], first
        first = torchpassd.wait_migration(job.job, "n3", skip=1)
    assert first["status"] == "succeeded" and first["target"] == "n5", (killed_at, first)
    slurm_nodes = hostlist.expand(devcluster.job_record(job.job)["NodeList"])
    with Journal(torchpassd.config.parent / "state" / "journal.sqlite") as journal:
        record = next(j for j in journal.jobs() if j.job_id == job.job)
    assert sorted(record.nodes) == sorted(slurm_nodes) == ["n1", "n2", "n4", "n5"], (record, slurm_nodes)
    assert_bit_identical(job.wait_done(), reference(STEPS))
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"


def test_a_drained_batch_host_hands_its_ranks_to_a_spare_and_stays_in_the_job(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, reference) -> None:  # noqa: ANN001
    """Slurm cannot take a job's batch host out of the running job, but its ranks can leave: they
    move to the spare like any node's. The host stays in the job running no ranks (its launchpad
    keeps the rendezvous store the groups re-form through) and is drained once the job ends
    COMPLETED, bit-identical; nothing is moved off it a second time."""
    job = training(devcluster, tp_config, workdir, torchpassd)
    host = devcluster.job_record(job.job)["BatchHost"]
    ranks = sorted(w["rank"] for w in torchpassd.job(job.job)["launchpads"][host]["workers"])
    devcluster.drain(host, "planned maintenance")
    mig = torchpassd.wait_migration(job.job, host)
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    handed = next(p for p in mig["phases"] if p["phase"] == "handed_over")
    assert sorted(handed["detail"]["ranks"]) == ranks and ranks, handed
    released = next(p for p in mig["phases"] if p["phase"] == "released")
    assert released["detail"]["kept_in_job"] is True, released
    in_job = devcluster.job_record(job.job)["NodeList"]
    assert host in hostlist.expand(in_job) and "n5" in hostlist.expand(in_job), in_job
    wait_until(f"{host}'s launchpad to report no ranks",
               lambda: torchpassd.job(job.job)["launchpads"][host]["workers"] == [], 30)
    assert_bit_identical(job.wait_done(), reference(STEPS))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert "drain" in devcluster.node_state(host)  # out of the job now: the operator can service it
    assert len(torchpassd.migrations(job.job)) == 1
