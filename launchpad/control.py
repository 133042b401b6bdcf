"""launchpad's control-plane presence: a retained online state with a Last Will (offline), a
heartbeat every timeouts.heartbeat_interval with each worker's step and state, and the command
loop: each command runs once per (migration, gen, cmd) and is acked, a redelivered one gets the
same ack again. Malformed messages are dropped by mqtt.ControlClient; nothing here crashes the agent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from launchpad.commands import Commands
from launchpad.node_context import NodeContext
from launchpad.telemetry.links import LinkWatch
from launchpad.telemetry.sampler import Sampler
from torchpass_common import broker_check, job_credentials, log, mqtt, protocol, rank_ranges
from torchpass_common.errors import CannotMove, TorchPassError
from torchpass_common.tasks import cancel_all
from torchpass_common.worker_state import WorkerState


class ControlPlane:
    """Runs while the agent runs (``async with``); needs ``agent.spec.job`` and ``agent.node``."""

    def __init__(self, agent: NodeContext) -> None:
        self.agent = agent
        self.job, self.node = str(agent.spec.job), agent.node
        self.commands = Commands(agent)
        self._done: dict[tuple[str, int, str], asyncio.Future[dict[str, Any]]] = {}
        self._order = asyncio.Lock()
        self._seq = 0
        self._log = log.get(job=self.job, node=self.node)
        self._beat_now = asyncio.Event()
        agent.channel.on_interrupted = lambda _link: self._beat_now.set()
        agent.beat_now = self._beat_now.set
        self.client = self._client(None)
        self._tasks: list[asyncio.Task[None]] = []
        self.telemetry = Sampler(agent.config.health, self.node)  # GPU health, sent with heartbeats
        self.links = LinkWatch(on_change=self._beat_now.set)  # network links, sent with heartbeats (at once on a change)
        self.commands.handlers["health_replay"] = self._health_replay

    def _client(self, credentials: tuple[str, str] | None) -> mqtt.ControlClient:
        will = protocol.encode(protocol.STATE, job=self.job, gen=self.agent.gen,
                               body={"node": self.node, "online": False, "will": True})  # "will": not a goodbye
        return mqtt.ControlClient(self.agent.config.broker, f"launchpad-{self.job}-{self.node}-{os.getpid()}",
                                  will=(protocol.state_topic(self.job, self.node), will), on_connect=self._announce,
                                  credentials=credentials)

    async def __aenter__(self) -> ControlPlane:
        orch = self.agent.config.orchestrator
        await broker_check.require_secure(self.agent.config.broker, f"launchpad on {self.node}")
        if orch.credentials_endpoint:
            # The job's own broker account, for a munge proof of this job and node (job_credentials);
            # the site config's broker.username/password_file are torchpassd's, not the job's.
            self.client = self._client(await job_credentials.fetch(
                orch.credentials_endpoint, self.job, self.node, munge_socket=orch.munge_socket,
                wait=self.agent.timeouts.reform))
        await self.client.__aenter__()
        await self.client.subscribe(protocol.cmd_topic(self.job, self.node))
        await self.telemetry.__aenter__()
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._commands()),
                       asyncio.create_task(self.links.run())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_all(self._tasks)
        with contextlib.suppress(TorchPassError):  # a clean goodbye; the Last Will covers a failed one
            await self._publish_state(online=False, timeout=1.0)
        await self.client.__aexit__(None, None, None)
        await self.telemetry.__aexit__(None, None, None)

    async def _announce(self, client: mqtt.ControlClient) -> None:
        await self._publish_state(online=True, timeout=mqtt.PUBLISH_TIMEOUT)
        self._log.info("control.online", connects=client.connects)

    async def _publish_state(self, *, online: bool, timeout: float) -> None:
        body = {"node": self.node, "online": online, "pid": os.getpid(), "host": socket.gethostname()}
        payload = protocol.encode(protocol.STATE, job=self.job, gen=self.agent.gen, body=body)
        await self.client.publish(protocol.state_topic(self.job, self.node), payload, retain=True, timeout=timeout)

    def heartbeat_body(self) -> dict[str, Any]:
        self._seq += 1
        links = {lk.pid: lk for lk in self.agent.channel.links.values()}
        workers = []
        group = self.agent.group
        # a node all of whose ranks moved away (the batch host, which stays in the job) runs none
        for w in (group.workers.values() if group and not group.emptied() else ()):
            lk = links.get(w.pid)
            state = (WorkerState.CRASHED if w.pid in group.held else WorkerState.EXITED if w.returncode is not None
                     else lk.state if lk else WorkerState.STARTING)
            workers.append({"rank": lk.rank if lk else w.rank, "step": lk.step if lk else 0, "state": state,
                            "pid": w.pid, "joining": bool(lk and lk.joining),
                            "registered": bool(lk and lk.registered), "movable": w.control is not None,
                            **({"exit_code": w.returncode} if w.returncode is not None else {}),
                            **({"frozen_s": round(group.frozen[w.pid], 1)} if w.pid in group.frozen else {}),
                            **({"busy_s": round(lk.busy_s, 5)} if lk and lk.busy_s is not None else {}),
                            **({"replicas": rank_ranges.compact(lk.replicas)} if lk and lk.replicas is not None else {}),
                            **({"registered": lk.interruption["registered"], "error": lk.interruption["error"],
                                "interrupted_at": lk.interrupted_at}
                               if lk and lk.interruption and state == WorkerState.INTERRUPTED else {})})
        return {"node": self.node, "seq": self._seq, "workers": workers,
                "standby": group.standby_state if group else "none",
                "hot_spare": bool(self.agent.spec.hot_spare and group is not None and not group.workers),
                **self.telemetry.heartbeat_part(),
                **self.links.heartbeat_part(), **({"path": self.agent.path} if self.agent.path else {})}

    async def _heartbeats(self) -> None:
        interval = self.agent.timeouts.heartbeat_interval
        topic = protocol.hb_topic(self.job, self.node)
        while True:
            if self.client.connected:
                payload = protocol.encode(protocol.HEARTBEAT, job=self.job, gen=self.agent.gen,
                                          body=self.heartbeat_body())
                try:
                    await self.client.publish(topic, payload, qos=0, timeout=interval)
                except mqtt.BrokerUnavailableError as exc:
                    self._log.debug("control.heartbeat_skipped", error=str(exc))
            with contextlib.suppress(TimeoutError):  # a worker interrupted: beat at once
                await asyncio.wait_for(self._beat_now.wait(), interval)
            self._beat_now.clear()

    async def _health_replay(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """The gpu-degrade drill's fault (torchpassd's health_replay, on the operator's request):
        this node's GPU samples come from ``recording`` from now on. A TelemetryError if malformed."""
        source = f"{args.get('source') or 'recording'} (sent by torchpassd, {migration})"
        await self.telemetry.replay(args.get("recording"), source)
        return {"node": self.node}

    async def _commands(self) -> None:
        async for _topic, msg in self.client.messages():
            if msg.kind != protocol.COMMAND:
                self._log.warning("control.unexpected_message", kind=msg.kind, id=msg.id)
                continue
            asyncio.create_task(self._handle(msg))

    async def _handle(self, msg: protocol.Message) -> None:
        """Run a command once; a repeat (same migration, gen, cmd) waits for and re-sends the same ack."""
        cmd, migration, args = msg.body["cmd"], msg.body["migration"], msg.body["args"]
        key = (migration, msg.gen, cmd)
        first = key not in self._done
        if first:
            self._done[key] = asyncio.get_running_loop().create_future()
            async with self._order:  # commands run in arrival order, one at a time
                self._log.info("control.command", cmd=cmd, migration=migration, gen=msg.gen, id=msg.id)
                try:
                    result = {"ok": True, "error": None, "result": await self.commands.execute(cmd, args, msg.gen, migration)}
                except TorchPassError as exc:
                    result = {"ok": False, "error": str(exc), "result": {"lasting": isinstance(exc, CannotMove)}}
                    self._log.warning("control.command_failed", cmd=cmd, migration=migration, gen=msg.gen,
                                      error=str(exc))
                except Exception as exc:  # a bug must cost one command, not the agent and its training
                    result = {"ok": False, "error": f"internal error in launchpad: {exc!r}", "result": {}}
                    self._log.exception("control.command_crashed", cmd=cmd, migration=migration, gen=msg.gen)
                self._done[key].set_result(result)
        else:
            self._log.info("control.command_repeat", cmd=cmd, migration=migration, gen=msg.gen, id=msg.id)
        outcome = await self._done[key]
        body = {"command_id": msg.id, "cmd": cmd, "migration": migration, **outcome}
        try:
            await self.client.publish(protocol.ack_topic(self.job, self.node),
                                      protocol.encode(protocol.ACK, job=self.job, gen=msg.gen, body=body))
        except TorchPassError as exc:
            self._log.warning("control.ack_failed", cmd=cmd, migration=migration, error=str(exc))
