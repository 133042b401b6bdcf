"""The one MQTT client every TorchPass process uses (torchpassd, launchpad, tools).
Owns the connection to the broker: TCP_NODELAY, Last Will, reconnect with backoff forever,
re-subscribing and the on_connect re-announcement after each reconnect, and delivering only
messages that pass protocol.decode (the rest are logged and dropped). Schemas live in protocol.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Self

import aiomqtt

from torchpass_common import log, protocol
from torchpass_common.config import BrokerConfig
from torchpass_common.errors import ConfigError, ProtocolError, TorchPassError
from torchpass_common.tasks import cancel_all

BACKOFF_FIRST = 0.05
BACKOFF_MAX = 5.0
PUBLISH_TIMEOUT = 10.0

OnConnect = Callable[["ControlClient"], Awaitable[None]]


class BrokerUnavailableError(TorchPassError):
    """The broker could not be reached (or the connection kept dropping) within a deadline."""


def broker_credentials(cfg: BrokerConfig) -> tuple[str | None, str | None, ssl.SSLContext | None]:
    """(username, password, TLS context) from ``cfg``; the TLS context verifies the broker against
    broker.tls_ca and presents broker.tls_cert/tls_key when they are set."""
    password = None
    if cfg.password_file:
        try:
            password = Path(cfg.password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read broker.password_file {cfg.password_file}: {exc.strerror}",
                              hint="create it (mode 0600) or remove the key") from exc
    tls = None
    if cfg.tls_ca:
        try:
            tls = ssl.create_default_context(cafile=cfg.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load broker.tls_ca {cfg.tls_ca}: {exc}") from exc
        if cfg.tls_cert:
            try:
                tls.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load broker.tls_cert {cfg.tls_cert} / tls_key {cfg.tls_key}: {exc}") from exc
    return cfg.username or None, password, tls


class ControlClient:
    """Async context manager holding one logical MQTT session that outlives broker restarts.

    ``credentials=(username, password)`` replaces those of ``broker_cfg`` (a launchpad's per-job
    account). ``will=(topic, payload)`` is published retained at QoS 1 by the broker when this client
    vanishes uncleanly. ``on_connect(client)`` runs after every (re)connection, once the
    subscriptions are back, e.g. to re-publish a retained online state. Entering does not wait
    for the broker: use :meth:`wait_connected` where that matters.
    """

    def __init__(self, broker_cfg: BrokerConfig, client_id: str, *,
                 will: tuple[str, bytes] | None = None, on_connect: OnConnect | None = None,
                 credentials: tuple[str, str] | None = None) -> None:
        self._cfg = broker_cfg
        self.client_id = client_id
        self._will = aiomqtt.Will(will[0], will[1], qos=1, retain=True) if will else None
        self._on_connect = on_connect
        self._username, self._password, self._tls = broker_credentials(broker_cfg)
        if credentials:
            self._username, self._password = credentials
        self._filters: list[str] = []
        self._inbox: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self.connects = 0

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def __aenter__(self) -> Self:
        self._runner = asyncio.create_task(self._run(), name=f"mqtt-{self.client_id}")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._runner is not None:
            # A graceful DISCONNECT to a hung broker times out; the session is over either way.
            await cancel_all([self._runner])
        self._connected.clear()

    async def wait_connected(self, timeout: float) -> None:
        """Wait until a connection to the broker is up; BrokerUnavailableError after ``timeout``."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            raise BrokerUnavailableError(
                f"no connection to the MQTT broker {self._cfg.host}:{self._cfg.port} after {timeout} s",
                node=self.client_id, hint="check that mosquitto runs and [broker] in the config") from None

    async def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, *,
                      timeout: float = PUBLISH_TIMEOUT) -> None:
        """Publish, waiting out a broker outage for up to ``timeout`` seconds (then
        BrokerUnavailableError). QoS 1 may deliver twice; commands are idempotent for that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.wait_connected(max(0.0, deadline - loop.time()))
            client = self._client
            if client is None:  # between a drop and the session task noticing it
                await asyncio.sleep(BACKOFF_FIRST)
                continue
            try:
                await client.publish(topic, payload, qos=qos, retain=retain,
                                     timeout=max(0.01, deadline - loop.time()))
                return
            except aiomqtt.MqttError as exc:
                if loop.time() >= deadline:
                    raise BrokerUnavailableError(f"publish to {topic} failed: {exc}", node=self.client_id,
                                                 hint="the broker is down or unreachable") from exc
                await asyncio.sleep(BACKOFF_FIRST)  # the session task notices the drop and reconnects

    async def subscribe(self, topic_filter: str) -> None:
        """Subscribe now if connected, and again after every reconnect."""
        if topic_filter not in self._filters:
            self._filters.append(topic_filter)
        client = self._client
        if client is not None and self.connected:
            with contextlib.suppress(aiomqtt.MqttError):  # the reconnect re-subscribes
                await client.subscribe(topic_filter, qos=1)

    async def messages(self) -> AsyncIterator[tuple[str, protocol.Message]]:
        """Yield ``(topic, message)`` for every valid message, across reconnects, forever (an empty
        payload, which clears a retained message, is none).
        A payload that fails decoding, or whose kind, job or node does not match its topic,
        is logged as ``mqtt.message_rejected`` and skipped. Use one consumer per client."""
        while True:
            topic, payload = await self._inbox.get()
            try:
                where = protocol.parse_topic(topic)
                msg = protocol.decode(payload)
                # Per-node kinds that name their node must name the topic's; events may name any.
                node = msg.body.get("node", where.node) if where.node is not None else None
                if msg.kind != where.kind or msg.job != where.job or node != where.node:
                    raise ProtocolError(f"{msg.kind} message of job {msg.job} node {node} arrived on topic {topic}",
                                        hint="a sender is misconfigured or hostile")
            except ProtocolError as exc:
                log.get(client=self.client_id).warning("mqtt.message_rejected", topic=topic,
                                                       size=len(payload), reason=str(exc))
                continue
            yield topic, msg

    async def _run(self) -> None:
        backoff = BACKOFF_FIRST
        logger = log.get(client=self.client_id, broker=f"{self._cfg.host}:{self._cfg.port}")
        while True:
            try:
                await self._session()
            except (aiomqtt.MqttError, OSError) as exc:
                was_up = self.connected
                self._connected.clear()
                self._client = None
                if was_up:
                    backoff = BACKOFF_FIRST
                    logger.warning("mqtt.disconnected", error=str(exc))
                else:
                    logger.debug("mqtt.connect_failed", error=str(exc), retry_in=round(backoff, 3))
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _session(self) -> None:
        client = aiomqtt.Client(
            self._cfg.host, self._cfg.port, identifier=self.client_id, username=self._username,
            password=self._password, tls_context=self._tls, will=self._will,
            keepalive=self._cfg.keepalive, clean_session=True, timeout=PUBLISH_TIMEOUT,
            # Without TCP_NODELAY the first messages of a connection stall ~40 ms (Nagle).
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        async with client:
            done: set[str] = set()
            # Loop until no filter is pending: subscribe() may add one while we await here.
            while pending := [f for f in self._filters if f not in done]:
                for topic_filter in pending:
                    await client.subscribe(topic_filter, qos=1)
                    done.add(topic_filter)
            self._client = client
            self.connects += 1
            self._connected.set()
            log.get(client=self.client_id).info("mqtt.connected", connects=self.connects)
            # on_connect runs beside the message pump: if it publishes and the link drops
            # meanwhile, the pump sees the drop and the next session retries the announcement.
            announce = asyncio.create_task(self._announce(self._on_connect)) if self._on_connect else None
            try:
                async for message in client.messages:
                    if message.payload:  # an empty one removes a retained message: no message itself
                        self._inbox.put_nowait((str(message.topic), bytes(message.payload)))
            finally:
                if announce is not None:
                    announce.cancel()

    async def _announce(self, on_connect: OnConnect) -> None:
        try:
            await on_connect(self)
        except TorchPassError as exc:
            log.get(client=self.client_id).warning("mqtt.on_connect_failed", error=str(exc))
