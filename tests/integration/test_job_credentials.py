"""The munge proof behind per-job broker accounts, with a real munged and a real authenticated
mosquitto: the job's launchpad gets a working account; forged, replayed, foreign-uid, other-job and
not-running-job proofs are refused with a clear reason, and nothing is issued for them."""

from __future__ import annotations

import asyncio
import base64
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_broker_security import sync
from tests.support.broker import Mosquitto
from tests.support.munge import munged  # noqa: F401 - fixture
from torchpass_common import mqtt, protocol
from torchpass_common.job_credentials import BURST, PROOF, CredentialError, CredentialServer, JobFacts, fetch
from torchpassd.broker_auth import BrokerAdmin

pytestmark = [pytest.mark.mqtt, pytest.mark.security, pytest.mark.timeout(120)]
NOBODY = 65534
JOBS = {"100": JobFacts(owner_uid=0, nodes=("na1", "na2"), started=1_700_000_100),
        "200": JobFacts(owner_uid=0, nodes=("nb1",), started=1_700_000_200),
        "300": JobFacts(owner_uid=NOBODY, nodes=("nc1",), started=1_700_000_300)}


class Server:
    """A CredentialServer over JOBS whose issue() records what it handed out."""

    def __init__(self, issue_with: BrokerAdmin | None, munge_socket: str) -> None:
        self.issued: list[str] = []

        async def lookup(job: str) -> JobFacts | None:
            return JOBS.get(job)

        async def issue(job: str, started: int) -> tuple[str, str]:
            self.issued.append(job)
            return await issue_with.issue(job, started) if issue_with else (f"tp-job-{job}", "pw")
        self.srv = CredentialServer("127.0.0.1", 0, lookup, issue, munge_socket=munge_socket)

    async def ask(self, credential: str) -> dict:
        return await self.srv.answer(f'{{"credential": "{credential}"}}\n'.encode())


def proof(job: str, node: str, sock: str, *, uid: int | None = None) -> str:
    """A job proof made by ``uid`` (default: this process's)."""
    pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    return subprocess.run([*pre, "munge", "--socket", sock, "-s", f"{PROOF} job={job} node={node}"],
                          check=True, capture_output=True, text=True, timeout=30).stdout.strip()


@sync
async def test_launchpad_gets_a_working_account(mosquitto: Mosquitto, munged: str, tmp_path: Path) -> None:  # noqa: F811
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    s = Server(admin, munged)
    async with s.srv:
        creds = await fetch(f"127.0.0.1:{s.srv.port}", "100", "na2", munge_socket=munged)
        with pytest.raises(CredentialError, match="node nb1 is not one of job 100's nodes"):
            await fetch(f"127.0.0.1:{s.srv.port}", "100", "nb1", munge_socket=munged)
    assert creds == (admin.username("100"), admin.password("100", JOBS["100"].started)) and s.issued == ["100"]
    async with mqtt.ControlClient(mosquitto.config(), "lp-100", credentials=creds) as lp:
        await lp.wait_connected(10)
        await lp.publish(protocol.hb_topic("100", "na2"), b"x", timeout=5)


@sync
async def test_a_launchpad_starting_during_a_broker_outage_connects_once_it_is_back(
        mosquitto: Mosquitto, munged: str, tmp_path: Path) -> None:  # noqa: F811
    """The broker is down when a job's launchpad asks for its account (a joiner started on a spare
    during a broker restart, a job starting): it gets the job's credentials, not a refusal that
    would end it, and once the broker is back the account is made and the launchpad connects."""
    admin = BrokerAdmin(mosquitto.config(), tmp_path / "secret")
    s = Server(admin, munged)
    mosquitto.stop()
    async with s.srv:
        creds = await fetch(f"127.0.0.1:{s.srv.port}", "200", "nb1", munge_socket=munged)
    assert creds == (admin.username("200"), admin.password("200", JOBS["200"].started))
    try:
        async with mqtt.ControlClient(mosquitto.config(), "lp-200", credentials=creds) as lp:
            await asyncio.sleep(1)
            assert not lp.connected
            await asyncio.get_running_loop().run_in_executor(None, mosquitto.start)
            await lp.wait_connected(60)
            await lp.publish(protocol.hb_topic("200", "nb1"), b"x", timeout=5)
        assert "tp-job-200" in await admin.list_clients()
    finally:
        await admin.close()


@sync
async def test_forged_and_malformed_proofs_refused(munged: str) -> None:  # noqa: F811
    s = Server(None, munged)
    good = proof("100", "na1", munged)
    prefix, body, _ = good.split(":")
    raw = bytearray(base64.b64decode(body))
    raw[len(raw) // 2] ^= 0x01  # one flipped bit inside the MAC-protected part
    forged = f"{prefix}:{base64.b64encode(bytes(raw)).decode()}:"
    for bad, why in ((forged, "munge credential refused: Invalid credential"),
                     ("MUNGE:AAAAnotbase64!!:", "munge credential refused"),
                     ("hello", 'expected {"credential": "MUNGE:..."}')):
        reply = await s.ask(bad)
        assert not reply["ok"] and why in reply["error"], reply
    assert not (await s.srv.answer(b"\xff\xfe not json\n"))["ok"]
    # A proof is only a proof of the payload's job: a plain munge credential is not accepted.
    plain = subprocess.run(["munge", "--socket", munged, "-s", "job=100 node=na1"], check=True,
                           capture_output=True, text=True, timeout=30).stdout.strip()
    reply = await s.ask(plain)
    assert not reply["ok"] and "not a TorchPass job proof" in reply["error"]
    assert (await s.ask(good))["ok"]  # the untouched one is fine
    assert s.issued == ["100"]


@sync
async def test_replayed_proof_refused(munged: str) -> None:  # noqa: F811
    s = Server(None, munged)
    p = proof("100", "na1", munged)
    first, again = await s.ask(p), await s.ask(p)
    assert first["ok"] and not again["ok"] and "Replayed credential" in again["error"], again
    assert s.issued == ["100"]


@sync
async def test_job_a_cannot_get_job_b_credentials(munged: str) -> None:  # noqa: F811
    s = Server(None, munged)
    cases = [
        (proof("200", "na1", munged), "node na1 is not one of job 200's nodes"),   # A's node asks for B
        (proof("300", "nc1", munged), "uid 0 does not own job 300"),                # right node, not the owner
        (proof("100", "na1", munged, uid=NOBODY), "uid 65534 does not own job 100"),  # another user on A's node
        (proof("999", "na1", munged), "job 999 is not a running TorchPass job"),
    ]
    for cred, why in cases:
        reply = await s.ask(cred)
        assert not reply["ok"] and why in reply["error"], reply
    assert s.issued == []
    # The owner of job 300 gets it, and its password is sealed for its uid.
    reply = await s.ask(proof("300", "nc1", munged, uid=NOBODY))
    assert reply["ok"] and reply["username"] == "tp-job-300" and s.issued == ["300"]


@sync
async def test_server_survives_hostile_connections(munged: str) -> None:  # noqa: F811
    s = Server(None, munged)
    async with s.srv:
        for junk in (b"x" * 10000 + b"\n", b"\x00\x01\x02", b"{}\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", s.srv.port)
            writer.write(junk)
            writer.write_eof()
            reply = await asyncio.wait_for(reader.read(), 15)
            writer.close()
            assert reply == b"" or b'"ok":false' in reply, reply
        assert await fetch(f"127.0.0.1:{s.srv.port}", "200", "nb1", munge_socket=munged)
    assert s.issued == ["200"]


@sync
async def test_a_flood_of_requests_from_one_address_is_cut_to_the_rate(munged: str) -> None:  # noqa: F811
    """Each request costs torchpassd two munge calls: one address gets the burst, then at most the
    rate (each refusal counted, the flood logged about once a second); another address (a real
    node's launchpad) is still answered."""
    s = Server(None, munged)
    counted: list[str] = []
    s.srv.refused = counted.append
    line = f'{{"credential": "{proof("200", "nb1", munged)}"}}\n'.encode()
    replies = [await s.srv.answer(line, peer="10.9.9.9") for _ in range(40)]
    limited = ["credential requests a second from 10.9.9.9" in (r.get("error") or "") for r in replies]
    assert limited == [False] * int(BURST) + [True] * (40 - int(BURST))
    assert replies[0]["ok"] and s.issued == ["200"]  # the rest of the burst: refused as replays
    assert counted == ["proof"] * (int(BURST) - 1) + ["rate"] * (40 - int(BURST))
    fresh = f'{{"credential": "{proof("200", "nb1", munged)}"}}\n'.encode()
    assert (await s.srv.answer(fresh, peer="10.9.9.10"))["ok"]
