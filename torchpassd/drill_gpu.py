"""What ``torchpassctl drill --mode gpu-degrade`` adds to the planned-aware drill: once the job
trains, torchpassd tells the launchpad on the job's last node (never the batch host) to replay
torchpassd/drill_jobs/health/degrading.json instead of sampling its GPUs (the FAKE NVML: corrected ECC climbing,
then XID 79, then the GPU lost; torchpassd's ``health_replay``, fault injection for drills); the
training runs long enough for the replay to reach the XID, and the drill waits for torchpassd's
health policy to drain a node of the job instead of draining one itself, reporting the drain
reason. The job script is the user's: nothing is exported into it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torchpass_common.config import Config
from torchpassd.ctl_client import DaemonClient

MODE = "gpu-degrade"
RECORDING = Path(__file__).resolve().parent / "drill_jobs" / "health" / "degrading.json"
MIGRATION_MARGIN_S = 30.0  # training still running this long after the XID, for the migration


def inject(daemon: DaemonClient, job: str, node: str) -> None:
    """Make ``node``'s launchpad in ``job`` replay the degrading GPU from now on."""
    daemon.call("health_replay", job=job, node=node, recording=json.loads(RECORDING.read_text()),
                source=str(RECORDING))


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
