"""mqtt.ControlClient against a real private mosquitto: round trip, Last Will on SIGKILL,
reconnect and re-announce after a broker restart, publishing through an outage, and hostile
payloads dropped with a logged event while valid traffic keeps flowing."""

from __future__ import annotations

import asyncio
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import structlog

from torchpass_common import log, protocol
from torchpass_common.mqtt import BrokerUnavailableError, ControlClient
from torchpassd.broker_auth import BrokerAdmin

pytestmark = [pytest.mark.mqtt, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]
JOB, NODE = "4242", "n1"
STARTED = 1_700_004_242  # the job's start time, which its broker password is bound to


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


def state(online: bool) -> bytes:
    return protocol.encode("state", job=JOB, gen=0, body={"node": NODE, "online": online})


def heartbeat(seq: int) -> bytes:
    return protocol.encode("heartbeat", job=JOB, gen=1,
                           body={"node": NODE, "seq": seq, "workers": [{"rank": 0, "step": seq, "state": "run"}]})


async def next_message(client: ControlClient, timeout: float = 10) -> tuple[str, protocol.Message]:
    return await asyncio.wait_for(anext(aiter(client.messages())), timeout)


def test_publish_subscribe_round_trip(mosquitto):
    async def scenario() -> None:
        async with ControlClient(mosquitto.config(), "orch") as orch, ControlClient(mosquitto.config(), "lp") as lp:
            await orch.wait_connected(10)
            await orch.subscribe(protocol.job_filter(JOB))
            await lp.wait_connected(10)
            await lp.publish(protocol.hb_topic(JOB, NODE), heartbeat(5))
            topic, msg = await next_message(orch)
            assert topic == protocol.hb_topic(JOB, NODE)
            assert (msg.kind, msg.job, msg.gen, msg.body["seq"]) == ("heartbeat", JOB, 1, 5)
            event = {"event": "node.drain_seen", "node": "n3"}  # events may name any node
            await lp.publish(protocol.events_topic(JOB), protocol.encode("event", job=JOB, gen=1, body=event))
            topic, msg = await next_message(orch)
            assert (topic, msg.body) == (protocol.events_topic(JOB), event)
    run(scenario())


CHILD = """
import asyncio, sys
from torchpass_common import protocol
from torchpass_common.config import BrokerConfig
from torchpass_common.mqtt import ControlClient
port, job, node, ca, user, password = int(sys.argv[1]), *sys.argv[2:7]
topic = protocol.state_topic(job, node)
def state(online):
    return protocol.encode("state", job=job, gen=0, body={"node": node, "online": online})
async def announce(client):
    await client.publish(topic, state(True), retain=True)
async def main():
    cfg = BrokerConfig(host="127.0.0.1", port=port, keepalive=5, tls_ca=ca)
    async with ControlClient(cfg, "lp-" + node, will=(topic, state(False)), on_connect=announce,
                             credentials=(user, password)) as c:
        await c.wait_connected(10)
        print("ready", flush=True)
        await asyncio.sleep(120)
asyncio.run(main())
"""


def job_account(mosquitto, tmp_path: Path) -> tuple[str, str]:
    """The broker account torchpassd gives job JOB (what its launchpads publish with)."""
    return run(BrokerAdmin(mosquitto.config(), tmp_path / "secret").ensure_job(JOB, STARTED))


def test_last_will_reports_a_killed_client_offline(mosquitto, tmp_path):
    user, password = job_account(mosquitto, tmp_path)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mosquitto.port), JOB, NODE, mosquitto.tls_ca,
                              user, password], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        async def scenario() -> float:
            async with ControlClient(mosquitto.config(), "orch") as orch:
                await orch.wait_connected(10)
                await orch.subscribe(protocol.state_topic(JOB, NODE))
                _, msg = await next_message(orch, 30)  # the child's retained online announcement
                assert msg.body["online"] is True
                killed = time.monotonic()
                child.send_signal(signal.SIGKILL)
                _, msg = await next_message(orch, 10)
                assert msg.body == {"node": NODE, "online": False}
                return time.monotonic() - killed
        delay = run(scenario(), 45)
        print(f"last will delay after SIGKILL: {delay * 1000:.1f} ms")
        assert delay < 2.0  # measured ~3 ms on loopback; keepalive plays no part after a kill

        async def late_reader() -> protocol.Message:  # the will is retained for tools that come later
            async with ControlClient(mosquitto.config(), "late") as late:
                await late.wait_connected(10)
                await late.subscribe(protocol.state_topic(JOB, NODE))
                return (await next_message(late))[1]
        assert run(late_reader()).body["online"] is False
    finally:
        child.kill()
        child.wait(timeout=10)


def test_clients_reconnect_and_reannounce_after_broker_restart(mosquitto):
    async def scenario() -> None:
        async def announce(client: ControlClient) -> None:
            await client.publish(protocol.state_topic(JOB, NODE), state(True), retain=True)

        async with ControlClient(mosquitto.config(), "orch") as orch, \
                ControlClient(mosquitto.config(), "lp", on_connect=announce) as lp:
            await orch.subscribe(protocol.job_filter(JOB))
            await orch.wait_connected(10)
            _, msg = await next_message(orch)
            assert msg.kind == "state" and msg.body["online"]

            await asyncio.get_running_loop().run_in_executor(None, mosquitto.restart)
            # No persistence: the broker forgot the retained state; lp's on_connect re-announces it
            # and orch's subscription is restored without the caller doing anything.
            _, msg = await next_message(orch, 20)
            assert msg.kind == "state" and msg.body["online"]
            await lp.publish(protocol.hb_topic(JOB, NODE), heartbeat(9))
            _, msg = await next_message(orch)
            assert msg.kind == "heartbeat" and msg.body["seq"] == 9
            assert (orch.connects, lp.connects) == (2, 2)
    run(scenario(), 45)


def test_publish_waits_out_a_short_outage_and_fails_clearly_on_a_long_one(mosquitto):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with ControlClient(mosquitto.config(), "lp") as lp:
            await lp.wait_connected(10)
            await loop.run_in_executor(None, mosquitto.stop)
            with pytest.raises(BrokerUnavailableError, match="MQTT broker 127.0.0.1"):
                await lp.publish(protocol.hb_topic(JOB, NODE), heartbeat(1), timeout=0.5)
            pending = asyncio.create_task(lp.publish(protocol.hb_topic(JOB, NODE), heartbeat(2), timeout=20))
            await loop.run_in_executor(None, mosquitto.start)
            await pending
            assert lp.connected
    run(scenario(), 45)


BODIES = {"heartbeat": {"node": NODE, "seq": 3, "workers": []}, "state": {"node": NODE, "online": True},
          "command": {"cmd": "pause", "migration": "m1", "args": {}},
          "ack": {"node": NODE, "command_id": "c1", "cmd": "pause", "migration": "m1", "ok": True, "error": None,
                  "result": {}},
          "event": {"event": "migration.started"}}
TOPICS = {"heartbeat": protocol.hb_topic(JOB, NODE), "state": protocol.state_topic(JOB, NODE),
          "command": protocol.cmd_topic(JOB, NODE), "ack": protocol.ack_topic(JOB, NODE),
          "event": protocol.events_topic(JOB)}


@pytest.mark.security
@pytest.mark.parametrize("kind", sorted(TOPICS))
def test_hostile_payloads_are_dropped_and_logged_while_valid_ones_flow(mosquitto, tmp_path, kind):
    """On every topic torchpassd or a launchpad reads, sent with job JOB's own account (a job's user
    is the one who can reach its topics): garbage, an oversized payload, the right kind for another
    job, and another kind are each dropped and logged; the valid message after them arrives."""
    log.setup("info")
    user, password = job_account(mosquitto, tmp_path)
    topic, other = TOPICS[kind], "state" if kind != "state" else "heartbeat"
    hostile = [b"not msgpack \xc1", b"\x91" * (protocol.MAX_MESSAGE_BYTES + 1),
               protocol.encode(kind, job="other", gen=1, body=BODIES[kind]),
               protocol.encode(other, job=JOB, gen=1, body=BODIES[other])]
    valid = protocol.encode(kind, job=JOB, gen=7, body=BODIES[kind])

    async def scenario() -> protocol.Message:
        async with ControlClient(mosquitto.config(), "orch") as orch:
            await orch.wait_connected(10)
            await orch.subscribe(topic)
            async with aiomqtt.Client(mosquitto.host, mosquitto.port, identifier="job-user", username=user,
                                      password=password,
                                      tls_context=ssl.create_default_context(cafile=mosquitto.tls_ca)) as raw:
                for payload in [*hostile, valid]:
                    await raw.publish(topic, payload, qos=1)
            return (await next_message(orch))[1]

    with structlog.testing.capture_logs() as logs:
        msg = run(scenario())
    assert (msg.kind, msg.gen) == (kind, 7)  # the first message to come through is the valid one
    rejected = [e for e in logs if e["event"] == "mqtt.message_rejected"]
    assert [e["size"] for e in rejected] == [len(p) for p in hostile]
    reasons = [e["reason"] for e in rejected]
    assert "not valid msgpack" in reasons[0]
    assert "exceeds the limit" in reasons[1]
    assert f"{kind} message of job other" in reasons[2] and f"arrived on topic {topic}" in reasons[2]
    assert f"{other} message of job {JOB}" in reasons[3]
