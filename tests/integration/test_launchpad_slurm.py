"""launchpad on the real dev cluster: a 2-node job runs `srun launchpad ... train.py` with 2 workers
per node and no node rank, node count or endpoint on the command line (launchpad derives them from
the step's SLURM_* environment); the losses equal those of the same script under torchrun."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import test_launchpad_training as lt
from test_launchpad_training import PYTHON, TorchrunReference, assert_same_training, results, write_script

from tests.support.devcluster import DevCluster

torchrun_reference = lt.torchrun_reference
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 20


def test_two_nodes_two_workers_under_srun_match_torchrun(devcluster: DevCluster, tmp_path: Path,
                                                         torchrun_reference: TorchrunReference) -> None:
    devcluster.reset()
    tmp_path.chmod(0o755)
    script = write_script(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    port = random.randint(30000, 39999)  # on the nodes' own addresses, not this host's
    job = devcluster.sbatch(f"""#!/bin/bash
cd {lt.ROOT}
srun --ntasks-per-node=1 {PYTHON} -m launchpad --nproc-per-node=2 --master-port={port} \\
    {script} {out} {STEPS}
echo "launchpad exit $?"
""", "-N2", "--export", f"ALL,PATH={os.environ['PATH']}")
    devcluster.wait_job_state(job, "COMPLETED", timeout=240)
    text = devcluster.job_output(job)
    assert "launchpad exit 0" in text, text[-3000:]
    got = results(out, 4)
    assert_same_training(got, torchrun_reference(4, STEPS))
    assert sorted(g["env"]["GROUP_RANK"] for g in got) == ["0", "0", "1", "1"]
    assert {g["env"]["TORCHELASTIC_RUN_ID"] for g in got} == {job}
