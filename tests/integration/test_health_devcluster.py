"""GPU health end to end on the dev cluster (real Slurm, real mosquitto, real torchpassd), through
``torchpassctl drill --mode gpu-degrade``: the job's last node replays a degrading GPU (corrected
ECC climbing, then XID 79, then the GPU lost) through the fake NVML; torchpassd drains that node
in Slurm with a reason naming the XID, ``torchpassctl nodes`` shows why and each node's GPU health,
and the planned migration moves the rank to the spare with training bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, install_site_config, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

TORCHPASSCTL = str(Path(sys.executable).parent / "torchpassctl")
VICTIM = "n2"  # the drill degrades the job's last node (n1 is the batch host, n5 the spare)
REASON = "torchpass: GPU0 XID 79 (fell off the bus)"


def test_gpu_degrade_drill_drains_the_node_naming_the_xid_and_migrates_first(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, e2e_dir: Path) -> None:  # noqa: F811
    config = e2e_dir / "health-drill.toml"  # the cluster's config, launchpads sampling every second
    config.write_text(tp_config.read_text() + "[health]\nsample_interval = 1.0\n")
    install_site_config(devcluster, config)  # the file the jobs' launchpads read (plugstack config=)
    ctl = [TORCHPASSCTL, "--config", str(config)]

    def nodes() -> dict[str, dict[str, str]]:
        res = subprocess.run([*ctl, "nodes", "--json"], capture_output=True, text=True, timeout=60, check=True)
        return {n["node"]: n for n in json.loads(res.stdout)["nodes"]}

    drill = subprocess.Popen([*ctl, "drill", "--mode", "gpu-degrade", "--json", "--step-sleep", "0.15",
                              "--nodes", "2", "--nproc-per-node", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the replay goes on after the XID: the GPU is lost two samples later, the node already drained
        rows = wait_until("torchpassctl nodes to show the lost GPU",
                          lambda: (r := nodes())[VICTIM]["gpu"] == "GPU0 not answering" and r, timeout=300, every=1)
        assert rows[VICTIM]["reason"] == REASON and "DRAIN" in rows[VICTIM]["state"], rows[VICTIM]
        assert rows["n1"]["gpu"] == "no NVML"  # this machine's real NVML: absent, said once, nothing else
        out, err = drill.communicate(timeout=600)
    finally:
        if drill.poll() is None:
            drill.kill()
            drill.wait(10)
            devcluster.resume(VICTIM)
    assert out, f"the drill printed no report (exit {drill.returncode}): {err[-3000:]}"
    report = json.loads(out)
    assert drill.returncode == 0, (report, err[-2000:])
    assert (report["mode"], report["drain_reason"], report["migrated_from"], report["migrated_to"]) == \
        ("gpu-degrade", REASON, VICTIM, "n5"), report
    assert report["ok"] and report["bit_identical"] and report["lost_steps"] == 0, report
    assert report["job_state"] == "COMPLETED" and len(report["moved_ranks"]) == 2, report
    assert devcluster.node_state(VICTIM) in ("idle", "mixed", "allocated")  # the drill resumed it
