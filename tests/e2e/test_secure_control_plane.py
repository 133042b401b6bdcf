"""The whole control plane with security on, on the dev cluster: an authenticated broker (dynamic
security), torchpassd as its admin, and launchpads that get their job's own account from torchpassd
with a munge proof. A job trains and migrates through it bit-identically; its account exists only
while the job runs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.e2e.conftest import Daemon, Training, assert_bit_identical, wait_until
from tests.support.broker import Mosquitto, _free_port
from tests.support.devcluster import DevCluster
from torchpassd.broker_auth import BrokerAdmin

pytestmark = [pytest.mark.slurm, pytest.mark.mqtt, pytest.mark.security, pytest.mark.slow]
STEPS, STEP_SLEEP = 200, 0.25


def secure_configs(tp_config: Path, d: Path, broker: Mosquitto, munge_socket: str) -> tuple[Path, Path]:
    """(torchpassd's config, the launchpads' config): the dev cluster's e2e config with the
    authenticated broker, the credentials endpoint and this test's own state and socket."""
    base = [ln for ln in tp_config.read_text().splitlines()
            if not ln.startswith(("host =", "port =", "state_dir =", "control_socket ="))]
    endpoint = f"{broker.host}:{_free_port(broker.host)}"
    common = "\n".join(base).replace("[broker]", f'[broker]\nhost = "{broker.host}"\nport = {broker.port}').replace(
        "[orchestrator]", f'[orchestrator]\nstate_dir = "{d / "state"}"\ncontrol_socket = "{d / "tpd.sock"}"\n'
                          f'credentials_endpoint = "{endpoint}"\nmunge_socket = "{munge_socket}"') + "\n"
    daemon_cfg, lp_cfg = d / "torchpass.toml", d / "launchpad.toml"
    admin = broker.config()
    daemon_cfg.write_text(common.replace("[broker]", f'[broker]\nusername = "{admin.username}"\n'
                                                      f'password_file = "{admin.password_file}"'))
    lp_cfg.write_text(common)  # no account of its own: launchpads ask torchpassd for the job's
    return daemon_cfg, lp_cfg


def test_job_trains_and_migrates_with_its_own_broker_account(devcluster: DevCluster, tp_config: Path, e2e_dir: Path,
                                                              reference) -> None:  # noqa: ANN001 - fixture factory
    devcluster.reset()
    d = e2e_dir / "secure"
    d.mkdir(mode=0o755, exist_ok=True)
    (d / "train.log").unlink(missing_ok=True)
    munge_socket = str(Path(devcluster.info["state_dir"]) / "munge" / "run" / "munge.socket.2")
    with Mosquitto(d / "broker", auth=True, host=devcluster.info["broker"]["host"]) as broker:
        daemon_cfg, lp_cfg = secure_configs(tp_config, d, broker, munge_socket)
        daemon = Daemon(daemon_cfg, d / "torchpassd.log")
        daemon.start()
        try:
            job = Training(devcluster, lp_cfg, d, steps=STEPS, step_sleep=STEP_SLEEP)
            job.wait_running(daemon)  # heartbeats of all 4 launchpads reached torchpassd through the ACLs
            admin = BrokerAdmin(broker.config(), d / "state" / "broker-secret")
            assert f"tp-job-{job.job}" in asyncio.run(admin.list_clients())
            issued = [e for e in (json.loads(ln) for ln in (d / "torchpassd.log").read_text().splitlines()
                                  if ln.startswith("{")) if e.get("event") == "credentials.issued"]
            assert sorted(e["node"] for e in issued) == ["n1", "n2", "n3", "n4"], issued
            devcluster.drain("n3", "planned maintenance")
            mig = daemon.wait_migration(job.job, "n3")
            assert mig["status"] == "succeeded" and mig["target"] == "n5", mig  # the joiner got an account too
            assert_bit_identical(job.wait_done(), reference(STEPS))
            wait_until("the ended job's account to be removed",
                       lambda: f"tp-job-{job.job}" not in asyncio.run(admin.list_clients()), 60, every=1)
        finally:
            daemon.stop()
            devcluster.reset()
