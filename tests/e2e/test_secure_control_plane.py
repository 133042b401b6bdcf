"""The whole control plane with security on, on the dev cluster: an authenticated broker (dynamic
security), torchpassd as its admin, and launchpads that get their job's own account from torchpassd
with a munge proof. A job trains and migrates through it bit-identically; its account exists only
while the job runs. A job's user forging GPU reports with that account: about a node outside the
job (refused), about its own node while the health policy is off (ignored)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from launchpad.telemetry.collector import Collector
from launchpad.telemetry.encoding import DeltaEncoder
from launchpad.telemetry.replay import ReplayBackend
from slurm_plugin import openapi
from tests.support.devcluster import DevCluster
from tests.support.e2e import ROOT, Daemon, Training, assert_bit_identical, sacct_state, wait_until
from torchpass_common import config, mqtt, protocol
from torchpass_common.config import derive
from torchpassd.broker_auth import BrokerAdmin

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.security, pytest.mark.slow]
STEPS, STEP_SLEEP = 200, 0.25
HEALTH = ROOT / "torchpassd" / "drill_jobs" / "health"


def test_job_trains_and_migrates_with_its_own_broker_account(torchpassd: Daemon, devcluster: DevCluster,
                                                              tp_config: Path, workdir: Path,
                                                              reference) -> None:  # noqa: ANN001 - fixture factory
    """The dev cluster's broker (as every e2e test's) admits no one anonymous and speaks TLS only;
    torchpassd is its admin, and each launchpad gets the job's own account with a munge proof."""
    devcluster.reset()
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=STEP_SLEEP)
    job.wait_running(torchpassd)  # heartbeats of all 4 launchpads reached torchpassd through the ACLs
    admin = BrokerAdmin(config.load(tp_config).broker, Path(config.load(tp_config).orchestrator.state_dir)
                        / "broker-secret")
    assert f"tp-job-{job.job}" in asyncio.run(admin.list_clients())
    issued = [e for e in (json.loads(ln) for ln in torchpassd.log_path.read_text().splitlines()
                          if ln.startswith("{")) if e.get("event") == "credentials.issued" and e.get("job") == job.job]
    assert sorted(e["node"] for e in issued) == ["n1", "n2", "n3", "n4"], issued
    assert _retained_states(tp_config, job.job) == {"n1", "n2", "n3", "n4"}  # online, for a restarted torchpassd
    links = wait_until("the launchpads' link reports", lambda: [lp.get("links") for lp in
                                                                   torchpassd.job(job.job)["launchpads"].values()
                                                                   if lp.get("links")] or None, 30)
    # each node's own two links (management and compute fabric), as seen in its network namespace
    assert all(set(lk) == {"eth0", "eth1"} and all(lk[i]["carrier"] is True for i in lk) for lk in links), links
    devcluster.drain("n3", "planned maintenance")
    mig = torchpassd.wait_migration(job.job, "n3")
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig  # the joiner got an account too
    assert_bit_identical(job.wait_done(), reference(STEPS))
    wait_until("the ended job's account to be removed",
               lambda: f"tp-job-{job.job}" not in asyncio.run(admin.list_clients()), 60, every=1)
    wait_until("the ended job's retained states (n3's, which left, too) to be cleared from the broker",
               lambda: not _retained_states(tp_config, job.job), 60, every=2)


def _retained_states(tp_config: Path, job: str) -> set[str]:
    """The nodes whose state the broker keeps retained for ``job`` (read as torchpassd)."""
    cfg = config.load(tp_config).broker
    username, password, tls = mqtt.broker_credentials(cfg)

    async def read() -> set[str]:
        nodes: set[str] = set()
        async with aiomqtt.Client(cfg.host, cfg.port, username=username, password=password,
                                  tls_context=tls, identifier=f"retained-reader-{job}") as client:
            await client.subscribe(protocol.job_filter(job), qos=1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.5):  # retained messages come at once after the subscription
                    async for message in client.messages:
                        where = protocol.parse_topic(str(message.topic))
                        if message.retain and message.payload and where.kind == protocol.STATE:
                            nodes.add(str(where.node))
        return nodes
    return asyncio.run(read())


def _forged_xid(job: str, node: str, workers: list[dict[str, Any]]) -> bytes:
    """A heartbeat in ``node``'s name carrying GPU telemetry with XID 79 (a keyframe of the
    recorded degrading GPU at its XID sample), as the job's user could publish it."""
    collector = Collector(ReplayBackend.from_file(HEALTH / "degrading.json", start=0.0), node=node)
    assert collector.open()
    sample = [collector.sample() for _ in range(13)][-1]
    assert any(f.get("xid_79") for f in sample["gpus"].values())
    return protocol.encode(protocol.HEARTBEAT, job=job, gen=1,
                           body={"node": node, "seq": 10**6, "workers": workers, "gpu": DeltaEncoder().encode(sample)})


def _publish_as_job(devcluster: DevCluster, cfg: config.Config, job: str, node: str, payload: bytes) -> None:
    """Publish with ``job``'s own broker account, as its user (who can read the password) could."""
    admin = BrokerAdmin(cfg.broker, Path(cfg.orchestrator.state_dir) / "broker-secret")
    started = openapi.jobs(json.loads(devcluster.run("squeue", "--json").stdout))[int(job)].start_time

    async def send() -> None:
        async with mqtt.ControlClient(cfg.broker, f"forger-{job}", credentials=(admin.username(job),
                                                                                  admin.password(job, started))) as c:
            await c.wait_connected(10)
            await c.publish(protocol.hb_topic(job, node), payload, timeout=5)
    asyncio.run(send())


def _refusals(log_path: Path, job: str, node: str) -> list[dict[str, Any]]:
    """torchpassd's refusals of heartbeats about ``node`` sent with ``job``'s account."""
    return [e for e in (json.loads(ln) for ln in log_path.read_text().splitlines() if ln.startswith("{"))
            if e.get("event") == "report.refused" and (e.get("job"), e.get("node"), e.get("kind")) == (job, node, "heartbeat")]


def test_forged_gpu_reports_are_not_acted_on_and_a_true_one_is(torchpassd: Daemon, devcluster: DevCluster,
                                                                 tp_config: Path, workdir: Path,
                                                                 reference) -> None:  # noqa: ANN001 - fixture factory
    """The job's user publishes, with the job's own broker account, an XID 79 heartbeat: for its own
    node while the health policy is off (ignored: the node keeps running the job), then for the
    spare n5, outside the job (refused: n5 stays a free spare). The control: the same report about
    its own node with the policy on drains that node, and the job moves off it to n5 and completes,
    bit-identical."""
    devcluster.reset()
    job = Training(devcluster, tp_config, workdir, steps=STEPS, step_sleep=0.3)
    off = tp_config.with_name("torchpass-health-off.toml")
    off.write_text(derive(tp_config.read_text(), {"health": {"enabled": False}}))
    torchpassd.stop()
    torchpassd.config = off
    torchpassd.start()
    view = job.wait_running(torchpassd)
    cfg = config.load(tp_config)
    workers = view["launchpads"]["n2"]["workers"]
    _publish_as_job(devcluster, cfg, job.job, "n2", _forged_xid(job.job, "n2", workers))
    time.sleep(4)  # several Slurm polls and heartbeats
    assert "drain" not in devcluster.node_state("n2"), "the policy is off: nothing may drain n2"
    assert torchpassd.migrations(job.job) == []

    torchpassd.stop()
    torchpassd.config = tp_config  # the health policy on
    torchpassd.start()
    job.wait_running(torchpassd)
    _publish_as_job(devcluster, cfg, job.job, "n5", _forged_xid(job.job, "n5", []))
    wait_until("the report about n5 to be refused", lambda: _refusals(torchpassd.log_path, job.job, "n5"), 30)
    (refusal,) = _refusals(torchpassd.log_path, job.job, "n5")
    assert refusal["reason"] == "not_in_job" and "not on n5" in refusal["why"], refusal
    time.sleep(2)
    assert "drain" not in devcluster.node_state("n5"), "n5 is not the job's: a forged report must not drain it"

    _publish_as_job(devcluster, cfg, job.job, "n2", _forged_xid(job.job, "n2", workers))  # the control
    mig = torchpassd.wait_migration(job.job, "n2")
    assert mig["status"] == "succeeded" and mig["target"] == "n5", mig
    assert "Reason=torchpass: GPU0 XID 79" in devcluster.run("scontrol", "show", "node", "n2").stdout
    assert_bit_identical(job.wait_done(), reference(STEPS))
    assert sacct_state(devcluster, job.job) == "COMPLETED 0:0"
