"""A training script started the way Lightning's SLURMEnvironment, submitit and NeMo-Run start ranks:
one Slurm task a rank (``#SBATCH --ntasks-per-node=N`` and ``srun python slurm_tasks.py SCRIPT ARGS``),
the rank, local rank and world size read from SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS, the store
on the step's first node (MASTER_ADDR and MASTER_PORT, when the job script exports them, win; the port
is Lightning's default otherwise). SCRIPT (a torchrun-style script: ddp_train.py, fsdp_train.py) then
runs as ``__main__`` with ARGS, unchanged: the same seeds give the same losses and parameters as under
torchrun on the same number of ranks."""

from __future__ import annotations

import os
import re
import runpy
import sys


def from_slurm(env: dict[str, str]) -> dict[str, str]:
    """The torch.distributed variables of this task, as SLURMEnvironment computes them."""
    nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    m = re.match(r"([^,\[]+)(?:\[(\d+))?", nodes)
    first = m.group(1) + (m.group(2) or "") if m else "127.0.0.1"
    return {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env["SLURM_LOCALID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "MASTER_ADDR": env.get("MASTER_ADDR", first),
            "MASTER_PORT": env.get("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"][-4:])))}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: srun python slurm_tasks.py SCRIPT [ARGS...]")
    os.environ.update(from_slurm(dict(os.environ)))
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
