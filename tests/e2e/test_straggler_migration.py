"""Straggler migration on the dev cluster (issue 23): with ``[straggler] enabled`` in the site's
torchpass.toml, one node's training processes are held to a sliver of a CPU (a cgroup CPU quota, as
a noisy neighbour or a throttled CPU would): every rank's step slows to that node's pace. torchpassd
sees that node's ranks want several times the CPU a step of the others, migrates them to the spare
with the reason "straggler" in the history, and the job's steps are as fast as before the
throttle again; it ends COMPLETED 0:0, bit-identical to an undisturbed run."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from tests.support import cpu_throttle
from tests.support.devcluster import DevCluster
from tests.support.e2e import Daemon, Training, assert_bit_identical, sacct_state, wait_until
from torchpass_common.config import derive

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.slow]

STEPS, STEP_SLEEP = 300, 0.05  # 300: the reference run of test_link_reroute serves both
SLOW_STEPS = 20  # [straggler] steps: how long a node must be slow before it moves
SHARE = 0.02  # of one CPU for the throttled node's workers


def step_times(log: Path, rank: int, after: float = 0.0, before: float = float("inf")) -> list[float]:
    """Seconds between ``rank``'s consecutive step lines logged in (after, before)."""
    times = [rec["t"] for line in log.read_text().splitlines() if line.startswith("{")
             and (rec := json.loads(line)).get("rank") == rank and "t" in rec and after < rec["t"] < before]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_a_throttled_node_is_migrated_as_a_straggler_and_the_job_speeds_up_again(
        torchpassd: Daemon, devcluster: DevCluster, tp_config: Path, workdir: Path, reference) -> None:  # noqa: ANN001
    if why := cpu_throttle.available():
        pytest.skip(why)
    policy = workdir / "straggler.toml"
    policy.write_text(derive(tp_config.read_text(), {"straggler": {"enabled": True, "steps": SLOW_STEPS}}))
    torchpassd.stop()
    torchpassd.config = policy
    torchpassd.start()
    job = Training(devcluster, policy, workdir, steps=STEPS, step_sleep=STEP_SLEEP)
    view = job.wait_running(torchpassd, min_step=20)
    victim = view["launchpads"]["n3"]["workers"][0]
    with cpu_throttle.throttled([victim["pid"]], SHARE) as group:
        throttled_at = time.time()
        mig = torchpassd.wait_migration(job.job, "n3", timeout=180)
        wait_until("the throttled worker to leave n3", lambda: not (group / "cgroup.procs").read_text().split(), 30)
    assert mig["status"] == "succeeded" and mig["target"] == "n5" and mig["mode"] == "planned-aware", mig
    assert mig["reason"].startswith("straggler: the ranks on n3 wanted"), mig["reason"]
    got = job.wait_done(timeout=240)
    before = step_times(job.log, 0, before=throttled_at)
    during = step_times(job.log, 0, after=throttled_at + 1, before=mig["started"])  # until torchpassd decided
    after = step_times(job.log, 0, after=mig["ended"] + 1)
    base = statistics.median(before)
    print(f"step s: before {base:.4f}, throttled {statistics.median(during):.4f}, "
          f"after {statistics.median(after):.4f}")
    assert statistics.median(during) > 1.2 * base, "the throttle did not slow the job: the test shows nothing"
    assert statistics.median(after) <= 1.2 * base
    assert_bit_identical(got, reference(STEPS))
    devcluster.wait_job_state(job.job, ("COMPLETED",), timeout=120)
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
    assert [m["source"] for m in torchpassd.migrations(job.job)] == ["n3"], "one straggler migration only"
