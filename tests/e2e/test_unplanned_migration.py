"""Unplanned, model-aware migration end to end on the dev cluster: a node of the training job is
killed (SIGKILL of its slurmd, launchpad and workers) or cut off the network; torchpassd detects
it, rebuilds the lost rank on the spare from a surviving replica, and the job goes on from the
step that failed, bit-identical to a run without the failure. Also: a second node dying during
the recovery (both recovered, two spares), no spare free (the job waits with the survivors parked
and says why, then recovers), and the `fail` policy (the job ends clearly at once)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, reference_log, sacct_state, wait_until
from tests.support.fault_matrix import OK, FaultMatrix
from torchpassd.drill_report import DrillReport
from torchpassd.drill_unplanned import judge

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.faults, pytest.mark.slow]

STEPS = 200
STEP_SLEEP = 0.15
VICTIM, VICTIM_RANK = "n3", 2  # never the batch host (n1); node n<k> runs rank k-1


def _drill(tp_config: Path, mode: str, *shape: str) -> dict:
    res = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config), "drill",
                          "--mode", mode, "--json", "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP),
                          "--timeout", "180", *shape],
                         capture_output=True, text=True, timeout=600)
    assert res.stdout, res.stderr[-2000:]
    report = json.loads(res.stdout)
    assert res.returncode == 0, report
    return report


def _assert_drill_ok(report: dict, fault: str, spares: tuple[str, ...] = ("n5",)) -> None:
    assert report["ok"] and report["bit_identical"] and report["lost_steps"] == 0, report
    assert report["job_state"] == "COMPLETED", report
    assert report["fault"] == fault and report["migrated_to"] in spares, report
    assert report["migrated_from"] not in ("n1", "n5")  # never the batch host
    assert report["resumed_at_step"] == report["expected_step"] > 0, report
    assert report["step_at_kill"] <= report["expected_step"] <= report["step_at_kill"] + 1, report
    phases = [p["phase"] for p in report["timeline"]]
    assert phases[-1] == "released" and "recovered" in phases, phases


def test_drill_unplanned_kill_of_a_two_rank_node_rebuilt_on_the_jobs_hot_spare(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path) -> None:
    """``sbatch -N4 --torchpass-spares=2`` of ``srun torchrun --nnodes $SLURM_NNODES``: two nodes
    train, the last two hold warm standbys; the killed node's ranks are rebuilt on one of those (no
    spare from the pool, no resize), the other ends with the job, which ends COMPLETED. Configured
    as `make demo` configures torchpassd (slurm_conf: a client file including the cluster's), the
    drill still knows the dev cluster by asking slurmctld and kills one node only."""
    slurmds = {n["name"]: n["slurmd_pid"] for n in devcluster.info["nodes"]}
    report = _drill(tp_config, "unplanned", "--nodes", "2", "--nproc-per-node", "2", "--hot-spares", "2")
    _assert_drill_ok(report, "kill", spares=("n3", "n4"))
    assert "spare_added" not in [p["phase"] for p in report["timeline"]], report  # the job was not resized
    others = {node: pid for node, pid in slurmds.items() if node != report["migrated_from"]}
    assert len(others) == len(slurmds) - 1 and all(Path(f"/proc/{pid}").exists() for pid in others.values()), slurmds
    assert len(report["moved_ranks"]) == 2, report
    assert 0 <= report["detect_s"] < 5 and 0 < report["pause_s"] < 90, report  # Last Will: within seconds


def test_drill_unplanned_network_cut_of_a_two_rank_node(torchpassd: Daemon, tp_config: Path) -> None:
    report = _drill(tp_config, "unplanned-cut", "--nodes", "2", "--nproc-per-node", "2")
    _assert_drill_ok(report, "cut")
    assert len(report["moved_ranks"]) == 2, report
    # Heartbeat silence decides a cut (the broker's Last Will comes only after 1.5 x keepalive).
    assert 0 <= report["detect_s"] < 15, report


def _kill_while_training(devcluster: DevCluster, tp_config: Path, workdir: Path, daemon: Daemon) -> tuple[Training, int]:
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP)
    job.wait_running(daemon, min_step=5)
    devcluster.kill_node(VICTIM)
    return job, job.log.stat().st_size


def _parked(daemon: Daemon, job: str) -> list[dict]:
    view = daemon.job(job) or {}
    return [w for n, lp in view.get("launchpads", {}).items() if n != VICTIM for w in lp["workers"]]


def test_no_spare_waits_with_survivors_parked_then_recovers(torchpassd: Daemon, devcluster: DevCluster,
                                                            tp_config: Path, workdir: Path) -> None:
    devcluster.drain("n5", "spare under repair")
    job, offset = _kill_while_training(devcluster, tp_config, workdir, torchpassd)
    dead = wait_until("torchpassd to say why the job waits",
                      lambda: next((d for d in torchpassd.call("status")["dead"] if d["job"] == job.job), None)
                      if "no spare free" in ((torchpassd.job(job.job) or {}).get("blocked") or "") else None, 60)
    assert dead["node"] == VICTIM and dead["ranks"] == [VICTIM_RANK] and dead["evidence"], dead
    assert "n5: drained: spare under repair" in dead["waiting"]
    workers = wait_until("the survivors to park", lambda: (ws := _parked(torchpassd, job.job)) and all(
        w["state"] == "interrupted" for w in ws) and ws, 60)
    assert not torchpassd.migrations(job.job)
    steps = sorted(w["step"] for w in workers)
    devcluster.resume("n5")
    mig = torchpassd.wait_migration(job.job, VICTIM, timeout=180)
    assert mig["status"] == "succeeded" and mig["target"] == "n5" and mig["mode"] == "unplanned-aware", mig
    resumed = next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]
    assert resumed["resumed_at_step"] == max(steps)  # parked, the survivors did not move on
    job.wait_done(timeout=180)
    ref = reference_log(workdir, 4, STEPS)
    rep = DrillReport()
    judge(job.log, ref, VICTIM_RANK, resumed["resumed_at_step"], offset, rep)
    assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep
    assert rep.resumed_at_step == resumed["resumed_at_step"], rep


def test_second_death_during_the_recovery_is_recovered_too(torchpassd: Daemon, devcluster: DevCluster,
                                                           tp_config: Path, workdir: Path,
                                                           fault_matrix: FaultMatrix) -> None:
    devcluster.run("scontrol", "update", "reservationname=torchpass_spares", "nodes=n4,n5")  # two spares
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP, nodes=3)
    job.wait_running(torchpassd, min_step=5)
    devcluster.kill_node("n3")
    offset = job.log.stat().st_size
    torchpassd.wait_phase(job.job, ("spare_chosen", "spare_added", "joiner_ready"), timeout=60)
    with fault_matrix.case("a survivor killed", "unplanned recovery") as cell:
        devcluster.kill_node("n2")  # while the first recovery starts its joiner
        mig = torchpassd.wait_migration(job.job, "n3", timeout=240)
        assert mig["status"] == "succeeded", mig
        chosen = [p["detail"] for p in mig["phases"] if p["phase"] == "spare_chosen"]
        assert [(c["dead"], c["spare"]) for c in chosen] == [("n3", "n4"), ("n2", "n5")], chosen
        failed_step = next(p for p in mig["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]
        job.wait_done(timeout=180)
        ref = reference_log(workdir, 3, STEPS)
        for rank in (1, 2):
            rep = DrillReport()
            judge(job.log, ref, rank, failed_step, offset, rep)
            assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep
            assert rep.resumed_at_step == failed_step, rep
        cell["outcome"] = OK
        cell["detail"] = f"n2 died while n3's rank was seated: both rebuilt (n4, n5) at step {failed_step}; bit-identical"


def test_no_spare_with_fail_policy_ends_the_job_clearly(torchpassd: Daemon, devcluster: DevCluster,
                                                        tp_config: Path, workdir: Path) -> None:
    fail_cfg = tp_config.with_name("torchpass-fail.toml")
    fail_cfg.write_text(tp_config.read_text().replace("metrics_port = 0\n",
                                                      'metrics_port = 0\nunplanned_no_spare = "fail"\n'))
    torchpassd.stop()
    torchpassd.config = fail_cfg
    torchpassd.start()
    devcluster.drain("n5", "spare under repair")
    job, _ = _kill_while_training(devcluster, tp_config, workdir, torchpassd)
    mig = torchpassd.wait_migration(job.job, VICTIM, timeout=120)
    assert mig["status"] == "failed" and "no usable spare" in mig["error"], mig
    devcluster.wait_job_state(job.job, ("COMPLETED", "FAILED", "CANCELLED"), timeout=120)


@pytest.mark.matrix
def test_torchpassd_sigkill_during_a_recovery_then_restart(torchpassd: Daemon, devcluster: DevCluster,
                                                           tp_config: Path, workdir: Path) -> None:
    """torchpassd SIGKILLed while it seats the dead node's rank on the spare, and started again: the
    attempt is recorded as failed by the restart, the survivors stay parked, the failure is decided
    again from the evidence and a new recovery rebuilds the rank; COMPLETED, bit-identical."""
    job, offset = _kill_while_training(devcluster, tp_config, workdir, torchpassd)
    torchpassd.wait_phase(job.job, ("spare_added", "joiner_ready", "interrupted"), timeout=60)
    torchpassd.stop(signal.SIGKILL)
    torchpassd.start()
    first = torchpassd.wait_migration(job.job, VICTIM, timeout=120)
    assert first["status"] == "failed" and "torchpassd restarted" in first["error"], first
    again = torchpassd.wait_migration(job.job, VICTIM, timeout=180, skip=1)
    assert again["status"] == "succeeded" and again["target"] == "n5", again
    resumed = next(p for p in again["phases"] if p["phase"] == "resumed")["detail"]["resumed_at_step"]
    job.wait_done(timeout=240)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    ref = reference_log(workdir, 4, STEPS)
    rep = DrillReport()
    judge(job.log, ref, VICTIM_RANK, resumed, offset, rep)
    assert rep.bit_identical and rep.lost_steps == 0 and rep.error is None, rep
