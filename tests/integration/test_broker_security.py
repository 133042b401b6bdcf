"""Broker authentication and ACLs on a real mosquitto set up by torchpassd.broker_auth: no anonymous
access, a job's account reads and writes only its own subtree, an ended job's account is gone, and
TLS with a self-made CA (the client verifies the broker)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import structlog

from tests.support.broker import Mosquitto
from tests.support.devcluster import DevCluster
from torchpass_common import mqtt, protocol
from torchpass_common.broker_check import admits_anonymous, require_secure
from torchpass_common.config import BrokerConfig
from torchpass_common.errors import ConfigError
from torchpassd.broker_auth import BrokerAdmin, BrokerAuthError
from torchpassd.broker_tls import make_broker_tls

pytestmark = [pytest.mark.mqtt, pytest.mark.security, pytest.mark.timeout(120)]
STARTED = 1_700_000_000  # the jobs' start time (Slurm's), which their passwords are bound to


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on its own event loop, bounded."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 90))
    return wrapper


def _client(broker: Mosquitto | BrokerConfig, creds: tuple[str, str] | None, *, tls: ssl.SSLContext | None = None,
            plain: bool = False, name: str = "t") -> aiomqtt.Client:
    """A raw client; it trusts the broker's own CA unless given ``tls`` or told ``plain``."""
    user, password = creds or (None, None)
    if tls is None and not plain:
        tls = ssl.create_default_context(cafile=broker.tls_ca)
    return aiomqtt.Client(broker.host, broker.port, username=user, password=password, identifier=name,
                          tls_context=tls, timeout=5)


async def _received(client: aiomqtt.Client, within: float) -> list[str]:
    got: list[str] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            async for m in client.messages:
                got.append(str(m.topic))
    return got


def _payload(job: str, node: str) -> bytes:
    return protocol.encode(protocol.HEARTBEAT, job=job, gen=1, body={"node": node, "seq": 1, "workers": []})


@sync
async def test_anonymous_and_wrong_password_refused(mosquitto: Mosquitto, tmp_path: Path) -> None:
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    user, _ = await admin.ensure_job("7", STARTED)
    for creds in (None, (user, "wrong"), ("nobody", "x")):
        with pytest.raises(aiomqtt.MqttError, match="[Nn]ot authori[sz]ed|[Bb]ad user"):
            async with _client(mosquitto, creds):
                pass


@sync
async def test_an_oversize_packet_gets_its_sender_disconnected_and_nothing_delivered(
        mosquitto: Mosquitto, tmp_path: Path) -> None:
    """The broker bounds what one client may send (max_packet_size): a job's account publishing
    half a megabyte on its own topic is cut off; a reader of that topic gets nothing."""
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    creds = await admin.ensure_job("8", STARTED)
    async with _client(mosquitto, creds, name="reader-8") as reader:
        await reader.subscribe(protocol.job_filter("8"), qos=1)
        with pytest.raises(aiomqtt.MqttError):
            async with _client(mosquitto, creds, name="big-8") as big:
                await big.publish(protocol.hb_topic("8", "n1"), b"x" * (512 * 1024), qos=1, timeout=5)
                await big.publish(protocol.hb_topic("8", "n1"), b"y", qos=1, timeout=5)  # the link is gone
        assert await _received(reader, 1.0) == []


@sync
async def test_job_account_confined_to_its_subtree(mosquitto: Mosquitto, tmp_path: Path) -> None:
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    await confined(mosquitto, admin, "11", "12")
    assert sorted(await admin.list_clients()) == ["torchpassd", "tp-job-11", "tp-job-12"]


@sync
@pytest.mark.slurm
async def test_job_accounts_are_confined_on_the_dev_clusters_broker(devcluster: DevCluster, tmp_path: Path) -> None:
    """The same attack on the broker every e2e test and the demo use (TLS, torchpassd's account)."""
    cfg = BrokerConfig(**devcluster.info["broker"])
    admin = BrokerAdmin(cfg, tmp_path / "secret")
    try:
        await confined(cfg, admin, "900011", "900012")
    finally:
        for job in ("900011", "900012"):
            await admin.remove_job(job)


async def confined(broker: Mosquitto | BrokerConfig, admin: BrokerAdmin, job_a: str, job_b: str) -> None:
    """Job B's account reads nothing of job A's subtree and its publications there are dropped; A's
    account cannot publish into B's subtree or command the security plugin."""
    creds_a, creds_b = await admin.ensure_job(job_a, STARTED), await admin.ensure_job(job_b, STARTED)
    assert creds_a != creds_b
    a_cmd, a_hb = protocol.cmd_topic(job_a, "n1"), protocol.hb_topic(job_a, "n1")
    async with _client(broker, (admin.cfg.username, admin.cfg.password_file and
                                          Path(admin.cfg.password_file).read_text().strip()), name="adm") as adm, \
            _client(broker, creds_a, name="a") as a, _client(broker, creds_b, name="b") as b:
        await adm.subscribe(protocol.job_filter(job_a), qos=1)
        await a.subscribe(a_cmd, qos=1)
        await b.subscribe(a_cmd, qos=1)  # the broker answers "not authorised" for this filter
        await b.subscribe("#", qos=1)
        await b.subscribe(protocol.nodes_filter(protocol.HEARTBEAT), qos=1)
        # B publishes into A's subtree: dropped by the broker (A's and the admin's views stay empty).
        await b.publish(a_hb, _payload(job_a, "n1"), qos=1)
        await b.publish(a_cmd, b"forged", qos=1)
        # A and the admin use A's subtree normally; B sees none of it.
        await a.publish(a_hb, _payload(job_a, "n1"), qos=1)
        await adm.publish(a_cmd, b"for a", qos=1)
        got_a, got_b, got_adm = await asyncio.gather(_received(a, 1.5), _received(b, 1.5), _received(adm, 1.5))
    assert got_a == [a_cmd], got_a
    assert got_b == [], f"job {job_b}'s account read job {job_a}'s topics: {got_b}"
    assert sorted(got_adm) == sorted([a_hb, a_cmd]), got_adm  # its own hb and its own cmd; B's two were dropped
    # A's account may not publish outside its subtree either (B's topics, the plugin's control topic).
    async with _client(broker, creds_b, name="b2") as b2, _client(broker, creds_a, name="a2") as a2:
        await b2.subscribe(protocol.job_filter(job_b), qos=1)
        await a2.publish(protocol.hb_topic(job_b, "n9"), _payload(job_b, "n9"), qos=1)
        await a2.publish("$CONTROL/dynamic-security/v1",
                         json.dumps({"commands": [{"command": "deleteClient", "username": f"tp-job-{job_b}"}]}))
        assert await _received(b2, 1.0) == []
    assert f"tp-job-{job_b}" in await admin.list_clients()


@sync
async def test_ended_job_account_is_removed_and_kicked(mosquitto: Mosquitto, tmp_path: Path) -> None:
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    creds = await admin.ensure_job("21", STARTED)
    again = await BrokerAdmin(mosquitto.config(), tmp_path / "secret").ensure_job("21", STARTED)
    assert again == creds  # a restarted torchpassd derives the same password; re-creating is harmless
    async with mqtt.ControlClient(mosquitto.config(), "lp-21", credentials=creds) as lp:
        await lp.wait_connected(10)
        await admin.ensure_job("21", STARTED)  # another launchpad of the job asks: this one stays connected
        await asyncio.sleep(0.5)
        assert lp.connected and lp.connects == 1
        await admin.remove_job("21")
        for _ in range(100):
            if not lp.connected:
                break
            await asyncio.sleep(0.05)
        assert not lp.connected, "the removed account's session was not disconnected"
    await admin.remove_job("21")  # idempotent
    with pytest.raises(aiomqtt.MqttError):
        async with _client(mosquitto, creds):
            pass
    assert "tp-job-21" not in await admin.list_clients()


@sync
async def test_a_job_id_used_again_gets_new_credentials_and_the_old_ones_stop_working(
        mosquitto: Mosquitto, tmp_path: Path) -> None:
    """Slurm hands out job 41 again (a new cluster database, MaxJobId wrapped) while torchpassd missed
    the first job's end: whoever kept the first job's password neither stays connected nor gets in."""
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    first = await admin.ensure_job("41", STARTED)
    async with mqtt.ControlClient(mosquitto.config(), "lp-41-old", credentials=first) as old:
        await old.wait_connected(10)
        second = await admin.ensure_job("41", STARTED + 3600)
        assert second[0] == first[0] and second[1] != first[1]
        for _ in range(100):
            if not old.connected:
                break
            await asyncio.sleep(0.05)
        assert not old.connected, "the earlier job's session outlived its account"
    with pytest.raises(aiomqtt.MqttError, match="[Nn]ot authori[sz]ed|[Bb]ad user name or password"):
        async with _client(mosquitto, first):
            pass
    async with _client(mosquitto, second):
        pass  # the new job's launchpads get in
    assert await admin.ensure_job("41", STARTED + 3600) == second  # asked again: the same, nobody kicked


@sync
async def test_accounts_of_jobs_that_ended_meanwhile_are_swept(mosquitto: Mosquitto, tmp_path: Path) -> None:
    """A torchpassd that was down when jobs ended removes their accounts when it starts again (it
    asks Slurm about every job account the broker holds); running jobs' accounts stay usable."""
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    for job in ("31", "32", "33"):
        await admin.ensure_job(job, STARTED)

    async def running(job: str) -> bool:
        return job == "32"
    assert sorted(await admin.sweep(running)) == ["31", "33"]
    clients = await admin.list_clients()
    assert "tp-job-32" in clients and "tp-job-31" not in clients and "tp-job-33" not in clients
    async with _client(mosquitto, (admin.username("32"), admin.password("32", STARTED))):
        pass  # the running job's launchpads still get in

    async def slurm_unreachable(job: str) -> bool:
        raise BrokerAuthError("stand-in for a Slurm error")
    with pytest.raises(BrokerAuthError):
        await admin.sweep(slurm_unreachable)
    assert "tp-job-32" in await admin.list_clients(), "nothing is removed when Slurm cannot say"


@sync
async def test_admin_calls_fail_clearly_without_the_plugin(tmp_path: Path) -> None:
    with Mosquitto(tmp_path / "mosquitto", insecure=True) as plain:  # a broker without the plugin
        cfg = dataclasses.replace(plain.config(), username="torchpassd", password_file=str(tmp_path / "pw"))
        (tmp_path / "pw").write_text("x\n")
        with pytest.raises(BrokerAuthError, match="dynamic security plugin did not answer"):
            await BrokerAdmin(cfg, tmp_path / "secret").ensure_job("1", STARTED)


@sync
async def test_tls_listener_with_its_own_ca(mosquitto: Mosquitto, tmp_path: Path) -> None:
    """The broker serves TLS with a certificate from the CA made for it (torchpassd.broker_tls);
    clients verify it: one that trusts another CA, or speaks plain MQTT, gets nowhere."""
    cfg = mosquitto.config()
    assert cfg.tls_ca
    creds = await BrokerAdmin(cfg, tmp_path / "secret").ensure_job("31", STARTED)  # the admin over TLS
    async with mqtt.ControlClient(cfg, "lp-31", credentials=creds) as lp:
        await lp.wait_connected(10)
        await lp.publish(protocol.hb_topic("31", "n1"), _payload("31", "n1"), timeout=5)
    # A client that trusts another CA refuses the broker (it never sends its password).
    stranger = make_broker_tls(tmp_path / "stranger", ["127.0.0.1"], ca_name="stranger-ca")
    wrong = ssl.create_default_context(cafile=str(stranger.ca))
    with pytest.raises(aiomqtt.MqttError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        async with _client(mosquitto, creds, tls=wrong):
            pass
    # Plain MQTT on the TLS listener gets nowhere.
    with pytest.raises(aiomqtt.MqttError):
        async with _client(mosquitto, creds, plain=True):
            pass


@sync
async def test_torchpassd_and_launchpad_refuse_an_open_or_plain_broker(mosquitto: Mosquitto, tmp_path: Path) -> None:
    """A broker that admits anonymous clients over plain MQTT is refused by name, with what to do;
    broker.allow_insecure = true lets it through with a warning at every start; the secure broker
    passes silently."""
    with Mosquitto(tmp_path / "open", insecure=True) as open_broker:
        for who in ("torchpassd", "launchpad on n1"):
            with pytest.raises(ConfigError, match=f"{who} refuses the broker at 127.0.0.1:{open_broker.port}: its "
                                                  "connection is not encrypted .*; it admits anonymous clients"):
                await require_secure(open_broker.config(), who)
        with structlog.testing.capture_logs() as logs:
            await require_secure(dataclasses.replace(open_broker.config(), allow_insecure=True), "torchpassd")
        assert [e["event"] for e in logs] == ["broker.insecure"] and len(logs[0]["problems"]) == 2
    with structlog.testing.capture_logs() as logs:
        await require_secure(mosquitto.config(), "torchpassd")
    assert logs == []
    assert await admits_anonymous(mosquitto.config()) is False
