"""Broker authentication and authorisation through mosquitto's dynamic security plugin: the
broker's files (mosquitto.conf fragment, the plugin's JSON with torchpassd's admin client and a
default-deny ACL), and at run time one client + role per job, confined to torchpass/v1/jobs/<job>/#,
created when the job starts and deleted when it ends (over the plugin's $CONTROL topic). A job's
password is derived from a secret in torchpassd's state dir and the job's id and start time, so a
restarted torchpassd agrees, and a job id Slurm uses again gets other credentials."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import pwd
import secrets
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

import aiomqtt
import click

from slurm_plugin import events as ev
from slurm_plugin.client import SlurmClient
from torchpass_common import log, mqtt, protocol
from torchpass_common.config import BrokerConfig, Config
from torchpass_common.errors import ConfigError, TorchPassError
from torchpass_common.job_credentials import CredentialServer, JobFacts
from torchpass_common.tasks import cancel_all
from torchpassd.broker_files import CONTROL_TOPIC, acls, write_broker_files
from torchpassd.broker_tls import make_broker_tls
from torchpassd.metrics import Counter

JOB_PREFIX = "tp-job-"
CALL_TIMEOUT = 10.0


class BrokerAuthError(TorchPassError):
    """The broker's dynamic security plugin refused or did not answer a command."""


class BrokerUnreachableError(BrokerAuthError):
    """The broker did not answer at all (down, restarting, unreachable): worth trying again."""


class BrokerAdmin:
    """torchpassd's side of per-job broker credentials. ``cfg`` must name the admin client
    (username + password_file); ``secret_path`` holds the key job passwords are derived from
    (created 0600 on first use)."""

    def __init__(self, cfg: BrokerConfig, secret_path: str | os.PathLike[str]) -> None:
        if not cfg.username or not cfg.password_file:
            raise ConfigError("per-job broker credentials need torchpassd's own broker account",
                              hint="set broker.username and broker.password_file (python -m torchpassd.broker_auth writes them)")
        self.cfg = cfg
        self._secret = self._load_secret(Path(secret_path))
        self._pending: dict[str, asyncio.Task[None]] = {}  # job -> its account, made when the broker answers
        self.log = log.get()

    @staticmethod
    def _load_secret(path: Path) -> bytes:
        try:
            return bytes.fromhex(path.read_text().strip())
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            key = secrets.token_bytes(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key.hex())
            return key
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the broker credential secret {path}: {exc}",
                              hint="delete it to make a new one (running jobs then need new credentials)") from exc

    @staticmethod
    def username(job: str) -> str:
        return JOB_PREFIX + job

    def password(self, job: str, started: int) -> str:
        """The password of ``job`` started at ``started`` (Slurm's start time, epoch seconds)."""
        return hmac.new(self._secret, f"broker-password:{job}:{started}".encode(), hashlib.sha256).hexdigest()

    async def ensure_job(self, job: str, started: int) -> tuple[str, str]:
        """Create the client and role of ``job`` started at ``started`` unless they exist; returns
        (username, password). The client of this same run is left alone: changing its password
        would make the broker disconnect the job's launchpads (it is derived: the same anyway).
        A client left by an earlier job with the same id (its start time differs) is replaced,
        and the broker disconnects whoever still used it."""
        name, password, text = self.username(job), self.password(job, started), f"TorchPass job {job} started {started}"
        client = {"command": "createClient", "username": name, "password": password, "textName": text,
                  "roles": [{"rolename": name}]}
        reply = await self._call([{"command": "createRole", "rolename": name, "acls": acls(protocol.job_filter(job))},
                                  dict(client)], tolerate=("already exists",))
        if reply[-1].get("error"):
            (existing,) = await self._call([{"command": "getClient", "username": name}])
            held = existing.get("data", {}).get("client", {})
            if held.get("textname", held.get("textName")) != text:  # mosquitto answers "textname"
                await self._call([{"command": "deleteClient", "username": name}, client])
                self.log.warning("broker.job_credentials_replaced", job=job, username=name, started=started,
                                 why="the account was made for an earlier job with the same id")
                return name, password
        self.log.info("broker.job_credentials_created", job=job, username=name, started=started)
        return name, password

    async def issue(self, job: str, started: int) -> tuple[str, str]:
        """``ensure_job``, except that a broker that does not answer (down for a restart) does not
        refuse the job: its credentials are derived, so they are returned at once and the account is
        made in the background once the broker answers. A launchpad started during a broker outage
        (a joiner on a spare, a job starting) then connects when the broker is back instead of exiting."""
        try:
            return await self.ensure_job(job, started)
        except BrokerUnreachableError as exc:
            if job not in self._pending:
                self.log.warning("broker.job_account_deferred", job=job, error=str(exc),
                                 effect="the job's launchpads connect once the broker is back and the account made")
                self._pending[job] = asyncio.create_task(self._ensure_later(job, started))
            return self.username(job), self.password(job, started)

    async def _ensure_later(self, job: str, started: int) -> None:
        delay = 1.0
        try:
            while True:
                await asyncio.sleep(delay)
                try:
                    await self.ensure_job(job, started)
                    return
                except BrokerUnreachableError:
                    delay = min(delay * 2, 30.0)
                except TorchPassError as exc:
                    self.log.error("broker.job_account_failed", job=job, error=str(exc))
                    return
        finally:
            self._pending.pop(job, None)

    async def close(self) -> None:
        """Stop making deferred accounts (torchpassd stopping; its restart makes them on demand)."""
        await cancel_all(list(self._pending.values()))

    async def remove_job(self, job: str) -> None:
        """Delete ``job``'s client (the broker disconnects its sessions) and role; an account still
        waiting for the broker is not made."""
        if task := self._pending.get(job):
            task.cancel()
        name = self.username(job)
        await self._call([{"command": "deleteClient", "username": name},
                          {"command": "deleteRole", "rolename": name}], tolerate=("not found",))
        self.log.info("broker.job_credentials_removed", job=job, username=name)

    async def sweep(self, running: Callable[[str], Awaitable[bool]]) -> list[str]:
        """Remove the accounts of jobs that are no longer ``running`` (they ended while torchpassd
        was down, so no JobEnded removed them); returns those jobs."""
        jobs = [c[len(JOB_PREFIX):] for c in await self.list_clients() if c.startswith(JOB_PREFIX)]
        gone = [job for job in jobs if not await running(job)]
        for job in gone:
            await self.remove_job(job)
        return gone

    async def list_clients(self) -> list[str]:
        reply = await self._call([{"command": "listClients", "verbose": False, "count": -1, "offset": 0}])
        return list(reply[0].get("data", {}).get("clients", []))

    async def _call(self, commands: list[dict[str, Any]], *, tolerate: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        corr = uuid.uuid4().hex
        for i, c in enumerate(commands):
            c["correlationData"] = f"{corr}-{i}"
        username, password, tls = mqtt.broker_credentials(self.cfg)
        try:
            async with asyncio.timeout(CALL_TIMEOUT), aiomqtt.Client(
                    self.cfg.host, self.cfg.port, username=username, password=password, tls_context=tls,
                    identifier=f"torchpassd-admin-{corr[:8]}", timeout=CALL_TIMEOUT) as client:
                await client.subscribe(f"{CONTROL_TOPIC}/response", qos=1)
                await client.publish(CONTROL_TOPIC, json.dumps({"commands": commands}), qos=1)
                async for message in client.messages:
                    reply = json.loads(bytes(message.payload)).get("responses", [])
                    if reply and str(reply[0].get("correlationData", "")).startswith(corr):
                        break
        except (TimeoutError, aiomqtt.MqttError, OSError, ValueError) as exc:
            raise BrokerUnreachableError(f"the broker's dynamic security plugin did not answer {commands[0]['command']}: "
                                  f"{exc or type(exc).__name__}",
                                  hint="check that mosquitto runs with the plugin and broker.username is its admin") from exc
        failed = [r for r in reply if r.get("error") and not any(t in r["error"] for t in tolerate)]
        if failed:
            raise BrokerAuthError(f"the broker refused {failed[0].get('command')}: {failed[0]['error']}",
                                  hint="see mosquitto's log")
        return reply


class JobAccounts:
    """torchpassd's per-job accounts: created on JobStarted, removed on JobEnded, handed to a job's
    launchpads by the job_credentials endpoint after the munge proof checks out against Slurm."""

    def __init__(self, cfg: Config, slurm: SlurmClient, refused: Counter) -> None:
        self.admin = BrokerAdmin(cfg.broker, Path(cfg.orchestrator.state_dir) / "broker-secret")
        self.slurm = slurm
        endpoint = cfg.orchestrator.credentials_endpoint
        try:
            port = int(endpoint.rpartition(":")[2])
        except ValueError:
            raise ConfigError(f"orchestrator.credentials_endpoint must be HOST:PORT, got {endpoint!r}") from None
        self.server = CredentialServer("0.0.0.0", port, self.facts, self.admin.issue,  # noqa: S104 - nodes connect
                                       munge_socket=cfg.orchestrator.munge_socket,
                                       refused=lambda reason: refused.inc(reason=reason))
        self._tasks: set[asyncio.Task[None]] = set()
        self.log = log.get()

    @classmethod
    def from_config(cls, cfg: Config, slurm: SlurmClient, refused: Counter) -> JobAccounts | None:
        """The accounts manager, or None when per-job credentials are off (no credentials_endpoint);
        ``refused`` counts the endpoint's refusals (label ``reason``)."""
        return cls(cfg, slurm, refused) if cfg.orchestrator.credentials_endpoint else None

    async def __aenter__(self) -> Self:
        await self.server.__aenter__()
        task = asyncio.create_task(self._sweep())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return self

    async def _sweep(self) -> None:
        async def running(job: str) -> bool:  # a Slurm error stops the sweep: nothing removed on a guess
            if not job.isdigit():
                return True  # not an account this code made
            rec = await asyncio.to_thread(self.slurm.job, int(job))
            return rec is not None and rec.active
        try:
            if gone := await self.admin.sweep(running):
                self.log.info("broker.stale_accounts_removed", jobs=gone)
        except TorchPassError as exc:
            self.log.error("broker.sweep_failed", error=str(exc))

    async def __aexit__(self, *exc: object) -> None:
        await self.server.__aexit__(*exc)
        await self.admin.close()

    async def facts(self, job: str) -> JobFacts | None:
        """The owner's uid, nodes and start time of a running TorchPass job ``job``, from Slurm
        (None: no such job)."""
        try:
            rec = await asyncio.to_thread(self.slurm.job, int(job))
        except (ValueError, TorchPassError):
            return None
        if rec is None or not rec.active or rec.torchpass is None:
            return None
        name, _, uid = rec.user.partition("(")  # "alice" or "alice(1000)"
        try:
            return JobFacts(int(uid.rstrip(")")) if uid else pwd.getpwnam(name).pw_uid, rec.nodes, rec.start_time)
        except (KeyError, ValueError):
            self.log.warning("credentials.unknown_owner", job=job, user=rec.user)
            return None

    def on_slurm(self, e: ev.SlurmEvent) -> None:
        """Create a started job's account, remove an ended job's, in the background (failures are
        logged; the endpoint creates a missing account on demand)."""
        if isinstance(e, ev.JobStarted | ev.JobEnded):
            task = asyncio.create_task(self._account(e))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _account(self, e: ev.JobStarted | ev.JobEnded) -> None:
        try:
            if isinstance(e, ev.JobStarted):
                await self.admin.issue(str(e.job), e.started)
            elif isinstance(e, ev.JobEnded):
                await self.admin.remove_job(str(e.job))
        except TorchPassError as exc:
            self.log.error("broker.job_account_failed", job=str(e.job), error=str(exc))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--port", type=int, default=1883, show_default=True, help="Port of the broker's listener.")
@click.option("--refuse-plain", "refuse_plain", type=int, default=None, metavar="PORT",
              help="With TLS: also listen on PORT without TLS, refusing every client (\"not authorised\"); "
                   "e.g. --port 8883 --refuse-plain 1883.")
@click.option("--host", default="", help="Address to listen on (default: all).")
@click.option("--admin-user", default="torchpassd", show_default=True, help="torchpassd's broker account.")
@click.option("--broker-user", default="mosquitto", show_default=True, help="User mosquitto runs as.")
@click.option("--tls", nargs=3, type=click.Path(dir_okay=False), default=None, metavar="CA CERT KEY",
              help="Serve TLS with this CA, certificate and key (the site's own PKI).")
@click.option("--tls-for", "tls_for", multiple=True, metavar="ADDR",
              help="Make a private CA and a certificate for this address or name (repeat for each) in "
                   "DIRECTORY/tls and serve TLS with them; clients set broker.tls_ca to DIRECTORY/tls/ca.crt.")
def main(directory: str, port: int, refuse_plain: int | None, host: str, admin_user: str, broker_user: str,
         tls: tuple[str, str, str] | None, tls_for: tuple[str, ...]) -> None:
    """Write an authenticated broker's files into DIRECTORY: mosquitto.conf (include it from
    /etc/mosquitto/conf.d), the dynamic security file, and torchpassd's password file."""
    try:
        if tls_for and not tls:
            tls = make_broker_tls(Path(directory) / "tls", list(tls_for)).as_tuple()
        files = write_broker_files(directory, port=port, host=host, admin_user=admin_user,
                                   broker_user=broker_user, tls=tls or None, refuse_plain_port=refuse_plain)
    except (TorchPassError, OSError) as exc:
        click.echo(f"torchpassd.broker_auth: {exc}", err=True)
        raise SystemExit(1) from None
    click.echo(f"wrote {files.conf}, {files.dynsec}, {files.password_file}\n"
               f"torchpassd's config: [broker] username = \"{admin_user}\", password_file = \"{files.password_file}\""
               + (f", tls_ca = \"{tls[0]}\" (every client's too)" if tls else ""))


if __name__ == "__main__":
    main()
