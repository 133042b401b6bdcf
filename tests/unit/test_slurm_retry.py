"""Transient Slurm API failures cost a retry, not the watcher's poll. The REST backend against a
stand-in slurmrestd on a unix socket that resets connections; one that lasts is a SlurmError naming
the socket and the tries. Any backend's snapshot retries Slurm's transient errors (timeouts,
slurmctld unreachable) and raises the others at once. (The live backends are tested in
tests/integration/test_slurm_adapter.py.)"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_plugin.backends.rest import RETRIES, RestClient
from slurm_plugin.client import SNAPSHOT_TRIES, SlurmClient
from slurm_plugin.model import Job, Node, Reservation
from slurm_plugin.runner import SlurmRunner
from torchpass_common.errors import SlurmError


class ResettingRestd:
    """Answers every GET with ``{}`` (HTTP 200) after resetting the first ``resets`` connections."""

    def __init__(self, path: Path, resets: int) -> None:
        self.resets, self.served = resets, 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                if self.resets > 0:
                    self.resets -= 1  # SO_LINGER 0: close sends a reset, as a dying slurmrestd worker does
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                self.served += 1
                body = json.dumps({"meta": {}, "errors": [], "jobs": []}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))


@pytest.fixture
def restd(tmp_path: Path) -> Iterator[tuple[str, ResettingRestd]]:
    server = ResettingRestd(tmp_path / "rest.sock", resets=0)
    yield f"unix:{tmp_path / 'rest.sock'}", server
    server.sock.close()


def test_a_reset_during_a_poll_is_retried_and_the_answer_returned(restd: tuple[str, ResettingRestd]) -> None:
    url, server = restd
    client = RestClient(url, SlurmRunner())
    server.resets = RETRIES  # every try but the last is reset
    status, doc = client._request(f"/slurm/{client.version}/jobs")
    assert status == 200 and doc["jobs"] == [] and server.resets == 0


def test_a_lasting_reset_is_a_slurm_error_naming_the_socket_and_the_tries(restd: tuple[str, ResettingRestd]) -> None:
    url, server = restd
    client = RestClient(url, SlurmRunner())
    server.resets = RETRIES + 1
    with pytest.raises(SlurmError, match=rf"slurmrestd at {url} did not answer GET .*jobs \({RETRIES + 1} tries\)"):
        client._request(f"/slurm/{client.version}/jobs")


def test_no_slurmrestd_at_all_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SlurmError, match="did not answer GET /slurm/v0.0.42/ping") as err:
        RestClient(f"unix:{tmp_path / 'nothing.sock'}", SlurmRunner())
    assert "slurm.rest_url" in (err.value.hint or "")


class Flaky(SlurmClient):
    """A backend whose node read fails with ``errors`` first, then answers."""

    name = "flaky"

    def __init__(self, errors: list[str]) -> None:
        self.errors, self.reads = list(errors), 0

    def nodes(self) -> dict[str, Node]:
        self.reads += 1
        if self.errors:
            raise SlurmError(self.errors.pop(0))
        return {"n1": Node("n1", "idle", frozenset())}

    def jobs(self) -> dict[int, Job]:
        return {}

    def reservations(self) -> dict[str, Reservation]:
        return {}


def test_a_transient_slurm_failure_costs_a_retry_inside_the_poll() -> None:
    client = Flaky(["`squeue --json` failed (rc=1): slurm_load_jobs error: Socket timed out on send/recv operation",
                    "`sinfo --json` failed (rc=1): Unable to contact slurm controller (connect failure)"])
    assert list(client.snapshot().nodes) == ["n1"] and client.reads == 3


def test_a_lasting_or_a_real_failure_raises() -> None:
    lasting = Flaky(["Socket timed out on send/recv operation"] * SNAPSHOT_TRIES)
    with pytest.raises(SlurmError, match="Socket timed out"):
        lasting.snapshot()
    assert lasting.reads == SNAPSHOT_TRIES
    denied = Flaky(["`sinfo --json` failed (rc=1): Access/permission denied"])
    with pytest.raises(SlurmError, match="permission denied"):
        denied.snapshot()
    assert denied.reads == 1
