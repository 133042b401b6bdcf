"""Broker authentication and ACLs on a real mosquitto set up by torchpassd.broker_auth: no anonymous
access, a job's account reads and writes only its own subtree, an ended job's account is gone, and
TLS with a self-made CA (the client verifies the broker)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ssl
import subprocess
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from tests.support.broker import Mosquitto
from torchpass_common import mqtt, protocol
from torchpassd.broker_auth import BrokerAdmin, BrokerAuthError

pytestmark = [pytest.mark.mqtt, pytest.mark.security, pytest.mark.timeout(120)]


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on its own event loop, bounded."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 90))
    return wrapper


def _client(broker: Mosquitto, creds: tuple[str, str] | None, *, tls: ssl.SSLContext | None = None,
            name: str = "t") -> aiomqtt.Client:
    user, password = creds or (None, None)
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
async def test_anonymous_and_wrong_password_refused(secure_mosquitto: Mosquitto, tmp_path: Path) -> None:
    admin = BrokerAdmin(secure_mosquitto.config(), tmp_path / "secret")
    user, _ = await admin.ensure_job("7")
    for creds in (None, (user, "wrong"), ("nobody", "x")):
        with pytest.raises(aiomqtt.MqttError, match="[Nn]ot authori[sz]ed|[Bb]ad user"):
            async with _client(secure_mosquitto, creds):
                pass


@sync
async def test_job_account_confined_to_its_subtree(secure_mosquitto: Mosquitto, tmp_path: Path) -> None:
    admin = BrokerAdmin(secure_mosquitto.config(), tmp_path / "secret")
    creds_a, creds_b = await admin.ensure_job("11"), await admin.ensure_job("12")
    assert creds_a != creds_b and sorted(await admin.list_clients()) == ["torchpassd", "tp-job-11", "tp-job-12"]
    a_cmd, a_hb = protocol.cmd_topic("11", "n1"), protocol.hb_topic("11", "n1")
    async with _client(secure_mosquitto, (admin.cfg.username, admin.cfg.password_file and
                                          Path(admin.cfg.password_file).read_text().strip()), name="adm") as adm, \
            _client(secure_mosquitto, creds_a, name="a") as a, _client(secure_mosquitto, creds_b, name="b") as b:
        await adm.subscribe(protocol.job_filter("11"), qos=1)
        await a.subscribe(a_cmd, qos=1)
        await b.subscribe(a_cmd, qos=1)  # the broker answers "not authorised" for this filter
        await b.subscribe("#", qos=1)
        await b.subscribe(protocol.nodes_filter(protocol.HEARTBEAT), qos=1)
        # B publishes into A's subtree: dropped by the broker (A's and the admin's views stay empty).
        await b.publish(a_hb, _payload("11", "n1"), qos=1)
        await b.publish(a_cmd, b"forged", qos=1)
        # A and the admin use A's subtree normally; B sees none of it.
        await a.publish(a_hb, _payload("11", "n1"), qos=1)
        await adm.publish(a_cmd, b"for a", qos=1)
        got_a, got_b, got_adm = await asyncio.gather(_received(a, 1.5), _received(b, 1.5), _received(adm, 1.5))
    assert got_a == [a_cmd], got_a
    assert got_b == [], f"job 12's account read job 11's topics: {got_b}"
    assert sorted(got_adm) == sorted([a_hb, a_cmd]), got_adm  # its own hb and its own cmd; B's two were dropped
    # A's account may not publish outside its subtree either (B's topics, the plugin's control topic).
    async with _client(secure_mosquitto, creds_b, name="b2") as b2, _client(secure_mosquitto, creds_a, name="a2") as a2:
        await b2.subscribe(protocol.job_filter("12"), qos=1)
        await a2.publish(protocol.hb_topic("12", "n9"), _payload("12", "n9"), qos=1)
        await a2.publish("$CONTROL/dynamic-security/v1", b'{"commands":[{"command":"deleteClient","username":"tp-job-12"}]}')
        assert await _received(b2, 1.0) == []
    assert "tp-job-12" in await admin.list_clients()


@sync
async def test_ended_job_account_is_removed_and_kicked(secure_mosquitto: Mosquitto, tmp_path: Path) -> None:
    admin = BrokerAdmin(secure_mosquitto.config(), tmp_path / "secret")
    creds = await admin.ensure_job("21")
    again = await BrokerAdmin(secure_mosquitto.config(), tmp_path / "secret").ensure_job("21")
    assert again == creds  # a restarted torchpassd derives the same password; re-creating is harmless
    async with mqtt.ControlClient(secure_mosquitto.config(), "lp-21", credentials=creds) as lp:
        await lp.wait_connected(10)
        await admin.ensure_job("21")  # another launchpad of the job asks: this one stays connected
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
        async with _client(secure_mosquitto, creds):
            pass
    assert "tp-job-21" not in await admin.list_clients()


@sync
async def test_accounts_of_jobs_that_ended_meanwhile_are_swept(secure_mosquitto: Mosquitto, tmp_path: Path) -> None:
    """A torchpassd that was down when jobs ended removes their accounts when it starts again (it
    asks Slurm about every job account the broker holds); running jobs' accounts stay usable."""
    admin = BrokerAdmin(secure_mosquitto.config(), tmp_path / "secret")
    for job in ("31", "32", "33"):
        await admin.ensure_job(job)

    async def running(job: str) -> bool:
        return job == "32"
    assert sorted(await admin.sweep(running)) == ["31", "33"]
    clients = await admin.list_clients()
    assert "tp-job-32" in clients and "tp-job-31" not in clients and "tp-job-33" not in clients
    async with _client(secure_mosquitto, (admin.username("32"), admin.password("32"))):
        pass  # the running job's launchpads still get in

    async def slurm_unreachable(job: str) -> bool:
        raise BrokerAuthError("stand-in for a Slurm error")
    with pytest.raises(BrokerAuthError):
        await admin.sweep(slurm_unreachable)
    assert "tp-job-32" in await admin.list_clients(), "nothing is removed when Slurm cannot say"


@sync
async def test_admin_calls_fail_clearly_without_the_plugin(mosquitto: Mosquitto, tmp_path: Path) -> None:
    cfg = dataclasses.replace(mosquitto.config(), username="torchpassd", password_file=str(tmp_path / "pw"))
    (tmp_path / "pw").write_text("x\n")
    with pytest.raises(BrokerAuthError, match="dynamic security plugin did not answer"):
        await BrokerAdmin(cfg, tmp_path / "secret").ensure_job("1")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-made CA (certificate, key) in ``d``."""
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(crt))
    return crt, key


def make_server_cert(d: Path, ca: tuple[Path, Path], ip: str) -> tuple[Path, Path]:
    key, csr, crt, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "san.ext"
    ext.write_text(f"subjectAltName=IP:{ip},DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=broker", "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-extfile", str(ext), "-out", str(crt))
    return crt, key


@sync
async def test_tls_listener_with_self_made_ca(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, other_ca = make_ca(certs, "torchpass-ca"), make_ca(certs, "stranger-ca")
    crt, key = make_server_cert(certs, ca, "127.0.0.1")
    for p in (certs / "server.key", crt, ca[0]):
        p.chmod(0o644)  # mosquitto drops to user mosquitto when started as root
    with Mosquitto(tmp_path / "mosquitto", auth=True, tls=(str(ca[0]), str(crt), str(key))) as broker:
        cfg = broker.config()
        creds = await BrokerAdmin(cfg, tmp_path / "secret").ensure_job("31")  # the admin over TLS
        async with mqtt.ControlClient(cfg, "lp-31", credentials=creds) as lp:
            await lp.wait_connected(10)
            await lp.publish(protocol.hb_topic("31", "n1"), _payload("31", "n1"), timeout=5)
        # A client that trusts another CA refuses the broker (it never sends its password).
        wrong = ssl.create_default_context(cafile=str(other_ca[0]))
        with pytest.raises(aiomqtt.MqttError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            async with _client(broker, creds, tls=wrong):
                pass
        # Plain MQTT on the TLS listener gets nowhere.
        with pytest.raises(aiomqtt.MqttError):
            async with _client(broker, creds):
                pass
