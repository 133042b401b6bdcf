"""What each orchestrator command does on this node: pause all workers after a step, have one
save its state, re-form the communicator as a new generation, resume, start a joining worker,
abort a migration, exit (and, through stall_watch.py, cut the collectives of stalled workers). Each handler returns the ack's result or raises a TorchPassError
(the ack's error). Transport, idempotency and acks live in control.py."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from launchpad.channel import WorkerLink
from launchpad.node_context import NodeContext
from launchpad.stall_watch import StallWatch
from launchpad.transparent import Transparent
from torchpass_common import agent_channel as ac
from torchpass_common import collective_path, transfer_address
from torchpass_common.errors import MigrationError, ProtocolError, WorkerError
from torchpass_common.transfer_address import TransferAddress
from torchpass_common.worker_state import WorkerState

Handler = Callable[[dict[str, Any], int, str], Awaitable[dict[str, Any]]]


def _int_arg(args: dict[str, Any], name: str, default: int | None = None) -> int:
    value = args.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"command argument {name!r} must be an integer, got {value!r}")
    return value


def _relayed(value: Any, what: str) -> dict[str, Any]:
    """``value`` checked as a TransferAddress (else ProtocolError) and put back on the wire for a worker."""
    return TransferAddress.parse(value, what).wire()


def _donations(raw: Any) -> list[dict[str, Any]]:
    """recover's ``donate``: one {to, dest[, from]} map or a list of them (``rank`` means ``to``)."""
    items = [] if raw is None else [raw] if isinstance(raw, dict) else raw
    if not isinstance(items, list):
        raise ProtocolError(f"recover's 'donate' must be a map or a list of maps, got {raw!r}")
    out = []
    for d in items:
        to = d.get("to", d.get("rank")) if isinstance(d, dict) else None
        if not isinstance(to, int) or not isinstance(d.get("dest"), dict):
            raise ProtocolError(f"a donation needs 'to' (the rank to rebuild) and a 'dest' map, got {d!r}")
        dest = _relayed(d["dest"], f"recover's donation to rank {to}: 'dest'")
        out.append({"to": to, "dest": dest, "from": d.get("from")})
    return out


def _loads(raw: Any, lagging: list[int]) -> dict[int, dict[str, Any]]:
    """recover's ``load_from``: a hand-over source for this node's lagging worker, or a map from
    rank to source when several lag; what each of them loads instead of its own state."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtocolError(f"recover's 'load_from' must be a map, got {raw!r}")
    if any(k in raw for k in (*transfer_address.KEYS, "path")):
        source = _relayed(raw, "recover's 'load_from'")
        if len(lagging) != 1:
            raise ProtocolError(f"one load_from source for {len(lagging)} lagging workers {lagging}",
                                hint="give load_from as a map from rank to source")
        return {lagging[0]: source}
    try:
        return {int(rank): _relayed(source, f"recover's 'load_from' for rank {rank}")
                for rank, source in raw.items() if isinstance(source, dict)}
    except ValueError as exc:
        raise ProtocolError(f"recover's load_from keys must be ranks: {sorted(raw)}") from exc


class Commands:
    """Handlers keyed by command name; ``gen`` is the command message's generation."""

    def __init__(self, agent: NodeContext) -> None:
        self.agent = agent
        self.joiners: dict[str, list[int]] = {}  # migration -> pids of joiners it started
        self.handlers: dict[str, Handler] = {
            "pause": self.pause, "save": self.save, "reform": self.reform, "resume": self.resume,
            "start_joiner": self.start_joiner, "abort": self.abort, "exit": self.exit,
            "recover": self.recover, "notice": self.notice,
            "sever": StallWatch(agent.channel, agent.node).sever,
        }
        self.handlers.update(Transparent(agent).handlers)  # criu moves (--torchpass=transparent)

    async def execute(self, cmd: str, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        handler = self.handlers.get(cmd)
        if handler is None:
            raise MigrationError(f"command {cmd!r} is not carried out by launchpad", node=self.agent.node,
                                 hint="the joining worker receives state itself (TORCHPASS_JOIN_SOURCE)")
        return await handler(args, gen, migration)

    def _links(self, *, include_joiners: bool = True) -> list[WorkerLink]:
        """Every live worker's channel link; WorkerError if one has not connected."""
        group = self.agent.group
        if group is None:
            raise WorkerError("no workers are running on this node", node=self.agent.node)
        links = self.agent.channel.links
        result = []
        for w in group.workers.values():
            if w.returncode is not None:
                continue
            link = links.get(w.pid)
            if link is None or not link.connected:
                raise WorkerError("worker has not connected to the agent channel", rank=w.rank, pid=w.pid,
                                  node=self.agent.node,
                                  hint="it has not imported torchpass yet, or runs without the bootstrap")
            if include_joiners or not link.joining:
                result.append(link)
        if not result:
            raise WorkerError("no running workers on this node", node=self.agent.node,
                              hint="training has ended or not started")
        return result

    async def _all(self, links: list[WorkerLink], make: Callable[[WorkerLink], dict[str, Any]],
                   accept: Callable[[dict[str, Any]], bool], timeout: float) -> dict[int, dict[str, Any]]:
        """Send to every link at once (collective operations need all ranks) and gather replies."""
        channel = self.agent.channel
        replies = await asyncio.gather(*(channel.request(link, make(link), accept, timeout) for link in links))
        return {link.rank: reply for link, reply in zip(links, replies, strict=True)}

    async def pause(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Park every (non-joining) worker after optimizer step ``at_step``."""
        at_step, pgen = _int_arg(args, "at_step"), _int_arg(args, "gen", gen)
        links = self._links(include_joiners=False)
        ahead = {lk.rank: lk.step for lk in links if lk.step >= at_step}
        if ahead:  # refuse at once rather than park some ranks while others run into their collective
            raise MigrationError(f"ranks {sorted(ahead)} already completed step {at_step}", node=self.agent.node,
                                 gen=pgen, hint=f"pick a later step; their steps: {ahead}")
        replies = await self._all(
            links, lambda _: ac.message(ac.PAUSE, gen=pgen, at_step=at_step),
            lambda r: r["t"] in (ac.PAUSED, ac.PAUSE_MISSED) and r["gen"] == pgen, self.agent.timeouts.reform)
        steps = {str(rank): r["step"] for rank, r in replies.items()}
        missed = sorted(rank for rank, r in replies.items() if r["t"] == ac.PAUSE_MISSED)
        if missed:
            raise MigrationError(f"ranks {missed} were already past step {at_step}", node=self.agent.node,
                                 gen=pgen, hint=f"pick a later step; reported steps: {steps}")
        return {"steps": steps}

    async def save(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Have worker ``rank`` send its state to ``dest`` (a wormhole receiver, never a path); with
        ``saves`` (a list of {rank, dest}) several workers of this node save at once, side by side."""
        raw = args.get("saves", [{"rank": args.get("rank"), "dest": args.get("dest")}])
        if not isinstance(raw, list) or not raw or not all(isinstance(x, dict) for x in raw):
            raise ProtocolError(f"save's 'saves' must be a non-empty list of {{rank, dest}} maps, got {raw!r}")
        # every destination checked before any worker is asked
        saves = [(rank := _int_arg(item, "rank"), _relayed(item.get("dest"), f"save's 'dest' for rank {rank}"))
                 for item in raw]
        links = {lk.rank: lk for lk in self._links(include_joiners=False)}
        jobs = []
        for rank, dest in saves:
            if rank not in links:
                raise WorkerError("no running (non-joining) worker has this rank here", rank=rank,
                                  node=self.agent.node)
            jobs.append(self.agent.channel.request(links[rank], ac.message(ac.SAVE, dest=dest),
                                                   lambda r: r["t"] == ac.SAVED, self.agent.timeouts.reform))
        replies = await asyncio.gather(*jobs)
        ranks = {str(item["rank"]): {"bytes": r["bytes"], "seconds": r["seconds"]}
                 for item, r in zip(raw, replies, strict=True)}
        return {"bytes": sum(r["bytes"] for r in replies), "seconds": max(r["seconds"] for r in replies),
                "ranks": ranks}

    async def reform(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Rebuild every worker's communicator as generation ``gen``; ``ranks`` maps old to new
        ranks where they change; the store defaults to the rendezvous store with a fresh prefix;
        ``ifname`` (optional) is the network interface the new generation's collectives take."""
        ngen = _int_arg(args, "gen", gen)
        world = _int_arg(args, "world_size", self.agent.world_size)
        ranks = {int(k): v for k, v in (args.get("ranks") or {}).items()}
        rdzv, spec = self.agent.rdzv, self.agent.spec  # no rendezvous: a joiner, on the job's endpoint
        host = args.get("store_host") or (rdzv.host if rdzv else spec.rdzv_host)
        port = _int_arg(args, "store_port", rdzv.port if rdzv else spec.rdzv_port)
        prefix = args.get("prefix") or f"/torchpass/{self.agent.spec.run_id}/gen{ngen}"
        path = collective_path.check(args["ifname"], "reform's 'ifname'") if args.get("ifname") else ""
        links = self._links()
        await self._all(
            links, lambda lk: ac.message(ac.REFORM, gen=ngen, rank=ranks.get(lk.rank, lk.rank), world_size=world,
                                         store_host=host, store_port=port, prefix=prefix,
                                         **({"ifname": path} if path else {})),
            lambda r: r["t"] == ac.REFORMED and r["gen"] == ngen, self.agent.timeouts.reform)
        for lk in links:
            lk.rank = ranks.get(lk.rank, lk.rank)
        self.agent.gen, self.agent.world_size = ngen, world
        self.agent.path = path or self.agent.path
        return {"ranks": sorted(lk.rank for lk in links)}

    async def resume(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        rgen = _int_arg(args, "gen", gen)
        replies = await self._all(self._links(), lambda _: ac.message(ac.RESUME, gen=rgen),
                                  lambda r: r["t"] == ac.RESUMED and r["gen"] == rgen, self.agent.timeouts.reform)
        return {"ranks": sorted(replies)}

    async def recover(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """After a lost peer (unplanned): every interrupted worker here donates its just-in-time
        state as ``donate`` says (to the lost rank's joiner, to lagging survivors), re-enters its
        script and loads its own state (a lagging one: the donor's, from ``load_from``), then parks
        in register(). Acked once all have; ``step`` is the most advanced survivor's step."""
        ngen, step = _int_arg(args, "gen", gen), _int_arg(args, "step")
        world = _int_arg(args, "world_size", self.agent.world_size)
        members = [lk for lk in self._links() if not lk.joining]
        where = {"node": self.agent.node, "gen": ngen}
        waiting = {lk.rank: lk.state for lk in members if lk.interruption is None}
        if waiting:
            raise MigrationError(f"ranks {sorted(waiting)} are not interrupted (states {waiting})", **where,
                                 hint="recover once every survivor reported interrupted; a frozen peer is "
                                      "noticed at timeouts.collective")
        unregistered = sorted(lk.rank for lk in members if not (lk.interruption or {}).get("registered"))
        if unregistered:
            raise MigrationError(f"ranks {unregistered} never called torchpass.register(): there is no state "
                                 "to recover from", **where,
                                 hint="restart the job from its last checkpoint; add torchpass.register(save=..., "
                                      "load=...) to the script for unplanned recovery")
        ahead = {lk.rank: lk.step for lk in members if lk.step > step}
        if ahead:
            raise MigrationError(f"ranks {ahead} completed more than step {step}", **where,
                                 hint="step must be the most advanced survivor's completed step")
        lagging = sorted(lk.rank for lk in members if lk.step < step)
        loads = _loads(args.get("load_from"), lagging)
        unfed = sorted(set(lagging) - set(loads))
        if unfed:
            raise MigrationError(f"ranks {unfed} lag behind step {step} and load_from names no source for them",
                                 **where, hint="let a survivor at that step donate to them (load_from)")
        leaders = [lk.rank for lk in members if lk.step == step]
        gifts: dict[int, list[dict[str, Any]]] = {lk.rank: [] for lk in members}
        for d in _donations(args.get("donate")):
            donor = d["from"] if d["from"] is not None else (leaders[0] if leaders else None)
            if donor not in leaders:
                raise MigrationError(f"no worker here at step {step} can donate to rank {d['to']} "
                                     f"(asked: {d['from']}, at that step: {leaders})", **where)
            gifts[donor].append({"to": d["to"], "dest": d["dest"]})
        replies = await self._all(
            members, lambda lk: ac.message(ac.RECOVER, gen=ngen, world_size=world, step=step, donate=gifts[lk.rank],
                                           load_from=loads.get(lk.rank)),
            lambda r: r["t"] == ac.JOINED, self.agent.timeouts.decision)
        wrong = {rank: r["step"] for rank, r in replies.items() if r["step"] != step}
        if wrong:
            raise MigrationError(f"ranks {wrong} loaded state of another step than {step}", **where)
        self.agent.lost_nodes += _int_arg(args, "lost_nodes", 1)
        ranks = {str(rank): {"step": r["step"], "bytes": r.get("bytes", 0), "seconds": r.get("seconds", 0.0)}
                 for rank, r in replies.items()}
        return {"step": step, "ranks": ranks, "bytes": sum(r["bytes"] for r in ranks.values()),
                "seconds": max(r["seconds"] for r in ranks.values())}

    async def notice(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Print torchpassd's ``text`` once into the job's output (launchpad's stderr is the task's):
        what a user reads there when TorchPass cannot protect the job right now, and why."""
        text = args.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ProtocolError(f"notice needs a non-empty 'text', got {text!r}")
        print(f"torchpass: {' '.join(text.split())}", file=sys.stderr, flush=True)
        return {}

    async def start_joiner(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Start a worker that joins as ``rank`` (with ``joiners``, a list of {rank, source}: one per
        entry, side by side); acked once they have connected to the channel. With ``group_rank`` and
        ``group_world_size`` (a hot spare seated for a lost node) the joiners take that node's place."""
        world = _int_arg(args, "world_size", self.agent.world_size)
        raw = args.get("joiners", [{"rank": args.get("rank"), "source": args.get("source")}])
        if not isinstance(raw, list) or not raw or not all(isinstance(j, dict) for j in raw):
            raise ProtocolError(f"start_joiner's 'joiners' must be a non-empty list of {{rank, source}} maps, got {raw!r}")
        joiners = [(_int_arg(j, "rank"), TransferAddress.parse(j.get("source"), "start_joiner's 'source'"))
                   for j in raw]  # every entry checked before any worker starts
        group = self.agent.group
        if group is None:
            raise WorkerError("no worker group to add a joiner to", node=self.agent.node)
        if "group_rank" in args:  # a hot spare takes a lost node's place
            group.seat(_int_arg(args, "group_rank"), _int_arg(args, "group_world_size"))
            self.agent.world_size = world
        pids = []
        for rank, source in joiners:
            w = await group.add_joiner(rank, world, source)
            self.joiners.setdefault(migration, []).append(w.pid)
            pids.append(w.pid)
        await self.agent.channel.wait_for(pids, self.agent.timeouts.reform)
        return {"pid": pids[0], "pids": pids}

    async def abort(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Give up ``migration``: stop the joiners it started, resume paused workers in the
        current generation. With ``hold``, a joiner that was rebuilding a crashed rank in place is
        killed so that its rank is held as crashed again: the next recovery is decided from it."""
        group = self.agent.group
        stopped, held = [], []
        for pid in self.joiners.pop(migration, []):
            if group is None or (w := group.workers.get(pid)) is None:
                continue
            if args.get("hold") and pid in group.rebuilding:
                await w.stop(signal.SIGKILL, 0.0)  # a signal death, not told to exit: held (group.py)
                held.append(w.rank)
                continue
            group.dismiss(w)  # stopped on purpose: not a crash to hold, nor a failure; its output stays out
            await w.stop(signal.SIGTERM, self.agent.spec.grace_period)
            stopped.append(w.rank)
        paused = [lk for lk in self.agent.channel.links.values() if lk.state == WorkerState.PAUSED and lk.connected and not lk.joining]
        if paused:
            cur = self.agent.gen
            await self._all(paused, lambda _: ac.message(ac.RESUME, gen=cur),
                            lambda r: r["t"] == ac.RESUMED, self.agent.timeouts.reform)
        # workers in an unplanned recovery (interrupted, or re-entered and parked, not resumed) wait for
        # the next command; with "exit" they end (non-zero: the job failed)
        recovering = [lk for lk in self.agent.channel.links.values() if lk.connected and lk.recovering]
        if args.get("exit") and recovering:
            if group is not None:
                group.told_to_exit.update(lk.pid for lk in recovering)
            await asyncio.gather(*(lk.chan.send(ac.message(ac.EXIT)) for lk in recovering))
        return {"stopped_joiners": stopped, "held": held, "resumed": sorted(lk.rank for lk in paused),
                "interrupted": sorted(lk.rank for lk in recovering), "exited": bool(args.get("exit") and recovering)}

    async def exit(self, args: dict[str, Any], gen: int, migration: str) -> dict[str, Any]:
        """Ask workers to exit cleanly: every worker, or with ``rank`` only the (non-joining)
        worker leaving as that rank. Acked once they have exited."""
        links = self._links()
        if "rank" in args:
            rank = _int_arg(args, "rank")
            links = [lk for lk in links if lk.rank == rank and not lk.joining]
            if not links:
                raise WorkerError("no running (non-joining) worker has this rank here", rank=rank,
                                  node=self.agent.node)
        group = self.agent.group
        if group is not None:
            group.told_to_exit.update(lk.pid for lk in links)
        await asyncio.gather(*(lk.chan.send(ac.message(ac.EXIT)) for lk in links))
        leaving = [w for lk in links if group is not None and (w := group.workers.get(lk.pid)) is not None]
        try:
            codes = await asyncio.wait_for(asyncio.gather(*(w.wait() for w in leaving)), self.agent.timeouts.step)
        except TimeoutError:
            raise WorkerError(f"workers did not exit within {self.agent.timeouts.step:.0f} s of the exit command",
                              node=self.agent.node, hint="they may be hung; abort stops them") from None
        return {"ranks": sorted(lk.rank for lk in links), "exit_codes": list(codes)}
