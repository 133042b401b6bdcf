"""Sending one command to one node's launchpad and awaiting its ack. Acks are matched by
(job, node, migration, gen, cmd), the key launchpad uses for idempotency, so the command is
re-published every few seconds until it is acked (a broker restart may lose it; launchpad runs
it once and re-sends the same ack). Owns no decisions: planned.py says what to send."""

from __future__ import annotations

import asyncio
from typing import Any

from torchpass_common import log, mqtt, protocol
from torchpass_common.errors import MigrationError, TorchPassError

RESEND_EVERY = 3.0  # seconds between re-publications of an unacked command

AckKey = tuple[str, str, str, int, str]  # job, node, migration, gen, cmd


class CommandFailed(MigrationError):
    """A launchpad carried out a command and reported failure, or never acked it in time.
    ``lasting``: the launchpad said that trying again would fail alike (errors.CannotMove)."""

    def __init__(self, message: str, *, lasting: bool = False, **where: object) -> None:
        super().__init__(message, **where)
        self.lasting = lasting


class Commander:
    """Publishes commands through ``client`` and resolves them from acks fed to :meth:`on_ack`."""

    def __init__(self, client: mqtt.ControlClient) -> None:
        self.client = client
        self._waiting: dict[AckKey, asyncio.Future[protocol.Message]] = {}

    def on_ack(self, msg: protocol.Message, node: str) -> None:
        """Deliver an ack message (from the daemon's MQTT pump); unknown acks are ignored."""
        body = msg.body
        fut = self._waiting.get((msg.job, node, body["migration"], msg.gen, body["cmd"]))
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def send(self, job: str, node: str, cmd: str, *, migration: str, gen: int,
                   args: dict[str, Any] | None = None, timeout: float) -> dict[str, Any]:
        """Run ``cmd`` on ``node``'s launchpad and return the ack's result. Raises CommandFailed
        when launchpad reports an error or no ack arrives within ``timeout`` seconds."""
        key = (job, node, migration, gen, cmd)
        fut = self._waiting.setdefault(key, asyncio.get_running_loop().create_future())
        where = {"job": job, "node": node, "gen": gen, "migration": migration}
        logger = log.get(**where)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while not fut.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise CommandFailed(f"launchpad did not acknowledge {cmd} within {timeout:.0f} s",
                                        hint="check the node's launchpad (torchpassctl status) and the broker",
                                        **where)
                payload = protocol.encode(protocol.COMMAND, job=job, gen=gen,
                                          body={"cmd": cmd, "migration": migration, "args": args or {}})
                try:
                    await self.client.publish(protocol.cmd_topic(job, node), payload,
                                              timeout=min(left, mqtt.PUBLISH_TIMEOUT))
                    logger.debug("command.sent", cmd=cmd)
                except TorchPassError as exc:  # broker down: keep trying until the deadline
                    logger.warning("command.publish_failed", cmd=cmd, error=str(exc))
                await asyncio.wait([fut], timeout=min(RESEND_EVERY, max(0.0, deadline - loop.time())))
            ack = fut.result()
        finally:
            self._waiting.pop(key, None)
        if not ack.body["ok"]:
            result = ack.body.get("result")
            raise CommandFailed(f"{cmd} failed on the launchpad: {ack.body['error']}",
                                lasting=isinstance(result, dict) and result.get("lasting") is True, **where)
        logger.info("command.acked", cmd=cmd)
        return ack.body["result"]
