"""Planned, model-transparent migration end to end on the dev cluster: a job submitted with
``--torchpass=transparent`` trains a DDP tutorial-style script with no TorchPass code under
``srun torchrun``; a drained node's worker process is moved to the spare by criu (pages by criu's
page server, the rest by the wormhole) and training goes on bit-identical to a run without the drain.
Also: a dump that fails (the worker trains on in place), a real criu failure (the site config's
[faults] criu); a restore that fails on the spare is tests/e2e/test_failed_moves.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, assert_bit_identical
from torchpassd import drill_transparent

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 120
STEP_SLEEP = 0.2  # the job must outlast the spare's launchpad start-up, the pause and the move
SCRIPT = drill_transparent.SCRIPT


@pytest.fixture(autouse=True)
def _criu(criu: None) -> None:
    """Every test here needs a working criu (the shared fixture skips with the reason)."""


@pytest.mark.matrix  # CI: the transparent drain of a two-rank node (test_real_jobs.py)
def test_drill_planned_transparent_reports_ok_and_bit_identical(torchpassd: Daemon, tp_config: Path) -> None:
    assert "torchpass" not in SCRIPT.read_text().split('"""', 2)[2].lower()  # its code, past the docstring
    res = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config), "drill",
                          "--mode", "planned-transparent", "--json", "--steps", str(STEPS), "--nodes", "3",
                          "--nproc-per-node", "2", "--step-sleep", str(STEP_SLEEP), "--timeout", "240"],
                         capture_output=True, text=True, timeout=560)
    assert res.stdout.strip(), f"torchpassctl drill printed no report (rc={res.returncode}): {res.stderr[-3000:]}"
    report = json.loads(res.stdout)
    print(json.dumps({k: report[k] for k in ("ok", "pause_s", "detect_s", "lost_steps", "bit_identical", "move")}))
    assert res.returncode == 0, report
    assert report["ok"] and report["bit_identical"] and report["lost_steps"] == 0, report
    assert report["job_state"] == "COMPLETED" and len(report["moved_ranks"]) == 2, report
    assert report["mode"] == "planned-transparent" and report["migrated_to"] == "n5"
    assert report["resumed_at_step"] == report["expected_step"] > 0
    phases = {p["phase"] for p in report["timeline"]}
    assert {"preflight", "handed_over", "reformed", "resumed"} <= phases, report["timeline"]
    moved = report["move"]  # timed separately
    assert moved["dump_s"] > 0 and moved["restore_s"] > 0 and moved["transfer_s"] >= 0, moved
    assert moved["page_bytes"] > 10 * moved["image_bytes"], "memory must travel by the page server"


def _failed_move(fault: str, torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path,
                 reference) -> dict:  # noqa: ANN001 - fixture factory
    site = workdir / "faulty.toml"  # the operator's fault injection: every CRIU dump (or restore) fails
    site.write_text(tp_config.read_text() + f'[faults]\ncriu = "{fault}"\n')
    job = Training(devcluster, site, workdir, steps=STEPS, step_sleep=STEP_SLEEP, script=SCRIPT, mode="transparent")
    job.wait_running(torchpassd)
    devcluster.drain("n3", "planned maintenance")
    mig = torchpassd.wait_migration(job.job, "n3", timeout=240)
    devcluster.resume("n3")
    assert_bit_identical(job.wait_done(), reference(STEPS, SCRIPT))
    return mig


@pytest.mark.faults
def test_failed_dump_leaves_the_worker_training(torchpassd: Daemon, devcluster: DevCluster, tp_config: Path,
                                                workdir: Path, reference) -> None:  # noqa: ANN001
    mig = _failed_move("dump", torchpassd, devcluster, tp_config, workdir, reference)
    assert mig["status"] == "rolled_back" and "criu dump failed" in mig["error"], mig
