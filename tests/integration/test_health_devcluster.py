"""GPU health end to end on the dev cluster (real Slurm, real mosquitto, real torchpassd): one
node's launchpad replays a degrading GPU (corrected ECC climbing, then XID 79, then the GPU lost)
through the fake NVML; torchpassd drains that node in Slurm with a reason naming the XID, the
planned migration moves its rank to the spare, and training stays bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launchpad.telemetry.sampler import REPLAY_ENV
from tests.e2e.conftest import (  # noqa: F401 - pytest fixtures shared with the e2e tests
    Daemon,
    Training,
    assert_bit_identical,
    e2e_dir,
    reference,
    torchpassd,
    tp_config,
    wait_until,
)
from tests.support.devcluster import DevCluster

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS, STEP_SLEEP = 240, 0.15
VICTIM = "n3"  # not the batch host (n1) nor the spare (n5)
REASON = "torchpass: GPU0 XID 79 (fell off the bus)"


def test_a_degrading_gpu_drains_its_node_and_the_rank_moves_first(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, e2e_dir: Path,  # noqa: F811
        reference, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001, F811 - fixture factory
    workdir = e2e_dir / "health-degrading"
    workdir.mkdir(mode=0o755, exist_ok=True)
    (workdir / "train.log").unlink(missing_ok=True)
    config = workdir / "torchpass.toml"  # the cluster's config, launchpads sampling every second
    config.write_text(tp_config.read_text() + "[health]\nsample_interval = 1.0\n")
    monkeypatch.setitem(devcluster.env, REPLAY_ENV, f"{VICTIM}={ROOT / 'contrib' / 'health' / 'degrading.json'}")
    try:
        job = Training(devcluster, config, workdir, steps=STEPS, step_sleep=STEP_SLEEP)
        job.wait_running(torchpassd, min_step=1)

        wait_until(f"{VICTIM} drained by torchpassd", lambda: devcluster.node_state(VICTIM) in ("draining", "drained"),
                   timeout=60)
        nodes = subprocess.run([str(Path(sys.executable).parent / "torchpassctl"), "--config", str(tp_config),
                                "nodes", "--json"], capture_output=True, text=True, timeout=60, check=True)
        row = next(n for n in json.loads(nodes.stdout)["nodes"] if n["node"] == VICTIM)
        assert row["reason"] == REASON, row

        health = torchpassd.call("health")
        assert health[VICTIM]["decision"]["reason"] == REASON
        assert health[VICTIM]["decision"]["signal"] == "xid"
        assert all(d["decision"] is None for n, d in health.items() if n != VICTIM)  # no NVML there: nothing

        mig = torchpassd.wait_migration(job.job, VICTIM)
        assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
        assert REASON in mig["reason"]
        assert_bit_identical(job.wait_done(), reference(STEPS))
    finally:
        devcluster.resume(VICTIM)
