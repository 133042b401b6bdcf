"""What ``torchpassctl drill --mode gpu-degrade`` adds to the planned-aware drill: the job's last
node (never the batch host) replays contrib/health/degrading.json through its launchpad's
collector (the FAKE NVML: corrected ECC climbing, then XID 79, then the GPU lost), the training
runs long enough for the replay to reach the XID, and the drill waits for torchpassd's health
policy to drain a node of the job instead of draining one itself, reporting the drain reason."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from launchpad.telemetry.sampler import REPLAY_ENV
from torchpass_common.config import Config
from torchpassd.ctl_client import DaemonClient

MODE = "gpu-degrade"
RECORDING = Path(__file__).resolve().parents[1] / "contrib" / "health" / "degrading.json"
MIGRATION_MARGIN_S = 30.0  # training still running this long after the XID, for the migration


def job_prelude() -> str:
    """Shell lines for the drill's batch script: only the job's last node replays the recording."""
    return (f'export {REPLAY_ENV}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n1)='
            f'{shlex.quote(str(RECORDING))}"\n')


def min_steps(cfg: Config, step_sleep: float) -> int:
    """Training steps that outlast the replay's XID (one recorded step per health sample) plus a
    migration, at ``step_sleep`` seconds per step."""
    steps = json.loads(RECORDING.read_text())["steps"]
    xid_at = next(i for i, s in enumerate(steps) if s.get("xids"))
    return math.ceil((xid_at * cfg.health.sample_interval + MIGRATION_MARGIN_S) / max(step_sleep, 0.01))


def decision(daemon: DaemonClient, job: str) -> tuple[str, str] | None:
    """(node, drain reason) of torchpassd's health decision about a node of ``job``, once taken."""
    for node, health in daemon.call("health").items():
        d = health.get("decision")
        if d and d.get("job") == job:
            return node, d["reason"]
    return None
