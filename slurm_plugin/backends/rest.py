"""The slurmrestd backend: the same three reads over Slurm's REST API. ``rest_url`` is
``http://host:port`` (JWT: a token minted with ``scontrol token`` and renewed before it expires,
or $SLURM_JWT) or ``unix:/path/to/socket`` (slurmrestd's local auth: the socket's peer uid).
The API version (v0.0.38 on 22.05 ... v0.0.42) is found by asking slurmrestd, newest first.
Jobs are polled with ``update_time``: an unchanged job list costs a 304 and no parsing."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from slurm_plugin import openapi
from slurm_plugin.client import SlurmClient
from slurm_plugin.model import Job, Node, Reservation
from slurm_plugin.runner import SlurmRunner
from torchpass_common.errors import SlurmError

API_VERSIONS = ("v0.0.42", "v0.0.41", "v0.0.40", "v0.0.39", "v0.0.38")
TOKEN_LIFESPAN = 3600  # seconds; renewed when less than a quarter is left
RETRIES = 3  # a reset or refused connection is tried again this many times ...
RETRY_DELAY = 0.2  # ... after 0.2, 0.4, 0.6 s


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class _Token:
    """A JWT for ``user``: $SLURM_JWT when set, else minted with ``scontrol token`` (root or
    SlurmUser only) and renewed before it runs out."""

    def __init__(self, runner: SlurmRunner, user: str) -> None:
        self.runner, self.user = runner, user
        self.value, self.expires = os.environ.get("SLURM_JWT", ""), float("inf")
        if not self.value:
            self.expires = 0.0
        self.lock = threading.Lock()

    def get(self) -> str:
        with self.lock:
            if time.time() > self.expires - TOKEN_LIFESPAN / 4:
                out = self.runner.run(["scontrol", "token", f"username={self.user}",
                                       f"lifespan={TOKEN_LIFESPAN}"])
                self.value = out.strip().partition("SLURM_JWT=")[2].strip()
                if not self.value:
                    raise SlurmError(f"`scontrol token` printed no token: {out.strip()!r}",
                                     hint="JWT needs AuthAltTypes=auth/jwt in slurm.conf")
                self.expires = time.time() + TOKEN_LIFESPAN
            return self.value


class RestClient(SlurmClient):
    name = "rest"

    def __init__(self, url: str, runner: SlurmRunner, *, user: str = "", timeout: float = 10.0) -> None:
        self.url, self.timeout = url, timeout
        if url.startswith("unix:"):
            self.socket_path, self.token = url[len("unix:"):], None
        else:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise SlurmError(f"slurm.rest_url {url!r} is neither http://HOST:PORT nor unix:/PATH")
            self.socket_path = ""
            self.host, self.port = parts.hostname, parts.port or 6820
            self.user = user or pwd.getpwuid(os.geteuid()).pw_name
            self.token = _Token(runner, self.user)
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self.version = self._discover_version()

    def _connection(self) -> http.client.HTTPConnection:
        if self.socket_path:
            return _UnixHTTPConnection(self.socket_path, self.timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _request(self, path: str) -> tuple[int, dict[str, Any]]:
        """One GET. A connection reset or refused (slurmrestd restarting a worker, measured
        during a slurmd kill) is tried again ``RETRIES`` times: a GET is idempotent, and a
        transient error of the Slurm API must cost a moment, not the caller's poll."""
        tries = 0
        while True:
            tries += 1
            try:
                return self._request_once(path)
            except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError) as exc:
                if tries <= RETRIES:
                    time.sleep(RETRY_DELAY * tries)
                    continue
                error: OSError = exc
            except OSError as exc:
                error = exc
            raise SlurmError(f"slurmrestd at {self.url} did not answer GET {path} "
                             f"({tries} {'try' if tries == 1 else 'tries'}): {error}",
                             hint="is slurmrestd running? see slurm.rest_url") from error

    def _request_once(self, path: str) -> tuple[int, dict[str, Any]]:
        headers = {"Accept": "application/json"}
        if self.token is not None:
            headers["X-SLURM-USER-NAME"] = self.user
            headers["X-SLURM-USER-TOKEN"] = self.token.get()
        conn = self._connection()
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        try:
            doc = json.loads(body) if body else {}
        except ValueError:
            doc = {"errors": [{"error": body[:200].decode(errors="replace")}]}
        return resp.status, doc

    def _discover_version(self) -> str:
        for version in API_VERSIONS:
            status, doc = self._request(f"/slurm/{version}/ping")
            if status == 200:
                return version
            if status in (401, 403):
                raise SlurmError(f"slurmrestd at {self.url} refused us (HTTP {status}): "
                                 f"{'; '.join(openapi.errors(doc)) or 'authentication failure'}",
                                 hint="slurmrestd needs SLURM_JWT=daemon and slurm.conf AuthAltTypes=auth/jwt")
        raise SlurmError(f"slurmrestd at {self.url} serves none of the API versions {', '.join(API_VERSIONS)}")

    def _get(self, what: str, *, cached: bool = False) -> dict[str, Any]:
        """GET one collection. ``cached``: send ``update_time`` so that slurmctld answers
        304 Not Modified when nothing changed (then the previous answer is reused)."""
        path = f"/slurm/{self.version}/{what}"
        last = self._cache.get(what) if cached else None
        asked_at = time.time()
        if last is not None:
            # whole seconds, one back: a change in the second of the last fetch is not missed
            path += f"?update_time={int(last[0]) - 1}"
        status, doc = self._request(path)
        if status == 304 and last is not None:
            return last[1]
        errs = openapi.errors(doc)
        if status != 200 or errs:
            raise SlurmError(f"slurmrestd GET {what} failed (HTTP {status}): {'; '.join(errs) or 'no message'}")
        if cached:
            self._cache[what] = (asked_at, doc)
        return doc

    def nodes(self) -> dict[str, Node]:
        # Not cached: slurmrestd 22.05 answers /nodes?update_time=T with HTTP 500 "Unspecified
        # error" whenever nodes changed but partitions did not (it loads both with T; measured).
        return openapi.nodes(self._get("nodes"))

    def jobs(self) -> dict[int, Job]:
        return openapi.jobs(self._get("jobs", cached=True))

    def reservations(self) -> dict[str, Reservation]:
        return openapi.reservations(self._get("reservations"))
